//! What happens to one event: admitted, sent, confirmed, refused, deferred
//! behind its aggregate or dead-lettered.

use super::PipelineError;
use super::serve::{Done, Pipeline};
use crate::config::HoldPolicy;
use crate::dead_letter::DeadLetter;
use crate::outbox::RawRow;
use crate::relay::scheduler::Admission;
use crate::sink::{Confirmation, Sink, SinkError};
use crate::source::{RowPosition, SourcedEvent};
use crate::telemetry::metrics::Failure;
use chrono::Utc;
use std::time::Duration;
use tokio::time::Instant;

impl<P, K> Pipeline<'_, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    pub(super) async fn admit(
        &mut self,
        events: Vec<SourcedEvent<P>>,
    ) -> Result<(), PipelineError> {
        self.telemetry
            .metrics
            .batch_size
            .record(events.len() as f64);
        for event in events {
            match self.scheduler.admit(event, self.blocks) {
                Admission::Send(e) => self.dispatch(e).await?,
                Admission::Parked => {}
                Admission::Deferred(e) => self.defer(e),
            }
        }
        Ok(())
    }

    /// An event of a blocked aggregate: it waits in the outbox, or follows a
    /// dead letter of its aggregate into the dead-letter table.
    fn defer(&mut self, event: SourcedEvent<P>) {
        let aggregate = event.aggregate_id().to_owned();
        let follows = match (
            &self.settings.dead_letter,
            self.blocks.dead_event(&aggregate),
        ) {
            (Some(d), Some(first)) if d.policy == HoldPolicy::Follow => first.to_owned(),
            _ => {
                tracing::debug!(aggregate_id = %aggregate, "aggregate blocked; event deferred");
                return;
            }
        };
        let (raw, id) = raw_of(&event);
        tracing::warn!(event_id = %id, aggregate_id = %aggregate, follows = %follows, "event follows an earlier dead letter of its aggregate");
        let now = Utc::now();
        self.telemetry.metrics.dead_lettered.increment(1);
        self.pending_letters.push(DeadLetter {
            seq: event.position.seq(),
            position: event.position,
            raw,
            reason: format!("follows dead-lettered event {follows} of its aggregate"),
            attempts: 0,
            first_failed_at: now,
            last_failed_at: now,
            follows: Some(follows),
        });
    }

    async fn dispatch(&mut self, sourced: SourcedEvent<P>) -> Result<(), PipelineError> {
        let aggregate = sourced.aggregate_id().to_owned();
        let event = match sourced.event {
            Ok(e) => e,
            Err(bad) => {
                let raw = bad.raw.map(|r| *r).unwrap_or_default();
                self.reject(sourced.position, &aggregate, raw, bad.reason, true);
                return Ok(());
            }
        };
        let message = self.envelope.build(&event);
        // Handing a message over is quick unless the broker stopped reading.
        let sent = tokio::time::timeout(
            self.settings.confirm_timeout,
            self.sink.send(&event, message),
        )
        .await
        .unwrap_or_else(|_| {
            Err(SinkError::Unavailable(format!(
                "the broker did not take a message within relay.confirm_timeout ({}s)",
                self.settings.confirm_timeout.as_secs()
            )))
        });
        match sent {
            Ok(confirmation) => {
                self.scheduler.sent(&aggregate);
                let timeout = self.settings.confirm_timeout;
                let position = sourced.position;
                self.in_flight.push(Box::pin(async move {
                    let result = confirm_within(confirmation, timeout).await;
                    (position, event, result)
                }));
                Ok(())
            }
            Err(SinkError::Rejected(reason)) => {
                self.reject(sourced.position, &aggregate, event.to_raw(), reason, true);
                Ok(())
            }
            Err(SinkError::Busy(reason)) => {
                self.reject(sourced.position, &aggregate, event.to_raw(), reason, false);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    pub(super) async fn complete(
        &mut self,
        (position, event, result): Done<P>,
    ) -> Result<(), PipelineError> {
        let aggregate = event.aggregate_id.clone();
        match result {
            Ok(()) => {
                self.telemetry.health.progress();
                let latency = (Utc::now() - event.created_at)
                    .num_microseconds()
                    .unwrap_or(0)
                    .max(0);
                self.telemetry
                    .metrics
                    .commit_to_confirm
                    .record(latency as f64 / 1e6);
                self.pending_acks.push(position);
                self.blocks.clear(&aggregate);
                if let Some(next) = self.scheduler.finished(&aggregate) {
                    self.dispatch(next).await?;
                }
                Ok(())
            }
            Err(SinkError::Rejected(reason)) => {
                // Parked events go first (reject takes them), so none is released here.
                self.reject(position, &aggregate, event.to_raw(), reason, true);
                self.scheduler.finished(&aggregate);
                Ok(())
            }
            Err(SinkError::Busy(reason)) => {
                self.reject(position, &aggregate, event.to_raw(), reason, false);
                self.scheduler.finished(&aggregate);
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// The event cannot be published now: hold its aggregate back and retry
    /// later, or, after `max_attempts` refusals that `count`, dead-letter it
    /// (back-pressure does not count: it is retried for as long as it takes).
    fn reject(&mut self, position: P, aggregate: &str, raw: RawRow, reason: String, count: bool) {
        self.telemetry.metrics.failed(Failure::Refused, 1);
        if self.blocks.is_dead(aggregate) {
            // An earlier event of the aggregate is already dead-lettered
            // (both were in flight): this one follows it, or waits.
            let id = raw.id.clone();
            self.defer(SourcedEvent {
                position,
                event: Err(crate::outbox::RowError {
                    id,
                    aggregate_id: Some(aggregate.to_owned()),
                    reason,
                    raw: Some(Box::new(raw)),
                }),
            });
            return;
        }
        let parked = self.scheduler.drop_parked(aggregate);
        let event_id = raw.id.clone();
        let block = self
            .blocks
            .block(aggregate, event_id.as_deref(), reason, Instant::now());
        let (attempts, first_failed_at, reason) =
            (block.attempts, block.first_failed_at, block.reason.clone());
        let retry_in = block
            .until
            .map(|t| t.saturating_duration_since(Instant::now()))
            .unwrap_or_default();
        let give_up = count
            && self
                .settings
                .dead_letter
                .as_ref()
                .is_some_and(|d| attempts >= d.max_attempts);
        if !give_up {
            tracing::warn!(
                event_id = event_id.as_deref().unwrap_or("?"),
                aggregate_id = aggregate,
                attempts,
                retry_in = ?retry_in,
                held_back = parked.len(),
                reason = %reason,
                "event refused; its aggregate waits, other aggregates continue"
            );
            return;
        }
        tracing::warn!(
            event_id = event_id.as_deref().unwrap_or("?"),
            aggregate_id = aggregate,
            attempts,
            reason = %reason,
            "event dead-lettered after repeated refusals; see `outbox-relay dlq list`"
        );
        self.blocks.mark_dead(aggregate);
        self.telemetry.metrics.dead_lettered.increment(1);
        self.pending_letters.push(DeadLetter {
            seq: position.seq(),
            position,
            raw,
            reason,
            attempts,
            first_failed_at,
            last_failed_at: Utc::now(),
            follows: None,
        });
        for e in parked {
            self.defer(e);
        }
    }
}

/// The row of an event as read, for a dead letter.
fn raw_of<P>(event: &SourcedEvent<P>) -> (RawRow, String) {
    match &event.event {
        Ok(e) => (e.to_raw(), e.id.clone()),
        Err(bad) => (
            bad.raw.as_deref().cloned().unwrap_or_default(),
            bad.id.clone().unwrap_or_else(|| "?".into()),
        ),
    }
}

async fn confirm_within(confirmation: Confirmation, timeout: Duration) -> Result<(), SinkError> {
    match tokio::time::timeout(timeout, confirmation).await {
        Ok(result) => result,
        Err(_) => Err(SinkError::Unavailable(format!(
            "no broker confirmation within relay.confirm_timeout ({}s)",
            timeout.as_secs()
        ))),
    }
}
