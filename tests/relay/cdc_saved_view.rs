//! CDC with `relay.mark = "update"` after a clean stop: the next start reads
//! from the table only what the slot cannot deliver, by the view the stop
//! saved in `<outbox>_relay_slots`, and the stream delivers the backlog
//! committed meanwhile, once each and in commit order. A slot moved past
//! that view, or rows marked since it was saved, make the start read every
//! unsent row instead.

use crate::cdc::cdc_toml;
use crate::cdc_backlog::backlog;
use crate::support::brokers::{RabbitExchange, Received};
use crate::support::*;
use std::time::Duration;

/// The relay streams a few events, stops cleanly, and leaves a saved view.
async fn stopped_after_a_run() -> (TestDb, RabbitExchange, String, Vec<String>) {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    db.migrate(&parse(&toml)).await;
    let mut relay = ChildRelay::start(&toml);
    let first = backlog(&db, 5, 1).await;
    broker.inbox.wait_ids(&first, WAIT).await;
    db.wait_all_marked().await;
    assert!(relay.terminate().success(), "a clean stop");
    assert_eq!(
        saved_views(&db, &slot_of(&toml)).await,
        1,
        "the stop saved a view"
    );
    (db, broker, toml, first)
}

async fn saved_views(db: &TestDb, slot: &str) -> i64 {
    db.client
        .query_one(
            "SELECT count(*) FROM outbox_relay_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0)
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
    assert_eq!(
        saved_views(&db, &slot_of(&toml)).await,
        0,
        "the start took the view"
    );
    db.wait_all_marked().await;
    assert!(relay.terminate().success());
    assert_eq!(
        saved_views(&db, &slot_of(&toml)).await,
        1,
        "and the stop saved one"
    );
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
    let mut relay = ChildRelay::start(&toml);
    exactly(&broker, &[first, later].concat()).await;
    assert!(relay.terminate().success());
}

/// Rows marked sent while the relay is stopped (as a polling relay run in
/// between would, or an operator) stay unpublished, as with every start
/// that reads all unsent rows, though the slot still holds their inserts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_marked_while_the_relay_was_stopped_are_not_published() {
    let (db, broker, toml, first) = stopped_after_a_run().await;
    let later = backlog(&db, 100, 10).await;
    let (marked, unmarked) = later.split_at(50);
    db.client
        .execute(
            "UPDATE outbox SET relay_sent_at = now() WHERE id::text = ANY($1)",
            &[&marked],
        )
        .await
        .unwrap();
    let mut relay = ChildRelay::start(&toml);
    exactly(&broker, &[first.as_slice(), unmarked].concat()).await;
    assert!(relay.terminate().success());
}
