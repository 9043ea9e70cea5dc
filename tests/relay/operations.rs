//! What operators see: metrics, readiness, `status`, several pipelines in one process.

use crate::support::brokers::RabbitExchange;
use crate::support::proxy::setup_cut;
use crate::support::*;
use serde_json::{Value, json};
use uuid::Uuid;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_are_scraped_after_a_known_workload() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let (mut relay, port) = ChildRelay::serving(&toml);
    for i in 0..25 {
        db.insert(Uuid::new_v4(), "order", &format!("a{i}"), json!({}))
            .await;
    }
    broker.inbox().wait_len(25, WAIT).await;
    let p = "pipeline=\"default\"";
    let text = wait_for(WAIT, "the metrics to show the workload", || async {
        let (code, body) = http_get(port, "/metrics").await?;
        let done = code == 200
            && metric(
                &body,
                &format!("outbox_relay_events_published_total{{destination=\"rabbitmq\",{p}}}"),
            ) == Some(25.0)
            && metric(&body, &format!("outbox_relay_backlog_events{{{p}}}")) == Some(0.0);
        done.then_some(body)
    })
    .await;
    assert_eq!(
        metric(&text, &format!("outbox_relay_active{{{p}}}")),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, &format!("outbox_relay_in_flight{{{p}}}")),
        Some(0.0)
    );
    assert_eq!(
        metric(&text, &format!("outbox_relay_dead_letters{{{p}}}")),
        Some(0.0)
    );
    assert_eq!(
        metric(
            &text,
            &format!(
                "outbox_relay_commit_to_confirm_seconds_count{{destination=\"rabbitmq\",{p}}}"
            )
        ),
        Some(25.0)
    );
    assert!(
        text.contains("outbox_relay_commit_to_confirm_seconds_bucket"),
        "a histogram, not a summary"
    );
    assert!(
        !text.contains("aggregate_id") && !text.contains("a1\""),
        "no id ever becomes a label"
    );
    let (code, body) = http_get(port, "/healthz").await.unwrap();
    assert_eq!((code, body.as_str()), (200, "ok\n"));
    assert_eq!(relay.terminate().code(), Some(0));
}

both_brokers!(readiness_flips_when_the_broker_goes_away_and_back);
async fn readiness_flips_when_the_broker_goes_away_and_back(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup_cut(mode, kind, &[]).await;
    let (mut relay, port) = ChildRelay::serving(&toml);
    let ready = |want: u16, state: &'static str| readyz(port, want, state);
    ready(200, "default: active").await;
    broker.proxy().cut();
    let body = ready(503, "default: failing").await;
    assert!(
        body.contains("RabbitMQ") || body.contains("broker"),
        "{body}"
    );
    broker.proxy().restore();
    ready(200, "default: active").await;
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    broker.inbox.wait_ids(&[id.to_string()], WAIT).await;
    // A second instance is a ready standby.
    let (mut standby, standby_port) = ChildRelay::serving(&toml);
    wait_for(WAIT, "the standby to report itself", || async {
        let (code, body) = http_get(standby_port, "/readyz").await?;
        (code == 200 && body == "default: standby\n").then_some(())
    })
    .await;
    assert_eq!(standby.terminate().code(), Some(0));
    assert_eq!(relay.terminate().code(), Some(0));
}

/// The README's promise for the database: unreachable, the relay is not
/// ready and says so; back, it is ready and relays again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_flips_when_the_database_goes_away_and_back() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let (proxy, toml) = db.behind_proxy(&toml).await;
    let (mut relay, port) = ChildRelay::serving(&toml);
    let ready = |want: u16, state: &'static str| readyz(port, want, state);
    ready(200, "default: active").await;
    proxy.cut();
    // The run's own error first ("connection closed"), then its reconnects'.
    ready(503, "default: failing: cannot connect to PostgreSQL").await;
    proxy.restore();
    ready(200, "default: active").await;
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    broker.inbox().wait_ids(&[id.to_string()], WAIT).await;
    assert_eq!(relay.terminate().code(), Some(0));
}

/// Waits until `/readyz` answers `want` with `state` in its body; the body.
async fn readyz(port: u16, want: u16, state: &str) -> String {
    wait_for(WAIT, &format!("/readyz {want} {state}"), || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == want && body.contains(state)).then_some(body)
    })
    .await
}

fn status_json(path: &str) -> Vec<Value> {
    let (code, out, err) = run_cli(&["status", "--config", path, "--json"], &[]);
    assert_eq!(code, 0, "{err}");
    out.lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_json_matches_a_known_state() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let path = config_file(&toml);
    for i in 0..5 {
        db.insert(Uuid::new_v4(), "order", &format!("a{i}"), json!({}))
            .await;
    }
    let s = &status_json(&path)[0];
    assert_eq!(s["pipeline"], "default");
    assert_eq!(s["mode"], "polling");
    assert_eq!(s["sink"], "rabbitmq");
    assert_eq!(s["backlog"], 5);
    assert_eq!(s["active"], Value::Null, "no relay runs");
    assert_eq!(s["dead_letters"], 0);
    assert!(s["oldest_unsent_age_seconds"].as_f64().unwrap() >= 0.0);
    let text = run_cli(&["status", "--config", &path], &[]).1;
    assert!(
        text.contains("backlog") && text.contains("5 unsent event(s)"),
        "{text}"
    );

    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_len(5, WAIT).await;
    let s = wait_for(
        WAIT,
        "status to show the relay and an empty backlog",
        || {
            let path = path.clone();
            async move {
                let s = status_json(&path).remove(0);
                (s["backlog"] == 0 && !s["active"].is_null()).then_some(s)
            }
        },
    )
    .await;
    assert_eq!(s["active"]["application_name"], "outbox-relay");
    assert!(s["last_publish"].is_string(), "{s}");
    relay.stop().await;
}

/// A backlog too large to count within the statement timeout does not hide
/// the rest of `status`: the count's failure (here a cancel, as a timeout
/// is one: SQLSTATE 57014) is shown in its place, the other lines are
/// still read, and the command fails after printing them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_rest_when_the_backlog_cannot_be_counted() {
    let (db, _broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[("relay.mark", "\"update\"")],
    )
    .await;
    let path = config_file(&toml);
    for i in 0..3 {
        db.insert(Uuid::new_v4(), "order", &format!("a{i}"), json!({}))
            .await;
    }
    // Another session holds the table, so the count waits; it is cancelled.
    let locker = connect(&db.url).await;
    locker
        .batch_execute("BEGIN; LOCK TABLE outbox IN ACCESS EXCLUSIVE MODE")
        .await
        .expect("lock the outbox");
    let status =
        tokio::task::spawn_blocking(move || run_cli(&["status", "--config", &path, "--json"], &[]));
    let counting: i32 = wait_for(
        WAIT,
        "the count of unsent rows to wait for the lock",
        || async {
            db.client
                .query_opt(
                    "SELECT pid FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                   AND query LIKE 'SELECT count(*) FROM %relay_sent_at IS NULL'",
                    &[],
                )
                .await
                .expect("read pg_stat_activity")
                .map(|r| r.get(0))
        },
    )
    .await;
    db.client
        .execute("SELECT pg_cancel_backend($1)", &[&counting])
        .await
        .expect("cancel the count");
    locker.batch_execute("COMMIT").await.expect("unlock");
    let (code, out, err) = tokio::time::timeout(WAIT, status)
        .await
        .expect("status within the wait")
        .expect("status ran");
    assert_ne!(
        code, 0,
        "a count it could not read fails the command: {out}"
    );
    let s: Value = serde_json::from_str(out.trim()).expect("the snapshot, printed before failing");
    assert_eq!(s["backlog"], Value::Null, "{s}");
    let why = s["backlog_error"].as_str().unwrap_or_default();
    assert!(
        why.contains("not counted") && why.contains("cancelled"),
        "{s}"
    );
    assert_eq!(s["dead_letters"], 0, "the rest is read: {s}");
    assert!(
        s["oldest_unsent_age_seconds"].as_f64().is_some(),
        "{s} {err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_process_relays_several_pipelines() {
    let db = TestDb::new().await;
    let orders = RabbitExchange::new().await;
    let billing = RabbitExchange::new().await;
    let toml = format!(
        "{}\n[pipelines.orders.outbox]\ntable = \"public.orders_outbox\"\n\n[pipelines.billing.outbox]\ntable = \"public.billing_outbox\"\n\n[pipelines.billing.sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{}\"\n",
        base_toml(&db.url, &orders.sink_toml()),
        amqp_url(),
        billing.exchange
    );
    let configs = outbox_relay::config::load_all_str(&toml).unwrap();
    assert_eq!(configs.len(), 2);
    for c in &configs {
        db.migrate(c).await;
    }
    let (mut relay, port) = ChildRelay::serving(&toml);
    let (o, b) = (Uuid::new_v4(), Uuid::new_v4());
    for (table, id) in [("orders_outbox", o), ("billing_outbox", b)] {
        db.client
            .execute(
                &format!("INSERT INTO {table} (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'x', 'a', 'E', '{{}}')"),
                &[&id],
            )
            .await
            .unwrap();
    }
    orders.inbox.wait_ids(&[o.to_string()], WAIT).await;
    billing.inbox.wait_ids(&[b.to_string()], WAIT).await;
    assert_eq!(
        orders.inbox.len(),
        1,
        "each pipeline to its own destination"
    );
    assert_eq!(billing.inbox.len(), 1);
    let text = wait_for(WAIT, "both pipelines in the metrics", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        (body.contains("pipeline=\"orders\"") && body.contains("pipeline=\"billing\""))
            .then_some(body)
    })
    .await;
    assert_eq!(
        metric(&text, "outbox_relay_active{pipeline=\"orders\"}"),
        Some(1.0)
    );
    let (_, ready) = http_get(port, "/readyz").await.unwrap();
    assert!(
        ready.contains("orders: active") && ready.contains("billing: active"),
        "{ready}"
    );
    let path = config_file(&toml);
    let names: Vec<String> = status_json(&path)
        .iter()
        .map(|s| s["pipeline"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names.len(), 2);
    assert_eq!(relay.terminate().code(), Some(0));
}

/// Without marking (CDC, `relay.mark = "none"`) every row of the table looks
/// unsent: `status`, `check` and the gauges say the table cannot tell,
/// instead of counting the table as a backlog that never shrinks (and
/// firing the backlog alert on the oldest row's age).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_marking_the_backlog_is_not_counted_from_the_table() {
    let (db, broker, toml) =
        setup(Mode::Cdc, Kind::Rabbit, &[], &[("relay.mark", "\"none\"")]).await;
    let path = config_file(&toml);
    let (mut relay, port) = ChildRelay::serving(&toml);
    for i in 0..5 {
        db.insert(Uuid::new_v4(), "order", &format!("a{i}"), json!({}))
            .await;
    }
    broker.inbox().wait_len(5, WAIT).await;
    assert_eq!(db.unsent().await, 5, "the rows stay, unmarked");
    let p = "pipeline=\"default\"";
    let published = format!("outbox_relay_events_published_total{{destination=\"rabbitmq\",{p}}}");
    wait_for(WAIT, "the metrics to show the events published", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        (metric(&body, &published) == Some(5.0)).then_some(())
    })
    .await;
    // Samples are taken every 200 ms: a few after the rows were written.
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    let (_, body) = http_get(port, "/metrics").await.expect("metrics");
    for gauge in [
        "outbox_relay_backlog_events",
        "outbox_relay_oldest_unsent_age_seconds",
    ] {
        assert_eq!(
            metric(&body, &format!("{gauge}{{{p}}}")),
            Some(0.0),
            "{gauge}: {body}"
        );
    }
    let s = status_json(&path).remove(0);
    assert_eq!(s["backlog"], Value::Null, "{s}");
    assert_eq!(s["oldest_unsent_age_seconds"], Value::Null, "{s}");
    // What says how far behind it is instead: the slot, streaming.
    assert_eq!(s["slot"]["streaming"], true, "{s}");
    assert!(s["slot"]["retained_wal_bytes"].as_i64().is_some(), "{s}");
    assert!(s["slot"]["confirmed_lag_bytes"].as_i64().is_some(), "{s}");
    let text = run_cli(&["status", "--config", &path], &[]).1;
    assert!(text.contains("not known from the table"), "{text}");
    assert!(
        text.lines()
            .any(|l| l.contains("slot") && l.contains("streaming") && l.contains("retains")),
        "{text}"
    );
    let (_, out, _) = run_cli(&["check", "--config", &path], &[]);
    let line = |what: &str| check_line(&out, what);
    assert!(
        line("backlog").contains("not known from the table"),
        "{out}"
    );
    assert!(
        line("ownership").contains("another instance is active"),
        "{out}"
    );
    assert!(
        line("slot").contains("streaming") && line("slot").contains("retains"),
        "{out}"
    );
    assert_eq!(relay.terminate().code(), Some(0));
    let (_, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        out.lines()
            .any(|l| l.contains("ownership") && l.contains("no instance is active")),
        "{out}"
    );
}

/// The oldest unsent row's age, as `status` and the gauge read it, by how
/// sent rows are recorded; none (not a failure) when its `created_at` is
/// NULL in a table whose column allows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_unsent_age_is_read_by_marking_and_a_null_created_at_has_none() {
    for mark in ["update", "ranges"] {
        let quoted = format!("\"{mark}\"");
        let sets = [("relay.mark", quoted.as_str())];
        let (db, _broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &sets).await;
        let config = parse(&toml);
        let age = || outbox_relay::ops::status::oldest_unsent_age(&db.client, &config);
        assert_eq!(age().await.expect("an empty outbox"), None, "{mark}");
        let insert = |created_at: &'static str| {
            let client = &db.client;
            async move {
                client
                    .batch_execute(&format!(
                        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, created_at)
                         VALUES (gen_random_uuid(), 'order', 'a', 'created', '{{}}', {created_at})"
                    ))
                    .await
                    .unwrap()
            }
        };
        insert("now() - interval '90 seconds'").await;
        insert("now()").await;
        let seconds = age().await.expect("two unsent rows").expect("an age");
        assert!((90.0..600.0).contains(&seconds), "{mark}: {seconds}");
        // The write-once trigger forbids changing an unsent row: a new one.
        db.client
            .batch_execute(
                "ALTER TABLE outbox ALTER COLUMN created_at DROP NOT NULL; DELETE FROM outbox",
            )
            .await
            .unwrap();
        insert("NULL").await;
        insert("now()").await;
        assert_eq!(age().await.expect("a NULL created_at"), None, "{mark}");
    }
}

/// A stop that comes while the broker does not take a message (here
/// RabbitMQ gone silent while the relay looks up a new exchange) is bounded
/// by `relay.shutdown_timeout`, not by `relay.confirm_timeout`: the relay
/// exits 0 in time, and the event stays unsent for the next owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_while_the_broker_takes_nothing_keeps_to_shutdown_timeout() {
    let sets = [
        ("relay.confirm_timeout", "\"60s\""),
        ("relay.shutdown_timeout", "\"4s\""),
        ("outbox.columns.destination", "\"route_to\""),
    ];
    let (db, broker, toml) = setup_cut(Mode::Polling, Kind::Rabbit, &sets).await;
    db.client
        .batch_execute("ALTER TABLE outbox ADD COLUMN route_to text")
        .await
        .unwrap();
    let mut relay = ChildRelay::start(&toml);
    let first = Uuid::new_v4();
    db.insert(first, "order", "a", json!({})).await;
    broker.inbox.wait_ids(&[first.to_string()], WAIT).await;
    assert!(broker.proxy().freeze_all() > 0, "the broker is proxied");
    let stuck = Uuid::new_v4();
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, route_to) \
             VALUES ($1, 'order', 'b', 'created', '{}', 'amq.topic')",
            &[&stuck],
        )
        .await
        .unwrap();
    // Read, and waiting on the exchange lookup the broker does not answer.
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    let asked = std::time::Instant::now();
    let status = relay.terminate();
    let took = asked.elapsed();
    assert_eq!(status.code(), Some(0), "a clean exit, in {took:?}");
    assert!(took < std::time::Duration::from_secs(15), "{took:?}");
    assert!(
        db.unsent_ids().await.contains(&stuck.to_string()),
        "left for the next owner"
    );
}

/// A mark set by hand past what a timestamp can show (`infinity`, a year
/// beyond 262143) is not the last publish time: `status` shows the newest
/// real one instead of failing on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_leaves_out_a_mark_set_to_infinity() {
    let (db, _broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[("relay.mark", "\"update\"")],
    )
    .await;
    let path = config_file(&toml);
    db.client
        .batch_execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, relay_sent_at) VALUES
                 (gen_random_uuid(), 'order', 'a', 'Happened', '{}', 'infinity'),
                 (gen_random_uuid(), 'order', 'b', 'Happened', '{}', '294000-01-01'),
                 (gen_random_uuid(), 'order', 'c', 'Happened', '{}', '2026-01-02 03:04:05+00')",
        )
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["status", "--config", &path, "--json"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let s: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(s["last_publish"], "2026-01-02T03:04:05Z", "{out}");
}
