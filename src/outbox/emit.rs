//! The function applications call to write an event as a logical message
//! (`source.cdc.messages`): its signature and body, which `migrate`
//! installs, and the prefix an installed one writes, which must be the
//! one the relay reads (it skips messages with any other).

use crate::config::TableName;
use crate::outbox::names::emit_function;
use crate::sql::{quote_ident, quote_literal};
use tokio_postgres::GenericClient;

/// The function's argument types, in order.
const ARGUMENTS: &str = "text, text, text, jsonb, jsonb, integer, jsonb, uuid";

/// `schema.function(argument types)`, as `to_regprocedure` reads it.
pub fn signature(table: &TableName) -> String {
    format!(
        "{}.{}({ARGUMENTS})",
        quote_ident(&table.schema),
        quote_ident(&emit_function(table))
    )
}

/// The function's body for `prefix`. The extra values go first, so that a
/// key there never replaces an event field; a payload keeps its nested nulls.
pub fn body(prefix: &str) -> String {
    format!(
        "
BEGIN
    PERFORM pg_logical_emit_message(true, {prefix}, (
        coalesce(extra, '{{}}'::jsonb) || jsonb_build_object(
            'id', id,
            'aggregate_type', aggregate_type,
            'aggregate_id', aggregate_id,
            'event_type', event_type,
            'event_version', event_version,
            'payload', payload,
            'headers', headers)
    )::text);
    RETURN id;
END
",
        prefix = quote_literal(prefix)
    )
}

/// The installed function's body, if there is one.
pub async fn installed_body(
    client: &impl GenericClient,
    table: &TableName,
) -> Result<Option<String>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure($1)",
            &[&signature(table)],
        )
        .await?
        .map(|r| r.get(0)))
}

/// The prefix a body written by [`body`] passes (`None` for a body that
/// is not one: edited by hand).
fn written_prefix(body: &str) -> Option<String> {
    let literal = body.split_once("pg_logical_emit_message(true, '")?.1;
    let mut prefix = String::new();
    let mut chars = literal.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\'' {
            if chars.peek() != Some(&'\'') {
                return Some(prefix);
            }
            chars.next();
        }
        prefix.push(c);
    }
    None
}

/// When the installed function writes messages with another prefix than
/// `prefix`: what to do. The relay would skip every event written with it.
pub async fn prefix_problem(
    client: &impl GenericClient,
    table: &TableName,
    prefix: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let body = installed_body(client, table).await?;
    let written = body.as_deref().and_then(written_prefix);
    Ok(written.filter(|w| w != prefix).map(|written| {
        format!(
            "{} writes logical messages with prefix {written:?}, and source.cdc.message_prefix is {prefix:?}: \
             the relay would skip the events it writes. Stop every relay of this outbox, run \
             `outbox-relay migrate` (it rewrites the function), then start them again",
            signature(table)
        )
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prefix_a_body_writes_is_read_back() {
        for prefix in ["outbox_relay_outbox", "it's", "a''b", "tail'"] {
            assert_eq!(written_prefix(&body(prefix)).as_deref(), Some(prefix));
        }
        assert_eq!(written_prefix("BEGIN RETURN NULL; END"), None);
        assert_eq!(written_prefix("pg_logical_emit_message(true, 'open"), None);
    }
}
