//! librdkafka's log lines and error callbacks, sent to `tracing` quietly.
//!
//! While no broker answers, librdkafka reports every failed connection
//! attempt, on every broker thread, dozens of lines a second; left as they
//! are, they bury the relay's own warning ("relay interrupted; reconnecting"),
//! which says the same thing once per retry. So connection chatter goes to
//! debug, and each kind of line (facility or error code) is logged at most
//! once per [`REPEAT_WINDOW`], with the number of repeats held back.
//!
//! The lines keep the target they had before this file moved into
//! `sink/kafka/`, [`TARGET`], so `log.level` filters written for it still
//! work.

use rdkafka::ClientContext;
use rdkafka::config::RDKafkaLogLevel;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The `tracing` target of librdkafka's lines.
pub const TARGET: &str = "outbox_relay::sink::kafka_log";

/// Lines of one kind within this long of the last one logged are counted, not logged.
pub const REPEAT_WINDOW: Duration = Duration::from_secs(30);

/// librdkafka's log facilities for a connection that failed or went down.
const CONNECTION_FACILITIES: &[&str] = &["FAIL", "BROKERFAIL", "CONNECT", "ERROR"];

#[derive(Default)]
pub struct LogContext {
    /// Per kind of line: when it was last logged, and how many were held back since.
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl LogContext {
    /// `Some(n)` when a line of this kind is to be logged, `n` being the
    /// lines of that kind held back since the last one.
    fn admit(&self, kind: &str) -> Option<u64> {
        let Ok(mut seen) = self.seen.lock() else {
            return Some(0); // poisoned: logging everything beats logging nothing
        };
        let now = Instant::now();
        match seen.get_mut(kind) {
            Some((last, held)) if now.duration_since(*last) < REPEAT_WINDOW => {
                *held += 1;
                None
            }
            Some((last, held)) => {
                let n = *held;
                *last = now;
                *held = 0;
                Some(n)
            }
            None => {
                seen.insert(kind.to_owned(), (now, 0));
                Some(0)
            }
        }
    }
}

fn is_connection_error(code: RDKafkaErrorCode) -> bool {
    matches!(
        code,
        RDKafkaErrorCode::BrokerTransportFailure
            | RDKafkaErrorCode::AllBrokersDown
            | RDKafkaErrorCode::Resolve
    )
}

impl ClientContext for LogContext {
    fn log(&self, level: RDKafkaLogLevel, facility: &str, message: &str) {
        // The relay sets enable.gapless.guarantee on purpose; the "experimental"
        // notice at every start would only teach operators to ignore warnings.
        let quiet = (facility == "CONFWARN" && message.contains("gapless"))
            || CONNECTION_FACILITIES.contains(&facility);
        let Some(held) = self.admit(&format!("log:{facility}")) else {
            return;
        };
        if quiet {
            tracing::debug!(target: TARGET, facility, held, "librdkafka: {message}");
            return;
        }
        match level {
            RDKafkaLogLevel::Emerg
            | RDKafkaLogLevel::Alert
            | RDKafkaLogLevel::Critical
            | RDKafkaLogLevel::Error => {
                tracing::error!(target: TARGET, facility, held, "librdkafka: {message}")
            }
            RDKafkaLogLevel::Warning => {
                tracing::warn!(target: TARGET, facility, held, "librdkafka: {message}")
            }
            RDKafkaLogLevel::Notice | RDKafkaLogLevel::Info => {
                tracing::info!(target: TARGET, facility, held, "librdkafka: {message}")
            }
            RDKafkaLogLevel::Debug => {
                tracing::debug!(target: TARGET, facility, held, "librdkafka: {message}")
            }
        }
    }

    /// Errors the producer reports outside a delivery: the relay sees those
    /// that matter through its own calls (delivery reports, metadata, fatal
    /// errors) and reports them itself.
    fn error(&self, error: KafkaError, reason: &str) {
        let code = error.rdkafka_error_code();
        let Some(held) = self.admit(&format!("error:{code:?}")) else {
            return;
        };
        if code.is_some_and(is_connection_error) {
            tracing::debug!(target: TARGET, held, "librdkafka: {error}: {reason}");
        } else {
            tracing::warn!(target: TARGET, held, "librdkafka: {error}: {reason}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_within_the_window_are_held_back_and_counted() {
        let context = LogContext::default();
        assert_eq!(context.admit("log:FAIL"), Some(0));
        for _ in 0..40 {
            assert_eq!(context.admit("log:FAIL"), None);
        }
        assert_eq!(context.admit("error:Some(AllBrokersDown)"), Some(0));
        // Once the window has passed, the next line says how many were held back.
        if let Ok(mut seen) = context.seen.lock()
            && let Some((last, _)) = seen.get_mut("log:FAIL")
        {
            *last -= REPEAT_WINDOW;
        }
        assert_eq!(context.admit("log:FAIL"), Some(40));
        assert_eq!(context.admit("log:FAIL"), None);
    }
}
