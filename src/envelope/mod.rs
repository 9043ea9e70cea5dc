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
use std::borrow::Cow;

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
///
/// It borrows what it can from the event it was built from (the strings a
/// sink copies into the broker client's own buffers anyway), so building
/// one costs few allocations; [`Message::into_owned`] detaches it.
#[derive(Debug, Clone)]
pub struct Message<'a> {
    /// The event id: Kafka header `event_id`, AMQP `message_id`.
    pub id: Cow<'a, str>,
    /// The aggregate id: the Kafka key, unless the row's key column
    /// replaces it (see [`routing`]).
    pub key: Cow<'a, str>,
    pub body: Vec<u8>,
    /// Message headers, relay-set ones first, then the row's.
    pub headers: Vec<(Cow<'a, str>, Cow<'a, str>)>,
    pub content_type: &'static str,
    pub event_type: Cow<'a, str>,
    /// Seconds since the epoch of `created_at` (AMQP `timestamp`).
    pub timestamp_secs: u64,
}

/// A header or attribute name and value, borrowed where it can be.
type Header<'a> = (Cow<'a, str>, Cow<'a, str>);

impl Message<'_> {
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

    /// The same message, owning all it holds.
    pub fn into_owned(self) -> Message<'static> {
        let own = |c: Cow<'_, str>| Cow::Owned(c.into_owned());
        Message {
            id: own(self.id),
            key: own(self.key),
            body: self.body,
            headers: self
                .headers
                .into_iter()
                .map(|(k, v)| (own(k), own(v)))
                .collect(),
            content_type: self.content_type,
            event_type: own(self.event_type),
            timestamp_secs: self.timestamp_secs,
        }
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

/// `(name, value)` pairs, names borrowed from the configuration and values
/// from the event.
type Pairs<'s, 'e> = Vec<(&'s str, &'e str)>;

/// Extension attributes from extra columns, as members of the document.
struct Extensions<'a>(Pairs<'a, 'a>);

/// A message's body, content type and headers, before extra and row headers.
type Parts<'a> = (Vec<u8>, &'static str, Vec<Header<'a>>);

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

    /// Binary mode's attribute headers, in the order [`Envelope::binary`]
    /// sets them: each prefixed, spelled out so that no message allocates
    /// them.
    fn attribute_headers(self) -> &'static [&'static str; 8] {
        match self {
            Binding::Kafka => &[
                "ce_specversion",
                "ce_id",
                "ce_source",
                "ce_type",
                "ce_subject",
                "ce_time",
                "ce_aggregatetype",
                "ce_eventversion",
            ],
            Binding::Amqp => &[
                "cloudEvents:specversion",
                "cloudEvents:id",
                "cloudEvents:source",
                "cloudEvents:type",
                "cloudEvents:subject",
                "cloudEvents:time",
                "cloudEvents:aggregatetype",
                "cloudEvents:eventversion",
            ],
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
    fn extras<'s, 'e>(&'s self, event: &'e OutboxEvent) -> (Pairs<'s, 'e>, Pairs<'s, 'e>) {
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

    pub fn build<'a>(&self, event: &'a OutboxEvent) -> Message<'a> {
        self.build_traced(event, None)
    }

    /// As [`Self::build`]; a `traceparent` given replaces the row's (the
    /// relay's span, when it exports spans).
    pub fn build_traced<'a>(
        &self,
        event: &'a OutboxEvent,
        traceparent: Option<&'a str>,
    ) -> Message<'a> {
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
                .map(|(h, v)| (Cow::Owned((*h).to_owned()), Cow::Borrowed(*v))),
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
        let row_headers: Vec<Header<'a>> = event
            .headers
            .iter()
            .filter(|(k, _)| !taken(k) && !replaced(k))
            .map(|(k, v)| (Cow::Borrowed(k.as_str()), Cow::Borrowed(v.as_str())))
            .collect();
        headers.extend(row_headers);
        if let Some(t) = traceparent {
            headers.push((Cow::Borrowed(TRACEPARENT), Cow::Borrowed(t)));
        }
        Message {
            id: Cow::Borrowed(&event.id),
            key: Cow::Borrowed(&event.aggregate_id),
            body,
            headers,
            content_type,
            event_type: Cow::Borrowed(&event.event_type),
            timestamp_secs: u64::try_from(event.created_at.timestamp()).unwrap_or(0),
        }
    }

    /// A structured-mode body (the whole CloudEvent as JSON) and its headers.
    fn structured<'a>(
        &self,
        event: &'a OutboxEvent,
        time: String,
        attributes: Pairs<'_, '_>,
        traceparent: Option<&str>,
    ) -> Parts<'a> {
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
        let mut headers: Vec<Header<'a>> = Vec::with_capacity(8 + event.headers.len());
        headers.extend([
            (header::CONTENT_TYPE.into(), STRUCTURED_CONTENT_TYPE.into()),
            (header::EVENT_ID.into(), event.id.as_str().into()),
            (header::EVENT_TYPE.into(), event.event_type.as_str().into()),
            (
                header::EVENT_VERSION.into(),
                event.event_version.to_string().into(),
            ),
            (
                header::AGGREGATE_TYPE.into(),
                event.aggregate_type.as_str().into(),
            ),
        ]);
        (body, STRUCTURED_CONTENT_TYPE, headers)
    }

    /// A binary-mode body (the payload) and the attributes as headers.
    fn binary<'a>(
        &self,
        event: &'a OutboxEvent,
        time: String,
        attributes: &Pairs<'_, '_>,
    ) -> Parts<'a> {
        let values: [Cow<'a, str>; 8] = [
            "1.0".into(),
            event.id.as_str().into(),
            self.source.clone().into(),
            event.event_type.as_str().into(),
            event.aggregate_id.as_str().into(),
            time.into(),
            event.aggregate_type.as_str().into(),
            event.event_version.to_string().into(),
        ];
        let mut headers: Vec<Header<'a>> =
            Vec::with_capacity(10 + attributes.len() + event.headers.len());
        headers.push((header::CONTENT_TYPE.into(), JSON_CONTENT_TYPE.into()));
        let names = self.binding.attribute_headers();
        headers.extend(names.iter().map(|n| Cow::Borrowed(*n)).zip(values));
        let p = self.binding.prefix();
        headers.extend(
            attributes
                .iter()
                .map(|(a, v)| (Cow::Owned(format!("{p}{a}")), Cow::Owned((*v).to_owned()))),
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
}
