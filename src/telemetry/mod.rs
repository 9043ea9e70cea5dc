//! Logging: text or JSON lines on stderr, filtered by `log.level` (or `RUST_LOG`);
//! metrics, health, and a span per event when `telemetry.otlp.endpoint` is set
//! ([`trace`]).

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

pub mod events;
pub mod health;
pub mod http;
pub mod metrics;
pub mod trace;

use crate::config::Config;
use std::sync::Arc;

/// A pipeline's health and metric handles, and its event tracer, shared by its tasks.
#[derive(Clone)]
pub struct PipelineTelemetry {
    pub health: Arc<health::PipelineHealth>,
    pub metrics: metrics::PipelineMetrics,
    /// Off unless made with [`Self::traced`].
    pub tracer: trace::EventTracer,
}

impl PipelineTelemetry {
    pub fn new(config: &Config) -> Self {
        PipelineTelemetry {
            health: health::PipelineHealth::new(&config.name, config.relay.confirm_timeout),
            metrics: metrics::PipelineMetrics::new(
                &config.name,
                config.sink.kind(),
                config.source.mode.name(),
            ),
            tracer: trace::EventTracer::default(),
        }
    }

    /// Sets the `active` gauge from the health: 1 while this instance owns
    /// the outbox (a shard of it); and with none owned, reads by no source.
    pub fn show_active(&self) {
        let active = self.health.is_active();
        self.metrics.active.set(if active { 1.0 } else { 0.0 });
        if !active {
            self.metrics.reading(None);
        }
    }

    /// As [`Self::new`], with event spans from `tracer` (when it exports).
    pub fn traced(config: &Config, tracer: &trace::EventTracer) -> Self {
        PipelineTelemetry {
            tracer: tracer.for_pipeline(&config.name, config.sink.kind()),
            ..Self::new(config)
        }
    }
}
