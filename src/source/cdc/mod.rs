//! The CDC source: tails the write-ahead log through a logical replication
//! slot (pgoutput), so events are read within milliseconds of their commit,
//! in commit order, without polling queries.
//!
//! # Start-up
//!
//! 1. Check `wal_level`, the publication, the slot (creating it when
//!    missing); a lost slot is a specific error with its recovery.
//! 2. When rows are marked (`relay.mark` is `update` or `delete`), read the
//!    unsent rows from the table in one REPEATABLE READ snapshot, in
//!    `relay_seq` order. This publishes rows written before the slot existed,
//!    rows a refused event held back, and recovers from a dropped slot.
//!    Transactions whose rows this read produced are skipped when the stream
//!    replays them (matched by xid, until the stream passes the WAL position
//!    taken with the snapshot). Meanwhile the slot is moved past the WAL
//!    the read accounts for ([`snapshot`]), so that after a backlog the
//!    server does not decode it all again before new commits reach the
//!    stream.
//! 3. A read that found many rows (or finished before the slot's move) is
//!    followed by another, in a new snapshot, of the rows that the previous
//!    snapshot could not see: the events committed meanwhile, which the
//!    stream would otherwise reach only after decoding all the WAL written
//!    during the read (its marking `UPDATE`s included). Each new read lets
//!    the slot be moved on again in fast-forward, so the stream opens close
//!    to the end of the WAL. See [`TableRead`].
//! 4. Stream from the slot's confirmed position.
//!
//! # Acknowledgement
//!
//! See [`progress`]: the flushed position reported to PostgreSQL never passes
//! an event the broker has not confirmed (and, when marking, that is not
//! marked). Status updates go out at least every
//! min(`source.cdc.status_interval`, `wal_sender_timeout`/2), also while the
//! relay applies backpressure by not reading the stream.

mod acker;
pub mod message;
pub mod progress;
pub mod server;
pub mod setup;
pub mod snapshot;
mod stream;

pub use acker::CdcAcker;
pub use progress::{CdcPosition, Progress};
pub use server::{CdcServer, CdcStream, PgServer, StreamMessage, TableRow, Timing};
pub use stream::SharedProgress;

use super::{Reader, SourceError, SourcedEvent};
use crate::config::{Config, MarkMode};
use crate::config::{ResolvedColumns, TableName};
use crate::replication::Lsn;
use crate::telemetry::events::{InternalEvent, SlotAdvanced, StreamClosed};
use progress::CATCH_UP;
use snapshot::{Snapshot, StartupView};
use std::time::Duration;
use stream::{Step, Streaming, lock};
use tokio::time::Instant;

/// How often a busy slot is looked at again, and how often that is logged.
const SLOT_BUSY_POLL: std::time::Duration = std::time::Duration::from_millis(250);
const SLOT_BUSY_REMINDER: std::time::Duration = std::time::Duration::from_secs(30);

/// Confirmed-but-unflushed events remembered for skipping after a restart.
pub const SKIP_MEMORY: usize = 100_000;

/// A start-up read that handed over at least this many rows is followed by
/// another (see [`TableRead`]).
pub const REREAD_ROWS: u64 = 1_000;

/// Reads after the first, at most: a writer faster than the relay never
/// lets a read come out small, and the stream takes over after these.
const MAX_REREADS: u32 = 100;

/// Pause before a small read that only waits out the slot's move.
const REREAD_PAUSE: Duration = Duration::from_millis(20);

/// CDC settings resolved from the configuration.
#[derive(Debug, Clone)]
pub struct CdcSettings {
    pub slot: String,
    pub publication: String,
    pub create_slot: bool,
    /// Create the slot as a failover slot.
    pub failover: bool,
    pub status_interval: Duration,
    pub heartbeat_interval: Option<Duration>,
    /// Rows are marked, so unsent rows can be read from the table at start-up.
    pub read_table: bool,
    /// A lost slot is dropped and created again (`source.cdc.on_lost_slot`).
    pub recreate_lost_slot: bool,
    /// The pipeline's name, for metrics.
    pub pipeline: String,
    /// The dead-letter table, when dead-lettering is on.
    pub dead_letters: Option<TableName>,
    /// The prefix of the logical messages that are events (`source.cdc.messages`).
    pub messages: Option<String>,
    /// Report the flushed position once this many events were confirmed
    /// since the last report (the in-flight window): without marking, what
    /// a crash sends again is what the slot was not told.
    pub report_every: u64,
    /// A start-up read that handed over this many rows is repeated
    /// ([`REREAD_ROWS`]).
    pub reread_rows: u64,
}

impl CdcSettings {
    pub fn from_config(config: &Config) -> Self {
        let cdc = &config.source.cdc;
        let table = &config.outbox.table;
        CdcSettings {
            slot: cdc.slot_name(table),
            publication: cdc.publication_name(table),
            create_slot: cdc.create_slot,
            failover: cdc.failover,
            status_interval: cdc.status_interval,
            heartbeat_interval: cdc.heartbeat_interval,
            read_table: config.relay.mark != MarkMode::None,
            recreate_lost_slot: cdc.recreates_lost_slot(config.relay.mark),
            pipeline: config.name.clone(),
            dead_letters: config
                .dead_letter
                .enabled
                .then(|| config.dead_letter.table_name(table)),
            messages: cdc.message_prefix(table),
            report_every: config.relay.max_in_flight as u64,
            reread_rows: REREAD_ROWS,
        }
    }
}

/// The start-up read, in one or more rounds.
///
/// Each round reads, in `relay_seq` order, the unsent rows of one snapshot.
/// A round after the first skips the rows whose transaction the previous
/// round's snapshot saw committed: that round read them (they were unsent
/// then, being unsent now), and they may still be on their way to the
/// broker. What is left are the events committed during the previous round.
///
/// All rounds feed one pseudo-transaction ([`CATCH_UP`]) of the progress,
/// which ends after the last round; the stream then skips what the last
/// snapshot saw (snapshots only grow, so it saw all the earlier ones did).
///
/// Without more rounds, the events committed during a long read would reach
/// the relay only through the stream, after the server decoded all the WAL
/// written meanwhile: the relay's own marking of the backlog included, a
/// million row changes after a million-event backlog, which takes seconds.
/// Each round instead lets the slot be moved past that WAL in fast-forward,
/// which does not decode row changes.
struct TableRead {
    cursor: i64,
    /// Rows handed over, over all rounds.
    rows: u64,
    /// Rows handed over by this round.
    round_rows: u64,
    /// Rounds after the first.
    rereads: u32,
    view: StartupView,
    /// The previous round's snapshot: rows it saw were read then.
    seen: Option<Snapshot>,
    /// The slot being moved to a view's settled position.
    advance: Option<Advance>,
}

/// The slot's move, running beside the start-up read; stopped when dropped
/// (a rewind or a crash: the server finishes it, and the next start waits
/// for the slot as for any busy one).
struct Advance {
    from: Lsn,
    task: tokio::task::JoinHandle<Result<Lsn, SourceError>>,
}

impl Drop for Advance {
    fn drop(&mut self) {
        self.task.abort();
    }
}

enum Phase<S> {
    Start,
    TableRead(TableRead),
    Streaming(Box<Streaming<S>>),
}

/// The CDC source: checks and slot, the start-up read, then the stream.
pub struct CdcReader<B: CdcServer = PgServer> {
    server: B,
    table: TableName,
    columns: ResolvedColumns,
    settings: CdcSettings,
    progress: SharedProgress,
    phase: Phase<B::Stream>,
    /// Read, not yet handed over (kept across a cancelled call).
    pending: Vec<SourcedEvent<CdcPosition>>,
    /// The payload bytes of `pending`.
    pending_bytes: usize,
    timing: Timing,
    next_heartbeat: Option<Instant>,
}

impl CdcReader<PgServer> {
    pub async fn connect(
        config: &Config,
        columns: &ResolvedColumns,
        progress: SharedProgress,
    ) -> Result<Self, SourceError> {
        let settings = CdcSettings::from_config(config);
        let (server, timing) = PgServer::connect(
            &config.database,
            &config.outbox.table,
            columns,
            settings.clone(),
        )
        .await?;
        Ok(CdcReader::new(
            server,
            &config.outbox.table,
            columns,
            settings,
            progress,
            timing,
        ))
    }
}

impl<B: CdcServer> CdcReader<B> {
    pub fn new(
        server: B,
        table: &TableName,
        columns: &ResolvedColumns,
        settings: CdcSettings,
        progress: SharedProgress,
        timing: Timing,
    ) -> Self {
        CdcReader {
            server,
            table: table.clone(),
            columns: columns.clone(),
            next_heartbeat: settings.heartbeat_interval.map(|h| Instant::now() + h),
            settings,
            progress,
            phase: Phase::Start,
            pending: Vec::new(),
            pending_bytes: 0,
            timing,
        }
    }

    /// Checks and the slot's position. A slot still streaming to another
    /// process (a previous owner on its way out) is waited for here, with
    /// ownership held: letting go and retrying would let that owner, or any
    /// other instance, take ownership back meanwhile.
    async fn prepare(&mut self) -> Result<Lsn, SourceError> {
        let mut last_said: Option<tokio::time::Instant> = None;
        loop {
            match self.server.prepare().await {
                Err(SourceError::SlotBusy(slot)) => {
                    let now = tokio::time::Instant::now();
                    if last_said.is_none_or(|t| now - t >= SLOT_BUSY_REMINDER) {
                        tracing::warn!(
                            slot = %slot,
                            "the replication slot is in use by another process; waiting for it to be released"
                        );
                        last_said = Some(now);
                    }
                    tokio::time::sleep(SLOT_BUSY_POLL).await;
                }
                other => return other,
            }
        }
    }

    /// Runs the setup checks and opens the slot now rather than at the first
    /// read, so that a missing publication or slot is reported before the
    /// relay says it is active.
    pub async fn begin(&mut self) -> Result<(), SourceError> {
        if matches!(self.phase, Phase::Start) {
            self.start().await?;
        }
        Ok(())
    }

    /// Checks, slot, and the choice of the first phase.
    async fn start(&mut self) -> Result<(), SourceError> {
        let slot_flushed = self.prepare().await?;
        lock(&self.progress).restart(slot_flushed);
        if !self.settings.read_table || self.settings.messages.is_some() {
            // Without marking, the WAL is replayed from the slot (and so are
            // logical messages, which no table holds): events already
            // dead-lettered there are not handled again.
            let from = lock(&self.progress).flushed();
            let done = self.server.dead_lettered_since(from).await?;
            lock(&self.progress).remember(&done);
        }
        if self.settings.read_table {
            let view = self.server.begin_table_read().await?;
            lock(&self.progress).begin(CATCH_UP);
            self.phase = Phase::TableRead(TableRead {
                cursor: 0,
                rows: 0,
                round_rows: 0,
                rereads: 0,
                view,
                seen: None,
                advance: None,
            });
            self.advance_to_settled();
        } else {
            self.phase = Phase::Streaming(Box::new(self.open_stream(None).await?));
        }
        Ok(())
    }

    fn take_pending(&mut self) -> Vec<SourcedEvent<CdcPosition>> {
        self.pending_bytes = 0;
        std::mem::take(&mut self.pending)
    }

    /// One page of the start-up read; after a round's last page, the next
    /// round or the stream.
    async fn table_page(&mut self, max: usize, max_bytes: usize) -> Result<(), SourceError> {
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        let rows = self.server.table_page(read.cursor, max, max_bytes).await?;
        let now = chrono::Utc::now();
        let done = rows.is_empty();
        for row in rows {
            read.cursor = row.seq;
            if read.seen.as_ref().is_some_and(|s| s.saw_committed(row.xid)) {
                continue; // read by the previous round
            }
            read.rows += 1;
            read.round_rows += 1;
            let position = CdcPosition {
                commit_lsn: CATCH_UP,
                index: u64::try_from(row.seq).unwrap_or_default(),
                seq: Some(row.seq),
                xid: None, // read from a snapshot: visible
            };
            if lock(&self.progress).event(&position) {
                let event = SourcedEvent::new(position, row.raw.decode(now));
                self.pending_bytes += event.bytes();
                self.pending.push(event);
            }
        }
        if done {
            self.end_round().await?;
        }
        Ok(())
    }

    /// After a round's last page: another round, or the stream.
    async fn end_round(&mut self) -> Result<(), SourceError> {
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        let moving = read.advance.as_ref().is_some_and(|a| !a.task.is_finished());
        let large = read.round_rows >= self.settings.reread_rows;
        let again = (large || moving)
            && read.rereads < MAX_REREADS
            && read.view.settled.is_some()
            && self.settings.messages.is_none();
        if again {
            if !large {
                tokio::time::sleep(REREAD_PAUSE).await;
            }
            return self.next_round().await;
        }
        self.finish_advance().await;
        // The WAL since the last move was not decoded yet either.
        self.advance_to_settled();
        self.finish_advance().await;
        self.server.end_table_read().await?;
        let flushed = {
            let mut p = lock(&self.progress);
            let f = p.flushed();
            p.commit(f);
            f
        };
        let Phase::TableRead(read) = std::mem::replace(&mut self.phase, Phase::Start) else {
            return Ok(());
        };
        tracing::info!(
            rows = read.rows,
            reads = read.rereads + 1,
            "start-up read of unsent rows done"
        );
        let skip = Some(StartupView {
            until: read.view.until.max(flushed),
            ..read.view
        });
        self.phase = Phase::Streaming(Box::new(self.open_stream(skip).await?));
        Ok(())
    }

    /// A new snapshot for the events committed during the previous round.
    async fn next_round(&mut self) -> Result<(), SourceError> {
        let view = self.server.begin_table_read().await?;
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        let previous = std::mem::replace(&mut read.view, view);
        read.seen = Some(previous.snapshot);
        read.cursor = 0;
        read.round_rows = 0;
        read.rereads += 1;
        tracing::debug!(
            reads = read.rereads + 1,
            "reading the rows committed during the start-up read"
        );
        if read.advance.as_ref().is_some_and(|a| a.task.is_finished()) {
            self.finish_advance().await;
        }
        self.advance_to_settled();
        Ok(())
    }

    /// Starts moving the slot to the current view's settled position,
    /// unless a move is under way or there is nothing to pass.
    fn advance_to_settled(&mut self) {
        let Phase::TableRead(read) = &mut self.phase else {
            return;
        };
        let from = lock(&self.progress).flushed();
        if read.advance.is_some() || self.settings.messages.is_some() {
            // Logical messages live in the WAL alone: the slot must not skip any.
            return;
        }
        read.advance = read.view.settled.filter(|to| *to > from).map(|to| Advance {
            from,
            task: tokio::spawn(self.server.advance_slot(to)),
        });
    }

    /// Waits for the slot's move, if one runs, and takes its result.
    async fn finish_advance(&mut self) {
        let Phase::TableRead(read) = &mut self.phase else {
            return;
        };
        let Some(advance) = &mut read.advance else {
            return;
        };
        // Kept until it ends, so a cancelled call waits for it again.
        let result = (&mut advance.task).await;
        let from = advance.from;
        read.advance = None;
        match result {
            Ok(Ok(to)) => {
                lock(&self.progress).skipped_to(to);
                SlotAdvanced::Moved {
                    slot: &self.settings.slot,
                    from: &from,
                    to: &to,
                }
                .emit();
            }
            Ok(Err(e)) => SlotAdvanced::Refused { error: &e }.emit(),
            Err(e) => SlotAdvanced::Stopped { error: &e }.emit(),
        }
    }

    /// Starts streaming from the flushed position.
    async fn open_stream(
        &mut self,
        skip: Option<StartupView>,
    ) -> Result<Streaming<B::Stream>, SourceError> {
        let start = lock(&self.progress).flushed();
        let stream = self.server.stream(start).await?;
        Ok(Streaming::new(
            stream,
            skip,
            start,
            self.settings.read_table,
            self.settings.messages.clone(),
        ))
    }

    /// One wake-up of the stream: a message handled, a status sent or a
    /// heartbeat written. True when a committed transaction left events to
    /// hand over.
    async fn stream_step(&mut self) -> Result<bool, SourceError> {
        let Phase::Streaming(s) = &mut self.phase else {
            return Ok(false);
        };
        let silence = s.last_message.max(s.paused_at) + self.timing.silence_limit;
        // Confirmations waiting for a report are looked at now and then.
        let report_check =
            (lock(&self.progress).unreported() > 0).then(|| Instant::now() + REPORT_CHECK);
        // Messages first: after a pause they are waiting unread.
        let wake = tokio::select! {
            biased;
            message = s.stream.next() => Wake::Message(message),
            _ = tokio::time::sleep_until(s.next_status) => Wake::Status,
            _ = sleep_until_opt(report_check) => Wake::Report,
            _ = tokio::time::sleep_until(silence) => Wake::Silence,
            _ = sleep_until_opt(self.next_heartbeat) => Wake::Heartbeat,
        };
        match wake {
            Wake::Message(message) => {
                let Some(message) = message? else {
                    return Err(SourceError::Stream(
                        "the server ended the replication stream".into(),
                    ));
                };
                let before = self.pending.len();
                let (reply, step) = s.handle(
                    message,
                    &self.table,
                    &self.columns,
                    &self.progress,
                    &mut self.pending,
                )?;
                self.pending_bytes += self.pending[before..]
                    .iter()
                    .map(SourcedEvent::bytes)
                    .sum::<usize>();
                // A busy stream still reports on time (the select
                // prefers messages).
                if reply
                    || Instant::now() >= s.next_status
                    || report_due(&self.progress, self.settings.report_every)
                {
                    s.send_status(&self.progress, self.timing.status_every)
                        .await?;
                }
                if matches!(step, Step::Committed) && !self.pending.is_empty() {
                    return Ok(true);
                }
            }
            Wake::Status => {
                s.send_status(&self.progress, self.timing.status_every)
                    .await?
            }
            Wake::Report => {
                if report_due(&self.progress, self.settings.report_every) {
                    s.send_status(&self.progress, self.timing.status_every)
                        .await?;
                }
            }
            Wake::Silence => {
                return Err(SourceError::Stream(format!(
                    "no message from the server for {}s; reconnecting",
                    self.timing.silence_limit.as_secs()
                )));
            }
            Wake::Heartbeat => self.heartbeat().await?,
        }
        Ok(false)
    }

    async fn heartbeat(&mut self) -> Result<(), SourceError> {
        if let Some(every) = self.settings.heartbeat_interval {
            self.server.heartbeat().await?;
            self.next_heartbeat = Some(Instant::now() + every);
        }
        Ok(())
    }
}

/// Enough confirmations since the last report to send one now.
fn report_due(progress: &SharedProgress, every: u64) -> bool {
    lock(progress).unreported() >= every
}

/// How often a paused reader looks whether confirmations are due for a report.
const REPORT_CHECK: Duration = Duration::from_millis(100);

enum Wake<M> {
    Message(M),
    Status,
    /// Time to look whether confirmations are due for a report.
    Report,
    Silence,
    Heartbeat,
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

impl<B: CdcServer> Reader for CdcReader<B> {
    type Position = CdcPosition;

    async fn next_batch(
        &mut self,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<SourcedEvent<CdcPosition>>, SourceError> {
        let max = max.max(1);
        loop {
            if self.pending.len() >= max || self.pending_bytes >= max_bytes {
                return Ok(self.take_pending());
            }
            match &mut self.phase {
                Phase::Start => self.start().await?,
                Phase::TableRead(_) => {
                    let room = max_bytes.saturating_sub(self.pending_bytes).max(1);
                    self.table_page(max - self.pending.len(), room).await?;
                    if !self.pending.is_empty() {
                        return Ok(self.take_pending());
                    }
                }
                Phase::Streaming(_) => {
                    if self.stream_step().await? {
                        return Ok(self.take_pending());
                    }
                }
            }
        }
    }

    fn rewind(&mut self) {
        self.take_pending();
        // A start-up read in progress leaves its snapshot open; start() ends it.
        self.phase = Phase::Start;
    }

    async fn close(mut self) {
        if let Phase::Streaming(s) = std::mem::replace(&mut self.phase, Phase::Start) {
            let mut s = *s;
            let flushed = lock(&self.progress).flushed();
            if let Err(e) = s
                .send_status(&self.progress, self.timing.status_every)
                .await
            {
                tracing::warn!(error = %e, "could not report the final position; a restart may repeat some events");
            }
            // The server may still be decoding a large transaction: do not wait long.
            let _ = tokio::time::timeout(Duration::from_secs(3), s.stream.finish()).await;
            StreamClosed {
                slot: &self.settings.slot,
                flushed: &flushed,
            }
            .emit();
        }
    }

    async fn maintain(&mut self) -> Result<(), SourceError> {
        // While the relay is not taking events, keep the server informed (it
        // would end a silent connection) without reading more, and report
        // confirmations as they pile up.
        match &mut self.phase {
            Phase::Streaming(s) => loop {
                s.paused_at = Instant::now();
                let check = Instant::now() + REPORT_CHECK;
                tokio::time::sleep_until(s.next_status.min(check)).await;
                if Instant::now() >= s.next_status
                    || report_due(&self.progress, self.settings.report_every)
                {
                    s.send_status(&self.progress, self.timing.status_every)
                        .await?;
                }
            },
            _ => std::future::pending().await,
        }
    }
}
