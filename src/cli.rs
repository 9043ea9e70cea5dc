//! Command-line interface: `run`, `migrate`, `check`.

use crate::config::{self, Config};
use crate::outbox::migrate::{self, MigrateOptions};
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
}

/// Exit codes: 0 success, 1 failure at runtime or a failed check, 2 bad configuration.
pub const EXIT_FAILURE: u8 = 1;
pub const EXIT_CONFIG: u8 = 2;

fn load(path: &std::path::Path) -> Result<Config, ExitCode> {
    config::load(path).map_err(|e| {
        eprintln!("error: {e}");
        ExitCode::from(EXIT_CONFIG)
    })
}

pub async fn main(cli: Cli) -> ExitCode {
    match cli.command {
        Command::Run(arg) => {
            let config = match load(&arg.config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            crate::telemetry::init(&config.log);
            let shutdown = match crate::shutdown::on_signals() {
                Ok(t) => t,
                Err(e) => {
                    eprintln!("error: cannot install signal handlers: {e}");
                    return ExitCode::from(EXIT_FAILURE);
                }
            };
            tracing::info!(version = env!("CARGO_PKG_VERSION"), config = %arg.config.display(), "outbox-relay starting");
            crate::relay::run(&config, shutdown).await;
            ExitCode::SUCCESS
        }
        Command::Migrate {
            config,
            dry_run,
            mark_existing_sent,
        } => {
            let config = match load(&config.config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            run_migrate(&config, dry_run, mark_existing_sent).await
        }
        Command::Check(arg) => {
            let config = match load(&arg.config) {
                Ok(c) => c,
                Err(code) => return code,
            };
            crate::check::run(&config).await
        }
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
