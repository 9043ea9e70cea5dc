//! What happens to a refused event, logged and counted in one place.
//!
//! The pipeline says what happened ([`Refused`], [`Followed`]); `emit` writes
//! the log line and bumps the metrics that go with it, so a refusal is never
//! logged without being counted, or counted twice.

use crate::errors::Outcome;
use crate::telemetry::metrics::PipelineMetrics;
use std::time::Duration;

/// The broker (or the relay's checks) refused an event.
pub(super) struct Refused<'a> {
    /// `?` when a row too broken to parse has none.
    pub event_id: &'a str,
    pub aggregate_id: &'a str,
    pub reason: &'a str,
    pub then: AfterRefusal,
}

/// What the pipeline does about a refusal.
pub(super) enum AfterRefusal {
    /// The aggregate waits `retry_in`, then the event is tried again;
    /// `held_back` events of the aggregate wait behind it.
    Retry {
        attempts: u32,
        retry_in: Duration,
        held_back: usize,
    },
    /// `dead_letter.max_attempts` reached: it goes to the dead-letter table.
    DeadLettered { attempts: u32 },
    /// A later event of an aggregate refused just before (both were in
    /// flight): it is read again with the aggregate's retry.
    BehindRefusal,
    /// An earlier event of its aggregate is already dead: it follows it, or
    /// waits (see [`Followed`]).
    BehindDeadLetter,
    /// A redriven dead letter, refused again: it stays in the table.
    LetterKept { letter: i64 },
}

impl Refused<'_> {
    pub fn emit(&self, metrics: &PipelineMetrics) {
        metrics.failed(Outcome::Refused, 1);
        let (event_id, aggregate_id, reason) = (self.event_id, self.aggregate_id, self.reason);
        match self.then {
            AfterRefusal::Retry {
                attempts,
                retry_in,
                held_back,
            } => tracing::warn!(
                event_id,
                aggregate_id,
                attempts,
                ?retry_in,
                held_back,
                reason,
                "event refused; its aggregate waits, other aggregates continue"
            ),
            AfterRefusal::DeadLettered { attempts } => {
                metrics.dead_lettered.increment(1);
                tracing::warn!(
                    event_id,
                    aggregate_id,
                    attempts,
                    reason,
                    "event dead-lettered after repeated refusals; see `outbox-relay dlq list`"
                );
            }
            AfterRefusal::BehindRefusal => tracing::debug!(
                event_id,
                aggregate_id,
                reason,
                "a later event of a refused aggregate was refused too"
            ),
            AfterRefusal::BehindDeadLetter => tracing::debug!(
                event_id,
                aggregate_id,
                reason,
                "an event of a dead-lettered aggregate was refused"
            ),
            AfterRefusal::LetterKept { letter } => tracing::warn!(
                letter,
                aggregate_id,
                reason,
                "a redriven dead letter was refused again; it stays in the dead-letter table"
            ),
        }
    }
}

/// An event followed an earlier dead letter of its aggregate into the
/// dead-letter table (`dead_letter.aggregate = "follow"`).
pub(super) struct Followed<'a> {
    pub event_id: &'a str,
    pub aggregate_id: &'a str,
    pub follows: &'a str,
}

impl Followed<'_> {
    pub fn emit(&self, metrics: &PipelineMetrics) {
        metrics.dead_lettered.increment(1);
        tracing::warn!(
            event_id = self.event_id,
            aggregate_id = self.aggregate_id,
            follows = self.follows,
            "event follows an earlier dead letter of its aggregate"
        );
    }
}
