//! Failures the relay must survive without losing an event: broker outages,
//! restarts, crashes, lost database sessions, a second instance.

use crate::support::brokers::{Received, first_ids};
use crate::support::proxy::setup_cut;
use crate::support::*;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

async fn insert_many(db: &TestDb, n: usize, aggregate: &str) -> Vec<String> {
    let ids = ids(n);
    for (i, id) in ids.iter().enumerate() {
        db.insert(*id, "order", aggregate, json!({"i": i})).await;
    }
    strings(&ids)
}

every_mode!(broker_outage_leaves_rows_unsent_then_recovers);
async fn broker_outage_leaves_rows_unsent_then_recovers(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup_cut(mode, kind, &[]).await;

    // Unreachable from the start: the relay waits and retries, marks nothing.
    broker.proxy().cut();
    let first = insert_many(&db, 10, "a").await;
    let relay = InProcess::start(parse(&toml));
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        db.unsent().await,
        10,
        "nothing is marked while the broker is unreachable"
    );
    assert_eq!(broker.inbox.len(), 0);
    broker.proxy().restore();
    broker.inbox.wait_ids(&first, WAIT).await;

    // Cut in the middle of a stream.
    broker.proxy().cut();
    let second = insert_many(&db, 20, "a").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let unsent = db.unsent().await;
    assert_eq!(unsent, 20, "rows written during the outage stay unsent");
    broker.proxy().restore();
    let got = broker
        .inbox
        .wait_ids(&second, Duration::from_secs(60))
        .await;
    db.wait_all_marked().await;
    assert_first_deliveries_in_order(&got, &[first, second].concat());
    relay.stop().await;
}

/// Checks that the first delivery of each id follows `expected`'s order.
fn assert_first_deliveries_in_order(got: &[Received], expected: &[String]) {
    let firsts = first_ids(got);
    let wanted: HashSet<&String> = expected.iter().collect();
    let firsts: Vec<&String> = firsts.iter().filter(|id| wanted.contains(id)).collect();
    assert_eq!(
        firsts,
        expected.iter().collect::<Vec<_>>(),
        "first deliveries out of order"
    );
}

every_mode!(graceful_restart_resumes_without_loss);
async fn graceful_restart_resumes_without_loss(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let relay = InProcess::start(parse(&toml));
    let before = insert_many(&db, 30, "a").await;
    broker.inbox().wait_ids(&before, WAIT).await;
    relay.stop().await;
    let during = insert_many(&db, 30, "a").await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(db.unsent().await, 30);
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_ids(&during, WAIT).await;
    assert_eq!(got.len(), 60, "a clean stop and start causes no duplicates");
    assert_first_deliveries_in_order(&got, &[before, during].concat());
    relay.stop().await;
}

every_mode!(killed_relay_loses_nothing);
async fn killed_relay_loses_nothing(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let toml = set(&toml, "relay.max_in_flight", "200");
    let writer_db = db.url.clone();
    let writer = tokio::spawn(async move {
        let c = connect(&writer_db).await;
        let mut ids = Vec::new();
        for i in 0..600 {
            let id = Uuid::new_v4();
            c.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'E', $3)",
                &[&id, &format!("agg{}", i % 7), &json!({"i": i})],
            )
            .await
            .unwrap();
            ids.push(id.to_string());
            if i % 20 == 0 {
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
        }
        ids
    });
    for round in 0..3 {
        let mut child = ChildRelay::start(&toml);
        tokio::time::sleep(Duration::from_millis(400 + round * 170)).await;
        child.kill();
    }
    let ids = writer.await.unwrap();
    let mut child = ChildRelay::start(&toml);
    let got = broker.inbox().wait_ids(&ids, Duration::from_secs(60)).await;
    db.wait_all_marked().await;
    let duplicates = got.len() - ids.len();
    assert!(
        duplicates <= 3 * 200,
        "{duplicates} duplicates exceed 3 kills x the in-flight window"
    );
    // Per aggregate, first deliveries follow the insert order.
    let mut per_agg: HashMap<String, Vec<i64>> = HashMap::new();
    let mut seen = HashSet::new();
    for m in &got {
        let body = m.json();
        if seen.insert(m.event_id()) {
            per_agg
                .entry(body["subject"].as_str().unwrap().to_owned())
                .or_default()
                .push(body["data"]["i"].as_i64().unwrap());
        }
    }
    for (agg, order) in per_agg {
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{agg}: {order:?}");
    }
    assert_eq!(child.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_in_flight_and_exits_zero() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let ids = insert_many(&db, 200, "a").await;
    let mut child = ChildRelay::start(&toml);
    broker.inbox().wait_len(1, WAIT).await;
    let status = child.terminate();
    assert_eq!(status.code(), Some(0), "graceful shutdown exits 0");
    // Whatever was confirmed is marked: unsent rows are exactly the undelivered ones.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let delivered = broker.inbox().event_ids();
    let unsent = db.unsent_ids().await;
    for id in &ids {
        assert!(
            delivered.contains(id) != unsent.contains(id),
            "{id}: delivered and marked must agree"
        );
    }
}

/// SIGTERM stops reading, but what was read still goes: RabbitMQ carries
/// one message of an aggregate at a time, so most of the first batch read
/// waits behind it when the signal comes, and all of it is delivered and
/// marked before the relay exits; what was not read stays unsent and
/// undelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_sends_what_was_read() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[
            ("relay.max_in_flight", "4"),
            ("source.batch_size", "500"),
            // Sending stops half-way: 20 s for 300 confirmations in turn,
            // on a loaded machine too.
            ("relay.shutdown_timeout", "\"40s\""),
        ],
    )
    .await;
    let ids = insert_many(&db, 300, "a").await;
    let mut child = ChildRelay::start(&toml);
    broker.inbox().wait_len(1, WAIT).await;
    let before = broker.inbox().len();
    assert_eq!(
        child.terminate().code(),
        Some(0),
        "graceful shutdown exits 0"
    );
    let unsent = db.unsent_ids().await;
    let marked: HashSet<String> = ids
        .iter()
        .filter(|id| !unsent.contains(*id))
        .cloned()
        .collect();
    broker.inbox().wait_len(marked.len(), WAIT).await;
    // Give a stray message, were there one, time to arrive.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let delivered = broker.inbox().event_ids();
    assert_eq!(
        delivered, marked,
        "what went is what was marked, and no more"
    );
    assert!(
        marked.len() > before,
        "{before} delivered at the signal and {} after the stop: what was read and waiting did not go",
        marked.len()
    );
}

/// A stop reads on to the end of a transaction it began sending. Without
/// marking the WAL is the only record, and the slot passes a transaction
/// only once all its events are confirmed: a stop that sent part of one
/// (a batch ends inside it) had the next owner send that part again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_sends_the_rest_of_a_transaction_it_began() {
    let (db, broker, toml) = setup(
        Mode::Cdc,
        Kind::Rabbit,
        &[],
        &[
            ("relay.mark", "\"none\""),
            ("relay.max_in_flight", "4"),
            ("source.batch_size", "10"),
            ("relay.shutdown_timeout", "\"20s\""),
        ],
    )
    .await;
    let relay = InProcess::start(parse(&toml));
    wait_streaming(&db.client, &slot_of(&toml)).await;
    let n = 100;
    // One transaction; RabbitMQ carries one message of an aggregate at a
    // time, so the stop comes while most of it is still to be read.
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'a', 'Happened', jsonb_build_object('i', g)
             FROM generate_series(1, $1) g",
            &[&(n as i32)],
        )
        .await
        .expect("one transaction");
    broker.inbox().wait_len(1, WAIT).await;
    let before = broker.inbox().len();
    let stopping = std::time::Instant::now();
    relay.stop().await;
    assert!(
        before < n,
        "the transaction went before the stop: nothing tested"
    );
    // Its commit ends a batch of its own: the stop does not wait out its
    // 10 s of sending for the rest of a transaction already whole.
    let took = stopping.elapsed();
    assert!(took < Duration::from_secs(8), "the stop took {took:?}");
    let sent = broker.inbox().wait_len(n, WAIT).await;
    let unique: HashSet<String> = sent.iter().map(Received::event_id).collect();
    assert_eq!(unique.len(), n, "each event of the transaction once");
    // The next owner starts past the transaction: a later event is all it sends.
    let relay = InProcess::start(parse(&toml));
    let later = Uuid::new_v4();
    db.insert(later, "order", "a", json!({"i": "later"})).await;
    broker.inbox().wait_ids(&[later.to_string()], WAIT).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        broker.inbox().len(),
        n + 1,
        "nothing of the transaction repeated"
    );
    relay.stop().await;
}

every_mode!(standby_takes_over_when_the_active_instance_dies);
async fn standby_takes_over_when_the_active_instance_dies(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let first = InProcess::start(parse(&toml));
    let before = insert_many(&db, 20, "a").await;
    broker.inbox().wait_ids(&before, WAIT).await;
    let second = InProcess::start(parse(&toml));
    let middle = insert_many(&db, 20, "a").await;
    broker.inbox().wait_ids(&middle, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        broker.inbox().len(),
        40,
        "two instances, yet every event once: one is a standby"
    );
    // The active one dies without a goodbye; its session, and lock, go with it.
    first.abort();
    let after = insert_many(&db, 20, "a").await;
    broker.inbox().wait_ids(&after, WAIT).await;
    second.stop().await;
}

every_mode!(terminated_database_sessions_are_survived);
async fn terminated_database_sessions_are_survived(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let relay = InProcess::start(parse(&toml));
    let first = insert_many(&db, 10, "a").await;
    broker.inbox().wait_ids(&first, WAIT).await;
    // An operator (or a failover) ends every relay session.
    let killed = db
        .count(&format!(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = 'outbox-relay' AND datname = '{}'",
            db.name
        ))
        .await;
    assert!(
        killed >= 2,
        "the relay had its reading and ownership sessions ({killed})"
    );
    let second = insert_many(&db, 10, "a").await;
    broker.inbox().wait_ids(&second, WAIT).await;
    db.wait_all_marked().await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn notify_wakes_the_relay_long_before_the_poll_interval() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[
            ("source.polling.notify", "true"),
            ("source.polling.poll_interval", "\"60s\""),
        ],
    )
    .await;
    let relay = InProcess::start(parse(&toml));
    // Let the first (empty) poll happen, so only a wake-up can bring the next.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for round in 0..3 {
        let id = insert_many(&db, 1, "a").await;
        let start = std::time::Instant::now();
        broker.inbox().wait_ids(&id, Duration::from_secs(10)).await;
        assert!(start.elapsed() < Duration::from_secs(10), "round {round}");
    }
    relay.stop().await;
}

every_mode!(a_crash_after_confirmation_before_marking_loses_nothing);
async fn a_crash_after_confirmation_before_marking_loses_nothing(mode: Mode, kind: Kind) {
    if !cfg!(feature = "failpoints") {
        panic!(
            "this test injects a crash through the `failpoints` feature: run the suite with --features failpoints (scripts/test.sh does)"
        );
    }
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let first = insert_many(&db, 40, "a").await;
    // The relay aborts right after the broker confirmed some events, before it records them.
    let mut child =
        ChildRelay::start_with_env(&toml, &[("OUTBOX_RELAY_FAILPOINT", "abort-before-ack:1")]);
    let status = child
        .wait_exit(WAIT)
        .expect("the failpoint aborts the relay");
    assert!(!status.success(), "aborted: {status:?}");
    // Some events were confirmed before the crash (the consumer may see them a moment later).
    broker.inbox().wait_len(1, WAIT).await;
    assert!(
        db.unsent().await > 0,
        "and some confirmed events were never marked"
    );
    let second = insert_many(&db, 10, "a").await;
    let mut child = ChildRelay::start(&toml);
    let all = [first, second].concat();
    let got = broker.inbox().wait_ids(&all, WAIT).await;
    db.wait_all_marked().await;
    assert_first_deliveries_in_order(&got, &all);
    assert!(
        got.len() - all.len() <= 200 + 500,
        "duplicates stay within the window and a batch"
    );
    assert_eq!(child.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_share_shards_evenly_and_take_over_a_dead_ones() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Kafka,
        &["order"],
        &[("relay.shards", "4")],
    )
    .await;
    let a = InProcess::start(parse(&set(
        &toml,
        "database.application_name",
        "\"relay-a\"",
    )));
    wait_for(WAIT, "the first instance to take every shard", || async {
        (db.shard_owners().await.get("relay-a") == Some(&4)).then_some(())
    })
    .await;
    let b = InProcess::start(parse(&set(
        &toml,
        "database.application_name",
        "\"relay-b\"",
    )));
    let split = wait_for(WAIT, "the shards to be shared two and two", || async {
        let owners = db.shard_owners().await;
        (owners.get("relay-a") == Some(&2) && owners.get("relay-b") == Some(&2)).then_some(owners)
    })
    .await;
    assert_eq!(split.len(), 2);
    // Events over many aggregates: each delivered once, in order per aggregate.
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for i in 0..200 {
        let id = Uuid::new_v4();
        let agg = format!("agg{}", i % 40);
        db.insert(id, "order", &agg, json!({"i": i})).await;
        expected.entry(agg).or_default().push(id.to_string());
    }
    let all: Vec<String> = expected.values().flatten().cloned().collect();
    let got = broker.inbox().wait_ids(&all, WAIT).await;
    assert_eq!(got.len(), 200, "no duplicates between instances");
    for (agg, ids) in &expected {
        let order: Vec<String> = got
            .iter()
            .map(Received::event_id)
            .filter(|id| ids.contains(id))
            .collect();
        assert_eq!(&order, ids, "{agg} in order");
    }
    // One instance dies: the other takes all four shards and carries on.
    a.abort();
    wait_for(WAIT, "the survivor to take every shard", || async {
        (db.shard_owners().await.get("relay-b") == Some(&4)).then_some(())
    })
    .await;
    let more = insert_many(&db, 20, "agg7").await;
    broker.inbox().wait_ids(&more, WAIT).await;
    b.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_with_different_shard_settings_never_publish_together() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Kafka, &["order"], &[]).await;
    // A whole-outbox instance is active.
    let whole = InProcess::start(parse(&set(
        &toml,
        "database.application_name",
        "\"relay-whole\"",
    )));
    let first = insert_many(&db, 10, "a").await;
    broker.inbox().wait_ids(&first, WAIT).await;
    // One with shards starts (a rolling change of relay.shards): it must wait.
    let sharded = set(
        &set(&toml, "relay.shards", "4"),
        "database.application_name",
        "\"relay-sharded\"",
    );
    let four = InProcess::start(parse(&sharded));
    // And one with another shard count must wait too, even after the whole one stops.
    let two = InProcess::start(parse(&set(
        &set(&toml, "relay.shards", "2"),
        "database.application_name",
        "\"relay-two\"",
    )));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let owners = db.shard_owners().await;
    assert_eq!(
        owners.get("relay-sharded"),
        None,
        "no shard taken beside a whole-outbox instance: {owners:?}"
    );
    assert_eq!(owners.get("relay-two"), None, "{owners:?}");
    let second = insert_many(&db, 10, "a").await;
    broker.inbox().wait_ids(&second, WAIT).await;
    whole.stop().await;
    // Exactly one shard setting wins; the other keeps waiting.
    let owners = wait_for(WAIT, "the sharded instances to take over", || async {
        let o = db.shard_owners().await;
        (o.get("relay-sharded") == Some(&4) || o.get("relay-two") == Some(&2)).then_some(o)
    })
    .await;
    assert_eq!(
        owners.len(),
        1,
        "instances with 4 and 2 shards never run together: {owners:?}"
    );
    let third = insert_many(&db, 10, "a").await;
    let got = broker.inbox().wait_ids(&third, WAIT).await;
    assert_eq!(got.len(), 30, "every event once");
    four.stop().await;
    two.stop().await;
}

/// A sharded instance that stops keeps the outbox until its shards are
/// drained: an instance without shards waiting meanwhile publishes only
/// after them, so nothing the stop still sends goes twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_sharded_instance_holds_the_outbox_until_its_shards_drained() {
    let sets = [
        ("relay.shards", "2"),
        ("source.batch_size", "6000"),
        ("relay.max_in_flight", "6000"),
        ("relay.shutdown_timeout", "\"50s\""),
    ];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &sets).await;
    // One aggregate: RabbitMQ carries its messages one at a time, so the
    // stop has most of the batch still to send, for longer than the lease
    // the instance without shards would wait before publishing (seconds).
    let n: i32 = 6_000;
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'a', 'Happened', jsonb_build_object('i', g)
             FROM generate_series(1, $1) g",
            &[&n],
        )
        .await
        .expect("the backlog");
    let sharded = InProcess::start(parse(&toml));
    broker.inbox().wait_len(1, WAIT).await;
    let whole = InProcess::start(parse(&set(&toml, "relay.shards", "1")));
    tokio::time::sleep(Duration::from_millis(500)).await;
    sharded.stop().await;
    let got = broker.inbox().wait_len(n as usize, WAIT).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let unique: HashSet<String> = got.iter().map(Received::event_id).collect();
    assert_eq!(
        (unique.len(), broker.inbox().len()),
        (n as usize, n as usize),
        "every event once"
    );
    whole.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_counts_in_other_databases_do_not_interfere() {
    // Two services on one server, each with its own database and an outbox of
    // the same name, sharded differently.
    let (db_a, broker_a, toml_a) =
        setup(Mode::Polling, Kind::Rabbit, &[], &[("relay.shards", "4")]).await;
    let (db_b, broker_b, toml_b) =
        setup(Mode::Polling, Kind::Rabbit, &[], &[("relay.shards", "2")]).await;
    // The first is running (registered as a member) before the second starts.
    let a = InProcess::start(parse(&toml_a));
    let ids_a = insert_many(&db_a, 20, "a").await;
    assert_eq!(broker_a.inbox().wait_ids(&ids_a, WAIT).await.len(), 20);
    let b = InProcess::start(parse(&toml_b));
    let ids_b = insert_many(&db_b, 20, "b").await;
    assert_eq!(broker_b.inbox().wait_ids(&ids_b, WAIT).await.len(), 20);
    a.stop().await;
    b.stop().await;
}

/// A panic outside the pipeline's tasks (a defect, injected here as a run
/// starts) stops the process with exit 1, for its supervisor to start it
/// again, instead of leaving a pipeline that relays nothing while its
/// health still says active. Started again, it delivers everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_stops_the_relay_with_exit_1_and_a_restart_delivers() {
    if !cfg!(feature = "failpoints") {
        panic!(
            "this test injects a panic through the `failpoints` feature: run the suite with --features failpoints"
        );
    }
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &[]).await;
    let events = insert_many(&db, 10, "a").await;
    let mut child = ChildRelay::start_with_env(
        &toml,
        &[("OUTBOX_RELAY_FAILPOINT", "panic-after-acquire:1")],
    );
    let status = child.wait_exit(WAIT).expect("the panic stops the relay");
    assert_eq!(status.code(), Some(1), "{status:?}");
    assert_eq!(db.unsent().await, 10, "nothing was relayed");
    let mut child = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&events, WAIT).await;
    db.wait_all_marked().await;
    assert_eq!(child.terminate().code(), Some(0));
}
