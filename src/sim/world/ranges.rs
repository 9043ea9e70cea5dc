//! `relay.mark = "ranges"` in the simulated database: the progress rows the
//! acker records, the frontier, the rows held open, and the two steps of a
//! fold round, a double of `outbox::progress::fold` (whose SQL is proven
//! against PostgreSQL in `tests/relay/ranges_histories.rs`). The simulated
//! readers evaluate the predicate ([`World::is_sent`]) where the SQL ones
//! run their queries.

use super::*;
use crate::source::cdc::snapshot::Snapshot;

/// The three tables of ranges, and the fold's lock.
#[derive(Debug, Default)]
pub struct Progress {
    next_id: u64,
    /// The progress rows: id → the `relay_seq` values it names.
    rows: BTreeMap<u64, Vec<i64>>,
    /// How many progress rows name each `relay_seq`.
    recorded: BTreeMap<i64, u32>,
    /// The newest frontier (`None` before the first fold).
    frontier: Option<Snapshot>,
    held: BTreeSet<i64>,
    /// How the instances fold (`None`: another marking mode, no fold).
    pub settings: Option<crate::sim::fold::FoldSettings>,
    /// The instance whose folding session holds the fold lock.
    pub fold_lock: Option<usize>,
    /// What the folds did, for the totals.
    pub counts: FoldCounts,
}

/// What the folds of a schedule did: the suite fails when its schedules
/// stop driving a kind of round.
#[derive(Debug, Default, Clone, Copy)]
pub struct FoldCounts {
    /// Frontiers written.
    pub advances: u64,
    /// Of them, from captures that did not settle (progress rows deleted
    /// one by one, by counting their rows visible).
    pub unsettled: u64,
    /// Rounds that found the relay draining (more rows to hold than the limit).
    pub backlogs: u64,
    /// Rows held open.
    pub held: u64,
    /// Progress rows deleted by rounds whose capture did not settle (one
    /// by one, by counting their rows visible).
    pub deleted_unsettled: u64,
    /// Schedules that switched from `update` to ranges while running.
    pub upgrades: u64,
}

/// What a capture keeps for the round after it (`fold::Capture`).
#[derive(Debug, Clone)]
pub struct Capture {
    pub snapshot: Snapshot,
    /// The newest progress row when the capture began (0: none).
    pub progress: u64,
    pub settled: bool,
}

/// What a round's second step did (`fold::Advance`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Advance {
    Advanced,
    Backlog,
    Stale,
}

/// Whether a committed transaction is visible in `s`.
fn visible(s: &Snapshot, xid: u64) -> bool {
    s.saw_finished(xid)
}

impl World {
    /// Records a confirmed batch as one progress row; it names its rows
    /// whether or not their transaction is visible yet.
    pub fn record(&mut self, seqs: &[i64]) {
        if seqs.is_empty() {
            return;
        }
        let p = &mut self.progress;
        p.next_id += 1;
        for s in seqs {
            *p.recorded.entry(*s).or_default() += 1;
        }
        p.rows.insert(p.next_id, seqs.to_vec());
    }

    /// The predicate `<outbox>_relay_sent`: marked, recorded, or visible in
    /// the frontier and not held open.
    pub fn is_sent(&self, row: &Row) -> bool {
        let p = &self.progress;
        row.sent
            || p.recorded.contains_key(&row.seq)
            || (p.frontier.as_ref().is_some_and(|f| visible(f, row.xid))
                && !p.held.contains(&row.seq))
    }

    /// The newest progress row's id (0: none).
    pub fn newest_progress(&self) -> u64 {
        self.progress.rows.keys().next_back().copied().unwrap_or(0)
    }

    /// A snapshot as another session takes it: a commit not yet visible to
    /// other sessions counts as still running.
    pub fn session_snapshot(&self) -> Snapshot {
        let mut s = self.snapshot();
        s.xip.extend(self.unseen.iter().copied());
        s.xip.sort_unstable();
        s.xip.dedup();
        s.xmin = s.xip.first().copied().unwrap_or(s.xmax);
        s
    }

    /// `pg_current_xact_id()` as a statement of its own: a transaction id,
    /// committed at once (it names no row, so no WAL here).
    pub fn take_xid(&mut self) -> u64 {
        let xid = self.begin();
        self.txs.insert(xid, TxState::Committed);
        xid
    }

    /// The fold's lock: taken when free (or already held by `instance`).
    pub fn take_fold_lock(&mut self, instance: usize) -> bool {
        match self.progress.fold_lock {
            Some(i) => i == instance,
            None => {
                self.progress.fold_lock = Some(instance);
                true
            }
        }
    }

    /// `instance`'s folding session ended.
    pub fn release_fold_lock(&mut self, instance: usize) {
        if self.progress.fold_lock == Some(instance) {
            self.progress.fold_lock = None;
        }
    }

    /// Nothing left for the fold: no progress row, no held row.
    pub fn fold_caught_up(&self) -> bool {
        self.progress.rows.is_empty() && self.progress.held.is_empty()
    }

    /// The second step of a round, in one transaction: holds open the rows
    /// the frontier would pass unrecorded (unless more than `limit`), closes
    /// held rows recorded or marked since, moves the frontier to the
    /// capture, and deletes the progress rows it covers. Checks that no row
    /// counts as sent unless the broker confirmed it (or it was
    /// dead-lettered), and that no sent row becomes unsent.
    pub fn advance_fold(&mut self, target: &Capture, limit: usize) -> Advance {
        let s = &target.snapshot;
        if let Some(f) = &self.progress.frontier {
            let stale = s.xmax < f.xmax || s.xip.iter().any(|x| *x < f.xmax && !f.xip.contains(x));
            if stale {
                return Advance::Stale;
            }
        }
        let before: BTreeSet<i64> = self
            .table_rows()
            .filter(|r| self.is_sent(r))
            .map(|r| r.seq)
            .collect();
        let frontier = self.progress.frontier.clone();
        let unrecorded: Vec<i64> = self
            .table_rows()
            .filter(|r| !r.sent && visible(s, r.xid))
            .filter(|r| !frontier.as_ref().is_some_and(|f| visible(f, r.xid)))
            .filter(|r| !self.progress.recorded.contains_key(&r.seq))
            .map(|r| r.seq)
            .collect();
        if unrecorded.len() > limit {
            self.progress.counts.backlogs += 1;
            return Advance::Backlog;
        }
        let closed: Vec<i64> = self
            .progress
            .held
            .iter()
            .copied()
            .filter(|seq| {
                self.progress.recorded.contains_key(seq)
                    || self.rows.get(seq).is_some_and(|r| r.sent)
            })
            .collect();
        let p = &mut self.progress;
        p.held.extend(unrecorded.iter().copied());
        for seq in &closed {
            p.held.remove(seq);
        }
        self.check_passed(s, frontier.as_ref());
        let p = &mut self.progress;
        p.frontier = Some(s.clone());
        p.counts.advances += 1;
        p.counts.unsettled += u64::from(!target.settled);
        p.counts.held += unrecorded.len() as u64;
        let gone: Vec<u64> = p
            .rows
            .range(..=target.progress)
            .filter(|(_, seqs)| {
                target.settled
                    || seqs
                        .iter()
                        .all(|seq| self.rows.get(seq).is_some_and(|r| visible(s, r.xid)))
            })
            .map(|(id, _)| *id)
            .collect();
        if !target.settled {
            p.counts.deleted_unsettled += gone.len() as u64;
        }
        for id in &gone {
            if let Some(seqs) = p.rows.remove(id) {
                for seq in seqs {
                    if let Some(n) = p.recorded.get_mut(&seq) {
                        *n -= 1;
                        if *n == 0 {
                            p.recorded.remove(&seq);
                        }
                    }
                }
            }
        }
        self.note(format!(
            "fold: frontier {s:?}, held {unrecorded:?}, closed {closed:?}, deleted progress {gone:?} (settled: {})",
            target.settled
        ));
        self.check_fold(&before);
        Advance::Advanced
    }

    /// I2, before a frontier is written: every row it passes (visible in
    /// the capture, not in the frontier) is marked, recorded or held open.
    fn check_passed(&mut self, capture: &Snapshot, frontier: Option<&Snapshot>) {
        let passed: Vec<String> = self
            .table_rows()
            .filter(|r| visible(capture, r.xid) && !frontier.is_some_and(|f| visible(f, r.xid)))
            .filter(|r| {
                !(r.sent
                    || self.progress.recorded.contains_key(&r.seq)
                    || self.progress.held.contains(&r.seq))
            })
            .map(|r| format!("row {} (event {})", r.seq, r.id))
            .take(5)
            .collect();
        if !passed.is_empty() && self.violations.len() < 10 {
            self.violation(format!(
                "a fold round moves the frontier past {} neither marked, recorded nor held open",
                passed.join(", ")
            ));
        }
    }

    /// After a round: every row sent before still is, and every row that
    /// counts as sent was confirmed by the broker or dead-lettered.
    fn check_fold(&mut self, before: &BTreeSet<i64>) {
        let confirmed: BTreeSet<&str> = self
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .chain(self.letters.iter().map(|l| l.event_id.as_str()))
            .collect();
        let mut problems = Vec::new();
        for r in self.table_rows() {
            let sent = self.is_sent(r);
            if before.contains(&r.seq) && !sent {
                problems.push(format!(
                    "row {} (event {}) was sent and counts as unsent after a fold round",
                    r.seq, r.id
                ));
            }
            if sent && !confirmed.contains(r.id.as_str()) {
                problems.push(format!(
                    "row {} (event {}) counts as sent after a fold round, but the broker never confirmed it",
                    r.seq, r.id
                ));
            }
        }
        // A few are enough to tell the story, and a broken fold repeats
        // them every round.
        if self.violations.len() < 10 {
            for p in problems.into_iter().take(5) {
                self.violation(p);
            }
        }
    }

    /// The committed rows in the table (logical messages are not).
    fn table_rows(&self) -> impl Iterator<Item = &Row> {
        self.rows
            .values()
            .filter(|r| !r.message && self.committed(r.xid))
    }
}
