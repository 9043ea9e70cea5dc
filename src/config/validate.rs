//! Range and cross-field checks, each problem naming its dotted key.

use super::SslMode;
use super::load::Problem;
use super::{Config, SinkConfig};
use std::time::Duration;

/// The allowed range of each integer key: `validate` checks values against
/// it, and the loader names it for a value that does not even fit the key's
/// type (a negative count). `sink_type` is `kafka` or `rabbitmq`.
pub(super) fn integer_range(key: &str, sink_type: Option<&str>) -> Option<(u64, u64)> {
    Some(match key {
        "source.batch_size" => (1, 10_000),
        "retention.batch_size" => (1, 100_000),
        "retention.partition_premake" => (1, 1000),
        "dead_letter.max_attempts" => (1, 1000),
        "relay.max_in_flight" => (1, 100_000),
        "relay.max_in_flight_bytes" => (1 << 20, 16 << 30),
        // Its upper bound is relay.max_in_flight; only the type is known here.
        "relay.max_in_flight_per_aggregate" => (1, 100_000),
        "relay.shards" => (1, 256),
        "telemetry.otlp.max_queue_size" => (1, 1_000_000),
        "sink.message_max_bytes" if sink_type == Some("rabbitmq") => (1_000, 512 * 1024 * 1024),
        // librdkafka's message.max.bytes, at most 1,000,000,000, is set to
        // this plus 64 KiB of room for the request around it.
        "sink.message_max_bytes" => (1_000, 1_000_000_000 - 64 * 1024),
        _ => return None,
    })
}

pub(super) struct Checker(Vec<Problem>);

impl Checker {
    pub(super) fn problem(&mut self, key: &str, message: impl Into<String>) {
        self.0.push(Problem {
            key: key.to_owned(),
            message: message.into(),
        });
    }

    pub(super) fn range<T: PartialOrd + std::fmt::Display>(
        &mut self,
        key: &str,
        value: T,
        min: T,
        max: T,
    ) {
        if value < min || value > max {
            self.problem(key, format!("{value} is out of range; use {min} to {max}"));
        }
    }

    /// An integer key against its range in [`integer_range`].
    pub(super) fn count(&mut self, key: &str, value: u64, sink_type: &str) {
        if let Some((min, max)) = integer_range(key, Some(sink_type)) {
            self.range(key, value, min, max);
        }
    }

    pub(super) fn duration(&mut self, key: &str, value: Duration, min: Duration, max: Duration) {
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

    /// A cap that must not be below its base (`base_key`), which may be the
    /// key the user set: the message names both.
    pub(super) fn cap(
        &mut self,
        key: &str,
        value: Duration,
        base: (&str, Duration),
        max: Duration,
    ) {
        if value < base.1 {
            self.problem(
                key,
                format!(
                    "{} is below {} ({}); raise it or lower {}",
                    humantime::format_duration(value),
                    base.0,
                    humantime::format_duration(base.1),
                    base.0
                ),
            );
        } else {
            self.duration(key, value, base.1, max);
        }
    }

    /// A client certificate and its key go together.
    pub(super) fn both_or_neither(&mut self, cert: (&str, bool), key: (&str, bool)) {
        if cert.1 != key.1 {
            let (present, missing) = if cert.1 {
                (cert.0, key.0)
            } else {
                (key.0, cert.0)
            };
            self.problem(
                present,
                format!("is set but {missing} is not: a client certificate needs both"),
            );
        }
    }
}

pub(super) const MS: Duration = Duration::from_millis(1);
pub(super) const SEC: Duration = Duration::from_secs(1);
pub(super) const HOUR: Duration = Duration::from_secs(3600);

impl Config {
    /// Checks every value; returns all problems found, not just the first.
    pub fn validate(&self) -> Result<(), Vec<Problem>> {
        let mut c = Checker(Vec::new());
        self.check_database(&mut c);
        self.check_outbox(&mut c);
        self.check_source_and_relay(&mut c);
        match &self.sink {
            SinkConfig::Kafka(k) => k.check(&mut c),
            SinkConfig::RabbitMq(r) => r.check(&mut c),
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
        } else if let Some(word) = bare_target(&self.log.level) {
            c.problem(
                "log.level",
                format!(
                    "{word:?} is not a level (trace, debug, info, warn, error, off): a word alone names a \
                     module to log at every level, and nothing else would be logged, errors included; \
                     write a level, or \"info,{word}=debug\" for a module"
                ),
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
            if otlp.ca.is_some() {
                c.problem(
                    "telemetry.otlp.ca",
                    "is set but telemetry.otlp.endpoint is not; set the endpoint or remove ca",
                );
            }
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
            Ok(u) if u.scheme() == "http" && otlp.ca.is_some() => c.problem(
                "telemetry.otlp.ca",
                "applies to https:// endpoints only; use https:// in telemetry.otlp.endpoint or remove ca",
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
                // The relay sets TLS from database.sslmode: an sslmode in
                // the URL that says otherwise would be overridden silently
                // (a `require` there weakened to the default `prefer`).
                let in_url = match pg.get_ssl_mode() {
                    tokio_postgres::config::SslMode::Disable => SslMode::Disable,
                    tokio_postgres::config::SslMode::Require => SslMode::Require,
                    _ => SslMode::Prefer,
                };
                // What the connection asks of tokio-postgres: the verify
                // modes are `require` there, with the relay's own checks.
                let relay = match db.sslmode {
                    SslMode::VerifyCa | SslMode::VerifyFull => SslMode::Require,
                    other => other,
                };
                if in_url != SslMode::Prefer && in_url != relay {
                    c.problem(
                        "database.url",
                        format!(
                            "sets sslmode={in_url}, but the relay takes TLS from database.sslmode ({}); remove sslmode from the URL and set database.sslmode = \"{in_url}\" (or verify-ca, verify-full)",
                            db.sslmode
                        ),
                    );
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
        if db.sslmode == SslMode::VerifyCa && db.sslrootcert.is_none() {
            // As libpq refuses since PostgreSQL 16: the system's store
            // without a host name check trusts any public certificate.
            c.problem(
                "database.sslmode",
                "verify-ca without database.sslrootcert would accept a certificate any public CA issued, \
                 for any host; set database.sslrootcert to your server's CA, or use verify-full",
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
        self.check_source(c);
        self.check_cdc(c);
        self.check_retention(c);
        self.check_http(c);
        self.check_dead_letter(c);
        self.check_relay(c);
    }

    /// `[source]`, `[source.polling]`, `[source.auto]`.
    fn check_source(&self, c: &mut Checker) {
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
                "\"auto\" needs relay.mark = \"update\", \"delete\" or \"ranges\": switching between CDC and polling relies on the table to say what is unsent; use source.mode = \"cdc\" with mark = \"none\"",
            );
        }
        if self.relay.mark == super::MarkMode::None && s.mode == super::SourceMode::Polling {
            c.problem(
                "relay.mark",
                "\"none\" needs source.mode = \"cdc\": the polling source relies on marking to know what was sent",
            );
        }
    }

    /// `[source.cdc]`.
    fn check_cdc(&self, c: &mut Checker) {
        let s = &self.source;
        let cdc = &s.cdc;
        c.duration(
            "source.cdc.status_interval",
            cdc.status_interval,
            100 * MS,
            10 * 60 * SEC,
        );
        c.duration(
            "source.cdc.batch_wait",
            cdc.batch_wait,
            Duration::ZERO,
            100 * MS,
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
                "\"recreate\" needs relay.mark = \"update\", \"delete\" or \"ranges\": with \"none\" the events in the removed WAL exist nowhere else, so a new slot would skip them; use \"stop\"",
            );
        }
        if cdc.messages && s.mode != super::SourceMode::Cdc {
            c.problem(
                "source.cdc.messages",
                "true needs source.mode = \"cdc\": logical messages exist only in the WAL, which polling does not read (and \"auto\" may fall back to polling)",
            );
        }
        if cdc.messages && cdc.on_lost_slot == Some(super::LostSlot::Recreate) {
            c.problem(
                "source.cdc.on_lost_slot",
                "\"recreate\" cannot be used with source.cdc.messages = true: messages exist only in the WAL, so a new slot would skip those in the removed WAL; use \"stop\"",
            );
        }
        if let Some(prefix) = &cdc.message_prefix {
            if !cdc.messages {
                c.problem(
                    "source.cdc.message_prefix",
                    "has no effect unless source.cdc.messages = true; set that too, or remove this key",
                );
            } else if prefix.trim().is_empty() || prefix.len() > 200 {
                c.problem("source.cdc.message_prefix", "use 1 to 200 characters");
            } else if prefix == super::HEARTBEAT_MESSAGE_PREFIX {
                c.problem(
                    "source.cdc.message_prefix",
                    "\"outbox-relay\" is the prefix of the relay's own heartbeat messages; choose another",
                );
            }
        }
    }

    /// `[retention]`.
    fn check_retention(&self, c: &mut Checker) {
        let sink = self.sink.kind();
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
        if t.mode == super::RetentionMode::Partitions {
            c.duration(
                "retention.partition_interval",
                t.partition_interval,
                60 * SEC,
                366 * 24 * HOUR,
            );
            if !t.partition_interval.as_secs().is_multiple_of(60)
                || t.partition_interval.subsec_nanos() != 0
            {
                c.problem(
                    "retention.partition_interval",
                    "must be a whole number of minutes (partitions are named by their start, to the minute)",
                );
            }
            c.count(
                "retention.partition_premake",
                t.partition_premake.into(),
                sink,
            );
            check_partitions_ahead(t, c);
            if self.relay.mark == super::MarkMode::None {
                c.problem(
                    "retention.mode",
                    "\"partitions\" needs relay.mark = \"update\", \"delete\" or \"ranges\": with \"none\" no row is known to be sent, so no partition could ever be dropped",
                );
            }
        }
    }

    /// `[http]`.
    fn check_http(&self, c: &mut Checker) {
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
    }

    /// `[dead_letter]`.
    fn check_dead_letter(&self, c: &mut Checker) {
        let s = &self.source;
        let sink = self.sink.kind();
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
    }

    /// `[relay]`.
    fn check_relay(&self, c: &mut Checker) {
        let s = &self.source;
        let sink = self.sink.kind();
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
        c.duration("relay.fold_interval", r.fold_interval, SEC, 60 * SEC);
        c.duration(
            "relay.shutdown_timeout",
            r.shutdown_timeout,
            Duration::ZERO,
            HOUR,
        );
        c.duration("relay.retry_base", r.retry_base, MS, 10 * 60 * SEC);
        c.cap(
            "relay.retry_max",
            r.retry_max,
            ("relay.retry_base", r.retry_base),
            HOUR,
        );
        c.duration("relay.reject_retry_base", r.reject_retry_base, MS, HOUR);
        c.cap(
            "relay.reject_retry_max",
            r.reject_retry_max,
            ("relay.reject_retry_base", r.reject_retry_base),
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

/// Each scheduled run creates partitions `partition_premake` intervals
/// ahead; the next run must come before they run out (an insert then finds
/// no partition and fails), with room for one missed run: so
/// `retention.interval` is at most half of that span.
fn check_partitions_ahead(t: &super::RetentionConfig, c: &mut Checker) {
    if !t.enabled || t.partition_premake == 0 || t.partition_interval < 60 * SEC {
        return;
    }
    let ahead = t.partition_interval.saturating_mul(t.partition_premake);
    if t.interval <= ahead / 2 {
        return;
    }
    let premake = (2 * t.interval.as_secs()).div_ceil(t.partition_interval.as_secs());
    c.problem(
        "retention.interval",
        format!(
            "{} is more than half of retention.partition_interval × retention.partition_premake \
             ({} × {} = {}), so the partitions made ahead could run out between two runs and \
             inserts fail; set retention.interval to {} or less, or retention.partition_premake \
             to {premake} or more",
            humantime::format_duration(t.interval),
            humantime::format_duration(t.partition_interval),
            t.partition_premake,
            humantime::format_duration(ahead),
            humantime::format_duration(ahead / 2),
        ),
    );
}

/// A directive of a log filter that is a word alone and not a level
/// (`warning`, `verbose`): read as a module name, it turns every other
/// log line off.
fn bare_target(filter: &str) -> Option<&str> {
    const LEVELS: &[&str] = &["trace", "debug", "info", "warn", "error", "off"];
    filter.split(',').map(str::trim).find(|d| {
        !d.is_empty()
            && !d.contains(['=', '[', ':'])
            && !d
                .trim_start_matches('+')
                .chars()
                .all(|c| c.is_ascii_digit())
            && !LEVELS.iter().any(|l| l.eq_ignore_ascii_case(d))
    })
}
