//! What only the CDC source has: slots, WAL retention, start-up reads,
//! large transactions, server restarts, and their errors. A backlog at
//! start-up, and transactions open across it, are in cdc_backlog.rs.

use crate::kit::cluster::PrivatePg;
use crate::support::brokers::{KafkaTopics, Received, first_ids};
use crate::support::*;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

pub fn cdc_toml(db_url: &str, sink: &str) -> String {
    with_mode(&base_toml(db_url, sink), Mode::Cdc)
}

async fn slot_lag(db: &TestDb, slot: &str) -> Option<i64> {
    db.client
        .query_opt(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rows_written_before_the_slot_existed_are_published_once() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("order").await;
    // The table exists (migrated for polling, so no slot yet) and has events.
    let polling = base_toml(&db.url, &broker.sink_toml());
    db.migrate(&parse(&polling)).await;
    let early: Vec<String> = strings(&ids(25));
    for id in &early {
        db.insert(id.parse().unwrap(), "order", "a", json!({}))
            .await;
    }
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let slot = slot_of(&toml);
    db.migrate(&parse(&toml)).await; // adds the publication and the slot
    assert!(
        slot_lag(&db, &slot).await.is_some(),
        "migrate created the slot"
    );
    let relay = InProcess::start(parse(&toml));
    broker.inbox.wait_ids(&early, WAIT).await;
    let late: Vec<String> = strings(&ids(25));
    for id in &late {
        db.insert(id.parse().unwrap(), "order", "a", json!({}))
            .await;
    }
    let got = broker.inbox.wait_ids(&late, WAIT).await;
    assert_eq!(
        got.len(),
        50,
        "the start-up read and the stream do not overlap"
    );
    let order: Vec<String> = got.iter().map(Received::event_id).collect();
    assert_eq!(
        order,
        [early, late].concat(),
        "one aggregate, in commit order"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_transaction_is_streamed_in_bounded_batches() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("bulk").await;
    let toml = set(
        &cdc_toml(&db.url, &broker.sink_toml()),
        "relay.max_in_flight",
        "1000",
    );
    let slot = slot_of(&toml);
    db.migrate(&parse(&toml)).await;
    let relay = InProcess::start(parse(&toml));
    let n = 50_000;
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'bulk', 'agg' || (g % 100), 'Imported', jsonb_build_object('n', g)
             FROM generate_series(1, $1) g",
            &[&n],
        )
        .await
        .unwrap();
    let got = broker
        .inbox
        .wait_len(n as usize, Duration::from_secs(180))
        .await;
    let unique: HashSet<String> = got.iter().map(Received::event_id).collect();
    assert_eq!(unique.len(), n as usize);
    wait_for(WAIT, "the slot to pass the transaction", || async {
        (slot_lag(&db, &slot).await.unwrap_or(i64::MAX) < 1024 * 1024).then_some(())
    })
    .await;
    db.wait_all_marked().await;
    relay.stop().await;
}

/// Transactions that reached the relay while it was not reading (here:
/// stopped with SIGSTOP, as a busy relay falls behind) are handed to the
/// pipeline together, not one hand-over per transaction; each still
/// arrives once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_waiting_in_the_stream_are_handed_over_together() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("burst").await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    db.migrate(&parse(&toml)).await;
    let (mut relay, port) = ChildRelay::serving(&toml);
    let insert = "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ($1, 'burst', 'one', 'E', '{}')";
    let first = Uuid::new_v4();
    db.client.execute(insert, &[&first]).await.unwrap();
    broker.inbox.wait_len(1, WAIT).await;
    let paused = Paused::pause(relay.pid());
    let n = 1_000;
    let mut ids = vec![first.to_string()];
    for _ in 0..n {
        let id = Uuid::new_v4();
        db.client.execute(insert, &[&id]).await.unwrap();
        ids.push(id.to_string());
    }
    paused.resume();
    broker.inbox.wait_len(n + 1, Duration::from_secs(120)).await;
    assert_eq!(
        broker.inbox.ids_in_order(),
        ids,
        "each once, in commit order"
    );
    let series = "outbox_relay_batch_size_count{pipeline=\"default\"}";
    let (_, body) = http_get(port, "/metrics").await.expect("a scrape");
    let batches = metric(&body, series).expect("the batch-size histogram");
    // One hand-over per transaction would be 1,001 batches.
    assert!(
        batches <= (n / 4) as f64,
        "{batches} batches for {} one-event transactions",
        n + 1
    );
    relay.terminate();
}

/// With `source.cdc.batch_wait`, a committed transaction waits that long
/// for later ones to join its hand-over: a lone one still goes (after the
/// wait), transactions committed one after another share hand-overs, and
/// each arrives once, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_within_the_batch_wait_are_handed_over_together() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("gather").await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let toml = set(&toml, "source.cdc.batch_wait", "\"100ms\"");
    db.migrate(&parse(&toml)).await;
    let (mut relay, port) = ChildRelay::serving(&toml);
    let insert = "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                  VALUES ($1, 'gather', 'one', 'E', '{}')";
    let first = Uuid::new_v4();
    db.client.execute(insert, &[&first]).await.unwrap();
    broker.inbox.wait_len(1, WAIT).await;
    let series = "outbox_relay_batch_size_count{pipeline=\"default\"}";
    let batches = || async {
        let (_, body) = http_get(port, "/metrics").await.expect("a scrape");
        metric(&body, series).expect("the batch-size histogram")
    };
    let before = batches().await;
    let n = 20;
    let mut ids = vec![first.to_string()];
    for _ in 0..n {
        let id = Uuid::new_v4();
        db.client.execute(insert, &[&id]).await.unwrap();
        ids.push(id.to_string());
    }
    broker.inbox.wait_len(n + 1, WAIT).await;
    assert_eq!(
        broker.inbox.ids_in_order(),
        ids,
        "each once, in commit order"
    );
    let handed_over = batches().await - before;
    // One hand-over per transaction would be 20.
    assert!(
        handed_over <= (n / 2) as f64,
        "{handed_over} hand-overs for {n} one-event transactions"
    );
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_outbox_on_a_busy_database_does_not_pin_wal() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("order").await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let slot = slot_of(&toml);
    db.migrate(&parse(&toml)).await;
    let relay = InProcess::start(parse(&toml));
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    broker.inbox.wait_ids(&[id.to_string()], WAIT).await;
    // An hour of other traffic, compressed: ~48 MiB of WAL the outbox has no part in.
    db.client
        .batch_execute("CREATE TABLE busy (id bigserial, pad text)")
        .await
        .unwrap();
    for _ in 0..12 {
        db.client
            .batch_execute(
                "INSERT INTO busy (pad) SELECT repeat('x', 1000) FROM generate_series(1, 4000)",
            )
            .await
            .unwrap();
    }
    let lag = wait_for(WAIT, "the idle slot to follow the WAL", || async {
        let lag = slot_lag(&db, &slot).await.unwrap_or(i64::MAX);
        (lag < 2 * 1024 * 1024).then_some(lag)
    })
    .await;
    assert!(lag < 2 * 1024 * 1024, "retained {lag} bytes");
    relay.stop().await;
}

pub async fn flushed(app: &tokio_postgres::Client, slot: String) -> outbox_relay::replication::Lsn {
    slot_position(app, &slot, "confirmed_flush_lsn").await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_heartbeat_moves_the_slot_of_an_idle_database() {
    let pg = PrivatePg::start(&["wal_level = logical"]);
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let app = connect(&pg.url("app")).await;
    let broker = KafkaTopics::new();
    let toml = set(
        &cdc_toml(&pg.url("app"), &broker.sink_toml()),
        "source.cdc.heartbeat_interval",
        "\"1s\"",
    );
    let slot = slot_of(&toml);
    let config = parse(&toml);
    migrate_at(&pg.url("app"), &config).await;
    let relay = InProcess::start(config);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let first = flushed(&app, slot.clone()).await;
    // Nothing else happens in this cluster: only the heartbeat writes WAL.
    let moved = wait_for(
        Duration::from_secs(20),
        "the slot to move on heartbeats",
        || {
            let app = &app;
            let slot = slot.clone();
            async move {
                let now = flushed(app, slot).await;
                (now > first).then_some(now)
            }
        },
    )
    .await;
    assert!(moved > first);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_restart_mid_stream_loses_nothing() {
    let pg = PrivatePg::start(&["wal_level = logical"]);
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let broker = KafkaTopics::new();
    broker.create("order").await;
    let toml = cdc_toml(&pg.url("app"), &broker.sink_toml());
    let config = parse(&toml);
    migrate_at(&pg.url("app"), &config).await;
    let relay = InProcess::start(config);
    // A writer that reconnects through the restart and records what committed.
    let url = pg.url("app");
    let writer = tokio::spawn(async move {
        let mut committed = Vec::new();
        let mut client: Option<tokio_postgres::Client> = None;
        let start = std::time::Instant::now();
        let mut i = 0;
        while committed.len() < 300 && start.elapsed() < Duration::from_secs(60) {
            if client.as_ref().is_none_or(|c| c.is_closed()) {
                client = match tokio_postgres::connect(&url, tokio_postgres::NoTls).await {
                    Ok((c, conn)) => {
                        tokio::spawn(conn);
                        Some(c)
                    }
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
            }
            let id = Uuid::new_v4();
            let ok = client
                .as_ref()
                .unwrap()
                .execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'a', 'E', $2)",
                    &[&id, &json!({"i": i})],
                )
                .await
                .is_ok();
            if ok {
                committed.push(id.to_string());
            }
            i += 1;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        committed
    });
    tokio::time::sleep(Duration::from_millis(1200)).await;
    pg.restart();
    let committed = writer.await.unwrap();
    assert!(committed.len() >= 300);
    let got = broker
        .inbox
        .wait_ids(&committed, Duration::from_secs(60))
        .await;
    // One aggregate: its first deliveries follow commit order.
    assert_eq!(first_ids(&got), committed);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wal_level_replica_is_refused_with_the_fix() {
    let pg = PrivatePg::start(&["wal_level = replica"]);
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    );
    let toml = cdc_toml(&pg.url("app"), &sink);
    let dir = std::env::temp_dir().join(unique("outbox-relay-cdc-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("relay.toml");
    std::fs::write(&path, &toml).unwrap();
    let path = path.to_str().unwrap();
    let (code, out, err) = run_cli(&["migrate", "--config", path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("wal_level is \"replica\"")
            && err.contains("ALTER SYSTEM SET wal_level = logical"),
        "{err}"
    );
    let (code, out, _) = run_cli(&["check", "--config", path], &[]);
    assert_eq!(code, 1);
    assert!(out.contains("[FAIL] wal_level"), "{out}");
    assert!(out.contains("[FAIL] publication"), "{out}");
}

/// A private server whose CDC slot for `toml`'s outbox is lost, with ten
/// events committed while no relay ran.
struct LostSlot {
    _pg: PrivatePg,
    app: tokio_postgres::Client,
    broker: KafkaTopics,
    toml: String,
    slot: String,
    waiting: Vec<String>,
}

impl LostSlot {
    async fn new(relay: &[(&str, &str)]) -> LostSlot {
        // Tiny WAL segments and retention, so a slot can be lost in seconds.
        let pg = cluster_that_loses_slots();
        let admin = connect(&pg.url("postgres")).await;
        admin.batch_execute("CREATE DATABASE app").await.unwrap();
        let app = connect(&pg.url("app")).await;
        let broker = KafkaTopics::new();
        broker.create("order").await;
        let mut toml = cdc_toml(&pg.url("app"), &broker.sink_toml());
        for (key, value) in relay {
            toml = set(&toml, key, value);
        }
        let slot = slot_of(&toml);
        migrate_at(&pg.url("app"), &parse(&toml)).await;
        // Events arrive while no relay runs; then enough WAL passes for the slot to be lost.
        let waiting: Vec<String> = strings(&ids(10));
        for id in &waiting {
            insert_at(&app, id).await;
        }
        lose_slot(&app, &slot, Duration::from_secs(60)).await;
        LostSlot {
            _pg: pg,
            app,
            broker,
            toml,
            slot,
            waiting,
        }
    }

    fn check(&self) -> (i32, String) {
        let (code, out, _) = run_cli(&["check", "--config", &config_file(&self.toml)], &[]);
        (code, out)
    }
}

async fn insert_at(app: &tokio_postgres::Client, id: &str) {
    app.execute(
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'a', 'E', '{}')",
        &[&id.parse::<Uuid>().unwrap()],
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_is_recreated_and_nothing_is_lost() {
    let lost = LostSlot::new(&[]).await;
    let (code, out) = lost.check();
    assert_eq!(
        code, 0,
        "a lost slot the relay recreates is a warning: {out}"
    );
    assert!(
        out.contains("[warn] slot") && out.contains("is lost") && out.contains("recreate"),
        "{out}"
    );
    let (mut relay, port) = ChildRelay::serving(&lost.toml);
    let got = lost.broker.inbox.wait_ids(&lost.waiting, WAIT).await;
    assert_eq!(
        got.len(),
        lost.waiting.len(),
        "the lost WAL's events came from the table"
    );
    // The new slot streams: an event committed now arrives too.
    let later = Uuid::new_v4().to_string();
    insert_at(&lost.app, &later).await;
    lost.broker
        .inbox
        .wait_ids(std::slice::from_ref(&later), WAIT)
        .await;
    assert_ne!(
        wal_status(&lost.app, &lost.slot).await.as_deref(),
        Some("lost")
    );
    let series = "outbox_relay_slots_recreated_total{pipeline=\"default\"}";
    wait_for(WAIT, "the metric to count the recreated slot", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        (metric(&body, series) == Some(1.0)).then_some(())
    })
    .await;
    relay.terminate();
    let ids = lost.broker.inbox.ids_in_order();
    assert_eq!(ids.len(), 11, "each event once: {ids:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_slot_stops_the_relay_when_told_to_until_it_is_dropped() {
    let lost = LostSlot::new(&[("source.cdc.on_lost_slot", "\"stop\"")]).await;
    let (code, out) = lost.check();
    assert_eq!(code, 1);
    assert!(
        out.contains("[FAIL] slot")
            && out.contains("is lost")
            && out.contains("pg_drop_replication_slot"),
        "{out}"
    );
    let (mut relay, port) = ChildRelay::serving(&lost.toml);
    wait_for(WAIT, "readiness to name the lost slot", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 503 && body.contains("is lost")).then_some(())
    })
    .await;
    assert_eq!(
        lost.broker.inbox.len(),
        0,
        "nothing is published from a lost slot"
    );
    // The documented recovery: drop the slot; the running relay makes a new
    // one and publishes the unsent rows from the table first.
    drop_lost_slot(&lost.app, &lost.slot).await;
    let got = lost.broker.inbox.wait_ids(&lost.waiting, WAIT).await;
    assert_eq!(got.len(), lost.waiting.len());
    relay.terminate();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_busy_with_another_process_is_waited_for() {
    use outbox_relay::replication::protocol::{ReplicationClient, publication_names};
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("order").await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let slot = slot_of(&toml);
    let config = parse(&toml);
    db.migrate(&config).await;
    // Another process streams from the slot (a stale session, an operator's tool).
    let pg = outbox_relay::db::pg_config(&config.database).unwrap();
    let other = ReplicationClient::connect(&pg, &config.database.tls())
        .await
        .unwrap();
    let publication = config.source.cdc.publication_name(&config.outbox.table);
    let names = publication_names(&[&publication]);
    let stream = other
        .start_logical_replication(
            &slot,
            Default::default(),
            &[("proto_version", "1"), ("publication_names", &names)],
        )
        .await
        .unwrap();
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    let relay = InProcess::start(config);
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        broker.inbox.len(),
        0,
        "the relay waits while the slot is busy (55006)"
    );
    assert_eq!(
        db.unsent().await,
        1,
        "nothing is read from the table either"
    );
    drop(stream);
    broker.inbox.wait_ids(&[id.to_string()], WAIT).await;
    relay.stop().await;
}
