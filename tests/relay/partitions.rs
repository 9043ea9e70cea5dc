//! A partitioned outbox: `migrate` adopting an application's table, delivery
//! and marking through the parent in both modes (also into partitions made
//! while the relay runs), the publication through the root, and retention
//! by partition.

use crate::support::*;
use uuid::Uuid;

/// The application's table: partitioned by day on `created_at`, one old
/// partition with a row in it, before the relay's columns exist.
const APP_TABLE: &str = "
CREATE TABLE outbox (
    id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
    event_type text NOT NULL, payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);
CREATE TABLE outbox_2020 PARTITION OF outbox
    FOR VALUES FROM ('2020-01-01 00:00:00+00') TO ('2021-01-01 00:00:00+00')";

async fn app_table(db: &TestDb) {
    db.client.batch_execute(APP_TABLE).await.unwrap();
}

/// An outbox partitioned by day on `created_at`, before the relay's columns
/// exist: one partition per `(name, day)`, and a default partition when
/// `with_default`.
/// [`setup`] on the application's partitioned table ([`app_table`]).
pub(crate) async fn partitioned(
    mode: Mode,
    kind: Kind,
    sets: &[(&str, &str)],
) -> (TestDb, Broker, String) {
    let db = TestDb::new().await;
    app_table(&db).await;
    let broker = Broker::new(kind, &["order"]).await;
    let mut toml = with_mode(&base_toml(&db.url, &broker.sink_toml()), mode);
    for (key, value) in sets {
        toml = set(&toml, key, value);
    }
    db.migrate(&parse(&toml)).await;
    (db, broker, toml)
}

pub(crate) async fn day_partitioned(db: &TestDb, days: &[(&str, &str)], with_default: bool) {
    let mut sql = String::from(
        "CREATE TABLE outbox (
             id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
             event_type text NOT NULL, payload jsonb NOT NULL,
             created_at timestamptz NOT NULL DEFAULT now(),
             PRIMARY KEY (id, created_at)
         ) PARTITION BY RANGE (created_at);",
    );
    for (name, day) in days {
        let from = chrono::NaiveDate::parse_from_str(day, "%Y-%m-%d").expect("a day");
        let to = from.succ_opt().expect("a next day");
        sql.push_str(&format!(
            "CREATE TABLE {name} PARTITION OF outbox
                 FOR VALUES FROM ('{from} 00:00:00+00') TO ('{to} 00:00:00+00');"
        ));
    }
    if with_default {
        sql.push_str("CREATE TABLE outbox_default PARTITION OF outbox DEFAULT;");
    }
    db.client.batch_execute(&sql).await.unwrap();
}

/// A partition for the year 2030, as the application would add one.
async fn partition_2030(db: &TestDb) {
    db.client
        .batch_execute(
            "CREATE TABLE outbox_2030 PARTITION OF outbox
                 FOR VALUES FROM ('2030-01-01 00:00:00+00') TO ('2031-01-01 00:00:00+00')",
        )
        .await
        .unwrap();
}

/// Inserts through the parent with `created_at` given.
pub(crate) async fn insert_at(
    db: &TestDb,
    id: Uuid,
    at: &str,
) -> Result<u64, tokio_postgres::Error> {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ($1, 'order', 'o-1', 'Happened', '{}', $2::text::timestamptz)",
            &[&id, &at],
        )
        .await
}

/// The outbox's partitions, by name.
pub(crate) async fn partitions_of(db: &TestDb) -> Vec<String> {
    db.client
        .query(
            "SELECT c.relname::text FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
             WHERE i.inhparent = 'outbox'::regclass ORDER BY 1",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test]
async fn migrate_adopts_an_application_partitioned_table() {
    let db = TestDb::new().await;
    app_table(&db).await;
    let old = Uuid::new_v4();
    insert_at(&db, old, "2020-06-01 00:00:00+00").await.unwrap();
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--dry-run", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        !out.contains("CONCURRENTLY") && out.contains("(\"relay_seq\", \"created_at\")"),
        "partitioned tables get their indexes on the parent, with the key: {out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    // relay_seq draws from one sequence, in every partition, present and future.
    partition_2030(&db).await;
    let new = Uuid::new_v4();
    insert_at(&db, new, "2030-06-01 00:00:00+00").await.unwrap();
    assert_eq!(
        db.count("SELECT count(DISTINCT relay_seq) FROM outbox WHERE relay_seq IS NOT NULL")
            .await,
        2
    );
    assert_eq!(
        db.count(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'outbox'
               AND indexdef LIKE 'CREATE UNIQUE INDEX % (relay_seq, created_at)'"
        )
        .await,
        1,
        "unique (relay_seq, created_at)"
    );
    // The write-once trigger reaches every partition.
    let refused = db
        .client
        .execute(
            "UPDATE outbox SET payload = '{\"changed\": true}' WHERE id = $1",
            &[&new],
        )
        .await
        .expect_err("an unsent event cannot change");
    let message = refused.as_db_error().map(|e| e.message().to_owned());
    assert!(
        message.as_deref().is_some_and(|m| m.contains("write-once")),
        "{refused:?}"
    );
    // So does the one that keeps relay_xid to the inserting transaction's.
    let refused = db
        .client
        .execute(
            "UPDATE outbox SET relay_xid = '3'::xid8 WHERE id = $1",
            &[&new],
        )
        .await
        .expect_err("an unsent row's relay_xid cannot change");
    let message = refused.as_db_error().map(|e| e.message().to_owned());
    assert!(
        message
            .as_deref()
            .is_some_and(|m| m.starts_with("outbox.relay_xid is the inserting transaction's id")),
        "{refused:?}"
    );
    let out = cli_says(&["migrate", "--dry-run", "--config", &path], 0, &[]);
    assert!(!out.contains("CREATE"), "nothing left to do: {out}");
    let out = cli_says(
        &["check", "--config", &path],
        0,
        &["partitioned by range (created_at)"],
    );
    assert!(!out.contains("[warn] outbox table"), "{out}");
}

#[tokio::test]
async fn a_table_partitioned_by_an_expression_is_refused_with_the_reason() {
    let db = TestDb::new().await;
    db.client
        .batch_execute(
            "CREATE TABLE outbox (
                 id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now()
             ) PARTITION BY LIST (lower(aggregate_type));
             CREATE TABLE outbox_all PARTITION OF outbox DEFAULT",
        )
        .await
        .unwrap();
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    cli_complains(
        &["migrate", "--config", &path],
        1,
        &["partitioned by an expression", "partition by columns"],
    );
    cli_says(
        &["check", "--config", &path],
        1,
        &["[FAIL] outbox table", "partitioned by an expression"],
    );
}

every_mode!(delivers_and_marks_across_partitions_made_while_running);
/// With `retention.mode = "partitions"` the relay makes the current
/// partitions itself at start-up; rows routed to them, to an old partition
/// and to one the application adds while the relay runs are all delivered
/// and marked.
async fn delivers_and_marks_across_partitions_made_while_running(mode: Mode, kind: Kind) {
    let sets = [
        ("retention.mode", "\"partitions\""),
        ("retention.partition_premake", "1"),
    ];
    let (db, broker, toml) = partitioned(mode, kind, &sets).await;
    let config = parse(&toml);
    let old = Uuid::new_v4();
    insert_at(&db, old, "2020-06-01 00:00:00+00").await.unwrap();
    let relay = InProcess::start(config.clone());
    // `run` schedules retention beside the relay; in process, the test does.
    let stop_retention = tokio_util::sync::CancellationToken::new();
    let retention = tokio::spawn({
        let token = stop_retention.clone();
        async move { outbox_relay::ops::retention::run_scheduled(&config, None, token).await }
    });
    // Retention's first run, at start-up, makes today's partition.
    let now = Uuid::new_v4();
    wait_for(WAIT, "a partition for the current time", || async {
        insert_at(&db, now, "now").await.ok()
    })
    .await;
    partition_2030(&db).await;
    let later = Uuid::new_v4();
    insert_at(&db, later, "2030-06-01 00:00:00+00")
        .await
        .unwrap();
    // Written straight into the partition: no NOTIFY (the trigger is the
    // parent's), but the poll and the stream (through the root) see it.
    let direct = Uuid::new_v4();
    db.client
        .execute(
            "INSERT INTO outbox_2030 (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ($1, 'order', 'o-2', 'Happened', '{}', '2030-07-01 00:00:00+00')",
            &[&direct],
        )
        .await
        .unwrap();
    let ids = strings(&[old, now, later, direct]);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 4);
    let names = partitions_of(&db).await;
    assert!(
        names.len() >= 4,
        "2020, 2030, today and tomorrow: {names:?}"
    );
    relay.stop().await;
    stop_retention.cancel();
    tokio::time::timeout(WAIT, retention)
        .await
        .expect("retention stops within the wait")
        .unwrap();
    assert_eq!(broker.inbox().len(), 4, "each event once");
}

/// The relay-side fields a test sets on rows to age them.
async fn age(db: &TestDb, id: Uuid, sent: Option<&str>) {
    db.client
        .execute(
            "UPDATE outbox SET relay_sent_at = $2::text::timestamptz WHERE id = $1",
            &[&id, &sent],
        )
        .await
        .unwrap();
}

#[tokio::test]
async fn retention_drops_old_sent_partitions_and_keeps_the_others() {
    let db = TestDb::new().await;
    day_partitioned(
        &db,
        &[
            ("outbox_sent", "2020-01-01"),
            ("outbox_unsent", "2020-01-02"),
            ("outbox_late", "2020-01-03"),
            ("outbox_empty", "2020-01-04"),
        ],
        true,
    )
    .await;
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let toml = set(&toml, "retention.partition_premake", "2");
    let config = parse(&toml);
    db.migrate(&config).await;
    let (sent, unsent, late, stray) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    insert_at(&db, sent, "2020-01-01 12:00:00+00")
        .await
        .unwrap();
    insert_at(&db, unsent, "2020-01-02 12:00:00+00")
        .await
        .unwrap();
    insert_at(&db, late, "2020-01-03 12:00:00+00")
        .await
        .unwrap();
    // No partition covers 2019: it lands in the default partition.
    insert_at(&db, stray, "2019-06-01 00:00:00+00")
        .await
        .unwrap();
    age(&db, sent, Some("2020-01-05 00:00:00+00")).await;
    age(&db, late, Some("now")).await; // sent within the window
    age(&db, stray, Some("2020-01-05 00:00:00+00")).await;
    // Two days ahead has no partition yet: this row waits in the default
    // partition, which keeps that range from being created.
    let ahead = Uuid::new_v4();
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ($1, 'order', 'o-1', 'Happened', '{}', date_trunc('day', now() AT TIME ZONE 'UTC')
                     AT TIME ZONE 'UTC' + interval '2 days 1 hour')",
            &[&ahead],
        )
        .await
        .unwrap();

    let path = config_file(&toml);
    let (code, out, err) = run_cli(
        &["retention", "--once", "--dry-run", "--config", &path],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("would drop public.outbox_sent, public.outbox_empty")
            && out.contains("kept public.outbox_unsent: it holds unsent rows"),
        "{out}"
    );
    assert_eq!(
        partitions_of(&db).await.len(),
        5,
        "a dry run changes nothing"
    );

    let client = outbox_relay::ops::retention::connect(&config)
        .await
        .unwrap();
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    let p = report.partitions.clone().expect("a partition report");
    let names = |v: &[outbox_relay::config::TableName]| -> Vec<String> {
        v.iter().map(|t| t.name.clone()).collect()
    };
    assert_eq!(
        names(&p.dropped),
        ["outbox_sent", "outbox_empty"],
        "{report}"
    );
    let kept: Vec<&str> = p.kept.iter().map(|(t, _)| t.name.as_str()).collect();
    assert_eq!(kept, ["outbox_unsent", "outbox_late"], "{report}");
    assert!(p.kept[0].1.contains("unsent"), "{report}");
    assert_eq!(p.created.len(), 2, "today and tomorrow: {report}");
    assert!(
        p.problems.len() == 1 && p.problems[0].contains("default partition holds rows"),
        "{report}"
    );
    // The default partition's sent row goes row by row.
    assert_eq!(report.outbox.rows(), 1, "{report}");
    let left = partitions_of(&db).await;
    assert!(
        !left.contains(&"outbox_sent".to_owned()) && left.contains(&"outbox_unsent".to_owned()),
        "{left:?}"
    );
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 3);
    assert_eq!(db.unsent().await, 2, "the unsent rows are still there");

    // Again: nothing more to do, and nothing made twice.
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    let p = report.partitions.clone().unwrap();
    assert!(p.created.is_empty() && p.dropped.is_empty(), "{report}");
    // Once the row is sent and its time passed, its partition goes too.
    age(&db, unsent, Some("2020-01-05 00:00:00+00")).await;
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    assert_eq!(
        names(&report.partitions.unwrap().dropped),
        ["outbox_unsent"]
    );
    let (_, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        out.contains("[ok  ] partitions") && out.contains("by range on created_at"),
        "{out}"
    );
}

#[tokio::test]
async fn partition_retention_refuses_a_layout_it_cannot_use() {
    let db = TestDb::new().await;
    db.client
        .batch_execute(
            "CREATE TABLE outbox (
                 id uuid NOT NULL, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                 event_type text NOT NULL, payload jsonb NOT NULL,
                 created_at timestamptz NOT NULL DEFAULT now(),
                 PRIMARY KEY (id, aggregate_type)
             ) PARTITION BY LIST (aggregate_type);
             CREATE TABLE outbox_rest PARTITION OF outbox DEFAULT",
        )
        .await
        .unwrap();
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "delivery works on any column layout: {out}{err}");
    let (code, out, err) = run_cli(&["retention", "--once", "--config", &path], &[]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("retention.mode") && err.contains("partitioned by list"),
        "{out}{err}"
    );
    cli_says(
        &["check", "--config", &path],
        1,
        &["[FAIL] partitions", "partitioned by list"],
    );
}

#[tokio::test]
async fn a_publication_naming_the_partitions_is_reported_and_fixed() {
    let db = TestDb::new().await;
    app_table(&db).await;
    let toml = with_mode(&base_toml(&db.url, &rabbit_sink()), Mode::Cdc);
    let path = config_file(&toml);
    // Made by hand, without publish_via_partition_root.
    db.client
        .batch_execute(
            "CREATE PUBLICATION outbox_relay_outbox FOR TABLE outbox WITH (publish = 'insert')",
        )
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["migrate", "--dry-run", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("SET (publish_via_partition_root = true)") && !out.contains("ADD TABLE"),
        "{out}"
    );
    cli_says(
        &["check", "--config", &path],
        1,
        &["[FAIL] publication", "publish_via_partition_root is off"],
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(out.contains("[ok  ] publication"), "{code} {out}");
}

/// A row being written into an expired partition while retention runs:
/// the check before the lock cannot see it (uncommitted), so the partition
/// is kept by the lock the writer holds, and after the commit by the row.
#[tokio::test]
async fn a_row_written_into_an_expired_partition_keeps_it() {
    let db = TestDb::new().await;
    day_partitioned(&db, &[("outbox_old", "2020-01-01")], false).await;
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let config = parse(&toml);
    db.migrate(&config).await;
    let writer = connect(&db.url).await;
    writer
        .batch_execute(&format!(
            "BEGIN; INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ('{}', 'order', 'o-1', 'Happened', '{{}}', '2020-01-01 12:00:00+00')",
            Uuid::new_v4()
        ))
        .await
        .unwrap();
    let client = outbox_relay::ops::retention::connect(&config)
        .await
        .unwrap();
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    let p = report.partitions.clone().unwrap();
    assert!(p.dropped.is_empty(), "{report}");
    assert!(
        p.kept.len() == 1 && p.kept[0].1.contains("locked"),
        "{report}"
    );
    // Creating waits for the same lock: one try, the rest left for the next run.
    assert!(
        p.created.is_empty() && p.problems.len() == 1 && p.problems[0].contains("locked"),
        "{report}"
    );
    writer.batch_execute("COMMIT").await.unwrap();
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    let p = report.partitions.clone().unwrap();
    assert!(
        p.dropped.is_empty() && p.kept[0].1.contains("unsent"),
        "{report}"
    );
    assert!(partitions_of(&db).await.contains(&"outbox_old".to_owned()));
    assert_eq!(db.unsent().await, 1);
}

every_mode!(a_dead_lettered_row_does_not_hold_its_partition);
/// A poison row in a partition is dead-lettered (its row marked in the same
/// transaction); the dead letter keeps its own copy, so once the row's time
/// is past the window its partition is dropped and the letter stays.
async fn a_dead_lettered_row_does_not_hold_its_partition(mode: Mode, kind: Kind) {
    let sets = [
        ("retention.mode", "\"partitions\""),
        ("retention.enabled", "false"),
        ("dead_letter.max_attempts", "2"),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
        ("sink.message_max_bytes", "4000"),
    ];
    let (db, broker, toml) = partitioned(mode, kind, &sets).await;
    let config = parse(&toml);
    let (poison, good) = (Uuid::new_v4(), Uuid::new_v4());
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ($1, 'order', 'P', 'Big', jsonb_build_object('x', repeat('x', 8000)),
                     '2020-06-01 00:00:00+00')",
            &[&poison],
        )
        .await
        .unwrap();
    insert_at(&db, good, "2020-06-02 00:00:00+00")
        .await
        .unwrap();
    let relay = InProcess::start(config.clone());
    broker.inbox().wait_ids(&strings(&[good]), WAIT).await;
    wait_for(WAIT, "the poison row dead-lettered and marked", || async {
        let letters = db.count("SELECT count(*) FROM outbox_dead_letters").await;
        (letters == 1 && db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;
    db.client
        .batch_execute("UPDATE outbox SET relay_sent_at = '2020-07-01 00:00:00+00'")
        .await
        .unwrap();
    let client = outbox_relay::ops::retention::connect(&config)
        .await
        .unwrap();
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    let dropped: Vec<String> = report
        .partitions
        .clone()
        .unwrap()
        .dropped
        .iter()
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(dropped, ["outbox_2020"], "{report}");
    assert_eq!(
        db.count("SELECT count(*) FROM outbox_dead_letters WHERE resolution IS NULL")
            .await,
        1,
        "the dead letter stays open, with its own copy"
    );
}
