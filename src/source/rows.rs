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

/// Rows a page asks for while no payload size is known yet (the first
/// page after a start): few, so that a first page of large payloads does
/// not carry many rows past the byte budget.
const FIRST_PAGE: usize = 64;

/// How many rows a page asks for, and where the byte budget cuts it.
///
/// A page query is `... ORDER BY relay_seq LIMIT n` with no byte cap of its
/// own (a running sum of the payloads in SQL added about a third to a
/// page's time on the server). The reader asks for as many rows as the budget holds at the
/// average payload of its previous page, at most `max`, and keeps rows
/// while the payloads before them take less than the budget (the first row
/// always); the rest of a page that payloads outgrew are dropped as they
/// arrive, and read again by the next page.
#[derive(Debug, Default)]
pub struct Paging {
    /// Average payload bytes of the last page that kept rows.
    average: Option<usize>,
}

/// One page's rows, and whether more may follow.
#[derive(Debug)]
pub struct Paged<T> {
    pub rows: Vec<T>,
    /// The page had as many rows as it asked for, or the budget cut it.
    pub full: bool,
}

impl Paging {
    /// The `LIMIT` of the next page: what `max_bytes` holds at the average
    /// payload, between 1 and `max`.
    pub fn limit(&self, max: usize, max_bytes: usize) -> usize {
        let fit = match self.average {
            None => FIRST_PAGE,
            // Empty payloads take no room.
            Some(average) => max_bytes.checked_div(average).unwrap_or(usize::MAX),
        };
        fit.clamp(1, max.max(1))
    }

    /// Runs a page query asking for `limit` rows and hands each row to
    /// `each` as it arrives, keeping what `each` returns (`None`: a row of
    /// NULLs, not a row) while the `payload` bytes of the rows kept before
    /// it are under `max_bytes`.
    ///
    /// Row by row because a row borrows the connection's read buffer:
    /// collecting a page first would hold it all in that buffer (grown to
    /// as much again) while `each` copied it out. Rows past the cut are
    /// dropped unread; the connection discards the rest of the answer.
    #[allow(clippy::too_many_arguments)]
    pub async fn read<T>(
        &mut self,
        client: &Client,
        statement: &Statement,
        params: &[&(dyn ToSql + Sync)],
        limit: usize,
        max_bytes: usize,
        mut each: impl FnMut(&Row) -> Option<T>,
        payload: impl Fn(&T) -> usize,
    ) -> Result<Paged<T>, tokio_postgres::Error> {
        let rows = client
            .query_raw(statement, params.iter().map(|p| *p as &dyn ToSql))
            .await?;
        let mut rows = std::pin::pin!(rows);
        let (mut kept, mut bytes, mut cut) = (Vec::new(), 0usize, false);
        while let Some(row) = rows.try_next().await? {
            if bytes >= max_bytes && !kept.is_empty() {
                cut = true;
                break;
            }
            if let Some(t) = each(&row) {
                bytes = bytes.saturating_add(payload(&t));
                kept.push(t);
            }
        }
        if !kept.is_empty() {
            self.average = Some(bytes / kept.len());
        }
        Ok(Paged {
            full: cut || kept.len() >= limit,
            rows: kept,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_asks_for_what_the_room_holds_at_the_last_average() {
        let mut paging = Paging::default();
        // Nothing known yet: a small first page, never more than `max`.
        assert_eq!(paging.limit(500, usize::MAX), FIRST_PAGE);
        assert_eq!(paging.limit(10, usize::MAX), 10);
        paging.average = Some(1_000);
        assert_eq!(paging.limit(500, 100_000), 100);
        assert_eq!(paging.limit(50, 100_000), 50);
        // Less room than one row: one row still.
        assert_eq!(paging.limit(500, 10), 1);
        assert_eq!(paging.limit(0, 10), 1);
        // Empty payloads: as many as `max`.
        paging.average = Some(0);
        assert_eq!(paging.limit(500, 1), 500);
    }
}
