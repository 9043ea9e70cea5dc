//! What the relay's log says at first contact: the relay's own message, not a
//! library's chatter, and "active" only once events can flow.

use crate::support::brokers::RabbitExchange;
use crate::support::*;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Runs `outbox-relay run` at the default log level (no `RUST_LOG`) for at
/// least `min` and until `done` holds for its log, or `max` has passed;
/// stops it with SIGTERM and returns the log.
fn run_and_read_log(
    config_toml: &str,
    min: Duration,
    max: Duration,
    done: impl Fn(&str) -> bool,
) -> String {
    run_with_rust_log(config_toml, None, (min, max), done)
}

/// [`run_and_read_log`] with `RUST_LOG` set to `rust_log` (removed if `None`).
fn run_with_rust_log(
    config_toml: &str,
    rust_log: Option<&str>,
    (min, max): (Duration, Duration),
    done: impl Fn(&str) -> bool,
) -> String {
    let dir = std::env::temp_dir().join(unique("outbox-relay-logs-"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("relay.toml");
    std::fs::write(&config, config_toml).unwrap();
    let log_path = dir.join("relay.log");
    let log_file = std::fs::File::create(&log_path).unwrap();
    let mut command = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    match rust_log {
        Some(filter) => command.env("RUST_LOG", filter),
        None => command.env_remove("RUST_LOG"),
    };
    let mut child = command
        .args(["run", "--config"])
        .arg(&config)
        .env("NO_COLOR", "1")
        .stdout(Stdio::null())
        .stderr(log_file)
        .spawn()
        .expect("start outbox-relay");
    let start = Instant::now();
    let read = || std::fs::read_to_string(&log_path).unwrap_or_default();
    while start.elapsed() < max {
        if start.elapsed() >= min && done(&read()) {
            break;
        }
        if child.try_wait().unwrap().is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let stopping = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if stopping.elapsed() > WAIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "relay did not exit within {WAIT:?} of SIGTERM; log:\n{}",
                read()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    read()
}

/// A port on which nothing listens.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test]
async fn with_kafka_down_the_log_shows_the_relays_warning_not_librdkafkas_chatter() {
    let db = TestDb::new().await;
    let port = closed_port();
    let toml = base_toml(
        &db.url,
        &format!("[sink]\ntype = \"kafka\"\nbrokers = \"127.0.0.1:{port}\"\n"),
    );
    db.migrate(&parse(&toml)).await;
    let warning = format!("cannot reach Kafka at 127.0.0.1:{port}");
    let log = run_and_read_log(
        &toml,
        Duration::from_secs(6),
        Duration::from_secs(30),
        |log| log.contains(&warning),
    );
    let librdkafka = log.lines().filter(|l| l.contains("librdkafka")).count();
    // librdkafka reports every connection attempt, dozens a second: over six
    // seconds that was hundreds of lines around the relay's one warning.
    assert!(
        librdkafka <= 3,
        "{librdkafka} librdkafka lines in the log:\n{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("WARN") && l.contains("relay interrupted") && l.contains(&warning)),
        "the relay's warning is missing:\n{log}"
    );
    assert!(
        log.lines().count() <= 12,
        "the log is longer than a few lines:\n{log}"
    );
}

#[tokio::test]
async fn cdc_says_active_only_after_its_setup_checks_pass() {
    let db = TestDb::new().await;
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    );
    let polling = base_toml(&db.url, &sink);
    // The table, but no publication: migrate in polling mode creates none.
    db.migrate(&parse(&polling)).await;
    let cdc = set(&polling, "source.mode", "\"cdc\"");
    let cdc = set(&cdc, "source.cdc.slot", &format!("\"{}\"", unique("slot_")));
    let setup_error = "does not exist; run `outbox-relay migrate`";
    let log = run_and_read_log(&cdc, Duration::ZERO, WAIT, |log| log.contains(setup_error));
    assert!(
        log.contains("publication") && log.contains(setup_error),
        "the missing publication is not reported:\n{log}"
    );
    assert!(
        !log.contains("active:"),
        "the relay said it was active before its setup checks passed:\n{log}"
    );

    // Once migrate has created the publication, it is active, and says so.
    db.migrate(&parse(&cdc)).await;
    let active = "active: relaying events from the replication slot";
    let log = run_and_read_log(&cdc, Duration::ZERO, WAIT, |log| log.contains(active));
    assert!(log.contains(active), "{log}");
}

/// A failed statement's error carries the server's message, not the
/// driver's bare "db error".
#[tokio::test]
async fn a_failed_statement_says_what_the_server_said() {
    let db = TestDb::new().await;
    let e = db
        .client
        .query("SELECT * FROM no_such_table_here", &[])
        .await
        .expect_err("no such table");
    let text = outbox_relay::db::DbError::query("reading the outbox", e).to_string();
    assert_eq!(
        text,
        "reading the outbox: relation \"no_such_table_here\" does not exist"
    );
}

/// A transaction left open anywhere on the server keeps the CDC start-up
/// read's position from settling, so the slot is not moved past the
/// backlog and newer events wait while the stream decodes it: the warning
/// names the transaction, once. On the newest version's cluster, apart
/// from the other tests there (a test group in `.config/nextest.toml`): on
/// the main cluster, the open transaction would keep the other tests'
/// start-up reads from settling.
#[tokio::test]
async fn a_transaction_that_keeps_the_slot_back_is_named() {
    let db = TestDb::new_on(&crate::versions::admin_url(18)).await;
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    );
    let cdc = set(&base_toml(&db.url, &sink), "source.mode", "\"cdc\"");
    let cdc = set(&cdc, "source.cdc.slot", &format!("\"{}\"", unique("slot_")));
    db.migrate(&parse(&cdc)).await;
    let long = connect(&db.url).await;
    let pid: i32 = long
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    long.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    let warning = "kept the start-up read from moving the slot past the WAL it covers";
    let active = "active: relaying events from the replication slot";
    let log = run_and_read_log(&cdc, Duration::ZERO, WAIT, |log| {
        log.contains(warning) && log.contains(active)
    });
    long.batch_execute("ROLLBACK").await.unwrap();
    let named: Vec<&str> = log.lines().filter(|l| l.contains(warning)).collect();
    assert_eq!(named.len(), 1, "one warning per run:\n{log}");
    assert!(
        named[0].contains("WARN")
            && named[0].contains(&format!("pid {pid} (database {}", db.name))
            && named[0].contains("nothing is lost"),
        "the warning does not name the open transaction:\n{log}"
    );
}

/// A `RUST_LOG` the relay cannot use is not ignored without a word: the
/// log says so, and logs by `log.level`.
#[tokio::test]
async fn an_unusable_rust_log_is_said_and_log_level_used() {
    let (_db, _broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let active = "active: relaying events";
    let log = run_with_rust_log(
        &toml,
        Some("outbox_relay=loud"),
        (Duration::ZERO, WAIT),
        |log| log.contains(active),
    );
    assert!(
        log.contains("RUST_LOG is not a valid filter: logging by log.level instead")
            && log.contains("outbox_relay=loud"),
        "{log}"
    );
    assert!(log.contains(active), "{log}");
}

/// A relay whose log reader went away (`run 2>&1 | tee relay.log`, tee
/// killed) drops its log and goes on delivering; it stops cleanly.
#[tokio::test]
async fn a_closed_log_does_not_stop_delivery() {
    let db = TestDb::new().await;
    let exchange = RabbitExchange::new().await;
    let toml = base_toml(&db.url, &exchange.sink_toml());
    db.migrate(&parse(&toml)).await;
    let (reader, writer) = std::io::pipe().expect("a pipe");
    drop(reader);
    let mut relay = ChildRelay::start_into(&toml, Stdio::from(writer));
    let ids: Vec<String> = (0..20).map(|_| uuid::Uuid::new_v4().to_string()).collect();
    for id in &ids {
        let id = uuid::Uuid::parse_str(id).expect("a uuid");
        db.insert(id, "order", "a", serde_json::json!({})).await;
    }
    exchange.inbox.wait_ids(&ids, WAIT).await;
    assert_eq!(relay.wait_exit(Duration::ZERO), None, "still running");
    let status = relay.terminate();
    assert!(status.success(), "{status:?}");
}
