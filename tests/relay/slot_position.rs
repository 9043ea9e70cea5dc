//! A replication stream never moves the slot back. Another instance can
//! move the slot between this one's start and its stream's opening: a new
//! owner's start-up read, while this one's ownership session was silent.
//! PostgreSQL then streams from the slot's position, and a status update
//! with the relay's own, older position would take the slot back to it:
//! WAL kept longer, and events sent again by whoever streams from the slot
//! next. The stream starts its reports at the slot's position instead.
//!
//! Recent minor releases of PostgreSQL (15.20 among them) ignore a flushed
//! position behind the slot's; older ones take it. So the test looks at
//! what the stream reports (`pg_stat_replication.flush_lsn`) as well as
//! at the slot.

use crate::support::*;
use outbox_relay::replication::Lsn;
use outbox_relay::source::Reader;
use outbox_relay::source::cdc::{CdcReader, Progress, SKIP_MEMORY};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// The slot's confirmed position, and the flushed position the stream
/// holding it last reported (none before its first status update).
async fn positions(db: &TestDb, slot: &str) -> (Lsn, Option<Lsn>) {
    let row = db
        .client
        .query_one(
            "SELECT s.confirmed_flush_lsn::text, r.flush_lsn::text
             FROM pg_replication_slots s
             LEFT JOIN pg_stat_replication r ON r.pid = s.active_pid
             WHERE s.slot_name = $1",
            &[&slot],
        )
        .await
        .expect("read the slot");
    let lsn = |text: String| -> Lsn { text.parse().expect("a WAL position") };
    (lsn(row.get(0)), row.get::<_, Option<String>>(1).map(lsn))
}

/// The lowest positions seen: the slot's, and any the stream reported.
#[derive(Debug)]
struct Lowest {
    slot: Lsn,
    reported: Option<Lsn>,
}

impl Lowest {
    async fn look(&mut self, db: &TestDb, slot: &str) {
        let (confirmed, reported) = positions(db, slot).await;
        self.slot = self.slot.min(confirmed);
        if let Some(r) = reported {
            self.reported = Some(self.reported.map_or(r, |l| l.min(r)));
        }
    }
}

/// Moves the slot to the end of the WAL, as another instance's start-up
/// read would; retried while the relay's own move holds the slot.
async fn move_slot_to_the_end(db: &TestDb, slot: &str) -> Lsn {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match db
            .client
            .query_one(
                "SELECT end_lsn::text FROM pg_replication_slot_advance($1, pg_current_wal_lsn())",
                &[&slot],
            )
            .await
        {
            Ok(row) => return row.get::<_, String>(0).parse().expect("a WAL position"),
            Err(e) => {
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "the slot could not be moved within {WAIT:?}: {e}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_opened_after_another_instance_moved_the_slot_does_not_move_it_back() {
    let (db, _broker, toml) = setup(
        Mode::Cdc,
        Kind::Rabbit,
        &[],
        &[
            ("relay.mark", "\"update\""),
            ("source.cdc.status_interval", "\"100ms\""),
        ],
    )
    .await;
    let config = parse(&toml);
    let columns = db.resolved_columns(&config).await;
    let slot = config.source.cdc.slot_name(&config.outbox.table);
    let insert = "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                  SELECT gen_random_uuid(), 'order', 'a' || i, 'Placed', '{}'
                  FROM generate_series(1, $1::int) i";
    db.client
        .execute(insert, &[&5i32])
        .await
        .expect("insert rows");

    // The reader creates the slot and begins its start-up read, with the
    // five rows in its snapshot. Nothing it reads is confirmed here, so
    // its own position stays where its start left it.
    let progress = Arc::new(Mutex::new(Progress::new(Lsn::default(), SKIP_MEMORY)));
    let mut reader = CdcReader::connect(&config, &columns, progress)
        .await
        .expect("connect the CDC reader");
    tokio::time::timeout(WAIT, reader.begin())
        .await
        .expect("the start within the wait")
        .expect("the start");

    // Meanwhile another instance moves the slot past WAL written since.
    db.client
        .batch_execute(
            "CREATE TABLE filler (x int); INSERT INTO filler SELECT generate_series(1, 1000)",
        )
        .await
        .expect("write WAL");
    let moved_to = move_slot_to_the_end(&db, &slot).await;

    // The start-up read ends and the stream opens; a row committed now
    // comes through the stream. The slot is looked at after each read.
    db.client
        .execute(insert, &[&1i32])
        .await
        .expect("insert a row");
    let mut read = 0;
    let mut lowest = Lowest {
        slot: moved_to,
        reported: None,
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    while read < 6 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{read} of 6 events read within {WAIT:?}"
        );
        if let Ok(batch) =
            tokio::time::timeout(Duration::from_millis(200), reader.next_batch(100, 1 << 20)).await
        {
            read += batch.expect("a read without error").len();
        }
        lowest.look(&db, &slot).await;
    }
    // Status updates for a few more intervals, the stream open.
    for _ in 0..5 {
        let _ =
            tokio::time::timeout(Duration::from_millis(200), reader.next_batch(100, 1 << 20)).await;
        lowest.look(&db, &slot).await;
    }
    reader.close().await;
    assert!(
        lowest.reported.is_some(),
        "the stream reported a position while it was looked at: {lowest:?}"
    );
    assert!(
        lowest.slot >= moved_to && lowest.reported >= Some(moved_to),
        "moved to {moved_to} by another instance, then {lowest:?}"
    );
}
