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
    // NOT_ALLOWED also says a connection limit is reached or the vhost is
    // down, which pass by themselves.
    if text.contains("NOT_ALLOWED")
        && (text.contains("refused for user") || text.contains("not found"))
    {
        return SinkError::Fatal(Reason::caused_by(
            format!(
                "RabbitMQ at {shown} does not let this user use the virtual host: {text}; \
                 check the vhost in sink.url (the path after the host, %2f for \"/\") and the user's permissions"
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
    declare: bool,
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
        Err(e) => Err(confirm_error(e, (exchange, routing_key, key_from), declare)),
    }
}

/// A confirmation that failed. When the broker closed the channel over a
/// publish to this message's exchange (the relay's user may not write
/// there, the exchange is internal, it was deleted since the relay looked,
/// or a topic permission refuses this routing key), that is this message's
/// destination refusing it, as every message sent there would be: a
/// refusal, dead-lettered after `dead_letter.max_attempts`, so that one
/// such event does not stall the others by closing the channel at every
/// run. Any other failure leaves the outcome unknown; so does an exchange
/// gone when the relay declares exchanges (the next connection declares it
/// again).
pub(super) fn confirm_error(
    e: lapin::Error,
    (exchange, routing_key, _): (&str, &str, &str),
    declare: bool,
) -> SinkError {
    if let lapin::ErrorKind::ProtocolError(amqp) = e.kind() {
        let text = amqp.get_message().as_str();
        let refused =
            text.starts_with("ACCESS_REFUSED") || (text.starts_with("NOT_FOUND") && !declare);
        let here = text.contains(&format!("exchange '{exchange}'"));
        let this_key =
            !text.contains("access to topic") || text.contains(&format!("topic '{routing_key}'"));
        if refused && here && this_key {
            let text = text.to_owned();
            return SinkError::Rejected(Reason::caused_by(
                format!(
                    "RabbitMQ refused a publish to exchange {exchange:?} and closed the channel ({text}); \
                     give the relay's user write access there, or route these events elsewhere"
                ),
                e,
            ));
        }
    }
    unavailable("confirm", e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::protocol::{AMQPError, AMQPErrorKind, AMQPSoftError};

    fn closed(kind: AMQPSoftError, text: &str) -> lapin::Error {
        lapin::ErrorKind::ProtocolError(AMQPError::new(AMQPErrorKind::Soft(kind), text.into()))
            .into()
    }

    /// Only a channel closed over this message's exchange (and, for a
    /// topic permission, its routing key) refuses it.
    #[test]
    fn a_channel_closed_over_this_exchange_refuses_the_message() {
        use AMQPSoftError::{ACCESSREFUSED, NOTFOUND, PRECONDITIONFAILED};
        let internal = "ACCESS_REFUSED - cannot publish to internal exchange 'x' in vhost '/'";
        let denied =
            "ACCESS_REFUSED - access to exchange 'x' in vhost '/' refused for user 'relay'";
        let topic = "ACCESS_REFUSED - write access to topic 'k' in exchange 'x' in vhost '/' refused for user 'relay'";
        let gone = "NOT_FOUND - no exchange 'x' in vhost '/'";
        for (kind, text, exchange, key, refused) in [
            (ACCESSREFUSED, internal, "x", "k", true),
            (ACCESSREFUSED, denied, "x", "k", true),
            (ACCESSREFUSED, topic, "x", "k", true),
            (NOTFOUND, gone, "x", "k", true),
            (ACCESSREFUSED, internal, "y", "k", false),
            (ACCESSREFUSED, denied, "xy", "k", false),
            (ACCESSREFUSED, topic, "x", "other", false),
            (
                PRECONDITIONFAILED,
                "PRECONDITION_FAILED - message size 9 is larger than configured max size 8",
                "x",
                "k",
                false,
            ),
        ] {
            let got = confirm_error(closed(kind, text), (exchange, key, ""), false);
            assert_eq!(
                matches!(got, SinkError::Rejected(_)),
                refused,
                "{text} for {exchange}/{key}: {got}"
            );
        }
        let io = lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(
            lapin::ConnectionState::Closed,
        ));
        assert!(matches!(
            confirm_error(io, ("x", "k", ""), false),
            SinkError::Unavailable(_)
        ));
        // Declared on first use: the next connection declares it again.
        let gone = confirm_error(closed(NOTFOUND, gone), ("x", "k", ""), true);
        assert!(matches!(gone, SinkError::Unavailable(_)), "{gone}");
    }
}
