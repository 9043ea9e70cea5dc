//! Sources: where events come from, and how progress is recorded.
//!
//! # The contract
//!
//! A [`Reader`] yields committed events in an order that keeps each
//! aggregate's events in commit order, and never an event of a rolled-back
//! transaction. It does not remember what it handed out as done: only the
//! [`Acker`] records progress (marks rows sent, or reports a WAL position as
//! flushed), and the relay calls it only with positions whose messages the
//! broker confirmed. Anything read but not acknowledged is read again after a
//! [`Reader::rewind`] or a restart, which is where duplicates come from, and
//! the only place.

pub mod auto;
pub mod budget;
pub mod cdc;
pub mod polling;
pub mod record;

use record::RowStore;
pub(crate) mod rows;

use crate::db::DbError;
use crate::errors::ErrorKind;
use crate::outbox::{OutboxEvent, RowError};
use std::fmt::Debug;
use std::future::Future;
use std::hash::Hash;

/// One row from the source: its position, and the event or why it is unusable.
#[derive(Debug)]
pub struct SourcedEvent<P> {
    pub position: P,
    pub event: Result<OutboxEvent, RowError>,
    /// The memory it holds against the pipeline's budget (none until the
    /// reader task charges it).
    pub charge: budget::Charge,
}

/// What [`SourcedEvent::bytes`] counts for an event beside its text.
pub(crate) const EVENT_OVERHEAD: usize = 256;

impl<P> SourcedEvent<P> {
    pub fn new(position: P, event: Result<OutboxEvent, RowError>) -> Self {
        SourcedEvent {
            position,
            event,
            charge: budget::Charge::default(),
        }
    }

    /// About how much memory the event holds: its text, mostly the payload.
    pub fn bytes(&self) -> usize {
        EVENT_OVERHEAD
            + match &self.event {
                Ok(e) => {
                    e.payload.get().len()
                        + e.id.len()
                        + e.aggregate_type.len()
                        + e.aggregate_id.len()
                        + e.event_type.len()
                        + e.headers
                            .iter()
                            .chain(&e.extra)
                            .map(|(k, v)| k.len() + v.len())
                            .sum::<usize>()
                }
                Err(e) => e.reason.len() + e.raw.as_ref().map_or(0, |r| r.text_len()),
            }
    }

    /// The aggregate the row belongs to, when it could be read at all. Rows
    /// without one are scheduled under the empty key.
    pub fn aggregate_id(&self) -> &str {
        match &self.event {
            Ok(e) => &e.aggregate_id,
            Err(e) => e.aggregate_id.as_deref().unwrap_or(""),
        }
    }
}

/// Why a source failed.
#[derive(Debug, thiserror::Error)]
pub enum SourceError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error(transparent)]
    Table(#[from] crate::outbox::inspect::TableProblem),
    /// The replication connection failed.
    #[error("replication: {0}")]
    Replication(#[from] crate::replication::protocol::ProtocolError),
    /// The server sent a message the decoder cannot read.
    #[error("replication stream: {0}")]
    Decode(#[from] crate::replication::pgoutput::DecodeError),
    /// The stream stalled or ended; reconnecting helps.
    #[error("{0}")]
    Stream(String),
    /// Another process streams from the slot (SQLSTATE 55006): wait as a standby.
    #[error("replication slot {0:?} is in use by another process; waiting for it to be released")]
    SlotBusy(String),
    /// Slot, publication or server settings need an operator; the message says what to do.
    #[error("{0}")]
    Setup(String),
}

impl SourceError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            SourceError::Db(e) => e.kind(),
            SourceError::Table(e) => e.kind(),
            SourceError::Replication(e) => e.kind(),
            SourceError::Decode(e) => e.kind(),
            SourceError::Stream(_) | SourceError::SlotBusy(_) => ErrorKind::Transient,
            SourceError::Setup(_) => ErrorKind::NeedsOperator,
        }
    }
}

/// A position that may name an outbox row.
pub trait RowPosition {
    /// The row's `relay_seq`, when the position names one.
    fn seq(&self) -> Option<i64>;

    /// The event's place in the WAL (commit LSN, index), for events read
    /// from a replication stream.
    fn wal(&self) -> Option<(crate::replication::Lsn, u64)> {
        None
    }
}

impl RowPosition for i64 {
    fn seq(&self) -> Option<i64> {
        Some(*self)
    }
}

/// Reads events. See the module docs for the contract.
pub trait Reader: Send + 'static {
    type Position: Clone + Debug + Eq + Hash + Send + Sync + RowPosition + 'static;

    /// Waits until events are available and returns up to `max` of them, in
    /// order, each while the rows before it take less than `max_bytes`
    /// (so at least one event, however large, and the last may pass the
    /// room). A batch with no events says that a transaction the last batch
    /// ended inside of is whole (see [`Reader::inside_transaction`]).
    ///
    /// Cancel-safe: state changes only once a read completes, so a dropped call
    /// loses nothing.
    fn next_batch(
        &mut self,
        max: usize,
        max_bytes: usize,
    ) -> impl Future<Output = Result<Vec<SourcedEvent<Self::Position>>, SourceError>> + Send;

    /// Forgets what was read; the next batch starts again from what is not yet
    /// acknowledged, in order.
    fn rewind(&mut self);

    /// Whether the last batch ended inside a transaction whose other events
    /// come in the next batches, where the WAL is the only record of them:
    /// such a transaction is done only once all its events are, so a stop
    /// reads on to its end, so that what it sent can be reported done.
    fn inside_transaction(&self) -> bool {
        false
    }

    /// Runs while the relay is not asking for events (backpressure); it never
    /// completes unless it fails. The CDC reader sends status updates here so
    /// the server keeps the connection while the stream is not being read.
    fn maintain(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send {
        std::future::pending()
    }

    /// Ends the reader after a clean run: the CDC reader reports its final
    /// flushed position, so a restart does not replay what was confirmed.
    fn close(self) -> impl Future<Output = ()> + Send
    where
        Self: Sized,
    {
        async {}
    }
}

/// Records progress. Called only with positions whose messages the broker confirmed.
pub trait Acker: Send + 'static {
    type Position: Send + Sync + 'static;
    /// The ownership session's record: dead letters, redrive requests, heartbeats.
    type Store: RowStore;

    /// The record the dead-letter calls below go to.
    fn store(&self) -> &Self::Store;

    fn ack(
        &mut self,
        positions: Vec<Self::Position>,
    ) -> impl Future<Output = Result<(), SourceError>> + Send;

    /// Moves events to the dead-letter table; their positions then count as
    /// done. Returns the aggregates found to have no open dead letter any
    /// more (their followers were not written: the relay publishes them).
    fn dead_letter(
        &mut self,
        letters: Vec<crate::dead_letter::DeadLetter<Self::Position>>,
    ) -> impl Future<Output = Result<std::collections::HashSet<String>, SourceError>> + Send;

    /// Aggregates with a dead letter nobody redrove or dropped yet, and
    /// where the first one is.
    fn open_dead_letters(
        &mut self,
    ) -> impl Future<Output = Result<crate::dead_letter::OpenLetters, SourceError>> + Send {
        self.store().open_dead_letters()
    }

    /// Dead letters an operator asked to publish again, oldest first (see
    /// [`crate::dead_letter`]).
    fn requested_letters(
        &mut self,
        max_bytes: usize,
    ) -> impl Future<Output = Result<crate::dead_letter::Requests, SourceError>> + Send {
        self.store().requested_letters(max_bytes)
    }

    /// The broker confirmed these redriven letters: they are done.
    fn letters_sent(
        &mut self,
        ids: Vec<i64>,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        let store = self.store();
        async move { store.letters_sent(&ids).await }
    }

    /// The broker refused a redriven letter again.
    fn letter_refused(
        &mut self,
        id: i64,
        reason: String,
        counts: bool,
    ) -> impl Future<Output = Result<(), SourceError>> + Send {
        let store = self.store();
        async move { store.letter_refused(id, &reason, counts).await }
    }

    /// Events the relay leaves unsent in the source for now (their aggregate
    /// is held back): a source that can read them again from a durable
    /// record (rows are marked, so the table keeps them unsent) need not
    /// hold its progress back for them; the others keep them pending.
    fn release(&mut self, positions: Vec<Self::Position>) {
        let _ = positions;
    }

    /// One round trip on the ownership session: fails when the acker can no
    /// longer record progress (its connection, and with it ownership, is
    /// gone). Its success renews the ownership lease.
    fn heartbeat(&mut self) -> impl Future<Output = Result<(), SourceError>> + Send {
        self.store().heartbeat()
    }
}
