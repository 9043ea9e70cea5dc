//! Reading outbox rows with SQL, shared by the polling reader and the CDC
//! start-up read: every contract column is selected as text (absent optional
//! ones as NULL), after `relay_seq`, in [`RawRow`] order, then the extra
//! and routing columns as one JSON object (so the list has the same width
//! whatever the configuration).

use crate::config::{ResolvedColumns, SEQ_COLUMN};
use crate::outbox::RawRow;
use crate::sql::{quote_ident, quote_literal};
use futures::TryStreamExt;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

/// Columns of [`select_list`] after `relay_seq`.
pub const ROW_WIDTH: usize = 9;

/// `relay_seq, <id>::text, ..., <created_at>::text, <extra>`.
pub fn select_list(columns: &ResolvedColumns) -> String {
    let mut list = vec![SEQ_COLUMN.to_owned()];
    for col in columns.in_row_order() {
        list.push(match col {
            Some(c) => format!("{}::text", quote_ident(c)),
            None => "NULL::text".to_owned(),
        });
    }
    list.push(extra_object(&columns.extra));
    list.join(", ")
}

/// The extra columns as one JSON object of text values, NULL ones left out
/// (as the CDC reader builds it from a tuple), or NULL when there are none.
fn extra_object(extra: &[String]) -> String {
    if extra.is_empty() {
        return "NULL::text".to_owned();
    }
    let pairs: Vec<String> = extra
        .iter()
        .map(|c| format!("{}, {}::text", quote_literal(c), quote_ident(c)))
        .collect();
    format!(
        "jsonb_strip_nulls(jsonb_build_object({}))::text",
        pairs.join(", ")
    )
}

/// Reads `relay_seq` and the row at `offset` (where the select list starts);
/// `None` when `relay_seq` is NULL (the empty side of an outer join).
pub fn read_row(row: &Row, offset: usize) -> Option<(i64, RawRow)> {
    let seq: Option<i64> = row.get(offset);
    let text = |i: usize| row.get::<_, Option<String>>(offset + 1 + i);
    seq.map(|seq| {
        (
            seq,
            RawRow {
                id: text(0),
                aggregate_type: text(1),
                aggregate_id: text(2),
                event_type: text(3),
                event_version: text(4),
                payload: text(5),
                headers: text(6),
                created_at: text(7),
                extra: text(8),
            },
        )
    })
}

/// Wraps a page query (`SELECT select_list ... ORDER BY relay_seq LIMIT n`)
/// so that it returns its rows only while their payloads, in order, fit in
/// the bytes given as parameter `bytes_param` (the first row always), and
/// adds a trailing column `relay_page_rows`: how many rows the page had
/// before the cut, which tells a full page from the end of the rows.
pub fn byte_capped(page: &str, payload: &str, bytes_param: &str) -> String {
    let size = format!("coalesce(octet_length(page.{}), 0)", quote_ident(payload));
    format!(
        "SELECT * FROM (
             SELECT page.*, count(*) OVER () AS relay_page_rows,
                    sum({size}) OVER (ORDER BY page.{SEQ_COLUMN} ROWS UNBOUNDED PRECEDING) - {size} AS relay_bytes_before
             FROM ({page}) page
         ) sized
         WHERE relay_bytes_before < {bytes_param}
         ORDER BY {SEQ_COLUMN}"
    )
}

/// The `relay_page_rows` column of a [`byte_capped`] page's row (0 when NULL).
pub fn page_rows(row: &Row) -> usize {
    row.try_get::<_, Option<i64>>("relay_page_rows")
        .ok()
        .flatten()
        .map_or(0, |n| usize::try_from(n).unwrap_or(0))
}

/// Runs a page query and hands each row to `each` as it arrives, keeping
/// what `each` returns. A row borrows the connection's read buffer, so
/// collecting a page's rows first would hold the whole page in that buffer
/// (grown to as much again) while `each` copied it out: with large payloads,
/// three times the page at once. Row by row, the buffer holds about one row.
pub async fn each_row<T>(
    client: &Client,
    statement: &Statement,
    params: &[&(dyn ToSql + Sync)],
    mut each: impl FnMut(&Row) -> Option<T>,
) -> Result<Vec<T>, tokio_postgres::Error> {
    let rows = client
        .query_raw(statement, params.iter().map(|p| *p as &dyn ToSql))
        .await?;
    let mut rows = std::pin::pin!(rows);
    let mut out = Vec::new();
    while let Some(row) = rows.try_next().await? {
        out.extend(each(&row));
    }
    Ok(out)
}
