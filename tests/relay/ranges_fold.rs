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
