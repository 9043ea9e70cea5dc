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
use crate::envelope::routing::{self, Routing};
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
    /// Per-row topic and key columns, when configured.
    routing: Routing,
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
            routing: Routing::default(),
            max_bytes: config.message_max_bytes,
            delivery_timeout: config.delivery_timeout,
            known_topics: HashSet::new(),
        };
        sink.probe().await?;
        Ok(sink)
    }

    /// Takes the topic and key of each event from these columns where the
    /// row has a value (`outbox.columns.destination`, `outbox.columns.key`).
    pub fn with_routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
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

/// The topic the template names for events of this kind.
fn render(
    template: &Template,
    aggregate_type: &str,
    event_type: &str,
) -> Result<String, SinkError> {
    let topic = template.render(|f| match f {
        Field::AggregateType => aggregate_type,
        Field::EventType => event_type,
    });
    destination::kafka_topic(&topic).map_err(SinkError::Rejected)?;
    Ok(topic)
}

/// The event's topic: its destination column's value, else the template's.
fn topic_of(
    template: &Template,
    routing: &Routing,
    event: &OutboxEvent,
) -> Result<String, SinkError> {
    let own = routing
        .destination(event, destination::kafka_topic, "sink.topic")
        .map_err(SinkError::Rejected)?;
    match own {
        Some(topic) => Ok(topic.to_owned()),
        None => render(template, &event.aggregate_type, &event.event_type),
    }
}

/// The event's key column's value, when it has one (else the aggregate id).
fn key_of<'a>(routing: &Routing, event: &'a OutboxEvent) -> Result<Option<&'a str>, SinkError> {
    routing
        .key(event, routing::any_value, "the aggregate id")
        .map_err(SinkError::Rejected)
}

/// Messages of one aggregate keep their order through a refusal only
/// within one partition: the same topic and the same key. Without a key of
/// its own an event's key is its aggregate id, the same for all of them.
/// An event whose topic or key is refused has no lane.
fn lane_of(template: &Template, routing: &Routing, event: &OutboxEvent) -> Option<String> {
    let topic = topic_of(template, routing, event).ok()?;
    match key_of(routing, event).ok()? {
        None => Some(topic),
        // A NUL cannot occur in a topic name.
        Some(key) => Some(format!("{topic}\0{key}")),
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
        mut message: Message,
    ) -> Result<Confirmation, SinkError> {
        let topic = topic_of(&self.topic, &self.routing, event)?;
        if let Some(key) = key_of(&self.routing, event)? {
            key.clone_into(&mut message.key);
        }
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

    /// The topic, and the key when a key column sets one: one partition
    /// per key, and a refused message fails every later one of its
    /// partition (`enable.gapless.guarantee`).
    fn lane(&self, event: &OutboxEvent) -> Option<String> {
        lane_of(&self.topic, &self.routing, event)
    }

    fn destination(&self, event: &OutboxEvent) -> Option<String> {
        topic_of(&self.topic, &self.routing, event).ok()
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
        let topic = render(&self.topic, aggregate_type, event_type)?;
        self.ensure_topic(&topic).await?;
        Ok(format!("topic {topic}"))
    }

    async fn check_named_destination(&mut self, name: &str) -> Result<String, SinkError> {
        destination::kafka_topic(name).map_err(SinkError::Rejected)?;
        self.ensure_topic(name).await?;
        Ok(format!("topic {name}"))
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

    fn event(aggregate_id: &str, extra: &[(&str, &str)]) -> OutboxEvent {
        OutboxEvent {
            id: "e".into(),
            aggregate_type: "order".into(),
            aggregate_id: aggregate_id.into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            payload: serde_json::value::RawValue::from_string("{}".into()).unwrap(),
            headers: vec![],
            created_at: chrono::Utc::now(),
            extra: extra
                .iter()
                .map(|(c, v)| ((*c).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    #[test]
    fn the_lane_follows_each_rows_own_topic_and_key() {
        let template = Template::parse("outbox.event.{aggregate_type}").unwrap();
        let routing = Routing::from_columns(&crate::outbox::ColumnMap {
            destination: Some("topic".into()),
            key: Some("msg_key".into()),
            ..Default::default()
        });
        let lane = |extra: &[(&str, &str)]| lane_of(&template, &routing, &event("o-1", extra));
        // NULL columns: the template's topic, keyed by the aggregate id.
        assert_eq!(lane(&[]).as_deref(), Some("outbox.event.order"));
        // Two events of one aggregate routed to different topics, or keyed
        // differently (other partitions), are in different lanes: one at a time.
        let a = lane(&[("topic", "billing")]);
        let b = lane(&[("topic", "shipping")]);
        assert_eq!(a.as_deref(), Some("billing"));
        assert_ne!(a, b);
        assert_ne!(a, lane(&[("topic", "billing"), ("msg_key", "k")]));
        assert_ne!(lane(&[("msg_key", "k1")]), lane(&[("msg_key", "k2")]));
        assert_eq!(lane(&[("msg_key", "k1")]), lane(&[("msg_key", "k1")]));
        // A refused value has no lane: the event goes alone, and is refused.
        assert_eq!(lane(&[("topic", "no spaces")]), None);
        assert_eq!(lane(&[("msg_key", "")]), None);
        let e = event("o-1", &[("topic", "no spaces")]);
        let Err(SinkError::Rejected(why)) = topic_of(&template, &routing, &e) else {
            panic!("a bad topic value is a refusal");
        };
        assert!(
            why.contains("column \"topic\" (outbox.columns.destination) holds \"no spaces\""),
            "{why}"
        );
        // Without routing columns the lane is the template's topic, as before.
        let plain = Routing::default();
        assert_eq!(
            lane_of(&template, &plain, &e).as_deref(),
            Some("outbox.event.order")
        );
    }
}
