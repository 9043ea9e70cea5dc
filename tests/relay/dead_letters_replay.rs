//! Dead letters and a crash: events delivered before an aggregate's dead
//! letter are recorded no later than the letter; a CDC replay brings them
//! again from the WAL, and they are told apart from its followers by their
//! WAL place, on the server that recorded it only.

use crate::dead_letters::{dlq_list, insert_big, poison_settings, wait_dead_letters};
use crate::support::*;
use outbox_relay::telemetry::metrics;
use serde_json::json;
use uuid::Uuid;

/// CDC without marking: after a crash the stream replays from the slot's
/// confirmed position, which can lie before events delivered ahead of a dead
/// letter of their aggregate. Those were delivered; they follow nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_after_a_crash_does_not_dead_letter_what_came_before_the_letter() {
    let (delivered, letters) = replay_after_a_crash_behind_a_letter(None).await;
    assert_eq!(
        letters.len(),
        2,
        "the event delivered before the dead letter ({delivered}) was replayed, not dead-lettered: {letters:?}"
    );
}

/// A WAL place recorded by another server (the database restored or moved
/// elsewhere) says nothing about this one's WAL: the replayed event is
/// taken for a follower, as when no place is known, and the replay does not
/// skip the events at the letters' places as done (on another server they
/// could be other events, never sent): the poison event and its follower
/// are handled again and recorded a second time. Kept, never skipped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wal_place_from_another_server_is_not_trusted() {
    let (delivered, letters) = replay_after_a_crash_behind_a_letter(Some("1234567890")).await;
    assert_eq!(letters.len(), 5, "{letters:?}");
    assert_eq!(letters[2], delivered, "kept behind the letter");
    assert_eq!(letters[3..], letters[..2], "replayed, not skipped");
}

/// One delivered event, then a poison event and its follower of the same
/// aggregate, then a SIGKILL that leaves the slot before all three; with
/// `foreign`, the letters' place is then made to look recorded elsewhere.
/// Returns the delivered event's id and the dead letters' ids after the
/// restart has streamed past the replay.
async fn replay_after_a_crash_behind_a_letter(foreign: Option<&str>) -> (String, Vec<String>) {
    let (db, broker, toml) =
        setup(Mode::Cdc, Kind::Rabbit, &[], &poison_settings("\"follow\"")).await;
    let toml = set(&toml, "relay.mark", "\"none\"");
    // PostgreSQL hears of the flushed position only now and then (and when
    // the stream restarts, as a retry does): the kill below leaves the slot
    // before every event of this test.
    let toml = set(&toml, "source.cdc.status_interval", "\"10m\"");
    let toml = set(&toml, "dead_letter.max_attempts", "1");
    let path = config_file(&toml);
    let slot = slot_of(&toml);
    let mut relay = ChildRelay::start(&toml);
    wait_streaming(&db.client, &slot).await;
    let before = wal_insert_position(&db.client).await;
    let (delivered, poison, follower) = (Uuid::new_v4(), Uuid::new_v4(), Uuid::new_v4());
    db.insert(delivered, "order", "P", json!({})).await;
    broker
        .inbox()
        .wait_ids(&[delivered.to_string()], WAIT)
        .await;
    insert_big(&db, poison, "P").await;
    db.insert(follower, "order", "P", json!({})).await;
    wait_dead_letters(&path, 2, "the poison event and its follower").await;
    let confirmed = slot_position(&db.client, &slot, "confirmed_flush_lsn").await;
    assert!(
        confirmed <= before,
        "the slot was confirmed to {confirmed} before the kill: nothing would be replayed"
    );
    relay.kill();
    let system = db.system_identifier().await;
    let recorded: Vec<Option<String>> = db
        .client
        .query(
            "SELECT source_system FROM outbox_dead_letters ORDER BY dead_letter_id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(recorded, vec![Some(system.clone()), Some(system)]);
    if let Some(other) = foreign {
        db.client
            .execute(
                "UPDATE outbox_dead_letters SET source_system = $1",
                &[&other],
            )
            .await
            .unwrap();
    }
    let (mut relay, port) = ChildRelay::serving(&toml);
    // The stream is read in WAL order: once a later event arrives, the
    // replayed ones were handled.
    let later = Uuid::new_v4();
    db.insert(later, "order", "G", json!({})).await;
    broker.inbox().wait_ids(&[later.to_string()], WAIT).await;
    // Only the later event was published by this relay: a replay
    // acknowledged without being sent is not counted as published.
    let (published, confirmed) = wait_for(WAIT, "the later event to be counted", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        let published = metric_sum(&body, metrics::EVENTS_PUBLISHED);
        let confirmed = metric_sum(&body, "outbox_relay_commit_to_confirm_seconds_count");
        (published >= 1.0 && confirmed >= 1.0).then_some((published, confirmed))
    })
    .await;
    assert_eq!(
        (published, confirmed),
        (1.0, 1.0),
        "events published (and confirmed) after the restart"
    );
    let letters: Vec<String> = dlq_list(&path)
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(letters[..2], [poison.to_string(), follower.to_string()]);
    assert_eq!(relay.terminate().code(), Some(0));
    (delivered.to_string(), letters)
}

every_mode!(a_crash_right_after_a_dead_letter_leaves_nothing_delivered_behind_it);
/// Events of an aggregate the broker confirmed just before refusing its
/// poison event are recorded with the dead letter, not after it: a crash
/// right after the letter's transaction committed leaves none of them
/// unsent, to be read again after the restart and taken for followers.
async fn a_crash_right_after_a_dead_letter_leaves_nothing_delivered_behind_it(
    mode: Mode,
    kind: Kind,
) {
    if !cfg!(feature = "failpoints") {
        panic!(
            "this test injects a crash through the `failpoints` feature: run the suite with --features failpoints (scripts/test.sh does)"
        );
    }
    let (db, broker, toml) = setup(mode, kind, &["order"], &poison_settings("\"follow\"")).await;
    let toml = set(&toml, "dead_letter.max_attempts", "1");
    let path = config_file(&toml);
    // Confirmed one after another up to the poison event, whose refusal
    // comes at once (it is over the size limit): the last confirmations
    // are still on their way to the acker when the letter is.
    let delivered = ids(20);
    for id in &delivered {
        db.insert(*id, "order", "P", json!({})).await;
    }
    let poison = Uuid::new_v4();
    insert_big(&db, poison, "P").await;
    let follower = Uuid::new_v4();
    db.insert(follower, "order", "P", json!({})).await;
    let mut relay = ChildRelay::start_with_env(
        &toml,
        &[("OUTBOX_RELAY_FAILPOINT", "abort-after-dead-letter:1")],
    );
    let status = relay
        .wait_exit(WAIT)
        .expect("the failpoint aborts the relay after the first dead letter");
    assert!(!status.success(), "aborted: {status:?}");
    let letters = dlq_list(&path);
    assert_eq!(
        letters.first().and_then(|l| l["id"].as_str()),
        Some(poison.to_string().as_str()),
        "the poison event's letter was written before the abort: {letters:?}"
    );
    let mut relay = ChildRelay::start(&toml);
    wait_dead_letters(&path, 2, "the poison event and its follower").await;
    // Every event before the poison one reached the broker, and none of
    // them went to the dead-letter table after the restart.
    broker.inbox().wait_ids(&strings(&delivered), WAIT).await;
    // Once nothing is unsent, everything read after the restart is recorded.
    wait_for(WAIT, "nothing left unsent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    let letters: Vec<String> = dlq_list(&path)
        .iter()
        .map(|l| l["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        letters,
        [poison.to_string(), follower.to_string()],
        "only the poison event and its follower are dead letters"
    );
    assert_eq!(relay.terminate().code(), Some(0));
}
