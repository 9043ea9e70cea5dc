//! Command-line interface: `run`, `migrate`, `check`, `status`, `dlq`, `retention`.

use crate::config::{self, Config};
use crate::dead_letter::admin::{self, Target};
use crate::migrate::{self, MigrateOptions};
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
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Put dead letters back into the outbox, in order, to be published again
    /// (with the rows of their aggregates still waiting behind them).
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

/// The pipelines of the file, or the one `--pipeline` names.
fn load_all(arg: &ConfigArg) -> Result<Vec<Config>, ExitCode> {
    let all = config::load(&arg.config).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_CONFIG)
    })?;
    match &arg.pipeline {
        None => Ok(all),
        Some(name) => {
            let names: Vec<String> = all.iter().map(|c| c.name.clone()).collect();
            match all.into_iter().find(|c| &c.name == name) {
                Some(c) => Ok(vec![c]),
                None => {
                    eprintln!(
                        "error: {} has no pipeline {name:?}; it has: {}",
                        arg.config.display(),
                        names.join(", ")
                    );
                    Err(ExitCode::from(EXIT_CONFIG))
                }
            }
        }
    }
}

/// The one pipeline a command acts on (the file's only one, or `--pipeline`).
fn load(arg: &ConfigArg) -> Result<Config, ExitCode> {
    let mut all = load_all(arg)?;
    if all.len() > 1 {
        let names: Vec<&str> = all.iter().map(|c| c.name.as_str()).collect();
        eprintln!(
            "error: {} defines {} pipelines ({}); this command acts on one: choose it with --pipeline",
            arg.config.display(),
            all.len(),
            names.join(", ")
        );
        return Err(ExitCode::from(EXIT_CONFIG));
    }
    Ok(all.remove(0))
}

/// Prints a header before each pipeline's output when there are several.
fn each(configs: &[Config]) -> impl Iterator<Item = &Config> {
    let several = configs.len() > 1;
    configs.iter().inspect(move |c| {
        if several {
            println!("== pipeline {} ==", c.name);
        }
    })
}

pub async fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Run(arg) => {
            let configs = match load_all(&arg) {
                Ok(c) => c,
                Err(code) => return code,
            };
            crate::telemetry::init(&configs[0].log);
            let shutdown = match crate::shutdown::on_signals() {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: cannot install signal handlers: {e}");
                    return ExitCode::from(EXIT_FAILURE);
                }
            };
            tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %arg.config.display(), pipelines = configs.len(), "outbox-relay starting");
            match crate::daemon::run(configs, shutdown).await {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    tracing::error!(error = %e, "cannot start");
                    eprintln!("error: {e}");
                    ExitCode::from(EXIT_FAILURE)
                }
            }
        }
        Command::Migrate {
            config,
            dry_run,
            mark_existing_sent,
        } => {
            let configs = match load_all(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let mut code = ExitCode::SUCCESS;
            for c in each(&configs) {
                let result = run_migrate(c, dry_run, mark_existing_sent).await;
                if result != ExitCode::SUCCESS {
                    code = result;
                }
            }
            code
        }
        Command::Check(arg) => {
            let configs = match load_all(&arg) {
                Ok(c) => c,
                Err(code) => return code,
            };
            let mut passed = true;
            for c in each(&configs) {
                passed &= crate::check::run(c).await;
            }
            if passed {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
        Command::Status { config, json } => {
            let configs = match load_all(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            if crate::status::command(&configs, json).await {
                ExitCode::SUCCESS
            } else {
                ExitCode::from(EXIT_FAILURE)
            }
        }
        Command::Dlq { command } => run_dlq(command).await,
        Command::Retention {
            config, dry_run, ..
        } => {
            let config = match load(&config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            run_retention(&config, dry_run).await
        }
    }
}

async fn run_dlq(command: DlqCommand) -> ExitCode {
    let arg = match &command {
        DlqCommand::List { config, .. }
        | DlqCommand::Redrive { config, .. }
        | DlqCommand::Drop { config, .. } => config,
    };
    let config = match load(arg) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let fail = |e: &dyn std::fmt::Display| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_FAILURE)
    };
    let mut client = match crate::db::connect(&config.database, None).await {
        Ok(c) => c,
        Err(e) => return fail(&e),
    };
    let table = &config.outbox.table;
    let dlq = config.dead_letter.table_name(table);
    match command {
        DlqCommand::List {
            aggregate,
            all,
            limit,
            json,
            ..
        } => match admin::list(&client, &dlq, aggregate.as_deref(), all, limit).await {
            Ok(entries) => {
                print_entries(&entries, json);
                ExitCode::SUCCESS
            }
            Err(e) => fail(&e),
        },
        DlqCommand::Drop { target, .. } => {
            match admin::drop(&mut client, &dlq, &target.target()).await {
                Ok(n) => {
                    println!("dropped {n} dead letter(s)");
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
        DlqCommand::Redrive { target, .. } => {
            match admin::redrive(&mut client, &dlq, &target.target()).await {
                Ok(n) => {
                    println!(
                        "requested the redrive of {n} dead letter(s); the active relay publishes them in order \
                         (within dead_letter.refresh_interval), and `dlq list` shows them until then"
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => fail(&e),
            }
        }
    }
}

async fn run_retention(config: &Config, dry_run: bool) -> ExitCode {
    let report = match crate::retention::connect(config).await {
        Ok(client) => crate::retention::once(&client, config, dry_run).await,
        Err(e) => Err(e),
    };
    match report {
        Ok(report) => {
            println!("{report}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}

fn print_entries(entries: &[admin::Entry], json: bool) {
    if json {
        for e in entries {
            println!("{}", serde_json::to_string(e).unwrap_or_default());
        }
        return;
    }
    if entries.is_empty() {
        println!("no dead letters");
        return;
    }
    println!(
        "{:<38} {:<16} {:<20} {:<18} {:>8}  {:<20} reason",
        "event id", "aggregate type", "aggregate id", "event type", "attempts", "dead-lettered at"
    );
    for e in entries {
        let status = match &e.resolution {
            Some(r) => format!(" [{r}]"),
            None => String::new(),
        };
        println!(
            "{:<38} {:<16} {:<20} {:<18} {:>8}  {:<20} {}{status}",
            e.id,
            e.aggregate_type.as_deref().unwrap_or("-"),
            e.aggregate_id.as_deref().unwrap_or("-"),
            e.event_type.as_deref().unwrap_or("-"),
            e.attempts,
            e.dead_lettered_at.format("%Y-%m-%d %H:%M:%S"),
            e.reason
        );
    }
}

async fn run_migrate(config: &Config, dry_run: bool, mark_existing_sent: bool) -> ExitCode {
    let mut client = match crate::db::connect(&config.database, None).await {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    let options = MigrateOptions::from_config(config, mark_existing_sent);
    let steps = match migrate::plan(&client, &options).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(EXIT_FAILURE);
        }
    };
    if steps.is_empty() {
        println!(
            "-- nothing to do: {} is ready for outbox-relay",
            options.table
        );
        return ExitCode::SUCCESS;
    }
    for (i, step) in steps.iter().enumerate() {
        println!("-- {}. {}\n{};\n", i + 1, step.description, step.sql);
    }
    if dry_run {
        println!("-- dry run: nothing was changed");
        return ExitCode::SUCCESS;
    }
    match migrate::apply(&mut client, &steps).await {
        Ok(()) => {
            println!("-- applied {} step(s)", steps.len());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(EXIT_FAILURE)
        }
    }
}
