//! Dead letters as the loop sees them: the periodic look at the table,
//! aggregates that resume once their letters are resolved, and redriven
//! letters queued ahead of the current batch.

use super::super::tasks::{AckCommand, Refreshed, task_error};
use super::super::{Origin, PipelineError};
use super::{Event, Intake, Pipeline};
use crate::sink::Sink;
use crate::source::{RowPosition, SourcedEvent};
use crate::telemetry::events::{AggregatesResumed, InternalEvent, LettersRedriven};
use chrono::Utc;
use std::collections::{HashMap, HashSet};
use tokio::sync::oneshot;
use tokio::time::Instant;

impl<P, K> Pipeline<'_, P, K>
where
    P: Clone + Send + Sync + RowPosition + 'static,
    K: Sink,
{
    /// Aggregates whose dead letters were resolved: unblock them, and re-read
    /// if any was blocked.
    pub(super) fn resolve(&mut self, aggregates: HashSet<String>) {
        let mut any = false;
        for a in aggregates {
            any |= self.blocks.is_blocked(&a);
            self.blocks.resolve(&a);
            self.call_off(&a);
        }
        if any {
            AggregatesResumed::Resolved.emit();
            self.rewind_later();
        }
    }

    /// The refresh's view of the dead-letter table arrived.
    pub(super) fn refreshed(&mut self, (open, requested): Refreshed, seen: u64, handed: u64) {
        self.refresh.waiting = None;
        let gone = self.blocks.resolve_missing(&open, seen);
        for a in &gone {
            self.call_off(a);
        }
        if !gone.is_empty() && self.intake != Intake::Rewinding {
            AggregatesResumed::Refreshed {
                aggregates: gone.len(),
            }
            .emit();
            self.rewind_later();
        }
        if requested.extending {
            // A request is being extended to many followers, one batch per
            // look: look again at once rather than a whole interval later.
            self.refresh.next = Some(Instant::now());
        }
        // A view older than letters handed over since may still list them:
        // a newer one tells which are left, at once unless a redrive under
        // way asks for it when its letters are handed.
        if handed == self.letters_handed {
            self.redrive(requested.letters);
        } else if !requested.letters.is_empty() && !self.redriving.values().any(|n| *n > 0) {
            self.refresh.next = Some(Instant::now());
        }
    }

    /// The aggregate's redrive, if any, is over (its letters resolved):
    /// letters of others its batches kept from a look come with the look
    /// after the rewind.
    fn call_off(&mut self, aggregate: &str) {
        if self.redriving.remove(aggregate).is_some_and(|n| n > 0) {
            self.refresh.after_rewind = true;
        }
        self.refresh.held.remove(aggregate);
    }

    /// A redriven letter of `aggregate` was refused again, and its redrive
    /// called off: the look after the rewind comes at once, for the
    /// letters of other aggregates. Back-pressure keeps the request: the
    /// aggregate's own letters then wait a refresh_interval before they go
    /// again, however soon the look.
    pub(in super::super) fn redrive_refused(&mut self, aggregate: &str, counts: bool) {
        self.refresh.after_rewind = true;
        if let Some(every) = self.refresh.every.filter(|_| !counts) {
            self.refresh
                .held
                .insert(aggregate.to_owned(), Instant::now() + every);
        }
    }

    /// Queues the requested letters of dead aggregates not being redriven
    /// already, in order, ahead of the current batch.
    fn redrive(&mut self, requested: Vec<crate::dead_letter::Requested>) {
        let instant = Instant::now();
        self.refresh.held.retain(|_, until| *until > instant);
        if self.intake != Intake::Open {
            self.refresh.after_rewind |= requested
                .iter()
                .any(|r| self.redrivable(r.raw.aggregate_id.as_deref()));
            return;
        }
        let now = Utc::now();
        let mut queued: Vec<Event<P>> = Vec::new();
        let mut started: HashMap<String, usize> = HashMap::new();
        for r in requested {
            if !self.redrivable(r.raw.aggregate_id.as_deref()) {
                continue;
            }
            let aggregate = r.raw.aggregate_id.clone().unwrap_or_default();
            *started.entry(aggregate.clone()).or_default() += 1;
            self.letter_aggregates.insert(r.letter_id, aggregate);
            let mut event = SourcedEvent::new(Origin::Letter(r.letter_id), r.raw.decode(now));
            event.charge = self.budget.charge(event.bytes());
            queued.push(event);
        }
        if queued.is_empty() {
            return;
        }
        LettersRedriven {
            letters: queued.len(),
            aggregates: started.len(),
        }
        .emit();
        self.redriving.extend(started);
        if self.telemetry.tracer.is_on() {
            self.read_at = std::time::SystemTime::now();
        }
        for e in queued.into_iter().rev() {
            self.waiting.push_front(e);
        }
    }

    /// Whether a requested letter of `aggregate` may be queued now: the
    /// aggregate is dead, publishes no letters already, and is not held
    /// after a push-back (then the next look comes when its hold ends).
    /// Letters without an aggregate id are one group (`""`), which nothing
    /// holds back: never dead, they go when none of the group is out (and
    /// are refused again, as an event needs an aggregate id, which ends
    /// their request).
    fn redrivable(&mut self, aggregate: Option<&str>) -> bool {
        let group = aggregate.unwrap_or_default();
        if let Some(&until) = self.refresh.held.get(group) {
            self.refresh.next = Some(self.refresh.next.map_or(until, |n| n.min(until)));
            return false;
        }
        let publishing = self.redriving.get(group).is_some_and(|n| *n > 0);
        !publishing && aggregate.is_none_or(|a| self.blocks.is_dead(a))
    }

    pub(super) async fn ask_refresh(&mut self) -> Result<(), PipelineError> {
        let (tx, rx) = oneshot::channel();
        if self
            .ack_tx
            .send(AckCommand::OpenDeadLetters(tx, self.budget.room().max(1)))
            .await
            .is_err()
        {
            return Err(task_error(&mut self.acker_task, "acker").await);
        }
        self.refresh.waiting = Some((rx, self.blocks.generation(), self.letters_handed));
        self.refresh.next = self.refresh.every.map(|d| Instant::now() + d);
        Ok(())
    }
}

/// The refresh's answer, once one was asked for.
pub(super) async fn wait_refresh(
    rx: &mut Option<(oneshot::Receiver<Refreshed>, u64, u64)>,
) -> Result<(Refreshed, u64, u64), ()> {
    match rx {
        Some((rx, seen, handed)) => {
            let (seen, handed) = (*seen, *handed);
            rx.await.map(|found| (found, seen, handed)).map_err(|_| ())
        }
        None => std::future::pending().await,
    }
}
