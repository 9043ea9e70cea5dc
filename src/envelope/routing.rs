//! Per-row routing: `outbox.columns.destination` and `outbox.columns.key`
//! name columns whose values, when not NULL, replace the destination the
//! sink's template renders and the message key.
//!
//! A value is checked by the broker's rules before anything is sent, as a
//! rendered template is; a bad one (empty, too long, characters the broker
//! refuses) refuses the event with a reason that names the column and the
//! value, so it is retried and dead-lettered like any refusal, and a
//! redrive after the value was corrected in the dead-letter table sends it.
//! NULL means "as configured": the template, or the aggregate id as key.
//!
//! The values travel with the row among the columns beyond the contract
//! ([`crate::outbox::RawRow::extra`]), so both source modes and the
//! dead-letter table carry them without columns of their own.

use crate::config::ColumnMap;
use crate::outbox::OutboxEvent;

/// A broker's rule for a name (see [`crate::config::destination`]).
pub type Rule = fn(&str) -> Result<(), String>;

/// Accepts any value that is not empty (a Kafka key is any bytes).
pub fn any_value(_: &str) -> Result<(), String> {
    Ok(())
}

/// The routing columns of `[outbox.columns]`; none by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routing {
    destination: Option<String>,
    key: Option<String>,
}

/// At most this much of a refused value is quoted in the reason.
const SHOWN_CHARS: usize = 80;

impl Routing {
    pub fn from_columns(map: &ColumnMap) -> Routing {
        Routing {
            destination: map.destination.clone(),
            key: map.key.clone(),
        }
    }

    /// The event's own destination, checked by `rule`; `None` when no
    /// destination column is configured or its value is NULL (then
    /// `fallback`, named in the reason, applies).
    pub fn destination<'a>(
        &self,
        event: &'a OutboxEvent,
        rule: Rule,
        fallback: &str,
    ) -> Result<Option<&'a str>, String> {
        checked(
            "destination",
            self.destination.as_deref(),
            event,
            rule,
            fallback,
        )
    }

    /// The event's own message key, checked by `rule`; `None` as above.
    pub fn key<'a>(
        &self,
        event: &'a OutboxEvent,
        rule: Rule,
        fallback: &str,
    ) -> Result<Option<&'a str>, String> {
        checked("key", self.key.as_deref(), event, rule, fallback)
    }
}

fn checked<'a>(
    key: &str,
    column: Option<&str>,
    event: &'a OutboxEvent,
    rule: Rule,
    fallback: &str,
) -> Result<Option<&'a str>, String> {
    let Some(column) = column else {
        return Ok(None);
    };
    let Some(value) = event
        .extra
        .iter()
        .find(|(c, _)| c == column)
        .map(|(_, v)| v.as_str())
    else {
        return Ok(None);
    };
    let problem = if value.is_empty() {
        Some("the value is empty".to_owned())
    } else {
        rule(value).err()
    };
    match problem {
        None => Ok(Some(value)),
        Some(p) => Err(format!(
            "column {column:?} (outbox.columns.{key}) holds {}: {p}; correct the value, or make it NULL to use {fallback}",
            shown(value)
        )),
    }
}

/// The value quoted, shortened when long.
fn shown(value: &str) -> String {
    match value.char_indices().nth(SHOWN_CHARS) {
        None => format!("{value:?}"),
        Some((end, _)) => format!("{:?}... ({} bytes)", &value[..end], value.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::destination;
    use chrono::Utc;
    use serde_json::value::RawValue;

    fn event(extra: &[(&str, &str)]) -> OutboxEvent {
        OutboxEvent {
            id: "e-1".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            payload: RawValue::from_string("{}".into()).unwrap(),
            headers: vec![],
            created_at: Utc::now(),
            extra: extra
                .iter()
                .map(|(c, v)| ((*c).to_owned(), (*v).to_owned()))
                .collect(),
        }
    }

    fn routing() -> Routing {
        Routing::from_columns(&ColumnMap {
            destination: Some("topic".into()),
            key: Some("msg_key".into()),
            ..ColumnMap::default()
        })
    }

    #[test]
    fn a_value_overrides_and_null_falls_back() {
        let r = routing();
        let e = event(&[("topic", "billing.events"), ("msg_key", "customer-7")]);
        assert_eq!(
            r.destination(&e, destination::kafka_topic, "sink.topic"),
            Ok(Some("billing.events"))
        );
        assert_eq!(
            r.key(&e, any_value, "the aggregate id"),
            Ok(Some("customer-7"))
        );
        // NULL columns are absent from the row's values.
        let e = event(&[]);
        assert_eq!(
            r.destination(&e, destination::kafka_topic, "sink.topic"),
            Ok(None)
        );
        assert_eq!(r.key(&e, any_value, "the aggregate id"), Ok(None));
        // Nothing configured: a column of that name means nothing.
        let e = event(&[("topic", "x y")]);
        assert_eq!(
            Routing::default().destination(&e, destination::kafka_topic, "sink.topic"),
            Ok(None)
        );
    }

    #[test]
    fn bad_values_are_refused_naming_column_value_and_fallback() {
        let r = routing();
        for (value, rule, expected) in [
            ("", destination::kafka_topic as Rule, "the value is empty"),
            ("bad topic", destination::kafka_topic, "contains ' '"),
            ("..", destination::kafka_topic, "not allowed"),
            ("ex change", destination::rabbitmq_exchange, "contains ' '"),
        ] {
            let e = event(&[("topic", value)]);
            let why = r.destination(&e, rule, "sink.topic").unwrap_err();
            assert!(
                why.starts_with(&format!(
                    "column \"topic\" (outbox.columns.destination) holds {value:?}: "
                )),
                "{why}"
            );
            assert!(why.contains(expected), "{expected:?} not in {why}");
            assert!(why.ends_with("or make it NULL to use sink.topic"), "{why}");
        }
        let long = "k".repeat(300);
        let e = event(&[("msg_key", &long)]);
        let why = r
            .key(&e, destination::rabbitmq_routing_key, "sink.routing_key")
            .unwrap_err();
        assert!(why.contains("(outbox.columns.key)"), "{why}");
        assert!(why.contains("over the 255-byte limit"), "{why}");
        assert!(
            why.contains("... (300 bytes)"),
            "long values are shortened: {why}"
        );
        assert!(why.len() < 300, "{why}");
        let e = event(&[("msg_key", "")]);
        assert!(
            r.key(&e, any_value, "the aggregate id")
                .unwrap_err()
                .contains("the value is empty")
        );
    }
}
