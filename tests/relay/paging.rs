//! The polling reader and the CDC start-up read against a real server: a
//! page stops where its rows pass the byte room it was given (the first row
//! always goes), on a first page and on a later one whose rows grew, and
//! the next page goes on from the row the cut left, so nothing is skipped
//! or read twice. A row's size is all its text plus a few hundred bytes
//! (`row_bytes` in `src/source/rows.rs`); the payloads here (10,000
//! and 40,000 bytes) make the rest small beside them.

use crate::support::*;
use outbox_relay::outbox::Shard;
use outbox_relay::source::Reader;
use outbox_relay::source::cdc::{CdcServer, CdcSettings, PgServer};
use outbox_relay::source::polling::PollingReader;
use std::time::Duration;

/// Rows `from..=to` whose payloads take `size` bytes as text
/// (`{"x": "` + `size - 9` × `a` + `"}`).
async fn insert(db: &TestDb, from: i32, to: i32, size: i32) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'a' || i, 'Paged',
                    jsonb_build_object('x', repeat('a', $3 - 9))
             FROM generate_series($1::int, $2::int) i ORDER BY i",
            &[&from, &to, &size],
        )
        .await
        .expect("insert rows");
}

/// The `relay_seq` and payload size of each row of one read of up to
/// `max` rows within `max_bytes`.
async fn read(reader: &mut PollingReader, max: usize, max_bytes: usize) -> Vec<(i64, usize)> {
    let events = tokio::time::timeout(WAIT, reader.next_batch(max, max_bytes))
        .await
        .expect("a read within the wait")
        .expect("a read without error");
    events
        .iter()
        .map(|e| {
            let event = e.event.as_ref().expect("a well-formed row");
            (e.position, event.payload.get().len())
        })
        .collect()
}

/// An outbox marked with `mark` for `mode`, its configuration and columns.
async fn outbox(
    mode: Mode,
    mark: &str,
) -> (
    TestDb,
    Broker,
    outbox_relay::config::Config,
    outbox_relay::config::ResolvedColumns,
) {
    let mark_value = format!("\"{mark}\"");
    let (db, broker, toml) = setup(
        mode,
        Kind::Rabbit,
        &[],
        &[("relay.mark", mark_value.as_str())],
    )
    .await;
    let config = parse(&toml);
    let columns = db.resolved_columns(&config).await;
    (db, broker, config, columns)
}

/// The `relay_seq` of every row, in order.
async fn all_seqs(db: &TestDb) -> Vec<i64> {
    db.client
        .query("SELECT relay_seq FROM outbox ORDER BY relay_seq", &[])
        .await
        .expect("read relay_seq")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

async fn pages_stop_where_the_rows_pass_the_room(mark: &str) {
    let (db, _broker, config, columns) = outbox(Mode::Polling, mark).await;
    // Five rows of 10,000 bytes, then five of 40,000.
    insert(&db, 1, 5, 10_000).await;
    insert(&db, 6, 10, 40_000).await;
    let seqs = all_seqs(&db).await;
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

    assert_eq!(seqs.len(), 10);
    // The rows at these indexes, with the sizes they were inserted with.
    let rows = |at: &[usize]| -> Vec<(i64, usize)> {
        at.iter()
            .map(|&i| (seqs[i], if i < 5 { 10_000 } else { 40_000 }))
            .collect()
    };
    // 25,000 bytes of room: the rows whose earlier rows take less than that.
    assert_eq!(
        read(&mut reader, 100, 25_000).await,
        rows(&[0, 1, 2]),
        "{mark}"
    );
    // A later page, sized for 10,000-byte rows, meets larger ones.
    assert_eq!(
        read(&mut reader, 100, 50_000).await,
        rows(&[3, 4, 5]),
        "{mark}"
    );
    // Less room than one row: that row alone.
    assert_eq!(read(&mut reader, 100, 1).await, rows(&[6]), "{mark}");
    // Room to spare: the rest of the rows, up to `max`.
    assert_eq!(
        read(&mut reader, 2, 10_000_000).await,
        rows(&[7, 8]),
        "{mark}"
    );
    assert_eq!(
        read(&mut reader, 100, 10_000_000).await,
        rows(&[9]),
        "{mark}"
    );
    // Nothing more until another row commits; then that row alone.
    let idle = tokio::time::timeout(
        Duration::from_millis(300),
        reader.next_batch(100, 10_000_000),
    );
    assert!(idle.await.is_err(), "{mark}: no row is read twice");
    insert(&db, 11, 11, 40_000).await;
    let got = read(&mut reader, 100, 25_000).await;
    assert_eq!(got.len(), 1, "{mark}: {got:?}");
    assert!(got[0].0 > seqs[9], "{mark}: {got:?} after {seqs:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_pages_stop_where_the_rows_pass_the_room_when_rows_are_marked() {
    pages_stop_where_the_rows_pass_the_room("update").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_pages_stop_where_the_rows_pass_the_room_when_ranges_are_recorded() {
    pages_stop_where_the_rows_pass_the_room("ranges").await;
}

/// One start-up read page of up to `max` rows within `max_bytes`, after
/// `after`: the `relay_seq` of each row.
async fn table_page(server: &mut PgServer, after: i64, max: usize, max_bytes: usize) -> Vec<i64> {
    tokio::time::timeout(WAIT, server.table_page(after, max, max_bytes))
        .await
        .expect("a page within the wait")
        .expect("a page without error")
        .iter()
        .map(|r| r.seq)
        .collect()
}

async fn startup_pages_go_on_from_the_row_the_cut_left(mark: &str) {
    let (db, _broker, config, columns) = outbox(Mode::Cdc, mark).await;
    // Five rows of 10,000 bytes, five of 40,000, then 70 of 2,000: more
    // than a start's first page asks for (64 rows).
    insert(&db, 1, 5, 10_000).await;
    insert(&db, 6, 10, 40_000).await;
    insert(&db, 11, 80, 2_000).await;
    let seqs = all_seqs(&db).await;
    assert_eq!(seqs.len(), 80);
    let (mut server, _) = PgServer::connect(
        &config.database,
        &config.outbox.table,
        &columns,
        CdcSettings::from_config(&config),
    )
    .await
    .expect("connect");
    server.prepare().await.expect("prepare the slot");
    server
        .begin_table_read()
        .await
        .expect("begin the start-up read");
    // The rows at these indexes (1-based, as inserted).
    let rows = |from: usize, to: usize| seqs[from - 1..to].to_vec();

    // 25,000 bytes of room: the rows whose earlier rows take less than that.
    assert_eq!(
        table_page(&mut server, 0, 100, 25_000).await,
        rows(1, 3),
        "{mark}"
    );
    // The row the cut left comes first; rows grow past the room.
    assert_eq!(
        table_page(&mut server, seqs[2], 100, 50_000).await,
        rows(4, 6),
        "{mark}"
    );
    // Less room than one row: that row alone.
    assert_eq!(
        table_page(&mut server, seqs[5], 100, 1).await,
        rows(7, 7),
        "{mark}"
    );
    // Room to spare: the rest of the rows, up to `max`, page after page.
    assert_eq!(
        table_page(&mut server, seqs[6], 2, 10_000_000).await,
        rows(8, 9),
        "{mark}"
    );
    assert_eq!(
        table_page(&mut server, seqs[8], 30, 10_000_000).await,
        rows(10, 39),
        "{mark}"
    );
    assert_eq!(
        table_page(&mut server, seqs[38], 100, 10_000_000).await,
        rows(40, 80),
        "{mark}"
    );
    // Nothing after the last row: the round's end.
    assert!(
        table_page(&mut server, seqs[79], 100, 10_000_000)
            .await
            .is_empty(),
        "{mark}"
    );
    // From an earlier cursor (a rewound read), the rows after it again.
    assert_eq!(
        table_page(&mut server, seqs[49], 5, 10_000_000).await,
        rows(51, 55),
        "{mark}"
    );
    server
        .end_table_read()
        .await
        .expect("end the start-up read");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_pages_go_on_from_the_row_the_cut_left_when_rows_are_marked() {
    startup_pages_go_on_from_the_row_the_cut_left("update").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn startup_pages_go_on_from_the_row_the_cut_left_when_ranges_are_recorded() {
    startup_pages_go_on_from_the_row_the_cut_left("ranges").await;
}
