//! `[[outbox.columns.extra]]`: more columns of the table, published as
//! headers and CloudEvents extension attributes in both source modes, NULL
//! ones omitted, and kept through a dead letter and its redrive.

use crate::dead_letters::dlq_list;
use crate::support::brokers::Received;
use crate::support::*;
use serde_json::json;
use uuid::Uuid;

/// `tenant_id` as header `tenant` and attribute `tenantid`; `region` as an
/// attribute only.
const EXTRA: &str = r#"
[[outbox.columns.extra]]
column = "tenant_id"
header = "tenant"
attribute = "tenantid"

[[outbox.columns.extra]]
column = "region"
attribute = "region"
"#;

/// A migrated outbox with the two extra columns added, as an application
/// table would have them, and the relay config that maps them.
async fn setup_extra(mode: Mode, kind: Kind, sets: &[(&str, &str)]) -> (TestDb, Broker, String) {
    let (db, broker, toml) = setup(mode, kind, &["order"], sets).await;
    db.client
        .batch_execute("ALTER TABLE outbox ADD COLUMN tenant_id text, ADD COLUMN region integer")
        .await
        .unwrap();
    (db, broker, format!("{toml}\n{EXTRA}"))
}

async fn insert(db: &TestDb, id: Uuid, tenant: Option<&str>, region: Option<i32>, headers: &str) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers, tenant_id, region)
             VALUES ($1, 'order', 'o-1', 'OrderPlaced', '{\"n\": 1}', $2::text::jsonb, $3, $4)",
            &[&id, &headers, &tenant, &region],
        )
        .await
        .unwrap();
}

fn by_id<'a>(got: &'a [Received], id: &Uuid) -> &'a Received {
    got.iter()
        .find(|m| {
            // Binary mode on RabbitMQ names the id cloudEvents:id.
            let found = m
                .header("event_id")
                .or(m.header("ce_id"))
                .or(m.header("cloudEvents:id"));
            found == Some(id.to_string().as_str())
        })
        .unwrap_or_else(|| panic!("no message for {id}"))
}

every_mode!(extra_columns_are_attributes_and_headers);
async fn extra_columns_are_attributes_and_headers(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup_extra(mode, kind, &[]).await;
    // Read from the table (in CDC mode, by the start-up read)...
    let early = Uuid::new_v4();
    insert(&db, early, Some("t-1"), None, "{}").await;
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_len(1, WAIT).await;
    assert_eq!(by_id(&got, &early).json()["tenantid"], "t-1");
    assert_eq!(by_id(&got, &early).header("tenant"), Some("t-1"));
    // ...and, the relay running, streamed in CDC mode.
    let (full, nulls) = (Uuid::new_v4(), Uuid::new_v4());
    insert(&db, full, Some("t-42"), Some(7), "{}").await;
    // The row's own "tenant" header cannot stand in for a NULL column.
    insert(&db, nulls, None, None, r#"{"tenant": "spoofed"}"#).await;
    let got = broker.inbox().wait_len(3, WAIT).await;
    let m = by_id(&got, &full);
    let body = m.json();
    assert_eq!(body["tenantid"], "t-42", "{body}");
    assert_eq!(body["region"], "7", "attributes are strings: {body}");
    assert_eq!(body["data"], json!({"n": 1}));
    assert_eq!(m.header("tenant"), Some("t-42"));
    assert_eq!(m.header("region"), None, "region is an attribute only");
    let m = by_id(&got, &nulls);
    let body = m.json();
    assert!(
        body.get("tenantid").is_none() && body.get("region").is_none(),
        "{body}"
    );
    assert_eq!(m.header("tenant"), None, "{:?}", m.headers);
    wait_for(WAIT, "the rows to be marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;
}

every_mode!(binary_mode_names_extra_attributes_by_binding);
async fn binary_mode_names_extra_attributes_by_binding(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup_extra(mode, kind, &[("envelope.mode", "\"binary\"")]).await;
    let relay = InProcess::start(parse(&toml));
    // Inserted while the relay runs: streamed in CDC mode.
    let (full, nulls) = (Uuid::new_v4(), Uuid::new_v4());
    insert(&db, full, Some("t-42"), Some(7), "{}").await;
    insert(&db, nulls, None, None, "{}").await;
    let got = broker.inbox().wait_len(2, WAIT).await;
    let prefix = match kind {
        Kind::Kafka => "ce_",
        Kind::Rabbit => "cloudEvents:",
    };
    let m = by_id(&got, &full);
    assert_eq!(m.json(), json!({"n": 1}), "the body is the payload");
    assert_eq!(m.header(&format!("{prefix}tenantid")), Some("t-42"));
    assert_eq!(m.header(&format!("{prefix}region")), Some("7"));
    assert_eq!(m.header("tenant"), Some("t-42"));
    let m = by_id(&got, &nulls);
    assert_eq!(
        m.header(&format!("{prefix}tenantid")),
        None,
        "{:?}",
        m.headers
    );
    assert_eq!(m.header(&format!("{prefix}region")), None);
    assert_eq!(m.header("tenant"), None);
    relay.stop().await;
}

every_mode!(a_redriven_dead_letter_keeps_its_extra_values);
async fn a_redriven_dead_letter_keeps_its_extra_values(mode: Mode, kind: Kind) {
    let sets = [
        ("dead_letter.max_attempts", "1"),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
        ("sink.message_max_bytes", "4000"),
    ];
    let (db, broker, toml) = setup_extra(mode, kind, &sets).await;
    let path = config_file(&toml);
    let poison = Uuid::new_v4();
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, tenant_id, region)
             VALUES ($1, 'order', 'P', 'Big', jsonb_build_object('x', repeat('x', 8000)), 't-9', NULL)",
            &[&poison],
        )
        .await
        .unwrap();
    let relay = InProcess::start(parse(&toml));
    let listed = wait_for(WAIT, "the too-large event in the dead-letter table", || {
        let path = path.clone();
        async move {
            let letters = dlq_list(&path);
            (letters.len() == 1).then_some(letters)
        }
    })
    .await;
    relay.stop().await;
    assert_eq!(
        listed[0]["extra"],
        json!({"tenant_id": "t-9"}),
        "dlq list shows the extra values: {listed:?}"
    );
    let kept: Vec<(String, Option<serde_json::Value>)> = db
        .client
        .query("SELECT id, extra::jsonb FROM outbox_dead_letters", &[])
        .await
        .expect("read the dead-letter table")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        kept,
        vec![(poison.to_string(), Some(json!({"tenant_id": "t-9"})))],
        "the letter keeps the extra values, NULL ones left out"
    );
    let toml = toml.replace("message_max_bytes = 4000", "message_max_bytes = 100000");
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["dlq", "redrive", "--config", &path, "--all"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let relay = InProcess::start(parse(&toml));
    let got = broker.inbox().wait_ids(&[poison.to_string()], WAIT).await;
    let m = by_id(&got, &poison);
    assert_eq!(m.json()["tenantid"], "t-9");
    assert!(m.json().get("region").is_none());
    assert_eq!(m.header("tenant"), Some("t-9"));
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_key_of_a_missing_extra_column() {
    let (_db, _broker, toml) = setup(Mode::Polling, Kind::Kafka, &["order"], &[]).await;
    let toml =
        format!("{toml}\n[[outbox.columns.extra]]\ncolumn = \"tenant_id\"\nheader = \"tenant\"\n");
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    let all = format!("{out}{err}");
    assert_ne!(code, 0, "{all}");
    assert!(
        all.contains("column \"tenant_id\" (outbox.columns.extra[0].column) does not exist"),
        "{all}"
    );
}
