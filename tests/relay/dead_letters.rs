//! Poison events: dead-lettered with their reason, never dropped; their
//! aggregate follows them or waits; other aggregates flow; `dlq` resolves them.

use crate::support::brokers::{RabbitExchange, Received};
use crate::support::*;
use serde_json::{Value, json};
use std::time::Duration;
use uuid::Uuid;

/// Quick retries and dead-lettering after two refusals; a 4 KB message limit.
pub fn poison_settings(policy: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("dead_letter.max_attempts", "2"),
        ("dead_letter.aggregate", policy),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
        ("sink.message_max_bytes", "4000"),
    ]
}

pub async fn insert_big(db: &TestDb, id: Uuid, aggregate: &str) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, 'order', $2, 'Big', jsonb_build_object('x', repeat('x', 8000)))",
            &[&id, &aggregate],
        )
        .await
        .unwrap();
}

pub fn dlq_list(path: &str) -> Vec<Value> {
    let (code, out, err) = run_cli(&["dlq", "list", "--config", path, "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A poison event of aggregate `P`, then three followers of the same aggregate.
async fn poison_and_followers(db: &TestDb) -> (Uuid, Vec<Uuid>) {
    let poison = Uuid::new_v4();
    insert_big(db, poison, "P").await;
    let followers = ids(3);
    for id in &followers {
        db.insert(*id, "order", "P", json!({})).await;
    }
    (poison, followers)
}

/// `outbox-relay dlq redrive --id <id>`: (exit code, stdout, stderr).
fn redrive_one(path: &str, id: &str) -> (i32, String, String) {
    run_cli(&["dlq", "redrive", "--config", path, "--id", id], &[])
}

/// Waits until `n` events are dead-lettered.
pub async fn wait_dead_letters(path: &str, n: usize, what: &str) {
    wait_for(WAIT, what, || async {
        (dlq_list(path).len() == n).then_some(())
    })
    .await;
}

every_mode!(a_poison_event_is_dead_lettered_and_its_aggregate_follows);
async fn a_poison_event_is_dead_lettered_and_its_aggregate_follows(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &poison_settings("\"follow\"")).await;
    let path = config_file(&toml);
    let (poison, followers) = poison_and_followers(&db).await;
    let others = ids(10);
    for (i, id) in others.iter().enumerate() {
        db.insert(*id, "order", &format!("g{i}"), json!({})).await;
    }
    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_ids(&strings(&others), WAIT).await;
    let letters = wait_for(
        WAIT,
        "the poison event and its followers in the dead-letter table",
        || {
            let path = path.clone();
            async move {
                let l = dlq_list(&path);
                (l.len() == 4).then_some(l)
            }
        },
    )
    .await;
    let ids_in_dlq: Vec<&str> = letters.iter().map(|l| l["id"].as_str().unwrap()).collect();
    let expected: Vec<String> = std::iter::once(poison.to_string())
        .chain(strings(&followers))
        .collect();
    assert_eq!(ids_in_dlq, expected, "dead-lettered in order");
    assert!(
        letters[0]["reason"]
            .as_str()
            .unwrap()
            .contains("sink.message_max_bytes"),
        "{}",
        letters[0]
    );
    assert_eq!(letters[0]["attempts"], 2);
    assert!(
        letters[1]["reason"]
            .as_str()
            .unwrap()
            .contains(&poison.to_string())
    );
    assert_eq!(
        db.unsent().await,
        0,
        "dead-lettered rows are no longer pending"
    );
    // Not one of the aggregate's events was published out of order.
    let got: Vec<String> = broker
        .inbox()
        .snapshot()
        .iter()
        .map(Received::event_id)
        .collect();
    for id in &expected {
        assert!(!got.contains(id));
    }
    // The operator raises the limit and redrives the aggregate: all four, in order.
    relay.stop().await;
    let toml = toml.replace("message_max_bytes = 4000", "message_max_bytes = 100000");
    let path = config_file(&toml);
    // Redriving the first letter alone, with its followers still open,
    // would split the aggregate: refused, naming the way that keeps order.
    let (code, _, err) = redrive_one(&path, &poison.to_string());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("one of 4 open dead letters of its aggregate (0 earlier, 3 later)")
            && err.contains("--aggregate"),
        "{err}"
    );
    let (code, out, err) = run_cli(
        &["dlq", "redrive", "--config", &path, "--aggregate", "P"],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("requested the redrive of 4 dead letter(s)"),
        "{out}"
    );
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_ids(&expected, WAIT).await;
    let order: Vec<String> = got
        .iter()
        .map(Received::event_id)
        .filter(|id| expected.contains(id))
        .collect();
    assert_eq!(order, expected, "redriven in order");
    // The consumer may see the last one before the relay records its
    // confirmation, which closes the letter.
    wait_dead_letters(&path, 0, "nothing left open").await;
    relay.stop().await;
}

both_brokers!(with_wait_later_events_stay_in_the_outbox_until_the_dead_letter_is_dropped);
async fn with_wait_later_events_stay_in_the_outbox_until_the_dead_letter_is_dropped(
    mode: Mode,
    kind: Kind,
) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &poison_settings("\"wait\"")).await;
    let path = config_file(&toml);
    let (poison, followers) = poison_and_followers(&db).await;
    let relay = InProcess::start(parse(&toml));
    wait_dead_letters(&path, 1, "the poison event dead-lettered").await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        db.unsent().await,
        3,
        "the followers wait, unsent, in the outbox"
    );
    assert_eq!(broker.inbox().len(), 0);
    // Redriving one later event alone would break the order: refused.
    let (code, _, err) = redrive_one(&path, &Uuid::new_v4().to_string());
    assert_eq!(code, 1);
    assert!(err.contains("no open dead letter"), "{err}");
    // The operator gives up on the poison event: the others flow, in order.
    let (code, out, err) = run_cli(
        &[
            "dlq",
            "drop",
            "--config",
            &path,
            "--id",
            &poison.to_string(),
        ],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    let got = broker.inbox().wait_ids(&strings(&followers), WAIT).await;
    let order: Vec<String> = got.iter().map(Received::event_id).collect();
    assert_eq!(order, strings(&followers));
    let all = run_cli(&["dlq", "list", "--config", &path, "--all"], &[]).1;
    assert!(
        all.contains("[dropped]"),
        "dropped dead letters stay on record: {all}"
    );
    relay.stop().await;
}

/// A relay publishing to `amq.direct` with the aggregate type as routing key,
/// dead-lettering at the first refusal, and a queue bound only to `order`:
/// an invoice has no route.
pub(crate) async fn only_orders_routed() -> (TestDb, Broker, String, RabbitExchange) {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[
            ("dead_letter.max_attempts", "1"),
            ("sink.routing_key", "\"{aggregate_type}\""),
        ],
    )
    .await;
    let Broker::Rabbit(r) = &broker else {
        unreachable!()
    };
    let toml = toml.replace(
        &format!("exchange = \"{}\"", r.exchange),
        "exchange = \"amq.direct\"",
    );
    let bound = RabbitExchange::bind_existing("amq.direct", "order").await;
    (db, broker, toml, bound)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unroutable_message_is_a_refusal_not_a_delivery() {
    // A queue bound only to order.* keys: an invoice event has no route.
    let (db, _broker, toml, bound) = only_orders_routed().await;
    // Interleaved, so returns and acks of neighbours cross.
    let mut routed_ids = Vec::new();
    let unroutable = Uuid::new_v4();
    for i in 0..20 {
        let id = Uuid::new_v4();
        db.insert(id, "order", &format!("a{i}"), json!({})).await;
        routed_ids.push(id.to_string());
        if i == 10 {
            db.insert(unroutable, "invoice", "b", json!({})).await;
        }
    }
    let relay = InProcess::start(parse(&toml));
    bound.inbox.wait_ids(&routed_ids, WAIT).await;
    let path = config_file(&toml);
    let letters = wait_for(WAIT, "the unroutable event dead-lettered", || {
        let path = path.clone();
        async move {
            let l = dlq_list(&path);
            (!l.is_empty()).then_some(l)
        }
    })
    .await;
    assert_eq!(letters[0]["id"], unroutable.to_string());
    assert!(
        letters[0]["reason"]
            .as_str()
            .unwrap()
            .contains("unroutable"),
        "{}",
        letters[0]
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn returns_are_told_apart_when_an_adopted_table_repeats_ids() {
    // An adopted table whose id column is not unique: a return names only a
    // message id, and must still be charged to the right message.
    let (db, _broker, toml, bound) = only_orders_routed().await;
    db.client
        .batch_execute("ALTER TABLE outbox DROP CONSTRAINT outbox_pkey")
        .await
        .unwrap();
    // `shared` is an order (routed) and an invoice (unroutable); `twice` is
    // two unroutable invoices. Routed events in between, so returns and
    // acks of neighbours cross.
    let (shared, twice) = (Uuid::new_v4(), Uuid::new_v4());
    let mut routed = Vec::new();
    for i in 0..30 {
        let id = Uuid::new_v4();
        db.insert(id, "order", &format!("a{i}"), json!({})).await;
        routed.push(id.to_string());
        match i {
            5 => db.insert(shared, "order", "s", json!({})).await,
            6 => db.insert(shared, "invoice", "b1", json!({})).await,
            10 | 11 => {
                db.insert(twice, "invoice", &format!("b{i}"), json!({}))
                    .await
            }
            _ => {}
        }
    }
    routed.push(shared.to_string());
    let relay = InProcess::start(parse(&toml));
    let path = config_file(&toml);
    let letters = wait_for(WAIT, "the three unroutable events dead-lettered", || {
        let path = path.clone();
        async move {
            let l = dlq_list(&path);
            (l.len() >= 3).then_some(l)
        }
    })
    .await;
    bound.inbox.wait_ids(&routed, WAIT).await;
    let mut lettered: Vec<(String, String)> = letters
        .iter()
        .map(|l| {
            (
                l["id"].as_str().unwrap().to_owned(),
                l["aggregate_id"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    lettered.sort();
    let mut expected = vec![
        (shared.to_string(), "b1".to_owned()),
        (twice.to_string(), "b10".to_owned()),
        (twice.to_string(), "b11".to_owned()),
    ];
    expected.sort();
    assert_eq!(lettered, expected);
    // Everything else was sent, and nothing is left waiting.
    wait_for(WAIT, "every row marked", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    let received = bound.inbox.snapshot();
    let shared_copies = received
        .iter()
        .filter(|m| m.event_id() == shared.to_string())
        .count();
    assert_eq!(shared_copies, 1, "only the routed order reached the queue");
    assert!(
        received.iter().all(|m| m.event_id() != twice.to_string()),
        "neither invoice was routed"
    );
    relay.stop().await;
}

/// A running relay (Kafka) that dead-lettered `n` events of aggregate `L`:
/// the "late" topic does not exist yet, so they were refused. `refresh`
/// replaces `dead_letter.refresh_interval`. Returns the config's path too.
async fn late_events_dead_lettered(
    mode: Mode,
    n: usize,
    refresh: Option<&str>,
) -> (TestDb, Broker, String, Vec<Uuid>, InProcess) {
    let (db, broker, toml) = setup(
        mode,
        Kind::Kafka,
        &["order"],
        &poison_settings("\"follow\""),
    )
    .await;
    let toml = match refresh {
        Some(every) => set(&toml, "dead_letter.refresh_interval", every),
        None => toml,
    };
    let path = config_file(&toml);
    let late = ids(n);
    for id in &late {
        db.insert(*id, "late", "L", json!({})).await;
    }
    let relay = InProcess::start(parse(&toml));
    wait_dead_letters(&path, n, "the late events dead-lettered").await;
    (db, broker, path, late, relay)
}

/// Creates the "late" topic and asks for every dead letter's redrive.
async fn create_late_and_redrive(broker: &Broker, path: &str) {
    let Broker::Kafka(k) = broker else {
        unreachable!()
    };
    k.create("late").await;
    let (code, out, err) = run_cli(&["dlq", "redrive", "--config", path, "--all"], &[]);
    assert_eq!(code, 0, "{out}{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_while_the_relay_runs_publishes_in_order() {
    for mode in [Mode::Polling, Mode::Cdc] {
        let (db, broker, path, late, relay) = late_events_dead_lettered(mode, 4, None).await;
        // Another event of the aggregate arrives while it is dead: it follows.
        let after = Uuid::new_v4();
        db.insert(after, "late", "L", json!({})).await;
        wait_dead_letters(&path, 5, "the newcomer to follow").await;
        create_late_and_redrive(&broker, &path).await;
        let expected: Vec<String> = strings(&late)
            .into_iter()
            .chain([after.to_string()])
            .collect();
        let got = broker.inbox().wait_ids(&expected, WAIT).await;
        let order: Vec<String> = got.iter().map(Received::event_id).collect();
        assert_eq!(order, expected, "{mode:?}: redriven in order while running");
        // And the aggregate is alive again.
        let next = Uuid::new_v4();
        db.insert(next, "late", "L", json!({})).await;
        broker.inbox().wait_ids(&[next.to_string()], WAIT).await;
        relay.stop().await;
    }
}

/// Events of an aggregate that arrive as its redrive ends, before the
/// relay's next look at the dead-letter table shows the aggregate resolved,
/// wait for it and then flow after the redriven letters: they are no
/// followers of letters already published. (Here the dead-letter table's
/// own guard, which writes no follower for an aggregate without open
/// letters, keeps them out as well; the simulation's seed 208811 reaches
/// a case that guard does not cover.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_arriving_as_a_redrive_ends_flow_after_it() {
    for mode in [Mode::Polling, Mode::Cdc] {
        // A long gap between looks at the table, for the events to arrive in.
        let (db, broker, path, late, relay) =
            late_events_dead_lettered(mode, 3, Some("\"3s\"")).await;
        create_late_and_redrive(&broker, &path).await;
        broker.inbox().wait_ids(&strings(&late), WAIT).await;
        // Once the relay has recorded the letters' confirmations too, well
        // before its next look at the table.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let newcomers = ids(3);
        for id in &newcomers {
            db.insert(*id, "late", "L", json!({})).await;
        }
        let expected: Vec<String> = strings(&late)
            .into_iter()
            .chain(strings(&newcomers))
            .collect();
        let got = broker.inbox().wait_ids(&expected, WAIT).await;
        let order: Vec<String> = got.iter().map(Received::event_id).collect();
        assert_eq!(order, expected, "{mode:?}: the newcomers after the letters");
        let lettered: i64 = db
            .client
            .query_one(
                "SELECT count(*) FROM outbox_dead_letters WHERE id = ANY($1)",
                &[&strings(&newcomers)],
            )
            .await
            .unwrap()
            .get(0);
        assert_eq!(lettered, 0, "{mode:?}: no newcomer was dead-lettered");
        wait_dead_letters(&path, 0, "every letter redriven").await;
        relay.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_queue_is_back_pressure_not_a_dead_letter() {
    use lapin::options::{BasicAckOptions, BasicGetOptions};
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[
            // A refusal would be dead-lettered at once.
            ("dead_letter.max_attempts", "1"),
            ("relay.reject_retry_base", "\"200ms\""),
            ("relay.reject_retry_max", "\"1s\""),
        ],
    )
    .await;
    let Broker::Rabbit(r) = &broker else {
        unreachable!()
    };
    // A queue that holds two messages and nacks the rest (reject-publish).
    let full = full_queue(2).await;
    let (ch, exchange, queue) = (&full.ch, &full.exchange, &full.queue);
    let toml = toml.replace(
        &format!("exchange = \"{}\"", r.exchange),
        &format!("exchange = \"{exchange}\""),
    );
    let ids: Vec<String> = strings(&ids(5));
    for (i, id) in ids.iter().enumerate() {
        db.insert(id.parse().unwrap(), "order", &format!("a{i}"), json!({}))
            .await;
    }
    let relay = InProcess::start(parse(&toml));
    // Two fit; the other three are refused for now and wait in the outbox.
    let path = config_file(&toml);
    wait_for(WAIT, "two events marked, three held", || async {
        (db.unsent().await == 3).then_some(())
    })
    .await;
    tokio::time::sleep(Duration::from_secs(2)).await; // several retries
    assert_eq!(db.unsent().await, 3, "nothing more was marked");
    assert!(
        dlq_list(&path).is_empty(),
        "a full queue dead-letters nothing"
    );
    // A consumer makes room: everything arrives.
    let mut got = std::collections::HashSet::new();
    let deadline = std::time::Instant::now() + WAIT;
    while got.len() < ids.len() {
        assert!(
            std::time::Instant::now() < deadline,
            "all five consumed within {WAIT:?}; got {got:?}"
        );
        match ch
            .basic_get(queue.as_str().into(), BasicGetOptions::default())
            .await
            .unwrap()
        {
            Some(m) => {
                if let Some(id) = m.delivery.properties.message_id() {
                    got.insert(id.to_string());
                }
                m.delivery.ack(BasicAckOptions::default()).await.unwrap();
            }
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert_eq!(got, ids.iter().cloned().collect());
    wait_for(WAIT, "every row marked", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    assert!(dlq_list(&path).is_empty());
    relay.stop().await;
}

/// A topic exchange whose one queue holds a few messages and nacks the rest
/// (reject-publish), with a connection of its own.
pub struct FullQueue {
    _connection: lapin::Connection,
    pub ch: lapin::Channel,
    pub exchange: String,
    pub queue: String,
}

/// A [`FullQueue`] that holds `max` messages.
pub async fn full_queue(max: i32) -> FullQueue {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
    use lapin::types::{AMQPValue, FieldTable, ShortString};
    use lapin::{Connection, ConnectionProperties, ExchangeKind};
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .unwrap();
    let ch = connection.create_channel().await.unwrap();
    let exchange = unique("full");
    let queue = unique("full");
    ch.exchange_declare(
        exchange.as_str().into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    let mut args = FieldTable::default();
    args.insert(ShortString::from("x-max-length"), AMQPValue::LongInt(max));
    args.insert(
        ShortString::from("x-overflow"),
        AMQPValue::LongString("reject-publish".into()),
    );
    ch.queue_declare(
        queue.as_str().into(),
        QueueDeclareOptions {
            auto_delete: true,
            ..Default::default()
        },
        args,
    )
    .await
    .unwrap();
    ch.queue_bind(
        queue.as_str().into(),
        exchange.as_str().into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    FullQueue {
        _connection: connection,
        ch,
        exchange,
        queue,
    }
}
