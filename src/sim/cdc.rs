//! The simulated server side of CDC: the slot, the start-up read and a
//! pgoutput stream decoded from the world's WAL. The real [`CdcReader`]
//! (start-up read, skipping, progress, status updates) runs on top.
//!
//! [`CdcReader`]: crate::source::cdc::CdcReader

use super::world::{Row, Shared, lock};
use crate::replication::Lsn;
use crate::replication::pgoutput::{
    Begin, Commit, Insert, LogicalDecodingMessage, LogicalMessage, Relation, RelationColumn,
    TupleValue,
};
use crate::source::SourceError;
use crate::source::cdc::snapshot::StartupView;
use crate::source::cdc::{CdcServer, CdcStream, StreamMessage, TableRow};
use crate::source::rows::Paging;
use bytes::Bytes;
use std::collections::VecDeque;
use std::time::Duration;
use tokio::time::Instant;

const RELATION_ID: u32 = 16_384;
const COLUMNS: [&str; 9] = [
    "relay_seq",
    "id",
    "aggregate_type",
    "aggregate_id",
    "event_type",
    "event_version",
    "payload",
    "headers",
    "created_at",
];
const KEEPALIVE: Duration = Duration::from_secs(1);
/// The simulated server's `wal_sender_timeout`: it ends a stream that sent
/// no status update for that long, which the relay must never let happen
/// (broker stalls and outages here last up to twice as long).
pub const WAL_SENDER_TIMEOUT: Duration = Duration::from_secs(4);

pub struct SimCdc {
    world: Shared,
    /// `source.cdc.on_lost_slot` resolves to recreate.
    recreate_lost_slot: bool,
    /// The prefix the world's logical messages carry.
    message_prefix: String,
    /// The start-up read's snapshot: the unsent rows it sees.
    snapshot: Option<Vec<Row>>,
    paging: Paging,
}

impl SimCdc {
    pub fn new(world: Shared, recreate_lost_slot: bool, message_prefix: String) -> Self {
        SimCdc {
            world,
            recreate_lost_slot,
            message_prefix,
            snapshot: None,
            paging: Paging::default(),
        }
    }
}

impl CdcServer for SimCdc {
    type Stream = SimStream;

    async fn prepare(&mut self) -> Result<Lsn, SourceError> {
        self.snapshot = None;
        let mut w = lock(&self.world);
        if w.cdc_blocked {
            return Err(SourceError::Setup(
                "sim: logical replication is not possible now".into(),
            ));
        }
        if w.slot_active.is_some() {
            return Err(SourceError::SlotBusy("sim".into()));
        }
        if w.slot_lost {
            if !self.recreate_lost_slot {
                return Err(SourceError::Setup("the slot is lost".into()));
            }
            // A new slot starts at the current end of the WAL: what the lost
            // WAL held must come from the start-up read.
            w.slot_lost = false;
            w.slot_confirmed = w.insert_lsn();
            w.slot_saved = w.slot_confirmed;
            w.slot_born = w.slot_confirmed;
            w.unseen.clear();
            let at = w.slot_confirmed;
            w.note(format!("lost slot recreated at {at}"));
        }
        Ok(w.slot_confirmed)
    }

    async fn wal_insert_position(&mut self) -> Result<Option<Lsn>, SourceError> {
        Ok(Some(lock(&self.world).insert_lsn()))
    }

    async fn begin_table_read(&mut self) -> Result<StartupView, SourceError> {
        let mut w = lock(&self.world);
        // As the server: the settled position is read first, and the relay
        // waits for the transactions running then to end, so every commit
        // before it is seen; one view in eight comes without one (a
        // transaction outlasted the wait). A commit after it whose record
        // was written a moment ago, and that no session has seen yet
        // (`unseen`), may not be visible to the snapshot taken next either:
        // the newest one or two, if that recent, half the time (a prefix of
        // the WAL is visible: writers of one aggregate wait for each other's
        // locks, which a transaction releases once visible). Their commit
        // LSNs are before `until`, their rows are not in the read, and the
        // stream must publish them. Every other commit is seen from here on.
        // Not one a stream has decoded or passed: the relay read the
        // settled position after the server sent it, so it lies before.
        let born = w.slot_born;
        let newest = w.rng.usize(0..4).saturating_sub(1);
        let now = Instant::now();
        let moment = now.checked_sub(Duration::from_millis(5)).unwrap_or(now);
        let hidden: Vec<(u64, Lsn)> = w
            .wal
            .iter()
            .rev()
            .take_while(|t| {
                t.commit_lsn >= born.max(w.streamed_to)
                    && t.at >= moment
                    && w.unseen.contains(&t.xid)
            })
            .take(newest)
            .map(|t| (t.xid, t.commit_lsn))
            .collect();
        w.unseen = hidden.iter().map(|h| h.0).collect();
        let settled = (w.rng.u8(0..8) != 0)
            .then(|| hidden.last().map(|h| h.1).unwrap_or_else(|| w.insert_lsn()));
        let snapshot = w.session_snapshot();
        self.snapshot = Some(
            w.unsent()
                .filter(|r| snapshot.saw_finished(r.xid))
                .cloned()
                .collect(),
        );
        if !w.unseen.is_empty() {
            let unseen = w.unseen.clone();
            w.note(format!(
                "start-up read's snapshot misses commits {unseen:?}"
            ));
        }
        Ok(StartupView {
            snapshot,
            until: w.insert_lsn(),
            settled,
        })
    }

    fn advance_slot(
        &mut self,
        to: Lsn,
    ) -> impl std::future::Future<Output = Result<Lsn, SourceError>> + Send + 'static {
        let world = self.world.clone();
        async move {
            let mut w = lock(&world);
            if w.slot_active.is_some() || w.slot_lost {
                return Err(SourceError::SlotBusy("sim".into()));
            }
            // As PostgreSQL 15: pg_replication_slot_advance never moves a
            // logical slot back (a status update could). The relay asks only
            // past what it knows the slot confirmed: a request behind it
            // would mean its view of the slot is stale.
            if to < w.slot_confirmed {
                let v = format!(
                    "the relay asked to move the slot back to {to}, behind its confirmed {}",
                    w.slot_confirmed
                );
                w.violation(v);
                return Err(SourceError::Stream(format!(
                    "sim: cannot advance replication slot to {to}, minimum is {}",
                    w.slot_confirmed
                )));
            }
            let end = to.min(w.insert_lsn());
            // Checked like a status update: nothing unaccounted for is passed.
            w.confirm_slot(end);
            w.note(format!("slot advanced to {end}"));
            Ok(w.slot_confirmed)
        }
    }

    async fn table_page(
        &mut self,
        after: i64,
        max: usize,
        max_bytes: usize,
    ) -> Result<Vec<TableRow>, SourceError> {
        // As the real read: `limit` rows in `relay_seq` order, kept while
        // the rows before them take less than the room.
        let limit = self.paging.limit(max, max_bytes);
        let mut page = self.paging.page(limit, max_bytes);
        let rows = self.snapshot.as_deref().unwrap_or_default();
        for r in rows.iter().filter(|r| r.seq > after).take(limit) {
            if !page.takes_another() {
                break;
            }
            let raw = r.raw();
            let bytes = crate::source::rows::row_bytes(&raw);
            let row = TableRow {
                seq: r.seq,
                xid: r.xid,
                raw,
            };
            page.keep(row, bytes);
        }
        Ok(self.paging.finish(page).rows)
    }

    async fn end_table_read(&mut self) -> Result<(), SourceError> {
        self.snapshot = None;
        Ok(())
    }

    fn stream(
        &mut self,
        from: Lsn,
    ) -> impl Future<Output = Result<SimStream, SourceError>> + Send + 'static {
        let world = self.world.clone();
        let message_prefix = self.message_prefix.clone();
        async move {
            // Connecting and starting take a while, in which the start-up
            // read may run more rounds.
            let setup = Duration::from_micros(lock(&world).rng.u64(0..60_000));
            tokio::time::sleep(setup).await;
            let (id, pos, slot_confirmed) = {
                let mut w = lock(&world);
                let Some(id) = w.open_stream() else {
                    return Err(SourceError::SlotBusy("sim".into()));
                };
                // The server starts at the slot's confirmed position when that is later.
                let start = from.max(w.slot_confirmed);
                let pos = w.wal.partition_point(|t| t.commit_lsn < start);
                w.note(format!("stream {id} from {start}"));
                (id, pos, w.slot_confirmed)
            };
            Ok(SimStream {
                world,
                id,
                pos,
                buffer: VecDeque::new(),
                relation_sent: false,
                next_keepalive: Instant::now() + KEEPALIVE,
                message_prefix,
                unflushed: None,
                last_reply: Instant::now(),
                slot_confirmed,
            })
        }
    }

    async fn heartbeat(&mut self) -> Result<(), SourceError> {
        Ok(())
    }

    async fn dead_lettered_since(&mut self, from: Lsn) -> Result<Vec<(Lsn, u64)>, SourceError> {
        Ok(lock(&self.world)
            .letters
            .iter()
            .filter_map(|l| l.wal)
            .filter(|(lsn, _)| *lsn >= from)
            .collect())
    }
}

pub struct SimStream {
    world: Shared,
    id: u64,
    /// The next WAL transaction to decode.
    pos: usize,
    buffer: VecDeque<StreamMessage>,
    relation_sent: bool,
    next_keepalive: Instant,
    message_prefix: String,
    /// A status message written but not yet flushed (a send cut short):
    /// it goes with the next one, or is lost with the connection.
    unflushed: Option<Lsn>,
    /// When the server last heard from the relay (the stream's start, or a
    /// status update).
    last_reply: Instant,
    /// The slot's confirmed position when the stream opened.
    slot_confirmed: Lsn,
}

fn text(s: &str) -> TupleValue {
    TupleValue::Text(Bytes::from(s.to_owned()))
}

impl SimStream {
    /// Decodes the next WAL transaction into the buffer, if there is one.
    fn decode(&mut self) -> bool {
        let mut w = lock(&self.world);
        let Some(end) = w.wal.get(self.pos).map(|t| t.end_lsn) else {
            return false;
        };
        w.streamed_to = w.streamed_to.max(end);
        let Some(tx) = w.wal.get(self.pos) else {
            return false;
        };
        self.pos += 1;
        if !self.relation_sent {
            self.relation_sent = true;
            self.buffer
                .push_back(StreamMessage::Change(LogicalMessage::Relation(Relation {
                    id: RELATION_ID,
                    namespace: "public".into(),
                    name: "outbox".into(),
                    replica_identity: b'd',
                    columns: COLUMNS
                        .iter()
                        .map(|c| RelationColumn {
                            flags: 0,
                            name: (*c).into(),
                            type_oid: 25,
                            type_modifier: -1,
                        })
                        .collect(),
                })));
        }
        self.buffer
            .push_back(StreamMessage::Change(LogicalMessage::Begin(Begin {
                final_lsn: tx.commit_lsn,
                commit_time_micros: 0,
                xid: tx.xid as u32,
            })));
        for r in &tx.rows {
            if r.message {
                self.buffer
                    .push_back(StreamMessage::Change(LogicalMessage::Message(
                        LogicalDecodingMessage {
                            transactional: true,
                            lsn: tx.commit_lsn,
                            prefix: self.message_prefix.clone(),
                            content: message_content(r),
                        },
                    )));
                continue;
            }
            let raw = r.raw();
            let values = [
                Some(r.seq.to_string()),
                raw.id,
                raw.aggregate_type,
                raw.aggregate_id,
                raw.event_type,
                raw.event_version,
                raw.payload,
                raw.headers,
                raw.created_at,
            ];
            self.buffer
                .push_back(StreamMessage::Change(LogicalMessage::Insert(Insert {
                    relation_id: RELATION_ID,
                    tuple: values
                        .iter()
                        .map(|v| v.as_deref().map(text).unwrap_or(TupleValue::Null))
                        .collect(),
                })));
        }
        self.buffer
            .push_back(StreamMessage::Change(LogicalMessage::Commit(Commit {
                flags: 0,
                commit_lsn: tx.commit_lsn,
                end_lsn: tx.end_lsn,
                commit_time_micros: 0,
            })));
        true
    }
}

impl SimStream {
    /// The server ends a stream it has not heard from for
    /// `wal_sender_timeout`; the relay's status updates must prevent it.
    fn timed_out(&self) -> Result<(), SourceError> {
        let silent = self.last_reply.elapsed();
        if silent <= WAL_SENDER_TIMEOUT {
            return Ok(());
        }
        lock(&self.world).violation(format!(
            "the server ended stream {}: no status update for {silent:?} (wal_sender_timeout {WAL_SENDER_TIMEOUT:?})",
            self.id
        ));
        Err(SourceError::Stream(
            "sim: terminating walsender process due to replication timeout".into(),
        ))
    }
}

impl CdcStream for SimStream {
    async fn next(&mut self) -> Result<Option<StreamMessage>, SourceError> {
        loop {
            self.timed_out()?;
            if lock(&self.world).cut_stream == Some(self.id) {
                return Err(SourceError::Stream(
                    "sim: the replication connection dropped".into(),
                ));
            }
            if let Some(m) = self.buffer.pop_front() {
                return Ok(Some(m));
            }
            if lock(&self.world).cdc_blocked {
                return Err(SourceError::Stream(
                    "sim: the server ended logical replication".into(),
                ));
            }
            let notify = lock(&self.world).commit_notify.clone();
            let woken = notify.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            if self.decode() {
                continue;
            }
            tokio::select! {
                biased;
                _ = woken => {}
                _ = tokio::time::sleep_until(self.next_keepalive) => {
                    self.next_keepalive = Instant::now() + KEEPALIVE;
                    // What the server has decoded so far: the next
                    // transaction's commit, or the end of the WAL.
                    let wal_end = {
                        let mut w = lock(&self.world);
                        let end = w.wal.get(self.pos).map(|t| t.commit_lsn).unwrap_or(w.insert_lsn());
                        w.streamed_to = w.streamed_to.max(end);
                        end
                    };
                    return Ok(Some(StreamMessage::Keepalive { wal_end, reply_requested: false }));
                }
            }
        }
    }

    async fn send_status(&mut self, _write: Lsn, flushed: Lsn) -> Result<(), SourceError> {
        // As the replication connection does: the message is written to the
        // buffer at once, and the flush that follows may be cut short by the
        // reader's select (it then goes with the next message).
        self.timed_out()?;
        let queued = self.unflushed.map_or(flushed, |u| u.max(flushed));
        self.unflushed = Some(queued);
        tokio::time::sleep(Duration::from_millis(1)).await;
        let mut w = lock(&self.world);
        if w.cut_stream == Some(self.id) {
            // The connection is gone: the server hears nothing more.
            return Err(SourceError::Stream(
                "sim: the replication connection dropped".into(),
            ));
        }
        if let Some(lsn) = self.unflushed.take() {
            self.last_reply = Instant::now();
            w.confirm_slot(lsn);
        }
        Ok(())
    }

    async fn finish(self) {}

    fn slot_confirmed(&self) -> Lsn {
        self.slot_confirmed
    }
}

impl Drop for SimStream {
    fn drop(&mut self) {
        lock(&self.world).close_stream(self.id);
    }
}

/// A logical message's JSON for an event, as the emit function writes it;
/// a row's bad headers stay bad (`[1]` is not an object).
fn message_content(r: &Row) -> Bytes {
    let headers: serde_json::Value =
        serde_json::from_str(&r.headers).unwrap_or(serde_json::Value::Null);
    let content = serde_json::json!({
        "id": r.id,
        "aggregate_type": "sim",
        "aggregate_id": r.aggregate,
        "event_type": r.event_type,
        "event_version": 1,
        "payload": {},
        "headers": headers,
    });
    Bytes::from(content.to_string())
}
