//! The real backend: ownership is a PostgreSQL session advisory lock, and a
//! run connects the configured source (polling, CDC, or in auto mode the one
//! the server allows now) and broker.

use super::RelayError;
use super::auto::{self, Modes};
use super::handoff::{self, Claim};
use super::pipeline::{self, Drained, Settings};
use super::shards::{self, Balance, Shard};
use super::supervise::{Backend, Claimed, Owned, RunEnd};
use crate::config::ResolvedColumns;
use crate::config::{Config, MarkMode, SourceMode};
use crate::db::DbError;
use crate::envelope::Envelope;
use crate::envelope::routing::Routing;
use crate::outbox::{inspect, ownership_key};
use crate::sink::AnySink;
use crate::source::SourceError;
use crate::source::auto::{Blocked, Reading, blocked_by, probe};
use crate::source::cdc::{CdcAcker, CdcReader};
use crate::source::polling::{PollingAcker, PollingReader};
use crate::source::record::RowRecorder;
use crate::telemetry::health::PipelineHealth;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// PostgreSQL and the configured broker.
pub struct Postgres<'a> {
    config: &'a Config,
    /// Auto mode: what the runs read with.
    modes: Modes,
    /// Auto mode: the backend pid of the last run's ownership session. After
    /// a switch of source the next run waits for it to end (and release the
    /// lock) rather than finding the lock taken by itself.
    previous_owner: Mutex<Option<i32>>,
}

impl<'a> Postgres<'a> {
    pub fn new(config: &'a Config) -> Self {
        Postgres {
            config,
            modes: Modes::default(),
            previous_owner: Mutex::new(None),
        }
    }
}

/// How a run ended, and whether anything it sent is still unconfirmed.
type Ended = (RunEnd, Drained);

/// How long a new run waits for the previous run's session to end.
const PREVIOUS_OWNER_WAIT: Duration = Duration::from_secs(10);

/// Waits (bounded) until the backend `pid` has ended.
async fn wait_ended(client: &Client, pid: i32) -> Result<(), RelayError> {
    let deadline = tokio::time::Instant::now() + PREVIOUS_OWNER_WAIT;
    while tokio::time::Instant::now() < deadline {
        let alive: bool = client
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)",
                &[&pid],
            )
            .await
            .map_err(|e| DbError::query("waiting for the previous ownership session", e))?
            .get(0);
        if !alive {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// The ownership session, and this owner's claim (when the owners table exists).
pub struct Ownership {
    client: Client,
    claim: Option<Claim>,
}

impl Backend for Postgres<'_> {
    type Owner = Ownership;

    /// Connects and polls the shard's advisory lock every `relay.standby_poll`.
    async fn acquire(
        &self,
        shard: Shard,
        balance: &Balance,
        health: &PipelineHealth,
        shutdown: &CancellationToken,
    ) -> Result<Option<Claimed<Ownership>>, RelayError> {
        let config = self.config;
        let base = ownership_key(&config.outbox.table);
        let key = shard.lock_key(&base);
        let client = crate::db::connect(&config.database, None).await?;
        let previous = self
            .previous_owner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(pid) = previous {
            wait_ended(&client, pid).await?;
        }
        let mut announced = false;
        loop {
            if !balance.may_acquire() {
                // A shard this instance steps back from still fails it.
                if !balance.stepping_back() {
                    health.not_taking(shard.index);
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return Ok(None),
                    _ = tokio::time::sleep(config.relay.standby_poll) => {}
                }
                continue;
            }
            let asked = tokio::time::Instant::now();
            let locked: bool = client
                .query_one(
                    "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                    &[&key],
                )
                .await
                .map_err(|e| DbError::query("taking the ownership lock", e))?
                .get(0);
            if locked
                && shard.count > 1
                && !shards::guard(&client, &base, shard.count as usize).await?
            {
                // An instance without shards, or with another shard count,
                // holds the outbox (or registers right now): let go, and
                // take nothing beside it (the session keeps no lock).
                client
                    .batch_execute("SELECT pg_advisory_unlock_all()")
                    .await
                    .map_err(|e| DbError::query("letting the shard go", e))?;
            } else if locked {
                let outbox = &config.outbox.table;
                let (takeover, claim) = handoff::claim(&client, outbox, &key, shard.count).await?;
                return Ok(Some((Ownership { client, claim }, takeover, asked)));
            }
            // The database answers and another instance is active: a healthy standby.
            health.healthy(shard.index);
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
    async fn relay(&self, owner: Ownership, mut run: Owned<'_>) -> Result<RunEnd, RelayError> {
        // The source-mode gauge is cleared once no shard is owned (see
        // PipelineTelemetry::show_active): another may still be polling.
        let (end, drained) = self.relay_with(owner.client, &mut run).await?;
        match (&owner.claim, drained) {
            (Some(claim), Drained::All) => self.record_clean_stop(claim).await,
            (Some(_), Drained::Abandoned) => tracing::info!(
                "messages were left unconfirmed: the next owner waits out this one's lease"
            ),
            (Some(_), Drained::PreviousOwnerUnsettled) => tracing::info!(
                "stopped while waiting out the previous owner's lease: the next owner waits too"
            ),
            (None, _) => {}
        }
        Ok(end)
    }
}

/// How long recording a clean stop may take before it is left undone.
const CLEAN_STOP_WAIT: Duration = Duration::from_secs(5);

impl Postgres<'_> {
    /// Tells the next owner it need not wait (see [`handoff`]), on a
    /// connection of its own: the ownership session closed with the run.
    /// A failure only costs the next owner the lease.
    async fn record_clean_stop(&self, claim: &Claim) {
        let recorded = tokio::time::timeout(CLEAN_STOP_WAIT, async {
            let client = crate::db::connect(&self.config.database, None).await?;
            handoff::stopped(&client, claim)
                .await
                .map_err(|e| DbError::query("recording a clean stop", e))
        })
        .await;
        match recorded {
            Ok(Ok(true)) => tracing::debug!("recorded a clean stop for the next owner"),
            Ok(Ok(false)) => tracing::info!("a newer owner has claimed the outbox since"),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "could not record the clean stop: the next owner waits out this one's lease")
            }
            Err(_) => tracing::warn!(
                "recording the clean stop timed out: the next owner waits out this one's lease"
            ),
        }
    }
}

/// Why a CDC run did not start: CDC is not possible after all (auto mode
/// then polls with the recorder back), or another failure.
enum CdcStart {
    Blocked(Blocked, Box<RowRecorder>),
    Failed(RelayError),
}

impl<E: Into<RelayError>> From<E> for CdcStart {
    fn from(e: E) -> Self {
        CdcStart::Failed(e.into())
    }
}

/// What every run builds the same way, whatever its source.
struct Parts {
    columns: ResolvedColumns,
    envelope: Envelope,
    /// Per-row destination and key columns.
    routing: Routing,
    settings: Settings,
}

impl Parts {
    fn context<'a>(&'a self, run: &Owned<'a>) -> pipeline::Context<'a> {
        pipeline::Context {
            envelope: &self.envelope,
            settings: &self.settings,
            telemetry: run.telemetry,
            lease: run.lease.clone(),
            shard: run.shard.index,
        }
    }
}

impl Postgres<'_> {
    async fn relay_with(&self, owner: Client, run: &mut Owned<'_>) -> Result<Ended, RelayError> {
        let config = self.config;
        let table = &config.outbox.table;
        // First: with another marking, the table's needs differ too.
        choice_problem(&owner, config).await?;
        names_problem(&owner, config).await?;
        let columns = inspect::resolve_table(
            &owner,
            table,
            &config.outbox.columns,
            config.relay.mark,
            config.deletes_rows(),
        )
        .await?;
        marking_problem(&owner, config).await?;
        streaming_problem(&owner, config, &columns).await?;
        // Asked on the ownership session, before it becomes the recorder's.
        let (reading, pid) = match config.source.mode {
            SourceMode::Polling => (None, None),
            SourceMode::Cdc => (Some(Reading::Cdc), None),
            SourceMode::Auto => {
                let pid: i32 = owner
                    .query_one("SELECT pg_backend_pid()", &[])
                    .await
                    .map_err(|e| DbError::query("reading the ownership session's pid", e))?
                    .get(0);
                (Some(probe(&owner, config).await?), Some(pid))
            }
        };
        let parts = Parts {
            columns,
            envelope: Envelope::new(
                &config.envelope,
                crate::envelope::Binding::of_sink(config.sink.kind()),
            )
            .with_extra(&config.outbox.columns.extra),
            routing: Routing::from_columns(&config.outbox.columns),
            settings: Settings::from_config(config),
        };
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
            config.source.cdc.messages,
        )
        .await?;
        let ended = match reading {
            None => self.relay_polling(&parts, recorder, None, run).await?,
            Some(Reading::Polling(blocked)) => {
                self.relay_polling(&parts, recorder, Some(blocked), run)
                    .await?
            }
            Some(Reading::Cdc) => match self.relay_cdc(&parts, recorder, run).await {
                Ok(ended) => ended,
                Err(CdcStart::Failed(e)) => return Err(e),
                Err(CdcStart::Blocked(blocked, recorder)) => {
                    self.relay_polling(&parts, *recorder, Some(blocked), run)
                        .await?
                }
            },
        };
        if ended.0 == RunEnd::SwitchSource {
            *self
                .previous_owner
                .lock()
                .unwrap_or_else(|e| e.into_inner()) = pid;
        }
        Ok(ended)
    }

    /// Streams from the slot. In auto mode, a start that finds CDC
    /// impossible after all hands the recorder back, to poll with.
    async fn relay_cdc(
        &self,
        parts: &Parts,
        recorder: RowRecorder,
        run: &mut Owned<'_>,
    ) -> Result<Ended, CdcStart> {
        let config = self.config;
        let table = &config.outbox.table;
        let fallback = |e: SourceError, recorder: RowRecorder| match blocked_by(&e) {
            Some(blocked) if config.source.mode == SourceMode::Auto => {
                CdcStart::Blocked(blocked, Box::new(recorder))
            }
            _ => CdcStart::Failed(e.into()),
        };
        let mut reader =
            match CdcReader::connect(config, &parts.columns, run.progress.clone()).await {
                Ok(reader) => reader,
                Err(e) => return Err(fallback(e, recorder)),
            };
        // "active" only once the publication and slot are known good;
        // waiting for a busy slot still gives way to shutdown.
        tokio::select! {
            biased;
            _ = run.shutdown.cancelled() => {
                tracing::info!("stopped cleanly");
                return Ok((RunEnd::Stopped, Drained::before_sending(&run.lease)));
            }
            started = reader.begin() => {
                if let Err(e) = started {
                    return Err(fallback(e, recorder));
                }
            }
        }
        if config.source.mode == SourceMode::Auto {
            self.modes.starting(&Reading::Cdc, config);
        }
        let acker = CdcAcker::new(recorder, run.progress.clone(), config.relay.mark);
        let sink = AnySink::connect(&config.sink)
            .await?
            .with_routing(parts.routing.clone());
        tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events from the replication slot");
        run.telemetry.metrics.reading(Some("cdc"));
        let cx = parts.context(run);
        let drained = pipeline::run(reader, acker, sink, cx, run.blocks, run.shutdown).await?;
        tracing::info!("stopped cleanly");
        Ok((RunEnd::Stopped, drained))
    }

    /// Polls; in auto mode (`blocked` says why CDC is not possible) until
    /// the probe finds CDC possible, then drains and asks for a new run.
    async fn relay_polling(
        &self,
        parts: &Parts,
        recorder: RowRecorder,
        blocked: Option<Blocked>,
        run: &mut Owned<'_>,
    ) -> Result<Ended, RelayError> {
        let config = self.config;
        let table = &config.outbox.table;
        let reader = PollingReader::connect(
            &config.database,
            table,
            &parts.columns,
            &config.source.polling,
            run.shard,
            config.relay.mark,
        )
        .await?;
        let acker = PollingAcker::new(recorder);
        let sink = AnySink::connect(&config.sink)
            .await?
            .with_routing(parts.routing.clone());
        let Some(blocked) = blocked else {
            tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events");
            run.telemetry.metrics.reading(Some("polling"));
            let cx = parts.context(run);
            let drained = pipeline::run(reader, acker, sink, cx, run.blocks, run.shutdown).await?;
            tracing::info!("stopped cleanly");
            return Ok((RunEnd::Stopped, drained));
        };
        self.modes.starting(&Reading::Polling(blocked), config);
        tracing::info!(table = %table, sink = config.sink.kind(), "active: relaying events by polling");
        run.telemetry.metrics.reading(Some("polling"));
        let pipeline_token = run.shutdown.child_token();
        let switch = AtomicBool::new(false);
        let cx = parts.context(run);
        let result = tokio::select! {
            result = pipeline::run(reader, acker, sink, cx, run.blocks, &pipeline_token) => result,
            never = auto::watch(config, &self.modes, &pipeline_token, &switch) => match never {},
        };
        let drained = result?;
        if switch.load(Ordering::SeqCst) && !run.shutdown.is_cancelled() {
            return Ok((RunEnd::SwitchSource, drained));
        }
        tracing::info!("stopped cleanly");
        Ok((RunEnd::Stopped, drained))
    }
}

/// With `relay.mark` unset: the outbox chose otherwise since this instance
/// chose (`ops::marking`): it must restart, not relay with the other mode.
async fn choice_problem(owner: &Client, config: &Config) -> Result<(), RelayError> {
    if !config.mark_chosen_by_outbox() {
        return Ok(());
    }
    let ranges = crate::outbox::progress::Ranges::new(&config.outbox.table);
    let now = ranges
        .exists(owner)
        .await
        .map_err(inspect::TableProblem::Query)?;
    if now == (config.relay.mark == MarkMode::Ranges) {
        return Ok(());
    }
    Err(inspect::TableProblem::Unusable(vec![format!(
        "relay.mark is unset and this instance started on {}, but {} {} now \
         (created by migrate or dropped by fold --into-sent-at since): restart it, \
         so that it relays with what the outbox chose now",
        if now { "update" } else { "ranges" },
        ranges.progress,
        if now { "exists" } else { "is gone" },
    )])
    .into())
}

/// Another outbox would share this one's relay objects (`outbox::names`),
/// or its relay the slot this one would stream from: relaying beside it
/// could skip or repeat events. Asked at every acquisition, as `migrate`
/// and `check` ask: the other outbox may have been set up since.
async fn names_problem(owner: &Client, config: &Config) -> Result<(), RelayError> {
    for problem in crate::outbox::names::problems(owner, config).await {
        match problem {
            Ok(None) => {}
            Ok(Some(problem)) => {
                return Err(inspect::TableProblem::Unusable(vec![problem]).into());
            }
            Err(e) => return Err(inspect::TableProblem::Query(e).into()),
        }
    }
    Ok(())
}

/// What ranges recorded, seen from the marking configured: a sequence set
/// back under ranges, ranges' records left for `update` or `delete` (see
/// `outbox::progress::downgrade`), refuse the start.
async fn marking_problem(owner: &Client, config: &Config) -> Result<(), RelayError> {
    if config.relay.mark == MarkMode::Ranges
        && let Ok(Some(problem)) = crate::outbox::progress::version_problem(owner).await
    {
        // Before the tables, which `migrate` refuses to create here.
        return Err(inspect::TableProblem::Unusable(vec![problem]).into());
    }
    let ranges = crate::outbox::progress::Ranges::new(&config.outbox.table);
    let problem = match config.relay.mark {
        MarkMode::Ranges => ranges
            .new_rows_problem(owner)
            .await
            .or_else(|e| ranges.missing_table_problem(&e).map(Some).ok_or(e)),
        mark => ranges.leftover_problem(owner, mark).await,
    }
    .map_err(inspect::TableProblem::Query)?;
    match problem {
        Some(problem) => Err(inspect::TableProblem::Unusable(vec![problem]).into()),
        None => Ok(()),
    }
}

/// In auto mode, a column CDC cannot stream (a generated one, one a column
/// list leaves out) or a publication's row filter refuses the
/// start, as CDC's own start-up does: otherwise the relay would poll now
/// and stop when it switches to CDC, perhaps months later.
async fn streaming_problem(
    owner: &Client,
    config: &Config,
    columns: &crate::config::ResolvedColumns,
) -> Result<(), RelayError> {
    if config.source.mode != SourceMode::Auto {
        return Ok(());
    }
    let table = &config.outbox.table;
    let publication = config.source.cdc.publication_name(table);
    let marks = config.relay.mark != crate::config::MarkMode::None;
    let problems =
        crate::source::cdc::setup::streaming_problems(owner, &publication, table, columns, marks)
            .await?;
    if problems.is_empty() {
        return Ok(());
    }
    Err(inspect::TableProblem::Unusable(problems).into())
}
