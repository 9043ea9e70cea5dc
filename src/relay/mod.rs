//! The relay: become the active instance, build the pipeline, run it, and
//! start over after failures.
//!
//! Ownership is a PostgreSQL session advisory lock held on the connection
//! that also marks rows sent. Only one session can hold it, so only one
//! instance publishes an outbox; a standby waits on `pg_try_advisory_lock`
//! and takes over within `relay.standby_poll` once the holder's session ends.
//! Because marking uses that same session, an instance that lost the lock
//! (its session was terminated, its network cut) cannot mark rows any more.

mod auto;
pub mod blocks;
pub mod handoff;
pub mod lease;
pub(crate) mod pipeline;
mod postgres;
pub mod scheduler;
pub mod shards;
pub(crate) mod supervise;

pub use pipeline::{PipelineError, Settings};
pub use postgres::Postgres;
pub use supervise::{Backend, Claimed, Owned, RunEnd};

use crate::config::Config;
use crate::db::DbError;
use crate::errors::ErrorKind;
use crate::outbox::inspect::TableProblem;
use crate::sink::SinkError;
use crate::source::SourceError;
use crate::telemetry::PipelineTelemetry;
use shards::{Balance, Shard};
use tokio_util::sync::CancellationToken;

/// Why a run of the relay stopped.
#[derive(Debug, thiserror::Error)]
pub enum RelayError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Table(#[from] TableProblem),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
}

impl From<SinkError> for RelayError {
    fn from(e: SinkError) -> Self {
        RelayError::Pipeline(e.into())
    }
}

impl From<SourceError> for RelayError {
    fn from(e: SourceError) -> Self {
        RelayError::Pipeline(e.into())
    }
}

impl RelayError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            RelayError::Db(e) => e.kind(),
            RelayError::Table(e) => e.kind(),
            RelayError::Pipeline(e) => e.kind(),
        }
    }
}

/// Runs the relay until `shutdown`. Failures never end it: each is logged
/// (at error level with what to fix when it will not pass by itself) and
/// retried after a jittered, growing delay.
pub async fn run(config: &Config, shutdown: CancellationToken) {
    let tracer = crate::telemetry::trace::EventTracer::start(&config.telemetry.otlp)
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "continuing without traces");
            Default::default()
        });
    let telemetry = PipelineTelemetry::traced(config, &tracer);
    let timeout = config.relay.shutdown_timeout;
    let drained = run_observed(config, telemetry, shutdown.clone());
    tracer.run_until_stopped(&shutdown, timeout, drained).await;
}

/// As [`run`], reporting health and metrics through `telemetry`.
pub async fn run_observed(
    config: &Config,
    telemetry: PipelineTelemetry,
    shutdown: CancellationToken,
) {
    if config.relay.shards > 1 {
        shards::run(config, telemetry, shutdown).await;
    } else {
        supervise_shard(
            config,
            Shard::whole(),
            Balance::unlimited(),
            telemetry,
            shutdown,
        )
        .await;
    }
}

/// Owns and relays one shard (or the whole outbox) of `config` until `shutdown`.
pub(crate) async fn supervise_shard(
    config: &Config,
    shard: Shard,
    balance: std::sync::Arc<Balance>,
    telemetry: PipelineTelemetry,
    shutdown: CancellationToken,
) {
    supervise::supervise(
        config,
        &Postgres::new(config),
        shard,
        balance,
        telemetry,
        shutdown,
    )
    .await;
}
