//! `[sink]` with `type = "kafka"`: its keys, their defaults, and their checks.
//!
//! The broker's configuration lives here, in the configuration layer, rather
//! than in `sink/kafka/`: the configuration is a leaf every other module
//! reads, and the sink already depends on it, so a `config -> sink` edge
//! would close a dependency cycle (`tests/architecture.rs`). What the relay
//! does with these values (the librdkafka properties it derives, how it
//! classifies the broker's errors) is in `sink/kafka/`.

use super::destination;
use crate::config::Secret;
use crate::config::Template;
use crate::config::validate::{Checker, HOUR, SEC};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

/// librdkafka properties the relay sets itself because its guarantees depend on them.
pub const PROTECTED_KAFKA_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "enable.gapless.guarantee",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
    "message.max.bytes",
    "linger.ms",
    "queue.buffering.max.ms",
    "client.id",
    "enable.auto.commit",
    "queue.buffering.max.messages",
    // Without a report of each success no send is ever confirmed.
    "delivery.report.only.error",
    // A transactional producer sends nothing before init_transactions.
    "transactional.id",
    // Only a permanent error fails the later messages of a partition with
    // the one that failed (the gapless guarantee); a message that ran out
    // of retries fails alone, and a later one of its aggregate may then be
    // on the broker before it. Left unlimited, librdkafka never gives up.
    "retries",
    "message.send.max.retries",
];

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
    #[serde(
        default = "defaults::kafka_message_max_bytes",
        deserialize_with = "super::whole_number"
    )]
    pub message_max_bytes: usize,
    /// How long a send waits for room in librdkafka's full queue. A message
    /// itself never times out in librdkafka (`message.timeout.ms = 0`):
    /// `relay.confirm_timeout` bounds the wait for its confirmation.
    #[serde(
        default = "defaults::delivery_timeout",
        with = "crate::config::duration"
    )]
    pub delivery_timeout: Duration,
    /// How long librdkafka waits to fill a batch (`linger.ms`).
    #[serde(default = "defaults::linger", with = "crate::config::duration")]
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

crate::config::keyword_enum!(SecurityProtocol {
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

crate::config::keyword_enum!(SaslMechanism {
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

impl KafkaConfig {
    /// Range and cross-field checks of `[sink]` for Kafka.
    pub(in crate::config) fn check(&self, c: &mut Checker) {
        if self.brokers.split(',').all(|b| b.trim().is_empty()) {
            c.problem("sink.brokers", "must list at least one host:port");
        }
        if let Err(e) = destination::check_template_literals(&self.topic, destination::kafka_topic)
        {
            c.problem("sink.topic", e);
        }
        c.count(
            "sink.message_max_bytes",
            self.message_max_bytes as u64,
            "kafka",
        );
        c.duration("sink.delivery_timeout", self.delivery_timeout, SEC, HOUR);
        c.duration("sink.linger", self.linger, Duration::ZERO, 5 * SEC);
        if self.client_id.is_empty() {
            c.problem("sink.client_id", "must not be empty");
        }
        for key in self.properties.keys() {
            if key == "partitioner" && self.properties[key].expose().trim() == "random" {
                // Every other partitioner sends one key to one partition.
                c.problem(
                    "sink.properties.partitioner",
                    "\"random\" spreads one aggregate's events over partitions, so their order would not hold; use a key-based partitioner (the default, or murmur2_random to match Java clients)",
                );
            } else if key == "queue.buffering.max.kbytes" {
                self.check_queue_room(c);
            } else if PROTECTED_KAFKA_PROPERTIES.contains(&key.as_str()) {
                c.problem(
                    &format!("sink.properties.{key}"),
                    "is set by the relay because its delivery guarantee depends on it; remove it (see the sink keys for the ones you can tune)",
                );
            } else if let Some((_, typed)) =
                KafkaConfig::TYPED_PROPERTIES.iter().find(|(p, _)| p == key)
            {
                c.problem(
                    &format!("sink.properties.{key}"),
                    format!("is set from a sink key; use {typed} instead"),
                );
            }
        }
        self.check_security(c);
    }

    /// librdkafka's queue must have room for the largest message: one
    /// larger than the queue is refused as "queue full" every time, so it
    /// would hold every aggregate back for ever instead of being refused
    /// as too large.
    fn check_queue_room(&self, c: &mut Checker) {
        let key = "sink.properties.queue.buffering.max.kbytes";
        match self.properties["queue.buffering.max.kbytes"]
            .expose()
            .trim()
            .parse::<u64>()
        {
            Ok(kbytes) if kbytes.saturating_mul(1024) >= self.message_max_bytes as u64 => {}
            Ok(kbytes) => c.problem(
                key,
                format!(
                    "{kbytes} KiB is less than sink.message_max_bytes ({} bytes), so the largest message \
                     would never fit in the producer's queue; raise it to at least {} or lower \
                     sink.message_max_bytes",
                    self.message_max_bytes,
                    (self.message_max_bytes as u64).div_ceil(1024)
                ),
            ),
            Err(_) => c.problem(key, "must be a whole number of KiB"),
        }
    }

    /// SASL keys need a `sasl_*` protocol, SSL keys an `ssl` one, and SASL needs
    /// its user name and password.
    fn check_security(&self, c: &mut Checker) {
        let protocol = self.security_protocol;
        if !protocol.uses_sasl() {
            for (key, set) in [
                ("sink.sasl_mechanism", self.sasl_mechanism.is_some()),
                ("sink.sasl_username", self.sasl_username.is_some()),
                ("sink.sasl_password", self.sasl_password.is_some()),
            ] {
                if set {
                    c.problem(
                        key,
                        format!(
                            "is only used with sink.security_protocol sasl_plaintext or sasl_ssl, not {}",
                            protocol.as_str()
                        ),
                    );
                }
            }
        } else {
            let mechanism = self.sasl_mechanism.unwrap_or_default().as_str();
            if self.sasl_username.as_deref().is_none_or(str::is_empty) {
                c.problem(
                    "sink.sasl_username",
                    format!("is required by SASL mechanism {mechanism}"),
                );
            }
            if self.sasl_password.as_ref().is_none_or(|p| p.is_empty()) {
                c.problem(
                    "sink.sasl_password",
                    format!("is required by SASL mechanism {mechanism}"),
                );
            }
        }
        if !protocol.uses_tls() {
            for (key, set) in [
                ("sink.ssl_ca", self.ssl_ca.is_some()),
                ("sink.ssl_cert", self.ssl_cert.is_some()),
                ("sink.ssl_key", self.ssl_key.is_some()),
            ] {
                if set {
                    c.problem(
                        key,
                        format!(
                            "is only used with sink.security_protocol ssl or sasl_ssl, not {}",
                            protocol.as_str()
                        ),
                    );
                }
            }
        }
        c.both_or_neither(
            ("sink.ssl_cert", self.ssl_cert.is_some()),
            ("sink.ssl_key", self.ssl_key.is_some()),
        );
    }
}

mod defaults {
    use crate::config::Template;
    use crate::config::sink::template;
    use std::time::Duration;

    pub fn topic() -> Template {
        template("outbox.event.{aggregate_type}")
    }
    pub fn kafka_message_max_bytes() -> usize {
        1_000_000
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
