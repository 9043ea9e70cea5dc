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
        }
    }
}

/// The default names of the optional columns.
pub const DEFAULT_EVENT_VERSION: &str = "event_version";
pub const DEFAULT_HEADERS: &str = "headers";
pub const DEFAULT_CREATED_AT: &str = "created_at";

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

    /// Problems with the names themselves, as `(key, message)`.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let named = self.named();
        for (i, (key, col)) in named.iter().enumerate() {
            if col.is_empty() || col.len() > 63 {
                out.push((*key, "a column name must be 1 to 63 bytes long".to_owned()));
            }
            if [SEQ_COLUMN, XID_COLUMN, SENT_AT_COLUMN].contains(col) {
                out.push((
                    *key,
                    format!("{col} is a column the relay owns; map a column of your own"),
                ));
            }
            if let Some((other, _)) = named[..i].iter().find(|(_, c)| c == col) {
                out.push((*key, format!("column {col:?} is already mapped to {other}")));
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
        }
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
}

impl ResolvedColumns {
    /// Every contract column in [`super::RawRow`] order, `None` for absent optional ones.
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
}
