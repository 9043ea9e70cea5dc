//! The relay's periodic look at the dead-letter table (real PostgreSQL):
//! it answers as reading every open letter would, and it does not read every
//! open letter, so a dead aggregate that gathers followers for days does not
//! make each look cost more.

use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::dead_letter::{create_sql, lookups};
use serde_json::Value;
use tokio_postgres::Client;

/// The statements as they were before the look used indexes, for reference:
/// each reads every open letter. (The relay always dropped the open
/// aggregates' row for letters without an aggregate id; here SQL does.)
fn reading_everything(table: &TableName, shard: &str) -> [String; 3] {
    let t = table.quoted();
    [
        format!(
            "SELECT DISTINCT ON (aggregate_id) aggregate_id, lsn::text, index
             FROM (SELECT aggregate_id,
                          CASE WHEN source_system = $1 THEN source_lsn END AS lsn,
                          CASE WHEN source_system = $1 THEN source_index END AS index
                   FROM {t} WHERE resolution IS NULL) open
             WHERE aggregate_id IS NOT NULL{shard}
             ORDER BY aggregate_id, lsn NULLS FIRST, index NULLS FIRST"
        ),
        format!(
            "UPDATE {t} l SET redrive_requested_at = now()
             WHERE l.resolution IS NULL AND l.redrive_requested_at IS NULL{shard}
               AND EXISTS (SELECT 1 FROM {t} r WHERE r.resolution IS NULL AND r.redrive_requested_at IS NOT NULL
                           AND r.aggregate_id IS NOT DISTINCT FROM l.aggregate_id
                           AND r.dead_letter_id < l.dead_letter_id
                           AND NOT EXISTS (SELECT 1 FROM {t} e WHERE e.resolution IS NULL
                                           AND e.redrive_requested_at IS NULL
                                           AND e.aggregate_id IS NOT DISTINCT FROM r.aggregate_id
                                           AND e.dead_letter_id < r.dead_letter_id))"
        ),
        format!(
            "SELECT l.dead_letter_id, l.id, l.aggregate_type, l.aggregate_id, l.event_type, l.event_version,
                    l.payload, l.headers, l.created_at, l.extra
             FROM {t} l
             WHERE l.resolution IS NULL AND l.redrive_requested_at IS NOT NULL{shard}
               AND NOT EXISTS (SELECT 1 FROM {t} e WHERE e.resolution IS NULL AND e.redrive_requested_at IS NULL
                               AND e.aggregate_id IS NOT DISTINCT FROM l.aggregate_id
                               AND e.dead_letter_id < l.dead_letter_id)
             ORDER BY l.dead_letter_id LIMIT $1"
        ),
    ]
}

/// The relay's statements: open aggregates, extending requests, requested letters.
fn looking_up(table: &TableName, shard: &str) -> [String; 3] {
    [
        lookups::open_sql(table, shard),
        lookups::extend_requests_sql(table, shard),
        lookups::requested_sql(table, shard),
    ]
}

pub(crate) async fn dead_letter_table(db: &TestDb) -> TableName {
    let table = TableName::new("public", "outbox_dead_letters");
    for sql in create_sql(&table) {
        db.client.batch_execute(&sql).await.expect("create");
    }
    table
}

/// Writes letters `(aggregate, system, lsn, index, requested, resolved)`.
pub(crate) type Letter<'a> = (
    Option<&'a str>,
    Option<&'a str>,
    Option<&'a str>,
    Option<i64>,
    bool,
    bool,
);

pub(crate) async fn write(client: &Client, table: &TableName, letters: &[Letter<'_>]) {
    for (i, (aggregate, system, lsn, index, requested, resolved)) in letters.iter().enumerate() {
        client
            .execute(
                &format!(
                    "INSERT INTO {} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at,
                                     source_system, source_lsn, source_index, redrive_requested_at, resolution)
                     VALUES ($1, $2, 'refused', 1, now(), now(), $3, $4::text::pg_lsn, $5,
                             CASE WHEN $6 THEN now() END, CASE WHEN $7 THEN 'dropped' END)",
                    table.quoted()
                ),
                &[
                    &format!("e{i}"),
                    aggregate,
                    system,
                    lsn,
                    index,
                    requested,
                    resolved,
                ],
            )
            .await
            .expect("insert letter");
    }
}

/// Open aggregates as `open` answers them: aggregate, place.
async fn open_aggregates(
    client: &Client,
    sql: &str,
    origin: Option<&str>,
) -> Vec<(String, Option<String>, Option<i64>)> {
    let mut open: Vec<_> = client
        .query(sql, &[&origin])
        .await
        .expect("open aggregates")
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    open.sort();
    open
}

/// A refresh's requests, rolled back: the letters `requested` hands over
/// after `extend` ran, and every letter requested then.
async fn requests(
    client: &mut Client,
    table: &TableName,
    extend: &str,
    requested: &str,
    limit: i64,
) -> (Vec<i64>, Vec<i64>) {
    let tx = client.transaction().await.expect("begin");
    tx.query(extend, &[]).await.expect("extend requests");
    let handed = tx.query(requested, &[&limit]).await.expect("requested");
    let marked = tx
        .query(
            &format!(
                "SELECT dead_letter_id FROM {} WHERE redrive_requested_at IS NOT NULL ORDER BY 1",
                table.quoted()
            ),
            &[],
        )
        .await
        .expect("requested letters");
    let out = (
        handed.iter().map(|r| r.get(0)).collect(),
        marked.iter().map(|r| r.get(0)).collect(),
    );
    tx.rollback().await.expect("rollback");
    out
}

#[tokio::test]
async fn the_look_at_open_letters_answers_as_reading_every_letter_would() {
    let mut db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let (me, other, later) = (Some("s1"), Some("s0"), Some("s2"));
    let letters: Vec<Letter> = vec![
        // Placed in this WAL, the earliest not written first.
        (Some("a"), me, Some("0/30"), Some(2), false, false),
        (Some("a"), me, Some("0/20"), Some(5), false, false),
        (Some("a"), me, Some("0/20"), Some(1), false, false),
        (Some("a"), me, Some("0/10"), Some(0), false, true),
        // One letter without a place (read from the table).
        (Some("b"), me, Some("0/40"), Some(1), false, false),
        (Some("b"), None, None, None, false, false),
        // Places from other servers' WAL, before and after in name.
        (Some("c"), me, Some("0/50"), Some(1), false, false),
        (Some("c"), other, Some("0/10"), Some(1), false, false),
        (Some("d"), me, Some("0/50"), Some(1), false, false),
        (Some("d"), later, Some("0/10"), Some(1), false, false),
        // A place without an index at the earliest position, and after it.
        (Some("e"), me, Some("0/60"), None, false, false),
        (Some("e"), me, Some("0/70"), Some(3), false, false),
        (Some("f"), me, Some("0/60"), Some(3), false, false),
        (Some("f"), me, Some("0/70"), None, false, false),
        // Nothing open.
        (Some("g"), me, Some("0/80"), Some(1), false, true),
        // Requests: on the first letter (covers the rest), on a later one
        // only (covers nothing), on the first two with a gap after them.
        (Some("h"), me, Some("0/90"), Some(1), true, false),
        (Some("h"), me, Some("0/91"), Some(1), false, false),
        (Some("h"), None, None, None, false, false),
        (Some("i"), me, Some("0/90"), Some(2), false, false),
        (Some("i"), me, Some("0/91"), Some(2), true, false),
        (Some("j"), None, None, None, true, false),
        (Some("j"), None, None, None, true, false),
        (Some("j"), None, None, None, false, false),
        (Some("j"), None, None, None, true, false),
        // The first open letter requested once an earlier one was resolved.
        (Some("k"), None, None, None, false, true),
        (Some("k"), None, None, None, true, false),
        (Some("k"), None, None, None, false, false),
        // Letters of rows without an aggregate id, one group.
        (None, None, None, None, true, false),
        (None, me, Some("0/95"), Some(1), false, false),
        (None, None, None, None, false, false),
    ];
    write(&db.client, &table, &letters).await;

    for origin in [Some("s1"), Some("s0"), None] {
        let [before, ..] = reading_everything(&table, "");
        let [now, ..] = looking_up(&table, "");
        let expected = open_aggregates(&db.client, &before, origin).await;
        let got = open_aggregates(&db.client, &now, origin).await;
        assert_eq!(got, expected, "open aggregates, origin {origin:?}");
        assert_eq!(
            expected.len(),
            10,
            "every aggregate with open letters: {expected:?}"
        );
    }
    // A shard's look: only its own aggregates.
    let shard = outbox_relay::outbox::Shard { index: 1, count: 2 };
    let condition = format!(" AND {}", shard.condition("aggregate_id").unwrap());
    let [before, ..] = reading_everything(&table, &condition);
    let [now, ..] = looking_up(&table, &condition);
    let expected = open_aggregates(&db.client, &before, Some("s1")).await;
    let got = open_aggregates(&db.client, &now, Some("s1")).await;
    assert_eq!(got, expected, "a shard's open aggregates");
    assert!(
        (1..10).contains(&expected.len()),
        "some aggregates, not all: {expected:?}"
    );
    let placed = open_aggregates(&db.client, &looking_up(&table, "")[0], Some("s1")).await;
    assert_eq!(
        placed
            .iter()
            .filter(|(_, lsn, index)| lsn.is_some() && index.is_some())
            .count(),
        3,
        "a, f and i have places in this WAL: {placed:?}"
    );
    // Requests, with and without a shard's condition; a refresh runs the
    // extension, then asks for the letters.
    for shard in ["", " AND aggregate_id <> 'h'"] {
        let [_, extend_before, requested_before] = reading_everything(&table, shard);
        let [_, extend_now, requested_now] = looking_up(&table, shard);
        for limit in [500_i64, 2] {
            let expected = requests(
                &mut db.client,
                &table,
                &extend_before,
                &requested_before,
                limit,
            )
            .await;
            let got = requests(&mut db.client, &table, &extend_now, &requested_now, limit).await;
            assert_eq!(got, expected, "requests, shard {shard:?}, limit {limit}");
            assert!(
                !expected.0.is_empty() && expected.1.len() > 8,
                "the requests reach letters and extend: {expected:?}"
            );
        }
    }
}

/// Rows a statement's plan handled, by `EXPLAIN ANALYZE` (rolled back): per
/// node, the rows it returned over all its loops and those its filters
/// removed. A statement that reads every open letter handles at least as
/// many rows as there are.
pub(crate) async fn rows_handled(
    client: &mut Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> f64 {
    handled(&explained(client, "ANALYZE", sql, params).await)
}

/// The top node of `sql`'s plan as `EXPLAIN (<options>, FORMAT JSON)`
/// shows it, run in a transaction rolled back.
async fn explained(
    client: &mut Client,
    options: &str,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Value {
    let tx = client.transaction().await.expect("begin");
    let rows = tx
        .query(&format!("EXPLAIN ({options}, FORMAT JSON) {sql}"), params)
        .await
        .expect("explain");
    let plan: Value = rows[0].get(0);
    tx.rollback().await.expect("rollback");
    plan[0]["Plan"].clone()
}

/// The rows a plan's node and those below it handled (see [`rows_handled`]).
pub(crate) fn handled(node: &Value) -> f64 {
    let n = |k: &str| node.get(k).and_then(Value::as_f64).unwrap_or(0.0);
    let own = n("Actual Rows") * n("Actual Loops").max(1.0)
        + n("Rows Removed by Filter")
        + n("Rows Removed by Index Recheck")
        + n("Rows Removed by Join Filter");
    own + node
        .get("Plans")
        .and_then(Value::as_array)
        .map_or(0.0, |plans| plans.iter().map(handled).sum())
}

/// What the three statements of a look (open aggregates, extending
/// requests, requested letters) handle, each.
async fn look_costs(client: &mut Client, [open, extend, requested]: &[String; 3]) -> Vec<f64> {
    vec![
        rows_handled(client, open, &[&Some("s1")]).await,
        rows_handled(client, extend, &[]).await,
        rows_handled(client, requested, &[&500_i64]).await,
    ]
}

async fn vacuum(client: &Client, table: &TableName) {
    client
        .batch_execute(&format!("VACUUM ANALYZE {}", table.quoted()))
        .await
        .expect("vacuum");
}

#[tokio::test]
async fn a_look_reads_a_few_letters_per_dead_aggregate_however_many_wait() {
    const FOLLOWERS: i64 = 40_000;
    const AGGREGATES: i64 = 50;
    let mut db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let t = table.quoted();
    // One busy aggregate dead with its followers, written first (lowest
    // ids), and a few dead ones with three letters each.
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, payload, reason, attempts, first_failed_at, last_failed_at,
                             source_system, source_lsn, source_index)
             SELECT 'hot' || g, 'hot', repeat('x', 256), 'follows', 0, now(), now(),
                    's1', ('0/' || to_hex(g * 64))::pg_lsn, 0
             FROM generate_series(1, {FOLLOWERS}) g;
             INSERT INTO {t} (id, aggregate_id, payload, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'cold' || g || '-' || i, 'cold' || g, repeat('x', 256), 'refused', 5, now(), now()
             FROM generate_series(1, {AGGREGATES}) g, generate_series(1, 3) i"
        ))
        .await
        .expect("letters");
    vacuum(&db.client, &table).await;
    let bound = (AGGREGATES * 30) as f64;

    // Nobody acted yet: the state an incident stays in.
    let reference = look_costs(&mut db.client, &reading_everything(&table, "")).await;
    let costs = look_costs(&mut db.client, &looking_up(&table, "")).await;
    eprintln!(
        "rows handled with nothing requested: {costs:?}; reading every letter: {reference:?}"
    );
    assert!(
        reference.iter().any(|c| *c >= FOLLOWERS as f64),
        "reading every letter handles them all, or the measure is wrong: {reference:?}"
    );
    assert!(
        costs.iter().all(|c| *c <= bound),
        "a look with nothing requested handled {costs:?} rows (at most {bound} expected; reading every letter: {reference:?})"
    );

    // An operator redrives the busy aggregate: the extension marks its
    // letters once, and the relay publishes and resolves the first ones.
    db.client
        .batch_execute(&format!(
            "UPDATE {t} SET redrive_requested_at = now()
             WHERE dead_letter_id = (SELECT min(dead_letter_id) FROM {t})"
        ))
        .await
        .expect("request");
    // Look after look, a bounded batch each, oldest first, until all are.
    let mut batches = Vec::new();
    loop {
        let extended: i64 = db
            .client
            .query_one(&looking_up(&table, "")[1], &[])
            .await
            .expect("extend")
            .get(0);
        if extended == 0 {
            break;
        }
        batches.push(extended);
        assert!(batches.len() < 100, "the extension ends: {batches:?}");
    }
    assert!(
        batches.iter().all(|b| *b <= lookups::EXTEND_BATCH),
        "{batches:?}"
    );
    assert_eq!(
        batches.iter().sum::<i64>(),
        FOLLOWERS - 1,
        "the request covers the followers"
    );
    db.client
        .batch_execute(&format!(
            "UPDATE {t} SET resolution = 'redriven', resolved_at = now()
             WHERE dead_letter_id IN (SELECT dead_letter_id FROM {t} ORDER BY dead_letter_id LIMIT 700)"
        ))
        .await
        .expect("resolve");
    // As autovacuum does after so many updates: until then, index scans
    // also step over the versions the updates left behind.
    vacuum(&db.client, &table).await;
    let costs = look_costs(&mut db.client, &looking_up(&table, "")).await;
    eprintln!("rows handled during a redrive: {costs:?}");
    // The requested letters are handed over 500 at a time: those are read.
    let redriving = bound + 500.0 * 4.0;
    assert!(
        costs.iter().all(|c| *c <= redriving),
        "a look during a redrive handled {costs:?} rows (at most {redriving} expected)"
    );
}

/// Shared buffers a statement's plan touched (hit or read), by `EXPLAIN
/// (ANALYZE, BUFFERS)` (rolled back): it counts what rows handled does not,
/// such as index entries of row versions an update left behind.
async fn buffers_touched(
    client: &mut Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> f64 {
    let plan = explained(client, "ANALYZE, BUFFERS", sql, params).await;
    let n = |k: &str| plan[k].as_f64().unwrap_or(0.0);
    n("Shared Hit Blocks") + n("Shared Read Blocks")
}

/// While a request is extended look by look, the letters it reached keep
/// their entries in the `waiting` index until a vacuum, and while an older
/// snapshot is open anywhere in the database (a long report, a backup)
/// nothing marks them dead. The look's probe for a letter nobody asked for
/// must not step over them for every requested letter: neither midway,
/// when the followers not reached yet hold the letters back, nor once all
/// are reached and the letters go.
#[tokio::test]
async fn a_look_does_not_step_over_the_letters_a_request_reached() {
    const LETTERS: i64 = lookups::EXTEND_BATCH + 50;
    let mut db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let t = table.quoted();
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, payload, reason, attempts, first_failed_at, last_failed_at,
                             redrive_requested_at)
             SELECT 'l' || g, 'a', '{{}}', 'refused', 5, now(), now(), CASE WHEN g = 1 THEN now() END
             FROM generate_series(1, {LETTERS}) g"
        ))
        .await
        .expect("letters");
    vacuum(&db.client, &table).await;
    // A snapshot older than the extension, held open meanwhile.
    let mut other = connect(&db.url).await;
    let old = other
        .build_transaction()
        .isolation_level(tokio_postgres::IsolationLevel::RepeatableRead)
        .start()
        .await
        .expect("begin");
    old.query_one(&format!("SELECT count(*) FROM {t}"), &[])
        .await
        .expect("take the snapshot");
    let [_, extend, requested] = looking_up(&table, "");
    assert_eq!(
        extended(&db.client, &extend).await,
        lookups::EXTEND_BATCH,
        "one look's extension"
    );
    // Midway the requested letters are all held back by the followers not
    // reached yet. One probe for the aggregate touched 315 buffers; a
    // probe per letter from the newest end 60,309, and from the oldest,
    // stepping over the reached letters' entries each time, 6,120,612.
    let midway = buffers_touched(&mut db.client, &requested, &[&500_i64]).await;
    assert!(
        listed(&db.client, &requested).await.is_empty(),
        "held back by the followers"
    );
    // All reached: the first 500 go. Probing once for the aggregate
    // touched 327 buffers; once per letter, 153,012.
    assert_eq!(
        extended(&db.client, &extend).await,
        LETTERS - 1 - lookups::EXTEND_BATCH,
        "the rest of the followers"
    );
    let reached = buffers_touched(&mut db.client, &requested, &[&500_i64]).await;
    let first: Vec<String> = (1..=500).map(|i| format!("l{i}")).collect();
    assert_eq!(
        listed(&db.client, &requested).await,
        first,
        "the oldest 500, in order"
    );
    eprintln!("buffers touched by a look midway: {midway}; all reached: {reached}");
    for (when, touched) in [("midway", midway), ("all reached", reached)] {
        assert!(
            touched < 10_000.0,
            "{when}: the look touched {touched} buffers for {LETTERS} letters"
        );
    }
    old.rollback().await.expect("end the old snapshot");
}

/// Letters one extension requested.
async fn extended(client: &Client, extend: &str) -> i64 {
    client.query_one(extend, &[]).await.expect("extend").get(0)
}

/// The ids of the letters a look lists, at most 500.
async fn listed(client: &Client, requested: &str) -> Vec<String> {
    client
        .query(requested, &[&500_i64])
        .await
        .expect("requested letters")
        .iter()
        .map(|r| r.get(1))
        .collect()
}
