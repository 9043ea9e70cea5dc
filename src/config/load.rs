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

/// Loads `path`, applies `OUTBOX_RELAY__*` environment overrides and validates.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
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

/// Parses and validates TOML text, without environment overrides.
pub fn load_str(text: &str) -> Result<Config, ConfigError> {
    build(text, "config", None)
}

fn build(
    text: &str,
    origin: &str,
    env: Option<config::Environment>,
) -> Result<Config, ConfigError> {
    let mut builder = config::Config::builder()
        .add_source(config::File::from_str(text, config::FileFormat::Toml));
    if let Some(env) = env {
        builder = builder.add_source(env);
    }
    let merged = builder
        .build()
        .map_err(|e| ConfigError::Parse(format!("{origin}: {}", describe(e))))?;
    let config: Config = merged
        .try_deserialize()
        .map_err(|e| ConfigError::Parse(format!("{origin}: {}", describe(e))))?;
    config.validate().map_err(ConfigError::Invalid)?;
    Ok(config)
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
