//! Decoding a row's text values into an event, rejecting bad input with a reason.
//!
//! Both sources see a row as text: the polling source casts every column to
//! `text` in its query (with `DateStyle=ISO` and `TimeZone=UTC`), and pgoutput
//! sends values in their text form. One decoder serves both.

use chrono::format::{Item, Parsed, StrftimeItems};
use chrono::{DateTime, NaiveDateTime, Utc};
use serde_json::value::RawValue;
use std::fmt;

/// A row as read, before decoding: each contract column's text, `None` when
/// the column is NULL or absent from the table.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RawRow {
    pub id: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub event_version: Option<String>,
    pub payload: Option<String>,
    pub headers: Option<String>,
    pub created_at: Option<String>,
    /// The `[[outbox.columns.extra]]` columns and the routing columns
    /// (`outbox.columns.destination`, `outbox.columns.key`) as a JSON object
    /// of their text values by column name, NULL ones left out; `None` when
    /// none are configured.
    pub extra: Option<String>,
}

/// One event, ready to be put in an envelope.
#[derive(Debug, Clone)]
pub struct OutboxEvent {
    /// The row's `id`: message id, CloudEvents `id`, the consumers' deduplication key.
    pub id: String,
    pub aggregate_type: String,
    /// The message key and the unit of ordering.
    pub aggregate_id: String,
    pub event_type: String,
    pub event_version: i32,
    /// The payload as JSON text, embedded in the envelope without re-encoding.
    pub payload: Box<RawValue>,
    /// The row's `headers` object, in key order.
    pub headers: Vec<(String, String)>,
    pub created_at: DateTime<Utc>,
    /// The extra and routing columns' values, `(column, value)` by column
    /// name; NULL ones are absent.
    pub extra: Vec<(String, String)>,
}

/// Why a row cannot be published. The row is bad input, not a relay failure:
/// it is reported, never dropped, and never stops other aggregates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowError {
    /// The row's id when it could be read, for the operator to find the row.
    pub id: Option<String>,
    pub aggregate_id: Option<String>,
    pub reason: String,
    /// The row as read.
    pub raw: Option<Box<RawRow>>,
}

impl fmt::Display for RowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.id {
            Some(id) => write!(f, "outbox row {id}: {}", self.reason),
            None => write!(f, "outbox row without id: {}", self.reason),
        }
    }
}

impl std::error::Error for RowError {}

/// Headers larger than this are refused: they travel with every message.
pub const MAX_HEADERS_BYTES: usize = 64 * 1024;

/// What checking a row produces besides the strings it keeps: the version,
/// the headers and the time.
type Checked = (
    i32,
    Vec<(String, String)>,
    DateTime<Utc>,
    Vec<(String, String)>,
);

impl RawRow {
    /// The bytes of its text values.
    pub fn text_len(&self) -> usize {
        [
            &self.id,
            &self.aggregate_type,
            &self.aggregate_id,
            &self.event_type,
            &self.event_version,
            &self.payload,
            &self.headers,
            &self.created_at,
            &self.extra,
        ]
        .iter()
        .map(|f| f.as_ref().map_or(0, String::len))
        .sum()
    }

    /// Decodes the row. `fallback_time` stands in for an absent `created_at`
    /// (the commit time in CDC, the read time when polling). A refused row
    /// comes back inside the error, so it can be dead-lettered as it was read.
    pub fn decode(self, fallback_time: DateTime<Utc>) -> Result<OutboxEvent, RowError> {
        let checked = match self.check(fallback_time) {
            Ok(c) => c,
            Err(reason) => {
                return Err(RowError {
                    id: self.id.clone(),
                    aggregate_id: self.aggregate_id.clone(),
                    reason,
                    raw: Some(Box::new(self)),
                });
            }
        };
        let (event_version, headers, created_at, extra) = checked;
        // Every field was checked above; the fallbacks below cannot be reached.
        let payload = RawValue::from_string(self.payload.unwrap_or_default()).unwrap_or_default();
        Ok(OutboxEvent {
            id: self.id.unwrap_or_default(),
            aggregate_type: self.aggregate_type.unwrap_or_default(),
            aggregate_id: self.aggregate_id.unwrap_or_default(),
            event_type: self.event_type.unwrap_or_default(),
            event_version,
            payload,
            headers,
            created_at,
            extra,
        })
    }

    /// Validates without taking the row apart.
    fn check(&self, fallback_time: DateTime<Utc>) -> Result<Checked, String> {
        let required = |value: &Option<String>, column: &str| match value {
            Some(v) if !v.trim().is_empty() => Ok(()),
            Some(_) => Err(format!("{column} is empty")),
            None => Err(format!("{column} is NULL")),
        };
        required(&self.id, "id")?;
        required(&self.aggregate_type, "aggregate_type")?;
        required(&self.aggregate_id, "aggregate_id")?;
        required(&self.event_type, "event_type")?;
        let event_version = match &self.event_version {
            None => 1,
            Some(v) => v.trim().parse::<i32>().map_err(|e| {
                use std::num::IntErrorKind::{NegOverflow, PosOverflow};
                match e.kind() {
                    PosOverflow | NegOverflow => format!(
                        "event_version {v:?} is outside the range the envelope carries ({}..={})",
                        i32::MIN,
                        i32::MAX
                    ),
                    _ => format!("event_version {v:?} is not an integer"),
                }
            })?,
        };
        match &self.payload {
            None => return Err("payload is NULL".into()),
            Some(p) => {
                serde_json::from_str::<&RawValue>(p)
                    .map_err(|e| format!("payload is not JSON: {e}"))?;
            }
        }
        let headers = match &self.headers {
            None => Vec::new(),
            Some(h) => parse_headers(h)?,
        };
        let created_at = match &self.created_at {
            None => fallback_time,
            Some(t) => parse_timestamp(t)?,
        };
        let extra = match &self.extra {
            None => Vec::new(),
            Some(x) => parse_extra(x)?,
        };
        Ok((event_version, headers, created_at, extra))
    }
}

impl OutboxEvent {
    /// The event's values as text again, for the dead-letter table.
    pub fn to_raw(&self) -> RawRow {
        let headers = serde_json::Value::Object(
            self.headers
                .iter()
                .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
                .collect(),
        );
        RawRow {
            id: Some(self.id.clone()),
            aggregate_type: Some(self.aggregate_type.clone()),
            aggregate_id: Some(self.aggregate_id.clone()),
            event_type: Some(self.event_type.clone()),
            event_version: Some(self.event_version.to_string()),
            payload: Some(self.payload.get().to_owned()),
            headers: Some(headers.to_string()),
            created_at: Some(self.created_at.to_rfc3339()),
            extra: (!self.extra.is_empty()).then(|| extra_json(&self.extra)),
        }
    }
}

/// The extra columns' `(column, value)` pairs as a JSON object, the form
/// [`RawRow::extra`] and the dead-letter table keep them in.
pub fn extra_json<'a>(pairs: impl IntoIterator<Item = &'a (String, String)>) -> String {
    serde_json::Value::Object(
        pairs
            .into_iter()
            .map(|(k, v)| (k.clone(), serde_json::Value::String(v.clone())))
            .collect(),
    )
    .to_string()
}

/// `extra` must be a JSON object of strings (a null stands for a NULL
/// column and is left out); it travels with every message, so it is
/// bounded like the headers.
fn parse_extra(text: &str) -> Result<Vec<(String, String)>, String> {
    if text.len() > MAX_HEADERS_BYTES {
        return Err(format!(
            "the extra columns' values are {} bytes; at most {MAX_HEADERS_BYTES} are allowed",
            text.len()
        ));
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("extra columns are not JSON: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err(format!(
            "extra columns must be a JSON object of strings, found {}",
            json_kind(&value)
        ));
    };
    map.into_iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            other => Err(format!(
                "extra columns must be a JSON object of strings; column {k:?} is {}",
                json_kind(&other)
            )),
        })
        .collect()
}

/// `headers` must be a JSON object whose values are all strings.
fn parse_headers(text: &str) -> Result<Vec<(String, String)>, String> {
    if text.len() > MAX_HEADERS_BYTES {
        return Err(format!(
            "headers are {} bytes; at most {MAX_HEADERS_BYTES} are allowed",
            text.len()
        ));
    }
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("headers are not JSON: {e}"))?;
    let serde_json::Value::Object(map) = value else {
        return Err(format!(
            "headers must be a JSON object of strings, found {}",
            json_kind(&value)
        ));
    };
    map.into_iter()
        .map(|(k, v)| match v {
            serde_json::Value::String(s) => Ok((k, s)),
            other => Err(format!(
                "headers must be a JSON object of strings; header {k:?} is {}",
                json_kind(&other)
            )),
        })
        .collect()
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The two forms of a time without its offset, compiled once: every event
/// read has one, and compiling the format per event showed in profiles.
static ISO_TIME: std::sync::LazyLock<[Vec<Item<'static>>; 2]> = std::sync::LazyLock::new(|| {
    ["%Y-%m-%d %H:%M:%S%.f", "%Y-%m-%dT%H:%M:%S%.f"]
        .map(|f| StrftimeItems::new(f).parse().unwrap_or_default())
});

fn naive_time(text: &str, items: &[Item<'static>]) -> Option<NaiveDateTime> {
    let mut parsed = Parsed::new();
    chrono::format::parse(&mut parsed, text, items.iter()).ok()?;
    parsed.to_naive_datetime_with_offset(0).ok()
}

/// Parses PostgreSQL's ISO output of `timestamptz` (`2026-11-29 15:45:41.123+00`,
/// offsets `+hh`, `+hh:mm` or `+hh:mm:ss`) and of `timestamp` (taken as UTC).
pub fn parse_timestamp(text: &str) -> Result<DateTime<Utc>, String> {
    let t = text.trim();
    let bad = || format!("created_at {t:?} is not a timestamp the relay can read");
    if t.ends_with(" BC") || t.contains("infinity") {
        return Err(format!(
            "{} (infinite and BC times have no CloudEvents form)",
            bad()
        ));
    }
    // Split off a trailing numeric offset, if any, after the time part.
    let time_start = t.find(' ').or_else(|| t.find('T')).ok_or_else(bad)?;
    let (base, offset) = match t[time_start..].rfind(['+', '-']) {
        Some(i) => t.split_at(time_start + i),
        None => (t, ""),
    };
    let naive = ISO_TIME
        .iter()
        .find_map(|items| naive_time(base, items))
        .ok_or_else(bad)?;
    if offset.is_empty() {
        return Ok(naive.and_utc());
    }
    let secs = offset_seconds(offset).ok_or_else(|| {
        format!(
            "{} (its offset must be +hh, +hh:mm, +hhmm or +hh:mm:ss, at most 15:59:59)",
            bad()
        )
    })?;
    naive
        .checked_sub_signed(chrono::Duration::seconds(secs))
        .map(|t| t.and_utc())
        .ok_or_else(bad)
}

/// A UTC offset (`+hh`, `+hh:mm`, `+hhmm`, `+hh:mm:ss`, or with `-`) in
/// seconds east; at most 15:59:59, as PostgreSQL allows.
fn offset_seconds(offset: &str) -> Option<i64> {
    let sign = match offset.as_bytes().first()? {
        b'+' => 1,
        b'-' => -1,
        _ => return None,
    };
    let digits = &offset[1..];
    if !digits.is_ascii() {
        return None;
    }
    let parts: Vec<&str> = match digits.len() {
        4 if !digits.contains(':') => vec![&digits[..2], &digits[2..]],
        _ => digits.split(':').collect(),
    };
    if parts.len() > 3 {
        return None;
    }
    let mut secs = 0;
    for (part, (unit, max)) in parts.iter().zip([(3600, 15), (60, 59), (1, 59)]) {
        if part.len() != 2 || !part.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        let n: i64 = part.parse().ok()?;
        if n > max {
            return None;
        }
        secs += n * unit;
    }
    Some(sign * secs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row() -> RawRow {
        RawRow {
            id: Some("6f1c2a9e-0000-4000-8000-000000000001".into()),
            aggregate_type: Some("order".into()),
            aggregate_id: Some("o-1".into()),
            event_type: Some("OrderPlaced".into()),
            event_version: Some("2".into()),
            payload: Some(r#"{"total": 12.5}"#.into()),
            headers: Some(r#"{"traceparent": "00-abc-def-01"}"#.into()),
            created_at: Some("2026-11-29 15:45:41.123456+00".into()),
            extra: None,
        }
    }

    #[test]
    fn extra_columns_decode_and_round_trip_through_the_raw_form() {
        let r = RawRow {
            extra: Some(r#"{"tenant_id": "acme", "region": null}"#.into()),
            ..row()
        };
        let e = r.decode(Utc::now()).unwrap();
        assert_eq!(e.extra, vec![("tenant_id".into(), "acme".into())]);
        let again = e.to_raw().decode(Utc::now()).unwrap();
        assert_eq!(again.extra, e.extra);
        assert_eq!(row().decode(Utc::now()).unwrap().to_raw().extra, None);
    }

    #[test]
    fn bad_extra_values_are_refused_with_a_reason() {
        for (extra, expected) in [
            ("[]".to_owned(), "found an array"),
            (r#"{"n": 1}"#.to_owned(), "column \"n\" is a number"),
            ("{".to_owned(), "not JSON"),
            (
                format!(r#"{{"big": "{}"}}"#, "x".repeat(MAX_HEADERS_BYTES)),
                "bytes; at most",
            ),
        ] {
            let err = RawRow {
                extra: Some(extra),
                ..row()
            }
            .decode(Utc::now())
            .unwrap_err();
            assert!(
                err.reason.contains(expected),
                "{err} should contain {expected}"
            );
            assert!(
                err.raw.is_some(),
                "the row is kept for the dead-letter table"
            );
        }
    }

    #[test]
    fn decodes_a_complete_row() {
        let e = row().decode(Utc::now()).unwrap();
        assert_eq!(e.event_version, 2);
        assert_eq!(e.payload.get(), r#"{"total": 12.5}"#);
        assert_eq!(
            e.headers,
            vec![("traceparent".into(), "00-abc-def-01".into())]
        );
        assert_eq!(
            e.created_at.to_rfc3339(),
            "2026-11-29T15:45:41.123456+00:00"
        );
    }

    #[test]
    fn absent_optional_columns_take_defaults() {
        let now = Utc::now();
        let r = RawRow {
            event_version: None,
            headers: None,
            created_at: None,
            ..row()
        };
        let e = r.decode(now).unwrap();
        assert_eq!(
            (e.event_version, e.headers.len(), e.created_at),
            (1, 0, now)
        );
    }

    #[test]
    fn bad_rows_are_refused_with_a_reason() {
        let cases = [
            (
                RawRow {
                    aggregate_id: Some("".into()),
                    ..row()
                },
                "aggregate_id is empty",
            ),
            (RawRow { id: None, ..row() }, "id is NULL"),
            (
                RawRow {
                    payload: Some("{".into()),
                    ..row()
                },
                "payload is not JSON",
            ),
            (
                RawRow {
                    headers: Some("[1]".into()),
                    ..row()
                },
                "found an array",
            ),
            (
                RawRow {
                    headers: Some(r#"{"a": 1}"#.into()),
                    ..row()
                },
                "header \"a\" is a number",
            ),
            (
                RawRow {
                    event_version: Some("x".into()),
                    ..row()
                },
                "not an integer",
            ),
            (
                RawRow {
                    event_version: Some("2147483648".into()),
                    ..row()
                },
                "outside the range the envelope carries (-2147483648..=2147483647)",
            ),
            (
                RawRow {
                    created_at: Some("infinity".into()),
                    ..row()
                },
                "infinite",
            ),
        ];
        for (r, expected) in cases {
            let err = r.decode(Utc::now()).unwrap_err();
            assert!(
                err.reason.contains(expected),
                "{err} should contain {expected}"
            );
        }
    }

    #[test]
    fn timestamps_in_every_postgres_offset_form() {
        let utc = "2026-01-02T03:04:05+00:00";
        for t in [
            "2026-01-02 03:04:05+00",
            "2026-01-02 05:34:05+02:30",
            "2026-01-02 02:04:05-01",
            "2026-01-02 03:04:05",
            "2026-01-02 05:34:05+02:30:00",
        ] {
            assert_eq!(parse_timestamp(t).unwrap().to_rfc3339(), utc, "{t}");
        }
        assert!(parse_timestamp("yesterday").is_err());
        assert!(parse_timestamp("2026-01-02 03:04:05+0a").is_err());
        // An offset typed by hand (a dead letter corrected before a
        // redrive): the compact form reads as hours and minutes; one out of
        // range, or too long to subtract, is refused instead of panicking.
        assert_eq!(
            parse_timestamp("2026-01-01 10:00:00+0530")
                .unwrap()
                .to_rfc3339(),
            "2026-01-01T04:30:00+00:00"
        );
        for t in [
            "2026-01-01 10:00:00+9999999999",
            "2026-01-01 10:00:00+99999999999999",
            "2026-01-01 10:00:00+16",
            "2026-01-01 10:00:00+05:60",
            "2026-01-01 10:00:00+1\u{e9}1",
            "2026-01-01 10:00:00+05:30:00:00",
        ] {
            assert!(parse_timestamp(t).is_err(), "{t}");
        }
    }
}
