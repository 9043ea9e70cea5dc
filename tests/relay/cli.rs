//! The binary's commands: `check`, `migrate`, configuration errors.

use crate::support::*;

fn write_config(toml: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(config_file(toml))
}

#[tokio::test]
async fn migrate_dry_run_changes_nothing_and_migrate_is_idempotent() {
    let db = TestDb::new().await;
    let path = write_config(&base_toml(&db.url, &rabbit_sink()));
    let path = path.to_str().unwrap();
    let (code, out, err) = run_cli(&["migrate", "--config", path, "--dry-run"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("CREATE TABLE \"public\".\"outbox\""), "{out}");
    // Wake-ups are off by default: no NOTIFY trigger.
    assert!(!out.contains("outbox_relay_notify"), "{out}");
    assert!(out.contains("dry run"), "{out}");
    assert_eq!(
        db.count("SELECT count(*) FROM pg_tables WHERE tablename = 'outbox'")
            .await,
        0
    );

    let (code, out, err) = run_cli(&["migrate", "--config", path], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("applied"), "{out}");
    let (code, out, _) = run_cli(&["migrate", "--config", path], &[]);
    assert_eq!(code, 0);
    assert!(out.contains("nothing to do"), "second run: {out}");

    let (code, out, err) = run_cli(&["check", "--config", path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("all checks passed"), "{out}");
    assert!(out.contains("the table is read every 50ms"), "{out}");
}

/// The NOTIFY trigger is there while `notify = true`, and `migrate` drops it
/// (and its function) once wake-ups are off, since it makes inserting
/// transactions commit one at a time; `check` says so until then.
#[tokio::test]
async fn migrate_installs_the_notify_trigger_only_while_notify_is_on() {
    let db = TestDb::new().await;
    let off = base_toml(&db.url, &rabbit_sink());
    let on = set(&off, "source.polling.notify", "true");
    let (on, off) = (write_config(&on), write_config(&off));
    let (on, off) = (on.to_str().unwrap(), off.to_str().unwrap());
    let triggers = "SELECT count(*) FROM pg_trigger WHERE tgname = 'outbox_relay_notify'";
    let functions = "SELECT count(*) FROM pg_proc WHERE proname = 'outbox_relay_notify'";

    let (code, out, err) = run_cli(&["migrate", "--config", on], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("create trigger outbox_relay_notify"), "{out}");
    assert_eq!(
        (db.count(triggers).await, db.count(functions).await),
        (1, 1)
    );
    let (code, out, err) = run_cli(&["check", "--config", on], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("insert trigger notifies channel outbox_relay_outbox"),
        "{out}"
    );
    // Another channel configured, and no migrate since: the trigger's is
    // not the one the relay listens on.
    let renamed = std::fs::read_to_string(on).unwrap();
    let renamed = write_config(&set(
        &renamed,
        "source.polling.notify_channel",
        "\"renamed\"",
    ));
    let (code, out, err) = run_cli(&["check", "--config", renamed.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "a warning, not a failure: {out}{err}");
    assert!(
        out.contains("notifies channel outbox_relay_outbox, and the relay listens on renamed"),
        "{out}"
    );

    let (code, out, err) = run_cli(&["check", "--config", off], &[]);
    assert_eq!(code, 0, "a warning, not a failure: {out}{err}");
    assert!(
        out.contains("outbox_relay_notify is installed but the relay does not listen"),
        "{out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", off, "--dry-run"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("drop trigger outbox_relay_notify"), "{out}");
    assert_eq!(db.count(triggers).await, 1, "a dry run changes nothing");
    let (code, out, err) = run_cli(&["migrate", "--config", off], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        (db.count(triggers).await, db.count(functions).await),
        (0, 0)
    );
    let (code, out, _) = run_cli(&["migrate", "--config", off], &[]);
    assert_eq!(code, 0);
    assert!(out.contains("nothing to do"), "second run: {out}");
    let (code, out, err) = run_cli(&["check", "--config", off], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("outbox_relay_notify"), "{out}");
    // A channel named while wake-ups are off: the relay does not listen.
    let named = std::fs::read_to_string(off).unwrap();
    let named = write_config(&set(&named, "source.polling.notify_channel", "\"mine\""));
    let (code, out, err) = run_cli(&["check", "--config", named.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "a warning, not a failure: {out}{err}");
    assert!(
        out.contains("notify_channel is set but source.polling.notify is false"),
        "{out}"
    );
}

#[tokio::test]
async fn check_names_a_missing_table_and_a_missing_column() {
    let db = TestDb::new().await;
    let path = write_config(&base_toml(&db.url, &rabbit_sink()));
    let path = path.to_str().unwrap();
    let (code, out, _) = run_cli(&["check", "--config", path], &[]);
    assert_eq!(code, 1);
    assert!(
        out.contains("[FAIL] outbox table") && out.contains("public.outbox does not exist"),
        "{out}"
    );
    assert!(
        out.contains("outbox-relay migrate"),
        "the fix is named: {out}"
    );

    run_cli(&["migrate", "--config", path], &[]);
    db.client
        .batch_execute("ALTER TABLE outbox RENAME COLUMN aggregate_id TO agg")
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", path], &[]);
    assert_eq!(code, 1);
    assert!(
        out.contains("column \"aggregate_id\" (outbox.columns.aggregate_id) does not exist"),
        "{out}"
    );
}

#[tokio::test]
async fn check_reports_unreachable_services() {
    let closed = crate::kit::free_port();
    let toml = base_toml(
        &format!("postgres://postgres@127.0.0.1:{closed}/nowhere"),
        &format!(
            "[sink]\ntype = \"rabbitmq\"\nurl = \"amqp://guest:s3cret@127.0.0.1:{closed}/%2f\"\n"
        ),
    );
    let path = write_config(&toml);
    let (code, out, err) = run_cli(&["check", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    assert!(
        out.contains("[FAIL] database") && out.contains(&format!("127.0.0.1:{closed}")),
        "{out}"
    );
    assert!(out.contains("[FAIL] broker"), "{out}");
    assert!(
        !out.contains("s3cret") && !err.contains("s3cret"),
        "no secret in output: {out}{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_that_accepts_and_goes_silent_is_reported_not_waited_for() {
    let db = TestDb::new().await;
    // Accepts connections and never answers: a half-open connection, or a
    // port that is not an AMQP server's.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    let held = std::thread::spawn(move || {
        let mut open = Vec::new();
        for stream in silent.incoming().take(4) {
            open.push(stream);
        }
        std::thread::sleep(std::time::Duration::from_secs(60));
    });
    let toml = base_toml(
        &db.url,
        &format!(
            "[sink]\ntype = \"rabbitmq\"\nurl = \"amqp://guest:guest@127.0.0.1:{port}/%2f\"\n"
        ),
    );
    let path = write_config(&toml);
    let started = std::time::Instant::now();
    let (code, out, _) = run_cli(&["check", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] broker") && out.contains("did not complete the connection within 15s"),
        "{out}"
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(40));
    drop(held);
}

#[test]
fn bad_configuration_exits_2_naming_the_key() {
    let path = write_config(
        &base_toml("postgres://relay:s3cret@127.0.0.1/app", &rabbit_sink())
            .replace("poll_interval", "poll_intervall"),
    );
    let (code, _, err) = run_cli(&["run", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("source.polling") && err.contains("poll_intervall"),
        "{err}"
    );

    let good = write_config(&base_toml(
        "postgres://relay:s3cret@127.0.0.1/app",
        &rabbit_sink(),
    ));
    let (code, _, err) = run_cli(
        &["check", "--config", good.to_str().unwrap()],
        &[("OUTBOX_RELAY__SOURCE__BATCH_SIZE", "0")],
    );
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains(
            "source.batch_size (set by OUTBOX_RELAY__SOURCE__BATCH_SIZE): 0 is out of range; use 1 to 10000"
        ),
        "environment overrides are validated, and blamed on their variable: {err}"
    );
    assert!(!err.contains("s3cret"), "{err}");

    let (code, _, err) = run_cli(&["run", "--config", "/nonexistent/relay.toml"], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent/relay.toml"), "{err}");
}

#[test]
fn every_command_explains_itself() {
    for cmd in ["run", "migrate", "check"] {
        let (code, out, _) = run_cli(&[cmd, "--help"], &[]);
        assert_eq!(code, 0);
        assert!(out.contains("--config"), "{cmd} --help: {out}");
    }
    let (_, out, _) = run_cli(&["migrate", "--help"], &[]);
    assert!(out.contains("--dry-run"), "{out}");
}

/// A count out of range is refused by the command line, naming the option,
/// before any configuration is read.
#[test]
fn a_negative_dlq_limit_is_refused_naming_the_option() {
    let (code, _, err) = run_cli(
        &[
            "dlq",
            "list",
            "--config",
            "/nonexistent/relay.toml",
            "--limit=-1",
        ],
        &[],
    );
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--limit") && err.contains("-1"), "{err}");
}

#[tokio::test]
async fn check_names_a_missing_topic_for_waiting_events() {
    let db = TestDb::new().await;
    let topics = crate::support::brokers::KafkaTopics::new();
    topics.create("order").await;
    let path = write_config(&base_toml(&db.url, &topics.sink_toml()));
    let path = path.to_str().unwrap();
    run_cli(&["migrate", "--config", path], &[]);
    db.insert(uuid::Uuid::new_v4(), "order", "a", serde_json::json!({}))
        .await;
    db.insert(uuid::Uuid::new_v4(), "invoice", "b", serde_json::json!({}))
        .await;
    // A row without an event type (an adopted table may allow one) is
    // dead-lettered by the relay; `check` reports the rest around it.
    db.client
        .batch_execute(
            "ALTER TABLE outbox ALTER COLUMN event_type DROP NOT NULL;
             INSERT INTO outbox (id, aggregate_type, aggregate_id, payload)
             VALUES (gen_random_uuid(), 'order', 'c', '{}')",
        )
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!(
            "[ok  ] destination    topic {} exists",
            topics.topic("order")
        )),
        "{out}"
    );
    assert!(
        out.contains("[FAIL] destination")
            && out.contains(&format!(
                "topic \"{}\" does not exist",
                topics.topic("invoice")
            )),
        "{out}"
    );
}

#[tokio::test]
async fn check_reports_wrong_credentials_and_wrong_column_types() {
    let pg = crate::kit::cluster::PrivatePg::start_with(
        &["--auth-host=scram-sha-256", "--auth-local=trust"],
        &["password_encryption = 'scram-sha-256'"],
    );
    let admin = connect(&pg.socket_conninfo("postgres")).await;
    admin
        .batch_execute("ALTER ROLE postgres PASSWORD 'right'")
        .await
        .unwrap();
    let wrong_db = format!("postgres://postgres:wrong@127.0.0.1:{}/postgres", pg.port);
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url().replace("guest:guest", "guest:not-the-password")
    );
    let path = write_config(&base_toml(&wrong_db, &sink));
    let (code, out, err) = run_cli(&["check", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    assert!(
        out.contains("[FAIL] database") && out.contains("password authentication failed"),
        "{out}"
    );
    assert!(
        out.contains("check the user and password"),
        "the fix is named: {out}"
    );
    assert!(
        out.contains("[FAIL] broker") && out.contains("refused the credentials"),
        "{out}"
    );
    assert!(
        !out.contains("not-the-password")
            && !err.contains("not-the-password")
            && !out.contains("wrong@"),
        "{out}{err}"
    );
    // A virtual host the user may not use is named as such, not as a broker down.
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url().replace("/%2f", "/relay-no-such-vhost")
    );
    let path = write_config(&base_toml(&wrong_db, &sink));
    let (_, out, _) = run_cli(&["check", "--config", path.to_str().unwrap()], &[]);
    assert!(
        out.contains("[FAIL] broker")
            && out.contains("does not let this user use the virtual host"),
        "{out}"
    );

    // A column of the wrong type, on the shared cluster.
    let db = TestDb::new().await;
    let path = write_config(&base_toml(&db.url, &rabbit_sink()));
    let path = path.to_str().unwrap();
    run_cli(&["migrate", "--config", path], &[]);
    db.client
        .batch_execute(
            "ALTER TABLE outbox DROP COLUMN payload; ALTER TABLE outbox ADD COLUMN payload integer",
        )
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", path], &[]);
    assert_eq!(code, 1);
    assert!(
        out.contains(
            "column \"payload\" (outbox.columns.payload) is integer, expected jsonb, json or text"
        ),
        "{out}"
    );
}

#[tokio::test]
async fn check_names_a_missing_publication_and_slot() {
    let db = TestDb::new().await;
    let polling = base_toml(&db.url, &rabbit_sink());
    let path = write_config(&polling);
    run_cli(&["migrate", "--config", path.to_str().unwrap()], &[]);
    let cdc = set(
        &set(&polling, "source.mode", "\"cdc\""),
        "source.cdc.create_slot",
        "false",
    );
    let cdc = set(&cdc, "source.cdc.slot", &format!("\"{}\"", unique("slot_")));
    let path = write_config(&cdc);
    let (code, out, _) = run_cli(&["check", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 1);
    assert!(out.contains("[ok  ] wal_level"), "{out}");
    assert!(
        out.contains("[FAIL] publication")
            && out.contains("does not exist; run `outbox-relay migrate`"),
        "{out}"
    );
    assert!(
        out.contains("[FAIL] slot") && out.contains("does not exist; run `outbox-relay migrate`"),
        "{out}"
    );
    // migrate fixes both; check passes.
    let (code, out, err) = run_cli(&["migrate", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, _) = run_cli(&["check", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("[ok  ] slot"), "{out}");
}

/// Adopting a table that already holds events: `--mark-existing-sent` marks
/// them as sent while it adds the relay's columns, so only what comes after
/// is published. Once the columns exist it changes no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_mark_existing_sent_publishes_only_what_comes_after() {
    let db = TestDb::new().await;
    let broker = Broker::new(Kind::Rabbit, &[]).await;
    db.client
        .batch_execute(
            "CREATE TABLE outbox (
                 id uuid PRIMARY KEY,
                 aggregate_type text NOT NULL,
                 aggregate_id text NOT NULL,
                 event_type text NOT NULL,
                 payload jsonb
             );
             INSERT INTO outbox
             SELECT gen_random_uuid(), 'order', 'old' || g, 'OrderCreated', '{}' FROM generate_series(1, 3) g",
        )
        .await
        .expect("an application's table with its events");
    let toml = base_toml(&db.url, &broker.sink_toml());
    let path = config_file(&toml);
    let insert = |aggregate: &'static str| {
        let client = &db.client;
        async move {
            let id = uuid::Uuid::new_v4();
            client
                .execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'order', $2, 'OrderCreated', '{}')",
                    &[&id, &aggregate],
                )
                .await
                .expect("insert");
            id.to_string()
        }
    };
    let (code, out, err) = run_cli(&["migrate", "--config", &path, "--mark-existing-sent"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("mark the rows already in the table as sent"),
        "{out}"
    );
    assert_eq!(db.unsent().await, 0, "the old events are marked sent");

    // Run again: the columns exist, so a row written since stays unsent.
    let new = insert("new").await;
    let (code, out, err) = run_cli(&["migrate", "--config", &path, "--mark-existing-sent"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(db.unsent().await, 1, "{out}");
    assert!(
        out.contains("--mark-existing-sent marks nothing") && out.contains("will be published"),
        "the flag says it did nothing: {out}"
    );

    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_len(1, WAIT).await;
    db.wait_all_marked().await;
    // Unsent rows are read in relay_seq order, the old ones first: had they
    // been unsent, they would have come before the new one.
    let ids: Vec<String> = got
        .iter()
        .map(|m| m.json()["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, [new], "only the event written after the adoption");
    relay.stop().await;
}
