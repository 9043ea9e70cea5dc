//! What a RabbitMQ node of the test's own can be made to do, that the
//! shared one must not: a memory or disk alarm (`connection.blocked`), a
//! connection limit, a user who may not write to the default exchange.
//!
//! During an alarm the relay waits on its one connection, instead of timing
//! out, reconnecting and leaving a blocked connection behind at every
//! `relay.confirm_timeout`; once the alarm clears, every event arrives. A
//! connection limit passes by itself. A refused publish to the default
//! exchange (which RabbitMQ names `amq.default`) is a refusal, dead-lettered,
//! not an outage retried for ever. One node serves the three, in turn.

use crate::dead_letters::dlq_list;
use crate::support::rabbit_node::RabbitNode;
use crate::support::*;
use crate::tls::{declare_exchange, pki, start_node};
use lapin::options::BasicGetOptions;
use outbox_relay::config::SinkConfig;
use outbox_relay::sink::{RabbitMqSink, SinkError};
use std::collections::HashSet;
use std::time::Duration;

/// `n` events of aggregate type `kind` (the exchange they go to, in the
/// alarm's part), each of an aggregate of its own (`kind-0`, ...).
async fn insert_events(db: &TestDb, kind: &str, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = uuid::Uuid::new_v4();
        db.insert(id, kind, &format!("{kind}-{i}"), serde_json::json!({}))
            .await;
        ids.push(id.to_string());
    }
    ids
}

/// Whether a message may arrive twice: only once a run has ended.
#[derive(PartialEq)]
enum Repeats {
    Refused,
    Allowed,
}

/// Takes messages from the queue into `got` until it holds all of `ids`.
async fn receive(
    ch: &lapin::Channel,
    queue: &str,
    got: &mut HashSet<String>,
    ids: &[String],
    repeats: Repeats,
) {
    let deadline = std::time::Instant::now() + WAIT;
    while !ids.iter().all(|id| got.contains(id)) {
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {} events arrived",
            ids.iter().filter(|id| got.contains(*id)).count(),
            ids.len()
        );
        let message = ch
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .expect("basic.get");
        match message.and_then(|m| m.delivery.properties.message_id().clone()) {
            Some(id) => {
                let first = got.insert(id.to_string());
                assert!(first || repeats == Repeats::Allowed, "{id} arrived twice");
            }
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_private_node_in_an_alarm_at_a_limit_and_refusing_a_user() {
    let (ca, server) = pki();
    let node = start_node(&ca, &server, false).await;
    an_alarm_pauses_the_relay_on_its_one_connection(&node).await;
    a_connection_limit_passes_by_itself(&node).await;
    the_default_exchange_refused_is_a_refusal(&node).await;
}

async fn an_alarm_pauses_the_relay_on_its_one_connection(node: &RabbitNode) {
    let exchange = unique("alarm");
    let (_consumer, ch) = declare_exchange(node, &exchange).await;
    let db = TestDb::new().await;
    // Each aggregate type to the exchange of its name.
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{{aggregate_type}}\"\n",
        node.amqp_url()
    );
    let mut toml = set(
        &base_toml(&db.url, &sink),
        "relay.confirm_timeout",
        "\"2s\"",
    );
    toml = set(&toml, "dead_letter.max_attempts", "2");
    db.migrate(&parse(&toml)).await;
    let mut relay = ChildRelay::start_logged(&toml);
    let mut ids = insert_events(&db, &exchange, 5).await;
    let mut got = HashSet::new();
    receive(&ch, &exchange, &mut got, &ids, Repeats::Refused).await;
    // An event for an exchange that does not exist: the broker closes the
    // channel that looked for it, a channel's error, not the connection's,
    // which must not end the watch on the connection's alarms.
    insert_events(&db, "nowhere", 1).await;
    wait_for(WAIT, "the event for no exchange dead-lettered", || async {
        relay.logged("dead-lettered").then_some(())
    })
    .await;

    node.ctl(&["set_disk_free_limit", "10000GB"]);
    ids.extend(insert_events(&db, &exchange, 50).await);
    wait_blocked(&relay, 1).await;
    // Six times relay.confirm_timeout and more.
    tokio::time::sleep(Duration::from_secs(12)).await;
    one_blocked_connection(node);
    assert!(!relay.logged("relay interrupted"), "the run did not end");
    assert!(db.unsent().await > 0, "nothing passes the alarm");
    node.ctl(&["set_disk_free_limit", "50MB"]);
    receive(&ch, &exchange, &mut got, &ids, Repeats::Refused).await;
    wait_for(WAIT, "every row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    assert!(relay.logged("unblocked publishers"));

    // A connection that fails while blocked ends the wait. The relay
    // connects again, and its new connection, blocked at its first
    // publish, waits in turn.
    node.ctl(&["set_disk_free_limit", "10000GB"]);
    ids.extend(insert_events(&db, &exchange, 20).await);
    wait_blocked(&relay, 2).await;
    node.ctl(&["close_all_connections", "closed by the test"]);
    wait_for(WAIT, "the run to end with its connection", || async {
        relay.logged("relay interrupted").then_some(())
    })
    .await;
    wait_blocked(&relay, 3).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    one_blocked_connection(node);
    assert_eq!(relay.log_count("relay interrupted"), 1, "one run ended");
    // The test's own connection went too.
    let (_consumer, ch) = declare_exchange(node, &exchange).await;
    node.ctl(&["set_disk_free_limit", "50MB"]);
    receive(&ch, &exchange, &mut got, &ids, Repeats::Allowed).await;
    wait_for(WAIT, "every row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    let status = relay.terminate();
    assert!(status.success(), "{status:?}");
}

/// Waits until the relay has logged `times` blocks of its connection.
async fn wait_blocked(relay: &ChildRelay, times: usize) {
    wait_for(WAIT, "the relay to log the alarm", || async {
        (relay.log_count("what is sent waits on this connection") >= times).then_some(())
    })
    .await;
}

/// The node holds one connection of the relay's, blocked.
fn one_blocked_connection(node: &RabbitNode) {
    let connections = node.ctl(&["-q", "list_connections", "client_properties", "state"]);
    let relays: Vec<&str> = connections
        .lines()
        .filter(|l| l.contains("outbox-relay"))
        .collect();
    assert_eq!(relays.len(), 1, "one connection:\n{connections}");
    assert!(relays[0].trim_end().ends_with("blocked"), "{connections}");
}

async fn a_connection_limit_passes_by_itself(node: &RabbitNode) {
    let db = TestDb::new().await;
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        node.amqp_url()
    );
    let SinkConfig::RabbitMq(config) = parse(&base_toml(&db.url, &sink)).sink else {
        unreachable!()
    };
    node.ctl(&["set_vhost_limits", "-p", "/", r#"{"max-connections": 0}"#]);
    let refused = tokio::time::timeout(WAIT, RabbitMqSink::connect(&config)).await;
    node.ctl(&["clear_vhost_limits", "-p", "/"]);
    match refused.expect("an answer within the wait") {
        Err(SinkError::Unavailable(why)) => {
            assert!(why.to_string().contains("connection limit"), "{why}")
        }
        Err(other) => panic!("a connection limit passes by itself: {other:?}"),
        Ok(_) => panic!("connected past a limit of 0"),
    }
}

async fn the_default_exchange_refused_is_a_refusal(node: &RabbitNode) {
    let queue = unique("plain");
    let (_consumer, _ch) = declare_exchange(node, &queue).await;
    let user = unique("writer");
    node.ctl(&["add_user", &user, "secret"]);
    node.ctl(&[
        "set_permissions",
        "-p",
        "/",
        &user,
        ".*",
        r"^(?!amq\.default$).*",
        ".*",
    ]);
    let db = TestDb::new().await;
    let url = format!("amqp://{user}:secret@127.0.0.1:{}/%2f", node.amqp_port);
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{url}\"\nexchange = \"\"\nrouting_key = \"{queue}\"\n"
    );
    let mut toml = base_toml(&db.url, &sink);
    for (key, value) in [
        ("dead_letter.max_attempts", "2"),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
    ] {
        toml = set(&toml, key, value);
    }
    db.migrate(&parse(&toml)).await;
    let path = config_file(&toml);
    let id = insert_events(&db, "order", 1).await.remove(0);
    let relay = InProcess::start(parse(&toml));
    let letters = wait_for(WAIT, "the refused event dead-lettered", || {
        let path = path.clone();
        async move {
            let l = dlq_list(&path);
            (!l.is_empty()).then_some(l)
        }
    })
    .await;
    relay.stop().await;
    assert_eq!(letters[0]["id"], id);
    let why = letters[0]["reason"].as_str().unwrap_or_default();
    assert!(
        why.contains("amq.default") && why.contains("closed the channel"),
        "{why}"
    );
}
