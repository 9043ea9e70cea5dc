//! Quoting for SQL text the relay builds from configured names, so no table,
//! column or channel name can inject SQL. A leaf: it imports nothing from the
//! crate, so configuration and every module that writes SQL can use it.

/// Quotes an identifier for SQL (`"a""b"`).
pub fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// Quotes a string literal for SQL (`'it''s'`).
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_and_literals_are_escaped() {
        assert_eq!(quote_ident("Out\"box"), "\"Out\"\"box\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
    }
}
