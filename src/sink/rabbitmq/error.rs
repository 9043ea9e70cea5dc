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
    // NOT_ALLOWED also says a connection limit is reached ("access to vhost
    // '/' refused for user 'u': connection limit (N) is reached") or the
    // vhost is down, which pass by themselves.
    let limit_reached = text.contains("connection limit (") && text.contains("is reached");
    if text.contains("NOT_ALLOWED")
        && !limit_reached
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
    sent: Published<'_>,
    declare: bool,
) -> Result<(), SinkError> {
    let Published {
        exchange,
        routing_key,
        key_from,
        ..
    } = sent;
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
        Err(e) => Err(confirm_error(e, sent, declare)),
    }
}

/// What one publish was: where it went, the key that chose its routing key,
/// and its body's size (what RabbitMQ's `max_message_size` counts).
#[derive(Clone, Copy)]
pub(super) struct Published<'a> {
    pub exchange: &'a str,
    pub routing_key: &'a str,
    pub key_from: &'a str,
    pub body_len: usize,
}

/// A confirmation that failed. When the broker closed the channel over a
/// publish to this message's exchange (the relay's user may not write
/// there, the exchange is internal, it was deleted since the relay looked,
/// or a topic permission refuses this routing key), that is this message's
/// destination refusing it, as every message sent there would be: a
/// refusal, dead-lettered after `dead_letter.max_attempts`, so that one
/// such event does not stall the others by closing the channel at every
/// run. So is a close over a body of this message's size that is larger
/// than the broker's `max_message_size` (set below `sink.message_max_bytes`).
/// Any other failure leaves the outcome unknown; so does an exchange gone
/// when the relay declares exchanges (the next connection declares it
/// again).
pub(super) fn confirm_error(e: lapin::Error, sent: Published<'_>, declare: bool) -> SinkError {
    let Published {
        exchange,
        routing_key,
        body_len,
        ..
    } = sent;
    if let lapin::ErrorKind::ProtocolError(amqp) = e.kind() {
        let text = amqp.get_message().as_str();
        let refused =
            text.starts_with("ACCESS_REFUSED") || (text.starts_with("NOT_FOUND") && !declare);
        // RabbitMQ checks (and names) the default exchange as amq.default.
        let named = if exchange.is_empty() {
            "amq.default"
        } else {
            exchange
        };
        let here = text.contains(&format!("exchange '{named}'"));
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
        // "message size N is larger than [configured ]max size M"
        let oversized = format!("PRECONDITION_FAILED - message size {body_len} is larger than ");
        if text.starts_with(&oversized) {
            let text = text.to_owned();
            return SinkError::Rejected(Reason::caused_by(
                format!(
                    "RabbitMQ refused a message of {body_len} bytes and closed the channel ({text}); \
                     set sink.message_max_bytes at or below the broker's max_message_size, \
                     or raise that"
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

    fn sent<'a>(exchange: &'a str, routing_key: &'a str, body_len: usize) -> Published<'a> {
        Published {
            exchange,
            routing_key,
            key_from: "",
            body_len,
        }
    }

    /// Only a channel closed over this message's exchange (and, for a
    /// topic permission, its routing key), or over a body of its size
    /// larger than the broker's limit, refuses it.
    #[test]
    fn a_channel_closed_over_this_message_refuses_it() {
        use AMQPSoftError::{ACCESSREFUSED, NOTFOUND, PRECONDITIONFAILED};
        let internal = "ACCESS_REFUSED - cannot publish to internal exchange 'x' in vhost '/'";
        let denied =
            "ACCESS_REFUSED - access to exchange 'x' in vhost '/' refused for user 'relay'";
        let topic = "ACCESS_REFUSED - write access to topic 'k' in exchange 'x' in vhost '/' refused for user 'relay'";
        let gone = "NOT_FOUND - no exchange 'x' in vhost '/'";
        let default_denied = "ACCESS_REFUSED - access to exchange 'amq.default' in vhost '/' refused for user 'relay'";
        let configured =
            "PRECONDITION_FAILED - message size 9 is larger than configured max size 8";
        let default = "PRECONDITION_FAILED - message size 9 is larger than max size 8";
        for (kind, text, (exchange, key, len), refused) in [
            (ACCESSREFUSED, internal, ("x", "k", 1), true),
            (ACCESSREFUSED, denied, ("x", "k", 1), true),
            (ACCESSREFUSED, topic, ("x", "k", 1), true),
            (NOTFOUND, gone, ("x", "k", 1), true),
            (ACCESSREFUSED, default_denied, ("", "k", 1), true),
            (ACCESSREFUSED, default_denied, ("x", "k", 1), false),
            (ACCESSREFUSED, internal, ("y", "k", 1), false),
            (ACCESSREFUSED, denied, ("xy", "k", 1), false),
            (ACCESSREFUSED, topic, ("x", "other", 1), false),
            (PRECONDITIONFAILED, configured, ("x", "k", 9), true),
            (PRECONDITIONFAILED, default, ("y", "q", 9), true),
            // Another message's size: this one's outcome is unknown.
            (PRECONDITIONFAILED, configured, ("x", "k", 8), false),
            (PRECONDITIONFAILED, configured, ("x", "k", 90), false),
        ] {
            let got = confirm_error(closed(kind, text), sent(exchange, key, len), false);
            assert_eq!(
                matches!(got, SinkError::Rejected(_)),
                refused,
                "{text} for {exchange}/{key} ({len} bytes): {got}"
            );
        }
        let io = lapin::Error::from(lapin::ErrorKind::InvalidConnectionState(
            lapin::ConnectionState::Closed,
        ));
        assert!(matches!(
            confirm_error(io, sent("x", "k", 1), false),
            SinkError::Unavailable(_)
        ));
        // Declared on first use: the next connection declares it again.
        let gone = confirm_error(closed(NOTFOUND, gone), sent("x", "k", 1), true);
        assert!(matches!(gone, SinkError::Unavailable(_)), "{gone}");
    }
}
