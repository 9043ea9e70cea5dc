//! Kafka through librdkafka's idempotent producer.
//!
//! Settings the guarantees rest on (not overridable): `enable.idempotence`
//! and `acks=all` so a delivery report means the in-sync replicas have the
//! message, exactly once per send, in order per partition; and
//! `enable.gapless.guarantee`, so a failure that would leave a gap in a
//! partition's sequence stops the producer (a fatal error) instead of letting
//! later messages through: the relay rebuilds the producer and re-sends from
//! the first unconfirmed message. See
//! <https://github.com/confluentinc/librdkafka/blob/master/INTRODUCTION.md#idempotent-producer>.

use super::kafka_log::LogContext;
use super::{Confirmation, Sink, SinkError};
use crate::config::KafkaConfig;
use crate::envelope::{Field, Message, Template, destination};
use crate::outbox::OutboxEvent;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::collections::HashSet;
use std::time::{Duration, Instant};

/// How long a metadata request (topic existence, reachability) may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// The idle liveness probe's lookup: it holds up the pipeline while it runs.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// librdkafka's own queue bound; larger than any `relay.max_in_flight`, so
/// the relay's window is the bound that binds.
const QUEUE_MAX_MESSAGES: &str = "200000";

type RelayProducer = FutureProducer<LogContext>;

pub struct KafkaSink {
    producer: RelayProducer,
    brokers: String,
    topic: Template,
    max_bytes: usize,
    delivery_timeout: Duration,
    /// Topics seen to exist; a missing topic is looked up again on every use.
    known_topics: HashSet<String>,
}

impl KafkaSink {
    /// Creates the producer and checks that a broker answers.
    pub async fn connect(config: &KafkaConfig) -> Result<Self, SinkError> {
        let producer: RelayProducer = client_config(config)
            .create_with_context(LogContext::default())
            .map_err(|e| {
                SinkError::Fatal(format!(
                    "cannot create the Kafka producer: {e}{}",
                    keys_to_check(&e.to_string())
                ))
            })?;
        let mut sink = KafkaSink {
            producer,
            brokers: config.brokers.clone(),
            topic: config.topic.clone(),
            max_bytes: config.message_max_bytes,
            delivery_timeout: config.delivery_timeout,
            known_topics: HashSet::new(),
        };
        sink.probe().await?;
        Ok(sink)
    }

    fn route(&self, aggregate_type: &str, event_type: &str) -> Result<String, SinkError> {
        let topic = self.topic.render(|f| match f {
            Field::AggregateType => aggregate_type,
            Field::EventType => event_type,
        });
        destination::kafka_topic(&topic).map_err(SinkError::Rejected)?;
        Ok(topic)
    }

    async fn ensure_topic(&mut self, topic: &str) -> Result<(), SinkError> {
        if self.known_topics.contains(topic) {
            return Ok(());
        }
        let producer = self.producer.clone();
        let name = topic.to_owned();
        let metadata = tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(Some(&name), METADATA_TIMEOUT)
        })
        .await
        .map_err(|e| SinkError::Unavailable(format!("metadata lookup task failed: {e}")))?
        .map_err(|e| {
            SinkError::Unavailable(format!("cannot reach Kafka at {}: {e}", self.brokers))
        })?;
        let found = metadata
            .topics()
            .iter()
            .find(|t| t.name() == topic)
            .is_some_and(|t| t.error().is_none() && !t.partitions().is_empty());
        if !found {
            return Err(SinkError::Rejected(format!(
                "topic {topic:?} does not exist and the broker did not create it; create the topic (or enable auto-creation on the broker)"
            )));
        }
        self.known_topics.insert(topic.to_owned());
        Ok(())
    }
}

/// librdkafka's configuration for the producer: the pass-through
/// `properties` first, then the typed keys and the settings the guarantees
/// rest on, which validation keeps out of `properties`.
pub(crate) fn client_config(config: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    for (k, v) in &config.properties {
        c.set(k, v.expose());
    }
    set_security(&mut c, config);
    c.set("bootstrap.servers", &config.brokers)
        .set("client.id", &config.client_id)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("enable.gapless.guarantee", "true")
        .set(
            "message.timeout.ms",
            config.delivery_timeout.as_millis().to_string(),
        )
        .set("linger.ms", config.linger.as_millis().to_string())
        .set("queue.buffering.max.messages", QUEUE_MAX_MESSAGES)
        // The request size must fit the largest message the relay lets through.
        .set(
            "message.max.bytes",
            (config.message_max_bytes + 64 * 1024)
                .max(1_000_000)
                .to_string(),
        );
    c
}

fn set_security(c: &mut ClientConfig, config: &KafkaConfig) {
    let protocol = config.security_protocol;
    c.set("security.protocol", protocol.as_str());
    if protocol.uses_sasl() {
        c.set(
            "sasl.mechanism",
            config.sasl_mechanism.unwrap_or_default().as_str(),
        );
        if let Some(user) = &config.sasl_username {
            c.set("sasl.username", user);
        }
        if let Some(password) = &config.sasl_password {
            c.set("sasl.password", password.expose());
        }
    }
    if protocol.uses_tls() {
        for (property, path) in [
            ("ssl.ca.location", &config.ssl_ca),
            ("ssl.certificate.location", &config.ssl_cert),
            ("ssl.key.location", &config.ssl_key),
        ] {
            if let Some(path) = path {
                c.set(property, path.to_string_lossy());
            }
        }
    }
}

/// librdkafka names its own properties when it refuses them (`ssl.ca.location
/// failed: ...`); the operator edits the relay's keys.
fn keys_to_check(message: &str) -> String {
    let mut keys: Vec<&str> = KafkaConfig::TYPED_PROPERTIES
        .iter()
        .filter(|(property, _)| message.contains(property))
        .map(|(_, key)| *key)
        .collect();
    keys.dedup();
    if keys.is_empty() {
        String::new()
    } else {
        format!("; check {}", keys.join(" and "))
    }
}

/// Sorts librdkafka's errors by what the relay should do about them.
fn classify(e: &KafkaError) -> SinkError {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::TopicAuthorizationFailed
            | C::UnknownTopicOrPartition
            | C::UnknownTopic
            | C::PolicyViolation,
        ) => SinkError::Rejected(format!("Kafka refused the message: {e}")),
        Some(
            C::SaslAuthenticationFailed
            | C::Authentication
            | C::ClusterAuthorizationFailed
            | C::TransactionalIdAuthorizationFailed,
        ) => SinkError::Fatal(format!(
            "Kafka refused the relay's credentials or permissions: {e}; check sink.sasl_username, sink.sasl_password, sink.ssl_cert and the ACLs"
        )),
        _ => SinkError::Unavailable(format!("Kafka delivery failed: {e}")),
    }
}

impl Sink for KafkaSink {
    async fn send(
        &mut self,
        event: &OutboxEvent,
        message: Message,
    ) -> Result<Confirmation, SinkError> {
        let topic = self.route(&event.aggregate_type, &event.event_type)?;
        let size = message.size();
        if size > self.max_bytes {
            return Err(SinkError::Rejected(format!(
                "message is {size} bytes, over sink.message_max_bytes ({})",
                self.max_bytes
            )));
        }
        self.ensure_topic(&topic).await?;
        let mut headers = OwnedHeaders::new_with_capacity(message.headers.len());
        for (k, v) in &message.headers {
            headers = headers.insert(Header {
                key: k,
                value: Some(v.as_bytes()),
            });
        }
        let mut record = FutureRecord::to(&topic)
            .key(message.key.as_bytes())
            .payload(&message.body)
            .headers(headers);
        let deadline = Instant::now() + self.delivery_timeout;
        loop {
            match self.producer.send_result(record) {
                Ok(delivery) => {
                    return Ok(Box::pin(async move {
                        match delivery.await {
                            Ok(Ok(_)) => Ok(()),
                            Ok(Err((e, _))) => Err(classify(&e)),
                            Err(_) => Err(SinkError::Unavailable(
                                "the Kafka producer was closed".into(),
                            )),
                        }
                    }));
                }
                // librdkafka's queue is full: wait for deliveries to make room (backpressure).
                Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back))
                    if Instant::now() < deadline =>
                {
                    record = back;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err((e, _)) => return Err(classify(&e)),
            }
        }
    }

    /// The topic: one partition per key, and a refused message fails every
    /// later one of its partition (`enable.gapless.guarantee`).
    fn lane(&self, event: &OutboxEvent) -> Option<String> {
        self.route(&event.aggregate_type, &event.event_type).ok()
    }

    async fn probe(&mut self) -> Result<(), SinkError> {
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            return Err(SinkError::Unavailable(format!(
                "the Kafka producer failed ({code:?}): {reason}"
            )));
        }
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.client().fetch_metadata(None, PROBE_TIMEOUT))
            .await
            .map_err(|e| SinkError::Unavailable(format!("metadata lookup task failed: {e}")))?
            .map(|_| ())
            .map_err(|e| {
                SinkError::Unavailable(format!(
                    "cannot reach Kafka at {} within {}s: {e}; check sink.brokers and that the broker is up",
                    self.brokers,
                    PROBE_TIMEOUT.as_secs()
                ))
            })
    }

    async fn check_destination(
        &mut self,
        aggregate_type: &str,
        event_type: &str,
    ) -> Result<String, SinkError> {
        let topic = self.route(aggregate_type, event_type)?;
        self.ensure_topic(&topic).await?;
        Ok(format!("topic {topic}"))
    }

    fn fixed_destination(&self) -> bool {
        self.topic.is_fixed()
    }

    async fn close(self) {
        // Dropping a producer waits for librdkafka's threads: keep that off the runtime.
        let producer = self.producer;
        let _ = tokio::task::spawn_blocking(move || {
            producer.purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
            drop(producer);
        })
        .await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{SinkConfig, load_str};

    fn kafka(sink_keys: &str) -> KafkaConfig {
        let toml = format!(
            "[database]\nurl = \"postgres://relay@db/app\"\n[sink]\ntype = \"kafka\"\nbrokers = \"k:9093\"\n{sink_keys}"
        );
        match load_str(&toml).unwrap_or_else(|e| panic!("{e}")).sink {
            SinkConfig::Kafka(k) => k,
            SinkConfig::RabbitMq(_) => unreachable!(),
        }
    }

    #[test]
    fn typed_security_keys_become_librdkafka_properties() {
        let c = client_config(&kafka(
            "security_protocol = \"sasl_ssl\"\nsasl_mechanism = \"SCRAM-SHA-512\"\nsasl_username = \"relay\"\nsasl_password = \"s3cret\"\nssl_ca = \"/etc/kafka/ca.pem\"\nssl_cert = \"/etc/kafka/relay.pem\"\nssl_key = \"/etc/kafka/relay.key\"\n[sink.properties]\n\"ssl.key.password\" = \"k3y\"\n",
        ));
        for (property, value) in [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "relay"),
            ("sasl.password", "s3cret"),
            ("ssl.ca.location", "/etc/kafka/ca.pem"),
            ("ssl.certificate.location", "/etc/kafka/relay.pem"),
            ("ssl.key.location", "/etc/kafka/relay.key"),
            ("ssl.key.password", "k3y"),
            ("enable.idempotence", "true"),
        ] {
            assert_eq!(c.get(property), Some(value), "{property}");
        }
    }

    #[test]
    fn sasl_defaults_to_plain_and_plaintext_sets_nothing_else() {
        let c = client_config(&kafka(
            "security_protocol = \"sasl_plaintext\"\nsasl_username = \"relay\"\nsasl_password = \"s3cret\"\n",
        ));
        assert_eq!(c.get("sasl.mechanism"), Some("PLAIN"));
        assert_eq!(c.get("ssl.ca.location"), None);
        let c = client_config(&kafka(""));
        assert_eq!(c.get("security.protocol"), Some("plaintext"));
        for property in ["sasl.mechanism", "sasl.username", "sasl.password"] {
            assert_eq!(c.get(property), None, "{property}");
        }
    }

    #[test]
    fn a_refused_file_is_reported_by_its_key() {
        let config = kafka("security_protocol = \"ssl\"\nssl_ca = \"/nonexistent/ca.pem\"\n");
        let e = client_config(&config)
            .create_with_context::<_, RelayProducer>(LogContext::default())
            .err()
            .expect("librdkafka refuses a CA file that does not exist");
        assert!(
            keys_to_check(&e.to_string()).ends_with("check sink.ssl_ca"),
            "{e}"
        );
    }
}
