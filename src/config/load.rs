//! Reading the file, applying environment overrides, and reporting errors.

use super::Config;
use super::collect::{EnvKeys, deserialize_all, locate};
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
    let vars = std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect();
    build(&text, &path.display().to_string(), Some(vars))
}

/// Like [`load_str`], with these variables as the environment.
#[cfg(test)]
pub fn load_str_with_env(text: &str, vars: &[(&str, &str)]) -> Result<Vec<Config>, ConfigError> {
    let vars = vars
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
    build(text, "config", Some(vars))
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
const GLOBAL_SECTIONS: &[&str] = &["log", "http", "telemetry"];

fn build(
    text: &str,
    origin: &str,
    env: Option<config::Map<String, String>>,
) -> Result<Vec<Config>, ConfigError> {
    let env_keys = env.as_ref().map(EnvKeys::new).unwrap_or_default();
    let overridden = env.is_some();
    // The environment's values alone: they win over a pipeline's table too.
    let env_only = match &env {
        Some(vars) => read_root("", origin, Some(vars.clone()))?,
        None => Table::new(),
    };
    let mut root = read_root(text, origin, env)?;
    let Some(pipelines) = root.remove("pipelines") else {
        return read_single(root, origin, &env_keys);
    };
    let mut problems = Vec::new();
    if overridden {
        unknown_pipelines(text, origin, &env_keys, &mut problems)?;
    }
    let mut configs = Vec::new();
    for (name, overrides) in pipeline_tables(pipelines, origin)? {
        let pipeline = Named {
            name: &name,
            origin,
            env_keys: &env_keys,
            env_only: &env_only,
        };
        let read = read_named(&root, &pipeline, overrides, &mut problems)?;
        configs.extend(read);
    }
    check_distinct(&configs, &mut problems);
    if problems.is_empty() {
        Ok(configs)
    } else {
        Err(ConfigError::Invalid(problems))
    }
}

type Table = config::Map<String, config::Value>;

/// The file's text with the environment's overrides merged over it.
fn read_root(
    text: &str,
    origin: &str,
    env: Option<config::Map<String, String>>,
) -> Result<Table, ConfigError> {
    let parse_error = |e: config::ConfigError| {
        ConfigError::Parse(format!("{origin}: {}", without_quoted_lines(&describe(e))))
    };
    let mut builder = config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml));
    if let Some(vars) = env {
        builder = builder.add_source(
            // Values stay text (no `try_parsing`): the config crate reads a
            // number out of text where a key wants one, while parsing every
            // value would turn a password `0123` into `123`, or `1e3`
            // into `1000`.
            config::Environment::with_prefix(ENV_PREFIX)
                .prefix_separator(ENV_SEPARATOR)
                .separator(ENV_SEPARATOR)
                .source(Some(vars)),
        );
    }
    let merged = builder.build().map_err(parse_error)?;
    merged.try_deserialize().map_err(parse_error)
}

/// Environment variables that name a pipeline the file does not have: the
/// config crate lowercases their keys, so `OUTBOX_RELAY__PIPELINES__ORDERS__...`
/// cannot reach a pipeline named `Orders`, and would make a new one.
fn unknown_pipelines(
    text: &str,
    origin: &str,
    env_keys: &EnvKeys,
    problems: &mut Vec<Problem>,
) -> Result<(), ConfigError> {
    let in_file: Vec<String> = match read_root(text, origin, None)?.remove("pipelines") {
        Some(p) => pipeline_tables(p, origin)?.into_keys().collect(),
        None => return Ok(()),
    };
    for (name, var) in env_keys.pipelines() {
        if !in_file.iter().any(|n| n == name) {
            problems.push(Problem {
                key: format!("pipelines.{name} (set by {var})"),
                message: format!(
                    "the file has no pipeline {name:?} (it has {}); environment variables reach pipelines named in lowercase only: rename the pipeline, or fix the variable",
                    in_file.join(", ")
                ),
            });
        }
    }
    Ok(())
}

/// A file without `[pipelines]`: one pipeline, named [`DEFAULT_PIPELINE`].
fn read_single(root: Table, origin: &str, env_keys: &EnvKeys) -> Result<Vec<Config>, ConfigError> {
    let (config, mut problems) = read_pipeline(root, origin)?;
    match config {
        Some(mut config) if problems.is_empty() => {
            config.name = DEFAULT_PIPELINE.to_owned();
            Ok(vec![config])
        }
        _ => {
            for p in &mut problems {
                env_keys.annotate(p, None);
            }
            Err(ConfigError::Invalid(problems))
        }
    }
}

/// The `[pipelines.<name>]` tables, by name, so the problems come in the
/// same order every run.
fn pipeline_tables(
    pipelines: config::Value,
    origin: &str,
) -> Result<std::collections::BTreeMap<String, config::Value>, ConfigError> {
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
    Ok(pipelines.into_iter().collect())
}

/// What reading one `[pipelines.<name>]` table needs besides the tables.
struct Named<'a> {
    name: &'a str,
    origin: &'a str,
    env_keys: &'a EnvKeys,
    /// The environment's values alone (top-level keys and pipelines').
    env_only: &'a Table,
}

/// The pipeline `[pipelines.<name>]` describes: the top-level sections with
/// its `overrides` merged over them, then the environment's top-level
/// values, then its values for this pipeline (the environment wins over the
/// file). Its problems go to `problems`.
fn read_named(
    root: &Table,
    named: &Named<'_>,
    overrides: config::Value,
    problems: &mut Vec<Problem>,
) -> Result<Option<Config>, ConfigError> {
    let Named {
        name,
        origin,
        env_keys,
        env_only,
    } = *named;
    let at = format!("pipelines.{name}");
    if name.is_empty()
        || !name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        problems.push(Problem {
            key: at,
            message: "a pipeline name uses letters, digits, '_' and '-'".into(),
        });
        return Ok(None);
    }
    let overrides = overrides
        .into_table()
        .map_err(|_| ConfigError::Parse(format!("{origin}: {at}: must be a table of sections")))?;
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
    let mut base = root.clone();
    let mut env_top = env_only.clone();
    let env_own = env_top
        .remove("pipelines")
        .and_then(|p| p.into_table().ok())
        .and_then(|mut p| p.remove(name))
        .and_then(|p| p.into_table().ok());
    // Another broker type: none of the top-level broker's keys apply.
    if let (Some(own), Some(top)) = (sink_type(&overrides), sink_type(root))
        && own != top
    {
        base.remove("sink");
        env_top.remove("sink");
    }
    let merged = merge(
        merge(merge(base, overrides), env_top),
        env_own.unwrap_or_default(),
    );
    let (config, found) = read_pipeline(merged, &format!("{origin}: {at}"))?;
    for mut problem in found {
        env_keys.annotate(&mut problem, Some(name));
        problem.key = format!("{at}: {}", problem.key);
        problems.push(problem);
    }
    Ok(config.map(|mut config| {
        config.name = name.to_owned();
        config
    }))
}

/// Reads and validates one pipeline's table: the values that cannot be read
/// and those out of range, all of them. `Err` for an error without a key.
fn read_pipeline(
    table: config::Map<String, config::Value>,
    origin: &str,
) -> Result<(Option<Config>, Vec<Problem>), ConfigError> {
    let (mut config, mut problems) = deserialize_all::<Config>(table)
        .map_err(|message| ConfigError::Parse(format!("{origin}: {message}")))?;
    if let Some(config) = &mut config {
        config.relay.mark = config.relay.mark_setting.unwrap_or_default();
    }
    if let Some(config) = &config
        && let Err(found) = config.validate()
    {
        // A key already refused was replaced by its default: not its problem.
        let refused: Vec<String> = problems.iter().map(|p| p.key.clone()).collect();
        problems.extend(found.into_iter().filter(|p| !refused.contains(&p.key)));
        problems.sort_by(|a, b| a.key.cmp(&b.key));
    }
    Ok((config, problems))
}

/// The `type` of the `[sink]` in `table`, when it says one.
fn sink_type(table: &config::Map<String, config::Value>) -> Option<String> {
    let sink = table.get("sink")?.clone().into_table().ok()?;
    sink.get("type")?.clone().into_string().ok()
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

/// Two pipelines must not share an outbox table, a dead-letter table or a
/// replication slot.
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
            let letters = |c: &Config| {
                c.dead_letter
                    .enabled
                    .then(|| c.dead_letter.table_name(&c.outbox.table))
            };
            if a.database.url == b.database.url && letters(a).is_some() && letters(a) == letters(b)
            {
                problems.push(Problem {
                    key: format!("pipelines.{}.dead_letter.table", a.name),
                    message: format!(
                        "{} is already the dead-letter table of pipeline {:?}: a dead letter does not say \
                         which outbox it came from, so each pipeline would redrive the other's; give each its own",
                        letters(a).map(|t| t.to_string()).unwrap_or_default(),
                        b.name
                    ),
                });
            }
            let slot = |c: &Config| c.source.cdc.slot_name(&c.outbox.table);
            if a.source.mode.may_use_cdc() && b.source.mode.may_use_cdc() && slot(a) == slot(b) {
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
/// A TOML syntax error quotes the line it is on, and that line may hold a
/// password (a backslash in a quoted URL is a bad escape): the message keeps
/// the line and column and what is wrong, not the quoted text.
fn without_quoted_lines(message: &str) -> String {
    let quoted = |line: &str| {
        let rest = line
            .trim_start()
            .trim_start_matches(|c: char| c.is_ascii_digit());
        rest.trim_start().starts_with('|')
    };
    message
        .lines()
        .filter(|line| !line.trim().is_empty() && !quoted(line))
        .collect::<Vec<_>>()
        .join(": ")
}

fn describe(e: config::ConfigError) -> String {
    let located = locate(e);
    match located.key {
        Some(key) => format!("{key}: {}", located.message),
        None => located.message,
    }
}
