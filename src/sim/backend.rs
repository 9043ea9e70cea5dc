//! One simulated instance's [`Backend`]: the world's ownership lock, and
//! pipelines over the world's database and broker.

use super::cdc::SimCdc;
use super::db::{SimPolling, SimStore};
use super::sink::SimSink;
use super::world::{Shared, lock};
use crate::config::ColumnMap;
use crate::config::{Config, MarkMode, SourceMode};
use crate::envelope::Envelope;
use crate::relay::pipeline::{self, Drained, Settings};
use crate::relay::shards::{Balance, Shard};
use crate::relay::{Backend, Claimed, Owned, RelayError, RunEnd};
use crate::source::cdc::{CdcAcker, CdcReader, CdcSettings, SharedProgress, Timing};
use crate::source::polling::PollingAcker;
use crate::telemetry::health::PipelineHealth;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub struct SimBackend {
    pub world: Shared,
    pub instance: usize,
    pub config: Config,
}

impl Backend for SimBackend {
    type Owner = u64;

    async fn acquire(
        &self,
        shard: Shard,
        _balance: &Balance,
        health: &PipelineHealth,
        shutdown: &CancellationToken,
    ) -> Result<Option<Claimed<u64>>, RelayError> {
        loop {
            let asked = tokio::time::Instant::now();
            let acquired = {
                let mut world = lock(&self.world);
                world
                    .try_lock(self.instance)
                    .map(|reign| (reign, world.claim(reign), asked))
            };
            if acquired.is_some() {
                return Ok(acquired);
            }
            health.healthy(shard.index);
            tokio::select! {
                biased;
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(self.config.relay.standby_poll) => {}
            }
        }
    }

    async fn relay(&self, reign: u64, run: Owned<'_>) -> Result<RunEnd, RelayError> {
        // The ownership session closes with the run, however it ends.
        let _session = Session {
            world: self.world.clone(),
            reign,
        };
        let config = &self.config;
        let settings = Settings::from_config(config);
        let envelope = Envelope::new(
            &config.envelope,
            crate::envelope::Binding::of_sink(config.sink.kind()),
        )
        .with_extra(&config.outbox.columns.extra);
        let store = SimStore::new(self.world.clone(), reign, config.relay.mark);
        let cx = pipeline::Context {
            envelope: &envelope,
            settings: &settings,
            telemetry: run.telemetry,
            lease: run.lease.clone(),
            shard: run.shard.index,
        };
        let sink = SimSink::connect(&self.world, self.instance, reign)?;
        let polls = match config.source.mode {
            SourceMode::Polling => true,
            SourceMode::Cdc => false,
            SourceMode::Auto => lock(&self.world).cdc_blocked,
        };
        match config.source.mode {
            _ if polls => {
                let reader =
                    SimPolling::new(self.world.clone(), config.source.polling.poll_interval);
                let acker = PollingAcker::new(store);
                if config.source.mode == SourceMode::Polling {
                    let drained =
                        pipeline::run(reader, acker, sink, cx, run.blocks, run.shutdown).await?;
                    self.stopped(reign, drained);
                    return Ok(RunEnd::Stopped);
                }
                // Auto mode while CDC is impossible: poll until it is
                // possible again, then drain and start over with CDC.
                let token = run.shutdown.child_token();
                let switch = watch_for_cdc(
                    self.world.clone(),
                    config.source.auto.probe_interval,
                    token.clone(),
                );
                let drained = pipeline::run(reader, acker, sink, cx, run.blocks, &token).await?;
                switch.abort();
                self.stopped(reign, drained);
                if token.is_cancelled() && !run.shutdown.is_cancelled() {
                    let mut w = lock(&self.world);
                    w.switches += 1;
                    w.note(format!("instance {} switches to CDC", self.instance));
                    return Ok(RunEnd::SwitchSource);
                }
            }
            _ => {
                let reader = self.cdc_reader(run.progress);
                let acker = CdcAcker::new(store, run.progress.clone(), config.relay.mark);
                let drained =
                    pipeline::run(reader, acker, sink, cx, run.blocks, run.shutdown).await?;
                self.stopped(reign, drained);
            }
        }
        Ok(RunEnd::Stopped)
    }
}

impl SimBackend {
    /// A run ended without a failure: when nothing it or an earlier owner
    /// sent can still land, it tells the next owner so (as the real backend does, on a new
    /// connection, whether or not the lock is still held).
    fn stopped(&self, reign: u64, drained: Drained) {
        let mut w = lock(&self.world);
        if drained == Drained::All {
            w.stopped_cleanly(reign);
        } else {
            w.unclean_stops += 1;
            w.note(format!("reign {reign} stopped, not cleanly: {drained:?}"));
        }
    }

    /// A CDC reader over the world's WAL.
    fn cdc_reader(&self, progress: &SharedProgress) -> CdcReader<SimCdc> {
        let config = &self.config;
        let columns = ColumnMap::default().resolve(&[
            "event_version".into(),
            "headers".into(),
            "created_at".into(),
        ]);
        CdcReader::new(
            SimCdc::new(
                self.world.clone(),
                config.source.cdc.recreates_lost_slot(config.relay.mark),
                config
                    .source
                    .cdc
                    .message_prefix(&config.outbox.table)
                    .unwrap_or_default(),
            ),
            &config.outbox.table,
            &columns,
            CdcSettings {
                // Small enough that start-up reads repeat in most schedules.
                reread_rows: 3,
                // With ranges, the stream takes over at once or after
                // moves past a few commits (80 bytes each here). Drawn for
                // ranges only, so the other modes' schedules stay as they were.
                stream_skip_wal: if config.relay.mark == MarkMode::Ranges {
                    lock(&self.world).rng.u64(0..0x200)
                } else {
                    crate::source::cdc::STREAM_SKIP_WAL
                },
                ..CdcSettings::from_config(config)
            },
            progress.clone(),
            Timing {
                // As the real server's connection works it out.
                status_every: config
                    .source
                    .cdc
                    .status_interval
                    .min(super::cdc::WAL_SENDER_TIMEOUT / 2),
                silence_limit: Duration::from_secs(60),
            },
        )
    }
}

/// Cancels `token` once the world allows CDC again, looking every
/// `every` (`source.auto.probe_interval`).
fn watch_for_cdc(
    world: Shared,
    every: Duration,
    token: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = token.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            if !lock(&world).cdc_blocked {
                token.cancel();
                return;
            }
        }
    })
}

/// The ownership session: closed (and the lock released) when dropped.
struct Session {
    world: Shared,
    reign: u64,
}

impl Drop for Session {
    fn drop(&mut self) {
        lock(&self.world).release(self.reign);
    }
}
