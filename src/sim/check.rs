//! What must hold after a schedule (the online checks, marking and slot
//! acknowledgement and zombie publishing, are in the world itself).

use super::params::Params;
use super::world::World;
use crate::config::{HoldPolicy, MarkMode, SourceMode};
use std::collections::{BTreeMap, BTreeSet};

fn delivered(w: &World) -> BTreeSet<&str> {
    w.deliveries.iter().map(|d| d.event_id.as_str()).collect()
}

/// After the faults: every committed event is delivered, dead-lettered (or
/// dropped), or waits in the outbox behind an open dead letter of its
/// aggregate (`wait`).
pub fn quiescent(w: &World, params: &Params) -> bool {
    if w.txs.values().any(|s| *s == super::world::TxState::Open) {
        return false;
    }
    let got = delivered(w);
    let open: BTreeSet<&str> = w.open_letters().map(|l| l.event_id.as_str()).collect();
    let dead: BTreeSet<&str> = w.open_letters().map(|l| l.aggregate.as_str()).collect();
    w.order.values().flatten().all(|id| {
        got.contains(id.as_str())
            || open.contains(id.as_str())
            || w.events.get(id).is_some_and(|e| e.dropped)
            || (params.policy == HoldPolicy::Wait
                && w.events
                    .get(id)
                    .is_some_and(|e| dead.contains(e.aggregate.as_str())))
    })
}

/// After the cure: every committed event was delivered or dropped.
pub fn all_delivered(w: &World) -> bool {
    let got = delivered(w);
    w.order
        .values()
        .flatten()
        .all(|id| got.contains(id.as_str()) || w.events.get(id).is_some_and(|e| e.dropped))
}

/// The checks over the whole history.
pub fn finally(w: &World, params: &Params) -> Vec<String> {
    let mut out = Vec::new();
    // Nothing rolled back is published.
    for d in &w.deliveries {
        if w.events
            .get(&d.event_id)
            .is_some_and(|e| e.aborted && !e.committed)
        {
            out.push(format!("{} was rolled back but published", d.event_id));
        }
    }
    // Nothing committed is lost.
    let got = delivered(w);
    for id in w.order.values().flatten() {
        if !got.contains(id.as_str()) && !w.events.get(id).is_some_and(|e| e.dropped) {
            out.push(format!("{id} was committed but never delivered"));
        }
    }
    // Each aggregate's first deliveries in commit order.
    let mut first: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, d) in w.deliveries.iter().enumerate() {
        first.entry(d.event_id.as_str()).or_insert(i);
    }
    for (aggregate, ids) in &w.order {
        let mut last: Option<(&str, usize)> = None;
        for id in ids {
            let Some(&at) = first.get(id.as_str()) else {
                continue;
            };
            if let Some((prev, prev_at)) = last
                && at < prev_at
            {
                out.push(format!(
                    "{aggregate}: {id} was first delivered before {prev}, which was committed earlier"
                ));
            }
            last = Some((id, at));
        }
    }
    out.extend(only_refused_events_dead_lettered(w));
    out.extend(dead_lettered_after_max_attempts(w, params));
    out.extend(duplicates_beyond_bound(w, params));
    // Marked modes end with nothing unsent.
    if params.mark != MarkMode::None {
        let left: Vec<i64> = w.unsent().map(|r| r.seq).take(5).collect();
        if !left.is_empty() {
            out.push(format!(
                "rows {left:?} are still unsent after every event was delivered and the relay stopped"
            ));
        }
    }
    if params.mode != SourceMode::Polling && w.slot_active.is_some() {
        out.push("a replication stream is still open after every instance stopped".into());
    }
    out
}

/// Duplicates only from incidents, each bounded by the window.
fn duplicates_beyond_bound(w: &World, params: &Params) -> Option<String> {
    let delivered: BTreeSet<&str> = w.deliveries.iter().map(|d| d.event_id.as_str()).collect();
    let duplicates = w.deliveries.len() - delivered.len();
    // The documented bound: the in-flight window per incident; without
    // marking, CDC may also repeat what was confirmed since the slot was
    // last told (at most another window), and so may logical messages
    // with marking (the WAL is their only record too).
    let wal_only =
        params.mark == MarkMode::None || (params.messages && params.mode != SourceMode::Polling);
    let per_incident = if wal_only {
        params.max_in_flight as u64 * 2
    } else {
        params.max_in_flight as u64
    };
    // And, where the WAL is the only record (without marking; logical
    // messages with it), what was confirmed behind an event that waited
    // for its confirmation or its retry when an incident struck, what a
    // database restart made the slot forget, and what a clean stop left
    // behind an event it no longer sent (excused, and bounded, below).
    let behind = w.repeats_behind_pins() + w.repeats_forgotten + repeats_after_clean_stops(w);
    let bound = u64::from(w.incidents) * per_incident + behind;
    if duplicates as u64 > bound {
        return Some(format!(
            "{duplicates} duplicates, over {} incidents x {per_incident} + {behind} confirmed behind a waiting event or forgotten by the slot",
            w.incidents
        ));
    }
    // And so at every point: a repeat sent before the (n+1)th cause of
    // repeats can come only from the first n, so one incident that repeated
    // many windows cannot hide in later incidents' allowance.
    // Copies sent on different connections land in either order: a repeat
    // counts under the latest cause of any copy of its event so far.
    let mut latest: BTreeMap<&str, u32> = BTreeMap::new();
    let mut by_causes: BTreeMap<u32, u64> = BTreeMap::new();
    for d in &w.deliveries {
        match latest.get_mut(d.event_id.as_str()) {
            None => {
                latest.insert(&d.event_id, d.causes);
            }
            Some(causes) => {
                *causes = (*causes).max(d.causes);
                *by_causes.entry(*causes).or_default() += 1;
            }
        }
    }
    let mut sent = 0;
    by_causes.into_iter().find_map(|(causes, n)| {
        sent += n;
        let bound = u64::from(causes) * per_incident + behind;
        (sent > bound).then(|| {
            format!(
                "{sent} duplicates sent while at most {causes} causes of repeats had happened, over {causes} x {per_incident} + {behind}"
            )
        })
    })
}

/// Back-pressure is never a refusal: a row written unpoisoned that the
/// broker never refused is dead-lettered only behind an earlier letter of
/// its aggregate (following it), never first. (A logical message held back
/// has no row to wait in, and goes to the dead-letter table.)
/// This covers an event replayed after it was delivered (CDC without
/// marking replays from the slot after a restart) when no earlier event of
/// its aggregate was dead-lettered.
fn only_refused_events_dead_lettered(w: &World) -> Vec<String> {
    let mut out = Vec::new();
    for l in &w.letters {
        let Some(e) = w.events.get(&l.event_id) else {
            continue;
        };
        if e.poisoned || e.refusals > 0 || e.message {
            continue;
        }
        let earlier = w.order.get(&l.aggregate).is_some_and(|ids| {
            ids.iter()
                .take_while(|id| **id != l.event_id)
                .any(|id| w.letters.iter().any(|other| other.event_id == *id))
        });
        if !earlier {
            out.push(format!(
                "{} ({}) was dead-lettered although the broker never refused it and no earlier event of its aggregate was",
                l.event_id, l.aggregate
            ));
        }
    }
    out
}

/// An event the broker refused goes to the dead-letter table on its own
/// account (not following an earlier letter) only after the broker refused
/// it `dead_letter.max_attempts` times: refusals of other events of its
/// aggregate, confirmed since, do not count toward it.
fn dead_lettered_after_max_attempts(w: &World, params: &Params) -> Vec<String> {
    let mut out = Vec::new();
    for l in w.letters.iter().filter(|l| !l.follows) {
        let Some(e) = w.events.get(&l.event_id) else {
            continue;
        };
        // The refusals the relay was told of, before sending or after (an
        // unreadable row is not seen by the broker).
        if e.refusals_seen == 0 || e.message {
            continue;
        }
        if e.refusals_seen < params.max_attempts {
            out.push(format!(
                "{} ({}) was dead-lettered after {} refusal(s) of its own, fewer than max_attempts = {}",
                l.event_id, l.aggregate, e.refusals_seen, params.max_attempts
            ));
        }
    }
    out
}

/// A clean stop repeats nothing the table records: an event delivered
/// before it is not delivered again by a later owner that sent it with no
/// incident and no unclean stop since, unless its only record is the WAL
/// (a logical message; any event without marking) and it was committed
/// after the slot's position at the stop (held there by an event the relay
/// had read and not sent), or it was left for a later owner (unsent in the
/// table, or an open dead letter: a repeat an earlier incident allows). The
/// global bound above would absorb such repeats among the other incidents'
/// windows.
pub fn nothing_repeated_after_a_clean_stop(w: &World) -> Vec<String> {
    let (mut out, _) = clean_stop_repeats(w);
    out.truncate(5);
    out
}

/// The repeats [`nothing_repeated_after_a_clean_stop`] excuses that the
/// stopping owner's own deliveries make: events whose only record is the
/// WAL, delivered by the owner that stopped after the slot's position at
/// the stop, sent again by the next owner.
pub fn repeats_after_clean_stops(w: &World) -> u64 {
    clean_stop_repeats(w).1
}

/// The violations, and the excused repeats.
fn clean_stop_repeats(w: &World) -> (Vec<String>, u64) {
    let (mut out, mut excused) = (Vec::new(), 0);
    for stop in &w.clean_stops {
        let before: BTreeSet<&str> = w.deliveries[..stop.deliveries]
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        let replayed: BTreeSet<&str> = w
            .wal
            .iter()
            .filter(|t| t.commit_lsn >= stop.slot)
            .flat_map(|t| &t.rows)
            .filter(|r| w.wal_only(r.message))
            .map(|r| r.id.as_str())
            .collect();
        // Delivered by the owner that stopped (a repeat of what an earlier
        // owner delivered is an earlier incident's).
        let own: BTreeSet<&str> = w.deliveries[..stop.deliveries]
            .iter()
            .filter(|d| d.reign == stop.reign)
            .map(|d| d.event_id.as_str())
            .collect();
        for d in &w.deliveries[stop.deliveries..] {
            let id = d.event_id.as_str();
            let repeat = d.reign > stop.reign && d.causes == stop.causes && before.contains(id);
            if repeat && replayed.contains(id) {
                excused += u64::from(own.contains(id));
            } else if repeat && !stop.pending.contains(id) {
                out.push(format!(
                    "{} was delivered before reign {}'s clean stop and again by reign {}, with no incident since",
                    d.event_id, stop.reign, d.reign
                ));
            }
        }
    }
    (out, excused)
}
