//! The gauges the alert rules (deploy/prometheus/alerts.yml) and the dashboard
//! read, scraped from a running relay while it falls behind: the age of the
//! oldest unsent event and the WAL a CDC slot retains. And the names the relay
//! declares are exactly those it exports.

use crate::support::proxy::{CutBroker, setup_cut};
use crate::support::*;
use outbox_relay::telemetry::metrics;
use serde_json::json;
use std::collections::BTreeSet;
use std::time::Instant;
use uuid::Uuid;

const P: &str = "{pipeline=\"default\"}";

/// The relay's gauge `name` of the default pipeline, from one scrape.
async fn gauge(port: u16, name: &str) -> Option<f64> {
    let (code, body) = http_get(port, "/metrics").await?;
    if code != 200 {
        return None;
    }
    metric(&body, &format!("{name}{P}"))
}

async fn wait_active(port: u16) {
    wait_for(WAIT, "the relay to be active", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 200 && body == "default: active\n").then_some(())
    })
    .await;
}

/// The relay serving HTTP, once active and one event went all the way through.
async fn start_warm(db: &TestDb, broker: &CutBroker, toml: &str) -> (ChildRelay, u16) {
    let (relay, port) = ChildRelay::serving(toml);
    wait_active(port).await;
    let warm_up = Uuid::new_v4();
    db.insert(warm_up, "order", "w", json!({})).await;
    broker.inbox.wait_ids(&[warm_up.to_string()], WAIT).await;
    (relay, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_unsent_age_grows_while_the_broker_is_unreachable() {
    let (db, broker, toml) = setup_cut(Mode::Polling, Kind::Rabbit, &[]).await;
    // The cut comes once the relay publishes (not during its start-up).
    let (mut relay, port) = start_warm(&db, &broker, &toml).await;
    wait_for(WAIT, "a healthy relay to report age 0", || async {
        (gauge(port, metrics::OLDEST_UNSENT_AGE).await? == 0.0).then_some(())
    })
    .await;

    broker.proxy().cut();
    let cut = Instant::now();
    let ids = ids(3);
    for (i, id) in ids.iter().enumerate() {
        db.insert(*id, "order", &format!("a{i}"), json!({})).await;
    }
    let first = wait_for(WAIT, "the age of the unsent rows to show", || async {
        let backlog = gauge(port, metrics::BACKLOG).await?;
        let age = gauge(port, metrics::OLDEST_UNSENT_AGE).await?;
        (backlog == 3.0 && age >= 2.0).then_some(age)
    })
    .await;
    assert!(
        first <= cut.elapsed().as_secs_f64() + 1.0,
        "the age ({first}s) is counted from the rows' created_at, after the cut"
    );
    wait_for(WAIT, "the age to keep growing", || async {
        (gauge(port, metrics::OLDEST_UNSENT_AGE).await? >= first + 2.0).then_some(())
    })
    .await;

    broker.proxy().restore();
    wait_for(WAIT, "age and backlog back to 0", || async {
        let backlog = gauge(port, metrics::BACKLOG).await?;
        let age = gauge(port, metrics::OLDEST_UNSENT_AGE).await?;
        (backlog == 0.0 && age == 0.0).then_some(())
    })
    .await;
    broker.inbox.wait_ids(&strings(&ids), WAIT).await;
    assert_eq!(relay.terminate().code(), Some(0));
}

/// An outbox without `created_at`: nothing dates its rows, so the gauge
/// counts from when the relay first saw the oldest one unsent, and the
/// aging alert still sees rows that do not move.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_created_at_the_age_counts_from_when_the_row_was_first_seen() {
    let (db, broker, toml) = setup_cut(Mode::Polling, Kind::Rabbit, &[]).await;
    db.client
        .batch_execute("ALTER TABLE outbox DROP COLUMN created_at")
        .await
        .expect("drop created_at");
    let (mut relay, port) = start_warm(&db, &broker, &toml).await;
    wait_for(WAIT, "a healthy relay to report age 0", || async {
        (gauge(port, metrics::OLDEST_UNSENT_AGE).await? == 0.0).then_some(())
    })
    .await;

    broker.proxy().cut();
    let ids = ids(2);
    let written = Instant::now();
    db.insert(ids[0], "order", "a", json!({})).await;
    let first = wait_for(WAIT, "the undated row's age to show", || async {
        let age = gauge(port, metrics::OLDEST_UNSENT_AGE).await?;
        (age >= 1.0).then_some(age)
    })
    .await;
    assert!(
        first <= written.elapsed().as_secs_f64(),
        "the age ({first}s) counts from no earlier than the row's write"
    );
    // A newer row behind it does not make the oldest one younger.
    db.insert(ids[1], "order", "b", json!({})).await;
    wait_for(WAIT, "the age to keep growing", || async {
        let age = gauge(port, metrics::OLDEST_UNSENT_AGE).await?;
        assert!(age >= first, "the age fell from {first}s to {age}s");
        (age >= first + 2.0).then_some(())
    })
    .await;

    broker.proxy().restore();
    broker.inbox.wait_ids(&strings(&ids), WAIT).await;
    wait_for(WAIT, "the age back to 0", || async {
        (gauge(port, metrics::OLDEST_UNSENT_AGE).await? == 0.0).then_some(())
    })
    .await;
    assert_eq!(relay.terminate().code(), Some(0));
}

/// Random text that compression cannot shrink much, so its WAL is about its size.
fn incompressible(len: usize) -> String {
    std::iter::repeat_with(fastrand::alphanumeric)
        .take(len)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_slot_retains_wal_while_cdc_is_behind() {
    const WRITTEN: usize = 20 * 64 * 1024;
    // What the rows must at least add to the WAL, allowing for compression.
    const AT_LEAST: f64 = (WRITTEN / 2) as f64;
    // Without marking, the slot is the only record of what is unsent, so it
    // must keep the WAL of every unconfirmed event; the flushed position is
    // reported every max_in_flight confirmations.
    let sets = [("relay.mark", "\"none\""), ("relay.max_in_flight", "10")];
    let (db, broker, toml) = setup_cut(Mode::Cdc, Kind::Rabbit, &sets).await;
    let (mut relay, port) = start_warm(&db, &broker, &toml).await;
    wait_for(WAIT, "the slot gauges to show", || async {
        gauge(port, metrics::SLOT_RETAINED_WAL).await
    })
    .await;

    broker.proxy().cut();
    let lsn = |sql: &'static str| {
        let client = &db.client;
        async move {
            client
                .query_one(sql, &[])
                .await
                .expect(sql)
                .get::<_, String>(0)
        }
    };
    let start = lsn("SELECT pg_current_wal_lsn()::text").await;
    let ids = ids(20);
    for (i, id) in ids.iter().enumerate() {
        let blob = incompressible(WRITTEN / 20);
        db.insert(*id, "order", &format!("a{i}"), json!({ "blob": blob }))
            .await;
    }
    // WAL written since the cut: the rows' and, with tests running side by
    // side, other databases'. The relay may confirm WAL that holds none of
    // its events (another database's, written before the first row), so
    // what the slot must keep is the rows' WAL: at least AT_LEAST.
    let behind: f64 = db
        .client
        .query_one(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::text::pg_lsn)::float8",
            &[&start],
        )
        .await
        .expect("WAL written since the cut")
        .get(0);
    assert!(
        behind >= AT_LEAST,
        "{behind} bytes of WAL for {WRITTEN} bytes of rows"
    );
    wait_for(WAIT, "the slot to retain the unsent rows' WAL", || async {
        let retained = gauge(port, metrics::SLOT_RETAINED_WAL).await?;
        let lag = gauge(port, metrics::SLOT_CONFIRMED_LAG).await?;
        (retained >= AT_LEAST && lag >= AT_LEAST).then_some(())
    })
    .await;

    broker.proxy().restore();
    broker.inbox.wait_ids(&strings(&ids), WAIT).await;
    wait_for(WAIT, "the confirmed position to catch up", || async {
        (gauge(port, metrics::SLOT_CONFIRMED_LAG).await? < AT_LEAST).then_some(())
    })
    .await;

    // Every name the relay declares is exported, and nothing else.
    let (_, text) = http_get(port, "/metrics").await.expect("a scrape");
    let scraped: BTreeSet<&str> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .filter(|n| n.starts_with("outbox_relay_"))
        .collect();
    let declared: BTreeSet<String> = metrics::ALL
        .iter()
        .flat_map(|name| {
            if metrics::HISTOGRAMS.contains(name) {
                ["_bucket", "_sum", "_count"]
                    .iter()
                    .map(|s| format!("{name}{s}"))
                    .collect()
            } else {
                vec![(*name).to_owned()]
            }
        })
        .collect();
    let declared: BTreeSet<&str> = declared.iter().map(String::as_str).collect();
    assert_eq!(scraped, declared, "{text}");
    assert_eq!(relay.terminate().code(), Some(0));
}

/// Ranges: the frontier's age grows while no instance can
/// fold (another session holds the fold's lock), `status` says the frontier
/// never moved, and once the lock is free the fold moves it and counts the
/// round.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_frontier_age_grows_while_the_fold_cannot_run_and_falls_once_it_can() {
    let sets = [
        ("relay.mark", "\"ranges\""),
        ("relay.fold_interval", "\"1s\""),
        ("http.sample_interval", "\"500ms\""),
    ];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let key = outbox_relay::ops::fold::lock_key(&parse(&toml));
    let blocker = connect(&db.url).await;
    blocker
        .execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", &[&key])
        .await
        .unwrap();
    let port = crate::kit::free_port();
    let mut relay = ChildRelay::start(&with_http(&toml, port));
    let ids = ids(5);
    for (i, id) in ids.iter().enumerate() {
        db.insert(*id, "order", &format!("f{i}"), json!({})).await;
    }
    broker.inbox().wait_ids(&strings(&ids), WAIT).await;
    wait_for(WAIT, "the frontier's age to grow past 3 s", || async {
        (gauge(port, metrics::FRONTIER_AGE).await? >= 3.0).then_some(())
    })
    .await;
    let (code, out, err) = run_cli(&["status", "--config", &config_file(&toml), "--json"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let status: serde_json::Value = serde_json::from_str(&out).unwrap();
    let frontier = &status["frontier"];
    assert!(
        frontier["folded_at"].is_null()
            && frontier["progress_rows"].as_i64() > Some(0)
            && frontier["age_seconds"].as_f64() >= Some(3.0),
        "{status}"
    );
    // Settled or not (other sessions on the server may hold transactions).
    let moved = |outcome: &str| {
        format!(
            "{}{{pipeline=\"default\",outcome=\"{outcome}\"}}",
            metrics::FOLD_ROUNDS
        )
    };
    let (advanced, unsettled) = (moved("advanced"), moved("unsettled"));
    let rounds = || async {
        let (_, body) = http_get(port, "/metrics").await?;
        Some(metric(&body, &advanced)? + metric(&body, &unsettled)?)
    };
    assert_eq!(
        rounds().await,
        Some(0.0),
        "no round while the lock is taken"
    );

    drop(blocker);
    wait_for(WAIT, "the fold to move the frontier", || async {
        let age = gauge(port, metrics::FRONTIER_AGE).await?;
        (age < 3.0 && rounds().await? > 0.0).then_some(())
    })
    .await;
    let (_, out, _) = run_cli(&["status", "--config", &config_file(&toml)], &[]);
    assert!(out.contains("frontier") && out.contains("moved"), "{out}");
    assert_eq!(relay.terminate().code(), Some(0));
}
