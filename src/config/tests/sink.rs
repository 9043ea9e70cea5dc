//! `[sink]`: broker values, TLS and SASL keys, secrets.

use super::*;

#[test]
fn sink_values_are_checked() {
    let e = err(&MINIMAL.replace(
        "brokers = \"k:9092\"",
        "brokers = \"k:9092\"\ntopic = \"bad topic.{aggregate_type}\"",
    ));
    assert!(e.contains("sink.topic") && e.contains("' '"), "{e}");
    let e = err(&MINIMAL.replace(
        "brokers = \"k:9092\"",
        "brokers = \"k:9092\"\ntopic = \"t.{aggregate}\"",
    ));
    assert!(e.contains("unknown placeholder {aggregate}"), "{e}");
    let e = err(&MINIMAL.replace(
        "brokers = \"k:9092\"",
        "brokers = \"k:9092\"\nproperties = { acks = \"1\" }",
    ));
    assert!(e.contains("sink.properties.acks"), "{e}");
    let e = err(&MINIMAL.replace("type = \"kafka\"", "type = \"nats\""));
    assert!(e.contains("nats"), "{e}");
    let rabbit = r#"
[database]
url = "postgres://relay@db/app"
[sink]
type = "rabbitmq"
url = "http://guest:guest@h"
exchange_type = "round-robin"
"#;
    let e = err(rabbit);
    assert!(e.contains("sink.url") && e.contains("amqp"), "{e}");
    assert!(e.contains("sink.exchange_type"), "{e}");
    assert!(
        !e.contains("guest:guest"),
        "secrets stay out of errors: {e}"
    );
}

const RABBIT: &str = r#"
[database]
url = "postgres://relay@db/app"
[sink]
type = "rabbitmq"
url = "amqps://guest:guest@h:5671/%2f"
"#;

#[test]
fn broker_tls_keys_need_a_tls_url_and_come_in_pairs() {
    let c = load_str(&format!("{RABBIT}tls_ca = \"/ca.pem\"\n")).unwrap();
    let SinkConfig::RabbitMq(r) = &c.sink else {
        panic!()
    };
    assert_eq!(r.tls_ca.as_deref(), Some(std::path::Path::new("/ca.pem")));
    let e = err(&format!("{RABBIT}tls_ca = \"/ca.pem\"\n").replace("amqps://", "amqp://"));
    assert!(e.contains("sink.tls_ca: is only used with amqps://"), "{e}");
    let e = err(&format!("{RABBIT}tls_cert = \"/c.pem\"\n"));
    assert!(
        e.contains("sink.tls_cert: is set but sink.tls_key is not"),
        "{e}"
    );
    let e = err(&format!("{MINIMAL}ssl_key = \"/k.pem\"\n"));
    assert!(
        e.contains("sink.ssl_key: is only used with sink.security_protocol ssl or sasl_ssl"),
        "{e}"
    );
    assert!(
        e.contains("sink.ssl_key: is set but sink.ssl_cert is not"),
        "{e}"
    );
}

#[test]
fn kafka_sasl_keys_are_checked_together() {
    let e = err(&format!(
        "{MINIMAL}sasl_username = \"relay\"\nsasl_password = \"s3cret\"\n"
    ));
    assert!(
        e.contains("sink.sasl_username: is only used with sink.security_protocol sasl_plaintext or sasl_ssl, not plaintext"),
        "{e}"
    );
    assert!(e.contains("sink.sasl_password: is only used"), "{e}");
    let e = err(&format!(
        "{MINIMAL}security_protocol = \"sasl_ssl\"\nsasl_mechanism = \"SCRAM-SHA-512\"\nsasl_password = \"s3cret\"\n"
    ));
    assert!(
        e.contains("sink.sasl_username: is required by SASL mechanism SCRAM-SHA-512"),
        "{e}"
    );
    let e = err(&format!("{MINIMAL}sasl_mechanism = \"SCRAM-SHA-1\"\n"));
    assert!(
        e.contains("sink.sasl_mechanism") && e.contains("SCRAM-SHA-256"),
        "{e}"
    );
    let e = err(&format!(
        "{MINIMAL}[sink.properties]\n\"sasl.password\" = \"s3cret\"\n"
    ));
    assert!(
        e.contains(
            "sink.properties.sasl.password: is set from a sink key; use sink.sasl_password instead"
        ),
        "{e}"
    );
    let ok = load_str(&format!(
        "{MINIMAL}security_protocol = \"sasl_ssl\"\nsasl_mechanism = \"SCRAM-SHA-256\"\nsasl_username = \"relay\"\nsasl_password = \"s3cret\"\nssl_ca = \"/ca.pem\"\n"
    ))
    .unwrap();
    let SinkConfig::Kafka(k) = &ok.sink else {
        panic!()
    };
    assert_eq!(k.security_protocol, SecurityProtocol::SaslSsl);
    assert_eq!(k.sasl_mechanism, Some(SaslMechanism::ScramSha256));
}

#[test]
fn the_sasl_password_never_prints() {
    let sasl = format!(
        "{MINIMAL}security_protocol = \"sasl_plaintext\"\nsasl_username = \"relay\"\nsasl_password = \"s3cret\"\n"
    );
    let shown = format!("{:?}", load_str(&sasl).unwrap());
    assert!(!shown.contains("s3cret"), "{shown}");
    assert!(shown.contains("sasl_password: Some(***)"), "{shown}");
    // Refused configs: the password is neither in the problem list nor in a type error.
    let e = err(&sasl.replace("sasl_plaintext", "plaintext"));
    assert!(
        e.contains("sink.sasl_password") && !e.contains("s3cret"),
        "{e}"
    );
    let e = err(&format!("{sasl}linger = \"soon\"\n"));
    assert!(!e.contains("s3cret"), "{e}");
}

/// The properties the delivery guarantee rests on cannot be overridden in
/// `sink.properties`: one key, one partition, in order, never timed out.
#[test]
fn properties_the_guarantees_rest_on_are_refused() {
    for property in [
        "enable.idempotence",
        "acks",
        "enable.gapless.guarantee",
        "message.timeout.ms",
        "delivery.timeout.ms",
        "queue.buffering.max.messages",
        "delivery.report.only.error",
        "transactional.id",
        "retries",
        "message.send.max.retries",
    ] {
        let e = err(&format!(
            "{MINIMAL}\n[sink.properties]\n\"{property}\" = \"1\"\n"
        ));
        assert!(
            e.contains(&format!("sink.properties.{property}: is set by the relay")),
            "{property}: {e}"
        );
    }
    // One key, one partition: only the random partitioner breaks that.
    let e = err(&format!(
        "{MINIMAL}\n[sink.properties]\npartitioner = \"random\"\n"
    ));
    assert!(
        e.contains("sink.properties.partitioner: \"random\" spreads"),
        "{e}"
    );
    load_str(&format!(
        "{MINIMAL}\n[sink.properties]\npartitioner = \"murmur2_random\"\n"
    ))
    .expect("a key-based partitioner is accepted");
}

/// A producer queue smaller than the largest message would answer "queue
/// full" to that message for ever: refused, with the size it needs.
#[test]
fn a_producer_queue_smaller_than_the_largest_message_is_refused() {
    let queue = |kbytes: &str| {
        format!("{MINIMAL}\n[sink.properties]\n\"queue.buffering.max.kbytes\" = \"{kbytes}\"\n")
    };
    let e = err(&queue("512"));
    assert!(
        e.contains("sink.properties.queue.buffering.max.kbytes: 512 KiB is less than sink.message_max_bytes (1000000 bytes)")
            && e.contains("at least 977"),
        "{e}"
    );
    let e = err(&queue("lots"));
    assert!(e.contains("must be a whole number of KiB"), "{e}");
    load_str(&queue("977")).expect("room for the largest message");
}

/// A RabbitMQ URL without `//` has no host (and no password field, so the
/// message would show it whole): refused, and the password not shown.
#[test]
fn a_rabbitmq_url_without_a_host_is_refused_without_its_password() {
    let e = err(&RABBIT.replace("amqps://guest:guest@h:5671/%2f", "amqp:relay:s3cret@rabbit"));
    assert!(e.contains("sink.url") && e.contains("names no host"), "{e}");
    assert!(!e.contains("s3cret"), "{e}");
}
