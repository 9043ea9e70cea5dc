//! The view saved with the slot's position at a clean stop: what lets the
//! next start read from the table only what the slot cannot deliver.
//!
//! When rows are marked, a start reads unsent rows from the table
//! ([`super::snapshot`]). Read in a fresh snapshot, that is every unsent
//! row, the backlog committed while the relay was stopped included,
//! although the slot delivers the backlog too: the stream then decodes all
//! of it again only to skip it, after the read and before new commits reach
//! the relay. So when the CDC reader closes, before it reports its last
//! flushed position `F` to the slot, it saves a view in
//! `<outbox>_relay_slots` (one row per slot, made by `migrate`):
//! `pg_current_snapshot()` and the WAL insert position read after it, with
//! `F` and the time.
//!
//! That snapshot sees every transaction committed before `F` that still has
//! unsent rows. Every transaction the stream handed over before `F` is fully
//! accounted for in the table: its rows were marked before the progress let
//! `F` be reported, and a mark only touches rows its own snapshot sees, so
//! they were committed and visible before the view was taken. A transaction
//! the stream skipped was seen by a start-up read's snapshot, and snapshots
//! only grow; one from before the slot existed was seen by the first
//! start-up read. So while the slot's confirmed position is not past `F`,
//! the next start may read the unsent rows of the transactions the saved
//! snapshot saw and leave the rest to the stream: each of them committed
//! after the view was taken, so after `F`, where the stream starts. The
//! stream skips what the saved view covers, as it skips what a fresh read
//! saw; the events the broker confirmed are marked and seen by the view,
//! so a clean stop repeats nothing.
//!
//! A start takes the view out of the table (a crash after it leaves none,
//! and the start after the crash reads every unsent row, as before) and
//! reads every unsent row instead when the slot's position is past `F`
//! (moved by hand, created again, or moved by a start-up read's
//! fast-forward) or when a row the view did not see was marked since (a
//! polling relay ran in between, or rows were marked by hand). Only with
//! `source.mode = "cdc"` and `relay.mark = "update"`: deleted rows leave no
//! trace to check, `auto` mode polls in between, logical messages are not
//! in the table, and ranges go by the frontier. Rows deleted by hand while
//! the relay is stopped are published all the same.

use super::snapshot::{Snapshot, StartupView};
use crate::config::{SENT_AT_COLUMN, TableName, XID_COLUMN};
use crate::db::DbError;
use crate::replication::Lsn;
use crate::source::SourceError;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

/// The relay-owned table of saved views next to `outbox`.
pub fn slots_table(outbox: &TableName) -> TableName {
    outbox.sibling("_relay_slots")
}

/// `CREATE TABLE` for `migrate`.
pub fn create_sql(slots: &TableName) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
    slot_name text PRIMARY KEY,
    snapshot pg_snapshot NOT NULL,
    until pg_lsn NOT NULL,
    flushed pg_lsn NOT NULL,
    saved_at timestamptz NOT NULL
)",
        slots.quoted()
    )
}

/// Takes the view saved for `slot` out of the table; returns it when a
/// start may read by it: the slot (at `slot_at`) is not past its flushed
/// position and no row it did not see was marked since. `None` otherwise,
/// and when there is no table (`migrate` has not made it).
pub async fn take(
    client: &Client,
    outbox: &TableName,
    slot: &str,
    slot_at: Lsn,
) -> Result<Option<StartupView>, SourceError> {
    let slots = slots_table(outbox);
    let sql = format!(
        "DELETE FROM {} WHERE slot_name = $1 RETURNING snapshot::text, until::text, flushed::text, saved_at",
        slots.quoted()
    );
    let row = match client.query_opt(&sql, &[&slot]).await {
        Ok(row) => row,
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => {
            tracing::info!(
                table = %slots,
                "{slots} is missing, so each start reads every unsent row: run outbox-relay migrate to let a start after a clean stop read only what the slot cannot deliver"
            );
            return Ok(None);
        }
        Err(e) if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) => {
            tracing::warn!(
                table = %slots,
                "the relay's role may not use {slots} ({}), so each start reads every unsent row: GRANT SELECT, INSERT, UPDATE, DELETE ON {slots} TO <relay role>",
                crate::db::error_text(&e)
            );
            return Ok(None);
        }
        Err(e) => {
            return Err(DbError::query(format!("taking the saved view from {slots}"), e).into());
        }
    };
    let Some(row) = row else {
        return Ok(None);
    };
    let (snapshot, until, flushed): (String, String, String) = (row.get(0), row.get(1), row.get(2));
    let saved_at: chrono::DateTime<chrono::Utc> = row.get(3);
    let (Some(snapshot), Ok(until), Ok(flushed)) = (
        Snapshot::parse(&snapshot),
        until.parse::<Lsn>(),
        flushed.parse::<Lsn>(),
    ) else {
        tracing::warn!(table = %slots, slot, "unreadable saved view, dropped; reading every unsent row");
        return Ok(None);
    };
    if slot_at > flushed {
        tracing::info!(slot, %flushed, at = %slot_at, "the slot moved past the view saved at the last stop; reading every unsent row");
        return Ok(None);
    }
    if marked_since(client, outbox, &snapshot, saved_at).await? {
        tracing::info!(
            slot,
            "rows were marked sent since the last stop; reading every unsent row"
        );
        return Ok(None);
    }
    Ok(Some(StartupView {
        snapshot,
        until,
        settled: None,
    }))
}

/// Whether a row the snapshot did not see committed was marked at or after
/// `saved_at`: something other than the relay that saved the view marked it.
async fn marked_since(
    client: &Client,
    outbox: &TableName,
    snapshot: &Snapshot,
    saved_at: chrono::DateTime<chrono::Utc>,
) -> Result<bool, SourceError> {
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {} WHERE {SENT_AT_COLUMN} >= $1
                          AND NOT pg_visible_in_snapshot({XID_COLUMN}, $2::text::pg_snapshot))",
        outbox.quoted()
    );
    let text = snapshot.to_string();
    client
        .query_one(&sql, &[&saved_at, &text])
        .await
        .map(|row| row.get(0))
        .map_err(|e| DbError::query("looking for rows marked since the last stop", e).into())
}

/// Saves a view taken now with `flushed`, before the slot is told it;
/// false when there is no table.
pub async fn save(
    client: &Client,
    outbox: &TableName,
    slot: &str,
    flushed: Lsn,
) -> Result<bool, SourceError> {
    let slots = slots_table(outbox);
    // The snapshot first, then the insert position (as a start-up read
    // takes them): every transaction the snapshot sees committed has its
    // commit record before that position.
    let sql = format!(
        "INSERT INTO {} AS s (slot_name, snapshot, until, flushed, saved_at)
         SELECT $1, v.snapshot, pg_current_wal_insert_lsn(), $2::text::pg_lsn, now()
           FROM (SELECT pg_current_snapshot() AS snapshot) v
         ON CONFLICT (slot_name) DO UPDATE
            SET snapshot = EXCLUDED.snapshot, until = EXCLUDED.until,
                flushed = EXCLUDED.flushed, saved_at = EXCLUDED.saved_at",
        slots.quoted()
    );
    match client.execute(&sql, &[&slot, &flushed.to_string()]).await {
        Ok(_) => Ok(true),
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => Ok(false),
        Err(e) => Err(DbError::query(format!("saving the view of the slot in {slots}"), e).into()),
    }
}
