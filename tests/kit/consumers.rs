//! What a consumer of the relay's messages does on either broker: Kafka
//! topics made before the relay publishes, a RabbitMQ queue of its own bound
//! to an exchange, and each message reduced to text. The tests' recording
//! consumers (`tests/relay/support/brokers.rs`) and the `tail` example share
//! it, so both read a message the same way.

use lapin::options::{BasicConsumeOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel, Consumer};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::KafkaError;
use rdkafka::message::{Headers, Message};
use rdkafka::types::RDKafkaErrorCode;
use std::time::Duration;

/// One message as a consumer received it.
#[derive(Debug, Clone)]
pub struct Received {
    /// Kafka: the topic; RabbitMQ: the routing key.
    pub destination: String,
    pub key: Option<String>,
    pub body: Vec<u8>,
    pub headers: Vec<(String, String)>,
    /// AMQP properties (RabbitMQ only), in a fixed order.
    pub properties: Vec<(&'static str, String)>,
}

impl Received {
    pub fn from_kafka(m: &impl Message) -> Received {
        let headers = m
            .headers()
            .map(|h| {
                h.iter()
                    .map(|h| (h.key.to_owned(), text(h.value.unwrap_or_default())))
                    .collect()
            })
            .unwrap_or_default();
        Received {
            destination: m.topic().to_owned(),
            key: m.key().map(text),
            body: m.payload().unwrap_or_default().to_vec(),
            headers,
            properties: Vec::new(),
        }
    }

    /// `timestamp` writes the AMQP timestamp property (seconds since the epoch).
    pub fn from_amqp(d: lapin::message::Delivery, timestamp: fn(u64) -> String) -> Received {
        let p = &d.properties;
        Received {
            destination: d.routing_key.to_string(),
            key: None,
            headers: amqp_headers(p),
            properties: amqp_properties(p, timestamp),
            body: d.data,
        }
    }

    /// The body as JSON (a test's message always is).
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).expect("message body is JSON")
    }

    /// The event id, from the `event_id` header (structured mode) or
    /// `ce_id` / `cloudEvents:id` (binary, Kafka / RabbitMQ).
    pub fn event_id(&self) -> String {
        self.header("event_id")
            .or(self.header("ce_id"))
            .or(self.header("cloudEvents:id"))
            .expect("message has an event id header")
            .to_owned()
    }

    pub fn property(&self, name: &str) -> Option<&str> {
        self.properties
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The properties the relay sets, those present.
fn amqp_properties(
    p: &BasicProperties,
    timestamp: fn(u64) -> String,
) -> Vec<(&'static str, String)> {
    [
        ("message_id", p.message_id().as_ref().map(|v| v.to_string())),
        ("type", p.kind().as_ref().map(|v| v.to_string())),
        (
            "content_type",
            p.content_type().as_ref().map(|v| v.to_string()),
        ),
        ("timestamp", p.timestamp().map(timestamp)),
        ("delivery_mode", p.delivery_mode().map(|v| v.to_string())),
        ("app_id", p.app_id().as_ref().map(|v| v.to_string())),
    ]
    .into_iter()
    .filter_map(|(k, v)| Some((k, v?)))
    .collect()
}

fn amqp_headers(p: &BasicProperties) -> Vec<(String, String)> {
    p.headers()
        .as_ref()
        .map(|t| {
            t.inner()
                .iter()
                .map(|(k, v)| (k.to_string(), amqp_text(v)))
                .collect()
        })
        .unwrap_or_default()
}

/// A header value as text (the relay's are long strings).
pub fn amqp_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => text(s.as_bytes()),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::Timestamp(t) => t.to_string(),
        other => format!("{other:?}"),
    }
}

/// Bytes shown as text, with invalid UTF-8 replaced.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// A step of [`bind_consumer`] that failed or did not answer within its limit.
#[derive(Debug)]
pub struct StepFailed {
    /// What was being done ("declaring a queue", ...).
    pub step: &'static str,
    /// `None`: no answer in time.
    pub error: Option<lapin::Error>,
}

/// A queue of the consumer's own (server-named, exclusive: it goes with the
/// connection; `auto_delete`: also with its consumer) bound to `exchange`
/// with `binding`, and a consumer on it that takes messages without acks.
/// Each call to the broker may take `limit`.
pub async fn bind_consumer(
    channel: &Channel,
    exchange: &str,
    binding: &str,
    tag: &str,
    auto_delete: bool,
    limit: Duration,
) -> Result<Consumer, StepFailed> {
    async fn step<T>(
        limit: Duration,
        step: &'static str,
        call: impl Future<Output = lapin::Result<T>>,
    ) -> Result<T, StepFailed> {
        match tokio::time::timeout(limit, call).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(StepFailed {
                step,
                error: Some(e),
            }),
            Err(_) => Err(StepFailed { step, error: None }),
        }
    }
    let queue_options = QueueDeclareOptions {
        exclusive: true,
        auto_delete,
        ..QueueDeclareOptions::default()
    };
    let queue = step(
        limit,
        "declaring a queue",
        channel.queue_declare("".into(), queue_options, FieldTable::default()),
    )
    .await?;
    step(
        limit,
        "binding the queue",
        channel.queue_bind(
            queue.name().clone(),
            exchange.into(),
            binding.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    let consume_options = BasicConsumeOptions {
        no_ack: true,
        ..BasicConsumeOptions::default()
    };
    step(
        limit,
        "starting the consumer",
        channel.basic_consume(
            queue.name().clone(),
            tag.into(),
            consume_options,
            FieldTable::default(),
        ),
    )
    .await
}

/// Why [`create_topic`] did not make the topic.
#[derive(Debug)]
pub enum TopicFailed {
    /// The admin client could not be made.
    NoClient(KafkaError),
    /// The request failed.
    Request(KafkaError),
    /// No answer within twice `call`.
    Timeout,
    /// The broker refused it.
    Refused(RDKafkaErrorCode),
}

/// Creates topic `name` of `partitions` partitions (one replica) on
/// `brokers`, each request to the broker bounded by `call` and the whole by
/// twice that; `Ok(false)` when it existed already.
pub async fn create_topic(
    brokers: &str,
    name: &str,
    partitions: i32,
    call: Duration,
) -> Result<bool, TopicFailed> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .create()
        .map_err(TopicFailed::NoClient)?;
    let topic = NewTopic::new(name, partitions, TopicReplication::Fixed(1));
    let options = AdminOptions::new()
        .request_timeout(Some(call))
        .operation_timeout(Some(call));
    let results = tokio::time::timeout(call * 2, admin.create_topics([&topic], &options))
        .await
        .map_err(|_| TopicFailed::Timeout)?
        .map_err(TopicFailed::Request)?;
    match results.into_iter().next() {
        Some(Err((_, RDKafkaErrorCode::TopicAlreadyExists))) => Ok(false),
        Some(Err((_, code))) => Err(TopicFailed::Refused(code)),
        Some(Ok(_)) | None => Ok(true),
    }
}
