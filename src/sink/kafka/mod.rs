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
//!
//! - `mod.rs`: the sink, its topic checks and the delivery reports;
//! - `client.rs`: the librdkafka properties derived from `[sink]`;
//! - `route.rs`: each event's topic, key and lane;
//! - `error.rs`: what librdkafka's errors mean for the relay;
//! - `log.rs`: librdkafka's own log lines, rate-limited.
//!
//! The keys and their checks are in `config/sink/kafka.rs` (the configuration
//! layer cannot depend on the sink).

mod client;
mod error;
mod log;
mod route;

use super::{Confirmation, Reason, Route, Sink, SinkCheck, SinkError, within_limit};
use crate::config::KafkaConfig;
use crate::config::destination;
use crate::envelope::Message;
use crate::envelope::routing::Routing;
use crate::outbox::OutboxEvent;
use client::{client_config, keys_to_check};
use error::classify;
use log::LogContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use route::{Topics, render, route};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long a metadata request (topic existence, reachability) may take.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);
/// The idle liveness probe's lookup: it holds up the pipeline while it runs.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

type RelayProducer = FutureProducer<LogContext>;

pub struct KafkaSink {
    producer: RelayProducer,
    brokers: String,
    topics: Topics,
    /// Per-row topic and key columns, when configured.
    routing: Routing,
    max_bytes: usize,
    delivery_timeout: Duration,
    /// Topics seen to exist; a missing topic is looked up again on every use.
    known_topics: HashSet<String>,
    /// Set by the fence while it purges (and for good when it purged
    /// anything): a message handed over meanwhile could overtake one it
    /// calls back, so sends are refused.
    fenced: Arc<AtomicBool>,
}

impl KafkaSink {
    /// Creates the producer and checks that a broker answers.
    pub async fn connect(config: &KafkaConfig) -> Result<Self, SinkError> {
        let producer: RelayProducer = client_config(config)
            .create_with_context(LogContext::default())
            .map_err(|e| {
                SinkError::Fatal(Reason::caused_by(
                    format!(
                        "cannot create the Kafka producer: {e}{}",
                        keys_to_check(&e.to_string())
                    ),
                    e,
                ))
            })?;
        let mut sink = KafkaSink {
            producer,
            brokers: config.brokers.clone(),
            topics: Topics::new(config.topic.clone()),
            routing: Routing::default(),
            max_bytes: config.message_max_bytes,
            delivery_timeout: config.delivery_timeout,
            known_topics: HashSet::new(),
            fenced: Arc::new(AtomicBool::new(false)),
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
        .map_err(|e| {
            SinkError::Unavailable(Reason::caused_by(
                format!("metadata lookup task failed: {e}"),
                e,
            ))
        })?
        .map_err(|e| {
            SinkError::Unavailable(Reason::caused_by(
                format!(
                    "cannot reach Kafka at {}: {e}; check sink.brokers and that the broker is up",
                    self.brokers
                ),
                e,
            ))
        })?;
        let found = metadata.topics().iter().find(|t| t.name() == topic);
        topic_problem(topic, found.map(|t| (t.error(), t.partitions().is_empty())))?;
        self.known_topics.insert(topic.to_owned());
        Ok(())
    }
}

/// What the broker's metadata for `topic` (its error, and whether it has
/// no partitions; `None` when it did not name the topic) means for a
/// message to it. A topic without a leader yet (LEADER_NOT_AVAILABLE:
/// being created by auto-creation, or a leader election), or without
/// partitions yet, pushes it back, counting no attempt against a healthy
/// event. Any other error (the topic does not exist, the relay may not
/// write to it, its creation failed) refuses it: an attempt, towards its
/// dead letter, so that it cannot pin the stream for ever.
fn topic_problem(
    topic: &str,
    found: Option<(Option<rdkafka::types::RDKafkaRespErr>, bool)>,
) -> Result<(), SinkError> {
    use RDKafkaErrorCode as C;
    let (error, no_partitions) = match found {
        Some((None, false)) => return Ok(()),
        Some((error, no_partitions)) => (error.map(C::from), no_partitions),
        None => (Some(C::UnknownTopicOrPartition), true),
    };
    match error {
        Some(C::UnknownTopicOrPartition | C::UnknownTopic) => Err(SinkError::rejected(format!(
            "topic {topic:?} does not exist and the broker did not create it; create the topic (or enable auto-creation on the broker)"
        ))),
        Some(code @ C::LeaderNotAvailable) => Err(SinkError::Busy(
            format!("Kafka has no leader for topic {topic:?} yet ({code}): it is being created, or electing one; retrying").into(),
        )),
        Some(code) => Err(SinkError::rejected(format!(
            "Kafka refused topic {topic:?} ({code}); give the relay's user write access to it, \
             fix what the broker says, or route these events elsewhere"
        ))),
        None if no_partitions => Err(SinkError::Busy(
            format!("topic {topic:?} has no partitions yet (it is being created); retrying").into(),
        )),
        None => Ok(()),
    }
}

impl Sink for KafkaSink {
    /// The topic, and the key when a key column sets one. The lane is the
    /// topic and key: one partition per key, and a refused message fails
    /// every later one of its partition (`enable.gapless.guarantee`).
    fn route(&self, event: &OutboxEvent) -> Result<Route, SinkError> {
        route(&self.topics, &self.routing, event)
    }

    async fn send(
        &mut self,
        route: Route,
        mut message: Message<'_>,
    ) -> Result<Confirmation, SinkError> {
        message.key = route.key.into();
        if self.fenced.load(Ordering::SeqCst) {
            return Err(SinkError::Unavailable(
                "the Kafka producer was fenced when the ownership lease ran out".into(),
            ));
        }
        within_limit(&message, self.max_bytes)?;
        let topic = route.destination;
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

    async fn probe(&mut self) -> Result<(), SinkError> {
        if let Some((code, reason)) = self.producer.client().fatal_error() {
            return Err(SinkError::Unavailable(
                format!("the Kafka producer failed ({code:?}): {reason}").into(),
            ));
        }
        let producer = self.producer.clone();
        tokio::task::spawn_blocking(move || producer.client().fetch_metadata(None, PROBE_TIMEOUT))
            .await
            .map_err(|e| SinkError::Unavailable(Reason::caused_by(format!("metadata lookup task failed: {e}"), e)))?
            .map(|_| ())
            .map_err(|e| {
                SinkError::Unavailable(Reason::caused_by(format!(
                    "cannot reach Kafka at {} within {}s: {e}; check sink.brokers and that the broker is up",
                    self.brokers,
                    PROBE_TIMEOUT.as_secs()
                ), e))
            })
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

    /// Purges the producer's queue and its requests in flight: librdkafka
    /// retries a request whose connection died, or whose partition moved
    /// to another leader, for as long as it takes (`message.timeout.ms` is
    /// unbounded), so without this a message could reach the broker long
    /// after the ownership lease ran out. A request already on the wire may
    /// still be written.
    fn fence(&self) -> Option<super::Fence> {
        let (producer, fenced) = (self.producer.clone(), self.fenced.clone());
        Some(Arc::new(move || {
            // At once, before the purge: nothing handed over from now on.
            fenced.store(true, Ordering::SeqCst);
            let (producer, fenced) = (producer.clone(), fenced.clone());
            // A purge may block for a moment: off the async threads.
            Box::pin(async move {
                let held = tokio::task::spawn_blocking(move || {
                    let held = usize::try_from(producer.in_flight_count()).unwrap_or(0);
                    if held > 0 {
                        producer
                            .purge(rdkafka::producer::PurgeConfig::default().queue().inflight());
                    }
                    held
                })
                .await
                .unwrap_or(1);
                if held == 0 {
                    fenced.store(false, Ordering::SeqCst);
                }
                held
            })
        }))
    }
}

impl SinkCheck for KafkaSink {
    async fn check_destination(
        &mut self,
        aggregate_type: &str,
        event_type: &str,
    ) -> Result<String, SinkError> {
        let topic = render(self.topics.template(), aggregate_type, event_type)?;
        self.ensure_topic(&topic).await?;
        Ok(format!("topic {topic}"))
    }

    async fn check_named_destination(&mut self, name: &str) -> Result<String, SinkError> {
        destination::kafka_topic(name).map_err(SinkError::rejected)?;
        self.ensure_topic(name).await?;
        Ok(format!("topic {name}"))
    }

    fn fixed_destination(&self) -> bool {
        self.topics.template().is_fixed()
    }
}

#[cfg(test)]
mod tests;
