//! Leaving ranges for another marking mode.
//!
//! Another mode knows only `relay_sent_at`: started on an outbox whose sent
//! rows are recorded by ranges, it would publish every retained row again.
//! So `run` refuses `update` and `delete` while the progress or frontier
//! table holds anything ([`Ranges::leftover_problem`]), and `outbox-relay
//! fold --into-sent-at` writes what ranges recorded into `relay_sent_at`,
//! batch by batch in `relay_seq` order, then drops the three tables (with
//! `relay.mark` unset, the outbox then chooses `update`). A run cut short
//! is resumed by running it again: rows already marked are skipped, and
//! the tables are dropped only at the end.

use super::Ranges;
use crate::config::{MarkMode, SENT_AT_COLUMN, SEQ_COLUMN};
use crate::sql::quote_literal;
use tokio_postgres::GenericClient;

impl Ranges {
    /// Why a relay with `mark` must not start on this outbox, if it must
    /// not: ranges recorded sent rows that `relay_sent_at` does not show.
    pub async fn leftover_problem(
        &self,
        client: &impl GenericClient,
        mark: MarkMode,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        if !matches!(mark, MarkMode::Update | MarkMode::Delete) {
            return Ok(None);
        }
        if let Some(missing) = self.unreadable(client).await? {
            return Ok(Some(format!(
                "{} exists but the relay's role may not read it, so it cannot tell whether \
                 relay.mark = \"ranges\" recorded rows that relay.mark = \"update\" or \"delete\" would \
                 publish again: GRANT SELECT ON {}, {} TO the relay's role (or, if ranges never ran, \
                 drop the tables {}, {} and {})",
                missing, self.progress, self.frontier, self.progress, self.frontier, self.held
            )));
        }
        if !self.has_state(client).await? {
            return Ok(None);
        }
        Ok(Some(format!(
            "{} and {} record rows sent while relay.mark was \"ranges\", which relay.mark = \"{}\" \
             cannot see: it would publish them again. Stop every instance and run \
             `outbox-relay fold --into-sent-at`, or set relay.mark = \"ranges\"",
            self.progress,
            self.frontier,
            if mark == MarkMode::Delete {
                "delete"
            } else {
                "update"
            }
        )))
    }

    /// Why new rows could count as sent before they are published, if
    /// they could: the frontier was recorded on another server, or the
    /// sequence of `relay_seq` was set back (see below).
    pub async fn new_rows_problem(
        &self,
        client: &impl GenericClient,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        match self.foreign_frontier_problem(client).await? {
            Some(problem) => Ok(Some(problem)),
            None => self.sequence_problem(client).await,
        }
    }

    /// The highest `relay_seq` recorded as sent: the frontier's `max_seq`
    /// or a progress row's (NULL when neither records any).
    fn highest_recorded_sql(&self) -> String {
        format!(
            "SELECT GREATEST((SELECT max_seq FROM {} ORDER BY id DESC LIMIT 1),
                             (SELECT max(upper(seqs)) - 1 FROM {}))",
            self.frontier.quoted(),
            self.progress.quoted()
        )
    }

    /// The frontier's snapshot runs past this server's transaction ids:
    /// it was recorded on another server whose ids ran higher (a dump
    /// restored, a logical copy), and rows written here, with lower ids,
    /// would be visible in it, so counted as sent. On the server that
    /// recorded it, a snapshot taken earlier never runs past a later one.
    async fn foreign_frontier_problem(
        &self,
        client: &impl GenericClient,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        let ahead = client
            .query_opt(
                &format!(
                    "SELECT pg_snapshot_xmax(f.snapshot)::text, pg_snapshot_xmax(pg_current_snapshot())::text,
                            ({})
                     FROM ({}) f(snapshot)
                     WHERE pg_snapshot_xmax(f.snapshot) > pg_snapshot_xmax(pg_current_snapshot())",
                    self.highest_recorded_sql(),
                    self.frontier_snapshot(),
                ),
                &[],
            )
            .await?;
        let Some(row) = ahead else {
            return Ok(None);
        };
        let (recorded, here, seq): (String, String, Option<i64>) =
            (row.get(0), row.get(1), row.get(2));
        Ok(Some(format!(
            "{} was recorded on another server (a dump restored, a logical copy): its snapshot runs \
             to transaction {recorded}, past this server's {here}, so rows written here would count as \
             sent and never be published. Stop every instance, run `outbox-relay fold --into-sent-at` \
             (it marks the rows the frontier records as sent, and drops the tables), then \
             `UPDATE {} SET {SENT_AT_COLUMN} = NULL WHERE {SEQ_COLUMN} > {}` (the rows written since the \
             copy, which it marks too), run `outbox-relay migrate` and start",
            self.frontier,
            self.outbox,
            seq.unwrap_or_default()
        )))
    }

    /// The sequence of `relay_seq` was set back (a restore, a `RESTART`)
    /// below the highest `relay_seq` recorded, so it would hand out values
    /// a progress row or the frontier's `max_seq` already names. `None`
    /// also when the sequence cannot be read (no SELECT on it, or a
    /// default that is not the column's own sequence).
    async fn sequence_problem(
        &self,
        client: &impl GenericClient,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        let row = client
            .query_one(
                &format!(
                    "WITH q AS (SELECT pg_get_serial_sequence($1, $2) AS name)
                     SELECT q.name, has_sequence_privilege(q.name, 'SELECT'), ({})
                     FROM q",
                    self.highest_recorded_sql()
                ),
                &[&self.outbox.quoted(), &SEQ_COLUMN],
            )
            .await?;
        let (name, readable, recorded): (Option<String>, Option<bool>, Option<i64>) =
            (row.get(0), row.get(1), row.get(2));
        let (Some(name), Some(true), Some(recorded)) = (name, readable, recorded) else {
            return Ok(None);
        };
        // The value handed out last, or before the next after a RESTART
        // (its last_value is then the next one, not yet handed out).
        let last: i64 = client
            .query_one(
                &format!(
                    "SELECT CASE WHEN is_called THEN last_value ELSE last_value - 1 END FROM {name}"
                ),
                &[],
            )
            .await?
            .get(0);
        Ok((last < recorded).then(|| {
            format!(
                "the sequence {name} of {SEQ_COLUMN} stands at {last}, below {recorded}, the highest {SEQ_COLUMN} \
                 recorded as sent: new rows would count as sent and never be published. \
                 Move it past: SELECT setval({}, {recorded})",
                crate::sql::quote_literal(&name)
            )
        }))
    }

    /// The first of the progress and frontier tables that exists and that
    /// this session may not read, if any.
    async fn unreadable(
        &self,
        client: &impl GenericClient,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        for table in [&self.progress, &self.frontier] {
            let readable: Option<bool> = client
                .query_one(
                    "SELECT CASE WHEN to_regclass($1) IS NULL THEN NULL
                                 ELSE has_table_privilege(to_regclass($1), 'SELECT') END",
                    &[&table.quoted()],
                )
                .await?
                .get(0);
            if readable == Some(false) {
                return Ok(Some(table.to_string()));
            }
        }
        Ok(None)
    }

    /// Whether the progress table exists: with `relay.mark` unset, the
    /// outbox then runs ranges ([`crate::ops::marking`]).
    pub async fn exists(&self, client: &impl GenericClient) -> Result<bool, tokio_postgres::Error> {
        let row = client
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[&self.progress.quoted()],
            )
            .await?;
        Ok(row.get(0))
    }

    /// Whether the progress or the frontier table holds a row (false when
    /// they do not exist).
    pub async fn has_state(
        &self,
        client: &impl GenericClient,
    ) -> Result<bool, tokio_postgres::Error> {
        let exists: bool = client
            .query_one(
                &format!(
                    "SELECT to_regclass({}) IS NOT NULL AND to_regclass({}) IS NOT NULL",
                    quote_literal(&self.progress.quoted()),
                    quote_literal(&self.frontier.quoted())
                ),
                &[],
            )
            .await?
            .get(0);
        if !exists {
            return Ok(false);
        }
        let sql = format!(
            "SELECT EXISTS (SELECT 1 FROM {}) OR EXISTS (SELECT 1 FROM {})",
            self.progress.quoted(),
            self.frontier.quoted()
        );
        Ok(client.query_one(&sql, &[]).await?.get(0))
    }

    /// Sets `relay_sent_at` on the next rows the predicate calls sent: `$1`
    /// the cursor (the highest `relay_seq` visited so far), `$2` the page's
    /// size. One row: the highest `relay_seq` of the page (NULL: no row
    /// left) and the rows marked.
    pub fn into_sent_at_sql(&self) -> String {
        let t = self.outbox.quoted();
        format!(
            "WITH page AS MATERIALIZED (
                 SELECT o.{SEQ_COLUMN} AS seq, NOT ({unsent}) AS sent FROM {t} o
                 WHERE o.{SENT_AT_COLUMN} IS NULL AND o.{SEQ_COLUMN} > $1
                 ORDER BY o.{SEQ_COLUMN} LIMIT $2),
             marked AS (
                 UPDATE {t} u SET {SENT_AT_COLUMN} = now() FROM page
                 WHERE page.sent AND u.{SEQ_COLUMN} = page.seq AND u.{SENT_AT_COLUMN} IS NULL
                 RETURNING 1)
             SELECT (SELECT max(seq) FROM page), (SELECT count(*) FROM marked)",
            unsent = self.unsent("o"),
        )
    }

    /// Drops the predicate's function and the three tables, in one
    /// transaction, once every row they call sent is marked: an outbox
    /// without them runs `update` when `relay.mark` is unset. The index on
    /// `relay_xid` goes with [`Ranges::drop_index_sql`].
    pub fn drop_sql(&self) -> String {
        format!(
            "BEGIN; {}; DROP TABLE IF EXISTS {}, {}, {}; COMMIT",
            self.drop_function_sql(),
            self.progress.quoted(),
            self.frontier.quoted(),
            self.held.quoted()
        )
    }

    /// Drops the predicate's function, if it is there.
    pub fn drop_function_sql(&self) -> String {
        format!(
            "DROP FUNCTION IF EXISTS {}(bigint, xid8, timestamptz)",
            self.sent_function.quoted()
        )
    }

    /// Why this session cannot drop the tables, the function and the index
    /// of ranges, if it cannot: only their owner (and the outbox's, for the
    /// index) may, as for `migrate`. Asked before any row is marked.
    pub async fn drop_problem(
        &self,
        client: &impl GenericClient,
    ) -> Result<Option<String>, tokio_postgres::Error> {
        let not_owned: Vec<String> = client
            .query(
                "SELECT c.relname::text FROM pg_class c
                 WHERE c.oid IN (to_regclass($1), to_regclass($2), to_regclass($3), to_regclass($4))
                   AND NOT pg_has_role(current_user, c.relowner, 'USAGE')
                 UNION ALL
                 SELECT p.proname::text FROM pg_proc p
                 WHERE p.oid = to_regprocedure($5)
                   AND NOT pg_has_role(current_user, p.proowner, 'USAGE')
                 ORDER BY 1",
                &[
                    &self.outbox.quoted(),
                    &self.progress.quoted(),
                    &self.frontier.quoted(),
                    &self.held.quoted(),
                    &format!("{}(bigint, xid8, timestamptz)", self.sent_function.quoted()),
                ],
            )
            .await?
            .iter()
            .map(|r| r.get(0))
            .collect();
        Ok((!not_owned.is_empty()).then(|| {
            format!(
                "this role does not own {}: fold --into-sent-at drops the tables of ranges and the \
                 index on relay_xid, which only their owner may; run it as the role that runs \
                 migrate (nothing was changed)",
                not_owned.join(", ")
            )
        }))
    }

    /// Drops the index on `relay_xid`; `concurrently`, without blocking
    /// the outbox's writers (which a partitioned outbox's index cannot).
    pub fn drop_index_sql(&self, concurrently: bool) -> String {
        format!(
            "DROP INDEX {}IF EXISTS {}.{}",
            if concurrently { "CONCURRENTLY " } else { "" },
            crate::sql::quote_ident(&self.outbox.schema),
            crate::sql::quote_ident(&self.xid_index)
        )
    }
}
