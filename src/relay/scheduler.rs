//! Per-aggregate scheduling: which event may go to the broker now.
//!
//! Events arrive in source order. An event is sent at once unless its
//! aggregate already has `per_aggregate` messages unconfirmed (it is parked
//! behind them, in order) or is blocked because the broker refused one of its
//! events (it is deferred: dropped from memory, still unsent in the outbox,
//! and read again when the block expires and the source rewinds). Other
//! aggregates are never held up by a blocked one.
//!
//! Blocks outlive a pipeline restart (the relay keeps [`Blocks`] across
//! reconnects), so a refused event is retried on its own schedule rather than
//! at every reconnect. An aggregate whose event went to the dead-letter table
//! stays blocked ("dead") until an operator redrives or drops the dead letter.

use super::backoff;
use crate::source::SourcedEvent;
use chrono::{DateTime, Utc};
use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Duration;
use tokio::time::Instant;

/// Why and until when an aggregate is held back.
#[derive(Debug, Clone)]
pub struct Block {
    /// The refused event.
    pub event_id: Option<String>,
    pub reason: String,
    /// Refusals of this event so far.
    pub attempts: u32,
    /// `Some` while waiting; `None` once released for a retry.
    pub until: Option<Instant>,
    /// When this event was first refused.
    pub first_failed_at: DateTime<Utc>,
    /// Dead-lettered: blocked until an operator acts, never retried.
    pub dead: bool,
    /// When it became dead ([`Blocks::generation`] at the time), so a view of
    /// the dead-letter table taken earlier cannot resolve it.
    pub dead_since: u64,
}

/// Blocked or dead aggregates the relay keeps track of, at most; past this
/// the relay stops reading until some are resolved.
pub const MAX_BLOCKED_AGGREGATES: usize = 100_000;

/// Blocked aggregates, shared by successive pipelines.
#[derive(Debug)]
pub struct Blocks {
    map: HashMap<String, Block>,
    base: Duration,
    max: Duration,
    /// Counts dead-marking events; see [`Block::dead_since`].
    generation: u64,
}

impl Blocks {
    pub fn new(base: Duration, max: Duration) -> Self {
        Blocks {
            map: HashMap::new(),
            base,
            max,
            generation: 0,
        }
    }

    /// Records a refusal; returns the block (with its attempt count and retry time).
    pub fn block(
        &mut self,
        aggregate: &str,
        event_id: Option<&str>,
        reason: String,
        now: Instant,
    ) -> &Block {
        // A dead aggregate stays dead, whatever else of it is refused.
        if self.map.get(aggregate).is_some_and(|b| b.dead) {
            return &self.map[aggregate];
        }
        let (attempts, first_failed_at) = match self.map.get(aggregate) {
            Some(b) if b.event_id.as_deref() == event_id => {
                (b.attempts.saturating_add(1), b.first_failed_at)
            }
            _ => (1, Utc::now()),
        };
        let delay = backoff::jittered(self.base, self.max, attempts).max(self.base / 2);
        self.map.insert(
            aggregate.to_owned(),
            Block {
                event_id: event_id.map(str::to_owned),
                reason,
                attempts,
                until: Some(now + delay),
                first_failed_at,
                dead: false,
                dead_since: 0,
            },
        );
        &self.map[aggregate]
    }

    /// True when events of `aggregate` must wait.
    pub fn is_blocked(&self, aggregate: &str) -> bool {
        self.map
            .get(aggregate)
            .is_some_and(|b| b.dead || b.until.is_some())
    }

    /// The id of the dead-lettered event blocking `aggregate`, if it is dead.
    pub fn dead_event(&self, aggregate: &str) -> Option<&str> {
        self.map
            .get(aggregate)
            .filter(|b| b.dead)
            .map(|b| b.event_id.as_deref().unwrap_or(""))
    }

    /// The aggregate's event went to the dead-letter table.
    pub fn mark_dead(&mut self, aggregate: &str) {
        self.generation += 1;
        if let Some(b) = self.map.get_mut(aggregate) {
            b.dead = true;
            b.until = None;
            b.dead_since = self.generation;
        }
    }

    /// The current generation: dead blocks marked later have a greater `dead_since`.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Aggregates with open dead letters (from the table): dead, whatever
    /// state they were in.
    pub fn set_dead(&mut self, aggregates: impl IntoIterator<Item = String>) {
        self.generation += 1;
        for a in aggregates {
            let b = self.map.entry(a).or_insert_with(|| Block {
                event_id: None,
                reason: "open dead letter".into(),
                attempts: 0,
                until: None,
                first_failed_at: Utc::now(),
                dead: true,
                dead_since: 0,
            });
            b.dead = true;
            b.until = None;
            b.dead_since = self.generation;
        }
    }

    /// Dead aggregates no longer in `open` (a view of the dead-letter table
    /// taken at generation `seen`): an operator redrove or dropped their dead
    /// letters. They are unblocked and returned. Aggregates that died after
    /// `seen` are left alone: the view could not know them.
    pub fn resolve_missing(&mut self, open: &HashSet<String>, seen: u64) -> Vec<String> {
        let gone: Vec<String> = self
            .map
            .iter()
            .filter(|(a, b)| b.dead && b.dead_since <= seen && !open.contains(*a))
            .map(|(a, _)| a.clone())
            .collect();
        for a in &gone {
            self.map.remove(a);
        }
        gone
    }

    /// Unblocks an aggregate at once.
    pub fn resolve(&mut self, aggregate: &str) {
        self.map.remove(aggregate);
    }

    pub fn has_dead(&self) -> bool {
        self.map.values().any(|b| b.dead)
    }

    /// Aggregates tracked (blocked, released for retry, or dead).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn is_dead(&self, aggregate: &str) -> bool {
        self.map.get(aggregate).is_some_and(|b| b.dead)
    }

    /// An event of the aggregate was confirmed: its history ends.
    pub fn clear(&mut self, aggregate: &str) {
        if self
            .map
            .get(aggregate)
            .is_some_and(|b| b.until.is_none() && !b.dead)
        {
            self.map.remove(aggregate);
        }
    }

    /// The earliest time a block expires (dead aggregates do not expire).
    pub fn next_expiry(&self) -> Option<Instant> {
        self.map
            .values()
            .filter(|b| !b.dead)
            .filter_map(|b| b.until)
            .min()
    }

    /// Releases every block that expired by `now`; returns how many.
    pub fn release_expired(&mut self, now: Instant) -> usize {
        let mut n = 0;
        for b in self.map.values_mut() {
            if b.until.is_some_and(|t| t <= now) {
                b.until = None;
                n += 1;
            }
        }
        n
    }

    /// Aggregates currently held back.
    pub fn blocked_count(&self) -> usize {
        self.map.values().filter(|b| b.until.is_some()).count()
    }
}

/// The in-memory part of the window: what is unconfirmed or waiting, per aggregate.
#[derive(Debug)]
pub struct Scheduler<P> {
    per_aggregate: usize,
    in_flight: HashMap<String, usize>,
    in_flight_total: usize,
    parked: HashMap<String, VecDeque<SourcedEvent<P>>>,
    parked_total: usize,
}

/// What to do with an event that arrived from the source.
#[derive(Debug)]
pub enum Admission<P> {
    /// Send it now.
    Send(SourcedEvent<P>),
    /// It waits behind its aggregate's unconfirmed messages.
    Parked,
    /// Its aggregate is blocked: it stays unsent in the outbox for later.
    Deferred(SourcedEvent<P>),
}

impl<P> Scheduler<P> {
    /// `per_aggregate`: unconfirmed messages allowed per aggregate (`None`: no limit).
    pub fn new(per_aggregate: Option<usize>) -> Self {
        Scheduler {
            per_aggregate: per_aggregate.unwrap_or(usize::MAX).max(1),
            in_flight: HashMap::new(),
            in_flight_total: 0,
            parked: HashMap::new(),
            parked_total: 0,
        }
    }

    /// Events in memory: unconfirmed plus parked.
    pub fn used(&self) -> usize {
        self.in_flight_total + self.parked_total
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight_total
    }

    pub fn admit(&mut self, event: SourcedEvent<P>, blocks: &Blocks) -> Admission<P> {
        let aggregate = event.aggregate_id();
        if blocks.is_blocked(aggregate) {
            return Admission::Deferred(event);
        }
        let busy = self.in_flight.get(aggregate).copied().unwrap_or(0) >= self.per_aggregate
            || self.parked.contains_key(aggregate);
        if busy {
            self.parked
                .entry(aggregate.to_owned())
                .or_default()
                .push_back(event);
            self.parked_total += 1;
            Admission::Parked
        } else {
            Admission::Send(event)
        }
    }

    /// The event was handed to the broker.
    pub fn sent(&mut self, aggregate: &str) {
        *self.in_flight.entry(aggregate.to_owned()).or_default() += 1;
        self.in_flight_total += 1;
    }

    /// A message of `aggregate` was confirmed, or its send failed: returns the
    /// aggregate's next parked event if it may go now.
    pub fn finished(&mut self, aggregate: &str) -> Option<SourcedEvent<P>> {
        if let Some(n) = self.in_flight.get_mut(aggregate) {
            *n -= 1;
            self.in_flight_total -= 1;
            if *n == 0 {
                self.in_flight.remove(aggregate);
            }
        }
        let in_flight = self.in_flight.get(aggregate).copied().unwrap_or(0);
        if in_flight >= self.per_aggregate {
            return None;
        }
        let queue = self.parked.get_mut(aggregate)?;
        let next = queue.pop_front();
        if queue.is_empty() {
            self.parked.remove(aggregate);
        }
        if next.is_some() {
            self.parked_total -= 1;
        }
        next
    }

    /// Takes the aggregate's parked events out, in order (its block defers them).
    pub fn drop_parked(&mut self, aggregate: &str) -> VecDeque<SourcedEvent<P>> {
        let q = self.parked.remove(aggregate).unwrap_or_default();
        self.parked_total -= q.len();
        q
    }

    /// Drops every parked event (before a rewind re-reads them).
    pub fn clear_parked(&mut self) {
        self.parked.clear();
        self.parked_total = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::RowError;

    fn ev(pos: u32, aggregate: &str) -> SourcedEvent<u32> {
        SourcedEvent {
            position: pos,
            event: Err(RowError {
                id: Some(pos.to_string()),
                aggregate_id: Some(aggregate.into()),
                reason: "test".into(),
                raw: None,
            }),
        }
    }

    fn blocks() -> Blocks {
        Blocks::new(Duration::from_secs(1), Duration::from_secs(60))
    }

    #[test]
    fn one_in_flight_per_aggregate_parks_the_rest_in_order() {
        let b = blocks();
        let mut s = Scheduler::new(Some(1));
        assert!(matches!(s.admit(ev(1, "a"), &b), Admission::Send(_)));
        s.sent("a");
        assert!(matches!(s.admit(ev(2, "a"), &b), Admission::Parked));
        assert!(matches!(s.admit(ev(3, "a"), &b), Admission::Parked));
        assert!(
            matches!(s.admit(ev(4, "b"), &b), Admission::Send(_)),
            "other aggregates flow"
        );
        s.sent("b");
        assert_eq!(s.used(), 4);
        let next = s.finished("a").unwrap();
        assert_eq!(next.position, 2);
        s.sent("a");
        assert!(s.finished("b").is_none());
        assert_eq!(s.finished("a").unwrap().position, 3);
        s.sent("a");
        assert!(s.finished("a").is_none());
        assert_eq!(s.used(), 0);
    }

    #[test]
    fn a_parked_aggregate_stays_parked_until_its_queue_drains() {
        let b = blocks();
        let mut s = Scheduler::new(Some(2));
        assert!(matches!(s.admit(ev(1, "a"), &b), Admission::Send(_)));
        s.sent("a");
        assert!(matches!(s.admit(ev(2, "a"), &b), Admission::Send(_)));
        s.sent("a");
        assert!(matches!(s.admit(ev(3, "a"), &b), Admission::Parked));
        // Even with room again, a newcomer must not overtake the parked event.
        assert_eq!(s.finished("a").unwrap().position, 3);
        assert!(s.parked.is_empty());
    }

    #[test]
    fn unlimited_sends_everything() {
        let b = blocks();
        let mut s: Scheduler<u32> = Scheduler::new(None);
        for i in 0..100 {
            assert!(matches!(s.admit(ev(i, "a"), &b), Admission::Send(_)));
            s.sent("a");
        }
        assert_eq!(s.in_flight(), 100);
    }

    #[test]
    fn blocked_aggregates_are_deferred_and_retried_with_growing_delays() {
        let mut b = blocks();
        let mut s = Scheduler::new(Some(1));
        let now = Instant::now();
        let first = b
            .block("a", Some("e1"), "too large".into(), now)
            .until
            .unwrap();
        assert!(first > now);
        assert!(matches!(s.admit(ev(1, "a"), &b), Admission::Deferred(_)));
        assert!(matches!(s.admit(ev(2, "b"), &b), Admission::Send(_)));
        assert_eq!(b.next_expiry(), Some(first));
        assert_eq!(b.release_expired(first), 1);
        assert!(!b.is_blocked("a"));
        assert_eq!(b.block("a", Some("e1"), "again".into(), now).attempts, 2);
        assert_eq!(b.block("a", Some("e2"), "other".into(), now).attempts, 1);
        b.release_expired(now + Duration::from_secs(3600));
        b.clear("a");
        assert_eq!(b.blocked_count(), 0);
        assert!(b.next_expiry().is_none());
    }

    #[test]
    fn a_dead_aggregate_stays_dead() {
        let mut b = blocks();
        let now = Instant::now();
        b.block("a", Some("e1"), "refused".into(), now);
        b.mark_dead("a");
        // A second in-flight event of the aggregate is refused afterwards.
        let after = b.block("a", Some("e2"), "refused too".into(), now);
        assert!(
            after.dead,
            "the second refusal must not turn it back into a retry"
        );
        assert_eq!(b.next_expiry(), None);
        b.release_expired(now + Duration::from_secs(3600));
        assert!(b.is_blocked("a"));
    }

    #[test]
    fn the_table_makes_a_retrying_aggregate_dead() {
        let mut b = blocks();
        b.block("a", Some("e1"), "refused".into(), Instant::now());
        b.set_dead(["a".to_owned()]);
        assert!(b.is_dead("a"));
        assert_eq!(b.next_expiry(), None);
    }

    #[test]
    fn an_older_view_of_the_table_cannot_resolve_a_newer_dead_aggregate() {
        let mut b = blocks();
        let now = Instant::now();
        b.block("x", Some("x1"), "r".into(), now);
        b.mark_dead("x");
        let seen = b.generation();
        // The refresh question went out here; then p dies.
        b.block("p", Some("p1"), "r".into(), now);
        b.mark_dead("p");
        let open: HashSet<String> = HashSet::new(); // the view knows neither
        assert_eq!(b.resolve_missing(&open, seen), vec!["x".to_owned()]);
        assert!(b.is_dead("p"), "p died after the view was taken");
    }
}
