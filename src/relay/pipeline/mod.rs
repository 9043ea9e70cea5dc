//! One run of the pipeline: read → publish → confirm → acknowledge, until
//! shutdown or a failure that needs fresh connections.
//!
//! Three tasks: the reader fills a small channel with batches; the loop in
//! [`Pipeline::serve`] sends events to the broker through the
//! [`Scheduler`](super::scheduler::Scheduler), keeping up to `max_in_flight`
//! unconfirmed; the acker records confirmed positions (and dead letters) in
//! order. Progress is recorded only for confirmed messages and written dead
//! letters, so whatever ends a run, the next run re-reads from the last
//! recorded point.
//!
//! A refused event blocks its aggregate and is retried with backoff; after
//! `dead_letter.max_attempts` refusals it is dead-lettered, and the
//! aggregate's later events follow it there or wait in the outbox, per
//! `dead_letter.aggregate`, until an operator redrives or drops it.
//!
//! - `serve.rs`: the loop, one method per `select!` arm, and the intake state;
//! - `publish.rs`: what happens to one event (admit, send, confirm, refuse);
//! - `events.rs`: what a refusal leads to, logged and counted in one place;
//! - `tasks.rs`: the reader and acker tasks.

mod events;
mod publish;
mod serve;
mod tasks;
pub(crate) use tasks::failpoint_countdown;

use super::blocks::Blocks;
use crate::config::HoldPolicy;
use crate::envelope::Envelope;
use crate::errors::ErrorKind;
use crate::sink::{Sink, SinkError};
use crate::source::{Acker, Reader, RowPosition, SourceError};
use crate::telemetry::PipelineTelemetry;
use serve::Pipeline;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Why a run ended early.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error("broker: {0}")]
    Sink(#[from] SinkError),
    #[error("source: {0}")]
    Source(#[from] SourceError),
    #[error("{0} task stopped unexpectedly")]
    TaskLost(&'static str),
    /// No round trip on the ownership session succeeded for a lease after
    /// the lease ran out: the session is presumed gone (a silent network
    /// partition), and with it ownership.
    #[error(
        "the ownership session has not answered for {}s (relay.ownership_lease and as much again): giving ownership up and starting over",
        .0.as_secs()
    )]
    OwnershipUnconfirmed(std::time::Duration),
}

impl PipelineError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            PipelineError::Sink(e) => e.kind(),
            PipelineError::Source(e) => e.kind(),
            PipelineError::TaskLost(_) | PipelineError::OwnershipUnconfirmed(_) => {
                ErrorKind::Transient
            }
        }
    }
}

/// Where an event in the pipeline comes from: the source, or a dead letter
/// an operator asked the relay to publish again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Origin<P> {
    Source(P),
    Letter(i64),
}

impl<P: RowPosition> RowPosition for Origin<P> {
    fn seq(&self) -> Option<i64> {
        match self {
            Origin::Source(p) => p.seq(),
            Origin::Letter(_) => None,
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
    pub max_in_flight_bytes: usize,
    pub per_aggregate: Option<usize>,
    pub confirm_timeout: Duration,
    pub shutdown_timeout: Duration,
    pub dead_letter: Option<DeadLetterSettings>,
}

impl Settings {
    pub fn from_config(config: &crate::config::Config) -> Self {
        Settings {
            probe_interval: config.relay.standby_poll.max(Duration::from_secs(10)),
            batch_size: config.source.batch_size,
            max_in_flight: config.relay.max_in_flight,
            max_in_flight_bytes: config.relay.max_in_flight_bytes,
            per_aggregate: config.relay.max_in_flight_per_aggregate,
            confirm_timeout: config.relay.confirm_timeout,
            shutdown_timeout: config.relay.shutdown_timeout,
            dead_letter: config.dead_letter.enabled.then_some(DeadLetterSettings {
                max_attempts: config.dead_letter.max_attempts,
                policy: config.dead_letter.aggregate,
                refresh_interval: config.dead_letter.refresh_interval,
            }),
        }
    }
}

/// What a run reads its settings from and reports to.
pub struct Context<'a> {
    pub envelope: &'a Envelope,
    pub settings: &'a Settings,
    pub telemetry: &'a PipelineTelemetry,
    /// Nothing is sent while it is not valid.
    pub lease: std::sync::Arc<super::lease::Lease>,
    /// The shard this run relays (0 for the whole outbox), for health.
    pub shard: u32,
}

/// How a run that ended without a failure left what it and earlier owners
/// had sent: only [`Drained::All`] lets the next owner publish at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drained {
    /// The broker confirmed everything this run sent, the broker connection
    /// is closed, and the run had waited out the previous owner's lease (or
    /// took over from a clean stop): nothing of this owner or an earlier one
    /// can reach the broker any more.
    All,
    /// `relay.shutdown_timeout` ran out with messages unconfirmed: the broker
    /// may still take them.
    Abandoned,
    /// Everything this run sent was confirmed, but it stopped while still
    /// waiting out the previous owner's lease: messages of that owner (an
    /// earlier run of the same process, after a failure, as well) may still
    /// reach the broker.
    PreviousOwnerUnsettled,
}

impl Drained {
    /// A run that stopped before it sent anything: all drained, unless the
    /// previous owner's lease has not run out yet (its messages, those of
    /// this process's failed run before as well, may still be on their way).
    pub fn before_sending(lease: &super::lease::Lease) -> Drained {
        if lease.previous_owner_settled(tokio::time::Instant::now()) {
            Drained::All
        } else {
            Drained::PreviousOwnerUnsettled
        }
    }
}

/// Runs until `shutdown` (then drains and returns `Ok`) or a failure.
pub async fn run<R, A, K>(
    reader: R,
    acker: A,
    sink: K,
    cx: Context<'_>,
    blocks: &mut Blocks,
    shutdown: &CancellationToken,
) -> Result<Drained, PipelineError>
where
    R: Reader,
    A: Acker<Position = R::Position>,
    K: Sink,
{
    let lease = cx.lease.clone();
    let fence = sink.fence();
    cx.telemetry.health.relaying(cx.shard);
    let mut pipeline = Pipeline::start(reader, acker, sink, cx, blocks);
    // Whatever the loop waits for (the acker, most likely, stuck on the
    // silent session), a lease that cannot be renewed ends it.
    let result = tokio::select! {
        result = async {
            pipeline.load_dead_letters().await?;
            pipeline.serve(shutdown).await
        } => result,
        silent = lease.lost(tokio::time::Instant::now()) => Err(PipelineError::OwnershipUnconfirmed(silent)),
        called_back = fence_at_run_out(&lease, fence) => Err(called_back),
    };
    pipeline.finish(result).await
}

/// Each time the lease runs out, calls back what the broker client holds
/// (see [`crate::sink::Fence`]): a new owner may publish a tenth of a lease
/// later, and a message the client writes after that would follow its
/// messages. Ends the run when anything was unconfirmed (it is sent again);
/// never, for a client with nothing to call back. Whatever the loop is
/// waiting for meanwhile.
async fn fence_at_run_out(
    lease: &super::lease::Lease,
    fence: Option<crate::sink::Fence>,
) -> PipelineError {
    let Some(fence) = fence else {
        return std::future::pending().await;
    };
    loop {
        lease.ran_out().await;
        let called_back = fence().await;
        if called_back > 0 {
            return PipelineError::Sink(SinkError::Unavailable(
                format!(
                    "the ownership lease ran out while the broker client held {called_back} messages (or their \
                     reports): it was purged, as a new owner may be publishing soon; what was unconfirmed will be sent again"
                )
                .into(),
            ));
        }
        lease.wait_valid().await;
    }
}
