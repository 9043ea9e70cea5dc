//! Mapping the contract's columns to an existing table's names.

use super::{SENT_AT_COLUMN, SEQ_COLUMN, XID_COLUMN};
use serde::Deserialize;

/// `[outbox.columns]`: the name of each contract column in the table.
///
/// The optional columns (`event_version`, `headers`, `created_at`) may be left
/// unset: the relay then uses the column of the default name when the table
/// has one, and a default value (1, no headers, the time the relay read the
/// row) when it does not. A name set explicitly must exist.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ColumnMap {
    #[serde(default = "d::id")]
    pub id: String,
    #[serde(default = "d::aggregate_type")]
    pub aggregate_type: String,
    #[serde(default = "d::aggregate_id")]
    pub aggregate_id: String,
    #[serde(default = "d::event_type")]
    pub event_type: String,
    #[serde(default = "d::payload")]
    pub payload: String,
    #[serde(default)]
    pub event_version: Option<String>,
    #[serde(default)]
    pub headers: Option<String>,
    #[serde(default)]
    pub created_at: Option<String>,
    /// More columns carried as message headers and/or CloudEvents
    /// extension attributes (`[[outbox.columns.extra]]`).
    #[serde(default)]
    pub extra: Vec<ExtraColumn>,
    /// A column whose value, when not NULL, is the event's destination
    /// instead of the configured template's (Kafka topic, RabbitMQ exchange).
    #[serde(default)]
    pub destination: Option<String>,
    /// A column whose value, when not NULL, is the message key instead of
    /// the aggregate id (Kafka record key, RabbitMQ routing key).
    #[serde(default)]
    pub key: Option<String>,
}

/// `[[outbox.columns.extra]]`: one more column of the table, published as a
/// plain message header, a CloudEvents extension attribute, or both. A NULL
/// value publishes neither.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExtraColumn {
    pub column: String,
    #[serde(default)]
    pub header: Option<String>,
    #[serde(default)]
    pub attribute: Option<String>,
}

/// Most extra columns: each is a header or attribute on every message.
pub const MAX_EXTRA_COLUMNS: usize = 32;

/// CloudEvents attributes the relay sets itself, and the names the
/// specification reserves (`data`, `data_base64`, `dataschema`): an extra
/// column cannot take them.
pub const RESERVED_ATTRIBUTES: &[&str] = &[
    "specversion",
    "id",
    "source",
    "type",
    "subject",
    "time",
    "datacontenttype",
    "dataschema",
    "data",
    "aggregatetype",
    "eventversion",
    "traceparent",
    "tracestate",
];

/// Header names (and prefixes, compared without case) the relay sets
/// itself: an extra column cannot take them, so consumers can trust them.
pub const RESERVED_HEADERS: &[&str] = &[
    "content-type",
    "event_id",
    "event_type",
    "event_version",
    "aggregate_type",
];
pub const RESERVED_HEADER_PREFIXES: &[&str] = &["ce_", "cloudevents:", "cloudevents_"];

/// What is wrong with a CloudEvents extension attribute name, if anything
/// (<https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/spec.md#naming-conventions>).
pub fn attribute_problem(name: &str) -> Option<String> {
    if name.is_empty()
        || !name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
    {
        return Some(format!(
            "{name:?} is not a CloudEvents attribute name: use lowercase letters a-z and digits 0-9 only"
        ));
    }
    if name.len() > 20 {
        return Some(format!(
            "{name:?} is {} characters; CloudEvents attribute names should be at most 20, and some SDKs refuse longer ones",
            name.len()
        ));
    }
    if RESERVED_ATTRIBUTES.contains(&name) {
        return Some(format!(
            "{name:?} is an attribute the relay sets or CloudEvents reserves; choose another name"
        ));
    }
    None
}

/// What is wrong with an extra column's header name, if anything.
pub fn header_problem(name: &str) -> Option<String> {
    if name.is_empty() || name.len() > 255 || name.chars().any(char::is_control) {
        return Some(format!(
            "{name:?} is not a header name: use 1 to 255 bytes without control characters"
        ));
    }
    let lower = name.to_ascii_lowercase();
    if RESERVED_HEADERS.contains(&lower.as_str()) {
        return Some(format!(
            "{name:?} is a header the relay sets itself; choose another name"
        ));
    }
    if let Some(p) = RESERVED_HEADER_PREFIXES
        .iter()
        .find(|p| lower.starts_with(*p))
    {
        return Some(format!(
            "{name:?} starts with {p:?}, which names CloudEvents attributes in binary mode; use `attribute` for an attribute, or another header name"
        ));
    }
    None
}

mod d {
    pub fn id() -> String {
        "id".into()
    }
    pub fn aggregate_type() -> String {
        "aggregate_type".into()
    }
    pub fn aggregate_id() -> String {
        "aggregate_id".into()
    }
    pub fn event_type() -> String {
        "event_type".into()
    }
    pub fn payload() -> String {
        "payload".into()
    }
}

impl Default for ColumnMap {
    fn default() -> Self {
        ColumnMap {
            id: d::id(),
            aggregate_type: d::aggregate_type(),
            aggregate_id: d::aggregate_id(),
            event_type: d::event_type(),
            payload: d::payload(),
            event_version: None,
            headers: None,
            created_at: None,
            extra: Vec::new(),
            destination: None,
            key: None,
        }
    }
}

/// The default names of the optional columns.
pub const DEFAULT_EVENT_VERSION: &str = "event_version";
pub const DEFAULT_HEADERS: &str = "headers";
pub const DEFAULT_CREATED_AT: &str = "created_at";

/// What is wrong with a configured column name, if anything.
fn column_problem(col: &str) -> Option<String> {
    if col.is_empty() || col.len() > 63 {
        return Some("a column name must be 1 to 63 bytes long".to_owned());
    }
    if [SEQ_COLUMN, XID_COLUMN, SENT_AT_COLUMN].contains(&col) {
        return Some(format!(
            "{col} is a column the relay owns; map a column of your own"
        ));
    }
    None
}

impl ColumnMap {
    /// `(key, column)` for every column the map names explicitly.
    pub fn named(&self) -> Vec<(&'static str, &str)> {
        let mut v = vec![
            ("id", self.id.as_str()),
            ("aggregate_type", self.aggregate_type.as_str()),
            ("aggregate_id", self.aggregate_id.as_str()),
            ("event_type", self.event_type.as_str()),
            ("payload", self.payload.as_str()),
        ];
        for (key, col) in [
            ("event_version", &self.event_version),
            ("headers", &self.headers),
            ("created_at", &self.created_at),
        ] {
            if let Some(c) = col {
                v.push((key, c.as_str()));
            }
        }
        v
    }

    /// Problems with the names themselves, as `(key, message)`, the key
    /// relative to `outbox.columns`.
    pub fn problems(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        let named = self.named();
        for (i, (key, col)) in named.iter().enumerate() {
            out.extend(column_problem(col).map(|m| (key.to_string(), m)));
            if let Some((other, _)) = named[..i].iter().find(|(_, c)| c == col) {
                out.push((
                    key.to_string(),
                    format!("column {col:?} is already mapped to {other}"),
                ));
            }
        }
        out.extend(self.extra_problems());
        for (key, column) in self.routing() {
            out.extend(column_problem(column).map(|m| (key.to_owned(), m)));
        }
        out
    }

    /// `(key, column)` of the routing columns that are set: `destination`,
    /// `key`. Either may name a contract or extra column too: its value is
    /// then used twice.
    pub fn routing(&self) -> Vec<(&'static str, &str)> {
        [("destination", &self.destination), ("key", &self.key)]
            .into_iter()
            .filter_map(|(k, c)| c.as_deref().map(|c| (k, c)))
            .collect()
    }

    /// Problems of `[[outbox.columns.extra]]`, keyed `extra[i].field`.
    fn extra_problems(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if self.extra.len() > MAX_EXTRA_COLUMNS {
            out.push((
                "extra".to_owned(),
                format!(
                    "{} extra columns; at most {MAX_EXTRA_COLUMNS} are allowed",
                    self.extra.len()
                ),
            ));
        }
        for (i, x) in self.extra.iter().enumerate() {
            let key = |field: &str| format!("extra[{i}].{field}");
            let earlier = &self.extra[..i];
            out.extend(column_problem(&x.column).map(|m| (key("column"), m)));
            if let Some(j) = earlier.iter().position(|e| e.column == x.column) {
                out.push((
                    key("column"),
                    format!(
                        "column {:?} is already listed in extra[{j}]; one entry can set both header and attribute",
                        x.column
                    ),
                ));
            }
            if x.header.is_none() && x.attribute.is_none() {
                out.push((
                    key("column"),
                    "publishes nothing; set header, attribute or both".to_owned(),
                ));
            }
            if let Some(h) = &x.header {
                out.extend(header_problem(h).map(|m| (key("header"), m)));
                let same =
                    |e: &ExtraColumn| e.header.as_ref().is_some_and(|o| o.eq_ignore_ascii_case(h));
                if let Some(j) = earlier.iter().position(same) {
                    out.push((
                        key("header"),
                        format!("header {h:?} is already set by extra[{j}]"),
                    ));
                }
            }
            if let Some(a) = &x.attribute {
                out.extend(attribute_problem(a).map(|m| (key("attribute"), m)));
                if let Some(j) = earlier.iter().position(|e| e.attribute.as_ref() == Some(a)) {
                    out.push((
                        key("attribute"),
                        format!("attribute {a:?} is already set by extra[{j}]"),
                    ));
                }
            }
        }
        out
    }

    /// Resolves the optional columns against the columns the table really has.
    pub fn resolve(&self, existing: &[String]) -> ResolvedColumns {
        let has = |name: &str| existing.iter().any(|c| c == name);
        let pick = |explicit: &Option<String>, default: &str| match explicit {
            Some(c) => Some(c.clone()),
            None if has(default) => Some(default.to_owned()),
            None => None,
        };
        ResolvedColumns {
            id: self.id.clone(),
            aggregate_type: self.aggregate_type.clone(),
            aggregate_id: self.aggregate_id.clone(),
            event_type: self.event_type.clone(),
            payload: self.payload.clone(),
            event_version: pick(&self.event_version, DEFAULT_EVENT_VERSION),
            headers: pick(&self.headers, DEFAULT_HEADERS),
            created_at: pick(&self.created_at, DEFAULT_CREATED_AT),
            extra: self.carried(),
        }
    }

    /// The columns beyond the contract that travel with each row: the extra
    /// columns, then the routing columns, each once.
    fn carried(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        let names = self.extra.iter().map(|x| x.column.as_str());
        for c in names.chain(self.routing().into_iter().map(|(_, c)| c)) {
            if !out.iter().any(|o| o == c) {
                out.push(c.to_owned());
            }
        }
        out
    }
}

/// The columns the relay reads from a given table; `None` means "absent, use the default value".
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResolvedColumns {
    pub id: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub event_type: String,
    pub payload: String,
    pub event_version: Option<String>,
    pub headers: Option<String>,
    pub created_at: Option<String>,
    /// The columns read besides the contract's, carried in
    /// [`crate::outbox::RawRow::extra`]: the `[[outbox.columns.extra]]` columns in
    /// configuration order, then the routing columns (`destination`, `key`)
    /// not among them.
    pub extra: Vec<String>,
}

impl ResolvedColumns {
    /// Every contract column in [`crate::outbox::RawRow`] order, `None` for absent optional ones.
    pub fn in_row_order(&self) -> [Option<&str>; 8] {
        [
            Some(self.id.as_str()),
            Some(self.aggregate_type.as_str()),
            Some(self.aggregate_id.as_str()),
            Some(self.event_type.as_str()),
            self.event_version.as_deref(),
            Some(self.payload.as_str()),
            self.headers.as_deref(),
            self.created_at.as_deref(),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn optional_columns_fall_back_to_defaults_only_when_present() {
        let map = ColumnMap {
            aggregate_type: "aggregatetype".into(),
            aggregate_id: "aggregateid".into(),
            event_type: "type".into(),
            ..ColumnMap::default()
        };
        let cols: Vec<String> = [
            "id",
            "aggregatetype",
            "aggregateid",
            "type",
            "payload",
            "created_at",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let r = map.resolve(&cols);
        assert_eq!(r.event_version, None);
        assert_eq!(r.headers, None);
        assert_eq!(r.created_at.as_deref(), Some("created_at"));
        assert_eq!(r.event_type, "type");
    }

    #[test]
    fn duplicate_and_reserved_names_are_problems() {
        let map = ColumnMap {
            aggregate_id: "aggregate_type".into(),
            headers: Some("relay_seq".into()),
            ..ColumnMap::default()
        };
        let p = map.problems();
        assert!(
            p.iter()
                .any(|(k, m)| *k == "aggregate_id" && m.contains("already mapped"))
        );
        assert!(
            p.iter()
                .any(|(k, m)| *k == "headers" && m.contains("relay owns"))
        );
    }

    fn extra(column: &str, header: Option<&str>, attribute: Option<&str>) -> ExtraColumn {
        ExtraColumn {
            column: column.into(),
            header: header.map(Into::into),
            attribute: attribute.map(Into::into),
        }
    }

    #[test]
    fn attribute_names_follow_cloudevents() {
        for good in ["tenantid", "a", "x2", "abcdefghij0123456789"] {
            assert_eq!(attribute_problem(good), None, "{good}");
        }
        for (bad, expected) in [
            ("", "lowercase letters"),
            ("tenant_id", "lowercase letters"),
            ("Tenant", "lowercase letters"),
            ("tenant-id", "lowercase letters"),
            ("abcdefghij01234567890", "at most 20"),
            ("id", "relay sets"),
            ("data", "relay sets or CloudEvents reserves"),
            ("traceparent", "relay sets"),
        ] {
            let p = attribute_problem(bad).unwrap_or_default();
            assert!(p.contains(expected), "{bad:?}: {p}");
        }
    }

    #[test]
    fn header_names_cannot_take_the_relays() {
        assert_eq!(header_problem("tenant"), None);
        for (bad, expected) in [
            ("Content-Type", "relay sets"),
            ("EVENT_ID", "relay sets"),
            ("ce_tenant", "starts with"),
            ("cloudEvents:tenant", "starts with"),
            ("", "not a header name"),
            ("a\nb", "not a header name"),
        ] {
            let p = header_problem(bad).unwrap_or_default();
            assert!(p.contains(expected), "{bad:?}: {p}");
        }
    }

    #[test]
    fn extra_columns_are_problems_by_index() {
        let map = ColumnMap {
            extra: vec![
                extra("tenant_id", Some("tenant"), Some("tenantid")),
                extra("relay_seq", Some("seq"), None),
                extra("region", Some("TENANT"), Some("tenantid")),
                extra("nothing", None, None),
            ],
            ..ColumnMap::default()
        };
        let p = map.problems();
        let has = |key: &str, text: &str| p.iter().any(|(k, m)| k == key && m.contains(text));
        assert!(!p.iter().any(|(k, _)| k.starts_with("extra[0]")), "{p:?}");
        assert!(has("extra[1].column", "relay owns"), "{p:?}");
        assert!(has("extra[2].header", "already set by extra[0]"), "{p:?}");
        assert!(
            has("extra[2].attribute", "already set by extra[0]"),
            "{p:?}"
        );
        assert!(has("extra[3].column", "publishes nothing"), "{p:?}");
        let many = ColumnMap {
            extra: (0..=MAX_EXTRA_COLUMNS)
                .map(|i| extra(&format!("c{i}"), Some(&format!("h{i}")), None))
                .collect(),
            ..ColumnMap::default()
        };
        assert!(many.problems().iter().any(|(k, _)| k == "extra"));
        let resolved = ColumnMap {
            extra: vec![extra("tenant_id", Some("tenant"), None)],
            ..ColumnMap::default()
        }
        .resolve(&[]);
        assert_eq!(resolved.extra, vec!["tenant_id".to_owned()]);
    }

    #[test]
    fn routing_columns_travel_once_and_are_checked_by_key() {
        let map = ColumnMap {
            extra: vec![extra("topic", Some("topic"), None)],
            destination: Some("topic".into()),
            key: Some("partition_key".into()),
            ..ColumnMap::default()
        };
        assert!(map.problems().is_empty(), "{:?}", map.problems());
        assert_eq!(
            map.resolve(&[]).extra,
            vec!["topic".to_owned(), "partition_key".to_owned()],
            "a routing column that is also an extra column is read once"
        );
        assert_eq!(
            ColumnMap::default().resolve(&[]).extra,
            Vec::<String>::new()
        );
        let bad = ColumnMap {
            destination: Some("relay_sent_at".into()),
            key: Some(String::new()),
            ..ColumnMap::default()
        };
        let p = bad.problems();
        assert!(
            p.iter()
                .any(|(k, m)| k == "destination" && m.contains("relay owns")),
            "{p:?}"
        );
        assert!(
            p.iter()
                .any(|(k, m)| k == "key" && m.contains("1 to 63 bytes")),
            "{p:?}"
        );
    }
}
