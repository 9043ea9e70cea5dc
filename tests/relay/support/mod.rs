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
pub mod otlp;
pub mod proxy;
pub mod rabbit_node;
mod slots;

pub use slots::{cluster_that_loses_slots, migrate_at, slot_of, wal_status};

use brokers::{Inbox, KafkaTopics, RabbitExchange};
use outbox_relay::config::{self, Config};
use std::future::Future;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio_postgres::{Client, NoTls};
use tokio_util::sync::CancellationToken;
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

/// A database of its own for one test.
pub struct TestDb {
    pub name: String,
    pub url: String,
    pub client: Client,
    /// The cluster's maintenance database, where this one is dropped from.
    admin_url: String,
}

impl TestDb {
    pub async fn new() -> TestDb {
        Self::new_on(&pg_admin_url()).await
    }

    /// A database of its own on the cluster of `admin_url` (another PostgreSQL version).
    pub async fn new_on(admin_url: &str) -> TestDb {
        let admin = connect(admin_url).await;
        let name = unique("t_");
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .expect("create test database");
        let url = admin_url
            .rsplit_once('/')
            .map(|(base, _)| format!("{base}/{name}"))
            .unwrap();
        let client = connect(&url).await;
        TestDb {
            name,
            url,
            client,
            admin_url: admin_url.to_owned(),
        }
    }

    /// Creates the default outbox table through `migrate` (the public contract).
    pub async fn migrate(&self, config: &Config) {
        let mut client = connect(&self.url).await;
        let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(config, false);
        let steps = outbox_relay::ops::migrate::plan(&client, &opts)
            .await
            .expect("plan migration");
        outbox_relay::ops::migrate::apply(&mut client, &steps)
            .await
            .expect("apply migration");
    }

    /// Inserts one event with only the contract columns, as an application does.
    pub async fn insert(
        &self,
        id: uuid::Uuid,
        aggregate_type: &str,
        aggregate_id: &str,
        payload: serde_json::Value,
    ) {
        self.client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, $2, $3, 'Happened', $4)",
                &[&id, &aggregate_type, &aggregate_id, &payload],
            )
            .await
            .expect("insert event");
    }

    pub async fn count(&self, sql: &str) -> i64 {
        self.client.query_one(sql, &[]).await.expect(sql).get(0)
    }

    pub async fn unsent(&self) -> i64 {
        self.count("SELECT count(*) FROM outbox WHERE relay_sent_at IS NULL")
            .await
    }
}

/// How long dropping a test database may take before it is left behind
/// (named `t_…`, it harms no other test).
const DROP_WAIT: Duration = Duration::from_secs(30);

impl Drop for TestDb {
    /// Drops the database and its replication slots, when the test passed and
    /// when it panicked. `drop` cannot await and may run while the test's
    /// runtime unwinds, so the work gets a thread and a runtime of its own,
    /// bounded by [`DROP_WAIT`]; failures are ignored, since panicking here
    /// would abort the test binary.
    fn drop(&mut self) {
        let (admin_url, name) = (self.admin_url.clone(), std::mem::take(&mut self.name));
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let dropper = std::thread::Builder::new()
            .name(format!("drop {name}"))
            .spawn(move || {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build();
                if let Ok(runtime) = runtime {
                    // The timer is made inside the runtime: it needs its clock.
                    runtime.block_on(async {
                        let drop = drop_database_on(&admin_url, &name);
                        let _ = tokio::time::timeout(DROP_WAIT, drop).await;
                    });
                }
                drop(done);
            });
        if dropper.is_ok() {
            // Disconnected when the thread ends, however it ends.
            let _ = finished.recv_timeout(DROP_WAIT + Duration::from_secs(1));
        }
    }
}

/// Drops database `name` of the cluster of `admin_url` with its replication
/// slots, ignoring every failure (see [`TestDb`]'s `Drop`).
async fn drop_database_on(admin_url: &str, name: &str) {
    let mut config: tokio_postgres::Config = match admin_url.parse() {
        Ok(config) => config,
        Err(_) => return,
    };
    config.connect_timeout(Duration::from_secs(10));
    let Ok((admin, conn)) = config.connect(NoTls).await else {
        return;
    };
    tokio::spawn(conn);
    let _ = admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1",
            &[&name],
        )
        .await;
    // A terminated walsender lets go of its slot a moment later.
    for _ in 0..50 {
        let dropped = admin
            .query_one(
                "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE database = $1 AND NOT active",
                &[&name],
            )
            .await;
        let left: i64 = admin
            .query_one(
                "SELECT count(*) FROM pg_replication_slots WHERE database = $1",
                &[&name],
            )
            .await
            .map(|r| r.get(0))
            .unwrap_or(0);
        if dropped.is_ok() && left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await;
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

/// A relay running inside the test process.
pub struct InProcess {
    pub shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl InProcess {
    pub fn start(config: Config) -> InProcess {
        // The relay's own log, when debugging a test.
        if std::env::var("OUTBOX_RELAY_TEST_LOG").is_ok() {
            outbox_relay::telemetry::init(&config.log);
        }
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        let task = tokio::spawn(async move { outbox_relay::relay::run(&config, token).await });
        InProcess { shutdown, task }
    }

    /// Graceful stop; panics if it takes longer than `WAIT`.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("relay stops within the wait")
            .expect("relay task did not panic");
    }

    /// Drops the relay abruptly (no drain): the in-process stand-in for a crash.
    pub fn abort(self) {
        self.task.abort();
    }
}

/// The relay binary as a child process, for tests that kill it.
pub struct ChildRelay {
    child: Child,
}

impl ChildRelay {
    pub fn start(config_toml: &str) -> ChildRelay {
        Self::start_with_env(config_toml, &[])
    }

    pub fn start_with_env(config_toml: &str, envs: &[(&str, &str)]) -> ChildRelay {
        let dir = std::env::temp_dir().join(unique("outbox-relay-test-"));
        std::fs::create_dir_all(&dir).unwrap();
        let config_path = dir.join("relay.toml");
        std::fs::write(&config_path, config_toml).unwrap();
        let child = Command::new(relay_bin())
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "outbox_relay=info,warn")
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start outbox-relay");
        ChildRelay { child }
    }

    /// Waits for the process to exit by itself; `None` if it is still running after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let start = Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            if start.elapsed() > WAIT {
                self.kill();
                panic!("relay did not exit within {WAIT:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ChildRelay {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Runs the binary to completion with arguments; returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(relay_bin());
    cmd.args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run outbox-relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The relay config for a test, with quick timings.
pub fn base_toml(db_url: &str, sink: &str) -> String {
    format!(
        r#"
[database]
url = "{db_url}"

[source.polling]
poll_interval = "200ms"

[relay]
retry_base = "50ms"
retry_max = "1s"
reject_retry_base = "200ms"
reject_retry_max = "1s"
standby_poll = "200ms"
confirm_timeout = "10s"
shutdown_timeout = "10s"

[http]
# Tests run side by side: a relay serves HTTP only where a test asks (on a free port).
enabled = false

{sink}
"#
    )
}

pub fn parse(toml: &str) -> Config {
    config::load_str(toml).unwrap_or_else(|e| panic!("test config does not load: {e}\n{toml}"))
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

/// Sets `section.key = value` in a TOML text: replaces the key if the
/// section has it, inserts it under the section's header otherwise, or adds
/// the section.
pub fn set(toml: &str, key: &str, value: &str) -> String {
    let (section, leaf) = key.rsplit_once('.').expect("a dotted key");
    let header = format!("[{section}]");
    let mut lines: Vec<String> = toml.lines().map(str::to_owned).collect();
    let Some(start) = lines.iter().position(|l| l.trim() == header) else {
        return format!("{toml}\n{header}\n{leaf} = {value}\n");
    };
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.trim_start().starts_with('['))
        .map_or(lines.len(), |i| start + 1 + i);
    let line = format!("{leaf} = {value}");
    match (start + 1..end).find(|&i| lines[i].split('=').next().is_some_and(|k| k.trim() == leaf)) {
        Some(i) => lines[i] = line,
        None => lines.insert(start + 1, line),
    }
    lines.join("\n") + "\n"
}

/// The source mode's settings, with quick CDC status updates for tests.
/// Serves HTTP on `port`, sampling gauges often.
pub fn with_http(toml: &str, port: u16) -> String {
    let t = set(toml, "http.enabled", "true");
    let t = set(&t, "http.address", &format!("\"127.0.0.1:{port}\""));
    set(&t, "http.sample_interval", "\"200ms\"")
}

pub fn with_mode(toml: &str, mode: Mode) -> String {
    match mode {
        Mode::Polling => toml.to_owned(),
        Mode::Cdc => {
            let t = set(toml, "source.mode", "\"cdc\"");
            let t = set(&t, "source.cdc.status_interval", "\"200ms\"");
            // Slot names are cluster-wide: one per test.
            set(&t, "source.cdc.slot", &format!("\"{}\"", unique("slot_")))
        }
    }
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

/// A minimal HTTP/1.1 GET on 127.0.0.1: (status, body), `None` if nothing answers.
pub async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .ok()?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").as_bytes(),
    )
    .await
    .ok()?;
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut raw))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let status = head.split_whitespace().nth(1)?.parse().ok()?;
    // The bodies here are small and sent whole; undo chunked framing if used.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).ok()?;
            if n == 0 {
                break;
            }
            out.push_str(after.get(..n)?);
            rest = after.get(n + 2..)?;
        }
        out
    } else {
        body.to_owned()
    };
    Some((status, body))
}

/// The value of a Prometheus series: `name{a="x",b="y"}` with labels in any order.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    fn parse(series: &str) -> (String, Vec<String>) {
        match series.split_once('{') {
            Some((name, labels)) => {
                let mut l: Vec<String> = labels
                    .trim_end_matches('}')
                    .split(',')
                    .filter(|x| !x.is_empty())
                    .map(str::to_owned)
                    .collect();
                l.sort();
                (name.to_owned(), l)
            }
            None => (series.to_owned(), Vec::new()),
        }
    }
    let wanted = parse(series);
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (series, value) = l.rsplit_once(' ')?;
        (parse(series) == wanted)
            .then(|| value.parse().ok())
            .flatten()
    })
}

/// Writes `toml` to a fresh file and returns its path, for the commands
/// tests run (`check`, `migrate`, `dlq`, ...).
pub fn config_file(toml: &str) -> String {
    let dir = std::env::temp_dir().join(unique("outbox-relay-config-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("relay.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A `[sink]` section for the test RabbitMQ, publishing to `amq.topic`.
pub fn rabbit_sink() -> String {
    format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    )
}

/// Starts the relay `kills` times, each time killing it (SIGKILL) once it
/// published `per_run` more messages: crashes while busy.
pub async fn kill_while_busy(toml: &str, inbox: &Inbox, kills: usize, per_run: usize) {
    for _ in 0..kills {
        let mut child = ChildRelay::start(toml);
        let before = inbox.len();
        wait_for(WAIT, "the relay to publish", || async {
            (inbox.len() >= before + per_run).then_some(())
        })
        .await;
        child.kill();
    }
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
