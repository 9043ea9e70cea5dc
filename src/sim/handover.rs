//! The CDC reader's hand-over (`source.cdc.batch_wait`) on the simulated
//! server, in virtual time: a batch full at its commit goes at once, a
//! short one waits and takes what committed meanwhile, and status updates
//! keep their schedule while it waits; and the stream opened beside the
//! start-up read is kept alive however long the relay takes nothing.

use super::cdc::SimCdc;
use super::world::{BrokerKind, Shared, World, lock};
use crate::config::{ColumnMap, load_str};
use crate::replication::Lsn;
use crate::source::cdc::{CdcPosition, CdcReader, CdcSettings, Progress, SharedProgress, Timing};
use crate::source::{Reader, SourcedEvent};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

const WAIT: Duration = Duration::from_secs(10);
const STATUS_EVERY: Duration = Duration::from_secs(1);
/// What a status update takes on the simulated connection, and more.
const AT_ONCE: Duration = Duration::from_millis(100);

/// A world with a slot, and a reader of it that hands over after `WAIT`
/// and reports its position every `STATUS_EVERY`. Without marking: the
/// reader streams from the slot at once, with no start-up read.
fn reader() -> (Shared, CdcReader<SimCdc>, SharedProgress) {
    reader_marking("none")
}

fn reader_marking(mark: &str) -> (Shared, CdcReader<SimCdc>, SharedProgress) {
    let config = load_str(&format!(
        r#"
[database]
url = "postgres://sim@sim/sim"
[source]
mode = "cdc"
[relay]
mark = "{mark}"
[http]
enabled = false
[sink]
type = "kafka"
brokers = "sim:9092"
topic = "t"
"#
    ))
    .expect("the test's configuration");
    let world: Shared = Arc::new(Mutex::new(World::new(
        1,
        BrokerKind {
            gapless: true,
            topic_per_type: false,
        },
        Duration::from_secs(2),
        mark != "none",
    )));
    let flushed = lock(&world).slot_confirmed;
    let progress = Arc::new(Mutex::new(Progress::new(flushed, 100)));
    let columns = ColumnMap::default().resolve(&[
        "event_version".into(),
        "headers".into(),
        "created_at".into(),
    ]);
    let reader = CdcReader::new(
        SimCdc::new(world.clone(), false, String::new()),
        &config.outbox.table,
        &columns,
        CdcSettings {
            batch_wait: WAIT,
            ..CdcSettings::from_config(&config)
        },
        progress.clone(),
        Timing {
            status_every: STATUS_EVERY,
            silence_limit: Duration::from_secs(60),
        },
    );
    (world, reader, progress)
}

/// Commits a transaction of `rows` events; its end position.
fn commit(world: &Shared, rows: usize) -> Lsn {
    let mut w = lock(world);
    let xid = w.begin();
    for i in 0..rows {
        w.insert(xid, &format!("e{xid}-{i}"), "a", "E", "{}");
    }
    w.commit(xid);
    w.wal.last().map(|t| t.end_lsn).expect("the commit's WAL")
}

fn ids(batch: &[SourcedEvent<CdcPosition>]) -> Vec<String> {
    batch
        .iter()
        .map(|e| e.event.as_ref().map(|e| e.id.clone()).unwrap_or_default())
        .collect()
}

#[tokio::test(start_paused = true)]
async fn a_batch_full_at_its_commit_goes_at_once() {
    let (world, mut reader, _progress) = reader();
    reader.begin().await.expect("the stream opens");
    commit(&world, 3);
    let asked = Instant::now();
    let batch = reader.next_batch(3, usize::MAX).await.expect("a batch");
    assert_eq!(ids(&batch).len(), 3);
    assert!(asked.elapsed() < AT_ONCE, "no wait for a full batch");
    // Full by its bytes alone: also at once.
    commit(&world, 2);
    let asked = Instant::now();
    let batch = reader.next_batch(100, 1).await.expect("a batch");
    assert!(!batch.is_empty());
    assert!(
        asked.elapsed() < AT_ONCE,
        "no wait for a batch full of bytes"
    );
}

#[tokio::test(start_paused = true)]
async fn a_short_batch_waits_and_takes_what_committed_meanwhile() {
    let (world, mut reader, _progress) = reader();
    reader.begin().await.expect("the stream opens");
    commit(&world, 1);
    let later = {
        let world = world.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_secs(3)).await;
            commit(&world, 2);
        })
    };
    let asked = Instant::now();
    let batch = reader.next_batch(10, usize::MAX).await.expect("a batch");
    later.await.expect("the later commit");
    let waited = asked.elapsed();
    assert!(
        (WAIT..WAIT + AT_ONCE).contains(&waited),
        "handed over when the wait ended: {waited:?}"
    );
    let mut expected = vec!["e1000-0".to_owned()];
    expected.extend(["e1001-0".to_owned(), "e1001-1".to_owned()]);
    assert_eq!(
        ids(&batch),
        expected,
        "the later transaction joined, in order"
    );
}

#[tokio::test(start_paused = true)]
async fn status_updates_keep_their_schedule_while_a_batch_waits() {
    let (world, mut reader, progress) = reader();
    reader.begin().await.expect("the stream opens");
    let first_end = commit(&world, 1);
    let first = reader.next_batch(10, usize::MAX).await.expect("a batch");
    assert_eq!(first.len(), 1);
    // The broker confirmed the first event: its transaction may be
    // reported as flushed.
    progress
        .lock()
        .expect("the progress")
        .confirm(&first[0].position);
    assert!(lock(&world).slot_confirmed < first_end, "not reported yet");
    commit(&world, 1);
    let asked = Instant::now();
    let waiting = tokio::spawn(async move {
        let batch = reader.next_batch(10, usize::MAX).await;
        (reader, batch)
    });
    tokio::time::sleep(STATUS_EVERY * 2).await;
    assert!(!waiting.is_finished(), "still within the batch wait");
    assert!(
        lock(&world).slot_confirmed >= first_end,
        "the status update went out during the wait"
    );
    let (_reader, second) = waiting.await.expect("the reader's task");
    assert_eq!(second.expect("a batch").len(), 1);
    let waited = asked.elapsed();
    assert!((WAIT..WAIT + AT_ONCE).contains(&waited), "{waited:?}");
}

/// The relay takes nothing for longer than the server's
/// `wal_sender_timeout` after each batch of the start-up read (a broker
/// stall), while the stream that takes over from it is open already:
/// the stream is not ended for its silence, and a later commit arrives
/// through it.
#[tokio::test(start_paused = true)]
async fn the_stream_opened_beside_the_start_up_read_outlives_a_long_stall() {
    use crate::source::cdc::progress::CATCH_UP;
    let (world, mut reader, _progress) = reader_marking("update");
    for _ in 0..3 {
        commit(&world, 2);
    }
    reader.begin().await.expect("the start-up read begins");
    let last_id = |world: &Shared| {
        lock(world)
            .wal
            .last()
            .and_then(|tx| tx.rows.first())
            .map(|row| row.id.clone())
            .unwrap_or_default()
    };
    let mut got = Vec::new();
    let mut last = None;
    // Stalls while the start-up read still handed rows over and a stream
    // was open beside it.
    let mut stalls_beside_open_stream = 0;
    let mut last_streamed = false;
    for round in 0..30 {
        let batch = reader.next_batch(2, usize::MAX).await.expect("a batch");
        let from_table = batch.iter().any(|e| e.position.commit_lsn == CATCH_UP);
        got.extend(ids(&batch));
        if let Some(id) = &last
            && let Some(e) = batch
                .iter()
                .find(|e| e.event.as_ref().is_ok_and(|e| &e.id == id))
        {
            last_streamed = e.position.commit_lsn != CATCH_UP;
            break;
        }
        // Writers go on during the start-up read (so its next round, the
        // one beside the opening stream, has rows too), and after it: the
        // last commits come once the stream must have taken over.
        if last.is_none() {
            commit(&world, 1);
            if round == 7 {
                last = Some(last_id(&world));
            }
        }
        if from_table && lock(&world).slot_active.is_some() {
            stalls_beside_open_stream += 1;
        }
        // The pipeline's reader task, while the broker takes nothing.
        tokio::select! {
            failed = reader.maintain() => failed.expect("the reader keeps its connection"),
            () = tokio::time::sleep(super::cdc::WAL_SENDER_TIMEOUT * 3 / 2) => {}
        }
    }
    assert!(
        stalls_beside_open_stream > 0,
        "the stream opened while the start-up read still handed rows over: {got:?}"
    );
    assert!(
        last_streamed,
        "the last commit ({last:?}) arrived through the stream: {got:?}"
    );
    let w = lock(&world);
    assert!(w.violations.is_empty(), "{:?}", w.violations);
}
