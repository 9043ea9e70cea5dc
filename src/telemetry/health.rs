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

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub struct PipelineHealth {
    pub name: String,
    shards: u32,
    started: AtomicBool,
    /// The runs of the shards this instance owns, by shard index.
    runs: Mutex<BTreeMap<u32, Run>>,
    /// What each failing shard last failed with, by shard index.
    failures: Mutex<BTreeMap<u32, String>>,
    stall_after: Duration,
    epoch: Instant,
}

/// The run of one owned shard (or the whole outbox).
#[derive(Debug)]
struct Run {
    /// Still setting up its source and sink (a busy replication slot is
    /// waited for there).
    setting_up: bool,
    in_flight: usize,
    /// Milliseconds since `epoch` of its last confirmation (or idle moment).
    last_progress_ms: u64,
}

/// A pipeline's state as the endpoints show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub ready: bool,
    /// `active`, `standby`, `starting`, `failing: ...`, `stalled: ...`.
    pub state: String,
}

impl PipelineHealth {
    /// `shards`: `relay.shards`, to name a stalled shard.
    pub fn new(name: &str, shards: u32, stall_after: Duration) -> Arc<Self> {
        Arc::new(PipelineHealth {
            name: name.to_owned(),
            shards,
            started: AtomicBool::new(false),
            runs: Mutex::new(BTreeMap::new()),
            failures: Mutex::new(BTreeMap::new()),
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

    fn runs(&self) -> std::sync::MutexGuard<'_, BTreeMap<u32, Run>> {
        self.runs.lock().unwrap_or_else(|e| e.into_inner())
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

    /// What `shard` failed with no longer stands; nothing else is known.
    pub fn cleared(&self, shard: u32) {
        self.failures().remove(&shard);
    }

    pub fn failing(&self, shard: u32, reason: &str) {
        self.failures().insert(shard, reason.to_owned());
    }

    /// This instance took ownership of a shard (or the whole outbox). It
    /// is not ready until the run [`relaying`], and a failure of the
    /// previous run stands until then: a run that fails again at once (a
    /// lost slot, a missing publication) must not read as ready between its
    /// attempts.
    ///
    /// [`relaying`]: PipelineHealth::relaying
    pub fn acquired(&self, shard: u32) {
        self.started.store(true, Ordering::SeqCst);
        let run = Run {
            setting_up: true,
            in_flight: 0,
            last_progress_ms: self.now_ms(),
        };
        self.runs().insert(shard, run);
    }

    /// The run of `shard` got past its source's and sink's setup and relays.
    pub fn relaying(&self, shard: u32) {
        self.healthy(shard);
        let now = self.now_ms();
        if let Some(run) = self.runs().get_mut(&shard) {
            run.setting_up = false;
            run.last_progress_ms = now;
        }
    }

    pub fn released(&self, shard: u32) {
        self.runs().remove(&shard);
    }

    /// A confirmation arrived for the run of `shard`.
    pub fn progress(&self, shard: u32) {
        let now = self.now_ms();
        if let Some(run) = self.runs().get_mut(&shard) {
            run.last_progress_ms = now;
        }
    }

    /// The run of `shard` has `n` messages unconfirmed (none: it is idle,
    /// which is progress too).
    pub fn set_in_flight(&self, shard: u32, n: usize) {
        let now = self.now_ms();
        if let Some(run) = self.runs().get_mut(&shard) {
            run.in_flight = n;
            if n == 0 {
                run.last_progress_ms = now;
            }
        }
    }

    pub fn is_active(&self) -> bool {
        !self.runs().is_empty()
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
        let now = self.now_ms();
        let runs = self.runs();
        if runs.is_empty() {
            return Status {
                ready: true,
                state: "standby".into(),
            };
        }
        if runs.values().any(|r| r.setting_up) {
            return not_ready(
                "taking over: setting up the source and the sink (the log says what it waits for)"
                    .into(),
            );
        }
        // Each run by itself: one that confirms says nothing of another.
        let stalled = runs.iter().find_map(|(shard, r)| {
            let quiet = Duration::from_millis(now.saturating_sub(r.last_progress_ms));
            (r.in_flight > 0 && quiet > self.stall_after).then_some((*shard, r.in_flight, quiet))
        });
        if let Some((shard, in_flight, quiet)) = stalled {
            let which = match self.shards {
                1 => String::new(),
                n => format!("shard {shard}/{n}: "),
            };
            return not_ready(format!(
                "stalled: {which}{in_flight} event(s) unconfirmed, no confirmation for {}s",
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
        let h = PipelineHealth::new("p", 1, Duration::from_millis(50));
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
        h.set_in_flight(0, 3);
        assert_eq!(h.status().state, "active");
        std::thread::sleep(Duration::from_millis(80));
        assert!(h.status().state.starts_with("stalled"), "{:?}", h.status());
        h.progress(0);
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
    fn a_shard_that_confirms_does_not_hide_one_that_stalled() {
        let h = PipelineHealth::new("p", 2, Duration::from_millis(50));
        for shard in [0, 1] {
            h.acquired(shard);
            h.relaying(shard);
        }
        h.set_in_flight(0, 4);
        h.set_in_flight(1, 2);
        std::thread::sleep(Duration::from_millis(80));
        h.progress(1);
        h.set_in_flight(1, 0);
        assert_eq!(
            h.status().state,
            "stalled: shard 0/2: 4 event(s) unconfirmed, no confirmation for 0s"
        );
        h.released(0);
        assert_eq!(h.status().state, "active", "the stalled shard's run ended");
    }

    #[test]
    fn a_shard_held_elsewhere_does_not_clear_another_shards_failure() {
        let h = PipelineHealth::new("p", 1, Duration::from_secs(10));
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
