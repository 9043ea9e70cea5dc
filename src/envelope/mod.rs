//! Turning an [`OutboxEvent`] into a broker-neutral [`Message`].
//!
//! The default is CloudEvents 1.0 in JSON structured mode
//! (<https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md>):
//! the body is the whole event, with the payload as `data`. Binary mode puts
//! the payload alone in the body and the attributes in headers named as the
//! broker's CloudEvents binding says: `ce_*` on Kafka, `cloudEvents:*`
//! (AMQP application properties) on RabbitMQ. Either way the row's own headers travel as
//! message headers, and `traceparent`/`tracestate` (the distributed tracing
//! extension) also appear as attributes in structured mode.

pub mod destination;
mod template;

pub use template::{Field, Template, TemplateError};

use crate::config::{EnvelopeConfig, EnvelopeMode};
use crate::outbox::OutboxEvent;
use chrono::SecondsFormat;
use serde::Serialize;
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

pub const STRUCTURED_CONTENT_TYPE: &str = "application/cloudevents+json; charset=utf-8";
pub const JSON_CONTENT_TYPE: &str = "application/json";

/// A message ready for any broker. The destination is chosen by the sink.
#[derive(Debug, Clone)]
pub struct Message {
    /// The event id: Kafka header `event_id`, AMQP `message_id`.
    pub id: String,
    /// The aggregate id: the Kafka key.
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
    data: &'a RawValue,
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
}

impl Envelope {
    pub fn new(config: &EnvelopeConfig, binding: Binding) -> Self {
        Envelope {
            mode: config.mode,
            source: config.source.clone(),
            binding,
        }
    }

    pub fn build(&self, event: &OutboxEvent) -> Message {
        let time = event
            .created_at
            .to_rfc3339_opts(SecondsFormat::AutoSi, true);
        let row_header = |name: &str| {
            event
                .headers
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.as_str())
        };
        let (body, content_type, mut headers) = match self.mode {
            EnvelopeMode::Structured => {
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
                    traceparent: row_header("traceparent"),
                    tracestate: row_header("tracestate"),
                    data: &event.payload,
                };
                // Serializing borrowed strings and already-valid JSON cannot fail.
                let body = serde_json::to_vec(&ce).unwrap_or_default();
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
            EnvelopeMode::Binary => {
                let p = self.binding.prefix();
                let attribute = |name: &str, value: String| (format!("{p}{name}"), value);
                let headers: Vec<(String, String)> = vec![
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
                (
                    event.payload.get().as_bytes().to_vec(),
                    JSON_CONTENT_TYPE,
                    headers,
                )
            }
        };
        let reserved = headers.len();
        for (k, v) in &event.headers {
            if !headers[..reserved]
                .iter()
                .any(|(r, _)| r.eq_ignore_ascii_case(k))
            {
                headers.push((k.clone(), v.clone()));
            }
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
}
