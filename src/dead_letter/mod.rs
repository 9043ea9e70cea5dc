//! Dead letters: events the broker kept refusing (or rows that cannot be
//! read), moved out of the way so the rest of the outbox moves on, and never
//! dropped.
//!
//! The relay-owned table keeps each event as it was read (every value as
//! text, since a bad value is often why it is here), the reason, the number
//! of attempts and the first and last failure times. Writing a dead letter
//! and marking its outbox row happen in one transaction on the ownership
//! connection, so a dead letter is recorded exactly when the row stops being
//! pending. `outbox-relay dlq` lists, redrives and drops them.
//!
//! A redrive is carried out by the active relay: `dlq redrive` only marks
//! the letters `redrive_requested_at`, and the relay publishes them from this
//! table, in order, at the point it has reached: everything of the aggregate
//! it had read so far is delivered or a letter before them, and everything
//! it has not read yet comes after them. Then the letters are `redriven` and
//! the aggregate flows again. No copy goes back into the outbox, so no reader
//! (a polling restart, a replayed WAL) can put one next to its original.

pub mod admin;
pub mod lookups;

use crate::config::TableName;
use crate::outbox::RawRow;
use crate::replication::Lsn;
use chrono::{DateTime, Utc};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::Ordering;
use tokio_postgres::{Client, Statement};

/// One event on its way to the dead-letter table.
#[derive(Debug, Clone)]
pub struct DeadLetter<P> {
    pub position: P,
    /// The row's `relay_seq`, when known (to mark the outbox row).
    pub seq: Option<i64>,
    /// Where the event is in the WAL (CDC), so that a replay after a crash
    /// does not handle it twice.
    pub wal: Option<(Lsn, u64)>,
    pub raw: RawRow,
    pub reason: String,
    pub attempts: u32,
    pub first_failed_at: DateTime<Utc>,
    pub last_failed_at: DateTime<Utc>,
    /// Set when the event is dead-lettered only because an earlier event of
    /// its aggregate was (`dead_letter.aggregate = "follow"`): the id of that event.
    pub follows: Option<String>,
}

impl<P> DeadLetter<P> {
    pub fn aggregate_id(&self) -> &str {
        self.raw.aggregate_id.as_deref().unwrap_or("")
    }
}

/// Aggregates with open dead letters, each with the WAL place (commit LSN,
/// index) of its earliest open letter when every open letter of it has one
/// from this server's WAL, counted as this relay counts (CDC). An event of
/// the aggregate replayed from before that place was delivered before the
/// letter was written, and is no follower of it.
pub type OpenLetters = HashMap<String, Option<(Lsn, u64)>>;

/// A dead letter an operator asked to publish again, as stored.
#[derive(Debug, Clone)]
pub struct Requested {
    pub letter_id: i64,
    pub raw: RawRow,
}

/// One look at the requested letters.
#[derive(Debug, Default)]
pub struct Requests {
    /// Letters to publish again, oldest first.
    pub letters: Vec<Requested>,
    /// The look extended a request to a full batch of followers
    /// ([`lookups::EXTEND_BATCH`]): more may be waiting, so look again soon
    /// instead of a whole refresh interval later.
    pub extending: bool,
}

/// Columns added after the first release, with their types: `migrate` adds
/// them to an existing table.
pub const LATER_COLUMNS: [(&str, &str); 5] = [
    ("redrive_requested_at", "timestamptz"),
    ("source_lsn", "pg_lsn"),
    ("source_index", "bigint"),
    // Whose WAL `source_lsn` is in (see [`Recorder::new`]).
    ("source_system", "text"),
    // The `[[outbox.columns.extra]]` and routing columns' values, a JSON
    // object, so a redriven letter carries them as the original would have.
    ("extra", "text"),
];

/// `CREATE TABLE` and its indexes, for `migrate`.
pub fn create_sql(table: &TableName) -> Vec<String> {
    let t = table.quoted();
    let mut sql = vec![format!(
        "CREATE TABLE IF NOT EXISTS {t} (
    dead_letter_id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    id text NOT NULL,
    outbox_seq bigint,
    aggregate_type text,
    aggregate_id text,
    event_type text,
    event_version text,
    payload text,
    headers text,
    created_at text,
    reason text NOT NULL,
    attempts integer NOT NULL,
    first_failed_at timestamptz NOT NULL,
    last_failed_at timestamptz NOT NULL,
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    resolution text CHECK (resolution IN ('redriven', 'dropped')),
    resolved_at timestamptz,
    redrive_requested_at timestamptz,
    source_lsn pg_lsn,
    source_index bigint,
    extra text,
    source_system text
)"
    )];
    sql.extend(
        lookups::indexes(table)
            .iter()
            .map(|index| lookups::create_index_sql(table, index)),
    );
    sql
}

/// What to do when dead-letter table `table` is missing.
pub fn missing_table(table: &TableName) -> String {
    format!(
        "the dead-letter table {table} does not exist; run `outbox-relay migrate` (or set dead_letter.enabled = false)"
    )
}

/// What to do when dead-letter table `table` lacks a column (`which`).
pub fn missing_column(table: &TableName, which: &str) -> String {
    format!(
        "the dead-letter table {table} lacks a column this version uses ({which}); run `outbox-relay migrate`"
    )
}

/// Adds the later columns that `existing` (the table's columns) lacks.
pub fn upgrade_sql(table: &TableName, existing: &[String]) -> Option<String> {
    let missing: Vec<String> = LATER_COLUMNS
        .iter()
        .filter(|(name, _)| !existing.iter().any(|c| c == name))
        .map(|(name, ty)| format!("ADD COLUMN IF NOT EXISTS {name} {ty}"))
        .collect();
    (!missing.is_empty()).then(|| format!("ALTER TABLE {} {}", table.quoted(), missing.join(", ")))
}

/// WAL positions of events dead-lettered at or after `from` (CDC), which a
/// replay from `from` must not handle again. Only places recorded on this
/// server, counted as this relay counts (`messages`: `source.cdc.messages`),
/// are returned: the replay skips the event at each one as done, so a
/// place from another server's WAL (the database restored or moved) or
/// counted otherwise could name a different event, which would then be
/// acknowledged without being sent. A letter with no such place is handled
/// again if replayed: dead-lettered twice, never lost.
pub async fn wal_positions_since(
    client: &Client,
    table: &TableName,
    from: Lsn,
    messages: bool,
) -> Result<Vec<(Lsn, u64)>, tokio_postgres::Error> {
    let Some(origin) = wal_origin(client, messages).await else {
        return Ok(Vec::new());
    };
    let rows = client
        .query(
            &format!(
                "SELECT source_lsn::text, source_index FROM {}
                 WHERE source_lsn >= $1::text::pg_lsn AND source_system = $2",
                table.quoted()
            ),
            &[&from.to_string(), &origin],
        )
        .await?;
    Ok(rows
        .iter()
        .filter_map(|r| {
            let lsn: Option<String> = r.get(0);
            let index: Option<i64> = r.get(1);
            Some((lsn?.parse().ok()?, u64::try_from(index?).ok()?))
        })
        .collect())
}

/// Most aggregates locked in one transaction: PostgreSQL's lock table
/// holds `max_locks_per_transaction` (64) times `max_connections` entries
/// for every session together, 6,400 by default.
pub const LOCKS_PER_TRANSACTION: usize = 500;

/// How many of `items`, from the first, name at most
/// [`LOCKS_PER_TRANSACTION`] aggregates (at least one item).
pub fn chunk_len<T>(items: &[T], aggregate: impl Fn(&T) -> &str) -> usize {
    let mut seen = HashSet::new();
    items
        .iter()
        .position(|i| seen.insert(aggregate(i)) && seen.len() > LOCKS_PER_TRANSACTION)
        .unwrap_or(items.len())
        .max(1)
}

/// The transaction-scoped advisory locks that serialise, per aggregate,
/// the relay writing a follower and an operator redriving or dropping
/// (taken by both), so neither acts on a view the other is about to
/// change: one for each key of `$1`, in one statement, in the array's
/// order (a function scan of unnest yields it in order).
pub const AGGREGATES_LOCK_SQL: &str =
    "SELECT count(pg_advisory_xact_lock(hashtextextended(k, 0))) FROM unnest($1::text[]) AS k";

/// The key of [`AGGREGATES_LOCK_SQL`] for an aggregate of a dead-letter table.
pub fn aggregate_lock_key(table: &TableName, aggregate: &str) -> String {
    format!("outbox-relay:dead-letters:{table}:{aggregate}")
}

/// Whose WAL the places of letters written now are in: the server's system
/// identifier, and whether event indexes count logical messages. `None`
/// (no right to read the identifier) leaves every place unknown.
async fn wal_origin(client: &Client, messages: bool) -> Option<String> {
    let row = client
        .query_one(
            "SELECT system_identifier::text FROM pg_control_system()",
            &[],
        )
        .await
        .map_err(|e| {
            tracing::warn!(
                error = %crate::db::error_text(&e),
                "cannot read the server's system identifier (pg_control_system()); dead letters written now record no trusted WAL place, so after a crash a CDC replay may dead-letter events delivered before a letter as its followers: grant EXECUTE on pg_control_system() to the relay's role"
            )
        })
        .ok()?;
    let system: String = row.get(0);
    Some(if messages {
        format!("{system}+messages")
    } else {
        system
    })
}

/// Writes dead letters and marks their outbox rows, and carries out
/// requested redrives, on the ownership connection.
pub struct Recorder {
    table: TableName,
    /// Whose WAL the places written refer to; `None` when unknown.
    origin: Option<String>,
    insert: Statement,
    /// Whether the aggregate's earliest open letter is requested; no row
    /// when none is open.
    first_open: Statement,
    /// Per aggregate, the earliest open letter's WAL place; a letter without
    /// one of this origin (read by polling or the start-up read, or from
    /// another server) makes the place unknown. The statements of the
    /// periodic look are in [`lookups`].
    open: Statement,
    extend_requests: Statement,
    requested: Statement,
    sent: Statement,
    refused: Statement,
    clear_requests: Statement,
    /// When each letter handed to the relay was first handed (the server's
    /// clock), until it is sent or refused: a refusal ends its aggregate's
    /// requests unless its earliest open letter, the one `dlq redrive`
    /// stamps, was asked for since. Bounded by [`TAKEN_MEMORY`]; a letter
    /// forgotten ends them.
    taken: std::sync::Mutex<HashMap<i64, DateTime<Utc>>>,
    /// The text bytes a requested letter is assumed to take: the average
    /// of those the last look handed over, or a quarter of the largest when
    /// more (0: none yet). A look asks for what the room holds at that size.
    letter_bytes: std::sync::atomic::AtomicUsize,
}

/// Most letters whose hand-over time a [`Recorder`] keeps: letters handed
/// over and never answered (a run that ended) are forgotten all at once
/// past it.
const TAKEN_MEMORY: usize = 20 * REQUESTED_BATCH as usize;

/// What writing a set of dead letters did.
#[derive(Debug, Default)]
pub struct Written {
    /// Letters written (indexes into the input).
    pub written: Vec<usize>,
    /// Aggregates found with no open dead letter any more.
    pub resolved: HashSet<String>,
}

/// Most requested letters handed to the relay at once.
pub const REQUESTED_BATCH: i64 = 500;

impl Recorder {
    /// `shard`: an SQL condition on `aggregate_id` selecting the letters
    /// this pipeline redrives (its shard), or `None` for all. `messages`:
    /// the WAL index of an event counts logical messages too
    /// (`source.cdc.messages`). A letter's WAL place is kept with the
    /// server's system identifier and that way of counting, so a place
    /// from another server (the database restored or moved) or counted
    /// otherwise is never compared with this stream's.
    pub async fn new(
        client: &Client,
        table: &TableName,
        shard: Option<&str>,
        messages: bool,
    ) -> Result<Self, tokio_postgres::Error> {
        let t = table.quoted();
        let shard = shard.map(|c| format!(" AND {c}")).unwrap_or_default();
        let prepare = |sql: String| async move { client.prepare(&sql).await };
        Ok(Recorder {
            table: table.clone(),
            origin: wal_origin(client, messages).await,
            insert: prepare(format!(
                "INSERT INTO {t} (id, outbox_seq, aggregate_type, aggregate_id, event_type, event_version,
                                  payload, headers, created_at, reason, attempts, first_failed_at, last_failed_at,
                                  source_lsn, source_index, extra, source_system, redrive_requested_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14::text::pg_lsn, $15, $16, $17,
                         CASE WHEN $18 THEN now() END)"
            ))
            .await?,
            first_open: prepare(format!(
                "SELECT redrive_requested_at IS NOT NULL FROM {t} WHERE aggregate_id = $1 AND resolution IS NULL
                 ORDER BY aggregate_id, dead_letter_id LIMIT 1"
            ))
            .await?,
            open: prepare(lookups::open_sql(table, &shard)).await?,
            extend_requests: prepare(lookups::extend_requests_sql(table, &shard)).await?,
            requested: prepare(lookups::requested_sql(table, &shard)).await?,
            sent: prepare(lookups::sent_sql(table)).await?,
            refused: prepare(format!(
                "UPDATE {t} SET reason = $2, attempts = attempts + $3, last_failed_at = now()
                 WHERE dead_letter_id = $1 AND resolution IS NULL"
            ))
            .await?,
            clear_requests: prepare(lookups::clear_requests_sql(table)).await?,
            taken: Default::default(),
            letter_bytes: Default::default(),
        })
    }

    /// Writes the letters, running `mark` for the rows of the ones written,
    /// in transactions of at most [`LOCKS_PER_TRANSACTION`] aggregates (each
    /// takes a lock, and PostgreSQL's lock table is shared and small). A
    /// follower whose aggregate no longer has an open dead letter (an
    /// operator dropped it, or the relay published it again, meanwhile) is
    /// not written: its aggregate is reported resolved, so the relay
    /// publishes it instead.
    pub async fn write<P>(
        &self,
        client: &mut Client,
        letters: &[DeadLetter<P>],
        mark: Option<&crate::outbox::MarkStatement>,
    ) -> Result<Written, tokio_postgres::Error> {
        let mut out = Written::default();
        let mut start = 0;
        while start < letters.len() {
            let end = start + chunk_len(&letters[start..], |l| l.aggregate_id());
            // What an earlier part found resolved stays so for later ones.
            let resolved = std::mem::take(&mut out.resolved);
            let part = self
                .write_chunk(client, &letters[start..end], mark, resolved)
                .await?;
            out.written.extend(part.written.iter().map(|i| i + start));
            out.resolved = part.resolved;
            start = end;
        }
        Ok(out)
    }

    /// Locks every aggregate of the letters, in one order (the dlq
    /// commands sort too), so two writers cannot wait on each other.
    async fn lock_aggregates<P>(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        letters: &[DeadLetter<P>],
    ) -> Result<(), tokio_postgres::Error> {
        let aggregates: std::collections::BTreeSet<&str> =
            letters.iter().map(|l| l.aggregate_id()).collect();
        let keys: Vec<String> = aggregates
            .into_iter()
            .map(|a| aggregate_lock_key(&self.table, a))
            .collect();
        tx.execute(AGGREGATES_LOCK_SQL, &[&keys]).await.map(|_| ())
    }

    async fn write_chunk<P>(
        &self,
        client: &mut Client,
        letters: &[DeadLetter<P>],
        mark: Option<&crate::outbox::MarkStatement>,
        resolved: HashSet<String>,
    ) -> Result<Written, tokio_postgres::Error> {
        let tx = client.transaction().await?;
        let mut out = Written {
            written: Vec::new(),
            resolved,
        };
        self.lock_aggregates(&tx, letters).await?;
        for (i, l) in letters.iter().enumerate() {
            let aggregate = l.aggregate_id();
            if out.resolved.contains(aggregate) {
                continue;
            }
            // A follower goes with its aggregate's letters: none open, it is
            // published instead; their redrive asked for, it is asked for too.
            let requested = match l.follows {
                Some(_) => match tx.query_opt(&self.first_open, &[&aggregate]).await? {
                    Some(row) => row.get::<_, bool>(0),
                    None => {
                        out.resolved.insert(aggregate.to_owned());
                        continue;
                    }
                },
                None => false,
            };
            let r = &l.raw;
            let attempts = i32::try_from(l.attempts).unwrap_or(i32::MAX);
            let (lsn, index, origin) = match l.wal {
                Some((lsn, index)) => (
                    Some(lsn.to_string()),
                    i64::try_from(index).ok(),
                    self.origin.as_deref(),
                ),
                None => (None, None, None),
            };
            tx.execute(
                &self.insert,
                &[
                    &r.id.as_deref().unwrap_or(""),
                    &l.seq,
                    &r.aggregate_type,
                    &r.aggregate_id,
                    &r.event_type,
                    &r.event_version,
                    &r.payload,
                    &r.headers,
                    &r.created_at,
                    &l.reason,
                    &attempts,
                    &l.first_failed_at,
                    &l.last_failed_at,
                    &lsn,
                    &index,
                    &r.extra,
                    &origin,
                    &requested,
                ],
            )
            .await?;
            out.written.push(i);
        }
        if let Some(mark) = mark {
            let seqs: Vec<i64> = out.written.iter().filter_map(|&i| letters[i].seq).collect();
            if !seqs.is_empty() {
                mark.execute(&tx, &seqs).await?;
            }
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Aggregates with a dead letter nobody redrove or dropped yet.
    pub async fn open_aggregates(
        &self,
        client: &Client,
    ) -> Result<OpenLetters, tokio_postgres::Error> {
        Ok(client
            .query(&self.open, &[&self.origin])
            .await?
            .iter()
            .filter_map(|r| {
                let aggregate = r.get::<_, Option<String>>(0)?;
                let lsn: Option<String> = r.get(1);
                let index: Option<i64> = r.get(2);
                let place = lsn
                    .and_then(|l| l.parse::<Lsn>().ok())
                    .zip(index.and_then(|i| u64::try_from(i).ok()));
                Some((aggregate, place))
            })
            .collect())
    }

    /// Letters an operator asked to publish again, oldest first: at most
    /// [`REQUESTED_BATCH`], and no more than take less than `max_bytes` of
    /// text (the first always), the room the pipeline's budget has for
    /// them. Read as they arrive, so a batch of large letters is not held
    /// whole. The rest come with a later look: the pipeline looks again as
    /// soon as an aggregate's letters handed over are confirmed (a look at
    /// once would find the same letters, still out, and look again).
    pub async fn requested(
        &self,
        client: &Client,
        max_bytes: usize,
    ) -> Result<Requests, tokio_postgres::Error> {
        let extending: bool = client.query_one(&self.extend_requests, &[]).await?.get(1);
        let assumed = self.letter_bytes.load(Ordering::Relaxed);
        let read = lookups::read_requested(client, &self.requested, assumed, max_bytes).await?;
        let letters = read.letters;
        if let Some(assumed) = read.assumed {
            self.letter_bytes.store(assumed, Ordering::Relaxed);
        }
        {
            let mut taken = self.taken();
            if taken.len() + letters.len() > TAKEN_MEMORY {
                taken.clear();
            }
            for (l, at) in &letters {
                taken.entry(l.letter_id).or_insert(*at);
            }
        }
        Ok(Requests {
            letters: letters.into_iter().map(|(l, _)| l).collect(),
            extending,
        })
    }

    /// The broker confirmed these redriven letters: they are marked
    /// `redriven`, whatever an operator decided meanwhile. Returns those an
    /// operator dropped while they were on their way (`dlq drop` does not
    /// call back a letter the relay is publishing): published all the same,
    /// and so recorded.
    pub async fn sent(
        &self,
        client: &Client,
        ids: &[i64],
    ) -> Result<Vec<i64>, tokio_postgres::Error> {
        if ids.is_empty() {
            return Ok(Vec::new());
        }
        let taken_at: Vec<Option<DateTime<Utc>>> = {
            let mut taken = self.taken();
            ids.iter().map(|id| taken.remove(id)).collect()
        };
        let rows = client.query(&self.sent, &[&ids, &taken_at]).await?;
        Ok(rows.iter().map(|r| r.get(0)).collect())
    }

    fn taken(&self) -> std::sync::MutexGuard<'_, HashMap<i64, DateTime<Utc>>> {
        self.taken
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The broker refused a redriven letter again: it records why and, when
    /// the refusal `counts`, its aggregate's requests end (an operator asks
    /// again once the cause is fixed), unless an operator asked again after
    /// the letter was handed over; back-pressure keeps them for a retry.
    pub async fn refused(
        &self,
        client: &Client,
        id: i64,
        reason: &str,
        counts: bool,
    ) -> Result<(), tokio_postgres::Error> {
        client
            .execute(&self.refused, &[&id, &reason, &i32::from(counts)])
            .await?;
        if counts {
            let taken = self.taken().remove(&id);
            client.execute(&self.clear_requests, &[&id, &taken]).await?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_name_at_most_so_many_aggregates() {
        let items: Vec<String> = (0..1200).map(|i| format!("a{}", i / 2)).collect();
        let len = chunk_len(&items, String::as_str);
        assert_eq!(
            len,
            2 * LOCKS_PER_TRANSACTION,
            "both letters of each aggregate"
        );
        assert_eq!(chunk_len(&items[len..], String::as_str), 200);
        assert_eq!(chunk_len(&items[..0], String::as_str), 1, "at least one");
    }
}
