//! Commit and receipt times per event, the consumers that record receipts,
//! and percentiles.
//!
//! Times are microseconds of the wall clock (`CLOCK_REALTIME`), which the
//! benchmark, the relay and PostgreSQL share on one machine, so a writer's
//! commit time can be compared with the server's `relay_sent_at`.

use crate::infra::{Services, rabbit_connect};
use crate::process::epoch_micros;
use crate::workload::seq_of;
use anyhow::Result;
use futures::StreamExt;
use lapin::options::BasicConsumeOptions;
use lapin::types::FieldTable;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

/// Per-event times of one run, indexed by sequence number; 0 means "not yet".
pub struct Times {
    pub tag: u64,
    pub commit: Vec<AtomicI64>,
    pub received: Vec<AtomicI64>,
    pub received_count: AtomicU64,
    /// Tag of the warm-up event, and whether a consumer saw it.
    pub warmup_tag: u64,
    pub warmup_seen: AtomicBool,
}

impl Times {
    pub fn new(tag: u64, warmup_tag: u64, events: u64) -> Times {
        let slots = || (0..events).map(|_| AtomicI64::new(0)).collect();
        Times {
            tag,
            commit: slots(),
            received: slots(),
            received_count: AtomicU64::new(0),
            warmup_tag,
            warmup_seen: AtomicBool::new(false),
        }
    }

    /// A consumer received the message with this event id now.
    fn receipt(&self, event_id: &str) {
        let now = epoch_micros(SystemTime::now());
        if let Some(seq) = seq_of(event_id, self.tag) {
            if let Some(slot) = self.received.get(seq as usize)
                && slot
                    .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                self.received_count.fetch_add(1, Ordering::Relaxed);
            }
        } else if seq_of(event_id, self.warmup_tag).is_some() {
            self.warmup_seen.store(true, Ordering::Relaxed);
        }
    }

    /// commit → receipt, in microseconds, for every event that has both.
    pub fn consumer_latencies(&self) -> Vec<i64> {
        self.commit
            .iter()
            .zip(&self.received)
            .filter_map(|(c, r)| {
                let (c, r) = (c.load(Ordering::Relaxed), r.load(Ordering::Relaxed));
                (c > 0 && r > 0).then_some(r - c)
            })
            .collect()
    }
}

/// Percentiles of a latency sample, in milliseconds.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Percentiles {
    pub n: usize,
    pub p50_ms: f64,
    pub p95_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Samples below zero (a receipt timed before the writer noted its
    /// commit returned), counted as zero.
    pub negative: usize,
}

impl Percentiles {
    pub fn of(mut micros: Vec<i64>) -> Option<Percentiles> {
        if micros.is_empty() {
            return None;
        }
        let negative = micros.iter().filter(|v| **v < 0).count();
        micros.iter_mut().for_each(|v| *v = (*v).max(0));
        micros.sort_unstable();
        // Nearest rank.
        let at = |q: f64| {
            let rank = ((q * micros.len() as f64).ceil() as usize).clamp(1, micros.len());
            micros[rank - 1] as f64 / 1000.0
        };
        Some(Percentiles {
            n: micros.len(),
            p50_ms: at(0.50),
            p95_ms: at(0.95),
            p99_ms: at(0.99),
            max_ms: at(1.0),
            negative,
        })
    }
}

/// The consumer of a destination (both stop when dropped).
pub type Watchers = (Option<KafkaWatcher>, Option<RabbitWatcher>);

/// Attaches a consumer to the topic or queue `inbox`, recording receipts in `times`.
pub async fn watch(
    services: &Services,
    broker: crate::options::BrokerKind,
    inbox: &str,
    times: Arc<Times>,
) -> Result<Watchers> {
    Ok(match broker {
        crate::options::BrokerKind::Kafka => {
            (Some(KafkaWatcher::start(services, inbox, times)?), None)
        }
        crate::options::BrokerKind::Rabbitmq => (
            None,
            Some(RabbitWatcher::start(services, inbox, times).await?),
        ),
    })
}

/// Reads a topic from the beginning on a thread of its own, recording receipts.
pub struct KafkaWatcher {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl KafkaWatcher {
    pub fn start(services: &Services, topic: &str, times: Arc<Times>) -> Result<KafkaWatcher> {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &services.kafka)
            .set("group.id", crate::kit::unique("bench_"))
            .set("enable.auto.commit", "false")
            .set("auto.offset.reset", "earliest")
            // tansu appears to answer a fetch only when this wait ends, even when
            // data arrived: it bounds the receipt time's resolution, and each
            // empty fetch costs the broker CPU (5 ms doubled tansu's load).
            .set("fetch.wait.max.ms", "10")
            .create()?;
        let mut list = TopicPartitionList::new();
        for p in 0..crate::infra::KAFKA_PARTITIONS {
            list.add_partition_offset(topic, p, Offset::Beginning)?;
        }
        consumer.assign(&list)?;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("kafka-watcher".into())
            .spawn(move || {
                while !flag.load(Ordering::Relaxed) {
                    let Some(Ok(m)) = consumer.poll(Duration::from_millis(100)) else {
                        continue;
                    };
                    let id = m.headers().and_then(|h| {
                        h.iter()
                            .find(|h| h.key == "event_id")
                            .and_then(|h| h.value)
                            .and_then(|v| std::str::from_utf8(v).ok())
                    });
                    if let Some(id) = id {
                        times.receipt(id);
                    }
                }
            })?;
        Ok(KafkaWatcher {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for KafkaWatcher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Consumes a queue (auto-ack), recording receipts.
pub struct RabbitWatcher {
    task: tokio::task::JoinHandle<()>,
    _connection: lapin::Connection,
}

impl RabbitWatcher {
    pub async fn start(
        services: &Services,
        queue: &str,
        times: Arc<Times>,
    ) -> Result<RabbitWatcher> {
        let connection = rabbit_connect(services).await?;
        let ch = connection.create_channel().await?;
        let mut consumer = ch
            .basic_consume(
                queue.into(),
                "".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await?;
        let task = tokio::spawn(async move {
            let _ch = ch;
            while let Some(Ok(d)) = consumer.next().await {
                if let Some(id) = d.properties.message_id() {
                    times.receipt(id.as_str());
                }
            }
        });
        Ok(RabbitWatcher {
            task,
            _connection: connection,
        })
    }
}

impl Drop for RabbitWatcher {
    fn drop(&mut self) {
        self.task.abort();
    }
}
