//! Deserializing a configuration while collecting every key of the wrong type.
//!
//! serde stops at the first value it cannot read, and which one is first
//! depends on the order of the config crate's maps, so a file with two bad
//! keys named one, and a different one from run to run. Here each bad key is
//! reported, removed (its default then applies) and the rest read again, so
//! every such key is listed at once, in key order, alongside the range
//! problems `validate` finds.

use super::load::{ENV_PREFIX, ENV_SEPARATOR, Problem};
use super::validate::integer_range;
use config::{Map, Value, ValueKind};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;

/// More bad keys than any file has; bounds the retries.
const MAX_PROBLEMS: usize = 100;

/// A deserialization error, with the dotted key it concerns when known.
pub(super) struct Located {
    pub key: Option<String>,
    pub message: String,
}

/// Takes the config crate's error apart so the key can be reported first and
/// the value at it removed.
pub(super) fn locate(e: config::ConfigError) -> Located {
    match e {
        config::ConfigError::At {
            error,
            key: Some(key),
            ..
        } => {
            let inner = locate(*error);
            let message = inner.message;
            // A nested key reported by a hand-written deserializer (the sink).
            match message.split_once(super::sink::PATH_SEPARATOR) {
                Some((path, message)) => Located {
                    key: Some(format!("{key}.{path}")),
                    message: message.to_owned(),
                },
                None => Located {
                    key: Some(inner.key.map_or(key.clone(), |k| format!("{key}.{k}"))),
                    message,
                },
            }
        }
        config::ConfigError::At { error, .. } => locate(*error),
        config::ConfigError::Type {
            key,
            unexpected,
            expected,
            ..
        } => Located {
            key,
            message: format!("expected {expected}, found {unexpected}"),
        },
        other => Located {
            key: None,
            message: other.to_string(),
        },
    }
}

/// Reads `table` as `T`. Every key whose value cannot be read becomes a
/// problem; `T` is returned when what is left reads, with those problems.
/// `Err` carries a message without a key, when nothing was located.
pub(super) fn deserialize_all<T: DeserializeOwned>(
    mut table: Map<String, Value>,
) -> Result<(Option<T>, Vec<Problem>), String> {
    let mut problems: Vec<Problem> = Vec::new();
    let sink = sink_type(&table);
    not_whole(&mut table, "", sink.as_deref(), &mut problems);
    while problems.len() < MAX_PROBLEMS {
        let value = Value::new(None, ValueKind::Table(table.clone()));
        let e = match value.try_deserialize::<T>() {
            Ok(t) => return Ok((Some(t), sorted(problems))),
            Err(e) => locate(e),
        };
        let Some(mut key) = e.key else {
            if problems.is_empty() {
                return Err(e.message);
            }
            break; // e.g. a required key removed above; it is already reported
        };
        let mut message = e.message;
        // An unknown key is reported at its section; name the key itself.
        if let Some(name) = message
            .strip_prefix("unknown field `")
            .and_then(|rest| rest.split_once('`'))
            .map(|(name, _)| name.to_owned())
        {
            key = format!("{key}.{name}");
            message = format!(
                "unknown key{}",
                &message["unknown field `".len() + name.len() + 1..]
            );
        }
        let related = |k: &str| {
            k == key || k.starts_with(&format!("{key}.")) || key.starts_with(&format!("{k}."))
        };
        if problems.iter().any(|p| related(&p.key)) {
            break; // a consequence of a removal, e.g. "missing field"
        }
        let removed = remove(&mut table, &key);
        let sink_type = sink_type(&table);
        problems.push(Problem {
            message: explain(&key, removed.as_ref(), message, sink_type.as_deref()),
            key,
        });
        if removed.is_none() {
            break; // the key is not a value of the file (a missing section)
        }
    }
    Ok((None, sorted(problems)))
}

/// Counts written as a fraction, `true`/`false` or other text: the config
/// crate would round `2.5` to 3 and read `true` as 1. Each becomes a
/// problem, and the key's default applies while the rest is read.
fn not_whole(
    table: &mut Map<String, Value>,
    at: &str,
    sink: Option<&str>,
    problems: &mut Vec<Problem>,
) {
    let mut refused = Vec::new();
    for (name, value) in table.iter_mut() {
        let key = if at.is_empty() {
            name.clone()
        } else {
            format!("{at}.{name}")
        };
        if let ValueKind::Table(inner) = &mut value.kind {
            not_whole(inner, &key, sink, problems);
            continue;
        }
        let Some((min, max)) = integer_range(&key, sink) else {
            continue;
        };
        let shown = match &value.kind {
            // Written `4.0`: a whole number all the same.
            ValueKind::Float(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => {
                value.kind = ValueKind::I64(*f as i64);
                continue;
            }
            ValueKind::Float(f) => format!("{f:?}"),
            ValueKind::Boolean(b) => b.to_string(),
            // Text from the environment, read as written but for spaces.
            ValueKind::String(t) => match t.trim().parse::<i64>() {
                Ok(n) => {
                    value.kind = ValueKind::I64(n);
                    continue;
                }
                Err(_) if t.trim().parse::<i128>().is_ok() => continue,
                Err(_) => format!("{t:?}"),
            },
            _ => continue,
        };
        problems.push(Problem {
            message: format!("{shown} is not a whole number; use {min} to {max}"),
            key,
        });
        refused.push(name.clone());
    }
    for name in refused {
        table.remove(&name);
    }
}

fn sorted(mut problems: Vec<Problem>) -> Vec<Problem> {
    problems.sort_by(|a, b| a.key.cmp(&b.key));
    problems
}

/// Removes the value at a dotted key, unless it is a whole section: removing
/// that would hide the other problems in it.
fn remove(table: &mut Map<String, Value>, key: &str) -> Option<Value> {
    let (parents, leaf) = match key.rsplit_once('.') {
        Some((parents, leaf)) => (Some(parents), leaf),
        None => (None, key),
    };
    let mut t = table;
    for part in parents.into_iter().flat_map(|p| p.split('.')) {
        t = match &mut t.get_mut(part)?.kind {
            ValueKind::Table(inner) => inner,
            _ => return None,
        };
    }
    if matches!(t.get(leaf)?.kind, ValueKind::Table(_)) {
        return None;
    }
    t.remove(leaf)
}

fn sink_type(table: &Map<String, Value>) -> Option<String> {
    match &table.get("sink")?.kind {
        ValueKind::Table(sink) => sink.get("type")?.clone().into_string().ok(),
        _ => None,
    }
}

/// The message for a value that could not be read: a count that does not fit
/// (negative, or not a number) is told its allowed range.
fn explain(key: &str, value: Option<&Value>, message: String, sink_type: Option<&str>) -> String {
    let Some((min, max)) = integer_range(key, sink_type) else {
        return message;
    };
    match value.map(|v| &v.kind) {
        Some(ValueKind::I64(v)) => format!("{v} is out of range; use {min} to {max}"),
        Some(ValueKind::I128(v)) => format!("{v} is out of range; use {min} to {max}"),
        Some(ValueKind::U64(v)) => format!("{v} is out of range; use {min} to {max}"),
        Some(ValueKind::U128(v)) => format!("{v} is out of range; use {min} to {max}"),
        // Environment variables are text.
        Some(ValueKind::String(s)) => match s.trim().parse::<i128>() {
            Ok(v) => format!("{v} is out of range; use {min} to {max}"),
            Err(_) => format!("{s:?} is not a whole number; use {min} to {max}"),
        },
        Some(ValueKind::Float(f)) => format!("{f} is not a whole number; use {min} to {max}"),
        _ => format!("{message}; use a whole number from {min} to {max}"),
    }
}

/// Which environment variable set each dotted key, as the config crate maps
/// `OUTBOX_RELAY__SOURCE__BATCH_SIZE` to `source.batch_size`.
#[derive(Default)]
pub(super) struct EnvKeys(BTreeMap<String, String>);

impl EnvKeys {
    pub fn new(vars: &Map<String, String>) -> Self {
        let prefix = format!("{ENV_PREFIX}{ENV_SEPARATOR}");
        EnvKeys(
            vars.keys()
                .filter_map(|name| {
                    let key = name
                        .strip_prefix(&prefix)?
                        .to_lowercase()
                        .replace(ENV_SEPARATOR, ".");
                    Some((key, name.clone()))
                })
                .collect(),
        )
    }

    /// The pipelines the variables name (`pipelines.<name>.…`), each once,
    /// with one of its variables.
    pub fn pipelines(&self) -> impl Iterator<Item = (&str, &str)> {
        let mut seen = std::collections::BTreeSet::new();
        self.0.iter().filter_map(move |(key, var)| {
            let name = key.strip_prefix("pipelines.")?.split('.').next()?;
            seen.insert(name).then_some((name, var.as_str()))
        })
    }

    /// Names the variable behind a problem's key, when one set it: the value
    /// in the file, if any, is not the one that was refused.
    pub fn annotate(&self, problem: &mut Problem, pipeline: Option<&str>) {
        let var = pipeline
            .and_then(|p| self.0.get(&format!("pipelines.{p}.{}", problem.key)))
            .or_else(|| self.0.get(&problem.key));
        if let Some(var) = var {
            problem.key = format!("{} (set by {var})", problem.key);
        }
    }
}
