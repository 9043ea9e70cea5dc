//! Recording "sent" by ranges (`outbox::progress`, `relay.mark =
//! "ranges"`), against real PostgreSQL: the helpers the random histories
//! (`ranges_histories.rs`) and other tests share, and the reads' plans,
//! which visit the new rows, not the retained ones.

use crate::dead_letter_lookups::{handled, rows_handled};
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::outbox::progress::Ranges;
use outbox_relay::outbox::progress::fold::Advance;
use outbox_relay::outbox::progress::read::{READER_SESSION, ReadSql, Stragglers};
use std::time::Duration;
use tokio_postgres::Client;

pub(crate) async fn outbox_with_ranges(db: &TestDb) -> Ranges {
    db.migrate(&parse(&base_toml(&db.url, &rabbit_sink())))
        .await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    for sql in ranges.create_sql() {
        db.client.batch_execute(&sql).await.expect("create");
    }
    ranges
}

pub(crate) const INSERT: &str =
    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                      VALUES (gen_random_uuid(), 'order', 'o', 'created', '{}')";

pub(crate) async fn seqs(
    client: &Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> Vec<i64> {
    client
        .query(sql, params)
        .await
        .unwrap_or_else(|e| panic!("{e:?}\n{sql}"))
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// What `status` reads of a first read ([`ReadSql::backlog`] and
/// [`ReadSql::oldest`], selecting `relay_seq`): the count and the lowest.
pub(crate) async fn count_and_oldest(client: &Client, sql: &ReadSql) -> (i64, Option<i64>) {
    let count = client.query_one(&sql.backlog, &[]).await.unwrap().get(0);
    let oldest = client.query_opt(&sql.oldest, &[]).await.unwrap();
    (count, oldest.map(|r| r.get(0)))
}

/// A read of the unsent rows from `base` (a snapshot and its highest
/// `relay_seq`; `None`: a first read), page by page: the first page has
/// run, [`Paged::next`] runs the next.
pub(crate) struct Paged {
    sql: ReadSql,
    base: Option<String>,
    /// The read's own snapshot, and its highest `relay_seq`: the next base.
    pub(crate) cur: String,
    pub(crate) cur_max: Option<i64>,
    base_max: i64,
    stragglers: Stragglers,
    page: i64,
    /// The rows read so far.
    pub(crate) got: Vec<i64>,
    /// Where the next page starts: the last row read, or the end of a
    /// window of stragglers none of which was unsent.
    cursor: i64,
    /// The last page was full, or was sent a window of the stragglers
    /// with more after it.
    more: bool,
}

impl Paged {
    pub(crate) async fn first(
        client: &Client,
        ranges: &Ranges,
        base: &Option<(String, Option<i64>)>,
        page: i64,
    ) -> Paged {
        let sql = ranges.read_sql("relay_seq", "");
        let (snap, max) = match base {
            Some((s, m)) => (Some(s.clone()), *m),
            None => (None, None),
        };
        let rows = client
            .query(&sql.first_page, &[&snap, &max, &page])
            .await
            .unwrap_or_else(|e| panic!("{e:?}\n{}", sql.first_page));
        let got: Vec<i64> = rows
            .iter()
            .filter_map(|r| r.get::<_, Option<i64>>(4))
            .collect();
        // Only the first row carries the snapshot and the stragglers.
        for r in rows.iter().skip(1) {
            let (cur, stragglers) = (
                r.get::<_, Option<String>>(0),
                r.get::<_, Option<Vec<i64>>>(3),
            );
            assert!(
                cur.is_none() && stragglers.is_none(),
                "a later row repeats the head"
            );
        }
        Paged {
            cur: rows[0].get(0),
            cur_max: rows[0].get(1),
            base_max: rows[0].get(2),
            stragglers: Stragglers::new(rows[0].get(3)),
            cursor: got.last().copied().unwrap_or(i64::MIN),
            more: got.len() as i64 == page,
            got,
            sql,
            base: snap,
            page,
        }
    }

    /// The base's snapshot (`None`: the frontier).
    pub(crate) fn base(&self) -> &Option<String> {
        &self.base
    }

    /// Nothing more to read.
    pub(crate) fn done(&self) -> bool {
        !self.more
    }

    /// The next page, as the readers run it: sent only a page of the
    /// stragglers after the cursor, and bounded by the last of them when
    /// more follow.
    pub(crate) async fn next(&mut self, client: &Client) {
        let page = usize::try_from(self.page).unwrap();
        let window = self.stragglers.window(self.cursor, page);
        assert!(window.stragglers.len() <= page);
        let more = seqs(
            client,
            &self.sql.next_page,
            &[
                &self.cursor,
                &self.cur,
                &self.base,
                &self.base_max,
                &window.stragglers,
                &self.page,
                &window.upper,
            ],
        )
        .await;
        self.cursor = more.last().copied().unwrap_or(window.upper);
        self.more = more.len() == page || window.truncated;
        self.got.extend(more);
    }
}

/// [`Paged`] to the end, with nothing between the pages. Returns the rows
/// and the read's own snapshot with its highest `relay_seq`.
pub(crate) async fn read(
    client: &Client,
    ranges: &Ranges,
    base: &Option<(String, Option<i64>)>,
    page: i64,
) -> (Vec<i64>, (String, Option<i64>)) {
    let mut read = Paged::first(client, ranges, base, page).await;
    while !read.done() {
        read.next(client).await;
    }
    (read.got, (read.cur, read.cur_max))
}

/// Records the rows `writer`'s open transaction wrote, on `client`, as CDC
/// may record a transaction decoded a moment before its commit is
/// visible; returns them.
pub(crate) async fn record_open(client: &Client, writer: &Client, ranges: &Ranges) -> Vec<i64> {
    let own = seqs(
        writer,
        "SELECT relay_seq FROM outbox WHERE relay_xid = pg_current_xact_id()",
        &[],
    )
    .await;
    ranges.record(client, &own).await.unwrap();
    own
}

/// The unsent rows by the predicate, one row at a time: what every read
/// must return (those not visible in `base`, when given).
pub(crate) async fn brute_force(client: &Client, ranges: &Ranges, base: Option<&str>) -> Vec<i64> {
    let sql = format!(
        "SELECT relay_seq FROM outbox
         WHERE NOT {}(relay_seq, relay_xid, relay_sent_at)
           AND ($1::text IS NULL OR NOT pg_visible_in_snapshot(relay_xid, $1::text::pg_snapshot))
         ORDER BY relay_seq",
        ranges.sent_function.quoted()
    );
    seqs(client, &sql, &[&base]).await
}

#[tokio::test]
async fn reads_visit_the_rows_since_the_frontier_not_the_retained_ones() {
    const RETAINED: i64 = 100_000;
    let mut db = TestDb::new().await;
    let ranges = outbox_with_ranges(&db).await;
    // A reader that started on a young table, as a relay on a new outbox
    // does: its one plan was made with the statistics of 300 rows, and
    // they stay so (autovacuum off) while the table grows.
    db.client
        .batch_execute(
            "ALTER TABLE outbox SET (autovacuum_enabled = off);
             INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'o' || i % 100, 'created', '{}' FROM generate_series(1, 300) i;
             ANALYZE outbox",
        )
        .await
        .unwrap();
    // A session as the relay opens it (JIT off), set up as its reader.
    let config = parse(&base_toml(&db.url, &rabbit_sink()));
    let young = outbox_relay::db::connect(&config.database, None)
        .await
        .unwrap();
    young.batch_execute(READER_SESSION).await.unwrap();
    young
        .batch_execute(&format!(
            "PREPARE first_page(text, bigint, bigint) AS {}",
            ranges.read_sql("relay_seq", "").first_page
        ))
        .await
        .unwrap();
    young
        .execute("EXECUTE first_page(NULL, NULL, 100)", &[])
        .await
        .unwrap();
    db.client
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'o' || i % 100, 'created', '{{}}' FROM generate_series(301, {RETAINED}) i"
        ))
        .await
        .unwrap();
    let all: Vec<i64> = (1..=RETAINED).collect();
    ranges.record(&db.client, &all).await.unwrap();
    let mut fold = connect(&db.url).await;
    let capture = ranges.capture(&fold, Duration::from_secs(5)).await.unwrap();
    let advanced = ranges.advance(&mut fold, &capture, 10).await.unwrap();
    assert_eq!(
        advanced,
        Advance::Advanced {
            held: 0,
            closed: 0,
            deleted: 1,
            settled: true
        }
    );
    let (_, before) = read(&db.client, &ranges, &None, 100).await;
    // A late committer: its relay_seq is below rows committed before it.
    let mut late = connect(&db.url).await;
    let late_tx = late.transaction().await.unwrap();
    late_tx.batch_execute(INSERT).await.unwrap();
    for _ in 0..20 {
        db.client.batch_execute(INSERT).await.unwrap();
    }
    late_tx.commit().await.unwrap();
    let sql = ranges.read_sql("relay_seq", "");
    let first = (None::<String>, None::<i64>, 100_i64);
    let steady = (Some(before.0.clone()), before.1, 100_i64);
    // As the relay runs them: one plan for any parameters.
    db.client.batch_execute(READER_SESSION).await.unwrap();
    let costs = [
        rows_handled(
            &mut db.client,
            &sql.first_page,
            &[&first.0, &first.1, &first.2],
        )
        .await,
        rows_handled(
            &mut db.client,
            &sql.first_page,
            &[&steady.0, &steady.1, &steady.2],
        )
        .await,
        rows_handled(&mut db.client, &sql.backlog, &[]).await,
    ];
    let young_cost = {
        let explain = format!(
            "EXPLAIN (ANALYZE, FORMAT JSON) EXECUTE first_page('{}', {}, 100)",
            before.0,
            before.1.unwrap_or(0)
        );
        let plan: serde_json::Value = young.query_one(&explain, &[]).await.unwrap().get(0);
        // The penalty on table scans makes the plan look costly: compiled
        // with JIT, a page took 350 ms.
        assert!(
            plan[0].get("JIT").is_none(),
            "the reads are compiled: {}",
            plan[0]["JIT"]
        );
        handled(&plan[0]["Plan"])
    };
    assert!(
        young_cost < 500.0,
        "rows handled by a plan made on a young table: {young_cost}"
    );
    assert!(
        costs.iter().all(|&c| c < 500.0),
        "rows handled (first read, steady, backlog): {costs:?}"
    );
    // The fold's look at what a new frontier would pass reads as little.
    let capture = ranges.capture(&fold, Duration::from_secs(5)).await.unwrap();
    let fold_cost = rows_handled(
        &mut db.client,
        &ranges.unrecorded_sql(),
        &[&capture.snapshot, &1000_i64],
    )
    .await;
    assert!(
        fold_cost < 500.0,
        "rows handled by the fold's look: {fold_cost}"
    );
    let want: Vec<i64> = (RETAINED + 1..=RETAINED + 21).collect();
    assert_eq!(read(&db.client, &ranges, &None, 100).await.0, want);
    assert_eq!(read(&db.client, &ranges, &Some(before), 7).await.0, want);
    // Without the split, the unsent index holds every retained row.
    let every = format!(
        "SELECT relay_seq FROM outbox o WHERE {} ORDER BY relay_seq LIMIT 100",
        ranges.unsent("o")
    );
    let scan = rows_handled(&mut db.client, &every, &[]).await;
    assert!(
        scan > RETAINED as f64,
        "a scan of the unsent index handled {scan}"
    );
}

#[tokio::test]
async fn a_batch_is_recorded_as_its_runs_and_nothing_more() {
    let db = TestDb::new().await;
    let ranges = outbox_with_ranges(&db).await;
    let recorded = |sql: &'static str| {
        let client = &db.client;
        let table = ranges.progress.quoted();
        async move {
            client
                .query_one(&format!("SELECT {sql} FROM {table}"), &[])
                .await
                .unwrap()
                .get::<_, Option<String>>(0)
        }
    };
    // Out of order and repeated, as answers may come: runs 1-3, 5, 7-8.
    let n = ranges
        .record(&db.client, &[8, 2, 5, 1, 3, 7, 2])
        .await
        .unwrap();
    assert_eq!(n, 1, "one progress row per batch");
    assert_eq!(
        recorded("range_agg(seqs)::text").await.as_deref(),
        Some("{[1,4),[5,6),[7,9)}")
    );
    assert_eq!(
        ranges.record(&db.client, &[]).await.unwrap(),
        0,
        "nothing to record"
    );
    // Bounds that do not pair up record nothing, rather than a range
    // without an end.
    let n = db
        .client
        .execute(&ranges.record_sql(), &[&vec![10_i64, 20], &vec![10_i64]])
        .await
        .unwrap();
    assert_eq!(n, 0);
    assert_eq!(
        recorded("count(*)::text").await.as_deref(),
        Some("1"),
        "only the first batch"
    );
}

/// The oldest unsent row and the backlog's count as `status` and the
/// gauges read them during a drain: the fold waits for the drain to end, so
/// the rows sent meanwhile lie recorded above the frontier, and the reads
/// step over their runs instead of visiting them one by one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_oldest_unsent_row_is_read_past_the_rows_a_drain_recorded() {
    let mut db = TestDb::new().await;
    let ranges = outbox_with_ranges(&db).await;
    let sql = ranges.read_sql("relay_seq", "");
    // Before the first fold (no frontier), then above the frontier it made.
    for round in 0..2 {
        // 2,000 rows in transactions of 100, analyzed, as autovacuum
        // would have a backlog's.
        for _ in 0..20 {
            db.client
                .batch_execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                     SELECT gen_random_uuid(), 'order', 'o' || i % 100, 'created', '{}'
                     FROM generate_series(1, 100) i",
                )
                .await
                .unwrap();
        }
        db.client.batch_execute("ANALYZE outbox").await.unwrap();
        let all = seqs(
            &db.client,
            "SELECT relay_seq FROM outbox ORDER BY relay_seq",
            &[],
        )
        .await;
        let from = round * 2_000;
        let mut sent = all[from..from + 1_900].to_vec();
        if round == 1 {
            // Holes in what was sent (relay_seq rolled back, or rows
            // deleted): three runs, which the reads step over one by one.
            for hole in [sent.remove(1_000), sent.remove(500)] {
                db.client
                    .execute("DELETE FROM outbox WHERE relay_seq = $1", &[&hole])
                    .await
                    .unwrap();
            }
        }
        for batch in sent.chunks(100) {
            ranges.record(&db.client, batch).await.unwrap();
        }
        assert_eq!(
            count_and_oldest(&db.client, &sql).await,
            (100, Some(all[from + 1_900])),
            "round {round}"
        );
        // The scans of the outbox by relay_seq (the bulk branch) step
        // over the recorded rows; the stragglers' look at the transactions
        // since the frontier is another matter.
        for (what, statement) in [("oldest", &sql.oldest), ("backlog", &sql.backlog)] {
            let removed = removed_by_seq_scans(&mut db.client, statement)
                .await
                .unwrap_or_else(|| panic!("{what}: no scan by relay_seq in the plan"));
            assert!(
                removed < 100.0,
                "round {round}, {what}: {removed} rows visited and dropped by relay_seq \
                 with 1,900 recorded above the frontier"
            );
        }
        if round == 0 {
            ranges.record(&db.client, &all[1_900..]).await.unwrap();
            let mut fold = connect(&db.url).await;
            let capture = ranges.capture(&fold, Duration::from_secs(5)).await.unwrap();
            let advanced = ranges.advance(&mut fold, &capture, 10).await.unwrap();
            assert!(matches!(advanced, Advance::Advanced { .. }), "{advanced:?}");
        }
    }
}

/// The rows that the page's own scans of the outbox (alias `o`) through
/// its `relay_seq` indexes read and their filters dropped, in `sql`'s plan
/// (`EXPLAIN ANALYZE`, rolled back); `None` when no such scan ran (the
/// bulk branch read another way).
async fn removed_by_seq_scans(client: &mut Client, sql: &str) -> Option<f64> {
    fn walk(node: &serde_json::Value) -> Option<f64> {
        let by_seq = node.get("Alias").and_then(serde_json::Value::as_str) == Some("o")
            && node
                .get("Index Name")
                .and_then(serde_json::Value::as_str)
                .is_some_and(|i| {
                    i.starts_with("outbox_relay_unsent") || i.starts_with("outbox_relay_seq")
                });
        let own = by_seq.then(|| node["Rows Removed by Filter"].as_f64().unwrap_or(0.0));
        let below = node
            .get("Plans")
            .and_then(serde_json::Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(walk);
        own.into_iter().chain(below).reduce(|a, b| a + b)
    }
    let tx = client.transaction().await.unwrap();
    let plan: serde_json::Value = tx
        .query_one(&format!("EXPLAIN (ANALYZE, FORMAT JSON) {sql}"), &[])
        .await
        .unwrap()
        .get(0);
    tx.rollback().await.unwrap();
    walk(&plan[0]["Plan"])
}

/// A transaction that took many low `relay_seq`s and committed after the
/// relay read past them: its rows are stragglers, and each page after the
/// first is sent only a page of them. Windows in which none is unsent
/// (recorded while the transaction was open, as CDC may record) are passed
/// over; every unsent row goes out once, in order. Polling meets them in
/// the tick after the commit; a CDC start-up read (`restart`), in its first
/// round, the transaction having been open at the frontier.
async fn a_large_late_transaction_is_read_a_window_of_stragglers_at_a_time(mode: Mode) {
    let sets = [("relay.mark", "\"ranges\""), ("source.batch_size", "10")];
    let (db, broker, toml) = setup(mode, Kind::Rabbit, &["order"], &sets).await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let mut relay = ChildRelay::start(&toml);
    let mut late = connect(&db.url).await;
    let late_tx = late.transaction().await.unwrap();
    let rows: Vec<String> = (0..95)
        .map(|i| format!("(gen_random_uuid(), 'order', 'late', 'created', '{{\"i\": {i}}}')"))
        .collect();
    late_tx
        .batch_execute(&format!(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES {}",
            rows.join(", ")
        ))
        .await
        .unwrap();
    let fast = crate::ranges_delivery::insert(&db, "fast", 5, 1).await;
    broker.inbox().wait_ids(&fast, WAIT).await;
    let own =
        "SELECT relay_seq FROM outbox WHERE relay_xid = pg_current_xact_id() ORDER BY relay_seq";
    let late_seqs: Vec<i64> = late_tx
        .query(own, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let fast_max = seqs(&db.client, "SELECT max(relay_seq) FROM outbox", &[]).await[0];
    assert!(late_seqs.iter().all(|&s| s < fast_max));
    if mode == Mode::Cdc {
        let frontier = format!(
            "SELECT COALESCE(max(max_seq), 0) FROM {}",
            ranges.frontier.quoted()
        );
        wait_for(WAIT, "the frontier to pass the late rows", || async {
            (seqs(&db.client, &frontier, &[]).await[0] >= fast_max).then_some(())
        })
        .await;
        relay.kill();
    }
    ranges.record(&db.client, &late_seqs[20..60]).await.unwrap();
    late_tx.commit().await.unwrap();
    if mode == Mode::Cdc {
        relay = ChildRelay::start(&toml);
    }
    let got = broker.inbox().wait_len(5 + 55, WAIT).await;
    let expected: Vec<i64> = (0..20).chain(60..95).collect();
    assert_eq!(first_deliveries(&got).remove("late"), Some(expected));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(broker.inbox().len(), 60, "each once");
    drop(relay);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_late_transaction_is_read_a_window_of_stragglers_at_a_time_by_polling() {
    a_large_late_transaction_is_read_a_window_of_stragglers_at_a_time(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_late_transaction_is_read_a_window_of_stragglers_at_a_time_at_a_cdc_start() {
    a_large_late_transaction_is_read_a_window_of_stragglers_at_a_time(Mode::Cdc).await;
}
