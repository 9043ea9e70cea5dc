//! What the decoder reports: the kind of message it read, and why one
//! could not be decoded.

use crate::errors::ErrorKind;
use std::fmt;
use std::str::Utf8Error;

/// The kinds of pgoutput message this decoder knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MessageKind {
    Begin,
    Commit,
    Origin,
    Relation,
    Type,
    Insert,
    Update,
    Delete,
    Truncate,
    Message,
}

impl MessageKind {
    pub(super) fn from_tag(tag: u8) -> Option<Self> {
        Some(match tag {
            b'B' => MessageKind::Begin,
            b'C' => MessageKind::Commit,
            b'O' => MessageKind::Origin,
            b'R' => MessageKind::Relation,
            b'Y' => MessageKind::Type,
            b'I' => MessageKind::Insert,
            b'U' => MessageKind::Update,
            b'D' => MessageKind::Delete,
            b'T' => MessageKind::Truncate,
            b'M' => MessageKind::Message,
            _ => return None,
        })
    }
}

impl fmt::Display for MessageKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The variant names are the names the PostgreSQL docs use.
        fmt::Debug::fmt(self, f)
    }
}

/// Why a pgoutput message could not be decoded.
///
/// Every variant is permanent: the server sends the same bytes again on a retry, so the source
/// must stop and report rather than back off. Offsets count from the message's type byte.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("empty pgoutput message")]
    Empty,
    #[error(
        "unknown pgoutput message type {tag:#04x} (the streaming and two-phase messages of \
         protocol versions above 1 are not supported)"
    )]
    UnknownMessageType { tag: u8 },
    #[error(
        "{message} message truncated: {field} at offset {offset} needs {needed} bytes, \
         {available} left"
    )]
    Truncated {
        message: MessageKind,
        field: &'static str,
        offset: usize,
        needed: usize,
        available: usize,
    },
    #[error("{message} message: {field} at offset {offset} has no terminating NUL")]
    UnterminatedString {
        message: MessageKind,
        field: &'static str,
        offset: usize,
    },
    #[error("{message} message: {field} at offset {offset} is not valid UTF-8")]
    InvalidUtf8 {
        message: MessageKind,
        field: &'static str,
        offset: usize,
        #[source]
        source: Utf8Error,
    },
    #[error("{message} message: unexpected {field} {value:#04x} at offset {offset}")]
    UnexpectedByte {
        message: MessageKind,
        field: &'static str,
        offset: usize,
        value: u8,
    },
    #[error("{message} message: {count} unexpected bytes after the end, at offset {offset}")]
    TrailingBytes {
        message: MessageKind,
        offset: usize,
        count: usize,
    },
}

impl DecodeError {
    /// The server sends the same bytes again on a retry.
    pub fn kind(&self) -> ErrorKind {
        ErrorKind::Corrupt
    }
}
