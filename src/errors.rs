//! What kind of failure an error is, and the one table of what the relay does
//! about each kind.
//!
//! Every error type of the crate answers `kind()` with an [`ErrorKind`];
//! nothing else looks at an error to decide how to react. [`policy`] turns a
//! kind into behaviour: whether trying again unchanged can succeed, the log
//! level, and the `outcome` label of `outbox_relay_events_failed_total`. The
//! pipeline and the retention loop retry every kind (a relay never exits on a
//! failure once started); the kind decides how loudly and what is counted.
//!
//! PostgreSQL errors are sorted here too, by SQLSTATE class
//! (<https://www.postgresql.org/docs/current/errcodes-appendix.html>), for
//! ordinary and replication connections alike. This module imports nothing
//! from the crate, so any module may use it.

use tracing::Level;

/// What kind of failure an error is; see each variant for what the relay does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    /// Passes by itself: a lost connection, a timeout, a restarting or busy
    /// server, a slot streamed by another process. The relay backs off,
    /// reconnects and re-sends what was unconfirmed (a duplicate, never a
    /// loss). Logged at warn; in-flight events count as `unavailable`.
    Transient,
    /// The broker (or the relay's own checks) refused this one message: too
    /// large, no such destination, unroutable. The relay holds back its
    /// aggregate, retries with backoff and dead-letters it after
    /// `dead_letter.max_attempts`. Counted as `refused`.
    Refused,
    /// The broker turned this one message away for now (a full queue). The
    /// relay holds back its aggregate and retries for as long as it takes;
    /// it never counts towards dead-lettering. Counted as `refused`.
    BackPressure,
    /// Nothing works until an operator changes something: credentials,
    /// permissions, a missing table, slot or setting, a rejected certificate.
    /// The relay keeps retrying with backoff and logs at error, with the fix
    /// in the message.
    NeedsOperator,
    /// Data the relay cannot read: a replication message it cannot decode, a
    /// peer breaking the protocol. The same bytes come again on a retry, so
    /// it is logged at error; the relay retries with backoff in case a
    /// restarted server sends something else.
    Corrupt,
}

/// Why an event was not published, as `outbox_relay_events_failed_total`'s
/// `outcome` label says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The broker (or the relay's checks) refused it: held back, retried.
    Refused,
    /// The broker could not be reached or did not answer: re-sent.
    Unavailable,
}

impl Outcome {
    /// The metric label.
    pub const fn label(self) -> &'static str {
        match self {
            Outcome::Refused => "refused",
            Outcome::Unavailable => "unavailable",
        }
    }
}

/// What the relay does about one kind of failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Policy {
    /// Trying again without anyone acting can succeed.
    pub retry: bool,
    /// A refused event counts towards `dead_letter.max_attempts`.
    pub dead_letter: bool,
    /// The level the failure is logged at.
    pub level: Level,
    /// How events failed by it are counted.
    pub outcome: Option<Outcome>,
}

/// The one table from kind to behaviour.
pub const fn policy(kind: ErrorKind) -> Policy {
    const fn row(retry: bool, dead_letter: bool, level: Level, outcome: Option<Outcome>) -> Policy {
        Policy {
            retry,
            dead_letter,
            level,
            outcome,
        }
    }
    use Outcome::{Refused, Unavailable};
    match kind {
        // row(retry, dead_letter, level, outcome)
        ErrorKind::Transient => row(true, false, Level::WARN, Some(Unavailable)),
        ErrorKind::Refused => row(false, true, Level::WARN, Some(Refused)),
        ErrorKind::BackPressure => row(true, false, Level::WARN, Some(Refused)),
        ErrorKind::NeedsOperator => row(false, false, Level::ERROR, None),
        ErrorKind::Corrupt => row(false, false, Level::ERROR, None),
    }
}

/// The kind of a PostgreSQL error by its SQLSTATE: conditions that pass
/// (connection exceptions, serialization failures, insufficient resources,
/// operator intervention such as a shutdown, a lock or slot held by someone
/// else) are transient; the rest (credentials, missing objects, a dropped
/// database) need an operator.
pub fn sqlstate(code: &str) -> ErrorKind {
    const TRANSIENT_CLASSES: &[&str] = &[
        "08", // connection_exception
        "40", // transaction_rollback: serialization failure, deadlock
        "53", // insufficient_resources, e.g. 53300 too_many_connections
        "57", // operator_intervention: shutdown, cancel, starting up
    ];
    match code {
        "57P04" => ErrorKind::NeedsOperator,       // database_dropped
        "55006" | "55P03" => ErrorKind::Transient, // object_in_use, lock_not_available
        _ if TRANSIENT_CLASSES.iter().any(|c| code.starts_with(c)) => ErrorKind::Transient,
        _ => ErrorKind::NeedsOperator,
    }
}

/// The kind of an error of `tokio_postgres`: by SQLSTATE when the server sent
/// one, else transient (I/O, a closed connection, a timeout).
pub fn postgres(e: &tokio_postgres::Error) -> ErrorKind {
    e.code()
        .map_or(ErrorKind::Transient, |c| sqlstate(c.code()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_sqlstates() {
        for code in [
            "55006", "55P03", "57P01", "57P03", "57014", "53300", "08006", "40001",
        ] {
            assert_eq!(sqlstate(code), ErrorKind::Transient, "{code}");
        }
        for code in [
            "28P01", "28000", "3D000", "42704", "42P01", "42601", "57P04",
        ] {
            assert_eq!(sqlstate(code), ErrorKind::NeedsOperator, "{code}");
        }
    }

    #[test]
    fn only_what_passes_by_itself_is_retried_unchanged() {
        let retried: Vec<_> = [
            ErrorKind::Transient,
            ErrorKind::Refused,
            ErrorKind::BackPressure,
            ErrorKind::NeedsOperator,
            ErrorKind::Corrupt,
        ]
        .into_iter()
        .filter(|k| policy(*k).retry)
        .collect();
        assert_eq!(retried, [ErrorKind::Transient, ErrorKind::BackPressure]);
        assert!(policy(ErrorKind::Refused).dead_letter);
        assert!(!policy(ErrorKind::BackPressure).dead_letter);
        assert_eq!(policy(ErrorKind::NeedsOperator).level, Level::ERROR);
    }
}
