//! Turning an [`OutboxEvent`] into a broker-neutral [`Message`].
//!
//! The default is CloudEvents 1.0 in JSON structured mode
//! (<https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md>):
//! the body is the whole event, with the payload as `data`. Binary mode puts
//! the payload alone in the body and the attributes in headers named as the
//! broker's CloudEvents binding says: `ce_*` on Kafka, `cloudEvents:*`
//! (AMQP application properties) on RabbitMQ. Either way the row's own headers travel as
//! message headers, and `traceparent`/`tracestate` (the distributed tracing
//! extension) also appear as attributes in structured mode. The
//! `[[outbox.columns.extra]]` columns add extension attributes (named like
//! the others in each mode) and plain headers; a NULL value adds neither.
//!
//! When the relay exports spans ([`crate::telemetry::trace`]), the message's
//! `traceparent` (header, and attribute in structured mode) names the
//! relay's span instead of the row's parent; `tracestate` still passes through.

pub mod routing;

use crate::config::{EnvelopeConfig, EnvelopeMode, ExtraColumn};
use crate::outbox::OutboxEvent;
use chrono::SecondsFormat;
use serde::Serialize;
use serde::ser::SerializeMap;
use serde_json::value::RawValue;

/// Header names the relay sets in structured mode; a row header of the same
/// name is not copied, so consumers can trust these.
pub mod header {
    pub const EVENT_ID: &str = "event_id";
    pub const EVENT_TYPE: &str = "event_type";
    pub const EVENT_VERSION: &str = "event_version";
    pub const AGGREGATE_TYPE: &str = "aggregate_type";
    pub const CONTENT_TYPE: &str = "content-type";
}

/// The W3C trace context header (and CloudEvents attribute).
const TRACEPARENT: &str = "traceparent";

pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=utf-8";
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// A message ready for any broker. The destination is chosen by the sink,
/// from its templates or the row's routing columns.
#[derive(Debug, Clone)]
pub struct Message {
    /// The event id: Kafka header `event_id`, AMQP `message_id`.
    pub id: String,
    /// The aggregate id: the Kafka key, unless the row's key column
    /// replaces it (see [`routing`]).
    pub key: String,
    pub body: Vec<u8>,
    /// Message headers, relay-set ones first, then the row's.
    pub headers: Vec<(String, String)>,
    pub content_type: &'static str,
    pub event_type: String,
    /// Seconds since the epoch of `created_at` (AMQP `timestamp`).
    pub timestamp_secs: u64,
}

impl Message {
    /// Bytes the message occupies on the wire, near enough for size limits.
    pub fn size(&self) -> usize {
        self.key.len()
            + self.body.len()
            + self
                .headers
                .iter()
                .map(|(k, v)| k.len() + v.len() + 8)
                .sum::<usize>()
    }
}

#[derive(Serialize)]
struct StructuredEvent<'a> {
    specversion: &'static str,
    id: &'a str,
    source: &'a str,
    #[serde(rename = "type")]
    event_type: &'a str,
    subject: &'a str,
    time: String,
    datacontenttype: &'static str,
    aggregatetype: &'a str,
    eventversion: i32,
    #[serde(skip_serializing_if = "Option::is_none")]
    traceparent: Option<&'a str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    tracestate: Option<&'a str>,
    #[serde(flatten)]
    extensions: Extensions<'a>,
    data: &'a RawValue,
}

/// `(name, value)` pairs borrowed from the configuration and the event.
type Pairs<'a> = Vec<(&'a str, &'a str)>;

/// Extension attributes from extra columns, as members of the document.
struct Extensions<'a>(Pairs<'a>);

/// A message's body, content type and headers, before extra and row headers.
type Parts = (Vec<u8>, &'static str, Vec<(String, String)>);

impl Serialize for Extensions<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

/// The CloudEvents protocol binding whose header names binary mode uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Binding {
    /// The Kafka binding: `ce_` headers.
    Kafka,
    /// The AMQP binding: `cloudEvents:` application properties.
    Amqp,
}

impl Binding {
    /// The binding of a sink kind (`SinkConfig::kind`).
    pub fn of_sink(kind: &str) -> Binding {
        if kind == "rabbitmq" {
            Binding::Amqp
        } else {
            Binding::Kafka
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Binding::Kafka => "ce_",
            Binding::Amqp => "cloudEvents:",
        }
    }
}

/// Builds messages according to `[envelope]`.
#[derive(Debug, Clone)]
pub struct Envelope {
    mode: EnvelopeMode,
    source: String,
    binding: Binding,
    extra: Vec<ExtraColumn>,
}

impl Envelope {
    pub fn new(config: &EnvelopeConfig, binding: Binding) -> Self {
        Envelope {
            mode: config.mode,
            source: config.source.clone(),
            binding,
            extra: Vec::new(),
        }
    }

    /// Publishes these extra columns (`outbox.columns.extra`, validated).
    pub fn with_extra(mut self, extra: &[ExtraColumn]) -> Self {
        self.extra = extra.to_vec();
        self
    }

    /// `(attribute, value)` and `(header, value)` of the event's extra
    /// columns that are not NULL.
    fn extras<'a>(&'a self, event: &'a OutboxEvent) -> (Pairs<'a>, Pairs<'a>) {
        let (mut attributes, mut headers) = (Vec::new(), Vec::new());
        for x in &self.extra {
            let Some((_, value)) = event.extra.iter().find(|(c, _)| *c == x.column) else {
                continue;
            };
            if let Some(a) = &x.attribute {
                attributes.push((a.as_str(), value.as_str()));
            }
            if let Some(h) = &x.header {
                headers.push((h.as_str(), value.as_str()));
            }
        }
        (attributes, headers)
    }

    pub fn build(&self, event: &OutboxEvent) -> Message {
        self.build_traced(event, None)
    }

    /// As [`Self::build`]; a `traceparent` given replaces the row's (the
    /// relay's span, when it exports spans).
    pub fn build_traced(&self, event: &OutboxEvent, traceparent: Option<&str>) -> Message {
        let time = event
            .created_at
            .to_rfc3339_opts(SecondsFormat::AutoSi, true);
        let (attributes, extra_headers) = self.extras(event);
        let (body, content_type, mut headers) = match self.mode {
            EnvelopeMode::Structured => self.structured(event, time, attributes, traceparent),
            EnvelopeMode::Binary => self.binary(event, time, &attributes),
        };
        let reserved = headers.len();
        headers.extend(
            extra_headers
                .iter()
                .map(|(h, v)| ((*h).to_owned(), (*v).to_owned())),
        );
        // A configured extra header is the column's, even when it is NULL:
        // a row header cannot stand in for it.
        let taken = |k: &str| {
            headers[..reserved]
                .iter()
                .any(|(r, _)| r.eq_ignore_ascii_case(k))
                || self
                    .extra
                    .iter()
                    .filter_map(|x| x.header.as_deref())
                    .any(|h| h.eq_ignore_ascii_case(k))
        };
        let replaced = |k: &str| traceparent.is_some() && k.eq_ignore_ascii_case(TRACEPARENT);
        let row_headers: Vec<(String, String)> = event
            .headers
            .iter()
            .filter(|(k, _)| !taken(k) && !replaced(k))
            .cloned()
            .collect();
        headers.extend(row_headers);
        if let Some(t) = traceparent {
            headers.push((TRACEPARENT.to_owned(), t.to_owned()));
        }
        Message {
            id: event.id.clone(),
            key: event.aggregate_id.clone(),
            body,
            headers,
            content_type,
            event_type: event.event_type.clone(),
            timestamp_secs: u64::try_from(event.created_at.timestamp()).unwrap_or(0),
        }
    }

    /// A structured-mode body (the whole CloudEvent as JSON) and its headers.
    fn structured(
        &self,
        event: &OutboxEvent,
        time: String,
        attributes: Pairs<'_>,
        traceparent: Option<&str>,
    ) -> Parts {
        let row_header = |name: &str| {
            event
                .headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let ce = StructuredEvent {
            specversion: "1.0",
            id: &event.id,
            source: &self.source,
            event_type: &event.event_type,
            subject: &event.aggregate_id,
            time,
            datacontenttype: JSON_CONTENT_TYPE,
            aggregatetype: &event.aggregate_type,
            eventversion: event.event_version,
            traceparent: traceparent.or_else(|| row_header(TRACEPARENT)),
            tracestate: row_header("tracestate"),
            extensions: Extensions(attributes),
            data: &event.payload,
        };
        // Room for the fields and the JSON around them, so that the body
        // is written without growing (extensions may still grow it).
        let fields = [
            ce.id,
            ce.source,
            ce.event_type,
            ce.subject,
            &ce.time,
            ce.aggregatetype,
            ce.data.get(),
            ce.traceparent.unwrap_or_default(),
            ce.tracestate.unwrap_or_default(),
        ];
        let mut body = Vec::with_capacity(fields.iter().map(|f| f.len()).sum::<usize>() + 256);
        // Serializing borrowed strings and already-valid JSON cannot fail.
        if serde_json::to_writer(&mut body, &ce).is_err() {
            body.clear();
        }
        let headers: Vec<(String, String)> = vec![
            (header::CONTENT_TYPE.into(), STRUCTURED_CONTENT_TYPE.into()),
            (header::EVENT_ID.into(), event.id.clone()),
            (header::EVENT_TYPE.into(), event.event_type.clone()),
            (
                header::EVENT_VERSION.into(),
                event.event_version.to_string(),
            ),
            (header::AGGREGATE_TYPE.into(), event.aggregate_type.clone()),
        ];
        (body, STRUCTURED_CONTENT_TYPE, headers)
    }

    /// A binary-mode body (the payload) and the attributes as headers.
    fn binary(&self, event: &OutboxEvent, time: String, attributes: &Pairs<'_>) -> Parts {
        let p = self.binding.prefix();
        let attribute = |name: &str, value: String| (format!("{p}{name}"), value);
        let mut headers: Vec<(String, String)> = vec![
            (header::CONTENT_TYPE.into(), JSON_CONTENT_TYPE.into()),
            attribute("specversion", "1.0".into()),
            attribute("id", event.id.clone()),
            attribute("source", self.source.clone()),
            attribute("type", event.event_type.clone()),
            attribute("subject", event.aggregate_id.clone()),
            attribute("time", time),
            attribute("aggregatetype", event.aggregate_type.clone()),
            attribute("eventversion", event.event_version.to_string()),
        ];
        headers.extend(
            attributes
                .iter()
                .map(|(a, v)| attribute(a, (*v).to_owned())),
        );
        (
            event.payload.get().as_bytes().to_vec(),
            JSON_CONTENT_TYPE,
            headers,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::{TimeZone, Utc};

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
        let m = env.build(&event());
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
                .map(|(_, v)| v.as_str())
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
            let m = Envelope::new(&config, binding).build(&event());
            assert_eq!(m.body, br#"{"total":12.5}"#);
            let has = |name: &str, value: &str| {
                m.headers
                    .contains(&(format!("{prefix}{name}"), value.to_owned()))
            };
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
            let values = |m: &Message, name: &str| {
                m.headers
                    .iter()
                    .filter(|(k, _)| k == name)
                    .map(|(_, v)| v.clone())
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
        let m = env.build(&tenant_event());
        let body: serde_json::Value = serde_json::from_slice(&m.body).unwrap();
        assert_eq!(body["tenantid"], "t-42");
        assert!(body.get("region").is_none(), "NULL is omitted: {body}");
        assert_eq!(body["data"], serde_json::json!({"total": 12.5}));
        let tenant: Vec<&str> = m
            .headers
            .iter()
            .filter(|(k, _)| k == "tenant")
            .map(|(_, v)| v.as_str())
            .collect();
        assert_eq!(tenant, vec!["t-42"], "the column wins over the row header");
        // NULL: no header, and still no row header of that name.
        let m = env.build(&OutboxEvent {
            extra: vec![],
            ..tenant_event()
        });
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
            let m = Envelope::new(&config, binding)
                .with_extra(&tenant_columns())
                .build(&tenant_event());
            assert!(
                m.headers
                    .contains(&(format!("{prefix}tenantid"), "t-42".to_owned())),
                "{binding:?}: {:?}",
                m.headers
            );
            assert!(
                m.headers
                    .contains(&("tenant".to_owned(), "t-42".to_owned()))
            );
            assert!(
                !m.headers.iter().any(|(k, _)| k.ends_with("region")),
                "{binding:?}: NULL omitted"
            );
            assert_eq!(m.body, br#"{"total":12.5}"#);
        }
    }
}
