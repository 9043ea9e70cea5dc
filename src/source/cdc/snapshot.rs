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
            candidate + EPOCH
        } else {
            candidate
        }
    }

    /// Whether a committed transaction had committed when the snapshot was taken.
    pub fn saw_committed(&self, xid: u32) -> bool {
        let x = self.widen(xid);
        x < self.xmin || (x < self.xmax && !self.xip.contains(&x))
    }
}

/// The start-up read's view, while the stream is before `until`.
#[derive(Debug, Clone)]
pub struct StartupView {
    pub snapshot: Snapshot,
    /// The WAL insert position read right after the snapshot was taken.
    pub until: Lsn,
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

    #[test]
    fn a_transaction_is_covered_only_if_the_snapshot_saw_it_committed() {
        let view = StartupView {
            snapshot: Snapshot::parse("100:105:101,103").unwrap(),
            until: Lsn(1000),
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
    }
}
