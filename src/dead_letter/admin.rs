//! `outbox-relay dlq list | redrive | drop`.
//!
//! A redrive only records the request; the active relay publishes the
//! letters (see [`super`]). A drop gives up on them at once.

use crate::config::TableName;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Client;

/// A dead letter as `dlq list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub dead_letter_id: i64,
    pub id: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub reason: String,
    pub attempts: i32,
    pub first_failed_at: DateTime<Utc>,
    pub last_failed_at: DateTime<Utc>,
    pub dead_lettered_at: DateTime<Utc>,
    pub resolution: Option<String>,
    pub resolved_at: Option<DateTime<Utc>>,
    /// When an operator asked for a redrive the relay has not carried out
    /// yet: of this letter, or of its aggregate's earliest open letter (a
    /// request the relay carries to the later ones).
    pub redrive_requested_at: Option<DateTime<Utc>>,
    /// The `[[outbox.columns.extra]]` and routing columns' values the event
    /// carried (absent when it had none), as the redrive sends them again.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub extra: Option<serde_json::Value>,
}

/// Which dead letters a command acts on.
#[derive(Debug, Clone)]
pub enum Target {
    /// One event id.
    Id(String),
    /// Every open dead letter of an aggregate.
    Aggregate(String),
    All,
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{}", crate::db::error_text(.0))]
    Db(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Refused(String),
}

pub async fn list(
    client: &Client,
    table: &TableName,
    aggregate: Option<&str>,
    include_resolved: bool,
    limit: i64,
) -> Result<Vec<Entry>, AdminError> {
    let rows = client
        .query(
            &format!(
                "SELECT dead_letter_id, id, aggregate_type, aggregate_id, event_type, reason, attempts,
                        first_failed_at, last_failed_at, dead_lettered_at, resolution, resolved_at,
                        CASE WHEN resolution IS NOT NULL OR redrive_requested_at IS NOT NULL
                               THEN redrive_requested_at
                             WHEN aggregate_id IS NULL THEN {earliest}f.aggregate_id IS NULL{order}
                             ELSE {earliest}f.aggregate_id = l.aggregate_id{order} END,
                        extra::jsonb
                 FROM {t} l WHERE ($1::text IS NULL OR aggregate_id = $1) AND ($2 OR resolution IS NULL)
                 ORDER BY dead_letter_id LIMIT $3",
                t = table.quoted(),
                earliest = format_args!(
                    "(SELECT f.redrive_requested_at FROM {} f WHERE f.resolution IS NULL AND ",
                    table.quoted()
                ),
                order = " ORDER BY f.aggregate_id, f.dead_letter_id LIMIT 1)",
            ),
            &[&aggregate, &include_resolved, &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Entry {
            dead_letter_id: r.get(0),
            id: r.get(1),
            aggregate_type: r.get(2),
            aggregate_id: r.get(3),
            event_type: r.get(4),
            reason: r.get(5),
            attempts: r.get(6),
            first_failed_at: r.get(7),
            last_failed_at: r.get(8),
            dead_lettered_at: r.get(9),
            resolution: r.get(10),
            resolved_at: r.get(11),
            redrive_requested_at: r.get(12),
            extra: r.get(13),
        })
        .collect())
}

/// Takes the per-aggregate locks (sorted, so two commands cannot deadlock)
/// of every aggregate the target names, before reading its dead letters: a
/// follower the relay is writing meanwhile is then either seen or told the
/// aggregate is resolved.
async fn lock_aggregates(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
    chunk: Option<&Chunk>,
) -> Result<std::collections::HashSet<String>, AdminError> {
    let aggregates: Vec<String> = match (target, chunk) {
        (_, Some(chunk)) => chunk.aggregates.clone(),
        (Target::Aggregate(a), None) => vec![a.clone()],
        (Target::Id(id), None) => tx
            .query(
                &format!(
                    "SELECT DISTINCT aggregate_id FROM {} WHERE id = $1 AND resolution IS NULL",
                    table.quoted()
                ),
                &[id],
            )
            .await?
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect(),
        (Target::All, None) => open_aggregates(tx, table).await?,
    };
    let mut aggregates = aggregates;
    aggregates.sort();
    let keys: Vec<String> = aggregates
        .iter()
        .map(|a| super::aggregate_lock_key(table, a))
        .collect();
    tx.execute(super::AGGREGATES_LOCK_SQL, &[&keys]).await?;
    Ok(aggregates.into_iter().collect())
}

/// The aggregates with open dead letters, sorted.
async fn open_aggregates(
    client: &impl tokio_postgres::GenericClient,
    table: &TableName,
) -> Result<Vec<String>, AdminError> {
    Ok(client
        .query(
            &format!(
                "SELECT DISTINCT aggregate_id FROM {} WHERE resolution IS NULL AND aggregate_id IS NOT NULL
                 ORDER BY 1",
                table.quoted()
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// Part of `--all`, acted on in one transaction: a share of the
/// aggregates (each is locked, and PostgreSQL's lock table is small), and
/// in the first part, the letters with no aggregate.
struct Chunk {
    aggregates: Vec<String>,
    first: bool,
}

/// The transactions a target is acted on in: one, except for `--all`.
async fn chunks(
    client: &Client,
    table: &TableName,
    target: &Target,
) -> Result<Vec<Option<Chunk>>, AdminError> {
    if !matches!(target, Target::All) {
        return Ok(vec![None]);
    }
    let aggregates = open_aggregates(client, table).await?;
    let mut parts: Vec<Option<Chunk>> = aggregates
        .chunks(super::LOCKS_PER_TRANSACTION)
        .map(|c| {
            Some(Chunk {
                aggregates: c.to_vec(),
                first: false,
            })
        })
        .collect();
    match parts.first_mut() {
        Some(Some(first)) => first.first = true,
        _ => parts.push(Some(Chunk {
            aggregates: Vec::new(),
            first: true,
        })),
    }
    Ok(parts)
}

/// The open dead letters with event id `id`, oldest first, of aggregates
/// locked by [`lock_aggregates`] (a letter of an aggregate that arrived
/// after the locks were taken is left for the next command):
/// `(dead_letter_id, aggregate_id)`.
async fn with_id_locked(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    id: &str,
) -> Result<Vec<(i64, Option<String>)>, AdminError> {
    let locked = lock_aggregates(tx, table, &Target::Id(id.to_owned()), None).await?;
    let rows = tx
        .query(
            &format!(
                "SELECT dead_letter_id, aggregate_id FROM {} WHERE resolution IS NULL AND id = $1
                 ORDER BY dead_letter_id FOR UPDATE",
                table.quoted()
            ),
            &[&id],
        )
        .await?;
    let mut letters: Vec<(i64, Option<String>)> =
        rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    letters.retain(|l| l.1.as_ref().is_none_or(|a| locked.contains(a)));
    // An id names one event; where the outbox's ids repeat (no unique
    // index), it may name letters of several aggregates, and acting on
    // them all would reach aggregates nobody looked at.
    let aggregates: std::collections::BTreeSet<&str> = letters
        .iter()
        .map(|l| l.1.as_deref().unwrap_or(""))
        .collect();
    if aggregates.len() > 1 {
        return Err(AdminError::Refused(format!(
            "{} open dead letters of {} aggregates have id {id:?} (the outbox's ids repeat); name the aggregate with --aggregate instead",
            letters.len(),
            aggregates.len()
        )));
    }
    Ok(letters)
}

/// Letters one `dlq drop` transaction marks at most. It holds the locks
/// of its aggregates, and the relay filing a follower of one of them
/// meanwhile waits on its ownership session: ten thousand take about a
/// tenth of a second, well within the lease (a million in one transaction
/// took 13 s here, over twice the default lease, after which the relay
/// gives ownership up).
pub const DROP_BATCH: i64 = 10_000;

/// Marks the targeted dead letters as dropped; returns how many. An
/// aggregate's letters go newest first, in transactions of at most
/// [`DROP_BATCH`], until none is open: its earliest letter, which holds the
/// aggregate back, goes last, and a follower the relay files meanwhile is
/// dropped with the rest.
pub async fn drop(
    client: &mut Client,
    table: &TableName,
    target: &Target,
) -> Result<usize, AdminError> {
    let mut dropped = 0;
    for chunk in chunks(client, table, target).await? {
        loop {
            let tx = client.transaction().await?;
            let (ids, more) = match target {
                Target::Id(id) => {
                    let letters = with_id_locked(&tx, table, id).await?;
                    (letters.iter().map(|l| l.0).collect::<Vec<i64>>(), false)
                }
                _ => {
                    let scope = scope(&tx, table, target, chunk.as_ref()).await?;
                    call_off_redrives(&tx, table, &scope).await?;
                    let ids = newest_open(&tx, table, &scope.0, scope.1, DROP_BATCH).await?;
                    let more = ids.len() as i64 == DROP_BATCH;
                    (ids, more)
                }
            };
            let n = tx
                .execute(
                    &format!(
                        "UPDATE {} SET resolution = 'dropped', resolved_at = now()
                         WHERE dead_letter_id = ANY($1) AND resolution IS NULL",
                        table.quoted()
                    ),
                    &[&ids],
                )
                .await?;
            tx.commit().await?;
            dropped += usize::try_from(n).unwrap_or(usize::MAX);
            if !more {
                break;
            }
        }
    }
    named_some(target, dropped)
}

/// Clears a redrive request on the earliest open letter of each aggregate
/// of `scope`: the relay publishes none of an aggregate's letters while
/// that one is not requested, nor carries a request on. So the batches of
/// a drop still to come are not published meanwhile.
async fn call_off_redrives(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    scope: &(Vec<String>, bool),
) -> Result<(), AdminError> {
    set_on_earliest_open(tx, table, scope, "NULL").await?;
    Ok(())
}

/// What an aggregate or `--all` command acts on in one transaction, with
/// those aggregates locked: the open letters of the aggregates (sorted),
/// and with `true`, those without an aggregate.
async fn scope(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
    chunk: Option<&Chunk>,
) -> Result<(Vec<String>, bool), AdminError> {
    let mut aggregates: Vec<String> = lock_aggregates(tx, table, target, chunk)
        .await?
        .into_iter()
        .collect();
    aggregates.sort();
    Ok((aggregates, chunk.is_some_and(|c| c.first)))
}

/// Up to `limit` open letters of `aggregates` (and with `unnamed`, of
/// those without an aggregate), each aggregate's newest first: an index
/// probe per aggregate, reading no more letters than it returns.
async fn newest_open(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    aggregates: &[String],
    unnamed: bool,
    limit: i64,
) -> Result<Vec<i64>, AdminError> {
    let t = table.quoted();
    let rows = tx
        .query(
            &format!(
                "(SELECT x.dead_letter_id FROM unnest($1::text[]) AS a(a), LATERAL (
                      SELECT dead_letter_id FROM {t} WHERE resolution IS NULL AND aggregate_id = a.a
                      ORDER BY aggregate_id DESC, dead_letter_id DESC LIMIT $3) x
                  LIMIT $3)
                 UNION ALL
                 (SELECT dead_letter_id FROM {t} WHERE $2 AND resolution IS NULL AND aggregate_id IS NULL
                  ORDER BY aggregate_id DESC, dead_letter_id DESC LIMIT $3)
                 LIMIT $3"
            ),
            &[&aggregates, &unnamed, &limit],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// A count of letters acted on, or an error when an id or an aggregate
/// named none: a typo would otherwise pass for success.
fn named_some(target: &Target, n: usize) -> Result<usize, AdminError> {
    let named = match target {
        Target::Id(id) => format!("with id {id:?}"),
        Target::Aggregate(a) => format!("of aggregate {a:?}"),
        Target::All => return Ok(n),
    };
    if n == 0 {
        return Err(AdminError::Refused(format!(
            "no open dead letter {named}; `dlq list` shows the open ones"
        )));
    }
    Ok(n)
}

/// Whether `dlq redrive --id id` may put one event back, given how many
/// open dead letters of its aggregate are older and newer than it. Alone,
/// a redriven letter would overtake the aggregate's earlier letters, or
/// leave its later ones for a redrive that could come after events the
/// aggregate writes meanwhile: it must be the aggregate's only open letter.
pub fn redrive_one_allowed(id: &str, earlier: i64, later: i64) -> Result<(), String> {
    if earlier + later > 0 {
        return Err(format!(
            "{id} is one of {} open dead letters of its aggregate ({earlier} earlier, {later} later); \
             redrive the aggregate (--aggregate) so that they go back in order",
            earlier + later + 1
        ));
    }
    Ok(())
}

/// Asks the active relay to publish the targeted dead letters again (see
/// the module docs of [`super`]); returns how many open letters the
/// request covers. The relay publishes them within
/// `dead_letter.refresh_interval`, in order, and marks them redriven once
/// the broker confirmed them.
///
/// Only each aggregate's earliest open letter is marked: the relay's looks
/// carry a request on it to the aggregate's later letters, a bounded batch
/// at a time, as they do for the followers it files after it. Marking a
/// million letters here would hold the aggregate's lock, and with it the
/// relay filing a follower, for as long as that takes.
pub async fn redrive(
    client: &mut Client,
    dead_letters: &TableName,
    target: &Target,
) -> Result<usize, AdminError> {
    let mut requested = 0;
    for chunk in chunks(client, dead_letters, target).await? {
        let tx = client.transaction().await?;
        let (marked, covered) = match target {
            Target::Id(id) => {
                let letters = with_id_locked(&tx, dead_letters, id).await?;
                check_alone(&tx, dead_letters, id, &letters).await?;
                let ids: Vec<i64> = letters.iter().map(|l| l.0).collect();
                let sql = set_request_sql(dead_letters, REQUESTED_NOW);
                (tx.query(&sql, &[&ids]).await?.len(), None)
            }
            _ => {
                let scope = scope(&tx, dead_letters, target, chunk.as_ref()).await?;
                let marked = set_on_earliest_open(&tx, dead_letters, &scope, REQUESTED_NOW).await?;
                (marked, Some(scope))
            }
        };
        tx.commit().await?;
        // Counted after the commit (the locks held no longer than needed):
        // what the relay or another command resolved meanwhile is not.
        requested += match covered {
            Some((aggregates, unnamed)) if marked > 0 => {
                count_open(client, dead_letters, &aggregates, unnamed)
                    .await?
                    .max(marked)
            }
            _ => marked,
        };
    }
    named_some(target, requested)
}

/// What a redrive request is stamped with.
const REQUESTED_NOW: &str = "statement_timestamp()";

/// Sets the request of the open letters `$1` to `value`, changing only
/// those it changes; returns every one still open (locked).
fn set_request_sql(table: &TableName, value: &str) -> String {
    let t = table.quoted();
    format!(
        "WITH open AS (
             SELECT dead_letter_id FROM {t} WHERE dead_letter_id = ANY($1) AND resolution IS NULL
             FOR UPDATE),
         changed AS (
             UPDATE {t} l SET redrive_requested_at = {value} FROM open
             WHERE l.dead_letter_id = open.dead_letter_id
               AND l.redrive_requested_at IS DISTINCT FROM {value})
         SELECT dead_letter_id FROM open"
    )
}

/// Sets the request (to `value`, SQL) of the earliest open letter of each
/// aggregate of `scope`; returns how many were open to set. The relay confirms a
/// letter without the aggregates' locks: one confirmed between the look
/// and the update is not set, and the aggregate's next open letter is
/// looked up and set instead. Else a request (or its calling off) would be
/// lost to the race, though the command reported it done.
async fn set_on_earliest_open(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    scope: &(Vec<String>, bool),
    value: &str,
) -> Result<usize, AdminError> {
    let sql = set_request_sql(table, value);
    let mut scope = scope.clone();
    let mut set = 0;
    // Ends: each round after the first is for letters resolved meanwhile,
    // and the aggregates' locks keep new ones from being filed.
    loop {
        let earliest = earliest_open(tx, table, &scope).await?;
        let ids: Vec<i64> = earliest.iter().map(|e| e.0).collect();
        let done: std::collections::HashSet<i64> = tx
            .query(&sql, &[&ids])
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        set += done.len();
        let missed: Vec<Option<String>> = earliest
            .into_iter()
            .filter(|(id, _)| !done.contains(id))
            .map(|(_, aggregate)| aggregate)
            .collect();
        if missed.is_empty() {
            return Ok(set);
        }
        let unnamed = missed.iter().any(Option::is_none);
        scope = (missed.into_iter().flatten().collect(), unnamed);
    }
}

/// The earliest open letter of each of the aggregates (and with `true`,
/// the earliest of those without an aggregate), one index probe each,
/// with its aggregate.
async fn earliest_open(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    (aggregates, unnamed): &(Vec<String>, bool),
) -> Result<Vec<(i64, Option<String>)>, AdminError> {
    let t = table.quoted();
    let rows = tx
        .query(
            &format!(
                "SELECT x.dead_letter_id, x.aggregate_id FROM unnest($1::text[]) AS a(a), LATERAL (
                     SELECT dead_letter_id, aggregate_id FROM {t} WHERE resolution IS NULL AND aggregate_id = a.a
                     ORDER BY aggregate_id, dead_letter_id LIMIT 1) x
                 UNION ALL
                 (SELECT dead_letter_id, aggregate_id FROM {t} WHERE $2 AND resolution IS NULL AND aggregate_id IS NULL
                  ORDER BY aggregate_id, dead_letter_id LIMIT 1)"
            ),
            &[aggregates, unnamed],
        )
        .await?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// How many letters of the aggregates (and with `unnamed`, without one) are open.
async fn count_open(
    client: &Client,
    table: &TableName,
    aggregates: &[String],
    unnamed: bool,
) -> Result<usize, AdminError> {
    let n: i64 = client
        .query_one(
            &format!(
                "SELECT count(*) FROM {} WHERE resolution IS NULL
                   AND (aggregate_id = ANY($1) OR ($2 AND aggregate_id IS NULL))",
                table.quoted()
            ),
            &[&aggregates, &unnamed],
        )
        .await?
        .get(0);
    Ok(usize::try_from(n).unwrap_or(usize::MAX))
}

/// `--id` redrives only an aggregate's only open dead letter (see [`redrive_one_allowed`]).
async fn check_alone(
    tx: &tokio_postgres::Transaction<'_>,
    dead_letters: &TableName,
    id: &str,
    letters: &[(i64, Option<String>)],
) -> Result<(), AdminError> {
    let Some(first) = letters.first() else {
        return Err(AdminError::Refused(format!(
            "no open dead letter with id {id:?}"
        )));
    };
    // Counted, not listed: an aggregate may hold a million letters.
    let row = tx
        .query_one(
            &format!(
                "SELECT count(*) FILTER (WHERE dead_letter_id < $2), count(*) FILTER (WHERE dead_letter_id > $2)
                 FROM {} WHERE resolution IS NULL
                   AND (aggregate_id = $1 OR ($1::text IS NULL AND aggregate_id IS NULL))",
                dead_letters.quoted()
            ),
            &[&first.1, &first.0],
        )
        .await?;
    redrive_one_allowed(id, row.get(0), row.get(1)).map_err(AdminError::Refused)
}
