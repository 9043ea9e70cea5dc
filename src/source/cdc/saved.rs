//! The view a clean stop saves beside the slot's position: what lets the
//! next start read from the table only what the slot cannot deliver.
//!
//! When rows are marked, a start reads unsent rows from the table
//! ([`super::snapshot`]). Read in a fresh snapshot, that is every unsent
//! row, the backlog committed while the relay was stopped included,
//! although the slot delivers that backlog too: the relay reads it twice
//! (once from the table, once from the stream, only to skip it), and so
//! does the server. So when the CDC reader closes, before it reports its
//! last flushed position `F` to the slot, it saves a view in
//! `<outbox>_relay_slots` (one row per slot, made by `migrate`):
//! `pg_current_snapshot()`, the highest `relay_seq` it sees and the WAL
//! insert position read after it, with `F` and the time. `migrate` saves one
//! the same way when it creates the slot, with `F` the slot's first
//! position.
//!
//! The view sees every transaction committed before `F` ([`save`] waits,
//! as a start-up read does, for those whose commit record is written to be
//! visible). Each of them is accounted for in the table: the ones the
//! stream handed over before `F` had their rows recorded before the
//! progress let `F` be reported; the ones it skipped were seen by a
//! start-up read, whose unsent rows a later snapshot (this one) sees again.
//! So while the slot's confirmed position is not past `F`, the next start
//! may read only the unsent rows of the transactions the view saw and leave
//! the rest to the stream, which starts at or before `F`: every transaction
//! the view did not see committed after it, so after `F`. The stream skips
//! what the view saw, as it skips what a fresh read saw.
//!
//! A start takes the view out of the table (the start after a crash finds
//! none and reads every unsent row, as before) and reads every unsent row
//! instead when the slot's position is past `F` (moved by hand, or created
//! again), or when a row was recorded or marked sent since the view was
//! saved (another relay ran in between, or an operator marked rows): such a
//! row, if the view did not see it, is still in the slot and would be
//! published again. Only with `source.mode = "cdc"`, `relay.mark =
//! "ranges"` and no logical messages (which no table holds): with `update`
//! the stream would decode the drain's own marking, a row change per event,
//! before new commits. Rows deleted by hand while the relay is stopped are
//! published all the same.

use super::snapshot::{Snapshot, StartupView};
use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
use crate::db::DbError;
use crate::outbox::progress::Ranges;
use crate::replication::Lsn;
use crate::source::SourceError;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

/// A saved view, as a start reads by it.
#[derive(Debug, Clone)]
pub struct Saved {
    /// What the stream skips; no settled position (the slot is not moved).
    pub view: StartupView,
    /// The highest `relay_seq` the view saw (`None`: it saw no row).
    pub max_seq: Option<i64>,
}

/// Takes the view saved for `slot` out of the table; returns it when a
/// start may read by it: the slot (at `slot_at`) is not past its flushed
/// position and nothing was recorded or marked sent since. `None`
/// otherwise, and when there is no table (an outbox migrated before it).
pub async fn take(
    client: &Client,
    ranges: &Ranges,
    slot: &str,
    slot_at: Lsn,
) -> Result<Option<Saved>, SourceError> {
    let slots = &ranges.slots;
    let sql = format!(
        "DELETE FROM {} WHERE slot_name = $1
         RETURNING snapshot::text, max_seq, until::text, flushed::text, saved_at",
        slots.quoted()
    );
    let row = match client.query_opt(&sql, &[&slot]).await {
        Ok(row) => row,
        Err(e) => return unusable(slots, e).map(|()| None),
    };
    let Some(row) = row else {
        return Ok(None);
    };
    let (snapshot, until, flushed): (String, String, String) = (row.get(0), row.get(2), row.get(3));
    let max_seq: Option<i64> = row.get(1);
    let saved_at: chrono::DateTime<chrono::Utc> = row.get(4);
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
    if sent_since(client, ranges, &snapshot, saved_at).await? {
        tracing::info!(
            slot,
            "rows were recorded or marked sent since the last stop; reading every unsent row"
        );
        return Ok(None);
    }
    tracing::info!(slot, %flushed, "reading from the table only the unsent rows the slot cannot deliver, by the view saved at the last stop");
    Ok(Some(Saved {
        view: StartupView {
            snapshot,
            until,
            settled: None,
        },
        max_seq,
    }))
}

/// Whether anything was recorded or marked sent at or after `saved_at`:
/// something other than the relay that saved the view (which recorded its
/// last batch before) ran. A row is recorded by a progress row, whose time
/// a fold that deletes it keeps in the frontier; or marked by
/// `relay_sent_at`, which only counts when the view did not see the row.
async fn sent_since(
    client: &Client,
    ranges: &Ranges,
    snapshot: &Snapshot,
    saved_at: chrono::DateTime<chrono::Utc>,
) -> Result<bool, SourceError> {
    let sql = format!(
        "SELECT COALESCE(({}) >= $1, false)
             OR EXISTS (SELECT 1 FROM {} o WHERE o.{SENT_AT_COLUMN} >= $1
                          AND NOT pg_visible_in_snapshot(o.{XID_COLUMN}, $2::text::pg_snapshot))",
        ranges.last_recorded_sql(),
        ranges.outbox.quoted()
    );
    client
        .query_one(&sql, &[&saved_at, &snapshot.to_string()])
        .await
        .map(|row| row.get(0))
        .map_err(|e| DbError::query("looking for rows sent since the last stop", e).into())
}

/// Saves a view taken now with `flushed`, before the slot is told it.
/// The caller has waited for every transaction committed before `flushed`
/// to be visible ([`super::settle::settled_position`]). False when there
/// is no table, or the relay may not use it.
pub async fn save(
    client: &Client,
    ranges: &Ranges,
    slot: &str,
    flushed: Lsn,
) -> Result<bool, SourceError> {
    let slots = &ranges.slots;
    // One statement, one snapshot: the highest relay_seq is the highest
    // the snapshot sees; the insert position, read after the snapshot was
    // taken, follows the commit record of every transaction it sees.
    let sql = format!(
        "INSERT INTO {} AS s (slot_name, snapshot, max_seq, until, flushed, saved_at)
         SELECT $1, pg_current_snapshot(), (SELECT max({SEQ_COLUMN}) FROM {}),
                pg_current_wal_insert_lsn(), $2::text::pg_lsn, now()
         ON CONFLICT (slot_name) DO UPDATE
            SET snapshot = EXCLUDED.snapshot, max_seq = EXCLUDED.max_seq, until = EXCLUDED.until,
                flushed = EXCLUDED.flushed, saved_at = EXCLUDED.saved_at",
        slots.quoted(),
        ranges.outbox.quoted()
    );
    match client.execute(&sql, &[&slot, &flushed.to_string()]).await {
        Ok(_) => Ok(true),
        Err(e) => unusable(slots, e).map(|()| false),
    }
}

/// Right after `migrate` created `slot`: saves the view of its first
/// position, so that the relay's first start reads from the table only the
/// rows committed before the slot (and leaves those after it to the slot).
/// False when nothing was saved: a transaction ran on, or no table.
pub async fn save_first(client: &Client, ranges: &Ranges, slot: &str) -> Result<bool, SourceError> {
    let mut quiet = true;
    let Some(settled) = super::settle::settled_position(client, slot, &mut quiet).await? else {
        return Ok(false);
    };
    let text: Option<String> = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| DbError::query("reading the new slot's position", e))?
        .and_then(|row| row.get(0));
    match text.map(|t| super::server::parse_lsn(&t)).transpose()? {
        Some(flushed) if flushed <= settled => save(client, ranges, slot, flushed).await,
        _ => Ok(false),
    }
}

/// A missing table or privilege is said (the start reads every unsent row);
/// any other error is returned.
fn unusable(slots: &TableName, e: tokio_postgres::Error) -> Result<(), SourceError> {
    if e.code() == Some(&SqlState::UNDEFINED_TABLE) {
        tracing::info!(
            table = %slots,
            "{slots} is missing, so each start reads every unsent row: run outbox-relay migrate to let a start after a clean stop read only what the slot cannot deliver"
        );
        return Ok(());
    }
    if e.code() == Some(&SqlState::INSUFFICIENT_PRIVILEGE) {
        tracing::warn!(
            table = %slots,
            "the relay's role may not use {slots} ({}), so each start reads every unsent row: GRANT SELECT, INSERT, UPDATE, DELETE ON {slots} TO <relay role>",
            crate::db::error_text(&e)
        );
        return Ok(());
    }
    Err(DbError::query(format!("using the saved view in {slots}"), e).into())
}
