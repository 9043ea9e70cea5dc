//! A slot lost while the relay streams, not before it starts: the relay is
//! paused mid-stream, the server removes the WAL the slot still needs, and
//! the relay, resumed, must notice on its open stream and recreate the slot
//! (publishing every unsent event once, in order) or stop loudly.
//!
//! Pausing the relay alone does not hold the stream back: its WAL sender
//! keeps decoding and parks the changes in the socket buffers, and the
//! resumed relay would publish them from there. So the WAL sender is paused
//! too (SIGSTOP), and continued only once the checkpoint that invalidates
//! the slot has told it to exit: the events written meanwhile exist in the
//! removed WAL and in the table, nowhere else. A third test leaves the WAL
//! sender running, as when a relay falls behind: what it had already
//! received is published, and what it had not marked is sent again.

use crate::auto::{Committed, assert_each_once_in_order, unsent, write};
use crate::kit::cluster::PrivatePg;
use crate::support::brokers::{RabbitExchange, first_ids};
use crate::support::*;
use std::time::Duration;

/// A relay that streamed, then lost its slot while paused.
struct LostMidStream {
    _pg: PrivatePg,
    app: tokio_postgres::Client,
    broker: RabbitExchange,
    relay: ChildRelay,
    port: u16,
    slot: String,
    /// Events delivered before the pause.
    before: usize,
    /// Every committed event, the ones written during the pause included.
    committed: Committed,
}

impl LostMidStream {
    /// `hold_sender`: pause the WAL sender as well, so that nothing written
    /// during the pause reaches the relay's socket.
    async fn new(hold_sender: bool, sets: &[(&str, &str)]) -> LostMidStream {
        // Tiny WAL segments and retention, so a slot can be lost in seconds.
        let pg = cluster_that_loses_slots();
        let admin = connect(&pg.url("postgres")).await;
        admin.batch_execute("CREATE DATABASE app").await.unwrap();
        let app = connect(&pg.url("app")).await;
        let broker = RabbitExchange::new().await;
        let mut toml = with_mode(&base_toml(&pg.url("app"), &broker.sink_toml()), Mode::Cdc);
        for (key, value) in sets {
            toml = set(&toml, key, value);
        }
        let slot = slot_of(&toml);
        migrate_at(&pg.url("app"), &parse(&toml)).await;

        // The first events wait in the table: the relay's start-up read
        // takes them.
        let mut committed = Committed::new();
        write(&app, 20, &mut committed).await;
        let port = crate::kit::free_port();
        let relay = ChildRelay::start_logged(&with_http(&toml, port));
        // The relay streams, its start-up read is over (it goes on for a
        // round after the stream opened, and would read what is written
        // during the pause), and it has marked everything: nothing is in
        // flight at the pause, so nothing may be sent twice.
        let ids: Vec<String> = committed.iter().map(|(_, id)| id.clone()).collect();
        broker.inbox.wait_ids(&ids, WAIT).await;
        wait_for(WAIT, "the start-up read to end", || async {
            relay
                .logged("start-up read of unsent rows done")
                .then_some(())
        })
        .await;
        wait_for(WAIT, "the streamed rows marked", || async {
            (unsent(&app).await == 0).then_some(())
        })
        .await;
        let before = committed.len();
        let walsender = wait_streaming(&app, &slot).await;
        let walsender = u32::try_from(walsender).unwrap();

        let paused_relay = Paused::pause(relay.pid());
        let paused_sender = hold_sender.then(|| Paused::pause(walsender));
        write(&app, 20, &mut committed).await;
        // Filler WAL and checkpoints until the slot is lost. The checkpoint
        // that invalidates the slot first terminates its WAL sender and waits
        // for it to exit; the SIGTERM stays pending while it is stopped.
        let url = pg.url("app");
        let slot_name = slot.clone();
        let filler = tokio::spawn(async move {
            let app = connect(&url).await;
            lose_slot(&app, &slot_name, Duration::from_secs(90)).await;
        });
        if let Some(paused_sender) = paused_sender {
            let log = pg.dir().join("server.log");
            let told = format!("terminating process {walsender} to release replication slot");
            wait_for(
                Duration::from_secs(60),
                "the checkpoint to terminate the WAL sender",
                || async {
                    std::fs::read_to_string(&log)
                        .unwrap_or_default()
                        .contains(&told)
                        .then_some(())
                },
            )
            .await;
            paused_sender.resume();
        }
        tokio::time::timeout(Duration::from_secs(90), filler)
            .await
            .expect("the slot is lost in time")
            .expect("the filler did not panic");
        assert_eq!(
            broker.inbox.len(),
            before,
            "nothing was published during the pause"
        );
        paused_relay.resume();
        LostMidStream {
            _pg: pg,
            app,
            broker,
            relay,
            port,
            slot,
            before,
            committed,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_mid_stream_is_recreated_and_each_event_arrives_once_in_order() {
    let mut lost = LostMidStream::new(true, &[]).await;
    // The resumed relay finds its stream ended, the slot lost: a new slot,
    // and the events of the removed WAL read from the table.
    let series = "outbox_relay_slots_recreated_total{pipeline=\"default\"}";
    wait_for(WAIT, "the metric to count the recreated slot", || async {
        let (_, body) = http_get(lost.port, "/metrics").await?;
        (metric(&body, series) == Some(1.0)).then_some(())
    })
    .await;
    // The new slot streams.
    wait_for(WAIT, "the new slot to stream", || async {
        (wal_status(&lost.app, &lost.slot).await.as_deref() != Some("lost")).then_some(())
    })
    .await;
    write(&lost.app, 20, &mut lost.committed).await;
    assert_each_once_in_order(&lost.broker, &lost.app, &lost.committed).await;
    assert_eq!(lost.relay.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_mid_stream_stops_the_relay_when_told_to() {
    let mut lost = LostMidStream::new(true, &[("source.cdc.on_lost_slot", "\"stop\"")]).await;
    wait_for(WAIT, "readiness to name the lost slot", || async {
        let (code, body) = http_get(lost.port, "/readyz").await?;
        (code == 503 && body.contains("is lost") && body.contains(&lost.slot)).then_some(())
    })
    .await;
    // It stays so, between its retries too: not ready, nothing published,
    // the slot left for the operator.
    let until = std::time::Instant::now() + Duration::from_secs(3);
    while std::time::Instant::now() < until {
        let (code, body) = http_get(lost.port, "/readyz")
            .await
            .expect("readyz answers");
        assert_eq!(code, 503, "readiness while the slot is lost: {body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        lost.broker.inbox.len(),
        lost.before,
        "nothing is published from a lost slot"
    );
    assert_eq!(
        unsent(&lost.app).await,
        i64::try_from(lost.committed.len() - lost.before).unwrap()
    );
    // The documented recovery: the operator drops the slot; the relay makes
    // a new one and publishes the unsent rows first.
    drop_lost_slot(&lost.app, &lost.slot).await;
    write(&lost.app, 10, &mut lost.committed).await;
    assert_each_once_in_order(&lost.broker, &lost.app, &lost.committed).await;
    assert_eq!(lost.relay.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_lost_behind_a_running_wal_sender_loses_nothing_and_keeps_order() {
    // The WAL sender streams the paused relay's events into the socket
    // before the slot is lost; the resumed relay publishes those, then loses
    // the stream before marking them, and the new slot's start-up read sends
    // them again: duplicates within the in-flight window, nothing missing.
    let mut lost = LostMidStream::new(false, &[]).await;
    wait_for(WAIT, "the new slot to stream", || async {
        let (_, body) = http_get(lost.port, "/metrics").await?;
        let series = "outbox_relay_slots_recreated_total{pipeline=\"default\"}";
        (metric(&body, series) == Some(1.0)).then_some(())
    })
    .await;
    write(&lost.app, 20, &mut lost.committed).await;
    let ids: Vec<String> = lost.committed.iter().map(|(_, id)| id.clone()).collect();
    lost.broker.inbox.wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row marked sent", || async {
        (unsent(&lost.app).await == 0).then_some(())
    })
    .await;
    let got = lost.broker.inbox.snapshot();
    let firsts = first_ids(&got);
    assert_eq!(firsts.len(), lost.committed.len(), "every event arrived");
    // Only the 20 events of the pause were in flight when the stream ended.
    assert!(
        got.len() - firsts.len() <= 20,
        "duplicates: {}",
        got.len() - firsts.len()
    );
    let aggregates: std::collections::BTreeSet<&str> =
        lost.committed.iter().map(|(a, _)| a.as_str()).collect();
    for aggregate in aggregates {
        let want: Vec<&str> = lost
            .committed
            .iter()
            .filter(|(a, _)| a == aggregate)
            .map(|(_, id)| id.as_str())
            .collect();
        let have: Vec<&str> = firsts
            .iter()
            .map(String::as_str)
            .filter(|id| want.contains(id))
            .collect();
        assert_eq!(
            have, want,
            "aggregate {aggregate}: first deliveries in commit order"
        );
    }
    assert_eq!(lost.relay.terminate().code(), Some(0));
}
