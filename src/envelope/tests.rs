//! The envelope's tests: what each mode and binding puts in a message.

use super::*;
use chrono::{TimeZone, Utc};

/// The attributes binary mode sets on every message, in order.
const ATTRIBUTES: [&str; 8] = [
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "aggregatetype",
    "eventversion",
];

fn has_header(m: &Message<'_>, name: &str, value: &str) -> bool {
    m.headers.iter().any(|(k, v)| k == name && v == value)
}

#[test]
fn binary_attribute_headers_are_the_prefixed_attributes() {
    for binding in [Binding::Kafka, Binding::Amqp] {
        let spelled: Vec<String> = ATTRIBUTES
            .iter()
            .map(|a| format!("{}{a}", binding.prefix()))
            .collect();
        assert_eq!(binding.attribute_headers().as_slice(), spelled.as_slice());
    }
}

fn event() -> OutboxEvent {
    OutboxEvent {
        id: "11111111-2222-4333-8444-555555555555".into(),
        aggregate_type: "order".into(),
        aggregate_id: "o-1".into(),
        event_type: "OrderPlaced".into(),
        event_version: 3,
        payload: RawValue::from_string(r#"{"total":12.5}"#.into()).unwrap(),
        headers: vec![
            (
                "traceparent".into(),
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into(),
            ),
            ("event_id".into(), "spoofed".into()),
            ("tenant".into(), "acme".into()),
        ],
        created_at: Utc.with_ymd_and_hms(2026, 11, 29, 15, 45, 41).unwrap(),
        extra: vec![],
    }
}

#[test]
fn structured_mode_is_cloudevents_json() {
    let env = Envelope::new(
        &EnvelopeConfig {
            mode: EnvelopeMode::Structured,
            source: "/shop".into(),
        },
        Binding::Kafka,
    );
    let e = event();
    let m = env.build(&e);
    let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "specversion": "1.0",
            "id": "11111111-2222-4333-8444-555555555555",
            "source": "/shop",
            "type": "OrderPlaced",
            "subject": "o-1",
            "time": "2026-11-29T15:45:41Z",
            "datacontenttype": "application/json",
            "aggregatetype": "order",
            "eventversion": 3,
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "data": {"total": 12.5}
        })
    );
    assert_eq!(m.key, "o-1");
    let h = |name: &str| {
        m.headers
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_ref())
            .collect::<Vec<_>>()
    };
    assert_eq!(
        h("event_id"),
        vec!["11111111-2222-4333-8444-555555555555"],
        "row headers cannot spoof relay headers"
    );
    assert_eq!(h("tenant"), vec!["acme"]);
    assert_eq!(h("event_version"), vec!["3"]);
}

#[test]
fn binary_mode_names_attributes_as_each_binding_does() {
    let config = EnvelopeConfig {
        mode: EnvelopeMode::Binary,
        source: "/shop".into(),
    };
    for (binding, prefix) in [(Binding::Kafka, "ce_"), (Binding::Amqp, "cloudEvents:")] {
        let e = event();
        let m = Envelope::new(&config, binding).build(&e);
        assert_eq!(m.body, br#"{"total":12.5}"#);
        let has = |name: &str, value: &str| has_header(&m, &format!("{prefix}{name}"), value);
        assert!(has("type", "OrderPlaced"), "{binding:?}");
        assert!(has("time", "2026-11-29T15:45:41Z"), "{binding:?}");
        assert!(has("eventversion", "3"), "{binding:?}");
        assert!(has("specversion", "1.0"), "{binding:?}");
        let other = if binding == Binding::Kafka {
            "cloudEvents:"
        } else {
            "ce_"
        };
        assert!(
            !m.headers.iter().any(|(k, _)| k.starts_with(other)),
            "{binding:?}: {:?}",
            m.headers
        );
        assert!(m.headers.iter().any(|(k, _)| k == "traceparent"));
        assert_eq!(m.content_type, JSON_CONTENT_TYPE);
    }
}

#[test]
fn a_traceparent_given_replaces_the_rows() {
    let relay = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01";
    for mode in [EnvelopeMode::Structured, EnvelopeMode::Binary] {
        let env = Envelope::new(
            &EnvelopeConfig {
                mode,
                source: "/shop".into(),
            },
            Binding::Kafka,
        );
        let mut row = event();
        row.headers.push(("tracestate".into(), "shop=1".into()));
        let plain = env.build(&row);
        let m = env.build_traced(&row, Some(relay));
        let values = |m: &Message<'_>, name: &str| {
            m.headers
                .iter()
                .filter(|(k, _)| k == name)
                .map(|(_, v)| v.to_string())
                .collect::<Vec<_>>()
        };
        assert_eq!(values(&m, "traceparent"), vec![relay], "{mode:?}");
        assert_eq!(values(&m, "tracestate"), vec!["shop=1"], "{mode:?}");
        assert_eq!(values(&plain, "tracestate"), vec!["shop=1"], "{mode:?}");
        if mode == EnvelopeMode::Structured {
            let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
            assert_eq!(body["traceparent"], relay);
            assert_eq!(body["tracestate"], "shop=1");
        }
        // Without a row traceparent the relay's is added.
        row.headers.retain(|(k, _)| k != "traceparent");
        let m = env.build_traced(&row, Some(relay));
        assert_eq!(values(&m, "traceparent"), vec![relay], "{mode:?}");
    }
}

fn tenant_columns() -> Vec<ExtraColumn> {
    vec![
        ExtraColumn {
            column: "tenant_id".into(),
            header: Some("tenant".into()),
            attribute: Some("tenantid".into()),
        },
        ExtraColumn {
            column: "region".into(),
            header: None,
            attribute: Some("region".into()),
        },
    ]
}

fn tenant_event() -> OutboxEvent {
    OutboxEvent {
        // "region" is NULL: absent; the row's own "tenant" header must not stand in.
        extra: vec![("tenant_id".into(), "t-42".into())],
        ..event()
    }
}

#[test]
fn extra_columns_are_attributes_in_the_document_and_headers() {
    let env = Envelope::new(
        &EnvelopeConfig {
            mode: EnvelopeMode::Structured,
            source: "/shop".into(),
        },
        Binding::Kafka,
    )
    .with_extra(&tenant_columns());
    let e = tenant_event();
    let m = env.build(&e);
    let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
    assert_eq!(body["tenantid"], "t-42");
    assert!(body.get("region").is_none(), "NULL is omitted: {body}");
    assert_eq!(body["data"], serde_json::json!({"total": 12.5}));
    let tenant: Vec<&str> = m
        .headers
        .iter()
        .filter(|(k, _)| k == "tenant")
        .map(|(_, v)| v.as_ref())
        .collect();
    assert_eq!(tenant, vec!["t-42"], "the column wins over the row header");
    // NULL: no header, and still no row header of that name.
    let e = OutboxEvent {
        extra: vec![],
        ..tenant_event()
    };
    let m = env.build(&e);
    assert!(
        !m.headers.iter().any(|(k, _)| k == "tenant"),
        "{:?}",
        m.headers
    );
    let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
    assert!(body.get("tenantid").is_none(), "{body}");
}

#[test]
fn binary_mode_prefixes_extra_attributes_by_binding() {
    let config = EnvelopeConfig {
        mode: EnvelopeMode::Binary,
        source: "/shop".into(),
    };
    for (binding, prefix) in [(Binding::Kafka, "ce_"), (Binding::Amqp, "cloudEvents:")] {
        let e = tenant_event();
        let m = Envelope::new(&config, binding)
            .with_extra(&tenant_columns())
            .build(&e);
        assert!(
            has_header(&m, &format!("{prefix}tenantid"), "t-42"),
            "{binding:?}: {:?}",
            m.headers
        );
        assert!(has_header(&m, "tenant", "t-42"));
        assert!(
            !m.headers.iter().any(|(k, _)| k.ends_with("region")),
            "{binding:?}: NULL omitted"
        );
        assert_eq!(m.body, br#"{"total":12.5}"#);
    }
}
