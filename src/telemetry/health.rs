//! What `/healthz` and `/readyz` report, kept up to date by the relay.
//!
//! A pipeline is ready when it relays (it owns its outbox, or some shards)
//! and is not stalled, or when it waits as a healthy standby; it is not ready
//! while starting, while failing (database or broker unreachable, a setup
//! problem), or when confirmations have stopped coming for longer than
//! `relay.confirm_timeout` with messages in flight.
//!
//! Failures are kept per shard (the whole outbox is shard 0): a shard that
//! another instance holds is a healthy standby, which says nothing about
//! a shard of this instance that keeps failing.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct PipelineHealth {
    pub name: String,
    started: AtomicBool,
    owned: AtomicUsize,
    in_flight: AtomicUsize,
    /// Milliseconds since `epoch` of the last confirmation (or idle moment).
    last_progress_ms: AtomicU64,
    /// What each failing shard last failed with, by shard index.
    failures: Mutex<BTreeMap<u32, String>>,
    /// Shards owned whose run is still setting up its source and sink (a
    /// busy replication slot is waited for there).
    setting_up: Mutex<BTreeSet<u32>>,
    stall_after: Duration,
    epoch: Instant,
}

/// A pipeline's state as the endpoints show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub ready: bool,
    /// `active`, `standby`, `starting`, `failing: ...`, `stalled: ...`.
    pub state: String,
}

impl PipelineHealth {
    pub fn new(name: &str, stall_after: Duration) -> Arc<Self> {
        Arc::new(PipelineHealth {
            name: name.to_owned(),
            started: AtomicBool::new(false),
            owned: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            last_progress_ms: AtomicU64::new(0),
            failures: Mutex::new(BTreeMap::new()),
            setting_up: Mutex::new(BTreeSet::new()),
            stall_after,
            epoch: Instant::now(),
        })
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn failures(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, String>> {
        self.failures.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn setting_up(&self) -> std::sync::MutexGuard<'_, BTreeSet<u32>> {
        self.setting_up.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The database answered and the instance knows its role for `shard`.
    pub fn healthy(&self, shard: u32) {
        self.started.store(true, Ordering::SeqCst);
        self.failures().remove(&shard);
    }

    /// `shard` is not this instance's to take now (its share is full):
    /// whatever it failed with before says nothing about it any more.
    pub fn not_taking(&self, shard: u32) {
        self.failures().remove(&shard);
    }

    pub fn failing(&self, shard: u32, reason: &str) {
        self.failures().insert(shard, reason.to_owned());
    }

    /// This instance took ownership of a shard (or the whole outbox). A
    /// failure of the previous run stands until this one [`relaying`]: a
    /// run that fails again at once (a lost slot, a missing publication)
    /// must not read as ready between its attempts.
    ///
    /// [`relaying`]: PipelineHealth::relaying
    /// Not ready until then either: the run is not relaying yet.
    pub fn acquired(&self, shard: u32) {
        self.started.store(true, Ordering::SeqCst);
        self.progress();
        self.setting_up().insert(shard);
        self.owned.fetch_add(1, Ordering::SeqCst);
    }

    /// The run of `shard` got past its source's and sink's setup and relays.
    pub fn relaying(&self, shard: u32) {
        self.healthy(shard);
        self.setting_up().remove(&shard);
        self.progress();
    }

    pub fn released(&self, shard: u32) {
        self.setting_up().remove(&shard);
        let _ = self
            .owned
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// A confirmation arrived, or nothing is in flight.
    pub fn progress(&self) {
        self.last_progress_ms
            .store(self.now_ms(), Ordering::Relaxed);
    }

    pub fn set_in_flight(&self, n: usize) {
        if n == 0 {
            self.progress();
        }
        self.in_flight.store(n, Ordering::Relaxed);
    }

    pub fn is_active(&self) -> bool {
        self.owned.load(Ordering::SeqCst) > 0
    }

    pub fn status(&self) -> Status {
        let not_ready = |state: String| Status {
            ready: false,
            state,
        };
        let failing = {
            let failures = self.failures();
            let first = failures.values().next().cloned();
            first.map(|reason| (reason, failures.len()))
        };
        if let Some((reason, count)) = failing {
            let more = match count {
                1 => String::new(),
                n => format!(" (and {} more failing shard(s))", n - 1),
            };
            return not_ready(format!("failing: {reason}{more}"));
        }
        if !self.started.load(Ordering::SeqCst) {
            return not_ready("starting".into());
        }
        if !self.is_active() {
            return Status {
                ready: true,
                state: "standby".into(),
            };
        }
        if !self.setting_up().is_empty() {
            return not_ready(
                "taking over: setting up the source and the sink (the log says what it waits for)"
                    .into(),
            );
        }
        let in_flight = self.in_flight.load(Ordering::Relaxed);
        let quiet = Duration::from_millis(
            self.now_ms()
                .saturating_sub(self.last_progress_ms.load(Ordering::Relaxed)),
        );
        if in_flight > 0 && quiet > self.stall_after {
            return not_ready(format!(
                "stalled: {in_flight} event(s) unconfirmed, no confirmation for {}s",
                quiet.as_secs()
            ));
        }
        Status {
            ready: true,
            state: "active".into(),
        }
    }
}

/// Every pipeline of the process.
#[derive(Debug, Default)]
pub struct Health {
    pipelines: Mutex<Vec<Arc<PipelineHealth>>>,
}

impl Health {
    pub fn register(&self, pipeline: Arc<PipelineHealth>) {
        self.pipelines
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(pipeline);
    }

    /// Ready when every pipeline is; one line per pipeline.
    pub fn readiness(&self) -> (bool, String) {
        let pipelines = self.pipelines.lock().unwrap_or_else(|e| e.into_inner());
        let mut ready = !pipelines.is_empty();
        let mut body = String::new();
        for p in pipelines.iter() {
            let s = p.status();
            ready &= s.ready;
            body.push_str(&format!("{}: {}\n", p.name, s.state));
        }
        (ready, body)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn states() {
        let h = PipelineHealth::new("p", Duration::from_millis(50));
        assert_eq!(h.status().state, "starting");
        h.healthy(0);
        assert_eq!(
            h.status(),
            Status {
                ready: true,
                state: "standby".into()
            }
        );
        h.acquired(0);
        assert_eq!(
            h.status().state,
            "taking over: setting up the source and the sink (the log says what it waits for)",
            "owning is not relaying yet (a busy slot is waited for after the lock)"
        );
        assert!(!h.status().ready);
        h.relaying(0);
        h.set_in_flight(3);
        assert_eq!(h.status().state, "active");
        std::thread::sleep(Duration::from_millis(80));
        assert!(h.status().state.starts_with("stalled"), "{:?}", h.status());
        h.progress();
        assert!(h.status().ready);
        h.failing(0, "broker unreachable");
        assert_eq!(
            h.status(),
            Status {
                ready: false,
                state: "failing: broker unreachable".into()
            }
        );
        h.released(0);
        h.acquired(0);
        assert!(
            !h.status().ready,
            "ownership alone does not clear the failure: the run may fail again at once"
        );
        h.relaying(0);
        assert!(h.status().ready, "relaying again clears the failure");
        let all = Health::default();
        all.register(h.clone());
        assert!(all.readiness().0);
        h.failing(0, "x");
        assert!(!all.readiness().0);
        assert_eq!(all.readiness().1, "p: failing: x\n");
    }

    #[test]
    fn a_shard_held_elsewhere_does_not_clear_another_shards_failure() {
        let h = PipelineHealth::new("p", Duration::from_secs(10));
        h.healthy(0);
        h.failing(1, "shard 1/4: broker unreachable");
        h.failing(3, "shard 3/4: broker unreachable");
        // Shard 2's supervisor finds its lock held by another instance.
        h.healthy(2);
        assert_eq!(
            h.status(),
            Status {
                ready: false,
                state: "failing: shard 1/4: broker unreachable (and 1 more failing shard(s))"
                    .into()
            }
        );
        h.not_taking(1);
        assert_eq!(h.status().state, "failing: shard 3/4: broker unreachable");
        h.acquired(3);
        h.relaying(3);
        assert!(h.status().ready, "{:?}", h.status());
    }
}
