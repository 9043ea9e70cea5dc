//! The relay: become the active instance, build the pipeline, run it, and
//! start over after failures.
//!
//! Ownership is a PostgreSQL session advisory lock held on the connection
//! that also marks rows sent. Only one session can hold it, so only one
//! instance publishes an outbox; a standby waits on `pg_try_advisory_lock`
//! and takes over within `relay.standby_poll` once the holder's session ends.
//! Because marking uses that same session, an instance that lost the lock
//! (its session was terminated, its network cut) cannot mark rows any more.

mod backoff;
mod pipeline;
pub mod scheduler;
pub mod shards;
mod tasks;

pub use backoff::Backoff;
pub use pipeline::{PipelineError, Settings};

use crate::config::{Config, SourceMode};
use crate::db::DbError;
use crate::envelope::Envelope;
use crate::outbox::inspect::{self, TableProblem};
use crate::sink::{AnySink, SinkError};
use crate::source::cdc::{self, CdcAcker, CdcReader, Progress, SharedProgress};
use crate::source::polling::{PollingAcker, PollingReader};
use crate::source::record::RowRecorder;
use crate::source::replication::Lsn;
use crate::source::{SourceError, ownership_key};
use crate::telemetry::PipelineTelemetry;
use crate::telemetry::health::PipelineHealth;
use scheduler::Blocks;
use shards::{Balance, Shard};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

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
    pub fn is_retryable(&self) -> bool {
        match self {
            RelayError::Db(e) => e.is_retryable(),
            RelayError::Table(TableProblem::Query(e)) => crate::db::is_retryable_pg(e),
            RelayError::Table(_) => false,
            RelayError::Pipeline(e) => e.is_retryable(),
        }
    }
}

/// Runs the relay until `shutdown`. Failures never end it: each is logged
/// (at error level with what to fix when it will not pass by itself) and
/// retried after a jittered, growing delay.
pub async fn run(config: &Config, shutdown: CancellationToken) {
    run_observed(config, PipelineTelemetry::new(config), shutdown).await;
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
        supervise(
            config,
            Shard::whole(),
            Balance::unlimited(),
            telemetry,
            shutdown,
        )
        .await;
    }
}

/// How a run ended without an error.
enum Stop {
    Shutdown,
    /// The shard was given back to balance the load between instances.
    Released,
}

/// Owns and relays one shard (or the whole outbox) until `shutdown`.
pub(crate) async fn supervise(
    config: &Config,
    shard: Shard,
    balance: Arc<Balance>,
    telemetry: PipelineTelemetry,
    shutdown: CancellationToken,
) {
    let relay = &config.relay;
    let mut blocks = Blocks::new(relay.reject_retry_base, relay.reject_retry_max);
    // What the CDC source has confirmed survives reconnects, so a restarted
    // stream skips it instead of sending it twice.
    let progress: SharedProgress =
        Arc::new(Mutex::new(Progress::new(Lsn::default(), cdc::SKIP_MEMORY)));
    let mut backoff = Backoff::new(relay.retry_base, relay.retry_max);
    loop {
        let started = Instant::now();
        let result = run_once(
            config,
            shard,
            &balance,
            &telemetry,
            &mut blocks,
            &progress,
            &shutdown,
        )
        .await;
        if shutdown.is_cancelled() {
            if let Err(e) = result {
                tracing::warn!(error = %e, "stopped with an error during shutdown");
            }
            return;
        }
        let e = match result {
            Ok(Stop::Shutdown) => return,
            Ok(Stop::Released) => {
                // Give the other instances a moment to take the shard.
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(relay.standby_poll * 3) => {}
                }
                continue;
            }
            Err(e) => e,
        };
        telemetry.health.failing(&e.to_string());
        telemetry.metrics.restarts.increment(1);
        if started.elapsed() > relay.retry_max {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        if e.is_retryable() {
            tracing::warn!(error = %e, attempt = backoff.attempts(), retry_in = ?delay, "relay interrupted; reconnecting");
        } else {
            tracing::error!(error = %e, attempt = backoff.attempts(), retry_in = ?delay, "relay cannot work until this is fixed; retrying");
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

async fn run_once(
    config: &Config,
    shard: Shard,
    balance: &Arc<Balance>,
    telemetry: &PipelineTelemetry,
    blocks: &mut Blocks,
    progress: &SharedProgress,
    shutdown: &CancellationToken,
) -> Result<Stop, RelayError> {
    let Some(owner) =
        acquire_ownership(config, shard, balance, &telemetry.health, shutdown).await?
    else {
        return Ok(Stop::Shutdown);
    };
    balance.acquired();
    telemetry.health.acquired();
    // Gives the shard back when this instance holds more than its share.
    let run_token = shutdown.child_token();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let (token, released, balance, every) = (
            run_token.clone(),
            released.clone(),
            balance.clone(),
            config.relay.standby_poll,
        );
        AbortOnDropHandle::new(tokio::spawn(async move {
            loop {
                tokio::time::sleep(every).await;
                if balance.should_release() {
                    released.store(true, std::sync::atomic::Ordering::SeqCst);
                    tracing::info!(
                        shard = shard.index,
                        "giving this shard back to balance the instances"
                    );
                    token.cancel();
                    return;
                }
            }
        }))
    };
    let result = relay_owned(
        config, shard, owner, telemetry, blocks, progress, &run_token,
    )
    .await;
    drop(watcher);
    telemetry.health.released();
    telemetry
        .metrics
        .active
        .set(if telemetry.health.is_active() {
            1.0
        } else {
            0.0
        });
    if released.load(std::sync::atomic::Ordering::SeqCst) {
        return result.map(|()| Stop::Released);
    }
    balance.released();
    result.map(|()| Stop::Shutdown)
}

/// Relays while holding ownership (the `owner` session).
async fn relay_owned(
    config: &Config,
    shard: Shard,
    owner: Client,
    telemetry: &PipelineTelemetry,
    blocks: &mut Blocks,
    progress: &SharedProgress,
    shutdown: &CancellationToken,
) -> Result<(), RelayError> {
    telemetry.metrics.active.set(1.0);
    let table = &config.outbox.table;
    let columns =
        inspect::resolve_table(&owner, table, &config.outbox.columns, config.relay.mark).await?;
    let envelope = Envelope::new(&config.envelope);
    let settings = Settings {
        probe_interval: config
            .relay
            .standby_poll
            .max(std::time::Duration::from_secs(10)),
        batch_size: config.source.batch_size,
        max_in_flight: config.relay.max_in_flight,
        per_aggregate: config
            .relay
            .max_in_flight_per_aggregate
            .or(config.sink.default_in_flight_per_aggregate()),
        confirm_timeout: config.relay.confirm_timeout,
        shutdown_timeout: config.relay.shutdown_timeout,
        dead_letter: config
            .dead_letter
            .enabled
            .then_some(pipeline::DeadLetterSettings {
                max_attempts: config.dead_letter.max_attempts,
                policy: config.dead_letter.aggregate,
                refresh_interval: config.dead_letter.refresh_interval,
            }),
    };
    let dead_letters = config
        .dead_letter
        .enabled
        .then(|| config.dead_letter.table_name(table));
    let recorder = RowRecorder::new(owner, table, config.relay.mark, dead_letters.as_ref()).await?;
    let cx = pipeline::Context {
        envelope: &envelope,
        settings: &settings,
        telemetry,
    };
    match config.source.mode {
        SourceMode::Polling => {
            let reader = PollingReader::connect(
                &config.database,
                table,
                &columns,
                &config.source.polling,
                shard,
            )
            .await?;
            let acker = PollingAcker::new(recorder);
            let sink = AnySink::connect(&config.sink).await?;
            tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events");
            pipeline::run(reader, acker, sink, cx, blocks, shutdown).await?;
            tracing::info!("stopped cleanly");
            Ok(())
        }
        SourceMode::Cdc => {
            let reader = CdcReader::connect(config, &columns, progress.clone()).await?;
            let acker = CdcAcker::new(recorder, progress.clone());
            let sink = AnySink::connect(&config.sink).await?;
            tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events from the replication slot");
            pipeline::run(reader, acker, sink, cx, blocks, shutdown).await?;
            tracing::info!("stopped cleanly");
            Ok(())
        }
    }
}

/// Connects and waits until this instance holds the shard's advisory lock
/// (and its share allows one more). Returns `None` on shutdown.
pub async fn acquire_ownership(
    config: &Config,
    shard: Shard,
    balance: &Balance,
    health: &PipelineHealth,
    shutdown: &CancellationToken,
) -> Result<Option<Client>, RelayError> {
    let key = shard.lock_key(&ownership_key(&config.outbox.table));
    let client = crate::db::connect(&config.database, None).await?;
    let mut announced = false;
    loop {
        if !balance.may_acquire() {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(config.relay.standby_poll) => {}
            }
            continue;
        }
        let locked: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&key],
            )
            .await
            .map_err(|e| DbError::query("taking the ownership lock", e))?
            .get(0);
        if locked {
            return Ok(Some(client));
        }
        // The database answers and another instance is active: a healthy standby.
        health.healthy();
        if !announced && shard.count == 1 {
            tracing::info!(table = %config.outbox.table, "standby: another instance is active; waiting to take over");
            announced = true;
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Ok(None),
            _ = tokio::time::sleep(config.relay.standby_poll) => {}
        }
    }
}
