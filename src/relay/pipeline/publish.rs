//! What happens to one event: admitted, sent, answered, refused, deferred
//! behind its aggregate or dead-lettered.

use super::events::{AfterRefusal, Followed, Refused};
use super::serve::{Event, Pipeline};
use super::{Origin, PipelineError};
use crate::config::HoldPolicy;
use crate::dead_letter::DeadLetter;
use crate::errors::{self, Outcome};
use crate::outbox::{OutboxEvent, RawRow, RowError};
use crate::relay::scheduler::{Admission, Laned};
use crate::sink::{Confirmation, Pause, Route, Sink, SinkError};
use crate::source::budget::Charge;
use crate::source::{RowPosition, SourcedEvent};
use crate::telemetry::trace::{EventSpan, Outcome as SpanOutcome};
use chrono::Utc;
use std::sync::Arc;
use std::time::Duration;
use tokio::time::Instant;

/// The broker's answer to one send (or the sink's own refusal).
pub(super) struct Answer<P> {
    pub position: Origin<P>,
    pub event: Result<OutboxEvent, RowError>,
    pub result: Result<(), SinkError>,
    /// The event's memory (and its message's, while the broker client held
    /// it), given back once the answer is handled.
    pub charge: Charge,
    /// Its span, when spans are exported.
    pub span: EventSpan,
}

/// An answer on its way back: the aggregate, the scheduler's ticket, the answer.
pub(super) type Answered<P> = (String, u64, Answer<P>);

/// An event's route, rendered once when it is admitted (its lane decides
/// whether it may go beside its aggregate's unconfirmed messages) and used
/// to send it; `None` for a row that is no event.
pub(super) type Routed = Option<Result<Route, SinkError>>;

impl Laned for Routed {
    fn lane(&self) -> Option<&str> {
        self.as_ref()?.as_ref().ok()?.lane.as_deref()
    }
}

/// The route's lane, shared with the scheduler without a copy.
fn lane_of(route: &Routed) -> Option<Arc<str>> {
    route.as_ref()?.as_ref().ok()?.lane.clone()
}

impl<P, K> Pipeline<'_, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    /// Admits events of the current batch while the window has room; the
    /// rest waits for answers to make room.
    pub(super) async fn admit_waiting(&mut self) -> Result<(), PipelineError> {
        while self.has_room() {
            let Some(event) = self.waiting.pop_front() else {
                return Ok(());
            };
            if let Origin::Source(p) = &event.position
                && self
                    .blocks
                    .delivered_before_dead_letter(event.aggregate_id(), p.wal())
            {
                // Replayed from before its aggregate's dead letter: the
                // broker confirmed it before the letter was written.
                tracing::debug!(aggregate_id = %event.aggregate_id(), wal = ?p.wal(), "a replayed event delivered before its aggregate's dead letter is not sent again");
                self.pending_acks.push(event.position);
                self.pending_replayed += 1;
                continue;
            }
            let route = event.event.as_ref().ok().map(|e| self.sink.route(e));
            // A redriven letter goes although its aggregate is dead.
            let blocked = matches!(event.position, Origin::Source(_))
                && self.blocks.is_blocked(event.aggregate_id());
            match self.scheduler.admit(event, route, blocked) {
                Admission::Send(e, route) => {
                    let aggregate = e.aggregate_id().to_owned();
                    self.dispatch(e, route).await?;
                    self.settle(&aggregate).await?;
                }
                Admission::Parked => {}
                Admission::Deferred(e) => self.defer(e, true),
            }
        }
        Ok(())
    }

    /// An answer arrived: handle the aggregate's answers that are due, in send order.
    pub(super) async fn answered(
        &mut self,
        (aggregate, ticket, answer): Answered<P>,
    ) -> Result<(), PipelineError> {
        let failed = answer.result.is_err();
        self.scheduler.answered(&aggregate, ticket, answer, failed);
        self.settle(&aggregate).await
    }

    /// Handles the aggregate's answers in send order, then sends what may go.
    async fn settle(&mut self, aggregate: &str) -> Result<(), PipelineError> {
        loop {
            while let Some(answer) = self.scheduler.next_answer(aggregate) {
                self.handle(aggregate, answer)?;
            }
            let blocked = self.blocks.is_blocked(aggregate)
                && self.redriving.get(aggregate).is_none_or(|n| *n == 0);
            let Some((next, route)) = self.scheduler.next_parked(aggregate, blocked) else {
                return Ok(());
            };
            self.dispatch(next, route).await?;
        }
    }

    /// An event of a blocked aggregate: it waits in the outbox, or follows a
    /// dead letter of its aggregate into the dead-letter table. Followers are
    /// written in order: one that comes after events of its aggregate still
    /// in flight (`behind_in_flight`) waits for their answers, and is read
    /// again once they are recorded.
    fn defer(&mut self, event: Event<P>, behind_in_flight: bool) {
        let aggregate = event.aggregate_id().to_owned();
        let Origin::Source(position) = event.position else {
            return; // a redriven letter stays in the dead-letter table
        };
        if self.redriving.contains_key(&aggregate) {
            // Its letters are being published: it comes after them, read
            // again once the aggregate flows.
            self.pending_releases.push(position);
            return;
        }
        let event = SourcedEvent {
            position,
            event: event.event,
            charge: event.charge,
        };
        let follows = match (
            &self.settings.dead_letter,
            self.blocks.dead_event(&aggregate),
        ) {
            (Some(d), Some(first)) if d.policy == HoldPolicy::Follow => first.to_owned(),
            _ => {
                tracing::debug!(aggregate_id = %aggregate, "aggregate blocked; event deferred");
                self.pending_releases.push(event.position);
                return;
            }
        };
        if behind_in_flight && self.scheduler.in_flight_of(&aggregate) > 0 {
            tracing::debug!(aggregate_id = %aggregate, "a follower waits for the answers to earlier events of its aggregate");
            self.rewind_later();
            return;
        }
        let (raw, id) = raw_of(&event.event);
        Followed {
            event_id: &id,
            aggregate_id: &aggregate,
            follows: &follows,
        }
        .emit(&self.telemetry.metrics);
        let now = Utc::now();
        self.pending_letters.push(DeadLetter {
            seq: event.position.seq(),
            wal: event.position.wal(),
            position: event.position,
            raw,
            reason: format!("follows dead-lettered event {follows} of its aggregate"),
            attempts: 0,
            first_failed_at: now,
            last_failed_at: now,
            follows: Some(follows),
        });
    }

    /// Hands the event to the sink. A refusal before sending is an answer
    /// like any other, handled in its turn.
    async fn dispatch(&mut self, sourced: Event<P>, route: Routed) -> Result<(), PipelineError> {
        if !self.lease.valid(Instant::now()) {
            // Ownership is not proven: send nothing; read it again later.
            self.rewind_later();
            return Ok(());
        }
        let aggregate = sourced.aggregate_id().to_owned();
        let ticket = self.scheduler.sent(&aggregate, lane_of(&route));
        let SourcedEvent {
            position,
            event,
            mut charge,
        } = sourced;
        let event = match event {
            Ok(e) => e,
            Err(bad) => {
                // A row that is no event is refused like one the broker refused.
                let reason = bad.reason.clone();
                let answer = Answer {
                    position,
                    event: Err(bad),
                    result: Err(SinkError::Rejected(reason.into())),
                    charge,
                    span: EventSpan::default(),
                };
                self.scheduler.answered(&aggregate, ticket, answer, true);
                return Ok(());
            }
        };
        let route = route.unwrap_or_else(|| self.sink.route(&event));
        let tracer = &self.telemetry.tracer;
        let mut span = if tracer.is_on() {
            let name = route.as_ref().ok().map(|r| r.destination_name().to_owned());
            tracer.span(&event, name, self.read_at)
        } else {
            EventSpan::default()
        };
        let message = self.envelope.build_traced(&event, span.traceparent());
        // The broker client keeps a copy until the broker answers.
        charge.grow(message.size());
        let sent = match route {
            Ok(route) => self.hand_over(route, message).await,
            Err(refused) => Err(refused),
        };
        match sent {
            Ok(confirmation) => {
                span.step("published");
                let (timeout, pause) = (self.settings.confirm_timeout, self.sink.pause());
                self.in_flight.push(Box::pin(async move {
                    let result = confirm_within(confirmation, timeout, pause).await;
                    if result.is_ok() {
                        span.step("confirmed");
                    }
                    let answer = Answer {
                        position,
                        event: Ok(event),
                        result,
                        charge,
                        span,
                    };
                    (aggregate, ticket, answer)
                }));
            }
            Err(e) => {
                let answer = Answer {
                    position,
                    event: Ok(event),
                    result: Err(e),
                    charge,
                    span,
                };
                self.scheduler.answered(&aggregate, ticket, answer, true);
            }
        }
        Ok(())
    }

    /// Gives the message to the broker client. That is quick unless the
    /// broker stopped reading, so it is bounded by `relay.confirm_timeout`,
    /// and during a stop by what is left of `relay.shutdown_timeout`; a
    /// stop that comes while it waits gives it the stop's sending half.
    async fn hand_over(
        &mut self,
        route: Route,
        message: crate::envelope::Message<'_>,
    ) -> Result<Confirmation, SinkError> {
        let confirm = self.settings.confirm_timeout;
        let deadline = self.intake.deadline();
        let timeout = deadline.map_or(confirm, |d| {
            confirm.min(d.saturating_duration_since(Instant::now()))
        });
        let (stop, seen) = (self.stop.clone(), self.stop_seen.clone());
        // During a stop, its deadline bounds the hand-over, paused or not.
        let pause = deadline.map_or_else(|| self.sink.pause(), |_| Pause::default());
        let lease = self.lease.clone();
        let send_window = self.settings.shutdown_timeout / 2;
        let stopped = async move {
            match deadline {
                // Already bounded by the stop.
                Some(_) => std::future::pending().await,
                None => {
                    stop.cancelled().await;
                    let seen = *seen.get_or_init(Instant::now);
                    tokio::time::sleep_until(seen + send_window).await
                }
            }
        };
        tokio::select! {
            // The send first: most are taken at once, and the stop's wait is
            // then never polled (no waiter registered per message).
            biased;
            sent = pause.within(timeout, self.sink.send(route, message)) => {
                sent.unwrap_or_else(|| {
                    Err(SinkError::Unavailable(if timeout < confirm {
                        "the broker did not take a message before relay.shutdown_timeout ran out".into()
                    } else {
                        format!(
                            "the broker did not take a message within relay.confirm_timeout ({}s)",
                            confirm.as_secs()
                        )
                        .into()
                    }))
                })
            }
            () = stopped => Err(SinkError::Unavailable(
                "a stop came while the broker did not take a message, and the first half of relay.shutdown_timeout ran out".into(),
            )),
            // Handed over later, the message could reach the broker after
            // a new owner's: the fence holds for the hand-over too.
            () = lease.ran_out() => Err(SinkError::Unavailable(
                "the ownership lease ran out before the broker client took a message; it was not handed over, \
                 as a new owner may be publishing by now"
                    .into(),
            )),
        }
    }

    /// One answer, in its aggregate's send order.
    fn handle(&mut self, aggregate: &str, answer: Answer<P>) -> Result<(), PipelineError> {
        let Answer {
            position,
            event,
            result,
            charge: _charge,
            mut span,
        } = answer;
        match result {
            Ok(()) => {
                let Ok(event) = event else {
                    return Ok(());
                };
                span.outcome(SpanOutcome::Published, None);
                if span.is_on() {
                    self.pending_spans.push(span);
                }
                // A confirmation, redriven letter or not: not stalled.
                self.in_flight_share.progress();
                if let Origin::Letter(_) = position {
                    self.pending_acks.push(position);
                    return Ok(());
                }
                if self.blocks.is_blocked(aggregate) {
                    // Only a sink that broke its ordering contract answers so.
                    tracing::error!(event_id = %event.id, aggregate_id = aggregate, "the broker confirmed an event after refusing an earlier one of its aggregate; their order is not kept");
                }
                let latency = (Utc::now() - event.created_at)
                    .num_microseconds()
                    .unwrap_or(0)
                    .max(0);
                self.telemetry
                    .metrics
                    .commit_to_confirm
                    .record(latency as f64 / 1e6);
                self.pending_acks.push(position);
                self.blocks.clear(aggregate, &event.id);
                Ok(())
            }
            // Refused for this message only: other aggregates go on.
            Err(e) if errors::policy(e.kind()).outcome == Some(Outcome::Refused) => {
                let (raw, _) = raw_of(&event);
                let counts = errors::policy(e.kind()).dead_letter;
                self.reject_traced(position, aggregate, raw, e.to_string(), counts, span);
                Ok(())
            }
            Err(e) => {
                span.outcome(SpanOutcome::Failed, Some(&e.to_string()));
                Err(e.into())
            }
        }
    }

    /// [`Self::reject`], and the span's outcome: dead-lettered when a dead
    /// letter was written for it, else failed (it is retried).
    fn reject_traced(
        &mut self,
        position: Origin<P>,
        aggregate: &str,
        raw: RawRow,
        reason: String,
        count: bool,
        mut span: EventSpan,
    ) {
        if !span.is_on() {
            return self.reject(position, aggregate, raw, reason, count);
        }
        let letters = self.pending_letters.len();
        let why = reason.clone();
        self.reject(position, aggregate, raw, reason, count);
        let outcome = if self.pending_letters.len() > letters {
            SpanOutcome::DeadLettered
        } else {
            SpanOutcome::Failed
        };
        span.outcome(outcome, Some(&why));
    }

    /// The event cannot be published now: hold its aggregate back and retry
    /// later, or, after `max_attempts` refusals that `count`, dead-letter it
    /// (back-pressure does not count: it is retried for as long as it takes).
    fn reject(
        &mut self,
        position: Origin<P>,
        aggregate: &str,
        raw: RawRow,
        reason: String,
        count: bool,
    ) {
        let event_id = raw.id.clone().unwrap_or_else(|| "?".into());
        let refused = |then| Refused {
            event_id: &event_id,
            aggregate_id: aggregate,
            reason: &reason,
            then,
        };
        let metrics = &self.telemetry.metrics;
        let position = match position {
            Origin::Source(p) => p,
            Origin::Letter(letter) => {
                refused(AfterRefusal::LetterKept { letter }).emit(metrics);
                return self.letter_refused(letter, aggregate, reason, count);
            }
        };
        if self.blocks.is_dead(aggregate) {
            refused(AfterRefusal::BehindDeadLetter).emit(metrics);
            return self.behind_dead_letter(position, aggregate, raw, reason);
        }
        let parked = self.scheduler.drop_parked(aggregate);
        let (block, new_round) = self.blocks.block(
            aggregate,
            raw.id.as_deref(),
            reason.clone(),
            Instant::now(),
            count,
        );
        if !new_round {
            // An event behind the refused one, in flight with it: it is
            // read again with the aggregate's retry.
            refused(AfterRefusal::BehindRefusal).emit(metrics);
            self.pending_releases.push(position);
            return;
        }
        let (attempts, first_failed_at) = (block.attempts, block.first_failed_at);
        let give_up = count
            && self
                .settings
                .dead_letter
                .as_ref()
                .is_some_and(|d| attempts >= d.max_attempts);
        if !give_up {
            let retry_in = block
                .until
                .map(|t| t.saturating_duration_since(Instant::now()))
                .unwrap_or_default();
            let held_back = parked.len();
            refused(AfterRefusal::Retry {
                attempts,
                retry_in,
                held_back,
            })
            .emit(metrics);
            return self.read_again_later(position, parked);
        }
        refused(AfterRefusal::DeadLettered { attempts }).emit(metrics);
        let letter = DeadLetter {
            seq: position.seq(),
            wal: position.wal(),
            position,
            raw,
            reason,
            attempts,
            first_failed_at,
            last_failed_at: Utc::now(),
            follows: None,
        };
        self.dead_letter(aggregate, letter, parked);
    }

    /// A refused event and those held back behind it are read again with
    /// the aggregate's retry.
    fn read_again_later(&mut self, position: P, parked: Vec<Event<P>>) {
        self.pending_releases.push(position);
        self.pending_releases
            .extend(parked.into_iter().filter_map(|e| match e.position {
                Origin::Source(p) => Some(p),
                Origin::Letter(_) => None,
            }));
    }

    /// A refused event of an aggregate whose earlier event is already
    /// dead-lettered (both were in flight): it follows it, or waits. Its
    /// answer is handled in order, so everything before it is settled.
    fn behind_dead_letter(&mut self, position: P, aggregate: &str, raw: RawRow, reason: String) {
        let event = SourcedEvent::new(
            Origin::Source(position),
            Err(RowError {
                id: raw.id.clone(),
                aggregate_id: Some(aggregate.to_owned()),
                reason,
                raw: Some(Box::new(raw)),
            }),
        );
        self.defer(event, false);
    }

    /// Writes the aggregate's dead letter; the events held back behind it
    /// follow it or wait, per `dead_letter.aggregate`.
    fn dead_letter(&mut self, aggregate: &str, letter: DeadLetter<P>, parked: Vec<Event<P>>) {
        self.blocks.mark_dead(aggregate, letter.wal);
        self.pending_letters.push(letter);
        for e in parked {
            self.defer(e, true);
        }
    }
}

impl<P, K> Pipeline<'_, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    /// A redriven letter was refused again: it stays in the dead-letter
    /// table with the new reason, its aggregate stays dead, and the rest of
    /// its redrive is called off (a refusal that counts ends the operator's
    /// request; back-pressure keeps it, for the next refresh).
    fn letter_refused(&mut self, id: i64, aggregate: &str, reason: String, counts: bool) {
        self.pending_letter_refusals.push((id, reason, counts));
        // The aggregate's redrive ends here (its other letters were dropped):
        // it is dead again, and nothing of it waits for a resolution.
        self.redriving.remove(aggregate);
        self.redrive_refused(aggregate, counts);
        self.letter_aggregates.retain(|_, a| a != aggregate);
        self.waiting.retain(|e| {
            !(e.aggregate_id() == aggregate && matches!(e.position, Origin::Letter(_)))
        });
        self.scheduler.drop_parked(aggregate);
        // What was held back behind the redrive follows the letter now, in order.
        self.rewind_later();
    }
}

/// The row of an event as read, for a dead letter, and its id.
fn raw_of(event: &Result<OutboxEvent, RowError>) -> (RawRow, String) {
    match event {
        Ok(e) => (e.to_raw(), e.id.clone()),
        Err(bad) => (
            bad.raw.as_deref().cloned().unwrap_or_default(),
            bad.id.clone().unwrap_or_else(|| "?".into()),
        ),
    }
}

/// The broker's answer, within `timeout` of the time it did not pause publishing.
async fn confirm_within(
    confirmation: Confirmation,
    timeout: Duration,
    pause: Pause,
) -> Result<(), SinkError> {
    match pause.within(timeout, confirmation).await {
        Some(result) => result,
        None => Err(SinkError::Unavailable(
            format!(
                "no broker confirmation within relay.confirm_timeout ({}s)",
                timeout.as_secs()
            )
            .into(),
        )),
    }
}
