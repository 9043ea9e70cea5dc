//! `[sink]`: the broker the events go to.

use super::{Secret, SecretUrl};
use crate::envelope::Template;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
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
    #[serde(default = "defaults::delivery_timeout", with = "super::duration")]
    pub delivery_timeout: Duration,
    /// How long librdkafka waits to fill a batch (`linger.ms`).
    #[serde(default = "defaults::linger", with = "super::duration")]
    pub linger: Duration,
    #[serde(default = "defaults::client_id")]
    pub client_id: String,
    /// How the relay talks to the brokers (`security.protocol`).
    #[serde(default)]
    pub security_protocol: SecurityProtocol,
    /// `sasl.mechanism`, with a `sasl_*` protocol; `PLAIN` when unset.
    #[serde(default)]
    pub sasl_mechanism: Option<SaslMechanism>,
    /// `sasl.username`.
    #[serde(default)]
    pub sasl_username: Option<String>,
    /// `sasl.password`.
    #[serde(default)]
    pub sasl_password: Option<Secret>,
    /// CA bundle (PEM) the brokers' certificates must chain to (`ssl.ca.location`);
    /// the system's CAs when unset.
    #[serde(default)]
    pub ssl_ca: Option<PathBuf>,
    /// Client certificate (PEM) for brokers that ask for one (`ssl.certificate.location`).
    #[serde(default)]
    pub ssl_cert: Option<PathBuf>,
    /// Private key (PEM) of `ssl_cert` (`ssl.key.location`).
    #[serde(default)]
    pub ssl_key: Option<PathBuf>,
    /// Any other librdkafka property, passed through as is (e.g. `compression.type`).
    /// Properties the relay's guarantees depend on, and those the keys above
    /// set, cannot be given here.
    #[serde(default)]
    pub properties: BTreeMap<String, Secret>,
}

impl KafkaConfig {
    /// librdkafka properties set from a typed key, with that key; they cannot
    /// be given in `properties` too.
    pub const TYPED_PROPERTIES: &[(&str, &str)] = &[
        ("security.protocol", "sink.security_protocol"),
        ("sasl.mechanism", "sink.sasl_mechanism"),
        ("sasl.mechanisms", "sink.sasl_mechanism"),
        ("sasl.username", "sink.sasl_username"),
        ("sasl.password", "sink.sasl_password"),
        ("ssl.ca.location", "sink.ssl_ca"),
        ("ssl.certificate.location", "sink.ssl_cert"),
        ("ssl.key.location", "sink.ssl_key"),
    ];
}

/// `sink.security_protocol`, librdkafka's `security.protocol`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum SecurityProtocol {
    #[default]
    Plaintext,
    Ssl,
    SaslPlaintext,
    SaslSsl,
}

super::keyword_enum!(SecurityProtocol {
    Plaintext = "plaintext",
    Ssl = "ssl",
    SaslPlaintext = "sasl_plaintext",
    SaslSsl = "sasl_ssl",
});

impl SecurityProtocol {
    /// The value of librdkafka's `security.protocol`.
    pub fn as_str(self) -> &'static str {
        match self {
            SecurityProtocol::Plaintext => "plaintext",
            SecurityProtocol::Ssl => "ssl",
            SecurityProtocol::SaslPlaintext => "sasl_plaintext",
            SecurityProtocol::SaslSsl => "sasl_ssl",
        }
    }

    pub fn uses_tls(self) -> bool {
        matches!(self, SecurityProtocol::Ssl | SecurityProtocol::SaslSsl)
    }

    pub fn uses_sasl(self) -> bool {
        matches!(
            self,
            SecurityProtocol::SaslPlaintext | SecurityProtocol::SaslSsl
        )
    }
}

/// `sink.sasl_mechanism`: the SASL mechanisms that authenticate with a user name
/// and a password.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum SaslMechanism {
    #[default]
    Plain,
    ScramSha256,
    ScramSha512,
}

super::keyword_enum!(SaslMechanism {
    Plain = "PLAIN",
    ScramSha256 = "SCRAM-SHA-256",
    ScramSha512 = "SCRAM-SHA-512",
});

impl SaslMechanism {
    /// The value of librdkafka's `sasl.mechanism`.
    pub fn as_str(self) -> &'static str {
        match self {
            SaslMechanism::Plain => "PLAIN",
            SaslMechanism::ScramSha256 => "SCRAM-SHA-256",
            SaslMechanism::ScramSha512 => "SCRAM-SHA-512",
        }
    }
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
    /// CA certificates (PEM) trusted for an `amqps://` broker's certificate, in
    /// addition to the system's.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM, chain after the leaf) for brokers that ask for one.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM, unencrypted) of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
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
