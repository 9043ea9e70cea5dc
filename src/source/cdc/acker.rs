//! The CDC acknowledging half: marks confirmed rows (when marking) and
//! dead letters on the ownership connection, then lets [`Progress`] move the
//! flushed WAL position past them.

use super::progress::{CATCH_UP, CdcPosition};
use super::stream::{SharedProgress, lock};
use crate::dead_letter::DeadLetter;
use crate::replication::Lsn;
use crate::source::record::{RowRecorder, RowStore};
use crate::source::{Acker, SourceError};
use std::collections::HashSet;

/// Marks confirmed rows (when marking) on the ownership connection, then
/// confirms their positions so the flushed WAL position can advance.
pub struct CdcAcker<S = RowRecorder> {
    recorder: S,
    progress: SharedProgress,
    marks_rows: bool,
}

impl<S: RowStore> CdcAcker<S> {
    /// `marks_rows`: `relay.mark` is `update` or `delete`.
    pub fn new(recorder: S, progress: SharedProgress, marks_rows: bool) -> Self {
        CdcAcker {
            recorder,
            progress,
            marks_rows,
        }
    }
}

impl<S: RowStore> Acker for CdcAcker<S> {
    type Position = CdcPosition;
    type Store = S;

    fn store(&self) -> &S {
        &self.recorder
    }

    async fn ack(&mut self, positions: Vec<CdcPosition>) -> Result<(), SourceError> {
        let seqs: Vec<i64> = positions.iter().filter_map(|p| p.seq).collect();
        if !seqs.is_empty() {
            self.recorder
                .wait_visible(positions.iter().filter_map(|p| p.xid).collect())
                .await?;
        }
        self.recorder.mark(&seqs).await?;
        let mut progress = lock(&self.progress);
        for p in &positions {
            progress.confirm(p);
        }
        Ok(())
    }

    async fn dead_letter(
        &mut self,
        letters: Vec<DeadLetter<CdcPosition>>,
    ) -> Result<HashSet<String>, SourceError> {
        self.recorder
            .wait_visible(letters.iter().filter_map(|l| l.position.xid).collect())
            .await?;
        let w = self.recorder.dead_letter(&letters).await?;
        // A dead letter is as durable as a delivery: its position is done.
        let mut progress = lock(&self.progress);
        for i in &w.written {
            progress.confirm(&letters[*i].position);
        }
        Ok(w.resolved)
    }

    /// With rows marked, a held-back row stays unsent in the table and the
    /// start-up read of the next start or rewind finds it: the slot need not
    /// wait for it. Without marking, or for a logical message (no `seq`),
    /// the WAL is its only record, so it does.
    fn release(&mut self, positions: Vec<CdcPosition>) {
        if self.marks_rows {
            let mut progress = lock(&self.progress);
            for p in positions.iter().filter(|p| p.seq.is_some()) {
                progress.release(p);
            }
        }
    }
}

impl crate::source::RowPosition for CdcPosition {
    fn seq(&self) -> Option<i64> {
        self.seq
    }

    fn wal(&self) -> Option<(Lsn, u64)> {
        (self.commit_lsn != CATCH_UP).then_some((self.commit_lsn, self.index))
    }
}
