//! `outbox-relay dlq list | redrive | drop`.
//!
//! A redrive puts events back into the outbox as new rows, in order: the
//! aggregate's open dead letters (oldest first), then its rows still unsent
//! (which, being later, must follow them). Original rows are deleted in the
//! same transaction, so ids stay unique and nothing is published twice by
//! design; the relay publishes the new rows like any others.

use crate::outbox::inspect::TableInfo;
use crate::outbox::{
    ResolvedColumns, SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN, quote_ident,
};
use crate::source::rows::{read_row, select_list};
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
    #[error("{0}")]
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
                        first_failed_at, last_failed_at, dead_lettered_at, resolution, resolved_at
                 FROM {} WHERE ($1::text IS NULL OR aggregate_id = $1) AND ($2 OR resolution IS NULL)
                 ORDER BY dead_letter_id LIMIT $3",
                table.quoted()
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
) -> Result<std::collections::HashSet<String>, AdminError> {
    let aggregates: Vec<String> = match target {
        Target::Aggregate(a) => vec![a.clone()],
        Target::Id(id) => tx
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
        Target::All => tx
            .query(
                &format!(
                    "SELECT DISTINCT aggregate_id FROM {} WHERE resolution IS NULL",
                    table.quoted()
                ),
                &[],
            )
            .await?
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect(),
    };
    let mut aggregates = aggregates;
    aggregates.sort();
    for a in &aggregates {
        tx.execute(
            super::AGGREGATE_LOCK_SQL,
            &[&super::aggregate_lock_key(table, a)],
        )
        .await?;
    }
    Ok(aggregates.into_iter().collect())
}

/// The targeted dead letters of the aggregates locked by [`lock_aggregates`]:
/// an aggregate whose first letter arrived after the locks were taken is left
/// for the next command.
async fn targeted_locked(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
) -> Result<Vec<(i64, String, Option<String>, Option<i64>)>, AdminError> {
    let locked = lock_aggregates(tx, table, target).await?;
    let mut letters = targeted(tx, table, target).await?;
    letters.retain(|l| l.2.as_ref().is_none_or(|a| locked.contains(a)));
    Ok(letters)
}

/// The open dead letters a target names, oldest first: `(dead_letter_id, id, aggregate_id, outbox_seq)`.
async fn targeted(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
) -> Result<Vec<(i64, String, Option<String>, Option<i64>)>, AdminError> {
    let (id, aggregate, all) = match target {
        Target::Id(i) => (Some(i.as_str()), None, false),
        Target::Aggregate(a) => (None, Some(a.as_str()), false),
        Target::All => (None, None, true),
    };
    let rows = tx
        .query(
            &format!(
                "SELECT dead_letter_id, id, aggregate_id, outbox_seq FROM {} WHERE resolution IS NULL
                   AND ($3 OR id = $1 OR aggregate_id = $2)
                 ORDER BY dead_letter_id FOR UPDATE",
                table.quoted()
            ),
            &[&id, &aggregate, &all],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
}

/// Marks the targeted dead letters as dropped; returns how many.
pub async fn drop(
    client: &mut Client,
    table: &TableName,
    target: &Target,
) -> Result<usize, AdminError> {
    let tx = client.transaction().await?;
    let letters = targeted_locked(&tx, table, target).await?;
    let ids: Vec<i64> = letters.iter().map(|l| l.0).collect();
    tx.execute(
        &format!(
            "UPDATE {} SET resolution = 'dropped', resolved_at = now() WHERE dead_letter_id = ANY($1)",
            table.quoted()
        ),
        &[&ids],
    )
    .await?;
    tx.commit().await?;
    Ok(ids.len())
}

/// Whether `dlq redrive --id id` may put one event back, given the open
/// dead letters of its aggregate (event ids, oldest first). A redriven
/// event goes to the end of the outbox, behind everything its aggregate
/// has there: it must be the aggregate's only open dead letter, or it would
/// overtake earlier letters or be overtaken by later ones (which a later
/// redrive would then publish ahead of it).
pub fn redrive_one_allowed(id: &str, open: &[String]) -> Result<(), String> {
    let Some(at) = open.iter().position(|o| o == id) else {
        return Err(format!("no open dead letter with id {id:?}"));
    };
    if open.len() > 1 {
        let (earlier, later) = (at, open.len() - at - 1);
        return Err(format!(
            "{id} is one of {} open dead letters of its aggregate ({earlier} earlier, {later} later); \
             redrive the aggregate (--aggregate) so that they go back in order",
            open.len()
        ));
    }
    Ok(())
}

/// The outbox the events go back into.
pub struct Outbox<'a> {
    pub table: &'a TableName,
    pub columns: &'a ResolvedColumns,
    pub info: &'a TableInfo,
    /// With `none`, unsent rows cannot be told from published ones, so no
    /// waiting row goes back with the dead letters (there are none to wait:
    /// with `mark = "none"` only `follow` applies).
    pub mark: crate::config::MarkMode,
}

/// Re-publishes the targeted dead letters (see the module docs); returns how
/// many dead letters and how many held rows went back.
pub async fn redrive(
    client: &mut Client,
    dead_letters: &TableName,
    outbox: &Outbox<'_>,
    target: &Target,
) -> Result<(usize, usize), AdminError> {
    let tx = client.transaction().await?;
    let letters = targeted_locked(&tx, dead_letters, target).await?;
    if let Target::Id(id) = target {
        check_alone(&tx, dead_letters, id, &letters).await?;
    }
    let mut aggregates: Vec<Option<String>> = Vec::new();
    for l in &letters {
        if !aggregates.contains(&l.2) {
            aggregates.push(l.2.clone());
        }
    }
    let insert = insert_sql(outbox);
    let mut held_total = 0;
    for aggregate in &aggregates {
        let mine: Vec<&(i64, String, Option<String>, Option<i64>)> =
            letters.iter().filter(|l| &l.2 == aggregate).collect();
        // The aggregate's rows still unsent come after its dead letters.
        let held = unsent_rows(&tx, outbox, aggregate, false).await?;
        let originals: Vec<i64> = mine
            .iter()
            .filter_map(|l| l.3)
            .chain(held.iter().map(|(seq, _)| *seq))
            .collect();
        delete_rows(&tx, outbox, &originals).await?;
        let ids: Vec<i64> = mine.iter().map(|l| l.0).collect();
        let stored = tx
            .query(
                &format!(
                    "SELECT id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at
                     FROM {} WHERE dead_letter_id = ANY($1) ORDER BY dead_letter_id",
                    dead_letters.quoted()
                ),
                &[&ids],
            )
            .await?;
        for r in &stored {
            let values: Vec<Option<String>> = (0..8).map(|i| r.get(i)).collect();
            insert_row(&tx, &insert, &values).await?;
        }
        for (_, raw) in &held {
            insert_row(&tx, &insert, &raw_values(raw)).await?;
        }
        held_total += held.len();
    }
    if outbox.mark != crate::config::MarkMode::None {
        held_total += move_late_rows(&tx, outbox, &insert, &aggregates).await?;
    }
    let ids: Vec<i64> = letters.iter().map(|l| l.0).collect();
    tx.execute(
        &format!(
            "UPDATE {} SET resolution = 'redriven', resolved_at = now() WHERE dead_letter_id = ANY($1)",
            dead_letters.quoted()
        ),
        &[&ids],
    )
    .await?;
    tx.commit().await?;
    Ok((ids.len(), held_total))
}

/// `--id` redrives only an aggregate's only open dead letter (see [`redrive_one_allowed`]).
async fn check_alone(
    tx: &tokio_postgres::Transaction<'_>,
    dead_letters: &TableName,
    id: &str,
    letters: &[(i64, String, Option<String>, Option<i64>)],
) -> Result<(), AdminError> {
    let Some(first) = letters.first() else {
        return Err(AdminError::Refused(format!(
            "no open dead letter with id {id:?}"
        )));
    };
    let open: Vec<String> = tx
        .query(
            &format!(
                "SELECT id FROM {} WHERE resolution IS NULL AND aggregate_id IS NOT DISTINCT FROM $1 ORDER BY dead_letter_id",
                dead_letters.quoted()
            ),
            &[&first.2],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    redrive_one_allowed(id, &open).map_err(AdminError::Refused)
}

/// The aggregate's unsent rows, locked, in order; with `others_only`, only
/// those other transactions wrote (this one's carry its own `relay_xid`).
async fn unsent_rows(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: &Outbox<'_>,
    aggregate: &Option<String>,
    others_only: bool,
) -> Result<Vec<(i64, crate::outbox::RawRow)>, AdminError> {
    if outbox.mark == crate::config::MarkMode::None {
        return Ok(Vec::new());
    }
    let rows = tx
        .query(
            &format!(
                "SELECT {} FROM {} WHERE {SENT_AT_COLUMN} IS NULL AND {}::text = $1 \
                 AND (NOT $2 OR {XID_COLUMN} <> pg_current_xact_id()) ORDER BY {SEQ_COLUMN} FOR UPDATE",
                select_list(outbox.columns),
                outbox.table.quoted(),
                quote_ident(&outbox.columns.aggregate_id)
            ),
            &[aggregate, &others_only],
        )
        .await?;
    Ok(rows.iter().filter_map(|r| read_row(r, 0)).collect())
}

async fn delete_rows(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: &Outbox<'_>,
    seqs: &[i64],
) -> Result<(), AdminError> {
    tx.execute(
        &format!(
            "DELETE FROM {} WHERE {SEQ_COLUMN} = ANY($1)",
            outbox.table.quoted()
        ),
        &[&seqs],
    )
    .await?;
    Ok(())
}

/// How long a redrive waits for transactions that were writing when it began.
const WRITERS_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

/// An application transaction open while the copies were written may hold
/// rows of the aggregate with smaller `relay_seq`s and commit after the
/// redrive: readers that order by `relay_seq` (a polling relay's first read
/// after a rewind, the CDC start-up read) would publish them ahead of the
/// copies. So the redrive waits for every transaction open after its last
/// insert (any later one takes larger `relay_seq`s) and moves the
/// aggregate's rows written by others behind the copies, in their order,
/// until no transaction was open. Returns how many rows it moved.
async fn move_late_rows(
    tx: &tokio_postgres::Transaction<'_>,
    outbox: &Outbox<'_>,
    insert: &(String, Vec<usize>),
    aggregates: &[Option<String>],
) -> Result<usize, AdminError> {
    let started = std::time::Instant::now();
    let mut moved = 0;
    loop {
        let running: Vec<i64> = tx
            .query_one(
                "SELECT coalesce(array_agg(x::text::int8), '{}') FROM pg_snapshot_xip(pg_current_snapshot()) x \
                 WHERE x <> pg_current_xact_id()",
                &[],
            )
            .await?
            .get(0);
        if running.is_empty() {
            return Ok(moved);
        }
        loop {
            let open: i64 = tx
                .query_one(
                    "SELECT count(*) FROM unnest($1::int8[]) x WHERE pg_xact_status(x::text::xid8) = 'in progress'",
                    &[&running],
                )
                .await?
                .get(0);
            if open == 0 {
                break;
            }
            if started.elapsed() > WRITERS_WAIT {
                return Err(AdminError::Refused(format!(
                    "{open} transaction(s) writing while the redrive ran are still open after {} s; \
                     nothing was changed: run the redrive again when they have finished (see pg_stat_activity)",
                    WRITERS_WAIT.as_secs()
                )));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        for aggregate in aggregates {
            let late = unsent_rows(tx, outbox, aggregate, true).await?;
            if late.is_empty() {
                continue;
            }
            let seqs: Vec<i64> = late.iter().map(|(seq, _)| *seq).collect();
            delete_rows(tx, outbox, &seqs).await?;
            for (_, raw) in &late {
                insert_row(tx, insert, &raw_values(raw)).await?;
            }
            moved += late.len();
        }
    }
}

fn raw_values(raw: &crate::outbox::RawRow) -> Vec<Option<String>> {
    vec![
        raw.id.clone(),
        raw.aggregate_type.clone(),
        raw.aggregate_id.clone(),
        raw.event_type.clone(),
        raw.event_version.clone(),
        raw.payload.clone(),
        raw.headers.clone(),
        raw.created_at.clone(),
    ]
}

/// `INSERT INTO outbox (<present contract columns>) VALUES (CAST($n AS <column type>), ...)`,
/// and which [`crate::outbox::RawRow`]-ordered values fill its parameters.
fn insert_sql(outbox: &Outbox<'_>) -> (String, Vec<usize>) {
    let mut names = Vec::new();
    let mut values = Vec::new();
    let mut present = Vec::new();
    for (i, column) in outbox.columns.in_row_order().iter().enumerate() {
        if let Some(c) = column {
            let ty = outbox
                .info
                .column(c)
                .map(|c| c.type_name.clone())
                .unwrap_or_else(|| "text".into());
            present.push(i);
            names.push(quote_ident(c));
            values.push(format!("CAST(${}::text AS {ty})", present.len()));
        }
    }
    let sql = format!(
        "INSERT INTO {} ({}) VALUES ({})",
        outbox.table.quoted(),
        names.join(", "),
        values.join(", ")
    );
    (sql, present)
}

async fn insert_row(
    tx: &tokio_postgres::Transaction<'_>,
    (sql, present): &(String, Vec<usize>),
    values: &[Option<String>],
) -> Result<(), AdminError> {
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = present
        .iter()
        .map(|&i| &values[i] as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    tx.execute(sql.as_str(), &params).await.map_err(|e| {
        AdminError::Refused(format!(
            "event {} cannot go back into the outbox: {}; fix the dead letter's values or drop it",
            values[0].as_deref().unwrap_or("?"),
            crate::db::error_text(&e)
        ))
    })?;
    Ok(())
}
