//! The real backend: ownership is a PostgreSQL session advisory lock, and a
//! run connects the configured source (polling or CDC) and broker.

use super::RelayError;
use super::pipeline::{self, Settings};
use super::shards::{Balance, Shard};
use super::supervise::{Backend, Owned};
use crate::config::{Config, MarkMode, SourceMode};
use crate::db::DbError;
use crate::envelope::Envelope;
use crate::envelope::routing::Routing;
use crate::outbox::inspect;
use crate::outbox::ownership_key;
use crate::sink::AnySink;
use crate::source::cdc::{CdcAcker, CdcReader};
use crate::source::polling::{PollingAcker, PollingReader};
use crate::source::record::RowRecorder;
use crate::telemetry::health::PipelineHealth;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// PostgreSQL and the configured broker.
pub struct Postgres<'a> {
    config: &'a Config,
}

impl<'a> Postgres<'a> {
    pub fn new(config: &'a Config) -> Self {
        Postgres { config }
    }
}

impl Backend for Postgres<'_> {
    type Owner = Client;

    /// Connects and polls the shard's advisory lock every `relay.standby_poll`.
    async fn acquire(
        &self,
        shard: Shard,
        balance: &Balance,
        health: &PipelineHealth,
        shutdown: &CancellationToken,
    ) -> Result<Option<Client>, RelayError> {
        let config = self.config;
        let key = shard.lock_key(&ownership_key(&config.outbox.table));
        let client = crate::db::connect(&config.database, None).await?;
        let mut announced = false;
        loop {
            if !balance.may_acquire() {
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(config.relay.standby_poll) => {}
                }
                continue;
            }
            let locked: bool = client
                .query_one(
                    "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                    &[&key],
                )
                .await
                .map_err(|e| DbError::query("taking the ownership lock", e))?
                .get(0);
            if locked {
                return Ok(Some(client));
            }
            // The database answers and another instance is active: a healthy standby.
            health.healthy();
            if !announced && shard.count == 1 {
                tracing::info!(table = %config.outbox.table, "standby: another instance is active; waiting to take over");
                announced = true;
            }
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(None),
                _ = tokio::time::sleep(config.relay.standby_poll) => {}
            }
        }
    }

    /// Relays while holding ownership (the `owner` session, which also marks rows).
    async fn relay(&self, owner: Client, run: Owned<'_>) -> Result<(), RelayError> {
        let config = self.config;
        let table = &config.outbox.table;
        let columns = inspect::resolve_table(
            &owner,
            table,
            &config.outbox.columns,
            config.relay.mark,
            config.deletes_rows(),
        )
        .await?;
        let envelope = Envelope::new(
            &config.envelope,
            crate::envelope::Binding::of_sink(config.sink.kind()),
        )
        .with_extra(&config.outbox.columns.extra);
        let routing = Routing::from_columns(&config.outbox.columns);
        let settings = Settings::from_config(config);
        let dead_letters = config
            .dead_letter
            .enabled
            .then(|| config.dead_letter.table_name(table));
        let shard = run.shard.condition("aggregate_id");
        let recorder = RowRecorder::new(
            owner,
            table,
            config.relay.mark,
            dead_letters.as_ref().map(|t| (t, shard.as_deref())),
        )
        .await?;
        let cx = pipeline::Context {
            envelope: &envelope,
            settings: &settings,
            telemetry: run.telemetry,
            lease: run.lease.clone(),
        };
        match config.source.mode {
            SourceMode::Polling => {
                let reader = PollingReader::connect(
                    &config.database,
                    table,
                    &columns,
                    &config.source.polling,
                    run.shard,
                )
                .await?;
                let acker = PollingAcker::new(recorder);
                let sink = AnySink::connect(&config.sink)
                    .await?
                    .with_routing(routing.clone());
                tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events");
                pipeline::run(reader, acker, sink, cx, run.blocks, run.shutdown).await?;
            }
            SourceMode::Cdc => {
                let mut reader = CdcReader::connect(config, &columns, run.progress.clone()).await?;
                let marks_rows = config.relay.mark != MarkMode::None;
                let acker = CdcAcker::new(recorder, run.progress.clone(), marks_rows);
                let sink = AnySink::connect(&config.sink)
                    .await?
                    .with_routing(routing.clone());
                // "active" only once the publication and slot are known good;
                // waiting for a busy slot still gives way to shutdown.
                tokio::select! {
                    biased;
                    _ = run.shutdown.cancelled() => {
                        tracing::info!("stopped cleanly");
                        return Ok(());
                    }
                    started = reader.begin() => started?,
                }
                tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events from the replication slot");
                pipeline::run(reader, acker, sink, cx, run.blocks, run.shutdown).await?;
            }
        }
        tracing::info!("stopped cleanly");
        Ok(())
    }
}
