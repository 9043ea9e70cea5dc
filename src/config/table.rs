//! The outbox table's name, and the bookkeeping columns the relay adds to
//! every outbox table (see [`crate::outbox`] for what each one records).

use crate::sql::quote_ident;
use serde::Deserialize;
use std::fmt;

/// The relay's identity column: orders the events of one aggregate.
pub const SEQ_COLUMN: &str = "relay_seq";
/// The inserting transaction (`pg_current_xact_id()`).
pub const XID_COLUMN: &str = "relay_xid";
/// NULL until the broker confirmed the event.
pub const SENT_AT_COLUMN: &str = "relay_sent_at";

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

    /// A relay-owned table beside this one, in its schema, named
    /// `<name><suffix>` with the name's start trimmed to PostgreSQL's 63-byte
    /// limit (the suffix, which says what the table is, stays whole).
    pub fn sibling(&self, suffix: &str) -> TableName {
        let mut name = format!("{}{suffix}", self.name);
        while name.len() > 63 {
            name.remove(0);
        }
        TableName::new(&self.schema, &name)
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
}
