//! The README's troubleshooting table, row by row: each message is printed
//! by the relay or its commands in the situation the row describes.

use crate::kit::cluster::PrivatePg;
use crate::support::*;

/// A configuration refused before the relay connects anywhere.
fn offline_toml(extra: &str) -> String {
    let toml = base_toml("postgres://relay@127.0.0.1:5432/app", &rabbit_sink());
    format!("{toml}\n{extra}")
}

/// Runs `check` on a configuration it refuses: exit code 2, the report on stderr.
fn refused(path: &str, envs: &[(&str, &str)]) -> String {
    let (code, out, err) = run_cli(&["check", "--config", path], envs);
    assert_eq!(code, 2, "{out}{err}");
    err
}

/// Rows: `the configuration has N problems: - source.batch_size: -5 is out
/// of range; ...`, `source.polling.poll_interval: "5 parsecs" is not a
/// duration (...); write a number and a unit, ...`, `... poll_intervall:
/// unknown key, expected one of ...` and the environment override.
#[test]
fn configuration_problems_are_named_key_by_key() {
    let toml = offline_toml("[source]\nbatch_size = -5\n")
        .replace("poll_interval = \"50ms\"", "poll_interval = \"5 parsecs\"");
    let err = refused(&config_file(&toml), &[]);
    for line in [
        "the configuration has 2 problems:",
        "  - source.batch_size: -5 is out of range; use 1 to 10000",
        "  - source.polling.poll_interval: \"5 parsecs\" is not a duration (",
        "); write a number and a unit, like \"500ms\", \"30s\", ",
    ] {
        assert!(err.contains(line), "{line:?} in:\n{err}");
    }

    let typo = toml.replace("poll_interval = \"5 parsecs\"", "poll_intervall = \"1s\"");
    let typo = typo.replace("batch_size = -5", "batch_size = 100");
    let err = refused(&config_file(&typo), &[]);
    let unknown = "source.polling.poll_intervall: unknown key, expected one of `poll_interval`";
    assert!(err.contains(unknown), "{err}");

    let good = config_file(&offline_toml(""));
    let err = refused(&good, &[("OUTBOX_RELAY__SOURCE__BATCH_SIZE", "abc")]);
    let blamed = "source.batch_size (set by OUTBOX_RELAY__SOURCE__BATCH_SIZE): \"abc\" is not a whole number; use 1 to 10000";
    assert!(err.contains(blamed), "{err}");
}

/// Rows: `cannot connect to PostgreSQL ...: is PostgreSQL running and
/// reachable?` and `cannot reach Kafka at ...; check sink.brokers` /
/// `cannot connect to RabbitMQ at ...`, from `check`.
#[test]
fn check_names_unreachable_services_and_where_to_look() {
    let closed = crate::kit::free_port();
    let db = format!("postgres://postgres@127.0.0.1:{closed}/nowhere");
    // `check` with this sink: exit code 1, the report.
    let check = |sink: &str| {
        let (code, out, err) = run_cli(
            &["check", "--config", &config_file(&base_toml(&db, sink))],
            &[],
        );
        assert_eq!(code, 1, "{out}{err}");
        out
    };
    let out = check(&format!(
        "[sink]\ntype = \"kafka\"\nbrokers = \"127.0.0.1:{closed}\"\n"
    ));
    let database = check_line(&out, "database");
    assert!(
        database.starts_with(&format!(
            "[FAIL] database       cannot connect to PostgreSQL at 127.0.0.1:{closed}/nowhere as postgres: "
        )) && database.ends_with("; is PostgreSQL running and reachable?"),
        "{out}"
    );
    let broker = check_line(&out, "broker");
    assert!(
        broker.contains(&format!("cannot reach Kafka at 127.0.0.1:{closed} within "))
            && broker.contains("; check sink.brokers and that the broker is up"),
        "{out}"
    );

    let out = check(&format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:{closed}/%2f\"\n"
    ));
    let broker = check_line(&out, "broker");
    assert!(
        broker.contains(&format!(
            "cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:{closed}/%2f: "
        )) && broker.ends_with("; check sink.url and that the broker is up"),
        "{out}"
    );
}

/// `outbox-relay run` with its log in a file, killed when dropped.
struct LoggedRun {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl LoggedRun {
    fn start(toml: &str) -> LoggedRun {
        let path = config_file(toml);
        let log = std::path::Path::new(&path).with_file_name("relay.log");
        let child = std::process::Command::new(relay_bin())
            .args(["run", "--config", &path])
            .env("RUST_LOG", "outbox_relay=info,warn")
            .env("NO_COLOR", "1")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start outbox-relay");
        LoggedRun { child, log }
    }

    /// The log so far, its quoted fields unescaped (`reason="a \"b\""` is
    /// read as `reason="a "b""`), so that messages compare as the relay wrote them.
    fn log(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.replace("\\\"", "\"")
    }

    /// Waits until the log holds `text` `times` times, the relay still
    /// running; returns the log.
    async fn wait_logged(&mut self, text: &str, times: usize) -> String {
        let start = std::time::Instant::now();
        loop {
            let exited = self.child.try_wait().unwrap();
            let log = self.log();
            assert!(exited.is_none(), "the relay exited ({exited:?}):\n{log}");
            if log.matches(text).count() >= times {
                return log;
            }
            assert!(
                start.elapsed() < WAIT,
                "{text:?} not logged {times} time(s) within {WAIT:?}:\n{log}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        }
    }
}

impl Drop for LoggedRun {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The rows' "the relay keeps retrying": `run` logs the same messages, again
/// and again, and does not exit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_keeps_retrying_while_a_service_is_unreachable() {
    let closed = crate::kit::free_port();
    let nowhere = format!("postgres://postgres@127.0.0.1:{closed}/nowhere");
    let mut relay = LoggedRun::start(&base_toml(&nowhere, &rabbit_sink()));
    let log = relay
        .wait_logged("is PostgreSQL running and reachable?", 2)
        .await;
    let at = format!("cannot connect to PostgreSQL at 127.0.0.1:{closed}/nowhere as postgres: ");
    assert!(log.contains(&at), "{log}");
    drop(relay);

    let db = TestDb::new().await;
    let rabbit = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:{closed}/%2f\"\nexchange = \"amq.topic\"\n"
    );
    let toml = base_toml(&db.url, &rabbit);
    db.migrate(&parse(&toml)).await;
    let mut relay = LoggedRun::start(&toml);
    let at = format!("cannot connect to RabbitMQ at amqp://guest:***@127.0.0.1:{closed}/%2f: ");
    let log = relay.wait_logged(&at, 2).await;
    assert!(
        log.contains("; check sink.url and that the broker is up"),
        "{log}"
    );
}

/// Row: `the relay's column "relay_seq" is missing; run outbox-relay
/// migrate`; running `migrate` is the fix.
#[tokio::test]
async fn check_names_a_missing_relay_column() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .batch_execute("ALTER TABLE outbox DROP COLUMN relay_seq CASCADE")
        .await
        .expect("drop the relay's column");
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(
        check_line(&out, "outbox table"),
        "[FAIL] outbox table   the relay's column \"relay_seq\" is missing; run `outbox-relay migrate`",
        "{out}"
    );

    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "migrate put the column back: {out}{err}");
}

/// Row: `the relay's database user cannot UPDATE the table ...; GRANT
/// UPDATE`; granting it is the fix.
#[tokio::test]
async fn check_names_the_missing_update_privilege() {
    let db = TestDb::new().await;
    let toml = base_toml(&db.url, &rabbit_sink());
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(&toml)], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let role = unique("relay_readonly_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT SELECT, DELETE ON outbox TO {role};
             GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_dead_letters TO {role};
             GRANT SELECT, INSERT, UPDATE ON outbox_relay_owners TO {role};"
        ))
        .await
        .expect("the documented role, without UPDATE on the outbox");
    let path = config_file(&toml.replace(&db.url, &db.url_as(&role)));
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert_eq!(
        check_line(&out, "outbox table"),
        "[FAIL] outbox table   the relay's database user cannot UPDATE the table to mark rows sent; GRANT UPDATE",
        "{out}"
    );

    db.client
        .batch_execute(&format!("GRANT UPDATE ON outbox TO {role}"))
        .await
        .expect("the privilege named");
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    let line = check_line(&out, "outbox table");
    assert!(line.starts_with("[ok  ] outbox table"), "{out}{err}");
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role}"))
        .await
        .expect("drop the test's role");
}

/// Row: `cannot connect to PostgreSQL at host:port/db as user: password
/// authentication failed ...; check the user and password`, from `check`
/// and `run`. The shared cluster trusts every local user, so a private one
/// asks for passwords.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_database_password_is_named_with_the_fix() {
    let pg = PrivatePg::start_with(
        &["--auth-host=scram-sha-256", "--auth-local=trust"],
        &["password_encryption = 'scram-sha-256'"],
    );
    let admin = connect(&pg.socket_conninfo("postgres")).await;
    admin
        .batch_execute("ALTER ROLE postgres PASSWORD 'the-right-one'")
        .await
        .expect("give the user a password");
    let port = pg.port;
    let url = format!("postgres://postgres:not-the-password@127.0.0.1:{port}/postgres");
    let toml = base_toml(&url, &rabbit_sink());
    let said = format!(
        "cannot connect to PostgreSQL at 127.0.0.1:{port}/postgres as postgres: password authentication failed"
    );
    let fix = "; check the user and password (database.url, database.password)";
    let (code, out, err) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert_eq!(code, 1, "{out}{err}");
    let line = check_line(&out, "database");
    assert!(
        line.starts_with(&format!("[FAIL] database       {said}")) && line.ends_with(fix),
        "{out}"
    );

    let mut relay = LoggedRun::start(&toml);
    let log = relay.wait_logged(&said, 1).await;
    assert!(log.contains(fix), "{log}");
    assert!(
        !log.contains("not-the-password"),
        "no secret in the log:\n{log}"
    );
}

/// Rows: `every replication slot is in use` (from `migrate` in CDC mode)
/// and `source auto: CDC is not possible; polling until it is` (from `run`
/// in auto mode, naming the same cause), on a private cluster whose one
/// slot another tool holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_every_slot_taken_migrate_refuses_and_auto_polls() {
    let pg = PrivatePg::start(&["wal_level = logical", "max_replication_slots = 1"]);
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    admin
        .batch_execute("SELECT pg_create_physical_replication_slot('another_tool')")
        .await
        .expect("take the only slot");
    let polling = base_toml(&pg.url("app"), &rabbit_sink());
    let path = config_file(&with_mode(&polling, Mode::Cdc));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    let cause = "every replication slot is in use: raise max_replication_slots (restart needed) or drop an unused slot";
    assert!(err.contains(cause), "{err}");
    // check says so too, rather than leave it to `run` to find.
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        code == 1 && out.contains("[FAIL] slot") && out.contains("`run` cannot create it"),
        "{out}"
    );

    let auto = set(&polling, "source.mode", "\"auto\"");
    let auto = set(
        &auto,
        "source.cdc.slot",
        &format!("\"{}\"", unique("slot_")),
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(&auto)], &[]);
    assert_eq!(code, 0, "auto mode leaves the slot to run: {out}{err}");
    let mut relay = LoggedRun::start(&auto);
    let polls = "source auto: CDC is not possible; polling until it is";
    let log = relay.wait_logged(polls, 1).await;
    let line = log.lines().find(|l| l.contains(polls)).unwrap();
    assert!(
        line.contains("WARN") && line.contains("reason=\"no_free_slot\"") && line.contains(cause),
        "{line}"
    );
}

/// An outbox whose exchange, declared by the relay, has no queue bound, with
/// quick retries, dead-lettering after two refusals and a 4 KB message limit.
async fn outbox_to_an_unbound_exchange() -> (TestDb, String, String) {
    let db = TestDb::new().await;
    let exchange = unique("t_unbound_");
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{exchange}\"\ndeclare_exchange = true\nmessage_max_bytes = 4000\n",
        amqp_url()
    );
    let mut toml = base_toml(&db.url, &sink);
    for (key, value) in [
        ("dead_letter.max_attempts", "2"),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
    ] {
        toml = set(&toml, key, value);
    }
    db.migrate(&parse(&toml)).await;
    (db, toml, exchange)
}

/// Four events the broker or the relay refuses: one with no route, one too
/// large, one without aggregate, one whose headers are a list.
async fn insert_refused_events(db: &TestDb) -> [uuid::Uuid; 4] {
    let ids = [(); 4].map(|_| uuid::Uuid::new_v4());
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES
               ($1, 'order', 'a', 'Happened', '{}', '{}'),
               ($2, 'order', 'b', 'Big', jsonb_build_object('x', repeat('x', 8000)), '{}'),
               ($3, 'order', '', 'Happened', '{}', '{}'),
               ($4, 'order', 'c', 'Happened', '{}', '[\"x\"]')",
            &[&ids[0], &ids[1], &ids[2], &ids[3]],
        )
        .await
        .expect("insert the refused events");
    ids
}

/// Asserts a line of `log` is about event `id` and holds every fragment.
fn logged_for(log: &str, id: &uuid::Uuid, fragments: &[&str]) {
    let id = format!("event_id=\"{id}\"");
    assert!(
        log.lines()
            .any(|l| l.contains(&id) && fragments.iter().all(|f| l.contains(f))),
        "{fragments:?} for {id} in:\n{log}"
    );
}

/// Rows: `unroutable: no queue is bound to exchange ... for routing key
/// ...`, `message is N bytes, over sink.message_max_bytes`, `aggregate_id
/// is empty` / `headers must be a JSON object of strings`, `event
/// dead-lettered after repeated refusals; see outbox-relay dlq list` and `a
/// redriven dead letter was refused again; it stays in the dead-letter
/// table`, in the log of `run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_are_logged_with_their_cause() {
    let (db, toml, exchange) = outbox_to_an_unbound_exchange().await;
    let [unroutable, big, no_aggregate, bad_headers] = insert_refused_events(&db).await;
    let mut relay = LoggedRun::start(&toml);
    let dead_lettered = "event dead-lettered after repeated refusals; see `outbox-relay dlq list`";
    let log = relay.wait_logged(dead_lettered, 4).await;
    let no_route = format!(
        "reason=\"unroutable: no queue is bound to exchange \"{exchange}\" for routing key \"order.Happened\""
    );
    logged_for(&log, &unroutable, &[dead_lettered, &no_route]);
    let too_large = " bytes, over sink.message_max_bytes (4000)\"";
    logged_for(
        &log,
        &big,
        &[dead_lettered, "reason=\"message is ", too_large],
    );
    let no_aggregate_id = "reason=\"aggregate_id is empty\"";
    logged_for(&log, &no_aggregate, &[dead_lettered, no_aggregate_id]);
    let list = "reason=\"headers must be a JSON object of strings, found an array\"";
    logged_for(&log, &bad_headers, &[dead_lettered, list]);

    // Redriven while nothing is bound yet: refused again, kept.
    let path = config_file(&toml);
    crate::dead_letters::wait_dead_letters(&path, 4, "the four dead letters").await;
    let (code, out, err) = run_cli(
        &[
            "dlq",
            "redrive",
            "--config",
            &path,
            "--id",
            &unroutable.to_string(),
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    let kept = "a redriven dead letter was refused again; it stays in the dead-letter table";
    let log = relay.wait_logged(kept, 1).await;
    let line = log.lines().find(|l| l.contains(kept)).unwrap();
    assert!(line.contains(&no_route), "{line}");
}

/// Row: `topic "outbox.event.x" does not exist ...; create the topic`, in
/// the log of `run`, and the held-back event follows once it exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_topic_is_named_and_its_events_follow_its_creation() {
    let db = TestDb::new().await;
    let topics = crate::support::brokers::KafkaTopics::new();
    // Held back, not dead-lettered, while the topic is missing.
    let toml = set(
        &base_toml(&db.url, &topics.sink_toml()),
        "dead_letter.max_attempts",
        "1000",
    );
    db.migrate(&parse(&toml)).await;
    let id = uuid::Uuid::new_v4();
    db.insert(id, "invoice", "a", serde_json::json!({})).await;
    let mut relay = LoggedRun::start(&toml);
    let missing = format!(
        "topic \"{}\" does not exist and the broker did not create it; create the topic",
        topics.topic("invoice")
    );
    relay.wait_logged(&missing, 1).await;

    topics.create("invoice").await;
    topics.inbox.wait_ids(&[id.to_string()], WAIT).await;
}

/// `pg_recvlogical` (`PG_BINDIR`, else the newest installed): another process to stream
/// from a slot.
fn pg_recvlogical() -> std::path::PathBuf {
    if let Ok(dir) = std::env::var("PG_BINDIR") {
        return std::path::Path::new(&dir).join("pg_recvlogical");
    }
    let mut found: Vec<_> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL under /usr/lib/postgresql (or set PG_BINDIR)")
        .filter_map(|e| Some(e.ok()?.path().join("bin/pg_recvlogical")))
        .filter(|p| p.exists())
        .collect();
    found.sort();
    found
        .pop()
        .expect("pg_recvlogical under /usr/lib/postgresql/*/bin")
}

/// Row: `replication slot "..." is in use by another process; waiting`:
/// the relay waits while another process streams from its slot, and
/// streams once that process is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_another_process_streams_from_is_waited_for() {
    let db = TestDb::new().await;
    let broker = crate::support::brokers::RabbitExchange::new().await;
    let toml = with_mode(&base_toml(&db.url, &broker.sink_toml()), Mode::Cdc);
    db.migrate(&parse(&toml)).await;
    let slot = slot_of(&toml);
    let mut other = std::process::Command::new(pg_recvlogical())
        .args(["-d", &db.url, "--slot", &slot, "--start", "-f", "/dev/null"])
        .args([
            "-o",
            "proto_version=1",
            "-o",
            "publication_names=outbox_relay_outbox",
        ])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("start pg_recvlogical");
    wait_streaming(&db.client, &slot).await;

    let port = crate::kit::free_port();
    let mut relay = LoggedRun::start(&with_http(&toml, port));
    let busy = format!(
        "replication slot {slot:?} is in use by another process; waiting for it to be released"
    );
    let log = relay.wait_logged(&busy, 1).await;
    let line = log.lines().find(|l| l.contains(busy.as_str())).unwrap();
    assert!(line.contains(&format!("slot={slot}")), "{line}");
    assert!(!log.contains("active:"), "{log}");
    // Owning the outbox is not relaying yet: not ready while it waits.
    let (code, body) = http_get(port, "/readyz").await.expect("readyz answers");
    assert_eq!(code, 503, "{body}");
    assert!(body.starts_with("default: taking over: "), "{body}");

    let _ = other.kill();
    let _ = other.wait();
    relay
        .wait_logged("active: relaying events from the replication slot", 1)
        .await;
    wait_for(WAIT, "the relay to be ready", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 200 && body == "default: active\n").then_some(())
    })
    .await;
    let id = uuid::Uuid::new_v4();
    db.insert(id, "order", "a", serde_json::json!({})).await;
    broker.inbox.wait_ids(&[id.to_string()], WAIT).await;
}

/// Row: `the ownership session has not answered for Ns ...: giving
/// ownership up`: the owner's session to PostgreSQL goes silent (a frozen
/// proxied connection), and the relay gives ownership up after two leases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_whose_session_goes_silent_gives_ownership_up() {
    let (db, _broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[("relay.ownership_lease", "\"2s\"")],
    )
    .await;
    // The relay reaches PostgreSQL through a proxy.
    let (proxy, toml) = db.behind_proxy(&toml).await;
    let mut relay = LoggedRun::start(&toml);
    relay.wait_logged("active: relaying events", 1).await;
    let (_, port) = db.owner_session().await;
    assert!(proxy.freeze(port), "the ownership session is proxied");
    let said = "s (relay.ownership_lease and as much again): giving ownership up and starting over";
    let log = relay.wait_logged(said, 1).await;
    // Two leases at least; more when the relay's timer fired late.
    let silent: u64 = log
        .lines()
        .find_map(|l| {
            l.split("the ownership session has not answered for ")
                .nth(1)
        })
        .and_then(|rest| rest.split_once(said))
        .and_then(|(secs, _)| secs.parse().ok())
        .unwrap_or_else(|| panic!("the message with a number of seconds in:\n{log}"));
    assert!(silent >= 4, "{log}");
}

/// Row: `wal_level is "replica", but CDC needs "logical": ...`, from
/// `migrate` in CDC mode on a private cluster left at `replica`.
#[tokio::test]
async fn cdc_under_wal_level_replica_names_the_setting() {
    let pg = PrivatePg::start(&["wal_level = replica"]);
    let toml = with_mode(&base_toml(&pg.url("postgres"), &rabbit_sink()), Mode::Cdc);
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(&toml)], &[]);
    assert_eq!(code, 1, "{out}{err}");
    let said = "wal_level is \"replica\", but CDC needs \"logical\": run ALTER SYSTEM SET wal_level = logical;";
    assert!(err.contains(said), "{err}");
}

/// Row: `publication "..." replicates updates or deletes of the table,
/// which has no replica identity ...`, from `check`: another tool's
/// publication of every table, and an outbox without a primary key.
#[tokio::test]
async fn check_names_a_publication_that_blocks_marking() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let publication = unique("every_table_");
    db.client
        .batch_execute(&format!(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_pkey;
             CREATE PUBLICATION {publication} FOR ALL TABLES"
        ))
        .await
        .expect("a publication of a table without replica identity");
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    let said = format!(
        "publication \"{publication}\" replicates updates or deletes of the table, which has no replica identity, \
         so PostgreSQL refuses marking rows sent (UPDATE)"
    );
    assert!(
        out.lines()
            .any(|l| l.starts_with("[FAIL] outbox table") && l.contains(&said)),
        "{out}"
    );
}
