//! Per-aggregate scheduling: which event may go to the broker now, and in
//! which order the broker's answers are handled.
//!
//! Events arrive in source order. An aggregate has one message in flight at
//! a time, unless the sink keeps order within a *lane* even when a message
//! fails (Kafka: a refused message fails every later one of the same topic
//! and key, the idempotent producer's gapless guarantee): then several may
//! be in flight, up to `per_aggregate`, as long as they share the lane. An
//! event that may not go yet is parked behind its aggregate's, in order; one
//! whose aggregate is blocked is deferred (dropped from memory, still unsent
//! in the source, read again after a rewind).
//!
//! Answers of one aggregate are handled in send order, whatever order the
//! broker gives them in: a refusal is always seen before anything sent
//! after it, so nothing later is recorded as sent ahead of it, and the
//! attempt count goes to the right event.

use crate::source::SourcedEvent;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// What the scheduler needs to know of an event's route: its lane. The
/// pipeline parks the rendered route with the event, so that it is rendered
/// once; the tests park a bare lane.
pub trait Laned {
    /// The lane (`None`: one message of the aggregate at a time).
    fn lane(&self) -> Option<&str>;
}

impl Laned for Option<String> {
    fn lane(&self) -> Option<&str> {
        self.as_deref()
    }
}

/// What to do with an event that arrived from the source.
#[derive(Debug)]
pub enum Admission<P, R> {
    /// Send it now, by this route.
    Send(SourcedEvent<P>, R),
    /// It waits behind its aggregate's unconfirmed messages.
    Parked,
    /// Its aggregate is blocked: it stays unsent in the source for later.
    Deferred(SourcedEvent<P>),
}

/// One sent event, and its answer once it came.
#[derive(Debug)]
struct Sent<O> {
    ticket: u64,
    lane: Option<Arc<str>>,
    outcome: Option<O>,
    /// The answer is a failure: nothing more of the aggregate goes out
    /// until it is handled (a refusal before sending has no lane to
    /// protect what follows).
    failed: bool,
}

#[derive(Debug)]
struct Aggregate<P, O, R> {
    sent: VecDeque<Sent<O>>,
    parked: VecDeque<(SourcedEvent<P>, R)>,
    /// How many of `sent` were answered with a failure.
    failures: usize,
}

impl<P, O, R> Aggregate<P, O, R> {
    fn new() -> Self {
        Aggregate {
            sent: VecDeque::new(),
            parked: VecDeque::new(),
            failures: 0,
        }
    }
}

/// Idle aggregates' entries kept for reuse, at most.
const SPARE_ENTRIES: usize = 64;

/// An entry is kept for reuse only if its queues hold at most this many
/// slots (and its name 4 times as many bytes).
const SPARE_CAPACITY: usize = 64;

/// The in-memory part of the window: what is unconfirmed or waiting, per
/// aggregate. `O` is the answer of one send, `R` an event's route.
#[derive(Debug)]
pub struct Scheduler<P, O, R = Option<String>> {
    per_aggregate: usize,
    aggregates: HashMap<String, Aggregate<P, O, R>>,
    /// Entries of aggregates that went idle, kept (a few, small ones) to
    /// be used again: a busy outbox's aggregates come and go with every
    /// answer, and their names and queues are then not allocated again.
    spare: Vec<(String, Aggregate<P, O, R>)>,
    in_flight: usize,
    parked: usize,
    next_ticket: u64,
}

impl<P, O, R: Laned> Scheduler<P, O, R> {
    /// `per_aggregate`: messages of one lane allowed in flight per aggregate (`None`: no limit).
    pub fn new(per_aggregate: Option<usize>) -> Self {
        Scheduler {
            per_aggregate: per_aggregate.unwrap_or(usize::MAX).max(1),
            aggregates: HashMap::new(),
            spare: Vec::new(),
            in_flight: 0,
            parked: 0,
            next_ticket: 0,
        }
    }

    /// Events in memory: unanswered plus parked.
    pub fn used(&self) -> usize {
        self.in_flight + self.parked
    }

    /// Events sent and not yet handled.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// The aggregate's events sent and not yet handled.
    pub fn in_flight_of(&self, aggregate: &str) -> usize {
        self.aggregates.get(aggregate).map_or(0, |a| a.sent.len())
    }

    fn may_send(&self, a: &Aggregate<P, O, R>, lane: Option<&str>) -> bool {
        match a.sent.back() {
            None => true,
            Some(last) => {
                lane.is_some()
                    && last.lane.as_deref() == lane
                    && a.sent.len() < self.per_aggregate
                    && a.failures == 0
            }
        }
    }

    /// `route`: the event's route, with the sink's lane for it;
    /// `blocked`: its aggregate is held back.
    pub fn admit(&mut self, event: SourcedEvent<P>, route: R, blocked: bool) -> Admission<P, R> {
        if blocked {
            return Admission::Deferred(event);
        }
        let aggregate = event.aggregate_id();
        let ready = match self.aggregates.get(aggregate) {
            None => true,
            Some(a) => a.parked.is_empty() && self.may_send(a, route.lane()),
        };
        if ready {
            return Admission::Send(event, route);
        }
        match self.aggregates.get_mut(aggregate) {
            // Not ready: it has unconfirmed or parked events, so an entry.
            Some(a) => a.parked.push_back((event, route)),
            None => {
                let key = aggregate.to_owned();
                self.with_entry(&key, |a| a.parked.push_back((event, route)));
            }
        }
        self.parked += 1;
        Admission::Parked
    }

    /// The event goes to the broker; its answer is expected under the returned ticket.
    pub fn sent(&mut self, aggregate: &str, lane: Option<Arc<str>>) -> u64 {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let sent = Sent {
            ticket,
            lane,
            outcome: None,
            failed: false,
        };
        self.with_entry(aggregate, |a| a.sent.push_back(sent));
        self.in_flight += 1;
        ticket
    }

    /// The answer to `ticket` came (it is handled in turn, see
    /// [`Scheduler::next_answer`]); `failed` when it is not a confirmation.
    pub fn answered(&mut self, aggregate: &str, ticket: u64, outcome: O, failed: bool) {
        // Tickets grow in send order, so an aggregate's are sorted.
        let Some(a) = self.aggregates.get_mut(aggregate) else {
            return;
        };
        if let Ok(i) = a.sent.binary_search_by_key(&ticket, |s| s.ticket) {
            let s = &mut a.sent[i];
            match (s.failed, failed) {
                (false, true) => a.failures += 1,
                (true, false) => a.failures -= 1,
                _ => {}
            }
            s.outcome = Some(outcome);
            s.failed = failed;
        }
    }

    /// The aggregate's oldest answer, once every earlier one was handled.
    pub fn next_answer(&mut self, aggregate: &str) -> Option<O> {
        let a = self.aggregates.get_mut(aggregate)?;
        if a.sent.front().is_none_or(|s| s.outcome.is_none()) {
            return None;
        }
        let sent = a.sent.pop_front()?;
        if sent.failed {
            a.failures -= 1;
        }
        let outcome = sent.outcome;
        self.in_flight -= 1;
        self.forget_if_idle(aggregate);
        outcome
    }

    /// The aggregate's next parked event, when it may go now (not `blocked`).
    pub fn next_parked(&mut self, aggregate: &str, blocked: bool) -> Option<(SourcedEvent<P>, R)> {
        if blocked {
            return None;
        }
        let a = self.aggregates.get(aggregate)?;
        let (_, route) = a.parked.front()?;
        if !self.may_send(a, route.lane()) {
            return None;
        }
        let next = self.aggregates.get_mut(aggregate)?.parked.pop_front();
        self.parked -= 1;
        self.forget_if_idle(aggregate);
        next
    }

    /// Takes the aggregate's parked events out, in order (its block defers them).
    pub fn drop_parked(&mut self, aggregate: &str) -> Vec<SourcedEvent<P>> {
        let Some(a) = self.aggregates.get_mut(aggregate) else {
            return Vec::new();
        };
        let out: Vec<_> = a.parked.drain(..).map(|(e, _)| e).collect();
        self.parked -= out.len();
        self.forget_if_idle(aggregate);
        out
    }

    /// Drops every parked event (before a rewind re-reads them).
    pub fn clear_parked(&mut self) {
        for a in self.aggregates.values_mut() {
            a.parked.clear();
        }
        self.aggregates.retain(|_, a| !a.sent.is_empty());
        self.parked = 0;
    }

    /// Applies `f` to the aggregate's entry, made (from a spare one when
    /// there is one) if it has none.
    fn with_entry(&mut self, aggregate: &str, f: impl FnOnce(&mut Aggregate<P, O, R>)) {
        if let Some(a) = self.aggregates.get_mut(aggregate) {
            f(a);
            return;
        }
        let (mut key, mut a) = self
            .spare
            .pop()
            .unwrap_or_else(|| (String::new(), Aggregate::new()));
        key.clear();
        key.push_str(aggregate);
        a.sent.clear();
        a.parked.clear();
        a.failures = 0;
        f(&mut a);
        self.aggregates.insert(key, a);
    }

    fn forget_if_idle(&mut self, aggregate: &str) {
        if !self
            .aggregates
            .get(aggregate)
            .is_some_and(|a| a.sent.is_empty() && a.parked.is_empty())
        {
            return;
        }
        let Some((key, a)) = self.aggregates.remove_entry(aggregate) else {
            return;
        };
        // Only small entries are kept: one that held a long queue gives
        // its memory back.
        let small = a.sent.capacity() + a.parked.capacity() <= SPARE_CAPACITY
            && key.capacity() <= SPARE_CAPACITY * 4;
        if small && self.spare.len() < SPARE_ENTRIES {
            self.spare.push((key, a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::outbox::RowError;
    use crate::relay::blocks::Blocks;
    use std::time::Duration;
    use tokio::time::Instant;

    fn ev(pos: u32, aggregate: &str) -> SourcedEvent<u32> {
        SourcedEvent::new(
            pos,
            Err(RowError {
                id: Some(pos.to_string()),
                aggregate_id: Some(aggregate.into()),
                reason: "test".into(),
                raw: None,
            }),
        )
    }

    fn blocks() -> Blocks {
        Blocks::new(Duration::from_secs(1), Duration::from_secs(60))
    }

    fn lane(name: &str) -> Option<String> {
        Some(name.to_owned())
    }

    /// Admits and, when it may go, sends; returns the ticket.
    fn go(
        s: &mut Scheduler<u32, u32>,
        b: &Blocks,
        pos: u32,
        agg: &str,
        l: Option<String>,
    ) -> Option<u64> {
        match s.admit(ev(pos, agg), l, b.is_blocked(agg)) {
            Admission::Send(e, l) => Some(s.sent(e.aggregate_id(), l.map(Arc::from))),
            Admission::Parked => None,
            Admission::Deferred(_) => panic!("not blocked"),
        }
    }

    #[test]
    fn without_a_lane_one_message_per_aggregate_is_in_flight() {
        let b = blocks();
        let mut s = Scheduler::new(None);
        let t1 = go(&mut s, &b, 1, "a", None).unwrap();
        assert!(go(&mut s, &b, 2, "a", None).is_none(), "parked");
        assert!(go(&mut s, &b, 3, "a", None).is_none(), "parked");
        assert!(
            go(&mut s, &b, 4, "b", None).is_some(),
            "other aggregates flow"
        );
        assert_eq!(s.used(), 4);
        s.answered("a", t1, 1, false);
        assert_eq!(s.next_answer("a"), Some(1));
        let (next, l) = s.next_parked("a", b.is_blocked("a")).unwrap();
        assert_eq!(next.position, 2);
        s.sent("a", l.map(Arc::from));
        assert!(
            s.next_parked("a", b.is_blocked("a")).is_none(),
            "one at a time"
        );
    }

    #[test]
    fn a_lane_allows_several_until_the_route_changes() {
        let b = blocks();
        let mut s = Scheduler::new(None);
        assert!(go(&mut s, &b, 1, "a", lane("t1")).is_some());
        assert!(go(&mut s, &b, 2, "a", lane("t1")).is_some());
        assert!(
            go(&mut s, &b, 3, "a", lane("t2")).is_none(),
            "another topic waits"
        );
        assert!(
            go(&mut s, &b, 4, "a", lane("t1")).is_none(),
            "and so does what follows it"
        );
        assert_eq!(s.in_flight(), 2);
    }

    #[test]
    fn a_failure_waiting_its_turn_stops_the_lane() {
        let b = blocks();
        let mut s = Scheduler::new(None);
        go(&mut s, &b, 1, "a", lane("t")).unwrap();
        // Refused before it was sent: nothing protects what would follow it.
        let t2 = go(&mut s, &b, 2, "a", lane("t")).unwrap();
        s.answered("a", t2, 2, true);
        assert!(go(&mut s, &b, 3, "a", lane("t")).is_none());
    }

    #[test]
    fn the_lane_opens_again_once_the_failure_is_handled() {
        let b = blocks();
        let mut s = Scheduler::new(None);
        let t1 = go(&mut s, &b, 1, "a", lane("t")).unwrap();
        let t2 = go(&mut s, &b, 2, "a", lane("t")).unwrap();
        let t3 = go(&mut s, &b, 3, "a", lane("t")).unwrap();
        s.answered("a", t2, 2, true);
        assert!(s.next_parked("a", false).is_none());
        assert!(go(&mut s, &b, 4, "a", lane("t")).is_none(), "parked");
        s.answered("a", t1, 1, false);
        s.answered("a", t3, 3, false);
        assert_eq!(s.next_answer("a"), Some(1));
        assert!(
            s.next_parked("a", false).is_none(),
            "the failure is not handled yet"
        );
        assert_eq!(s.next_answer("a"), Some(2));
        let (next, _) = s
            .next_parked("a", false)
            .expect("behind a confirmed message the lane is open again");
        assert_eq!(next.position, 4);
    }

    #[test]
    fn per_aggregate_caps_a_lane() {
        let b = blocks();
        let mut s = Scheduler::new(Some(2));
        assert!(go(&mut s, &b, 1, "a", lane("t")).is_some());
        assert!(go(&mut s, &b, 2, "a", lane("t")).is_some());
        assert!(go(&mut s, &b, 3, "a", lane("t")).is_none());
    }

    #[test]
    fn idle_entries_are_used_again_and_only_a_few_small_ones_kept() {
        let b = blocks();
        let mut s = Scheduler::new(Some(2));
        // 100 aggregates have a message out; each fails, and is handled.
        let tickets: Vec<u64> = (0..100)
            .map(|n| go(&mut s, &b, n, &format!("agg-{n}"), lane("t")).unwrap())
            .collect();
        assert_eq!(s.spare.len(), 0);
        for (n, t) in (0..100).zip(tickets) {
            let agg = format!("agg-{n}");
            s.answered(&agg, t, n, true);
            assert_eq!(s.next_answer(&agg), Some(n));
        }
        assert!(s.aggregates.is_empty());
        assert_eq!(s.spare.len(), SPARE_ENTRIES, "a few are kept");
        // An entry used again starts clean: the lane is open, up to the cap.
        assert!(go(&mut s, &b, 200, "fresh", lane("t")).is_some());
        assert!(go(&mut s, &b, 201, "fresh", lane("t")).is_some());
        assert!(go(&mut s, &b, 202, "fresh", lane("t")).is_none());
        assert_eq!(s.spare.len(), SPARE_ENTRIES - 1);
        // An aggregate that held a long queue gives its memory back.
        let t = go(&mut s, &b, 300, "long", None).unwrap();
        for n in 301..400 {
            assert!(go(&mut s, &b, n, "long", None).is_none(), "parked");
        }
        s.answered("long", t, 300, false);
        assert_eq!(s.next_answer("long"), Some(300));
        for n in 301..400 {
            let (next, l) = s.next_parked("long", false).unwrap();
            assert_eq!(next.position, n);
            let t = s.sent("long", l.map(Arc::from));
            s.answered("long", t, n, false);
            assert_eq!(s.next_answer("long"), Some(n));
        }
        assert!(!s.aggregates.contains_key("long"));
        assert!(
            s.spare
                .iter()
                .all(|(_, a)| a.sent.capacity() + a.parked.capacity() <= SPARE_CAPACITY),
            "no long queue is kept"
        );
    }

    #[test]
    fn answers_are_handled_in_send_order() {
        let b = blocks();
        let mut s = Scheduler::new(None);
        let t1 = go(&mut s, &b, 1, "a", lane("t")).unwrap();
        let t2 = go(&mut s, &b, 2, "a", lane("t")).unwrap();
        s.answered("a", t2, 2, false);
        assert_eq!(
            s.next_answer("a"),
            None,
            "the later answer waits for the earlier"
        );
        s.answered("a", t1, 1, false);
        assert_eq!(s.next_answer("a"), Some(1));
        assert_eq!(s.next_answer("a"), Some(2));
        assert_eq!(s.used(), 0);
        assert!(s.aggregates.is_empty());
    }

    #[test]
    fn a_blocked_aggregate_is_deferred_and_its_parked_events_dropped() {
        let mut b = blocks();
        let mut s = Scheduler::new(None);
        go(&mut s, &b, 1, "a", None).unwrap();
        assert!(go(&mut s, &b, 2, "a", None).is_none());
        b.block("a", Some("1"), "refused".into(), Instant::now(), true);
        assert!(matches!(
            s.admit(ev(3, "a"), None, b.is_blocked("a")),
            Admission::Deferred(_)
        ));
        assert!(s.next_parked("a", b.is_blocked("a")).is_none());
        assert_eq!(s.drop_parked("a").len(), 1);
        assert_eq!(s.used(), 1);
    }
}
