//! Logging: text or JSON lines on stderr, filtered by `log.level` (or `RUST_LOG`);
//! metrics, health, and a span per event when `telemetry.otlp.endpoint` is set
//! ([`trace`]).

use crate::config::{LogConfig, LogFormat};
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

const QUIET_AMQP_CLIENT: &str = "lapin=error";

/// Installs the global subscriber; a second call does nothing.
pub fn init(config: &LogConfig) {
    let mut refused = None;
    let (filter, spec) = match std::env::var("RUST_LOG") {
        Ok(spec) if EnvFilter::try_new(&spec).is_ok() => (EnvFilter::new(&spec), spec),
        other => {
            refused = other.ok();
            match EnvFilter::try_new(&config.level) {
                Ok(f) => (f, config.level.clone()),
                Err(_) => (EnvFilter::new("info"), "info".to_owned()),
            }
        }
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
        .with_target(false)
        // A line that cannot be written (the log's reader went away) is
        // dropped: losing the log must not stop delivery. Saying so on the
        // same closed stream would panic.
        .log_internal_errors(false);
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
    if let Some(spec) = refused {
        tracing::warn!(
            rust_log = %spec,
            level = %config.level,
            "RUST_LOG is not a valid filter: logging by log.level instead"
        );
    }
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
            health: health::PipelineHealth::new(
                &config.name,
                config.relay.shards,
                config.relay.confirm_timeout,
            ),
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

/// One run's share of its pipeline's in-flight state: the gauges, which
/// the runs of every shard of the pipeline add to (a run that set them
/// would hide the others'), and its shard's progress for `/readyz`. Taken
/// back when the run ends, however it ends.
pub struct InFlightShare {
    in_flight: ::metrics::Gauge,
    bytes: ::metrics::Gauge,
    health: Arc<health::PipelineHealth>,
    shard: u32,
    count: f64,
    used: f64,
}

impl InFlightShare {
    pub fn new(telemetry: &PipelineTelemetry, shard: u32) -> Self {
        InFlightShare {
            in_flight: telemetry.metrics.in_flight.clone(),
            bytes: telemetry.metrics.in_flight_bytes.clone(),
            health: telemetry.health.clone(),
            shard,
            count: 0.0,
            used: 0.0,
        }
    }

    /// This run has `count` messages and `used` bytes in flight now.
    pub fn report(&mut self, count: usize, used: usize) {
        self.health.set_in_flight(self.shard, count);
        let (count, used) = (count as f64, used as f64);
        self.in_flight.increment(count - self.count);
        self.bytes.increment(used - self.used);
        (self.count, self.used) = (count, used);
    }

    /// A confirmation arrived.
    pub fn progress(&self) {
        self.health.progress(self.shard);
    }
}

impl Drop for InFlightShare {
    fn drop(&mut self) {
        self.report(0, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runs_of_a_pipelines_shards_add_up_their_in_flight() {
        let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let value = |name: &str| {
            let text = handle.render();
            text.lines()
                .find(|l| l.starts_with(&format!("{name}{{")))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        };
        ::metrics::with_local_recorder(&recorder, || {
            let telemetry = PipelineTelemetry {
                health: health::PipelineHealth::new("p", 2, std::time::Duration::from_secs(10)),
                metrics: metrics::PipelineMetrics::new("p", "kafka", "polling"),
                tracer: trace::EventTracer::default(),
            };
            let mut one = InFlightShare::new(&telemetry, 0);
            let mut two = InFlightShare::new(&telemetry, 1);
            one.report(3, 300);
            two.report(5, 500);
            one.report(1, 100);
            assert_eq!(value(metrics::IN_FLIGHT), Some(6.0));
            assert_eq!(value(metrics::IN_FLIGHT_BYTES), Some(600.0));
            drop(two);
            assert_eq!(
                value(metrics::IN_FLIGHT),
                Some(1.0),
                "an ended run takes its share back"
            );
            assert_eq!(value(metrics::IN_FLIGHT_BYTES), Some(100.0));
        });
    }
}
