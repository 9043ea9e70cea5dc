//! CDC with a backlog at start-up: the slot skips what the start-up read
//! publishes instead of decoding it again, a transaction open across the
//! start is published from the stream, events committed during a long
//! start-up read come from further reads of the table, and marking waits
//! until a streamed transaction is visible to the table's readers.

use crate::cdc::{cdc_toml, flushed};
use crate::support::brokers::{RabbitExchange, Received};
use crate::support::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marking_waits_until_a_streamed_transaction_is_visible() {
    use outbox_relay::config::MarkMode;
    use outbox_relay::source::record::{RowRecorder, RowStore};
    let db = TestDb::new().await;
    let toml = base_toml(
        &db.url,
        "[sink]\ntype = \"rabbitmq\"\nurl = \"amqp://127.0.0.1\"\nexchange = \"x\"\n",
    );
    let config = parse(&toml);
    db.migrate(&config).await;
    // A transaction that is still running stands in for a commit that
    // decoding has seen and other sessions not yet.
    let other = connect(&db.url).await;
    other.batch_execute("BEGIN").await.unwrap();
    let xid: i64 = other
        .query_one("SELECT txid_current() % 4294967296", &[])
        .await
        .unwrap()
        .get(0);
    let recorder = RowRecorder::new(
        connect(&db.url).await,
        &config.outbox.table,
        MarkMode::Update,
        None,
        false,
    )
    .await
    .unwrap();
    let xid = u32::try_from(xid).unwrap();
    let waiting = tokio::spawn(async move { recorder.wait_visible(vec![xid]).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !waiting.is_finished(),
        "does not go on while the transaction runs"
    );
    other.batch_execute("COMMIT").await.unwrap();
    tokio::time::timeout(WAIT, waiting)
        .await
        .expect("goes on once it is visible")
        .unwrap()
        .unwrap();
}

/// Commits `n` events of aggregate `agg` in transactions of `per_tx`; returns their ids in order.
async fn backlog(db: &TestDb, n: i64, per_tx: i64) -> Vec<String> {
    let mut ids = Vec::new();
    for start in (0..n).step_by(per_tx as usize) {
        let rows = db
            .client
            .query(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                 SELECT gen_random_uuid(), 'order', 'agg', 'Placed', jsonb_build_object('n', g)
                 FROM generate_series($1::bigint, $2::bigint) g ORDER BY g RETURNING id::text",
                &[&start, &(start + per_tx - 1).min(n - 1)],
            )
            .await
            .unwrap();
        ids.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    }
    ids
}

/// Inserts one event in a transaction left open on `other`; returns its id.
async fn open_insert(other: &tokio_postgres::Client) -> String {
    other.batch_execute("BEGIN").await.unwrap();
    other
        .query_one(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'order', 'straddler', 'Placed', '{}') RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .get(0)
}

/// After a backlog, the slot is moved past the WAL the start-up read
/// covers while the backlog is published (instead of being decoded again
/// once it is done): its confirmed position passes the backlog while rows
/// are still unsent. A transaction running across the start, committed
/// while the relay waits for it, is published from the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_skips_a_backlog_while_it_is_published() {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = set(
        &cdc_toml(&db.url, &broker.sink_toml()),
        "relay.max_in_flight",
        "500",
    );
    let slot = slot_of(&toml);
    db.migrate(&parse(&toml)).await;
    let early = backlog(&db, 2_000, 10).await;
    let backlog_end = wal_insert_position(&db.client).await;
    let other = connect(&db.url).await;
    let straddler = open_insert(&other).await;
    let relay = InProcess::start(parse(&toml));
    tokio::time::sleep(Duration::from_millis(300)).await;
    other.batch_execute("COMMIT").await.unwrap();
    wait_for(WAIT, "the slot to pass the backlog", || async {
        (flushed(&db.client, slot.clone()).await >= backlog_end).then_some(())
    })
    .await;
    assert!(
        db.unsent().await > 0,
        "the slot passed the backlog before it was published, not after"
    );
    let late = backlog(&db, 10, 1).await;
    let mut all = early.clone();
    all.push(straddler.clone());
    all.extend(late.iter().cloned());
    let got = broker.inbox.wait_ids(&all, Duration::from_secs(120)).await;
    let order: Vec<String> = got
        .iter()
        .map(Received::event_id)
        .filter(|id| *id != straddler)
        .collect();
    assert_eq!(order, [early, late].concat(), "once each, in commit order");
    assert_eq!(got.len(), all.len(), "no duplicates");
    relay.stop().await;
}

/// After a backlog, decoding the slot starts again after it: each move of
/// the slot, and the stream that follows, would otherwise decode the whole
/// backlog again, for as long as the server writes no new restart point
/// (every 15 seconds at most). The temporary slot that writes one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_backlog_the_slot_restarts_after_it() {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let slot = slot_of(&toml);
    db.migrate(&parse(&toml)).await;
    let early = backlog(&db, 2_000, 20).await;
    let backlog_end = wal_insert_position(&db.client).await;
    assert!(restart_position(&db.client, &slot).await < backlog_end);
    let relay = InProcess::start(parse(&toml));
    broker.inbox.wait_ids(&early, WAIT).await;
    db.wait_all_marked().await;
    // Well within the server's own 15 seconds.
    wait_for(
        Duration::from_secs(3),
        "the slot to restart after the backlog",
        || async { (restart_position(&db.client, &slot).await >= backlog_end).then_some(()) },
    )
    .await;
    assert_eq!(
        slots_named(&db.client, &slot).await,
        std::slice::from_ref(&slot),
        "no temporary slot is left"
    );
    relay.stop().await;
}

/// Writing a restart point needs a free slot. On a server with none, the
/// relay goes on without it: every event of a backlog and after it, once
/// each, in commit order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_free_slot_the_backlog_is_published_all_the_same() {
    let pg = crate::kit::cluster::PrivatePg::start(&[
        "wal_level = logical",
        "max_replication_slots = 1",
    ]);
    let db = TestDb::new_on(&pg.url("postgres")).await;
    let broker = RabbitExchange::new().await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let slot = slot_of(&toml);
    migrate_at(&db.url, &parse(&toml)).await;
    let early = backlog(&db, 1_200, 20).await;
    let relay = InProcess::start(parse(&toml));
    broker.inbox.wait_ids(&early, WAIT).await;
    wait_streaming(&db.client, &slot).await;
    let late = backlog(&db, 10, 1).await;
    let all = [early, late].concat();
    let got = broker.inbox.wait_ids(&all, WAIT).await;
    let order: Vec<String> = got.iter().map(Received::event_id).collect();
    assert_eq!(order, all, "once each, in commit order");
    assert_eq!(
        slots_named(&db.client, "").await,
        [slot],
        "the only slot there is"
    );
    relay.stop().await;
}

/// A transaction that runs on for longer than the relay waits keeps the
/// slot where it is (the stream skips the backlog instead); its event is
/// published once it commits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_transaction_across_the_start_is_not_skipped() {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    db.migrate(&parse(&toml)).await;
    let early = backlog(&db, 200, 10).await;
    let other = connect(&db.url).await;
    let straddler = open_insert(&other).await;
    let relay = InProcess::start(parse(&toml));
    broker.inbox.wait_ids(&early, WAIT).await;
    // Past the relay's wait for running transactions.
    tokio::time::sleep(Duration::from_secs(3)).await;
    other.batch_execute("COMMIT").await.unwrap();
    let late = backlog(&db, 10, 1).await;
    let mut all = early.clone();
    all.push(straddler);
    all.extend(late.iter().cloned());
    let got = broker.inbox.wait_ids(&all, WAIT).await;
    assert_eq!(got.len(), all.len(), "every event once");
    relay.stop().await;
}

/// Events committed while a long start-up read is published come from
/// further reads of the table (a read of 1,000 rows or more is followed by
/// another), not from the stream behind the relay's own marking: each once,
/// in commit order, although the first read's rows are still unsent, in
/// flight or waiting behind their aggregate, when the next read starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_committed_during_the_start_up_read_come_once_in_order() {
    committed_during_the_start_up_read("update", "relay_sent_at IS NULL").await;
}

/// The same with ranges, where the stream takes over once the slot moved
/// past the backlog instead of after further reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_ranges_events_committed_during_the_start_up_read_come_once_in_order() {
    committed_during_the_start_up_read(
        "ranges",
        "NOT outbox_relay_sent(relay_seq, relay_xid, relay_sent_at)",
    )
    .await;
}

async fn committed_during_the_start_up_read(mark: &str, unsent: &str) {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = set(
        &set(
            &cdc_toml(&db.url, &broker.sink_toml()),
            "relay.max_in_flight",
            "200",
        ),
        "relay.mark",
        &format!("{mark:?}"),
    );
    db.migrate(&parse(&toml)).await;
    let early = backlog(&db, 3_000, 100).await;
    let last_early: i64 = db
        .client
        .query_one("SELECT max(relay_seq) FROM outbox", &[])
        .await
        .unwrap()
        .get(0);
    let relay = InProcess::start(parse(&toml));
    let mut during = Vec::new();
    let started = std::time::Instant::now();
    loop {
        let early_unsent = db
            .count(&format!(
                "SELECT count(*) FROM outbox WHERE {unsent} AND relay_seq <= {last_early}"
            ))
            .await;
        if early_unsent == 0 {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "the backlog was not sent within {WAIT:?}"
        );
        during.extend(backlog(&db, 5, 5).await);
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!during.is_empty(), "events were committed during the read");
    let all = [early, during].concat();
    let got = broker.inbox.wait_ids(&all, WAIT).await;
    let order: Vec<String> = got.iter().map(Received::event_id).collect();
    assert_eq!(order, all, "once each, in commit order");
    relay.stop().await;
}
