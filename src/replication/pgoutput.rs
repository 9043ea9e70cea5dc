//! Decoder for the messages of the `pgoutput` logical decoding plugin, protocol version 1.
//!
//! [`decode`] turns the payload of one XLogData message into a [`LogicalMessage`]; it keeps no
//! state. The CDC source starts replication with `proto_version '1'` and `messages 'true'`, so the
//! streaming messages and the extra transaction-id fields of protocol version 2 and later never
//! arrive and are rejected as unknown. Relation messages precede the first change of each table
//! (and follow any schema change), so the caller keeps a [`RelationCache`] to name the columns
//! of the tuples that follow.
//!
//! The decoder trusts nothing: every read is length-checked, strings must be NUL-terminated
//! UTF-8, counts never size an allocation beyond what the remaining bytes could hold, and bytes
//! left over after a complete message are an error. Column values are zero-copy slices of the
//! input [`Bytes`].
//!
//! Format reference:
//! <https://www.postgresql.org/docs/15/protocol-logicalrep-message-formats.html>

use std::collections::HashMap;

use bytes::Bytes;

use super::Lsn;

mod error;

pub use error::{DecodeError, MessageKind};

/// One decoded pgoutput message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogicalMessage {
    Begin(Begin),
    Commit(Commit),
    Origin(Origin),
    Relation(Relation),
    Type(TypeMessage),
    Insert(Insert),
    Update(Update),
    Delete(Delete),
    Truncate(Truncate),
    Message(LogicalDecodingMessage),
}

impl LogicalMessage {
    /// Which kind of message this is, for logs and metrics labels.
    pub fn kind(&self) -> MessageKind {
        match self {
            LogicalMessage::Begin(_) => MessageKind::Begin,
            LogicalMessage::Commit(_) => MessageKind::Commit,
            LogicalMessage::Origin(_) => MessageKind::Origin,
            LogicalMessage::Relation(_) => MessageKind::Relation,
            LogicalMessage::Type(_) => MessageKind::Type,
            LogicalMessage::Insert(_) => MessageKind::Insert,
            LogicalMessage::Update(_) => MessageKind::Update,
            LogicalMessage::Delete(_) => MessageKind::Delete,
            LogicalMessage::Truncate(_) => MessageKind::Truncate,
            LogicalMessage::Message(_) => MessageKind::Message,
        }
    }
}

/// The start of a transaction; its changes follow, then a [`Commit`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Begin {
    /// The LSN of the transaction's commit record.
    pub final_lsn: Lsn,
    /// Commit time in microseconds since 2000-01-01 00:00:00 UTC (PostgreSQL's epoch).
    pub commit_time_micros: i64,
    pub xid: u32,
}

/// The end of a transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Commit {
    /// Unused by PostgreSQL so far; kept so that a future meaning is not silently lost.
    pub flags: u8,
    /// The LSN of the commit record (equal to the [`Begin::final_lsn`]).
    pub commit_lsn: Lsn,
    /// The LSN just past the commit record: the position to acknowledge once the transaction's
    /// changes are durable downstream.
    pub end_lsn: Lsn,
    /// Commit time in microseconds since 2000-01-01 00:00:00 UTC.
    pub commit_time_micros: i64,
}

/// The replication origin of the current transaction (sent when it was replayed from elsewhere).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Origin {
    /// The LSN of the commit on the origin server.
    pub commit_lsn: Lsn,
    pub name: String,
}

/// The shape of a table, sent before its first change and again after it changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Relation {
    /// The table's OID; changes refer to the table by it.
    pub id: u32,
    /// The schema; PostgreSQL sends an empty string for `pg_catalog`.
    pub namespace: String,
    pub name: String,
    /// `REPLICA IDENTITY`: `b'd'` default (primary key), `b'n'` nothing, `b'f'` full,
    /// `b'i'` index.
    pub replica_identity: u8,
    /// The published columns in tuple order (dropped and generated columns are left out).
    pub columns: Vec<RelationColumn>,
}

/// One column of a [`Relation`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RelationColumn {
    /// 1 when the column is part of the replica identity key, else 0.
    pub flags: u8,
    pub name: String,
    pub type_oid: u32,
    /// The type modifier (`atttypmod`), -1 when there is none.
    pub type_modifier: i32,
}

impl RelationColumn {
    /// Whether the column is part of the replica identity key.
    pub fn is_key(&self) -> bool {
        self.flags & 1 != 0
    }
}

impl Relation {
    /// The position of the column named `name` in this relation's tuples.
    pub fn column_index(&self, name: &str) -> Option<usize> {
        self.columns.iter().position(|column| column.name == name)
    }

    /// The value of the column named `name` in `tuple`, a tuple of this relation.
    ///
    /// `None` when the relation has no such column or the tuple is shorter than the relation.
    pub fn column_value<'t>(&self, tuple: &'t [TupleValue], name: &str) -> Option<&'t TupleValue> {
        tuple.get(self.column_index(name)?)
    }
}

/// A user-defined data type used by a published column (built-in types are never sent).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TypeMessage {
    pub id: u32,
    pub namespace: String,
    pub name: String,
}

/// One column value of a tuple.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TupleValue {
    Null,
    /// A TOASTed value that the change did not touch; its content is not sent.
    UnchangedToast,
    /// The type's text output, in the replication connection's `client_encoding`.
    Text(Bytes),
    /// The type's binary send format (only with the `binary` option).
    Binary(Bytes),
}

/// The old row of an [`Update`] or [`Delete`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OldTuple {
    /// Only the replica identity key columns carry values; the others are [`TupleValue::Null`].
    Key(Vec<TupleValue>),
    /// The whole old row (`REPLICA IDENTITY FULL`).
    Full(Vec<TupleValue>),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Insert {
    pub relation_id: u32,
    pub tuple: Vec<TupleValue>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Update {
    pub relation_id: u32,
    /// Present when the key changed (`Key`) or the table has `REPLICA IDENTITY FULL` (`Full`).
    pub old: Option<OldTuple>,
    pub new: Vec<TupleValue>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delete {
    pub relation_id: u32,
    pub old: OldTuple,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Truncate {
    /// Bit 1: `CASCADE`; bit 2: `RESTART IDENTITY`.
    pub options: u8,
    pub relation_ids: Vec<u32>,
}

impl Truncate {
    pub fn cascade(&self) -> bool {
        self.options & 1 != 0
    }

    pub fn restart_identity(&self) -> bool {
        self.options & 2 != 0
    }
}

/// A message written with `pg_logical_emit_message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogicalDecodingMessage {
    /// A transactional message arrives between the Begin and Commit of its transaction; a
    /// non-transactional one arrives on its own, even if its transaction later aborts.
    pub transactional: bool,
    pub lsn: Lsn,
    pub prefix: String,
    pub content: Bytes,
}

/// Decodes the payload of one XLogData message (everything after its 25-byte header).
pub fn decode(buf: Bytes) -> Result<LogicalMessage, DecodeError> {
    let tag = *buf.first().ok_or(DecodeError::Empty)?;
    let kind = MessageKind::from_tag(tag).ok_or(DecodeError::UnknownMessageType { tag })?;
    let mut r = Reader {
        buf,
        pos: 1,
        message: kind,
    };
    let message = match kind {
        MessageKind::Begin => LogicalMessage::Begin(Begin {
            final_lsn: r.lsn("final LSN")?,
            commit_time_micros: r.i64("commit timestamp")?,
            xid: r.u32("xid")?,
        }),
        MessageKind::Commit => LogicalMessage::Commit(Commit {
            flags: r.u8("flags")?,
            commit_lsn: r.lsn("commit LSN")?,
            end_lsn: r.lsn("end LSN")?,
            commit_time_micros: r.i64("commit timestamp")?,
        }),
        MessageKind::Origin => LogicalMessage::Origin(Origin {
            commit_lsn: r.lsn("origin commit LSN")?,
            name: r.string("origin name")?,
        }),
        MessageKind::Relation => LogicalMessage::Relation(relation(&mut r)?),
        MessageKind::Type => LogicalMessage::Type(TypeMessage {
            id: r.u32("type OID")?,
            namespace: r.string("namespace")?,
            name: r.string("type name")?,
        }),
        MessageKind::Insert => {
            let relation_id = r.u32("relation id")?;
            r.expect_byte(b'N', "new tuple marker")?;
            LogicalMessage::Insert(Insert {
                relation_id,
                tuple: r.tuple()?,
            })
        }
        MessageKind::Update => LogicalMessage::Update(update(&mut r)?),
        MessageKind::Delete => LogicalMessage::Delete(Delete {
            relation_id: r.u32("relation id")?,
            old: r.old_tuple("old tuple marker")?,
        }),
        MessageKind::Truncate => LogicalMessage::Truncate(truncate(&mut r)?),
        MessageKind::Message => LogicalMessage::Message(logical_decoding_message(&mut r)?),
    };
    r.finish()?;
    Ok(message)
}

/// Smallest encoding of a relation column: flags, an empty name's NUL, type OID, type modifier.
const MIN_RELATION_COLUMN_LEN: usize = 1 + 1 + 4 + 4;

// Struct fields are evaluated in the order written, which is the order on the wire.

fn relation(r: &mut Reader) -> Result<Relation, DecodeError> {
    Ok(Relation {
        id: r.u32("relation id")?,
        namespace: r.string("namespace")?,
        name: r.string("relation name")?,
        replica_identity: r.u8("replica identity")?,
        columns: {
            let count = r.u16("column count")?;
            let mut columns =
                Vec::with_capacity(r.capacity_for(count.into(), MIN_RELATION_COLUMN_LEN));
            for _ in 0..count {
                columns.push(RelationColumn {
                    flags: r.u8("column flags")?,
                    name: r.string("column name")?,
                    type_oid: r.u32("column type OID")?,
                    type_modifier: r.i32("column type modifier")?,
                });
            }
            columns
        },
    })
}

fn update(r: &mut Reader) -> Result<Update, DecodeError> {
    Ok(Update {
        relation_id: r.u32("relation id")?,
        // The old tuple is optional: without one the new tuple's marker comes right away.
        old: match r.buf.get(r.pos) {
            Some(b'N') => None,
            _ => Some(r.old_tuple("old tuple marker")?),
        },
        new: {
            r.expect_byte(b'N', "new tuple marker")?;
            r.tuple()?
        },
    })
}

fn truncate(r: &mut Reader) -> Result<Truncate, DecodeError> {
    let count = r.u32("relation count")?;
    let options = r.u8("options")?;
    // A count beyond usize can only be hostile; the loop then fails on the first missing id.
    let count = usize::try_from(count).unwrap_or(usize::MAX);
    let mut relation_ids = Vec::with_capacity(r.capacity_for(count, 4));
    for _ in 0..count {
        relation_ids.push(r.u32("relation id")?);
    }
    Ok(Truncate {
        options,
        relation_ids,
    })
}

fn logical_decoding_message(r: &mut Reader) -> Result<LogicalDecodingMessage, DecodeError> {
    let flags_offset = r.pos;
    Ok(LogicalDecodingMessage {
        transactional: match r.u8("flags")? {
            0 => false,
            1 => true,
            value => return Err(r.unexpected("flags", flags_offset, value)),
        },
        lsn: r.lsn("LSN")?,
        prefix: r.string("prefix")?,
        content: {
            let len = r.u32("content length")?;
            r.bytes(len, "content")?
        },
    })
}

/// A cursor over one message that reports errors with the message kind, field and offset.
struct Reader {
    buf: Bytes,
    pos: usize,
    message: MessageKind,
}

impl Reader {
    fn remaining(&self) -> usize {
        self.buf.len().saturating_sub(self.pos)
    }

    /// How many items to pre-allocate for `count` items of at least `min_len` bytes each: no
    /// more than the rest of the message could hold, whatever a hostile count says.
    fn capacity_for(&self, count: usize, min_len: usize) -> usize {
        count.min(self.remaining() / min_len.max(1))
    }

    fn truncated(&self, field: &'static str, needed: usize) -> DecodeError {
        DecodeError::Truncated {
            message: self.message,
            field,
            offset: self.pos,
            needed,
            available: self.remaining(),
        }
    }

    fn unexpected(&self, field: &'static str, offset: usize, value: u8) -> DecodeError {
        DecodeError::UnexpectedByte {
            message: self.message,
            field,
            offset,
            value,
        }
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], DecodeError> {
        let bytes = self
            .buf
            .get(self.pos..)
            .and_then(|rest| rest.first_chunk::<N>())
            .copied()
            .ok_or_else(|| self.truncated(field, N))?;
        self.pos += N;
        Ok(bytes)
    }

    fn u8(&mut self, field: &'static str) -> Result<u8, DecodeError> {
        Ok(u8::from_be_bytes(self.array(field)?))
    }

    fn u16(&mut self, field: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }

    fn u32(&mut self, field: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }

    fn i32(&mut self, field: &'static str) -> Result<i32, DecodeError> {
        Ok(i32::from_be_bytes(self.array(field)?))
    }

    fn i64(&mut self, field: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_be_bytes(self.array(field)?))
    }

    fn lsn(&mut self, field: &'static str) -> Result<Lsn, DecodeError> {
        Ok(Lsn(u64::from_be_bytes(self.array(field)?)))
    }

    fn expect_byte(&mut self, expected: u8, field: &'static str) -> Result<(), DecodeError> {
        let offset = self.pos;
        match self.u8(field)? {
            value if value == expected => Ok(()),
            value => Err(self.unexpected(field, offset, value)),
        }
    }

    /// `len` bytes as a zero-copy slice of the message.
    fn bytes(&mut self, len: u32, field: &'static str) -> Result<Bytes, DecodeError> {
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > self.remaining() {
            return Err(self.truncated(field, len));
        }
        let end = self.pos + len;
        let bytes = self.buf.slice(self.pos..end);
        self.pos = end;
        Ok(bytes)
    }

    fn string(&mut self, field: &'static str) -> Result<String, DecodeError> {
        let offset = self.pos;
        let rest = self.buf.get(offset..).unwrap_or_default();
        let len = rest
            .iter()
            .position(|&b| b == 0)
            .ok_or(DecodeError::UnterminatedString {
                message: self.message,
                field,
                offset,
            })?;
        let text = rest.get(..len).unwrap_or_default();
        let text = std::str::from_utf8(text).map_err(|source| DecodeError::InvalidUtf8 {
            message: self.message,
            field,
            offset,
            source,
        })?;
        self.pos = offset + len + 1;
        Ok(text.to_owned())
    }

    /// A `K` (key columns only) or `O` (whole row) marker and the TupleData after it.
    fn old_tuple(&mut self, field: &'static str) -> Result<OldTuple, DecodeError> {
        let offset = self.pos;
        match self.u8(field)? {
            b'K' => Ok(OldTuple::Key(self.tuple()?)),
            b'O' => Ok(OldTuple::Full(self.tuple()?)),
            value => Err(self.unexpected(field, offset, value)),
        }
    }

    fn tuple(&mut self) -> Result<Vec<TupleValue>, DecodeError> {
        let count = self.u16("tuple column count")?;
        // Each column takes at least its one-byte kind.
        let mut values = Vec::with_capacity(self.capacity_for(count.into(), 1));
        for _ in 0..count {
            let offset = self.pos;
            let value = match self.u8("tuple column kind")? {
                b'n' => TupleValue::Null,
                b'u' => TupleValue::UnchangedToast,
                b't' => {
                    let len = self.u32("text value length")?;
                    TupleValue::Text(self.bytes(len, "text value")?)
                }
                b'b' => {
                    let len = self.u32("binary value length")?;
                    TupleValue::Binary(self.bytes(len, "binary value")?)
                }
                kind => return Err(self.unexpected("tuple column kind", offset, kind)),
            };
            values.push(value);
        }
        Ok(values)
    }

    fn finish(&self) -> Result<(), DecodeError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(DecodeError::TrailingBytes {
                message: self.message,
                offset: self.pos,
                count,
            }),
        }
    }
}

/// The latest [`Relation`] of each table seen on the stream, to interpret the tuples of later
/// changes.
///
/// PostgreSQL sends a table's Relation message again before its first change after anything
/// may have altered the definition, so replacing the entry is all it takes to stay current. The cache lives as long as one replication session: a new session starts empty,
/// because the server resends every Relation it needs.
#[derive(Debug, Default)]
pub struct RelationCache {
    relations: HashMap<u32, Relation>,
}

impl RelationCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Stores `relation`, returning the definition it replaces, if any.
    pub fn apply(&mut self, relation: Relation) -> Option<Relation> {
        self.relations.insert(relation.id, relation)
    }

    pub fn get(&self, relation_id: u32) -> Option<&Relation> {
        self.relations.get(&relation_id)
    }
}

#[cfg(test)]
mod tests;
