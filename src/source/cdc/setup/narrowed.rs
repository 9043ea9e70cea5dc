//! What a publication's entry for the outbox may narrow on PostgreSQL 15
//! or later: a column list, which may leave out a column the relay reads
//! (or `relay_seq`, which it marks rows by), and a row filter, which keeps
//! rows out of the stream. The stream meets the first only at the first
//! Relation message, and the second never: a row the filter holds back
//! would wait for the next start-up read, behind later events of its
//! aggregate (with `relay.mark = "none"` it would never go out). Both are
//! refused before streaming, as a setup problem that says what to run.

use super::generated::read_columns;
use super::q;
use crate::config::{ResolvedColumns, SEQ_COLUMN, TableName};
use crate::db::DbError;
use crate::sql::quote_ident;
use tokio_postgres::Client;

/// What `publication` narrows of `table` on a server of `version`
/// (`server_version_num`): a column the relay reads missing from its column
/// list (the `generated` ones are told of apart), `relay_seq` missing when
/// rows are marked (`marks`), a row filter. Nothing when the table is not
/// in the publication (told of apart).
pub(super) async fn narrowing_problems(
    client: &Client,
    version: i32,
    publication: &str,
    table: &TableName,
    (columns, generated): (&ResolvedColumns, &[String]),
    marks: bool,
) -> Result<Vec<String>, DbError> {
    if version < 150_000 {
        return Ok(Vec::new());
    }
    let row = client
        .query_opt(
            "SELECT coalesce(t.attnames::text[], '{}'), t.rowfilter,
                    ARRAY(SELECT attname::text FROM pg_attribute
                          WHERE attrelid = to_regclass($4) AND attnum > 0 AND NOT attisdropped)
             FROM pg_publication_tables t
             WHERE t.pubname = $1 AND t.schemaname = $2 AND t.tablename = $3",
            &[&publication, &table.schema, &table.name, &table.quoted()],
        )
        .await
        .map_err(|e| {
            q(
                "reading what the publication streams of the outbox table",
                e,
            )
        })?;
    let Some(row) = row else {
        return Ok(Vec::new());
    };
    let (listed, filter, existing): (Vec<String>, Option<String>, Vec<String>) =
        (row.get(0), row.get(1), row.get(2));
    let has = |names: &[String], column: &str| names.iter().any(|n| n == column);
    let fix = fix_sql(publication, table);
    let seq = marks.then_some(("relay.mark: rows are marked sent by it", SEQ_COLUMN));
    let mut problems: Vec<String> = read_columns(columns)
        .chain(seq)
        .filter(|(_, c)| has(&existing, c) && !has(&listed, c) && !has(generated, c))
        .map(|(key, column)| {
            format!(
                "publication {publication:?} leaves column {column:?} ({key}) of {table} out of its \
                 column list, so the relay cannot read it in CDC mode; publish all of the table's \
                 columns: {fix}"
            )
        })
        .collect();
    if let Some(filter) = filter {
        problems.push(format!(
            "publication {publication:?} streams only the rows of {table} WHERE {filter}, so events \
             the filter holds back would go out late and behind later events of their aggregate \
             (with relay.mark = \"none\", never); publish every row: {fix}"
        ));
    }
    Ok(problems)
}

/// The statement that publishes every column and row of `table` again.
fn fix_sql(publication: &str, table: &TableName) -> String {
    let publication = quote_ident(publication);
    let table = table.quoted();
    format!(
        "`ALTER PUBLICATION {publication} SET TABLE {table}` where the publication holds only the \
         outbox (as `outbox-relay migrate` makes it), otherwise `ALTER PUBLICATION {publication} \
         DROP TABLE {table}` and `ALTER PUBLICATION {publication} ADD TABLE {table}` in one transaction"
    )
}
