//! Logging: text or JSON lines on stderr, filtered by `log.level` (or `RUST_LOG`).

use crate::config::{LogConfig, LogFormat};
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

const QUIET_AMQP_CLIENT: &str = "lapin=error";

/// Installs the global subscriber; a second call does nothing.
pub fn init(config: &LogConfig) {
    let (filter, spec) = match std::env::var("RUST_LOG") {
        Ok(spec) if EnvFilter::try_new(&spec).is_ok() => (EnvFilter::new(&spec), spec),
        _ => match EnvFilter::try_new(&config.level) {
            Ok(f) => (f, config.level.clone()),
            Err(_) => (EnvFilter::new("info"), "info".to_owned()),
        },
    };
    // The AMQP client logs whole messages (event payloads) at warn when a
    // publish fails; keep payloads out of logs unless asked for by name.
    let filter = match QUIET_AMQP_CLIENT.parse() {
        Ok(quiet) if !spec.contains("lapin") => filter.add_directive(quiet),
        _ => filter,
    };
    // Colours only on a terminal: not in files, journald or `docker logs`.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}

pub mod health;
pub mod http;
pub mod metrics;

use crate::config::Config;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// A pipeline's health and metric handles, shared by its tasks.
#[derive(Clone)]
pub struct PipelineTelemetry {
    pub health: Arc<health::PipelineHealth>,
    pub metrics: metrics::PipelineMetrics,
}

impl PipelineTelemetry {
    pub fn new(config: &Config) -> Self {
        PipelineTelemetry {
            health: health::PipelineHealth::new(&config.name, config.relay.confirm_timeout),
            metrics: metrics::PipelineMetrics::new(&config.name, config.sink.kind()),
        }
    }
}

/// Refreshes the backlog, oldest-unsent, dead-letter and slot gauges until `shutdown`.
pub async fn sample(config: Config, telemetry: PipelineTelemetry, shutdown: CancellationToken) {
    let m = &telemetry.metrics;
    let mut client: Option<tokio_postgres::Client> = None;
    loop {
        m.active.set(if telemetry.health.is_active() {
            1.0
        } else {
            0.0
        });
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = crate::db::connect(&config.database, None).await.ok();
        }
        if let Some(c) = &client {
            match crate::status::snapshot(c, &config, false).await {
                Ok(s) => {
                    m.backlog.set(s.backlog as f64);
                    m.oldest_unsent_age
                        .set(s.oldest_unsent_age_seconds.unwrap_or(0.0));
                    if let Some(n) = s.dead_letters {
                        m.dead_letters.set(n as f64);
                    }
                    if let Some(slot) = s.slot {
                        m.slot_retained_wal
                            .set(slot.retained_wal_bytes.unwrap_or(0) as f64);
                        m.slot_confirmed_lag
                            .set(slot.confirmed_lag_bytes.unwrap_or(0) as f64);
                    }
                }
                Err(e) => tracing::debug!(error = %e, "metrics sample failed"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.http.sample_interval) => {}
        }
    }
}
