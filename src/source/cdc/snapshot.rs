//! What the start-up read saw, and therefore what the stream may skip.
//!
//! When rows are marked, each start of the CDC reader first reads every
//! unsent row in one snapshot (`pg_current_snapshot()`), with the WAL insert
//! position taken in the same statement. Every transaction that snapshot
//! sees as committed is then fully accounted for by the table: its unsent
//! rows were just read, and its other rows were sent (marked) or removed
//! (marked by deletion, or replaced by a `dlq redrive`). So the stream skips
//! every such transaction outright, whatever it held; it only publishes
//! transactions the snapshot could not see. A transaction the snapshot sees
//! committed has its commit record before the insert position read after
//! it, so past that position nothing more is skipped.
//!
//! This is what keeps a restart (a crash, a reconnect, a rewind) from
//! publishing again what was marked before it, and a redrive's originals
//! from being published next to their copies.
//!
//! Skipping in the stream still costs the server a full decoding of that
//! WAL, which after a large backlog takes longer than publishing the
//! backlog. So the view also names a position, [`StartupView::settled`],
//! before which *every* committed transaction is one the snapshot saw: the
//! slot is moved there (PostgreSQL decodes in fast-forward, without the
//! output plugin) while the start-up read is published, and the stream
//! starts at it. A commit record is written before the transaction leaves
//! the process array, so the insert position read just before the snapshot
//! is not enough: the position is read first, then every transaction still
//! running at that moment is waited for, and only then is the read's
//! snapshot taken.

use crate::replication::Lsn;

/// A `pg_current_snapshot()`: transactions below `xmin` are finished, those
/// from `xmax` on had not started, and `xip` were running.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub xmin: u64,
    pub xmax: u64,
    pub xip: Vec<u64>,
}

impl Snapshot {
    /// Parses `xmin:xmax:xip1,xip2,...` (the text form of `pg_snapshot`).
    pub fn parse(text: &str) -> Option<Snapshot> {
        let mut parts = text.trim().splitn(3, ':');
        let xmin = parts.next()?.parse().ok()?;
        let xmax = parts.next()?.parse().ok()?;
        let xip = match parts.next()? {
            "" => Vec::new(),
            list => list
                .split(',')
                .map(|x| x.parse().ok())
                .collect::<Option<Vec<u64>>>()?,
        };
        (xmin <= xmax).then_some(Snapshot { xmin, xmax, xip })
    }

    /// The full transaction id of a recent 32-bit one (as pgoutput sends
    /// it): the one within 2^31 of `xmax`.
    pub fn widen(&self, xid: u32) -> u64 {
        const EPOCH: u64 = 1 << 32;
        let candidate = (self.xmax & !(EPOCH - 1)) | u64::from(xid);
        if candidate > self.xmax.saturating_add(EPOCH / 2) && candidate >= EPOCH {
            candidate - EPOCH
        } else if candidate.saturating_add(EPOCH / 2) < self.xmax {
            // Saturating: an id past every possible one (a snapshot no
            // server sends) is one the snapshot did not see, so its
            // transaction is streamed, never skipped.
            candidate.saturating_add(EPOCH)
        } else {
            candidate
        }
    }

    /// Whether a committed transaction had committed when the snapshot was taken.
    pub fn saw_committed(&self, xid: u32) -> bool {
        self.saw_finished(self.widen(xid))
    }

    /// Whether the transaction (a full id) had ended, committed or not,
    /// when the snapshot was taken.
    pub fn saw_finished(&self, xid: u64) -> bool {
        xid < self.xmin || (xid < self.xmax && !self.xip.contains(&xid))
    }
}

/// The start-up read's view, while the stream is before `until`.
#[derive(Debug, Clone)]
pub struct StartupView {
    pub snapshot: Snapshot,
    /// The WAL insert position read right after the snapshot was taken.
    pub until: Lsn,
    /// Every transaction committed before this position was seen committed
    /// by the snapshot, so the slot may be moved here without decoding the
    /// WAL before it. `None` when that could not be established (a
    /// transaction ran on for longer than the relay waits).
    pub settled: Option<Lsn>,
}

impl StartupView {
    /// True when the transaction (its 32-bit xid and commit LSN) is fully
    /// accounted for by the start-up read and must not be published again.
    pub fn covers(&self, xid: u32, commit_lsn: Lsn) -> bool {
        commit_lsn < self.until && self.snapshot.saw_committed(xid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_parse_and_refuse_garbage() {
        assert_eq!(
            Snapshot::parse("100:105:101,103"),
            Some(Snapshot {
                xmin: 100,
                xmax: 105,
                xip: vec![101, 103]
            })
        );
        assert_eq!(Snapshot::parse("7:7:").unwrap().xip, Vec::<u64>::new());
        for bad in ["", "1", "1:2", "5:2:", "a:b:", "1:9:x"] {
            assert_eq!(Snapshot::parse(bad), None, "{bad:?}");
        }
    }

    /// A row read at start-up may be far older than any 32-bit id can be
    /// placed from a snapshot: the start-up read compares the full id
    /// (`relay_xid`), which a 32-bit one would have placed an epoch later,
    /// unseen, so the next round would read the row again.
    #[test]
    fn an_old_row_is_seen_by_its_full_id() {
        let old: u64 = 7;
        let later = old + (1 << 31) + 10;
        let snapshot = Snapshot::parse(&format!("{later}:{later}:")).unwrap();
        assert!(snapshot.saw_finished(old));
        assert!(
            !snapshot.saw_committed(old as u32),
            "the 32-bit id misleads"
        );
    }

    #[test]
    fn a_transaction_is_covered_only_if_the_snapshot_saw_it_committed() {
        let view = StartupView {
            snapshot: Snapshot::parse("100:105:101,103").unwrap(),
            until: Lsn(1000),
            settled: None,
        };
        assert!(view.covers(99, Lsn(10)), "finished before xmin");
        assert!(view.covers(102, Lsn(10)), "committed between xmin and xmax");
        assert!(
            !view.covers(101, Lsn(10)),
            "running when the snapshot was taken"
        );
        assert!(!view.covers(105, Lsn(10)), "started after it");
        assert!(
            !view.covers(102, Lsn(1000)),
            "past the insert position nothing is skipped"
        );
    }

    #[test]
    fn ids_are_widened_across_the_epoch() {
        let s = Snapshot {
            xmin: (3 << 32) + 5,
            xmax: (3 << 32) + 10,
            xip: vec![],
        };
        assert_eq!(s.widen(7), (3 << 32) + 7);
        // Just before the epoch turned.
        assert_eq!(s.widen(u32::MAX - 2), (3 << 32) - 3);
        assert!(s.saw_committed(u32::MAX - 2));
        assert!(!s.saw_committed(12));
        // A snapshot at the very end of the id space: no overflow, and an
        // id past it counts as unseen (streamed, never skipped).
        let last = Snapshot::parse(&format!("{0}:{0}:", u64::MAX)).unwrap();
        assert!(!last.saw_committed(0));
    }

    #[test]
    fn finished_means_below_xmin_or_known_and_not_running() {
        let s = Snapshot::parse("100:105:101,103").unwrap();
        assert!(s.saw_finished(42));
        assert!(s.saw_finished(102));
        assert!(s.saw_finished(104));
        assert!(!s.saw_finished(101));
        assert!(!s.saw_finished(103));
        assert!(
            !s.saw_finished(105),
            "not started when the snapshot was taken"
        );
    }
}
