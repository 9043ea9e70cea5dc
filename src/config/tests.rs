use super::*;

const MINIMAL: &str = r#"
[database]
url = "postgres://relay:s3cret@db:5432/app"

[sink]
type = "kafka"
brokers = "k:9092"
"#;

fn err(toml: &str) -> String {
    load_str(toml)
        .expect_err("config should be refused")
        .to_string()
}

#[test]
fn every_shipped_example_loads() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            load_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            n += 1;
        }
    }
    assert!(n >= 3, "expected the example configs in {}", dir.display());
}

#[test]
fn defaults_apply() {
    let c = load_str(MINIMAL).unwrap();
    assert_eq!(c.outbox.table.to_string(), "public.outbox");
    assert_eq!(c.source.mode, SourceMode::Polling);
    assert_eq!(c.source.batch_size, 500);
    assert_eq!(c.relay.max_in_flight, 2000);
    assert_eq!(c.relay.confirm_timeout, Duration::from_secs(30));
    let SinkConfig::Kafka(k) = &c.sink else {
        panic!()
    };
    assert_eq!(k.topic.as_str(), "outbox.event.{aggregate_type}");
}

#[test]
fn unknown_keys_are_refused_with_their_path() {
    let e = err(&format!(
        "{MINIMAL}\n[source.polling]\npoll_intervall = \"1s\"\n"
    ));
    assert!(e.contains("poll_intervall"), "{e}");
    assert!(e.contains("source.polling"), "{e}");
    let e = err(&format!("{MINIMAL}\n[relay]\nmax_inflight = 3\n"));
    assert!(e.contains("relay") && e.contains("max_inflight"), "{e}");
    let e = err(&MINIMAL.replace("brokers", "broker"));
    assert!(e.contains("broker"), "{e}");
}

#[test]
fn wrong_types_and_durations_name_the_key() {
    let e = err(&format!("{MINIMAL}\n[relay]\nconfirm_timeout = \"soon\"\n"));
    assert!(e.contains("relay.confirm_timeout"), "{e}");
    let e = err(&format!("{MINIMAL}\n[source]\nbatch_size = \"many\"\n"));
    assert!(e.contains("source.batch_size"), "{e}");
    let e = err(&format!("{MINIMAL}\n[source]\nmode = \"tail\"\n"));
    assert!(e.contains("source.mode") && e.contains("polling"), "{e}");
}

#[test]
fn out_of_range_values_are_listed_together() {
    let e = err(&format!(
        "{MINIMAL}\n[source]\nbatch_size = 0\n[relay]\nmax_in_flight = 0\nretry_base = \"10s\"\nretry_max = \"1s\"\n"
    ));
    assert!(e.contains("3 problems") || e.contains("problems"), "{e}");
    assert!(e.contains("source.batch_size: 0 is out of range"), "{e}");
    assert!(e.contains("relay.max_in_flight"), "{e}");
    assert!(e.contains("relay.retry_max"), "{e}");
}

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

#[test]
fn secrets_never_print() {
    let c = load_str(MINIMAL).unwrap();
    let shown = format!("{c:?}");
    assert!(!shown.contains("s3cret"), "{shown}");
    assert!(shown.contains("relay:***@db"), "{shown}");
    let e = err(&MINIMAL.replace(
        "postgres://relay:s3cret@db:5432/app",
        "postgres://relay:s3cret@db:notaport/app",
    ));
    assert!(!e.contains("s3cret"), "{e}");
}

#[test]
fn database_url_problems() {
    let e = err(&MINIMAL.replace(
        "postgres://relay:s3cret@db:5432/app",
        "postgres://db/app?sslmode=verify-full",
    ));
    assert!(
        e.contains("database.url") && e.contains("database.sslmode"),
        "{e}"
    );
    let e = err(&MINIMAL.replace("/app", ""));
    assert!(e.contains("names no database"), "{e}");
}

#[test]
fn column_mapping_is_checked() {
    let e = err(&format!(
        "{MINIMAL}\n[outbox.columns]\naggregate_id = \"aggregate_type\"\n"
    ));
    assert!(
        e.contains("outbox.columns.aggregate_id") && e.contains("already mapped"),
        "{e}"
    );
    let e = err(&format!("{MINIMAL}\n[outbox]\ntable = \"a.b.c\"\n"));
    assert!(e.contains("outbox.table") || e.contains("a.b.c"), "{e}");
}

#[test]
fn extra_columns_are_read_and_checked_by_key() {
    let ok = load_str(&format!(
        "{MINIMAL}\n[[outbox.columns.extra]]\ncolumn = \"tenant_id\"\nheader = \"tenant\"\nattribute = \"tenantid\"\n"
    ))
    .unwrap();
    assert_eq!(
        ok.outbox.columns.extra,
        vec![super::ExtraColumn {
            column: "tenant_id".into(),
            header: Some("tenant".into()),
            attribute: Some("tenantid".into()),
        }]
    );
    let e = err(&format!(
        "{MINIMAL}
[[outbox.columns.extra]]
column = \"tenant_id\"
attribute = \"Tenant_Id\"
[[outbox.columns.extra]]
column = \"region\"
header = \"event_id\"
attribute = \"type\"
[[outbox.columns.extra]]
column = \"tenant_id\"
"
    ));
    for expected in [
        "outbox.columns.extra[0].attribute: \"Tenant_Id\" is not a CloudEvents attribute name",
        "outbox.columns.extra[1].attribute: \"type\" is an attribute the relay sets",
        "outbox.columns.extra[1].header: \"event_id\" is a header the relay sets",
        "outbox.columns.extra[2].column: column \"tenant_id\" is already listed in extra[0]",
        "outbox.columns.extra[2].column: publishes nothing",
    ] {
        assert!(e.contains(expected), "{expected:?} not in: {e}");
    }
    let e = err(&format!(
        "{MINIMAL}\n[[outbox.columns.extra]]\ncolumn = \"t\"\nheadr = \"x\"\n"
    ));
    assert!(
        e.contains("outbox.columns.extra") && e.contains("headr"),
        "{e}"
    );
}

#[test]
fn routing_columns_are_read_and_checked_by_key() {
    let ok = load_str(&format!(
        "{MINIMAL}\n[outbox.columns]\ndestination = \"topic\"\nkey = \"partition_key\"\n"
    ))
    .unwrap();
    assert_eq!(ok.outbox.columns.destination.as_deref(), Some("topic"));
    assert_eq!(ok.outbox.columns.key.as_deref(), Some("partition_key"));
    let absent = load_str(MINIMAL).unwrap();
    assert_eq!(
        (absent.outbox.columns.destination, absent.outbox.columns.key),
        (None, None),
        "no routing column by default"
    );
    let e = err(&format!(
        "{MINIMAL}\n[outbox.columns]\ndestination = \"relay_seq\"\nkey = \"\"\n"
    ));
    for expected in [
        "outbox.columns.destination: relay_seq is a column the relay owns",
        "outbox.columns.key: a column name must be 1 to 63 bytes long",
    ] {
        assert!(e.contains(expected), "{expected:?} not in: {e}");
    }
}

/// Dotted keys of a TOML file, including keys in commented-out `# key = value` lines.
fn keys_of(text: &str) -> Vec<String> {
    fn walk(prefix: &str, table: &toml::Table, out: &mut Vec<String>) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v {
                // A map of free-form entries is one documented key.
                toml::Value::Table(t) if key != "sink.properties" => walk(&key, t, out),
                _ => out.push(key),
            }
        }
    }
    let mut out = Vec::new();
    walk("", &toml::from_str(text).unwrap(), &mut out);
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if let Some(s) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = s.to_owned();
        } else if let Some(rest) = line.strip_prefix("# ")
            && let Some((k, _)) = rest.split_once(" = ")
            && k.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        {
            out.push(format!("{section}.{k}"));
        }
    }
    out
}

#[test]
fn the_readme_documents_every_key() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let mut checked = 0;
    for file in ["reference.toml", "polling-rabbitmq.toml"] {
        let text = std::fs::read_to_string(root.join("config").join(file)).unwrap();
        for key in keys_of(&text) {
            assert!(
                readme.contains(&format!("`{key}`")),
                "README.md does not document `{key}` (from config/{file})"
            );
            checked += 1;
        }
    }
    assert!(checked > 40, "only {checked} keys found");
}

/// Sets a dotted key in a TOML table, creating sections as needed.
fn set_key(table: &mut toml::Table, key: &str, value: toml::Value) {
    let mut parts: Vec<&str> = key.split('.').collect();
    let leaf = parts.pop().unwrap();
    let mut t = table;
    for p in parts {
        t = t
            .entry(p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .unwrap();
    }
    t.insert(leaf.to_owned(), value);
}

#[test]
fn every_key_of_the_wrong_type_is_refused_by_name() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    for file in ["reference.toml", "polling-rabbitmq.toml"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        for key in keys_of(&text) {
            if key == "sink.type" {
                continue; // chooses the variant; covered by sink_values_are_checked
            }
            let mut table: toml::Table = toml::from_str(&text).unwrap();
            set_key(
                &mut table,
                &key,
                toml::Value::Array(vec![1.into(), 2.into()]),
            );
            let broken = toml::to_string(&table).unwrap();
            let e = load_str(&broken).expect_err(&format!("{key} = [1, 2] must be refused"));
            let shown = e.to_string();
            // A map key (sink.properties) is reported by its entry.
            assert!(
                shown.contains(&key),
                "{file}: the error for {key} does not name it: {shown}"
            );
        }
    }
}

#[test]
fn numeric_keys_out_of_range_are_refused_by_name() {
    let base: toml::Table = toml::from_str(
        &std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/reference.toml"),
        )
        .unwrap(),
    )
    .unwrap();
    let cases: [(&str, toml::Value); 10] = [
        ("source.batch_size", 0.into()),
        ("source.batch_size", 1_000_000.into()),
        ("relay.max_in_flight", 0.into()),
        ("relay.shards", 0.into()),
        ("dead_letter.max_attempts", 0.into()),
        ("sink.message_max_bytes", 10.into()),
        ("relay.confirm_timeout", "1ms".into()),
        ("source.polling.poll_interval", "0s".into()),
        ("database.connect_timeout", "2h".into()),
        ("source.cdc.status_interval", "1ms".into()),
    ];
    for (key, value) in cases {
        let mut table = base.clone();
        set_key(&mut table, key, value.clone());
        let e = load_str(&toml::to_string(&table).unwrap())
            .expect_err(&format!("{key} = {value} must be refused"))
            .to_string();
        assert!(
            e.contains(&format!("{key}: ")) && e.contains("out of range"),
            "{key} = {value}: {e}"
        );
    }
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

#[test]
fn a_lost_slot_is_recreated_only_when_rows_are_marked() {
    let cdc = format!("{MINIMAL}\n[source]\nmode = \"cdc\"\n");
    let c = load_str(&cdc).unwrap();
    assert!(c.source.cdc.recreates_lost_slot(c.relay.mark));
    let c = load_str(&format!("{cdc}[relay]\nmark = \"none\"\n")).unwrap();
    assert!(!c.source.cdc.recreates_lost_slot(c.relay.mark));
    let c = load_str(&format!("{cdc}[source.cdc]\non_lost_slot = \"stop\"\n")).unwrap();
    assert!(!c.source.cdc.recreates_lost_slot(c.relay.mark));
    let e = err(&format!(
        "{cdc}[source.cdc]\non_lost_slot = \"recreate\"\n[relay]\nmark = \"none\"\n"
    ));
    assert!(
        e.contains("source.cdc.on_lost_slot") && e.contains("\"stop\""),
        "{e}"
    );
    let e = err(&format!("{cdc}[source.cdc]\non_lost_slot = \"heal\"\n"));
    assert!(e.contains("on_lost_slot") && e.contains("recreate"), "{e}");
}

#[test]
fn logical_messages_need_cdc_a_kept_slot_and_a_prefix_of_their_own() {
    let cdc = format!("{MINIMAL}\n[source]\nmode = \"cdc\"\n[source.cdc]\nmessages = true\n");
    let c = load_str(&cdc).unwrap();
    assert_eq!(
        c.source.cdc.message_prefix(&c.outbox.table).as_deref(),
        Some("outbox_relay_outbox")
    );
    // Messages live in the WAL alone: a lost slot stops the relay by default.
    assert!(!c.source.cdc.recreates_lost_slot(c.relay.mark));
    let c = load_str(&format!("{cdc}message_prefix = \"shop events\"\n")).unwrap();
    assert_eq!(
        c.source.cdc.message_prefix(&c.outbox.table).as_deref(),
        Some("shop events")
    );
    for (toml, key, says) in [
        (
            format!("{MINIMAL}\n[source.cdc]\nmessages = true\n"),
            "source.cdc.messages",
            "source.mode = \"cdc\"",
        ),
        (
            format!("{cdc}on_lost_slot = \"recreate\"\n"),
            "source.cdc.on_lost_slot",
            "\"stop\"",
        ),
        (
            format!("{cdc}message_prefix = \"outbox-relay\"\n"),
            "source.cdc.message_prefix",
            "heartbeat",
        ),
        (
            format!("{cdc}message_prefix = \" \"\n"),
            "source.cdc.message_prefix",
            "1 to 200",
        ),
        (
            format!("{MINIMAL}\n[source]\nmode = \"cdc\"\n[source.cdc]\nmessage_prefix = \"x\"\n"),
            "source.cdc.message_prefix",
            "messages = true",
        ),
    ] {
        let e = err(&toml);
        assert!(e.contains(key) && e.contains(says), "{e}");
    }
}

#[test]
fn auto_mode_needs_marked_rows_and_probes_every_30s_by_default() {
    let auto = format!("{MINIMAL}\n[source]\nmode = \"auto\"\n");
    let c = load_str(&auto).unwrap();
    assert_eq!(c.source.mode, SourceMode::Auto);
    assert_eq!(c.source.auto.probe_interval, Duration::from_secs(30));
    let c = load_str(&format!("{auto}[relay]\nmark = \"delete\"\n")).unwrap();
    assert_eq!(c.relay.mark, MarkMode::Delete);

    let e = err(&format!("{auto}[relay]\nmark = \"none\"\n"));
    assert!(
        e.contains("source.mode: \"auto\" needs relay.mark = \"update\" or \"delete\""),
        "{e}"
    );
    // One problem, not a second one about mark = "none" without CDC.
    assert!(!e.contains("relay.mark:"), "{e}");

    let e = err(&format!("{auto}[source.auto]\nprobe_interval = \"10ms\"\n"));
    assert!(
        e.contains("source.auto.probe_interval: ") && e.contains("out of range"),
        "{e}"
    );
    // What CDC refuses, auto refuses too: it may read by CDC.
    let e = err(&format!("{auto}[relay]\nshards = 2\n"));
    assert!(e.contains("relay.shards"), "{e}");
    let e = err(&format!("{auto}[dead_letter]\naggregate = \"wait\"\n"));
    assert!(e.contains("dead_letter.aggregate"), "{e}");
}

#[test]
fn negative_counts_are_all_reported_with_their_ranges_in_key_order() {
    let text = format!(
        "{MINIMAL}\n[source]\nbatch_size = -5\n[source.polling]\npoll_interval = \"5 parsecs\"\n\
         [relay]\nmax_in_flight = -1\nshards = 0\n[dead_letter]\nmax_attempts = -3\n"
    );
    let first = err(&text);
    let lines: Vec<&str> = first.lines().collect();
    assert_eq!(lines[0], "the configuration has 5 problems:", "{first}");
    assert_eq!(
        lines[1..4],
        [
            "  - dead_letter.max_attempts: -3 is out of range; use 1 to 1000",
            "  - relay.max_in_flight: -1 is out of range; use 1 to 100000",
            "  - relay.shards: 0 is out of range; use 1 to 256",
        ],
        "{first}"
    );
    assert_eq!(
        lines[4], "  - source.batch_size: -5 is out of range; use 1 to 10000",
        "{first}"
    );
    assert!(
        lines[5].starts_with("  - source.polling.poll_interval: "),
        "{first}"
    );
    // The config crate's maps iterate in a different order each run; the report must not.
    for _ in 0..20 {
        assert_eq!(err(&text), first);
    }
}

#[test]
fn a_count_that_is_not_a_number_gets_its_range() {
    let e = err(&format!("{MINIMAL}\n[source]\nbatch_size = \"many\"\n"));
    assert!(
        e.contains("source.batch_size: \"many\" is not a whole number; use 1 to 10000"),
        "{e}"
    );
    let e = err(&format!(
        "{MINIMAL}\n[relay]\nmax_in_flight_per_aggregate = -2\n"
    ));
    assert!(
        e.contains("relay.max_in_flight_per_aggregate: -2 is out of range"),
        "{e}"
    );
}

#[test]
fn a_bad_duration_lists_the_accepted_units() {
    let e = err(&format!(
        "{MINIMAL}\n[source.polling]\npoll_interval = \"5 parsecs\"\n"
    ));
    assert!(
        e.contains("source.polling.poll_interval: \"5 parsecs\" is not a duration"),
        "{e}"
    );
    for unit in ["\"500ms\"", "\"30s\"", "\"5m\"", "\"1h\"", "ms, s, m, h"] {
        assert!(e.contains(unit), "{unit} missing from: {e}");
    }
    let e = err(&format!("{MINIMAL}\n[relay]\nconfirm_timeout = 30\n"));
    assert!(
        e.contains("relay.confirm_timeout: 30 has no unit") && e.contains("\"30s\""),
        "{e}"
    );
    let e = err(&format!(
        "{MINIMAL}\n[source.cdc]\nheartbeat_interval = \"often\"\n"
    ));
    assert!(
        e.contains("source.cdc.heartbeat_interval: \"often\" is not a duration"),
        "{e}"
    );
    let c = load_str(&format!(
        "{MINIMAL}\n[source.cdc]\nheartbeat_interval = \"90s\"\n"
    ))
    .unwrap();
    assert_eq!(
        c.source.cdc.heartbeat_interval,
        Some(Duration::from_secs(90))
    );
}

#[test]
fn a_bad_environment_override_names_its_variable() {
    let file = format!("{MINIMAL}\n[source]\nbatch_size = 100\n");
    for (value, message) in [
        ("abc", "\"abc\" is not a whole number; use 1 to 10000"),
        ("0", "0 is out of range; use 1 to 10000"),
        ("-5", "-5 is out of range; use 1 to 10000"),
    ] {
        let e =
            super::load::load_str_with_env(&file, &[("OUTBOX_RELAY__SOURCE__BATCH_SIZE", value)])
                .expect_err("a bad override must be refused")
                .to_string();
        assert!(
            e.contains(&format!(
                "source.batch_size (set by OUTBOX_RELAY__SOURCE__BATCH_SIZE): {message}"
            )),
            "{value}: {e}"
        );
    }
    // A bad value in the file is not blamed on the environment.
    let e = super::load::load_str_with_env(
        &format!("{MINIMAL}\n[source]\nbatch_size = 0\n"),
        &[("OUTBOX_RELAY__RELAY__MAX_IN_FLIGHT", "10")],
    )
    .expect_err("batch_size = 0 must be refused")
    .to_string();
    assert!(
        e.contains("  - source.batch_size: 0 is out of range"),
        "{e}"
    );
    // A good override applies.
    let c = super::load::load_str_with_env(&file, &[("OUTBOX_RELAY__SOURCE__BATCH_SIZE", "42")])
        .unwrap();
    assert_eq!(c[0].source.batch_size, 42);
}

#[test]
fn pipelines_report_every_bad_key_each() {
    let e = err(&format!(
        "{MINIMAL}\n[pipelines.b.source]\nbatch_size = -1\n[pipelines.a.relay]\nmax_in_flight = -1\n"
    ));
    let a = e
        .find("pipelines.a: relay.max_in_flight: -1 is out of range")
        .expect(&e);
    let b = e
        .find("pipelines.b: source.batch_size: -1 is out of range")
        .expect(&e);
    assert!(a < b, "{e}");
}

#[test]
fn partition_retention_keys_are_checked_by_name() {
    let ok = load_str(&format!(
        "{MINIMAL}\n[retention]\nmode = \"partitions\"\npartition_interval = \"6h\"\npartition_premake = 2\n"
    ))
    .unwrap();
    assert_eq!(ok.retention.mode, RetentionMode::Partitions);
    assert_eq!(
        ok.retention.partition_interval,
        Duration::from_secs(6 * 3600)
    );
    let e = err(&format!("{MINIMAL}\n[retention]\nmode = \"drop\"\n"));
    assert!(
        e.contains("retention.mode") && e.contains("partitions"),
        "{e}"
    );
    let e = err(&format!(
        "{MINIMAL}\n[retention]\nmode = \"partitions\"\npartition_interval = \"30s\"\npartition_premake = 0\n"
    ));
    assert!(e.contains("retention.partition_interval"), "{e}");
    assert!(e.contains("retention.partition_premake"), "{e}");
    let e = err(&format!(
        "{MINIMAL}\n[retention]\nmode = \"partitions\"\npartition_interval = \"90s\"\n"
    ));
    assert!(
        e.contains("retention.partition_interval") && e.contains("whole number of minutes"),
        "{e}"
    );
    let e = err(&format!(
        "{MINIMAL}\n[relay]\nmark = \"none\"\n[retention]\nmode = \"partitions\"\n"
    ));
    assert!(
        e.contains("retention.mode") && e.contains("relay.mark"),
        "{e}"
    );
    // Rows mode ignores the partition keys.
    load_str(&format!(
        "{MINIMAL}\n[retention]\npartition_interval = \"30s\"\n"
    ))
    .unwrap();
}

#[test]
fn otlp_keys_are_checked_by_name() {
    let c = load_str(MINIMAL).unwrap();
    assert_eq!(c.telemetry.otlp.endpoint, None, "export is off by default");
    assert_eq!(c.telemetry.otlp.max_queue_size, 2048);
    let with = |lines: &str| format!("{MINIMAL}\n[telemetry.otlp]\n{lines}\n");
    let c = load_str(&with("endpoint = \"http://collector:4318\"")).unwrap();
    assert_eq!(
        c.telemetry.otlp.endpoint.as_deref(),
        Some("http://collector:4318")
    );
    for (bad, says) in [
        ("endpoint = \"collector:4318\"", "is not http or https"),
        (
            "endpoint = \"grpc://collector:4317\"",
            "is not http or https",
        ),
        ("endpoint = \"not a url\"", "not a URL"),
        (
            "endpoint = \"http://collector:4318/?x=1\"",
            "query or fragment",
        ),
        ("service_name = \" \"", "must not be empty"),
        ("max_queue_size = 0", "out of range"),
        ("flush = true", "unknown key"),
    ] {
        let e = err(&with(bad));
        assert!(
            e.contains("telemetry.otlp.") && e.contains(says),
            "{bad}: {e}"
        );
    }
    let e = err(&format!(
        "{MINIMAL}\n[pipelines.a.telemetry.otlp]\nendpoint = \"http://c:4318\"\n"
    ));
    assert!(e.contains("configures the whole process"), "{e}");
}
