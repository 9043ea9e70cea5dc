//! The Kubernetes manifests: their schemas, and their agreement with the relay.

use crate::{read, relay_accepts, root, run, str_of, tool, with_override, yaml_documents};
use outbox_relay::config::{self, Config};
use outbox_relay::telemetry::http::{HEALTHZ_PATH, METRICS_PATH, READYZ_PATH};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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
    // No relay is ready during a database outage: a drain must not wait on it.
    assert_eq!(pdb["spec"]["unhealthyPodEvictionPolicy"], "AlwaysAllow");
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
    let longest = shutdown + outbox_relay::shutdown::STOP_GRACE;
    assert!(
        grace > longest,
        "terminationGracePeriodSeconds {grace:?} must exceed the longest stop ({longest:?}: relay.shutdown_timeout {shutdown:?} and the grace after it)"
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
