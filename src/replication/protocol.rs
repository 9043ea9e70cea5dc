//! A replication-mode connection to PostgreSQL: the CDC source's wire client.
//!
//! `tokio-postgres` cannot open a connection with `replication=database`, so this client
//! speaks the protocol itself with `postgres-protocol`'s message codecs over a tokio TCP, TLS
//! or Unix stream. It is deliberately small:
//!
//! - [`ReplicationClient::connect`] negotiates TLS per `database.sslmode` (TLS is shared with
//!   the ordinary connection through [`crate::db::tls`]) and authenticates with trust,
//!   password, md5 or SCRAM-SHA-256 (channel-bound over TLS).
//! - Only the simple query protocol is used, as walsenders accept no other
//!   (<https://www.postgresql.org/docs/current/protocol-replication.html>).
//! - `START_REPLICATION` switches the connection to copy-both mode
//!   (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-FLOW-COPY>); the
//!   [`ReplicationStream`] then reads XLogData and keepalives and writes standby status
//!   updates, all inside CopyData
//!   (<https://www.postgresql.org/docs/current/protocol-message-formats.html>).
//!
//! Reading is cancel-safe: bytes move from the socket into a buffer owned by the connection,
//! and a message leaves the buffer only once complete, so a dropped `next()` loses nothing.
//! Every frame is length-checked (at most 1 GiB, the server's own limit) and malformed input is
//! a [`ProtocolError`], never a panic.
mod error;
mod startup;
mod wire;

pub use error::{ProtocolError, ServerError};
pub use startup::DEFAULT_CONNECT_TIMEOUT;
pub use wire::ReplicationMessage;

use super::Lsn;
use crate::config::TlsOptions;
use postgres_protocol::message::backend::{DataRowBody, Message};
use postgres_protocol::message::frontend;
use tokio_postgres::fallible_iterator::FallibleIterator;
use wire::{Backend, Connection, message_name};

/// The result type of this module.
pub type Result<T, E = ProtocolError> = std::result::Result<T, E>;

/// What `IDENTIFY_SYSTEM` reports about the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemIdentity {
    /// Identifies the cluster; it changes when the cluster is re-created, not on fail-over
    /// to a physical standby.
    pub system_id: u64,
    pub timeline: u32,
    /// The current end of WAL.
    pub xlogpos: Lsn,
    /// The database connected to.
    pub dbname: Option<String>,
}

/// A connection in replication mode, ready for replication commands and SQL.
pub struct ReplicationClient {
    conn: Connection,
    server_version: Option<String>,
    /// ReadyForQuery messages still owed by the server for queries whose call was dropped;
    /// they are read and discarded before the next query.
    owed_ready: usize,
}

impl std::fmt::Debug for ReplicationClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationClient")
            .field("server_version", &self.server_version)
            .finish_non_exhaustive()
    }
}

impl ReplicationClient {
    /// Connects with the host, port, user, password, dbname, application_name, options and
    /// connect_timeout of `config` ([`DEFAULT_CONNECT_TIMEOUT`] when unset), trying each host
    /// in turn. `config`'s own sslmode is ignored in favour of `tls`.
    pub async fn connect(config: &tokio_postgres::Config, tls: &TlsOptions) -> Result<Self> {
        let established = startup::connect(config, tls).await?;
        Ok(ReplicationClient {
            conn: established.conn,
            server_version: established.server_version,
            owed_ready: 0,
        })
    }

    /// The server's `server_version` report, e.g. `15.4 (Debian 15.4-1)`.
    pub fn server_version(&self) -> Option<&str> {
        self.server_version.as_deref()
    }

    /// Runs `sql` (a replication command or SQL) with the simple query protocol and returns
    /// the text of every row. An ErrorResponse is returned after the server is ready again,
    /// so the client stays usable.
    ///
    /// Cancel-safe in effect: if the call is dropped, the rest of its response is discarded
    /// by the next query.
    pub async fn simple_query(&mut self, sql: &str) -> Result<Vec<Vec<Option<String>>>> {
        self.send_query(sql).await?;
        let mut rows = Vec::new();
        let mut error = None;
        loop {
            // A FATAL error is followed by the server closing the socket: report the error.
            let message = match self.conn.read().await {
                Ok(message) => message,
                Err(closed) => return Err(error.map_or(closed, ProtocolError::Server)),
            };
            match message {
                Backend::Message(Message::DataRow(row)) => rows.push(decode_row(&row)?),
                Backend::Message(Message::ErrorResponse(body)) => {
                    error.get_or_insert(ServerError::parse(body.fields())?);
                }
                Backend::Message(Message::ReadyForQuery(_)) => {
                    self.owed_ready = self.owed_ready.saturating_sub(1);
                    return match error {
                        Some(error) => Err(ProtocolError::Server(error)),
                        None => Ok(rows),
                    };
                }
                Backend::Message(
                    Message::RowDescription(_)
                    | Message::CommandComplete(_)
                    | Message::EmptyQueryResponse
                    | Message::ParameterStatus(_),
                ) => {}
                Backend::Message(other) => {
                    return Err(ProtocolError::unexpected(
                        message_name(&other),
                        "in a simple query (COPY is not supported)",
                    ));
                }
                Backend::CopyBothResponse => {
                    return Err(ProtocolError::Protocol(
                        "simple_query cannot stream: use start_logical_replication".to_owned(),
                    ));
                }
            }
        }
    }

    /// `IDENTIFY_SYSTEM`: the cluster's identity, timeline and current end of WAL.
    ///
    /// Cancel-safe in effect, as [`simple_query`](Self::simple_query).
    pub async fn identify_system(&mut self) -> Result<SystemIdentity> {
        let rows = self.simple_query("IDENTIFY_SYSTEM").await?;
        let invalid = |what: &str| {
            ProtocolError::Protocol(format!("IDENTIFY_SYSTEM returned an invalid {what}"))
        };
        let [row] = rows.as_slice() else {
            return Err(invalid("number of rows"));
        };
        let [Some(system_id), Some(timeline), Some(xlogpos), dbname] = row.as_slice() else {
            return Err(invalid("row"));
        };
        Ok(SystemIdentity {
            system_id: system_id.parse().map_err(|_| invalid("systemid"))?,
            timeline: timeline.parse().map_err(|_| invalid("timeline"))?,
            xlogpos: xlogpos.parse().map_err(|_| invalid("xlogpos"))?,
            dbname: dbname.clone(),
        })
    }

    /// Starts streaming changes of logical slot `slot` from `start` with the output plugin
    /// `options`, e.g. `[("proto_version", "1"), ("publication_names",
    /// &publication_names(&["outbox_pub"]))]`. Names and values are quoted here.
    ///
    /// The server resumes from the slot's `confirmed_flush_lsn` when `start` is older.
    /// Errors the caller acts on: SQLSTATE `55006` (the slot is active for another process)
    /// and `42704` (the slot does not exist), see [`ProtocolError::code`]. Not cancel-safe:
    /// dropping it drops the connection.
    pub async fn start_logical_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<ReplicationStream> {
        let mut command = format!(
            "START_REPLICATION SLOT {} LOGICAL {start}",
            quote_identifier(slot)
        );
        if !options.is_empty() {
            let options: Vec<String> = options
                .iter()
                .map(|(name, value)| format!("{} {}", quote_identifier(name), quote_literal(value)))
                .collect();
            command.push_str(&format!(" ({})", options.join(", ")));
        }
        self.send_query(&command).await?;
        loop {
            match self.conn.read().await? {
                Backend::CopyBothResponse => {
                    return Ok(ReplicationStream {
                        conn: self.conn,
                        server_done: false,
                    });
                }
                Backend::Message(Message::ErrorResponse(body)) => {
                    return Err(ProtocolError::Server(ServerError::parse(body.fields())?));
                }
                Backend::Message(Message::ParameterStatus(_)) => {}
                Backend::Message(other) => {
                    return Err(ProtocolError::unexpected(
                        message_name(&other),
                        "instead of CopyBothResponse",
                    ));
                }
            }
        }
    }

    /// Ends the session with Terminate.
    pub async fn close(mut self) -> Result<()> {
        self.conn.queue(|buf| {
            frontend::terminate(buf);
            Ok(())
        })?;
        self.conn.shutdown().await
    }

    /// Discards what is left of dropped queries, then sends `sql`.
    async fn send_query(&mut self, sql: &str) -> Result<()> {
        while self.owed_ready > 0 {
            if let Backend::Message(Message::ReadyForQuery(_)) = self.conn.read().await? {
                self.owed_ready -= 1;
            }
        }
        self.conn.queue(|buf| frontend::query(sql, buf))?;
        self.owed_ready += 1;
        self.conn.flush().await
    }
}

/// A logical replication stream in copy-both mode.
///
/// Answer keepalives that have `reply_requested` set, and send status updates regularly
/// (well within the server's `wal_sender_timeout`), or the server ends the connection.
pub struct ReplicationStream {
    conn: Connection,
    /// The server sent CopyDone: it will send no more data.
    server_done: bool,
}

impl std::fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationStream")
            .field("server_done", &self.server_done)
            .finish_non_exhaustive()
    }
}

impl ReplicationStream {
    /// The next message, or `None` once the server has ended the stream (CopyDone).
    ///
    /// Cancel-safe: it can be a branch of `tokio::select!`; a message partly received when the
    /// future is dropped is completed by the next call.
    pub async fn next(&mut self) -> Result<Option<ReplicationMessage>> {
        if self.server_done {
            return Ok(None);
        }
        loop {
            match self.conn.read_ok().await? {
                Message::CopyData(body) => {
                    return ReplicationMessage::parse(body.into_bytes()).map(Some);
                }
                Message::CopyDone => {
                    self.server_done = true;
                    return Ok(None);
                }
                Message::ParameterStatus(_) => {}
                other => {
                    return Err(ProtocolError::unexpected(
                        message_name(&other),
                        "in the replication stream",
                    ));
                }
            }
        }
    }

    /// Sends a standby status update: WAL up to `write` is received, up to `flush` is durably
    /// handled (the slot's `confirmed_flush_lsn` advances to it, and the server may recycle
    /// WAL before it), up to `apply` is applied. `reply_requested` asks the server for an
    /// immediate keepalive. The client clock is sent in microseconds since 2000-01-01.
    ///
    /// Cancel-safe in effect: if dropped, the update stays queued and is sent before the next
    /// update (or by [`finish`](Self::finish)).
    pub async fn send_standby_status(
        &mut self,
        write: Lsn,
        flush: Lsn,
        apply: Lsn,
        reply_requested: bool,
    ) -> Result<()> {
        let status = wire::standby_status(write, flush, apply, reply_requested);
        self.conn
            .queue(|buf| frontend::CopyData::new(status).map(|data| data.write(buf)))?;
        self.conn.flush().await
    }

    /// Ends the stream cleanly: sends CopyDone, reads what the server still sends up to
    /// ReadyForQuery (data in flight is discarded: it was not acknowledged, so it will be sent
    /// again), then Terminate. The server may first finish decoding a transaction, so bound
    /// this with a timeout; dropping the stream instead just closes the socket.
    pub async fn finish(mut self) -> Result<()> {
        self.conn.queue(|buf| {
            frontend::copy_done(buf);
            Ok(())
        })?;
        self.conn.flush().await?;
        loop {
            match self.conn.read_ok().await? {
                Message::ReadyForQuery(_) => break,
                Message::CopyData(_)
                | Message::CopyDone
                | Message::CommandComplete(_)
                | Message::ParameterStatus(_) => {}
                other => {
                    return Err(ProtocolError::unexpected(
                        message_name(&other),
                        "while ending the replication stream",
                    ));
                }
            }
        }
        self.conn.queue(|buf| {
            frontend::terminate(buf);
            Ok(())
        })?;
        self.conn.shutdown().await
    }
}

/// Quotes an identifier (slot, option or publication name) for a replication command.
pub fn quote_identifier(name: &str) -> String {
    postgres_protocol::escape::escape_identifier(name)
}

/// Quotes a string literal for a replication command. The walsender's command lexer knows
/// only `'...'` with doubled quotes, not the `E'...'` form that
/// `postgres_protocol::escape::escape_literal` emits for backslashes; backslashes are plain
/// characters there.
pub fn quote_literal(value: &str) -> String {
    format!("'{}'", value.replace('\'', "''"))
}

/// The value of pgoutput's `publication_names` option: each name quoted, comma-separated.
pub fn publication_names(names: &[&str]) -> String {
    let quoted: Vec<String> = names.iter().map(|name| quote_identifier(name)).collect();
    quoted.join(",")
}

fn decode_row(row: &DataRowBody) -> Result<Vec<Option<String>>> {
    let buffer = row.buffer();
    let malformed = |e| ProtocolError::malformed(b'D', e);
    let mut values = Vec::new();
    let mut ranges = row.ranges();
    while let Some(range) = ranges.next().map_err(malformed)? {
        values.push(match range {
            None => None,
            Some(range) => {
                let bytes = buffer.get(range).ok_or_else(|| {
                    ProtocolError::Protocol("DataRow column out of bounds".to_owned())
                })?;
                let text = std::str::from_utf8(bytes).map_err(|_| {
                    ProtocolError::Protocol("DataRow column is not UTF-8".to_owned())
                })?;
                Some(text.to_owned())
            }
        });
    }
    Ok(values)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_names_and_values_for_replication_commands() {
        assert_eq!(quote_identifier("outbox"), "\"outbox\"");
        assert_eq!(quote_identifier("a\"b"), "\"a\"\"b\"");
        assert_eq!(quote_literal("it's"), "'it''s'");
        assert_eq!(quote_literal("a\\b"), "'a\\b'");
        assert_eq!(
            publication_names(&["outbox_pub", "odd \"one\""]),
            "\"outbox_pub\",\"odd \"\"one\"\"\""
        );
    }
}
