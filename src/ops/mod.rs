//! The operator commands: each subcommand of the CLI is one function here
//! (`run`, `migrate`, `check`, `status`, `dlq`, `retention`, `fold`), and may use
//! every layer below (configuration, the outbox contract, sources, sinks,
//! the pipeline). Each returns a [`Failure`] that decides the exit code in
//! [`crate::cli`]; what it prints on success is its report.

pub mod check;
pub mod daemon;
pub mod dlq;
pub mod fold;
pub mod gauges;
pub mod marking;
pub mod migrate;
pub mod report;
pub mod retention;
pub mod status;

use report::{complain, say};

use crate::config::{self, Config};
use std::error::Error;
use std::future::Future;
use std::path::PathBuf;

type Cause = Box<dyn Error + Send + Sync>;

/// Why a command did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum Failure {
    /// The configuration cannot be used: unreadable, invalid, or not
    /// naming the pipeline asked for.
    #[error(transparent)]
    Config(Cause),
    /// A connection, query or start-up failed.
    #[error(transparent)]
    Runtime(Cause),
    /// The command ran and its report (already printed) names the problems:
    /// a failed check, a pipeline whose status could not be read.
    #[error("the report names the problems")]
    Reported,
}

impl Failure {
    pub fn runtime(e: impl Into<Cause>) -> Self {
        Failure::Runtime(e.into())
    }

    /// Prints the failure for the operator, unless its report already did.
    pub fn print(&self) {
        if !matches!(self, Failure::Reported) {
            complain!("error: {self}");
        }
    }
}

/// Which configuration file a command reads, and optionally which one of
/// its pipelines it acts on (`--pipeline`).
#[derive(Debug, Clone)]
pub struct ConfigFile {
    pub path: PathBuf,
    pub pipeline: Option<String>,
}

impl ConfigFile {
    /// The pipelines of the file, or the one `pipeline` names.
    pub fn load_all(&self) -> Result<Vec<Config>, Failure> {
        let all = config::load(&self.path).map_err(|e| Failure::Config(e.into()))?;
        let Some(name) = &self.pipeline else {
            return Ok(all);
        };
        let names: Vec<String> = all.iter().map(|c| c.name.clone()).collect();
        match all.into_iter().find(|c| &c.name == name) {
            Some(c) => Ok(vec![c]),
            None => Err(Failure::Config(
                format!(
                    "{} has no pipeline {name:?}; it has: {}",
                    self.path.display(),
                    names.join(", ")
                )
                .into(),
            )),
        }
    }

    /// The one pipeline a command acts on (the file's only one, or `pipeline`).
    pub fn load_one(&self) -> Result<Config, Failure> {
        let mut all = self.load_all()?;
        if all.len() > 1 {
            let names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
            return Err(Failure::Config(
                format!(
                    "{} defines {} pipelines ({}); this command acts on one: choose it with --pipeline",
                    self.path.display(),
                    all.len(),
                    names.join(", ")
                )
                .into(),
            ));
        }
        Ok(all.remove(0))
    }
}

/// A byte count in MiB for reports, `?` when unknown.
fn mib(bytes: Option<i64>) -> String {
    bytes.map_or("?".into(), |b| format!("{:.1} MiB", b as f64 / 1_048_576.0))
}

/// Runs `one` for each pipeline, with a header before each when there are
/// several. A pipeline that fails has its error printed and the others
/// still run; the command then fails as [`Failure::Reported`].
async fn for_each<'a, F, Fut>(configs: &'a [Config], mut one: F) -> Result<(), Failure>
where
    F: FnMut(&'a Config) -> Fut,
    Fut: Future<Output = Result<(), Failure>>,
{
    let several = configs.len() > 1;
    let mut failed = false;
    for config in configs {
        if several {
            say!("== pipeline {} ==", config.name);
        }
        if let Err(e) = one(config).await {
            e.print();
            failed = true;
        }
    }
    if failed {
        Err(Failure::Reported)
    } else {
        Ok(())
    }
}
