//! The check that streamed transactions are visible before their rows are
//! marked (CDC with `relay.mark` `update` or `delete`), run against
//! snapshots near an epoch boundary of transaction ids.

use crate::support::*;

/// How many of `xids` (32-bit, as pgoutput sends them) the visibility check
/// counts as running under `snapshot` instead of the server's current one.
async fn running_under(db: &TestDb, snapshot: &str, xids: &[u32]) -> i64 {
    let sql = outbox_relay::source::record::IN_PROGRESS_SQL.replace(
        "txid_current_snapshot()",
        &format!("'{snapshot}'::txid_snapshot"),
    );
    let xids: Vec<i64> = xids.iter().map(|&x| i64::from(x)).collect();
    db.client
        .query_one(&sql, &[&xids])
        .await
        .expect("the visibility check runs")
        .get(0)
}

/// The check that streamed transactions are visible before their rows are
/// marked widens each 32-bit id to the one nearest the snapshot's `xmax`,
/// across an epoch boundary either way: a commit decoded before its
/// session left the process array, with an id in the next epoch, is still
/// running, not long finished.
#[tokio::test]
async fn the_visibility_check_widens_ids_across_an_epoch_either_way() {
    let db = TestDb::new().await;
    let epoch = 1u64 << 32;
    // xmax 16 ids before the end of epoch 1.
    let end = 2 * epoch - 16;
    let near_end = format!("{end}:{end}:");
    assert_eq!(
        running_under(&db, &near_end, &[3]).await,
        1,
        "epoch 2's id 3"
    );
    assert_eq!(
        running_under(&db, &near_end, &[(end - 5) as u32]).await,
        0,
        "an id just before xmax finished"
    );
    // xmax 5 ids into epoch 2.
    let start = 2 * epoch + 5;
    let near_start = format!("{}:{start}:{}", start - 2, start - 2);
    assert_eq!(
        running_under(&db, &near_start, &[u32::MAX - 2]).await,
        0,
        "epoch 1's id finished"
    );
    assert_eq!(
        running_under(&db, &near_start, &[(start - 2) as u32, 7]).await,
        2,
        "one in progress, one past xmax"
    );
}
