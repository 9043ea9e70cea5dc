//! The librdkafka properties the relay derives from `[sink]`.

use crate::config::KafkaConfig;
use rdkafka::ClientConfig;

/// librdkafka's own queue bound; larger than any `relay.max_in_flight`, so
/// the relay's window is the bound that binds.
const QUEUE_MAX_MESSAGES: &str = "200000";

/// librdkafka's configuration for the producer: the pass-through
/// `properties` first, then the typed keys and the settings the guarantees
/// rest on, which validation keeps out of `properties`.
pub(super) fn client_config(config: &KafkaConfig) -> ClientConfig {
    let mut c = ClientConfig::new();
    for (k, v) in &config.properties {
        c.set(k, v.expose());
    }
    set_security(&mut c, config);
    c.set("bootstrap.servers", &config.brokers)
        .set("client.id", &config.client_id)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("enable.gapless.guarantee", "true")
        // Never: the gapless guarantee does not cover a message that times
        // out in librdkafka, after which later messages of its partition
        // may still be written, ahead of its re-send. The relay's
        // confirm_timeout bounds the wait instead; it then drops the
        // producer with every later message and re-sends them in order.
        .set("message.timeout.ms", "0")
        // Only a permanent error fails the later messages of a partition
        // with the one that failed; a message out of retries fails alone.
        // librdkafka's default, set so that no default can change it.
        .set("message.send.max.retries", "2147483647")
        .set("linger.ms", config.linger.as_millis().to_string())
        .set("queue.buffering.max.messages", QUEUE_MAX_MESSAGES)
        // The request size must fit the largest message the relay lets through.
        .set(
            "message.max.bytes",
            (config.message_max_bytes + 64 * 1024)
                .max(1_000_000)
                .to_string(),
        )
        .set("batch.size", batch_size(config).to_string());
    c
}

/// librdkafka's default `batch.size`.
const DEFAULT_BATCH_SIZE: usize = 1_000_000;

/// The largest batch, in bytes: `properties."batch.size"` (librdkafka's
/// default when unset) but no more than `sink.message_max_bytes`. The
/// broker applies a topic's `max.message.bytes` to a whole batch, and
/// librdkafka does not split a batch the broker refused: every message in
/// it would come back refused for the batch's size, however small.
fn batch_size(config: &KafkaConfig) -> usize {
    config
        .properties
        .get("batch.size")
        .and_then(|v| v.expose().trim().parse::<usize>().ok())
        .unwrap_or(DEFAULT_BATCH_SIZE)
        .min(config.message_max_bytes)
}

fn set_security(c: &mut ClientConfig, config: &KafkaConfig) {
    let protocol = config.security_protocol;
    c.set("security.protocol", protocol.as_str());
    if protocol.uses_sasl() {
        c.set(
            "sasl.mechanism",
            config.sasl_mechanism.unwrap_or_default().as_str(),
        );
        if let Some(user) = &config.sasl_username {
            c.set("sasl.username", user);
        }
        if let Some(password) = &config.sasl_password {
            c.set("sasl.password", password.expose());
        }
    }
    if protocol.uses_tls() {
        for (property, path) in [
            ("ssl.ca.location", &config.ssl_ca),
            ("ssl.certificate.location", &config.ssl_cert),
            ("ssl.key.location", &config.ssl_key),
        ] {
            if let Some(path) = path {
                c.set(property, path.to_string_lossy());
            }
        }
    }
}

/// librdkafka names its own properties when it refuses them (`ssl.ca.location
/// failed: ...`); the operator edits the relay's keys.
pub(super) fn keys_to_check(message: &str) -> String {
    let mut keys: Vec<&str> = KafkaConfig::TYPED_PROPERTIES
        .iter()
        .filter(|(property, _)| message.contains(property))
        .map(|(_, key)| *key)
        .collect();
    keys.dedup();
    if keys.is_empty() {
        String::new()
    } else {
        format!("; check {}", keys.join(" and "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{SinkConfig, load_str};
    use crate::sink::kafka::RelayProducer;
    use crate::sink::kafka::log::LogContext;

    fn kafka(sink_keys: &str) -> KafkaConfig {
        let toml = format!(
            "[database]\nurl = \"postgres://relay@db/app\"\n[sink]\ntype = \"kafka\"\nbrokers = \"k:9093\"\n{sink_keys}"
        );
        match load_str(&toml).unwrap_or_else(|e| panic!("{e}")).sink {
            SinkConfig::Kafka(k) => k,
            SinkConfig::RabbitMq(_) => unreachable!(),
        }
    }

    /// A topic's `max.message.bytes` bounds a whole batch: no batch is
    /// larger than `sink.message_max_bytes`, a smaller `batch.size` stands.
    #[test]
    fn batches_stay_within_the_largest_message() {
        for (keys, want) in [
            ("", "1000000"),
            ("message_max_bytes = 60000\n", "60000"),
            (
                "message_max_bytes = 60000\n[sink.properties]\n\"batch.size\" = \"16384\"\n",
                "16384",
            ),
            (
                "[sink.properties]\n\"batch.size\" = \"4000000\"\n",
                "1000000",
            ),
        ] {
            assert_eq!(
                client_config(&kafka(keys)).get("batch.size"),
                Some(want),
                "{keys}"
            );
        }
    }

    #[test]
    fn typed_security_keys_become_librdkafka_properties() {
        let c = client_config(&kafka(
            "security_protocol = \"sasl_ssl\"\nsasl_mechanism = \"SCRAM-SHA-512\"\nsasl_username = \"relay\"\nsasl_password = \"s3cret\"\nssl_ca = \"/etc/kafka/ca.pem\"\nssl_cert = \"/etc/kafka/relay.pem\"\nssl_key = \"/etc/kafka/relay.key\"\n[sink.properties]\n\"ssl.key.password\" = \"k3y\"\n",
        ));
        for (property, value) in [
            ("security.protocol", "sasl_ssl"),
            ("sasl.mechanism", "SCRAM-SHA-512"),
            ("sasl.username", "relay"),
            ("sasl.password", "s3cret"),
            ("ssl.ca.location", "/etc/kafka/ca.pem"),
            ("ssl.certificate.location", "/etc/kafka/relay.pem"),
            ("ssl.key.location", "/etc/kafka/relay.key"),
            ("ssl.key.password", "k3y"),
            ("enable.idempotence", "true"),
        ] {
            assert_eq!(c.get(property), Some(value), "{property}");
        }
    }

    #[test]
    fn sasl_defaults_to_plain_and_plaintext_sets_nothing_else() {
        let c = client_config(&kafka(
            "security_protocol = \"sasl_plaintext\"\nsasl_username = \"relay\"\nsasl_password = \"s3cret\"\n",
        ));
        assert_eq!(c.get("sasl.mechanism"), Some("PLAIN"));
        assert_eq!(c.get("ssl.ca.location"), None);
        let c = client_config(&kafka(""));
        assert_eq!(c.get("security.protocol"), Some("plaintext"));
        for property in ["sasl.mechanism", "sasl.username", "sasl.password"] {
            assert_eq!(c.get(property), None, "{property}");
        }
    }

    #[test]
    fn a_refused_file_is_reported_by_its_key() {
        let config = kafka("security_protocol = \"ssl\"\nssl_ca = \"/nonexistent/ca.pem\"\n");
        let e = client_config(&config)
            .create_with_context::<_, RelayProducer>(LogContext::default())
            .err()
            .expect("librdkafka refuses a CA file that does not exist");
        assert!(
            keys_to_check(&e.to_string()).ends_with("check sink.ssl_ca"),
            "{e}"
        );
    }
}
