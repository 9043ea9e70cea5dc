//! Switching a running outbox from `relay.mark = "update"` to `"ranges"`,
//! the way the README's upgrade steps do it: every instance stops cleanly,
//! the progress tables appear (`migrate`), and every instance starts again
//! with the new setting. Rows marked by `relay_sent_at` before the switch
//! count as sent from then on (the predicate's first clause), and whatever
//! was on the way at the stop (a backlog, open dead letters, a slot behind
//! the table) is taken over by ranges.

use super::fold::FoldSettings;
use super::params::{Focus, Params};
use super::scenario::Instance;
use super::world::{Shared, lock};
use crate::config::{Config, MarkMode};

/// A switch to come, at a fault's turn.
pub(super) struct Upgrade {
    pub(super) settings: FoldSettings,
    pub(super) config: Config,
    /// Performed before this fault; when it is the number of faults, after
    /// the last one, once `delay` has passed.
    pub(super) before_fault: usize,
    pub(super) delay: std::time::Duration,
}

/// The configuration a schedule starts with, and the fold settings from
/// the start or an upgrade to ranges later. Drawn from the fold's own
/// generator, after its settings, so that schedules of other marking modes,
/// and the ranges schedules without an upgrade, stay as they were.
pub(super) fn plan(
    seed: u64,
    params: &Params,
    config: Config,
) -> (Config, Option<FoldSettings>, Option<Upgrade>) {
    if params.mark != MarkMode::Ranges {
        return (config, None, None);
    }
    let mut rng = fastrand::Rng::with_seed(seed ^ 0x00f0_1d0f_5eed);
    let settings = FoldSettings::random(&mut rng);
    if params.focus != Focus::Mixed || rng.u32(0..3) != 0 {
        return (config, Some(settings), None);
    }
    let mut before = config.clone();
    before.relay.mark = MarkMode::Update;
    let upgrade = Upgrade {
        settings,
        config,
        before_fault: rng.usize(0..=params.faults),
        delay: std::time::Duration::from_millis(rng.u64(50..1500)),
    };
    (before, None, Some(upgrade))
}

impl Upgrade {
    /// Stops every instance cleanly, creates the progress tables and starts
    /// every instance again with ranges; returns the new configuration.
    pub(super) async fn perform(
        self,
        world: &Shared,
        instances: &mut [Instance],
    ) -> Result<Config, String> {
        lock(world).note("upgrade: every instance stops, to start again with ranges".into());
        for i in instances.iter_mut() {
            i.stop(world).await?;
        }
        {
            let mut w = lock(world);
            w.progress.settings = Some(self.settings);
            w.progress.counts.upgrades += 1;
        }
        for i in instances.iter_mut() {
            *i = Instance::start(world, &self.config, i.id);
        }
        Ok(self.config)
    }
}
