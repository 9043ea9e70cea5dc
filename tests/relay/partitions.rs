//! A partitioned outbox: `migrate` adopting an application's table and the
//! publication through the root.

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

/// Inserts through the parent with `created_at` given.
async fn insert_at(db: &TestDb, id: Uuid, at: &str) -> Result<u64, tokio_postgres::Error> {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES ($1, 'order', 'o-1', 'Happened', '{}', $2::text::timestamptz)",
            &[&id, &at],
        )
        .await
}

#[allow(dead_code)]
async fn partitions_of(db: &TestDb) -> Vec<String> {
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
    db.client
        .batch_execute(
            "CREATE TABLE outbox_2030 PARTITION OF outbox
                 FOR VALUES FROM ('2030-01-01 00:00:00+00') TO ('2031-01-01 00:00:00+00')",
        )
        .await
        .unwrap();
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
    let (code, out, _) = run_cli(&["migrate", "--dry-run", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("CREATE"), "nothing left to do: {out}");
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("partitioned by range (created_at)"), "{out}");
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
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("partitioned by an expression") && err.contains("partition by columns"),
        "{err}"
    );
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] outbox table") && out.contains("partitioned by an expression"),
        "{out}"
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
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] publication") && out.contains("publish_via_partition_root is off"),
        "{out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(out.contains("[ok  ] publication"), "{code} {out}");
}
