//! The table-less outbox: events an application writes into the WAL with
//! `pg_logical_emit_message(true, <prefix>, <json>)` (or the function
//! `migrate` installs for it) instead of inserting a row.
//!
//! The content is a JSON object with a row's fields: `id`, `aggregate_type`,
//! `aggregate_id`, `event_type` (required), `event_version`, `payload`,
//! `headers` (optional), and the values of the configured extra and routing
//! columns under those columns' names. String values are taken as they are,
//! any other JSON value as its JSON text, `null` as absent; other fields are
//! ignored. The event's time is its transaction's commit time. From there a
//! message is checked, enveloped, routed and dead-lettered like a row.

use crate::outbox::RawRow;
use serde_json::value::RawValue;
use std::collections::HashMap;

/// Why a message with the events' prefix is no row: the reason a dead
/// letter records, and the event and aggregate ids where they could be read
/// (so that the letter holds back its aggregate and `dlq` finds it).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Unreadable {
    pub reason: String,
    pub id: Option<String>,
    pub aggregate_id: Option<String>,
}

/// What a message with the events' prefix stands for: the row it describes,
/// or why it cannot be one.
pub fn raw_row(content: &[u8], extra: &[String]) -> Result<RawRow, Unreadable> {
    let unreadable = |reason| Unreadable {
        reason,
        ..Unreadable::default()
    };
    let text = std::str::from_utf8(content)
        .map_err(|e| unreadable(format!("the logical message is not UTF-8 text: {e}")))?;
    let fields: HashMap<&str, &RawValue> = serde_json::from_str(text)
        .map_err(|e| unreadable(format!("the logical message is not a JSON object: {e}")))?;
    let field = |name: &str| fields.get(name).and_then(|v| value_text(v));
    // A NUL fits no text column, nor the dead letter's (its extra values
    // are read back as jsonb, which refuses `\u0000` too).
    const TEXT_FIELDS: [&str; 7] = [
        "id",
        "aggregate_type",
        "aggregate_id",
        "event_type",
        "event_version",
        "payload",
        "headers",
    ];
    let holds_nul = |name: &&str| field(name).is_some_and(|t| t.contains('\0'));
    let mut names = TEXT_FIELDS
        .iter()
        .copied()
        .chain(extra.iter().map(String::as_str));
    // Valid JSON holds a NUL only as this escape: most messages skip the look.
    if text.contains("\\u0000")
        && let Some(name) = names.find(holds_nul)
    {
        let readable = |name: &str| field(name).filter(|t| !t.contains('\0'));
        return Err(Unreadable {
            reason: format!(
                "the logical message's field {name:?} holds a NUL character (\\u0000), \
                 which no text column of a row can hold; leave it out"
            ),
            id: readable("id"),
            aggregate_id: readable("aggregate_id"),
        });
    }
    let extra = (!extra.is_empty()).then(|| {
        let object: serde_json::Map<String, serde_json::Value> = extra
            .iter()
            .filter_map(|name| Some((name.clone(), serde_json::Value::String(field(name)?))))
            .collect();
        serde_json::Value::Object(object).to_string()
    });
    Ok(RawRow {
        id: field("id"),
        aggregate_type: field("aggregate_type"),
        aggregate_id: field("aggregate_id"),
        event_type: field("event_type"),
        event_version: field("event_version"),
        payload: field("payload"),
        headers: field("headers"),
        created_at: None,
        extra,
    })
}

/// A string's value, any other value's JSON text, `None` for `null`.
fn value_text(value: &RawValue) -> Option<String> {
    let text = value.get();
    match text.as_bytes().first() {
        Some(b'"') => serde_json::from_str::<String>(text).ok(),
        _ if text == "null" => None,
        _ => Some(text.to_owned()),
    }
}

/// The content kept in a dead letter of a message that is not a JSON
/// object: its text (lossily, when not UTF-8) as the payload, with a NUL
/// byte, which a PostgreSQL text value cannot hold, written `\u0000`.
pub fn unreadable(content: &[u8]) -> RawRow {
    RawRow {
        id: None,
        aggregate_type: None,
        aggregate_id: None,
        event_type: None,
        event_version: None,
        payload: Some(String::from_utf8_lossy(content).replace('\0', "\\u0000")),
        headers: None,
        created_at: None,
        extra: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_message_reads_as_the_row_it_describes() {
        let raw = raw_row(
            br#"{"id":"e1","aggregate_type":"order","aggregate_id":"42","event_type":"Placed",
                "event_version":2,"payload":{"total":3,"note":null},"headers":{"h":"v"},
                "tenant":"acme","route":null,"unknown":1}"#,
            &["tenant".into(), "route".into()],
        )
        .unwrap();
        assert_eq!(raw.id.as_deref(), Some("e1"));
        assert_eq!(raw.aggregate_id.as_deref(), Some("42"));
        assert_eq!(raw.event_version.as_deref(), Some("2"));
        // The payload keeps its JSON text, nested nulls included.
        assert_eq!(raw.payload.as_deref(), Some(r#"{"total":3,"note":null}"#));
        assert_eq!(raw.headers.as_deref(), Some(r#"{"h":"v"}"#));
        assert_eq!(raw.extra.as_deref(), Some(r#"{"tenant":"acme"}"#));
        assert_eq!(raw.created_at, None);
    }

    #[test]
    fn absent_and_null_fields_are_missing_and_decode_says_which() {
        let raw = raw_row(
            br#"{"id":"e1","aggregate_type":"order","aggregate_id":null}"#,
            &[],
        )
        .unwrap();
        assert_eq!(raw.aggregate_id, None);
        assert_eq!(raw.extra, None);
        let e = raw.decode(chrono::Utc::now()).unwrap_err();
        assert!(e.reason.contains("aggregate_id"), "{}", e.reason);
    }

    #[test]
    fn content_that_is_no_json_object_is_refused_with_the_reason() {
        for (content, says) in [
            (&b"not json"[..], "not a JSON object"),
            (&b"[1,2]"[..], "not a JSON object"),
            (&b"\xff\xfe"[..], "not UTF-8"),
        ] {
            let e = raw_row(content, &[]).unwrap_err();
            assert!(e.reason.contains(says), "{e:?}");
        }
        assert_eq!(unreadable(b"not json").payload.as_deref(), Some("not json"));
    }

    /// A NUL cannot go into the dead letter's text columns (PostgreSQL
    /// refuses it, and the letter would never be written): a string field
    /// holding one refuses the message, whose content keeps the escape,
    /// and raw NUL bytes are kept escaped.
    #[test]
    fn a_nul_character_refuses_the_message_and_is_kept_escaped() {
        let content =
            br#"{"id":"e1","aggregate_type":"a\u0000b","aggregate_id":"1","event_type":"E"}"#;
        let e = raw_row(content, &[]).unwrap_err();
        assert!(
            e.reason.contains("\"aggregate_type\"") && e.reason.contains("NUL"),
            "{e:?}"
        );
        // The ids are kept, so that the letter holds back its aggregate.
        assert_eq!(
            (e.id.as_deref(), e.aggregate_id.as_deref()),
            (Some("e1"), Some("1"))
        );
        let in_extra = br#"{"id":"e1","aggregate_type":"a","aggregate_id":"1","event_type":"E","tenant":"x\u0000"}"#;
        let e = raw_row(in_extra, &["tenant".into()]).unwrap_err();
        assert!(e.reason.contains("\"tenant\""), "{e:?}");
        let in_id = br#"{"id":"e\u0000","aggregate_type":"a","aggregate_id":"1","event_type":"E"}"#;
        let e = raw_row(in_id, &[]).unwrap_err();
        assert_eq!((e.id, e.aggregate_id.as_deref()), (None, Some("1")));
        // Inside a JSON payload the escape stays text, and is no NUL.
        let nested = br#"{"id":"e1","aggregate_type":"a","aggregate_id":"1","event_type":"E","payload":{"k":"\u0000"}}"#;
        assert!(raw_row(nested, &[]).is_ok());
        let kept = unreadable(b"{\x00\xff}").payload.unwrap();
        assert!(!kept.contains('\0'), "{kept:?}");
        assert_eq!(kept, "{\\u0000\u{fffd}}");
    }
}
