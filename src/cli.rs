//! Command-line interface: `run`, `migrate`, `check`, `status`, `dlq`,
//! `retention`. Each subcommand is one call into [`crate::ops`]; [`main`]
//! maps its result to the exit code.

use crate::dead_letter::admin::Target;
use crate::ops::{self, ConfigFile, Failure, dlq};
use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Debug, Parser)]
#[command(
    name = "outbox-relay",
    version,
    about = "Publishes the committed rows of a PostgreSQL outbox table to Kafka or RabbitMQ.",
    long_about = "Publishes the committed rows of a PostgreSQL outbox table to Kafka or RabbitMQ, \
                  in order per aggregate, marking each row sent only after the broker confirmed it.\n\n\
                  Configuration comes from one TOML file; any key can be overridden with an \
                  environment variable OUTBOX_RELAY__SECTION__KEY (e.g. OUTBOX_RELAY__DATABASE__URL)."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Args)]
pub struct ConfigArg {
    /// The TOML configuration file.
    #[arg(long, short, env = "OUTBOX_RELAY_CONFIG", value_name = "FILE")]
    pub config: PathBuf,
    /// Act on this pipeline only (a [pipelines.<name>] of the file).
    #[arg(long, value_name = "NAME")]
    pub pipeline: Option<String>,
}

impl ConfigArg {
    fn file(&self) -> ConfigFile {
        ConfigFile {
            path: self.config.clone(),
            pipeline: self.pipeline.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Relay events until SIGTERM/SIGINT. With other instances on the same outbox,
    /// one is active and the others wait as standbys.
    Run(ConfigArg),
    /// Create the outbox table, or add the relay's columns, index and trigger to an
    /// existing one. Idempotent.
    Migrate {
        #[command(flatten)]
        config: ConfigArg,
        /// Print the SQL that would run, and change nothing.
        #[arg(long)]
        dry_run: bool,
        /// When adding the relay's columns to a table that already has rows, mark
        /// those rows as sent instead of publishing them.
        #[arg(long)]
        mark_existing_sent: bool,
    },
    /// Validate the configuration, connect to the database and the broker, verify the
    /// table, columns and privileges, and print a report. Exits non-zero on any problem.
    Check(ConfigArg),
    /// Is it working, and how far behind is it? The active instance, backlog, oldest
    /// unsent event, dead letters, last publish and replication slot, per pipeline.
    Status {
        #[command(flatten)]
        config: ConfigArg,
        /// One JSON object per pipeline instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Inspect and resolve dead letters: events the broker kept refusing.
    Dlq {
        #[command(subcommand)]
        command: DlqCommand,
    },
    /// Delete sent rows and resolved dead letters older than their retention
    /// windows ([retention]), once, and print what was deleted.
    #[command(
        long_about = "Delete sent rows and resolved dead letters older than their retention windows \
                      ([retention] sent_window, dead_letter_window), in batches, and print what was \
                      deleted. Unsent rows and open dead letters are never deleted. Skips when another \
                      instance is cleaning. `run` already schedules this every retention.interval; \
                      this command is for operators and cron."
    )]
    Retention {
        #[command(flatten)]
        config: ConfigArg,
        /// Run one cleanup now and exit. Required: this command has no daemon mode,
        /// since `run` schedules the cleanup itself.
        #[arg(long, required = true)]
        once: bool,
        /// Count what would be deleted, and delete nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Leave relay.mark = "ranges": mark every row it recorded as
    /// sent in relay_sent_at, then empty its tables.
    #[command(
        long_about = "Leave relay.mark = \"ranges\" for \"update\" or \"delete\": \
                      sets relay_sent_at on every row ranges recorded as sent, in batches, then \
                      empties the progress, frontier and held tables. Stop every instance first: \
                      it refuses while one owns or folds the outbox. Running it again resumes."
    )]
    Fold {
        #[command(flatten)]
        config: ConfigArg,
        /// Write what ranges recorded into relay_sent_at. Required: the fold
        /// itself runs inside `run`.
        #[arg(long, required = true)]
        into_sent_at: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum DlqCommand {
    /// List dead letters, oldest first (open ones unless --all).
    List {
        #[command(flatten)]
        config: ConfigArg,
        /// Only this aggregate's.
        #[arg(long)]
        aggregate: Option<String>,
        /// Include redriven and dropped ones.
        #[arg(long)]
        all: bool,
        /// At most this many (0 to 1,000,000).
        #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(i64).range(0..=1_000_000))]
        limit: i64,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Ask the active relay to publish dead letters again, in order, from the
    /// dead-letter table (their aggregates' waiting events follow them).
    Redrive {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        target: TargetArgs,
    },
    /// Give up on dead letters: they are marked dropped (kept for the record),
    /// and their aggregates resume.
    Drop {
        #[command(flatten)]
        config: ConfigArg,
        #[command(flatten)]
        target: TargetArgs,
    },
}

/// Which dead letters: exactly one of these.
#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct TargetArgs {
    /// One event, by its id.
    #[arg(long)]
    pub id: Option<String>,
    /// Every open dead letter of one aggregate.
    #[arg(long)]
    pub aggregate: Option<String>,
    /// Every open dead letter.
    #[arg(long)]
    pub all: bool,
}

impl TargetArgs {
    fn target(&self) -> Target {
        match (&self.id, &self.aggregate) {
            (Some(id), _) => Target::Id(id.clone()),
            (_, Some(a)) => Target::Aggregate(a.clone()),
            _ => Target::All,
        }
    }
}

/// Exit codes: 0 success, 1 failure at runtime or a failed check, 2 bad configuration.
pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_CONFIG: u8 = 2;

pub async fn main(cli: Cli) -> ExitCode {
    let outcome = run(cli.command).await;
    if let Err(failure) = &outcome {
        failure.print();
    }
    if let Some(e) = ops::report::finish() {
        let done = match &outcome {
            Ok(()) => "the command itself did its work",
            Err(Failure::Reported) => {
                "the command failed, and the report naming the problems is cut short"
            }
            Err(_) => "the command failed, as said above",
        };
        ops::report::complaint(format_args!(
            "error: writing the report to standard output failed: {e}; {done}"
        ));
        if outcome.is_ok() {
            return ExitCode::from(EXIT_FAILURE);
        }
    }
    match outcome {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => ExitCode::from(match failure {
            Failure::Config(_) => EXIT_CONFIG,
            Failure::Runtime(_) | Failure::Reported => EXIT_FAILURE,
        }),
    }
}

async fn run(command: Command) -> Result<(), Failure> {
    match command {
        Command::Run(arg) => ops::daemon::command(&arg.file()).await,
        Command::Migrate {
            config,
            dry_run,
            mark_existing_sent,
        } => ops::migrate::command(&config.file(), dry_run, mark_existing_sent).await,
        Command::Check(arg) => ops::check::command(&arg.file()).await,
        Command::Status { config, json } => ops::status::command(&config.file(), json).await,
        Command::Retention {
            config, dry_run, ..
        } => ops::retention::command(&config.file(), dry_run).await,
        Command::Fold { config, .. } => ops::fold::into_sent_at(&config.file()).await,
        Command::Dlq {
            command:
                DlqCommand::List {
                    config,
                    aggregate,
                    all,
                    limit,
                    json,
                },
        } => {
            let options = dlq::ListOptions {
                aggregate,
                all,
                limit,
                json,
            };
            dlq::list(&config.file(), &options).await
        }
        Command::Dlq {
            command: DlqCommand::Redrive { config, target },
        } => dlq::redrive(&config.file(), &target.target()).await,
        Command::Dlq {
            command: DlqCommand::Drop { config, target },
        } => dlq::drop(&config.file(), &target.target()).await,
    }
}
