//! The start-up read's statements: the unsent rows of a round's snapshot,
//! in `relay_seq` order, a page at a time.
//!
//! When rows are marked, the unsent rows are those with
//! `relay_sent_at IS NULL`, read through that partial index from the start.
//!
//! When sent rows are recorded by ranges (`relay.mark = "ranges"`,
//! [`crate::outbox::progress`]), no outbox row changes when it is sent, so
//! that index holds every row. Each round instead reads the rows of its
//! snapshot that a *base* did not see, through the bulk and straggler
//! branches of `outbox::progress::read`: the first round's base is the
//! frontier (with the rows it holds open), a later round's the previous
//! round's snapshot, whose unsent rows that round read. Both branches filter
//! on the whole predicate, so a round hands over exactly the unsent rows a
//! scan of the table would; what it visits is O(rows since the base).

use super::server::TableRow;
use crate::config::{ResolvedColumns, SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
use crate::db::DbError;
use crate::outbox::progress::read::Stragglers;
use crate::outbox::progress::{Ranges, read};
use crate::source::SourceError;
use crate::source::rows::{Paging, ROW_WIDTH, read_row, select_list};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

/// The columns a ranges round's first page puts before the rows: *cur*,
/// its highest `relay_seq`, the base's, the stragglers.
const HEAD: usize = 4;

/// Column of the full xid within a page's row, after `relay_seq` and the row.
const XID_INDEX: usize = 1 + ROW_WIDTH;

/// How the start-up read finds unsent rows, and the size of its pages.
pub(super) struct StartupRows {
    find: Find,
    paging: Paging,
}

enum Find {
    /// `relay_sent_at IS NULL` (`$1` the cursor, `$2` the page's size).
    Marked(Statement),
    Ranges(RangesRead),
}

/// The ranges statements, and what a round's pages share.
struct RangesRead {
    first_page: Statement,
    next_page: Statement,
    /// The previous round's snapshot and highest visible `relay_seq`, the
    /// base of this round; `None` in a start's first round (the frontier).
    base: Option<(String, Option<i64>)>,
    /// This round's, once its first page ran.
    head: Option<Head>,
}

/// What a ranges round's first page resolved for the next pages.
struct Head {
    cur: String,
    cur_max: Option<i64>,
    base_max: i64,
    stragglers: Stragglers,
}

impl StartupRows {
    pub(super) async fn prepare(
        client: &Client,
        table: &TableName,
        columns: &ResolvedColumns,
        ranges: bool,
    ) -> Result<Self, SourceError> {
        let cols = format!(
            "{}, {XID_COLUMN}::text::bigint AS relay_xid_full",
            select_list(columns)
        );
        let prepare = |sql: String| async move {
            client.prepare(&sql).await.map_err(|e| {
                match Some(Ranges::new(table)).filter(|_| ranges) {
                    Some(r) => r.missing_table_problem(&e).map(SourceError::Setup),
                    None => None,
                }
                .unwrap_or_else(|| DbError::query("preparing the start-up read", e).into())
            })
        };
        let find = if ranges {
            let sql = Ranges::new(table).read_sql(&cols, "");
            Find::Ranges(RangesRead {
                first_page: prepare(sql.first_page).await?,
                next_page: prepare(sql.next_page).await?,
                base: None,
                head: None,
            })
        } else {
            Find::Marked(
                prepare(format!(
                    "SELECT {cols} FROM {} WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} > $1 ORDER BY {SEQ_COLUMN} LIMIT $2",
                    table.quoted()
                ))
                .await?,
            )
        };
        Ok(StartupRows {
            find,
            paging: Paging::default(),
        })
    }

    /// What the start-up read's transaction sets after its BEGIN: with
    /// ranges, the reading session's planner settings
    /// ([`read::READER_SESSION`]), for this transaction only.
    pub(super) fn transaction_settings(&self) -> String {
        match self.find {
            Find::Marked(_) => String::new(),
            Find::Ranges(_) => read::READER_SESSION.replace("SET ", "SET LOCAL "),
        }
    }

    /// A new start: its first round reads from the frontier.
    pub(super) fn restart(&mut self) {
        if let Find::Ranges(r) = &mut self.find {
            (r.base, r.head) = (None, None);
        }
    }

    /// A new round: the one that ended is its base.
    pub(super) fn next_round(&mut self) {
        if let Find::Ranges(r) = &mut self.find
            && let Some(head) = r.head.take()
        {
            r.base = Some((head.cur, head.cur_max));
        }
    }

    /// Up to `max` unsent rows of the round's snapshot after `after`, cut
    /// where their sizes pass `max_bytes` ([`Paging`]); none only when the
    /// round has no more. A ranges page that found none of its window of
    /// stragglers unsent moves on to the next window.
    pub(super) async fn page(
        &mut self,
        client: &Client,
        mut after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<TableRow>, SourceError> {
        loop {
            let (rows, window_end) = self.page_once(client, after, max, max_bytes).await?;
            match window_end {
                Some(upper) if rows.is_empty() => after = upper,
                _ => return Ok(rows),
            }
        }
    }

    /// One page query, and the end of the stragglers' window it was sent
    /// when more follow ([`Stragglers::window`]).
    async fn page_once(
        &mut self,
        client: &Client,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<(Vec<TableRow>, Option<i64>), SourceError> {
        let want = self.paging.limit(max, max_bytes);
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        let size = |r: &TableRow| crate::source::rows::row_bytes(&r.raw);
        let r = match &mut self.find {
            Find::Marked(statement) => {
                let params: [&(dyn ToSql + Sync); 2] = [&after, &limit];
                let read = |row: &Row| table_row(row, 0);
                return self
                    .paging
                    .read(client, statement, &params, want, max_bytes, read, size)
                    .await
                    .map(|paged| (paged.rows, None))
                    .map_err(|e| DbError::query("reading unsent rows at start-up", e).into());
            }
            Find::Ranges(r) => r,
        };
        let (base, base_max) = match &r.base {
            Some((snapshot, max)) => (Some(snapshot.clone()), *max),
            None => (None, None),
        };
        let window = r.head.as_ref().map(|h| h.stragglers.window(after, want));
        let (stragglers, upper) = window.map_or((&[][..], i64::MAX), |w| (w.stragglers, w.upper));
        let (statement, offset, params): (_, _, Vec<&(dyn ToSql + Sync)>) = match &r.head {
            None => (&r.first_page, HEAD, vec![&base, &base_max, &limit]),
            Some(h) => (
                &r.next_page,
                0,
                vec![
                    &after,
                    &h.cur,
                    &base,
                    &h.base_max,
                    &stragglers,
                    &limit,
                    &upper,
                ],
            ),
        };
        let mut head = None;
        let read = |row: &Row| {
            if offset == HEAD && head.is_none() {
                head = Some(Head {
                    cur: row.get(0),
                    cur_max: row.get(1),
                    base_max: row.get(2),
                    stragglers: Stragglers::new(row.get(3)),
                });
            }
            table_row(row, offset)
        };
        let paged = self
            .paging
            .read(client, statement, &params, want, max_bytes, read, size)
            .await
            .map_err(|e| DbError::query("reading unsent rows at start-up, by ranges", e))?;
        let window_end = window.filter(|w| w.truncated).map(|w| w.upper);
        if head.is_some() {
            r.head = head;
        }
        Ok((paged.rows, window_end))
    }
}

/// A page's row from column `offset` on; `None` for the row of NULLs an
/// empty ranges first page returns.
fn table_row(row: &Row, offset: usize) -> Option<TableRow> {
    let (seq, raw) = read_row(row, offset)?;
    let xid: i64 = row.get(offset + XID_INDEX);
    Some(TableRow {
        seq,
        // Never negative (an xid8); were it, the row would count as unseen
        // and be read again rather than skipped.
        xid: u64::try_from(xid).unwrap_or(u64::MAX),
        raw,
    })
}
