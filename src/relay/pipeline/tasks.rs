//! The pipeline's two helper tasks: the reader, filling a small channel with
//! batches, and the acker, recording progress in order.

use super::PipelineError;
use crate::dead_letter::{DeadLetter, OpenLetters, Requests};
use crate::relay::lease::Lease;
use crate::source::budget::Budget;
use crate::source::{Acker, Reader, SourceError, SourcedEvent};
use crate::telemetry::trace::EventSpan;
use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::task::AbortOnDropHandle;

/// Most positions recorded by one acknowledgement statement.
const MAX_ACK_BATCH: usize = 5_000;

/// Events handed to the acker and not recorded yet (part of the window),
/// with a wake-up for the pipeline when some were recorded.
#[derive(Default)]
pub struct Unrecorded {
    count: AtomicUsize,
    wake: Notify,
}

impl Unrecorded {
    pub fn get(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }

    pub fn add(&self, n: usize) {
        self.count.fetch_add(n, Ordering::SeqCst);
    }

    fn recorded(&self, n: usize) {
        self.count.fetch_sub(n, Ordering::SeqCst);
        self.wake.notify_one();
    }

    /// Waits until something was recorded since the last call. Cancel-safe.
    pub async fn recorded_some(&self) {
        self.wake.notified().await;
    }
}

/// Aggregates the acker found resolved, waiting for the pipeline: a set
/// (bounded by the aggregates that exist) and a wake-up, so the acker never
/// waits on the pipeline while the pipeline waits on it.
#[derive(Default)]
pub struct Resolved {
    aggregates: Mutex<HashSet<String>>,
    wake: Notify,
}

impl Resolved {
    pub fn add(&self, found: HashSet<String>) {
        self.aggregates
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(found);
        self.wake.notify_one();
    }

    /// The aggregates added since the last call; waits for some. Cancel-safe.
    pub async fn next(&self) -> HashSet<String> {
        loop {
            let found =
                std::mem::take(&mut *self.aggregates.lock().unwrap_or_else(|e| e.into_inner()));
            if !found.is_empty() {
                return found;
            }
            self.wake.notified().await;
        }
    }
}

pub struct Batch<P> {
    pub epoch: u64,
    pub events: Vec<SourcedEvent<P>>,
    /// It ends inside a transaction (see [`Reader::inside_transaction`]).
    pub inside_transaction: bool,
}

/// What a refresh of the dead-letter table found: the aggregates with open
/// letters, and the letters an operator asked to publish again.
pub type Refreshed = (OpenLetters, Requests);

/// Work for the acker, carried out in the order sent.
pub enum AckCommand<P> {
    Ack(Confirmed<P>),
    /// Events left unsent in the source (their aggregate is held back).
    Release(Vec<P>),
    /// Dead letters, after the confirmations that arose before them: an
    /// aggregate's events confirmed before its letter are recorded first,
    /// so a crash between the two never leaves them unsent behind it.
    DeadLetter(Confirmed<P>, Vec<DeadLetter<P>>),
    /// A redriven letter was refused again: its id, why, and whether it
    /// counts; after the confirmations that arose before (the letters of
    /// its aggregate published before it are recorded redriven first).
    LetterRefused(Confirmed<P>, i64, String, bool),
    /// The view of the dead-letter table, with the requested letters that
    /// fit in the budget's room (bytes) at the time of asking.
    OpenDeadLetters(oneshot::Sender<Refreshed>, usize),
    /// Answered once everything sent before it is recorded.
    Flush(oneshot::Sender<()>),
}

pub async fn flush<P>(ack_tx: &mpsc::Sender<AckCommand<P>>) -> Result<(), PipelineError> {
    let (tx, rx) = oneshot::channel();
    ack_tx
        .send(AckCommand::Flush(tx))
        .await
        .map_err(|_| PipelineError::TaskLost("acker"))?;
    rx.await.map_err(|_| PipelineError::TaskLost("acker"))
}

pub fn joined(
    res: Result<Result<(), SourceError>, tokio::task::JoinError>,
    name: &'static str,
) -> PipelineError {
    match res {
        Ok(Ok(())) => PipelineError::TaskLost(name),
        Ok(Err(e)) => e.into(),
        Err(e) => {
            if e.is_panic() {
                let payload = e.into_panic();
                let message = payload
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| payload.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(no message)".to_owned());
                tracing::error!(task = name, panic = %message, "a pipeline task panicked; this is a bug, please report it");
            }
            PipelineError::TaskLost(name)
        }
    }
}

pub async fn task_error(
    task: &mut AbortOnDropHandle<Result<(), SourceError>>,
    name: &'static str,
) -> PipelineError {
    match tokio::time::timeout(Duration::from_secs(5), task).await {
        Ok(res) => joined(res, name),
        Err(_) => PipelineError::TaskLost(name),
    }
}

/// Reads batches into the channel; a rewind command resets the reader and
/// tags later batches with the new epoch.
pub async fn drive_reader<R: Reader>(
    mut reader: R,
    batch_size: usize,
    budget: Arc<Budget>,
    tx: mpsc::Sender<Batch<R::Position>>,
    mut rewinds: mpsc::Receiver<u64>,
) -> Result<(), SourceError> {
    let mut epoch = 0;
    loop {
        // Read only while the budget has room, and no more than that.
        tokio::select! {
            biased;
            cmd = rewinds.recv() => match cmd {
                Some(e) => { reader.rewind(); epoch = e; continue; }
                None => { reader.close().await; return Ok(()); }
            },
            _ = budget.has_room() => {}
            failed = reader.maintain() => { failed?; }
        }
        let events = tokio::select! {
            biased;
            cmd = rewinds.recv() => match cmd {
                Some(e) => { reader.rewind(); epoch = e; continue; }
                None => { reader.close().await; return Ok(()); }
            },
            events = read_batch(&mut reader, batch_size, budget.room().max(1)) => events?,
        };
        let inside_transaction = reader.inside_transaction();
        let events = events
            .into_iter()
            .map(|mut e| {
                e.charge = budget.charge(e.bytes());
                e
            })
            .collect();
        tokio::select! {
            biased;
            cmd = rewinds.recv() => match cmd {
                Some(e) => { reader.rewind(); epoch = e; }
                None => { reader.close().await; return Ok(()); }
            },
            sent = tx.send(Batch { epoch, events, inside_transaction }) => if sent.is_err() { return Ok(()) },
            // Waiting for room (backpressure): let the reader keep its connection alive.
            failed = reader.maintain() => failed?,
        }
    }
}

/// One read, in a span with its size and duration (debug level).
async fn read_batch<R: Reader>(
    reader: &mut R,
    batch_size: usize,
    max_bytes: usize,
) -> Result<Vec<SourcedEvent<R::Position>>, SourceError> {
    let started = std::time::Instant::now();
    let events = reader.next_batch(batch_size, max_bytes).await?;
    tracing::debug!(
        events = events.len(),
        read_ms = started.elapsed().as_millis() as u64,
        "batch read"
    );
    Ok(events)
}

/// Crash-injection hooks for the test suite, compiled only with the
/// `failpoints` feature: `OUTBOX_RELAY_FAILPOINT=abort-before-ack:N` aborts
/// the process just before the N-th acknowledgement, i.e. after the broker
/// confirmed messages and before their rows are marked (or their WAL
/// position reported): the most dangerous moment to crash.
/// `abort-after-dead-letter:N` aborts right after the N-th write of dead
/// letters committed. `panic-after-acquire:N` (whatever N) panics as
/// every run of the supervisor starts, outside the pipeline's tasks (a
/// defect's panic).
#[cfg(feature = "failpoints")]
pub(crate) fn failpoint_countdown(name: &str) -> Option<u32> {
    std::env::var("OUTBOX_RELAY_FAILPOINT")
        .ok()?
        .strip_prefix(name)?
        .strip_prefix(':')?
        .parse()
        .ok()
}

#[cfg(not(feature = "failpoints"))]
pub(crate) fn failpoint_countdown(_name: &str) -> Option<u32> {
    None
}

/// Counts a failpoint's countdown down; true when it reaches zero.
fn failpoint_hit(countdown: &mut Option<u32>) -> bool {
    countdown.as_mut().is_some_and(|n| {
        *n = n.saturating_sub(1);
        *n == 0
    })
}

/// Records progress in command order, merging consecutive acknowledgements
/// into one statement. Each answered round trip of the store renews the
/// ownership lease, and a heartbeat does when nothing did for a quarter
/// lease. Aggregates whose dead letters turned out resolved
/// are reported on `resolved`; `unrecorded` counts what was handed over and
/// is not recorded yet.
pub async fn drive_acker<A: Acker>(
    mut acker: A,
    mut rx: mpsc::Receiver<AckCommand<A::Position>>,
    resolved: Arc<Resolved>,
    lease: Arc<Lease>,
    unrecorded: Arc<Unrecorded>,
) -> Result<(), SourceError> {
    let mut countdown = failpoint_countdown("abort-before-ack");
    let mut letters_countdown = failpoint_countdown("abort-after-dead-letter");
    let mut done = Confirmed::default();
    {
        use crate::source::record::RowStore;
        acker.store().report_answers_to(lease.clone());
    }
    loop {
        let first = match tokio::time::timeout_at(lease.renew_by(), rx.recv()).await {
            Ok(Some(cmd)) => cmd,
            Ok(None) => return Ok(()),
            Err(_) => {
                renew(&mut acker, &lease).await?;
                continue;
            }
        };
        if Instant::now() >= lease.renew_by() {
            renew(&mut acker, &lease).await?;
        }
        let mut flushes = Vec::new();
        let mut next = Some(first);
        while let Some(cmd) = next {
            match cmd {
                AckCommand::Ack(confirmed) => done.extend(confirmed),
                AckCommand::Release(p) => acker.release(p),
                AckCommand::Flush(tx) => flushes.push(tx),
                AckCommand::DeadLetter(confirmed, letters) => {
                    done.extend(confirmed);
                    done.record(&mut acker, &mut countdown, &unrecorded).await?;
                    let n = letters.len();
                    let found = acker.dead_letter(letters).await?;
                    if cfg!(feature = "failpoints") && failpoint_hit(&mut letters_countdown) {
                        eprintln!("failpoint abort-after-dead-letter: aborting");
                        std::process::abort();
                    }
                    unrecorded.recorded(n);
                    if !found.is_empty() {
                        resolved.add(found);
                    }
                }
                AckCommand::LetterRefused(confirmed, id, reason, counts) => {
                    done.extend(confirmed);
                    done.record(&mut acker, &mut countdown, &unrecorded).await?;
                    acker.letter_refused(id, reason, counts).await?;
                }
                AckCommand::OpenDeadLetters(reply, room) => {
                    done.record(&mut acker, &mut countdown, &unrecorded).await?;
                    let open = acker.open_dead_letters().await?;
                    let requested = acker.requested_letters(room).await?;
                    let _ = reply.send((open, requested));
                }
            }
            next = if done.positions.len() + done.letters.len() < MAX_ACK_BATCH {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        done.record(&mut acker, &mut countdown, &unrecorded).await?;
        for tx in flushes {
            let _ = tx.send(());
        }
    }
}

/// Confirmed: source positions to record, and redriven letters; the
/// spans of those that have one end once they are recorded. The acker
/// gathers consecutive ones into one recording.
pub struct Confirmed<P> {
    pub positions: Vec<P>,
    pub letters: Vec<i64>,
    pub spans: Vec<EventSpan>,
}

impl<P> Default for Confirmed<P> {
    fn default() -> Self {
        Confirmed {
            positions: Vec::new(),
            letters: Vec::new(),
            spans: Vec::new(),
        }
    }
}

impl<P: Send + Sync + 'static> Confirmed<P> {
    fn extend(&mut self, more: Confirmed<P>) {
        self.positions.extend(more.positions);
        self.letters.extend(more.letters);
        self.spans.extend(more.spans);
    }

    async fn record<A: Acker<Position = P>>(
        &mut self,
        acker: &mut A,
        countdown: &mut Option<u32>,
        unrecorded: &Unrecorded,
    ) -> Result<(), SourceError> {
        record(acker, &mut self.positions, countdown, unrecorded).await?;
        if !self.letters.is_empty() {
            let n = self.letters.len();
            acker
                .letters_sent(std::mem::take(&mut self.letters))
                .await?;
            unrecorded.recorded(n);
        }
        for mut span in self.spans.drain(..) {
            span.step("marked");
        }
        Ok(())
    }
}

/// One round trip on the ownership session; the lease runs from when it was sent.
async fn renew<A: Acker>(acker: &mut A, lease: &Lease) -> Result<(), SourceError> {
    let sent = Instant::now();
    acker.heartbeat().await?;
    lease.renew(sent);
    Ok(())
}

async fn record<A: Acker>(
    acker: &mut A,
    positions: &mut Vec<A::Position>,
    countdown: &mut Option<u32>,
    unrecorded: &Unrecorded,
) -> Result<(), SourceError> {
    if positions.is_empty() {
        return Ok(());
    }
    if cfg!(feature = "failpoints") && failpoint_hit(countdown) {
        eprintln!(
            "failpoint abort-before-ack: aborting with {} confirmed, unrecorded events",
            positions.len()
        );
        std::process::abort();
    }
    let started = std::time::Instant::now();
    let n = positions.len();
    acker.ack(std::mem::take(positions)).await?;
    unrecorded.recorded(n);
    tracing::debug!(
        events = n,
        record_ms = started.elapsed().as_millis() as u64,
        "batch recorded"
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dead_letter::Written;
    use crate::source::record::{Answered, Renew, RowStore};

    /// A store whose `wait_visible` polls: many answered round trips.
    #[derive(Default)]
    struct Polling {
        answered: Answered,
        heartbeats: AtomicUsize,
    }

    const POLL: Duration = Duration::from_millis(250);

    impl RowStore for Polling {
        async fn wait_visible(&self, _: Vec<u32>) -> Result<(), SourceError> {
            for _ in 0..40 {
                let poll = || async {
                    tokio::time::sleep(POLL).await;
                    Ok::<_, SourceError>(())
                };
                self.answered.round_trip(poll).await?;
            }
            Ok(())
        }
        async fn mark(&self, _: &[i64]) -> Result<u64, SourceError> {
            Ok(0)
        }
        async fn dead_letter<P: Sync>(
            &mut self,
            _: &[DeadLetter<P>],
        ) -> Result<Written, SourceError> {
            Ok(Written::default())
        }
        async fn open_dead_letters(&self) -> Result<OpenLetters, SourceError> {
            Ok(OpenLetters::new())
        }
        async fn heartbeat(&self) -> Result<(), SourceError> {
            self.heartbeats.fetch_add(1, Ordering::SeqCst);
            Ok(())
        }
        async fn requested_letters(&self, _: usize) -> Result<Requests, SourceError> {
            Ok(Requests::default())
        }
        async fn letters_sent(&self, _: &[i64]) -> Result<(), SourceError> {
            Ok(())
        }
        async fn letter_refused(&self, _: i64, _: &str, _: bool) -> Result<(), SourceError> {
            Ok(())
        }
        fn report_answers_to(&self, lease: Arc<dyn Renew>) {
            self.answered.report_to(lease);
        }
    }

    /// Acknowledges by waiting for visibility (as the CDC acker does for a
    /// commit decoded before other sessions see it).
    struct Waits(Arc<Polling>);

    impl Acker for Waits {
        type Position = i64;
        type Store = Polling;
        fn store(&self) -> &Polling {
            &self.0
        }
        async fn ack(&mut self, _: Vec<i64>) -> Result<(), SourceError> {
            self.0.wait_visible(vec![7]).await
        }
        async fn dead_letter(
            &mut self,
            _: Vec<DeadLetter<i64>>,
        ) -> Result<HashSet<String>, SourceError> {
            Ok(HashSet::new())
        }
    }

    /// An acknowledgement of 40 answered round trips (10 s) keeps a 3 s
    /// lease valid throughout, with no heartbeat: each answer renews it.
    #[tokio::test(start_paused = true)]
    async fn answered_round_trips_renew_the_lease_as_they_come() {
        let d = Duration::from_secs(3);
        let start = Instant::now();
        let lease = Arc::new(Lease::after_clean_stop(d, start));
        let store = Arc::new(Polling::default());
        let (tx, rx) = mpsc::channel(4);
        let unrecorded = Arc::new(Unrecorded::default());
        unrecorded.add(1);
        let acker = tokio::spawn(drive_acker(
            Waits(store.clone()),
            rx,
            Arc::new(Resolved::default()),
            lease.clone(),
            unrecorded.clone(),
        ));
        let l = lease.clone();
        let lost = tokio::spawn(async move { l.lost(start).await });
        let confirmed = Confirmed {
            positions: vec![1],
            ..Confirmed::default()
        };
        tx.send(AckCommand::Ack(confirmed)).await.unwrap();
        let (flushed, done) = oneshot::channel();
        tx.send(AckCommand::Flush(flushed)).await.unwrap();
        tokio::pin!(done);
        let mut samples = 0;
        loop {
            tokio::select! {
                r = &mut done => break r.expect("the acker answers the flush"),
                _ = tokio::time::sleep(Duration::from_millis(100)) => {
                    samples += 1;
                    assert!(lease.valid(Instant::now()), "lease ran out at {:?}", start.elapsed());
                }
            }
        }
        assert!(start.elapsed() >= POLL * 40);
        assert!(samples >= 99, "{samples} samples");
        assert_eq!(unrecorded.get(), 0);
        assert_eq!(store.heartbeats.load(Ordering::SeqCst), 0);
        assert!(!lost.is_finished());
        drop(tx);
        acker.await.unwrap().unwrap();
    }
}
