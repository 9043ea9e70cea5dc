//! The fold: moves the frontier forward, holds open the rows it passes
//! before they were recorded, and deletes the progress rows the new
//! frontier covers.
//!
//! A round has two steps, some time apart:
//!
//! 1. [`Ranges::capture`] reads the newest progress row's id *M*, takes a
//!    transaction id *A*, waits (a bounded time) for a snapshot whose oldest
//!    running transaction is past *A*, and keeps that snapshot *C*. A
//!    progress row is written after the rows it names committed, so their
//!    transactions took their ids before *A*: every row named by a progress
//!    row up to *M* is visible in *C* when the wait succeeded ("settled").
//! 2. [`Ranges::advance`], one REPEATABLE READ transaction: the rows
//!    visible in *C* and not in the frontier that are neither marked nor
//!    recorded are held open (unless there are more than a limit of them: a
//!    drain is under way, and the round gives up until it ends); held rows
//!    that are now recorded or marked are closed (deleted: the frontier
//!    covers them from now on); the frontier becomes *C*;
//!    and, when *C* settled, the progress rows up to *M* are deleted (when
//!    it did not, because a long transaction runs somewhere on the server,
//!    those whose rows are all visible in *C*, counted row by row).
//!
//! Between the two steps the relay confirms what it had in flight at *C*,
//! so a capture a few seconds old holds open next to nothing.

use super::Ranges;
use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, XID_COLUMN};
use crate::db::DbError;
use std::time::Duration;
use tokio_postgres::{Client, IsolationLevel, Transaction};

/// How many rows a round may hold open. More than `drain` means the relay
/// is draining: the round leaves the frontier and waits, since the rows it
/// would hold are about to be recorded. Once rounds have found more for
/// `stuck_after`, the rows may be held back for good (behind a dead letter
/// with `dead_letter.aggregate = "wait"`, or refused and retried without
/// end): a round then holds up to `stuck`, so that the frontier, and with
/// it the deletion of progress rows and the start of every first read,
/// does not stay behind for as long as they wait.
#[derive(Debug, Clone, Copy)]
pub struct HoldLimits {
    pub drain: usize,
    pub stuck: usize,
    pub stuck_after: Duration,
}

impl HoldLimits {
    /// The relay's. Holding 20,000 rows costs a round one INSERT of them,
    /// each later round a look at every held row, and each page of a first
    /// read a comparison with every held row.
    pub const RELAY: HoldLimits = HoldLimits {
        drain: 2_000,
        stuck: 20_000,
        stuck_after: Duration::from_secs(120),
    };

    /// The limit of a round at `now`, when every round since `backlog`
    /// (if any) found more unrecorded rows than it could hold.
    pub fn at(&self, backlog: Option<tokio::time::Instant>, now: tokio::time::Instant) -> usize {
        match backlog {
            Some(since) if now.saturating_duration_since(since) >= self.stuck_after => self.stuck,
            _ => self.drain,
        }
    }
}

/// A snapshot the frontier can move to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capture {
    /// *C*, as text.
    pub snapshot: String,
    /// The highest `relay_seq` visible in *C* (`None`: no rows).
    pub max_seq: Option<i64>,
    /// *M*: the newest progress row when the capture began (0: none).
    pub progress: i64,
    /// Every row named by a progress row up to `progress` is visible in *C*.
    pub settled: bool,
}

/// What a call of [`Ranges::advance`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Advance {
    /// The frontier is the capture now.
    Advanced {
        /// Rows newly held open.
        held: u64,
        /// Held rows closed (recorded or marked since), deleted.
        closed: u64,
        /// Progress rows deleted.
        deleted: u64,
        /// The capture settled: every progress row up to its own could go
        /// (otherwise a long transaction kept it from settling, and only
        /// batches counted visible went).
        settled: bool,
    },
    /// More rows than the limit are visible in the capture and neither
    /// recorded nor marked: the relay is draining. Nothing was written.
    Backlog,
    /// The frontier already saw a transaction the capture did not (it is
    /// older than the frontier). Nothing was written.
    Stale,
}

/// How often the capture looks for a snapshot past its transaction id.
const SETTLE_POLL: Duration = Duration::from_millis(10);

/// The history keeps one frontier per span of this many seconds of the
/// clock (retention's cut-offs): a round rewrites the newest row while it
/// was folded in the current span, and adds one in the next. (Deciding by
/// the newest row's age instead never adds one: every round makes it new.)
const FRONTIER_ROW_SPAN_SECONDS: u32 = 10;

fn query_error(what: &'static str) -> impl Fn(tokio_postgres::Error) -> DbError {
    move |e| DbError::query(what, e)
}

impl Ranges {
    /// The first step of a round; waits at most `settle` for the
    /// transactions running at its start to end.
    pub async fn capture(&self, client: &Client, settle: Duration) -> Result<Capture, DbError> {
        let progress: i64 = client
            .query_one(
                &format!(
                    "SELECT COALESCE(max(id), 0) FROM {}",
                    self.progress.quoted()
                ),
                &[],
            )
            .await
            .map_err(query_error("reading the newest progress row"))?
            .get(0);
        let assigned: String = client
            .query_one("SELECT pg_current_xact_id()::text", &[])
            .await
            .map_err(query_error("taking a transaction id"))?
            .get(0);
        let look = format!(
            "SELECT s::text, pg_snapshot_xmin(s) > $1::text::xid8, (SELECT max({SEQ_COLUMN}) FROM {})
             FROM pg_current_snapshot() s",
            self.outbox.quoted()
        );
        let deadline = tokio::time::Instant::now() + settle;
        loop {
            let row = client
                .query_one(&look, &[&assigned])
                .await
                .map_err(query_error("capturing a snapshot"))?;
            let settled: bool = row.get(1);
            if settled || tokio::time::Instant::now() >= deadline {
                return Ok(Capture {
                    snapshot: row.get(0),
                    max_seq: row.get(2),
                    progress,
                    settled,
                });
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }

    /// The second step of a round: moves the frontier to `target` unless
    /// more than `limit` rows would be held open.
    pub async fn advance(
        &self,
        client: &mut Client,
        target: &Capture,
        limit: i64,
    ) -> Result<Advance, DbError> {
        let tx = client
            .build_transaction()
            .isolation_level(IsolationLevel::RepeatableRead)
            .start()
            .await
            .map_err(query_error("starting a fold"))?;
        let stale: bool = tx
            .query_one(&self.stale_sql(), &[&target.snapshot])
            .await
            .map_err(query_error("comparing the capture with the frontier"))?
            .get(0);
        if stale {
            return Ok(Advance::Stale);
        }
        let finding = query_error("finding the rows the frontier would pass");
        let unrecorded: Vec<i64> = tx
            .query(&self.unrecorded_sql(), &[&target.snapshot, &(limit + 1)])
            .await
            .map_err(&finding)?
            .iter()
            // A NULL relay_seq (a column `check` refuses) fails the round.
            .map(|r| r.try_get(0))
            .collect::<Result<_, _>>()
            .map_err(&finding)?;
        if unrecorded.len() as i64 > limit {
            return Ok(Advance::Backlog);
        }
        let (held, closed) = self.hold(&tx, &unrecorded).await?;
        self.write_frontier(&tx, target).await?;
        let p = self.progress.quoted();
        let deleted = if target.settled {
            tx.execute(
                &format!("DELETE FROM {p} WHERE id <= $1"),
                &[&target.progress],
            )
            .await
            .map_err(query_error("deleting folded progress rows"))?
        } else {
            tx.execute(
                &self.delete_visible_sql(),
                &[&target.progress, &target.snapshot],
            )
            .await
            .map_err(query_error("deleting folded progress rows"))?
        };
        tx.commit()
            .await
            .map_err(query_error("committing a fold"))?;
        Ok(Advance::Advanced {
            held,
            closed,
            deleted,
            settled: target.settled,
        })
    }

    /// Holds `unrecorded` open and closes the held rows recorded or marked
    /// since; returns how many of each.
    async fn hold(&self, tx: &Transaction<'_>, unrecorded: &[i64]) -> Result<(u64, u64), DbError> {
        let h = self.held.quoted();
        let held = tx
            .execute(
                &format!(
                    "INSERT INTO {h} ({SEQ_COLUMN}) SELECT unnest($1::bigint[])
                     ON CONFLICT ({SEQ_COLUMN}) DO UPDATE SET held_at = now()"
                ),
                &[&unrecorded],
            )
            .await
            .map_err(query_error("holding rows open"))?;
        let closed = tx
            .execute(
                &format!(
                    "DELETE FROM {h} h
                     WHERE (COALESCE(h.{SEQ_COLUMN} <@ ({recorded}), false)
                            OR EXISTS (SELECT 1 FROM {t} o WHERE o.{SEQ_COLUMN} = h.{SEQ_COLUMN}
                                       AND o.{SENT_AT_COLUMN} IS NOT NULL))",
                    recorded = self.recorded(),
                    t = self.outbox.quoted(),
                ),
                &[],
            )
            .await
            .map_err(query_error("closing held rows"))?;
        Ok((held, closed))
    }

    /// Makes `target` the frontier: rewrites the newest frontier row, or adds
    /// one when that was folded in an earlier span (or there is none).
    async fn write_frontier(&self, tx: &Transaction<'_>, target: &Capture) -> Result<(), DbError> {
        let (f, p) = (self.frontier.quoted(), self.progress.quoted());
        // Every progress row up to the capture's, deleted in this round or
        // not: `last_publish` takes the greater of this and the rows left.
        let last_recorded = format!("(SELECT max(recorded_at) FROM {p} WHERE id <= $3)");
        let rewritten = tx
            .execute(
                &format!(
                    "UPDATE {f} SET snapshot = $1::text::pg_snapshot,
                                    max_seq = GREATEST(max_seq, $2::bigint),
                                    last_recorded_at = GREATEST(last_recorded_at, {last_recorded}),
                                    folded_at = now()
                     WHERE id = (SELECT max(id) FROM {f})
                       AND floor(extract(epoch FROM folded_at) / {FRONTIER_ROW_SPAN_SECONDS})
                           = floor(extract(epoch FROM now()) / {FRONTIER_ROW_SPAN_SECONDS})"
                ),
                &[&target.snapshot, &target.max_seq, &target.progress],
            )
            .await
            .map_err(query_error("writing the frontier"))?;
        if rewritten == 0 {
            tx.execute(
                &format!(
                    "INSERT INTO {f} (snapshot, max_seq, last_recorded_at)
                     SELECT $1::text::pg_snapshot,
                            COALESCE(GREATEST((SELECT max_seq FROM {f} ORDER BY id DESC LIMIT 1), $2::bigint),
                                     (-9223372036854775808)::bigint),
                            GREATEST((SELECT last_recorded_at FROM {f} ORDER BY id DESC LIMIT 1), {last_recorded})"
                ),
                &[&target.snapshot, &target.max_seq, &target.progress],
            )
            .await
            .map_err(query_error("writing the frontier"))?;
        }
        Ok(())
    }

    /// Deletes the progress rows up to `$1` all of whose rows are visible
    /// in the capture `$2`, for a capture that did not settle (a long
    /// transaction somewhere on the server kept the snapshot's oldest
    /// running transaction back): a progress row's rows must be visible in
    /// the frontier before it goes, and without the settle wait only
    /// counting them says so. A row not yet visible (CDC records a
    /// transaction it decoded a moment before the server shows it) is not
    /// counted, nor is one retention deleted: the progress row stays.
    /// (Distinct: a partitioned outbox's `relay_seq` is unique only with
    /// the partition key.)
    /// The held rows were closed earlier in the round, so none of these
    /// rows is held open.
    fn delete_visible_sql(&self) -> String {
        format!(
            "DELETE FROM {p} p
             WHERE p.id <= $1
               AND (SELECT count(DISTINCT o.{SEQ_COLUMN}) FROM unnest(p.seqs) r, {t} o
                    WHERE o.{SEQ_COLUMN} >= lower(r) AND o.{SEQ_COLUMN} < upper(r)
                      AND pg_visible_in_snapshot(o.{XID_COLUMN}, $2::text::pg_snapshot))
                   = (SELECT sum(upper(r) - lower(r)) FROM unnest(p.seqs) r)",
            p = self.progress.quoted(),
            t = self.outbox.quoted(),
        )
    }

    /// `$1` (a capture) misses a transaction the frontier saw: its `xmax` is
    /// lower, or a transaction it saw running had ended by the frontier.
    fn stale_sql(&self) -> String {
        format!(
            "SELECT COALESCE((
                 SELECT pg_snapshot_xmax($1::text::pg_snapshot) < pg_snapshot_xmax(snapshot)
                     OR EXISTS (SELECT 1 FROM pg_snapshot_xip($1::text::pg_snapshot) x
                                WHERE x < pg_snapshot_xmax(snapshot)
                                  AND x <> ALL (ARRAY(SELECT pg_snapshot_xip(snapshot))))
                 FROM {} ORDER BY id DESC LIMIT 1), false)",
            self.frontier.quoted()
        )
    }

    /// The rows visible in `$1` and not in the frontier that are neither
    /// marked nor recorded, newest transactions first, at most `$2`.
    pub fn unrecorded_sql(&self) -> String {
        format!(
            "WITH f AS MATERIALIZED ({frontier}),
             -- As in the reads: the transactions running at the frontier on
             -- their own, the later ones as a range bounded on both sides,
             -- so that both go through the index on relay_xid.
             running AS MATERIALIZED (
                 SELECT o.{SEQ_COLUMN} AS seq, o.{XID_COLUMN} AS xid FROM {t} o
                 WHERE o.{SENT_AT_COLUMN} IS NULL
                   AND o.{XID_COLUMN} = ANY ((SELECT ARRAY(SELECT pg_snapshot_xip(snapshot)) FROM f)::xid8[])
             ),
             later AS MATERIALIZED (
                 SELECT o.{SEQ_COLUMN} AS seq, o.{XID_COLUMN} AS xid FROM {t} o
                 WHERE o.{SENT_AT_COLUMN} IS NULL
                   AND o.{XID_COLUMN} >= COALESCE((SELECT pg_snapshot_xmax(snapshot) FROM f), '0'::xid8)
                   AND o.{XID_COLUMN} < pg_snapshot_xmax($1::text::pg_snapshot)
             )
             SELECT c.seq FROM (SELECT * FROM running UNION ALL SELECT * FROM later) c
             WHERE pg_visible_in_snapshot(c.xid, $1::text::pg_snapshot)
               AND NOT COALESCE(c.seq <@ ({recorded}), false)
             ORDER BY c.xid DESC LIMIT $2",
            frontier = self.frontier_snapshot(),
            t = self.outbox.quoted(),
            recorded = self.recorded(),
        )
    }
}
