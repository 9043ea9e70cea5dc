//! Random histories of `relay.mark = "ranges"` against real PostgreSQL:
//! concurrent transactions (late commits, rollbacks), recordings (CDC's
//! ahead of the commit too), other modes' marks, the fold's captures and
//! advances, and retention. Every read (a polling tick's, and a CDC
//! start-up round's in one REPEATABLE READ snapshot) must equal a scan of
//! the whole table through the predicate; a tick's read with steps between
//! its pages must miss no row still unsent at its end; nothing may count as
//! sent that was not recorded or marked, and a sent row stays sent.

use crate::marking_ranges::{
    INSERT, Paged, brute_force, count_and_oldest, outbox_with_ranges, read, record_open, seqs,
};
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::outbox::progress::Ranges;
use outbox_relay::outbox::progress::fold::{Advance, Capture};
use std::collections::{BTreeSet, VecDeque};
use std::time::Duration;
use tokio_postgres::Client;

/// A writer holding a transaction open, or idle.
struct Writer {
    client: Client,
    open: bool,
}

/// What a history did, for the checks.
#[derive(Default)]
struct Ledger {
    /// Every `relay_seq` recorded or marked.
    confirmed: BTreeSet<i64>,
    /// Rows that counted as sent at the last check.
    sent: BTreeSet<i64>,
    reads: usize,
    advanced: usize,
    held: u64,
    deleted: u64,
    backlog: usize,
    /// Rows retention deleted.
    retained: usize,
    /// Reads with recordings, marks, folds or retention between their
    /// pages, and of them those with rows of their view still unsent at
    /// their end (whose completeness was checked).
    interleaved: usize,
    completed: usize,
}

async fn check_sent(db: &TestDb, ranges: &Ranges, ledger: &mut Ledger, step: &str) {
    let sent: BTreeSet<i64> = seqs(
        &db.client,
        &format!(
            "SELECT relay_seq FROM outbox WHERE {}(relay_seq, relay_xid, relay_sent_at)",
            ranges.sent_function.quoted()
        ),
        &[],
    )
    .await
    .into_iter()
    .collect();
    let unconfirmed: Vec<_> = sent.difference(&ledger.confirmed).collect();
    assert!(
        unconfirmed.is_empty(),
        "{step}: counted as sent, never recorded or marked: {unconfirmed:?}"
    );
    // A recorded row is sent from the moment it is visible (recorded ahead
    // of its commit, as CDC does), whatever the fold did meanwhile.
    let visible = seqs(&db.client, "SELECT relay_seq FROM outbox", &[]).await;
    let confirmed_unsent: Vec<_> = visible
        .iter()
        .filter(|s| ledger.confirmed.contains(s) && !sent.contains(s))
        .collect();
    assert!(
        confirmed_unsent.is_empty(),
        "{step}: recorded or marked, yet unsent: {confirmed_unsent:?}"
    );
    let unsent_again: Vec<_> = ledger.sent.difference(&sent).collect();
    assert!(
        unsent_again.is_empty(),
        "{step}: sent rows became unsent: {unsent_again:?}"
    );
    ledger.sent = sent;
}

/// One run of retention's batches with the newest frontier as its cut-off's;
/// returns the rows it deleted.
async fn retain(client: &Client, ranges: &Ranges) -> BTreeSet<i64> {
    let all = "SELECT relay_seq FROM outbox";
    let before: BTreeSet<i64> = seqs(client, all, &[]).await.into_iter().collect();
    let cutoff = chrono::Utc::now() + chrono::Duration::hours(1);
    let table = TableName::new("public", "outbox");
    let mut from = String::from("0");
    let mut total = 0;
    loop {
        let row = client
            .query_one(
                &ranges.retention_delete_sql(&table),
                &[&cutoff, &3i64, &from],
            )
            .await
            .expect("a retention batch");
        let (n, end): (i64, Option<String>) = (row.get(0), row.get(1));
        total += n as usize;
        match end {
            Some(end) if n == 3 => from = end,
            _ => break,
        }
    }
    let after: BTreeSet<i64> = seqs(client, all, &[]).await.into_iter().collect();
    let deleted: BTreeSet<i64> = before.difference(&after).copied().collect();
    assert_eq!(deleted.len(), total, "what the batches counted");
    deleted
}

/// One random history: its tables, its sessions and what it did.
struct History {
    rng: fastrand::Rng,
    db: TestDb,
    ranges: Ranges,
    writers: Vec<Writer>,
    fold: Client,
    round: Client,
    captures: VecDeque<Capture>,
    /// The last polling tick's snapshot and highest `relay_seq`.
    tick: Option<(String, Option<i64>)>,
    ledger: Ledger,
}

/// One random history of `steps` steps; checks after each.
async fn history(seed: u64, steps: usize) -> Ledger {
    let mut h = History::new(seed).await;
    for step in 0..steps {
        let what = h.rng.u32(0..100);
        let label = format!("seed {seed} step {step} ({what})");
        if what < CHANGES {
            h.change(what, &label).await;
        } else if what < 96 {
            h.reads(step, &label).await;
        } else {
            h.read_while_changing(&label).await;
        }
        check_sent(&h.db, &h.ranges, &mut h.ledger, &label).await;
    }
    h.ledger
}

/// The steps below this number change the tables; the others read.
const CHANGES: u32 = 87;

impl History {
    async fn new(seed: u64) -> Self {
        let db = TestDb::new().await;
        let ranges = outbox_with_ranges(&db).await;
        let mut writers = Vec::new();
        for _ in 0..4 {
            writers.push(Writer {
                client: connect(&db.url).await,
                open: false,
            });
        }
        History {
            rng: fastrand::Rng::with_seed(seed),
            fold: connect(&db.url).await,
            round: connect(&db.url).await,
            db,
            ranges,
            writers,
            captures: VecDeque::new(),
            tick: None,
            ledger: Ledger::default(),
        }
    }

    /// A step that writes: an application's transactions, the relay's
    /// recordings, another mode's marks, the fold's two steps, retention.
    async fn change(&mut self, what: u32, label: &str) {
        let (db, ranges, rng, ledger) = (&self.db, &self.ranges, &mut self.rng, &mut self.ledger);
        match what {
            0..=29 => {
                let w = &mut self.writers[rng.usize(0..4)];
                if !w.open {
                    w.client.batch_execute("BEGIN").await.unwrap();
                    w.open = true;
                }
                for _ in 0..rng.u32(1..4) {
                    w.client.batch_execute(INSERT).await.unwrap();
                }
                if rng.bool() {
                    w.client.batch_execute("COMMIT").await.unwrap();
                    w.open = false;
                }
            }
            30..=44 => {
                let w = &mut self.writers[rng.usize(0..4)];
                if w.open {
                    let end = if rng.u32(0..5) == 0 {
                        "ROLLBACK"
                    } else {
                        "COMMIT"
                    };
                    w.client.batch_execute(end).await.unwrap();
                    w.open = false;
                }
            }
            45..=59 => {
                // The relay confirms some of what it read.
                let unsent = brute_force(&db.client, ranges, None).await;
                let batch: Vec<i64> = unsent.into_iter().filter(|_| rng.u32(0..3) > 0).collect();
                ranges.record(&db.client, &batch).await.unwrap();
                ledger.confirmed.extend(batch);
            }
            60..=61 => {
                // CDC confirms a transaction decoded from the WAL a moment
                // before its rows are visible: recorded ahead of its commit.
                let w = &self.writers[rng.usize(0..4)];
                if w.open {
                    let own = record_open(&db.client, &w.client, ranges).await;
                    ledger.confirmed.extend(own);
                }
            }
            62..=63 => {
                // Another marking mode (or an operator) sets relay_sent_at.
                if let Some(&seq) = brute_force(&db.client, ranges, None).await.first() {
                    db.client
                        .execute(
                            "UPDATE outbox SET relay_sent_at = now() WHERE relay_seq = $1",
                            &[&seq],
                        )
                        .await
                        .unwrap();
                    ledger.confirmed.insert(seq);
                }
            }
            64..=73 => {
                // Now and then a quiet moment, so that some captures settle
                // (other tests' short transactions end within the wait).
                let quiet = rng.u32(0..3) == 0;
                if quiet {
                    for w in self.writers.iter_mut().filter(|w| w.open) {
                        w.client.batch_execute("COMMIT").await.unwrap();
                        w.open = false;
                    }
                }
                let settle = Duration::from_millis(if quiet { 2_000 } else { 30 });
                let capture = ranges.capture(&self.fold, settle).await.unwrap();
                self.captures.push_back(capture);
            }
            74..=83 => {
                if let Some(target) = self.captures.pop_front() {
                    let limit = if rng.bool() { 2 } else { 1000 };
                    match ranges
                        .advance(&mut self.fold, &target, limit)
                        .await
                        .unwrap()
                    {
                        Advance::Advanced { held, deleted, .. } => {
                            ledger.advanced += 1;
                            ledger.held += held;
                            ledger.deleted += deleted;
                            check_frontier(&db.client, ranges, &ledger.confirmed, label).await;
                        }
                        Advance::Backlog => ledger.backlog += 1,
                        Advance::Stale => panic!("{label}: captures are taken in order"),
                    }
                }
            }
            _ => {
                // Retention, at a cut-off after every frontier: it may
                // delete only rows that count as sent.
                let deleted = retain(&db.client, ranges).await;
                let unsent: Vec<_> = deleted.difference(&ledger.sent).collect();
                assert!(
                    unsent.is_empty(),
                    "{label}: retention deleted unsent rows {unsent:?}"
                );
                ledger.sent.retain(|s| !deleted.contains(s));
                ledger.retained += deleted.len();
            }
        }
    }

    /// A first read, a steady read and a CDC start-up round, with nothing
    /// else happening meanwhile: each must equal the predicate.
    async fn reads(&mut self, step: usize, label: &str) {
        let (db, ranges) = (&self.db, &self.ranges);
        let page = self.rng.i64(1..6);
        let (first, cur) = read(&db.client, ranges, &None, page).await;
        assert_eq!(
            first,
            brute_force(&db.client, ranges, None).await,
            "{label}: first read"
        );
        if let Some(base) = &self.tick {
            let (steady, _) = read(&db.client, ranges, &self.tick, page).await;
            let want = brute_force(&db.client, ranges, Some(&base.0)).await;
            assert_eq!(steady, want, "{label}: steady read");
        }
        // A CDC start-up round: the same read in one REPEATABLE
        // READ transaction, from the frontier or the previous read.
        let base = if step.is_multiple_of(2) {
            None
        } else {
            self.tick.clone()
        };
        let round = &self.round;
        round
            .batch_execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            .await
            .unwrap();
        let (got, _) = read(round, ranges, &base, page).await;
        let want = brute_force(round, ranges, base.as_ref().map(|b| b.0.as_str())).await;
        round.batch_execute("COMMIT").await.unwrap();
        assert_eq!(got, want, "{label}: a start-up round in one snapshot");
        self.tick = Some(cur);
        let sql = ranges.read_sql("relay_seq", "");
        assert_eq!(
            count_and_oldest(&db.client, &sql).await,
            (first.len() as i64, first.first().copied()),
            "{label}: backlog and oldest unsent"
        );
        self.ledger.reads += 1;
    }

    /// A read as a polling tick runs it, one statement per page, with
    /// commits, recordings, folds and retention between the pages. What it
    /// returns must be in order, visible in its snapshot *cur* and not in
    /// its base, and unsent when the read began; and it must return every
    /// row of *cur* not in the base that is still unsent when it ends: a
    /// row that became sent meanwhile may be skipped, no other.
    async fn read_while_changing(&mut self, label: &str) {
        let base = if self.rng.bool() {
            None
        } else {
            self.tick.clone()
        };
        let page = self.rng.i64(1..4);
        let sent_before = self.ledger.sent.clone();
        let mut read = Paged::first(&self.db.client, &self.ranges, &base, page).await;
        // The read's view (visible in cur, not in the base), before any
        // step between the pages could delete a row of it.
        let in_view = "SELECT relay_seq FROM outbox
             WHERE pg_visible_in_snapshot(relay_xid, $1::text::pg_snapshot)
               AND ($2::text IS NULL OR NOT pg_visible_in_snapshot(relay_xid, $2::text::pg_snapshot))";
        let view: BTreeSet<i64> = seqs(&self.db.client, in_view, &[&read.cur, read.base()])
            .await
            .into_iter()
            .collect();
        // Steps between the pages that can change what counts as sent.
        let mut changed = 0;
        while !read.done() {
            for _ in 0..self.rng.u32(0..3) {
                let what = self.rng.u32(0..CHANGES);
                changed += usize::from(what >= 45);
                let step = format!("{label}, between pages ({what})");
                self.change(what, &step).await;
                check_sent(&self.db, &self.ranges, &mut self.ledger, &step).await;
            }
            read.next(&self.db.client).await;
        }
        let got = read.got;
        assert!(
            got.windows(2).all(|w| w[0] < w[1]),
            "{label}: out of order {got:?}"
        );
        let early: Vec<_> = got.iter().filter(|s| sent_before.contains(s)).collect();
        assert!(
            early.is_empty(),
            "{label}: read rows sent before it began: {early:?}"
        );
        let outside: Vec<_> = got.iter().filter(|s| !view.contains(s)).collect();
        assert!(
            outside.is_empty(),
            "{label}: read rows outside its view: {outside:?}"
        );
        let unsent: Vec<i64> = brute_force(&self.db.client, &self.ranges, None)
            .await
            .into_iter()
            .filter(|s| view.contains(s))
            .collect();
        let missed: Vec<_> = unsent.iter().filter(|s| !got.contains(s)).collect();
        assert!(
            missed.is_empty(),
            "{label}: missed unsent rows {missed:?} (read {got:?})"
        );
        if changed > 0 {
            self.ledger.interleaved += 1;
            self.ledger.completed += usize::from(!unsent.is_empty());
        }
    }
}

/// I2, as it can be seen after the round (its progress rows may be gone):
/// every row visible in the frontier and not held open was recorded or
/// marked.
async fn check_frontier(client: &Client, ranges: &Ranges, confirmed: &BTreeSet<i64>, label: &str) {
    let passed: Vec<i64> = seqs(
        client,
        &format!(
            "SELECT o.relay_seq FROM outbox o
             WHERE pg_visible_in_snapshot(o.relay_xid, ({frontier}))
               AND NOT EXISTS (SELECT 1 FROM {held} h WHERE h.relay_seq = o.relay_seq)",
            frontier = ranges.frontier_snapshot(),
            held = ranges.held.quoted(),
        ),
        &[],
    )
    .await
    .into_iter()
    .filter(|s| !confirmed.contains(s))
    .collect();
    assert!(
        passed.is_empty(),
        "{label}: the frontier passed unconfirmed rows {passed:?}"
    );
}

#[tokio::test]
async fn reads_equal_the_predicate_and_nothing_counts_as_sent_unconfirmed_over_random_histories() {
    let mut total = Ledger::default();
    for seed in 1..=8 {
        let l = history(seed, 200).await;
        total.reads += l.reads;
        total.advanced += l.advanced;
        total.held += l.held;
        total.deleted += l.deleted;
        total.backlog += l.backlog;
        total.retained += l.retained;
        total.interleaved += l.interleaved;
        total.completed += l.completed;
    }
    // The histories reach every path: reads, folds that hold rows open,
    // delete progress rows, and give up while many rows are unrecorded.
    assert!(total.reads > 50, "reads {}", total.reads);
    assert!(total.advanced > 20, "advanced {}", total.advanced);
    assert!(total.held > 0, "no row was ever held open");
    assert!(total.deleted > 0, "no progress row was ever deleted");
    assert!(total.backlog > 0, "no fold ever gave up");
    assert!(total.retained > 0, "retention never deleted a row");
    assert!(
        total.interleaved > 20,
        "interleaved reads {}",
        total.interleaved
    );
    assert!(
        total.completed > 10,
        "interleaved reads that ended with unsent rows {}",
        total.completed
    );
}
