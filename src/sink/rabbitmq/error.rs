//! What lapin's errors mean for the relay: what may pass by itself (the
//! broker down, the network) and what an operator must fix (credentials,
//! certificates).

use super::RabbitMqConfig;
use super::tls;
use crate::sink::{Reason, SinkError};
use lapin::Confirmation as Ack;

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

/// What the broker's answer to one publish means: an ack is a delivery
/// unless the message came back unroutable (`returned`, a refusal); a nack
/// is back-pressure. `route` names the exchange, the routing key and the key
/// that chose it, for the refusal's message.
pub(super) fn answer(
    outcome: Result<Ack, lapin::Error>,
    returned: Option<String>,
    (exchange, routing_key, key_from): (&str, &str, &str),
) -> Result<(), SinkError> {
    match outcome {
        Ok(Ack::Ack(_)) => match returned {
            None => Ok(()),
            Some(why) => Err(SinkError::rejected(format!(
                "unroutable: no queue is bound to exchange {exchange:?} for routing key {routing_key:?} ({why}); bind a queue or change {key_from}"
            ))),
        },
        Ok(Ack::Nack(_)) => Err(SinkError::Busy(
            "RabbitMQ turned the message away (basic.nack): a queue is full with overflow=reject-publish, or the broker could not store it; retrying".into(),
        )),
        Ok(Ack::NotRequested) => Err(SinkError::Unavailable(
            "the channel is not in confirm mode".into(),
        )),
        Err(e) => Err(unavailable("confirm", e)),
    }
}
