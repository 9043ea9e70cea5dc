//! The relay's configuration: one TOML file, every key overridable from the
//! environment (`OUTBOX_RELAY__SECTION__KEY`).
//!
//! Structs deserialize strictly (`deny_unknown_fields`, so a typo is an error
//! naming the key), carry their documented defaults as constants, and
//! [`Config::validate`] checks ranges and cross-field rules, naming the dotted
//! key of every problem. Secrets live in [`Secret`]/[`SecretUrl`], which print
//! as `***`.

mod collect;
pub mod columns;
mod duration;
mod load;
mod secret;
mod service;
mod sink;
mod source;
mod table;
mod template;
mod tls;
mod validate;

pub use columns::{ColumnMap, ExtraColumn, ResolvedColumns};
pub use load::{ConfigError, DEFAULT_PIPELINE, load, load_all_str, load_str};
pub use secret::{Secret, SecretUrl, redact_url};
use serde::Deserialize;
pub use service::{
    HttpConfig, LogConfig, LogFormat, OtlpConfig, RetentionConfig, RetentionMode, TelemetryConfig,
};
pub use sink::{
    KafkaConfig, RabbitMqConfig, SaslMechanism, SecurityProtocol, SinkConfig, destination,
};
pub use source::{
    AutoConfig, CdcConfig, HEARTBEAT_MESSAGE_PREFIX, LostSlot, PollingConfig, SourceConfig,
    SourceMode, default_replication_name,
};
use std::path::PathBuf;
use std::time::Duration;
pub use table::{SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
pub use template::{Field, Template, TemplateError};
pub use tls::{SslMode, TlsOptions};

/// Deserializes a unit enum from its keyword, with an error that lists the
/// accepted keywords (serde's own message for config values does not).
macro_rules! keyword_enum {
    ($ty:ident { $($variant:ident = $text:literal),+ $(,)? }) => {
        impl TryFrom<String> for $ty {
            type Error = String;
            fn try_from(s: String) -> Result<Self, String> {
                match s.as_str() {
                    $($text => Ok($ty::$variant),)+
                    other => Err(format!(
                        "unknown value {other:?}; expected one of: {}",
                        [$($text),+].join(", ")
                    )),
                }
            }
        }
    };
}
pub(crate) use keyword_enum;

/// The configuration of one pipeline: one outbox to one broker, with the
/// process-wide sections (`log`, `http`, `telemetry`) alongside.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The pipeline's name (`default`, or its `[pipelines.<name>]` key): a metrics label.
    #[serde(skip)]
    pub name: String,
    pub database: DatabaseConfig,
    #[serde(default)]
    pub outbox: OutboxConfig,
    #[serde(default)]
    pub source: SourceConfig,
    pub sink: SinkConfig,
    #[serde(default)]
    pub envelope: EnvelopeConfig,
    #[serde(default)]
    pub relay: RelayConfig,
    #[serde(default)]
    pub dead_letter: DeadLetterConfig,
    #[serde(default)]
    pub retention: RetentionConfig,
    #[serde(default)]
    pub http: HttpConfig,
    #[serde(default)]
    pub log: LogConfig,
    #[serde(default)]
    pub telemetry: TelemetryConfig,
}

impl Config {
    /// Whether `relay.mark` is unset, so the outbox chooses it.
    pub fn mark_chosen_by_outbox(&self) -> bool {
        self.relay.mark_setting.is_none()
    }

    /// Whether the relay deletes outbox rows: `relay.mark = "delete"`, or
    /// retention cleaning up marked rows.
    pub fn deletes_rows(&self) -> bool {
        self.relay.mark == MarkMode::Delete
            || (matches!(self.relay.mark, MarkMode::Update | MarkMode::Ranges)
                && self.retention.enabled)
    }
}

/// `[database]`: the PostgreSQL database holding the outbox.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// `postgres://user[:password]@host[:port]/dbname` or a libpq key/value string.
    pub url: SecretUrl,
    /// Overrides the password of `url` (handy from the environment).
    #[serde(default)]
    pub password: Option<Secret>,
    #[serde(default = "defaults::connect_timeout", with = "duration")]
    pub connect_timeout: Duration,
    #[serde(default = "defaults::application_name")]
    pub application_name: String,
    #[serde(default)]
    pub sslmode: SslMode,
    #[serde(default)]
    pub sslrootcert: Option<PathBuf>,
    #[serde(default)]
    pub sslcert: Option<PathBuf>,
    #[serde(default)]
    pub sslkey: Option<PathBuf>,
}

impl DatabaseConfig {
    pub fn tls(&self) -> TlsOptions {
        TlsOptions {
            mode: self.sslmode,
            root_cert: self.sslrootcert.clone(),
            client_cert: self.sslcert.clone(),
            client_key: self.sslkey.clone(),
        }
    }
}

/// `[outbox]`: which table to read and how its columns are named.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxConfig {
    #[serde(default = "defaults::table")]
    pub table: TableName,
    #[serde(default)]
    pub columns: ColumnMap,
}

impl Default for OutboxConfig {
    fn default() -> Self {
        OutboxConfig {
            table: defaults::table(),
            columns: ColumnMap::default(),
        }
    }
}

/// What happens to a row once the broker confirmed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum MarkMode {
    /// `UPDATE ... SET relay_sent_at = now()`; retention deletes it later.
    #[default]
    Update,
    /// `DELETE` the row at once.
    Delete,
    /// Leave the row alone (CDC only: the slot records progress). Rows
    /// written before the slot existed are not published.
    None,
    /// Record each confirmed batch as one row of `relay_seq` ranges
    /// (`outbox::progress`; PostgreSQL 14 or later).
    Ranges,
}

keyword_enum!(MarkMode { Update = "update", Delete = "delete", None = "none", Ranges = "ranges" });

impl MarkMode {
    /// The keyword, as written in `relay.mark`.
    pub fn name(self) -> &'static str {
        match self {
            MarkMode::Update => "update",
            MarkMode::Delete => "delete",
            MarkMode::None => "none",
            MarkMode::Ranges => "ranges",
        }
    }

    /// Whether the table records what was sent (every mode but `none`).
    pub fn records_sent(self) -> bool {
        self != MarkMode::None
    }
}

/// `[relay]`: the pipeline between source and broker.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RelayConfig {
    /// Messages handed to the broker and not yet confirmed, at most.
    #[serde(default = "defaults::max_in_flight")]
    pub max_in_flight: usize,
    /// Bytes of events read and not yet done with (waiting, in flight, and
    /// the broker client's copies of unconfirmed messages), at most; one
    /// event larger than this still goes, alone.
    #[serde(default = "defaults::max_in_flight_bytes")]
    pub max_in_flight_bytes: usize,
    /// Unconfirmed messages per aggregate within one Kafka topic, at most
    /// (`None`: no limit). Elsewhere an aggregate has one at a time.
    #[serde(default)]
    pub max_in_flight_per_aggregate: Option<usize>,
    /// A broker confirmation not received within this is treated as a lost
    /// connection: the message is re-sent.
    #[serde(default = "defaults::confirm_timeout", with = "duration")]
    pub confirm_timeout: Duration,
    /// `relay.mark` as written; unset, the outbox chooses
    /// ([`crate::ops::marking`]).
    #[serde(default, rename = "mark")]
    pub mark_setting: Option<MarkMode>,
    /// The marking in force: `mark_setting`, or until the outbox chose,
    /// `update`. Commands read it only after [`crate::ops::marking`] chose.
    #[serde(skip)]
    pub mark: MarkMode,
    /// With `mark = "ranges"`: the pause between the fold's rounds while
    /// the relay keeps up (`ops::fold`).
    #[serde(default = "defaults::fold_interval", with = "duration")]
    pub fold_interval: Duration,
    /// On SIGTERM, how long a stop may take: what was read is sent during
    /// the first half, and confirmations are awaited until the end.
    #[serde(default = "defaults::shutdown_timeout", with = "duration")]
    pub shutdown_timeout: Duration,
    /// First delay after a connection failure; doubles up to `retry_max`, with full jitter.
    #[serde(default = "defaults::retry_base", with = "duration")]
    pub retry_base: Duration,
    #[serde(default = "defaults::retry_max", with = "duration")]
    pub retry_max: Duration,
    /// First delay before retrying an event the broker refused; doubles up to `reject_retry_max`.
    #[serde(default = "defaults::reject_retry_base", with = "duration")]
    pub reject_retry_base: Duration,
    #[serde(default = "defaults::reject_retry_max", with = "duration")]
    pub reject_retry_max: Duration,
    /// How long the standby waits between attempts to become the active instance.
    #[serde(default = "defaults::standby_poll", with = "duration")]
    pub standby_poll: Duration,
    /// The owner publishes only within this long of its last round trip on
    /// the ownership session; a new owner waits this long before publishing.
    #[serde(default = "defaults::ownership_lease", with = "duration")]
    pub ownership_lease: Duration,
    /// Virtual shards (polling only): the outbox is split by a hash of
    /// `aggregate_id`, and running instances share the shards evenly, each
    /// aggregate staying on one owner.
    #[serde(default = "defaults::shards")]
    pub shards: u32,
}

impl Default for RelayConfig {
    fn default() -> Self {
        RelayConfig {
            max_in_flight: defaults::max_in_flight(),
            max_in_flight_bytes: defaults::max_in_flight_bytes(),
            max_in_flight_per_aggregate: None,
            confirm_timeout: defaults::confirm_timeout(),
            mark_setting: None,
            mark: MarkMode::default(),
            fold_interval: defaults::fold_interval(),
            shutdown_timeout: defaults::shutdown_timeout(),
            retry_base: defaults::retry_base(),
            retry_max: defaults::retry_max(),
            reject_retry_base: defaults::reject_retry_base(),
            reject_retry_max: defaults::reject_retry_max(),
            standby_poll: defaults::standby_poll(),
            ownership_lease: defaults::ownership_lease(),
            shards: defaults::shards(),
        }
    }
}

/// What happens to the later events of an aggregate whose event was dead-lettered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum HoldPolicy {
    /// They are dead-lettered after it, in order, so a redrive replays the
    /// aggregate in order and the rest of the outbox moves on.
    #[default]
    Follow,
    /// They stay unsent in the outbox until the dead letter is redriven or
    /// dropped (polling only: CDC cannot hold the stream for one aggregate).
    Wait,
}

keyword_enum!(HoldPolicy { Follow = "follow", Wait = "wait" });

/// `[dead_letter]`: where events go that the broker keeps refusing.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadLetterConfig {
    /// Move an event to the dead-letter table after `max_attempts` refusals.
    /// When off, a refused event is retried forever.
    #[serde(default = "defaults::yes")]
    pub enabled: bool,
    /// Default: `<outbox table>_dead_letters`, in the outbox's schema.
    #[serde(default)]
    pub table: Option<TableName>,
    #[serde(default = "defaults::max_attempts")]
    pub max_attempts: u32,
    #[serde(default)]
    pub aggregate: HoldPolicy,
    /// How often the relay looks for dead letters redriven or dropped by an operator.
    #[serde(default = "defaults::dead_letter_refresh", with = "duration")]
    pub refresh_interval: Duration,
}

impl Default for DeadLetterConfig {
    fn default() -> Self {
        DeadLetterConfig {
            enabled: true,
            table: None,
            max_attempts: defaults::max_attempts(),
            aggregate: HoldPolicy::default(),
            refresh_interval: defaults::dead_letter_refresh(),
        }
    }
}

impl DeadLetterConfig {
    pub fn table_name(&self, outbox: &TableName) -> TableName {
        self.table.clone().unwrap_or_else(|| {
            let mut name = format!("{}_dead_letters", outbox.name);
            while name.len() > 63 {
                name.remove(0);
            }
            TableName::new(&outbox.schema, &name)
        })
    }
}

/// How an event is laid out in the broker message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum EnvelopeMode {
    /// CloudEvents JSON (structured content mode): the body is the whole event.
    #[default]
    Structured,
    /// The body is the payload itself; CloudEvents attributes go in `ce_*` headers.
    Binary,
}

keyword_enum!(EnvelopeMode { Structured = "structured", Binary = "binary" });

/// `[envelope]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EnvelopeConfig {
    #[serde(default)]
    pub mode: EnvelopeMode,
    /// CloudEvents `source` attribute.
    #[serde(default = "defaults::ce_source")]
    pub source: String,
}

impl Default for EnvelopeConfig {
    fn default() -> Self {
        EnvelopeConfig {
            mode: EnvelopeMode::default(),
            source: defaults::ce_source(),
        }
    }
}

/// Documented defaults, one function per key (serde needs functions).
pub mod defaults {
    use super::TableName;
    use std::time::Duration;

    pub fn yes() -> bool {
        true
    }
    pub fn connect_timeout() -> Duration {
        Duration::from_secs(10)
    }
    pub fn application_name() -> String {
        "outbox-relay".into()
    }
    pub fn table() -> TableName {
        TableName::new("public", "outbox")
    }
    pub fn batch_size() -> usize {
        500
    }
    pub fn poll_interval() -> Duration {
        Duration::from_millis(50)
    }
    pub fn retention_interval() -> Duration {
        Duration::from_secs(60)
    }
    pub fn sent_window() -> Duration {
        Duration::from_secs(7 * 24 * 3600)
    }
    pub fn dead_letter_window() -> Duration {
        Duration::from_secs(30 * 24 * 3600)
    }
    pub fn retention_batch() -> usize {
        1000
    }
    pub fn retention_pause() -> Duration {
        Duration::from_millis(100)
    }
    pub fn partition_interval() -> Duration {
        Duration::from_secs(86_400)
    }
    pub fn partition_premake() -> u32 {
        3
    }
    pub fn sample_interval() -> Duration {
        Duration::from_secs(15)
    }
    pub fn http_address() -> String {
        "127.0.0.1:9187".into()
    }
    pub fn max_attempts() -> u32 {
        5
    }
    pub fn dead_letter_refresh() -> Duration {
        Duration::from_secs(5)
    }
    pub fn probe_interval() -> Duration {
        Duration::from_secs(30)
    }

    pub fn status_interval() -> Duration {
        Duration::from_secs(10)
    }
    pub fn batch_wait() -> Duration {
        Duration::from_millis(2)
    }
    pub fn max_in_flight() -> usize {
        8000
    }
    pub fn max_in_flight_bytes() -> usize {
        64 << 20
    }
    pub fn confirm_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn fold_interval() -> Duration {
        Duration::from_secs(2)
    }
    pub fn shutdown_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn retry_base() -> Duration {
        Duration::from_millis(200)
    }
    pub fn retry_max() -> Duration {
        Duration::from_secs(30)
    }
    pub fn reject_retry_base() -> Duration {
        Duration::from_secs(1)
    }
    pub fn reject_retry_max() -> Duration {
        Duration::from_secs(300)
    }
    pub fn standby_poll() -> Duration {
        Duration::from_secs(2)
    }
    pub fn ownership_lease() -> Duration {
        Duration::from_secs(3)
    }
    pub fn shards() -> u32 {
        1
    }
    pub fn ce_source() -> String {
        "outbox-relay".into()
    }
    pub fn log_level() -> String {
        "info".into()
    }
    pub fn otlp_service_name() -> String {
        "outbox-relay".into()
    }
    pub fn otlp_max_queue_size() -> usize {
        2048
    }
}

#[cfg(test)]
mod tests;
