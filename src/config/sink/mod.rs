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

/// A whole number of `[sink]`, written as one in the file or as text in an
/// environment variable (`OUTBOX_RELAY__SINK__MESSAGE_MAX_BYTES=1048576`):
/// the sink is read through JSON, where the config crate's coercion of
/// text does not reach.
fn whole_number<'de, D: serde::Deserializer<'de>>(d: D) -> Result<usize, D::Error> {
    struct Whole;
    impl serde::de::Visitor<'_> for Whole {
        type Value = usize;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a whole number")
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<usize, E> {
            usize::try_from(v)
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Unsigned(v), &self))
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<usize, E> {
            usize::try_from(v)
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Signed(v), &self))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<usize, E> {
            v.trim()
                .parse()
                .map_err(|_| E::invalid_value(serde::de::Unexpected::Str(v), &self))
        }
    }
    d.deserialize_any(Whole)
}

/// A `true` or `false` of `[sink]`, in the file or as text in an
/// environment variable (`true`, `on`, `yes`, `1` and their opposites, in
/// any case, as for every other flag; see [`whole_number`]).
fn flag<'de, D: serde::Deserializer<'de>>(d: D) -> Result<bool, D::Error> {
    struct Flag;
    impl serde::de::Visitor<'_> for Flag {
        type Value = bool;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("true or false")
        }
        fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<bool, E> {
            Ok(v)
        }
        /// The words every other flag accepts from the environment.
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<bool, E> {
            match v.trim().to_lowercase().as_str() {
                "true" | "on" | "yes" | "1" => Ok(true),
                "false" | "off" | "no" | "0" => Ok(false),
                _ => Err(E::invalid_value(serde::de::Unexpected::Str(v), &self)),
            }
        }
    }
    d.deserialize_any(Flag)
}

/// A default template of a broker's keys.
fn template(s: &str) -> Template {
    // Constants of the brokers' `defaults`, covered by the config tests.
    Template::parse(s).expect("default templates parse")
}
