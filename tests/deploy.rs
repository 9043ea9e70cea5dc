//! The deployment files under `deploy/`, checked by the tools that will read
//! them (systemd-analyze, kubernetes-validate, promtool) and against the relay
//! itself: its configuration loader, defaults, HTTP paths and metric names.
//!
//! `scripts/deploy-checks.sh install` (which `scripts/test.sh` runs) installs
//! the tools; a missing tool fails its test rather than skipping it.

use outbox_relay::config::{self, Config};
use outbox_relay::telemetry::http::{HEALTHZ_PATH, METRICS_PATH, READYZ_PATH};
use outbox_relay::telemetry::metrics;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeSet;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound of one tool run; they take well under a second.
const TOOL_LIMIT: Duration = Duration::from_secs(120);
/// Where `scripts/deploy-checks.sh` puts kubernetes-validate when pip may not
/// install into the system Python.
const TOOLS_VENV_BIN: &str = "/var/tmp/outbox-relay-tools/bin";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(relative: &str) -> String {
    std::fs::read_to_string(root().join(relative))
        .unwrap_or_else(|e| panic!("cannot read {relative}: {e}"))
}

/// The tool's path; panics (fails the test) when it is not installed.
fn tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from(TOOLS_VENV_BIN)])
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
        .unwrap_or_else(|| panic!("{name} is not installed: run scripts/deploy-checks.sh install"))
}

struct Output {
    success: bool,
    text: String,
}

/// Runs a command to completion within `TOOL_LIMIT`; stdout and stderr together.
fn run(mut cmd: Command) -> Output {
    let shown = format!("{cmd:?}");
    let mut child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {shown}: {e}"));
    let drain = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut s = String::new();
            let _ = pipe.read_to_string(&mut s);
            s
        })
    };
    let out = drain(Box::new(child.stdout.take().unwrap()));
    let err = drain(Box::new(child.stderr.take().unwrap()));
    let start = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > TOOL_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{shown} did not finish within {TOOL_LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let text = out.join().unwrap() + &err.join().unwrap();
    println!("$ {shown}\n{text}");
    Output {
        success: status.success(),
        text,
    }
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "outbox-relay-deploy-{name}-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

// ---- systemd ----

const UNIT: &str = "deploy/systemd/outbox-relay.service";
const INSTALLED_BINARY: &str = "/usr/local/bin/outbox-relay";

/// `key=value` lines of a unit file, comments and section headers left out.
fn unit_settings(text: &str) -> Vec<(&str, &str)> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with(['#', ';', '[']))
        .map(|l| l.split_once('=').unwrap_or((l, "")))
        .collect()
}

/// What `systemd-analyze verify` says about the file named `unit_name`
/// (it may also talk about units of the host, which are not ours).
fn verify(dir: &Path, unit_name: &str) -> Vec<String> {
    let mut cmd = Command::new(tool("systemd-analyze"));
    cmd.arg("verify").arg(dir.join(unit_name));
    let out = run(cmd);
    let mut complaints: Vec<String> = out
        .text
        .lines()
        .filter(|l| l.contains(unit_name))
        .map(str::to_owned)
        .collect();
    if !out.success {
        complaints.push(format!("systemd-analyze verify failed:\n{}", out.text));
    }
    complaints
}

#[test]
fn the_systemd_unit_passes_systemd_analyze_verify() {
    let unit = read(UNIT);
    // Only the binary's path changes: verify checks that it exists.
    let built = env!("CARGO_BIN_EXE_outbox-relay");
    let exec = format!("ExecStart={INSTALLED_BINARY} ");
    assert_eq!(
        unit.lines().filter(|l| l.starts_with(&exec)).count(),
        1,
        "{UNIT} must start {INSTALLED_BINARY} on exactly one ExecStart line"
    );
    let copy: String = unit
        .lines()
        .map(|l| match l.strip_prefix(&exec) {
            Some(args) => format!("ExecStart={built} {args}\n"),
            None => format!("{l}\n"),
        })
        .collect();
    let changed = unit.lines().zip(copy.lines()).filter(|(a, b)| a != b);
    assert_eq!(changed.count(), 1, "only ExecStart differs in the copy");
    assert_eq!(unit.lines().count(), copy.lines().count());

    let dir = scratch_dir("systemd");
    std::fs::write(dir.join("outbox-relay.service"), &copy).unwrap();
    let complaints = verify(&dir, "outbox-relay.service");
    assert!(complaints.is_empty(), "{}", complaints.join("\n"));

    // The check above sees what systemd only warns about: a comment after a
    // value, which it reads as part of the value.
    let broken = copy.replace("Restart=on-failure", "Restart=on-failure # crashes only");
    std::fs::write(dir.join("broken.service"), broken).unwrap();
    assert!(
        !verify(&dir, "broken.service").is_empty(),
        "systemd-analyze verify no longer reports a trailing comment"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_systemd_unit_is_hardened_and_outlasts_the_drain() {
    let unit = read(UNIT);
    let settings = unit_settings(&unit);
    for (key, value) in &settings {
        assert!(
            !value.contains('#'),
            "{UNIT}: {key}={value}: systemd reads a trailing comment as part of the value"
        );
    }
    let get = |key: &str| {
        settings
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{UNIT} does not set {key}"))
    };
    let stop = humantime::parse_duration(get("TimeoutStopSec")).expect("TimeoutStopSec");
    assert!(
        stop > config::defaults::shutdown_timeout(),
        "TimeoutStopSec={stop:?} must exceed relay.shutdown_timeout's default"
    );
    for (key, value) in [
        ("Restart", "on-failure"),
        ("KillSignal", "SIGTERM"),
        ("DynamicUser", "yes"),
        ("NoNewPrivileges", "yes"),
        ("ProtectSystem", "strict"),
        ("ProtectHome", "yes"),
        ("PrivateTmp", "yes"),
        ("CapabilityBoundingSet", ""),
        // Exit code 2 is a configuration error: restarting cannot fix it.
        ("RestartPreventExitStatus", "2"),
    ] {
        assert_eq!(get(key), value, "{UNIT}: {key}");
    }
    assert!(
        get("ExecStart").ends_with(" run --config /etc/outbox-relay/relay.toml"),
        "{UNIT}: ExecStart"
    );
}

/// Sets `section.key` (dotted) in a TOML text, the way an
/// `OUTBOX_RELAY__SECTION__KEY` variable overrides it.
fn with_override(toml_text: &str, variable: &str, value: &str) -> String {
    let path = variable
        .strip_prefix("OUTBOX_RELAY__")
        .unwrap_or_else(|| panic!("{variable} does not start with OUTBOX_RELAY__"))
        .to_ascii_lowercase();
    let mut table: toml::Table = toml::from_str(toml_text).unwrap();
    let mut parts: Vec<&str> = path.split("__").collect();
    let leaf = parts.pop().unwrap();
    let mut at = &mut table;
    for p in parts {
        at = at
            .entry(p)
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .unwrap();
    }
    at.insert(leaf.to_owned(), toml::Value::String(value.to_owned()));
    toml::to_string(&table).unwrap()
}

#[test]
fn the_systemd_environment_file_sets_keys_the_relay_accepts() {
    let env = read("deploy/systemd/outbox-relay.env");
    let base = read("config/polling-kafka.toml");
    let mut set = 0;
    for line in env.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (variable, value) = line
            .split_once('=')
            .unwrap_or_else(|| panic!("not KEY=value: {line}"));
        assert!(!value.contains('#'), "a comment after a value: {line}");
        let overridden = with_override(&base, variable, value);
        config::load_str(&overridden)
            .unwrap_or_else(|e| panic!("{variable} is not a key the relay accepts: {e}"));
        set += 1;
    }
    assert!(set > 0, "the example sets nothing");
    let envs: Vec<(String, String)> = env
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect();
    relay_accepts(&base, &envs);
}

/// Runs `outbox-relay check` on `toml_text` with only `envs` in its
/// environment: the relay's own loader and environment overrides. The
/// database and broker of a deployment file are not reachable here, so the
/// check fails after the configuration passed; exit code 2 would be a
/// configuration error.
fn relay_accepts(toml_text: &str, envs: &[(String, String)]) {
    let dir = scratch_dir("config");
    let path = dir.join("relay.toml");
    std::fs::write(&path, toml_text).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_outbox-relay"));
    cmd.env_clear()
        .envs(envs.iter().map(|(k, v)| (k, v)))
        .arg("check")
        .arg("--config")
        .arg(&path);
    let out = run(cmd);
    assert!(
        out.text.contains("[ok  ] config"),
        "the relay refuses the configuration with {envs:?}:\n{}",
        out.text
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

// ---- Kubernetes ----

const KUBERNETES: &str = "deploy/kubernetes";

fn manifest_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(root().join(KUBERNETES))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(files.len() >= 6, "manifests missing: {files:?}");
    files
}

/// Every document of a YAML file.
fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

const CUSTOM_KINDS: &[&str] = &["ServiceMonitor"];

#[test]
fn the_kubernetes_manifests_validate_against_the_schemas() {
    let validator = tool("kubernetes-validate");
    let mut checked = 0;
    for file in manifest_files() {
        let kinds: Vec<String> = yaml_documents(&file)
            .iter()
            .map(|d| d["kind"].as_str().unwrap_or_default().to_owned())
            .collect();
        // A custom resource has no schema in Kubernetes itself; its fields
        // are checked in the_kubernetes_manifests_keep_the_relay_invariants.
        if kinds.iter().all(|k| CUSTOM_KINDS.contains(&k.as_str())) {
            continue;
        }
        let mut cmd = Command::new(&validator);
        cmd.arg("--strict").arg(&file);
        let out = run(cmd);
        assert!(
            out.success,
            "{} does not validate:\n{}",
            file.display(),
            out.text
        );
        assert_eq!(
            out.text.matches(" passed ").count(),
            kinds.len(),
            "every resource of {} is validated:\n{}",
            file.display(),
            out.text
        );
        checked += 1;
    }
    assert!(checked >= 5, "only {checked} files validated");
}

/// The one resource of `kind` among the manifests.
fn resource<'a>(all: &'a [Value], kind: &str) -> &'a Value {
    let found: Vec<&Value> = all.iter().filter(|d| d["kind"] == kind).collect();
    assert_eq!(found.len(), 1, "one {kind} in {KUBERNETES}");
    found[0]
}

/// Whether every label of `selector` is among `labels`.
fn selects(selector: &Value, labels: &Value) -> bool {
    let Some(wanted) = selector.as_object() else {
        return false;
    };
    !wanted.is_empty() && wanted.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {v}"))
}

#[test]
fn the_kubernetes_manifests_keep_the_relay_invariants() {
    let all: Vec<Value> = manifest_files()
        .iter()
        .flat_map(|f| yaml_documents(f))
        .collect();
    let config_map = resource(&all, "ConfigMap");
    let secret = resource(&all, "Secret");
    let deployment = resource(&all, "Deployment");
    let pdb = resource(&all, "PodDisruptionBudget");
    let service = resource(&all, "Service");
    let monitor = resource(&all, "ServiceMonitor");

    let spec = &deployment["spec"];
    let pod = &spec["template"]["spec"];
    let pod_labels = &spec["template"]["metadata"]["labels"];
    assert_eq!(spec["replicas"], 2, "one active relay and one standby");
    assert!(selects(&spec["selector"]["matchLabels"], pod_labels));
    assert!(selects(&pdb["spec"]["selector"]["matchLabels"], pod_labels));
    assert_eq!(pdb["spec"]["minAvailable"], 1);
    assert!(selects(&service["spec"]["selector"], pod_labels));

    let containers = pod["containers"].as_array().expect("containers");
    assert_eq!(containers.len(), 1);
    let relay = &containers[0];

    // The configuration: the ConfigMap's file, where the container reads it,
    // with the container's environment overrides, through the relay's loader.
    let args: Vec<&str> = relay["args"]
        .as_array()
        .expect("args")
        .iter()
        .map(|a| str_of(a, "an argument"))
        .collect();
    let at = args
        .iter()
        .position(|a| *a == "--config")
        .expect("--config");
    let config_path = Path::new(args[at + 1]);
    let mount = relay["volumeMounts"]
        .as_array()
        .expect("volumeMounts")
        .iter()
        .find(|m| config_path.starts_with(str_of(&m["mountPath"], "mountPath")))
        .expect("the config file is on a mounted volume");
    let volume = pod["volumes"]
        .as_array()
        .expect("volumes")
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("the mounted volume");
    assert_eq!(volume["configMap"]["name"], config_map["metadata"]["name"]);
    let file_name = config_path.file_name().unwrap().to_str().unwrap();
    let mut toml_text = str_of(&config_map["data"][file_name], "the config file").to_owned();
    let secret_values = secret["stringData"]
        .as_object()
        .or(secret["data"].as_object())
        .expect("the Secret has data");
    let config_file = toml_text.clone();
    let mut envs = Vec::new();
    for var in relay["env"].as_array().expect("env") {
        let name = str_of(&var["name"], "an env name");
        let value = match (&var["value"], &var["valueFrom"]["secretKeyRef"]) {
            (Value::String(v), _) => v.clone(),
            (_, from) if from.is_object() => {
                assert_eq!(from["name"], secret["metadata"]["name"], "{name}");
                let key = str_of(&from["key"], "a secret key");
                assert!(secret_values.contains_key(key), "the Secret has no {key}");
                "from-the-secret".to_owned()
            }
            _ => panic!("{name} has neither a value nor a secretKeyRef"),
        };
        toml_text = with_override(&toml_text, name, &value);
        envs.push((name.to_owned(), value));
    }
    assert!(
        !envs.is_empty(),
        "the database password comes from the Secret"
    );
    relay_accepts(&config_file, &envs);
    let pipelines: Vec<Config> = config::load_all_str(&toml_text)
        .unwrap_or_else(|e| panic!("the ConfigMap's relay.toml does not load: {e}"));
    assert!(
        pipelines.iter().all(|p| p.database.password.is_some()),
        "the password is set from the Secret"
    );
    let http = &pipelines[0].http;
    assert!(http.enabled);
    let address: std::net::SocketAddr = http.address.parse().expect("http.address");
    assert!(
        address.ip().is_unspecified(),
        "http.address {address} must listen on the pod's interfaces for probes and scrapes"
    );
    let shutdown = pipelines
        .iter()
        .map(|p| p.relay.shutdown_timeout)
        .max()
        .unwrap();
    let grace = Duration::from_secs(
        pod["terminationGracePeriodSeconds"]
            .as_u64()
            .expect("grace"),
    );
    assert!(
        grace > shutdown,
        "terminationGracePeriodSeconds {grace:?} must exceed relay.shutdown_timeout {shutdown:?}"
    );

    // Probes and scrapes reach the relay's port and paths.
    let port = relay["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == "http")
        .expect("a port named http");
    assert_eq!(
        port["containerPort"],
        address.port(),
        "the port of http.address"
    );
    for (probe, path) in [
        ("livenessProbe", HEALTHZ_PATH),
        ("readinessProbe", READYZ_PATH),
    ] {
        assert_eq!(relay[probe]["httpGet"]["path"], path, "{probe}");
        assert_eq!(relay[probe]["httpGet"]["port"], "http", "{probe}");
    }
    let service_port = &service["spec"]["ports"][0];
    assert_eq!(service_port["targetPort"], "http");
    assert_eq!(service_port["port"], address.port());

    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert!(selects(
        &monitor["spec"]["selector"]["matchLabels"],
        &service["metadata"]["labels"]
    ));
    let endpoint = &monitor["spec"]["endpoints"][0];
    assert_eq!(endpoint["port"], service_port["name"]);
    assert_eq!(endpoint["path"], METRICS_PATH);

    // Not root, nothing writable, no capabilities; the user is the image's.
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    let user = pod["securityContext"]["runAsUser"]
        .as_u64()
        .expect("runAsUser");
    assert!(
        read("Dockerfile").contains(&format!("USER {user}:")),
        "runAsUser {user} is the Dockerfile's user"
    );
    let security = &relay["securityContext"];
    assert_eq!(security["readOnlyRootFilesystem"], true);
    assert_eq!(security["allowPrivilegeEscalation"], false);
    assert_eq!(security["capabilities"]["drop"], serde_json::json!(["ALL"]));
}

// ---- Prometheus and Grafana ----

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
