//! The supervisor of one shard (or the whole outbox): wait to own it, relay
//! while owning it, and start over after every failure, with backoff.
//!
//! The supervisor only decides *when*; a [`Backend`] does the work: take the
//! ownership lock, and run a pipeline while it is held. [`super::Postgres`]
//! is the real backend; the pipeline simulation drives this same supervisor
//! with an in-memory one.

use super::RelayError;
use super::blocks::Blocks;
use super::handoff::Takeover;
use super::lease::Lease;
use super::shards::{Balance, Shard};
use crate::backoff::Backoff;
use crate::config::Config;
use crate::replication::Lsn;
use crate::source::cdc::{self, Progress, SharedProgress};
use crate::telemetry::PipelineTelemetry;
use crate::telemetry::events::{InternalEvent, PipelineInterrupted};
use crate::telemetry::health::PipelineHealth;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// What a run while owning the outbox keeps across runs, and reports to.
pub struct Owned<'a> {
    pub shard: Shard,
    pub telemetry: &'a PipelineTelemetry,
    /// Refused and dead aggregates: a refused event keeps its own retry
    /// schedule across reconnects.
    pub blocks: &'a mut Blocks,
    /// What the CDC source has confirmed survives reconnects, so a restarted
    /// stream skips it instead of sending it twice.
    pub progress: &'a SharedProgress,
    /// Publishing is fenced by this (see [`super::lease`]).
    pub lease: Arc<Lease>,
    pub shutdown: &'a CancellationToken,
}

/// What [`Backend::acquire`] won: the ownership session, what the
/// previous owner left, and when the round trip that won it was sent.
pub type Claimed<O> = (O, Takeover, Instant);

/// The outside world of one supervised shard.
pub trait Backend: Sync {
    /// Proof of ownership: the session that holds the ownership lock.
    type Owner: Send;

    /// Waits until this instance owns `shard` (and its share allows one
    /// more), and claims it (see [`super::handoff`]); `None` on shutdown.
    /// Reports a healthy standby meanwhile.
    fn acquire(
        &self,
        shard: Shard,
        balance: &Balance,
        health: &PipelineHealth,
        shutdown: &CancellationToken,
    ) -> impl Future<Output = Result<Option<Claimed<Self::Owner>>, RelayError>> + Send;

    /// Connects the source and the sink and relays until `run.shutdown` or
    /// a failure; after a clean stop it records one for the next owner.
    fn relay(
        &self,
        owner: Self::Owner,
        run: Owned<'_>,
    ) -> impl Future<Output = Result<RunEnd, RelayError>> + Send;
}

/// How [`Backend::relay`] ended without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// `run.shutdown` was cancelled, and what was in flight is drained.
    Stopped,
    /// The run drained what was in flight and ended to read the outbox
    /// another way (`source.mode = "auto"` found CDC possible again): start
    /// the next run at once.
    SwitchSource,
}

/// How a run ended without an error.
enum Stop {
    Shutdown,
    /// The shard was given back to balance the load between instances.
    Released,
    /// The source is switching: no backoff, this is no failure.
    Switch,
}

/// Owns and relays one shard (or the whole outbox) until `shutdown`.
/// Failures never end it: each is logged (at error level with what to fix
/// when it will not pass by itself) and retried after a jittered, growing delay.
pub async fn supervise<B: Backend>(
    config: &Config,
    backend: &B,
    shard: Shard,
    balance: Arc<Balance>,
    telemetry: PipelineTelemetry,
    shutdown: CancellationToken,
) {
    let relay = &config.relay;
    let mut blocks = Blocks::new(relay.reject_retry_base, relay.reject_retry_max);
    let progress: SharedProgress =
        Arc::new(Mutex::new(Progress::new(Lsn::default(), cdc::SKIP_MEMORY)));
    let mut backoff = Backoff::new(relay.retry_base, relay.retry_max);
    loop {
        let started = Instant::now();
        let result = run_once(
            config,
            backend,
            &balance,
            (shard, &telemetry, &mut blocks, &progress),
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
            Ok(Stop::Switch) => {
                backoff.reset();
                continue;
            }
            Ok(Stop::Released) => {
                backoff.reset();
                // Give the other instances a moment to take the shard.
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(relay.standby_poll * 3) => {}
                }
                continue;
            }
            Err(e) => e,
        };
        telemetry
            .health
            .failing(shard.index, &failure_text(shard, &e));
        if started.elapsed() > relay.retry_max {
            backoff.reset();
        }
        let delay = backoff.next_delay();
        if shard.count > 1 && backoff.attempts() >= 2 {
            step_back(relay, shard, &balance, &e);
        }
        PipelineInterrupted {
            metrics: &telemetry.metrics,
            error: &e,
            kind: e.kind(),
            attempt: backoff.attempts(),
            retry_in: delay,
        }
        .emit();
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(delay) => {}
        }
    }
}

/// A run's failure as `/readyz` shows it: with shards, which one.
fn failure_text(shard: Shard, e: &RelayError) -> String {
    match shard.count {
        1 => e.to_string(),
        n => format!("shard {}/{n}: {e}", shard.index),
    }
}

/// A shard failed again right after a retry: the other instances take
/// this one's shards for a while (see [`Balance::step_back`]).
fn step_back(relay: &crate::config::RelayConfig, shard: Shard, balance: &Balance, e: &RelayError) {
    let wait = super::shards::step_back_wait(relay);
    if balance.step_back(wait) {
        tracing::warn!(
            shard = shard.index,
            wait_s = wait.as_secs(),
            error = %e,
            "this shard's runs keep failing: stepping back so that other instances take this one's shards"
        );
    }
}

/// What a run keeps across runs: its shard, telemetry, blocks and CDC progress.
type Kept<'a> = (
    Shard,
    &'a PipelineTelemetry,
    &'a mut Blocks,
    &'a SharedProgress,
);

/// A new owner's lease: at once after a clean stop, else after the previous one's.
fn lease_for(takeover: Takeover, config: &Config, shard: Shard, sent_at: Instant) -> Lease {
    lease_from_now(takeover, config, shard).proven_at(sent_at)
}

fn lease_from_now(takeover: Takeover, config: &Config, shard: Shard) -> Lease {
    let (lease, now) = (config.relay.ownership_lease, Instant::now());
    match takeover {
        Takeover::AfterCleanStop => {
            tracing::info!(
                shard = shard.index,
                "the previous owner stopped cleanly: publishing at once"
            );
            Lease::after_clean_stop(lease, now)
        }
        Takeover::NewOutbox => {
            tracing::info!(
                shard = shard.index,
                "nobody has relayed this outbox since migrate created it: publishing at once"
            );
            Lease::after_clean_stop(lease, now)
        }
        Takeover::Unknown => {
            tracing::info!(
                shard = shard.index,
                wait_ms = (lease + lease / 10).as_millis() as u64,
                "waiting out the previous owner's lease before publishing"
            );
            Lease::acquired(lease, now)
        }
    }
}

async fn run_once<B: Backend>(
    config: &Config,
    backend: &B,
    balance: &Arc<Balance>,
    (shard, telemetry, blocks, progress): Kept<'_>,
    shutdown: &CancellationToken,
) -> Result<Stop, RelayError> {
    let Some((owner, takeover, sent_at)) = backend
        .acquire(shard, balance, &telemetry.health, shutdown)
        .await?
    else {
        return Ok(Stop::Shutdown);
    };
    let lease = Arc::new(lease_for(takeover, config, shard, sent_at));
    balance.acquired();
    telemetry.health.acquired(shard.index);
    if super::pipeline::failpoint_countdown("panic-after-acquire").is_some() {
        panic!("failpoint panic-after-acquire");
    }
    // Gives the shard back when this instance holds more than its share.
    let run_token = shutdown.child_token();
    let released = Arc::new(AtomicBool::new(false));
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
                    released.store(true, Ordering::SeqCst);
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
    telemetry.metrics.active.set(1.0);
    let run = Owned {
        shard,
        telemetry,
        blocks,
        progress,
        lease,
        shutdown: &run_token,
    };
    let result = backend.relay(owner, run).await;
    drop(watcher);
    telemetry.health.released(shard.index);
    telemetry.show_active();
    if released.load(Ordering::SeqCst) {
        return result.map(|_| Stop::Released);
    }
    balance.released();
    result.map(|end| match end {
        RunEnd::Stopped => Stop::Shutdown,
        RunEnd::SwitchSource => Stop::Switch,
    })
}
