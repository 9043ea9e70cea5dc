//! Databases, topics, exchanges and queues of the benchmark's own, and their
//! removal.
//!
//! The services are shared with other users (test suites running in
//! parallel), so every object has a unique `bench_` name, is registered in
//! [`Cleanup`] as soon as it exists, and is removed when its scenario ends,
//! or when the benchmark is interrupted. Replication slots are cluster-wide:
//! each scenario's slot has a unique name and goes with its database.

use crate::options::QueueType;
use anyhow::{Context, Result, anyhow};
use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ConnectionProperties, ExchangeKind};
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions};
use rdkafka::client::DefaultClientContext;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_postgres::{Client, NoTls};

/// Longest wait for any one setup or cleanup step.
pub const STEP: Duration = Duration::from_secs(30);

/// Partitions of every benchmark topic (relay and ceiling alike).
pub const KAFKA_PARTITIONS: i32 = 3;

/// Where the services listen; the test suite's variables override the defaults.
#[derive(Debug, Clone)]
pub struct Services {
    pub pg_admin: String,
    pub amqp: String,
    pub kafka: String,
}

impl Services {
    pub fn from_env() -> Services {
        let var =
            |name: &str, default: &str| std::env::var(name).unwrap_or_else(|_| default.into());
        Services {
            pg_admin: var(
                "OUTBOX_RELAY_TEST_PG",
                "postgres://postgres@127.0.0.1:55432/postgres",
            ),
            amqp: var(
                "OUTBOX_RELAY_TEST_AMQP",
                "amqp://guest:guest@127.0.0.1:5672/%2f",
            ),
            kafka: var("OUTBOX_RELAY_TEST_KAFKA", "127.0.0.1:9092"),
        }
    }

    /// The URL of another database on the same server.
    pub fn db_url(&self, name: &str) -> String {
        match self.pg_admin.rsplit_once('/') {
            Some((base, _)) => format!("{base}/{name}"),
            None => self.pg_admin.clone(),
        }
    }
}

/// `fut`, or an error naming `what` after `limit`.
pub async fn bounded<T>(
    limit: Duration,
    what: &str,
    fut: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::time::timeout(limit, fut)
        .await
        .map_err(|_| anyhow!("timed out after {}s: {what}", limit.as_secs()))?
}

/// Runs one whole measurement within `limit` (whatever hangs, the run goes
/// on), then removes what it created. Returns the failure, if any, as the
/// result's status.
pub async fn measurement(
    cleanup: &Cleanup,
    limit: Duration,
    fut: impl Future<Output = Result<()>>,
) -> Option<String> {
    let outcome = bounded(limit, "the whole measurement", fut).await;
    cleanup.run().await;
    outcome.err().map(|e| format!("failed: {e:#}"))
}

/// `application_name` of every session the benchmark opens (setup, writer,
/// polls), so that the server processes serving the relay can be told apart.
pub const BENCH_APPLICATION: &str = "outbox-relay-bench";

pub async fn connect(url: &str) -> Result<Client> {
    bounded(STEP, "connecting to PostgreSQL", async {
        let mut config: tokio_postgres::Config = url
            .parse()
            .with_context(|| format!("not a PostgreSQL URL: {url}"))?;
        config.application_name(BENCH_APPLICATION);
        let (client, conn) = config
            .connect(NoTls)
            .await
            .with_context(|| format!("cannot connect to {url}; did scripts/services.sh run?"))?;
        tokio::spawn(conn);
        Ok(client)
    })
    .await
}

/// Something to remove when the scenario ends.
#[derive(Debug, Clone)]
enum Resource {
    Database(String),
    Topic(String),
    Queue(String),
    Exchange(String),
}

/// What the running scenario created and has not removed yet.
#[derive(Clone)]
pub struct Cleanup {
    services: Services,
    pending: Arc<Mutex<Vec<Resource>>>,
}

impl Cleanup {
    pub fn new(services: &Services) -> Cleanup {
        Cleanup {
            services: services.clone(),
            pending: Arc::default(),
        }
    }

    fn add(&self, r: Resource) {
        self.pending.lock().unwrap().push(r);
    }

    /// How many resources are registered: a mark for [`Cleanup::run_from`].
    pub fn mark(&self) -> usize {
        self.pending.lock().unwrap().len()
    }

    /// Removes everything registered; failures are reported, not fatal.
    pub async fn run(&self) {
        self.run_from(0).await;
    }

    /// Removes what was registered after `mark`, newest first.
    pub async fn run_from(&self, mark: usize) {
        let pending: Vec<Resource> = {
            let mut all = self.pending.lock().unwrap();
            let at = mark.min(all.len());
            all.split_off(at)
        };
        for r in pending.into_iter().rev() {
            let result = match &r {
                Resource::Database(name) => drop_database(&self.services, name).await,
                Resource::Topic(name) => delete_topic(&self.services, name).await,
                Resource::Queue(name) => {
                    rabbit_admin(&self.services, |ch| async move {
                        ch.queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                            .await
                            .map(|_| ())
                    })
                    .await
                }
                Resource::Exchange(name) => {
                    rabbit_admin(&self.services, |ch| async move {
                        ch.exchange_delete(name.as_str().into(), ExchangeDeleteOptions::default())
                            .await
                    })
                    .await
                }
            };
            if let Err(e) = result {
                eprintln!("bench: cleanup of {r:?} failed: {e:#}");
            }
        }
    }
}

/// A database of the scenario's own.
pub struct BenchDb {
    pub name: String,
    pub url: String,
    pub client: Client,
}

impl BenchDb {
    pub async fn create(services: &Services, cleanup: &Cleanup) -> Result<BenchDb> {
        let admin = connect(&services.pg_admin).await?;
        let name = crate::kit::unique("bench_");
        bounded(STEP, "CREATE DATABASE", async {
            admin
                .batch_execute(&format!("CREATE DATABASE {name}"))
                .await
                .context("creating the benchmark database")
        })
        .await?;
        cleanup.add(Resource::Database(name.clone()));
        let url = services.db_url(&name);
        let client = connect(&url).await?;
        Ok(BenchDb { name, url, client })
    }

    /// True once no row is left unsent (cheap: the relay's partial index).
    pub async fn all_sent(&self) -> Result<bool> {
        let row = self
            .client
            .query_one(
                "SELECT NOT EXISTS (SELECT 1 FROM outbox WHERE relay_sent_at IS NULL)",
                &[],
            )
            .await?;
        Ok(row.get(0))
    }
}

/// Ends the database's sessions, drops its (inactive) replication slots, then the database.
async fn drop_database(services: &Services, name: &str) -> Result<()> {
    let admin = connect(&services.pg_admin).await?;
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            &[&name],
        )
        .await?;
    // A terminated WAL sender releases its slot a moment later.
    let mut left = 0;
    for _ in 0..100 {
        let _ = admin
            .execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE database = $1 AND NOT active",
                &[&name],
            )
            .await;
        left = admin
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE database = $1",
                &[&name],
            )
            .await?
            .get::<_, i64>(0);
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if left > 0 {
        eprintln!(
            "bench: {left} replication slot(s) of {name} are still active; dropping the database anyway"
        );
    }
    bounded(STEP, "DROP DATABASE", async {
        admin
            .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            .await
            .context("dropping the benchmark database")
    })
    .await
}

fn kafka_admin(services: &Services) -> Result<AdminClient<DefaultClientContext>> {
    ClientConfig::new()
        .set("bootstrap.servers", &services.kafka)
        .create()
        .context("creating a Kafka admin client")
}

/// Creates a topic of [`KAFKA_PARTITIONS`] partitions, registered for removal.
pub async fn create_topic(services: &Services, cleanup: &Cleanup, name: &str) -> Result<()> {
    use crate::kit::consumers::{TopicFailed, create_topic};
    let created = create_topic(&services.kafka, name, KAFKA_PARTITIONS, STEP / 2).await;
    if matches!(created, Ok(_) | Err(TopicFailed::Refused(_))) {
        cleanup.add(Resource::Topic(name.to_owned()));
    }
    match created {
        Ok(true) => Ok(()),
        Ok(false) => Err(anyhow!("creating topic {name}: TopicAlreadyExists")),
        Err(TopicFailed::NoClient(e)) => Err(e).context("creating a Kafka admin client"),
        Err(TopicFailed::Request(e)) => Err(e.into()),
        Err(TopicFailed::Timeout) => Err(anyhow!(
            "timed out after {}s: creating a Kafka topic",
            STEP.as_secs()
        )),
        Err(TopicFailed::Refused(code)) => Err(anyhow!("creating topic {name}: {code:?}")),
    }
}

async fn delete_topic(services: &Services, name: &str) -> Result<()> {
    let admin = kafka_admin(services)?;
    let opts = AdminOptions::new().operation_timeout(Some(Duration::from_secs(10)));
    let results = bounded(STEP, "deleting a Kafka topic", async {
        Ok(admin.delete_topics(&[name], &opts).await?)
    })
    .await?;
    for r in results {
        if let Err((t, code)) = r {
            return Err(anyhow!("deleting topic {t}: {code:?}"));
        }
    }
    Ok(())
}

pub async fn rabbit_connect(services: &Services) -> Result<Connection> {
    bounded(STEP, "connecting to RabbitMQ", async {
        Connection::connect(&services.amqp, ConnectionProperties::default())
            .await
            .with_context(|| format!("cannot connect to RabbitMQ at {}", services.amqp))
    })
    .await
}

async fn rabbit_admin<F, Fut>(services: &Services, op: F) -> Result<()>
where
    F: FnOnce(Channel) -> Fut,
    Fut: Future<Output = lapin::Result<()>>,
{
    let conn = rabbit_connect(services).await?;
    let result = bounded(STEP, "a RabbitMQ cleanup step", async {
        let ch = conn.create_channel().await?;
        Ok(op(ch).await?)
    })
    .await;
    let _ = conn.close(200, "bench cleanup".into()).await;
    result
}

/// A durable topic exchange with a durable queue of type `queue` bound to
/// every routing key, both named `name`. The queue expires after an hour
/// unused, so an interrupted benchmark cannot leave it behind for long.
pub async fn declare_rabbit(
    services: &Services,
    cleanup: &Cleanup,
    name: &str,
    queue: QueueType,
) -> Result<()> {
    let conn = rabbit_connect(services).await?;
    let result = bounded(STEP, "declaring a RabbitMQ exchange and queue", async {
        let ch = conn.create_channel().await?;
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        cleanup.add(Resource::Exchange(name.to_owned()));
        let mut args = FieldTable::default();
        args.insert("x-expires".into(), AMQPValue::LongInt(3_600_000));
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(queue.name().into()),
        );
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            args,
        )
        .await?;
        cleanup.add(Resource::Queue(name.to_owned()));
        ch.queue_bind(
            name.into(),
            name.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await?;
        Ok(())
    })
    .await;
    let _ = conn.close(200, "bench setup".into()).await;
    result
}

/// How many messages a destination holds, asked of the broker without
/// consuming: the sum of a topic's high watermarks, or a queue's ready count.
pub enum BrokerCount {
    Kafka {
        consumer: Arc<rdkafka::consumer::BaseConsumer>,
        topic: String,
    },
    Rabbitmq {
        channel: Box<Channel>,
        queue: String,
        _connection: Box<Connection>,
    },
}

impl BrokerCount {
    pub async fn kafka(services: &Services, topic: &str) -> Result<BrokerCount> {
        let consumer: rdkafka::consumer::BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &services.kafka)
            .set("group.id", crate::kit::unique("bench_"))
            .set("enable.auto.commit", "false")
            // librdkafka asks for the last stable offset by default, which
            // tansu reports behind the high watermark.
            .set("isolation.level", "read_uncommitted")
            .create()?;
        Ok(BrokerCount::Kafka {
            consumer: Arc::new(consumer),
            topic: topic.to_owned(),
        })
    }

    pub async fn rabbitmq(services: &Services, queue: &str) -> Result<BrokerCount> {
        let connection = rabbit_connect(services).await?;
        let channel = connection.create_channel().await?;
        Ok(BrokerCount::Rabbitmq {
            channel: Box::new(channel),
            queue: queue.to_owned(),
            _connection: Box::new(connection),
        })
    }

    /// Whether `count` is exact. tansu reports a high watermark that leaves
    /// out (apparently) each partition's last batch, so a topic's count
    /// stops short of what it holds.
    pub fn exact(&self) -> bool {
        matches!(self, BrokerCount::Rabbitmq { .. })
    }

    /// Every message of a topic, counted by reading it (bounded; not for timing).
    pub async fn read_all(services: &Services, topic: &str) -> Result<u64> {
        let consumer: rdkafka::consumer::BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &services.kafka)
            .set("group.id", crate::kit::unique("bench_"))
            .set("enable.auto.commit", "false")
            .set("enable.partition.eof", "true")
            .create()?;
        let mut list = rdkafka::TopicPartitionList::new();
        for p in 0..KAFKA_PARTITIONS {
            list.add_partition_offset(topic, p, rdkafka::Offset::Beginning)?;
        }
        use rdkafka::consumer::Consumer;
        consumer.assign(&list)?;
        tokio::task::spawn_blocking(move || {
            let start = std::time::Instant::now();
            let (mut count, mut eof) = (0u64, std::collections::HashSet::new());
            while eof.len() < KAFKA_PARTITIONS as usize {
                if start.elapsed() > Duration::from_secs(120) {
                    return Err(anyhow!("reading the topic back took over 120s"));
                }
                match consumer.poll(Duration::from_millis(200)) {
                    Some(Ok(_)) => count += 1,
                    Some(Err(rdkafka::error::KafkaError::PartitionEOF(p))) => {
                        eof.insert(p);
                    }
                    Some(Err(e)) => return Err(e.into()),
                    None => {}
                }
            }
            Ok(count)
        })
        .await?
    }

    pub async fn count(&self) -> Result<u64> {
        match self {
            BrokerCount::Kafka { consumer, topic } => {
                let (consumer, topic) = (consumer.clone(), topic.clone());
                tokio::task::spawn_blocking(move || {
                    use rdkafka::consumer::Consumer;
                    let mut sum = 0;
                    for p in 0..KAFKA_PARTITIONS {
                        let (_, high) =
                            consumer.fetch_watermarks(&topic, p, Duration::from_secs(5))?;
                        sum += high.max(0) as u64;
                    }
                    Ok(sum)
                })
                .await?
            }
            BrokerCount::Rabbitmq { channel, queue, .. } => {
                let q = bounded(STEP, "counting a RabbitMQ queue", async {
                    Ok(channel
                        .queue_declare(
                            queue.as_str().into(),
                            QueueDeclareOptions {
                                passive: true,
                                ..Default::default()
                            },
                            FieldTable::default(),
                        )
                        .await?)
                })
                .await?;
                Ok(u64::from(q.message_count()))
            }
        }
    }
}
