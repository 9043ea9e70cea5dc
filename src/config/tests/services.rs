//! `[pipelines]`, `[retention]` partitions, `[telemetry.otlp]`.

use super::*;

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

/// With 15m partitions made 1 ahead, a run every hour leaves inserts
/// without a partition half the time: the schedule must come at least
/// twice per span made ahead.
#[test]
fn partitions_made_ahead_outlast_two_retention_intervals() {
    let with = |lines: &str| {
        format!(
            "{MINIMAL}\n[retention]\nmode = \"partitions\"\npartition_interval = \"15m\"\n{lines}\n"
        )
    };
    let e = err(&with("partition_premake = 1\ninterval = \"1h\""));
    assert!(
        e.contains("retention.interval: 1h is more than half of retention.partition_interval × retention.partition_premake (15m × 1 = 15m)")
            && e.contains("set retention.interval to 7m 30s or less, or retention.partition_premake to 8 or more"),
        "{e}"
    );
    // At most half: room for one missed run.
    load_str(&with("partition_premake = 1\ninterval = \"7m 30s\"")).unwrap();
    let e = err(&with("partition_premake = 1\ninterval = \"8m\""));
    assert!(e.contains("retention.interval"), "{e}");
    load_str(&with("partition_premake = 8\ninterval = \"1h\"")).unwrap();
    // Without the schedule (cron runs `retention --once`), or in rows mode,
    // the interval does not matter.
    load_str(&with(
        "partition_premake = 1\ninterval = \"1h\"\nenabled = false",
    ))
    .unwrap();
    load_str(&format!(
        "{MINIMAL}\n[retention]\npartition_interval = \"15m\"\npartition_premake = 1\ninterval = \"1h\"\n"
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
        (
            "ca = \"/ca.pem\"",
            "is set but telemetry.otlp.endpoint is not",
        ),
        (
            "endpoint = \"http://c:4318\"\nca = \"/ca.pem\"",
            "applies to https:// endpoints only",
        ),
    ] {
        let e = err(&with(bad));
        assert!(
            e.contains("telemetry.otlp.") && e.contains(says),
            "{bad}: {e}"
        );
    }
    let c = load_str(&with("endpoint = \"https://c:4318\"\nca = \"/etc/ca.pem\"")).unwrap();
    assert_eq!(
        c.telemetry.otlp.ca.as_deref(),
        Some(std::path::Path::new("/etc/ca.pem"))
    );
    let e = err(&format!(
        "{MINIMAL}\n[pipelines.a.telemetry.otlp]\nendpoint = \"http://c:4318\"\n"
    ));
    assert!(e.contains("configures the whole process"), "{e}");
}

/// Environment variables reach pipelines named in lowercase (their keys
/// are lowercased): one aimed at `Orders` is refused, naming the
/// variable, instead of making a pipeline `orders` of its own.
#[test]
fn an_environment_variable_for_a_pipeline_the_file_lacks_is_refused() {
    let file = format!(
        "{MINIMAL}\n[pipelines.Orders.outbox]\ntable = \"public.orders\"\n[pipelines.audit.outbox]\ntable = \"public.audit\"\n"
    );
    let var = "OUTBOX_RELAY__PIPELINES__ORDERS__SINK__TOPIC";
    let e = super::load::load_str_with_env(&file, &[(var, "t")])
        .expect_err("refused")
        .to_string();
    assert!(
        e.contains(&format!(
            "pipelines.orders (set by {var}): the file has no pipeline \"orders\" (it has Orders, audit)"
        )),
        "{e}"
    );
    let c = super::load::load_str_with_env(
        &file,
        &[("OUTBOX_RELAY__PIPELINES__AUDIT__SINK__TOPIC", "audited")],
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let audit = c.iter().find(|c| c.name == "audit").expect("audit");
    let SinkConfig::Kafka(k) = &audit.sink else {
        panic!("kafka")
    };
    assert_eq!(k.topic.to_string(), "audited");
    assert_eq!(c.len(), 2);
}

#[test]
fn pipelines_may_not_share_a_dead_letter_table() {
    let shared = err(&format!(
        "{MINIMAL}\n[dead_letter]\ntable = \"public.letters\"\n\
         [pipelines.orders.outbox]\ntable = \"public.orders\"\n\
         [pipelines.audit.outbox]\ntable = \"public.audit\"\n"
    ));
    assert!(
        shared.contains(
            "dead_letter.table: public.letters is already the dead-letter table of pipeline"
        ),
        "{shared}"
    );
    // By default each has its own; one without dead-lettering shares nothing.
    load_str(&format!(
        "{MINIMAL}\n[pipelines.orders.outbox]\ntable = \"public.orders\"\n\
         [pipelines.audit.outbox]\ntable = \"public.audit\"\n"
    ))
    .expect("own dead-letter tables");
    load_str(&format!(
        "{MINIMAL}\n[dead_letter]\ntable = \"public.letters\"\n\
         [pipelines.orders.outbox]\ntable = \"public.orders\"\n\
         [pipelines.audit.outbox]\ntable = \"public.audit\"\n\
         [pipelines.audit.dead_letter]\nenabled = false\n"
    ))
    .expect("one pipeline without dead letters");
}

#[test]
fn the_operations_guide_example_of_several_outboxes_loads() {
    let guide = include_str!("../../../docs/operations.md");
    let example = guide
        .split("### Several outboxes in one process")
        .nth(1)
        .and_then(|rest| rest.split("```toml").nth(1))
        .and_then(|block| block.split("```").next())
        .expect("the guide's example");
    let configs = crate::config::load_all_str(example).unwrap_or_else(|e| panic!("{e}"));
    let kinds: Vec<(&str, &str)> = configs
        .iter()
        .map(|c| (c.name.as_str(), c.sink.kind()))
        .collect();
    assert_eq!(kinds, [("billing", "rabbitmq"), ("orders", "kafka")]);
}
