//! Reading unsent rows when "sent" is recorded by ranges.
//!
//! Every read asks for the unsent rows visible in a snapshot *cur* that
//! were not visible in a *base*: the previous tick's snapshot (a steady
//! tick), or the frontier (a first read after a start or a rewind, and
//! `status`), in which case the rows the frontier holds open are read too.
//! Every unsent row could be found through the `relay_sent_at IS NULL`
//! index, but with ranges that index holds every row, sent or not, so the
//! rows visited are chosen by two branches, merged in `relay_seq` order:
//!
//! - **bulk**: rows above the highest `relay_seq` visible in the base, in
//!   order through that index;
//! - **stragglers**: rows at or below it whose transaction the base had not
//!   seen (a transaction that took a low `relay_seq` and committed late): a
//!   committed transaction is invisible in a snapshot exactly when its id is
//!   at or above the snapshot's `xmax` or in its `xip`, which the index on
//!   `relay_xid` finds. On a first read, the held-open rows join them.
//!
//! Both branches filter on the whole predicate ([`Ranges::unsent`]): the
//! split decides which rows are visited, never which count as unsent, and
//! it needs no exactness of the base's highest `relay_seq` either (a wrong
//! one only moves rows from one branch to the other).

use super::Ranges;
use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, XID_COLUMN};

/// The settings of a session that runs the reads. Planning a tick's first
/// page costs more than running it, and its plan is the same for any
/// parameters (each index condition is on a parameter or a subquery's
/// result): one generic plan. That plan must not be the table scan a young
/// table's statistics suggest, kept for the session's life: every read is
/// index-driven by design. The penalty that keeps table scans out makes
/// the plan look expensive enough to compile with JIT (350 ms a page),
/// which every relay session has off (`crate::db`).
pub const READER_SESSION: &str =
    "SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off";

/// The split point when the base has no rows: below every `relay_seq`.
const BELOW_ALL: &str = "(-9223372036854775808)::bigint";

/// A read's statements (see [`Ranges::read_sql`]).
#[derive(Debug, Clone)]
pub struct ReadSql {
    /// `$1` the base snapshot as text, or NULL for a first read (the
    /// frontier and the held-open rows), `$2` the base's highest
    /// `relay_seq` (ignored on a first read; NULL when the base had no
    /// rows), `$3` the page's size. Each row: *cur* as text, its highest
    /// `relay_seq`, the base's highest (resolved), the stragglers
    /// (`bigint[]`), then the page's columns; one row of NULLs after the
    /// first four when the page is empty. Only the first row carries *cur*
    /// and the stragglers (NULL in the others): a late transaction's
    /// stragglers can be many, and each row would carry them all.
    pub first_page: String,
    /// `$1` the cursor (last `relay_seq` read), `$2` *cur*, `$3` the base
    /// snapshot or NULL, `$4` the base's highest `relay_seq` (as the first
    /// page resolved it), `$5` and `$7` the stragglers after the cursor and
    /// the page's highest `relay_seq` ([`Stragglers::window`]), `$6` the
    /// page's size.
    pub next_page: String,
    /// A first read's size, `count(*)`, with no parameters (`status`). It
    /// visits every unsent row.
    pub backlog: String,
    /// A first read's first row, the page's columns (no row when nothing
    /// is unsent), with no parameters: it visits only the rows before it,
    /// past the recorded runs above the frontier (the oldest unsent age).
    pub oldest: String,
}

/// The parts of one page: what the placeholders are in this statement.
struct Page<'a> {
    cursor: &'a str,
    base_snapshot: &'a str,
    base_max: &'a str,
    stragglers: &'a str,
    /// A visibility condition for a page read after *cur* was taken.
    cur: Option<&'a str>,
    /// The page's highest `relay_seq`, for a page that probes a window of
    /// the stragglers.
    upper: Option<&'a str>,
    limit: Option<&'a str>,
    /// A `relay_seq` at or above the base's highest, up to which every
    /// row is sent, to start the bulk branch past: during a drain the fold
    /// waits for the drain to end, and the rows sent meanwhile would be
    /// visited one by one.
    past: Option<&'a str>,
}

impl Ranges {
    /// The statements of a read. `cols` is the select list (its first
    /// column `relay_seq`, the others unqualified); `shard` a condition on
    /// the outbox's columns, prefixed with ` AND `, or empty.
    pub fn read_sql(&self, cols: &str, shard: &str) -> ReadSql {
        let first = self.page(
            cols,
            shard,
            &Page {
                cursor: BELOW_ALL,
                base_snapshot: "$1::text",
                base_max: "(SELECT max_seq FROM base)",
                stragglers: "(SELECT seqs FROM strag)::bigint[]",
                cur: None,
                upper: None,
                limit: Some("$3"),
                past: None,
            },
        );
        // The rows come in the lateral page's order, which the window
        // function keeps and numbers as they come.
        let first_page = format!(
            "{base_and_stragglers}
             SELECT CASE WHEN row_number() OVER () = 1 THEN pg_current_snapshot()::text END,
                    (SELECT max({SEQ_COLUMN}) FROM {t}), (SELECT max_seq FROM base),
                    CASE WHEN row_number() OVER () = 1 THEN (SELECT seqs FROM strag) END, e.*
             FROM (SELECT 1) one LEFT JOIN LATERAL ({first}) e ON true",
            base_and_stragglers = self.base_and_stragglers(shard, "$1::text", "$2::bigint"),
            t = self.outbox.quoted(),
        );
        let next_page = self.page(
            cols,
            shard,
            &Page {
                cursor: "$1",
                base_snapshot: "$3::text",
                base_max: "$4::bigint",
                stragglers: "$5::bigint[]",
                cur: Some("$2::text::pg_snapshot"),
                upper: Some("$7::bigint"),
                limit: Some("$6"),
                past: None,
            },
        );
        // Every unsent row of a first read, in one statement.
        let all_rows = Page {
            cursor: BELOW_ALL,
            base_snapshot: "NULL::text",
            base_max: "(SELECT max_seq FROM base)",
            stragglers: "(SELECT seqs FROM strag)::bigint[]",
            cur: None,
            upper: None,
            limit: None,
            past: Some("(SELECT seq FROM past)"),
        };
        let first_row = self.page(
            cols,
            "",
            &Page {
                limit: Some("1"),
                ..all_rows
            },
        );
        let bases = format!(
            "{}, {}",
            self.base_and_stragglers("", "NULL::text", "NULL::bigint"),
            self.past_recorded_runs()
        );
        ReadSql {
            first_page,
            next_page,
            backlog: format!(
                "{bases} SELECT count(*) FROM ({}) backlog",
                self.page(SEQ_COLUMN, "", &all_rows)
            ),
            oldest: format!("{bases} {first_row}"),
        }
    }

    /// The CTEs `base` (snapshot and highest `relay_seq`) and `strag` (the
    /// stragglers, as a sorted array) for a base given as a snapshot's text
    /// (NULL: the frontier) and its highest `relay_seq`.
    fn base_and_stragglers(&self, shard: &str, snapshot: &str, max: &str) -> String {
        let (t, f, h) = (
            self.outbox.quoted(),
            self.frontier.quoted(),
            self.held.quoted(),
        );
        format!(
            "WITH base AS MATERIALIZED (
                 SELECT CASE WHEN {snapshot} IS NULL THEN ({frontier}) ELSE {snapshot}::pg_snapshot END AS snap,
                        COALESCE(CASE WHEN {snapshot} IS NULL
                                      THEN (SELECT max_seq FROM {f} ORDER BY id DESC LIMIT 1)
                                      ELSE {max} END, {BELOW_ALL}) AS max_seq
             ),
             -- The transactions running at the base, on their own: next to
             -- a condition on relay_seq, the planner would read that index.
             running AS MATERIALIZED (
                 SELECT o.{SEQ_COLUMN} AS seq FROM {t} o
                 WHERE o.{XID_COLUMN} = ANY ((SELECT ARRAY(SELECT pg_snapshot_xip(snap)) FROM base)::xid8[]){shard}
             ),
             -- The later transactions bounded on both sides: a range of
             -- unknown bounds is estimated narrow, so the planner goes
             -- through the index on relay_xid rather than relay_seq's.
             strag AS MATERIALIZED (
                 SELECT COALESCE(array_agg(s.seq ORDER BY s.seq), '{{}}'::bigint[]) AS seqs FROM (
                     SELECT o.{SEQ_COLUMN} AS seq FROM {t} o
                     WHERE o.{XID_COLUMN} >= (SELECT pg_snapshot_xmax(snap) FROM base)
                       AND o.{XID_COLUMN} < pg_snapshot_xmax(pg_current_snapshot())
                       AND o.{SEQ_COLUMN} <= (SELECT max_seq FROM base){shard}
                     UNION
                     SELECT seq FROM running WHERE seq <= (SELECT max_seq FROM base)
                     UNION
                     SELECT h.{SEQ_COLUMN} FROM {h} h WHERE {snapshot} IS NULL
                 ) s
             )",
            frontier = self.frontier_snapshot(),
        )
    }

    /// The CTE `past` (after `base`): its `seq` is the end of the recorded
    /// runs that follow the base's highest `relay_seq` with no unsent-index
    /// row between them, NULL when the first row above is not recorded.
    /// Every row of a run is recorded, so sent. The runs from the one that
    /// holds the first row above the base are taken in order, and the walk
    /// ends at the first whose gap to the next holds a row: one index
    /// probe per run, whatever the number of gaps.
    fn past_recorded_runs(&self) -> String {
        let t = self.outbox.quoted();
        format!(
            "past AS MATERIALIZED (
                 WITH first AS MATERIALIZED (
                     SELECT min(f.{SEQ_COLUMN}) AS s FROM {t} f
                     WHERE f.{SENT_AT_COLUMN} IS NULL AND f.{SEQ_COLUMN} > (SELECT max_seq FROM base)
                 ),
                 runs AS MATERIALIZED (
                     SELECT r, lead(lower(r)) OVER (ORDER BY lower(r)) AS next
                     FROM unnest(({recorded})) r WHERE upper(r) > (SELECT s FROM first)
                 )
                 SELECT upper(r) - 1 AS seq FROM runs
                 WHERE (SELECT min(lower(r)) FROM runs) <= (SELECT s FROM first)
                   AND (next IS NULL
                        OR EXISTS (SELECT 1 FROM {t} g
                                   WHERE g.{SENT_AT_COLUMN} IS NULL
                                     AND g.{SEQ_COLUMN} >= upper(r) AND g.{SEQ_COLUMN} < next))
                 ORDER BY lower(r) LIMIT 1
             )",
            recorded = self.recorded(),
        )
    }

    fn page(&self, cols: &str, shard: &str, p: &Page) -> String {
        let t = self.outbox.quoted();
        let limit = p.limit.map(|l| format!(" LIMIT {l}")).unwrap_or_default();
        let cur = p
            .cur
            .map(|c| format!(" AND pg_visible_in_snapshot(o.{XID_COLUMN}, {c})"))
            .unwrap_or_default();
        let rest = format!(
            "AND ({base} IS NULL OR NOT pg_visible_in_snapshot(o.{XID_COLUMN}, {base}::pg_snapshot)){cur}{shard}",
            base = p.base_snapshot,
        );
        let bulk_lower = match p.past {
            Some(past) => format!("GREATEST({}, {}, {past})", p.cursor, p.base_max),
            None => format!("GREATEST({}, {})", p.cursor, p.base_max),
        };
        let bulk = format!("{} {rest}", self.unsent_above("o", &bulk_lower));
        // A window of stragglers (a next page) takes the union of the
        // ranges within it; the first page, which has them all but
        // commonly few, probes the progress rows for each.
        let recorded = match p.upper {
            Some(upper) => {
                let within = format!("LEAST({}, {upper})", p.base_max);
                self.unsent_within("o", p.cursor, &within)
            }
            None => self.unsent_probed("o"),
        };
        let stragglers = format!("{recorded} {rest}");
        // An index condition, so that a page below the bulk ends at once.
        let upper = p
            .upper
            .map(|u| format!(" AND o.{SEQ_COLUMN} <= {u}"))
            .unwrap_or_default();
        format!(
            "SELECT * FROM (
                 (SELECT {cols} FROM {t} o
                  WHERE o.{SENT_AT_COLUMN} IS NULL AND o.{SEQ_COLUMN} > {bulk_lower}{upper}
                    AND {bulk}
                  ORDER BY o.{SEQ_COLUMN}{limit})
                 UNION ALL
                 (SELECT {cols} FROM {t} o
                  WHERE o.{SEQ_COLUMN} = ANY ({stragglers_of})
                    AND o.{SEQ_COLUMN} > {cursor} AND o.{SEQ_COLUMN} <= {base_max}{upper}
                    AND {stragglers}
                  ORDER BY o.{SEQ_COLUMN}{limit})
             ) page ORDER BY {SEQ_COLUMN}{limit}",
            cursor = p.cursor,
            base_max = p.base_max,
            stragglers_of = p.stragglers,
        )
    }
}

/// A round's stragglers (its first page's), for the next pages. Each next
/// page is sent only the stragglers it may return: those after its cursor,
/// at most a page of them. Sent every one, a late transaction of n rows
/// would cost its n / page pages n probes each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stragglers(Vec<i64>);

impl Stragglers {
    pub fn new(mut seqs: Vec<i64>) -> Self {
        seqs.sort_unstable();
        seqs.dedup();
        Stragglers(seqs)
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// A next page's `$5` and `$7` after `cursor` for a page of `limit`
    /// rows: the stragglers after the cursor, at most `limit`, and the
    /// page's highest `relay_seq`. That is the last of them when more
    /// follow, so that the page reads no row past a straggler it was not
    /// sent; else unbounded. Every unsent row up to the bound is in reach,
    /// so a page that returns fewer than `limit` rows read all of them:
    /// [`Window::truncated`] says whether rows may still follow.
    pub fn window(&self, cursor: i64, limit: usize) -> Window<'_> {
        let after = &self.0[self.0.partition_point(|&s| s <= cursor)..];
        let sent = &after[..after.len().min(limit.max(1))];
        let truncated = sent.len() < after.len();
        Window {
            stragglers: sent,
            upper: match sent.last() {
                Some(&last) if truncated => last,
                _ => i64::MAX,
            },
            truncated,
        }
    }
}

/// What [`Stragglers::window`] gives a next page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window<'a> {
    pub stragglers: &'a [i64],
    pub upper: i64,
    /// Stragglers follow `upper`: a page that was not full does not end
    /// the round; the next starts after its last row, or after `upper`
    /// when it returned none.
    pub truncated: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_window_holds_at_most_a_page_of_the_stragglers_after_the_cursor() {
        let s = Stragglers::new(vec![9, 3, 5, 7, 3, 11]);
        assert_eq!(s.len(), 5);
        let w = s.window(3, 2);
        assert_eq!((w.stragglers, w.upper, w.truncated), (&[5, 7][..], 7, true));
        // The last ones: unbounded, nothing follows.
        let w = s.window(7, 2);
        assert_eq!(
            (w.stragglers, w.upper, w.truncated),
            (&[9, 11][..], i64::MAX, false)
        );
        let w = s.window(11, 2);
        assert_eq!(
            (w.stragglers, w.upper, w.truncated),
            (&[][..], i64::MAX, false)
        );
        let w = s.window(i64::MIN, 10);
        assert_eq!((w.stragglers.len(), w.truncated), (5, false));
    }
}
