//! Errors of the replication client, each mapped to its [`ErrorKind`].
use crate::config::SslMode;
use crate::db::tls::TlsError;
use crate::errors::{self, ErrorKind};
use postgres_protocol::message::backend::ErrorFields;
use std::fmt;
use std::io;
use std::time::Duration;
use tokio_postgres::fallible_iterator::FallibleIterator;

/// An `ErrorResponse` from the server
/// (<https://www.postgresql.org/docs/current/protocol-error-fields.html>).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerError {
    /// `ERROR`, `FATAL` or `PANIC` (not localized).
    pub severity: String,
    /// The SQLSTATE code, e.g. `55006`.
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

impl ServerError {
    pub(super) fn parse(mut fields: ErrorFields<'_>) -> Result<ServerError, ProtocolError> {
        let mut error = ServerError {
            severity: String::new(),
            code: String::new(),
            message: String::new(),
            detail: None,
            hint: None,
        };
        let mut localized_severity = String::new();
        while let Some(field) = fields
            .next()
            .map_err(|e| ProtocolError::malformed(b'E', e))?
        {
            let value = String::from_utf8_lossy(field.value_bytes()).into_owned();
            match field.type_() {
                b'V' => error.severity = value,
                b'S' => localized_severity = value,
                b'C' => error.code = value,
                b'M' => error.message = value,
                b'D' => error.detail = Some(value),
                b'H' => error.hint = Some(value),
                _ => {}
            }
        }
        if error.severity.is_empty() {
            // Servers before 9.6 send only the localized severity.
            error.severity = localized_severity;
        }
        if error.code.is_empty() || error.message.is_empty() {
            return Err(ProtocolError::Protocol(
                "ErrorResponse without SQLSTATE code or message".to_owned(),
            ));
        }
        Ok(error)
    }

    /// By SQLSTATE, as for ordinary connections: `55006` (the slot is streamed by another
    /// process), a shutdown or a server starting up pass; a wrong password or a missing slot
    /// does not.
    pub fn kind(&self) -> ErrorKind {
        errors::sqlstate(&self.code)
    }
}

impl fmt::Display for ServerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "PostgreSQL {} {}: {}",
            self.severity, self.code, self.message
        )?;
        if let Some(detail) = &self.detail {
            write!(f, " (detail: {detail})")?;
        }
        if let Some(hint) = &self.hint {
            write!(f, " (hint: {hint})")?;
        }
        Ok(())
    }
}

impl std::error::Error for ServerError {}

/// Why the replication connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ProtocolError {
    #[error("invalid connection settings: {0}")]
    Config(String),
    #[error("cannot connect to PostgreSQL at {addr}: {source}")]
    Connect {
        addr: String,
        #[source]
        source: io::Error,
    },
    #[error("no answer from PostgreSQL at {addr} within the {timeout:?} connect timeout")]
    ConnectTimeout { addr: String, timeout: Duration },
    #[error("replication connection failed: {0}")]
    Io(#[source] io::Error),
    #[error("PostgreSQL closed the replication connection")]
    Closed,
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error(
        "PostgreSQL at {addr} does not accept TLS but database.sslmode is {mode}: \
         turn ssl on in the server, or set database.sslmode to prefer or disable"
    )]
    TlsRefused { addr: String, mode: SslMode },
    #[error("PostgreSQL asks for a password for user {user:?}, but none is configured")]
    MissingPassword { user: String },
    #[error(
        "PostgreSQL asks for {method} authentication, which outbox-relay does not support: \
         use scram-sha-256, md5, password or trust for this user in pg_hba.conf"
    )]
    UnsupportedAuth { method: String },
    #[error("SCRAM authentication failed: {0}")]
    Scram(String),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error("PostgreSQL sent a message of {len} bytes (tag {tag:?}), more than the 1 GiB limit")]
    MessageTooLarge { tag: char, len: usize },
    #[error("protocol violation: {0}")]
    Protocol(String),
}

impl ProtocolError {
    /// The SQLSTATE code when the server reported the error, e.g. `55006` (the slot is active
    /// for another process) or `42704` (the slot does not exist).
    pub fn code(&self) -> Option<&str> {
        self.server_error().map(|e| e.code.as_str())
    }

    /// The server's error report, when there is one.
    pub fn server_error(&self) -> Option<&ServerError> {
        match self {
            ProtocolError::Server(e) => Some(e),
            _ => None,
        }
    }

    /// Transport failures pass; wrong credentials, a missing slot or a rejected certificate
    /// need an operator; a server that does not speak the protocol is corrupt input.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProtocolError::Connect { .. }
            | ProtocolError::ConnectTimeout { .. }
            | ProtocolError::Io(_)
            | ProtocolError::Closed => ErrorKind::Transient,
            ProtocolError::Tls(e) => e.kind(),
            ProtocolError::Server(e) => e.kind(),
            ProtocolError::Config(_)
            | ProtocolError::TlsRefused { .. }
            | ProtocolError::MissingPassword { .. }
            | ProtocolError::UnsupportedAuth { .. }
            | ProtocolError::Scram(_) => ErrorKind::NeedsOperator,
            ProtocolError::MessageTooLarge { .. } | ProtocolError::Protocol(_) => {
                ErrorKind::Corrupt
            }
        }
    }

    pub(super) fn malformed(tag: u8, error: io::Error) -> ProtocolError {
        ProtocolError::Protocol(format!("malformed {:?} message: {error}", char::from(tag)))
    }

    pub(super) fn unexpected(message: &str, during: &str) -> ProtocolError {
        ProtocolError::Protocol(format!("unexpected {message} {during}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db_error(code: &str) -> ProtocolError {
        ProtocolError::Server(ServerError {
            severity: "FATAL".to_owned(),
            code: code.to_owned(),
            message: "m".to_owned(),
            detail: None,
            hint: None,
        })
    }

    #[test]
    fn classifies_server_errors_by_sqlstate() {
        for code in ["55006", "57P01", "57P03", "53300", "08006"] {
            assert_eq!(db_error(code).kind(), ErrorKind::Transient, "{code}");
        }
        for code in ["28P01", "28000", "42704", "42601", "57P04"] {
            assert_eq!(db_error(code).kind(), ErrorKind::NeedsOperator, "{code}");
        }
        assert_eq!(db_error("55006").code(), Some("55006"));
    }

    #[test]
    fn classifies_transport_errors() {
        assert_eq!(ProtocolError::Closed.kind(), ErrorKind::Transient);
        let reset = ProtocolError::Io(io::ErrorKind::ConnectionReset.into());
        assert_eq!(reset.kind(), ErrorKind::Transient);
        let garbled = ProtocolError::Protocol("x".to_owned());
        assert_eq!(garbled.kind(), ErrorKind::Corrupt);
        let no_password = ProtocolError::MissingPassword { user: "u".into() };
        assert_eq!(no_password.kind(), ErrorKind::NeedsOperator);
        assert_eq!(ProtocolError::Closed.code(), None);
    }

    #[test]
    fn displays_detail_and_hint() {
        let error = ServerError {
            severity: "ERROR".to_owned(),
            code: "55006".to_owned(),
            message: "replication slot \"s\" is active for PID 7".to_owned(),
            detail: Some("d".to_owned()),
            hint: Some("h".to_owned()),
        };
        assert_eq!(
            error.to_string(),
            "PostgreSQL ERROR 55006: replication slot \"s\" is active for PID 7 \
             (detail: d) (hint: h)"
        );
    }
}
