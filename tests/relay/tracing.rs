//! Event spans exported over OTLP (`telemetry.otlp.endpoint`): they continue
//! the row's trace, the message names them in its `traceparent`, and a
//! collector that is gone or silent never holds delivery up.

use crate::kit::certs::Ca;
use crate::support::brokers::Received;
use crate::support::otlp::{OtlpReceiver, ReceivedSpan, SilentCollector};
use crate::support::*;
use std::time::{Duration, Instant};
use uuid::Uuid;

const ROW_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const ROW_SPAN: &str = "00f067aa0ba902b7";

fn row_traceparent() -> String {
    format!("00-{ROW_TRACE}-{ROW_SPAN}-01")
}

async fn insert_with_headers(db: &TestDb, id: Uuid, aggregate_id: &str, headers: &str) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ($1, 'order', $2, 'OrderPlaced', '{\"total\": 1}', $3::text::jsonb)",
            &[&id, &aggregate_id, &headers],
        )
        .await
        .unwrap();
}

/// A polling relay on RabbitMQ sending its spans to `endpoint`, with `more` settings.
async fn traced(endpoint: &str, more: &[(&str, &str)]) -> (TestDb, Broker, String) {
    let endpoint = format!("\"{endpoint}\"");
    let mut sets = vec![("telemetry.otlp.endpoint", endpoint.as_str())];
    sets.extend_from_slice(more);
    setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await
}

fn span_of<'a>(spans: &'a [ReceivedSpan], id: &str) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|s| s.attribute("messaging.message.id") == Some(id))
        .collect()
}

fn message_of<'a>(got: &'a [Received], id: &str) -> &'a Received {
    got.iter()
        .find(|m| m.event_id() == id)
        .expect("the event was delivered")
}

/// `00-<trace>-<parent>-<flags>`, split.
fn parts(traceparent: &str) -> (String, String, String) {
    let p: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(p.len(), 4, "{traceparent}");
    assert_eq!(p[0], "00", "{traceparent}");
    (p[1].to_owned(), p[2].to_owned(), p[3].to_owned())
}

every_mode!(spans_continue_the_rows_trace);
async fn spans_continue_the_rows_trace(mode: Mode, kind: Kind) {
    let receiver = OtlpReceiver::start().await;
    let (db, broker, toml) = setup(
        mode,
        kind,
        &["order"],
        &[
            (
                "telemetry.otlp.endpoint",
                &format!("\"{}\"", receiver.endpoint()),
            ),
            ("telemetry.otlp.service_name", "\"relay-under-test\""),
        ],
    )
    .await;
    let (traced, fresh) = (Uuid::new_v4(), Uuid::new_v4());
    insert_with_headers(
        &db,
        traced,
        "o-1",
        &format!(
            r#"{{"traceparent": "{}", "tracestate": "shop=7", "tenant": "acme"}}"#,
            row_traceparent()
        ),
    )
    .await;
    insert_with_headers(&db, fresh, "o-2", r#"{"tenant": "acme"}"#).await;
    let relay = InProcess::start(parse(&toml));
    let ids = strings(&[traced, fresh]);
    let got = broker.inbox().wait_ids(&ids, WAIT).await;
    let spans = receiver.wait_outcomes(&ids, "published", WAIT).await;
    relay.stop().await;
    let spans_after_stop = receiver.spans();

    // The row's trace continues: same trace id, the row's span as parent.
    let s = span_of(&spans_after_stop, &ids[0]);
    assert_eq!(s.len(), 1, "one span per event: {s:#?}");
    let s = s[0];
    assert_eq!(s.trace_id, ROW_TRACE);
    assert_eq!(s.parent_span_id, ROW_SPAN);
    assert_eq!(s.name, "publish");
    assert_eq!(s.service_name.as_deref(), Some("relay-under-test"));
    assert_eq!(s.attribute("outbox.aggregate_type"), Some("order"));
    assert_eq!(s.attribute("outbox.aggregate_id"), Some("o-1"));
    assert_eq!(s.attribute("outbox.event_type"), Some("OrderPlaced"));
    assert_eq!(s.attribute("outbox.outcome"), Some("published"));
    let destination = match &broker {
        Broker::Kafka(k) => k.topic("order"),
        Broker::Rabbit(r) => r.exchange.clone(),
    };
    assert_eq!(
        s.attribute("messaging.destination.name"),
        Some(destination.as_str())
    );
    assert_eq!(s.events, ["published", "confirmed", "marked"]);

    // The message names the relay's span, so consumers nest under it.
    let m = message_of(&got, &ids[0]);
    let (trace, parent, flags) = parts(m.header("traceparent").expect("a traceparent"));
    assert_eq!((trace.as_str(), flags.as_str()), (ROW_TRACE, "01"));
    assert_eq!(parent, s.span_id);
    assert_eq!(m.header("tracestate"), Some("shop=7"));
    assert_eq!(m.header("tenant"), Some("acme"));
    let body = m.json();
    assert_eq!(body["traceparent"], m.header("traceparent").unwrap());
    assert_eq!(body["tracestate"], "shop=7");

    // A row without a traceparent starts a trace; the message carries it.
    let s = span_of(&spans, &ids[1]);
    assert_eq!(s.len(), 1, "{s:#?}");
    let s = s[0];
    assert!(s.parent_span_id.is_empty(), "a root span: {s:?}");
    assert_ne!(s.trace_id, ROW_TRACE);
    let m = message_of(&got, &ids[1]);
    let (trace, parent, _) = parts(m.header("traceparent").expect("a traceparent"));
    assert_eq!((trace, parent), (s.trace_id.clone(), s.span_id.clone()));
    assert_eq!(span_of(&spans_after_stop, &ids[1]).len(), 1);
}

/// A refused event has a span per attempt: failed, then dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_event_has_failed_then_dead_lettered_spans() {
    let receiver = OtlpReceiver::start().await;
    let (db, broker, toml) = traced(
        &receiver.endpoint(),
        &[
            ("dead_letter.max_attempts", "2"),
            ("relay.reject_retry_base", "\"100ms\""),
            ("relay.reject_retry_max", "\"200ms\""),
            ("sink.message_max_bytes", "4000"),
        ],
    )
    .await;
    let (big, fine) = (Uuid::new_v4(), Uuid::new_v4());
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
             VALUES ($1, 'order', 'o-9', 'Big', jsonb_build_object('x', repeat('x', 8000)), $2::text::jsonb)",
            &[&big, &format!(r#"{{"traceparent": "{}"}}"#, row_traceparent())],
        )
        .await
        .unwrap();
    db.insert(fine, "order", "o-10", serde_json::json!({}))
        .await;
    let relay = InProcess::start(parse(&toml));
    let ids = strings(&[big, fine]);
    broker.inbox().wait_ids(&ids[1..], WAIT).await;
    let spans = receiver
        .wait_outcomes(&ids[..1], "dead-lettered", WAIT)
        .await;
    relay.stop().await;
    let attempts = span_of(&spans, &ids[0]);
    let outcomes: Vec<_> = attempts
        .iter()
        .map(|s| s.attribute("outbox.outcome").unwrap())
        .collect();
    assert_eq!(outcomes, ["failed", "dead-lettered"], "{attempts:#?}");
    for s in attempts {
        assert_eq!(
            (s.trace_id.as_str(), s.parent_span_id.as_str()),
            (ROW_TRACE, ROW_SPAN)
        );
        assert_eq!(s.attribute("outbox.event_type"), Some("Big"));
    }
    assert_eq!(
        span_of(&spans, &ids[1])[0].attribute("outbox.outcome"),
        Some("published")
    );
}

/// A collector that takes connections and never answers, with a queue of
/// four spans: events flow at full speed, spans are dropped, and shutdown
/// still ends within its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_collector_does_not_hold_delivery_up() {
    let silent = SilentCollector::start().await;
    let (db, broker, toml) = traced(
        &silent.endpoint(),
        &[
            ("telemetry.otlp.max_queue_size", "4"),
            ("relay.shutdown_timeout", "\"3s\""),
        ],
    )
    .await;
    let ids = ids(200);
    for (i, id) in ids.iter().enumerate() {
        db.insert(*id, "order", &format!("a{}", i % 7), serde_json::json!({}))
            .await;
    }
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_ids(&strings(&ids), WAIT).await;
    for m in &got {
        assert!(
            m.header("traceparent").is_some(),
            "traced while export fails"
        );
    }
    wait_for(WAIT, "every row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    // Draining (3 s at most) and flushing (3 s at most) bound the stop,
    // although an export is waiting for an answer that never comes.
    let started = Instant::now();
    relay.stop().await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "stopped in {:?}",
        started.elapsed()
    );
}

/// Nothing listens at the endpoint: the relay delivers as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_collector_does_not_stop_delivery() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[(
            "telemetry.otlp.endpoint",
            &format!("\"http://127.0.0.1:{port}\""),
        )],
    )
    .await;
    let ids = ids(20);
    for id in &ids {
        db.insert(*id, "order", "a", serde_json::json!({})).await;
    }
    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_ids(&strings(&ids), WAIT).await;
    wait_for(WAIT, "every row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;
}

/// `telemetry.otlp.ca` in a fresh directory; returns the CA and the path.
fn write_ca(name: &str, ca: &Ca) -> String {
    let dir = std::env::temp_dir().join(unique("outbox-relay-otlp-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, ca.cert_pem()).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A collector behind TLS with a private CA: with `telemetry.otlp.ca` the
/// relay verifies it and exports; `check` reaches it too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_collector_of_the_configured_ca_receives_spans() {
    let ca = Ca::new("outbox-relay test collector CA");
    let receiver = OtlpReceiver::start_tls(&ca.server(&["localhost"], &["127.0.0.1"])).await;
    let ca_path = write_ca("collector-ca.pem", &ca);
    let (db, broker, toml) = traced(
        &receiver.endpoint(),
        &[("telemetry.otlp.ca", &format!("\"{ca_path}\""))],
    )
    .await;
    assert!(receiver.endpoint().starts_with("https://"));
    let (code, out, _) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert!(
        out.lines()
            .any(|l| l.starts_with("[ok  ] traces") && l.contains("accepted an export")),
        "check reaches the collector ({code}): {out}"
    );
    let ids = ids(5);
    for id in &ids {
        db.insert(*id, "order", "a", serde_json::json!({})).await;
    }
    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_ids(&strings(&ids), WAIT).await;
    let spans = receiver
        .wait_outcomes(&strings(&ids), "published", WAIT)
        .await;
    assert!(spans.iter().all(|s| s.name == "publish"), "{spans:#?}");
    relay.stop().await;
    assert_eq!(receiver.refused_handshakes(), 0);
}

/// The same collector without `telemetry.otlp.ca`: its certificate is not
/// trusted, so no span reaches it (the handshake fails), events are still
/// delivered, and `check` warns, naming the key to set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_collector_of_an_unknown_ca_gets_nothing_and_check_says_why() {
    let ca = Ca::new("outbox-relay test collector CA");
    let receiver = OtlpReceiver::start_tls(&ca.server(&["localhost"], &["127.0.0.1"])).await;
    let (db, broker, toml) = traced(&receiver.endpoint(), &[]).await;
    let (_, out, _) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    let line = out
        .lines()
        .find(|l| l.starts_with("[warn] traces"))
        .unwrap_or_else(|| panic!("check warns about the collector: {out}"));
    assert!(
        line.contains("certificate") && line.contains("telemetry.otlp.ca"),
        "{line}"
    );
    let ids = ids(5);
    for id in &ids {
        db.insert(*id, "order", "a", serde_json::json!({})).await;
    }
    let refused_by_check = receiver.refused_handshakes();
    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_ids(&strings(&ids), WAIT).await;
    // Spans are exported within about a second of their end: wait for the
    // relay's own attempt to be turned away.
    wait_for(WAIT, "the relay's export attempt", || async {
        (receiver.refused_handshakes() > refused_by_check).then_some(())
    })
    .await;
    relay.stop().await;
    assert!(receiver.spans().is_empty(), "{:#?}", receiver.spans());
}

/// A CA file that cannot be read stops `run` before it starts, and fails
/// `check`, both naming the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_collector_ca_is_refused_with_the_key() {
    let missing = std::env::temp_dir()
        .join(unique("outbox-relay-no-ca-"))
        .join("ca.pem");
    let not_pem = write_ca("not.pem", &Ca::new("x")).replace("not.pem", "garbage.pem");
    std::fs::write(&not_pem, b"not a certificate").unwrap();
    for path in [missing.to_str().unwrap(), &not_pem] {
        let (_db, _broker, toml) = setup(
            Mode::Polling,
            Kind::Rabbit,
            &["order"],
            &[
                ("telemetry.otlp.endpoint", "\"https://127.0.0.1:9\""),
                ("telemetry.otlp.ca", &format!("\"{path}\"")),
            ],
        )
        .await;
        let file = config_file(&toml);
        let (code, out, _) = run_cli(&["check", "--config", &file], &[]);
        assert_ne!(code, 0, "{out}");
        assert!(
            out.lines().any(|l| l.starts_with("[FAIL] traces")
                && l.contains("telemetry.otlp.ca")
                && l.contains(path)),
            "{out}"
        );
        // Bounded: a relay that started anyway is stopped after a minute.
        let run = std::process::Command::new("timeout")
            .arg("60")
            .arg(relay_bin())
            .args(["run", "--config", &file])
            .output()
            .expect("run outbox-relay");
        let err = String::from_utf8_lossy(&run.stderr);
        assert_eq!(run.status.code(), Some(1), "{err}");
        assert!(
            err.contains("telemetry.otlp.ca") && err.contains(path),
            "{err}"
        );
    }
}
