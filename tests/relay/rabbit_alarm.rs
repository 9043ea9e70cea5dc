//! A RabbitMQ memory or disk alarm (`connection.blocked`), on a private node
//! the test can put into an alarm: the relay waits on its one connection,
//! instead of timing out, reconnecting and leaving a blocked connection
//! behind at every `relay.confirm_timeout`; once the alarm clears, every
//! event arrives.

use crate::support::*;
use crate::tls::{declare_exchange, pki, start_node};
use lapin::options::BasicGetOptions;
use std::collections::HashSet;
use std::time::Duration;

async fn insert_events(db: &TestDb, n: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = uuid::Uuid::new_v4();
        db.insert(id, "order", &format!("a{i}"), serde_json::json!({}))
            .await;
        ids.push(id.to_string());
    }
    ids
}

/// Takes messages from the queue into `got` until it holds all of `ids`.
async fn receive(ch: &lapin::Channel, queue: &str, got: &mut HashSet<String>, ids: &[String]) {
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
                got.insert(id.to_string());
            }
            None => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broker_alarm_pauses_the_relay_on_its_one_connection() {
    let (ca, server) = pki();
    let node = start_node(&ca, &server, false).await;
    let exchange = unique("alarm");
    let (_consumer, ch) = declare_exchange(&node, &exchange).await;
    let db = TestDb::new().await;
    let sink = format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{exchange}\"\n",
        node.amqp_url()
    );
    let toml = set(
        &base_toml(&db.url, &sink),
        "relay.confirm_timeout",
        "\"2s\"",
    );
    db.migrate(&parse(&toml)).await;
    let mut relay = ChildRelay::start_logged(&toml);
    let mut ids = insert_events(&db, 5).await;
    let mut got = HashSet::new();
    receive(&ch, &exchange, &mut got, &ids).await;

    node.ctl(&["set_disk_free_limit", "10000GB"]);
    ids.extend(insert_events(&db, 50).await);
    wait_for(WAIT, "the relay to log the alarm", || async {
        relay.logged("blocked publishers").then_some(())
    })
    .await;
    // Six times relay.confirm_timeout and more.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let connections = node.ctl(&["-q", "list_connections", "client_properties", "state"]);
    let relays: Vec<&str> = connections
        .lines()
        .filter(|l| l.contains("outbox-relay"))
        .collect();
    assert_eq!(relays.len(), 1, "one connection:\n{connections}");
    assert!(relays[0].trim_end().ends_with("blocked"), "{connections}");
    assert!(!relay.logged("reconnecting"), "the run did not end");
    assert!(db.unsent().await > 0, "nothing passes the alarm");

    node.ctl(&["set_disk_free_limit", "50MB"]);
    receive(&ch, &exchange, &mut got, &ids).await;
    wait_for(WAIT, "every row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    assert!(relay.logged("unblocked publishers"));
    let status = relay.terminate();
    assert!(status.success(), "{status:?}");
}
