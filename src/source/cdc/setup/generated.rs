//! Columns a CDC stream cannot carry: generated ones, which pgoutput
//! leaves out of its tuples, so that the stream would stop at the first
//! Relation message on a column it lacks. PostgreSQL 18 streams a stored
//! one where the publication asks for it
//! (<https://www.postgresql.org/docs/18/logical-replication-gencols.html>);
//! earlier versions never do. Polling reads them as any column.

use super::q;
use crate::config::{ResolvedColumns, TableName};
use crate::db::DbError;
use tokio_postgres::Client;

/// Why CDC cannot read `columns`, the columns the relay reads: one
/// message for each that is `generated` (of the table's generated
/// columns) and that `publication` does not stream on a server of
/// `version` (`server_version_num`), naming its key and the fix.
pub(super) async fn generated_problems(
    client: &Client,
    version: i32,
    publication: &str,
    table: &TableName,
    (columns, generated): (&ResolvedColumns, &[String]),
) -> Result<Vec<String>, DbError> {
    if generated.is_empty() {
        return Ok(Vec::new());
    }
    let streamed = streamed_columns(client, version, publication, table).await?;
    let unstreamed: Vec<String> = generated
        .iter()
        .filter(|c| !streamed.contains(c))
        .cloned()
        .collect();
    Ok(unstreamed_problems(columns, &unstreamed))
}

/// The columns pgoutput streams of `table` for `publication` on PostgreSQL
/// 18 or later, where `pg_publication_tables.attnames` lists a generated
/// column only when it is streamed; empty before 18, where the view lists
/// generated columns that pgoutput leaves out.
async fn streamed_columns(
    client: &Client,
    version: i32,
    publication: &str,
    table: &TableName,
) -> Result<Vec<String>, DbError> {
    if version < 180_000 {
        return Ok(Vec::new());
    }
    let rows = client
        .query(
            "SELECT unnest(attnames)::text FROM pg_publication_tables
             WHERE pubname = $1 AND schemaname = $2 AND tablename = $3",
            &[&publication, &table.schema, &table.name],
        )
        .await
        .map_err(|e| q("reading the columns the publication streams", e))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Every column the relay reads of the outbox, with the configuration key
/// that names it (the contract's, then the extra and routing columns).
pub(super) fn read_columns(
    columns: &ResolvedColumns,
) -> impl Iterator<Item = (&'static str, &str)> {
    const KEYS: [&str; 8] = [
        "outbox.columns.id",
        "outbox.columns.aggregate_type",
        "outbox.columns.aggregate_id",
        "outbox.columns.event_type",
        "outbox.columns.event_version",
        "outbox.columns.payload",
        "outbox.columns.headers",
        "outbox.columns.created_at",
    ];
    let contract = KEYS
        .into_iter()
        .zip(columns.in_row_order())
        .filter_map(|(key, column)| Some((key, column?)));
    let carried = columns
        .extra
        .iter()
        .map(|c| ("outbox.columns.extra, destination or key", c.as_str()));
    contract.chain(carried)
}

/// [`generated_problems`] for the columns the relay reads that are among
/// `unstreamed`.
fn unstreamed_problems(columns: &ResolvedColumns, unstreamed: &[String]) -> Vec<String> {
    read_columns(columns)
        .filter(|(_, column)| unstreamed.iter().any(|u| u == column))
        .map(|(key, column)| {
            format!(
                "column {column:?} ({key}) is a generated column, which logical replication leaves out \
                 of the rows it streams, so the relay cannot read it in CDC mode: make it a plain column \
                 that the application fills when it writes the event (or a BEFORE INSERT trigger fills), \
                 or use source.mode = \"polling\" (PostgreSQL 18 streams a STORED generated column where \
                 the publication sets publish_generated_columns = stored)"
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_generated_column_the_relay_reads_is_named_with_its_key() {
        let mut columns = crate::config::ColumnMap::default().resolve(&["headers".into()]);
        columns.extra = vec!["tenant".into()];
        let unstreamed = |names: &[&str]| {
            let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
            unstreamed_problems(&columns, &names)
        };
        let problems = unstreamed(&["aggregate_id", "tenant", "search_vector"]);
        assert_eq!(problems.len(), 2, "{problems:?}");
        assert!(
            problems[0].starts_with(
                "column \"aggregate_id\" (outbox.columns.aggregate_id) is a generated column"
            ),
            "{problems:?}"
        );
        assert!(problems[1].starts_with("column \"tenant\" (outbox.columns.extra"));
        assert!(problems[1].contains("make it a plain column"));
        // A column the relay does not read may be generated.
        assert!(unstreamed(&["search_vector"]).is_empty());
    }
}
