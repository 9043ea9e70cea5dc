//! The streaming half of the CDC reader: pgoutput messages in, outbox events
//! out, progress registered, status updates sent.

use super::message;
use super::progress::{CdcPosition, Progress};
use super::server::{CdcStream, StreamMessage};
use super::snapshot::StartupView;
use crate::config::{ResolvedColumns, SEQ_COLUMN, TableName};
use crate::outbox::{RawRow, RowError};
use crate::replication::Lsn;
use crate::replication::pgoutput::{
    Insert, LogicalDecodingMessage, LogicalMessage, MessageKind, Relation, RelationCache,
    TupleValue,
};
use crate::source::{SourceError, SourcedEvent};
use chrono::{DateTime, Utc};
use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use text::TextForm;
use tokio::time::Instant;

mod text;

/// Microseconds from the Unix epoch to PostgreSQL's (2000-01-01).
const PG_EPOCH_OFFSET_MICROS: i64 = 946_684_800_000_000;

/// Where each contract column sits in the outbox relation's tuples.
struct OutboxColumns {
    relation_id: u32,
    /// In [`RawRow`] order; `None` for absent optional columns.
    contract: [Option<usize>; 8],
    /// The extra and routing columns: name and position.
    extra: Vec<(String, usize)>,
    seq: Option<usize>,
    /// How many columns its tuples carry.
    width: usize,
    /// How each column's text becomes what the table read selects, by
    /// position (see [`text`]).
    forms: Vec<TextForm>,
}

struct CurrentTx {
    commit_lsn: Lsn,
    xid: u32,
    next_index: u64,
    commit_time: DateTime<Utc>,
    /// Its rows were already read from the table at start-up.
    skip: bool,
    /// A logical message of it was handed over: those are published even
    /// when its rows are skipped (the table does not hold them).
    handed_message: bool,
}

pub struct Streaming<S> {
    pub stream: S,
    relations: RelationCache,
    outbox: Option<OutboxColumns>,
    tx: Option<CurrentTx>,
    /// The start-up read's view: transactions it accounts for are skipped.
    skip: Option<StartupView>,
    /// Highest position received (the "write" position of status updates).
    received: Lsn,
    pub next_status: Instant,
    pub last_message: Instant,
    /// When the reader last stood still (the relay not taking events):
    /// messages the server sent meanwhile are still unread, so silence
    /// counts from here too.
    pub paused_at: Instant,
    warned: HashSet<MessageKind>,
    /// Rows are marked by their `relay_seq`, so the stream must carry it.
    needs_seq: bool,
    /// The prefix of the logical messages that are events, when they are on.
    messages: Option<String>,
    /// The commit LSN of the last transaction begun: each next one must
    /// come later (the progress of confirmations relies on that order).
    last_begun: Option<Lsn>,
}

/// An outbox row whose tuple the relay cannot read as it reads every row:
/// another width than its Relation said, or a column it reads sent
/// unchanged (TOAST) or in binary. Read as missing, it would go out wrong
/// (a default version, no headers) instead of being refused.
fn tuple_problem(cols: &OutboxColumns, tuple: &[TupleValue]) -> Result<(), SourceError> {
    if tuple.len() != cols.width {
        return Err(SourceError::Stream(format!(
            "an outbox row came with {} columns where its Relation message announced {}",
            tuple.len(),
            cols.width
        )));
    }
    let read = cols
        .contract
        .iter()
        .flatten()
        .chain(cols.extra.iter().map(|(_, i)| i))
        .chain(cols.seq.iter());
    for &i in read {
        let sent = match tuple.get(i) {
            Some(TupleValue::UnchangedToast) => "as an unchanged TOAST value",
            Some(TupleValue::Binary(_)) => "in binary",
            _ => continue,
        };
        return Err(SourceError::Stream(format!(
            "column {} of an outbox row came {sent}; the relay reads the text of every column it uses",
            i + 1
        )));
    }
    Ok(())
}

/// What handling one message asks of the reader.
pub enum Step {
    Continue,
    /// A transaction ended: a good moment to hand over what was read.
    Committed,
}

impl<S: CdcStream> Streaming<S> {
    pub fn new(
        stream: S,
        skip: Option<StartupView>,
        start: Lsn,
        needs_seq: bool,
        messages: Option<String>,
    ) -> Self {
        let now = Instant::now();
        Streaming {
            stream,
            relations: RelationCache::new(),
            outbox: None,
            tx: None,
            skip,
            received: start,
            next_status: now,
            last_message: now,
            paused_at: now,
            warned: HashSet::new(),
            needs_seq,
            messages,
            last_begun: None,
        }
    }

    /// Sends a status update: flushed = what [`Progress`] allows; a reply is
    /// always requested, so the server's keepalives keep coming (liveness,
    /// and the WAL end an idle slot can advance to).
    pub async fn send_status(
        &mut self,
        progress: &Mutex<Progress>,
        interval: std::time::Duration,
    ) -> Result<(), SourceError> {
        let (flushed, counted) = {
            let p = lock(progress);
            (p.flushed(), p.unreported())
        };
        let write = self.received.max(flushed);
        self.stream.send_status(write, flushed).await?;
        // Only once sent: a send cut short (the reader's select moved on)
        // leaves the report due, so the next step sends it again.
        lock(progress).reported(flushed, counted);
        self.next_status = Instant::now() + interval;
        Ok(())
    }

    /// Some events of the current transaction were handed over, and its
    /// commit is still to come.
    pub fn inside_transaction(&self) -> bool {
        self.tx
            .as_ref()
            .is_some_and(|t| (!t.skip && t.next_index > 0) || t.handed_message)
    }

    /// Handles one message from the server.
    pub fn handle(
        &mut self,
        message: StreamMessage,
        table: &TableName,
        columns: &ResolvedColumns,
        progress: &Mutex<Progress>,
        out: &mut Vec<SourcedEvent<CdcPosition>>,
    ) -> Result<(bool, Step), SourceError> {
        self.last_message = Instant::now();
        match message {
            StreamMessage::Keepalive {
                wal_end,
                reply_requested,
            } => {
                self.received = self.received.max(wal_end);
                if self.tx.is_none() {
                    lock(progress).server_end(wal_end);
                }
                Ok((reply_requested, Step::Continue))
            }
            StreamMessage::Change(message) => self
                .logical(message, table, columns, progress, out)
                .map(|s| (false, s)),
        }
    }

    fn logical(
        &mut self,
        message: LogicalMessage,
        table: &TableName,
        columns: &ResolvedColumns,
        progress: &Mutex<Progress>,
        out: &mut Vec<SourcedEvent<CdcPosition>>,
    ) -> Result<Step, SourceError> {
        match message {
            LogicalMessage::Begin(b) => {
                if self.tx.is_some() {
                    return Err(SourceError::Stream(
                        "a Begin arrived inside a transaction".into(),
                    ));
                }
                if self.last_begun.is_some_and(|last| b.final_lsn <= last) {
                    return Err(SourceError::Stream(format!(
                        "a transaction committing at {} began after one committing at {}: the server sent \
                         transactions out of commit order",
                        b.final_lsn,
                        self.last_begun.unwrap_or_default()
                    )));
                }
                self.last_begun = Some(b.final_lsn);
                let skip = self
                    .skip
                    .as_ref()
                    .is_some_and(|s| s.covers(b.xid, b.final_lsn));
                lock(progress).begin(b.final_lsn);
                let micros = b.commit_time_micros.saturating_add(PG_EPOCH_OFFSET_MICROS);
                self.tx = Some(CurrentTx {
                    commit_lsn: b.final_lsn,
                    xid: b.xid,
                    next_index: 0,
                    commit_time: DateTime::from_timestamp_micros(micros).unwrap_or_else(Utc::now),
                    skip,
                    handed_message: false,
                });
                Ok(Step::Continue)
            }
            LogicalMessage::Commit(c) => {
                let Some(tx) = &self.tx else {
                    return Err(SourceError::Stream(
                        "a Commit arrived outside a transaction".into(),
                    ));
                };
                if c.commit_lsn != tx.commit_lsn || c.end_lsn < c.commit_lsn {
                    return Err(SourceError::Stream(format!(
                        "a Commit at {} (ending at {}) closed a transaction that began saying it commits at {}",
                        c.commit_lsn, c.end_lsn, tx.commit_lsn
                    )));
                }
                lock(progress).commit(c.end_lsn);
                self.received = self.received.max(c.end_lsn);
                self.tx = None;
                if self.skip.as_ref().is_some_and(|s| c.end_lsn >= s.until) {
                    self.skip = None; // past the start-up read: nothing more to skip
                }
                Ok(Step::Committed)
            }
            LogicalMessage::Relation(r) => self.relation(r, table, columns),
            LogicalMessage::Insert(insert) => self.insert(insert, progress, out),
            LogicalMessage::Update(u) => Ok(self.ignored(MessageKind::Update, u.relation_id)),
            LogicalMessage::Delete(d) => Ok(self.ignored(MessageKind::Delete, d.relation_id)),
            LogicalMessage::Truncate(t) => {
                for id in t.relation_ids {
                    self.ignored(MessageKind::Truncate, id);
                }
                Ok(Step::Continue)
            }
            LogicalMessage::Message(m) => self.message(m, columns, progress, out),
            LogicalMessage::Origin(_) | LogicalMessage::Type(_) => Ok(Step::Continue),
        }
    }

    /// A Relation message: the outbox table's column positions are learnt
    /// (and checked) from it; every relation is cached for decoding.
    fn relation(
        &mut self,
        r: Relation,
        table: &TableName,
        columns: &ResolvedColumns,
    ) -> Result<Step, SourceError> {
        let renamed = self.outbox.as_ref().is_some_and(|o| o.relation_id == r.id)
            && (r.namespace != table.schema || r.name != table.name);
        if renamed {
            return Err(SourceError::Setup(format!(
                "the outbox table {table} is now named {}.{} on the server: rename it back, or set \
                 outbox.table (and run migrate)",
                r.namespace, r.name
            )));
        }
        if r.namespace == table.schema && r.name == table.name {
            let index = |name: &str| {
                r.column_index(name).ok_or_else(|| {
                    SourceError::Setup(format!(
                        "the replicated table {table} has no column {name:?}; check [outbox.columns] \
                         and the publication's column list (a generated column is not replicated: make it \
                         a plain column the application or a trigger fills)"
                    ))
                })
            };
            let mut contract = [None; 8];
            for (slot, name) in contract.iter_mut().zip(columns.in_row_order()) {
                if let Some(name) = name {
                    *slot = Some(index(name)?);
                }
            }
            let extra = columns
                .extra
                .iter()
                .map(|name| Ok((name.clone(), index(name)?)))
                .collect::<Result<Vec<_>, SourceError>>()?;
            let seq = r.column_index(SEQ_COLUMN);
            if seq.is_none() && self.needs_seq {
                // Without it no row could be marked sent: every one
                // would be sent again after each restart.
                return Err(SourceError::Setup(format!(
                    "the publication does not replicate {SEQ_COLUMN} of {table}, which the relay marks rows by; \
                     include it in the publication's column list (or publish all columns), or set relay.mark = \"none\""
                )));
            }
            self.outbox = Some(OutboxColumns {
                relation_id: r.id,
                contract,
                extra,
                seq,
                width: r.columns.len(),
                forms: r.columns.iter().map(|c| TextForm::of(c.type_oid)).collect(),
            });
        }
        self.relations.apply(r);
        Ok(Step::Continue)
    }

    /// An Insert: an event when it is a row of the outbox table that the
    /// start-up read did not already publish.
    fn insert(
        &mut self,
        insert: Insert,
        progress: &Mutex<Progress>,
        out: &mut Vec<SourcedEvent<CdcPosition>>,
    ) -> Result<Step, SourceError> {
        if self.relations.get(insert.relation_id).is_none() {
            return Err(SourceError::Stream(format!(
                "an Insert arrived for relation {} that no Relation message announced",
                insert.relation_id
            )));
        }
        let Some(cols) = self
            .outbox
            .as_ref()
            .filter(|c| c.relation_id == insert.relation_id)
        else {
            return Ok(Step::Continue);
        };
        tuple_problem(cols, &insert.tuple)?;
        let Some(tx) = self.tx.as_mut() else {
            return Err(SourceError::Stream(
                "an Insert arrived outside a transaction".into(),
            ));
        };
        // Counted even when skipped: an event's index is its place in
        // the transaction, the same whether or not the rows are
        // skipped, so a logical message after them keeps its position.
        let index = tx.next_index;
        tx.next_index += 1;
        if tx.skip {
            return Ok(Step::Continue);
        }
        // As the table read selects it, so that both name the same
        // aggregate, key and values.
        let text = |i: Option<usize>| match i
            .and_then(|i| Some((insert.tuple.get(i)?, cols.forms.get(i)?)))
        {
            Some((TupleValue::Text(b), form)) => Some(form.text(b)),
            _ => None,
        };
        let c = cols.contract;
        let raw = RawRow {
            id: text(c[0]),
            aggregate_type: text(c[1]),
            aggregate_id: text(c[2]),
            event_type: text(c[3]),
            event_version: text(c[4]),
            payload: text(c[5]),
            headers: text(c[6]),
            created_at: text(c[7]),
            extra: extra_object(&cols.extra, |i| text(Some(i))),
        };
        let position = CdcPosition {
            commit_lsn: tx.commit_lsn,
            index,
            seq: text(cols.seq).and_then(|s| s.parse().ok()),
            xid: Some(tx.xid),
        };
        if lock(progress).event(&position) {
            out.push(SourcedEvent::new(position, raw.decode(tx.commit_time)));
        }
        Ok(Step::Continue)
    }

    /// A logical decoding message: an event when it carries the events'
    /// prefix (see [`message`]). Unlike a row, it is never skipped as part
    /// of the start-up read: the table does not hold it.
    fn message(
        &mut self,
        m: LogicalDecodingMessage,
        columns: &ResolvedColumns,
        progress: &Mutex<Progress>,
        out: &mut Vec<SourcedEvent<CdcPosition>>,
    ) -> Result<Step, SourceError> {
        if self.messages.as_deref() != Some(m.prefix.as_str()) {
            return Ok(Step::Continue);
        }
        if !m.transactional {
            return self.untransactional(m, progress, out);
        }
        let Some(tx) = self.tx.as_mut() else {
            return Err(SourceError::Stream(
                "a transactional logical message arrived outside a transaction".into(),
            ));
        };
        let event = match message::raw_row(&m.content, &columns.extra) {
            Ok(raw) => raw.decode(tx.commit_time).map_err(|mut e| {
                e.reason = format!("logical message: {}", e.reason);
                e
            }),
            Err(why) => Err(unreadable(&m, why)),
        };
        let position = CdcPosition {
            commit_lsn: tx.commit_lsn,
            index: tx.next_index,
            seq: None,
            xid: Some(tx.xid),
        };
        tx.next_index += 1;
        if lock(progress).event(&position) {
            out.push(SourcedEvent::new(position, event));
            tx.handed_message = true;
        }
        Ok(Step::Continue)
    }

    /// A message with the events' prefix written with `transactional =
    /// false`: PostgreSQL sends it even when its transaction rolls back, so
    /// it is not published but dead-lettered (an operator may redrive it).
    /// It stands alone in the stream, as a transaction of its own.
    fn untransactional(
        &mut self,
        m: LogicalDecodingMessage,
        progress: &Mutex<Progress>,
        out: &mut Vec<SourcedEvent<CdcPosition>>,
    ) -> Result<Step, SourceError> {
        if self.tx.is_some() {
            return Err(SourceError::Stream(
                "a non-transactional logical message arrived inside a transaction".into(),
            ));
        }
        let reason = "the logical message was written with transactional = false, so it would be \
                      published even if its transaction rolled back; emit events with transactional = true"
            .to_owned();
        let error = match message::raw_row(&m.content, &[]) {
            Ok(raw) => RowError {
                id: raw.id.clone(),
                aggregate_id: raw.aggregate_id.clone(),
                reason,
                raw: Some(Box::new(raw)),
            },
            Err(why) => unreadable(&m, message::Unreadable { reason, ..why }),
        };
        // The message's LSN is where its WAL record ends, and where the
        // next record may start: the commit record of a transaction still
        // to come, whose events are placed at that LSN. So the message ends
        // there (a restart from there skips the message, which started
        // before, and not that transaction, which starts there), and is
        // placed one byte before it, where no commit record starts (they
        // start 8-byte aligned), so the two never share a place.
        let end = m.lsn;
        let at = Lsn(m.lsn.0.saturating_sub(1));
        let position = CdcPosition {
            commit_lsn: at,
            index: 0,
            seq: None,
            xid: None,
        };
        let mut p = lock(progress);
        p.begin(at);
        if p.event(&position) {
            out.push(SourcedEvent::new(position, Err(error)));
        }
        p.commit(end);
        self.received = self.received.max(end);
        Ok(Step::Committed)
    }

    /// Updates and deletes of outbox rows are not events (the publication
    /// should carry inserts only); they are reported once and ignored.
    fn ignored(&mut self, kind: MessageKind, relation_id: u32) -> Step {
        if self
            .outbox
            .as_ref()
            .is_some_and(|c| c.relation_id == relation_id)
        {
            self.warn_once(kind);
        }
        Step::Continue
    }

    fn warn_once(&mut self, kind: MessageKind) {
        if self.warned.insert(kind) {
            tracing::warn!(
                change = %kind,
                "the publication sends a {kind} of the outbox table; only inserts are events, so it is ignored (create the publication WITH (publish = 'insert'))"
            );
        }
    }
}

/// A message whose content is not an event: the reason, and its text kept as the payload.
/// The ids, where they could be read, go with it (the letter's columns).
fn unreadable(m: &LogicalDecodingMessage, why: message::Unreadable) -> RowError {
    let raw = RawRow {
        id: why.id.clone(),
        aggregate_id: why.aggregate_id.clone(),
        ..message::unreadable(&m.content)
    };
    RowError {
        id: why.id,
        aggregate_id: why.aggregate_id,
        reason: why.reason,
        raw: Some(Box::new(raw)),
    }
}

/// The extra columns as the polling query builds them: a JSON object of
/// their text values, NULL ones left out; `None` when there are none.
fn extra_object(
    extra: &[(String, usize)],
    text: impl Fn(usize) -> Option<String>,
) -> Option<String> {
    if extra.is_empty() {
        return None;
    }
    let object: serde_json::Map<String, serde_json::Value> = extra
        .iter()
        .filter_map(|(name, i)| Some((name.clone(), serde_json::Value::String(text(*i)?))))
        .collect();
    Some(serde_json::Value::Object(object).to_string())
}

/// Locks the shared progress; a poisoned lock (a panic elsewhere) still holds valid data.
pub fn lock(progress: &Mutex<Progress>) -> std::sync::MutexGuard<'_, Progress> {
    progress.lock().unwrap_or_else(|e| e.into_inner())
}

pub type SharedProgress = Arc<Mutex<Progress>>;

#[cfg(test)]
mod tests;
