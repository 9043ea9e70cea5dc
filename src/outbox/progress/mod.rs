//! Recording "sent" by ranges of `relay_seq` instead of updating each row
//! (`docs/design/marking-by-ranges.md`), `relay.mark = "ranges"`: the
//! recorder inserts one progress row per confirmed batch,
//! the readers ([`read`]) find what is unsent, the fold ([`fold`]) moves
//! the frontier, and retention ([`retain`]) deletes what was sent before
//! its cut-off. Proven against real PostgreSQL in
//! `tests/relay/marking_ranges.rs` and `ranges_histories.rs`.
//!
//! A committed outbox row is *sent* exactly when at least one of these holds:
//!
//! 1. its `relay_sent_at` is set (another marking mode, or an earlier one);
//! 2. its `relay_seq` lies in a range of the progress table (a confirmed batch,
//!    recorded by one INSERT);
//! 3. its transaction is visible in the *frontier* (the newest snapshot the
//!    fold wrote) and its `relay_seq` is not *held open*.
//!
//! The fold ([`fold`]) moves the frontier forward. Before it writes a
//! frontier, every row visible in it is sent by 1 or 2, or held open (the
//! rows the relay had not confirmed yet); it deletes a progress row only in
//! the round that writes a frontier in which every row that progress row
//! names is visible. So a row that is sent stays sent, and the progress
//! table keeps only the last few seconds of batches.

pub mod downgrade;
pub mod fold;
pub mod read;
pub mod retain;

use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};

/// Why ranges cannot work on this server, if they cannot: multiranges came
/// with PostgreSQL 14.
pub async fn version_problem(client: &tokio_postgres::Client) -> Result<Option<String>, String> {
    let version = crate::db::server_version_num(client).await?;
    Ok((version < 140_000).then(|| {
        format!(
            "relay.mark = \"ranges\" needs PostgreSQL 14 or later (multiranges); this server is version {version}: \
             use relay.mark = \"update\", or upgrade"
        )
    }))
}

/// The objects that record "sent" for one outbox table.
#[derive(Debug, Clone)]
pub struct Ranges {
    pub outbox: TableName,
    /// One row per recorded batch: `seqs int8multirange`.
    pub progress: TableName,
    /// The frontier's history; the newest row is the frontier.
    pub frontier: TableName,
    /// Rows a frontier passed before they were recorded: *held open* while
    /// here; the fold deletes each once it is recorded or marked.
    pub held: TableName,
    /// `<outbox>_relay_sent(relay_seq, relay_xid, relay_sent_at)`: the
    /// predicate, for operators, `check` and tests.
    pub sent_function: TableName,
    /// Rows by transaction: the fold and the readers find the transactions
    /// a snapshot had not seen through it. Not partial: the index on unsent
    /// rows has the same predicate and, on a young table, the planner took
    /// it instead (and kept it in the reader's one plan).
    pub xid_index: String,
}

impl Ranges {
    pub fn new(outbox: &TableName) -> Self {
        Ranges {
            outbox: outbox.clone(),
            progress: outbox.sibling("_relay_progress"),
            frontier: outbox.sibling("_relay_frontier"),
            held: outbox.sibling("_relay_held"),
            sent_function: outbox.sibling("_relay_sent"),
            xid_index: outbox.derived("outbox_relay_xid"),
        }
    }

    /// What to tell the operator when a statement on these tables failed
    /// because one does not exist (`42P01` naming one of them): an outbox
    /// migrated for another mode, or a table dropped. `None` for any other
    /// error (another missing relation included).
    pub fn missing_table_problem(&self, e: &tokio_postgres::Error) -> Option<String> {
        let names_one = e.as_db_error().is_some_and(|db| {
            [&self.progress, &self.frontier, &self.held]
                .iter()
                .any(|t| db.message().contains(&format!("{}\"", t.name)))
        });
        (e.code().map(|c| c.code()) == Some("42P01") && names_one).then(|| {
            format!(
                "relay.mark = \"ranges\" reads what was sent from {}, {} and {} ({}): run outbox-relay migrate",
                self.progress,
                self.frontier,
                self.held,
                crate::db::error_text(e)
            )
        })
    }

    /// The statements that create the objects (PostgreSQL 14 or later: the
    /// progress rows are multiranges). Safe to run again.
    pub fn create_sql(&self) -> Vec<String> {
        let mut sql = self.tables_sql();
        sql.push(format!(
            "CREATE INDEX IF NOT EXISTS {} ON {} {}",
            crate::sql::quote_ident(&self.xid_index),
            self.outbox.quoted(),
            Self::xid_index_definition()
        ));
        sql
    }

    /// What follows `ON <outbox>` in the index on `relay_xid`.
    pub fn xid_index_definition() -> String {
        format!("({XID_COLUMN}) INCLUDE ({SEQ_COLUMN})")
    }

    /// The three tables and the predicate's function (no index on the outbox).
    pub fn tables_sql(&self) -> Vec<String> {
        let (p, f, h) = (
            self.progress.quoted(),
            self.frontier.quoted(),
            self.held.quoted(),
        );
        vec![
            format!(
                "CREATE TABLE IF NOT EXISTS {p} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    seqs int8multirange NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now()
)"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {f} (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    snapshot pg_snapshot NOT NULL,
    max_seq bigint NOT NULL,
    last_recorded_at timestamptz,
    folded_at timestamptz NOT NULL DEFAULT now()
)"
            ),
            format!(
                "CREATE TABLE IF NOT EXISTS {h} (
    {SEQ_COLUMN} bigint PRIMARY KEY,
    held_at timestamptz NOT NULL DEFAULT now()
)"
            ),
            format!(
                "CREATE OR REPLACE FUNCTION {}(bigint, xid8, timestamptz) RETURNS boolean
LANGUAGE sql STABLE AS $fn$
SELECT $3 IS NOT NULL
    OR COALESCE($1 <@ ({recorded}), false)
    OR (COALESCE(pg_visible_in_snapshot($2, ({frontier})), false)
        AND NOT EXISTS (SELECT 1 FROM {h} h WHERE h.{SEQ_COLUMN} = $1))
$fn$",
                self.sent_function.quoted(),
                recorded = self.recorded(),
                frontier = self.frontier_snapshot(),
            ),
        ]
    }

    /// The union of the progress rows (NULL when there are none), as a
    /// scalar subquery body.
    pub fn recorded(&self) -> String {
        format!(
            "SELECT range_agg(r) FROM {}, unnest(seqs) r",
            self.progress.quoted()
        )
    }

    /// The frontier's snapshot (NULL before the first fold).
    pub fn frontier_snapshot(&self) -> String {
        format!(
            "SELECT snapshot FROM {} ORDER BY id DESC LIMIT 1",
            self.frontier.quoted()
        )
    }

    /// The condition that row `alias` is unsent: none of the three holds.
    pub fn unsent(&self, alias: &str) -> String {
        self.unsent_with(
            alias,
            &format!(
                "COALESCE({alias}.{SEQ_COLUMN} <@ ({}), false)",
                self.recorded()
            ),
        )
    }

    /// [`Ranges::unsent`] for rows above `lower` only: the union is taken of
    /// the recorded ranges that reach above it. Confirmations arrive out of
    /// order, so a drain records many scattered ranges; a page above a
    /// cursor needs only the recent ones.
    pub fn unsent_above(&self, alias: &str, lower: &str) -> String {
        self.unsent_with(
            alias,
            &format!(
                "COALESCE({alias}.{SEQ_COLUMN} <@ (SELECT range_agg(r) FROM {} p, unnest(p.seqs) r
                                                  WHERE upper(p.seqs) > {lower} AND upper(r) > {lower}), false)",
                self.progress.quoted()
            ),
        )
    }

    /// [`Ranges::unsent`] for rows in (`lower`, `upper`] only: the union of
    /// the recorded ranges that reach into it. For a window of stragglers:
    /// a page of them, each probing every progress row, would cost a page
    /// times the progress rows, which a drain multiplies.
    pub fn unsent_within(&self, alias: &str, lower: &str, upper: &str) -> String {
        self.unsent_with(
            alias,
            &format!(
                "COALESCE({alias}.{SEQ_COLUMN} <@ (SELECT range_agg(r) FROM {} p, unnest(p.seqs) r
                                                  WHERE upper(p.seqs) > {lower} AND lower(p.seqs) <= {upper}
                                                    AND upper(r) > {lower} AND lower(r) <= {upper}), false)",
                self.progress.quoted()
            ),
        )
    }

    /// [`Ranges::unsent`] probing the progress rows for each row: for a few
    /// rows (the stragglers), cheaper than the union of every range.
    pub fn unsent_probed(&self, alias: &str) -> String {
        self.unsent_with(
            alias,
            &format!(
                "EXISTS (SELECT 1 FROM {} p WHERE p.seqs @> {alias}.{SEQ_COLUMN})",
                self.progress.quoted()
            ),
        )
    }

    /// The predicate's negation with `recorded` as clause 2.
    fn unsent_with(&self, alias: &str, recorded: &str) -> String {
        format!(
            "{alias}.{SENT_AT_COLUMN} IS NULL
             AND NOT {recorded}
             AND NOT (COALESCE(pg_visible_in_snapshot({alias}.{XID_COLUMN}, ({frontier})), false)
                      AND NOT EXISTS (SELECT 1 FROM {held} h
                                      WHERE h.{SEQ_COLUMN} = {alias}.{SEQ_COLUMN}))",
            frontier = self.frontier_snapshot(),
            held = self.held.quoted(),
        )
    }

    /// When the newest recorded batch was confirmed (NULL: none yet).
    pub fn last_recorded_sql(&self) -> String {
        format!(
            "SELECT GREATEST((SELECT max(recorded_at) FROM {}),
                             (SELECT last_recorded_at FROM {} ORDER BY id DESC LIMIT 1))",
            self.progress.quoted(),
            self.frontier.quoted()
        )
    }

    /// Records a confirmed batch as one row: `$1` and `$2` are the first
    /// and last `relay_seq` of each run of it ([`runs`]). A batch is mostly
    /// runs of consecutive rows, so the server joins a few ranges instead
    /// of one per row. Arrays of different lengths record nothing (`unnest`
    /// would pair a bound with NULL, an unbounded range).
    pub fn record_sql(&self) -> String {
        format!(
            "INSERT INTO {} (seqs) SELECT range_agg(int8range(lo, hi, '[]')) FROM unnest($1::bigint[], $2::bigint[]) AS r(lo, hi) \
             WHERE cardinality($1::bigint[]) = cardinality($2::bigint[]) HAVING count(*) > 0",
            self.progress.quoted()
        )
    }

    /// Records `seqs` with [`Self::record_sql`], unprepared; nothing when
    /// `seqs` is empty.
    pub async fn record(
        &self,
        client: &impl tokio_postgres::GenericClient,
        seqs: &[i64],
    ) -> Result<u64, tokio_postgres::Error> {
        let (first, last) = runs(seqs);
        client.execute(&self.record_sql(), &[&first, &last]).await
    }
}

/// The runs of consecutive values in `seqs` (in any order, repeats
/// allowed), as their first and last values, in order.
pub fn runs(seqs: &[i64]) -> (Vec<i64>, Vec<i64>) {
    let mut sorted = seqs.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let (mut first, mut last): (Vec<i64>, Vec<i64>) = (Vec::new(), Vec::new());
    for s in sorted {
        match last.last_mut() {
            Some(l) if l.checked_add(1) == Some(s) => *l = s,
            _ => {
                first.push(s);
                last.push(s);
            }
        }
    }
    (first, last)
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn runs_join_consecutive_rows_in_any_order() {
        assert_eq!(runs(&[]), (vec![], vec![]));
        assert_eq!(runs(&[7]), (vec![7], vec![7]));
        assert_eq!(runs(&[1, 2, 3, 5, 6, 9]), (vec![1, 5, 9], vec![3, 6, 9]));
        assert_eq!(runs(&[9, 3, 1, 2, 6, 5, 2]), (vec![1, 5, 9], vec![3, 6, 9]));
        assert_eq!(
            runs(&[i64::MAX, i64::MAX - 1, i64::MIN]),
            (vec![i64::MIN, i64::MAX - 1], vec![i64::MIN, i64::MAX])
        );
    }
}
