//! CDC with `relay.mark = "ranges"` after a clean stop, or on the first
//! start after `migrate` made the slot: the start reads from the table only
//! what the slot cannot deliver, by the view saved in
//! `<outbox>_relay_slots`, and the stream delivers the backlog committed
//! since, once each and in commit order. A slot moved past that view, or
//! rows recorded or marked sent since it was saved, make the start read
//! every unsent row instead.

use crate::cdc::cdc_toml;
use crate::cdc_backlog::backlog;
use crate::support::brokers::{RabbitExchange, Received};
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::outbox::progress::Ranges;
use std::time::Duration;

fn ranges_toml(db: &TestDb, broker: &RabbitExchange) -> String {
    set(
        &cdc_toml(&db.url, &broker.sink_toml()),
        "relay.mark",
        "\"ranges\"",
    )
}

async fn saved_views(db: &TestDb) -> i64 {
    db.count("SELECT count(*) FROM outbox_relay_slots").await
}

async fn wait_all_sent(db: &TestDb) {
    wait_for(WAIT, "every row recorded as sent", || async {
        (crate::ranges_downgrade::unsent(db).await == 0).then_some(())
    })
    .await;
}

/// The relay streams a few events, stops cleanly, and leaves a saved view.
async fn stopped_after_a_run() -> (TestDb, RabbitExchange, String, Vec<String>) {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = ranges_toml(&db, &broker);
    db.migrate(&parse(&toml)).await;
    let mut relay = ChildRelay::start(&toml);
    let first = backlog(&db, 5, 1).await;
    broker.inbox.wait_ids(&first, WAIT).await;
    wait_all_sent(&db).await;
    assert!(relay.terminate().success(), "a clean stop");
    assert_eq!(saved_views(&db).await, 1, "the stop saved a view");
    (db, broker, toml, first)
}

/// Waits for `expected` and checks that nothing else, and nothing twice, arrived.
async fn exactly(broker: &RabbitExchange, expected: &[String]) {
    broker
        .inbox
        .wait_ids(expected, Duration::from_secs(120))
        .await;
    // A little longer, for anything that should not come.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got: Vec<String> = broker
        .inbox
        .snapshot()
        .iter()
        .map(Received::event_id)
        .collect();
    assert_eq!(got, expected, "once each, in commit order, nothing else");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_clean_stop_the_backlog_comes_from_the_stream() {
    let (db, broker, toml, first) = stopped_after_a_run().await;
    let later = backlog(&db, 2_000, 10).await;
    let mut relay = ChildRelay::start_logged(&toml);
    exactly(&broker, &[first, later].concat()).await;
    assert!(
        relay.logged("start-up read of unsent rows done rows=0 reads=1"),
        "the start-up read handed over nothing: the slot delivered the backlog"
    );
    assert_eq!(saved_views(&db).await, 0, "the start took the view");
    wait_all_sent(&db).await;
    assert!(relay.terminate().success());
    assert_eq!(saved_views(&db).await, 1, "and the stop saved one");
}

/// `migrate` made the slot after rows were committed (the outbox was first
/// migrated for polling): the first start reads those from the table and
/// leaves the ones committed after the slot to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_start_after_migrate_reads_only_the_rows_from_before_the_slot() {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let polling = set(
        &base_toml(&db.url, &broker.sink_toml()),
        "relay.mark",
        "\"ranges\"",
    );
    db.migrate(&parse(&polling)).await;
    assert_eq!(saved_views(&db).await, 0, "no slot, no view");
    let before = backlog(&db, 20, 5).await;
    let toml = ranges_toml(&db, &broker);
    db.migrate(&parse(&toml)).await;
    assert_eq!(
        saved_views(&db).await,
        1,
        "migrate saved the slot's first view"
    );
    let after = backlog(&db, 1_000, 10).await;
    let mut relay = ChildRelay::start_logged(&toml);
    exactly(&broker, &[before, after].concat()).await;
    assert!(
        relay.logged("start-up read of unsent rows done rows=20 reads=1"),
        "the read handed over the rows from before the slot, and only those"
    );
    assert!(relay.terminate().success());
}

/// The slot is moved past the backlog while the relay is stopped (the view
/// saved at the stop does not see it): the start reads it from the table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_moved_past_the_saved_view_makes_the_start_read_every_unsent_row() {
    let (db, broker, toml, first) = stopped_after_a_run().await;
    let later = backlog(&db, 200, 10).await;
    db.client
        .execute(
            "SELECT pg_replication_slot_advance($1, pg_current_wal_insert_lsn())",
            &[&slot_of(&toml)],
        )
        .await
        .unwrap();
    let mut relay = ChildRelay::start_logged(&toml);
    exactly(&broker, &[first, later].concat()).await;
    assert!(relay.logged("rows=200"), "the read handed the backlog over");
    assert!(relay.terminate().success());
}

/// Rows recorded or marked sent while the relay is stopped (as another
/// relay run in between would, or an operator) stay unpublished, as with
/// every start that reads all unsent rows, though the slot still holds
/// their inserts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_recorded_or_marked_while_the_relay_was_stopped_are_not_published() {
    let (db, broker, toml, first) = stopped_after_a_run().await;
    let later = backlog(&db, 100, 10).await;
    let seqs: Vec<i64> = db
        .client
        .query(
            "SELECT relay_seq FROM outbox WHERE id::text = ANY($1) ORDER BY relay_seq",
            &[&later],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    ranges.record(&db.client, &seqs[..30]).await.unwrap();
    db.client
        .execute(
            "UPDATE outbox SET relay_sent_at = now() WHERE relay_seq = ANY($1)",
            &[&seqs[30..50].to_vec()],
        )
        .await
        .unwrap();
    let mut relay = ChildRelay::start(&toml);
    exactly(&broker, &[first.as_slice(), &later[50..]].concat()).await;
    assert!(relay.terminate().success());
}
