//! Reading outbox rows with SQL, shared by the polling reader and the CDC
//! start-up read: every contract column is selected as text (absent optional
//! ones as NULL), after `relay_seq`, in [`RawRow`] order, then the extra
//! and routing columns as one JSON object (so the list has the same width
//! whatever the configuration). The CDC stream turns pgoutput's text into
//! these `::text` forms (`source/cdc/stream/text.rs`): change one, change both.

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

/// The bytes a row read takes of a page's room: its text values (payload,
/// headers, extra columns) and what the budget counts per event beside
/// them, as [`crate::source::SourcedEvent::bytes`] will charge it.
pub fn row_bytes(raw: &RawRow) -> usize {
    raw.text_len() + crate::source::EVENT_OVERHEAD
}

/// Rows a page asks for while no row size is known yet (the first
/// page after a start): few, so that a first page of large rows does not
/// carry many of them past the byte budget.
const FIRST_PAGE: usize = 64;

/// How many rows a page asks for, and where the byte budget cuts it.
///
/// A page query is `... ORDER BY relay_seq LIMIT n` with no byte cap of
/// its own (a running sum of the payloads in SQL added about a third to a
/// page's time on the server). The reader asks for as many rows as the
/// room holds at the previous page's row sizes ([`row_bytes`]), at most
/// `max`, and keeps rows while the rows before them take less than the
/// room (the first row always). The server still sends the rest of a page
/// the rows outgrew; the reader drops it, and the next page reads it again.
///
/// The size a page assumes is its previous page's average row, or a
/// quarter of that page's largest when larger: unless rows outgrow the
/// previous page's largest, a page carries at most about four times the
/// room. A first page after a start asks for [`FIRST_PAGE`] rows.
#[derive(Debug, Default)]
pub struct Paging {
    /// The bytes a row is assumed to take; `None` until a page kept rows.
    assumed: Option<usize>,
}

/// A page's rows as they arrive: kept while the room lasts.
#[derive(Debug)]
pub struct Page<T> {
    rows: Vec<T>,
    limit: usize,
    max_bytes: usize,
    bytes: usize,
    largest: usize,
    cut: bool,
}

/// One page's rows, and whether more may follow.
#[derive(Debug)]
pub struct Paged<T> {
    pub rows: Vec<T>,
    /// The page had as many rows as it asked for, or the room cut it.
    pub full: bool,
}

impl Paging {
    /// The `LIMIT` of the next page: what `max_bytes` holds at the
    /// assumed row size, between 1 and `max`.
    pub fn limit(&self, max: usize, max_bytes: usize) -> usize {
        let fit = match self.assumed {
            None => FIRST_PAGE,
            // Rows that take no room (in tests).
            Some(0) => usize::MAX,
            // The rows kept: all but the last take less than the room.
            Some(size) => max_bytes.div_ceil(size),
        };
        fit.clamp(1, max.max(1))
    }

    /// A page of the rows of a query that asked for `limit`.
    pub fn page<T>(&self, limit: usize, max_bytes: usize) -> Page<T> {
        Page {
            rows: Vec::new(),
            limit,
            max_bytes,
            bytes: 0,
            largest: 0,
            cut: false,
        }
    }

    /// The page's rows; what it kept sizes the next. `full` counts the rows
    /// kept: a row of NULLs comes only alone, in an empty answer.
    pub fn finish<T>(&mut self, page: Page<T>) -> Paged<T> {
        if let Some(average) = page.bytes.checked_div(page.rows.len()) {
            self.assumed = Some(average.max(page.largest / 4));
        }
        Paged {
            full: page.cut || page.rows.len() >= page.limit,
            rows: page.rows,
        }
    }

    /// Runs a page query asking for `limit` rows and hands each row to
    /// `each` as it arrives, keeping what `each` returns (`None`: a row of
    /// NULLs, not a row) while the [`Page`] takes it; `size` tells a kept
    /// row's bytes ([`row_bytes`]).
    ///
    /// Row by row because a row borrows the connection's read buffer:
    /// collecting a page first would hold it all in that buffer (grown to
    /// as much again) while `each` copied it out. After a cut, the
    /// connection reads the rest of the answer and drops it.
    #[allow(clippy::too_many_arguments)]
    pub async fn read<T>(
        &mut self,
        client: &Client,
        statement: &Statement,
        params: &[&(dyn ToSql + Sync)],
        limit: usize,
        max_bytes: usize,
        mut each: impl FnMut(&Row) -> Option<T>,
        size: impl Fn(&T) -> usize,
    ) -> Result<Paged<T>, tokio_postgres::Error> {
        let rows = client
            .query_raw(statement, params.iter().map(|p| *p as &dyn ToSql))
            .await?;
        let mut rows = std::pin::pin!(rows);
        let mut page = self.page(limit, max_bytes);
        while let Some(row) = rows.try_next().await? {
            if !page.takes_another() {
                tracing::debug!(kept = page.rows.len(), limit, "page cut at the byte room");
                break;
            }
            if let Some(t) = each(&row) {
                let bytes = size(&t);
                page.keep(t, bytes);
            }
        }
        Ok(self.finish(page))
    }
}

impl<T> Page<T> {
    /// Whether another row that arrived is kept: while the rows kept take
    /// less than the room (the first row always). `false` cuts the page,
    /// so ask only once a row has arrived.
    pub fn takes_another(&mut self) -> bool {
        self.cut = self.bytes >= self.max_bytes && !self.rows.is_empty();
        !self.cut
    }

    pub fn keep(&mut self, row: T, bytes: usize) {
        self.bytes = self.bytes.saturating_add(bytes);
        self.largest = self.largest.max(bytes);
        self.rows.push(row);
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
        paging.assumed = Some(1_000);
        // As many rows as are kept: the room holds 100, and 101 when the
        // last passes it.
        assert_eq!(paging.limit(500, 100_000), 100);
        assert_eq!(paging.limit(500, 100_001), 101);
        assert_eq!(paging.limit(50, 100_000), 50);
        // Less room than one row: one row still.
        assert_eq!(paging.limit(500, 10), 1);
        assert_eq!(paging.limit(0, 10), 1);
        // Rows that take no room: as many as `max`.
        paging.assumed = Some(0);
        assert_eq!(paging.limit(500, 1), 500);
    }

    /// Keeps `payloads` as rows of a page that asked for `limit`.
    fn page_of(paging: &mut Paging, limit: usize, room: usize, payloads: &[usize]) -> Paged<usize> {
        let mut page = paging.page(limit, room);
        for (i, &size) in payloads.iter().enumerate() {
            if !page.takes_another() {
                break;
            }
            page.keep(i, size);
        }
        paging.finish(page)
    }

    #[test]
    fn a_page_keeps_rows_while_the_ones_before_take_less_than_the_room() {
        let mut paging = Paging::default();
        let paged = page_of(&mut paging, 64, 2_500, &[1_000; 10]);
        assert_eq!((paged.rows, paged.full), (vec![0, 1, 2], true));
        // The first row always, however large.
        let paged = page_of(&mut paging, 64, 10, &[1_000, 1_000]);
        assert_eq!((paged.rows, paged.full), (vec![0], true));
        // The answer ended before the room or the limit: the last page.
        let paged = page_of(&mut paging, 64, 10_000, &[1_000; 3]);
        assert_eq!((paged.rows, paged.full), (vec![0, 1, 2], false));
        // As many rows as asked for: more may follow.
        let paged = page_of(&mut paging, 3, 10_000, &[1_000; 3]);
        assert_eq!((paged.rows, paged.full), (vec![0, 1, 2], true));
    }

    #[test]
    fn the_next_page_assumes_the_average_or_a_quarter_of_the_largest() {
        let mut paging = Paging::default();
        page_of(&mut paging, 64, usize::MAX, &[100; 8]);
        assert_eq!(paging.assumed, Some(100));
        // One large payload among small ones.
        page_of(&mut paging, 64, usize::MAX, &[100, 100, 100, 4_000]);
        assert_eq!(paging.assumed, Some(1_075));
        page_of(
            &mut paging,
            64,
            usize::MAX,
            &[100, 100, 100, 100, 100, 100, 100, 4_000],
        );
        assert_eq!(paging.assumed, Some(1_000));
        // An empty page leaves it as it was.
        page_of(&mut paging, 64, usize::MAX, &[]);
        assert_eq!(paging.assumed, Some(1_000));
    }
}
