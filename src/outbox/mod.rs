//! The outbox table: its public contract, the relay's bookkeeping columns,
//! and the decoding of a row into an [`OutboxEvent`].
//!
//! Applications insert only the contract columns (`id`, `aggregate_type`,
//! `aggregate_id`, `event_type`, `event_version`, `payload`, `headers`,
//! `created_at`), under their own names if a [`ColumnMap`] says so. The relay
//! adds three columns with defaults, so no application INSERT mentions them:
//!
//! - `relay_seq`: an identity; orders events of one aggregate (see `source::polling`);
//! - `relay_xid`: the inserting transaction (`pg_current_xact_id()`), which tells
//!   the polling source which transactions' rows it has already seen;
//! - `relay_sent_at`: NULL until the broker confirmed the event.

pub mod columns;
mod event;
pub mod inspect;
mod shard;

pub use columns::{ColumnMap, ExtraColumn, ResolvedColumns};
pub use event::{OutboxEvent, RawRow, RowError};
pub use shard::Shard;

use serde::Deserialize;
use std::fmt;

pub const SEQ_COLUMN: &str = "relay_seq";
pub const XID_COLUMN: &str = "relay_xid";
pub const SENT_AT_COLUMN: &str = "relay_sent_at";

/// The statement that records confirmed rows (by `relay_seq`, `$1`), or
/// `None` when rows are left alone.
pub fn mark_sql(table: &TableName, mark: crate::config::MarkMode) -> Option<String> {
    use crate::config::MarkMode;
    let t = table.quoted();
    match mark {
        MarkMode::Update => Some(format!(
            "UPDATE {t} SET {SENT_AT_COLUMN} = now() WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} = ANY($1)"
        )),
        MarkMode::Delete => Some(format!(
            "DELETE FROM {t} WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} = ANY($1)"
        )),
        MarkMode::None => None,
    }
}

/// Quotes an identifier for SQL (`"a""b"`), so no configured name can inject SQL.
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for SQL (`'it''s'`).
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// A schema-qualified table name, written `schema.table` (schema defaults to `public`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TableName {
    pub schema: String,
    pub name: String,
}

impl TableName {
    pub fn new(schema: &str, name: &str) -> Self {
        TableName {
            schema: schema.to_owned(),
            name: name.to_owned(),
        }
    }

    pub fn parse(s: &str) -> Result<Self, String> {
        let (schema, name) = s.split_once('.').unwrap_or(("public", s));
        for part in [schema, name] {
            if part.is_empty() || part.len() > 63 {
                return Err(format!(
                    "{s:?} is not a table name: write schema.table with names of 1 to 63 bytes"
                ));
            }
        }
        if name.contains('.') {
            return Err(format!("{s:?} has more than one '.': write schema.table"));
        }
        Ok(TableName::new(schema, name))
    }

    /// `"schema"."table"`, ready for SQL.
    pub fn quoted(&self) -> String {
        format!("{}.{}", quote_ident(&self.schema), quote_ident(&self.name))
    }

    /// A name derived from this table for relay-owned objects (index, trigger,
    /// channel), truncated to PostgreSQL's 63-byte identifier limit.
    pub fn derived(&self, prefix: &str) -> String {
        let mut s = if self.schema == "public" {
            format!("{prefix}_{}", self.name)
        } else {
            format!("{prefix}_{}_{}", self.schema, self.name)
        };
        while s.len() > 63 {
            s.pop();
        }
        s
    }
}

impl fmt::Display for TableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.schema, self.name)
    }
}

impl<'de> Deserialize<'de> for TableName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        TableName::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// The partial index on `relay_sent_at` of sent rows, which retention reads
/// through (`migrate` creates it).
pub fn sent_index(table: &TableName) -> String {
    table.derived("outbox_relay_sent")
}

/// The trigger that keeps unsent rows as inserted (`migrate` installs it,
/// `check` looks for it).
pub const WRITE_ONCE_TRIGGER: &str = "outbox_relay_write_once";

/// The key of the session advisory lock that makes one instance active per
/// outbox (the pipeline takes it; `status`, `check` and retention read it).
pub fn ownership_key(table: &TableName) -> String {
    format!("outbox-relay:{table}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_parse_and_quote() {
        assert_eq!(
            TableName::parse("outbox").unwrap(),
            TableName::new("public", "outbox")
        );
        let t = TableName::parse("shop.Out\"box").unwrap();
        assert_eq!(t.quoted(), "\"shop\".\"Out\"\"box\"");
        assert!(TableName::parse("a.b.c").is_err());
        assert!(TableName::parse(".x").is_err());
        assert_eq!(
            TableName::new("public", "outbox").derived("outbox_relay"),
            "outbox_relay_outbox"
        );
        assert_eq!(TableName::new("s", &"x".repeat(80)).derived("p").len(), 63);
    }

    #[test]
    fn literals_are_escaped() {
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
