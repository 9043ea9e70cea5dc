//! The polling source: reads unsent rows with SQL, in commit-consistent batches.
//!
//! # Why not a cursor on the id or sequence
//!
//! Sequence values are taken at INSERT, but rows become visible at COMMIT, in
//! another order: a reader that remembers "the highest `relay_seq` seen" skips
//! a row whose transaction took a lower value and committed later. Instead
//! the reader works in *ticks*, each bounded by two snapshots of the
//! transaction state (`pg_current_snapshot()`):
//!
//! - tick *k* covers exactly the rows whose inserting transaction
//!   (`relay_xid`) is visible in snapshot *S(k)* and was not in *S(k-1)*, i.e.
//!   the transactions that committed between the two snapshots. Every
//!   committed transaction falls in exactly one tick, however long it ran and
//!   whatever its xid; a rolled-back one is never visible at all.
//! - within a tick, rows are read in `relay_seq` order, paged by a cursor (the
//!   set is fixed once *S(k)* is taken, so paging cannot skip anything).
//!
//! # The ordering guarantee
//!
//! When the application serialises the writes of one aggregate (the usual
//! `SELECT ... FOR UPDATE` or UPDATE of the aggregate's row before inserting
//! the event), a later event of the aggregate takes its `relay_seq` after the
//! earlier one committed. So the earlier event is in the same tick with a lower
//! `relay_seq`, or in an earlier tick: the reader yields each aggregate's
//! events in commit order. Without that serialisation, events of one
//! aggregate from concurrent transactions have no commit order to keep; the
//! reader then yields them by tick, then by `relay_seq`.
//!
//! The first tick after a start or a [`Reader::rewind`] has no previous
//! snapshot and reads every unsent row. A tick that ends starts the next
//! after [`between_ticks`]: soon after one that found rows, up to
//! `poll_interval` after empty ones, or at once on the insert trigger's
//! NOTIFY when `notify` is on (off by default: it serialises the
//! application's commits).

use super::record::{RowRecorder, RowStore};
use super::rows::{Paging, read_row, select_list};
use super::{Acker, Reader, SourceError, SourcedEvent};
use crate::config::PollingConfig;
use crate::config::{ResolvedColumns, SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
use crate::db::DbError;
use crate::dead_letter::DeadLetter;
use crate::outbox::RawRow;
use crate::outbox::Shard;
use crate::outbox::progress::read::Stragglers;
use crate::sql::quote_ident;
use chrono::Utc;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

/// The default NOTIFY channel for a table.
pub fn default_channel(table: &TableName) -> String {
    table.derived("outbox_relay")
}

/// The channel a polling config listens on, when wake-ups are on.
pub fn notify_channel(config: &PollingConfig, table: &TableName) -> Option<String> {
    config.notify.then(|| {
        config
            .notify_channel
            .clone()
            .unwrap_or_else(|| default_channel(table))
    })
}

pub struct PollingReader {
    client: Client,
    wakeups: Arc<Notify>,
    /// Starts a tick: returns the snapshot and the first page.
    first_page: Statement,
    /// Continues a tick from the cursor.
    next_page: Statement,
    /// With `relay.mark = "ranges"`: what a tick's pages share besides the
    /// snapshots (`outbox::progress::read`).
    ranges: Option<RangesTick>,
    poll_interval: Duration,
    /// The previous tick's snapshot; `None` reads every unsent row.
    prev: Option<String>,
    /// The snapshot of the tick being paged through.
    cur: Option<String>,
    cursor: i64,
    /// The last tick ended: wait for a wake-up or `next_poll`.
    idle: bool,
    next_poll: Instant,
    /// Ticks in a row that found nothing.
    quiet: u32,
    paging: Paging,
}

/// A tick's state when sent rows are recorded by ranges: the highest
/// `relay_seq` visible in the previous tick's snapshot and in this one's,
/// and what the first page resolved for the next ones.
#[derive(Debug, Default)]
struct RangesTick {
    prev_max: Option<i64>,
    cur_max: Option<i64>,
    base_max: i64,
    stragglers: Stragglers,
}

/// What a ranges tick's first page says besides the rows.
type RangesHead = (Option<i64>, i64, Vec<i64>);

/// The wait after a tick that found rows: more are likely on their way.
const SOON: Duration = Duration::from_millis(10);

/// The wait before the next tick: [`SOON`] after one that found rows, then
/// twice as long after each one that found none, up to `poll_interval`. A
/// steady flow is read every 10 ms or so, in batches; an idle table costs a
/// query per `poll_interval`.
fn between_ticks(quiet: u32, poll_interval: Duration) -> Duration {
    SOON.saturating_mul(1 << quiet.min(20)).min(poll_interval)
}

impl PollingReader {
    pub async fn connect(
        db: &crate::config::DatabaseConfig,
        table: &TableName,
        columns: &ResolvedColumns,
        polling: &PollingConfig,
        shard: Shard,
        mark: crate::config::MarkMode,
    ) -> Result<Self, SourceError> {
        let wakeups = Arc::new(Notify::new());
        let client = crate::db::connect(db, Some(wakeups.clone())).await?;
        if let Some(channel) = notify_channel(polling, table) {
            client
                .batch_execute(&format!("LISTEN {}", quote_ident(&channel)))
                .await
                .map_err(|e| DbError::query("LISTEN for new-row notifications", e))?;
        }
        let ranges = mark == crate::config::MarkMode::Ranges;
        if ranges {
            client
                .batch_execute(crate::outbox::progress::read::READER_SESSION)
                .await
                .map_err(|e| DbError::query("setting the planner up for ranges", e))?;
        }
        let (first_page, next_page) = statements(table, columns, shard, ranges);
        let missing = ranges.then(|| crate::outbox::progress::Ranges::new(table));
        let prepare = |sql: String| {
            let (client, missing) = (&client, &missing);
            async move {
                client.prepare(&sql).await.map_err(|e| {
                    match missing.as_ref().and_then(|r| r.missing_table_problem(&e)) {
                        Some(problem) => SourceError::Setup(problem),
                        None => DbError::query("preparing the outbox query", e).into(),
                    }
                })
            }
        };
        Ok(PollingReader {
            first_page: prepare(first_page).await?,
            next_page: prepare(next_page).await?,
            client,
            wakeups,
            ranges: ranges.then(RangesTick::default),
            poll_interval: polling.poll_interval,
            prev: None,
            cur: None,
            cursor: 0,
            idle: false,
            next_poll: Instant::now(),
            quiet: 0,
            paging: Paging::default(),
        })
    }

    /// Reads the next page of the tick: returns the tick's snapshot, the
    /// rows, and whether more rows may follow in this tick. A ranges page
    /// that found none of its window of stragglers unsent moves on to the
    /// next window.
    async fn page(&mut self, max: usize, max_bytes: usize) -> Result<Page, SourceError> {
        loop {
            let page = self.page_once(max, max_bytes).await?;
            match page.window_end {
                Some(upper) if page.rows.is_empty() => self.cursor = upper,
                _ => return Ok(page),
            }
        }
    }

    /// Runs one page query.
    async fn page_once(&mut self, max: usize, max_bytes: usize) -> Result<Page, SourceError> {
        let want = self.paging.limit(max, max_bytes);
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        let window = match (&self.cur, &self.ranges) {
            (Some(_), Some(r)) => Some(r.stragglers.window(self.cursor, want)),
            _ => None,
        };
        let (stragglers, upper) = window.map_or((&[][..], i64::MAX), |w| (w.stragglers, w.upper));
        // The first page's rows start after the tick's snapshot, which every
        // row carries (one row of NULLs after it when there are none); by
        // ranges, only the first row carries the head (snapshot, highest
        // `relay_seq`s, stragglers) and the others NULLs there.
        let (statement, offset, params): (_, _, Vec<&(dyn ToSql + Sync)>) =
            match (&self.cur, &self.ranges) {
                (None, None) => (&self.first_page, 1, vec![&self.prev, &limit]),
                (Some(cur), None) => (
                    &self.next_page,
                    0,
                    vec![&self.cursor, cur, &self.prev, &limit],
                ),
                (None, Some(r)) => (&self.first_page, 4, vec![&self.prev, &r.prev_max, &limit]),
                (Some(cur), Some(r)) => (
                    &self.next_page,
                    0,
                    vec![
                        &self.cursor,
                        cur,
                        &self.prev,
                        &r.base_max,
                        &stragglers,
                        &limit,
                        &upper,
                    ],
                ),
            };
        let mut snapshot: Option<String> = None;
        let mut head: Option<RangesHead> = None;
        let paged = self
            .paging
            .read(
                &self.client,
                statement,
                &params,
                want,
                max_bytes,
                |row| {
                    if snapshot.is_none() {
                        snapshot = Some(if offset > 0 {
                            row.get(0)
                        } else {
                            String::new()
                        });
                        if offset == 4 {
                            head = Some((row.get(1), row.get(2), row.get(3)));
                        }
                    }
                    read_row(row, offset)
                },
                |(_, raw)| super::rows::row_bytes(raw),
            )
            .await
            .map_err(|e| DbError::query("reading unsent outbox rows", e))?;
        let window_end = window.filter(|w| w.truncated).map(|w| w.upper);
        Ok(Page {
            full: paged.full || window_end.is_some(),
            rows: paged.rows,
            snapshot: self.cur.clone().or(snapshot).unwrap_or_default(),
            head,
            window_end,
        })
    }
}

/// A tick's two statements, first page and next: with `ranges`, those of
/// `outbox::progress::read`, else by `relay_sent_at IS NULL`.
fn statements(
    table: &TableName,
    columns: &ResolvedColumns,
    shard: Shard,
    ranges: bool,
) -> (String, String) {
    let t = table.quoted();
    let cols = select_list(columns);
    let shard = shard
        .condition(&quote_ident(&columns.aggregate_id))
        .map(|c| format!(" AND {c}"))
        .unwrap_or_default();
    if ranges {
        let sql = crate::outbox::progress::Ranges::new(table).read_sql(&cols, &shard);
        return (sql.first_page, sql.next_page);
    }
    let first = format!(
        "SELECT {cols} FROM {t}
         WHERE {SENT_AT_COLUMN} IS NULL{shard}
           AND ($1::text IS NULL OR NOT pg_visible_in_snapshot({XID_COLUMN}, $1::text::pg_snapshot))
         ORDER BY {SEQ_COLUMN} LIMIT $2"
    );
    let first_page = format!(
        "WITH snap AS (SELECT pg_current_snapshot() AS cur)
         SELECT snap.cur::text, e.* FROM snap LEFT JOIN LATERAL ({first}) e ON true"
    );
    let next_page = format!(
        "SELECT {cols} FROM {t}
         WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} > $1{shard}
           AND pg_visible_in_snapshot({XID_COLUMN}, $2::text::pg_snapshot)
           AND ($3::text IS NULL OR NOT pg_visible_in_snapshot({XID_COLUMN}, $3::text::pg_snapshot))
         ORDER BY {SEQ_COLUMN} LIMIT $4"
    );
    (first_page, next_page)
}

/// One page of a tick.
struct Page {
    snapshot: String,
    rows: Vec<(i64, RawRow)>,
    full: bool,
    /// A ranges tick's first page: *cur*'s highest `relay_seq`, the base's,
    /// the stragglers.
    head: Option<RangesHead>,
    /// A ranges page sent a window of the stragglers with more after it:
    /// the window's end, up to which the page read every unsent row.
    window_end: Option<i64>,
}

impl Reader for PollingReader {
    type Position = i64;

    async fn next_batch(
        &mut self,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<SourcedEvent<i64>>, SourceError> {
        let max = max.max(1);
        loop {
            if self.cur.is_none() && self.idle {
                tokio::select! {
                    _ = self.wakeups.notified() => {}
                    _ = tokio::time::sleep_until(self.next_poll) => {}
                }
                self.idle = false;
            }
            if self.client.is_closed() {
                return Err(DbError::Connect {
                    target: "the outbox database".into(),
                    message: "the reading connection was closed".into(),
                    kind: crate::errors::ErrorKind::Transient,
                    source: None,
                }
                .into());
            }
            let Page {
                snapshot,
                rows,
                full,
                head,
                ..
            } = self.page(max, max_bytes).await?;
            // No await below: the state moves in one step, keeping the call cancel-safe.
            if self.cur.is_none() {
                self.cur = Some(snapshot);
                if let (Some(r), Some((cur_max, base_max, stragglers))) = (&mut self.ranges, head) {
                    (r.cur_max, r.base_max) = (cur_max, base_max);
                    r.stragglers = Stragglers::new(stragglers);
                }
            }
            if let Some((seq, _)) = rows.last() {
                self.cursor = *seq;
            }
            if !full {
                self.prev = self.cur.take();
                if let Some(r) = &mut self.ranges {
                    r.prev_max = r.cur_max;
                }
                self.cursor = 0;
                self.quiet = if rows.is_empty() {
                    self.quiet.saturating_add(1)
                } else {
                    0
                };
                self.idle = true;
                self.next_poll = Instant::now() + between_ticks(self.quiet, self.poll_interval);
            }
            if !rows.is_empty() {
                let now = Utc::now();
                return Ok(rows
                    .into_iter()
                    .map(|(seq, raw)| SourcedEvent::new(seq, raw.decode(now)))
                    .collect());
            }
        }
    }

    fn rewind(&mut self) {
        self.prev = None;
        if let Some(r) = &mut self.ranges {
            r.prev_max = None;
        }
        self.cur = None;
        self.cursor = 0;
        self.idle = false;
    }
}

/// Marks confirmed rows, one statement per batch, on the connection that
/// holds the ownership lock: if that connection is lost, so is the lock, and
/// this acker can no longer mark anything (fencing).
pub struct PollingAcker<S = RowRecorder> {
    recorder: S,
}

impl<S: RowStore> PollingAcker<S> {
    pub fn new(recorder: S) -> Self {
        PollingAcker { recorder }
    }
}

impl<S: RowStore> Acker for PollingAcker<S> {
    type Position = i64;
    type Store = S;

    fn store(&self) -> &S {
        &self.recorder
    }

    /// The rows were read through a snapshot, so they are visible.
    async fn ack(&mut self, positions: Vec<i64>) -> Result<(), SourceError> {
        self.recorder.mark(&positions).await.map(drop)
    }

    async fn dead_letter(
        &mut self,
        letters: Vec<DeadLetter<i64>>,
    ) -> Result<HashSet<String>, SourceError> {
        Ok(self.recorder.dead_letter(&letters).await?.resolved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_come_soon_after_rows_and_back_off_to_the_interval() {
        let interval = Duration::from_millis(50);
        let waits: Vec<u128> = (0..5)
            .map(|quiet| between_ticks(quiet, interval).as_millis())
            .collect();
        assert_eq!(waits, [10, 20, 40, 50, 50]);
        assert_eq!(
            between_ticks(u32::MAX, Duration::from_secs(3600)),
            Duration::from_secs(3600)
        );
        // An interval under SOON is kept.
        assert_eq!(
            between_ticks(0, Duration::from_millis(5)),
            Duration::from_millis(5)
        );
    }
}
