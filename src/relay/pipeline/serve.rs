//! The pipeline's event loop: its state in one struct, one method per arm.

use super::publish::{Answer, Answered, Routed};
use super::tasks::{
    AckCommand, Batch, Confirmed, Refreshed, Resolved, Unrecorded, drive_acker, drive_reader,
    flush, joined, task_error,
};
use super::{Context, Origin, PipelineError, Settings};
use crate::dead_letter::DeadLetter;
use crate::envelope::Envelope;
use crate::relay::blocks::{Blocks, MAX_BLOCKED_AGGREGATES};
use crate::relay::lease::Lease;
use crate::relay::scheduler::Scheduler;
use crate::sink::Sink;
use crate::source::SourcedEvent;
use crate::source::budget::Budget;
use crate::source::{Acker, Reader, RowPosition, SourceError};
use crate::telemetry::InFlightShare;
use crate::telemetry::PipelineTelemetry;
use crate::telemetry::events::{InternalEvent, RefusalsRetried};
use crate::telemetry::trace::EventSpan;
use chrono::Utc;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

mod letters;
mod stop;

/// How long closing the broker connection may take at the end of a run.
const SINK_CLOSE_WAIT: Duration = Duration::from_secs(5);

pub(super) type InFlight<P> = Pin<Box<dyn Future<Output = Answered<P>> + Send>>;

/// An event in the pipeline: from the source, or a redriven dead letter.
pub(super) type Event<P> = SourcedEvent<Origin<P>>;

/// Whether new events are taken, and what happens once nothing is in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Intake {
    /// Reading and publishing.
    Open,
    /// Closed until everything sent is confirmed and recorded; then the
    /// reader starts again from the recorded point (a block expired, or dead
    /// letters were resolved: the aggregate's events must come back in order).
    Rewinding,
    /// Shutting down: nothing more is read (but the rest of a transaction
    /// begun, see [`Reader::inside_transaction`]); what was read is sent until
    /// `send_until` (`None` once passed, or once a rewind let go of it),
    /// and confirmations are awaited until `deadline`, then the run ends.
    Draining {
        deadline: Instant,
        send_until: Option<Instant>,
    },
}

/// A question about open dead letters on its way to the acker.
struct Refresh {
    /// How often dead aggregates are looked up (`None`: dead-lettering is off).
    every: Option<Duration>,
    next: Option<Instant>,
    /// The reply, [`Blocks::generation`] when the question was asked, and
    /// how many redriven letters had been handed to the acker by then.
    waiting: Option<(oneshot::Receiver<Refreshed>, u64, u64)>,
    /// Requested letters were set aside, or a redrive called off, before
    /// the reader starts over: the rewind looks for them again at once.
    after_rewind: bool,
    /// Aggregates whose redriven letter the broker pushed back, and until
    /// when their letters wait (a refresh_interval), however soon a look.
    held: HashMap<String, Instant>,
}

/// Everything one run holds.
pub(super) struct Pipeline<'a, P, K> {
    pub(super) settings: &'a Settings,
    pub(super) telemetry: &'a PipelineTelemetry,
    pub(super) envelope: &'a Envelope,
    pub(super) sink: K,
    pub(super) blocks: &'a mut Blocks,
    pub(super) scheduler: Scheduler<Origin<P>, Answer<P>, Routed>,
    pub(super) in_flight: FuturesUnordered<InFlight<P>>,
    /// Confirmed positions not yet handed to the acker.
    pub(super) pending_acks: Vec<Origin<P>>,
    /// How many of them are replays acknowledged without being sent again
    /// (delivered before their aggregate's dead letter): not published now.
    pub(super) pending_replayed: usize,
    /// The spans of those of them that have one (export on), ended once recorded.
    pub(super) pending_spans: Vec<EventSpan>,
    /// When the current batch reached the pipeline: where event spans start.
    pub(super) read_at: std::time::SystemTime,
    /// Dead letters to hand to the acker, in order.
    pub(super) pending_letters: Vec<DeadLetter<P>>,
    pub(super) intake: Intake,
    /// The rest of the current batch (and redriven letters), admitted as
    /// the window makes room.
    pub(super) waiting: VecDeque<Event<P>>,
    /// Redriven letters refused again, for the acker.
    pub(super) pending_letter_refusals: Vec<(i64, String, bool)>,
    /// Aggregates whose requested letters are being published: letters
    /// not yet handed to the acker. An aggregate stays here with none
    /// until the dead-letter table shows its letters resolved (or one is
    /// refused again): until then its events wait in the source, where they
    /// are read again once it flows, instead of following letters that are
    /// already published.
    pub(super) redriving: HashMap<String, usize>,
    /// The aggregate of each redriven letter not yet handed to the acker.
    pub(super) letter_aggregates: HashMap<i64, String>,
    /// Redriven letters handed to the acker so far.
    letters_handed: u64,
    /// Held-back events whose positions go back to the source.
    pub(super) pending_releases: Vec<P>,
    pub(super) lease: Arc<Lease>,
    /// Handed to the acker and not recorded yet: part of the window.
    unrecorded: Arc<Unrecorded>,
    warned_full: bool,
    /// This run's part of the pipeline's in-flight gauges.
    pub(super) in_flight_share: InFlightShare,
    epoch: u64,
    /// The last batch taken ended inside a transaction: a stop reads on
    /// to its end, so that the events it sent from it can be recorded.
    inside_transaction: bool,
    refresh: Refresh,
    /// The run's stop, seen also by a send the broker does not take, and
    /// when it was first seen: a stop's limits count from then.
    pub(super) stop: CancellationToken,
    pub(super) stop_seen: Arc<std::sync::OnceLock<Instant>>,
    next_probe: Instant,
    batch_rx: mpsc::Receiver<Batch<P>>,
    rewind_tx: mpsc::Sender<u64>,
    ack_tx: mpsc::Sender<AckCommand<P>>,
    resolved: Arc<Resolved>,
    /// Bytes of events read and not yet done with.
    pub(super) budget: Arc<Budget>,
    reader_task: AbortOnDropHandle<Result<(), SourceError>>,
    acker_task: AbortOnDropHandle<Result<(), SourceError>>,
}

impl<'a, P, K> Pipeline<'a, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    /// Starts the reader and acker tasks.
    pub(super) fn start<R, A>(
        reader: R,
        acker: A,
        sink: K,
        cx: Context<'a>,
        blocks: &'a mut Blocks,
    ) -> Self
    where
        R: Reader<Position = P>,
        A: Acker<Position = P>,
    {
        let (envelope, settings, telemetry, lease) =
            (cx.envelope, cx.settings, cx.telemetry, cx.lease);
        let (batch_tx, batch_rx) = mpsc::channel(2);
        let (rewind_tx, rewind_rx) = mpsc::channel(4);
        let budget = Budget::new(settings.max_in_flight_bytes);
        let reader_task = AbortOnDropHandle::new(tokio::spawn(drive_reader(
            reader,
            settings.batch_size,
            budget.clone(),
            batch_tx,
            rewind_rx,
        )));
        let (ack_tx, ack_rx) = mpsc::channel(4);
        let resolved = Arc::new(Resolved::default());
        let unrecorded = Arc::new(Unrecorded::default());
        let acker_task = AbortOnDropHandle::new(tokio::spawn(drive_acker(
            acker,
            ack_rx,
            resolved.clone(),
            lease.clone(),
            unrecorded.clone(),
        )));
        let every = settings.dead_letter.as_ref().map(|d| d.refresh_interval);
        Pipeline {
            settings,
            telemetry,
            envelope,
            sink,
            blocks,
            scheduler: Scheduler::new(settings.per_aggregate),
            in_flight: FuturesUnordered::new(),
            pending_acks: Vec::new(),
            pending_replayed: 0,
            pending_spans: Vec::new(),
            read_at: std::time::SystemTime::now(),
            pending_letters: Vec::new(),
            intake: Intake::Open,
            waiting: VecDeque::new(),
            pending_letter_refusals: Vec::new(),
            redriving: HashMap::new(),
            letter_aggregates: HashMap::new(),
            letters_handed: 0,
            pending_releases: Vec::new(),
            lease,
            unrecorded,
            budget,
            warned_full: false,
            in_flight_share: InFlightShare::new(telemetry, cx.shard),
            epoch: 0,
            inside_transaction: false,
            stop: CancellationToken::new(),
            stop_seen: Arc::default(),
            refresh: Refresh {
                every,
                next: every.map(|d| Instant::now() + d),
                waiting: None,
                after_rewind: false,
                held: HashMap::new(),
            },
            next_probe: Instant::now() + settings.probe_interval,
            batch_rx,
            rewind_tx,
            ack_tx,
            resolved,
            reader_task,
            acker_task,
        }
    }

    /// Aggregates dead-lettered earlier (by this or another instance) stay
    /// blocked: known before the first event is admitted.
    pub(super) async fn load_dead_letters(&mut self) -> Result<(), PipelineError> {
        if self.refresh.every.is_none() {
            return Ok(());
        }
        let (tx, rx) = oneshot::channel();
        let answer = match self
            .ack_tx
            .send(AckCommand::OpenDeadLetters(tx, self.budget.room().max(1)))
            .await
        {
            Ok(()) => rx.await.ok(),
            Err(_) => None,
        };
        let Some((open, requested)) = answer else {
            return Err(task_error(&mut self.acker_task, "acker").await);
        };
        if !requested.letters.is_empty() || requested.extending {
            // Asked for while no relay ran: the first look comes at once.
            self.refresh.next = Some(Instant::now());
        }
        if !open.is_empty() {
            tracing::warn!(
                aggregates = open.len(),
                "aggregates with open dead letters are held back; see `outbox-relay dlq list`"
            );
        }
        // Dead in an earlier run and resolved since (a redrive it finished,
        // an operator's drop): the view is newer than every mark.
        self.blocks.resolve_missing(&open, self.blocks.generation());
        self.blocks.set_dead(open);
        Ok(())
    }

    /// The loop: returns `Ok` after a clean drain, or the failure that ended the run.
    pub(super) async fn serve(
        &mut self,
        shutdown: &CancellationToken,
    ) -> Result<(), PipelineError> {
        self.stop = shutdown.clone();
        loop {
            let fenced = !self.lease.valid(Instant::now());
            if self.quiet() && self.at_rest(fenced).await? {
                return flush(&self.ack_tx).await;
            }
            let open = self.intake == Intake::Open;
            let sending = open || self.intake.send_until().is_some();
            if sending && !fenced && !self.waiting.is_empty() {
                self.admit_waiting().await?;
            }
            self.report_in_flight();
            let open = self.intake == Intake::Open;
            let room = self.has_room();
            let reading = open || (self.inside_transaction && self.intake.send_until().is_some());
            let intake = reading && !fenced && self.waiting.is_empty() && room;
            let expiry = self.blocks.next_expiry().filter(|_| open);
            let deadline = self.intake.deadline();
            // Everything confirmed goes to the acker first: the view it returns
            // then includes every letter dead, and every letter redriven, by now.
            let ask_refresh =
                self.refresh.waiting.is_none() && self.blocks.has_dead() && !self.has_work();
            tokio::select! {
                biased;
                // 1. Shutdown: stop reading, send what was read, drain.
                _ = shutdown.cancelled(), if deadline.is_none() => self.begin_shutdown(),
                // 2. The drain took too long: record what was confirmed and stop.
                _ = sleep_until_opt(deadline) => return self.drain_timed_out().await,
                // Half of it is left: what was read and not sent stays unsent.
                _ = sleep_until_opt(self.intake.send_until()) => self.rewind_later(),
                // 3. Confirmations.
                Some(answer) = self.in_flight.next(), if !self.in_flight.is_empty() => {
                    self.answered(answer).await?
                }
                // 4. Hand confirmed positions and dead letters to the acker, in order.
                permit = self.ack_tx.clone().reserve_owned(), if self.has_work() => match permit {
                    Ok(p) => { p.send(self.next_command()); }
                    Err(_) => return Err(task_error(&mut self.acker_task, "acker").await),
                },
                // 5. Operators resolved dead letters (seen by the acker, or by the refresh).
                found = self.resolved.next() => self.resolve(found),
                answer = letters::wait_refresh(&mut self.refresh.waiting), if self.refresh.waiting.is_some() => match answer {
                    Ok((found, seen, handed)) => self.refreshed(found, seen, handed),
                    // The acker dropped the question: it failed (a receiver
                    // that answered must not be polled again).
                    Err(()) => {
                        self.refresh.waiting = None;
                        return Err(task_error(&mut self.acker_task, "acker").await);
                    }
                },
                // Only dead aggregates need watching. Dead letters still to be
                // written go first: the acker answers in order, so the view it
                // returns includes every aggregate dead by now.
                _ = sleep_until_opt(self.refresh.next), if ask_refresh => self.ask_refresh().await?,
                // 6. A block expired: drain, then re-read so the aggregate's events come back in order.
                _ = sleep_until_opt(expiry) => self.retry_expired(),
                // 7. New events.
                batch = self.batch_rx.recv(), if intake => self.take(batch).await?,
                // Recorded events make room in the window.
                _ = self.unrecorded.recorded_some(), if !room => {}
                // The ownership lease ran out (or a new owner waits out the
                // previous one's): nothing is sent until it is renewed.
                _ = self.lease.wait_valid(), if fenced && open => {}
                // 8. The acker failed (e.g. lost its connection, and with it ownership).
                res = &mut self.acker_task => return Err(joined(res, "acker")),
                // 9. An idle broker connection can die unnoticed: look now and
                // then. With messages in flight, confirm_timeout already watches.
                _ = tokio::time::sleep_until(self.next_probe) => self.probe().await?,
            }
        }
    }

    /// Nothing unconfirmed, nothing waiting for the acker.
    fn quiet(&self) -> bool {
        self.scheduler.in_flight() == 0
            && self.pending_acks.is_empty()
            && self.pending_letters.is_empty()
    }

    /// With nothing unconfirmed: starts a rewind that is due, and says
    /// whether a stop is done (what was read is sent, or cannot be:
    /// ownership unproven, or too many aggregates blocked).
    async fn at_rest(&mut self, fenced: bool) -> Result<bool, PipelineError> {
        match self.intake {
            Intake::Draining { send_until, .. } => Ok(!self.has_work()
                && ((self.waiting.is_empty() && !self.inside_transaction)
                    || send_until.is_none()
                    || fenced
                    || self.blocks.len() >= MAX_BLOCKED_AGGREGATES)),
            Intake::Rewinding => self.rewind().await.map(|()| false),
            Intake::Open => Ok(false),
        }
    }

    fn has_work(&self) -> bool {
        !self.pending_acks.is_empty()
            || !self.pending_letters.is_empty()
            || !self.pending_letter_refusals.is_empty()
            || !self.pending_releases.is_empty()
    }

    fn report_in_flight(&mut self) {
        let in_flight = self.scheduler.in_flight();
        self.in_flight_share.report(in_flight, self.budget.used());
    }

    /// Everything sent is confirmed and recorded: re-read from the recorded point.
    async fn rewind(&mut self) -> Result<(), PipelineError> {
        // The reader starts over: what it would have been told to let go of
        // is read afresh, and requested letters are fetched again (their
        // aggregates still wait for the table to show them resolved).
        self.pending_releases.clear();
        // A redrive cut short (its queued letters dropped) goes on with the
        // next look, at once: with nothing else to hurry it, it would wait
        // a whole dead_letter.refresh_interval.
        if std::mem::take(&mut self.refresh.after_rewind) || self.redriving.values().any(|n| *n > 0)
        {
            self.refresh.next = Some(Instant::now());
        }
        self.redriving.values_mut().for_each(|n| *n = 0);
        self.letter_aggregates.clear();
        flush(&self.ack_tx).await?;
        self.epoch += 1;
        self.inside_transaction = false;
        if self.rewind_tx.send(self.epoch).await.is_err() {
            return Err(PipelineError::TaskLost("reader"));
        }
        self.intake = Intake::Open;
        Ok(())
    }

    /// Stops taking events until a rewind; a stop sends nothing more.
    pub(super) fn rewind_later(&mut self) {
        match &mut self.intake {
            Intake::Rewinding => return,
            Intake::Open => self.intake = Intake::Rewinding,
            Intake::Draining { send_until, .. } => *send_until = None,
        }
        // Parked and waiting events are unsent and unrecorded: they are
        // read again later, in order (and so is the rest of a transaction
        // begun: a stop does not read on past them).
        self.scheduler.clear_parked();
        self.waiting.clear();
        self.inside_transaction = false;
    }

    /// The acker's next command (it carries them out in order). Dead letters
    /// go first, with the confirmations that arose before them: the events
    /// of an aggregate confirmed before its letter are recorded no later
    /// than the letter, or after a crash between the two they would be read
    /// again as unsent and follow a letter they came before. A redriven
    /// letter refused again takes them along too.
    fn next_command(&mut self) -> AckCommand<P> {
        if !self.pending_letters.is_empty() {
            let letters = std::mem::take(&mut self.pending_letters);
            self.unrecorded.add(letters.len());
            AckCommand::DeadLetter(self.confirmed(), letters)
        } else if let Some((id, reason, counts)) = self.pending_letter_refusals.pop() {
            self.letters_handed += 1;
            AckCommand::LetterRefused(self.confirmed(), id, reason, counts)
        } else if !self.pending_releases.is_empty() {
            AckCommand::Release(std::mem::take(&mut self.pending_releases))
        } else {
            AckCommand::Ack(self.confirmed())
        }
    }

    /// The confirmations waiting, taken for the acker.
    fn confirmed(&mut self) -> Confirmed<P> {
        let acks = std::mem::take(&mut self.pending_acks);
        self.unrecorded.add(acks.len());
        let published = acks.len() - std::mem::take(&mut self.pending_replayed);
        if published > 0 {
            let m = &self.telemetry.metrics;
            m.published.increment(published as u64);
            m.last_publish
                .set(Utc::now().timestamp_millis() as f64 / 1000.0);
        }
        let mut positions = Vec::with_capacity(acks.len());
        let mut letters = Vec::new();
        for a in acks {
            match a {
                Origin::Source(p) => positions.push(p),
                Origin::Letter(id) => letters.push(id),
            }
        }
        for id in &letters {
            self.letters_handed += 1;
            let Some(aggregate) = self.letter_aggregates.remove(id) else {
                continue;
            };
            if let Some(n) = self.redriving.get_mut(&aggregate) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    // Look again once these are recorded (the loop looks
                    // only with nothing left for the acker): a redrive larger
                    // than one look's batch goes on at the broker's pace, and
                    // its aggregate resumes at once, instead of one batch per
                    // dead_letter.refresh_interval.
                    self.refresh.next = Some(Instant::now());
                }
            }
        }
        Confirmed {
            positions,
            letters,
            spans: std::mem::take(&mut self.pending_spans),
        }
    }

    pub(super) async fn push_pending(&mut self) {
        while self.has_work() {
            let cmd = self.next_command();
            if self.ack_tx.send(cmd).await.is_err() {
                return;
            }
        }
    }

    fn retry_expired(&mut self) {
        let released = self.blocks.release_expired(Instant::now());
        RefusalsRetried {
            aggregates: released,
        }
        .emit();
        self.rewind_later();
    }

    async fn take(&mut self, batch: Option<Batch<P>>) -> Result<(), PipelineError> {
        match batch {
            Some(b) if b.epoch == self.epoch => {
                if self.telemetry.tracer.is_on() {
                    self.read_at = std::time::SystemTime::now();
                }
                self.telemetry
                    .metrics
                    .batch_size
                    .record(b.events.len() as f64);
                self.inside_transaction = b.inside_transaction;
                self.waiting
                    .extend(b.events.into_iter().map(|e| SourcedEvent {
                        position: Origin::Source(e.position),
                        event: e.event,
                        charge: e.charge,
                    }));
                self.admit_waiting().await
            }
            Some(_) => Ok(()), // read before the last rewind; it will be read again
            None => Err(task_error(&mut self.reader_task, "reader").await),
        }
    }

    async fn probe(&mut self) -> Result<(), PipelineError> {
        self.next_probe = Instant::now() + self.settings.probe_interval;
        // A broker that paused publishing (an alarm) will answer when it
        // clears; a new connection would only be paused too.
        if self.scheduler.in_flight() > 0 || self.sink.pause().is_paused() {
            return Ok(());
        }
        self.sink.probe().await.map_err(Into::into)
    }

    pub(super) fn has_room(&mut self) -> bool {
        // Aggregates released for a retry only count attempts: forgotten
        // before reading pauses, or reading could pause for good (nothing
        // read, nothing confirmed, none cleared).
        if self.blocks.len() >= MAX_BLOCKED_AGGREGATES && self.blocks.forget_released() > 0 {
            tracing::warn!(
                aggregates = self.blocks.len(),
                "many aggregates were refused at once: the attempt counts of those released for a retry start again"
            );
        }
        if self.blocks.len() >= MAX_BLOCKED_AGGREGATES {
            if !self.warned_full {
                tracing::error!(
                    aggregates = self.blocks.len(),
                    "too many blocked aggregates; reading pauses until some are resolved (see `outbox-relay dlq list`)"
                );
                self.warned_full = true;
            }
            return false;
        }
        self.warned_full = false;
        // Confirmed events not yet recorded count too: a slow database
        // holds reading back instead of growing the acker's queue.
        self.scheduler.used()
            + self.pending_acks.len()
            + self.pending_letters.len()
            + self.unrecorded.get()
            < self.settings.max_in_flight
    }
}

impl Intake {
    pub(super) fn deadline(&self) -> Option<Instant> {
        match self {
            Intake::Draining { deadline, .. } => Some(*deadline),
            _ => None,
        }
    }

    /// While a stop still sends what was read: until when.
    fn send_until(&self) -> Option<Instant> {
        match self {
            Intake::Draining { send_until, .. } => *send_until,
            _ => None,
        }
    }
}

pub(crate) async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
