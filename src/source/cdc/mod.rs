//! The CDC source: tails the write-ahead log through a logical replication
//! slot (pgoutput), so events are read within milliseconds of their commit,
//! in commit order, without polling queries.
//!
//! # Start-up
//!
//! 1. Check `wal_level`, the publication, the slot (creating it when
//!    missing); a lost slot is a specific error with its recovery.
//! 2. When rows are marked (`relay.mark` is `update` or `delete`), read the
//!    unsent rows from the table in one REPEATABLE READ snapshot, in
//!    `relay_seq` order. This publishes rows written before the slot existed,
//!    rows a refused event held back, and recovers from a dropped slot.
//!    Transactions whose rows this read produced are skipped when the stream
//!    replays them (matched by xid, until the stream passes the WAL position
//!    taken with the snapshot).
//! 3. Stream from the slot's confirmed position.
//!
//! # Acknowledgement
//!
//! See [`progress`]: the flushed position reported to PostgreSQL never passes
//! an event the broker has not confirmed (and, when marking, that is not
//! marked). Status updates go out at least every
//! min(`source.cdc.status_interval`, `wal_sender_timeout`/2), also while the
//! relay applies backpressure by not reading the stream.

pub mod progress;
pub mod setup;
mod stream;

pub use progress::{CdcPosition, Progress};
pub use stream::SharedProgress;

use super::record::RowRecorder;
use super::rows::{read_row, select_list};
use super::{Acker, Reader, SourceError, SourcedEvent};
use crate::config::{Config, DatabaseConfig, MarkMode};
use crate::db::DbError;
use crate::dead_letter::DeadLetter;
use crate::outbox::{ResolvedColumns, SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
use crate::source::replication::Lsn;
use crate::source::replication::protocol::{ReplicationClient, publication_names};
use progress::CATCH_UP;
use std::collections::HashSet;
use std::time::Duration;
use stream::{SkipRead, Step, Streaming, lock};
use tokio::time::Instant;
use tokio_postgres::{Client, Statement};

/// Confirmed-but-unflushed events remembered for skipping after a restart.
pub const SKIP_MEMORY: usize = 100_000;

/// CDC settings resolved from the configuration.
#[derive(Debug, Clone)]
pub struct CdcSettings {
    pub slot: String,
    pub publication: String,
    pub create_slot: bool,
    pub status_interval: Duration,
    pub heartbeat_interval: Option<Duration>,
    /// Rows are marked, so unsent rows can be read from the table at start-up.
    pub read_table: bool,
}

impl CdcSettings {
    pub fn from_config(config: &Config) -> Self {
        let cdc = &config.source.cdc;
        let table = &config.outbox.table;
        CdcSettings {
            slot: cdc.slot_name(table),
            publication: cdc.publication_name(table),
            create_slot: cdc.create_slot,
            status_interval: cdc.status_interval,
            heartbeat_interval: cdc.heartbeat_interval,
            read_table: config.relay.mark != MarkMode::None,
        }
    }
}

struct TableRead {
    cursor: i64,
    xids: HashSet<u32>,
    until: Lsn,
}

enum Phase {
    Start,
    TableRead(TableRead),
    Streaming(Box<Streaming>),
}

pub struct CdcReader {
    db: DatabaseConfig,
    table: TableName,
    columns: ResolvedColumns,
    settings: CdcSettings,
    progress: SharedProgress,
    /// Ordinary connection: checks, the start-up table read, heartbeats.
    client: Client,
    table_page: Statement,
    phase: Phase,
    /// Read, not yet handed over (kept across a cancelled call).
    pending: Vec<SourcedEvent<CdcPosition>>,
    status_every: Duration,
    silence_limit: Duration,
    next_heartbeat: Option<Instant>,
    /// The start-up read's REPEATABLE READ transaction is open.
    snapshot_open: bool,
}

/// Column of the 32-bit xid in the start-up read, after `relay_seq` and the 8 contract columns.
const XID_INDEX: usize = 9;

impl CdcReader {
    pub async fn connect(
        config: &Config,
        columns: &ResolvedColumns,
        progress: SharedProgress,
    ) -> Result<Self, SourceError> {
        let client = crate::db::connect(&config.database, None).await?;
        let table = config.outbox.table.clone();
        let settings = CdcSettings::from_config(config);
        let sql = format!(
            "SELECT {}, ({XID_COLUMN}::text::bigint % 4294967296)::bigint FROM {} WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} > $1 ORDER BY {SEQ_COLUMN} LIMIT $2",
            select_list(columns),
            table.quoted()
        );
        let table_page = client
            .prepare(&sql)
            .await
            .map_err(|e| DbError::query("preparing the start-up read", e))?;
        let timeout_ms = setup::wal_sender_timeout_ms(&client).await?;
        let (status_every, silence_limit) = if timeout_ms > 0 {
            let timeout = Duration::from_millis(timeout_ms.unsigned_abs());
            (
                settings.status_interval.min(timeout / 2),
                (timeout * 2).max(Duration::from_secs(10)),
            )
        } else {
            (settings.status_interval, Duration::from_secs(120))
        };
        Ok(CdcReader {
            db: config.database.clone(),
            table,
            columns: columns.clone(),
            next_heartbeat: settings.heartbeat_interval.map(|h| Instant::now() + h),
            settings,
            progress,
            client,
            table_page,
            phase: Phase::Start,
            pending: Vec::new(),
            snapshot_open: false,
            status_every,
            silence_limit,
        })
    }

    /// Checks, slot, and the choice of the first phase.
    async fn start(&mut self) -> Result<(), SourceError> {
        if std::mem::take(&mut self.snapshot_open) {
            self.client
                .batch_execute("ROLLBACK")
                .await
                .map_err(|e| DbError::query("ending the start-up read", e))?;
        }
        let s = &self.settings;
        if let Some(problem) = setup::wal_level_problem(&setup::wal_level(&self.client).await?) {
            return Err(SourceError::Setup(problem));
        }
        match setup::publication_covers(&self.client, &s.publication, &self.table).await? {
            Some(true) => {}
            Some(false) => {
                return Err(SourceError::Setup(format!(
                    "publication {:?} does not publish inserts into {}; run `outbox-relay migrate`",
                    s.publication, self.table
                )));
            }
            None => {
                return Err(SourceError::Setup(format!(
                    "publication {:?} does not exist; run `outbox-relay migrate`",
                    s.publication
                )));
            }
        }
        let database: String = self
            .client
            .query_one("SELECT current_database()::text", &[])
            .await
            .map_err(|e| DbError::query("reading the database name", e))?
            .get(0);
        let slot_flushed = match setup::slot_info(&self.client, &s.slot).await? {
            Some(info) => {
                let problems = setup::slot_problems(&info, &s.slot, &database);
                if let Some(first) = problems.into_iter().next() {
                    return Err(SourceError::Setup(first));
                }
                if info.active {
                    // Checked before the start-up read, so nothing is published
                    // while another process owns the stream.
                    return Err(SourceError::SlotBusy(s.slot.clone()));
                }
                info.confirmed_flush.unwrap_or_default()
            }
            None if s.create_slot => {
                let lsn = setup::create_slot(&self.client, &s.slot)
                    .await
                    .map_err(SourceError::Setup)?;
                tracing::info!(slot = %s.slot, consistent_point = %lsn, "created the replication slot");
                lsn
            }
            None => {
                return Err(SourceError::Setup(format!(
                    "replication slot {:?} does not exist; run `outbox-relay migrate` or set source.cdc.create_slot = true",
                    s.slot
                )));
            }
        };
        lock(&self.progress).restart(slot_flushed);
        if self.settings.read_table {
            // One snapshot for the whole read; the WAL position taken with it
            // bounds which streamed transactions it already covers. The read
            // waits while the broker catches up, so a server-wide
            // idle-in-transaction timeout must not end it.
            self.client
                .batch_execute(
                    "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; \
                     SET LOCAL idle_in_transaction_session_timeout = 0",
                )
                .await
                .map_err(|e| DbError::query("starting the start-up read", e))?;
            self.snapshot_open = true;
            let until: String = self
                .client
                .query_one("SELECT pg_current_wal_lsn()::text", &[])
                .await
                .map_err(|e| DbError::query("starting the start-up read", e))?
                .get(0);
            let until = until
                .parse()
                .map_err(|e| SourceError::Stream(format!("unreadable WAL position: {e}")))?;
            lock(&self.progress).begin(CATCH_UP);
            self.phase = Phase::TableRead(TableRead {
                cursor: 0,
                xids: HashSet::new(),
                until,
            });
        } else {
            self.phase = Phase::Streaming(Box::new(
                open_stream(&self.db, &self.settings, &self.progress, None).await?,
            ));
        }
        Ok(())
    }

    /// One page of the start-up read; moves to streaming after the last.
    async fn table_page(&mut self, max: usize) -> Result<(), SourceError> {
        let Phase::TableRead(read) = &mut self.phase else {
            return Ok(());
        };
        let limit = i64::try_from(max).unwrap_or(i64::MAX);
        let rows = self
            .client
            .query(&self.table_page, &[&read.cursor, &limit])
            .await
            .map_err(|e| DbError::query("reading unsent rows at start-up", e))?;
        let now = chrono::Utc::now();
        for row in &rows {
            let Some((seq, raw)) = read_row(row, 0) else {
                continue;
            };
            let xid: i64 = row.get(XID_INDEX);
            read.xids.insert(u32::try_from(xid).unwrap_or_default());
            read.cursor = seq;
            let position = CdcPosition {
                commit_lsn: CATCH_UP,
                index: u64::try_from(seq).unwrap_or_default(),
                seq: Some(seq),
                xid: None, // read from a snapshot: visible
            };
            if lock(&self.progress).event(&position) {
                self.pending.push(SourcedEvent {
                    position,
                    event: raw.decode(now),
                });
            }
        }
        if rows.len() < max {
            self.client
                .batch_execute("COMMIT")
                .await
                .map_err(|e| DbError::query("ending the start-up read", e))?;
            self.snapshot_open = false;
            let flushed = {
                let mut p = lock(&self.progress);
                let f = p.flushed();
                p.commit(f);
                f
            };
            let Phase::TableRead(read) = std::mem::replace(&mut self.phase, Phase::Start) else {
                return Ok(());
            };
            tracing::info!(
                rows = read.cursor,
                transactions = read.xids.len(),
                "start-up read of unsent rows done"
            );
            let skip = (!read.xids.is_empty()).then_some(SkipRead {
                xids: read.xids,
                until: read.until.max(flushed),
            });
            self.phase = Phase::Streaming(Box::new(
                open_stream(&self.db, &self.settings, &self.progress, skip).await?,
            ));
        }
        Ok(())
    }

    async fn heartbeat(&mut self) -> Result<(), SourceError> {
        if let Some(every) = self.settings.heartbeat_interval {
            self.client
                .execute(
                    "SELECT pg_logical_emit_message(false, 'outbox-relay', 'heartbeat')",
                    &[],
                )
                .await
                .map_err(|e| DbError::query("writing the heartbeat message", e))?;
            self.next_heartbeat = Some(Instant::now() + every);
        }
        Ok(())
    }
}

enum Wake<M> {
    Message(M),
    Status,
    Silence,
    Heartbeat,
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

/// Opens a replication connection and starts streaming from the flushed position.
/// (A free function: the reader itself is not `Sync` while it holds a stream.)
async fn open_stream(
    db: &DatabaseConfig,
    settings: &CdcSettings,
    progress: &SharedProgress,
    skip: Option<SkipRead>,
) -> Result<Streaming, SourceError> {
    let pg = crate::db::pg_config(db)?;
    let client = ReplicationClient::connect(&pg, &db.tls()).await?;
    let start = lock(progress).flushed();
    let names = publication_names(&[&settings.publication]);
    let stream = client
        .start_logical_replication(
            &settings.slot,
            start,
            &[
                ("proto_version", "1"),
                ("publication_names", &names),
                ("messages", "true"),
            ],
        )
        .await?;
    tracing::info!(slot = %settings.slot, from = %start, "streaming from the replication slot");
    Ok(Streaming::new(stream, skip, start, settings.read_table))
}

impl Reader for CdcReader {
    type Position = CdcPosition;

    async fn next_batch(
        &mut self,
        max: usize,
    ) -> Result<Vec<SourcedEvent<CdcPosition>>, SourceError> {
        let max = max.max(1);
        loop {
            if self.pending.len() >= max {
                return Ok(std::mem::take(&mut self.pending));
            }
            match &mut self.phase {
                Phase::Start => self.start().await?,
                Phase::TableRead(_) => {
                    self.table_page(max - self.pending.len()).await?;
                    if !self.pending.is_empty() {
                        return Ok(std::mem::take(&mut self.pending));
                    }
                }
                Phase::Streaming(s) => {
                    let silence = s.last_message.max(s.paused_at) + self.silence_limit;
                    // Messages first: after a pause they are waiting unread.
                    let wake = tokio::select! {
                        biased;
                        message = s.stream.next() => Wake::Message(message),
                        _ = tokio::time::sleep_until(s.next_status) => Wake::Status,
                        _ = tokio::time::sleep_until(silence) => Wake::Silence,
                        _ = sleep_until_opt(self.next_heartbeat) => Wake::Heartbeat,
                    };
                    match wake {
                        Wake::Message(message) => {
                            let Some(message) = message? else {
                                return Err(SourceError::Stream(
                                    "the server ended the replication stream".into(),
                                ));
                            };
                            let (reply, step) = s.handle(
                                message,
                                &self.table,
                                &self.columns,
                                &self.progress,
                                &mut self.pending,
                            )?;
                            // A busy stream still reports on time (the select
                            // prefers messages).
                            if reply || Instant::now() >= s.next_status {
                                s.send_status(&self.progress, self.status_every).await?;
                            }
                            if matches!(step, Step::Committed) && !self.pending.is_empty() {
                                return Ok(std::mem::take(&mut self.pending));
                            }
                        }
                        Wake::Status => s.send_status(&self.progress, self.status_every).await?,
                        Wake::Silence => {
                            return Err(SourceError::Stream(format!(
                                "no message from the server for {}s; reconnecting",
                                self.silence_limit.as_secs()
                            )));
                        }
                        Wake::Heartbeat => self.heartbeat().await?,
                    }
                }
            }
        }
    }

    fn rewind(&mut self) {
        self.pending.clear();
        // A start-up read in progress leaves its snapshot open; start() ends it.
        self.phase = Phase::Start;
    }

    async fn close(mut self) {
        if let Phase::Streaming(s) = std::mem::replace(&mut self.phase, Phase::Start) {
            let mut s = *s;
            let flushed = lock(&self.progress).flushed();
            if let Err(e) = s.send_status(&self.progress, self.status_every).await {
                tracing::warn!(error = %e, "could not report the final position; a restart may repeat some events");
            }
            // The server may still be decoding a large transaction: do not wait long.
            let _ = tokio::time::timeout(Duration::from_secs(3), s.stream.finish()).await;
            tracing::info!(slot = %self.settings.slot, flushed = %flushed, "replication stream closed");
        }
    }

    async fn maintain(&mut self) -> Result<(), SourceError> {
        // While the relay is not taking events, keep the server informed (it
        // would end a silent connection) without reading more.
        match &mut self.phase {
            Phase::Streaming(s) => loop {
                s.paused_at = Instant::now();
                tokio::time::sleep_until(s.next_status).await;
                s.send_status(&self.progress, self.status_every).await?;
            },
            _ => std::future::pending().await,
        }
    }
}

/// Marks confirmed rows (when marking) on the ownership connection, then
/// confirms their positions so the flushed WAL position can advance.
pub struct CdcAcker {
    recorder: RowRecorder,
    progress: SharedProgress,
}

impl CdcAcker {
    pub fn new(recorder: RowRecorder, progress: SharedProgress) -> Self {
        CdcAcker { recorder, progress }
    }
}

impl Acker for CdcAcker {
    type Position = CdcPosition;

    async fn ack(&mut self, positions: Vec<CdcPosition>) -> Result<(), SourceError> {
        let seqs: Vec<i64> = positions.iter().filter_map(|p| p.seq).collect();
        if !seqs.is_empty() {
            self.recorder
                .wait_visible(positions.iter().filter_map(|p| p.xid))
                .await?;
        }
        self.recorder.mark(&seqs).await?;
        let mut progress = lock(&self.progress);
        for p in &positions {
            progress.confirm(p);
        }
        Ok(())
    }

    async fn dead_letter(
        &mut self,
        letters: Vec<DeadLetter<CdcPosition>>,
    ) -> Result<HashSet<String>, SourceError> {
        self.recorder
            .wait_visible(letters.iter().filter_map(|l| l.position.xid))
            .await?;
        let w = self.recorder.dead_letter(&letters).await?;
        // A dead letter is as durable as a delivery, and a follower whose row
        // a redrive put back as a new one is accounted for: their positions are done.
        let mut progress = lock(&self.progress);
        for i in w.written.iter().chain(&w.superseded) {
            progress.confirm(&letters[*i].position);
        }
        Ok(w.resolved)
    }

    async fn open_dead_letters(&mut self) -> Result<HashSet<String>, SourceError> {
        self.recorder.open_dead_letters().await
    }

    async fn heartbeat(&mut self) -> Result<(), SourceError> {
        self.recorder.heartbeat().await
    }
}

impl super::RowPosition for CdcPosition {
    fn seq(&self) -> Option<i64> {
        self.seq
    }
}
