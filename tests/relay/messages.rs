//! The table-less outbox (`source.cdc.messages`): events written as
//! transactional logical messages, through the function `migrate` installs
//! or by hand. On both brokers: delivered beside rows, in order, never when
//! rolled back, none lost across SIGKILLs, and a malformed or
//! non-transactional message dead-lettered with its reason.

use crate::dead_letters::dlq_list;
use crate::support::*;
use serde_json::{Value, json};
use std::collections::HashSet;
use std::time::Duration;
use tokio_postgres::Client;
use uuid::Uuid;

/// The function `migrate` installs for the table `outbox`.
const EMIT: &str = "outbox_relay_emit_outbox";

async fn setup_messages(kind: Kind, sets: &[(&str, &str)]) -> (TestDb, Broker, String) {
    let mut all = vec![("source.cdc.messages", "true")];
    all.extend_from_slice(sets);
    setup(Mode::Cdc, kind, &["order"], &all).await
}

/// Writes one event as a message through the installed function; returns its id.
async fn emit(c: &Client, aggregate: &str, payload: Value) -> String {
    let id: Uuid = c
        .query_one(
            &format!("SELECT {EMIT}('order', $1, 'OrderPlaced', $2)"),
            &[&aggregate, &payload],
        )
        .await
        .unwrap()
        .get(0);
    id.to_string()
}

/// `data.i` of each message of `aggregate`, in arrival order, first deliveries only.
fn sequence(got: &[crate::support::brokers::Received], aggregate: &str) -> Vec<i64> {
    first_deliveries(got).remove(aggregate).unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_and_rows_flow_in_order_and_rollbacks_stay_out_kafka() {
    messages_and_rows_flow_in_order_and_rollbacks_stay_out(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_and_rows_flow_in_order_and_rollbacks_stay_out_rabbitmq() {
    messages_and_rows_flow_in_order_and_rollbacks_stay_out(Kind::Rabbit).await;
}

async fn messages_and_rows_flow_in_order_and_rollbacks_stay_out(kind: Kind) {
    let (db, broker, toml) = setup_messages(kind, &[]).await;
    // Migrating again finds nothing to do: the function is in place.
    let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(&parse(&toml), false);
    let again = outbox_relay::ops::migrate::plan(&db.client, &opts)
        .await
        .unwrap();
    assert!(again.is_empty(), "{again:?}");
    let relay = InProcess::start(parse(&toml));
    // Streaming: each start first publishes the table's unsent rows, which
    // would put rows written meanwhile before messages of their transactions.
    let first = emit(&db.client, "first", json!({"i": 0})).await;
    broker
        .inbox()
        .wait_ids(std::slice::from_ref(&first), WAIT)
        .await;
    let mut expected = vec![first];
    let mut rolled_back = Vec::new();
    for i in 0..30i64 {
        if i % 10 == 5 {
            // Written, then rolled back: never published.
            db.client.batch_execute("BEGIN").await.unwrap();
            rolled_back.push(emit(&db.client, "m", json!({"i": -1})).await);
            db.client.batch_execute("ROLLBACK").await.unwrap();
        }
        if i % 3 == 0 {
            // A row and a message of one aggregate in one transaction.
            db.client.batch_execute("BEGIN").await.unwrap();
            let row = Uuid::new_v4();
            db.insert(row, "order", "both", json!({"i": 2 * i})).await;
            expected.push(row.to_string());
            expected.push(emit(&db.client, "both", json!({"i": 2 * i + 1})).await);
            db.client.batch_execute("COMMIT").await.unwrap();
        }
        expected.push(emit(&db.client, "m", json!({"i": i})).await);
    }
    // By hand, with headers and a version; arrives after everything above.
    let by_hand = Uuid::new_v4().to_string();
    let content = json!({"id": by_hand, "aggregate_type": "order", "aggregate_id": "m",
        "event_type": "OrderShipped", "event_version": 2, "payload": {"i": 30, "note": null},
        "headers": {"tenant": "acme"}});
    db.client
        .execute(
            "SELECT pg_logical_emit_message(true, 'outbox_relay_outbox', $1::text)",
            &[&content.to_string()],
        )
        .await
        .unwrap();
    expected.push(by_hand.clone());
    let got = broker.inbox().wait_ids(&expected, WAIT).await;
    // Commit order is stream order: a rolled-back message would have come before the last.
    let delivered: HashSet<String> = got.iter().map(|m| m.event_id()).collect();
    for id in &rolled_back {
        assert!(
            !delivered.contains(id),
            "rolled-back message {id} was published"
        );
    }
    assert_eq!(sequence(&got, "m"), (0..=30).collect::<Vec<_>>());
    let both = sequence(&got, "both");
    assert_eq!(both.len(), 20);
    assert!(both.windows(2).all(|w| w[0] < w[1]), "{both:?}");
    let last = got.iter().find(|m| m.event_id() == by_hand).unwrap();
    let body = last.json();
    assert_eq!(body["type"], "OrderShipped");
    assert_eq!(body["data"], json!({"i": 30, "note": null}));
    assert_eq!(last.header("tenant"), Some("acme"));
    // Messages are not rows: nothing of them is in the table.
    assert_eq!(db.count("SELECT count(*) FROM outbox").await, 10);
    relay.stop().await;
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains(EMIT), "{out}");
    // Without the function, check says how to get it (a warning: messages
    // can still be written by hand).
    db.client
        .batch_execute(&format!("DROP FUNCTION {EMIT}"))
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("does not exist: run `outbox-relay migrate`"),
        "{out}"
    );
}

/// Emits `n` messages over eight aggregates at a steady pace.
fn start_emitter(url: String, n: i64) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let c = connect(&url).await;
        let mut ids = Vec::new();
        for i in 0..n {
            ids.push(emit(&c, &format!("agg{}", i % 8), json!({"i": i})).await);
            if i % 10 == 0 {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
        ids
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkills_lose_no_message_and_repeat_at_most_the_window_kafka() {
    sigkills_lose_no_message_and_repeat_at_most_the_window(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkills_lose_no_message_and_repeat_at_most_the_window_rabbitmq() {
    sigkills_lose_no_message_and_repeat_at_most_the_window(Kind::Rabbit).await;
}

async fn sigkills_lose_no_message_and_repeat_at_most_the_window(kind: Kind) {
    const WINDOW: usize = 100;
    const KILLS: usize = 2;
    let (db, broker, toml) = setup_messages(
        kind,
        &[
            ("source.cdc.status_interval", "\"10s\""),
            ("relay.max_in_flight", "100"),
            ("relay.ownership_lease", "\"1s\""),
        ],
    )
    .await;
    let emitter = start_emitter(db.url.clone(), 1500);
    kill_while_busy(&toml, broker.inbox(), KILLS, 300).await;
    let ids = emitter.await.unwrap();
    let mut child = ChildRelay::start(&toml);
    let got = broker.inbox().wait_ids(&ids, Duration::from_secs(60)).await;
    let duplicates = got.len() - ids.len();
    println!(
        "{} messages, {KILLS} SIGKILLs, {duplicates} duplicates",
        ids.len()
    );
    // Like rows without marking, only the slot says what was sent.
    assert!(
        duplicates <= KILLS * 2 * WINDOW,
        "{duplicates} duplicates exceed {KILLS} kills x {}",
        2 * WINDOW
    );
    assert_each_aggregate_in_order(&got);
    assert_eq!(child.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_untransactional_messages_are_dead_lettered_with_the_reason_kafka() {
    malformed_and_untransactional_messages_are_dead_lettered_with_the_reason(Kind::Kafka).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_untransactional_messages_are_dead_lettered_with_the_reason_rabbitmq() {
    malformed_and_untransactional_messages_are_dead_lettered_with_the_reason(Kind::Rabbit).await;
}

async fn malformed_and_untransactional_messages_are_dead_lettered_with_the_reason(kind: Kind) {
    let (db, broker, toml) = setup_messages(kind, &[]).await;
    let path = config_file(&toml);
    let relay = InProcess::start(parse(&toml));
    let no_aggregate = Uuid::new_v4().to_string();
    let untransactional = Uuid::new_v4().to_string();
    let write = |transactional: bool, prefix: &'static str, content: String| {
        let c = &db.client;
        async move {
            c.execute(
                "SELECT pg_logical_emit_message($1, $2::text, $3::text)",
                &[&transactional, &prefix, &content],
            )
            .await
            .unwrap();
        }
    };
    write(true, "outbox_relay_outbox", "not json".into()).await;
    write(
        true,
        "outbox_relay_outbox",
        json!({"id": no_aggregate, "aggregate_type": "order", "event_type": "E"}).to_string(),
    )
    .await;
    write(
        false,
        "outbox_relay_outbox",
        json!({"id": untransactional, "aggregate_type": "order", "aggregate_id": "u",
            "event_type": "E", "payload": {}})
        .to_string(),
    )
    .await;
    // A NUL character fits no text column (nor the dead letter's): a
    // string field holding one, and raw NUL bytes, are refused and kept
    // escaped, and the stream goes on.
    write(
        true,
        "outbox_relay_outbox",
        json!({"id": "nul", "aggregate_type": "a\u{0}b", "aggregate_id": "n", "event_type": "E"})
            .to_string(),
    )
    .await;
    db.client
        .batch_execute(
            "SELECT pg_logical_emit_message(true, 'outbox_relay_outbox', '\\x7b00ff'::bytea)",
        )
        .await
        .unwrap();
    // Another prefix is someone else's: neither published nor dead-lettered.
    write(true, "some_other_tool", "{}".into()).await;
    let good = emit(&db.client, "g", json!({"i": 0})).await;
    broker
        .inbox()
        .wait_ids(std::slice::from_ref(&good), WAIT)
        .await;
    let letters = wait_for(WAIT, "five dead letters", || {
        let path = path.clone();
        async move {
            let l = dlq_list(&path);
            (l.len() >= 5).then_some(l)
        }
    })
    .await;
    assert_eq!(letters.len(), 5, "{letters:?}");
    // The untransactional one is sent as soon as it is decoded, so the order varies.
    let reason = |says: &str| {
        letters
            .iter()
            .find(|l| l["reason"].as_str().unwrap().contains(says))
            .unwrap_or_else(|| panic!("no dead letter says {says:?}: {letters:?}"))
    };
    reason("not a JSON object");
    assert_eq!(
        db.count(
            "SELECT count(*) FROM outbox_dead_letters
             WHERE reason LIKE '%not a JSON object%' AND payload = 'not json'"
        )
        .await,
        1,
        "the content is kept"
    );
    // Its ids are kept: the letter holds back its aggregate, and dlq finds it.
    let nul = reason("\"aggregate_type\" holds a NUL character");
    assert_eq!(
        (&nul["id"], &nul["aggregate_id"]),
        (&json!("nul"), &json!("n"))
    );
    for (kept, says) in [
        (
            "reason LIKE '%NUL character%' AND strpos(payload, '\"a\\u0000b\"') > 0",
            "the message's content is kept",
        ),
        (
            "reason LIKE '%not UTF-8%' AND payload = '{\\u0000\u{fffd}'",
            "raw NUL bytes are kept escaped",
        ),
    ] {
        let sql = format!("SELECT count(*) FROM outbox_dead_letters WHERE {kept}");
        let all = db
            .client
            .query("SELECT reason, payload FROM outbox_dead_letters", &[])
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, Option<String>>(1)))
            .collect::<Vec<_>>();
        assert_eq!(db.count(&sql).await, 1, "{says}: {all:?}");
    }
    let missing = reason("logical message: aggregate_id is NULL");
    assert_eq!(missing["id"], no_aggregate);
    assert_eq!(reason("transactional = false")["id"], untransactional);
    assert_eq!(
        broker.inbox().len(),
        1,
        "only the good message was published"
    );
    relay.stop().await;
}

/// An untransactional message written last in a transaction ends where
/// that transaction's commit record starts: each keeps its own place, so
/// the event is delivered, the message dead-lettered, and the slot moves
/// past both (the two sharing a place could hold it back for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untransactional_message_just_before_a_commit_holds_nothing_back() {
    let (db, broker, toml) = setup_messages(
        Kind::Rabbit,
        &[
            ("relay.mark", "\"none\""),
            ("source.cdc.status_interval", "\"1s\""),
        ],
    )
    .await;
    let (path, slot) = (config_file(&toml), slot_of(&toml));
    let relay = InProcess::start(parse(&toml));
    wait_streaming(&db.client, &slot).await;
    let (event, untransactional) = (Uuid::new_v4(), Uuid::new_v4());
    let content = |id: Uuid| {
        json!({"id": id.to_string(), "aggregate_type": "order", "aggregate_id": id.to_string(),
            "event_type": "E", "payload": {}})
        .to_string()
        .replace('\'', "''")
    };
    db.client
        .batch_execute(&format!(
            "BEGIN;
             SELECT pg_logical_emit_message(true, 'outbox_relay_outbox', '{}');
             SELECT pg_logical_emit_message(false, 'outbox_relay_outbox', '{}');
             COMMIT;",
            content(event),
            content(untransactional)
        ))
        .await
        .expect("one transaction");
    let committed = wal_insert_position(&db.client).await;
    broker.inbox().wait_ids(&[event.to_string()], WAIT).await;
    let letters = wait_for(WAIT, "the untransactional message dead-lettered", || {
        let path = path.clone();
        async move { Some(dlq_list(&path)).filter(|l| !l.is_empty()) }
    })
    .await;
    assert_eq!(letters[0]["id"], untransactional.to_string(), "{letters:?}");
    wait_for(WAIT, "the slot to pass the transaction", || async {
        let flushed = slot_position(&db.client, &slot, "confirmed_flush_lsn").await;
        (flushed >= committed).then_some(())
    })
    .await;
    assert_eq!(broker.inbox().len(), 1, "only the event was published");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_marking_an_aggregate_written_both_ways_keeps_its_order_across_a_start() {
    // Everything comes from the WAL, in commit order: no start-up read of
    // the table puts rows ahead of messages.
    let (db, broker, toml) = setup_messages(Kind::Rabbit, &[("relay.mark", "\"none\"")]).await;
    let mut expected = Vec::new();
    for i in 0..20i64 {
        if i % 2 == 0 {
            let row = Uuid::new_v4();
            db.insert(row, "order", "both", json!({"i": i})).await;
            expected.push(row.to_string());
        } else {
            expected.push(emit(&db.client, "both", json!({"i": i})).await);
        }
    }
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_ids(&expected, WAIT).await;
    assert_eq!(sequence(&got, "both"), (0..20).collect::<Vec<_>>());
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_routes_by_the_key_column_it_carries() {
    let (db, broker, toml) = setup_messages(Kind::Kafka, &[]).await;
    db.client
        .batch_execute("ALTER TABLE outbox ADD COLUMN route_key text")
        .await
        .unwrap();
    let toml = set(&toml, "outbox.columns.key", "\"route_key\"");
    let relay = InProcess::start(parse(&toml));
    let keyed: Uuid = db
        .client
        .query_one(
            &format!(
                "SELECT {EMIT}('order', 'o-1', 'E', '{{}}', extra => '{{\"route_key\": \"k-9\"}}')"
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let plain = emit(&db.client, "o-1", json!({"i": 1})).await;
    let got = broker
        .inbox()
        .wait_ids(&[keyed.to_string(), plain.clone()], WAIT)
        .await;
    let key = |id: &str| got.iter().find(|m| m.event_id() == id).unwrap().key.clone();
    assert_eq!(
        key(&keyed.to_string()).as_deref(),
        Some("k-9"),
        "the message's key column"
    );
    assert_eq!(
        key(&plain).as_deref(),
        Some("o-1"),
        "no value: the aggregate id"
    );
    relay.stop().await;
}

/// The relay skips messages with another prefix than its own, so the
/// installed function must write its prefix: a changed `message_prefix`
/// without `migrate` is refused by `check` and by `run`, and `migrate`
/// does not change the function while a relay streams with the old one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_the_installed_function_does_not_write_is_refused() {
    let (db, broker, toml) = setup_messages(Kind::Rabbit, &[]).await;
    let slot = slot_of(&toml);
    let renamed = set(&toml, "source.cdc.message_prefix", "\"renamed\"");
    let path = config_file(&renamed);
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] messages") && out.contains("\"renamed\""),
        "{out}"
    );
    let log = crate::schema::run_until_logged_with_env(&path, "the relay would skip", &[]);
    assert!(log.contains("run `outbox-relay migrate`"), "{log}");

    let relay = InProcess::start(parse(&toml));
    wait_streaming(&db.client, &slot).await;
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(err.contains("while a relay streams from slot"), "{err}");
    relay.stop().await;
    wait_for(WAIT, "the slot to be let go", || async {
        let active: bool = db
            .client
            .query_one(
                "SELECT active FROM pg_replication_slots WHERE slot_name = $1",
                &[&slot],
            )
            .await
            .unwrap()
            .get(0);
        (!active).then_some(())
    })
    .await;

    // Stopped: migrate rewrites the function, and what it writes flows.
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let relay = InProcess::start(parse(&renamed));
    let id = emit(&db.client, "a", json!({"i": 1})).await;
    broker.inbox().wait_ids(&[id], WAIT).await;
    relay.stop().await;
}
