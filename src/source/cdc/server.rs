//! What the CDC reader asks of PostgreSQL, as a trait: the checks and the
//! slot, the start-up read of unsent rows, and the replication stream.
//! [`PgServer`] is the real server; the pipeline simulation drives the same
//! reader over an in-memory one, so the reader's decisions (what to skip,
//! what to acknowledge) are the ones the simulation checks.

use super::CdcSettings;
use super::setup;
use super::snapshot::{Snapshot, StartupView};
use super::startup_rows::StartupRows;
use crate::config::DatabaseConfig;
use crate::config::{ResolvedColumns, TableName};
use crate::db::DbError;
use crate::outbox::RawRow;
use crate::replication::Lsn;
use crate::replication::pgoutput::LogicalMessage;
use crate::replication::protocol::{ReplicationClient, publication_names};
use crate::source::SourceError;
use crate::telemetry::events::{InternalEvent, SlotCreated, SlotRecreated, SlotStreaming};
use std::future::Future;
use std::time::Duration;
use tokio_postgres::Client;

mod pg_stream;
pub use pg_stream::PgStream;

/// One message of the replication stream.
#[derive(Debug)]
pub enum StreamMessage {
    /// The server's WAL end; answer at once when `reply_requested`.
    Keepalive { wal_end: Lsn, reply_requested: bool },
    /// A decoded pgoutput message.
    Change(LogicalMessage),
}

/// An unsent row from the start-up read.
#[derive(Debug)]
pub struct TableRow {
    pub seq: i64,
    /// The inserting transaction's full id (`relay_xid`): a row may be
    /// older than any 32-bit id can be placed from a snapshot.
    pub xid: u64,
    pub raw: RawRow,
}

/// How often to report, and how long a silent server is tolerated.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    pub status_every: Duration,
    pub silence_limit: Duration,
}

/// The server side of the CDC source.
pub trait CdcServer: Send + 'static {
    type Stream: CdcStream;

    /// Checks `wal_level`, the publication and the slot (creating it when
    /// allowed) and ends a start-up read left open; returns the slot's
    /// confirmed position.
    fn prepare(&mut self) -> impl Future<Output = Result<Lsn, SourceError>> + Send;

    /// The server's current timeline, when it has one to tell (a primary):
    /// a promoted standby is on a new one, and its WAL past the switch may
    /// differ from what the relay was told before.
    fn timeline(&mut self) -> impl Future<Output = Result<Option<u32>, SourceError>> + Send {
        async { Ok(None) }
    }

    /// Opens a round of the start-up read (ending the previous one, if it
    /// is still open): one snapshot for the whole round; returns it
    /// with the WAL insert position read just after it was taken and, when
    /// it could be established, the settled position (see [`StartupView`]).
    fn begin_table_read(&mut self)
    -> impl Future<Output = Result<StartupView, SourceError>> + Send;

    /// The WAL insert position now, when the server can say: how much WAL a
    /// stream opened now would decode before new commits. `None` by default.
    fn wal_insert_position(
        &mut self,
    ) -> impl Future<Output = Result<Option<Lsn>, SourceError>> + Send {
        async { Ok(None) }
    }

    /// Best effort: writes a position the server can restart decoding from
    /// (see [`setup::write_restart_point`]), before a view the slot is
    /// moved to. Nothing where decoding has no restart position.
    fn write_restart_point(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// Moves the slot's confirmed position forward to `to` without the
    /// output plugin, on a connection of its own, so that it runs while the
    /// start-up read is published. Returns where the slot got to (the server
    /// does not move it past the WAL it has flushed).
    fn advance_slot(
        &mut self,
        to: Lsn,
    ) -> impl Future<Output = Result<Lsn, SourceError>> + Send + 'static;

    /// Up to `max` unsent rows after `after`, each while the rows before
    /// it take less than `max_bytes` (so at least one row, and the
    /// last may pass the room); none once the read is through.
    fn table_page(
        &mut self,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Vec<TableRow>, SourceError>> + Send;

    fn end_table_read(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Starts streaming from the slot at `from`, on a connection of its
    /// own, so that it can open while the start-up read ends.
    fn stream(
        &mut self,
        from: Lsn,
    ) -> impl Future<Output = Result<Self::Stream, SourceError>> + Send + 'static;

    /// Writes a tiny logical message so that an idle database's slot moves.
    fn heartbeat(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// WAL positions (commit LSN, index) of events dead-lettered at or after
    /// `from`: a replay from there must not handle them again.
    fn dead_lettered_since(
        &mut self,
        from: Lsn,
    ) -> impl Future<Output = Result<Vec<(Lsn, u64)>, SourceError>> + Send;
}

/// A replication stream.
pub trait CdcStream: Send + 'static {
    /// The next message; `None` once the server ended the stream. Cancel-safe.
    fn next(&mut self) -> impl Future<Output = Result<Option<StreamMessage>, SourceError>> + Send;

    /// Reports `write` as received and `flushed` as durably handled (the
    /// slot's confirmed position), asking for a keepalive in reply.
    fn send_status(
        &mut self,
        write: Lsn,
        flushed: Lsn,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Ends the stream cleanly (bounded by the caller).
    fn finish(self) -> impl Future<Output = ()> + Send;

    /// The slot's confirmed position once this stream held the slot, before
    /// any status update on it. When that is past the position asked for
    /// (the start-up read's move, or another instance: a new owner while
    /// this one's session was silent), the server streams from it, and a
    /// status update behind it would move the slot back.
    fn slot_confirmed(&self) -> Lsn;
}

/// PostgreSQL: an ordinary connection for checks, the start-up read and
/// heartbeats; a replication connection per stream.
pub struct PgServer {
    db: DatabaseConfig,
    table: TableName,
    /// The columns the relay reads.
    columns: ResolvedColumns,
    settings: CdcSettings,
    client: Client,
    startup_rows: StartupRows,
    /// The start-up read's REPEATABLE READ transaction is open.
    snapshot_open: bool,
    /// A start-up read already said which transaction kept its position
    /// from settling (said once per run).
    told_unsettled: bool,
}

impl PgServer {
    /// wal_level, the server version messages and failover slots need,
    /// the publication, and columns it cannot stream.
    async fn check_server(&self) -> Result<(), SourceError> {
        let s = &self.settings;
        if let Some(problem) = setup::wal_level_problem(&setup::wal_level(&self.client).await?) {
            return Err(SourceError::Setup(problem));
        }
        // Refused whether or not the slot exists: streaming from a slot
        // made without failover would quietly drop what was asked for.
        if s.failover
            && let Some(problem) = setup::failover_problem(&self.client)
                .await
                .map_err(SourceError::Setup)?
        {
            return Err(SourceError::Setup(problem));
        }
        if let Some(prefix) = &s.messages {
            if let Some(problem) = setup::messages_problem(&self.client)
                .await
                .map_err(SourceError::Setup)?
            {
                return Err(SourceError::Setup(problem));
            }
            if let Some(problem) =
                crate::outbox::emit::prefix_problem(&self.client, &self.table, prefix)
                    .await
                    .map_err(|e| DbError::query("reading the function that writes messages", e))?
            {
                return Err(SourceError::Setup(problem));
            }
        }
        match setup::publication_covers(&self.client, &s.publication, &self.table).await? {
            Some(true) => {}
            Some(false) => {
                return Err(SourceError::Setup(
                    setup::not_published_problem(&self.client, &s.publication, &self.table).await?,
                ));
            }
            None => {
                return Err(SourceError::Setup(format!(
                    "publication {:?} does not exist; run `outbox-relay migrate`",
                    s.publication
                )));
            }
        }
        let problems = setup::streaming_problems(
            &self.client,
            &s.publication,
            &self.table,
            &self.columns,
            s.read_table,
        )
        .await?;
        if !problems.is_empty() {
            return Err(SourceError::Setup(problems.join("; ")));
        }
        Ok(())
    }

    /// The slot's state, if it exists, once it is known to be usable here
    /// and not streaming to another process.
    async fn usable_slot(&self) -> Result<Option<setup::SlotInfo>, SourceError> {
        let s = &self.settings;
        let database: String = self
            .client
            .query_one("SELECT current_database()::text", &[])
            .await
            .map_err(|e| DbError::query("reading the database name", e))?
            .get(0);
        let info = setup::slot_info(&self.client, &s.slot).await?;
        if let Some(info) = &info {
            let problems = setup::slot_problems(info, &s.slot, &database);
            if let Some(first) = problems.into_iter().next() {
                return Err(SourceError::Setup(first));
            }
            if info.active {
                // Checked before the start-up read, so nothing is published
                // while another process owns the stream.
                return Err(SourceError::SlotBusy(s.slot.clone()));
            }
        }
        Ok(info)
    }

    /// The slot's confirmed position: a lost slot recreated (when allowed),
    /// a missing one created (when allowed).
    async fn open_slot(&mut self, info: Option<setup::SlotInfo>) -> Result<Lsn, SourceError> {
        let s = &self.settings;
        match info {
            Some(info) if info.is_lost() => {
                if !s.recreate_lost_slot {
                    return Err(SourceError::Setup(setup::lost_slot_message(
                        &s.slot,
                        s.read_table && s.messages.is_none(),
                    )));
                }
                // Every event the lost WAL held is an unsent row: the
                // start-up read that follows a new slot publishes it.
                setup::drop_slot(&self.client, &s.slot).await?;
                let lsn = self.create_slot().await?;
                SlotRecreated {
                    pipeline: &s.pipeline,
                    slot: &s.slot,
                    consistent_point: &lsn,
                }
                .emit();
                Ok(lsn)
            }
            Some(info) => Ok(info.confirmed_flush.unwrap_or_default()),
            None if s.create_slot => {
                let lsn = self.create_slot().await?;
                SlotCreated {
                    slot: &s.slot,
                    consistent_point: &lsn,
                }
                .emit();
                Ok(lsn)
            }
            None => Err(SourceError::Setup(format!(
                "replication slot {:?} does not exist; run `outbox-relay migrate` or set source.cdc.create_slot = true",
                s.slot
            ))),
        }
    }

    pub async fn connect(
        db: &DatabaseConfig,
        table: &TableName,
        columns: &ResolvedColumns,
        settings: CdcSettings,
    ) -> Result<(Self, Timing), SourceError> {
        let client = crate::db::connect(db, None).await?;
        let startup_rows = StartupRows::prepare(&client, table, columns, settings.ranges).await?;
        let timeout_ms = setup::wal_sender_timeout_ms(&client).await?;
        let timing = if timeout_ms > 0 {
            let timeout = Duration::from_millis(timeout_ms.unsigned_abs());
            Timing {
                status_every: settings.status_interval.min(timeout / 2),
                silence_limit: (timeout * 2).max(Duration::from_secs(10)),
            }
        } else {
            Timing {
                status_every: settings.status_interval,
                silence_limit: Duration::from_secs(120),
            }
        };
        Ok((
            PgServer {
                db: db.clone(),
                table: table.clone(),
                columns: columns.clone(),
                settings,
                client,
                startup_rows,
                snapshot_open: false,
                told_unsettled: false,
            },
            timing,
        ))
    }
}

impl PgServer {
    async fn create_slot(&self) -> Result<Lsn, SourceError> {
        setup::create_slot(&self.client, &self.settings.slot, self.settings.failover)
            .await
            .map_err(SourceError::Setup)
    }
}

impl CdcServer for PgServer {
    type Stream = PgStream;

    async fn prepare(&mut self) -> Result<Lsn, SourceError> {
        if std::mem::take(&mut self.snapshot_open) {
            self.client
                .batch_execute("ROLLBACK")
                .await
                .map_err(|e| DbError::query("ending the start-up read", e))?;
        }
        self.startup_rows.restart();
        self.check_server().await?;
        let info = self.usable_slot().await?;
        self.open_slot(info).await
    }

    /// From the name of the WAL file being written, whose first eight hex
    /// digits are the timeline; none on a standby, which writes none.
    async fn timeline(&mut self) -> Result<Option<u32>, SourceError> {
        let name: Option<String> = self
            .client
            .query_one(
                "SELECT CASE WHEN pg_is_in_recovery() THEN NULL \
                 ELSE pg_walfile_name(pg_current_wal_insert_lsn()) END",
                &[],
            )
            .await
            .map_err(|e| DbError::query("reading the server's timeline", e))?
            .get(0);
        Ok(name.and_then(|n| u32::from_str_radix(n.get(..8)?, 16).ok()))
    }

    async fn begin_table_read(&mut self) -> Result<StartupView, SourceError> {
        if std::mem::take(&mut self.snapshot_open) {
            self.client
                .batch_execute("COMMIT")
                .await
                .map_err(|e| DbError::query("ending a start-up read", e))?;
        }
        let settled = super::settle::settled_position(
            &self.client,
            &self.settings.pipeline,
            &mut self.told_unsettled,
        )
        .await?;
        self.startup_rows.next_round();
        // Open from here on for the next prepare(), even should this future
        // be dropped before the BEGIN's answer (a rewind): a ROLLBACK
        // outside a transaction only warns.
        self.snapshot_open = true;
        // The read waits while the broker catches up, so a server-wide
        // idle-in-transaction timeout must not end it.
        self.client
            .batch_execute(&format!(
                "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY; \
                 SET LOCAL idle_in_transaction_session_timeout = 0; {}",
                self.startup_rows.transaction_settings()
            ))
            .await
            .map_err(|e| DbError::query("starting the start-up read", e))?;
        // The first statement takes the transaction's snapshot, then reads
        // the insert position (not the write position: a commit with
        // synchronous_commit = off is visible before it is written).
        let row = self
            .client
            .query_one(
                "SELECT pg_current_snapshot()::text, pg_current_wal_insert_lsn()::text",
                &[],
            )
            .await
            .map_err(|e| DbError::query("starting the start-up read", e))?;
        let (snapshot, until): (String, String) = (row.get(0), row.get(1));
        let snapshot = parse_snapshot(&snapshot)?;
        let until = parse_lsn(&until)?;
        Ok(StartupView {
            snapshot,
            until,
            settled,
        })
    }

    async fn wal_insert_position(&mut self) -> Result<Option<Lsn>, SourceError> {
        let row = self
            .client
            .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
            .await
            .map_err(|e| DbError::query("reading the WAL insert position", e))?;
        parse_lsn(&row.get::<_, String>(0)).map(Some)
    }

    async fn write_restart_point(&mut self) {
        let started = std::time::Instant::now();
        let written = match crate::db::connect(&self.db, None).await {
            Ok(client) => setup::write_restart_point(&client, &self.settings.slot).await,
            Err(e) => Err(e),
        };
        match written {
            Ok(()) => tracing::debug!(elapsed = ?started.elapsed(), "restart point written"),
            Err(e) => {
                tracing::debug!(error = %e, "no restart point; the slot's next move decodes from further back")
            }
        }
    }

    fn advance_slot(
        &mut self,
        to: Lsn,
    ) -> impl Future<Output = Result<Lsn, SourceError>> + Send + 'static {
        let db = self.db.clone();
        let slot = self.settings.slot.clone();
        async move {
            let started = std::time::Instant::now();
            let client = crate::db::connect(&db, None).await?;
            let text: String = client
                .query_one(
                    "SELECT end_lsn::text FROM pg_replication_slot_advance($1, $2::text::pg_lsn)",
                    &[&slot, &to.to_string()],
                )
                .await
                .map_err(|e| {
                    DbError::query("moving the replication slot past the start-up read", e)
                })?
                .get(0);
            let reached = parse_lsn(&text)?;
            tracing::debug!(slot = %slot, to = %reached, elapsed = ?started.elapsed(), "replication slot moved");
            Ok(reached)
        }
    }

    async fn table_page(
        &mut self,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<TableRow>, SourceError> {
        self.startup_rows
            .page(&self.client, after, max, max_bytes)
            .await
    }

    async fn end_table_read(&mut self) -> Result<(), SourceError> {
        self.client
            .batch_execute("COMMIT")
            .await
            .map_err(|e| DbError::query("ending the start-up read", e))?;
        self.snapshot_open = false;
        Ok(())
    }

    fn stream(
        &mut self,
        from: Lsn,
    ) -> impl Future<Output = Result<PgStream, SourceError>> + Send + 'static {
        let db = self.db.clone();
        let slot = self.settings.slot.clone();
        let names = publication_names(&[&self.settings.publication]);
        async move {
            let pg = crate::db::replication_config(&db)?;
            let mut client = ReplicationClient::connect(&pg, &db.tls()).await?;
            let pid = walsender_pid(&mut client).await?;
            let mut options = vec![
                ("proto_version", "1"),
                ("publication_names", names.as_str()),
            ];
            // pgoutput learned `messages` in PostgreSQL 14 and refuses options it
            // does not know. The relay only skips the messages (its heartbeats
            // move the slot by writing WAL, received or not), so 13 goes without.
            if setup::major_version(client.server_version()).is_none_or(|v| v >= 14) {
                options.push(("messages", "true"));
            }
            let stream = client
                .start_logical_replication(&slot, from, &options)
                .await?;
            // Read once this stream holds the slot: nothing else can move
            // it now, and this stream has reported nothing yet. Held by
            // this stream's process, so that a URL naming several hosts
            // cannot answer from another server's slot of the same name.
            let reader = crate::db::connect(&db, None).await?;
            let slot_confirmed = setup::held_slot_confirmed(&reader, &slot, pid)
                .await?
                .ok_or_else(|| {
                    SourceError::Stream(format!(
                        "replication slot {slot:?} is not held by the stream just opened (process {pid}): the stream ended at once (the server's log says why), or the connections database.url makes reach different servers"
                    ))
                })?
                .unwrap_or(from);
            SlotStreaming {
                slot: &slot,
                from: &from,
            }
            .emit();
            Ok(PgStream::new(stream, slot_confirmed))
        }
    }

    async fn heartbeat(&mut self) -> Result<(), SourceError> {
        self.client
            .execute(
                "SELECT pg_logical_emit_message(false, $1::text, 'heartbeat'::text)",
                &[&crate::config::HEARTBEAT_MESSAGE_PREFIX],
            )
            .await
            .map_err(|e| DbError::query("writing the heartbeat message", e))?;
        Ok(())
    }

    async fn dead_lettered_since(&mut self, from: Lsn) -> Result<Vec<(Lsn, u64)>, SourceError> {
        let Some(table) = &self.settings.dead_letters else {
            return Ok(Vec::new());
        };
        let messages = self.settings.messages.is_some();
        crate::dead_letter::wal_positions_since(&self.client, table, from, messages)
            .await
            .map_err(|e| DbError::query("reading dead-lettered WAL positions", e).into())
    }
}

/// The process id of a replication connection's walsender.
async fn walsender_pid(client: &mut ReplicationClient) -> Result<i32, SourceError> {
    let rows = client.simple_query("SELECT pg_backend_pid()").await?;
    let text = rows
        .first()
        .and_then(|r| r.first())
        .cloned()
        .flatten()
        .unwrap_or_default();
    text.parse().map_err(|e| {
        SourceError::Stream(format!(
            "unreadable process id {text:?} from the replication connection: {e}"
        ))
    })
}

/// A WAL position in its text form, as the server reports it.
pub(super) fn parse_lsn(text: &str) -> Result<Lsn, SourceError> {
    text.parse()
        .map_err(|e| SourceError::Stream(format!("unreadable WAL position {text:?}: {e}")))
}

/// A `pg_snapshot` in its text form, as the server reports it.
pub(super) fn parse_snapshot(text: &str) -> Result<Snapshot, SourceError> {
    Snapshot::parse(text).ok_or_else(|| {
        SourceError::Stream(format!("unreadable snapshot from the server: {text:?}"))
    })
}
