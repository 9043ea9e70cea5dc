//! The systemd unit and its environment file.

use crate::{read, relay_accepts, run, scratch_dir, tool, with_override};
use outbox_relay::config;
use std::path::Path;
use std::process::Command;

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
    let longest = config::defaults::shutdown_timeout() + outbox_relay::shutdown::STOP_GRACE;
    assert!(
        stop > longest,
        "TimeoutStopSec={stop:?} must exceed the longest stop with relay.shutdown_timeout's default ({longest:?})"
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
    // Priority over the database and broker on a shared host (the README's
    // "A shared host"); systemd's default weight is 100, its range 1..=10000.
    let weight: u32 = get("CPUWeight").parse().expect("CPUWeight is a number");
    assert!(
        (101..=10_000).contains(&weight),
        "{UNIT}: CPUWeight={weight} must rank the relay above the default of 100"
    );
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
