//! Aggregates held back because the broker refused one of their events.
//!
//! A refusal blocks its aggregate until a retry time (backoff with full
//! jitter); other aggregates are never held up. Refusals come in *rounds*:
//! the first refusal after the aggregate was (re)tried opens a round and
//! counts one attempt against `dead_letter.max_attempts`; refusals of later
//! events of the same aggregate in that round (they were in flight behind
//! it) count nothing. Answers are handled in send order, so a round is
//! opened by the aggregate's first unconfirmed event; one opened by another
//! event means the earlier opener went through (confirmed here, or by
//! another owner while this one had lost the outbox), and the count starts
//! again. So an event is dead-lettered after it was refused at least
//! `max_attempts` times itself, and one that keeps being refused gets
//! there (a retry that reads the aggregate's events in another order, from
//! the table instead of the WAL, can restart the count once). Back-pressure
//! (a RabbitMQ nack) opens rounds for the backoff but never counts.
//!
//! Blocks outlive a pipeline restart (the supervisor keeps [`Blocks`] across
//! reconnects), so a refused event is retried on its own schedule rather
//! than at every reconnect. An aggregate whose event went to the dead-letter
//! table stays blocked ("dead") until an operator redrives or drops it.
//! Events of a dead aggregate from before its earliest open dead letter in
//! the WAL (a CDC stream replays them after a restart) were delivered before
//! it: they are not held back behind it. The place is known only when every
//! open letter of the aggregate has one from this server's WAL. A row read
//! from the table needs no place: the confirmations of an aggregate that
//! arose before its dead letter are recorded no later than the letter, so
//! an unsent row of a dead aggregate was not confirmed before it.

use crate::backoff;
use crate::dead_letter::OpenLetters;
use crate::replication::Lsn;
use chrono::{DateTime, Utc};
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// Why and until when an aggregate is held back.
#[derive(Debug, Clone)]
pub struct Block {
    /// The refused event that opened the current round.
    pub event_id: Option<String>,
    pub reason: String,
    /// Counted refusals (rounds opened by a refusal, not by back-pressure).
    pub attempts: u32,
    /// Rounds of any kind, for the backoff.
    rounds: u32,
    /// `Some` while waiting; `None` once released for a retry.
    pub until: Option<Instant>,
    /// When the aggregate was first refused.
    pub first_failed_at: DateTime<Utc>,
    /// Dead-lettered: blocked until an operator acts, never retried.
    pub dead: bool,
    /// When it became dead ([`Blocks::generation`] at the time), so a view of
    /// the dead-letter table taken earlier cannot resolve it.
    pub dead_since: u64,
    /// Where the aggregate's earliest open dead letter is in the WAL, when known.
    dead_at: Option<(Lsn, u64)>,
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

    /// Records a refusal (`counted`) or a nack; returns the block and whether
    /// this refusal opened a new round (only then may it lead to a dead letter).
    pub fn block(
        &mut self,
        aggregate: &str,
        event_id: Option<&str>,
        reason: String,
        now: Instant,
        counted: bool,
    ) -> (&Block, bool) {
        let (attempts, rounds, first_failed_at) = match self.map.get(aggregate) {
            // Dead stays dead; a later event refused in the same round adds nothing.
            Some(b) if b.dead || b.until.is_some() => return (&self.map[aggregate], false),
            Some(b) if b.event_id.as_deref() == event_id => {
                (b.attempts, b.rounds, b.first_failed_at)
            }
            // None yet, or the previous opener went through: this event's
            // count starts.
            _ => (0, 0, Utc::now()),
        };
        let attempts = attempts.saturating_add(u32::from(counted));
        let rounds = rounds.saturating_add(1);
        let delay = backoff::jittered(self.base, self.max, rounds).max(self.base / 2);
        self.map.insert(
            aggregate.to_owned(),
            Block {
                event_id: event_id.map(str::to_owned),
                reason,
                attempts,
                rounds,
                until: Some(now + delay),
                first_failed_at,
                dead: false,
                dead_since: 0,
                dead_at: None,
            },
        );
        (&self.map[aggregate], true)
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

    /// The aggregate's event (at `wal`, when read from the WAL) went to the
    /// dead-letter table.
    pub fn mark_dead(&mut self, aggregate: &str, wal: Option<(Lsn, u64)>) {
        self.generation += 1;
        if let Some(b) = self.map.get_mut(aggregate) {
            b.dead = true;
            b.until = None;
            b.dead_since = self.generation;
            b.dead_at = wal;
        }
    }

    /// True when `aggregate` is dead and an event of it at `wal` comes
    /// before its first dead letter: that event was delivered before the
    /// letter was written (the relay dead-letters an aggregate's first
    /// event the broker did not confirm), and is here again only because
    /// the stream replayed it. Unknown places answer false.
    pub fn delivered_before_dead_letter(&self, aggregate: &str, wal: Option<(Lsn, u64)>) -> bool {
        self.map.get(aggregate).is_some_and(|b| {
            b.dead && matches!((wal, b.dead_at), (Some(event), Some(letter)) if event < letter)
        })
    }

    /// The current generation: dead blocks marked later have a greater `dead_since`.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Aggregates with open dead letters (from the table, with the place of
    /// the first): dead, whatever state they were in. One already dead keeps
    /// the earlier place, and an unknown one stays unknown.
    pub fn set_dead(&mut self, aggregates: impl IntoIterator<Item = (String, Option<(Lsn, u64)>)>) {
        self.generation += 1;
        for (a, place) in aggregates {
            let b = self.map.entry(a).or_insert_with(|| Block {
                event_id: None,
                reason: "open dead letter".into(),
                attempts: 0,
                rounds: 0,
                until: None,
                first_failed_at: Utc::now(),
                dead: false,
                dead_since: 0,
                dead_at: None,
            });
            b.dead_at = match (b.dead, b.dead_at, place) {
                (false, _, place) => place,
                (true, Some(known), Some(place)) => Some(known.min(place)),
                (true, _, _) => None,
            };
            b.dead = true;
            b.until = None;
            b.dead_since = self.generation;
        }
    }

    /// Dead aggregates no longer in `open` (a view of the dead-letter table
    /// taken at generation `seen`): an operator redrove or dropped their dead
    /// letters. They are unblocked and returned. Aggregates that died after
    /// `seen` are left alone: the view could not know them.
    pub fn resolve_missing(&mut self, open: &OpenLetters, seen: u64) -> Vec<String> {
        let gone: Vec<String> = self
            .map
            .iter()
            .filter(|(a, b)| b.dead && b.dead_since <= seen && !open.contains_key(*a))
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

    /// Forgets the aggregates released for a retry whose retried event has
    /// not been confirmed yet: all they hold is a count of attempts (a
    /// forgotten one starts again). What is left is held back or dead.
    /// Returns how many were forgotten.
    pub fn forget_released(&mut self) -> usize {
        let before = self.map.len();
        self.map.retain(|_, b| b.dead || b.until.is_some());
        before - self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    pub fn is_dead(&self, aggregate: &str) -> bool {
        self.map.get(aggregate).is_some_and(|b| b.dead)
    }

    /// Event `event_id` of the aggregate was confirmed: when it is the one
    /// that was refused, the aggregate's history ends (an earlier event sent
    /// again after a restart leaves the count alone).
    pub fn clear(&mut self, aggregate: &str, event_id: &str) {
        if self.map.get(aggregate).is_some_and(|b| {
            b.until.is_none() && !b.dead && b.event_id.as_deref() == Some(event_id)
        }) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn blocks() -> Blocks {
        Blocks::new(Duration::from_secs(1), Duration::from_secs(60))
    }

    #[test]
    fn forgetting_released_aggregates_keeps_the_held_and_the_dead() {
        let mut b = blocks();
        let now = Instant::now();
        for a in ["held", "released", "dead"] {
            b.block(a, Some("e"), "refused".into(), now, true);
        }
        b.mark_dead("dead", None);
        b.map.get_mut("released").unwrap().until = None;
        assert_eq!(b.forget_released(), 1);
        assert_eq!(b.len(), 2);
        assert!(b.is_blocked("held") && b.is_dead("dead"));
        let (again, _) = b.block("released", Some("e"), "refused".into(), now, true);
        assert_eq!(again.attempts, 1, "its count starts again");
    }

    #[test]
    fn blocks_expire_and_count_one_attempt_per_round() {
        let mut b = blocks();
        let now = Instant::now();
        let (first, new) = b.block("a", Some("e1"), "too large".into(), now, true);
        assert!(new);
        let until = first.until.unwrap();
        assert!(until > now);
        assert!(b.is_blocked("a"));
        assert_eq!(b.next_expiry(), Some(until));
        assert_eq!(b.release_expired(until), 1);
        assert!(!b.is_blocked("a"));
        let (again, new) = b.block("a", Some("e1"), "again".into(), now, true);
        assert!(new);
        assert_eq!(again.attempts, 2);
        b.release_expired(now + Duration::from_secs(3600));
        b.clear("a", "e1");
        assert_eq!(b.blocked_count(), 0);
        assert!(b.next_expiry().is_none());
        assert!(b.is_empty());
    }

    #[test]
    fn refusals_behind_the_opener_count_nothing() {
        let mut b = blocks();
        let now = Instant::now();
        let mut attempts = 0;
        for _ in 0..6 {
            // Two events in flight; answers come in send order.
            let (block, new) = b.block("a", Some("e1"), "refused".into(), now, true);
            assert!(new);
            attempts = block.attempts;
            let (_, new) = b.block("a", Some("e2"), "refused".into(), now, true);
            assert!(!new, "a second refusal of the same round opens nothing");
            b.release_expired(now + Duration::from_secs(3600));
        }
        assert_eq!(attempts, 6);
    }

    #[test]
    fn a_round_opened_by_another_event_counts_afresh() {
        let mut b = blocks();
        let now = Instant::now();
        for _ in 0..2 {
            b.block("a", Some("e1"), "refused".into(), now, true);
            b.release_expired(now + Duration::from_secs(3600));
        }
        // e1 went through elsewhere (another owner delivered it): e2's
        // refusals are its own.
        let (block, new) = b.block("a", Some("e2"), "refused".into(), now, true);
        assert!(new);
        assert_eq!(block.attempts, 1);
        assert_eq!(block.event_id.as_deref(), Some("e2"));
    }

    #[test]
    fn back_pressure_backs_off_without_counting() {
        let mut b = blocks();
        let now = Instant::now();
        for _ in 0..5 {
            let (block, _) = b.block("a", Some("e1"), "queue full".into(), now, false);
            assert_eq!(block.attempts, 0);
            b.release_expired(now + Duration::from_secs(3600));
        }
        assert_eq!(
            b.block("a", Some("e1"), "refused".into(), now, true)
                .0
                .attempts,
            1
        );
    }

    #[test]
    fn an_earlier_event_confirmed_again_keeps_the_count() {
        let mut b = blocks();
        let now = Instant::now();
        b.block("a", Some("e2"), "refused".into(), now, true);
        b.release_expired(now + Duration::from_secs(3600));
        // e1, confirmed before the refusal, is sent again after a restart.
        b.clear("a", "e1");
        assert_eq!(
            b.block("a", Some("e2"), "refused".into(), now, true)
                .0
                .attempts,
            2
        );
    }

    #[test]
    fn a_dead_aggregate_stays_dead() {
        let mut b = blocks();
        let now = Instant::now();
        b.block("a", Some("e1"), "refused".into(), now, true);
        b.mark_dead("a", None);
        let (after, new) = b.block("a", Some("e2"), "refused too".into(), now, true);
        assert!(after.dead && !new);
        assert_eq!(b.next_expiry(), None);
        b.release_expired(now + Duration::from_secs(3600));
        assert!(b.is_blocked("a"));
    }

    #[test]
    fn the_table_makes_a_retrying_aggregate_dead() {
        let mut b = blocks();
        b.block("a", Some("e1"), "refused".into(), Instant::now(), true);
        b.set_dead([("a".to_owned(), None)]);
        assert!(b.is_dead("a"));
        assert_eq!(b.next_expiry(), None);
    }

    #[test]
    fn an_older_view_of_the_table_cannot_resolve_a_newer_dead_aggregate() {
        let mut b = blocks();
        let now = Instant::now();
        b.block("x", Some("x1"), "r".into(), now, true);
        b.mark_dead("x", None);
        let seen = b.generation();
        // The refresh question went out here; then p dies.
        b.block("p", Some("p1"), "r".into(), now, true);
        b.mark_dead("p", None);
        let open = OpenLetters::new(); // the view knows neither
        assert_eq!(b.resolve_missing(&open, seen), vec!["x".to_owned()]);
        assert!(b.is_dead("p"), "p died after the view was taken");
    }

    #[test]
    fn only_events_before_the_first_dead_letter_were_delivered() {
        let at = |lsn, index| Some((Lsn(lsn), index));
        let mut b = blocks();
        b.block("a", Some("e3"), "refused".into(), Instant::now(), true);
        b.mark_dead("a", at(200, 1));
        assert!(b.delivered_before_dead_letter("a", at(200, 0)));
        assert!(b.delivered_before_dead_letter("a", at(100, 7)));
        assert!(
            !b.delivered_before_dead_letter("a", at(200, 1)),
            "the letter itself"
        );
        assert!(!b.delivered_before_dead_letter("a", at(300, 0)));
        assert!(
            !b.delivered_before_dead_letter("a", None),
            "a place unknown"
        );
        assert!(!b.delivered_before_dead_letter("b", at(1, 0)), "not dead");
        // The table knows an earlier letter: the earlier place counts.
        b.set_dead([("a".to_owned(), at(150, 0))]);
        assert!(!b.delivered_before_dead_letter("a", at(160, 0)));
        assert!(b.delivered_before_dead_letter("a", at(140, 0)));
        // An open letter without a place (read by polling) makes it unknown.
        b.set_dead([("a".to_owned(), None)]);
        assert!(!b.delivered_before_dead_letter("a", at(1, 0)));
        // Dead from the table alone: its place is the table's.
        b.set_dead([("c".to_owned(), at(50, 2))]);
        assert!(b.delivered_before_dead_letter("c", at(50, 1)));
        assert!(!b.delivered_before_dead_letter("c", at(50, 3)));
    }
}
