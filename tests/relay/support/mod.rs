//! Helpers for the end-to-end tests: a fresh database per test, per-test
//! topics and exchanges, consumers, a relay running in-process or as a child
//! process, and bounded waits.
//!
//! The services come from `scripts/services.sh` (the test command starts
//! them); their addresses can be overridden with `OUTBOX_RELAY_TEST_PG`,
//! `OUTBOX_RELAY_TEST_AMQP` and `OUTBOX_RELAY_TEST_KAFKA`. The clusters of the
//! other PostgreSQL versions come from `scripts/pg-versions.sh`
//! (`OUTBOX_RELAY_TEST_PG<major>`); `OUTBOX_RELAY_TEST_BIN` names the relay
//! binary to run instead of the one cargo built.

pub mod brokers;
mod db;
mod http;
pub mod otlp;
mod pause;
pub mod proxy;
pub mod rabbit_node;
mod relay_config;
mod relays;
mod slots;

pub use db::TestDb;
pub use http::{http_get, metric, metric_sum};
pub use pause::Paused;
pub use relay_config::{
    base_toml, config_file, parse, rabbit_sink, set, unset, with_http, with_mode,
};
pub use relays::{
    ChildRelay, InProcess, check_line, cli_complains, cli_says, kill_while_busy,
    kill_while_busy_with_env, run_cli, run_cli_into, terminate,
};
pub use slots::{
    cluster_that_loses_slots, drop_lost_slot, lose_slot, migrate_at, restart_position, slot_of,
    slot_position, slots_named, wait_streaming, wal_insert_position, wal_status,
};

use brokers::{Inbox, KafkaTopics, RabbitExchange};
use std::future::Future;
use std::time::{Duration, Instant};
use tokio_postgres::{Client, NoTls};
use uuid::Uuid;

pub const WAIT: Duration = Duration::from_secs(30);

pub fn pg_admin_url() -> String {
    std::env::var("OUTBOX_RELAY_TEST_PG")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:55432/postgres".into())
}

pub fn amqp_url() -> String {
    std::env::var("OUTBOX_RELAY_TEST_AMQP")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

pub fn kafka_brokers() -> String {
    std::env::var("OUTBOX_RELAY_TEST_KAFKA").unwrap_or_else(|_| "127.0.0.1:9092".into())
}

/// The relay binary: the one cargo built for these tests, or
/// `OUTBOX_RELAY_TEST_BIN` (a copy of it, when a target directory shared by
/// several checkouts may replace the built one while tests run).
pub fn relay_bin() -> std::ffi::OsString {
    std::env::var_os("OUTBOX_RELAY_TEST_BIN")
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_outbox-relay").into())
}

pub use crate::kit::unique;

pub async fn connect(url: &str) -> Client {
    let (client, conn) = tokio_postgres::connect(url, NoTls)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e} (did scripts/services.sh run?)"));
    tokio::spawn(conn);
    client
}

/// Waits until `check` returns `Some`, polling; panics with `what` after `limit`.
pub async fn wait_for<T, F, Fut>(limit: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = check().await {
            return v;
        }
        if start.elapsed() > limit {
            panic!("timed out after {limit:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A broker set up for one test.
pub enum Broker {
    Kafka(KafkaTopics),
    Rabbit(RabbitExchange),
}

#[derive(Clone, Copy, Debug)]
pub enum Kind {
    Kafka,
    Rabbit,
}

impl Broker {
    /// `aggregate_types`: Kafka topics to create (RabbitMQ routes everything to one queue).
    pub async fn new(kind: Kind, aggregate_types: &[&str]) -> Broker {
        match kind {
            Kind::Kafka => {
                let k = KafkaTopics::new();
                for t in aggregate_types {
                    k.create(t).await;
                }
                Broker::Kafka(k)
            }
            Kind::Rabbit => Broker::Rabbit(RabbitExchange::new().await),
        }
    }

    pub fn inbox(&self) -> &Inbox {
        match self {
            Broker::Kafka(k) => &k.inbox,
            Broker::Rabbit(r) => &r.inbox,
        }
    }

    pub fn sink_toml(&self) -> String {
        match self {
            Broker::Kafka(k) => k.sink_toml(),
            Broker::Rabbit(r) => r.sink_toml(),
        }
    }
}

/// Generates one polling test per broker from `async fn $case(mode: Mode, kind: Kind)`.
#[macro_export]
macro_rules! both_brokers {
    ($case:ident) => {
        mod $case {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn kafka() {
                super::$case($crate::support::Mode::Polling, $crate::support::Kind::Kafka).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn rabbitmq() {
                super::$case(
                    $crate::support::Mode::Polling,
                    $crate::support::Kind::Rabbit,
                )
                .await
            }
        }
    };
}

/// Generates one test per source mode and broker from `async fn $case(mode: Mode, kind: Kind)`.
#[macro_export]
macro_rules! every_mode {
    ($case:ident) => {
        mod $case {
            mod polling {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn kafka() {
                    super::super::$case(
                        $crate::support::Mode::Polling,
                        $crate::support::Kind::Kafka,
                    )
                    .await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn rabbitmq() {
                    super::super::$case(
                        $crate::support::Mode::Polling,
                        $crate::support::Kind::Rabbit,
                    )
                    .await
                }
            }
            mod cdc {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn kafka() {
                    super::super::$case($crate::support::Mode::Cdc, $crate::support::Kind::Kafka)
                        .await
                }
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn rabbitmq() {
                    super::super::$case($crate::support::Mode::Cdc, $crate::support::Kind::Rabbit)
                        .await
                }
            }
        }
    };
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Polling,
    Cdc,
}

/// A database, a broker and a migrated outbox for one test; `sets` are extra
/// `("section.key", "toml value")` settings.
pub async fn setup(
    mode: Mode,
    kind: Kind,
    aggregate_types: &[&str],
    sets: &[(&str, &str)],
) -> (TestDb, Broker, String) {
    let db = TestDb::new().await;
    let broker = Broker::new(kind, aggregate_types).await;
    let mut toml = with_mode(&base_toml(&db.url, &broker.sink_toml()), mode);
    for (k, v) in sets {
        toml = set(&toml, k, v);
    }
    db.migrate(&parse(&toml)).await;
    (db, broker, toml)
}

pub fn ids(n: usize) -> Vec<Uuid> {
    (0..n).map(|_| Uuid::new_v4()).collect()
}

pub fn strings(ids: &[Uuid]) -> Vec<String> {
    ids.iter().map(Uuid::to_string).collect()
}

/// Each aggregate's first deliveries (by the CloudEvents `subject`), as the
/// payload's `i`, in arrival order: repeats after a crash are left out.
pub fn first_deliveries(got: &[brokers::Received]) -> std::collections::HashMap<String, Vec<i64>> {
    let mut per_aggregate: std::collections::HashMap<String, Vec<i64>> = Default::default();
    let mut seen = std::collections::HashSet::new();
    for m in got {
        if seen.insert(m.event_id()) {
            let body = m.json();
            per_aggregate
                .entry(body["subject"].as_str().unwrap_or_default().to_owned())
                .or_default()
                .push(body["data"]["i"].as_i64().unwrap_or(-1));
        }
    }
    per_aggregate
}

/// Asserts every aggregate's first deliveries follow the order they were written in.
pub fn assert_each_aggregate_in_order(got: &[brokers::Received]) {
    for (aggregate, order) in first_deliveries(got) {
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "{aggregate}: {order:?}"
        );
    }
}
