//! The deployment files under `deploy/`, checked by the tools that will read
//! them (systemd-analyze, kubernetes-validate, promtool, hadolint) and against the relay
//! itself: its configuration loader, defaults, HTTP paths and metric names.
//!
//! `scripts/deploy-checks.sh install` (which `scripts/test.sh` runs) installs
//! the tools; a missing tool fails its test rather than skipping it.

mod docker;
mod kubernetes;
mod monitoring;
mod systemd;

use serde::Deserialize;
use serde_json::Value;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Bound of one tool run; they take well under a second.
const TOOL_LIMIT: Duration = Duration::from_secs(120);
/// Where `scripts/deploy-checks.sh` installs the tools the system lacks
/// (promtool, and kubernetes-validate in a virtual environment).
const TOOLS_BIN: &str = "/var/tmp/outbox-relay-tools/bin";

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
        .chain([PathBuf::from(TOOLS_BIN)])
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

/// Every document of a YAML file.
fn yaml_documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| Value::deserialize(doc).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
        .collect()
}

fn str_of<'a>(v: &'a Value, what: &str) -> &'a str {
    v.as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {v}"))
}
