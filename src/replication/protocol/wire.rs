//! Framing of backend messages over a buffered stream, and the replication sub-messages
//! carried in CopyData.
//!
//! Every frame is length-checked before any of it is trusted: a frame longer than the
//! server's own 1 GiB allocation limit is refused, and the read buffer grows only as bytes
//! actually arrive.
use super::Lsn;
use super::error::{ProtocolError, ServerError};
use bytes::{Buf, BufMut, Bytes, BytesMut};
use postgres_protocol::message::backend::Message;
use std::io;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// PostgreSQL never allocates more than `MaxAllocSize` (1 GiB - 1) for one message.
pub(super) const MAX_MESSAGE_LEN: usize = 0x3fff_ffff;
/// How much buffer space to add at a time while a frame is incomplete.
const READ_CHUNK: usize = 64 * 1024;
const COPY_BOTH_RESPONSE_TAG: u8 = b'W';
const XLOG_DATA_TAG: u8 = b'w';
const PRIMARY_KEEPALIVE_TAG: u8 = b'k';
const STANDBY_STATUS_UPDATE_TAG: u8 = b'r';
/// Seconds from the Unix epoch to PostgreSQL's, 2000-01-01 00:00:00 UTC.
const POSTGRES_EPOCH_UNIX_SECS: u64 = 946_684_800;

/// A byte stream to the server: TCP, TLS over TCP, or a Unix socket.
pub(super) trait Io: AsyncRead + AsyncWrite + Send + Unpin {}
impl<T: AsyncRead + AsyncWrite + Send + Unpin> Io for T {}

/// A message from the server.
pub(super) enum Backend {
    Message(Message),
    /// `postgres-protocol` does not know CopyBothResponse; its body (the copy format and
    /// column formats) carries nothing a replication client needs.
    CopyBothResponse,
}

/// Takes one complete message off the front of `buf`, or returns `None` (leaving `buf`
/// untouched but with room reserved) when more bytes are needed.
pub(super) fn decode(buf: &mut BytesMut) -> Result<Option<Backend>, ProtocolError> {
    let Some(&[tag, a, b, c, d]) = buf.get(..5) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([a, b, c, d]) as usize;
    if len < 4 {
        return Err(ProtocolError::Protocol(format!(
            "message {:?} declares a length of {len}, less than its own 4-byte length field",
            char::from(tag)
        )));
    }
    if len > MAX_MESSAGE_LEN {
        return Err(ProtocolError::MessageTooLarge {
            tag: char::from(tag),
            len,
        });
    }
    let total = len + 1;
    if buf.len() < total {
        buf.reserve((total - buf.len()).min(READ_CHUNK));
        return Ok(None);
    }
    if tag == COPY_BOTH_RESPONSE_TAG {
        buf.advance(total);
        return Ok(Some(Backend::CopyBothResponse));
    }
    match Message::parse(buf) {
        Ok(Some(message)) => Ok(Some(Backend::Message(message))),
        Ok(None) => Err(ProtocolError::Protocol(
            "complete message not decoded".to_owned(),
        )),
        Err(e) => Err(ProtocolError::malformed(tag, e)),
    }
}

/// A message of the replication sub-protocol, received inside CopyData
/// (<https://www.postgresql.org/docs/current/protocol-replication.html#PROTOCOL-REPLICATION-XLOGDATA>).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// WAL data; for logical replication, one message of the output plugin (`pgoutput`).
    XLogData {
        /// The position of the decoded record; for a pgoutput Commit, the end of the
        /// transaction, which is what to report as flushed once it is handled.
        wal_start: Lsn,
        /// The server's end of WAL for physical replication; logical walsenders repeat
        /// `wal_start` here.
        wal_end: Lsn,
        /// The server's clock when sending, in microseconds since 2000-01-01 UTC.
        server_time_micros: i64,
        data: Bytes,
    },
    /// A heartbeat; when `reply_requested`, answer soon with a standby status update or the
    /// server drops the connection after `wal_sender_timeout`.
    PrimaryKeepalive {
        wal_end: Lsn,
        server_time_micros: i64,
        reply_requested: bool,
    },
}

impl ReplicationMessage {
    pub(super) fn parse(mut payload: Bytes) -> Result<ReplicationMessage, ProtocolError> {
        let violation = |what: &str| ProtocolError::Protocol(format!("{what} in CopyData"));
        if payload.is_empty() {
            return Err(violation("empty message"));
        }
        match payload.get_u8() {
            XLOG_DATA_TAG if payload.len() >= 24 => Ok(ReplicationMessage::XLogData {
                wal_start: Lsn(payload.get_u64()),
                wal_end: Lsn(payload.get_u64()),
                server_time_micros: payload.get_i64(),
                data: payload,
            }),
            PRIMARY_KEEPALIVE_TAG if payload.len() == 17 => {
                Ok(ReplicationMessage::PrimaryKeepalive {
                    wal_end: Lsn(payload.get_u64()),
                    server_time_micros: payload.get_i64(),
                    reply_requested: payload.get_u8() != 0,
                })
            }
            XLOG_DATA_TAG => Err(violation("truncated XLogData header")),
            PRIMARY_KEEPALIVE_TAG => Err(violation("primary keepalive of the wrong length")),
            tag => Err(violation(&format!(
                "unknown replication message {:?}",
                char::from(tag)
            ))),
        }
    }
}

/// The body of a Standby status update (`r`), to be sent as CopyData.
pub(super) fn standby_status(write: Lsn, flush: Lsn, apply: Lsn, reply_requested: bool) -> Bytes {
    let mut body = BytesMut::with_capacity(34);
    body.put_u8(STANDBY_STATUS_UPDATE_TAG);
    body.put_u64(write.0);
    body.put_u64(flush.0);
    body.put_u64(apply.0);
    body.put_i64(postgres_now_micros(SystemTime::now()));
    body.put_u8(u8::from(reply_requested));
    body.freeze()
}

/// Microseconds since 2000-01-01 UTC, the clock of the replication protocol.
fn postgres_now_micros(now: SystemTime) -> i64 {
    let since_unix = now.duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
    let since_pg = since_unix.saturating_sub(Duration::from_secs(POSTGRES_EPOCH_UNIX_SECS));
    i64::try_from(since_pg.as_micros()).unwrap_or(i64::MAX)
}

/// A name for a message in errors about the message flow.
pub(super) fn message_name(message: &Message) -> &'static str {
    match message {
        Message::AuthenticationOk => "AuthenticationOk",
        Message::BackendKeyData(_) => "BackendKeyData",
        Message::CommandComplete(_) => "CommandComplete",
        Message::CopyData(_) => "CopyData",
        Message::CopyDone => "CopyDone",
        Message::CopyInResponse(_) => "CopyInResponse",
        Message::CopyOutResponse(_) => "CopyOutResponse",
        Message::DataRow(_) => "DataRow",
        Message::EmptyQueryResponse => "EmptyQueryResponse",
        Message::ErrorResponse(_) => "ErrorResponse",
        Message::NotificationResponse(_) => "NotificationResponse",
        Message::ParameterStatus(_) => "ParameterStatus",
        Message::ReadyForQuery(_) => "ReadyForQuery",
        Message::RowDescription(_) => "RowDescription",
        _ => "message",
    }
}

fn log_notice(notice: ServerError) {
    tracing::info!(
        severity = %notice.severity,
        code = %notice.code,
        message = %notice.message,
        "postgres notice on the replication connection"
    );
}

/// The stream and its two buffers. Reads are cancel-safe because bytes only ever move from
/// the socket into `read_buf`, and a message leaves `read_buf` only once it is complete.
/// Writes are queued whole into `write_buf` and drained from its front, so a cancelled flush
/// leaves the rest queued for the next one.
pub(super) struct Connection {
    io: Box<dyn Io>,
    read_buf: BytesMut,
    write_buf: BytesMut,
}

impl Connection {
    pub(super) fn new(io: Box<dyn Io>) -> Connection {
        Connection {
            io,
            read_buf: BytesMut::with_capacity(READ_CHUNK),
            write_buf: BytesMut::new(),
        }
    }

    /// The next message, with ErrorResponse left to the caller and notices logged. Cancel-safe.
    pub(super) async fn read(&mut self) -> Result<Backend, ProtocolError> {
        loop {
            match decode(&mut self.read_buf)? {
                Some(Backend::Message(Message::NoticeResponse(body))) => {
                    log_notice(ServerError::parse(body.fields())?);
                    continue;
                }
                Some(message) => return Ok(message),
                None => {}
            }
            if self.read_buf.capacity() == self.read_buf.len() {
                self.read_buf.reserve(READ_CHUNK);
            }
            let read = self
                .io
                .read_buf(&mut self.read_buf)
                .await
                .map_err(ProtocolError::Io)?;
            if read == 0 {
                return Err(ProtocolError::Closed);
            }
        }
    }

    /// The next message, with ErrorResponse turned into [`ProtocolError::Server`]. Cancel-safe.
    pub(super) async fn read_ok(&mut self) -> Result<Message, ProtocolError> {
        match self.read().await? {
            Backend::Message(Message::ErrorResponse(body)) => {
                Err(ProtocolError::Server(ServerError::parse(body.fields())?))
            }
            Backend::Message(message) => Ok(message),
            Backend::CopyBothResponse => Err(ProtocolError::Protocol(
                "unexpected CopyBothResponse".to_owned(),
            )),
        }
    }

    /// Appends one frontend message to the write queue; nothing of it is kept if encoding
    /// fails (e.g. a NUL byte in a string).
    pub(super) fn queue(
        &mut self,
        encode: impl FnOnce(&mut BytesMut) -> io::Result<()>,
    ) -> Result<(), ProtocolError> {
        let start = self.write_buf.len();
        encode(&mut self.write_buf).map_err(|e| {
            self.write_buf.truncate(start);
            ProtocolError::Protocol(format!("cannot encode message: {e}"))
        })
    }

    /// Sends everything queued. Not cancel-safe on its own, but a cancelled flush loses
    /// nothing: what was not written stays queued for the next flush.
    pub(super) async fn flush(&mut self) -> Result<(), ProtocolError> {
        while !self.write_buf.is_empty() {
            let written = self
                .io
                .write(&self.write_buf)
                .await
                .map_err(ProtocolError::Io)?;
            if written == 0 {
                return Err(ProtocolError::Closed);
            }
            self.write_buf.advance(written);
        }
        self.io.flush().await.map_err(ProtocolError::Io)
    }

    /// Closes the write side after sending what is queued.
    pub(super) async fn shutdown(&mut self) -> Result<(), ProtocolError> {
        self.flush().await?;
        self.io.shutdown().await.map_err(ProtocolError::Io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(tag: u8, body: &[u8]) -> BytesMut {
        let mut buf = BytesMut::new();
        buf.put_u8(tag);
        buf.put_u32(u32::try_from(body.len() + 4).expect("small body"));
        buf.put_slice(body);
        buf
    }

    #[test]
    fn waits_for_a_whole_frame_then_takes_exactly_it() {
        let mut whole = frame(b'Z', b"I");
        whole.extend_from_slice(&frame(b'c', b""));
        for cut in 0..6 {
            let mut partial = BytesMut::from(&whole[..cut]);
            assert!(decode(&mut partial).expect("valid prefix").is_none());
            assert_eq!(partial.len(), cut, "an incomplete frame is left in place");
        }
        let first = decode(&mut whole).expect("valid").expect("complete");
        assert!(matches!(first, Backend::Message(Message::ReadyForQuery(_))));
        let second = decode(&mut whole).expect("valid").expect("complete");
        assert!(matches!(second, Backend::Message(Message::CopyDone)));
        assert!(whole.is_empty());
    }

    #[test]
    fn refuses_short_and_oversized_lengths_without_allocating() {
        let mut short = BytesMut::from(&[b'd', 0, 0, 0, 3][..]);
        assert!(matches!(
            decode(&mut short),
            Err(ProtocolError::Protocol(_))
        ));

        let mut huge = BytesMut::from(&[b'd', 0x7f, 0xff, 0xff, 0xff][..]);
        assert!(matches!(
            decode(&mut huge),
            Err(ProtocolError::MessageTooLarge { tag: 'd', .. })
        ));

        let mut big_but_allowed = BytesMut::from(&[b'd', 0x3f, 0xff, 0xff, 0xff][..]);
        assert!(decode(&mut big_but_allowed).expect("allowed").is_none());
        assert!(big_but_allowed.capacity() <= 5 + READ_CHUNK + 64);
    }

    #[test]
    fn garbage_never_panics() {
        // A fixed xorshift sequence: deterministic, and covers every tag byte.
        let mut state: u32 = 0x9e37_79b9;
        for _ in 0..20_000 {
            let mut buf = BytesMut::new();
            let len = (state % 40) as usize;
            for _ in 0..len {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                buf.put_u8(state.to_le_bytes()[0]);
            }
            if buf.len() >= 5 {
                // Keep the declared length plausible so bodies get parsed too.
                let body = u32::try_from(buf.len() - 1).expect("small");
                buf[1..5].copy_from_slice(&body.to_be_bytes());
            }
            let _ = decode(&mut buf);
            let _ = ReplicationMessage::parse(Bytes::copy_from_slice(&buf));
        }
    }

    #[test]
    fn parses_xlogdata_and_keepalive() {
        let mut xlog = BytesMut::new();
        xlog.put_u8(b'w');
        xlog.put_u64(0x16_0000_0010);
        xlog.put_u64(0x16_0000_0020);
        xlog.put_i64(42);
        xlog.put_slice(b"Bpayload");
        assert_eq!(
            ReplicationMessage::parse(xlog.freeze()).expect("valid"),
            ReplicationMessage::XLogData {
                wal_start: Lsn(0x16_0000_0010),
                wal_end: Lsn(0x16_0000_0020),
                server_time_micros: 42,
                data: Bytes::from_static(b"Bpayload"),
            }
        );

        let mut keepalive = BytesMut::new();
        keepalive.put_u8(b'k');
        keepalive.put_u64(7);
        keepalive.put_i64(-1);
        keepalive.put_u8(1);
        let keepalive = keepalive.freeze();
        assert_eq!(
            ReplicationMessage::parse(keepalive.clone()).expect("valid"),
            ReplicationMessage::PrimaryKeepalive {
                wal_end: Lsn(7),
                server_time_micros: -1,
                reply_requested: true,
            }
        );
        for cut in 0..keepalive.len() {
            assert!(ReplicationMessage::parse(keepalive.slice(..cut)).is_err());
        }
        assert!(ReplicationMessage::parse(Bytes::from_static(b"x123")).is_err());
        assert!(ReplicationMessage::parse(Bytes::from_static(b"w")).is_err());
    }

    #[test]
    fn encodes_standby_status_with_the_postgres_clock() {
        let body = standby_status(Lsn(1), Lsn(2), Lsn(3), true);
        assert_eq!(body.len(), 34);
        assert_eq!(body[0], b'r');
        assert_eq!(&body[1..9], &1u64.to_be_bytes());
        assert_eq!(&body[9..17], &2u64.to_be_bytes());
        assert_eq!(&body[17..25], &3u64.to_be_bytes());
        assert_eq!(body[33], 1);

        let y2k = UNIX_EPOCH + Duration::from_secs(POSTGRES_EPOCH_UNIX_SECS);
        assert_eq!(postgres_now_micros(y2k + Duration::from_micros(5)), 5);
        assert_eq!(postgres_now_micros(UNIX_EPOCH), 0);
    }
}
