//! One run of the pipeline: read → publish → confirm → acknowledge, until
//! shutdown or a failure that needs fresh connections.
//!
//! Three tasks: the reader fills a small channel with batches; this loop
//! sends events to the broker through the [`Scheduler`], keeping up to
//! `max_in_flight` unconfirmed; the acker records confirmed positions (and
//! dead letters) in order. Progress is recorded only for confirmed messages
//! and written dead letters, so whatever ends a run, the next run re-reads
//! from the last recorded point.
//!
//! A refused event blocks its aggregate and is retried with backoff; after
//! `dead_letter.max_attempts` refusals it is dead-lettered, and the
//! aggregate's later events follow it there or wait in the outbox, per
//! `dead_letter.aggregate`, until an operator redrives or drops it.

use super::scheduler::{Admission, Blocks, MAX_BLOCKED_AGGREGATES, Scheduler};
use super::tasks::{AckCommand, Resolved, drive_acker, drive_reader, flush, joined, task_error};
use crate::config::HoldPolicy;
use crate::dead_letter::DeadLetter;
use crate::envelope::Envelope;
use crate::outbox::{OutboxEvent, RawRow};
use crate::sink::{Confirmation, Sink, SinkError};
use crate::source::{Acker, Reader, RowPosition, SourceError, SourcedEvent};
use crate::telemetry::PipelineTelemetry;
use crate::telemetry::metrics::Failure;
use chrono::Utc;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::collections::HashSet;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// Why a run ended early.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("broker: {0}")]
    Sink(#[from] SinkError),
    #[error("source: {0}")]
    Source(#[from] SourceError),
    #[error("{0} task stopped unexpectedly")]
    TaskLost(&'static str),
}

impl PipelineError {
    pub fn is_retryable(&self) -> bool {
        match self {
            PipelineError::Sink(e) => e.is_retryable(),
            PipelineError::Source(e) => e.is_retryable(),
            PipelineError::TaskLost(_) => true,
        }
    }
}

/// Dead-lettering, when on.
#[derive(Debug, Clone)]
pub struct DeadLetterSettings {
    pub max_attempts: u32,
    pub policy: HoldPolicy,
    pub refresh_interval: Duration,
}

/// Tunables of a run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// How often the broker connection is checked while nothing else would notice its loss.
    pub probe_interval: Duration,
    pub batch_size: usize,
    pub max_in_flight: usize,
    pub per_aggregate: Option<usize>,
    pub confirm_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub dead_letter: Option<DeadLetterSettings>,
}

/// A confirmation on its way back: the position, the event, the outcome.
type Done<P> = (P, OutboxEvent, Result<(), SinkError>);
type InFlight<P> = Pin<Box<dyn Future<Output = Done<P>> + Send>>;

struct Run<'a, P, K> {
    settings: &'a Settings,
    telemetry: &'a PipelineTelemetry,
    sink: K,
    envelope: &'a Envelope,
    blocks: &'a mut Blocks,
    scheduler: Scheduler<P>,
    in_flight: FuturesUnordered<InFlight<P>>,
    pending_acks: Vec<P>,
    /// Dead letters to hand to the acker, in order.
    pending_letters: Vec<DeadLetter<P>>,
    /// Intake is closed while draining for shutdown or for a rewind.
    intake_closed: bool,
    warned_full: bool,
}

/// What a run reads its settings from and reports to.
pub struct Context<'a> {
    pub envelope: &'a Envelope,
    pub settings: &'a Settings,
    pub telemetry: &'a PipelineTelemetry,
}

/// Runs until `shutdown` (then drains and returns `Ok`) or a failure.
pub async fn run<R, A, K>(
    reader: R,
    acker: A,
    sink: K,
    cx: Context<'_>,
    blocks: &mut Blocks,
    shutdown: &CancellationToken,
) -> Result<(), PipelineError>
where
    R: Reader,
    A: Acker<Position = R::Position>,
    K: Sink,
{
    let Context {
        envelope,
        settings,
        telemetry,
    } = cx;
    let (batch_tx, mut batch_rx) = mpsc::channel(2);
    let (rewind_tx, rewind_rx) = mpsc::channel(4);
    let mut reader_task = AbortOnDropHandle::new(tokio::spawn(drive_reader(
        reader,
        settings.batch_size,
        batch_tx,
        rewind_rx,
    )));
    let (ack_tx, ack_rx) = mpsc::channel(4);
    let resolved = Arc::new(Resolved::default());
    let mut acker_task =
        AbortOnDropHandle::new(tokio::spawn(drive_acker(acker, ack_rx, resolved.clone())));
    let mut run = Run {
        settings,
        telemetry,
        sink,
        envelope,
        blocks,
        scheduler: Scheduler::new(settings.per_aggregate),
        in_flight: FuturesUnordered::new(),
        pending_acks: Vec::new(),
        pending_letters: Vec::new(),
        intake_closed: false,
        warned_full: false,
    };
    let mut epoch = 0u64;
    let mut rewinding = false;
    let mut drain_deadline: Option<Instant> = None;
    // Aggregates dead-lettered earlier (by this or another instance) stay
    // blocked: known before the first event is admitted.
    let refresh_every = settings.dead_letter.as_ref().map(|d| d.refresh_interval);
    if refresh_every.is_some() {
        let (tx, rx) = oneshot::channel();
        let open = match ack_tx.send(AckCommand::OpenDeadLetters(tx)).await {
            Ok(()) => rx.await.ok(),
            Err(_) => None,
        };
        let Some(open) = open else {
            return Err(task_error(&mut acker_task, "acker").await);
        };
        if !open.is_empty() {
            tracing::warn!(
                aggregates = open.len(),
                "aggregates with open dead letters are held back; see `outbox-relay dlq list`"
            );
        }
        run.blocks.set_dead(open);
    }
    // The reply, and the generation of the blocks when it was asked for.
    let mut refresh: Option<(oneshot::Receiver<HashSet<String>>, u64)> = None;
    let mut next_refresh = refresh_every.map(|d| Instant::now() + d);
    let mut next_probe = Instant::now() + settings.probe_interval;

    let result = loop {
        if run.scheduler.in_flight() == 0
            && run.pending_acks.is_empty()
            && run.pending_letters.is_empty()
        {
            if drain_deadline.is_some() {
                break flush(&ack_tx).await;
            }
            if rewinding {
                // Everything sent is confirmed and recorded: re-read from the recorded point.
                if let Err(e) = flush(&ack_tx).await {
                    break Err(e);
                }
                epoch += 1;
                if rewind_tx.send(epoch).await.is_err() {
                    break Err(PipelineError::TaskLost("reader"));
                }
                rewinding = false;
                run.intake_closed = false;
            }
        }
        let in_flight = run.scheduler.in_flight();
        telemetry.metrics.in_flight.set(in_flight as f64);
        telemetry.health.set_in_flight(in_flight);
        let intake = !run.intake_closed && run.has_room();
        let expiry = run.blocks.next_expiry().filter(|_| !run.intake_closed);
        let has_work = !run.pending_acks.is_empty() || !run.pending_letters.is_empty();
        tokio::select! {
            biased;
            // 1. Shutdown: stop reading, drain what is in flight.
            _ = shutdown.cancelled(), if drain_deadline.is_none() => {
                tracing::info!(in_flight = run.scheduler.in_flight(), "shutting down: waiting for broker confirmations");
                drain_deadline = Some(Instant::now() + settings.shutdown_timeout);
                run.close_intake();
            }
            // 2. The drain took too long: record what was confirmed and stop.
            _ = sleep_until_opt(drain_deadline) => {
                tracing::warn!(unconfirmed = run.scheduler.in_flight(), "shutdown timeout reached; unconfirmed events will be re-sent on the next start");
                run.push_pending(&ack_tx).await;
                break flush(&ack_tx).await;
            }
            // 3. Confirmations.
            Some(done) = run.in_flight.next(), if !run.in_flight.is_empty() => {
                if let Err(e) = run.complete(done).await {
                    break Err(e);
                }
            }
            // 4. Hand confirmed positions and dead letters to the acker, in order.
            permit = ack_tx.reserve(), if has_work => match permit {
                Ok(p) => p.send(run.next_command()),
                Err(_) => break Err(task_error(&mut acker_task, "acker").await),
            },
            // 5. Operators resolved dead letters (seen by the acker, or by the refresh).
            found = resolved.next() => {
                if run.resolve(found) && !rewinding {
                    rewinding = true;
                    run.close_intake();
                }
            }
            Ok((open, seen)) = wait_refresh(&mut refresh), if refresh.is_some() => {
                refresh = None;
                let gone = run.blocks.resolve_missing(&open, seen);
                if !gone.is_empty() && !rewinding {
                    tracing::info!(aggregates = gone.len(), "dead letters redriven or dropped; their aggregates resume");
                    rewinding = true;
                    run.close_intake();
                }
            }
            // Only dead aggregates need watching. Dead letters still to be
            // written go first: the acker answers in order, so the view it
            // returns includes every aggregate dead by now.
            _ = sleep_until_opt(next_refresh), if refresh.is_none() && run.blocks.has_dead() && run.pending_letters.is_empty() => {
                let (tx, rx) = oneshot::channel();
                if ack_tx.send(AckCommand::OpenDeadLetters(tx)).await.is_err() {
                    break Err(task_error(&mut acker_task, "acker").await);
                }
                refresh = Some((rx, run.blocks.generation()));
                next_refresh = refresh_every.map(|d| Instant::now() + d);
            }
            // 6. A block expired: drain, then re-read so the aggregate's events come back in order.
            _ = sleep_until_opt(expiry), if !rewinding => {
                let released = run.blocks.release_expired(Instant::now());
                tracing::info!(aggregates = released, "retrying refused events");
                rewinding = true;
                run.close_intake();
            }
            // 7. New events.
            batch = batch_rx.recv(), if intake => match batch {
                Some(b) if b.epoch == epoch => {
                    if let Err(e) = run.admit(b.events).await {
                        break Err(e);
                    }
                }
                Some(_) => {} // read before the last rewind; it will be read again
                None => break Err(task_error(&mut reader_task, "reader").await),
            },
            // 8. The acker failed (e.g. lost its connection, and with it ownership).
            res = &mut acker_task => break Err(joined(res, "acker")),
            // 9. An idle broker connection can die unnoticed: look now and
            // then. With messages in flight, confirm_timeout already watches.
            _ = tokio::time::sleep_until(next_probe) => {
                next_probe = Instant::now() + settings.probe_interval;
                if run.scheduler.in_flight() > 0 {
                    continue;
                }
                if let Err(e) = run.sink.probe().await {
                    break Err(e.into());
                }
            }
        }
    };
    if let Err(e) = &result
        && e.is_retryable()
    {
        // Their fate is unknown: they will be sent again.
        telemetry
            .metrics
            .failed(Failure::Unavailable, run.scheduler.in_flight() as u64);
    }
    if result.is_err() {
        // Record what the broker confirmed before giving up, to spare re-sends.
        run.push_pending(&ack_tx).await;
        let _ = tokio::time::timeout(Duration::from_secs(5), flush(&ack_tx)).await;
    }
    // Let the reader close (report its final position) after the last acknowledgement.
    drop(rewind_tx);
    if !reader_task.is_finished() {
        let _ = tokio::time::timeout(Duration::from_secs(5), &mut reader_task).await;
    }
    run.sink.close().await;
    result
}

async fn wait_refresh(
    rx: &mut Option<(oneshot::Receiver<HashSet<String>>, u64)>,
) -> Result<(HashSet<String>, u64), ()> {
    match rx {
        Some((rx, seen)) => {
            let seen = *seen;
            rx.await.map(|open| (open, seen)).map_err(|_| ())
        }
        None => std::future::pending().await,
    }
}

impl<P, K> Run<'_, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    fn has_room(&mut self) -> bool {
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
        // Confirmed events not yet handed to the acker count too: a slow
        // database holds reading back instead of growing this queue.
        self.scheduler.used() + self.pending_acks.len() + self.pending_letters.len()
            < self.settings.max_in_flight
    }

    fn close_intake(&mut self) {
        self.intake_closed = true;
        // Parked events are unsent and unrecorded: they are read again later.
        self.scheduler.clear_parked();
    }

    /// The acker's next command: dead letters go before later acknowledgements
    /// only in the order they arose, so both are sent as they are, letters first
    /// (a letter never depends on a later acknowledgement).
    fn next_command(&mut self) -> AckCommand<P> {
        if !self.pending_letters.is_empty() {
            AckCommand::DeadLetter(std::mem::take(&mut self.pending_letters))
        } else {
            let acks = std::mem::take(&mut self.pending_acks);
            let m = &self.telemetry.metrics;
            m.published.increment(acks.len() as u64);
            m.last_publish
                .set(Utc::now().timestamp_millis() as f64 / 1000.0);
            AckCommand::Ack(acks)
        }
    }

    /// Aggregates whose dead letters were resolved: unblock; true if any was blocked.
    fn resolve(&mut self, aggregates: HashSet<String>) -> bool {
        let mut any = false;
        for a in aggregates {
            any |= self.blocks.is_blocked(&a);
            self.blocks.resolve(&a);
        }
        if any {
            tracing::info!("dead letters were redriven or dropped; their aggregates resume");
        }
        any
    }

    async fn admit(&mut self, events: Vec<SourcedEvent<P>>) -> Result<(), PipelineError> {
        self.telemetry
            .metrics
            .batch_size
            .record(events.len() as f64);
        for event in events {
            match self.scheduler.admit(event, self.blocks) {
                Admission::Send(e) => self.dispatch(e).await?,
                Admission::Parked => {}
                Admission::Deferred(e) => self.defer(e),
            }
        }
        Ok(())
    }

    /// An event of a blocked aggregate: it waits in the outbox, or follows a
    /// dead letter of its aggregate into the dead-letter table.
    fn defer(&mut self, event: SourcedEvent<P>) {
        let aggregate = event.aggregate_id().to_owned();
        let follows = match (
            &self.settings.dead_letter,
            self.blocks.dead_event(&aggregate),
        ) {
            (Some(d), Some(first)) if d.policy == HoldPolicy::Follow => first.to_owned(),
            _ => {
                tracing::debug!(aggregate_id = %aggregate, "aggregate blocked; event deferred");
                return;
            }
        };
        let (raw, id) = raw_of(&event);
        tracing::warn!(event_id = %id, aggregate_id = %aggregate, follows = %follows, "event follows an earlier dead letter of its aggregate");
        let now = Utc::now();
        self.telemetry.metrics.dead_lettered.increment(1);
        self.pending_letters.push(DeadLetter {
            seq: event.position.seq(),
            position: event.position,
            raw,
            reason: format!("follows dead-lettered event {follows} of its aggregate"),
            attempts: 0,
            first_failed_at: now,
            last_failed_at: now,
            follows: Some(follows),
        });
    }

    async fn dispatch(&mut self, sourced: SourcedEvent<P>) -> Result<(), PipelineError> {
        let aggregate = sourced.aggregate_id().to_owned();
        let event = match sourced.event {
            Ok(e) => e,
            Err(bad) => {
                let raw = bad.raw.map(|r| *r).unwrap_or_default();
                self.reject(sourced.position, &aggregate, raw, bad.reason, true);
                return Ok(());
            }
        };
        let message = self.envelope.build(&event);
        // Handing a message over is quick unless the broker stopped reading.
        let sent = tokio::time::timeout(
            self.settings.confirm_timeout,
            self.sink.send(&event, message),
        )
        .await
        .unwrap_or_else(|_| {
            Err(SinkError::Unavailable(format!(
                "the broker did not take a message within relay.confirm_timeout ({}s)",
                self.settings.confirm_timeout.as_secs()
            )))
        });
        match sent {
            Ok(confirmation) => {
                self.scheduler.sent(&aggregate);
                let timeout = self.settings.confirm_timeout;
                let position = sourced.position;
                self.in_flight.push(Box::pin(async move {
                    let result = confirm_within(confirmation, timeout).await;
                    (position, event, result)
                }));
                Ok(())
            }
            Err(SinkError::Rejected(reason)) => {
                self.reject(sourced.position, &aggregate, event.to_raw(), reason, true);
                Ok(())
            }
            Err(SinkError::Busy(reason)) => {
                self.reject(sourced.position, &aggregate, event.to_raw(), reason, false);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn complete(&mut self, (position, event, result): Done<P>) -> Result<(), PipelineError> {
        let aggregate = event.aggregate_id.clone();
        match result {
            Ok(()) => {
                self.telemetry.health.progress();
                let latency = (Utc::now() - event.created_at)
                    .num_microseconds()
                    .unwrap_or(0)
                    .max(0);
                self.telemetry
                    .metrics
                    .commit_to_confirm
                    .record(latency as f64 / 1e6);
                self.pending_acks.push(position);
                self.blocks.clear(&aggregate);
                if let Some(next) = self.scheduler.finished(&aggregate) {
                    self.dispatch(next).await?;
                }
                Ok(())
            }
            Err(SinkError::Rejected(reason)) => {
                // Parked events go first (reject takes them), so none is released here.
                self.reject(position, &aggregate, event.to_raw(), reason, true);
                self.scheduler.finished(&aggregate);
                Ok(())
            }
            Err(SinkError::Busy(reason)) => {
                self.reject(position, &aggregate, event.to_raw(), reason, false);
                self.scheduler.finished(&aggregate);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The event cannot be published now: hold its aggregate back and retry
    /// later, or, after `max_attempts` refusals that `count`, dead-letter it
    /// (back-pressure does not count: it is retried for as long as it takes).
    fn reject(&mut self, position: P, aggregate: &str, raw: RawRow, reason: String, count: bool) {
        self.telemetry.metrics.failed(Failure::Refused, 1);
        if self.blocks.is_dead(aggregate) {
            // An earlier event of the aggregate is already dead-lettered
            // (both were in flight): this one follows it, or waits.
            let id = raw.id.clone();
            self.defer(SourcedEvent {
                position,
                event: Err(crate::outbox::RowError {
                    id,
                    aggregate_id: Some(aggregate.to_owned()),
                    reason,
                    raw: Some(Box::new(raw)),
                }),
            });
            return;
        }
        let parked = self.scheduler.drop_parked(aggregate);
        let event_id = raw.id.clone();
        let block = self
            .blocks
            .block(aggregate, event_id.as_deref(), reason, Instant::now());
        let (attempts, first_failed_at, reason) =
            (block.attempts, block.first_failed_at, block.reason.clone());
        let retry_in = block
            .until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        let give_up = count
            && self
                .settings
                .dead_letter
                .as_ref()
                .is_some_and(|d| attempts >= d.max_attempts);
        if !give_up {
            tracing::warn!(
                event_id = event_id.as_deref().unwrap_or("?"),
                aggregate_id = aggregate,
                attempts,
                retry_in = ?retry_in,
                held_back = parked.len(),
                reason = %reason,
                "event refused; its aggregate waits, other aggregates continue"
            );
            return;
        }
        tracing::warn!(
            event_id = event_id.as_deref().unwrap_or("?"),
            aggregate_id = aggregate,
            attempts,
            reason = %reason,
            "event dead-lettered after repeated refusals; see `outbox-relay dlq list`"
        );
        self.blocks.mark_dead(aggregate);
        self.telemetry.metrics.dead_lettered.increment(1);
        self.pending_letters.push(DeadLetter {
            seq: position.seq(),
            position,
            raw,
            reason,
            attempts,
            first_failed_at,
            last_failed_at: Utc::now(),
            follows: None,
        });
        for e in parked {
            self.defer(e);
        }
    }

    async fn push_pending(&mut self, ack_tx: &mpsc::Sender<AckCommand<P>>) {
        while !self.pending_letters.is_empty() || !self.pending_acks.is_empty() {
            let cmd = self.next_command();
            if ack_tx.send(cmd).await.is_err() {
                return;
            }
        }
    }
}

/// The row of an event as read, for a dead letter.
fn raw_of<P>(event: &SourcedEvent<P>) -> (RawRow, String) {
    match &event.event {
        Ok(e) => (e.to_raw(), e.id.clone()),
        Err(bad) => (
            bad.raw.as_deref().cloned().unwrap_or_default(),
            bad.id.clone().unwrap_or_else(|| "?".into()),
        ),
    }
}

async fn confirm_within(confirmation: Confirmation, timeout: Duration) -> Result<(), SinkError> {
    match tokio::time::timeout(timeout, confirmation).await {
        Ok(result) => result,
        Err(_) => Err(SinkError::Unavailable(format!(
            "no broker confirmation within relay.confirm_timeout ({}s)",
            timeout.as_secs()
        ))),
    }
}

pub(super) async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
