//! The function applications call to write an event as a logical message
//! (`source.cdc.messages`), so none has to build the JSON by hand.

use super::{MigrateError, Step};
use crate::config::TableName;
use crate::outbox::emit::{body, installed_body};
use crate::outbox::names::emit_function;
use crate::sql::quote_ident;
use tokio_postgres::Client;

/// The step that creates (or updates) the function, when it is missing or
/// writes with another prefix.
pub(super) async fn step(
    client: &Client,
    table: &TableName,
    prefix: &str,
) -> Result<Option<Step>, MigrateError> {
    let body = body(prefix);
    let current = installed_body(client, table).await?;
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
