//! `[sink]`: the broker the events go to, one file per broker with its keys,
//! defaults and checks (`kafka.rs`, `rabbitmq.rs`).

pub mod destination;
mod kafka;
mod rabbitmq;

pub use kafka::{KafkaConfig, SaslMechanism, SecurityProtocol};
pub use rabbitmq::RabbitMqConfig;

use super::Template;
use serde::Deserialize;

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
}

/// A default template of a broker's keys.
fn template(s: &str) -> Template {
    // Constants of the brokers' `defaults`, covered by the config tests.
    Template::parse(s).expect("default templates parse")
}
