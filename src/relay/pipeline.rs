//! One run of the pipeline: read → publish → confirm → acknowledge, until
//! shutdown or a failure that needs fresh connections.
//!
//! Three tasks: the reader fills a small channel with batches; this loop
//! sends events to the broker through the [`Scheduler`], keeping up to
//! `max_in_flight` unconfirmed; the acker records confirmed positions in
//! batches. Progress is recorded only for confirmed messages, so whatever
//! ends a run, the next run re-reads from the last recorded point.

use super::scheduler::{Admission, Blocks, Scheduler};
use crate::envelope::Envelope;
use crate::sink::{Confirmation, Sink, SinkError};
use crate::source::{Acker, Reader, SourceError, SourcedEvent};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use std::future::Future;
use std::pin::Pin;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// Most positions recorded by one acknowledgement statement.
const MAX_ACK_BATCH: usize = 5_000;
/// How often an idle acker checks that it still holds ownership.
const ACKER_HEARTBEAT: Duration = Duration::from_secs(2);

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

/// Tunables of a run.
#[derive(Debug, Clone)]
pub struct Settings {
    pub batch_size: usize,
    pub max_in_flight: usize,
    pub per_aggregate: Option<usize>,
    pub confirm_timeout: Duration,
    pub shutdown_timeout: Duration,
}

struct Batch<P> {
    epoch: u64,
    events: Vec<SourcedEvent<P>>,
}

enum AckCommand<P> {
    Ack(Vec<P>),
    Flush(oneshot::Sender<()>),
}

type Done<P> = (P, String, String, Result<(), SinkError>);
type InFlight<P> = Pin<Box<dyn Future<Output = Done<P>> + Send>>;

struct Run<'a, P, K> {
    settings: &'a Settings,
    sink: K,
    envelope: &'a Envelope,
    blocks: &'a mut Blocks,
    scheduler: Scheduler<P>,
    in_flight: FuturesUnordered<InFlight<P>>,
    pending_acks: Vec<P>,
    /// Intake is closed while draining for shutdown or for a rewind.
    intake_closed: bool,
}

/// Runs until `shutdown` (then drains and returns `Ok`) or a failure.
pub async fn run<R, A, K>(
    reader: R,
    acker: A,
    sink: K,
    envelope: &Envelope,
    settings: &Settings,
    blocks: &mut Blocks,
    shutdown: &CancellationToken,
) -> Result<(), PipelineError>
where
    R: Reader,
    A: Acker<Position = R::Position>,
    K: Sink,
{
    let (batch_tx, mut batch_rx) = mpsc::channel(2);
    let (rewind_tx, rewind_rx) = mpsc::channel(4);
    let mut reader_task = AbortOnDropHandle::new(tokio::spawn(drive_reader(
        reader,
        settings.batch_size,
        batch_tx,
        rewind_rx,
    )));
    let (ack_tx, ack_rx) = mpsc::channel(4);
    let mut acker_task = AbortOnDropHandle::new(tokio::spawn(drive_acker(acker, ack_rx)));
    let mut run = Run {
        settings,
        sink,
        envelope,
        blocks,
        scheduler: Scheduler::new(settings.per_aggregate),
        in_flight: FuturesUnordered::new(),
        pending_acks: Vec::new(),
        intake_closed: false,
    };
    let mut epoch = 0u64;
    let mut rewinding = false;
    let mut drain_deadline: Option<Instant> = None;

    let result = loop {
        if run.scheduler.in_flight() == 0 && run.pending_acks.is_empty() {
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
        let intake = !run.intake_closed && run.scheduler.used() < settings.max_in_flight;
        let expiry = run.blocks.next_expiry().filter(|_| !run.intake_closed);
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
                run.push_acks(&ack_tx).await;
                break flush(&ack_tx).await;
            }
            // 3. Confirmations.
            Some(done) = run.in_flight.next(), if !run.in_flight.is_empty() => {
                if let Err(e) = run.complete(done).await {
                    break Err(e);
                }
            }
            // 4. Hand confirmed positions to the acker.
            permit = ack_tx.reserve(), if !run.pending_acks.is_empty() => match permit {
                Ok(p) => p.send(AckCommand::Ack(std::mem::take(&mut run.pending_acks))),
                Err(_) => break Err(task_error(&mut acker_task, "acker").await),
            },
            // 5. A block expired: drain, then re-read so the aggregate's events come back in order.
            _ = sleep_until_opt(expiry), if !rewinding => {
                let released = run.blocks.release_expired(Instant::now());
                tracing::info!(aggregates = released, "retrying refused events");
                rewinding = true;
                run.close_intake();
            }
            // 6. New events.
            batch = batch_rx.recv(), if intake => match batch {
                Some(b) if b.epoch == epoch => {
                    if let Err(e) = run.admit(b.events).await {
                        break Err(e);
                    }
                }
                Some(_) => {} // read before the last rewind; it will be read again
                None => break Err(task_error(&mut reader_task, "reader").await),
            },
            // 7. The acker failed (e.g. lost its connection, and with it ownership).
            res = &mut acker_task => break Err(joined(res, "acker")),
        }
    };
    if result.is_err() {
        // Record what the broker confirmed before giving up, to spare re-sends.
        run.push_acks(&ack_tx).await;
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

impl<P, K> Run<'_, P, K>
where
    P: Clone + Send + 'static,
    K: Sink,
{
    fn close_intake(&mut self) {
        self.intake_closed = true;
        // Parked events are unsent and unrecorded: they are read again later.
        self.scheduler.clear_parked();
    }

    async fn admit(&mut self, events: Vec<SourcedEvent<P>>) -> Result<(), PipelineError> {
        for event in events {
            match self.scheduler.admit(event, self.blocks) {
                Admission::Send(e) => self.dispatch(e).await?,
                Admission::Parked => {}
                Admission::Deferred(e) => {
                    tracing::debug!(
                        aggregate_id = e.aggregate_id(),
                        "aggregate blocked; event deferred"
                    );
                }
            }
        }
        Ok(())
    }

    async fn dispatch(&mut self, sourced: SourcedEvent<P>) -> Result<(), PipelineError> {
        let aggregate = sourced.aggregate_id().to_owned();
        let event = match sourced.event {
            Ok(e) => e,
            Err(bad) => {
                self.reject(&aggregate, bad.id.as_deref(), bad.reason);
                return Ok(());
            }
        };
        let message = self.envelope.build(&event);
        match self.sink.send(&event, message).await {
            Ok(confirmation) => {
                self.scheduler.sent(&aggregate);
                let timeout = self.settings.confirm_timeout;
                let position = sourced.position;
                let id = event.id;
                self.in_flight.push(Box::pin(async move {
                    let result = confirm_within(confirmation, timeout).await;
                    (position, aggregate, id, result)
                }));
                Ok(())
            }
            Err(SinkError::Rejected(reason)) => {
                self.reject(&aggregate, Some(&event.id), reason);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    async fn complete(
        &mut self,
        (position, aggregate, id, result): Done<P>,
    ) -> Result<(), PipelineError> {
        match result {
            Ok(()) => {
                self.pending_acks.push(position);
                self.blocks.clear(&aggregate);
                if let Some(next) = self.scheduler.finished(&aggregate) {
                    self.dispatch(next).await?;
                }
                Ok(())
            }
            Err(SinkError::Rejected(reason)) => {
                self.scheduler.drop_parked(&aggregate);
                self.scheduler.finished(&aggregate);
                self.reject(&aggregate, Some(&id), reason);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The event cannot be published now: hold its aggregate back, keep the row unsent.
    fn reject(&mut self, aggregate: &str, event_id: Option<&str>, reason: String) {
        let dropped = self.scheduler.drop_parked(aggregate);
        let block = self
            .blocks
            .block(aggregate, event_id, reason, Instant::now());
        let retry_in = block
            .until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        tracing::warn!(
            event_id = event_id.unwrap_or("?"),
            aggregate_id = aggregate,
            attempts = block.attempts,
            retry_in = ?retry_in,
            held_back = dropped,
            reason = %block.reason,
            "event refused; its aggregate waits, other aggregates continue"
        );
    }

    async fn push_acks(&mut self, ack_tx: &mpsc::Sender<AckCommand<P>>) {
        if !self.pending_acks.is_empty() {
            let acks = std::mem::take(&mut self.pending_acks);
            let _ = ack_tx.send(AckCommand::Ack(acks)).await;
        }
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

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

async fn flush<P>(ack_tx: &mpsc::Sender<AckCommand<P>>) -> Result<(), PipelineError> {
    let (tx, rx) = oneshot::channel();
    ack_tx
        .send(AckCommand::Flush(tx))
        .await
        .map_err(|_| PipelineError::TaskLost("acker"))?;
    rx.await.map_err(|_| PipelineError::TaskLost("acker"))
}

fn joined(
    res: Result<Result<(), SourceError>, tokio::task::JoinError>,
    name: &'static str,
) -> PipelineError {
    match res {
        Ok(Ok(())) => PipelineError::TaskLost(name),
        Ok(Err(e)) => e.into(),
        Err(_) => PipelineError::TaskLost(name),
    }
}

async fn task_error(
    task: &mut AbortOnDropHandle<Result<(), SourceError>>,
    name: &'static str,
) -> PipelineError {
    match tokio::time::timeout(Duration::from_secs(5), task).await {
        Ok(res) => joined(res, name),
        Err(_) => PipelineError::TaskLost(name),
    }
}

/// Reads batches into the channel; a rewind command resets the reader and
/// tags later batches with the new epoch.
async fn drive_reader<R: Reader>(
    mut reader: R,
    batch_size: usize,
    tx: mpsc::Sender<Batch<R::Position>>,
    mut rewinds: mpsc::Receiver<u64>,
) -> Result<(), SourceError> {
    let mut epoch = 0;
    loop {
        let events = tokio::select! {
            biased;
            cmd = rewinds.recv() => match cmd {
                Some(e) => { reader.rewind(); epoch = e; continue; }
                None => { reader.close().await; return Ok(()); }
            },
            events = reader.next_batch(batch_size) => events?,
        };
        tokio::select! {
            biased;
            cmd = rewinds.recv() => match cmd {
                Some(e) => { reader.rewind(); epoch = e; }
                None => { reader.close().await; return Ok(()); }
            },
            sent = tx.send(Batch { epoch, events }) => if sent.is_err() { return Ok(()) },
            // Waiting for room (backpressure): let the reader keep its connection alive.
            failed = reader.maintain() => failed?,
        }
    }
}

/// Crash-injection hook for the test suite: `OUTBOX_RELAY_FAILPOINT=abort-before-ack:N`
/// aborts the process just before the N-th acknowledgement, i.e. after the
/// broker confirmed messages and before their rows are marked (or their WAL
/// position reported): the most dangerous moment to crash.
fn abort_before_ack_countdown() -> Option<u32> {
    std::env::var("OUTBOX_RELAY_FAILPOINT")
        .ok()?
        .strip_prefix("abort-before-ack:")?
        .parse()
        .ok()
}

/// Records confirmed positions, merging queued commands into one statement.
async fn drive_acker<A: Acker>(
    mut acker: A,
    mut rx: mpsc::Receiver<AckCommand<A::Position>>,
) -> Result<(), SourceError> {
    let mut countdown = abort_before_ack_countdown();
    loop {
        let first = match tokio::time::timeout(ACKER_HEARTBEAT, rx.recv()).await {
            Ok(Some(cmd)) => cmd,
            Ok(None) => return Ok(()),
            Err(_) => {
                acker.heartbeat().await?;
                continue;
            }
        };
        let mut positions = Vec::new();
        let mut flushes = Vec::new();
        let mut next = Some(first);
        while let Some(cmd) = next {
            match cmd {
                AckCommand::Ack(p) => positions.extend(p),
                AckCommand::Flush(done) => flushes.push(done),
            }
            next = if positions.len() < MAX_ACK_BATCH {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        if let Some(n) = countdown.as_mut()
            && !positions.is_empty()
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                eprintln!(
                    "failpoint abort-before-ack: aborting with {} confirmed, unrecorded events",
                    positions.len()
                );
                std::process::abort();
            }
        }
        acker.ack(positions).await?;
        for done in flushes {
            let _ = done.send(());
        }
    }
}
