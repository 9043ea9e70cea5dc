//! The alert rules and the dashboard: promtool, and the metric names they use.

use crate::{read, root, run, str_of, tool, yaml_documents};
use outbox_relay::telemetry::metrics;
use serde_json::Value;
use std::collections::BTreeSet;
use std::process::Command;

const ALERTS: &str = "deploy/prometheus/alerts.yml";

/// The `outbox_relay_*` names in an expression.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("outbox_relay_") {
        let tail = &rest[at..];
        let end = tail
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(tail.len());
        names.insert(tail[..end].to_owned());
        rest = &tail[end..];
    }
    names
}

/// Whether Prometheus has series of this name from the relay: a histogram
/// only as its `_bucket`, `_sum` and `_count` series.
fn exported(name: &str) -> bool {
    let histogram_series = metrics::HISTOGRAMS.iter().any(|h| {
        ["_bucket", "_sum", "_count"]
            .iter()
            .any(|suffix| name == format!("{h}{suffix}"))
    });
    histogram_series || (metrics::ALL.contains(&name) && !metrics::HISTOGRAMS.contains(&name))
}

#[test]
fn metric_names_are_recognised() {
    assert!(exported("outbox_relay_backlog_events"));
    assert!(exported("outbox_relay_commit_to_confirm_seconds_bucket"));
    assert!(!exported("outbox_relay_commit_to_confirm_seconds"));
    assert!(!exported("outbox_relay_backlog"));
    assert_eq!(
        metric_names("max(outbox_relay_a{x=\"y\"}) / outbox_relay_b_total[5m]"),
        BTreeSet::from([
            "outbox_relay_a".to_owned(),
            "outbox_relay_b_total".to_owned()
        ])
    );
}

#[test]
fn the_alert_rules_pass_promtool() {
    let promtool = tool("promtool");
    let dir = root().join("deploy/prometheus");
    let mut check = Command::new(&promtool);
    check
        .args(["check", "rules", "alerts.yml"])
        .current_dir(&dir);
    let out = run(check);
    assert!(out.success && out.text.contains("SUCCESS"), "{}", out.text);
    let mut test = Command::new(&promtool);
    test.args(["test", "rules", "alerts.test.yml"])
        .current_dir(&dir);
    let out = run(test);
    assert!(out.success && out.text.contains("SUCCESS"), "{}", out.text);
}

fn alert_rules() -> Vec<Value> {
    let doc = yaml_documents(&root().join(ALERTS)).remove(0);
    doc["groups"]
        .as_array()
        .expect("groups")
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("rules").clone())
        .collect()
}

#[test]
fn the_alert_rules_use_only_metrics_the_relay_exports() {
    let mut used = BTreeSet::new();
    for rule in alert_rules() {
        let expr = str_of(&rule["expr"], "expr");
        for name in metric_names(expr) {
            assert!(
                exported(&name),
                "alert {}: {name} is not exported by the relay",
                rule["alert"]
            );
            used.insert(name);
        }
    }
    assert!(used.len() >= 5, "only {used:?}");
}

#[test]
fn every_alert_is_unit_tested_firing_and_not_firing() {
    let tests = yaml_documents(&root().join("deploy/prometheus/alerts.test.yml")).remove(0);
    let cases: Vec<&Value> = tests["tests"]
        .as_array()
        .expect("tests")
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().expect("alert_rule_test"))
        .collect();
    for rule in alert_rules() {
        let name = &rule["alert"];
        let of = |firing: bool| {
            cases.iter().any(|c| {
                c["alertname"] == *name
                    && c["exp_alerts"]
                        .as_array()
                        .is_some_and(|a| a.is_empty() != firing)
            })
        };
        assert!(of(true), "no test fires {name}");
        assert!(of(false), "no test shows {name} not firing");
    }
}

#[test]
fn the_operations_guide_links_the_files_instead_of_copying_them() {
    let guide = read("docs/operations.md");
    for file in [
        "deploy/prometheus/alerts.yml",
        "deploy/kubernetes",
        "deploy/systemd/outbox-relay.service",
        "deploy/grafana/outbox-relay.json",
    ] {
        assert!(
            guide.contains(file),
            "docs/operations.md does not mention {file}"
        );
    }
    assert!(
        !guide.contains("- alert: "),
        "alert rules copied into the guide"
    );
    assert!(!guide.contains("[Service]"), "a unit copied into the guide");
    assert!(
        !guide.contains("kind: Deployment"),
        "a manifest copied into the guide"
    );
}

#[test]
fn the_dashboard_uses_only_metrics_the_relay_exports() {
    let dashboard: Value = serde_json::from_str(&read("deploy/grafana/outbox-relay.json"))
        .expect("the dashboard is JSON");
    fn strings<'a>(v: &'a Value, out: &mut Vec<&'a str>) {
        match v {
            Value::String(s) => out.push(s),
            Value::Array(a) => a.iter().for_each(|x| strings(x, out)),
            Value::Object(o) => o.values().for_each(|x| strings(x, out)),
            _ => {}
        }
    }
    let mut all = Vec::new();
    strings(&dashboard, &mut all);
    let used: BTreeSet<String> = all.iter().flat_map(|s| metric_names(s)).collect();
    for name in &used {
        assert!(
            exported(name),
            "the dashboard uses {name}, which the relay does not export"
        );
    }
    for wanted in [
        metrics::BACKLOG,
        metrics::OLDEST_UNSENT_AGE,
        metrics::EVENTS_PUBLISHED,
        metrics::EVENTS_FAILED,
        "outbox_relay_commit_to_confirm_seconds_bucket",
        metrics::IN_FLIGHT,
        metrics::DEAD_LETTERS,
        metrics::SLOT_RETAINED_WAL,
        metrics::ACTIVE,
    ] {
        assert!(
            used.contains(wanted),
            "the dashboard has no panel of {wanted}"
        );
    }
    let panels = dashboard["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    for panel in panels {
        assert!(
            ids.insert(panel["id"].as_u64().expect("a numeric panel id")),
            "panel ids repeat: {}",
            panel["id"]
        );
        let targets = panel["targets"].as_array().expect("targets");
        assert!(
            targets.iter().all(|t| t["expr"].is_string()),
            "panel {} has a target without a query",
            panel["title"]
        );
    }
}
