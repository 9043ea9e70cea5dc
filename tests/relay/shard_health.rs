//! Sharing shards with an instance that is alive but cannot publish.

use crate::support::*;
use serde_json::json;
use std::collections::HashMap;
use uuid::Uuid;

/// Starts an instance named `app` whose broker is a port nobody listens
/// on, and waits until its `/readyz` says a shard fails; that body. Its
/// long retry_max keeps it out long enough for another to take over.
async fn cannot_publish(toml: &str, app: &str) -> (ChildRelay, String) {
    let closed = format!(
        "\"amqp://guest:guest@127.0.0.1:{}/%2f\"",
        crate::kit::free_port()
    );
    let toml = set(toml, "database.application_name", &format!("\"{app}\""));
    let toml = set(
        &set(&toml, "sink.url", &closed),
        "relay.retry_max",
        "\"10s\"",
    );
    let (relay, port) = ChildRelay::serving(&toml);
    let failing = wait_for(WAIT, "the instance to fail its shards", || async {
        let (status, body) = http_get(port, "/readyz").await?;
        (status == 503 && body.contains("failing: shard ")).then_some(body)
    })
    .await;
    (relay, failing)
}

/// An instance that cannot reach its broker (from where it runs) keeps
/// failing its shards' runs: it steps back, the instance that can publish
/// takes its shards, and no aggregate waits for it. Meanwhile its
/// `/readyz` says which shard fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shards_of_an_instance_that_cannot_publish_go_to_one_that_can() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
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
    let (b, failing) = cannot_publish(&toml, "relay-b").await;
    assert!(failing.contains("/4: "), "{failing}");

    // Events of every shard, written while the second instance is there.
    let mut expected: HashMap<String, Vec<String>> = HashMap::new();
    for round in 0..10 {
        for i in 0..20 {
            let id = Uuid::new_v4();
            let agg = format!("agg{}", (round * 20 + i) % 40);
            db.insert(id, "order", &agg, json!({"round": round})).await;
            expected.entry(agg).or_default().push(id.to_string());
        }
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    }
    let all: Vec<String> = expected.values().flatten().cloned().collect();
    let got = broker.inbox().wait_ids(&all, WAIT).await;
    assert_eq!(got.len(), all.len(), "each event once");
    for (agg, ids) in &expected {
        let order: Vec<String> = got
            .iter()
            .map(brokers::Received::event_id)
            .filter(|id| ids.contains(id))
            .collect();
        assert_eq!(&order, ids, "{agg} in order");
    }
    drop(b);
    a.stop().await;
}

/// An instance kept out by one with other shard settings (a rolling change
/// of `relay.shards`) is a ready standby: a rollout that waits for
/// readiness goes on, and the instance takes over once the other stops.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_kept_out_by_other_shard_settings_is_a_ready_standby() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &[]).await;
    let whole = InProcess::start(parse(&toml));
    let first = Uuid::new_v4();
    db.insert(first, "order", "a", json!({})).await;
    broker.inbox().wait_ids(&[first.to_string()], WAIT).await;
    let (sharded, port) = ChildRelay::serving(&set(&toml, "relay.shards", "4"));
    wait_for(
        WAIT,
        "the sharded instance to report a ready standby",
        || async {
            let (code, body) = http_get(port, "/readyz").await?;
            (code == 200 && body == "default: standby\n").then_some(())
        },
    )
    .await;
    whole.stop().await;
    wait_for(WAIT, "the sharded instance to take every shard", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 200 && body == "default: active\n").then_some(())
    })
    .await;
    let second = Uuid::new_v4();
    db.insert(second, "order", "b", json!({})).await;
    broker.inbox().wait_ids(&[second.to_string()], WAIT).await;
    drop(sharded);
}

/// An instance stepping back (its runs fail) still keeps instances with
/// another shard count out: their shards are other keys, so nothing else
/// would stop both from publishing the same rows once its broker is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_stepping_back_keeps_other_shard_settings_out() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[("relay.shards", "4")],
    )
    .await;
    let (failing, _) = cannot_publish(&toml, "relay-a").await;
    // A rolling change of relay.shards starts an instance with 2.
    let other = InProcess::start(parse(&set(
        &set(&toml, "relay.shards", "2"),
        "database.application_name",
        "\"relay-c\"",
    )));
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while std::time::Instant::now() < until {
        let owners = db.shard_owners().await;
        assert_eq!(
            owners.get("relay-c"),
            None,
            "both shard counts at once: {owners:?}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    drop(failing);
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    broker.inbox().wait_ids(&[id.to_string()], WAIT).await;
    other.stop().await;
}

/// A shard's guard refuses while an instance with another shard count is
/// registered, even when this instance's member session never saw it (the
/// session died unnoticed, and the other registered meanwhile): their
/// shards are other keys, so both would own the same rows.
#[tokio::test]
async fn a_shard_is_not_taken_beside_another_shard_count() {
    use outbox_relay::relay::shards::guard;
    let db = TestDb::new().await;
    let base = outbox_relay::outbox::ownership_key(&outbox_relay::config::TableName::new(
        "public", "outbox",
    ));
    // An instance with 2 shards, registered: its member locks.
    let other = connect(&db.url).await;
    let registered: bool = other
        .query_one(
            "SELECT pg_try_advisory_lock_shared(hashtextextended($1, 0))
                    AND pg_try_advisory_lock(hashtext($1 || ':members:2'), 0)",
            &[&base],
        )
        .await
        .unwrap()
        .get(0);
    assert!(registered);
    let mine = connect(&db.url).await;
    assert!(
        !guard(&mine, &base, 4).await.unwrap(),
        "a shard of 4 beside an instance with 2"
    );
    mine.batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    other
        .batch_execute("SELECT pg_advisory_unlock_all()")
        .await
        .unwrap();
    assert!(guard(&mine, &base, 4).await.unwrap(), "alone");
}
