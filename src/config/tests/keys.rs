//! Every key, by name: documented in the README, refused with its key when of
//! the wrong type or out of range, from the file or the environment.

use super::*;

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
pub(super) fn set_key(table: &mut toml::Table, key: &str, value: toml::Value) {
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
    let cases: [(&str, toml::Value); 12] = [
        ("source.batch_size", 0.into()),
        ("source.batch_size", 1_000_000.into()),
        ("relay.max_in_flight", 0.into()),
        ("relay.shards", 0.into()),
        ("dead_letter.max_attempts", 0.into()),
        ("sink.message_max_bytes", 10.into()),
        // librdkafka's limit, less the room around a message.
        ("sink.message_max_bytes", 999_934_465.into()),
        ("relay.confirm_timeout", "1ms".into()),
        ("source.polling.poll_interval", "0s".into()),
        ("database.connect_timeout", "2h".into()),
        ("source.cdc.status_interval", "1ms".into()),
        ("source.cdc.batch_wait", "101ms".into()),
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
        (" 0 ", "0 is out of range; use 1 to 10000"),
        ("2.5", "\"2.5\" is not a whole number; use 1 to 10000"),
        ("yes", "\"yes\" is not a whole number; use 1 to 10000"),
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

/// `config/reference.toml` holds the defaults: with only its required keys
/// (the database URL and the brokers) the relay is configured exactly as
/// with the whole file.
#[test]
fn the_reference_file_holds_the_defaults() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/reference.toml")).unwrap();
    let required = r#"
[database]
url = "postgres://relay@127.0.0.1:5432/app"

[sink]
type = "kafka"
brokers = "127.0.0.1:9092"
"#;
    // Values the relay derives when a key is unset (the optional columns'
    // names, names made from the table's), and an example property.
    let mut file: toml::Table = toml::from_str(&text).unwrap();
    for (section, keys) in [
        (
            "outbox.columns",
            &["event_version", "headers", "created_at"][..],
        ),
        ("source.polling", &["notify_channel"][..]),
        ("source.cdc", &["slot", "publication"][..]),
        ("sink", &["properties"][..]),
    ] {
        let mut t = &mut file;
        for part in section.split('.') {
            t = t.get_mut(part).and_then(toml::Value::as_table_mut).unwrap();
        }
        for k in keys {
            assert!(t.remove(*k).is_some(), "{section}.{k} is in the file");
        }
    }
    let reduced = toml::to_string(&file).unwrap();
    let (whole, defaults) = (load_str(&reduced).unwrap(), load_str(required).unwrap());
    assert_eq!(
        format!("{whole:#?}"),
        format!("{defaults:#?}"),
        "config/reference.toml differs from the defaults"
    );
}

/// The README's configuration table shows each value of
/// `config/reference.toml` as its key's default (the first literal of the
/// default column).
#[test]
fn the_readme_shows_the_defaults() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(root.join("config/reference.toml")).unwrap();
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let documented = |key: &str| -> Option<String> {
        let row = readme
            .lines()
            .find(|l| l.starts_with(&format!("| `{key}` |")))?;
        let cell = row.split(" | ").nth(1)?;
        let literal = cell.strip_prefix('`')?.split('`').next()?;
        Some(literal.to_owned())
    };
    let table: toml::Table = toml::from_str(&text).unwrap();
    let mut compared = 0;
    let mut walk = vec![(String::new(), &table)];
    while let Some((prefix, t)) = walk.pop() {
        for (k, v) in t {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            let value = match v {
                toml::Value::Table(inner) if key != "sink.properties" => {
                    walk.push((key, inner));
                    continue;
                }
                toml::Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            // Required keys have no default; the README says so instead.
            if ["database.url", "sink.brokers"].contains(&key.as_str()) {
                continue;
            }
            // A row whose default is described in words, or made from a
            // name (`outbox_relay_<table>`), shows no literal to compare.
            let Some(shown) = documented(&key).filter(|d| !d.contains('<')) else {
                continue;
            };
            assert_eq!(shown, value, "README's default for `{key}`");
            compared += 1;
        }
    }
    assert!(compared > 40, "only {compared} defaults compared");
}

/// Environment variables are text: a value that looks like a number stays
/// as written where a key takes text (a password `0123`, a topic `007`),
/// and is read as a number or a flag where a key takes one, in `[sink]` too.
#[test]
fn environment_values_stay_as_written_where_a_key_takes_text() {
    let env = |vars: &[(&str, &str)]| {
        super::load::load_str_with_env(MINIMAL, vars)
            .map(|mut c| c.remove(0))
            .unwrap_or_else(|e| panic!("{vars:?}: {e}"))
    };
    let c = env(&[
        ("OUTBOX_RELAY__DATABASE__PASSWORD", "0123"),
        ("OUTBOX_RELAY__SINK__SECURITY_PROTOCOL", "sasl_ssl"),
        ("OUTBOX_RELAY__SINK__SASL_PASSWORD", "1e3"),
        ("OUTBOX_RELAY__SINK__SASL_USERNAME", "+5"),
        ("OUTBOX_RELAY__SINK__TOPIC", "007"),
        ("OUTBOX_RELAY__SINK__CLIENT_ID", "Infinity"),
        ("OUTBOX_RELAY__SINK__MESSAGE_MAX_BYTES", "2048"),
        ("OUTBOX_RELAY__SOURCE__BATCH_SIZE", "42"),
        ("OUTBOX_RELAY__SOURCE__CDC__CREATE_SLOT", "false"),
    ]);
    assert_eq!(
        c.database.password.as_ref().map(|p| p.expose()),
        Some("0123")
    );
    let SinkConfig::Kafka(k) = &c.sink else {
        panic!("a kafka sink")
    };
    assert_eq!(k.sasl_password.as_ref().map(|p| p.expose()), Some("1e3"));
    assert_eq!(k.sasl_username.as_deref(), Some("+5"));
    assert_eq!(k.topic.to_string(), "007");
    assert_eq!(k.client_id, "Infinity");
    assert_eq!(k.message_max_bytes, 2048);
    assert_eq!(c.source.batch_size, 42);
    assert!(!c.source.cdc.create_slot);
}

/// `[sink]` is read through JSON: its numbers and flags are read out of an
/// environment variable's text too, and text that is neither is refused,
/// naming the variable.
#[test]
fn sink_numbers_and_flags_are_read_from_environment_text() {
    let rabbit = MINIMAL.replace(
        "type = \"kafka\"\nbrokers = \"k:9092\"",
        "type = \"rabbitmq\"\nurl = \"amqp://localhost\"",
    );
    let c = super::load::load_str_with_env(
        &rabbit,
        &[
            ("OUTBOX_RELAY__SINK__DECLARE_EXCHANGE", "TRUE"),
            ("OUTBOX_RELAY__SINK__MESSAGE_MAX_BYTES", "4096"),
            ("OUTBOX_RELAY__SINK__EXCHANGE", "0x10"),
        ],
    )
    .unwrap()
    .remove(0);
    let SinkConfig::RabbitMq(r) = &c.sink else {
        panic!("a rabbitmq sink")
    };
    assert!(r.declare_exchange);
    assert_eq!(r.message_max_bytes, 4096);
    assert_eq!(r.exchange.to_string(), "0x10");

    // Text where a key takes a number or a flag is refused, naming the variable.
    for (var, value, says) in [
        (
            "OUTBOX_RELAY__SINK__MESSAGE_MAX_BYTES",
            "big",
            "\"big\" is not a whole number",
        ),
        (
            "OUTBOX_RELAY__SINK__MESSAGE_MAX_BYTES",
            "-1",
            "-1 is out of range",
        ),
        (
            "OUTBOX_RELAY__SINK__DECLARE_EXCHANGE",
            "maybe",
            "true or false",
        ),
    ] {
        let e = super::load::load_str_with_env(&rabbit, &[(var, value)])
            .expect_err("refused")
            .to_string();
        assert!(
            e.contains(&format!(
                "sink.{} (set by {var}): ",
                var[20..].to_lowercase()
            )) && e.contains(says),
            "{var}={value}: {e}"
        );
    }
}

#[test]
fn a_log_level_that_is_no_level_is_refused() {
    for level in ["warning", "verbose", "info,verbose"] {
        let e = err(&format!("{MINIMAL}\n[log]\nlevel = \"{level}\"\n"));
        assert!(
            e.contains("log.level: \"") && e.contains("is not a level"),
            "{level}: {e}"
        );
    }
    for level in [
        "warn",
        "INFO",
        "info,outbox_relay=debug",
        "outbox_relay::relay=trace",
        "off",
        "3",
    ] {
        load_str(&format!("{MINIMAL}\n[log]\nlevel = \"{level}\"\n"))
            .unwrap_or_else(|e| panic!("{level}: {e}"));
    }
}

#[test]
fn a_count_written_as_a_fraction_or_a_flag_is_refused() {
    let e = err(&format!(
        "{MINIMAL}\n[relay]\nshards = 2.5\n[dead_letter]\nmax_attempts = true\n\
         [pipelines.a.source]\nbatch_size = 499.6\n"
    ));
    load_str(&format!("{MINIMAL}\n[relay]\nshards = 4.0\n")).expect("4.0 is whole");
    for expected in [
        "pipelines.a: relay.shards: 2.5 is not a whole number; use 1 to 256",
        "pipelines.a: dead_letter.max_attempts: true is not a whole number; use 1 to 1000",
        "pipelines.a: source.batch_size: 499.6 is not a whole number; use 1 to 10000",
    ] {
        assert!(e.contains(expected), "{expected}: {e}");
    }
}

#[test]
fn the_environment_wins_over_a_pipelines_table() {
    let file = format!(
        "{MINIMAL}\n[pipelines.a.source]\nbatch_size = 50\n[pipelines.b.outbox]\ntable = \"public.b\"\n"
    );
    let top = [("OUTBOX_RELAY__SOURCE__BATCH_SIZE", "100")];
    let c = super::load::load_str_with_env(&file, &top).unwrap();
    let sizes: Vec<(&str, usize)> = c
        .iter()
        .map(|c| (c.name.as_str(), c.source.batch_size))
        .collect();
    assert_eq!(sizes, [("a", 100), ("b", 100)]);
    // A pipeline's own variable wins over the top-level one.
    let both = [
        ("OUTBOX_RELAY__SOURCE__BATCH_SIZE", "100"),
        ("OUTBOX_RELAY__PIPELINES__A__SOURCE__BATCH_SIZE", "7"),
    ];
    let c = super::load::load_str_with_env(&file, &both).unwrap();
    assert_eq!(c[0].source.batch_size, 7);
    assert_eq!(c[1].source.batch_size, 100);
    // A top-level Kafka variable does not reach a RabbitMQ pipeline.
    let rabbit = format!(
        "{MINIMAL}\n[pipelines.k.outbox]\ntable = \"public.k\"\n\
         [pipelines.r.sink]\ntype = \"rabbitmq\"\nurl = \"amqp://mq\"\n"
    );
    let c = super::load::load_str_with_env(&rabbit, &[("OUTBOX_RELAY__SINK__BROKERS", "k2:9092")])
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c[1].sink.kind(), "rabbitmq");
}

#[test]
fn an_environment_count_with_spaces_is_read() {
    let c =
        super::load::load_str_with_env(MINIMAL, &[("OUTBOX_RELAY__SOURCE__BATCH_SIZE", " 42 ")])
            .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c[0].source.batch_size, 42);
}

#[test]
fn a_sink_without_type_at_the_top_is_shared_by_the_pipelines() {
    let c = load_all_str(
        "[database]\nurl = \"postgres://relay@db/app\"\n[sink]\nbrokers = \"k:9092\"\n\
         [pipelines.a.sink]\ntype = \"kafka\"\n\
         [pipelines.b.outbox]\ntable = \"public.b\"\n[pipelines.b.sink]\ntype = \"kafka\"\n",
    )
    .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(c.len(), 2);
}
