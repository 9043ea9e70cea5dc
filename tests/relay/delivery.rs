//! What consumers receive: envelope, order, completeness, refusals.

use crate::support::brokers::{KafkaTopics, RabbitExchange, Received};
use crate::support::*;
use serde_json::json;
use std::collections::{HashMap, HashSet};
use std::time::Duration;
use uuid::Uuid;

every_mode!(exact_envelope_and_headers);
async fn exact_envelope_and_headers(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(
        mode,
        kind,
        &["order"],
        &[("envelope.source", "\"/shop/orders\"")],
    )
    .await;
    let id = Uuid::new_v4();
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at)
             VALUES ($1, 'order', 'o-42', 'OrderPlaced', 2, '{\"total\": 12.5, \"items\": [1, 2]}',
                     '{\"traceparent\": \"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\", \"tenant\": \"acme\"}',
                     '2026-11-29 15:45:41.5+00')",
            &[&id],
        )
        .await
        .unwrap();
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_len(1, WAIT).await;
    let m = &got[0];
    assert_eq!(
        m.json(),
        json!({
            "specversion": "1.0",
            "id": id.to_string(),
            "source": "/shop/orders",
            "type": "OrderPlaced",
            "subject": "o-42",
            "time": "2026-11-29T15:45:41.500Z",
            "datacontenttype": "application/json",
            "aggregatetype": "order",
            "eventversion": 2,
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "data": {"total": 12.5, "items": [1, 2]}
        })
    );
    assert_eq!(m.header("event_id"), Some(id.to_string().as_str()));
    assert_eq!(m.header("event_type"), Some("OrderPlaced"));
    assert_eq!(m.header("event_version"), Some("2"));
    assert_eq!(m.header("aggregate_type"), Some("order"));
    assert_eq!(m.header("tenant"), Some("acme"));
    assert_eq!(
        m.header("traceparent"),
        Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
    );
    match &broker {
        Broker::Kafka(k) => {
            assert_eq!(m.key.as_deref(), Some("o-42"));
            assert_eq!(m.destination, k.topic("order"));
            assert_eq!(
                m.header("content-type"),
                Some("application/cloudevents+json; charset=utf-8")
            );
        }
        Broker::Rabbit(_) => {
            assert_eq!(m.destination, "order.OrderPlaced", "default routing key");
            assert_eq!(m.property("message_id"), Some(id.to_string().as_str()));
            assert_eq!(
                m.property("content_type"),
                Some("application/cloudevents+json; charset=utf-8")
            );
            assert_eq!(m.property("type"), Some("OrderPlaced"));
            assert_eq!(m.property("delivery_mode"), Some("2"), "persistent");
            assert_eq!(m.property("timestamp"), Some("1795967141"));
        }
    }
    wait_for(WAIT, "the row to be marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;
}

both_brokers!(binary_mode_carries_the_raw_payload);
async fn binary_mode_carries_the_raw_payload(mode: Mode, kind: Kind) {
    let (db, broker, toml) =
        setup(mode, kind, &["order"], &[("envelope.mode", "\"binary\"")]).await;
    let id = Uuid::new_v4();
    db.insert(id, "order", "o-1", json!({"n": 1})).await;
    let relay = InProcess::start(parse(&toml));
    let m = &broker.inbox().wait_len(1, WAIT).await[0];
    assert_eq!(m.json(), json!({"n": 1}));
    // Each broker's CloudEvents binding names the attributes its own way.
    let (prefix, other) = match kind {
        Kind::Kafka => ("ce_", "cloudEvents:"),
        Kind::Rabbit => ("cloudEvents:", "ce_"),
    };
    let attr = |name: &str| m.header(&format!("{prefix}{name}"));
    assert_eq!(attr("id"), Some(id.to_string().as_str()));
    assert_eq!(attr("type"), Some("Happened"));
    assert_eq!(attr("subject"), Some("o-1"));
    assert_eq!(attr("specversion"), Some("1.0"));
    assert_eq!(attr("eventversion"), Some("1"));
    assert_eq!(attr("aggregatetype"), Some("order"));
    assert_eq!(
        m.header(&format!("{other}id")),
        None,
        "one binding's names only"
    );
    relay.stop().await;
}

every_mode!(rolled_back_rows_are_never_published);
async fn rolled_back_rows_are_never_published(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let relay = InProcess::start(parse(&toml));
    let committed = ids(20);
    let mut rolled_back = Vec::new();
    for (i, id) in committed.iter().enumerate() {
        let mut c = connect(&db.url).await;
        let tx = c.transaction().await.unwrap();
        let doomed = Uuid::new_v4();
        tx.execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'Doomed', '{}')",
            &[&doomed, &format!("a{i}")],
        )
        .await
        .unwrap();
        // Let the relay poll while the doomed row is uncommitted.
        tokio::time::sleep(Duration::from_millis(10)).await;
        tx.rollback().await.unwrap();
        rolled_back.push(doomed.to_string());
        db.insert(*id, "order", &format!("a{i}"), json!({"i": i}))
            .await;
    }
    broker.inbox().wait_ids(&strings(&committed), WAIT).await;
    // Give a wrongly published row time to show up before concluding.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = broker.inbox().event_ids();
    for id in &rolled_back {
        assert!(!got.contains(id), "rolled-back event {id} was published");
    }
    assert_eq!(got.len(), committed.len());
    relay.stop().await;
}

every_mode!(commits_out_of_sequence_order_are_not_skipped);
async fn commits_out_of_sequence_order_are_not_skipped(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &[]).await;
    let relay = InProcess::start(parse(&toml));
    // A long transaction takes the lower sequence value, and commits last.
    let mut slow = connect(&db.url).await;
    let slow_tx = slow.transaction().await.unwrap();
    let slow_id = Uuid::new_v4();
    slow_tx
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'slow', 'E', '{}')",
            &[&slow_id],
        )
        .await
        .unwrap();
    let fast = ids(5);
    for id in &fast {
        db.insert(*id, "order", "fast", json!({})).await;
    }
    broker.inbox().wait_ids(&strings(&fast), WAIT).await;
    // Several poll intervals pass with the slow row still in progress.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(broker.inbox().len(), 5);
    slow_tx.commit().await.unwrap();
    broker.inbox().wait_ids(&[slow_id.to_string()], WAIT).await;
    let seq: i64 = db
        .client
        .query_one("SELECT relay_seq FROM outbox WHERE id = $1", &[&slow_id])
        .await
        .unwrap()
        .get(0);
    let max_fast: i64 = db
        .count("SELECT max(relay_seq) FROM outbox WHERE aggregate_id = 'fast'")
        .await;
    assert!(
        seq < max_fast,
        "the slow row really had the lower sequence value"
    );
    db.wait_all_marked().await;
    relay.stop().await;
}

every_mode!(per_aggregate_order_under_concurrent_writers);
async fn per_aggregate_order_under_concurrent_writers(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["account"], &[("source.batch_size", "50")]).await;
    db.client
        .batch_execute(
            "CREATE TABLE accounts (id text PRIMARY KEY, version int NOT NULL);
             INSERT INTO accounts SELECT 'acc' || g, 0 FROM generate_series(0, 19) g;",
        )
        .await
        .unwrap();
    let relay = InProcess::start(parse(&toml));
    let writers = 8;
    let per_writer = 60;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let url = db.url.clone();
        tasks.push(tokio::spawn(async move {
            let mut c = connect(&url).await;
            for i in 0..per_writer {
                let account = format!("acc{}", (w * 7 + i * 3) % 20);
                let tx = c.transaction().await.unwrap();
                // The application's own serialisation: lock the aggregate, bump its version.
                let version: i32 = tx
                    .query_one("UPDATE accounts SET version = version + 1 WHERE id = $1 RETURNING version", &[&account])
                    .await
                    .unwrap()
                    .get(0);
                tx.execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES (gen_random_uuid(), 'account', $1, 'Changed', jsonb_build_object('version', $2::int))",
                    &[&account, &version],
                )
                .await
                .unwrap();
                if i % 5 == 0 {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
                tx.commit().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let total = writers * per_writer;
    let got = broker
        .inbox()
        .wait_len(total, Duration::from_secs(60))
        .await;
    let mut last: HashMap<String, i64> = HashMap::new();
    let mut seen = HashSet::new();
    for m in &got {
        let body = m.json();
        if !seen.insert(body["id"].as_str().unwrap().to_owned()) {
            continue; // a duplicate; order is judged on first deliveries
        }
        let account = body["subject"].as_str().unwrap().to_owned();
        let version = body["data"]["version"].as_i64().unwrap();
        let prev = last.insert(account.clone(), version).unwrap_or(0);
        assert_eq!(
            version,
            prev + 1,
            "{account}: version {version} arrived after {prev}"
        );
    }
    assert_eq!(seen.len(), total);
    relay.stop().await;
}

every_mode!(a_missing_destination_keeps_rows_unsent_until_it_exists);
async fn a_missing_destination_keeps_rows_unsent_until_it_exists(mode: Mode, kind: Kind) {
    // Kafka: the "late" topic is not created yet. RabbitMQ: the exchange is not declared yet.
    let db = TestDb::new().await;
    let (sink, late_rabbit, kafka) = match kind {
        Kind::Kafka => {
            let k = KafkaTopics::new();
            k.create("ready").await;
            (k.sink_toml(), None, Some(k))
        }
        Kind::Rabbit => {
            let r = RabbitExchange::with_name(&unique("t"), false).await;
            (r.sink_toml(), Some(r), None)
        }
    };
    // Retried until the destination exists (not dead-lettered: that has its own tests).
    let toml = set(
        &with_mode(&base_toml(&db.url, &sink), mode),
        "dead_letter.enabled",
        "false",
    );
    db.migrate(&parse(&toml)).await;
    let late = ids(3);
    for id in &late {
        db.insert(*id, "late", "l-1", json!({})).await;
    }
    let ready = Uuid::new_v4();
    db.insert(ready, "ready", "r-1", json!({})).await;
    let relay = InProcess::start(parse(&toml));
    if let Some(k) = &kafka {
        // Other destinations keep flowing while one is missing.
        k.inbox.wait_ids(&[ready.to_string()], WAIT).await;
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let unsent = db.unsent().await;
    match kind {
        Kind::Kafka => assert_eq!(unsent, 3, "the rows for the missing topic stay unsent"),
        Kind::Rabbit => assert_eq!(unsent, 4, "nothing is sent while the exchange is missing"),
    }
    // The operator creates the destination; the relay retries and delivers in order.
    let inbox = match (&kafka, &late_rabbit) {
        (Some(k), _) => {
            k.create("late").await;
            k.inbox.clone()
        }
        (_, Some(r)) => {
            r.declare().await;
            r.inbox.clone()
        }
        _ => unreachable!(),
    };
    let got = inbox.wait_ids(&strings(&late), WAIT).await;
    let order: Vec<String> = got
        .iter()
        .map(Received::event_id)
        .filter(|id| strings(&late).contains(id))
        .collect();
    assert_eq!(
        &order[..3],
        &strings(&late)[..],
        "retried events keep their order"
    );
    db.wait_all_marked().await;
    relay.stop().await;
}

every_mode!(bad_rows_are_refused_and_other_aggregates_flow);
async fn bad_rows_are_refused_and_other_aggregates_flow(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(
        mode,
        kind,
        &["order"],
        &[
            ("source.batch_size", "10"),
            ("sink.message_max_bytes", "10000"),
            // Held and retried (dead-lettering has its own tests).
            ("dead_letter.enabled", "false"),
        ],
    )
    .await;
    let bad = [
        // An aggregate_type that makes an invalid topic / exchange-safe but invalid Kafka name.
        (
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'bad type!', 'b1', 'E', '{}')",
            "b1",
        ),
        // Larger than sink.message_max_bytes.
        (
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', 'b2', 'E', jsonb_build_object('x', repeat('x', 20000)))",
            "b2",
        ),
        // An empty aggregate_id.
        (
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', '', 'E', '{}')",
            "",
        ),
        // Headers that are not an object of strings.
        (
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers) VALUES ($1, 'order', 'b4', 'E', '{}', '{\"n\": 1}')",
            "b4",
        ),
    ];
    let mut bad_ids = Vec::new();
    for (sql, _) in bad {
        let id = Uuid::new_v4();
        db.client.execute(sql, &[&id]).await.unwrap();
        bad_ids.push(id.to_string());
    }
    // A later event of a refused aggregate waits behind it.
    let blocked_follower = Uuid::new_v4();
    db.insert(blocked_follower, "order", "b2", json!({})).await;
    let good = ids(10);
    for (i, id) in good.iter().enumerate() {
        db.insert(*id, "order", &format!("g{i}"), json!({"i": i}))
            .await;
    }
    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_ids(&strings(&good), WAIT).await;
    // Several retry rounds pass; the bad rows (and the follower) stay unsent, the relay stays up.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let got = broker.inbox().event_ids();
    let mut unsent_expected = bad_ids.clone();
    unsent_expected.push(blocked_follower.to_string());
    if matches!(kind, Kind::Rabbit) {
        // "bad type!" is a valid routing key for RabbitMQ (only the exchange is templated).
        unsent_expected.remove(0);
    }
    for id in &unsent_expected {
        assert!(!got.contains(id), "{id} should not have been published");
    }
    let unsent = db.unsent_ids().await;
    for id in &unsent_expected {
        assert!(unsent.contains(id), "{id} must stay unsent in the outbox");
    }
    assert_eq!(unsent.len(), unsent_expected.len());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_debezium_style_table_works_through_a_column_mapping() {
    let db = TestDb::new().await;
    let broker = KafkaTopics::new();
    broker.create("Order").await;
    db.client
        .batch_execute(
            "CREATE TABLE outboxevent (
                 id uuid PRIMARY KEY,
                 aggregatetype varchar(255) NOT NULL,
                 aggregateid varchar(255) NOT NULL,
                 type varchar(255) NOT NULL,
                 payload jsonb
             )",
        )
        .await
        .unwrap();
    let toml = format!(
        "{}\n[outbox]\ntable = \"outboxevent\"\n[outbox.columns]\naggregate_type = \"aggregatetype\"\naggregate_id = \"aggregateid\"\nevent_type = \"type\"\n",
        base_toml(&db.url, &broker.sink_toml())
    );
    db.migrate(&parse(&toml)).await;
    let names: Vec<String> = db
        .client
        .query("SELECT column_name::text FROM information_schema.columns WHERE table_name = 'outboxevent' ORDER BY ordinal_position", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        names,
        [
            "id",
            "aggregatetype",
            "aggregateid",
            "type",
            "payload",
            "relay_seq",
            "relay_xid",
            "relay_sent_at"
        ],
        "migrate adds only the relay's columns"
    );
    let id = Uuid::new_v4();
    // The application's INSERT is unchanged: it names only its own columns.
    db.client
        .execute(
            "INSERT INTO outboxevent (id, aggregatetype, aggregateid, type, payload) VALUES ($1, 'Order', '7', 'OrderCreated', '{\"n\": 7}')",
            &[&id],
        )
        .await
        .unwrap();
    let relay = InProcess::start(parse(&toml));
    let m = &broker.inbox.wait_len(1, WAIT).await[0];
    let body = m.json();
    assert_eq!(body["id"], id.to_string());
    assert_eq!(body["type"], "OrderCreated");
    assert_eq!(body["subject"], "7");
    assert_eq!(body["aggregatetype"], "Order");
    assert_eq!(
        body["eventversion"], 1,
        "absent event_version defaults to 1"
    );
    assert_eq!(body["data"], json!({"n": 7}));
    assert!(body["time"].as_str().is_some_and(|t| t.ends_with('Z')));
    assert_eq!(m.destination, broker.topic("Order"));
    wait_for(WAIT, "the row marked", || async {
        (db.count("SELECT count(*) FROM outboxevent WHERE relay_sent_at IS NULL")
            .await
            == 0)
            .then_some(())
    })
    .await;
    relay.stop().await;
}
