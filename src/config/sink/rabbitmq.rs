//! `[sink]` with `type = "rabbitmq"`: its keys, their defaults, and their
//! checks. It lives in the configuration layer for the reason given in
//! `kafka.rs`; the connection, TLS and publishing are in `sink/rabbitmq/`.

use super::destination;
use crate::config::SecretUrl;
use crate::config::Template;
use crate::config::validate::Checker;
use serde::Deserialize;
use std::path::PathBuf;

/// `[sink]` with `type = "rabbitmq"`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RabbitMqConfig {
    /// `amqp://user:password@host:port/vhost` (or `amqps://`).
    pub url: SecretUrl,
    /// Exchange per event; placeholders `{aggregate_type}` and `{event_type}`.
    #[serde(default = "defaults::exchange")]
    pub exchange: Template,
    /// Routing key per event; placeholders `{aggregate_type}` and `{event_type}`.
    #[serde(default = "defaults::routing_key")]
    pub routing_key: Template,
    /// Declare each exchange (durable, of `exchange_type`) when first used, instead of
    /// requiring it to exist.
    #[serde(default, deserialize_with = "super::flag")]
    pub declare_exchange: bool,
    #[serde(default = "defaults::exchange_type")]
    pub exchange_type: String,
    /// Largest message body the relay sends (RabbitMQ's own `max_message_size` defaults to 128 MiB).
    #[serde(
        default = "defaults::rabbitmq_message_max_bytes",
        deserialize_with = "super::whole_number"
    )]
    pub message_max_bytes: usize,
    /// CA certificates (PEM) trusted for an `amqps://` broker's certificate, in
    /// addition to the system's.
    #[serde(default)]
    pub tls_ca: Option<PathBuf>,
    /// Client certificate (PEM, chain after the leaf) for brokers that ask for one.
    #[serde(default)]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM, unencrypted) of `tls_cert`.
    #[serde(default)]
    pub tls_key: Option<PathBuf>,
}

impl RabbitMqConfig {
    /// Range and cross-field checks of `[sink]` for RabbitMQ.
    pub(in crate::config) fn check(&self, c: &mut Checker) {
        match url::Url::parse(self.url.expose()) {
            Ok(u) if (u.scheme() == "amqp" || u.scheme() == "amqps") && u.has_host() => {}
            Ok(u) if u.scheme() == "amqp" || u.scheme() == "amqps" => c.problem(
                "sink.url",
                "names no host: use amqp://user:password@host:5672/vhost",
            ),
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
            destination::check_template_literals(&self.exchange, destination::rabbitmq_exchange)
        {
            c.problem("sink.exchange", e);
        }
        if let Err(e) = destination::check_template_literals(
            &self.routing_key,
            destination::rabbitmq_routing_key,
        ) {
            c.problem("sink.routing_key", e);
        }
        if !["direct", "topic", "fanout", "headers"].contains(&self.exchange_type.as_str()) {
            c.problem(
                "sink.exchange_type",
                "must be direct, topic, fanout or headers",
            );
        }
        c.count(
            "sink.message_max_bytes",
            self.message_max_bytes as u64,
            "rabbitmq",
        );
        // An unparseable URL is reported above, not blamed on these keys.
        let plain = url::Url::parse(self.url.expose()).is_ok_and(|u| u.scheme() != "amqps");
        for (key, set) in [
            ("sink.tls_ca", self.tls_ca.is_some()),
            ("sink.tls_cert", self.tls_cert.is_some()),
            ("sink.tls_key", self.tls_key.is_some()),
        ] {
            if set && plain {
                c.problem(
                    key,
                    "is only used with amqps://; change sink.url to amqps:// (RabbitMQ's TLS port, 5671 by default) or remove it",
                );
            }
        }
        c.both_or_neither(
            ("sink.tls_cert", self.tls_cert.is_some()),
            ("sink.tls_key", self.tls_key.is_some()),
        );
    }
}

mod defaults {
    use crate::config::Template;
    use crate::config::sink::template;

    pub fn exchange() -> Template {
        template("outbox")
    }
    pub fn routing_key() -> Template {
        template("{aggregate_type}.{event_type}")
    }
    pub fn exchange_type() -> String {
        "topic".into()
    }
    pub fn rabbitmq_message_max_bytes() -> usize {
        16 * 1024 * 1024
    }
}
