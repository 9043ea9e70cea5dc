//! Which WAL position may be reported to PostgreSQL as flushed.
//!
//! The reader registers every transaction it streams, in commit order, and
//! every outbox event in it; the acker confirms events once the broker
//! confirmed them (and the rows were marked). The flushed position is the
//! end LSN of the last transaction that is complete (its Commit seen) and
//! whose events, and every earlier transaction's, are all confirmed. With no
//! transaction outstanding, the position follows the server's WAL end from
//! keepalives, so an idle outbox on a busy server does not pin WAL.
//!
//! Events confirmed in transactions not yet flushed are remembered (up to a
//! cap), so that when the stream restarts from the flushed position they are
//! skipped instead of sent twice; so are, whole, the runs of transactions
//! complete behind an unfinished one when it restarts (uncapped, as bounded
//! as the transactions tracked).

use crate::replication::Lsn;
use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use tokio::sync::Notify;

/// Where an event sits in the stream: its transaction's commit LSN and its
/// index in the transaction (for rows from the start-up table read, the
/// pseudo-transaction [`CATCH_UP`] and the row's `relay_seq`). The same event
/// streamed again gets the same position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct CdcPosition {
    pub commit_lsn: Lsn,
    pub index: u64,
    /// The row's `relay_seq`, used to mark it sent.
    pub seq: Option<i64>,
    /// The inserting transaction's id, for streamed rows: decoding can see a
    /// commit before other sessions do, so marking waits until it is visible.
    pub xid: Option<u32>,
}

/// The commit LSN of the start-up table read, which precedes every streamed transaction.
pub const CATCH_UP: Lsn = Lsn(0);

#[derive(Debug)]
struct Tx {
    commit_lsn: Lsn,
    /// Known once the Commit message arrived.
    end_lsn: Option<Lsn>,
    total: u64,
    confirmed: u64,
    /// Events of it held back (see [`Progress::release`]): replayed, they
    /// are read again, so the transaction is not skipped whole.
    released: u64,
}

impl Tx {
    fn complete(&self) -> bool {
        self.end_lsn.is_some() && self.confirmed >= self.total
    }
}

/// Progress shared by the CDC reader and acker.
#[derive(Debug)]
pub struct Progress {
    flushed: Lsn,
    txs: VecDeque<Tx>,
    confirmed_ahead: BTreeSet<(Lsn, u64)>,
    ahead_cap: usize,
    /// Runs of transactions, from the first's commit LSN to the last's end
    /// (exclusive: the next transaction's commit record may start right
    /// there), that were complete (none of their events released) when the
    /// stream restarted behind an unfinished one: replayed, each is skipped
    /// whole. Sorted and disjoint; one per run between unfinished ones.
    done_spans: Vec<(Lsn, Lsn)>,
    /// The server's WAL end from the latest keepalive.
    server_end: Lsn,
    /// The highest flushed position a status update told the server.
    told: Lsn,
    /// The server's timeline at the last (re)start, when known.
    timeline: Option<u32>,
    /// Events confirmed since the flushed position was last reported.
    unreported: u64,
    /// Confirmations that make a report due (see [`Progress::report_every`]).
    report_every: u64,
    /// Woken when `unreported` reaches `report_every`.
    report_due: Arc<Notify>,
}

impl Progress {
    /// `ahead_cap`: confirmed-but-unflushed events remembered at most.
    pub fn new(flushed: Lsn, ahead_cap: usize) -> Self {
        Progress {
            flushed,
            txs: VecDeque::new(),
            confirmed_ahead: BTreeSet::new(),
            ahead_cap,
            done_spans: Vec::new(),
            server_end: flushed,
            told: flushed,
            timeline: None,
            unreported: 0,
            report_every: u64::MAX,
            report_due: Arc::new(Notify::new()),
        }
    }

    /// A report falls due once `every` confirmations piled up: the reader
    /// waiting on [`Progress::report_due`] is woken then, not at its next
    /// look, so that no more than `every` confirmed events are left for a
    /// crash to repeat.
    pub fn report_every(&mut self, every: u64) {
        self.report_every = every.max(1);
    }

    /// Woken when a report falls due (see [`Progress::report_every`]).
    pub fn report_due(&self) -> Arc<Notify> {
        Arc::clone(&self.report_due)
    }

    /// The position to report as flushed.
    pub fn flushed(&self) -> Lsn {
        self.flushed
    }

    /// Events confirmed since [`Progress::reported`]: a restart after a
    /// crash sends them again unless the flushed position is reported.
    pub fn unreported(&self) -> u64 {
        self.unreported
    }

    /// The flushed position `told` was just reported to the server,
    /// covering the first `counted` of the [`Progress::unreported`]
    /// confirmations (those that came while it was sent are still to report).
    pub fn reported(&mut self, told: Lsn, counted: u64) {
        self.told = self.told.max(told);
        self.unreported = self.unreported.saturating_sub(counted);
        if self.unreported >= self.report_every {
            // A window came while it was sent: its wake-up was spent on this one.
            self.report_due.notify_one();
        }
    }

    /// Nothing read is waiting for the broker.
    pub fn idle(&self) -> bool {
        self.txs.is_empty()
    }

    /// The stream restarts from [`Progress::flushed`]: forget the transactions
    /// read since (they come again), keep the confirmations to skip them.
    /// `slot_flushed` is the slot's own confirmed position, which may be ahead
    /// if a status update went out before a restart, or behind when the
    /// server did not save what it was told (a restart or crash before a
    /// checkpoint): the same WAL, so the relay's own position stands.
    ///
    /// On a new `timeline` (a standby was promoted), the WAL past the slot
    /// may hold other transactions than the relay saw, at the positions it
    /// remembers: nothing is skipped (a repeat, never a loss). With the
    /// slot behind the relay's position (what it told the old server, or
    /// confirmed since without telling it: the standby may never have
    /// received that WAL), the stream starts from the slot.
    pub fn restart(&mut self, slot_flushed: Lsn, timeline: Option<u32>) {
        let new_history = matches!((self.timeline, timeline), (Some(a), Some(b)) if a != b);
        if new_history {
            // Past the slot, the promoted server's WAL may hold other
            // transactions at the positions remembered: skip none of them.
            self.done_spans.clear();
            self.confirmed_ahead.clear();
        } else {
            self.keep_done_spans();
        }
        self.txs.clear();
        if timeline.is_some() {
            self.timeline = timeline;
        }
        if new_history && slot_flushed < self.flushed {
            tracing::warn!(
                slot = %slot_flushed,
                told = %self.told,
                "the server is on a new timeline (a failover) and its slot is behind the position the relay confirmed before: streaming from the slot; events after it may be sent again"
            );
            self.flushed = slot_flushed;
            self.told = slot_flushed;
        }
        self.flushed = self.flushed.max(slot_flushed);
        self.server_end = self.flushed;
        let flushed = self.flushed;
        // The start-up table read is redone from the rows still unsent.
        self.confirmed_ahead.retain(|(lsn, _)| *lsn >= flushed);
        self.done_spans.retain(|(_, end)| *end > flushed);
    }

    /// Before the transactions read are forgotten: the complete ones still
    /// waiting behind an unfinished one join [`Progress::done_spans`]
    /// (merged with those kept from earlier restarts). Every transaction
    /// committed within a span was streamed, in commit order, and each of
    /// its events confirmed (or dead-lettered). The start-up table read's
    /// rows are not streamed again, so it never makes one.
    fn keep_done_spans(&mut self) {
        let done = self
            .txs
            .iter()
            .filter(|t| t.complete() && t.released == 0 && t.commit_lsn != CATCH_UP);
        let mut spans: Vec<(Lsn, Lsn)> = done
            .filter_map(|t| t.end_lsn.map(|end| (t.commit_lsn, end)))
            .chain(self.done_spans.drain(..))
            .collect();
        spans.sort_unstable();
        for (start, end) in spans {
            match self.done_spans.last_mut() {
                Some(last) if start <= last.1 => last.1 = last.1.max(end),
                _ => self.done_spans.push((start, end)),
            }
        }
    }

    /// Whether the transaction committed at `commit_lsn` lies in a span of
    /// complete ones (see [`Progress::done_spans`]).
    fn in_done_span(&self, commit_lsn: Lsn) -> bool {
        let after = self
            .done_spans
            .partition_point(|(start, _)| *start <= commit_lsn);
        after > 0 && commit_lsn < self.done_spans[after - 1].1
    }

    /// The slot was moved to `lsn`, past WAL the start-up read accounts
    /// for, or found there when a stream opened (another instance moved
    /// it): nothing before it will be streamed again.
    pub fn skipped_to(&mut self, lsn: Lsn) {
        self.flushed = self.flushed.max(lsn);
        self.server_end = self.server_end.max(self.flushed);
        let flushed = self.flushed;
        self.confirmed_ahead.retain(|(l, _)| *l >= flushed);
        self.done_spans.retain(|(_, end)| *end > flushed);
    }

    /// Events known to be done (dead-lettered) past the flushed position:
    /// skipped when the stream replays them.
    pub fn remember(&mut self, done: &[(Lsn, u64)]) {
        for d in done {
            if self.confirmed_ahead.len() >= self.ahead_cap {
                break;
            }
            if d.0 >= self.flushed {
                self.confirmed_ahead.insert(*d);
            }
        }
    }

    /// A transaction starts (Begin, or the start-up table read).
    pub fn begin(&mut self, commit_lsn: Lsn) {
        self.txs.push_back(Tx {
            commit_lsn,
            end_lsn: None,
            total: 0,
            confirmed: 0,
            released: 0,
        });
    }

    /// An event of the current transaction was read. Returns `false` when it
    /// was already confirmed before a restart: the caller skips it.
    pub fn event(&mut self, pos: &CdcPosition) -> bool {
        let already = self.confirmed_ahead.contains(&(pos.commit_lsn, pos.index))
            || self.in_done_span(pos.commit_lsn);
        if let Some(tx) = self.txs.back_mut() {
            tx.total += 1;
            if already {
                tx.confirmed += 1;
            }
        }
        !already
    }

    /// The current transaction ended at `end_lsn`.
    ///
    /// A transaction without outbox events that waits behind an unfinished
    /// one is folded into it (the earlier one now ends where this one does):
    /// flushing either means flushing both, and a busy server's unrelated
    /// transactions cannot pile up while the broker is away.
    pub fn commit(&mut self, end_lsn: Lsn) {
        let len = self.txs.len();
        if len >= 2 && self.txs.back().is_some_and(|t| t.total == 0) {
            self.txs.pop_back();
            if let Some(prev) = self.txs.back_mut() {
                prev.end_lsn = Some(end_lsn);
            }
        } else if let Some(tx) = self.txs.back_mut() {
            tx.end_lsn = Some(end_lsn);
            let last = self.txs.len() - 1;
            if last > 0 && self.txs[last].complete() {
                self.merge_complete(last);
            }
        }
        self.advance();
    }

    /// The broker confirmed the event (and its row was marked).
    pub fn confirm(&mut self, pos: &CdcPosition) {
        self.unreported += 1;
        if self.unreported == self.report_every {
            self.report_due.notify_one();
        }
        if self.settle(pos, false) && self.confirmed_ahead.len() < self.ahead_cap {
            self.confirmed_ahead.insert((pos.commit_lsn, pos.index));
        }
        self.advance();
    }

    /// The event is held back and stays unsent in the table (rows are
    /// marked), where the next start-up read finds it: it no longer holds
    /// the flushed position back, and a replay of it is not skipped.
    pub fn release(&mut self, pos: &CdcPosition) {
        self.settle(pos, true);
        self.advance();
    }

    /// Counts the event as done (`released`: held back) in its transaction;
    /// false when the transaction is not tracked (from before a restart).
    fn settle(&mut self, pos: &CdcPosition, released: bool) -> bool {
        // Transactions are registered in commit order.
        let Ok(i) = self
            .txs
            .binary_search_by_key(&pos.commit_lsn, |t| t.commit_lsn)
        else {
            return false; // from before a restart: it will be read, and skipped, again
        };
        self.txs[i].confirmed += 1;
        self.txs[i].released += u64::from(released);
        if i > 0 && self.txs[i].complete() {
            self.merge_complete(i);
        }
        true
    }

    /// Complete transactions waiting behind an unfinished one are merged
    /// with their complete neighbours, so one held-back event keeps a
    /// bounded tracker (one entry per unfinished transaction, and at most
    /// one between two of them) while everything after it flows.
    fn merge_complete(&mut self, i: usize) {
        let mut i = i;
        if i > 1 && self.txs[i - 1].complete() {
            i -= 1;
            self.absorb_next(i);
        }
        if i + 1 < self.txs.len() && self.txs[i + 1].complete() {
            self.absorb_next(i);
        }
    }

    /// `txs[i]` takes over `txs[i + 1]` (both complete).
    fn absorb_next(&mut self, i: usize) {
        if let Some(next) = self.txs.remove(i + 1) {
            let tx = &mut self.txs[i];
            tx.end_lsn = next.end_lsn.max(tx.end_lsn);
            tx.total += next.total;
            tx.confirmed += next.confirmed;
            tx.released += next.released;
        }
    }

    /// A keepalive reported the server's WAL end.
    pub fn server_end(&mut self, lsn: Lsn) {
        self.server_end = self.server_end.max(lsn);
        if self.txs.is_empty() {
            self.flushed = self.flushed.max(self.server_end);
        }
    }

    fn advance(&mut self) {
        let mut popped = false;
        while self.txs.front().is_some_and(Tx::complete) {
            let Some(tx) = self.txs.pop_front() else {
                break;
            };
            if let Some(end) = tx.end_lsn {
                self.flushed = self.flushed.max(end);
            }
            popped = true;
        }
        // The flushed transactions' confirmations are no longer needed for
        // skipping: every transaction committed before the flushed position
        // is done (merged ones included); drop them in one cut.
        if popped
            && self
                .confirmed_ahead
                .first()
                .is_some_and(|(l, _)| *l < self.flushed)
        {
            self.confirmed_ahead = self.confirmed_ahead.split_off(&(self.flushed, 0));
        }
        if popped {
            let flushed = self.flushed;
            self.done_spans.retain(|(_, end)| *end > flushed);
        }
        if self.txs.is_empty() {
            self.flushed = self.flushed.max(self.server_end);
        }
    }

    /// Transactions read and not yet flushed (for metrics and tests).
    pub fn outstanding(&self) -> usize {
        self.txs.len()
    }
}

#[cfg(test)]
mod tests;
