//! Reading the file, applying environment overrides, and reporting errors.

use super::Config;
use std::fmt;
use std::path::{Path, PathBuf};

/// Environment variables `OUTBOX_RELAY__SECTION__KEY` override `section.key`.
pub const ENV_PREFIX: &str = "OUTBOX_RELAY";
pub const ENV_SEPARATOR: &str = "__";

/// One thing wrong with a configuration, with the dotted key it concerns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub key: String,
    pub message: String,
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.key, self.message)
    }
}

/// Why a configuration could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// Syntax errors, unknown keys, wrong types; the message names the key.
    #[error("{0}")]
    Parse(String),
    #[error("{}", list(.0))]
    Invalid(Vec<Problem>),
}

fn list(problems: &[Problem]) -> String {
    let mut out = format!(
        "the configuration has {} problem{}:",
        problems.len(),
        if problems.len() == 1 { "" } else { "s" }
    );
    for p in problems {
        out.push_str("\n  - ");
        out.push_str(&p.to_string());
    }
    out
}

/// Loads `path`, applies `OUTBOX_RELAY__*` environment overrides and
/// validates. Returns one configuration per pipeline: the file itself, or
/// one per `[pipelines.<name>]` table, each merged over the top-level sections.
pub fn load(path: &Path) -> Result<Vec<Config>, ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })?;
    let env = config::Environment::with_prefix(ENV_PREFIX)
        .prefix_separator(ENV_SEPARATOR)
        .separator(ENV_SEPARATOR)
        .try_parsing(true);
    build(&text, &path.display().to_string(), Some(env))
}

/// Parses and validates TOML text, without environment overrides; the first
/// (or only) pipeline.
pub fn load_str(text: &str) -> Result<Config, ConfigError> {
    let mut all = build(text, "config", None)?;
    Ok(all.swap_remove(0))
}

/// Parses and validates TOML text, without environment overrides; every pipeline.
pub fn load_all_str(text: &str) -> Result<Vec<Config>, ConfigError> {
    build(text, "config", None)
}

/// The name of the pipeline a configuration without `[pipelines]` describes.
pub const DEFAULT_PIPELINE: &str = "default";

/// Sections that configure the process, not a pipeline.
const GLOBAL_SECTIONS: &[&str] = &["log", "http"];

fn build(
    text: &str,
    origin: &str,
    env: Option<config::Environment>,
) -> Result<Vec<Config>, ConfigError> {
    let parse_error =
        |e: config::ConfigError| ConfigError::Parse(format!("{origin}: {}", describe(e)));
    let mut builder = config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml));
    if let Some(env) = env {
        builder = builder.add_source(env);
    }
    let merged = builder.build().map_err(parse_error)?;
    let mut root: config::Map<String, config::Value> =
        merged.clone().try_deserialize().map_err(parse_error)?;
    let Some(pipelines) = root.remove("pipelines") else {
        let mut config: Config = merged.try_deserialize().map_err(parse_error)?;
        config.name = DEFAULT_PIPELINE.to_owned();
        config.validate().map_err(ConfigError::Invalid)?;
        return Ok(vec![config]);
    };
    let pipelines = pipelines.into_table().map_err(|_| {
        ConfigError::Parse(format!(
            "{origin}: pipelines: must be tables, written [pipelines.<name>]"
        ))
    })?;
    if pipelines.is_empty() {
        return Err(ConfigError::Parse(format!(
            "{origin}: pipelines: is empty; add a [pipelines.<name>] table or remove it"
        )));
    }
    let mut configs = Vec::new();
    let mut problems = Vec::new();
    for (name, overrides) in pipelines {
        let at = format!("pipelines.{name}");
        if name.is_empty()
            || !name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            problems.push(Problem {
                key: at.clone(),
                message: "a pipeline name uses letters, digits, '_' and '-'".into(),
            });
            continue;
        }
        let overrides = overrides.into_table().map_err(|_| {
            ConfigError::Parse(format!("{origin}: {at}: must be a table of sections"))
        })?;
        for global in GLOBAL_SECTIONS {
            if overrides.contains_key(*global) {
                problems.push(Problem {
                    key: format!("{at}.{global}"),
                    message: format!(
                        "[{global}] configures the whole process; set it at the top level"
                    ),
                });
            }
        }
        let merged = merge(root.clone(), overrides);
        let value = config::Value::new(None, config::ValueKind::Table(merged));
        let mut config: Config = value
            .try_deserialize()
            .map_err(|e| ConfigError::Parse(format!("{origin}: {at}: {}", describe(e))))?;
        config.name = name.clone();
        if let Err(mut p) = config.validate() {
            for problem in &mut p {
                problem.key = format!("{at}: {}", problem.key);
            }
            problems.extend(p);
        }
        configs.push(config);
    }
    check_distinct(&configs, &mut problems);
    if problems.is_empty() {
        Ok(configs)
    } else {
        Err(ConfigError::Invalid(problems))
    }
}

/// Deep-merges `over` into `base`: tables merge key by key, anything else replaces.
fn merge(
    mut base: config::Map<String, config::Value>,
    over: config::Map<String, config::Value>,
) -> config::Map<String, config::Value> {
    for (key, value) in over {
        let merged = match (base.remove(&key), value) {
            (Some(b), v)
                if matches!(b.kind, config::ValueKind::Table(_))
                    && matches!(v.kind, config::ValueKind::Table(_)) =>
            {
                match (b.into_table(), v.into_table()) {
                    (Ok(bt), Ok(vt)) => {
                        config::Value::new(None, config::ValueKind::Table(merge(bt, vt)))
                    }
                    (_, Ok(vt)) => config::Value::new(None, config::ValueKind::Table(vt)),
                    (_, Err(_)) => config::Value::new(None, config::ValueKind::Nil),
                }
            }
            (_, v) => v,
        };
        base.insert(key, merged);
    }
    base
}

/// Two pipelines must not share an outbox table (or a replication slot).
fn check_distinct(configs: &[Config], problems: &mut Vec<Problem>) {
    for (i, a) in configs.iter().enumerate() {
        for b in &configs[..i] {
            if a.outbox.table == b.outbox.table && a.database.url == b.database.url {
                problems.push(Problem {
                    key: format!("pipelines.{}.outbox.table", a.name),
                    message: format!(
                        "{} is already relayed by pipeline {:?}",
                        a.outbox.table, b.name
                    ),
                });
            }
            let slot = |c: &Config| c.source.cdc.slot_name(&c.outbox.table);
            if a.source.mode == super::SourceMode::Cdc
                && b.source.mode == super::SourceMode::Cdc
                && slot(a) == slot(b)
            {
                problems.push(Problem {
                    key: format!("pipelines.{}.source.cdc.slot", a.name),
                    message: format!(
                        "slot {:?} is already used by pipeline {:?}",
                        slot(a),
                        b.name
                    ),
                });
            }
        }
    }
}

/// Rewords the config crate's errors so the key comes first, the way the
/// validation problems read.
fn describe(e: config::ConfigError) -> String {
    match e {
        config::ConfigError::At {
            error,
            key: Some(key),
            origin,
        } => {
            let from = match origin {
                Some(o) if o.contains("environment") || o.starts_with(ENV_PREFIX) => {
                    " (set in the environment)".to_owned()
                }
                _ => String::new(),
            };
            let inner = describe(*error);
            // A nested key reported by a hand-written deserializer (the sink).
            match inner.split_once(super::sink::PATH_SEPARATOR) {
                Some((path, message)) => format!("{key}.{path}{from}: {message}"),
                None => format!("{key}{from}: {inner}"),
            }
        }
        config::ConfigError::At { error, .. } => describe(*error),
        config::ConfigError::Type {
            key: Some(key),
            unexpected,
            expected,
            ..
        } => format!("{key}: expected {expected}, found {unexpected}"),
        other => other.to_string(),
    }
}
