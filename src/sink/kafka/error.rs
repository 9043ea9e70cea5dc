//! What librdkafka's errors mean for the relay.

use crate::sink::{Reason, SinkError};
use rdkafka::error::{KafkaError, RDKafkaErrorCode};

/// Sorts librdkafka's errors by what the relay should do about them.
pub(super) fn classify(e: &KafkaError) -> SinkError {
    use RDKafkaErrorCode as C;
    match e.rdkafka_error_code() {
        Some(
            C::MessageSizeTooLarge
            | C::MessageBatchTooLarge
            | C::UnsupportedForMessageFormat
            | C::InvalidMessageSize
            | C::InvalidMessage
            | C::InvalidRecord
            | C::InvalidTopic
            | C::TopicAuthorizationFailed
            | C::UnknownTopicOrPartition
            | C::UnknownTopic
            | C::PolicyViolation,
        ) => SinkError::Rejected(Reason::caused_by(
            format!("Kafka refused the message: {e}"),
            e.clone(),
        )),
        Some(
            C::SaslAuthenticationFailed
            | C::Authentication
            | C::ClusterAuthorizationFailed
            | C::TransactionalIdAuthorizationFailed,
        ) => SinkError::Fatal(Reason::caused_by(
            format!(
                "Kafka refused the relay's credentials or permissions: {e}; check sink.sasl_username, sink.sasl_password, sink.ssl_cert and the ACLs"
            ),
            e.clone(),
        )),
        _ => SinkError::Unavailable(Reason::caused_by(
            format!("Kafka delivery failed: {e}"),
            e.clone(),
        )),
    }
}
