//! `outbox-relay run`: every pipeline of the configuration, with the HTTP
//! endpoints, the metrics sampler and the scheduled retention, until shutdown.

use super::{ConfigFile, Failure};
use crate::config::Config;
use crate::telemetry::health::Health;
use crate::telemetry::{self, PipelineTelemetry};
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    #[error(
        "cannot listen on http.address {address}: {source}; choose a free address or set http.enabled = false"
    )]
    Listen {
        address: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Trace(#[from] telemetry::trace::TraceError),
}

/// `outbox-relay run`: logging, signal handlers, then [`run`] until SIGTERM
/// or SIGINT.
pub async fn command(file: &ConfigFile) -> Result<(), Failure> {
    let configs = file.load_all()?;
    telemetry::init(&configs[0].log);
    let stop_within = configs
        .iter()
        .map(|c| c.relay.shutdown_timeout)
        .max()
        .unwrap_or_default();
    let shutdown = crate::shutdown::on_signals(stop_within)
        .map_err(|e| Failure::runtime(format!("cannot install signal handlers: {e}")))?;
    tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %file.path.display(), pipelines = configs.len(), "outbox-relay starting");
    run(configs, shutdown).await.map_err(|e| {
        tracing::error!(error = %e, "cannot start");
        Failure::runtime(e)
    })?;
    if PANICKED.load(Ordering::SeqCst) {
        return Err(Failure::runtime(
            "a task of the relay panicked (logged above); the relay stopped",
        ));
    }
    Ok(())
}

/// Runs until `shutdown`; every pipeline drains before this returns.
pub async fn run(configs: Vec<Config>, shutdown: CancellationToken) -> Result<(), DaemonError> {
    let Some(first) = configs.first() else {
        return Ok(());
    };
    // One exporter for the process; flushed once every pipeline has drained.
    let tracer = telemetry::trace::EventTracer::start(&first.telemetry.otlp)?;
    let health = Arc::new(Health::default());
    // Nothing renders the metrics without the endpoint, and the recorder
    // keeps histogram samples until a render or an upkeep folds them.
    let prometheus = first
        .http
        .enabled
        .then(telemetry::metrics::install)
        .flatten();
    let mut tasks = JoinSet::new();
    if first.http.enabled {
        let address: SocketAddr = first
            .http
            .address
            .parse()
            .map_err(|_| DaemonError::Listen {
                address: first.http.address.clone(),
                source: std::io::Error::other("not an address"),
            })?;
        let server = telemetry::http::bind(address, health.clone(), prometheus, shutdown.clone())
            .await
            .map_err(|source| DaemonError::Listen {
                address: first.http.address.clone(),
                source,
            })?;
        tracing::info!(%address, "serving /metrics, /healthz and /readyz");
        tasks.spawn(server);
    }
    // The stop's own limit is the longest of the pipelines' (src/shutdown.rs).
    let flush_within = configs
        .iter()
        .map(|c| c.relay.shutdown_timeout)
        .max()
        .unwrap_or(first.relay.shutdown_timeout);
    for config in configs {
        let t = PipelineTelemetry::traced(&config, &tracer);
        health.register(t.health.clone());
        tasks.spawn(pipeline(config, t, shutdown.clone()));
    }
    let drained = async {
        while let Some(ended) = tasks.join_next().await {
            said(ended, &shutdown)
        }
    };
    tracer
        .run_until_stopped(&shutdown, flush_within, drained)
        .await;
    Ok(())
}

/// One pipeline: once its outbox chose the marking (not ready meanwhile;
/// other pipelines do not wait), its gauges, retention, fold and relay,
/// until `shutdown`.
async fn pipeline(config: Config, t: PipelineTelemetry, shutdown: CancellationToken) {
    let Some(config) = crate::ops::marking::chosen_until(config, &t, &shutdown).await else {
        return;
    };
    let mut tasks = JoinSet::new();
    tasks.spawn(crate::ops::gauges::sample(
        config.clone(),
        t.clone(),
        shutdown.clone(),
    ));
    {
        let (config, metrics, token) = (config.clone(), t.metrics.clone(), shutdown.clone());
        tasks.spawn(async move {
            crate::ops::retention::run_scheduled(&config, Some(metrics), token).await
        });
    }
    {
        let (config, metrics, token) = (config.clone(), t.metrics.clone(), shutdown.clone());
        tasks.spawn(
            async move { crate::ops::fold::run_scheduled(&config, Some(metrics), token).await },
        );
    }
    {
        let shutdown = shutdown.clone();
        tasks.spawn(async move { crate::relay::run_observed(&config, t, shutdown).await });
    }
    while let Some(ended) = tasks.join_next().await {
        said(ended, &shutdown)
    }
}

/// Whether a task of the process panicked: `run` then exits 1.
static PANICKED: AtomicBool = AtomicBool::new(false);

/// A task of the process that ended by a panic (a defect: every input error
/// is an error value) is said at error level, and stops the process as a
/// stop signal does: what panicked (a pipeline's supervisor, say) no longer
/// works, and may have left its health saying otherwise, so the process
/// exits 1 for its supervisor (systemd, Kubernetes) to start it again from
/// what was recorded, rather than run on as a half.
fn said(ended: Result<(), tokio::task::JoinError>, shutdown: &CancellationToken) {
    if let Err(e) = ended
        && e.is_panic()
    {
        tracing::error!(error = %e, "a task of the relay panicked (a defect: please report it); stopping, to be started again");
        PANICKED.store(true, Ordering::SeqCst);
        shutdown.cancel();
    }
}
