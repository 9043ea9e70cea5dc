//! The fold `run` schedules with `relay.mark = "ranges"` (`ops::fold`), as
//! each simulated instance runs it: under one lock for the outbox, every
//! interval it moves the frontier to the capture it took a round before,
//! then takes the next; a round that finds the relay draining doubles the
//! pause. Its connection may drop between any two statements, and the
//! instance may crash at any await: the next folder starts with a fresh
//! capture.

use super::db::latency;
use super::world::{Advance, Capture, Shared, lock};
use crate::outbox::progress::fold::HoldLimits;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How a schedule's folds behave (drawn per schedule, far shorter than
/// the relay's: a schedule lasts seconds).
#[derive(Debug, Clone, Copy)]
pub struct FoldSettings {
    /// `relay.fold_interval`.
    pub interval: Duration,
    /// How long a capture waits for the transactions running at its start.
    pub settle: Duration,
    /// Rows a round holds open at most (`HoldLimits`, far lower than the
    /// relay's).
    pub limits: HoldLimits,
}

impl FoldSettings {
    pub fn random(rng: &mut fastrand::Rng) -> Self {
        let interval = Duration::from_millis(rng.u64(20..600));
        // Often none: the capture keeps its first look.
        let settle = Duration::from_millis(if rng.bool() { 0 } else { rng.u64(0..400) });
        let drain = rng.usize(1..40);
        // Drawn apart, so that the draws above stay what they were.
        let mut stuck = fastrand::Rng::with_seed(rng.get_seed() ^ 0x57AC_0F01D);
        FoldSettings {
            interval,
            settle,
            limits: HoldLimits {
                drain,
                stuck: drain * stuck.usize(2..200),
                stuck_after: Duration::from_millis(stuck.u64(50..3_000)),
            },
        }
    }
}

/// The pause's ceiling while the relay drains (`BACKLOG_INTERVAL_MAX`).
const BACKLOG_INTERVAL_MAX: Duration = Duration::from_secs(60);
/// How often a capture looks for a snapshot past its transaction id.
const SETTLE_POLL: Duration = Duration::from_millis(10);

/// The folding session ended: its lock with it.
struct Lost;

/// Folds until `shutdown`.
pub async fn run(
    world: Shared,
    instance: usize,
    settings: FoldSettings,
    shutdown: CancellationToken,
) {
    let mut folder = Folder {
        world: world.clone(),
        instance,
        settings,
        locked: false,
        pending: None,
    };
    let mut wait = settings.interval;
    // Since when every round found more rows than it could hold.
    let mut backlog: Option<tokio::time::Instant> = None;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = tokio::time::sleep(wait) => {}
        }
        let limit = settings.limits.at(backlog, tokio::time::Instant::now());
        wait = match folder.round(limit).await {
            Ok(Some(Advance::Backlog)) => {
                backlog.get_or_insert_with(tokio::time::Instant::now);
                (wait * 2).clamp(settings.interval, BACKLOG_INTERVAL_MAX)
            }
            Ok(_) => {
                backlog = None;
                settings.interval
            }
            Err(Lost) => {
                folder.locked = false;
                folder.pending = None;
                lock(&world).release_fold_lock(instance);
                settings.interval
            }
        };
    }
    lock(&world).release_fold_lock(instance);
}

struct Folder {
    world: Shared,
    instance: usize,
    settings: FoldSettings,
    locked: bool,
    pending: Option<Capture>,
}

impl Folder {
    /// A statement on the folding session: the lock must still be this
    /// session's; now and then the connection drops after the statement
    /// took effect.
    async fn statement<T>(&self, f: impl FnOnce(&mut super::world::World) -> T) -> Result<T, Lost> {
        latency(&self.world).await;
        let out = {
            let mut w = lock(&self.world);
            if self.locked && w.progress.fold_lock != Some(self.instance) {
                return Err(Lost);
            }
            f(&mut w)
        };
        latency(&self.world).await;
        let mut w = lock(&self.world);
        if w.rng.u32(0..100) == 0 {
            w.note(format!(
                "instance {}: the folding connection drops, its answer lost",
                self.instance
            ));
            return Err(Lost);
        }
        Ok(out)
    }

    /// Moves the frontier to the pending capture (if any), then takes the
    /// next; `None` when another instance folds or there was no capture.
    async fn round(&mut self, limit: usize) -> Result<Option<Advance>, Lost> {
        if !self.locked {
            let instance = self.instance;
            self.locked = self.statement(|w| w.take_fold_lock(instance)).await?;
            if !self.locked {
                return Ok(None);
            }
        }
        let outcome = match self.pending.take() {
            Some(target) => Some(self.statement(|w| w.advance_fold(&target, limit)).await?),
            None => None,
        };
        self.pending = Some(self.capture().await?);
        Ok(outcome)
    }

    /// The newest progress row, then a transaction id, then a snapshot whose
    /// oldest running transaction is past it (waiting at most `settle`).
    async fn capture(&self) -> Result<Capture, Lost> {
        let progress = self.statement(|w| w.newest_progress()).await?;
        let assigned = self.statement(|w| w.take_xid()).await?;
        let deadline = tokio::time::Instant::now() + self.settings.settle;
        loop {
            let snapshot = self
                .statement(|w| {
                    let snapshot = w.session_snapshot();
                    // Commits decoded before other sessions saw them
                    // become visible within moments: to the next look,
                    // more often than not.
                    if w.rng.u32(0..3) != 0 {
                        w.unseen.clear();
                    }
                    snapshot
                })
                .await?;
            let settled = snapshot.xmin > assigned;
            if settled || tokio::time::Instant::now() >= deadline {
                lock(&self.world).note(format!(
                    "instance {}: fold captured {snapshot:?} at progress {progress} (settled: {settled})",
                    self.instance
                ));
                return Ok(Capture {
                    snapshot,
                    progress,
                    settled,
                });
            }
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }
}
