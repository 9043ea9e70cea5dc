//! The ranges the README's key table states are the ones enforced: each
//! end accepted, one step past it refused with the key's name.

use super::*;

/// How a key's value is counted.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Count,
    Millis,
    Bytes,
    Characters,
}

/// A number of the README's units as the smallest step of its kind
/// (milliseconds, bytes), and that kind.
fn fine(n: u64, unit: &str) -> Option<(u64, Kind)> {
    Some(match unit {
        "" => (n, Kind::Count),
        "characters" => (n, Kind::Characters),
        "ms" => (n, Kind::Millis),
        "s" => (n * 1000, Kind::Millis),
        "h" => (n * 3_600_000, Kind::Millis),
        "MiB" => (n << 20, Kind::Bytes),
        "GiB" => (n << 30, Kind::Bytes),
        _ => return None,
    })
}

/// `(key, low, high, kind)` of each row of the README's key tables that
/// states a range as `(low to high)`; a unit is written after the high end
/// and, when it differs, after the low end too (`10 ms to 1 h`).
fn readme_ranges() -> Vec<(String, u64, u64, Kind)> {
    let readme = include_str!("../../../README.md");
    let number = |s: &str| s.replace(',', "").parse::<u64>().ok();
    let mut out = Vec::new();
    for line in readme.lines() {
        let Some((key, rest)) = line
            .strip_prefix("| `")
            .and_then(|rest| rest.split_once("` |"))
        else {
            continue;
        };
        let Some(meaning) = rest.split(" | ").nth(1) else {
            continue;
        };
        for part in meaning.split('(').skip(1) {
            let inner = part.split([')', ';']).next().unwrap_or("");
            let Some((low, high)) = inner.split_once(" to ") else {
                continue;
            };
            let (high, unit) = high.split_once(' ').unwrap_or((high, ""));
            let (low, low_unit) = low.split_once(' ').unwrap_or((low, unit));
            let (Some(l), Some(h)) = (number(low), number(high)) else {
                continue;
            };
            let (Some((l, kind)), Some((h, high_kind))) = (fine(l, low_unit), fine(h, unit)) else {
                panic!("{key}: a range in units this test does not know: {inner:?}");
            };
            assert_eq!(kind, high_kind, "{key}: {inner:?}");
            out.push((key.to_owned(), l, h, kind));
        }
    }
    out
}

/// `n` steps of `kind` as the key takes them.
fn value(kind: Kind, n: u64) -> toml::Value {
    match kind {
        Kind::Millis => toml::Value::String(format!("{n}ms")),
        Kind::Characters => toml::Value::String("p".repeat(n as usize)),
        Kind::Count | Kind::Bytes => toml::Value::Integer(n as i64),
    }
}

/// The problems the loader reports about `key` set to `v` (on the
/// reference configuration, with what the key needs to be read at all):
/// `Ok` when it loads.
fn problems(key: &str, v: toml::Value) -> Result<(), Vec<String>> {
    let mut table: toml::Table = toml::from_str(include_str!("../../../config/reference.toml"))
        .expect("the reference configuration");
    let needs: Vec<(&str, toml::Value)> = match key {
        "source.cdc.message_prefix" => vec![
            ("source.mode", "cdc".into()),
            ("source.cdc.messages", true.into()),
        ],
        "retention.partition_premake" => vec![("retention.mode", "partitions".into())],
        _ => Vec::new(),
    };
    for (k, v) in needs {
        keys::set_key(&mut table, k, v);
    }
    keys::set_key(&mut table, key, v);
    load_str(&toml::to_string(&table).unwrap())
        .map(|_| ())
        .map_err(|e| e.to_string().lines().map(str::to_owned).collect())
}

#[test]
fn every_range_the_readme_states_is_enforced_at_both_ends() {
    let ranges = readme_ranges();
    let keys: Vec<&str> = ranges.iter().map(|r| r.0.as_str()).collect();
    assert_eq!(
        keys,
        [
            "source.batch_size",
            "source.polling.poll_interval",
            "source.cdc.batch_wait",
            "source.cdc.message_prefix",
            "source.auto.probe_interval",
            "relay.max_in_flight",
            "relay.max_in_flight_bytes",
            "relay.fold_interval",
            "relay.shards",
            "dead_letter.max_attempts",
            "retention.partition_premake",
            "telemetry.otlp.max_queue_size",
        ],
        "the rows that state a range (a reworded row must still be read)"
    );
    for (key, low, high, kind) in ranges {
        let at = |n| problems(&key, value(kind, n));
        for n in [low, high] {
            if let Err(e) = at(n) {
                panic!("{key} = {n} ({kind:?}) is in the README's range, but: {e:?}");
            }
        }
        // A range from 0 has nothing below it to refuse.
        for n in [low.checked_sub(1), Some(high + 1)].into_iter().flatten() {
            let e = at(n).expect_err(&format!("{key} = {n} ({kind:?}) must be refused"));
            assert!(
                e.iter()
                    .any(|l| l.contains(&format!("{key}: ")) || l.contains(&format!("{key} ("))),
                "{key} = {n}: the refusal names the key: {e:?}"
            );
        }
    }
}
