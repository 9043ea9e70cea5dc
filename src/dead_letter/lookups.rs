//! The relay's periodic look at the dead-letter table, and the indexes that
//! keep it cheap however many letters are open.
//!
//! Every `dead_letter.refresh_interval` the relay asks three things: which
//! aggregates have open letters (and the WAL place of each one's earliest),
//! which requests an operator made cover an aggregate's later letters too,
//! and which requested letters may be published now. A dead aggregate whose
//! events keep arriving under `dead_letter.aggregate = "follow"` gathers a
//! letter per event for as long as nobody acts: a busy aggregate over a
//! weekend leaves a million. So each answer is found by index probes per
//! aggregate (a loose scan over the aggregates of an index, then a lookup
//! or two in each) or per requested letter, never by reading every open
//! letter: the cost grows with the number of dead aggregates and the
//! letters being redriven, not with the letters waiting.
//!
//! Letters without an aggregate id (rows that lacked one) form one group of
//! their own, as they do for the relay; the look at open aggregates leaves
//! them out, as the relay holds nothing back for them.

use crate::config::TableName;
use crate::sql::quote_ident;

/// The dead-letter table's indexes, `(name suffix, what follows ON table,
/// what it is for)`: `migrate` creates them, and the files under
/// `migrations/` do the same.
const INDEXES: [(&str, &str, &str); 4] = [
    (
        "open",
        "(aggregate_id, dead_letter_id) WHERE resolution IS NULL",
        "open dead letters per aggregate, in order",
    ),
    (
        "waiting",
        "(aggregate_id, dead_letter_id) WHERE resolution IS NULL AND redrive_requested_at IS NULL",
        "open dead letters nobody asked to redrive, per aggregate",
    ),
    (
        "requested",
        "(dead_letter_id) WHERE resolution IS NULL AND redrive_requested_at IS NOT NULL",
        "dead letters an operator asked to redrive, in order",
    ),
    (
        "placed",
        "(aggregate_id, source_system, source_lsn NULLS FIRST, source_index NULLS FIRST) WHERE resolution IS NULL",
        "where each aggregate's earliest open dead letter is in the WAL",
    ),
];

/// One of the dead-letter table's indexes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LetterIndex {
    /// Unqualified; it lives in the table's schema.
    pub name: String,
    /// What follows `ON table`.
    pub definition: &'static str,
    pub purpose: &'static str,
}

/// The indexes of dead-letter table `table`.
pub fn indexes(table: &TableName) -> Vec<LetterIndex> {
    INDEXES
        .iter()
        .map(|(suffix, definition, purpose)| {
            // An identifier holds 63 bytes: the end, which names the
            // purpose, is kept.
            let mut name = format!("{}_{suffix}", table.name);
            while name.len() > 63 {
                name.remove(0);
            }
            LetterIndex {
                name,
                definition,
                purpose,
            }
        })
        .collect()
}

/// `CREATE INDEX IF NOT EXISTS` of `index` on `table`.
pub fn create_index_sql(table: &TableName, index: &LetterIndex) -> String {
    format!(
        "CREATE INDEX IF NOT EXISTS {} ON {} {}",
        quote_ident(&index.name),
        table.quoted(),
        index.definition
    )
}

/// Per aggregate with open letters, the WAL place (`lsn`, `index`) of its
/// earliest open letter when every open letter of it has one from WAL `$1`
/// (NULLs otherwise): a loose scan over the aggregates of the `open` index,
/// then probes of the `placed` index for those of the shard. `shard`:
/// `" AND <condition on aggregate_id>"` or empty (a shard blocks only its
/// own aggregates: every shard holding all of them would hold N times the
/// memory, and reach the cap on blocked aggregates N times sooner).
pub fn open_sql(table: &TableName, shard: &str) -> String {
    let t = table.quoted();
    let unplaced = |condition: &str| {
        format!(
            "NOT EXISTS (SELECT 1 FROM {t} u WHERE u.resolution IS NULL AND u.aggregate_id = o.aggregate_id AND {condition})"
        )
    };
    format!(
        "WITH RECURSIVE g(a) AS (
             SELECT min(aggregate_id) FROM {t} WHERE resolution IS NULL
           UNION ALL
             SELECT (SELECT min(aggregate_id) FROM {t} WHERE resolution IS NULL AND aggregate_id > g.a)
             FROM g WHERE g.a IS NOT NULL
         )
         SELECT o.aggregate_id, p.lsn::text, p.index
         FROM (SELECT a AS aggregate_id FROM g) o LEFT JOIN LATERAL (
             SELECT f.source_lsn AS lsn, f.source_index AS index FROM {t} f
             WHERE f.resolution IS NULL AND f.aggregate_id = o.aggregate_id AND f.source_system = $1
             ORDER BY f.source_system, f.source_lsn NULLS FIRST, f.source_index NULLS FIRST LIMIT 1
         ) p ON {} AND {} AND {}
         WHERE o.aggregate_id IS NOT NULL{shard}",
        unplaced("u.source_system IS NULL"),
        unplaced("u.source_system < $1"),
        unplaced("u.source_system > $1"),
    )
}

/// Letters one look marks requested, at most: a statement on the ownership
/// session must end well within the lease (about half a second here).
pub const EXTEND_BATCH: i64 = 20_000;

/// Marks requested the open letters of every aggregate whose earliest open
/// letter is requested, in each aggregate's order, [`EXTEND_BATCH`] at most
/// of the named aggregates' and as many of the letters without an
/// aggregate (the next look goes on); returns whether either batch was
/// full, so more may be waiting: an operator's request on an aggregate's
/// oldest letter covers the followers the relay wrote after it, which go
/// back with it.
/// A loose scan over the `open` index yields each aggregate with its
/// earliest open letter in one probe (ordered by both columns, so no other
/// index can serve it: a lookup of an aggregate's first letter by id alone
/// may be planned along the primary key, which reads every letter before
/// it). `shard`: `" AND <condition on aggregate_id>"` or empty.
pub fn extend_requests_sql(table: &TableName, shard: &str) -> String {
    let t = table.quoted();
    // Marks requested the candidates the CTE `ids` chose (re-checked: a
    // dlq command may have resolved or requested some meanwhile).
    let mark = |ids: &str| {
        format!(
            "UPDATE {t} l SET redrive_requested_at = now()
             WHERE l.dead_letter_id = ANY ((SELECT ids FROM {ids})::bigint[])
               AND l.resolution IS NULL AND l.redrive_requested_at IS NULL
             RETURNING 1"
        )
    };
    format!(
        "WITH RECURSIVE {dead},
         asked AS (
             SELECT g.a FROM g JOIN {t} f ON f.dead_letter_id = g.first
             WHERE f.redrive_requested_at IS NOT NULL
         ),
         named_ids AS (
             SELECT ARRAY (
                 SELECT w.dead_letter_id FROM asked JOIN {t} w ON w.aggregate_id = asked.a
                 WHERE w.resolution IS NULL AND w.redrive_requested_at IS NULL{shard}
                 ORDER BY w.aggregate_id, w.dead_letter_id LIMIT {EXTEND_BATCH}) AS ids
         ),
         named AS ({mark_named}),
         unnamed_ids AS (
             SELECT ARRAY (
                 SELECT w.dead_letter_id FROM {t} w
                 WHERE w.aggregate_id IS NULL AND w.resolution IS NULL AND w.redrive_requested_at IS NULL{shard}
                   AND (SELECT f.redrive_requested_at IS NOT NULL FROM {t} f
                        WHERE f.resolution IS NULL AND f.aggregate_id IS NULL
                        ORDER BY f.aggregate_id, f.dead_letter_id LIMIT 1)
                 ORDER BY w.aggregate_id, w.dead_letter_id LIMIT {EXTEND_BATCH}) AS ids
         ),
         unnamed AS ({mark_unnamed})
         SELECT (SELECT count(*) FROM named) + (SELECT count(*) FROM unnamed),
                (SELECT cardinality(ids) FROM named_ids) = {EXTEND_BATCH}
                OR (SELECT cardinality(ids) FROM unnamed_ids) = {EXTEND_BATCH}",
        dead = dead_aggregates(&t),
        mark_named = mark("named_ids"),
        mark_unnamed = mark("unnamed_ids"),
    )
}

/// The recursive CTE `g(a, first)`: each aggregate with an open letter,
/// with its earliest, by a loose scan over the `open` index.
fn dead_aggregates(t: &str) -> String {
    format!(
        "g(a, first) AS (
             (SELECT aggregate_id, dead_letter_id FROM {t}
              WHERE resolution IS NULL AND aggregate_id IS NOT NULL
              ORDER BY aggregate_id, dead_letter_id LIMIT 1)
           UNION ALL
             SELECT n.aggregate_id, n.dead_letter_id FROM g, LATERAL (
                 SELECT aggregate_id, dead_letter_id FROM {t}
                 WHERE resolution IS NULL AND aggregate_id > g.a
                 ORDER BY aggregate_id, dead_letter_id LIMIT 1) n
         )"
    )
}

/// The requested letters that may be published now, oldest first, at most
/// `$1`, each with the time of the look (`now()`, last): those of
/// aggregates with no open letter nobody asked for (one before them holds
/// them back; one after them is a follower the
/// extension has not reached yet, and publishing the letters first would
/// leave it first, unrequested, and the request ended). The aggregates
/// come first, from the loose scan over the dead ones: those whose
/// earliest open letter is requested are probed along the `waiting` index
/// once each; then the letters of those found ready, in order, from the
/// `requested` index (a hashed set: many may be ready). `shard` as for
/// [`extend_requests_sql`], on the aggregates probed and on the letters.
pub fn requested_sql(table: &TableName, shard: &str) -> String {
    let t = table.quoted();
    // A probe along the `waiting` index, with statistics or without (a
    // table just filled): ordered by its columns, no other index serves it
    // as cheaply; and OFFSET 0 keeps it a probe (flattened into an
    // anti-join, the plan read every waiting letter). The index keeps the
    // entries of the letters an extension reached until a vacuum (or, when
    // no older snapshot can still see them, until a scan marks them dead),
    // and a probe that finds no waiting letter steps over all of them. So
    // it runs once per aggregate, not once per letter: with a snapshot held
    // open elsewhere, a look at 20,050 requested letters of one aggregate
    // probed 500 times took 1.2 s. From the end: an extension requests an
    // aggregate's letters from its oldest, so midway the followers not
    // reached yet are there (from the start, a look midway through 20,050
    // letters took 50 s, probing for each letter; from the end, 0.2 s).
    let none_waiting = |group: &str| {
        format!(
            "NOT EXISTS (SELECT 1 FROM {t} e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                         AND e.aggregate_id {group}
                         ORDER BY e.aggregate_id DESC, e.dead_letter_id DESC LIMIT 1 OFFSET 0)"
        )
    };
    format!(
        "WITH RECURSIVE {dead},
         ready AS (
             SELECT g.a FROM g JOIN {t} f ON f.dead_letter_id = g.first
             WHERE f.redrive_requested_at IS NOT NULL{shard} AND {named}
         )
         SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
                l.payload, l.headers, l.created_at, l.extra, now()
         FROM {t} l
         WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL{shard}
           AND (l.aggregate_id IN (SELECT a FROM ready)
                OR (l.aggregate_id IS NULL AND {unnamed}))
         ORDER BY l.dead_letter_id LIMIT $1",
        dead = dead_aggregates(&t),
        named = none_waiting("= g.a"),
        unnamed = none_waiting("IS NULL"),
    )
}

/// A look's requested letters, as [`read_requested`] kept them.
pub(super) struct ReadRequested {
    /// Each with the time of the look.
    pub letters: Vec<(super::Requested, chrono::DateTime<chrono::Utc>)>,
    /// The size the next look assumes a letter takes: the average of
    /// those kept, or a quarter of the largest when more.
    pub assumed: Option<usize>,
}

/// Runs [`requested_sql`], asking for as many letters as `max_bytes`
/// holds at `assumed` bytes each (0: unknown, a whole batch), at most
/// [`super::REQUESTED_BATCH`], and keeps them as they arrive while those
/// kept take less than `max_bytes` of text (the first always). A batch of
/// large letters is so never held whole; the server's rows past the cut
/// are read and dropped.
pub(super) async fn read_requested(
    client: &tokio_postgres::Client,
    statement: &tokio_postgres::Statement,
    assumed: usize,
    max_bytes: usize,
) -> Result<ReadRequested, tokio_postgres::Error> {
    let batch = super::REQUESTED_BATCH;
    let limit = match max_bytes.checked_div(assumed) {
        Some(fit) => i64::try_from(fit.saturating_add(1)).unwrap_or(i64::MAX),
        None => batch,
    }
    .clamp(1, batch);
    let rows = client.query_raw(statement, [limit]).await?;
    let mut rows = std::pin::pin!(rows);
    let (mut letters, mut bytes, mut largest) = (Vec::new(), 0usize, 0usize);
    while let Some(r) = futures::TryStreamExt::try_next(&mut rows).await? {
        if bytes >= max_bytes && !letters.is_empty() {
            break;
        }
        let letter = requested_letter(&r);
        let size = letter.0.raw.text_len();
        (bytes, largest) = (bytes.saturating_add(size), largest.max(size));
        letters.push(letter);
    }
    Ok(ReadRequested {
        assumed: bytes
            .checked_div(letters.len())
            .map(|average| average.max(largest / 4).max(1)),
        letters,
    })
}

/// A requested letter of [`requested_sql`]'s answer, and the time
/// of the look that handed it over.
fn requested_letter(r: &tokio_postgres::Row) -> (super::Requested, chrono::DateTime<chrono::Utc>) {
    let letter = super::Requested {
        letter_id: r.get(0),
        raw: crate::outbox::RawRow {
            id: r.get(1),
            aggregate_type: r.get(2),
            aggregate_id: r.get(3),
            event_type: r.get(4),
            event_version: r.get(5),
            payload: r.get(6),
            headers: r.get(7),
            created_at: r.get(8),
            extra: r.get(9),
        },
    };
    (letter, r.get(10))
}

/// Marks `redriven` the letters `$1` the broker confirmed, whatever an
/// operator decided meanwhile; returns those an operator dropped while they
/// were on their way. `$2`: when each was handed over (NULL: not known). A
/// letter an operator asked for again after it was handed over (its
/// request is later) passes that request on to its aggregate's next open
/// letter, one of the same batch: a refusal of that one must not end a
/// request made after the batch left (see [`clear_requests_sql`]).
pub fn sent_sql(table: &TableName) -> String {
    let t = table.quoted();
    // Along the `open` index: one probe (IS NOT DISTINCT FROM would read
    // the index from its start).
    let next_open = |group: &str| {
        format!(
            "(SELECT e.dead_letter_id FROM {t} e
              WHERE {group} AND e.resolution IS NULL AND e.dead_letter_id <> ALL ($1)
              ORDER BY e.aggregate_id, e.dead_letter_id LIMIT 1)"
        )
    };
    format!(
        "WITH was AS (
             SELECT dead_letter_id, resolution, aggregate_id, redrive_requested_at FROM {t}
             WHERE dead_letter_id = ANY($1) AND resolution IS DISTINCT FROM 'redriven'
             FOR UPDATE),
         marked AS (
             UPDATE {t} l SET resolution = 'redriven', resolved_at = now()
             FROM was WHERE l.dead_letter_id = was.dead_letter_id),
         again AS (
             SELECT w.aggregate_id, max(w.redrive_requested_at) AS at
             FROM was w JOIN unnest($1::bigint[], $2::timestamptz[]) AS k(id, taken)
               ON k.id = w.dead_letter_id
             WHERE w.redrive_requested_at > k.taken
             GROUP BY w.aggregate_id),
         carried AS (
             UPDATE {t} n SET redrive_requested_at = again.at FROM again
             WHERE n.dead_letter_id = COALESCE({next_named}, {next_unnamed})
               AND n.resolution IS NULL
               AND (n.redrive_requested_at IS NULL OR n.redrive_requested_at < again.at))
         SELECT dead_letter_id FROM was WHERE resolution = 'dropped'",
        next_named =
            next_open("again.aggregate_id IS NOT NULL AND e.aggregate_id = again.aggregate_id"),
        next_unnamed = next_open("again.aggregate_id IS NULL AND e.aggregate_id IS NULL"),
    )
}

/// Ends the requests of the aggregate of letter `$1`, refused again,
/// unless its earliest open letter was asked for after `$2`, when the
/// refused letter was handed over (an operator asked again meanwhile; a
/// request on a letter confirmed since was passed on to it: [`sent_sql`]).
pub fn clear_requests_sql(table: &TableName) -> String {
    let t = table.quoted();
    // Named and unnamed apart, each along the `open` index (IS NOT
    // DISTINCT FROM would read it from its start on every refusal). A
    // letter gone meanwhile names no aggregate and ends nothing.
    let named = "aggregate_id = (SELECT a FROM agg)";
    let unnamed = "EXISTS (SELECT 1 FROM agg WHERE a IS NULL) AND aggregate_id IS NULL";
    let earliest = |group: &str| {
        format!(
            "(SELECT redrive_requested_at > $2::timestamptz FROM {t}
              WHERE {group} AND resolution IS NULL
              ORDER BY aggregate_id, dead_letter_id LIMIT 1)"
        )
    };
    let clear = |group: &str| {
        format!(
            "UPDATE {t} SET redrive_requested_at = NULL
             WHERE {group} AND resolution IS NULL AND redrive_requested_at IS NOT NULL
               AND NOT (SELECT again FROM asked)"
        )
    };
    format!(
        "WITH agg AS MATERIALIZED (SELECT aggregate_id AS a FROM {t} WHERE dead_letter_id = $1),
         asked AS MATERIALIZED (SELECT COALESCE({named_asked}, {unnamed_asked}, false) AS again),
         named AS ({clear_named})
         {clear_unnamed}",
        named_asked = earliest(named),
        unnamed_asked = earliest(unnamed),
        clear_named = clear(named),
        clear_unnamed = clear(unnamed),
    )
}
