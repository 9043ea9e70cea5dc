//! The start-up read's statements: the unsent rows of a round's snapshot,
//! in `relay_seq` order, a page at a time.
//!
//! A query asks for several pages' worth and stays open while the reader
//! hands its pages over ([`Ahead`]): the server produces the next rows
//! while the relay publishes the last ones, as the replication stream does,
//! instead of waiting for a query per page. The connection reads only as
//! fast as the pages are taken, so what waits on it is bounded by its
//! buffers, not by the query's size.
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
use crate::outbox::progress::{Ranges, read};
use crate::source::SourceError;
use crate::source::rows::{Paging, ROW_WIDTH, read_row, select_list};
use futures::TryStreamExt;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, RowStream, Statement};

/// The columns a ranges round's first page puts before the rows: *cur*,
/// its highest `relay_seq`, the base's, the stragglers.
const HEAD: usize = 4;

/// Column of the 32-bit xid within a page's row, after `relay_seq` and the row.
const XID_INDEX: usize = 1 + ROW_WIDTH;

/// How the start-up read finds unsent rows, and the size of its pages.
pub(super) struct StartupRows {
    find: Find,
    paging: Paging,
    /// The query still sending rows, if any.
    ahead: Option<Ahead>,
    /// The cursor after which the last query ended short: the round has
    /// no rows past it.
    answered: Option<i64>,
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
    stragglers: Vec<i64>,
}

impl StartupRows {
    pub(super) async fn prepare(
        client: &Client,
        table: &TableName,
        columns: &ResolvedColumns,
        ranges: bool,
    ) -> Result<Self, SourceError> {
        let cols = format!(
            "{}, ({XID_COLUMN}::text::bigint % 4294967296)::bigint AS relay_xid32",
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
            ahead: None,
            answered: None,
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
        self.close();
        if let Find::Ranges(r) = &mut self.find {
            (r.base, r.head) = (None, None);
        }
    }

    /// A new round: the one that ended is its base.
    pub(super) fn next_round(&mut self) {
        self.close();
        if let Find::Ranges(r) = &mut self.find
            && let Some(head) = r.head.take()
        {
            r.base = Some((head.cur, head.cur_max));
        }
    }

    /// Up to `max` unsent rows of the round's snapshot after `after`, cut
    /// where their payloads pass `max_bytes` ([`Page`]); none when the
    /// round has no more.
    ///
    /// The rows come from a query that asks for several pages' worth
    /// ([`Ahead`]) and stays open between calls: while the relay hands a
    /// page over, the server goes on sending the next rows. A row past a
    /// page's room waits for the next page instead of being read again.
    /// A call that does not continue where the last one stopped (`after`
    /// is not its last row: a cancelled call, a new round) reads afresh.
    pub(super) async fn page(
        &mut self,
        client: &Client,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<TableRow>, SourceError> {
        if self.ahead.as_ref().is_some_and(|a| a.after != after) {
            self.close();
        }
        // One row at least: an empty page ends the round.
        let mut page = self.paging.page(max.max(1), max_bytes);
        // The last row taken: where a new query starts.
        let mut cursor = after;
        while !page.full() {
            if self.ahead.is_none() {
                if self.answered == Some(cursor) {
                    break; // the last query ended short there: nothing more
                }
                self.ahead = Some(self.query(client, cursor, max, max_bytes).await?);
            }
            let Some(ahead) = self.ahead.as_mut() else {
                break;
            };
            let row = match ahead.held.take() {
                Some(row) => Some(row),
                None => ahead.next(&mut self.find).await?,
            };
            let Some(row) = row else {
                // The answer ended: short, with the round's last rows; as
                // long as asked for, more may follow, after its last row.
                let short = ahead.sent < ahead.limit;
                self.answered = short.then_some(cursor);
                self.ahead = None;
                if short {
                    break;
                }
                continue;
            };
            if !page.takes_another() {
                ahead.held = Some(row);
                break;
            }
            (ahead.after, cursor) = (row.seq, row.seq);
            let bytes = row.raw.payload.as_ref().map_or(0, String::len);
            page.keep(row, bytes);
        }
        Ok(self.paging.finish(page).rows)
    }

    /// Stops reading the open query's answer, if any. The connection reads
    /// the rest of it and drops it; every other statement on the start-up
    /// read's connection must wait for that, so call this before one.
    pub(super) fn close(&mut self) {
        self.ahead = None;
        self.answered = None;
    }

    /// Starts the query for the rows after `after`: as many as
    /// [`AHEAD_PAGES`] pages hold at the assumed payload, within
    /// [`AHEAD_BYTES`] (or the room, when larger).
    async fn query(
        &mut self,
        client: &Client,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Ahead, SourceError> {
        let want = self
            .paging
            .limit(max.saturating_mul(AHEAD_PAGES), max_bytes.max(AHEAD_BYTES));
        let limit = i64::try_from(want).unwrap_or(i64::MAX);
        let (rows, offset) = match &self.find {
            Find::Marked(statement) => {
                let params: [&(dyn ToSql + Sync); 2] = [&after, &limit];
                let rows = client
                    .query_raw(statement, params)
                    .await
                    .map_err(|e| DbError::query("reading unsent rows at start-up", e))?;
                (rows, 0)
            }
            Find::Ranges(r) => {
                let (base, base_max) = match &r.base {
                    Some((snapshot, max)) => (Some(snapshot.as_str()), *max),
                    None => (None, None),
                };
                let started = match &r.head {
                    None => client
                        .query_raw(
                            &r.first_page,
                            [&base as &(dyn ToSql + Sync), &base_max, &limit],
                        )
                        .await
                        .map(|rows| (rows, HEAD)),
                    Some(h) => client
                        .query_raw(
                            &r.next_page,
                            [
                                &after as &(dyn ToSql + Sync),
                                &h.cur,
                                &base,
                                &h.base_max,
                                &h.stragglers,
                                &limit,
                            ],
                        )
                        .await
                        .map(|rows| (rows, 0)),
                };
                started
                    .map_err(|e| DbError::query("reading unsent rows at start-up, by ranges", e))?
            }
        };
        Ok(Ahead {
            rows: Box::pin(rows),
            offset,
            after,
            limit: want,
            sent: 0,
            held: None,
        })
    }
}

/// Pages' worth of rows a start-up read query asks for at most.
const AHEAD_PAGES: usize = 8;

/// The payload bytes a start-up read query asks for at most, unless the
/// room of a page is larger: what the connection reads and drops when a
/// query is closed before its end.
const AHEAD_BYTES: usize = 8 << 20;

/// An open start-up read query: the rows it has still to send.
struct Ahead {
    rows: std::pin::Pin<Box<RowStream>>,
    /// Where the page's rows start ([`HEAD`] for a ranges round's first query).
    offset: usize,
    /// The last row taken (the query's cursor before the first).
    after: i64,
    /// Rows asked for, and rows sent so far (a row of NULLs included).
    limit: usize,
    sent: usize,
    /// A row past the last page's room: the next page's first.
    held: Option<TableRow>,
}

impl Ahead {
    /// The next row of the answer; `None` at its end. A ranges round's
    /// first query also tells the round's head ([`Head`]), on every row.
    async fn next(&mut self, find: &mut Find) -> Result<Option<TableRow>, SourceError> {
        loop {
            let row = self
                .rows
                .try_next()
                .await
                .map_err(|e| DbError::query("reading unsent rows at start-up", e))?;
            let Some(row) = row else {
                return Ok(None);
            };
            self.sent += 1;
            if self.offset == HEAD
                && let Find::Ranges(r) = find
                && r.head.is_none()
            {
                r.head = Some(Head {
                    cur: row.try_get(0).map_err(head_error)?,
                    cur_max: row.try_get(1).map_err(head_error)?,
                    base_max: row.try_get(2).map_err(head_error)?,
                    stragglers: row.try_get(3).map_err(head_error)?,
                });
            }
            if let Some(row) = table_row(&row, self.offset) {
                return Ok(Some(row));
            }
            // The row of NULLs an empty ranges first query returns.
        }
    }
}

fn head_error(e: tokio_postgres::Error) -> SourceError {
    DbError::query("reading the start-up read's snapshot", e).into()
}

/// A page's row from column `offset` on; `None` for the row of NULLs an
/// empty ranges first page returns.
fn table_row(row: &Row, offset: usize) -> Option<TableRow> {
    let (seq, raw) = read_row(row, offset)?;
    let xid: i64 = row.get(offset + XID_INDEX);
    Some(TableRow {
        seq,
        xid: u32::try_from(xid).unwrap_or_default(),
        raw,
    })
}
