//! The sections that run beside the relay: retention, the HTTP endpoints,
//! logging, trace export.

use super::defaults;
use serde::Deserialize;
use std::path::PathBuf;
use std::time::Duration;

/// `[retention]`: the scheduled cleanup of sent rows and resolved dead letters.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionConfig {
    /// Run the cleanup on a schedule inside `run` (one instance at a time).
    #[serde(default = "defaults::yes")]
    pub enabled: bool,
    /// Time between two cleanups.
    #[serde(default = "defaults::retention_interval", with = "super::duration")]
    pub interval: Duration,
    /// Sent rows older than this (by `relay_sent_at`) are deleted.
    #[serde(default = "defaults::sent_window", with = "super::duration")]
    pub sent_window: Duration,
    /// Redriven or dropped dead letters older than this (by when they were
    /// resolved) are deleted; open dead letters are never deleted.
    #[serde(default = "defaults::dead_letter_window", with = "super::duration")]
    pub dead_letter_window: Duration,
    /// Rows deleted per statement.
    #[serde(default = "defaults::retention_batch")]
    pub batch_size: usize,
    /// Pause between two batches, so cleanup never holds long locks or floods WAL.
    #[serde(default = "defaults::retention_pause", with = "super::duration")]
    pub pause: Duration,
    /// How sent events leave the outbox: row by row, or a whole partition at a time.
    #[serde(default)]
    pub mode: RetentionMode,
    /// `mode = "partitions"`: the time range of each partition the relay creates.
    #[serde(default = "defaults::partition_interval", with = "super::duration")]
    pub partition_interval: Duration,
    /// `mode = "partitions"`: partitions kept created ahead of the current one.
    #[serde(default = "defaults::partition_premake")]
    pub partition_premake: u32,
}

/// `retention.mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum RetentionMode {
    /// Sent rows are deleted in batches.
    #[default]
    Rows,
    /// The outbox is partitioned by range on a time column: the relay creates
    /// partitions ahead of time and drops a whole partition once its range is
    /// older than `sent_window` and every row in it was sent.
    Partitions,
}

super::keyword_enum!(RetentionMode {
    Rows = "rows",
    Partitions = "partitions"
});

impl Default for RetentionConfig {
    fn default() -> Self {
        RetentionConfig {
            enabled: true,
            interval: defaults::retention_interval(),
            sent_window: defaults::sent_window(),
            dead_letter_window: defaults::dead_letter_window(),
            batch_size: defaults::retention_batch(),
            pause: defaults::retention_pause(),
            mode: RetentionMode::default(),
            partition_interval: defaults::partition_interval(),
            partition_premake: defaults::partition_premake(),
        }
    }
}

/// `[http]`: `/metrics` (Prometheus), `/healthz` and `/readyz`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    #[serde(default = "defaults::yes")]
    pub enabled: bool,
    /// `host:port` to listen on; keep it on a private interface.
    #[serde(default = "defaults::http_address")]
    pub address: String,
    /// How often the gauges read from the database (backlog, dead letters,
    /// slot) are refreshed; the backlog's, less often when counting it is
    /// slow (`ops::gauges`).
    #[serde(default = "defaults::sample_interval", with = "super::duration")]
    pub sample_interval: Duration,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            enabled: true,
            address: defaults::http_address(),
            sample_interval: defaults::sample_interval(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

super::keyword_enum!(LogFormat { Text = "text", Json = "json" });

/// `[log]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogConfig {
    #[serde(default)]
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `outbox_relay=debug,info`; `RUST_LOG` wins when set.
    #[serde(default = "defaults::log_level")]
    pub level: String,
}

impl Default for LogConfig {
    fn default() -> Self {
        LogConfig {
            format: LogFormat::default(),
            level: defaults::log_level(),
        }
    }
}

/// `[telemetry]`: what the relay reports beside logs and metrics.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TelemetryConfig {
    #[serde(default)]
    pub otlp: OtlpConfig,
}

/// `[telemetry.otlp]`: a span per event, exported over OTLP/HTTP (protobuf).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OtlpConfig {
    /// Base URL of the collector's OTLP/HTTP receiver, like
    /// `http://localhost:4318`; spans go to `<endpoint>/v1/traces`. Unset:
    /// no spans, messages carry the row's `traceparent` unchanged.
    #[serde(default)]
    pub endpoint: Option<String>,
    /// The `service.name` resource attribute of the spans.
    #[serde(default = "defaults::otlp_service_name")]
    pub service_name: String,
    /// Finished spans held while the collector is slow or unreachable; more are dropped.
    #[serde(default = "defaults::otlp_max_queue_size")]
    pub max_queue_size: usize,
    /// A PEM file of CA certificates trusted for an `https://` endpoint, in
    /// addition to the system's (a collector with a private CA).
    #[serde(default)]
    pub ca: Option<PathBuf>,
}

impl Default for OtlpConfig {
    fn default() -> Self {
        OtlpConfig {
            endpoint: None,
            service_name: defaults::otlp_service_name(),
            max_queue_size: defaults::otlp_max_queue_size(),
            ca: None,
        }
    }
}
