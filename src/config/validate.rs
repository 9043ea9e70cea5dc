//! Range and cross-field checks, each problem naming its dotted key.

use super::load::Problem;
use super::{Config, KafkaConfig, RabbitMqConfig, SinkConfig};
use crate::db::tls::SslMode;
use crate::envelope::destination;
use std::time::Duration;

/// librdkafka properties the relay sets itself because its guarantees depend on them.
pub const PROTECTED_KAFKA_PROPERTIES: &[&str] = &[
    "bootstrap.servers",
    "metadata.broker.list",
    "enable.idempotence",
    "acks",
    "request.required.acks",
    "enable.gapless.guarantee",
    "message.timeout.ms",
    "delivery.timeout.ms",
    "max.in.flight.requests.per.connection",
    "max.in.flight",
    "message.max.bytes",
    "linger.ms",
    "queue.buffering.max.ms",
    "client.id",
    "enable.auto.commit",
];

/// The allowed range of each integer key: `validate` checks values against
/// it, and the loader names it for a value that does not even fit the key's
/// type (a negative count). `sink_type` is `kafka` or `rabbitmq`.
pub(super) fn integer_range(key: &str, sink_type: Option<&str>) -> Option<(u64, u64)> {
    Some(match key {
        "source.batch_size" => (1, 10_000),
        "retention.batch_size" => (1, 100_000),
        "dead_letter.max_attempts" => (1, 1000),
        "relay.max_in_flight" => (1, 100_000),
        "relay.max_in_flight_bytes" => (1 << 20, 16 << 30),
        // Its upper bound is relay.max_in_flight; only the type is known here.
        "relay.max_in_flight_per_aggregate" => (1, 100_000),
        "relay.shards" => (1, 256),
        "telemetry.otlp.max_queue_size" => (1, 1_000_000),
        "sink.message_max_bytes" if sink_type == Some("rabbitmq") => (1_000, 512 * 1024 * 1024),
        "sink.message_max_bytes" => (1_000, 1_000_000_000),
        _ => return None,
    })
}

struct Checker(Vec<Problem>);

impl Checker {
    fn problem(&mut self, key: &str, message: impl Into<String>) {
        self.0.push(Problem {
            key: key.to_owned(),
            message: message.into(),
        });
    }

    fn range<T: PartialOrd + std::fmt::Display>(&mut self, key: &str, value: T, min: T, max: T) {
        if value < min || value > max {
            self.problem(key, format!("{value} is out of range; use {min} to {max}"));
        }
    }

    /// An integer key against its range in [`integer_range`].
    fn count(&mut self, key: &str, value: u64, sink_type: &str) {
        if let Some((min, max)) = integer_range(key, Some(sink_type)) {
            self.range(key, value, min, max);
        }
    }

    fn duration(&mut self, key: &str, value: Duration, min: Duration, max: Duration) {
        if value < min || value > max {
            self.problem(
                key,
                format!(
                    "{} is out of range; use {} to {}",
                    humantime::format_duration(value),
                    humantime::format_duration(min),
                    humantime::format_duration(max)
                ),
            );
        }
    }
}

const MS: Duration = Duration::from_millis(1);
const SEC: Duration = Duration::from_secs(1);
const HOUR: Duration = Duration::from_secs(3600);

impl Config {
    /// Checks every value; returns all problems found, not just the first.
    pub fn validate(&self) -> Result<(), Vec<Problem>> {
        let mut c = Checker(Vec::new());
        self.check_database(&mut c);
        self.check_outbox(&mut c);
        self.check_source_and_relay(&mut c);
        match &self.sink {
            SinkConfig::Kafka(k) => check_kafka(&mut c, k),
            SinkConfig::RabbitMq(r) => check_rabbitmq(&mut c, r),
        }
        if self.envelope.source.trim().is_empty() {
            c.problem(
                "envelope.source",
                "must not be empty (CloudEvents requires a source)",
            );
        }
        self.check_telemetry(&mut c);
        if let Err(e) = tracing_subscriber::EnvFilter::try_new(&self.log.level) {
            c.problem(
                "log.level",
                format!("not a valid filter ({e}); try \"info\""),
            );
        }
        if c.0.is_empty() { Ok(()) } else { Err(c.0) }
    }

    fn check_telemetry(&self, c: &mut Checker) {
        let otlp = &self.telemetry.otlp;
        c.count(
            "telemetry.otlp.max_queue_size",
            otlp.max_queue_size as u64,
            self.sink.kind(),
        );
        if otlp.service_name.trim().is_empty() {
            c.problem("telemetry.otlp.service_name", "must not be empty");
        }
        let Some(endpoint) = &otlp.endpoint else {
            return;
        };
        let fix = "use the base URL of an OTLP/HTTP receiver, like http://localhost:4318";
        match url::Url::parse(endpoint) {
            Ok(u) if !matches!(u.scheme(), "http" | "https") => c.problem(
                "telemetry.otlp.endpoint",
                format!("scheme {:?} is not http or https; {fix}", u.scheme()),
            ),
            Ok(u) if u.host_str().is_none_or(str::is_empty) => {
                c.problem("telemetry.otlp.endpoint", format!("has no host; {fix}"))
            }
            Ok(u) if u.query().is_some() || u.fragment().is_some() => c.problem(
                "telemetry.otlp.endpoint",
                format!("must not have a query or fragment; {fix}"),
            ),
            Ok(_) => {}
            Err(e) => c.problem("telemetry.otlp.endpoint", format!("not a URL ({e}); {fix}")),
        }
    }

    fn check_database(&self, c: &mut Checker) {
        let db = &self.database;
        match db.url.expose().parse::<tokio_postgres::Config>() {
            Err(e) => {
                let hint = if db.url.expose().contains("sslmode") {
                    "; set TLS with database.sslmode instead of in the URL"
                } else {
                    ""
                };
                c.problem(
                    "database.url",
                    format!("not a PostgreSQL connection URL ({e}){hint}"),
                );
            }
            Ok(pg) => {
                if pg.get_dbname().is_none() {
                    c.problem("database.url", "names no database; add /dbname to the URL");
                }
                if pg.get_user().is_none() {
                    c.problem("database.url", "names no user; add user@ to the URL");
                }
            }
        }
        c.duration(
            "database.connect_timeout",
            db.connect_timeout,
            100 * MS,
            10 * 60 * SEC,
        );
        if db.sslcert.is_some() != db.sslkey.is_some() {
            c.problem(
                "database.sslcert",
                "database.sslcert and database.sslkey go together; set both or neither",
            );
        }
        if db.sslrootcert.is_some()
            && !matches!(db.sslmode, SslMode::VerifyCa | SslMode::VerifyFull)
        {
            c.problem(
                "database.sslrootcert",
                "is only used with sslmode verify-ca or verify-full; set database.sslmode",
            );
        }
    }

    fn check_outbox(&self, c: &mut Checker) {
        for (key, message) in self.outbox.columns.problems() {
            // `key` is relative to the section.
            c.problem(&format!("outbox.columns.{key}"), message);
        }
    }

    fn check_source_and_relay(&self, c: &mut Checker) {
        let s = &self.source;
        let sink = self.sink.kind();
        c.count("source.batch_size", s.batch_size as u64, sink);
        c.duration(
            "source.polling.poll_interval",
            s.polling.poll_interval,
            10 * MS,
            HOUR,
        );
        if let Some(ch) = &s.polling.notify_channel
            && (ch.is_empty() || ch.len() > 63)
        {
            c.problem(
                "source.polling.notify_channel",
                "must be 1 to 63 bytes long",
            );
        }
        c.duration(
            "source.auto.probe_interval",
            s.auto.probe_interval,
            SEC,
            HOUR,
        );
        if s.mode == super::SourceMode::Auto && self.relay.mark == super::MarkMode::None {
            c.problem(
                "source.mode",
                "\"auto\" needs relay.mark = \"update\" or \"delete\": switching between CDC and polling relies on the table to say what is unsent; use source.mode = \"cdc\" with mark = \"none\"",
            );
        }
        let cdc = &s.cdc;
        c.duration(
            "source.cdc.status_interval",
            cdc.status_interval,
            100 * MS,
            10 * 60 * SEC,
        );
        if let Some(h) = cdc.heartbeat_interval {
            c.duration("source.cdc.heartbeat_interval", h, SEC, 24 * HOUR);
        }
        for (key, name) in [
            ("source.cdc.slot", &cdc.slot),
            ("source.cdc.publication", &cdc.publication),
        ] {
            if let Some(n) = name
                && (n.is_empty()
                    || n.len() > 63
                    || !n
                        .chars()
                        .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_'))
            {
                c.problem(key, "use 1 to 63 characters of a-z, 0-9 and _");
            }
        }
        if self.relay.mark == super::MarkMode::None
            && cdc.on_lost_slot == Some(super::LostSlot::Recreate)
        {
            c.problem(
                "source.cdc.on_lost_slot",
                "\"recreate\" needs relay.mark = \"update\" or \"delete\": with \"none\" the events in the removed WAL exist nowhere else, so a new slot would skip them; use \"stop\"",
            );
        }
        if self.relay.mark == super::MarkMode::None && s.mode == super::SourceMode::Polling {
            c.problem(
                "relay.mark",
                "\"none\" needs source.mode = \"cdc\": the polling source relies on marking to know what was sent",
            );
        }
        let t = &self.retention;
        c.duration("retention.interval", t.interval, SEC, 24 * HOUR);
        c.duration(
            "retention.sent_window",
            t.sent_window,
            Duration::ZERO,
            3650 * 24 * HOUR,
        );
        c.duration(
            "retention.dead_letter_window",
            t.dead_letter_window,
            Duration::ZERO,
            3650 * 24 * HOUR,
        );
        c.count("retention.batch_size", t.batch_size as u64, sink);
        c.duration("retention.pause", t.pause, Duration::ZERO, 60 * SEC);
        c.duration(
            "http.sample_interval",
            self.http.sample_interval,
            100 * MS,
            HOUR,
        );
        if self.http.enabled && self.http.address.parse::<std::net::SocketAddr>().is_err() {
            c.problem(
                "http.address",
                "must be an IP address and port, like 127.0.0.1:9187",
            );
        }
        let d = &self.dead_letter;
        c.count("dead_letter.max_attempts", d.max_attempts.into(), sink);
        c.duration(
            "dead_letter.refresh_interval",
            d.refresh_interval,
            100 * MS,
            HOUR,
        );
        if d.aggregate == super::HoldPolicy::Wait && s.mode.may_use_cdc() {
            c.problem(
                "dead_letter.aggregate",
                "\"wait\" needs source.mode = \"polling\": with CDC (also in \"auto\"), held events would keep the slot from advancing; use \"follow\"",
            );
        }
        if d.table.as_ref() == Some(&self.outbox.table) {
            c.problem("dead_letter.table", "must not be the outbox table itself");
        }
        let r = &self.relay;
        c.count("relay.max_in_flight", r.max_in_flight as u64, sink);
        c.count(
            "relay.max_in_flight_bytes",
            r.max_in_flight_bytes as u64,
            sink,
        );
        if let Some(n) = r.max_in_flight_per_aggregate {
            c.range(
                "relay.max_in_flight_per_aggregate",
                n,
                1,
                r.max_in_flight.max(1),
            );
        }
        c.duration("relay.confirm_timeout", r.confirm_timeout, SEC, HOUR);
        c.duration(
            "relay.shutdown_timeout",
            r.shutdown_timeout,
            Duration::ZERO,
            HOUR,
        );
        c.duration("relay.retry_base", r.retry_base, MS, 10 * 60 * SEC);
        c.duration("relay.retry_max", r.retry_max, r.retry_base, HOUR);
        c.duration("relay.reject_retry_base", r.reject_retry_base, MS, HOUR);
        c.duration(
            "relay.reject_retry_max",
            r.reject_retry_max,
            r.reject_retry_base,
            24 * HOUR,
        );
        c.duration(
            "relay.standby_poll",
            r.standby_poll,
            100 * MS,
            10 * 60 * SEC,
        );
        c.duration(
            "relay.ownership_lease",
            r.ownership_lease,
            500 * MS,
            10 * 60 * SEC,
        );
        c.count("relay.shards", r.shards.into(), sink);
        if r.shards > 1 && s.mode.may_use_cdc() {
            c.problem(
                "relay.shards",
                "shards need source.mode = \"polling\": a replication slot is one ordered stream with one reader",
            );
        }
    }
}

fn check_kafka(c: &mut Checker, k: &KafkaConfig) {
    if k.brokers.split(',').all(|b| b.trim().is_empty()) {
        c.problem("sink.brokers", "must list at least one host:port");
    }
    if let Err(e) = destination::check_template_literals(&k.topic, destination::kafka_topic) {
        c.problem("sink.topic", e);
    }
    c.count(
        "sink.message_max_bytes",
        k.message_max_bytes as u64,
        "kafka",
    );
    c.duration("sink.delivery_timeout", k.delivery_timeout, SEC, HOUR);
    c.duration("sink.linger", k.linger, Duration::ZERO, 5 * SEC);
    if k.client_id.is_empty() {
        c.problem("sink.client_id", "must not be empty");
    }
    for key in k.properties.keys() {
        if PROTECTED_KAFKA_PROPERTIES.contains(&key.as_str()) {
            c.problem(
                &format!("sink.properties.{key}"),
                "is set by the relay because its delivery guarantee depends on it; remove it (see the sink keys for the ones you can tune)",
            );
        } else if let Some((_, typed)) =
            KafkaConfig::TYPED_PROPERTIES.iter().find(|(p, _)| p == key)
        {
            c.problem(
                &format!("sink.properties.{key}"),
                format!("is set from a sink key; use {typed} instead"),
            );
        }
    }
    check_kafka_security(c, k);
}

/// SASL keys need a `sasl_*` protocol, SSL keys an `ssl` one, and SASL needs
/// its user name and password.
fn check_kafka_security(c: &mut Checker, k: &KafkaConfig) {
    let protocol = k.security_protocol;
    if !protocol.uses_sasl() {
        for (key, set) in [
            ("sink.sasl_mechanism", k.sasl_mechanism.is_some()),
            ("sink.sasl_username", k.sasl_username.is_some()),
            ("sink.sasl_password", k.sasl_password.is_some()),
        ] {
            if set {
                c.problem(
                    key,
                    format!(
                        "is only used with sink.security_protocol sasl_plaintext or sasl_ssl, not {}",
                        protocol.as_str()
                    ),
                );
            }
        }
    } else {
        let mechanism = k.sasl_mechanism.unwrap_or_default().as_str();
        if k.sasl_username.as_deref().is_none_or(str::is_empty) {
            c.problem(
                "sink.sasl_username",
                format!("is required by SASL mechanism {mechanism}"),
            );
        }
        if k.sasl_password.as_ref().is_none_or(|p| p.is_empty()) {
            c.problem(
                "sink.sasl_password",
                format!("is required by SASL mechanism {mechanism}"),
            );
        }
    }
    if !protocol.uses_tls() {
        for (key, set) in [
            ("sink.ssl_ca", k.ssl_ca.is_some()),
            ("sink.ssl_cert", k.ssl_cert.is_some()),
            ("sink.ssl_key", k.ssl_key.is_some()),
        ] {
            if set {
                c.problem(
                    key,
                    format!(
                        "is only used with sink.security_protocol ssl or sasl_ssl, not {}",
                        protocol.as_str()
                    ),
                );
            }
        }
    }
    both_or_neither(
        c,
        ("sink.ssl_cert", k.ssl_cert.is_some()),
        ("sink.ssl_key", k.ssl_key.is_some()),
    );
}

/// A client certificate and its key go together.
fn both_or_neither(c: &mut Checker, cert: (&str, bool), key: (&str, bool)) {
    if cert.1 != key.1 {
        let (present, missing) = if cert.1 {
            (cert.0, key.0)
        } else {
            (key.0, cert.0)
        };
        c.problem(
            present,
            format!("is set but {missing} is not: a client certificate needs both"),
        );
    }
}

fn check_rabbitmq(c: &mut Checker, r: &RabbitMqConfig) {
    match url::Url::parse(r.url.expose()) {
        Ok(u) if u.scheme() == "amqp" || u.scheme() == "amqps" => {}
        Ok(u) => c.problem(
            "sink.url",
            format!("scheme {:?} is not amqp:// or amqps://", u.scheme()),
        ),
        Err(e) => c.problem(
            "sink.url",
            format!("not a URL ({e}): use amqp://user:password@host:5672/vhost"),
        ),
    }
    if let Err(e) =
        destination::check_template_literals(&r.exchange, destination::rabbitmq_exchange)
    {
        c.problem("sink.exchange", e);
    }
    if let Err(e) =
        destination::check_template_literals(&r.routing_key, destination::rabbitmq_routing_key)
    {
        c.problem("sink.routing_key", e);
    }
    if !["direct", "topic", "fanout", "headers"].contains(&r.exchange_type.as_str()) {
        c.problem(
            "sink.exchange_type",
            "must be direct, topic, fanout or headers",
        );
    }
    c.count(
        "sink.message_max_bytes",
        r.message_max_bytes as u64,
        "rabbitmq",
    );
    // An unparseable URL is reported above, not blamed on these keys.
    let plain = url::Url::parse(r.url.expose()).is_ok_and(|u| u.scheme() != "amqps");
    for (key, set) in [
        ("sink.tls_ca", r.tls_ca.is_some()),
        ("sink.tls_cert", r.tls_cert.is_some()),
        ("sink.tls_key", r.tls_key.is_some()),
    ] {
        if set && plain {
            c.problem(
                key,
                "is only used with amqps://; change sink.url to amqps:// (RabbitMQ's TLS port, 5671 by default) or remove it",
            );
        }
    }
    both_or_neither(
        c,
        ("sink.tls_cert", r.tls_cert.is_some()),
        ("sink.tls_key", r.tls_key.is_some()),
    );
}
