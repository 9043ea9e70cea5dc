//! The fold `run` schedules with `relay.mark = "ranges"`:
//! every `relay.fold_interval` it moves the frontier to the capture it took a round
//! earlier and deletes the progress rows that frontier covers
//! (`outbox::progress::fold`). One instance at a time folds an outbox;
//! failures are logged and retried, they never end it.

use super::{ConfigFile, Failure, say};
use crate::backoff::Backoff;
use crate::config::{Config, MarkMode};
use crate::db::DbError;
use crate::outbox::progress::Ranges;
use crate::outbox::progress::fold::{Advance, Capture, HoldLimits};
use crate::telemetry::metrics::{FoldOutcome, PipelineMetrics};
use std::time::Duration;
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// The pause grows to this while a drain is under way (rows visible in the
/// capture that are not recorded yet are more than a round may hold).
const BACKLOG_INTERVAL_MAX: Duration = Duration::from_secs(60);

/// How often a fold that keeps finding too many unrecorded rows says so
/// (at warning level: before then it is an ordinary drain).
const BACKLOG_WARN_EVERY: Duration = Duration::from_secs(600);

/// How long a capture waits for the transactions running at its start.
const SETTLE: Duration = Duration::from_secs(2);

/// The key of the advisory lock one folding instance holds.
pub fn lock_key(config: &Config) -> String {
    format!("outbox-relay-fold:{}", config.outbox.table)
}

fn count_round<E>(m: &PipelineMetrics, result: &Result<Option<Advance>, E>) {
    match result {
        Ok(Some(Advance::Advanced { settled: true, .. })) => m.fold_round(FoldOutcome::Advanced),
        Ok(Some(Advance::Advanced { settled: false, .. })) => m.fold_round(FoldOutcome::Unsettled),
        Ok(Some(Advance::Backlog)) => m.fold_round(FoldOutcome::Draining),
        Ok(Some(Advance::Stale)) => m.fold_round(FoldOutcome::Stale),
        Ok(None) => {}
        Err(_) => m.fold_round(FoldOutcome::Failed),
    }
}

/// Since when every round found more unrecorded rows than it may hold,
/// and when that was last said.
#[derive(Default)]
struct Waiting(Option<(Instant, Instant)>);

impl Waiting {
    /// One more such round: said every [`BACKLOG_WARN_EVERY`].
    fn again(&mut self, pipeline: &str) {
        let now = Instant::now();
        let (since, said) = self.0.get_or_insert((now, now));
        if now - *said >= BACKLOG_WARN_EVERY {
            *said = now;
            let limit = HoldLimits::RELAY.at(Some(*since), now);
            tracing::warn!(
                pipeline,
                waited_s = (now - *since).as_secs(),
                "the fold cannot move the frontier: more than {limit} rows it would pass are read and \
                 not recorded. A drain this long, or events held back for good: aggregates refused and \
                 waiting for a retry, or behind dead letters (see `outbox-relay dlq list`)"
            );
        }
    }

    /// The limit of the next round.
    fn limit(&self) -> usize {
        HoldLimits::RELAY.at(self.0.map(|(since, _)| since), Instant::now())
    }
}

/// What a round that moved the frontier did, at debug level, and at info
/// when it held open rows found read and unrecorded round after round.
fn say_advanced(pipeline: &str, advance: &Advance) {
    let Advance::Advanced {
        held,
        closed,
        deleted,
        settled,
    } = *advance
    else {
        return;
    };
    if held as usize > HoldLimits::RELAY.drain {
        tracing::info!(
            pipeline,
            held,
            "the fold moved the frontier past rows that rounds had found read and not \
             recorded for {:?}: they are held open until they are",
            HoldLimits::RELAY.stuck_after
        );
    }
    tracing::debug!(
        pipeline,
        held,
        closed,
        deleted,
        settled,
        "fold moved the frontier"
    );
}

/// Runs rounds until `shutdown`; returns at once unless `relay.mark = "ranges"`.
pub async fn run_scheduled(
    config: &Config,
    metrics: Option<PipelineMetrics>,
    shutdown: CancellationToken,
) {
    if config.relay.mark != MarkMode::Ranges {
        return;
    }
    let pipeline = config.name.as_str();
    let ranges = Ranges::new(&config.outbox.table);
    let mut backoff = Backoff::new(config.relay.retry_base, config.relay.retry_max);
    let mut folder: Option<Folder> = None;
    // The pause between rounds while the relay keeps up: a capture is
    // about this old when the frontier moves to it, so the relay has
    // confirmed what it had in flight then.
    let interval = config.relay.fold_interval;
    let mut wait = interval;
    let mut waiting = Waiting::default();
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let limit = waiting.limit();
        let round = async {
            let f = match folder.take() {
                Some(f) if !f.client.is_closed() => folder.insert(f),
                _ => folder.insert(Folder::connect(config).await?),
            };
            f.round(&ranges, limit).await
        };
        let result = round.await;
        if let Some(m) = &metrics {
            count_round(m, &result);
        }
        match result {
            Ok(Some(Advance::Backlog)) => {
                backoff.reset();
                wait = (wait * 2).clamp(interval, BACKLOG_INTERVAL_MAX.max(interval));
                tracing::debug!(pipeline, next_in = ?wait, "fold waits: the relay is draining");
                waiting.again(pipeline);
            }
            Ok(outcome) => {
                waiting.0 = None;
                backoff.reset();
                wait = interval;
                if let Some(advanced) = outcome {
                    say_advanced(pipeline, &advanced);
                }
            }
            Err(e) => {
                folder = None;
                wait = backoff.next_delay();
                tracing::warn!(pipeline, error = %e, retry_in = ?wait, "fold failed; retrying");
            }
        }
    }
}

/// Rows marked per statement by [`into_sent_at`].
const INTO_SENT_AT_BATCH: i64 = 5_000;

/// `outbox-relay fold --into-sent-at`: for leaving `relay.mark = "ranges"`
/// (see [`crate::outbox::progress::downgrade`]). Refuses while an
/// instance owns the outbox or folds it, and keeps their locks until it
/// ends, so none starts meanwhile.
pub async fn into_sent_at(file: &ConfigFile) -> Result<(), Failure> {
    let config = file.load_one()?;
    let table = &config.outbox.table;
    let ranges = Ranges::new(table);
    let client = crate::db::connect(&config.database, None)
        .await
        .map_err(Failure::runtime)?;
    let failed = |what: &'static str| move |e| Failure::runtime(DbError::query(what, e));
    if !ranges
        .exists(&client)
        .await
        .map_err(failed("looking for the tables of ranges"))?
    {
        // A run cut short after the tables went: the rest goes too.
        drop_index(&client, &ranges).await?;
        let (name, progress) = (&config.name, &ranges.progress);
        say!("{name}: {progress} does not exist, so nothing is recorded by ranges; nothing to do");
        return Ok(());
    }
    if let Some(problem) = ranges
        .drop_problem(&client)
        .await
        .map_err(failed("reading who owns the tables of ranges"))?
    {
        return Err(Failure::runtime(problem));
    }
    let base = crate::outbox::ownership_key(table);
    let mut keys = vec![lock_key(&config), base.clone()];
    let count = config.relay.shards;
    keys.extend((0..count).map(|index| crate::outbox::Shard { index, count }.lock_key(&base)));
    for key in keys {
        let free: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&key],
            )
            .await
            .map_err(failed("taking the relay's locks"))?
            .get(0);
        if !free {
            return Err(Failure::runtime(format!(
                "an instance is running on {table} (it holds the lock {key:?}): \
                 stop every instance of pipeline {}, then run this again",
                config.name
            )));
        }
    }
    let statement = client
        .prepare(&ranges.into_sent_at_sql())
        .await
        .map_err(failed("marking recorded rows sent"))?;
    let (mut cursor, mut marked) = (i64::MIN, 0);
    loop {
        let row = client
            .query_one(&statement, &[&cursor, &INTO_SENT_AT_BATCH])
            .await
            .map_err(failed("marking recorded rows sent"))?;
        marked += row.get::<_, i64>(1);
        match row.get::<_, Option<i64>>(0) {
            Some(last) => cursor = last,
            None => break,
        }
    }
    client
        .batch_execute(&ranges.drop_sql())
        .await
        .map_err(failed("dropping the tables of ranges"))?;
    drop_index(&client, &ranges).await?;
    say!(
        "{}: marked {marked} row(s) sent from what relay.mark = \"ranges\" recorded, and dropped {}, {}, {} \
         and {}; a relay with relay.mark = \"update\", \"delete\" or unset can start now",
        config.name,
        ranges.progress,
        ranges.frontier,
        ranges.held,
        ranges.xid_index,
    );
    Ok(())
}

/// Drops the function and the index on `relay_xid` if they are still
/// there: concurrently, but on a partitioned outbox (which cannot) at once.
async fn drop_index(client: &Client, ranges: &Ranges) -> Result<(), Failure> {
    let partitioned: bool = client
        .query_one(
            "SELECT COALESCE((SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass($1)), false)",
            &[&ranges.outbox.quoted()],
        )
        .await
        .map_err(|e| Failure::runtime(DbError::query("reading the outbox's kind", e)))?
        .get(0);
    for sql in [
        ranges.drop_function_sql(),
        ranges.drop_index_sql(!partitioned),
    ] {
        client
            .batch_execute(&sql)
            .await
            .map_err(|e| Failure::runtime(DbError::query("dropping what ranges left", e)))?;
    }
    Ok(())
}

/// The folding connection, with the capture a round took for the next.
struct Folder {
    client: Client,
    key: String,
    locked: bool,
    pending: Option<Capture>,
}

impl Folder {
    async fn connect(config: &Config) -> Result<Folder, DbError> {
        let client = crate::db::connect(&config.database, None).await?;
        Ok(Folder {
            client,
            key: lock_key(config),
            locked: false,
            pending: None,
        })
    }

    /// One round: under the lock, moves the frontier to the pending capture
    /// (if any), then takes the next. `None`: another instance folds, or
    /// there was no capture yet.
    async fn round(&mut self, ranges: &Ranges, limit: usize) -> Result<Option<Advance>, DbError> {
        if !self.locked {
            // Held by this session until its connection ends.
            self.locked = self
                .client
                .query_one(
                    "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                    &[&self.key],
                )
                .await
                .map_err(|e| DbError::query("taking the fold lock", e))?
                .get(0);
            if !self.locked {
                return Ok(None);
            }
        }
        let outcome = match self.pending.take() {
            Some(target) => Some(
                ranges
                    .advance(&mut self.client, &target, limit as i64)
                    .await?,
            ),
            None => None,
        };
        self.pending = Some(ranges.capture(&self.client, SETTLE).await?);
        Ok(outcome)
    }
}
