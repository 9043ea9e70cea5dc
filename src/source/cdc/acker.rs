//! The CDC acknowledging half: marks confirmed rows (when marking) and
//! dead letters on the ownership connection, then lets [`Progress`] move the
//! flushed WAL position past them.

use super::progress::{CATCH_UP, CdcPosition};
use super::stream::{SharedProgress, lock};
use crate::config::MarkMode;
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
    mark: MarkMode,
}

impl<S: RowStore> CdcAcker<S> {
    /// `mark`: `relay.mark`, which says how `recorder` records sent rows.
    pub fn new(recorder: S, progress: SharedProgress, mark: MarkMode) -> Self {
        CdcAcker {
            recorder,
            progress,
            mark,
        }
    }
}

impl<S: RowStore> Acker for CdcAcker<S> {
    type Position = CdcPosition;
    type Store = S;

    fn store(&self) -> &S {
        &self.recorder
    }

    /// Marks first: almost always every row is visible by the time the
    /// broker confirmed it, and one statement does. When it changed fewer
    /// rows than it was given (a commit decoded before other sessions see
    /// it, or rows marked before a crash), it waits until the transactions
    /// are visible and marks again; the statement skips marked rows.
    ///
    /// With `ranges` the statement writes no outbox row, only the batch's
    /// `relay_seq` ranges, whether or not their transactions are visible
    /// yet: it runs once, and nothing waits (the fold deletes a progress row
    /// only once every row it names is visible, `outbox::progress`).
    async fn ack(&mut self, positions: Vec<CdcPosition>) -> Result<(), SourceError> {
        let mut seqs: Vec<i64> = positions.iter().filter_map(|p| p.seq).collect();
        seqs.sort_unstable();
        seqs.dedup();
        if self.mark.records_sent() && !seqs.is_empty() {
            let marked = self.recorder.mark(&seqs).await?;
            if self.mark != MarkMode::Ranges && marked < seqs.len() as u64 {
                tracing::debug!(
                    rows = seqs.len(),
                    marked,
                    "not every confirmed row was marked at once (not visible yet, or marked before): waiting for their transactions, then marking again"
                );
                self.recorder
                    .wait_visible(positions.iter().filter_map(|p| p.xid).collect())
                    .await?;
                self.recorder.mark(&seqs).await?;
            }
        }
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
        if self.mark.records_sent() {
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

#[cfg(test)]
mod tests {
    //! The acker against a scripted store: a real server cannot be made to
    //! decode a commit before other sessions see it on demand (the window
    //! is microseconds), so the order of calls is checked here.
    use super::*;
    use crate::dead_letter::{OpenLetters, Requests, Written};
    use crate::source::cdc::progress::Progress;
    use std::sync::{Arc, Mutex};

    /// Answers each `mark` with the next scripted count of changed rows.
    struct Scripted {
        counts: Mutex<Vec<u64>>,
        calls: Mutex<Vec<String>>,
    }

    impl Scripted {
        fn new(counts: &[u64]) -> Self {
            Scripted {
                counts: Mutex::new(counts.iter().rev().copied().collect()),
                calls: Mutex::new(Vec::new()),
            }
        }
        fn log(&self, call: String) {
            self.calls.lock().unwrap().push(call);
        }
    }

    impl RowStore for Scripted {
        async fn wait_visible(&self, xids: Vec<u32>) -> Result<(), SourceError> {
            self.log(format!("wait {xids:?}"));
            Ok(())
        }
        async fn mark(&self, seqs: &[i64]) -> Result<u64, SourceError> {
            self.log(format!("mark {seqs:?}"));
            Ok(self.counts.lock().unwrap().pop().expect("a scripted count"))
        }
        async fn dead_letter<P: Sync>(
            &mut self,
            _letters: &[DeadLetter<P>],
        ) -> Result<Written, SourceError> {
            Ok(Written::default())
        }
        async fn open_dead_letters(&self) -> Result<OpenLetters, SourceError> {
            Ok(OpenLetters::new())
        }
        async fn heartbeat(&self) -> Result<(), SourceError> {
            Ok(())
        }
        fn report_answers_to(&self, _: Arc<dyn crate::source::record::Renew>) {}
        async fn requested_letters(&self, _: usize) -> Result<Requests, SourceError> {
            Ok(Requests::default())
        }
        async fn letters_sent(&self, _ids: &[i64]) -> Result<(), SourceError> {
            Ok(())
        }
        async fn letter_refused(&self, _: i64, _: &str, _: bool) -> Result<(), SourceError> {
            Ok(())
        }
    }

    fn at(seq: i64, xid: u32) -> CdcPosition {
        CdcPosition {
            commit_lsn: Lsn(100 + seq as u64),
            index: 0,
            seq: Some(seq),
            xid: Some(xid),
        }
    }

    async fn ack(counts: &[u64], positions: Vec<CdcPosition>, mark: MarkMode) -> Vec<String> {
        let progress = Arc::new(Mutex::new(Progress::new(Lsn(1), 16)));
        let mut acker = CdcAcker::new(Scripted::new(counts), progress, mark);
        acker.ack(positions).await.unwrap();
        acker.recorder.calls.into_inner().unwrap()
    }

    #[tokio::test]
    async fn one_statement_when_every_row_was_marked() {
        let calls = ack(&[2], vec![at(2, 7), at(1, 7)], MarkMode::Update).await;
        assert_eq!(calls, ["mark [1, 2]"]);
    }

    #[tokio::test]
    async fn rows_not_marked_at_once_are_marked_once_visible() {
        let calls = ack(&[1, 1], vec![at(1, 7), at(2, 8)], MarkMode::Update).await;
        assert_eq!(calls, ["mark [1, 2]", "wait [7, 8]", "mark [1, 2]"]);
    }

    #[tokio::test]
    async fn a_seq_given_twice_is_one_row() {
        let calls = ack(&[1], vec![at(1, 7), at(1, 7)], MarkMode::Update).await;
        assert_eq!(calls, ["mark [1]"]);
    }

    #[tokio::test]
    async fn nothing_is_marked_with_mark_none() {
        let calls = ack(&[], vec![at(1, 7)], MarkMode::None).await;
        assert!(calls.is_empty(), "{calls:?}");
    }

    /// The ranges statement inserts one progress row however many rows its
    /// batch names, visible yet or not: one statement, no wait.
    #[tokio::test]
    async fn ranges_are_recorded_once_without_waiting() {
        let calls = ack(&[1], vec![at(1, 7), at(2, 8), at(3, 8)], MarkMode::Ranges).await;
        assert_eq!(calls, ["mark [1, 2, 3]"]);
    }
}
