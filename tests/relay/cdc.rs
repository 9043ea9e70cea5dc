//! What only the CDC source has: slots, WAL retention, start-up reads,
//! large transactions, server restarts, and their errors.

use crate::kit::cluster::PrivatePg;
use crate::support::brokers::{KafkaTopics, RabbitExchange, Received};
use crate::support::*;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;
use uuid::Uuid;

fn cdc_toml(db_url: &str, sink: &str) -> String {
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
    wait_for(WAIT, "all rows marked", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;
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

async fn flushed(app: &tokio_postgres::Client, slot: String) -> outbox_relay::replication::Lsn {
    let lsn: String = app
        .query_one(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .get(0);
    lsn.parse().unwrap()
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
    let mut seen = HashSet::new();
    let firsts: Vec<String> = got
        .iter()
        .map(Received::event_id)
        .filter(|id| seen.insert(id.clone()))
        .collect();
    assert_eq!(firsts, committed);
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_without_relay_seq_is_refused_while_marking() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("order").await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let config = parse(&toml);
    db.migrate(&config).await;
    // An operator narrowed the publication to the application's columns.
    let publication = config.source.cdc.publication_name(&config.outbox.table);
    db.client
        .batch_execute(&format!(
            "ALTER PUBLICATION {publication} SET TABLE outbox \
             (id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at)"
        ))
        .await
        .unwrap();
    let port = crate::kit::free_port();
    let mut relay = ChildRelay::start(&with_http(&toml, port));
    // Streamed (not read at start-up): inserted once the relay is streaming.
    let slot = slot_of(&toml);
    wait_for(WAIT, "the relay to start streaming", || async {
        let active: bool = db
            .client
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .ok()?
            .get(0);
        active.then_some(())
    })
    .await;
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    let body = wait_for(WAIT, "readiness to name the missing column", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 503 && body.contains("relay_seq")).then_some(body)
    })
    .await;
    assert!(body.contains("column list"), "says what to fix: {body}");
    assert_eq!(db.unsent().await, 1, "the row stays unsent");
    relay.terminate();
    assert!(
        !broker
            .inbox
            .snapshot()
            .iter()
            .any(|r| r.event_id() == id.to_string()),
        "nothing was published that could not be marked"
    );
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
        app.batch_execute("CREATE TABLE filler (pad text)")
            .await
            .unwrap();
        wait_for(Duration::from_secs(60), "the slot to be lost", || async {
            app.batch_execute("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 3000); SELECT pg_switch_wal(); CHECKPOINT;")
                .await
                .unwrap();
            (wal_status(&app, &slot).await.as_deref() == Some("lost")).then_some(())
        })
        .await;
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
    let port = crate::kit::free_port();
    let mut relay = ChildRelay::start(&with_http(&lost.toml, port));
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
    let ids: Vec<String> = lost
        .broker
        .inbox
        .snapshot()
        .iter()
        .map(|m| m.event_id())
        .collect();
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
    let port = crate::kit::free_port();
    let mut relay = ChildRelay::start(&with_http(&lost.toml, port));
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
    assert_eq!(
        wal_status(&lost.app, &lost.slot).await.as_deref(),
        Some("lost"),
        "the slot is left alone"
    );
    // The documented recovery: drop the slot; the running relay makes a new
    // one and publishes the unsent rows from the table first.
    lost.app
        .execute("SELECT pg_drop_replication_slot($1)", &[&lost.slot])
        .await
        .unwrap();
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
    let backlog_end: String = db
        .client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    let backlog_end: outbox_relay::replication::Lsn = backlog_end.parse().unwrap();
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
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = set(
        &cdc_toml(&db.url, &broker.sink_toml()),
        "relay.max_in_flight",
        "200",
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
                "SELECT count(*) FROM outbox WHERE relay_sent_at IS NULL AND relay_seq <= {last_early}"
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
