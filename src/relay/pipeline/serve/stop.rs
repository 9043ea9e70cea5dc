//! How a run ends: a stop sends what was read and waits for its
//! confirmations (at most `relay.shutdown_timeout`); then whatever ended
//! the run, what the broker confirmed is recorded, the reader reports its
//! final position and the broker connection closes.

use super::super::tasks::flush;
use super::super::{Drained, PipelineError};
use super::{Intake, Pipeline, SINK_CLOSE_WAIT};
use crate::errors::{self, Outcome};
use crate::sink::Sink;
use crate::source::RowPosition;
use std::time::Duration;
use tokio::time::Instant;

impl<P, K> Pipeline<'_, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    /// Records what the broker confirmed, lets the reader close, closes the
    /// sink; says whether anything sent is still unconfirmed.
    pub(in super::super) async fn finish(
        mut self,
        result: Result<(), PipelineError>,
    ) -> Result<Drained, PipelineError> {
        // Whatever ended the run, what the broker client still holds of
        // it goes no further (while the rest of the stop takes its time, the
        // lease may run out and a new owner start).
        if result.is_err()
            && let Some(fence) = self.sink.fence()
        {
            fence().await;
        }
        if let Err(e) = &result
            && errors::policy(e.kind()).outcome == Some(Outcome::Unavailable)
        {
            // Their fate is unknown: they will be sent again.
            self.telemetry
                .metrics
                .failed(Outcome::Unavailable, self.scheduler.in_flight() as u64);
        }
        // Record what the broker confirmed before giving up, to spare
        // re-sends; the acker may be what failed, so not for long (and not
        // at all when it is stuck on a silent ownership session).
        if result.is_err() && !matches!(result, Err(PipelineError::OwnershipUnconfirmed(_))) {
            let _ = tokio::time::timeout(Duration::from_secs(5), async {
                self.push_pending().await;
                flush(&self.ack_tx).await
            })
            .await;
        }
        let drained = if self.scheduler.in_flight() > 0 {
            Drained::Abandoned
        } else if !self.lease.previous_owner_settled(Instant::now()) {
            Drained::PreviousOwnerUnsettled
        } else {
            Drained::All
        };
        let Pipeline {
            sink,
            rewind_tx,
            mut reader_task,
            ..
        } = self;
        // Let the reader close (report its final position) after the last acknowledgement.
        drop(rewind_tx);
        if !reader_task.is_finished() {
            let _ = tokio::time::timeout(Duration::from_secs(5), &mut reader_task).await;
        }
        // A broker that stopped answering must not hold the stop up.
        if tokio::time::timeout(SINK_CLOSE_WAIT, sink.close())
            .await
            .is_err()
        {
            tracing::warn!(
                "the broker did not answer the close within {}s: leaving the connection",
                SINK_CLOSE_WAIT.as_secs()
            );
        }
        result.map(|()| drained)
    }

    /// Stops reading, once a transaction begun is read to its end; what was
    /// read goes on to the broker (the rest of the current batch, and the
    /// events parked behind their aggregate's), so
    /// that the position recorded at the stop passes everything it
    /// confirmed: without marking, or for logical messages, the next owner
    /// then repeats nothing.
    pub(super) fn begin_shutdown(&mut self) {
        tracing::info!(
            in_flight = self.scheduler.in_flight(),
            read = self.waiting.len(),
            "shutting down: sending what was read and waiting for broker confirmations"
        );
        // Sending ends half-way, so that what it sends is confirmed in time;
        // both count from when the stop was first seen (a send the broker
        // did not take may have held the loop since).
        let now = *self.stop_seen.get_or_init(Instant::now);
        self.intake = Intake::Draining {
            deadline: now + self.settings.shutdown_timeout,
            send_until: Some(now + self.settings.shutdown_timeout / 2),
        };
    }

    pub(super) async fn drain_timed_out(&mut self) -> Result<(), PipelineError> {
        tracing::warn!(
            unconfirmed = self.scheduler.in_flight(),
            "shutdown timeout reached; unconfirmed events will be re-sent on the next start, and events read and not sent read again"
        );
        self.push_pending().await;
        flush(&self.ack_tx).await
    }
}
