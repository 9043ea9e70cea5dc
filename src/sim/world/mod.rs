//! The simulated world every instance shares: one database (transactions,
//! outbox rows, the WAL, dead letters, the slot, the ownership lock) and one
//! broker, plus the record of what happened that the checks read.
//!
//! Everything is in one struct behind a mutex that is never held across an
//! await: each database statement and each broker step happens at one
//! instant of (paused, simulated) time.

use crate::outbox::RawRow;
use crate::replication::Lsn;
use crate::sink::SinkError;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::sync::{Notify, oneshot};
use tokio::time::Instant;

mod broker;
mod client;
mod ownership;
mod ranges;
mod slot;

use broker::{BrokerMsg, PendingConfirm};
pub use broker::{CleanStop, Delivery};
use client::ClientMsg;
pub use ranges::{Advance, Capture, FoldCounts};

pub type Shared = Arc<Mutex<World>>;

pub fn lock(world: &Shared) -> MutexGuard<'_, World> {
    world.lock().unwrap_or_else(|e| e.into_inner())
}

/// What the broker does with an event, decided when it is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poison {
    None,
    /// Refused by the sink's own checks, before anything is sent (too large).
    RefuseBeforeSend,
    /// Refused by the broker after the send (an invalid destination).
    RefuseAfterSend,
    /// Refused this many times, then accepted.
    Flaky(u32),
    /// The row itself cannot be read (headers that are not an object of strings).
    BadRow,
}

/// One outbox row.
#[derive(Debug, Clone)]
pub struct Row {
    pub seq: i64,
    pub id: String,
    pub aggregate: String,
    pub event_type: String,
    pub headers: String,
    pub xid: u64,
    pub sent: bool,
    /// Written as a logical message (`source.cdc.messages`): in the WAL
    /// only, never in the table.
    pub message: bool,
}

impl Row {
    pub fn raw(&self) -> RawRow {
        RawRow {
            id: Some(self.id.clone()),
            aggregate_type: Some("sim".into()),
            aggregate_id: Some(self.aggregate.clone()),
            event_type: Some(self.event_type.clone()),
            event_version: Some("1".into()),
            payload: Some("{}".into()),
            headers: Some(self.headers.clone()),
            created_at: Some("2026-12-01 00:00:00+00".into()),
            extra: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TxState {
    Open,
    Committed,
    Aborted,
}

/// A committed transaction as logical decoding sees it.
#[derive(Debug, Clone)]
pub struct WalTx {
    pub commit_lsn: Lsn,
    pub end_lsn: Lsn,
    pub xid: u64,
    /// The rows as inserted.
    pub rows: Vec<Row>,
    /// When the commit record was written.
    pub at: Instant,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    Redriven,
    Dropped,
}

#[derive(Debug, Clone)]
pub struct Letter {
    pub letter_id: i64,
    pub event_id: String,
    pub aggregate: String,
    pub raw: RawRow,
    pub resolution: Option<Resolution>,
    /// An operator asked for a redrive the relay has not carried out yet.
    pub requested: bool,
    /// Where the event is in the WAL (CDC).
    pub wal: Option<(Lsn, u64)>,
    /// Written as the follower of an earlier letter of its aggregate.
    pub follows: bool,
    /// Deliveries made before it was written.
    pub after_deliveries: usize,
}

/// What the checks know about an event.
#[derive(Debug, Clone)]
pub struct EventFacts {
    pub aggregate: String,
    pub committed: bool,
    pub aborted: bool,
    pub poison: Poison,
    /// Refused by the broker so far (for `Flaky`).
    pub refusals: u32,
    /// Refusals the relay was told of (a refusal on a connection that died
    /// reaches it as a lost connection), before sending or after.
    pub refusals_seen: u32,
    /// Pushed back by the broker (a nack: back-pressure) so far.
    pub nacks: u32,
    pub dropped: bool,
    /// Written poisoned (the cure clears `poison`, not this).
    pub poisoned: bool,
    /// Written as a logical message: nothing in the table to hold it back
    /// in, so a held-back message goes to the dead-letter table instead.
    pub message: bool,
}

/// How the simulated broker behaves.
#[derive(Debug, Clone, Copy)]
pub struct BrokerKind {
    /// Kafka: a refusal after a send fails every later message of the same
    /// topic and key on that connection (the idempotent producer's gapless
    /// guarantee), and breaks the connection. RabbitMQ: outcomes are independent.
    pub gapless: bool,
    /// Each event type has its own topic.
    pub topic_per_type: bool,
}

pub struct World {
    pub rng: fastrand::Rng,
    pub broker_kind: BrokerKind,
    pub confirm_timeout: Duration,
    pub marks_rows: bool,
    // The database.
    /// `relay.mark = "ranges"`: progress rows, frontier, held rows.
    pub progress: ranges::Progress,
    next_xid: u64,
    next_seq: i64,
    next_lsn: u64,
    pub txs: BTreeMap<u64, TxState>,
    /// Rows of committed (and open) transactions, by `relay_seq`.
    pub rows: BTreeMap<i64, Row>,
    /// Committed transactions whose rows other sessions' statements do not
    /// see yet (decoding can hand a commit over first): a marking statement
    /// skips them until a wait for visibility or a snapshot that sees them.
    pub unseen: BTreeSet<u64>,
    /// How far the server's streams have decoded or reported the WAL: a
    /// settled position read later lies past it.
    pub streamed_to: Lsn,
    /// Commit order: the xid of each committed transaction.
    pub commits: Vec<u64>,
    /// Each committed xid's place in `commits`.
    pub commit_pos: BTreeMap<u64, usize>,
    pub wal: Vec<WalTx>,
    pub letters: Vec<Letter>,
    /// Aggregates whose dead-letter lock a redrive holds.
    pub redrive_locks: BTreeSet<String>,
    pub slot_confirmed: Lsn,
    /// The slot's position as last saved to disk (every third move, as a
    /// checkpoint would): a database crash takes the slot back to it.
    pub slot_saved: Lsn,
    /// Where the slot was (re)created: commits before it are all visible.
    pub slot_born: Lsn,
    slot_moves: u32,
    /// PostgreSQL removed WAL the slot still needed (`wal_status = lost`).
    pub slot_lost: bool,
    /// The stream currently reading the slot.
    pub slot_active: Option<u64>,
    /// A stream whose connection dropped: it fails at its next message,
    /// in the middle of a transaction or not.
    pub cut_stream: Option<u64>,
    /// The server allows no logical replication for now (`wal_level`
    /// lowered, no free slot): a CDC start fails, a stream ends, and
    /// `source.mode = "auto"` polls until it is allowed again.
    pub cdc_blocked: bool,
    /// Auto mode's switches from polling back to CDC.
    pub switches: u32,
    next_stream: u64,
    /// The ownership lock: the holder's reign (one per acquisition).
    pub lock_reign: Option<u64>,
    next_reign: u64,
    /// The owners table's row: the last claim, and whether its owner
    /// recorded a clean stop.
    claimed: Option<u64>,
    stopped_cleanly: Option<u64>,
    pub clean_takeovers: u32,
    /// Clean stops recorded, in order.
    pub clean_stops: Vec<CleanStop>,
    /// Stops not recorded as clean: messages of this or an earlier owner
    /// may still land.
    pub unclean_stops: u32,
    /// Reign of each instance's current ownership session.
    pub reign_instance: BTreeMap<u64, usize>,
    /// Instances the schedule is stopping (SIGTERM): their sessions' end is
    /// its doing, counted there.
    pub stopping: BTreeSet<usize>,
    pub commit_notify: Arc<Notify>,
    // The broker.
    conns: BTreeMap<u64, (usize, bool)>,
    next_conn: u64,
    inflight: Vec<BrokerMsg>,
    confirms: Vec<PendingConfirm>,
    /// Per connection, topic and key, the latest due time (deliveries on
    /// one connection stay in order).
    last_due: BTreeMap<(u64, String, String), Instant>,
    pub broker_down: bool,
    /// Until then the broker takes nothing in (a pause): what is sent lands
    /// after it, in no particular order across connections.
    pub stalled_until: Option<Instant>,
    /// Instances whose broker client has no room until then: a send waits.
    pub no_room: BTreeMap<usize, Instant>,
    pub waited_for_room: u64,
    /// Instances whose broker client holds what it is given until then
    /// (see `client.rs`), and what they hold, in order.
    pub holds: BTreeMap<usize, Instant>,
    /// Of those, instances whose client holds only some partitions: those
    /// whose hash (see `client.rs`) divided by the first number leaves the
    /// second (a leader move elects partitions one by one).
    pub held_partitions: BTreeMap<usize, (u64, u64)>,
    held: Vec<ClientMsg>,
    /// Messages a client held and called back.
    pub called_back: u64,
    /// Reigns whose ownership session went silent: no statement answers.
    pub silent_reigns: BTreeSet<u64>,
    pub busy_topics: BTreeSet<String>,
    pub broker_notify: Arc<Notify>,
    // What happened.
    pub events: BTreeMap<String, EventFacts>,
    /// Per aggregate, its committed events in commit order.
    pub order: BTreeMap<String, Vec<String>>,
    pub deliveries: Vec<Delivery>,
    /// Per topic and key, the newest reign whose message landed.
    landed_reign: BTreeMap<(String, String), u64>,
    /// The latest reign that published anything.
    latest_publishing_reign: u64,
    /// Crashes, lost connections and sessions, outages, confirm timeouts:
    /// each may cause up to a window of duplicates.
    pub incidents: u32,
    /// Per incident, the first event then unconfirmed or held back whose
    /// only record is the WAL, and the deliveries made by then (see
    /// [`World::incident`]).
    pub pins: Vec<(String, usize)>,
    /// Events whose only record is the WAL, delivered, and forgotten by the
    /// slot in a database restart.
    pub repeats_forgotten: u64,
    pub violations: Vec<String>,
    pub log: VecDeque<String>,
    /// `OUTBOX_RELAY_SIM_TRACE`: notes are also logged as they happen.
    trace: bool,
}

/// Lines of history kept for a failure report.
const LOG_LINES: usize = 20_000;

impl World {
    pub fn new(
        seed: u64,
        broker_kind: BrokerKind,
        confirm_timeout: Duration,
        marks_rows: bool,
    ) -> Self {
        World {
            rng: fastrand::Rng::with_seed(seed ^ 0x5eed_0f7e_1a00_u64),
            broker_kind,
            confirm_timeout,
            marks_rows,
            progress: ranges::Progress::default(),
            next_xid: 1000,
            next_seq: 1,
            next_lsn: 0x1000,
            txs: BTreeMap::new(),
            rows: BTreeMap::new(),
            unseen: BTreeSet::new(),
            streamed_to: Lsn::default(),
            commits: Vec::new(),
            commit_pos: BTreeMap::new(),
            wal: Vec::new(),
            letters: Vec::new(),
            redrive_locks: BTreeSet::new(),
            slot_confirmed: Lsn(0x1000),
            slot_saved: Lsn(0x1000),
            slot_born: Lsn(0),
            slot_moves: 0,
            slot_lost: false,
            slot_active: None,
            cut_stream: None,
            cdc_blocked: false,
            switches: 0,
            next_stream: 1,
            lock_reign: None,
            next_reign: 1,
            claimed: None,
            stopped_cleanly: None,
            clean_takeovers: 0,
            clean_stops: Vec::new(),
            unclean_stops: 0,
            reign_instance: BTreeMap::new(),
            stopping: BTreeSet::new(),
            commit_notify: Arc::new(Notify::new()),
            conns: BTreeMap::new(),
            next_conn: 1,
            inflight: Vec::new(),
            confirms: Vec::new(),
            last_due: BTreeMap::new(),
            broker_down: false,
            stalled_until: None,
            no_room: BTreeMap::new(),
            waited_for_room: 0,
            holds: BTreeMap::new(),
            held_partitions: BTreeMap::new(),
            held: Vec::new(),
            called_back: 0,
            silent_reigns: BTreeSet::new(),
            busy_topics: BTreeSet::new(),
            broker_notify: Arc::new(Notify::new()),
            events: BTreeMap::new(),
            order: BTreeMap::new(),
            deliveries: Vec::new(),
            landed_reign: BTreeMap::new(),
            latest_publishing_reign: 0,
            incidents: 0,
            pins: Vec::new(),
            repeats_forgotten: 0,
            violations: Vec::new(),
            log: VecDeque::new(),
            trace: std::env::var("OUTBOX_RELAY_SIM_TRACE").is_ok(),
        }
    }

    pub fn note(&mut self, line: String) {
        if self.trace {
            // Between the relay's own lines, at the simulated time.
            tracing::info!(target: "sim", at = ?tokio::time::Instant::now(), "{line}");
        }
        if self.log.len() == LOG_LINES {
            self.log.pop_front();
        }
        self.log.push_back(line);
    }

    pub fn violation(&mut self, v: String) {
        self.note(format!("VIOLATION {v}"));
        self.violations.push(v);
    }

    // ----- transactions -----

    pub fn begin(&mut self) -> u64 {
        let xid = self.next_xid;
        self.next_xid += 1;
        self.txs.insert(xid, TxState::Open);
        xid
    }

    pub fn insert(
        &mut self,
        xid: u64,
        id: &str,
        aggregate: &str,
        event_type: &str,
        headers: &str,
    ) -> i64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        self.note(format!(
            "insert {id} of {aggregate} as row {seq} in xid {xid}"
        ));
        self.rows.insert(
            seq,
            Row {
                seq,
                id: id.to_owned(),
                aggregate: aggregate.to_owned(),
                event_type: event_type.to_owned(),
                headers: headers.to_owned(),
                xid,
                sent: false,
                message: false,
            },
        );
        seq
    }

    /// Like [`World::insert`], but the event is a logical message: the
    /// stream carries it, no table read sees it and nothing marks it.
    pub fn emit_message(
        &mut self,
        xid: u64,
        id: &str,
        aggregate: &str,
        event_type: &str,
        headers: &str,
    ) {
        let seq = self.insert(xid, id, aggregate, event_type, headers);
        if let Some(r) = self.rows.get_mut(&seq) {
            r.message = true;
        }
        self.note(format!("(event {id} is a logical message)"));
    }

    /// Commits: the rows become visible and the transaction enters the WAL.
    pub fn commit(&mut self, xid: u64) {
        self.txs.insert(xid, TxState::Committed);
        // One commit in four is decoded before other sessions see it; by
        // the xid, so that the schedules' random draws stay as they were.
        if xid.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 62 == 0 {
            self.unseen.insert(xid);
        }
        self.commit_pos.insert(xid, self.commits.len());
        self.commits.push(xid);
        let rows: Vec<Row> = self
            .rows
            .values()
            .filter(|r| r.xid == xid)
            .cloned()
            .collect();
        let commit_lsn = Lsn(self.next_lsn);
        self.next_lsn += 0x40;
        let end_lsn = Lsn(self.next_lsn);
        self.next_lsn += 0x10;
        for r in &rows {
            if let Some(e) = self.events.get_mut(&r.id)
                && !e.committed
            {
                e.committed = true;
                self.order
                    .entry(r.aggregate.clone())
                    .or_default()
                    .push(r.id.clone());
            }
        }
        self.note(format!(
            "commit xid {xid} at {commit_lsn}: {} rows",
            rows.len()
        ));
        self.wal.push(WalTx {
            commit_lsn,
            end_lsn,
            xid,
            rows,
            at: Instant::now(),
        });
        self.commit_notify.notify_waiters();
    }

    pub fn abort(&mut self, xid: u64) {
        self.txs.insert(xid, TxState::Aborted);
        let gone: Vec<i64> = self
            .rows
            .values()
            .filter(|r| r.xid == xid)
            .map(|r| r.seq)
            .collect();
        for seq in gone {
            if let Some(r) = self.rows.remove(&seq)
                && let Some(e) = self.events.get_mut(&r.id)
            {
                e.aborted = true;
            }
        }
        self.note(format!("abort xid {xid}"));
    }

    pub fn committed(&self, xid: u64) -> bool {
        self.txs.get(&xid) == Some(&TxState::Committed)
    }

    /// `pg_current_snapshot()`.
    pub fn snapshot(&self) -> crate::source::cdc::snapshot::Snapshot {
        let xip: Vec<u64> = self
            .txs
            .iter()
            .filter(|(_, s)| **s == TxState::Open)
            .map(|(x, _)| *x)
            .collect();
        crate::source::cdc::snapshot::Snapshot {
            xmin: xip.first().copied().unwrap_or(self.next_xid),
            xmax: self.next_xid,
            xip,
        }
    }

    /// Where the next WAL record goes.
    pub fn insert_lsn(&self) -> Lsn {
        Lsn(self.next_lsn)
    }

    /// A transaction of another table: WAL without outbox rows.
    pub fn unrelated_commit(&mut self) {
        let xid = self.begin();
        self.commit(xid);
    }

    /// The committed rows not yet marked sent.
    pub fn unsent(&self) -> impl Iterator<Item = &Row> {
        self.rows
            .values()
            .filter(|r| !r.message && self.committed(r.xid) && !self.is_sent(r))
    }

    pub fn open_letters(&self) -> impl Iterator<Item = &Letter> {
        self.letters.iter().filter(|l| l.resolution.is_none())
    }
}
