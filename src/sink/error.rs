//! How a sink failed. Each variant is one [`ErrorKind`]; the message is
//! complete on its own (log lines print only the top error) and the broker
//! client's error, when there is one, stays reachable as the source.

use crate::errors::ErrorKind;
use std::error::Error;
use std::fmt;
use std::sync::Arc;

/// How a sink failed, which decides what the relay does next.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SinkError {
    /// This message was refused; the relay holds back its aggregate and retries later.
    #[error(transparent)]
    Rejected(Reason),
    /// This message was turned away for now (back-pressure); the relay holds
    /// back its aggregate and retries, without counting towards dead-lettering.
    #[error(transparent)]
    Busy(Reason),
    /// The outcome is unknown or the broker cannot be reached; the relay reconnects and re-sends.
    #[error(transparent)]
    Unavailable(Reason),
    /// The sink cannot work until an operator changes something (credentials,
    /// permissions); the relay keeps retrying slowly and says what to fix.
    #[error(transparent)]
    Fatal(Reason),
}

impl SinkError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            SinkError::Rejected(_) => ErrorKind::Refused,
            SinkError::Busy(_) => ErrorKind::BackPressure,
            SinkError::Unavailable(_) => ErrorKind::Transient,
            SinkError::Fatal(_) => ErrorKind::NeedsOperator,
        }
    }

    /// A refusal with this message, for `map_err` over checks that explain
    /// themselves in a `String`.
    pub fn rejected(message: impl Into<Reason>) -> Self {
        SinkError::Rejected(message.into())
    }
}

/// What a sink error says, and the broker client's error behind it. Cheap to
/// clone: one refusal can fail several messages of a lane.
#[derive(Debug, Clone)]
pub struct Reason {
    message: String,
    source: Option<Arc<dyn Error + Send + Sync>>,
}

impl Reason {
    /// `message` (which already says what `source` means for the relay) with its cause.
    pub fn caused_by(
        message: impl Into<String>,
        source: impl Error + Send + Sync + 'static,
    ) -> Self {
        Reason {
            message: message.into(),
            source: Some(Arc::new(source)),
        }
    }
}

impl From<String> for Reason {
    fn from(message: String) -> Self {
        Reason {
            message,
            source: None,
        }
    }
}

impl From<&str> for Reason {
    fn from(message: &str) -> Self {
        message.to_owned().into()
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl Error for Reason {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        self.source.as_deref().map(|e| e as &(dyn Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_message_and_the_cause() {
        let cause = std::io::Error::other("connection reset");
        let e = SinkError::Unavailable(Reason::caused_by("RabbitMQ publish failed", cause));
        assert_eq!(e.to_string(), "RabbitMQ publish failed");
        let source = e.source().expect("the cause is kept");
        assert_eq!(source.to_string(), "connection reset");
        assert_eq!(e.kind(), ErrorKind::Transient);
    }
}
