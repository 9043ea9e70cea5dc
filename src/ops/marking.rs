//! `relay.mark` unset: the outbox chooses its marking. An outbox whose
//! progress table (`<outbox>_relay_progress`) exists runs `ranges`; any
//! other runs `update`.
//!
//! `migrate` creates that table for an outbox it creates itself, on
//! PostgreSQL 14 or later, or when `relay.mark = "ranges"` is set; never on
//! its own for an outbox that already exists, since `migrate` often runs at
//! every deploy. `fold --into-sent-at` drops it. So an outbox relayed by an
//! earlier version keeps `update` across an upgrade: an instance of that
//! version still in the standby set reads `relay_sent_at` alone, and would
//! publish again what ranges recorded. Switching an existing outbox is a
//! step of its own (README, "Marking").
//!
//! Every command that reads `relay.mark` has it chosen here first: `run`
//! once per pipeline at start ([`chosen_until`]), the others when they
//! connect. The relay checks the choice again at every ownership
//! acquisition (`relay::postgres`), so an instance that chose before the
//! tables came or went refuses instead of relaying with the other mode.

use crate::backoff::Backoff;
use crate::config::{Config, MarkMode};
use crate::db::DbError;
use crate::outbox::progress::Ranges;
use crate::telemetry::PipelineTelemetry;
use crate::telemetry::events::{InternalEvent, PipelineInterrupted};
use tokio_postgres::GenericClient;
use tokio_util::sync::CancellationToken;

/// The key of `/readyz`'s failure while the marking is chosen (shard keys
/// count up from 0, the shard membership's is `u32::MAX`).
const CHOOSING_MARK: u32 = u32::MAX - 1;

/// Sets `config.relay.mark` from the outbox when `relay.mark` is unset.
/// An outbox table that does not exist yet has not chosen: `migrate` may
/// still create it with the tables of ranges, so that is an error (which
/// `run` waits out).
pub async fn choose(client: &impl GenericClient, config: &mut Config) -> Result<(), DbError> {
    if !config.mark_chosen_by_outbox() {
        return Ok(());
    }
    let table = &config.outbox.table;
    let found = |what: &'static str| move |e| DbError::query(what, e);
    let outbox: bool = client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.quoted()])
        .await
        .map_err(found("looking for the outbox table"))?
        .get(0);
    if !outbox {
        return Err(DbError::Missing(format!(
            "{table} does not exist (or this role cannot see it): run outbox-relay migrate; \
             with relay.mark unset the outbox chooses its marking once it exists"
        )));
    }
    let ranges = Ranges::new(table)
        .exists(client)
        .await
        .map_err(found("looking for the outbox's progress table"))?;
    config.relay.mark = if ranges {
        MarkMode::Ranges
    } else {
        MarkMode::Update
    };
    Ok(())
}

/// `config` with its marking chosen, on a connection of its own when the
/// outbox chooses.
pub async fn chosen(config: &Config) -> Result<Config, DbError> {
    let mut config = config.clone();
    if config.mark_chosen_by_outbox() {
        let client = crate::db::connect(&config.database, None).await?;
        choose(&client, &mut config).await?;
    }
    Ok(config)
}

/// For `run`: `config` with its marking chosen, retrying (as the relay
/// retries a connection) while the database cannot answer. `None` when
/// `shutdown` came first. A failure reads as the relay's own would: in
/// `/readyz`, in the restart count, and logged at the level its kind
/// calls for (an error for what will not pass by itself).
pub async fn chosen_until(
    config: Config,
    telemetry: &PipelineTelemetry,
    shutdown: &CancellationToken,
) -> Option<Config> {
    if !config.mark_chosen_by_outbox() {
        return Some(config);
    }
    let health = &telemetry.health;
    let mut backoff = Backoff::new(config.relay.retry_base, config.relay.retry_max);
    loop {
        let attempt = tokio::select! {
            () = shutdown.cancelled() => return None,
            attempt = chosen(&config) => attempt,
        };
        match attempt {
            Ok(chosen) => {
                health.cleared(CHOOSING_MARK);
                tracing::info!(
                    pipeline = %chosen.name,
                    mark = ?chosen.relay.mark,
                    "relay.mark is unset: the outbox chose (ranges where its progress table exists, else update)"
                );
                return Some(chosen);
            }
            Err(e) => {
                let reason = format!("choosing the marking (relay.mark is unset): {e}");
                health.failing(CHOOSING_MARK, &reason);
                let retry_in = backoff.next_delay();
                PipelineInterrupted {
                    metrics: &telemetry.metrics,
                    error: &reason,
                    kind: e.kind(),
                    attempt: backoff.attempts(),
                    retry_in,
                }
                .emit();
                tokio::select! {
                    () = shutdown.cancelled() => return None,
                    () = tokio::time::sleep(retry_in) => {}
                }
            }
        }
    }
}
