//! Retention of rows recorded by ranges: which outbox rows count as sent
//! before a cut-off, and may go.
//!
//! The fold keeps one frontier row a minute as history. Let *H* be the
//! newest one folded at or before the cut-off. When the fold wrote *H*,
//! every row visible in its snapshot was recorded, marked, or held open
//! (the fold's invariant), and a held row leaves the held table only once
//! it is recorded or marked. So a row visible in *H* that is not held open
//! now was sent, and by *H*'s time unless it was held open then: a row the
//! frontier passed before its confirmation (a late commit, or one waiting
//! behind a dead letter) counts as sent from the first frontier that
//! passed it, so it may go earlier than `retention.sent_window` after its
//! own confirmation. No unsent row is ever eligible.
//!
//! Rows are visited through the index on `relay_xid`, oldest transaction
//! first, from where the previous batch ended: every row below *H*'s
//! `xmax` is a candidate, and deleted rows' index entries are not walked
//! again within a run.

use super::Ranges;
use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, XID_COLUMN};

impl Ranges {
    /// *H* for the cut-off `$1`: the newest frontier row folded at or
    /// before it (no row: nothing is eligible). None either while the
    /// frontier runs past this server's transaction ids: it was recorded
    /// on another server (see `foreign_frontier_problem`), and rows written
    /// here would look sent in it. The relay refuses to start then, and
    /// retention, which runs beside it or from cron, deletes nothing.
    fn retained_frontier(&self) -> String {
        format!(
            "SELECT id, snapshot FROM {f} WHERE folded_at <= $1
               AND COALESCE((SELECT pg_snapshot_xmax(n.snapshot) <= pg_snapshot_xmax(pg_current_snapshot())
                             FROM {f} n ORDER BY n.id DESC LIMIT 1), false)
             ORDER BY id DESC LIMIT 1",
            f = self.frontier.quoted()
        )
    }

    /// Row `alias` is sent as of *H* (`h.snapshot`): visible in it, not
    /// held open now. Rows another mode marked go by their mark instead
    /// (retention's other target), so they are not counted twice.
    fn sent_by(&self, alias: &str) -> String {
        format!(
            "{alias}.{SENT_AT_COLUMN} IS NULL
             AND {alias}.{XID_COLUMN} < pg_snapshot_xmax(h.snapshot)
             AND pg_visible_in_snapshot({alias}.{XID_COLUMN}, h.snapshot)
             AND NOT EXISTS (SELECT 1 FROM {held} x WHERE x.{SEQ_COLUMN} = {alias}.{SEQ_COLUMN})",
            held = self.held.quoted()
        )
    }

    /// Deletes one batch of rows of `table` (the outbox, or its default
    /// partition) sent before the cut-off `$1`: at most `$2` rows whose
    /// `relay_xid` is at least `$3` (text; `'0'` for the first batch), the
    /// oldest transactions first, skipping rows another session has
    /// locked. One row: the number deleted and the highest `relay_xid`
    /// of the batch picked (text; NULL when none), where the next batch
    /// starts.
    ///
    /// On a partitioned outbox a `ctid` names a row only within its
    /// partition, so the DELETE may also take rows of other partitions at
    /// the same `ctid` (each eligible too: the condition is repeated).
    /// The next batch therefore starts after the rows picked, not after
    /// the rows deleted: those may reach further and pass rows not yet
    /// visited.
    pub fn retention_delete_sql(&self, table: &crate::config::TableName) -> String {
        let t = table.quoted();
        format!(
            "WITH h AS MATERIALIZED ({h}),
             p AS MATERIALIZED (
                 SELECT c.ctid, c.{XID_COLUMN} FROM {t} c, h
                 WHERE c.{XID_COLUMN} >= $3::text::xid8 AND {sent_c}
                 ORDER BY c.{XID_COLUMN} LIMIT $2 FOR UPDATE OF c SKIP LOCKED),
             d AS (
                 DELETE FROM {t} o USING h
                 WHERE o.ctid = ANY(ARRAY(SELECT ctid FROM p)) AND {sent_o}
                 RETURNING 1)
             SELECT (SELECT count(*) FROM d),
                    (SELECT {XID_COLUMN} FROM p ORDER BY {XID_COLUMN} DESC LIMIT 1)::text",
            h = self.retained_frontier(),
            sent_c = self.sent_by("c"),
            sent_o = self.sent_by("o"),
        )
    }

    /// How many rows of `table` [`Ranges::retention_delete_sql`] would
    /// delete for the cut-off `$1`, in all.
    pub fn retention_count_sql(&self, table: &crate::config::TableName) -> String {
        format!(
            "WITH h AS MATERIALIZED ({h})
             SELECT count(*) FROM {t} c, h WHERE {sent_c}",
            h = self.retained_frontier(),
            t = table.quoted(),
            sent_c = self.sent_by("c"),
        )
    }

    /// Deletes the frontier rows older than *H* for the cut-off `$1`: no
    /// later run needs them (cut-offs only move forward), and readers use
    /// the newest row only.
    pub fn prune_frontier_sql(&self) -> String {
        format!(
            "DELETE FROM {f} WHERE id < (SELECT id FROM ({h}) h)",
            f = self.frontier.quoted(),
            h = self.retained_frontier(),
        )
    }

    /// Why the expired `partition` must stay, given the cut-off `$1`: two
    /// booleans, whether it holds an unsent row, and whether it holds a row
    /// not sent before the cut-off (by *H*, or marked before it); then the
    /// statement's snapshot's xmin (text). With `since`, only rows whose
    /// `relay_xid` is at least `$2` (text: such an xmin) are looked at,
    /// through the `relay_xid` index: the rows a look with that snapshot
    /// could not see. Once every row it saw was sent, none becomes unsent,
    /// so the look again under the outbox's lock reads those rows alone,
    /// and writers wait for that look, not for a scan of the partition.
    pub fn partition_keep_sql(&self, partition: &crate::config::TableName, since: bool) -> String {
        let p = partition.quoted();
        let after = |alias: &str| {
            if since {
                format!(" AND {alias}.{XID_COLUMN} >= $2::text::xid8")
            } else {
                String::new()
            }
        };
        format!(
            "WITH h AS MATERIALIZED ({h})
             SELECT EXISTS (SELECT 1 FROM {p} o WHERE {unsent}{after_o}),
                    EXISTS (SELECT 1 FROM {p} c
                            WHERE NOT ((c.{SENT_AT_COLUMN} IS NOT NULL AND c.{SENT_AT_COLUMN} < $1)
                                       OR COALESCE((SELECT {sent_c} FROM h), false)){after_c}),
                    pg_snapshot_xmin(pg_current_snapshot())::text",
            h = self.retained_frontier(),
            unsent = self.unsent("o"),
            sent_c = self.sent_by("c"),
            after_o = after("o"),
            after_c = after("c"),
        )
    }
}
