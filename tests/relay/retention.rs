//! Retention: only old sent rows and old resolved dead letters go, in
//! bounded batches, one instance at a time; `run_scheduled` stops on shutdown;
//! `outbox-relay retention --once`.

use crate::support::*;
use outbox_relay::config::Config;
use outbox_relay::ops::retention::{self, Cleanup};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A migrated outbox (the relay never runs: the sink is only there to be valid)
/// with the given `[retention]` and other settings.
pub(crate) async fn outbox(sets: &[(&str, &str)]) -> (TestDb, String) {
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    );
    let db = TestDb::new().await;
    let mut toml = base_toml(&db.url, &sink);
    for (k, v) in sets {
        toml = set(&toml, k, v);
    }
    db.migrate(&parse(&toml)).await;
    (db, toml)
}

/// Inserts `n` rows of `aggregate_type`, created `created_ago` and sent
/// `sent_ago` ago (unsent when `None`), in one statement.
pub(crate) async fn rows(
    db: &TestDb,
    aggregate_type: &str,
    n: i32,
    created_ago: &str,
    sent_ago: Option<&str>,
) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at, relay_sent_at)
             SELECT gen_random_uuid(), $1, g::text, 'Happened', '{}',
                    now() - $3::text::interval, now() - $4::text::interval
             FROM generate_series(1, $2) g",
            &[&aggregate_type, &n, &created_ago, &sent_ago],
        )
        .await
        .expect("insert rows");
}

pub(crate) async fn count_of(db: &TestDb, aggregate_type: &str) -> i64 {
    db.client
        .query_one(
            "SELECT count(*) FROM outbox WHERE aggregate_type = $1",
            &[&aggregate_type],
        )
        .await
        .unwrap()
        .get(0)
}

pub(crate) async fn client(config: &Config) -> tokio_postgres::Client {
    retention::connect(config)
        .await
        .expect("connect for retention")
}

/// Inserts and marks rows of aggregate type `live` until `stop`, as an
/// application and the relay do; returns how many it inserted.
fn writer(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<i64> {
    tokio::spawn(async move {
        let c = connect(&url).await;
        let mut inserted = 0;
        while !stop.load(Ordering::SeqCst) {
            c.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'live', g::text, 'Happened', '{}' FROM generate_series(1, 20) g",
                &[],
            )
            .await
            .unwrap();
            inserted += 20;
            c.execute(
                "UPDATE outbox SET relay_sent_at = now()
                 WHERE relay_sent_at IS NULL AND relay_seq = ANY(ARRAY(
                     SELECT relay_seq FROM outbox WHERE relay_sent_at IS NULL AND aggregate_type = 'live'))",
                &[],
            )
            .await
            .unwrap();
        }
        inserted
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_only_old_sent_rows_while_rows_are_inserted_and_marked() {
    let (db, toml) = outbox(&[
        ("retention.sent_window", "\"7d\""),
        ("retention.batch_size", "200"),
        ("retention.pause", "\"20ms\""),
    ])
    .await;
    let config = parse(&toml);
    rows(&db, "old_sent", 3000, "30 days", Some("10 days")).await;
    rows(&db, "recent_sent", 500, "30 days", Some("1 day")).await;
    rows(&db, "old_unsent", 500, "400 days", None).await;
    let stop = Arc::new(AtomicBool::new(false));
    let live = writer(db.url.clone(), stop.clone());
    let dbr = &db;
    wait_for(WAIT, "the writer to get going", || async move {
        (count_of(dbr, "live").await >= 100).then_some(())
    })
    .await;
    let c = client(&config).await;
    let report = retention::once(&c, &config, false).await.expect("cleanup");
    stop.store(true, Ordering::SeqCst);
    let inserted = tokio::time::timeout(WAIT, live)
        .await
        .expect("writer stops")
        .unwrap();

    assert_eq!(
        report.outbox,
        Cleanup::Done {
            rows: 3000,
            batches: 15
        },
        "{report}"
    );
    assert_eq!(
        count_of(&db, "old_sent").await,
        0,
        "every old sent row is gone"
    );
    assert_eq!(
        count_of(&db, "recent_sent").await,
        500,
        "recent sent rows stay"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE aggregate_type = 'old_unsent' AND relay_sent_at IS NULL")
            .await,
        500,
        "unsent rows stay, however old"
    );
    assert_eq!(
        count_of(&db, "live").await,
        inserted,
        "rows written meanwhile stay"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deletes_in_bounded_batches_each_its_own_transaction() {
    let (db, toml) = outbox(&[
        ("retention.batch_size", "100"),
        ("retention.pause", "\"30ms\""),
    ])
    .await;
    let config = parse(&toml);
    assert_eq!(
        db.count("SELECT count(*) FROM pg_indexes WHERE indexname = 'outbox_relay_sent_outbox'")
            .await,
        1,
        "migrate creates the index retention reads through"
    );
    rows(&db, "old", 1050, "30 days", Some("8 days")).await;
    // Every DELETE statement logs how many rows it removed, and in which transaction.
    db.client
        .batch_execute(
            "CREATE TABLE deletes (rows bigint, xid xid8);
             CREATE FUNCTION log_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN INSERT INTO deletes SELECT count(*), pg_current_xact_id() FROM gone; RETURN NULL; END $$;
             CREATE TRIGGER log_delete AFTER DELETE ON outbox REFERENCING OLD TABLE AS gone
             FOR EACH STATEMENT EXECUTE FUNCTION log_delete();",
        )
        .await
        .unwrap();
    let c = client(&config).await;
    let report = retention::once(&c, &config, false).await.expect("cleanup");
    assert_eq!(
        report.outbox,
        Cleanup::Done {
            rows: 1050,
            batches: 11
        },
        "{report}"
    );
    assert!(
        report.duration >= Duration::from_millis(30 * 10),
        "a pause between batches: {report}"
    );
    let logged = db
        .client
        .query("SELECT rows, xid::text FROM deletes", &[])
        .await
        .unwrap();
    let sizes: Vec<i64> = logged.iter().map(|r| r.get(0)).collect();
    assert_eq!(sizes.len(), 11, "{sizes:?}");
    assert!(sizes.iter().all(|&n| n <= 100), "{sizes:?}");
    assert_eq!(sizes.iter().sum::<i64>(), 1050);
    let mut xids: Vec<String> = logged.iter().map(|r| r.get(1)).collect();
    xids.sort();
    xids.dedup();
    assert_eq!(xids.len(), 11, "one transaction per batch");
    assert_eq!(count_of(&db, "old").await, 0);

    // Running it again is harmless.
    let again = retention::once(&c, &config, false)
        .await
        .expect("second cleanup");
    assert_eq!(
        again.outbox,
        Cleanup::Done {
            rows: 0,
            batches: 0
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_instance_cleans_at_a_time() {
    let (db, toml) = outbox(&[
        ("retention.batch_size", "50"),
        ("retention.pause", "\"50ms\""),
    ])
    .await;
    let config = parse(&toml);
    rows(&db, "old", 500, "30 days", Some("8 days")).await;
    let key = retention::lock_key(&config.outbox.table);

    // Another instance holds the lock: this one skips, and deletes nothing.
    let holder = connect(&db.url).await;
    holder
        .execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", &[&key])
        .await
        .unwrap();
    let c1 = client(&config).await;
    let report = retention::once(&c1, &config, false).await.expect("cleanup");
    assert!(report.is_busy(), "{report}");
    assert_eq!(report.to_string(), "skipped: another instance is cleaning");
    assert_eq!(count_of(&db, "old").await, 500);
    holder
        .execute(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
            &[&key],
        )
        .await
        .unwrap();

    // Two at once: one cleans (for about half a second), the other skips.
    let c2 = client(&config).await;
    let (a, b) = tokio::join!(
        retention::once(&c1, &config, false),
        retention::once(&c2, &config, false)
    );
    let (a, b) = (a.expect("first"), b.expect("second"));
    assert!(a.is_busy() != b.is_busy(), "exactly one skipped: {a} / {b}");
    assert_eq!(a.outbox.rows() + b.outbox.rows(), 500, "{a} / {b}");
    assert_eq!(count_of(&db, "old").await, 0);
    // The lock was released: a later run is not skipped.
    let later = retention::once(&c2, &config, false).await.unwrap();
    assert!(!later.is_busy(), "{later}");
}

/// Inserts a dead letter, resolved `resolved_ago` ago (open when `None`).
async fn dead_letter(db: &TestDb, id: &str, resolved_ago: Option<&str>) {
    db.client
        .execute(
            "INSERT INTO outbox_dead_letters (id, reason, attempts, first_failed_at, last_failed_at, resolution, resolved_at)
             VALUES ($1, 'refused', 5, now() - interval '90 days', now() - interval '90 days',
                     CASE WHEN $2::text IS NULL THEN NULL ELSE 'dropped' END, now() - $2::text::interval)",
            &[&id, &resolved_ago],
        )
        .await
        .unwrap();
}

async fn dead_letter_ids(db: &TestDb) -> Vec<String> {
    db.client
        .query("SELECT id FROM outbox_dead_letters ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dry_run_counts_and_deletes_nothing() {
    let (db, toml) = outbox(&[("retention.batch_size", "100")]).await;
    let config = parse(&toml);
    rows(&db, "old", 250, "30 days", Some("8 days")).await;
    rows(&db, "old_unsent", 10, "30 days", None).await;
    dead_letter(&db, "resolved-old", Some("31 days")).await;
    dead_letter(&db, "open-old", None).await;
    let c = client(&config).await;
    let report = retention::once(&c, &config, true).await.expect("dry run");
    assert_eq!(
        report.outbox,
        Cleanup::Done {
            rows: 250,
            batches: 3
        }
    );
    assert_eq!(
        report.dead_letters,
        Cleanup::Done {
            rows: 1,
            batches: 1
        }
    );
    assert!(
        report
            .to_string()
            .starts_with("would delete 250 sent rows older than 7d in 3 batches; 1 dead letter older than 30d; took"),
        "{report}"
    );
    assert_eq!(count_of(&db, "old").await, 250);
    assert_eq!(count_of(&db, "old_unsent").await, 10);
    assert_eq!(dead_letter_ids(&db).await.len(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resolved_dead_letters_go_after_their_own_window_and_open_ones_stay() {
    let (db, toml) = outbox(&[
        ("retention.sent_window", "\"1d\""),
        ("retention.dead_letter_window", "\"30d\""),
        ("retention.batch_size", "2"),
        ("retention.pause", "\"0s\""),
    ])
    .await;
    let config = parse(&toml);
    for i in 0..5 {
        dead_letter(&db, &format!("resolved-old-{i}"), Some("31 days")).await;
    }
    dead_letter(&db, "resolved-recent", Some("2 days")).await;
    dead_letter(&db, "open-old", None).await;
    // Open, and dead-lettered long before both windows.
    db.client
        .execute(
            "UPDATE outbox_dead_letters SET dead_lettered_at = now() - interval '400 days' WHERE id = 'open-old'",
            &[],
        )
        .await
        .unwrap();
    let c = client(&config).await;
    let report = retention::once(&c, &config, false).await.expect("cleanup");
    assert_eq!(
        report.dead_letters,
        Cleanup::Done {
            rows: 5,
            batches: 3
        },
        "{report}"
    );
    assert_eq!(
        dead_letter_ids(&db).await,
        vec!["open-old", "resolved-recent"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_its_index_it_still_cleans_and_says_to_migrate() {
    let (db, toml) = outbox(&[("retention.batch_size", "100")]).await;
    let config = parse(&toml);
    db.client
        .batch_execute("DROP INDEX outbox_relay_sent_outbox")
        .await
        .unwrap();
    rows(&db, "old", 250, "30 days", Some("8 days")).await;
    rows(&db, "unsent", 10, "30 days", None).await;
    let c = client(&config).await;
    let report = retention::once(&c, &config, false).await.expect("cleanup");
    assert_eq!(
        report.outbox,
        Cleanup::Done {
            rows: 250,
            batches: 3
        }
    );
    assert!(
        report.to_string().contains(
            "hint: index outbox_relay_sent_outbox is missing, so every batch scans the table: run outbox-relay migrate"
        ),
        "{report}"
    );
    assert_eq!(count_of(&db, "unsent").await, 10);

    // migrate builds it without blocking writers, and the hint goes.
    let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(&config, false);
    let steps = outbox_relay::ops::migrate::plan(&c, &opts).await.unwrap();
    assert_eq!(steps.len(), 1, "{steps:?}");
    assert!(
        steps[0]
            .sql
            .starts_with("CREATE INDEX CONCURRENTLY IF NOT EXISTS \"outbox_relay_sent_outbox\""),
        "{steps:?}"
    );
    db.migrate(&config).await;
    let report = retention::once(&c, &config, false).await.unwrap();
    assert_eq!(report.hint, None, "{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_scheduled_cleans_and_stops_promptly() {
    let (db, toml) = outbox(&[
        ("retention.interval", "\"1s\""),
        ("retention.batch_size", "100"),
        // Long enough that shutdown arrives during a pause.
        ("retention.pause", "\"30s\""),
    ])
    .await;
    let config = parse(&toml);
    rows(&db, "old", 300, "30 days", Some("8 days")).await;
    rows(&db, "unsent", 10, "30 days", None).await;
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let (config, token) = (config.clone(), shutdown.clone());
        async move { retention::run_scheduled(&config, None, token).await }
    });
    let dbr = &db;
    wait_for(
        Duration::from_secs(15),
        "the first scheduled batch",
        || async move { (count_of(dbr, "old").await == 200).then_some(()) },
    )
    .await;
    let asked = Instant::now();
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(3), task)
        .await
        .expect("run_scheduled stops within 3s of shutdown")
        .unwrap();
    let took = asked.elapsed();
    // Between batches, not by abandoning the run after the grace period.
    assert!(took < Duration::from_millis(800), "stopped in {took:?}");
    assert_eq!(count_of(&db, "unsent").await, 10);
    // No transaction left open, and the lock goes with the session.
    let key = &retention::lock_key(&config.outbox.table);
    wait_for(Duration::from_secs(5), "the retention session to end", || async move {
        let open = dbr
            .count(&format!(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = '{}' AND state LIKE 'idle in transaction%'",
                dbr.name
            ))
            .await;
        let held: bool = dbr
            .client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&key],
            )
            .await
            .unwrap()
            .get(0);
        (open == 0 && held).then_some(())
    })
    .await;
    assert_eq!(
        count_of(&db, "old").await,
        200,
        "nothing deleted after shutdown"
    );

    // Stopped while waiting for its first run.
    let config = parse(&set(&toml, "retention.interval", "\"1h\""));
    let shutdown = CancellationToken::new();
    let task = tokio::spawn({
        let token = shutdown.clone();
        async move { retention::run_scheduled(&config, None, token).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .expect("stops while waiting")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_retention_command_prints_a_summary() {
    let (db, toml) = outbox(&[]).await;
    rows(&db, "old", 1050, "30 days", Some("8 days")).await;
    let dir = std::env::temp_dir().join(unique("outbox-relay-retention-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("relay.toml");
    std::fs::write(&path, &toml).unwrap();
    let path = path.to_str().unwrap();

    let (code, _, err) = run_cli(&["retention", "--config", path], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("--once"), "{err}");

    let (code, out, err) = run_cli(&["retention", "--config", path, "--once", "--dry-run"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("would delete 1,050 sent rows older than 7d in 2 batches; 0 dead letters older than 30d; took"),
        "{out}"
    );
    assert_eq!(count_of(&db, "old").await, 1050);

    let (code, out, err) = run_cli(&["retention", "--config", path, "--once"], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.starts_with("deleted 1,050 sent rows older than 7d in 2 batches; 0 dead letters older than 30d; took"),
        "{out}"
    );
    assert_eq!(count_of(&db, "old").await, 0);

    let unreachable = set(
        &toml,
        "database.url",
        "\"postgres://postgres@127.0.0.1:1/x\"",
    );
    std::fs::write(dir.join("down.toml"), unreachable).unwrap();
    let (code, _, err) = run_cli(
        &[
            "retention",
            "--config",
            dir.join("down.toml").to_str().unwrap(),
            "--once",
        ],
        &[],
    );
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("error: cannot connect to PostgreSQL"), "{err}");
}
