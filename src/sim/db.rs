//! The simulated database as the relay reaches it: the acker's [`RowStore`]
//! on the ownership session, and a polling reader.
//!
//! The polling reader is a double of the SQL one (ticks bounded by commit
//! snapshots, unsent rows in `relay_seq` order); the SQL itself is tested
//! against PostgreSQL.

use super::world::{Letter, Resolution, Shared, lock};
use crate::config::MarkMode;
use crate::dead_letter::{DeadLetter, OpenLetters, Written};
use crate::source::record::{Answered, Renew, RowStore};
use crate::source::rows::Paging;
use crate::source::{Reader, SourceError, SourcedEvent};
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::time::Duration;
use tokio::time::Instant;

/// The model's counterparts of the relay's `lookups::EXTEND_BATCH` and
/// `dead_letter::REQUESTED_BATCH`, small enough that the simulation's
/// requests take several looks.
const EXTEND_BATCH: usize = 2;
const REQUESTED_BATCH: usize = 3;

fn lost_session() -> SourceError {
    SourceError::Stream("sim: the ownership session is gone".into())
}

/// A statement's round trip: a little latency (now and then a long one),
/// then the statement at one instant, then a little more before the answer
/// arrives. A session that ends meanwhile may take the answer with it: the
/// statement took effect, and the relay sees an error (a commit whose reply
/// was lost).
pub(super) async fn latency(world: &Shared) {
    let d = {
        let mut w = lock(world);
        if w.rng.u32(0..400) == 0 {
            // Now and then a statement waits on a lock or a stalled disk,
            // at times for longer than the ownership lease.
            let d = Duration::from_millis(w.rng.u64(300..4_500));
            w.note(format!("a statement takes {d:?}"));
            d
        } else {
            Duration::from_micros(w.rng.u64(0..3_000))
        }
    };
    tokio::time::sleep(d).await;
}

pub struct SimStore {
    world: Shared,
    reign: u64,
    mark: MarkMode,
    answered: Answered,
}

impl SimStore {
    pub fn new(world: Shared, reign: u64, mark: MarkMode) -> Self {
        SimStore {
            world,
            reign,
            mark,
            answered: Answered::default(),
        }
    }

    async fn statement<T>(
        &self,
        f: impl FnOnce(&mut super::world::World) -> T + Send,
    ) -> Result<T, SourceError> {
        let sent = Instant::now();
        latency(&self.world).await;
        if lock(&self.world).silent_reigns.contains(&self.reign) {
            std::future::pending::<()>().await;
        }
        let out = {
            let mut w = lock(&self.world);
            if !w.owns(self.reign) {
                return Err(lost_session());
            }
            f(&mut w)
        };
        latency(&self.world).await;
        let mut w = lock(&self.world);
        if !w.owns(self.reign) && w.rng.bool() {
            w.note(format!(
                "reign {}: a statement took effect, its answer is lost",
                self.reign
            ));
            return Err(lost_session());
        }
        self.answered.note(sent);
        Ok(out)
    }
}

/// Marks the unsent rows of `seqs` (with ranges, records them as one
/// progress row); returns how many it changed.
fn mark_rows(w: &mut super::world::World, mark: MarkMode, seqs: &[i64], check: bool) -> u64 {
    let mut changed = 0;
    for seq in seqs {
        let Some(row) = w
            .rows
            .get(seq)
            // A progress row names its rows whether or not their
            // transaction is visible yet; a mark updates visible rows only.
            .filter(|r| !w.is_sent(r) && (mark == MarkMode::Ranges || !w.unseen.contains(&r.xid)))
        else {
            continue;
        };
        let id = row.id.clone();
        if check && !w.deliveries.iter().any(|d| d.event_id == id) {
            w.violation(format!(
                "row {seq} (event {id}) marked sent, but the broker never confirmed it"
            ));
        }
        match mark {
            MarkMode::Update => {
                if let Some(r) = w.rows.get_mut(seq) {
                    r.sent = true;
                }
            }
            MarkMode::Delete => {
                w.rows.remove(seq);
            }
            MarkMode::None | MarkMode::Ranges => {}
        }
        changed += 1;
    }
    if mark == MarkMode::Ranges {
        // One INSERT names every value it was given.
        w.record(seqs);
    }
    changed
}

impl RowStore for SimStore {
    async fn wait_visible(&self, xids: Vec<u32>) -> Result<(), SourceError> {
        self.statement(|w| w.unseen.retain(|x| !xids.contains(&(*x as u32))))
            .await
    }

    async fn mark(&self, seqs: &[i64]) -> Result<u64, SourceError> {
        if self.mark == MarkMode::None || seqs.is_empty() {
            return Ok(0);
        }
        let mark = self.mark;
        self.statement(|w| mark_rows(w, mark, seqs, true)).await
    }

    async fn dead_letter<P: Sync>(
        &mut self,
        letters: &[DeadLetter<P>],
    ) -> Result<Written, SourceError> {
        let mark = self.mark;
        // The aggregates' locks, held by a redrive in progress.
        while letters
            .iter()
            .any(|l| lock(&self.world).redrive_locks.contains(l.aggregate_id()))
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        self.statement(|w| {
            let mut out = Written::default();
            for (i, l) in letters.iter().enumerate() {
                let aggregate = l.aggregate_id().to_owned();
                let follower_resolved = out.resolved.contains(&aggregate)
                    || (l.follows.is_some() && !w.open_letters().any(|o| o.aggregate == aggregate));
                if follower_resolved {
                    out.resolved.insert(aggregate);
                    continue;
                }
                // As the real write: a follower of letters whose redrive was
                // asked for is asked for too.
                let requested = l.follows.is_some()
                    && w.open_letters()
                        .find(|o| o.aggregate == aggregate)
                        .is_some_and(|o| o.requested);
                let event_id = l.raw.id.clone().unwrap_or_default();
                w.note(format!("dead letter: {event_id} of {aggregate}"));
                let letter_id = w.letters.len() as i64 + 1;
                w.letters.push(Letter {
                    letter_id,
                    event_id,
                    aggregate,
                    raw: l.raw.clone(),
                    resolution: None,
                    requested,
                    wal: l.wal,
                    follows: l.follows.is_some(),
                    after_deliveries: w.deliveries.len(),
                });
                out.written.push(i);
            }
            let seqs: Vec<i64> = out.written.iter().filter_map(|&i| letters[i].seq).collect();
            mark_rows(w, mark, &seqs, false);
            out
        })
        .await
    }

    async fn open_dead_letters(&self) -> Result<OpenLetters, SourceError> {
        self.statement(|w| {
            // As the real query: the earliest place, unknown when any is.
            let mut open = OpenLetters::new();
            for l in w.open_letters() {
                let place = open.entry(l.aggregate.clone()).or_insert(l.wal);
                *place = place.zip(l.wal).map(|(a, b)| a.min(b));
            }
            open
        })
        .await
    }

    async fn heartbeat(&self) -> Result<(), SourceError> {
        self.statement(|_| ()).await
    }

    fn report_answers_to(&self, lease: std::sync::Arc<dyn Renew>) {
        self.answered.report_to(lease);
    }

    async fn requested_letters(
        &self,
        max_bytes: usize,
    ) -> Result<crate::dead_letter::Requests, SourceError> {
        self.statement(|w| {
            // As the relay's statements do, in batches far smaller than
            // theirs, so a request takes several looks: a request on an
            // aggregate's oldest open letter is extended to its followers in
            // (aggregate, letter) order, EXTEND_BATCH per look; then the
            // requested letters of aggregates with no open letter nobody
            // asked for are handed over, oldest first, REQUESTED_BATCH at most,
            // and only while those taken hold less than `max_bytes` of text.
            let open = |l: &&mut Letter| l.resolution.is_none();
            let mut first: BTreeMap<String, bool> = BTreeMap::new();
            for l in w.letters.iter_mut().filter(open) {
                first.entry(l.aggregate.clone()).or_insert(l.requested);
            }
            let mut followers: Vec<&mut Letter> = w
                .letters
                .iter_mut()
                .filter(open)
                .filter(|l| !l.requested && first.get(&l.aggregate) == Some(&true))
                .collect();
            followers.sort_by(|a, b| (&a.aggregate, a.letter_id).cmp(&(&b.aggregate, b.letter_id)));
            let extended = followers.len().min(EXTEND_BATCH);
            for l in followers.into_iter().take(EXTEND_BATCH) {
                l.requested = true;
            }
            if extended > 0 {
                w.note(format!("a look extended requests to {extended} followers"));
            }
            let waiting: BTreeSet<String> = w
                .letters
                .iter_mut()
                .filter(open)
                .filter(|l| !l.requested)
                .map(|l| l.aggregate.clone())
                .collect();
            let mut bytes = 0usize;
            let mut ready = w
                .letters
                .iter_mut()
                .filter(open)
                .filter(|l| l.requested && !waiting.contains(&l.aggregate))
                .take(REQUESTED_BATCH)
                .peekable();
            let mut letters = Vec::new();
            while let Some(l) = ready.next_if(|_| bytes < max_bytes || letters.is_empty()) {
                bytes = bytes.saturating_add(l.raw.text_len());
                letters.push(crate::dead_letter::Requested {
                    letter_id: l.letter_id,
                    raw: l.raw.clone(),
                });
            }
            if ready.peek().is_some() {
                w.note(format!(
                    "a look's room held {} requested letters",
                    letters.len()
                ));
            }
            crate::dead_letter::Requests {
                letters,
                extending: extended == EXTEND_BATCH,
            }
        })
        .await
    }

    async fn letters_sent(&self, ids: &[i64]) -> Result<(), SourceError> {
        self.statement(|w| {
            for l in w.letters.iter_mut() {
                if ids.contains(&l.letter_id) && l.resolution.is_none() {
                    l.resolution = Some(Resolution::Redriven);
                    l.requested = false;
                }
            }
            w.note(format!("letters {ids:?} redriven"));
        })
        .await
    }

    async fn letter_refused(
        &self,
        id: i64,
        _reason: &str,
        counts: bool,
    ) -> Result<(), SourceError> {
        self.statement(|w| {
            let Some(aggregate) = w
                .letters
                .iter()
                .find(|l| l.letter_id == id)
                .map(|l| l.aggregate.clone())
            else {
                return;
            };
            w.note(format!("letter {id} refused again (counts: {counts})"));
            if counts {
                for l in w.letters.iter_mut() {
                    if l.aggregate == aggregate && l.resolution.is_none() {
                        l.requested = false;
                    }
                }
            }
        })
        .await
    }
}

/// A double of the polling reader: ticks bounded by commit snapshots.
pub struct SimPolling {
    world: Shared,
    poll_interval: Duration,
    /// Commits seen by the previous tick's snapshot; `None` reads every unsent row.
    prev: Option<usize>,
    cur: Option<usize>,
    cursor: i64,
    idle: bool,
    next_poll: Instant,
    paging: Paging,
}

impl SimPolling {
    pub fn new(world: Shared, poll_interval: Duration) -> Self {
        SimPolling {
            world,
            poll_interval,
            prev: None,
            cur: None,
            cursor: 0,
            idle: false,
            next_poll: Instant::now(),
            paging: Paging::default(),
        }
    }
}

impl Reader for SimPolling {
    type Position = i64;

    async fn next_batch(
        &mut self,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<SourcedEvent<i64>>, SourceError> {
        let max = max.max(1);
        loop {
            if self.cur.is_none() && self.idle {
                let notify = lock(&self.world).commit_notify.clone();
                let woken = notify.notified();
                tokio::pin!(woken);
                woken.as_mut().enable();
                let seen = self.prev.unwrap_or(0);
                if lock(&self.world).commits.len() <= seen {
                    tokio::select! {
                        biased;
                        _ = woken => {}
                        _ = tokio::time::sleep_until(self.next_poll) => {}
                    }
                }
                self.idle = false;
            }
            latency(&self.world).await;
            let limit = self.paging.limit(max, max_bytes);
            let (snapshot, paged) = {
                let mut w = lock(&self.world);
                // A snapshot sees every commit before it.
                w.unseen.clear();
                let snapshot = self.cur.unwrap_or(w.commits.len());
                let from = self.prev.unwrap_or(0);
                let tick: HashSet<u64> = w.commits[from.min(snapshot)..snapshot]
                    .iter()
                    .copied()
                    .collect();
                // As the real reader: `limit` rows in `relay_seq` order,
                // kept while the rows before them take less than the room.
                let mut page = self.paging.page(limit, max_bytes);
                let answer = w
                    .rows
                    .range(self.cursor + 1..)
                    .filter(|(_, r)| !w.is_sent(r) && tick.contains(&r.xid))
                    .take(limit);
                for (seq, r) in answer {
                    if !page.takes_another() {
                        break;
                    }
                    let raw = r.raw();
                    let bytes = crate::source::rows::row_bytes(&raw);
                    page.keep((*seq, raw), bytes);
                }
                (snapshot, self.paging.finish(page))
            };
            let rows = paged.rows;
            latency(&self.world).await;
            if self.cur.is_none() {
                self.cur = Some(snapshot);
            }
            if let Some((seq, _)) = rows.last() {
                self.cursor = *seq;
            }
            if !paged.full {
                self.prev = self.cur.take();
                self.cursor = 0;
                if rows.is_empty() {
                    self.idle = true;
                    self.next_poll = Instant::now() + self.poll_interval;
                }
            }
            if !rows.is_empty() {
                let now = chrono::Utc::now();
                return Ok(rows
                    .into_iter()
                    .map(|(seq, raw)| SourcedEvent::new(seq, raw.decode(now)))
                    .collect());
            }
        }
    }

    fn rewind(&mut self) {
        self.prev = None;
        self.cur = None;
        self.cursor = 0;
        self.idle = false;
    }
}

/// `outbox-relay dlq redrive` and `drop`, as their transactions do them.
pub mod admin {
    use super::*;
    use crate::dead_letter::admin::Target;

    fn targeted(w: &super::super::world::World, target: &Target) -> Vec<usize> {
        w.letters
            .iter()
            .enumerate()
            .filter(|(_, l)| l.resolution.is_none())
            .filter(|(_, l)| match target {
                Target::Id(id) => &l.event_id == id,
                Target::Aggregate(a) => &l.aggregate == a,
                Target::All => true,
            })
            .map(|(i, _)| i)
            .collect()
    }

    /// One transaction of a drop: at most `batch` targeted letters, each
    /// aggregate's newest first (an id's letters at once); returns how many
    /// it dropped. The command repeats it until it drops fewer than `batch`.
    pub fn drop_batch(world: &Shared, target: &Target, batch: usize) -> usize {
        let mut w = lock(world);
        let mut chosen = targeted(&w, target);
        if !matches!(target, Target::Id(_)) {
            // As the real drop: a redrive of these aggregates is called off.
            set_earliest_requested(&mut w, &chosen, false);
            chosen.sort_by(|&a, &b| {
                (&w.letters[a].aggregate, std::cmp::Reverse(a))
                    .cmp(&(&w.letters[b].aggregate, std::cmp::Reverse(b)))
            });
            chosen.truncate(batch);
        }
        for &i in &chosen {
            w.letters[i].resolution = Some(Resolution::Dropped);
            let id = w.letters[i].event_id.clone();
            if let Some(e) = w.events.get_mut(&id) {
                e.dropped = true;
            }
        }
        w.note(format!("dlq drop {target:?}: {} letters", chosen.len()));
        chosen.len()
    }

    /// Asks the relay to publish the targeted letters again: marks each
    /// targeted aggregate's earliest open letter, which the relay's looks
    /// carry on to the later ones.
    pub fn redrive(world: &Shared, target: &Target) -> Result<usize, String> {
        let mut w = lock(world);
        let chosen = targeted(&w, target);
        if let Target::Id(id) = target {
            let Some(&first) = chosen.first() else {
                return Err(format!("no open dead letter with id {id:?}"));
            };
            let aggregate = &w.letters[first].aggregate;
            let open = |before: bool| {
                w.letters
                    .iter()
                    .enumerate()
                    .filter(|(i, l)| {
                        l.resolution.is_none()
                            && &l.aggregate == aggregate
                            && (*i < first) == before
                            && *i != first
                    })
                    .count() as i64
            };
            crate::dead_letter::admin::redrive_one_allowed(id, open(true), open(false))?;
        }
        set_earliest_requested(&mut w, &chosen, true);
        w.note(format!("dlq redrive {target:?}: {} letters", chosen.len()));
        Ok(chosen.len())
    }

    /// Sets whether a redrive is requested on the earliest open letter of
    /// each aggregate of the `chosen` letters (what a request on it covers).
    fn set_earliest_requested(
        w: &mut super::super::world::World,
        chosen: &[usize],
        requested: bool,
    ) {
        let aggregates: std::collections::BTreeSet<String> = chosen
            .iter()
            .map(|&i| w.letters[i].aggregate.clone())
            .collect();
        for aggregate in &aggregates {
            if let Some(l) = w
                .letters
                .iter_mut()
                .find(|l| l.resolution.is_none() && &l.aggregate == aggregate)
            {
                l.requested = requested;
            }
        }
    }

    /// Whether an aggregate has open letters its earliest's request does
    /// not cover (a redrive would make a new request).
    pub fn unasked(w: &super::super::world::World) -> bool {
        let mut seen = std::collections::HashSet::new();
        w.open_letters()
            .any(|l| seen.insert(l.aggregate.as_str()) && !l.requested)
    }
}
