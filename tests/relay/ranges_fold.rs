//! The fold (`outbox::progress::fold`) against real PostgreSQL, in the
//! cases the random histories of `ranges_histories.rs` reach only by chance:
//! a capture older than the frontier, and a long transaction that keeps
//! every capture from settling.

use crate::marking_ranges::{INSERT, brute_force, outbox_with_ranges, record_open, seqs};
use crate::support::*;
use outbox_relay::outbox::progress::fold::Advance;
use std::time::Duration;

#[tokio::test]
async fn a_capture_older_than_the_frontier_is_refused() {
    let db = TestDb::new().await;
    let ranges = outbox_with_ranges(&db).await;
    let mut fold = connect(&db.url).await;
    let older = ranges.capture(&fold, Duration::from_secs(2)).await.unwrap();
    db.client.batch_execute(INSERT).await.unwrap();
    let newer = ranges.capture(&fold, Duration::from_secs(2)).await.unwrap();
    assert!(newer.settled && older.settled);
    let advanced = ranges.advance(&mut fold, &newer, 10).await.unwrap();
    assert!(
        matches!(advanced, Advance::Advanced { held: 1, .. }),
        "{advanced:?}"
    );
    // Moving back would make the row the newer frontier held open look
    // as if no frontier had passed it, and the one it covers unseen.
    assert_eq!(
        ranges.advance(&mut fold, &older, 10).await.unwrap(),
        Advance::Stale
    );
    assert_eq!(brute_force(&db.client, &ranges, None).await, vec![1]);
}

/// A long transaction elsewhere keeps every capture from settling: the fold
/// still deletes the progress rows whose rows are all visible in its
/// capture, and keeps one recorded ahead of its transaction's commit until
/// a capture sees it.
#[tokio::test]
async fn a_long_transaction_leaves_only_the_progress_rows_not_yet_visible() {
    let db = TestDb::new().await;
    let ranges = outbox_with_ranges(&db).await;
    let mut fold = connect(&db.url).await;
    let long = connect(&db.url).await;
    long.batch_execute("BEGIN; SELECT pg_current_xact_id()")
        .await
        .unwrap();
    for _ in 0..3 {
        db.client.batch_execute(INSERT).await.unwrap();
    }
    let committed = seqs(&db.client, "SELECT relay_seq FROM outbox", &[]).await;
    ranges.record(&db.client, &committed).await.unwrap();
    // Recorded ahead of its commit, as CDC may.
    let late = connect(&db.url).await;
    late.batch_execute("BEGIN").await.unwrap();
    late.batch_execute(INSERT).await.unwrap();
    record_open(&db.client, &late, &ranges).await;
    let progress = format!("SELECT count(*) FROM {}", ranges.progress.quoted());
    let first = ranges
        .capture(&fold, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(
        !first.settled,
        "the long transaction keeps it from settling"
    );
    let advanced = ranges.advance(&mut fold, &first, 100).await.unwrap();
    assert!(
        matches!(advanced, Advance::Advanced { deleted: 1, .. }),
        "{advanced:?}"
    );
    assert_eq!(db.count(&progress).await, 1, "the late row's stays");
    late.batch_execute("COMMIT").await.unwrap();
    let second = ranges
        .capture(&fold, Duration::from_millis(200))
        .await
        .unwrap();
    assert!(!second.settled);
    let advanced = ranges.advance(&mut fold, &second, 100).await.unwrap();
    assert!(
        matches!(
            advanced,
            Advance::Advanced {
                deleted: 1,
                held: 0,
                ..
            }
        ),
        "{advanced:?}"
    );
    assert_eq!(db.count(&progress).await, 0);
    assert!(brute_force(&db.client, &ranges, None).await.is_empty());
    let last: Option<chrono::DateTime<chrono::Utc>> = db
        .client
        .query_one(&ranges.last_recorded_sql(), &[])
        .await
        .unwrap()
        .get(0);
    assert!(
        last.is_some(),
        "the frontier keeps when the deleted batches were recorded"
    );
    long.batch_execute("ROLLBACK").await.unwrap();
}

/// Rows held back for good (a dead aggregate's followers that wait): more
/// than a drain's limit keep every round from moving the frontier, and the
/// progress rows of everything recorded since stay. Once rounds have found
/// them for `stuck_after`, the relay's limit is the larger one: the
/// frontier passes them, holds them open (still unsent), and deletes the
/// progress rows; once they are recorded, a round closes them.
#[tokio::test]
async fn rows_held_back_for_good_are_held_open_and_the_frontier_moves() {
    use outbox_relay::outbox::progress::fold::HoldLimits;
    let limits = HoldLimits::RELAY;
    let stuck = limits.drain as i64 + 100;
    let db = TestDb::new().await;
    let ranges = outbox_with_ranges(&db).await;
    let mut fold = connect(&db.url).await;
    db.client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'dead', 'created', '{{}}' FROM generate_series(1, {stuck})"
        ))
        .await
        .unwrap();
    // Other aggregates' events go on, and are recorded.
    db.client.batch_execute(INSERT).await.unwrap();
    let others = seqs(
        &db.client,
        "SELECT relay_seq FROM outbox WHERE aggregate_id <> 'dead'",
        &[],
    )
    .await;
    ranges.record(&db.client, &others).await.unwrap();
    let capture = ranges.capture(&fold, Duration::from_secs(2)).await.unwrap();

    let drain = ranges
        .advance(&mut fold, &capture, limits.drain as i64)
        .await
        .unwrap();
    assert_eq!(drain, Advance::Backlog);
    let now = tokio::time::Instant::now();
    assert_eq!(limits.at(None, now), limits.drain);
    assert_eq!(limits.at(Some(now), now), limits.drain, "a drain, so far");
    let since = now - limits.stuck_after;
    assert_eq!(limits.at(Some(since), now), limits.stuck);
    let advanced = ranges
        .advance(&mut fold, &capture, limits.at(Some(since), now) as i64)
        .await
        .unwrap();
    assert!(
        matches!(advanced, Advance::Advanced { held, .. } if held == stuck as u64),
        "{advanced:?}"
    );
    let progress = format!("SELECT count(*) FROM {}", ranges.progress.quoted());
    if let Advance::Advanced { settled: true, .. } = advanced {
        assert_eq!(
            db.count(&progress).await,
            0,
            "the others' progress row folded"
        );
    }
    // Held open, they are what a first read still finds unsent.
    let unsent = brute_force(&db.client, &ranges, None).await;
    assert_eq!(unsent.len() as i64, stuck);
    assert!(!unsent.iter().any(|s| others.contains(s)));

    // Redriven at last: recorded, and the next round closes them.
    ranges.record(&db.client, &unsent).await.unwrap();
    let next = ranges.capture(&fold, Duration::from_secs(2)).await.unwrap();
    let closed = ranges
        .advance(&mut fold, &next, limits.drain as i64)
        .await
        .unwrap();
    assert!(
        matches!(closed, Advance::Advanced { held: 0, closed, .. } if closed == stuck as u64),
        "{closed:?}"
    );
    assert!(brute_force(&db.client, &ranges, None).await.is_empty());
}
