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
mod tests;
