//! The function applications call to write an event as a logical message
//! (`source.cdc.messages`), so none has to build the JSON by hand.

use super::{MigrateError, Step};
use crate::config::TableName;
use crate::sql::{quote_ident, quote_literal};
use tokio_postgres::Client;

/// The function's argument types, in order.
const ARGUMENTS: &str = "text, text, text, jsonb, jsonb, integer, jsonb, uuid";

use crate::outbox::names::emit_function;

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
fn body(prefix: &str) -> String {
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

/// The step that creates (or updates) the function, when it is missing or
/// writes with another prefix.
pub(super) async fn step(
    client: &Client,
    table: &TableName,
    prefix: &str,
) -> Result<Option<Step>, MigrateError> {
    let body = body(prefix);
    let current: Option<String> = client
        .query_opt(
            "SELECT prosrc FROM pg_proc WHERE oid = to_regprocedure($1)",
            &[&signature(table)],
        )
        .await?
        .map(|r| r.get(0));
    if current.as_deref() == Some(body.as_str()) {
        return Ok(None);
    }
    let name = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&emit_function(table))
    );
    Ok(Some(Step::new(
        format!(
            "create function {}.{} (writes an event as a logical message with prefix {prefix:?})",
            table.schema,
            emit_function(table)
        ),
        format!(
            "CREATE OR REPLACE FUNCTION {name}(
    aggregate_type text,
    aggregate_id text,
    event_type text,
    payload jsonb,
    headers jsonb DEFAULT NULL,
    event_version integer DEFAULT 1,
    extra jsonb DEFAULT NULL,
    id uuid DEFAULT gen_random_uuid()
) RETURNS uuid VOLATILE LANGUAGE plpgsql AS $fn${body}$fn$"
        ),
    )))
}
