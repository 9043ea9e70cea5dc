//! The CDC source: tails the write-ahead log through a logical replication
//! slot (pgoutput), so events are read within milliseconds of their commit,
//! in commit order, without polling queries.
//!
//! # Start-up
//!
//! 1. Check `wal_level`, the publication (and that it streams every column
//!    the relay reads: a generated one is refused), the slot (creating it
//!    when missing); a lost slot is a specific error with its recovery.
//!    The stream gives each column the text the table read selects
//!    (`stream/text.rs`), so both read one row alike.
//! 2. When rows are marked (`relay.mark` is `update`, `delete` or
//!    `ranges`), read the unsent rows from the table in one REPEATABLE READ
//!    snapshot, in `relay_seq` order (`startup_rows`). This publishes rows
//!    written before the slot existed, rows a refused event held back, and
//!    recovers from a dropped slot.
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
//!    during the read (its marking `UPDATE`s included). After each large
//!    read the slot is moved on again in fast-forward, so the stream opens
//!    close to the end of the WAL. See [`TableRead`]. Before each move a
//!    restart point is written ([`setup::write_restart_point`]), so that
//!    later decoding starts from there, not from before the backlog.
//! 4. Stream from the slot's confirmed position.
//!
//! # Hand-over
//!
//! A committed transaction is handed to the pipeline with the ones the
//! stream already holds. When that leaves the batch short, the reader
//! waits `source.cdc.batch_wait`, without reading meanwhile, then takes
//! what arrived (up to the batch's limits): at steady rates of small
//! transactions, one hand-over (one publishing round, one record of sent
//! rows) serves several, for a few milliseconds of latency. A batch full
//! at the commit goes at once. Status updates keep their schedule; a reply
//! the server asks for waits at most the window.
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
mod settings;
mod settle;
pub mod setup;
pub mod snapshot;
mod startup_rows;
mod stream;
mod table_read;

pub use acker::CdcAcker;
pub use progress::{CdcPosition, Progress};
pub use server::{CdcServer, CdcStream, PgServer, StreamMessage, TableRow, Timing};
pub use settings::CdcSettings;
pub use stream::SharedProgress;
pub use table_read::{REREAD_ROWS, STREAM_SKIP_WAL};

use super::{Reader, SourceError, SourcedEvent};
use crate::config::Config;
use crate::config::{ResolvedColumns, TableName};
use crate::replication::Lsn;
use crate::telemetry::events::{InternalEvent, StreamClosed};
use futures::FutureExt;
use progress::CATCH_UP;
use snapshot::StartupView;
use std::time::Duration;
use stream::{Step, Streaming, lock};
use table_read::TableRead;
use tokio::time::Instant;

/// How often a busy slot is looked at again, and how often that is logged.
const SLOT_BUSY_POLL: std::time::Duration = std::time::Duration::from_millis(250);
const SLOT_BUSY_REMINDER: std::time::Duration = std::time::Duration::from_secs(30);

/// Confirmed-but-unflushed events remembered for skipping after a restart.
pub const SKIP_MEMORY: usize = 100_000;

enum Phase<S> {
    Start,
    TableRead(TableRead<S>),
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
    /// When `pending`, gathered from the stream, is handed over even if
    /// no more transactions joined it (`source.cdc.batch_wait`).
    hand_over_at: Option<Instant>,
    /// The last batch ended inside a transaction: its commit ends a batch,
    /// even one with no events, so that the relay learns it is whole.
    split: bool,
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
        lock(&progress).report_every(settings.report_every);
        CdcReader {
            server,
            table: table.clone(),
            columns: columns.clone(),
            next_heartbeat: settings.heartbeat_interval.map(|h| Instant::now() + h),
            settings,
            progress,
            phase: Phase::Start,
            split: false,
            pending: Vec::new(),
            pending_bytes: 0,
            hand_over_at: None,
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
                            "replication slot {slot:?} is in use by another process; waiting for it to be released"
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
        let timeline = self.server.timeline().await?;
        lock(&self.progress).restart(slot_flushed, timeline);
        if !self.settings.read_table || self.settings.messages.is_some() {
            // Without marking, the WAL is replayed from the slot (and so are
            // logical messages, which no table holds): events already
            // dead-lettered there are not handled again.
            let from = lock(&self.progress).flushed();
            let done = self.server.dead_lettered_since(from).await?;
            lock(&self.progress).remember(&done);
        }
        if self.settings.read_table {
            if self.settings.messages.is_none() {
                // The slot is moved to the view's settled position.
                self.server.write_restart_point().await;
            }
            let view = self.server.begin_table_read().await?;
            lock(&self.progress).begin(CATCH_UP);
            self.phase = Phase::TableRead(TableRead::new(view));
            self.advance_to_settled();
        } else {
            self.phase = Phase::Streaming(Box::new(self.open_stream(None).await?));
        }
        Ok(())
    }

    fn take_pending(&mut self) -> Vec<SourcedEvent<CdcPosition>> {
        self.pending_bytes = 0;
        self.hand_over_at = None;
        self.split = self.inside_transaction();
        std::mem::take(&mut self.pending)
    }

    /// Starts streaming from the flushed position.
    async fn open_stream(
        &mut self,
        skip: Option<StartupView>,
    ) -> Result<Streaming<B::Stream>, SourceError> {
        let start = lock(&self.progress).flushed();
        let stream = self.server.stream(start).await?;
        Ok(self.streaming(stream, skip, start))
    }

    /// A stream opened from `from` takes over. When the slot was past
    /// `from` (see [`CdcStream::slot_confirmed`]), the server streams from
    /// the slot and the flushed position starts there: status updates
    /// never move the slot back.
    fn streaming(
        &self,
        stream: B::Stream,
        skip: Option<StartupView>,
        from: Lsn,
    ) -> Streaming<B::Stream> {
        let slot = stream.slot_confirmed();
        let start = if slot > from {
            tracing::info!(
                slot = %self.settings.slot,
                from = %from,
                confirmed = %slot,
                "the replication slot is past the relay's position (moved by the start-up read or by another instance); streaming and reporting from the slot's"
            );
            lock(&self.progress).skipped_to(slot);
            slot
        } else {
            from
        };
        Streaming::new(
            stream,
            skip,
            start,
            self.settings.read_table,
            self.settings.messages.clone(),
        )
    }

    /// One wake-up of the stream: a message handled, a status sent or a
    /// heartbeat written. True when a committed transaction left events to
    /// hand over, or ended one the last batch split.
    async fn stream_step(&mut self) -> Result<bool, SourceError> {
        let Phase::Streaming(s) = &mut self.phase else {
            return Ok(false);
        };
        if report_due(&self.progress, self.settings.report_every) {
            // Left due (a send cut short): its wake-up was spent.
            s.send_status(&self.progress, self.timing.status_every)
                .await?;
        }
        let silence = s.last_message.max(s.paused_at) + self.timing.silence_limit;
        let due = lock(&self.progress).report_due();
        // Messages first: after a pause they are waiting unread.
        let wake = tokio::select! {
            biased;
            message = s.stream.next() => Wake::Message(message),
            _ = tokio::time::sleep_until(s.next_status) => Wake::Status,
            () = due.notified() => Wake::Report,
            _ = tokio::time::sleep_until(silence) => Wake::Silence,
            _ = sleep_until_opt(self.next_heartbeat) => Wake::Heartbeat,
        };
        match wake {
            Wake::Message(message) => self.on_message(message).await,
            Wake::Status => {
                self.send_status().await?;
                Ok(false)
            }
            Wake::Report => {
                if report_due(&self.progress, self.settings.report_every) {
                    self.send_status().await?;
                }
                Ok(false)
            }
            Wake::Silence => Err(SourceError::Stream(format!(
                "no message from the server for {}s; reconnecting",
                self.timing.silence_limit.as_secs()
            ))),
            Wake::Heartbeat => {
                self.heartbeat().await?;
                Ok(false)
            }
        }
    }

    /// After a commit, the transactions already received join the batch
    /// (up to its limits) instead of waiting for a hand-over each: when the
    /// stream runs ahead of the relay, one hand-over carries many of them.
    /// Never waits for a message: what is not ready yet goes in a later
    /// batch (a transaction may be split, as at the batch's limits).
    async fn take_ready(&mut self, max: usize, max_bytes: usize) -> Result<(), SourceError> {
        while self.pending.len() < max && self.pending_bytes < max_bytes {
            let Phase::Streaming(s) = &mut self.phase else {
                return Ok(());
            };
            // The stream's next() is cancel-safe (the select above drops it
            // on every timer), so looking without waiting loses nothing.
            let Some(message) = s.stream.next().now_or_never() else {
                return Ok(());
            };
            self.on_message(message).await?;
        }
        Ok(())
    }

    /// Handles one message of the stream (reporting the position when the
    /// server asks or a report is due). True when a committed transaction
    /// left events to hand over, or ended one the last batch split.
    async fn on_message(
        &mut self,
        message: Result<Option<StreamMessage>, SourceError>,
    ) -> Result<bool, SourceError> {
        let Phase::Streaming(s) = &mut self.phase else {
            return Ok(false);
        };
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
        // A busy stream still reports on time (the select prefers messages).
        if reply
            || Instant::now() >= s.next_status
            || report_due(&self.progress, self.settings.report_every)
        {
            s.send_status(&self.progress, self.timing.status_every)
                .await?;
        }
        let whole = matches!(step, Step::Committed);
        Ok(whole && (!self.pending.is_empty() || std::mem::take(&mut self.split)))
    }

    /// Waits until `at` without reading the stream, so that what arrives
    /// meanwhile is read at the end, at once, not message by message. A
    /// status update due meanwhile still goes on time.
    async fn gather(&mut self, at: Instant) -> Result<(), SourceError> {
        loop {
            let Phase::Streaming(s) = &self.phase else {
                return Ok(());
            };
            if s.next_status >= at {
                tokio::time::sleep_until(at).await;
                return Ok(());
            }
            tokio::time::sleep_until(s.next_status).await;
            self.send_status().await?;
        }
    }

    async fn send_status(&mut self) -> Result<(), SourceError> {
        if let Phase::Streaming(s) = &mut self.phase {
            s.send_status(&self.progress, self.timing.status_every)
                .await?;
        }
        Ok(())
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

enum Wake<M> {
    Message(M),
    Status,
    /// Enough confirmations piled up for a report.
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
                    if let Some(at) = self.hand_over_at {
                        self.gather(at).await?;
                        self.take_ready(max, max_bytes).await?;
                        return Ok(self.take_pending());
                    }
                    if self.stream_step().await? {
                        self.take_ready(max, max_bytes).await?;
                        let wait = self.settings.batch_wait;
                        if wait.is_zero()
                            || self.pending.len() >= max
                            || self.pending_bytes >= max_bytes
                        {
                            return Ok(self.take_pending());
                        }
                        self.hand_over_at = Some(Instant::now() + wait);
                    }
                }
            }
        }
    }

    fn inside_transaction(&self) -> bool {
        // Only where the WAL is the only record of some events: marked
        // rows left unsent are read again from the table, so a stop need
        // not wait for the rest of their transaction.
        let wal_only = !self.settings.read_table || self.settings.messages.is_some();
        wal_only && matches!(&self.phase, Phase::Streaming(s) if s.inside_transaction())
    }

    fn rewind(&mut self) {
        self.take_pending();
        self.split = false;
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
        let due = lock(&self.progress).report_due();
        match &mut self.phase {
            Phase::Streaming(s) => loop {
                // First: a report left due (a send cut short) goes at once.
                if Instant::now() >= s.next_status
                    || report_due(&self.progress, self.settings.report_every)
                {
                    s.send_status(&self.progress, self.timing.status_every)
                        .await?;
                }
                s.paused_at = Instant::now();
                tokio::select! {
                    _ = tokio::time::sleep_until(s.next_status) => {}
                    () = due.notified() => {}
                }
            },
            _ => std::future::pending().await,
        }
    }
}
