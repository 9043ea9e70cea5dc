//! One publisher at a time, even when the active instance cannot tell it
//! lost ownership: its ownership session is silently partitioned away while
//! its reading session and its broker connection stay up.

use crate::support::proxy::Proxy;
use crate::support::*;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use uuid::Uuid;

const LEASE: &str = "\"2s\"";

/// Inserts an event every few milliseconds, over eight aggregates, until
/// told to stop; returns the ids inserted.
fn start_writer(url: String, stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let client = connect(&url).await;
        let mut ids = Vec::new();
        let mut i = 0usize;
        while !stop.load(Ordering::Relaxed) {
            let id = Uuid::new_v4();
            client
                .execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'order', $2, 'Happened', $3)",
                    &[&id, &format!("a{}", i % 8), &json!({"i": i})],
                )
                .await
                .expect("insert event");
            ids.push(id.to_string());
            i += 1;
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        ids
    })
}

/// What the database shows when a takeover does not happen: who holds the
/// ownership lock, whether the terminated session is still there, what
/// every session of the test's database is doing, and the owners table.
async fn takeover_state(db: &TestDb, terminated: i32) -> String {
    let sessions = listed(
        db,
        "SELECT format('pid %s port %s state %s wait %s/%s since %s lock %s query %L',
                       a.pid, a.client_port, a.state, a.wait_event_type, a.wait_event,
                       a.backend_start, EXISTS (SELECT 1 FROM pg_locks l WHERE l.pid = a.pid
                                                AND l.locktype = 'advisory' AND l.granted),
                       left(a.query, 80))
         FROM pg_stat_activity a
         WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()",
        "\n  ",
    )
    .await;
    let owners = listed(
        db,
        "SELECT format('%L %L claimed %s stopped %s', lock_key, owner, claimed_at, stopped_at)
         FROM outbox_relay_owners",
        "; ",
    )
    .await;
    format!("terminated pid {terminated}; sessions:\n  {sessions}\nowners: {owners}")
}

/// The one text column of each row of `sql`, joined by `separator`.
async fn listed(db: &TestDb, sql: &str, separator: &str) -> String {
    match db.client.query(sql, &[]).await {
        Ok(rows) => rows
            .iter()
            .map(|r| r.get::<_, Option<String>>(0).unwrap_or_default())
            .collect::<Vec<_>>()
            .join(separator),
        Err(e) => format!("(not read: {e})"),
    }
}

every_mode!(a_partitioned_owner_stops_before_the_standby_starts);
async fn a_partitioned_owner_stops_before_the_standby_starts(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(
        mode,
        kind,
        &["order"],
        &[
            ("relay.ownership_lease", LEASE),
            // The window is not what stops the old owner: the lease is.
            ("relay.max_in_flight", "20000"),
        ],
    )
    .await;
    // Instance A reaches PostgreSQL through a proxy; B directly.
    let pg: std::net::SocketAddr = "127.0.0.1:55432".parse().unwrap();
    let proxy = Proxy::start(pg, true).await;
    let toml_a = set(
        &toml.replace("127.0.0.1:55432", &format!("127.0.0.1:{}", proxy.port)),
        "envelope.source",
        "\"relay-a\"",
    );
    let toml_b = set(&toml, "envelope.source", "\"relay-b\"");
    let a = InProcess::start(parse(&toml_a));
    let stop = Arc::new(AtomicBool::new(false));
    let writer = start_writer(db.url.clone(), stop.clone());
    let (owner_pid, owner_port) = db.owner_session().await;
    wait_for(WAIT, "A to publish", || async {
        (broker.inbox().len() > 50).then_some(())
    })
    .await;
    let b = InProcess::start(parse(&toml_b));
    // B must be a standby polling the lock before A is cut off: A gives
    // ownership up a few seconds later and takes the lock again if nobody
    // else has.
    wait_for(
        WAIT,
        "B to stand by, polling the ownership lock",
        || async {
            let polling: i64 = db
                .client
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND pid <> $1
                   AND query LIKE 'SELECT pg_try_advisory_lock%'",
                    &[&owner_pid],
                )
                .await
                .unwrap()
                .get(0);
            (polling > 0).then_some(())
        },
    )
    .await;

    // A's ownership session goes silent; the server ends it (as its TCP
    // keepalive would), which frees the lock for B. A hears nothing.
    assert!(proxy.freeze(owner_port), "A's ownership session is proxied");
    let ended: bool = db
        .client
        .query_one("SELECT pg_terminate_backend($1)", &[&owner_pid])
        .await
        .unwrap()
        .get(0);
    assert!(ended);
    let source =
        |m: &crate::support::brokers::Received| m.json()["source"].as_str().map(str::to_owned);
    let deadline = std::time::Instant::now() + WAIT;
    while !broker
        .inbox()
        .snapshot()
        .iter()
        .any(|m| source(m).as_deref() == Some("relay-b"))
    {
        if std::time::Instant::now() > deadline {
            panic!(
                "timed out after {WAIT:?} waiting for B to publish; {}",
                takeover_state(&db, owner_pid).await
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Writes go on a while under B, then everything must arrive.
    tokio::time::sleep(Duration::from_secs(2)).await;
    stop.store(true, Ordering::Relaxed);
    let ids = writer.await.unwrap();
    let received = broker.inbox().wait_ids(&ids, WAIT).await;

    // In arrival order (one queue, or one partition per aggregate: check
    // each aggregate's sequence), nothing of A's follows B's first.
    let snapshot = broker.inbox().snapshot();
    let mut by_key: std::collections::HashMap<String, Vec<String>> = Default::default();
    for m in &snapshot {
        let key = match kind {
            Kind::Rabbit => String::new(),
            Kind::Kafka => m.key.clone().unwrap_or_default(),
        };
        by_key
            .entry(key)
            .or_default()
            .push(source(m).unwrap_or_default());
    }
    let mut a_before_b = 0;
    for (key, sources) in &by_key {
        let Some(first_b) = sources.iter().position(|s| s == "relay-b") else {
            continue;
        };
        let late_a = sources[first_b..]
            .iter()
            .filter(|s| *s == "relay-a")
            .count();
        assert_eq!(
            late_a,
            0,
            "key {key:?}: A published {late_a} message(s) after B's first (message {first_b} of {})",
            sources.len()
        );
        a_before_b += sources[..first_b]
            .iter()
            .filter(|s| *s == "relay-a")
            .count();
    }
    assert!(a_before_b > 0, "A published before B took over");
    let unique: std::collections::HashSet<String> = received.iter().map(|m| m.event_id()).collect();
    assert_eq!(unique.len(), ids.len(), "nothing was lost");

    // A gave ownership up and started over as a standby by itself: once B
    // stops, A takes over again.
    b.stop().await;
    let stop = Arc::new(AtomicBool::new(false));
    let writer = start_writer(db.url.clone(), stop.clone());
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    let later = writer.await.unwrap();
    let received = broker.inbox().wait_ids(&later, WAIT).await;
    assert!(
        received
            .iter()
            .any(|m| later.contains(&m.event_id()) && source(m).as_deref() == Some("relay-a")),
        "A published again after B stopped"
    );
    a.abort();
    drop(proxy);
}
