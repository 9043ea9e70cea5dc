//! The relay's configuration as the tests write it: a base with quick
//! timings, single settings changed, the source mode, files for commands.

use super::{Mode, amqp_url, unique};
use outbox_relay::config::{self, Config};

/// The relay config for a test, with quick timings.
pub fn base_toml(db_url: &str, sink: &str) -> String {
    format!(
        r#"
[database]
url = "{db_url}"

[source.polling]
poll_interval = "50ms"

[relay]
# Most tests drive `update`; those of ranges and of the outbox's choice
# (marking_default.rs) set or remove it.
mark = "update"
retry_base = "50ms"
retry_max = "1s"
reject_retry_base = "200ms"
reject_retry_max = "1s"
standby_poll = "200ms"
confirm_timeout = "10s"
shutdown_timeout = "10s"

[http]
# Tests run side by side: a relay serves HTTP only where a test asks (on a free port).
enabled = false

{sink}
"#
    )
}

pub fn parse(toml: &str) -> Config {
    config::load_str(toml).unwrap_or_else(|e| panic!("test config does not load: {e}\n{toml}"))
}

/// Sets `section.key = value` in a TOML text: replaces the key if the
/// section has it, inserts it under the section's header otherwise, or adds
/// the section.
pub fn set(toml: &str, key: &str, value: &str) -> String {
    let (section, leaf) = key.rsplit_once('.').expect("a dotted key");
    let header = format!("[{section}]");
    let mut lines: Vec<String> = toml.lines().map(str::to_owned).collect();
    let Some(start) = lines.iter().position(|l| l.trim() == header) else {
        return format!("{toml}\n{header}\n{leaf} = {value}\n");
    };
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.trim_start().starts_with('['))
        .map_or(lines.len(), |i| start + 1 + i);
    let line = format!("{leaf} = {value}");
    match (start + 1..end).find(|&i| lines[i].split('=').next().is_some_and(|k| k.trim() == leaf)) {
        Some(i) => lines[i] = line,
        None => lines.insert(start + 1, line),
    }
    lines.join("\n") + "\n"
}

/// Removes `section.key` from a TOML text (the key's line under the
/// section's header).
pub fn unset(toml: &str, key: &str) -> String {
    let (section, leaf) = key.rsplit_once('.').expect("a dotted key");
    let mut current = String::new();
    let kept: Vec<&str> = toml
        .lines()
        .filter(|line| {
            let l = line.trim();
            if l.starts_with('[') {
                current = l.trim_matches(|c| c == '[' || c == ']').to_owned();
            }
            !(current == section && l.split('=').next().is_some_and(|k| k.trim() == leaf))
        })
        .collect();
    kept.join("\n") + "\n"
}

/// The source mode's settings, with quick CDC status updates for tests.
/// Serves HTTP on `port`, sampling gauges often.
pub fn with_http(toml: &str, port: u16) -> String {
    let t = set(toml, "http.enabled", "true");
    let t = set(&t, "http.address", &format!("\"127.0.0.1:{port}\""));
    set(&t, "http.sample_interval", "\"200ms\"")
}

pub fn with_mode(toml: &str, mode: Mode) -> String {
    match mode {
        Mode::Polling => toml.to_owned(),
        Mode::Cdc => {
            let t = set(toml, "source.mode", "\"cdc\"");
            let t = set(&t, "source.cdc.status_interval", "\"200ms\"");
            // Slot names are cluster-wide: one per test.
            set(&t, "source.cdc.slot", &format!("\"{}\"", unique("slot_")))
        }
    }
}

/// Writes `toml` to a fresh file and returns its path, for the commands
/// tests run (`check`, `migrate`, `dlq`, ...).
pub fn config_file(toml: &str) -> String {
    let dir = std::env::temp_dir().join(unique("outbox-relay-config-"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("relay.toml");
    std::fs::write(&path, toml).unwrap();
    path.to_str().unwrap().to_owned()
}

/// A `[sink]` section for the test RabbitMQ, publishing to `amq.topic`.
pub fn rabbit_sink() -> String {
    format!(
        "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"amq.topic\"\n",
        amqp_url()
    )
}
