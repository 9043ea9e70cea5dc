//! Partition retention against partitions it did not make: a range held
//! only in part (another `partition_interval` before) gets the rest of it,
//! a partition the server refuses to drop stays without stopping the
//! run, and ranges the default partition holds rows of are not tried.

use crate::partitions::{day_partitioned, insert_at, partitions_of};
use crate::support::*;
use outbox_relay::ops::retention::{self, Cleanup};
use uuid::Uuid;

/// `outbox` partitioned by `partitions` with the relay's columns, and a
/// config for `retention.mode = "partitions"` with `sets`.
async fn partition_retention(sets: &[(&str, &str)]) -> (TestDb, String) {
    let db = TestDb::new().await;
    day_partitioned(&db, &[], false).await;
    let mut toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    for (key, value) in sets {
        toml = set(&toml, key, value);
    }
    (db, toml)
}

/// Switching `partition_interval` from 6h to 1d: the 6h partitions made
/// up to 06:00 tomorrow hold part of tomorrow, and the rest of it is
/// created from 06:00 (nothing was before, and inserts then failed).
/// `check` warns while that part is missing.
#[tokio::test]
async fn switching_the_interval_creates_the_rest_of_a_range_held_in_part() {
    let sets = [
        ("retention.partition_interval", "\"1d\""),
        ("retention.partition_premake", "2"),
    ];
    let (db, toml) = partition_retention(&sets).await;
    // "Today" is read in several statements: none may fall after midnight.
    let to_midnight: f64 = db
        .client
        .query_one(
            "SELECT extract(epoch FROM date_trunc('day', now() AT TIME ZONE 'UTC') + interval '1 day'
                                      - now() AT TIME ZONE 'UTC')::float8",
            &[],
        )
        .await
        .expect("the time to midnight")
        .get(0);
    if to_midnight < 120.0 {
        tokio::time::sleep(std::time::Duration::from_secs_f64(to_midnight + 2.0)).await;
    }
    // What 6h partitions with a premake of 3 made at the end of yesterday:
    // today from midnight (UTC) and tomorrow until 06:00.
    db.client
        .batch_execute(
            "DO $$
             DECLARE day timestamptz := date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC';
             BEGIN
                 FOR k IN 0..4 LOOP
                     EXECUTE format('CREATE TABLE outbox_6h_%s PARTITION OF outbox FOR VALUES FROM (%L) TO (%L)',
                                    k, day + k * interval '6 hours', day + (k + 1) * interval '6 hours');
                 END LOOP;
             END $$",
        )
        .await
        .unwrap();
    let config = parse(&toml);
    db.migrate(&config).await;
    let dbr = &db;
    let day = |k: i32| async move {
        let row = dbr
            .client
            .query_one(
                "SELECT to_char(now() AT TIME ZONE 'UTC' + $1 * interval '1 day', 'YYYYMMDD'),
                        to_char(now() AT TIME ZONE 'UTC' + $1 * interval '1 day', 'YYYY-MM-DD')",
                &[&f64::from(k)],
            )
            .await
            .unwrap();
        (row.get::<_, String>(0), row.get::<_, String>(1))
    };
    let ((tomorrow, tomorrow_date), (after, after_date)) = (day(1).await, day(2).await);

    let path = config_file(&toml);
    let (_, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        out.contains("[warn] partitions")
            && out.contains(&format!("no partition holds {tomorrow_date} 06:00:00Z to ")),
        "the current time is held, the rest of tomorrow is not: {out}{err}"
    );

    // A table that is no partition has the name the day after's would.
    db.client
        .batch_execute(&format!("CREATE TABLE outbox_p{after} (x int)"))
        .await
        .unwrap();
    let client = retention::connect(&config).await.unwrap();
    let report = retention::once(&client, &config, false).await.unwrap();
    let p = report.partitions.clone().expect("a partition report");
    let created: Vec<&str> = p.created.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        created,
        [
            format!("outbox_p{tomorrow}_0600"),
            format!("outbox_p{after}_2")
        ],
        "{report}"
    );
    assert!(p.problems.is_empty(), "{report}");
    for at in [
        format!("{tomorrow_date} 12:00:00+00"),
        format!("{tomorrow_date} 23:59:59+00"),
        format!("{after_date} 12:00:00+00"),
    ] {
        insert_at(&db, Uuid::new_v4(), &at)
            .await
            .unwrap_or_else(|e| panic!("a partition holds {at}: {e}"));
    }
    let (_, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert!(out.contains("[ok  ] partitions"), "{out}{err}");
    // Nothing is made twice.
    let report = retention::once(&client, &config, false).await.unwrap();
    let again = report.partitions.clone().unwrap();
    assert!(again.created.is_empty(), "{report}");
    assert_eq!(partitions_of(&db).await.len(), 7);
}

/// A view on an expired partition makes the server refuse to drop it: it
/// is kept with the error and the fix, and the run goes on: the next
/// expired partition is dropped, the default partition's sent row and the
/// old dead letter are deleted, and the run succeeds.
#[tokio::test]
async fn a_partition_the_server_refuses_to_drop_is_kept_and_the_run_goes_on() {
    let db = TestDb::new().await;
    day_partitioned(
        &db,
        &[
            ("outbox_viewed", "2020-01-01"),
            ("outbox_old", "2020-01-02"),
        ],
        true,
    )
    .await;
    db.client
        .batch_execute("CREATE VIEW outbox_viewed_count AS SELECT count(*) AS n FROM outbox_viewed")
        .await
        .unwrap();
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let config = parse(&toml);
    db.migrate(&config).await;
    // Before every partition: in the default one, sent long ago.
    let stray = Uuid::new_v4();
    insert_at(&db, stray, "2019-06-01 00:00:00+00")
        .await
        .unwrap();
    db.client
        .execute(
            "UPDATE outbox SET relay_sent_at = '2020-01-05 00:00:00+00' WHERE id = $1",
            &[&stray],
        )
        .await
        .unwrap();
    db.client
        .batch_execute(
            "INSERT INTO outbox_dead_letters (id, reason, attempts, first_failed_at, last_failed_at, resolution, resolved_at)
             VALUES ('resolved-old', 'refused', 5, now() - interval '90 days', now() - interval '90 days',
                     'dropped', now() - interval '31 days')",
        )
        .await
        .unwrap();

    let client = retention::connect(&config).await.unwrap();
    let report = retention::once(&client, &config, false)
        .await
        .expect("one partition's error does not fail the run");
    let p = report.partitions.clone().unwrap();
    let dropped: Vec<&str> = p.dropped.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(dropped, ["outbox_old"], "{report}");
    assert!(p.kept.is_empty(), "{report}");
    let [(name, why)] = p.failed.as_slice() else {
        panic!("one partition failed: {report}");
    };
    assert_eq!(name.name, "outbox_viewed");
    assert!(
        why.contains("outbox_viewed_count depends on")
            && why.contains("drop or change them, or drop the partition yourself"),
        "the error and the fix: {why}"
    );
    assert_eq!(report.outbox.rows(), 1, "{report}");
    assert_eq!(
        report.dead_letters,
        Cleanup::Done {
            rows: 1,
            batches: 1
        },
        "{report}"
    );
    let left = partitions_of(&db).await;
    assert!(
        left.contains(&"outbox_viewed".to_owned()) && !left.contains(&"outbox_old".to_owned()),
        "the refused partition is attached again: {left:?}"
    );
    assert_eq!(
        db.count("SELECT n FROM outbox_viewed_count").await,
        0,
        "the view still reads it"
    );
    // The command says so and succeeds.
    let path = config_file(&toml);
    let out = cli_says(
        &["retention", "--once", "--config", &path],
        0,
        &["kept public.outbox_viewed, which could not be dropped"],
    );
    assert!(out.contains("depends on"), "{out}");
}

/// Ranges due that the default partition holds rows of are reported
/// without asking for the outbox's lock: PostgreSQL would scan the default
/// partition under it, then refuse them. Here a writer holds the outbox, so
/// a try would wait for the lock and end the run's creations.
#[tokio::test]
async fn ranges_the_default_partition_holds_are_not_tried_under_the_lock() {
    let db = TestDb::new().await;
    day_partitioned(&db, &[], true).await;
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let config = parse(&set(&toml, "retention.partition_premake", "1"));
    db.migrate(&config).await;
    // Today and tomorrow have no partition: these rows wait in the default
    // (the day after too, in case midnight passes before retention looks).
    db.client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT gen_random_uuid(), 'order', 'o-1', 'Happened', '{}',
                    date_trunc('day', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' + d * interval '1 day'
             FROM generate_series(0, 2) d",
        )
        .await
        .unwrap();
    let writer = connect(&db.url).await;
    writer
        .batch_execute("BEGIN; LOCK TABLE outbox IN ROW EXCLUSIVE MODE")
        .await
        .unwrap();
    let client = outbox_relay::ops::retention::connect(&config)
        .await
        .unwrap();
    let report = outbox_relay::ops::retention::once(&client, &config, false)
        .await
        .unwrap();
    let p = report.partitions.clone().expect("a partition report");
    assert!(p.created.is_empty(), "{report}");
    assert!(
        p.problems.len() == 2
            && p.problems
                .iter()
                .all(|m| m.contains("default partition holds rows")),
        "both ranges, neither tried: {report}"
    );
    writer.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(partitions_of(&db).await.len(), 1, "the default only");
}
