//! `[sink]`: the broker the events go to.

use super::{Secret, SecretUrl};
use crate::envelope::Template;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::time::Duration;

/// `[sink]`, chosen by `type = "kafka"` or `type = "rabbitmq"`.
#[derive(Debug, Clone)]
pub enum SinkConfig {
    Kafka(KafkaConfig),
    RabbitMq(RabbitMqConfig),
}

/// Separates a nested key path from its message in a custom error, so the
/// loader can report `sink.<path>` (see `load::describe`).
pub const PATH_SEPARATOR: char = '\u{1f}';

impl<'de> Deserialize<'de> for SinkConfig {
    /// By hand rather than `#[serde(tag = "type")]`: serde's internally tagged
    /// enums lose the field name in errors, and every error must name its key.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let mut map = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        let kind = match map.remove("type") {
            Some(serde_json::Value::String(k)) => k,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "type{PATH_SEPARATOR}expected \"kafka\" or \"rabbitmq\", found {other}"
                )));
            }
            None => {
                return Err(D::Error::custom(format!(
                    "type{PATH_SEPARATOR}missing: set type = \"kafka\" or \"rabbitmq\""
                )));
            }
        };
        let rest = serde_json::Value::Object(map);
        fn inner<T: serde::de::DeserializeOwned, E: Error>(v: serde_json::Value) -> Result<T, E> {
            serde_path_to_error::deserialize(v).map_err(|e| {
                let path = e.path().to_string();
                let message = e.into_inner().to_string();
                if path == "." || path.is_empty() {
                    E::custom(message)
                } else {
                    E::custom(format!("{path}{PATH_SEPARATOR}{message}"))
                }
            })
        }
        match kind.as_str() {
            "kafka" => inner(rest).map(SinkConfig::Kafka),
            "rabbitmq" => inner(rest).map(SinkConfig::RabbitMq),
            other => Err(D::Error::custom(format!(
                "type{PATH_SEPARATOR}unknown variant `{other}`, expected `kafka` or `rabbitmq`"
            ))),
        }
    }
}

impl SinkConfig {
    pub fn kind(&self) -> &'static str {
        match self {
            SinkConfig::Kafka(_) => "kafka",
            SinkConfig::RabbitMq(_) => "rabbitmq",
        }
    }

    /// Default of `relay.max_in_flight_per_aggregate` for this broker.
    pub fn default_in_flight_per_aggregate(&self) -> Option<usize> {
        match self {
            // The idempotent producer (with the gapless guarantee) never lets a
            // later message of a partition succeed after an earlier one failed.
            SinkConfig::Kafka(_) => None,
            // RabbitMQ can refuse one message (nack, unroutable) and accept the
            // next: one unconfirmed message per aggregate keeps their order.
            SinkConfig::RabbitMq(_) => Some(1),
        }
    }
}

/// `[sink]` with `type = "kafka"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Comma-separated `host:port` list (`bootstrap.servers`).
    pub brokers: String,
    /// Topic per event; placeholders `{aggregate_type}` and `{event_type}`.
    #[serde(default = "defaults::topic")]
    pub topic: Template,
    /// Largest message (key + value + headers) the relay sends; a larger event is refused
    /// before it reaches the broker. Keep it at or below the topic's `max.message.bytes`.
    #[serde(default = "defaults::kafka_message_max_bytes")]
    pub message_max_bytes: usize,
    /// Time librdkafka may spend delivering one message, retries included (`message.timeout.ms`).
    #[serde(default = "defaults::delivery_timeout", with = "humantime_serde")]
    pub delivery_timeout: Duration,
    /// How long librdkafka waits to fill a batch (`linger.ms`).
    #[serde(default = "defaults::linger", with = "humantime_serde")]
    pub linger: Duration,
    #[serde(default = "defaults::client_id")]
    pub client_id: String,
    /// Any other librdkafka property, passed through as is (e.g. `compression.type`).
    /// Properties the relay's guarantees depend on cannot be overridden here.
    #[serde(default)]
    pub properties: BTreeMap<String, Secret>,
}

/// `[sink]` with `type = "rabbitmq"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// `amqp://user:password@host:port/vhost` (or `amqps://`).
    pub url: SecretUrl,
    /// Exchange per event; placeholders `{aggregate_type}` and `{event_type}`.
    #[serde(default = "defaults::exchange")]
    pub exchange: Template,
    /// Routing key per event; placeholders `{aggregate_type}` and `{event_type}`.
    #[serde(default = "defaults::routing_key")]
    pub routing_key: Template,
    /// Declare each exchange (durable, of `exchange_type`) when first used, instead of
    /// requiring it to exist.
    #[serde(default)]
    pub declare_exchange: bool,
    #[serde(default = "defaults::exchange_type")]
    pub exchange_type: String,
    /// Largest message body the relay sends (RabbitMQ's own `max_message_size` defaults to 128 MiB).
    #[serde(default = "defaults::rabbitmq_message_max_bytes")]
    pub message_max_bytes: usize,
}

pub mod defaults {
    use crate::envelope::Template;
    use std::time::Duration;

    fn template(s: &str) -> Template {
        // Constants of this module, covered by the config tests.
        Template::parse(s).expect("default templates parse")
    }
    pub fn topic() -> Template {
        template("outbox.event.{aggregate_type}")
    }
    pub fn exchange() -> Template {
        template("outbox")
    }
    pub fn routing_key() -> Template {
        template("{aggregate_type}.{event_type}")
    }
    pub fn exchange_type() -> String {
        "topic".into()
    }
    pub fn kafka_message_max_bytes() -> usize {
        1_000_000
    }
    pub fn rabbitmq_message_max_bytes() -> usize {
        16 * 1024 * 1024
    }
    pub fn delivery_timeout() -> Duration {
        Duration::from_secs(30)
    }
    pub fn linger() -> Duration {
        Duration::from_millis(5)
    }
    pub fn client_id() -> String {
        "outbox-relay".into()
    }
}
