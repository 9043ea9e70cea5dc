//! The start-up read of unsent rows, in rounds, and the slot's fast-forward
//! moves beside it (see [`TableRead`] and the [module docs](super)).

use super::progress::{CATCH_UP, CdcPosition};
use super::snapshot::{Snapshot, StartupView};
use super::stream::lock;
use super::{CdcReader, CdcServer, CdcStream, Phase};
use crate::replication::Lsn;
use crate::source::{SourceError, SourcedEvent};
use crate::telemetry::events::{InternalEvent, SlotAdvanced};
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::oneshot;

/// A start-up read that handed over at least this many rows is followed by
/// another (see [`TableRead`]).
pub const REREAD_ROWS: u64 = 1_000;

/// Reads after the first, at most: a writer faster than the relay never
/// lets a read come out small, and the stream takes over after these.
const MAX_REREADS: u32 = 100;

/// Pause before a small read that only waits out the slot's move.
const REREAD_PAUSE: Duration = Duration::from_millis(20);

/// With ranges, WAL a stream opened at the end of a round may decode and
/// skip (the writers' commits during the rounds, already read from the
/// table) before new commits, in bytes; more is passed by a move first.
/// About 5,000 small events, tens of milliseconds of decoding.
pub const STREAM_SKIP_WAL: u64 = 4 << 20;

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
/// After a large round the slot is instead moved past that WAL in
/// fast-forward, which does not decode row changes; small rounds leave
/// their little WAL to the stream (see `next_round`). A move starts one
/// round after the large round, not at once: the next round hands over the
/// events committed while the backlog was published, which have waited
/// longest, and a move beside it would take a core from them.
///
/// Once the slot no longer moves, the stream is opened beside one more
/// small round, and taken over when it is open: the events committed while
/// the server sets it up come from the table.
///
/// Recording by ranges (`relay.mark = "ranges"`) leaves no marking WAL to
/// pass: once the first move ends, the stream opens beside the next round,
/// however large, and takes over from it (see `marks_rows`), unless the
/// writers' own commits since the slot's position are more WAL than the
/// stream should decode first ([`STREAM_SKIP_WAL`]): then a move passes
/// them, as after a large round with `update`.
pub(super) struct TableRead<S> {
    cursor: i64,
    /// Rows handed over, over all rounds.
    rows: u64,
    /// Rows handed over by this round.
    round_rows: u64,
    /// Rounds after the first.
    rereads: u32,
    /// Large rounds since the slot last started to move: the WAL of their
    /// marking is still to be passed.
    unmoved: u32,
    /// With ranges, the WAL ahead of the slot when last weighed, in bytes.
    ahead: Option<u64>,
    view: StartupView,
    /// The previous round's snapshot: rows it saw were read then.
    seen: Option<Snapshot>,
    /// The slot being moved to a view's settled position.
    advance: Option<Advance>,
    /// The stream being opened, to take over after the current round.
    opening: Option<Opening<S>>,
}

/// The stream, being opened from `from` beside the last round; closed
/// when dropped. Nothing reads it before it is taken over, which a broker
/// stall can put off for long: meanwhile its task reports the position it
/// was opened from every status interval, so that the server does not end
/// it after `wal_sender_timeout` (a status update is read by the server
/// even while what it sends waits unread).
struct Opening<S> {
    from: Lsn,
    /// Set once the stream is open (or failed to open).
    opened: Arc<AtomicBool>,
    /// Tells the task to hand the stream over.
    take: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<S, SourceError>>,
}

impl<S: CdcStream> Opening<S> {
    fn start(
        open: impl Future<Output = Result<S, SourceError>> + Send + 'static,
        from: Lsn,
        status_every: Duration,
    ) -> Self {
        let opened = Arc::new(AtomicBool::new(false));
        let (take, mut taken) = oneshot::channel();
        let flag = opened.clone();
        let task = tokio::spawn(async move {
            let opening = open.await;
            flag.store(true, Ordering::SeqCst);
            let mut stream = opening?;
            // Never behind the slot: that would move it back.
            let at = from.max(stream.slot_confirmed());
            loop {
                tokio::select! {
                    biased;
                    _ = &mut taken => return Ok(stream),
                    () = tokio::time::sleep(status_every) => stream.send_status(at, at).await?,
                }
            }
        });
        Opening {
            from,
            opened,
            take: Some(take),
            task,
        }
    }

    /// Whether the stream is open, or failed to open.
    fn settled(&self) -> bool {
        self.opened.load(Ordering::SeqCst) || self.task.is_finished()
    }

    /// The open stream.
    async fn take(&mut self) -> Result<S, SourceError> {
        if let Some(take) = self.take.take() {
            let _ = take.send(());
        }
        (&mut self.task)
            .await
            .map_err(|e| SourceError::Stream(format!("opening the replication stream: {e}")))?
    }
}

impl<S> Drop for Opening<S> {
    fn drop(&mut self) {
        self.task.abort();
    }
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

impl<S> TableRead<S> {
    /// The first round, over `view`.
    pub(super) fn new(view: StartupView) -> Self {
        TableRead {
            cursor: 0,
            rows: 0,
            round_rows: 0,
            rereads: 0,
            unmoved: 0,
            ahead: None,
            view,
            seen: None,
            advance: None,
            opening: None,
        }
    }
}

impl<B: CdcServer> CdcReader<B> {
    /// One page of the start-up read; after a round's last page, the next
    /// round or the stream.
    pub(super) async fn table_page(
        &mut self,
        max: usize,
        max_bytes: usize,
    ) -> Result<(), SourceError> {
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        let rows = self.server.table_page(read.cursor, max, max_bytes).await?;
        let now = chrono::Utc::now();
        let done = rows.is_empty();
        for row in rows {
            read.cursor = row.seq;
            if read.seen.as_ref().is_some_and(|s| s.saw_finished(row.xid)) {
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
        let large = read.round_rows >= self.settings.reread_rows;
        let opening = read.opening.as_ref().map(Opening::settled);
        let can = read.rereads < MAX_REREADS
            && read.view.settled.is_some()
            && self.settings.messages.is_none();
        if read.advance.as_ref().is_some_and(|a| a.task.is_finished()) {
            // Its position counts for the WAL ahead.
            self.finish_advance().await;
        }
        let moving = matches!(&self.phase, Phase::TableRead(r) if r.advance.is_some());
        let pass = if self.marks_rows() {
            large
        } else if can && !moving && opening.is_none() {
            self.writers_wal_ahead().await?
        } else {
            false
        };
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        // While the stream opens, rounds go on until it is open (then the
        // slot, which the stream holds, cannot move).
        let again = can
            && match opening {
                Some(open) => !open,
                None => pass || moving || read.unmoved > 0,
            };
        if again {
            if !large {
                tokio::time::sleep(REREAD_PAUSE).await;
            }
            return self.next_round(pass).await;
        }
        // Not moving: nothing to wait for. The stream decodes the WAL since
        // the last move, which holds the marking of small reads only.
        self.finish_advance().await;
        if can && opening.is_none() {
            let from = lock(&self.progress).flushed();
            let opening = Opening::start(self.server.stream(from), from, self.timing.status_every);
            if let Phase::TableRead(read) = &mut self.phase {
                read.opening = Some(opening);
            }
            if !large {
                tokio::time::sleep(REREAD_PAUSE).await;
            }
            return self.next_round(false).await;
        }
        self.take_over().await
    }

    /// The last round is done: the stream takes over, skipping what the
    /// last snapshot saw.
    async fn take_over(&mut self) -> Result<(), SourceError> {
        self.server.end_table_read().await?;
        let flushed = {
            let mut p = lock(&self.progress);
            let f = p.flushed();
            p.commit(f);
            f
        };
        let Phase::TableRead(mut read) = std::mem::replace(&mut self.phase, Phase::Start) else {
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
        let streaming = match read.opening.take() {
            Some(mut opening) => {
                let stream = opening.take().await?;
                self.streaming(stream, skip, opening.from)
            }
            None => self.open_stream(skip).await?,
        };
        self.phase = Phase::Streaming(Box::new(streaming));
        Ok(())
    }

    /// With ranges: whether the writers' own commits since the slot's
    /// position are more WAL than a stream opened now should decode and
    /// skip before new commits (`stream_skip_wal`, [`STREAM_SKIP_WAL`]
    /// bytes); a move passes them first, as it passes a large round's
    /// marking with `update`. Not when
    /// it did not shrink since it was last weighed: writers that fill the
    /// WAL as fast as moves pass it would keep the stream waiting for
    /// every round there is. A server that cannot say: no.
    async fn writers_wal_ahead(&mut self) -> Result<bool, SourceError> {
        let Some(now) = self.server.wal_insert_position().await? else {
            return Ok(false);
        };
        let ahead = now.0.saturating_sub(lock(&self.progress).flushed().0);
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(false);
        };
        let shrank = read.ahead.is_none_or(|before| ahead < before);
        read.ahead = Some(ahead);
        Ok(shrank && ahead > self.settings.stream_skip_wal)
    }

    /// A new snapshot for the events committed during the previous round;
    /// one round after a large round, the slot is moved past its WAL.
    /// Small reads leave their WAL to the stream: each move costs a
    /// restart point and a decode from it.
    async fn next_round(&mut self, large: bool) -> Result<(), SourceError> {
        let marks_rows = self.marks_rows();
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        // Large rounds before the one that just ended.
        let due = read.unmoved > 0;
        read.unmoved += u32::from(large);
        let moves = due
            && self.settings.messages.is_none()
            && read.opening.is_none()
            && read.advance.as_ref().is_none_or(|a| a.task.is_finished());
        if moves {
            self.server.write_restart_point().await;
        }
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
        if moves {
            // The marking of the round just read comes after this view.
            // With ranges, the move passes everything before the view; what
            // the writers add after it is weighed again at a round's end.
            read.unmoved = u32::from(large && marks_rows);
        }
        if read.advance.as_ref().is_some_and(|a| a.task.is_finished()) {
            self.finish_advance().await;
        }
        if moves {
            self.advance_to_settled();
        }
        Ok(())
    }

    /// Whether marking writes WAL per row (`update`, `delete`), which the
    /// slot is moved past. Recording by ranges writes a row per batch: the
    /// stream decodes what was committed during a round about as fast as
    /// another round would read it, so it opens after the first move unless
    /// much WAL lies ahead (`writers_wal_ahead`).
    fn marks_rows(&self) -> bool {
        !self.settings.ranges
    }

    /// Starts moving the slot to the current view's settled position,
    /// unless a move is under way or there is nothing to pass.
    pub(super) fn advance_to_settled(&mut self) {
        let Phase::TableRead(read) = &mut self.phase else {
            return;
        };
        let from = lock(&self.progress).flushed();
        if read.advance.is_some() || read.opening.is_some() || self.settings.messages.is_some() {
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
}
