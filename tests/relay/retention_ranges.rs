//! Retention with `relay.mark = "ranges"`, against real
//! PostgreSQL: rows recorded and folded before the cut-off go; rows unsent,
//! held open, committed after the frontier or recorded since stay; rows
//! marked by another mode before still go by their mark; the frontier's
//! history is pruned; locked rows are skipped; expired partitions go when
//! every row in them was sent before the cut-off.

use crate::retention::{client, count_of, outbox, rows};
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::ops::retention::{self, Cleanup};
use outbox_relay::outbox::progress::Ranges;
use outbox_relay::outbox::progress::fold::Advance;
use std::time::Duration;
use tokio_postgres::Client;

const RANGES: (&str, &str) = ("relay.mark", "\"ranges\"");

fn outbox_ranges() -> Ranges {
    Ranges::new(&TableName::new("public", "outbox"))
}

/// Inserts `n` rows of `aggregate_type` on `client` in one statement;
/// returns their `relay_seq`.
async fn insert(client: &Client, aggregate_type: &str, n: i32) -> Vec<i64> {
    client
        .query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), $1, g::text, 'Happened', '{}' FROM generate_series(1, $2) g
             RETURNING relay_seq",
            &[&aggregate_type, &n],
        )
        .await
        .expect("insert")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Inserts one row through the parent of a day-partitioned outbox, with
/// `created_at` at `day`; returns its `relay_seq`.
async fn insert_on(client: &Client, day: &str) -> i64 {
    client
        .query_one(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             VALUES (gen_random_uuid(), 'order', 'o-1', 'Happened', '{}', $1::text::timestamptz)
             RETURNING relay_seq",
            &[&day],
        )
        .await
        .unwrap()
        .get(0)
}

/// Records `seqs` as one confirmed batch, as the relay does.
async fn record(db: &TestDb, ranges: &Ranges, seqs: &[i64]) {
    ranges.record(&db.client, seqs).await.expect("record");
}

/// One round of the fold: a capture (waiting at most `settle`), then the
/// frontier moved to it.
async fn fold(fold: &mut Client, ranges: &Ranges, settle: Duration) -> Advance {
    let capture = ranges.capture(fold, settle).await.expect("capture");
    ranges
        .advance(fold, &capture, 1_000)
        .await
        .expect("advance")
}

async fn cleanup(toml: &str, window: &str, dry_run: bool) -> retention::Report {
    let config = parse(&set(toml, "retention.sent_window", window));
    let c = client(&config).await;
    retention::once(&c, &config, dry_run)
        .await
        .expect("cleanup")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_sent_before_the_frontier_of_the_cutoff_go_and_no_other() {
    let (db, toml) = outbox(&[RANGES]).await;
    let ranges = outbox_ranges();
    let mut folder = connect(&db.url).await;
    // Marked by `update` before the switch, 8 days ago.
    rows(&db, "legacy", 3, "30 days", Some("8 days")).await;
    let folded = insert(&db.client, "folded", 5).await;
    record(&db, &ranges, &folded).await;
    // Committed, never confirmed: the fold holds them open.
    insert(&db.client, "held", 2).await;
    // Open across the fold: not visible in its frontier.
    let late = connect(&db.url).await;
    late.batch_execute("BEGIN").await.unwrap();
    let late_seqs = insert(&late, "late", 1).await;
    let advanced = fold(&mut folder, &ranges, Duration::from_millis(200)).await;
    assert!(
        matches!(advanced, Advance::Advanced { held: 2, .. }),
        "{advanced:?}"
    );
    late.batch_execute("COMMIT").await.unwrap();
    let recent = insert(&db.client, "recent", 2).await;
    record(&db, &ranges, &recent).await;
    record(&db, &ranges, &late_seqs).await;

    // No frontier is an hour old: only the row marked 8 days ago goes.
    let report = cleanup(&toml, "\"1h\"", true).await;
    assert_eq!(report.outbox.rows(), 3, "{report}");
    let report = cleanup(&toml, "\"1h\"", false).await;
    assert_eq!(report.outbox.rows(), 3, "{report}");
    assert_eq!(count_of(&db, "legacy").await, 0);
    assert_eq!(count_of(&db, "folded").await, 5);

    // With no window, the frontier is the one of the cut-off: what it
    // covers goes; the held rows, the late row and the recent ones stay,
    // although the late and recent rows are recorded.
    for dry_run in [true, false] {
        let report = cleanup(&toml, "\"0s\"", dry_run).await;
        let done = Cleanup::Done {
            rows: 5,
            batches: 1,
        };
        assert_eq!(report.outbox, done, "dry run {dry_run}: {report}");
        let left = if dry_run { 5 } else { 0 };
        assert_eq!(count_of(&db, "folded").await, left, "dry run {dry_run}");
    }
    for (kind, n) in [("folded", 0), ("held", 2), ("late", 1), ("recent", 2)] {
        assert_eq!(count_of(&db, kind).await, n, "{kind}");
    }
    assert_eq!(
        db.count(&ranges.read_sql("relay_seq", "").backlog).await,
        2,
        "the held rows are still unsent"
    );

    // The held rows are confirmed; a later frontier (a new history row)
    // covers everything, and the older history goes.
    let held = crate::marking_ranges::seqs(
        &db.client,
        "SELECT relay_seq FROM outbox WHERE aggregate_type = 'held'",
        &[],
    )
    .await;
    record(&db, &ranges, &held).await;
    let f = ranges.frontier.quoted();
    db.client
        .execute(
            &format!("UPDATE {f} SET folded_at = folded_at - interval '2 minutes'"),
            &[],
        )
        .await
        .unwrap();
    let advanced = fold(&mut folder, &ranges, Duration::from_secs(5)).await;
    assert!(
        matches!(advanced, Advance::Advanced { closed: 2, .. }),
        "{advanced:?}"
    );
    assert_eq!(db.count(&format!("SELECT count(*) FROM {f}")).await, 2);
    let report = cleanup(&toml, "\"0s\"", false).await;
    assert_eq!(report.outbox.rows(), 5, "{report}");
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
    assert_eq!(
        db.count(&format!("SELECT count(*) FROM {f}")).await,
        1,
        "the history before the cut-off's frontier is pruned"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recorded_rows_go_in_batches_around_a_locked_row() {
    let (db, toml) = outbox(&[RANGES, ("retention.batch_size", "1000")]).await;
    let ranges = outbox_ranges();
    let mut folder = connect(&db.url).await;
    let mut seqs = Vec::new();
    for _ in 0..5 {
        seqs.extend(insert(&db.client, "many", 500).await);
    }
    record(&db, &ranges, &seqs).await;
    let advanced = fold(&mut folder, &ranges, Duration::from_secs(5)).await;
    assert!(
        matches!(advanced, Advance::Advanced { held: 0, .. }),
        "{advanced:?}"
    );
    let locker = connect(&db.url).await;
    locker.batch_execute("BEGIN").await.unwrap();
    locker
        .execute(
            "SELECT 1 FROM outbox WHERE relay_seq = $1 FOR UPDATE",
            &[&seqs[1_700]],
        )
        .await
        .unwrap();
    let report = cleanup(&toml, "\"0s\"", false).await;
    assert_eq!(
        report.outbox,
        Cleanup::Done {
            rows: 2_499,
            batches: 3
        },
        "{report}"
    );
    locker.batch_execute("COMMIT").await.unwrap();
    let report = cleanup(&toml, "\"0s\"", false).await;
    assert_eq!(report.outbox.rows(), 1, "{report}");
    assert_eq!(count_of(&db, "many").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_partition_goes_once_every_row_in_it_was_sent_before_the_cutoff() {
    let db = TestDb::new().await;
    crate::partitions::day_partitioned(
        &db,
        &[
            ("outbox_sent", "2020-01-01"),
            ("outbox_unsent", "2020-01-02"),
        ],
        false,
    )
    .await;
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "retention.mode",
        "\"partitions\"",
    );
    let toml = set(
        &set(&toml, RANGES.0, RANGES.1),
        "retention.sent_window",
        "\"0s\"",
    );
    let config = parse(&toml);
    db.migrate(&config).await;
    let ranges = outbox_ranges();
    let mut folder = connect(&db.url).await;
    let sent = insert_on(&db.client, "2020-01-01 12:00:00+00").await;
    let unsent = insert_on(&db.client, "2020-01-02 12:00:00+00").await;
    record(&db, &ranges, &[sent]).await;
    fold(&mut folder, &ranges, Duration::from_secs(5)).await;
    let c = client(&config).await;
    let report = retention::once(&c, &config, false).await.unwrap();
    let p = report.partitions.clone().expect("a partition report");
    let dropped: Vec<&str> = p.dropped.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(dropped, ["outbox_sent"], "{report}");
    assert!(
        p.kept.len() == 1 && p.kept[0].0.name == "outbox_unsent" && p.kept[0].1.contains("unsent"),
        "{report}"
    );
    // Recorded, not yet folded: sent, but not before the cut-off's frontier.
    record(&db, &ranges, &[unsent]).await;
    let report = retention::once(&c, &config, false).await.unwrap();
    let p = report.partitions.clone().unwrap();
    assert!(
        p.dropped.is_empty() && p.kept[0].1.contains("after the retention cutoff"),
        "{report}"
    );
    // The frontier so far becomes history: the next fold adds a row.
    let f = ranges.frontier.quoted();
    db.client
        .execute(
            &format!("UPDATE {f} SET folded_at = folded_at - interval '1 minute'"),
            &[],
        )
        .await
        .unwrap();
    fold(&mut folder, &ranges, Duration::from_secs(5)).await;
    assert_eq!(db.count(&format!("SELECT count(*) FROM {f}")).await, 2);
    let report = retention::once(&c, &config, false).await.unwrap();
    assert_eq!(
        db.count(&format!("SELECT count(*) FROM {f}")).await,
        1,
        "partitions mode prunes the history too"
    );
    let dropped: Vec<String> = report
        .partitions
        .unwrap()
        .dropped
        .iter()
        .map(|t| t.name.clone())
        .collect();
    assert_eq!(dropped, ["outbox_unsent"]);
    // A ranges table gone (the outbox migrated for another mode): the
    // error says what to run.
    db.client
        .batch_execute(&format!(
            "CREATE TABLE outbox_later PARTITION OF outbox
                 FOR VALUES FROM ('2020-01-03 00:00:00+00') TO ('2020-01-04 00:00:00+00');
             DROP TABLE {}",
            ranges.held.quoted()
        ))
        .await
        .unwrap();
    insert_on(&db.client, "2020-01-03 12:00:00+00").await;
    let err = retention::once(&c, &config, false)
        .await
        .expect_err("the held table is gone")
        .to_string();
    assert!(
        err.contains("outbox_relay_held") && err.contains("run outbox-relay migrate"),
        "{err}"
    );
}

/// On a partitioned outbox a `ctid` names a row only within its partition,
/// so a batch may also delete another partition's row at the same `ctid`,
/// of a later transaction. The next batch starts after the rows the batch
/// picked, not after that row: the rows between still go in the same run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_on_a_partitioned_outbox_pass_no_row() {
    let db = TestDb::new().await;
    crate::partitions::day_partitioned(
        &db,
        &[("outbox_a", "2020-01-01"), ("outbox_b", "2020-01-02")],
        false,
    )
    .await;
    let toml = set(&base_toml(&db.url, &rabbit_sink()), RANGES.0, RANGES.1);
    let toml = set(&toml, "retention.batch_size", "1");
    let config = parse(&toml);
    db.migrate(&config).await;
    // The oldest transaction writes outbox_a's first row; the newest
    // outbox_b's first row, at the same ctid; the one between them commits
    // last, into outbox_b's second row.
    let oldest = insert_on(&db.client, "2020-01-01 12:00:00+00").await;
    let between = connect(&db.url).await;
    between
        .batch_execute("BEGIN; SELECT txid_current();")
        .await
        .unwrap();
    let newest = insert_on(&db.client, "2020-01-02 12:00:00+00").await;
    let middle = insert_on(&between, "2020-01-02 12:00:00+00").await;
    between.batch_execute("COMMIT").await.unwrap();
    let same_ctid = db
        .count("SELECT count(*) FROM outbox WHERE ctid = '(0,1)'")
        .await;
    assert_eq!(same_ctid, 2, "both partitions' first rows at (0,1)");
    let ranges = outbox_ranges();
    record(&db, &ranges, &[oldest, newest, middle]).await;
    let mut folder = connect(&db.url).await;
    fold(&mut folder, &ranges, Duration::from_secs(5)).await;
    let report = cleanup(&toml, "\"0s\"", false).await;
    assert_eq!(report.outbox.rows(), 3, "{report}");
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 0);
}

/// The scans of `relation` in a JSON plan.
fn scans_of(plan: &serde_json::Value, relation: &str, found: &mut Vec<String>) {
    match plan {
        serde_json::Value::Object(node) => {
            if node.get("Relation Name").and_then(|r| r.as_str()) == Some(relation) {
                let kind = node["Node Type"].as_str().unwrap_or_default();
                found.push(kind.to_owned());
            }
            node.values().for_each(|v| scans_of(v, relation, found));
        }
        serde_json::Value::Array(items) => items.iter().for_each(|v| scans_of(v, relation, found)),
        _ => {}
    }
}

/// The drop's second look at an expired partition runs under the outbox's
/// lock, which holds the application's inserts: it reads only the rows the
/// first look could not see (`relay_xid` at or above that look's xmin),
/// through the `relay_xid` index, not the whole partition.
#[tokio::test]
async fn the_look_under_the_lock_reads_only_what_the_first_could_not_see() {
    let db = TestDb::new().await;
    crate::partitions::day_partitioned(&db, &[("outbox_sent", "2020-01-01")], false).await;
    let toml = set(
        &set(
            &base_toml(&db.url, &rabbit_sink()),
            "retention.mode",
            "\"partitions\"",
        ),
        RANGES.0,
        RANGES.1,
    );
    db.migrate(&parse(&toml)).await;
    let seqs: Vec<i64> = db
        .client
        .query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
             SELECT gen_random_uuid(), 'order', g::text, 'Happened', '{}', '2020-01-01 12:00:00+00'
             FROM generate_series(1, 20000) g RETURNING relay_seq",
            &[],
        )
        .await
        .expect("rows of 2020-01-01")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let ranges = outbox_ranges();
    record(&db, &ranges, &seqs).await;
    let mut folder = connect(&db.url).await;
    fold(&mut folder, &ranges, Duration::from_secs(5)).await;
    db.client
        .batch_execute("ANALYZE outbox_sent")
        .await
        .unwrap();
    let partition = TableName::new("public", "outbox_sent");
    let xmin: String = db
        .client
        .query_one("SELECT pg_snapshot_xmin(pg_current_snapshot())::text", &[])
        .await
        .unwrap()
        .get(0);
    let cutoff = chrono::Utc::now();
    let plan = |since: bool| {
        let sql = format!(
            "EXPLAIN (FORMAT JSON) {}",
            ranges.partition_keep_sql(&partition, since)
        );
        let (c, xmin) = (&db.client, xmin.clone());
        async move {
            let row = match since {
                true => c.query_one(&sql, &[&cutoff, &xmin]).await,
                false => c.query_one(&sql, &[&cutoff]).await,
            };
            let plan: serde_json::Value = row.expect("explain").get(0);
            let mut scans = Vec::new();
            scans_of(&plan, "outbox_sent", &mut scans);
            scans
        }
    };
    let first = plan(false).await;
    assert!(
        first.iter().any(|s| s == "Seq Scan"),
        "the first look reads it all: {first:?}"
    );
    let again = plan(true).await;
    assert!(
        !again.is_empty() && again.iter().all(|s| s.contains("Index")),
        "under the lock, the relay_xid index: {again:?}"
    );

    // A row of a transaction still open at the first look, committed
    // before the second: the first look cannot see it, the second must.
    let writer = connect(&db.url).await;
    writer.batch_execute("BEGIN").await.unwrap();
    insert_on(&writer, "2020-01-01 18:00:00+00").await;
    let first = db
        .client
        .query_one(&ranges.partition_keep_sql(&partition, false), &[&cutoff])
        .await
        .expect("the first look");
    let (unsent, late): (bool, bool) = (first.get(0), first.get(1));
    assert!(
        !unsent && !late,
        "the open transaction's row is not seen yet"
    );
    let xmin: String = first.get(2);
    writer.batch_execute("COMMIT").await.unwrap();
    let second = db
        .client
        .query_one(
            &ranges.partition_keep_sql(&partition, true),
            &[&cutoff, &xmin],
        )
        .await
        .expect("the look under the lock");
    assert!(
        second.get::<_, bool>(0),
        "the committed row is unsent, and keeps the partition"
    );
}
