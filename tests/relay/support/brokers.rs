//! Per-test Kafka topics and RabbitMQ exchanges, with consumers that record
//! everything they receive.

use super::{WAIT, amqp_url, kafka_brokers, wait_for};
use crate::kit::consumers;
use futures::StreamExt;
use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message as _;
use rdkafka::{Offset, TopicPartitionList};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub use crate::kit::consumers::Received;

#[derive(Clone, Default)]
pub struct Inbox(Arc<Mutex<Vec<Received>>>);

impl Inbox {
    pub fn snapshot(&self) -> Vec<Received> {
        self.0.lock().unwrap().clone()
    }

    pub fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }

    /// The event ids received so far.
    pub fn event_ids(&self) -> HashSet<String> {
        self.ids_in_order().into_iter().collect()
    }

    /// The event id of every message received so far, in arrival order.
    pub fn ids_in_order(&self) -> Vec<String> {
        self.snapshot().iter().map(Received::event_id).collect()
    }

    /// Waits until at least `n` messages arrived; returns them all.
    pub async fn wait_len(&self, n: usize, limit: Duration) -> Vec<Received> {
        wait_for(
            limit,
            &format!("{n} messages (have {})", self.len()),
            || {
                let inbox = self.clone();
                async move { (inbox.len() >= n).then(|| inbox.snapshot()) }
            },
        )
        .await
    }

    /// Waits until every id in `ids` was received at least once; on timeout,
    /// the ids still missing.
    pub async fn try_wait_ids(
        &self,
        ids: &[String],
        limit: Duration,
    ) -> Result<Vec<Received>, Vec<String>> {
        let start = std::time::Instant::now();
        loop {
            let got = self.snapshot();
            let seen: std::collections::HashSet<String> =
                got.iter().map(|m| m.event_id()).collect();
            let missing: Vec<String> = ids
                .iter()
                .filter(|id| !seen.contains(*id))
                .cloned()
                .collect();
            if missing.is_empty() {
                return Ok(got);
            }
            if start.elapsed() > limit {
                return Err(missing);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every id in `ids` was received at least once; on
    /// timeout, panics naming what is missing.
    pub async fn wait_ids(&self, ids: &[String], limit: Duration) -> Vec<Received> {
        match self.try_wait_ids(ids, limit).await {
            Ok(got) => got,
            Err(missing) => panic!(
                "timed out after {limit:?} waiting for {} event ids: {} missing, e.g. {:?}",
                ids.len(),
                missing.len(),
                &missing[..missing.len().min(5)]
            ),
        }
    }
}

/// The event ids of `got` at their first delivery, in arrival order: the
/// repeats a crash or a retry may bring are left out.
pub fn first_ids(got: &[Received]) -> Vec<String> {
    let mut seen = HashSet::new();
    got.iter()
        .map(Received::event_id)
        .filter(|id| seen.insert(id.clone()))
        .collect()
}

/// A Kafka topic prefix of its own, and a consumer reading every topic created under it.
pub struct KafkaTopics {
    pub brokers: String,
    pub prefix: String,
    pub inbox: Inbox,
    stop: Arc<AtomicBool>,
    consumer: Arc<BaseConsumer>,
    assigned: Arc<Mutex<TopicPartitionList>>,
}

pub const KAFKA_PARTITIONS: i32 = 3;

impl KafkaTopics {
    pub fn new() -> KafkaTopics {
        Self::with_brokers(&kafka_brokers())
    }

    /// Topics on another broker (e.g. a test's private one).
    pub fn with_brokers(brokers: &str) -> KafkaTopics {
        let prefix = super::unique("t");
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", brokers)
            .set("group.id", &prefix)
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            .create()
            .expect("kafka consumer");
        let consumer = Arc::new(consumer);
        let inbox = Inbox::default();
        let stop = Arc::new(AtomicBool::new(false));
        let (c, i, s) = (consumer.clone(), inbox.clone(), stop.clone());
        std::thread::spawn(move || {
            // Offsets are contiguous per partition (idempotent producer, no
            // transactions). The test broker can return records out of place
            // when a fetch starts inside a record batch; reading a partition
            // again from its beginning is reliable, so on a gap the consumer
            // rewinds that partition and skips what it already has.
            let mut next: HashMap<(String, i32), i64> = HashMap::new();
            // Where a rewind already happened: a gap still there after one is real.
            let mut rewound: HashMap<(String, i32), i64> = HashMap::new();
            while !s.load(Ordering::Relaxed) {
                let Some(Ok(m)) = c.poll(Duration::from_millis(100)) else {
                    continue;
                };
                let tp = (m.topic().to_owned(), m.partition());
                let expected = next.entry(tp.clone()).or_insert(0);
                if m.offset() < *expected {
                    continue; // already recorded
                }
                if m.offset() > *expected && rewound.get(&tp) != Some(expected) {
                    rewound.insert(tp, *expected);
                    let _ = c.seek(
                        m.topic(),
                        m.partition(),
                        Offset::Beginning,
                        Duration::from_secs(5),
                    );
                    continue;
                }
                *expected = m.offset() + 1;
                i.0.lock().unwrap().push(Received::from_kafka(&m));
            }
        });
        KafkaTopics {
            brokers: brokers.to_owned(),
            prefix,
            inbox,
            stop,
            consumer,
            assigned: Arc::new(Mutex::new(TopicPartitionList::new())),
        }
    }

    /// The topic for an aggregate type, as the relay's template `{prefix}.{aggregate_type}` names it.
    pub fn topic(&self, aggregate_type: &str) -> String {
        format!("{}.{aggregate_type}", self.prefix)
    }

    /// Creates the topic for `aggregate_type` and starts consuming it from the beginning.
    pub async fn create(&self, aggregate_type: &str) {
        let name = self.topic(aggregate_type);
        create_topic(&self.brokers, &name, KAFKA_PARTITIONS).await;
        let mut list = self.assigned.lock().unwrap();
        for p in 0..KAFKA_PARTITIONS {
            list.add_partition_offset(&name, p, Offset::Beginning)
                .unwrap();
        }
        self.consumer.assign(&list).expect("assign partitions");
    }

    /// The `[sink]` section for a relay publishing here.
    pub fn sink_toml(&self) -> String {
        format!(
            "[sink]\ntype = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{}.{{aggregate_type}}\"\nlinger = \"1ms\"\ndelivery_timeout = \"15s\"\n",
            self.brokers, self.prefix
        )
    }
}

impl Drop for KafkaTopics {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

pub async fn create_topic(brokers: &str, name: &str, partitions: i32) {
    match consumers::create_topic(brokers, name, partitions, WAIT / 2).await {
        Ok(_) => {}
        Err(e) => panic!("creating {name}: {e:?}"),
    }
}

/// A RabbitMQ exchange of its own with a queue bound to every routing key.
pub struct RabbitExchange {
    pub exchange: String,
    pub inbox: Inbox,
    _connection: Connection,
}

impl RabbitExchange {
    pub async fn new() -> RabbitExchange {
        let exchange = super::unique("t");
        Self::with_name(&exchange, true).await
    }

    /// `declare`: whether to create the exchange (and its queue) now.
    pub async fn with_name(exchange: &str, declare: bool) -> RabbitExchange {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("connect to RabbitMQ");
        let inbox = Inbox::default();
        let r = RabbitExchange {
            exchange: exchange.to_owned(),
            inbox,
            _connection: connection,
        };
        if declare {
            r.declare().await;
        }
        r
    }

    /// Declares the exchange and binds a fresh queue that records deliveries.
    pub async fn declare(&self) {
        let ch = self._connection.create_channel().await.unwrap();
        ch.exchange_declare(
            self.exchange.as_str().into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                auto_delete: false,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare exchange");
        self.bind("#").await;
    }

    /// A consumer on an exchange that already exists (e.g. `amq.direct`),
    /// through a fresh queue bound with `binding`.
    pub async fn bind_existing(exchange: &str, binding: &str) -> RabbitExchange {
        let r = Self::with_name(exchange, false).await;
        r.bind(binding).await;
        r
    }

    async fn bind(&self, binding: &str) {
        let ch = self._connection.create_channel().await.unwrap();
        let mut consumer = consumers::bind_consumer(&ch, &self.exchange, binding, "", false, WAIT)
            .await
            .unwrap_or_else(|f| panic!("{}: {:?}", f.step, f.error));
        let inbox = self.inbox.clone();
        tokio::spawn(async move {
            let _ch = ch;
            while let Some(Ok(d)) = consumer.next().await {
                let received = Received::from_amqp(d, |secs| secs.to_string());
                inbox.0.lock().unwrap().push(received);
            }
        });
    }

    pub fn sink_toml(&self) -> String {
        format!(
            "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{}\"\n",
            amqp_url(),
            self.exchange
        )
    }
}
