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
use crate::outbox::progress::{Ranges, read};
use crate::source::SourceError;
use crate::source::rows::{
    ROW_WIDTH, Started, byte_capped, each_row_of, read_row, select_list, start_rows,
};
use std::sync::Arc;
use tokio::task::JoinHandle;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Row, Statement};

/// The columns a ranges round's first page puts before the rows: *cur*,
/// its highest `relay_seq`, the base's, the stragglers.
const HEAD: usize = 4;

/// Column of the 32-bit xid within a page's row, after `relay_seq` and the row.
const XID_INDEX: usize = 1 + ROW_WIDTH;

/// How the start-up read finds unsent rows, and the next page, asked for
/// ahead.
///
/// A page's rows reach the relay as the server reads them, but the next
/// page's query would wait until the relay had decoded this one and handed
/// it over: the server idle while the relay works, and the relay's reader
/// idle while the server reads. So once a page has arrived, the next one is
/// asked for at once, from its last `relay_seq`, at the same size and a
/// quarter of its byte room, and taken when the read goes on from there
/// (otherwise dropped; the server finishes it and the connection discards
/// its rows). The budget's room shrinks meanwhile, so a read may go past it
/// by that quarter. The page's error, if any, is the next read's. Nothing
/// else may use the connection while the page is out (its rows stand
/// before the other statement's answer): [`Self::stop_ahead`] drops it
/// first. It may wait unread while the broker is slow: the read's
/// transaction allows for that (`PgServer`).
pub(super) struct StartupRows {
    how: How,
    ahead: Option<Ahead>,
}

enum How {
    /// `relay_sent_at IS NULL` (`$1` the cursor, `$2` the page's size,
    /// `$3` its bytes).
    Marked(Statement),
    Ranges(RangesRead),
}

/// The next page's query, sent by a task of its own: waiting here for the
/// server to take it would wait for the page's first rows, and a byte-capped
/// page has none until the server has read all of it. Aborted when dropped
/// (a query not sent yet never is; the rows of one sent are discarded).
struct Ahead {
    after: i64,
    limit: i64,
    task: JoinHandle<Result<Started, tokio_postgres::Error>>,
}

impl Drop for Ahead {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A page's statement and its parameters, owned so that a task can send it.
struct Query {
    statement: Statement,
    params: Vec<Box<dyn ToSql + Send + Sync>>,
    /// A ranges round's first page: its rows start with the round's [`Head`].
    first: bool,
}

impl Query {
    async fn send(&self, client: &Client) -> Result<Started, tokio_postgres::Error> {
        let params: Vec<&(dyn ToSql + Sync)> = self
            .params
            .iter()
            .map(|p| p.as_ref() as &(dyn ToSql + Sync))
            .collect();
        start_rows(client, &self.statement, &params).await
    }
}

/// What share of a page's byte room the page asked ahead takes: the room
/// shrinks while the page before it is published.
const AHEAD_SHARE: i64 = 4;
/// The ranges statements, and what a round's pages share.
pub(super) struct RangesRead {
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
        let capped = |page: String, bytes: &str| byte_capped(&page, &columns.payload, bytes);
        let prepare = |sql: String| async move {
            client.prepare(&sql).await.map_err(|e| {
                match Some(Ranges::new(table)).filter(|_| ranges) {
                    Some(r) => r.missing_table_problem(&e).map(SourceError::Setup),
                    None => None,
                }
                .unwrap_or_else(|| DbError::query("preparing the start-up read", e).into())
            })
        };
        if !ranges {
            let sql = capped(
                format!(
                    "SELECT {cols} FROM {} WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} > $1 ORDER BY {SEQ_COLUMN} LIMIT $2",
                    table.quoted()
                ),
                "$3",
            );
            let how = How::Marked(prepare(sql).await?);
            return Ok(StartupRows { how, ahead: None });
        }
        let sql = Ranges::new(table).read_sql_wrapped(&cols, "", &capped);
        let how = How::Ranges(RangesRead {
            first_page: prepare(sql.first_page).await?,
            next_page: prepare(sql.next_page).await?,
            base: None,
            head: None,
        });
        Ok(StartupRows { how, ahead: None })
    }

    /// What the start-up read's transaction sets after its BEGIN: with
    /// ranges, the reading session's planner settings
    /// ([`read::READER_SESSION`]), for this transaction only.
    pub(super) fn transaction_settings(&self) -> String {
        match self.how {
            How::Marked(_) => String::new(),
            How::Ranges(_) => read::READER_SESSION.replace("SET ", "SET LOCAL "),
        }
    }

    /// A new start: its first round reads from the frontier.
    pub(super) fn restart(&mut self) {
        self.stop_ahead();
        if let How::Ranges(r) = &mut self.how {
            (r.base, r.head) = (None, None);
        }
    }

    /// A new round: the one that ended is its base.
    pub(super) fn next_round(&mut self) {
        self.stop_ahead();
        if let How::Ranges(r) = &mut self.how
            && let Some(head) = r.head.take()
        {
            r.base = Some((head.cur, head.cur_max));
        }
    }

    /// Drops the page asked ahead, before the connection serves anything
    /// else (a statement, the end of the read).
    pub(super) fn stop_ahead(&mut self) {
        self.ahead = None;
    }

    /// Up to `max` unsent rows of the round's snapshot after `after`,
    /// whose payloads take no more than `max_bytes` (one row at least).
    pub(super) async fn page(
        &mut self,
        client: &Arc<Client>,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<TableRow>, SourceError> {
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let bytes = i64::try_from(max_bytes).unwrap_or(i64::MAX);
        // Asked for with no more rows than this page may have.
        let ahead = self
            .ahead
            .take()
            .filter(|a| a.after == after && a.limit <= limit);
        let (rows, first) = match ahead {
            // Its error is this page's; a task that did not finish (it
            // cannot panic) asks again.
            Some(mut a) => match (&mut a.task).await {
                Ok(sent) => (sent.map_err(|e| self.read_error(e))?, false),
                Err(_) => self.send(client, after, limit, bytes).await?,
            },
            None => self.send(client, after, limit, bytes).await?,
        };
        let rows = self.collect(rows, first).await?;
        if let Some(last) = rows.last()
            && self.next_known()
        {
            let query = self.query(last.seq, limit, (bytes / AHEAD_SHARE).max(1));
            let client = Arc::clone(client);
            self.ahead = Some(Ahead {
                after: last.seq,
                limit,
                task: tokio::spawn(async move { query.send(&client).await }),
            });
        }
        Ok(rows)
    }

    /// Whether the page after this one can be asked for already: with
    /// ranges, once the round's first page resolved its snapshot.
    fn next_known(&self) -> bool {
        match &self.how {
            How::Marked(_) => true,
            How::Ranges(r) => r.head.is_some(),
        }
    }

    /// Sends the query of the page after `after`; true when it is a ranges
    /// round's first page.
    async fn send(
        &self,
        client: &Client,
        after: i64,
        limit: i64,
        bytes: i64,
    ) -> Result<(Started, bool), SourceError> {
        let query = self.query(after, limit, bytes);
        let rows = query.send(client).await.map_err(|e| self.read_error(e))?;
        Ok((rows, query.first))
    }

    /// The query of the page after `after`.
    fn query(&self, after: i64, limit: i64, bytes: i64) -> Query {
        let r = match &self.how {
            How::Marked(statement) => {
                return Query {
                    statement: statement.clone(),
                    params: vec![Box::new(after), Box::new(limit), Box::new(bytes)],
                    first: false,
                };
            }
            How::Ranges(r) => r,
        };
        let (base, base_max) = match &r.base {
            Some((snapshot, max)) => (Some(snapshot.clone()), *max),
            None => (None, None),
        };
        match &r.head {
            None => Query {
                statement: r.first_page.clone(),
                params: vec![
                    Box::new(base),
                    Box::new(base_max),
                    Box::new(limit),
                    Box::new(bytes),
                ],
                first: true,
            },
            Some(h) => Query {
                statement: r.next_page.clone(),
                params: vec![
                    Box::new(after),
                    Box::new(h.cur.clone()),
                    Box::new(base),
                    Box::new(h.base_max),
                    Box::new(h.stragglers.clone()),
                    Box::new(limit),
                    Box::new(bytes),
                ],
                first: false,
            },
        }
    }

    fn read_error(&self, e: tokio_postgres::Error) -> SourceError {
        match self.how {
            How::Marked(_) => DbError::query("reading unsent rows at start-up", e),
            How::Ranges(_) => DbError::query("reading unsent rows at start-up, by ranges", e),
        }
        .into()
    }

    /// A page's rows; a ranges round's `first` page also resolves its head.
    async fn collect(&mut self, rows: Started, first: bool) -> Result<Vec<TableRow>, SourceError> {
        let offset = if first { HEAD } else { 0 };
        let mut head = None;
        let rows = each_row_of(rows, |row| {
            if first && head.is_none() {
                head = Some(Head {
                    cur: row.get(0),
                    cur_max: row.get(1),
                    base_max: row.get(2),
                    stragglers: row.get(3),
                });
            }
            table_row(row, offset)
        })
        .await
        .map_err(|e| self.read_error(e))?;
        if let (Some(head), How::Ranges(r)) = (head, &mut self.how) {
            r.head = Some(head);
        }
        Ok(rows)
    }
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
