//! `outbox-relay dlq list | redrive | drop`: the dead-letter commands, on the
//! one pipeline they act on. The statements are in
//! [`crate::dead_letter::admin`], which the simulation drives too.

use super::{ConfigFile, Failure, say};
use crate::config::{Config, TableName};
use crate::dead_letter::admin::{self, Entry, Target};
use tokio_postgres::Client;

/// `dlq list`: which dead letters to show, and how.
#[derive(Debug, Clone)]
pub struct ListOptions {
    pub aggregate: Option<String>,
    pub all: bool,
    pub limit: i64,
    pub json: bool,
}

/// Prints the dead letters `options` select, oldest first.
pub async fn list(file: &ConfigFile, options: &ListOptions) -> Result<(), Failure> {
    let (client, dlq) = open(&file.load_one()?).await?;
    let entries = admin::list(
        &client,
        &dlq,
        options.aggregate.as_deref(),
        options.all,
        options.limit,
    )
    .await
    .map_err(Failure::runtime)?;
    print_entries(&entries, options.json);
    Ok(())
}

/// Puts the `target` dead letters back into the outbox.
pub async fn redrive(file: &ConfigFile, target: &Target) -> Result<(), Failure> {
    let (mut client, dlq) = open(&file.load_one()?).await?;
    let n = admin::redrive(&mut client, &dlq, target)
        .await
        .map_err(Failure::runtime)?;
    say!(
        "requested the redrive of {n} dead letter(s); the active relay publishes them in order \
         (within dead_letter.refresh_interval), and `dlq list` shows them until then"
    );
    Ok(())
}

/// Marks the `target` dead letters dropped.
pub async fn drop(file: &ConfigFile, target: &Target) -> Result<(), Failure> {
    let (mut client, dlq) = open(&file.load_one()?).await?;
    let n = admin::drop(&mut client, &dlq, target)
        .await
        .map_err(Failure::runtime)?;
    say!("dropped {n} dead letter(s)");
    Ok(())
}

/// A connection to the pipeline's database, and its dead-letter table.
async fn open(config: &Config) -> Result<(Client, TableName), Failure> {
    let client = crate::db::connect(&config.database, None)
        .await
        .map_err(Failure::runtime)?;
    Ok((client, config.dead_letter.table_name(&config.outbox.table)))
}

fn print_entries(entries: &[Entry], json: bool) {
    if json {
        for e in entries {
            say!("{}", serde_json::to_string(e).unwrap_or_default());
        }
        return;
    }
    if entries.is_empty() {
        say!("no dead letters");
        return;
    }
    say!(
        "{:<38} {:<16} {:<20} {:<18} {:>8}  {:<20} reason",
        "event id",
        "aggregate type",
        "aggregate id",
        "event type",
        "attempts",
        "dead-lettered at"
    );
    for e in entries {
        let status = match (&e.resolution, e.redrive_requested_at) {
            (Some(r), _) => format!(" [{r}]"),
            (None, Some(_)) => " [redrive requested]".to_owned(),
            (None, None) => String::new(),
        };
        say!(
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
