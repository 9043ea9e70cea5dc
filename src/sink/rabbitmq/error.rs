//! What lapin's errors mean for the relay: what may pass by itself (the
//! broker down, the network) and what an operator must fix (credentials,
//! certificates).

use super::RabbitMqConfig;
use super::tls;
use crate::sink::{Reason, SinkError};

pub(super) fn unavailable(what: &str, e: lapin::Error) -> SinkError {
    SinkError::Unavailable(Reason::caused_by(format!("RabbitMQ {what} failed: {e}"), e))
}

/// Tells what the operator must fix (credentials, certificates) from what
/// may pass by itself (the broker down, the network).
pub(super) async fn connect_error(
    config: &RabbitMqConfig,
    shown: &str,
    e: &lapin::Error,
) -> SinkError {
    let text = e.to_string();
    if text.contains("ACCESS_REFUSED") || text.contains("403") {
        return SinkError::Fatal(Reason::caused_by(
            format!(
                "RabbitMQ at {shown} refused the credentials: {text}; check the user and password in sink.url"
            ),
            e.clone(),
        ));
    }
    if let Some(problem) = tls::diagnose(config, shown).await {
        return problem;
    }
    SinkError::Unavailable(Reason::caused_by(
        format!(
            "cannot connect to RabbitMQ at {shown}: {text}; check sink.url and that the broker is up"
        ),
        e.clone(),
    ))
}
