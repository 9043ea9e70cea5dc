//! Dead letters: events the broker kept refusing (or rows that cannot be
//! read), moved out of the way so the rest of the outbox moves on, and never
//! dropped.
//!
//! The relay-owned table keeps each event as it was read (every value as
//! text, since a bad value is often why it is here), the reason, the number
//! of attempts and the first and last failure times. Writing a dead letter
//! and marking its outbox row happen in one transaction on the ownership
//! connection, so a dead letter is recorded exactly when the row stops being
//! pending. `outbox-relay dlq` lists, redrives (re-inserts into the outbox, in
//! order, as new rows) and drops them.

pub mod admin;

use crate::outbox::{RawRow, TableName, quote_ident};
use chrono::{DateTime, Utc};
use std::collections::HashSet;
use tokio_postgres::{Client, Statement};

/// One event on its way to the dead-letter table.
#[derive(Debug, Clone)]
pub struct DeadLetter<P> {
    pub position: P,
    /// The row's `relay_seq`, when known (to mark the outbox row).
    pub seq: Option<i64>,
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

/// `CREATE TABLE` and its index, for `migrate`.
pub fn create_sql(table: &TableName) -> Vec<String> {
    let t = table.quoted();
    let mut index = format!("{}_open", table.name);
    while index.len() > 63 {
        index.remove(0);
    }
    let index = quote_ident(&index);
    vec![
        format!(
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
    resolved_at timestamptz
)"
        ),
        format!(
            "CREATE INDEX IF NOT EXISTS {index} ON {t} (aggregate_id, dead_letter_id) WHERE resolution IS NULL"
        ),
    ]
}

/// The transaction-scoped advisory lock that serialises, per aggregate, the
/// relay writing a follower and an operator redriving or dropping (taken by
/// both), so neither acts on a view the other is about to change.
pub const AGGREGATE_LOCK_SQL: &str = "SELECT pg_advisory_xact_lock(hashtextextended($1, 0))";

/// The key of [`AGGREGATE_LOCK_SQL`] for an aggregate of a dead-letter table.
pub fn aggregate_lock_key(table: &TableName, aggregate: &str) -> String {
    format!("outbox-relay:dead-letters:{table}:{aggregate}")
}

/// Writes dead letters and marks their outbox rows, on the ownership connection.
pub struct Recorder {
    table: TableName,
    insert: Statement,
    still_open: Statement,
    open: Statement,
    /// Does the outbox row still exist (a redrive replaces the rows it puts back)?
    row_exists: Option<Statement>,
}

/// What writing a set of dead letters did.
#[derive(Debug, Default)]
pub struct Written {
    /// Letters written (indexes into the input).
    pub written: Vec<usize>,
    /// Followers not written because an operator had redriven their
    /// aggregate, including their row: they are accounted for.
    pub superseded: Vec<usize>,
    /// Aggregates found with no open dead letter any more.
    pub resolved: HashSet<String>,
}

impl Recorder {
    /// `outbox`: the outbox table, when redrives may replace its rows (rows
    /// are marked); `None` when rows are left alone.
    pub async fn new(
        client: &Client,
        table: &TableName,
        outbox: Option<&TableName>,
    ) -> Result<Self, tokio_postgres::Error> {
        let t = table.quoted();
        let insert = client
            .prepare(&format!(
                "INSERT INTO {t} (id, outbox_seq, aggregate_type, aggregate_id, event_type, event_version,
                                  payload, headers, created_at, reason, attempts, first_failed_at, last_failed_at)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)"
            ))
            .await?;
        let still_open = client
            .prepare(&format!(
                "SELECT EXISTS (SELECT 1 FROM {t} WHERE aggregate_id = $1 AND resolution IS NULL)"
            ))
            .await?;
        let open = client
            .prepare(&format!(
                "SELECT DISTINCT aggregate_id FROM {t} WHERE resolution IS NULL"
            ))
            .await?;
        let row_exists = match outbox {
            Some(o) => Some(
                client
                    .prepare(&format!(
                        "SELECT EXISTS (SELECT 1 FROM {} WHERE {} = $1)",
                        o.quoted(),
                        crate::outbox::SEQ_COLUMN
                    ))
                    .await?,
            ),
            None => None,
        };
        Ok(Recorder {
            table: table.clone(),
            insert,
            still_open,
            open,
            row_exists,
        })
    }

    /// Writes the letters in one transaction, running `mark` for the rows of
    /// the ones written. A follower whose aggregate no longer has an open
    /// dead letter (an operator redrove or dropped it meanwhile) is not
    /// written: its aggregate is reported resolved, so the relay publishes it
    /// instead, unless the redrive already put its row back as a new one.
    pub async fn write<P>(
        &self,
        client: &mut Client,
        letters: &[DeadLetter<P>],
        mark: Option<&Statement>,
    ) -> Result<Written, tokio_postgres::Error> {
        let tx = client.transaction().await?;
        let mut out = Written::default();
        // Every aggregate of the batch, in one order (the dlq commands sort
        // too), so two writers cannot wait on each other.
        let aggregates: std::collections::BTreeSet<&str> =
            letters.iter().map(|l| l.aggregate_id()).collect();
        for aggregate in aggregates {
            let key = aggregate_lock_key(&self.table, aggregate);
            tx.execute(AGGREGATE_LOCK_SQL, &[&key]).await?;
        }
        for (i, l) in letters.iter().enumerate() {
            let aggregate = l.aggregate_id();
            if out.resolved.contains(aggregate) {
                self.account_follower(&tx, l, i, &mut out).await?;
                continue;
            }
            if l.follows.is_some() {
                let open: bool = tx.query_one(&self.still_open, &[&aggregate]).await?.get(0);
                if !open {
                    out.resolved.insert(aggregate.to_owned());
                    self.account_follower(&tx, l, i, &mut out).await?;
                    continue;
                }
            }
            let r = &l.raw;
            let attempts = i32::try_from(l.attempts).unwrap_or(i32::MAX);
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
                ],
            )
            .await?;
            out.written.push(i);
        }
        if let Some(mark) = mark {
            let seqs: Vec<i64> = out.written.iter().filter_map(|&i| letters[i].seq).collect();
            if !seqs.is_empty() {
                tx.execute(mark, &[&seqs]).await?;
            }
        }
        tx.commit().await?;
        Ok(out)
    }

    /// A follower not written: superseded when a redrive replaced its row.
    async fn account_follower<P>(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        letter: &DeadLetter<P>,
        index: usize,
        out: &mut Written,
    ) -> Result<(), tokio_postgres::Error> {
        if let (Some(exists), Some(seq)) = (&self.row_exists, letter.seq) {
            let there: bool = tx.query_one(exists, &[&seq]).await?.get(0);
            if !there {
                out.superseded.push(index);
            }
        }
        Ok(())
    }

    /// Aggregates with a dead letter nobody redrove or dropped yet.
    pub async fn open_aggregates(
        &self,
        client: &Client,
    ) -> Result<HashSet<String>, tokio_postgres::Error> {
        Ok(client
            .query(&self.open, &[])
            .await?
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect())
    }
}
