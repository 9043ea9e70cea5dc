//! Recording progress in the outbox table, shared by both ackers: marking
//! confirmed rows, writing dead letters, all on the ownership connection (so
//! an instance that lost ownership records nothing).
//!
//! The ackers see this through [`RowStore`]; [`RowRecorder`] is the
//! PostgreSQL implementation, and the pipeline simulation has an in-memory one.

use super::SourceError;
use crate::config::MarkMode;
use crate::config::TableName;
use crate::db::DbError;
use crate::dead_letter::{DeadLetter, OpenLetters, Recorder, Requests, Written};
use crate::outbox::{MarkStatement, mark_sql};
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::time::Instant;
use tokio_postgres::Client;

/// Where an acker records progress. Every call is one round trip on the
/// session that holds the ownership lock, so each success also proves that
/// this instance still owned the outbox when the call was made.
pub trait RowStore: Send + Sync + 'static {
    /// Waits until the transactions (32-bit ids of recent commits) are
    /// visible to new snapshots, so their rows can be marked.
    fn wait_visible(&self, xids: Vec<u32>) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Marks (or deletes) the rows; nothing when rows are left alone.
    /// Returns how many rows it changed: fewer than asked when some were
    /// marked before or are not visible to the statement yet.
    fn mark(&self, seqs: &[i64]) -> impl Future<Output = Result<u64, SourceError>> + Send;

    /// Writes dead letters and marks their rows in one transaction.
    fn dead_letter<P: Sync>(
        &mut self,
        letters: &[DeadLetter<P>],
    ) -> impl Future<Output = Result<Written, SourceError>> + Send;

    /// Aggregates with open dead letters, and where their first one is.
    fn open_dead_letters(&self) -> impl Future<Output = Result<OpenLetters, SourceError>> + Send;

    /// One round trip on the ownership session.
    fn heartbeat(&self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// From now on, tells `lease` of each round trip above that was
    /// answered, as soon as it was: the session, and so the ownership lock,
    /// was alive when it was sent. A busy acker then needs no heartbeats,
    /// and a long call of many round trips (a wait for visibility) keeps
    /// the lease.
    fn report_answers_to(&self, lease: Arc<dyn Renew>);

    /// Dead letters an operator asked to publish again, oldest first, as
    /// many as take less than `max_bytes` (the first always).
    fn requested_letters(
        &self,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Requests, SourceError>> + Send;

    /// The broker confirmed these redriven letters.
    fn letters_sent(&self, ids: &[i64]) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// The broker refused a redriven letter again (see [`Recorder::refused`]).
    fn letter_refused(
        &self,
        id: i64,
        reason: &str,
        counts: bool,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;
}

/// How many of the 32-bit transaction ids in `$1` the current snapshot
/// still sees as running. Each id is widened to the one within 2^31 of the
/// snapshot's `xmax`: with `xmax`'s epoch, or the epoch before or after
/// when that one is nearer (ids are recent, and a running one may be at or
/// past `xmax`, in the next epoch when `xmax` is near the end of its own).
pub const IN_PROGRESS_SQL: &str = "SELECT count(*)::int8 FROM \
     (SELECT txid_current_snapshot() AS s) q, \
     LATERAL (SELECT ((txid_snapshot_xmax(q.s) >> 32) << 32) | x AS w FROM unnest($1::int8[]) AS x) f \
     WHERE NOT txid_visible_in_snapshot(GREATEST(3, CASE \
     WHEN f.w > txid_snapshot_xmax(q.s) + 2147483648 THEN f.w - 4294967296 \
     WHEN f.w + 2147483648 < txid_snapshot_xmax(q.s) THEN f.w + 4294967296 \
     ELSE f.w END), q.s)";

/// How often a wait for visibility (normally microseconds) is reported.
const VISIBLE_WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(10);
/// After this long the stream is restarted (and the waiting events are sent
/// again once visible): a bound on the wait, not an expected case.
const VISIBLE_GIVE_UP: std::time::Duration = std::time::Duration::from_secs(600);

/// Told of each answered round trip on the ownership session: the
/// ownership lease, which runs from when the latest was sent.
pub trait Renew: Send + Sync + 'static {
    /// A round trip sent at `sent` was answered.
    fn renew(&self, sent: Instant);
}

/// Reports a store's answered round trips to a [`Renew`], once given one
/// (see [`RowStore::report_answers_to`]).
#[derive(Default)]
pub struct Answered(Mutex<Option<Arc<dyn Renew>>>);

impl Answered {
    pub fn report_to(&self, to: Arc<dyn Renew>) {
        *self.0.lock().unwrap_or_else(|e| e.into_inner()) = Some(to);
    }

    /// A round trip sent at `sent` was answered.
    pub fn note(&self, sent: Instant) {
        let to = self.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        if let Some(to) = to {
            to.renew(sent);
        }
    }

    /// Runs `call`, one or more round trips, and notes when it began if it
    /// succeeded (every round trip in it was sent after that).
    pub async fn round_trip<T, E, F: Future<Output = Result<T, E>>>(
        &self,
        call: impl FnOnce() -> F,
    ) -> Result<T, E> {
        let sent = Instant::now();
        let out = call().await;
        if out.is_ok() {
            self.note(sent);
        }
        out
    }
}

pub struct RowRecorder {
    client: Client,
    mark: Option<MarkStatement>,
    dead_letters: Option<Recorder>,
    answered: Answered,
}

impl RowRecorder {
    /// `dead_letters`: the dead-letter table, when dead-lettering is on, and
    /// an SQL condition on its `aggregate_id` selecting this pipeline's shard;
    /// `messages`: `source.cdc.messages` (see [`Recorder::new`]).
    pub async fn new(
        client: Client,
        table: &TableName,
        mark: MarkMode,
        dead_letters: Option<(&TableName, Option<&str>)>,
        messages: bool,
    ) -> Result<Self, SourceError> {
        let mark = match mark_sql(table, mark) {
            Some(sql) => Some(client.prepare(&sql).await.map(|s| MarkStatement::new(s, mark)).map_err(|e| {
                match (mark, e.code().map(|c| c.code())) {
                    (MarkMode::Ranges, Some("42P01")) => SourceError::Setup(format!(
                        "relay.mark = \"ranges\" records sent rows in {}, which does not exist: run outbox-relay migrate",
                        crate::outbox::progress::Ranges::new(table).progress
                    )),
                    _ => DbError::query("preparing the mark-sent statement", e).into(),
                }
            })?),
            None => None,
        };
        let dead_letters = match dead_letters {
            Some((t, shard)) => Some(Recorder::new(&client, t, shard, messages).await.map_err(
                |e| match e.code().map(|c| c.code()) {
                    Some("42P01") => SourceError::Setup(crate::dead_letter::missing_table(t)),
                    Some("42703") => SourceError::Setup(crate::dead_letter::missing_column(
                        t,
                        &crate::db::error_text(&e),
                    )),
                    _ => DbError::query("preparing the dead-letter statements", e).into(),
                },
            )?),
            None => None,
        };
        Ok(RowRecorder {
            client,
            mark,
            dead_letters,
            answered: Answered::default(),
        })
    }
}

impl RowStore for RowRecorder {
    /// Logical decoding can hand a commit over before the committing session
    /// has left the process array, and a row that is not visible yet would
    /// silently not be marked: the wait polls the server's snapshot.
    async fn wait_visible(&self, xids: Vec<u32>) -> Result<(), SourceError> {
        if self.mark.is_none() {
            return Ok(());
        }
        let xids: Vec<i64> = xids
            .into_iter()
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .map(i64::from)
            .collect();
        if xids.is_empty() {
            return Ok(());
        }
        let started = std::time::Instant::now();
        let mut next_warning = VISIBLE_WARN_EVERY;
        let mut pause = std::time::Duration::from_millis(1);
        loop {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&xids];
            let pending: i64 = self
                .answered
                .round_trip(|| self.client.query_one(IN_PROGRESS_SQL, &params))
                .await
                .map_err(|e| DbError::query("checking that streamed transactions are visible", e))?
                .get(0);
            if pending == 0 {
                return Ok(());
            }
            // The events are confirmed already: giving up sends them again,
            // so wait long (reading stays paused behind the acker) and say
            // why: typically a synchronous standby that does not answer.
            if started.elapsed() > VISIBLE_GIVE_UP {
                return Err(SourceError::Stream(format!(
                    "{pending} committed transaction(s) still not visible after {}s; reconnecting",
                    VISIBLE_GIVE_UP.as_secs()
                )));
            }
            if started.elapsed() > next_warning {
                tracing::warn!(
                    transactions = pending,
                    waited_s = started.elapsed().as_secs(),
                    "committed transactions are not visible yet (a synchronous standby not answering?); marking waits"
                );
                next_warning += VISIBLE_WARN_EVERY;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_millis(100));
        }
    }

    async fn mark(&self, seqs: &[i64]) -> Result<u64, SourceError> {
        match &self.mark {
            Some(mark) if !seqs.is_empty() => Ok(self
                .answered
                .round_trip(|| mark.execute(&self.client, seqs))
                .await
                .map_err(|e| DbError::query("marking rows sent", e))?),
            _ => Ok(0),
        }
    }

    async fn dead_letter<P: Sync>(
        &mut self,
        letters: &[DeadLetter<P>],
    ) -> Result<Written, SourceError> {
        let Some(recorder) = &self.dead_letters else {
            return Ok(Written::default());
        };
        let sent = Instant::now();
        let written = recorder
            .write(&mut self.client, letters, self.mark.as_ref())
            .await
            .map_err(|e| DbError::query("writing dead letters", e))?;
        self.answered.note(sent);
        Ok(written)
    }

    async fn open_dead_letters(&self) -> Result<OpenLetters, SourceError> {
        match &self.dead_letters {
            Some(r) => self
                .answered
                .round_trip(|| r.open_aggregates(&self.client))
                .await
                .map_err(|e| DbError::query("reading open dead letters", e).into()),
            None => Ok(OpenLetters::new()),
        }
    }

    async fn heartbeat(&self) -> Result<(), SourceError> {
        self.answered
            .round_trip(|| self.client.simple_query("SELECT 1"))
            .await
            .map_err(|e| DbError::query("checking the ownership connection", e))?;
        Ok(())
    }

    async fn requested_letters(&self, max_bytes: usize) -> Result<Requests, SourceError> {
        match &self.dead_letters {
            Some(r) => self
                .answered
                .round_trip(|| r.requested(&self.client, max_bytes))
                .await
                .map_err(|e| DbError::query("reading requested redrives", e).into()),
            None => Ok(Requests::default()),
        }
    }

    async fn letters_sent(&self, ids: &[i64]) -> Result<(), SourceError> {
        if let Some(r) = &self.dead_letters {
            let dropped = self
                .answered
                .round_trip(|| r.sent(&self.client, ids))
                .await
                .map_err(|e| DbError::query("recording redriven dead letters", e))?;
            if !dropped.is_empty() {
                tracing::warn!(
                    dead_letter_ids = ?dropped,
                    "dead letters dropped by an operator while the relay published them were \
                     confirmed by the broker: they are marked redriven"
                );
            }
        }
        Ok(())
    }

    async fn letter_refused(&self, id: i64, reason: &str, counts: bool) -> Result<(), SourceError> {
        if let Some(r) = &self.dead_letters {
            self.answered
                .round_trip(|| r.refused(&self.client, id, reason, counts))
                .await
                .map_err(|e| DbError::query("recording a refused redrive", e))?;
        }
        Ok(())
    }

    fn report_answers_to(&self, lease: Arc<dyn Renew>) {
        self.answered.report_to(lease);
    }
}
