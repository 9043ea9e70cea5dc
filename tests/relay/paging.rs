//! The polling reader against a real server: a page stops where its rows'
//! payloads pass the byte room it was given (the first row always goes),
//! and the next page goes on from the row the cut left, so nothing is
//! skipped or read twice.

use crate::support::*;
use outbox_relay::outbox::Shard;
use outbox_relay::source::Reader;
use outbox_relay::source::polling::PollingReader;
use std::time::Duration;

/// Each row's payload as text: `{"x": "` + 991 × `a` + `"}`.
const PAYLOAD: usize = 1000;

async fn insert(db: &TestDb, from: i32, to: i32) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'a' || i, 'Paged',
                    jsonb_build_object('x', repeat('a', 991))
             FROM generate_series($1::int, $2::int) i ORDER BY i",
            &[&from, &to],
        )
        .await
        .expect("insert rows");
}

/// The `relay_seq`s of one read of up to `max` rows within `max_bytes`.
async fn read(reader: &mut PollingReader, max: usize, max_bytes: usize) -> Vec<i64> {
    let events = tokio::time::timeout(WAIT, reader.next_batch(max, max_bytes))
        .await
        .expect("a read within the wait")
        .expect("a read without error");
    for e in &events {
        let event = e.event.as_ref().expect("a well-formed row");
        assert_eq!(
            event.payload.get().len(),
            PAYLOAD,
            "the payload as the row has it"
        );
    }
    events.iter().map(|e| e.position).collect()
}

async fn pages_stop_where_the_payloads_pass_the_room(mark: &str) {
    let mark_value = format!("\"{mark}\"");
    let (db, _broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[("relay.mark", mark_value.as_str())],
    )
    .await;
    let config = parse(&toml);
    insert(&db, 1, 10).await;
    let seqs: Vec<i64> = db
        .client
        .query("SELECT relay_seq FROM outbox ORDER BY relay_seq", &[])
        .await
        .expect("read relay_seq")
        .iter()
        .map(|r| r.get(0))
        .collect();
    let info = outbox_relay::outbox::inspect::table_info(&db.client, &config.outbox.table)
        .await
        .expect("table info")
        .expect("the outbox exists");
    let columns = config.outbox.columns.resolve(&info.names());
    let mut reader = PollingReader::connect(
        &config.database,
        &config.outbox.table,
        &columns,
        &config.source.polling,
        Shard::whole(),
        config.relay.mark,
    )
    .await
    .expect("connect the reader");

    // 2,500 bytes of room: the rows whose earlier rows take less than that.
    assert_eq!(read(&mut reader, 100, 2_500).await, seqs[0..3], "{mark}");
    // Less room than one row: that row alone.
    assert_eq!(read(&mut reader, 100, 1).await, seqs[3..4], "{mark}");
    // Room to spare: the rest of the rows, up to `max`.
    assert_eq!(read(&mut reader, 4, 1_000_000).await, seqs[4..8], "{mark}");
    assert_eq!(
        read(&mut reader, 100, 1_000_000).await,
        seqs[8..10],
        "{mark}"
    );
    // Nothing more until another row commits; then that row alone.
    let idle = tokio::time::timeout(
        Duration::from_millis(300),
        reader.next_batch(100, 1_000_000),
    );
    assert!(idle.await.is_err(), "{mark}: no row is read twice");
    insert(&db, 11, 11).await;
    let last: i64 = db
        .client
        .query_one("SELECT max(relay_seq) FROM outbox", &[])
        .await
        .expect("read relay_seq")
        .get(0);
    assert_eq!(read(&mut reader, 100, 2_500).await, [last], "{mark}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_pages_stop_where_the_payloads_pass_the_room_when_rows_are_marked() {
    pages_stop_where_the_payloads_pass_the_room("update").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_pages_stop_where_the_payloads_pass_the_room_when_ranges_are_recorded() {
    pages_stop_where_the_payloads_pass_the_room("ranges").await;
}
