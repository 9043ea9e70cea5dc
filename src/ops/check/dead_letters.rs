//! The dead-letter table: there, with the columns this version writes, and
//! with the indexes that keep the relay's periodic look at it cheap.

use super::{Mark, Report};
use crate::config::Config;
use crate::db;
use crate::dead_letter::{LATER_COLUMNS, lookups, missing_column, missing_table};
use crate::outbox::inspect;
use tokio_postgres::Client;

pub(super) async fn check_dead_letters(config: &Config, client: &Client, r: &mut Report) {
    if !config.dead_letter.enabled {
        return;
    }
    let table = config.dead_letter.table_name(&config.outbox.table);
    let info = match inspect::table_info(client, &table).await {
        Ok(Some(info)) => info,
        Ok(None) => return r.add(Mark::Fail, "dead letters", missing_table(&table)),
        Err(e) => return r.add(Mark::Warn, "dead letters", db::error_text(&e)),
    };
    let names = info.names();
    let lacking: Vec<&str> = LATER_COLUMNS
        .iter()
        .map(|(name, _)| *name)
        .filter(|name| !names.iter().any(|n| n == name))
        .collect();
    if !lacking.is_empty() {
        return r.add(
            Mark::Fail,
            "dead letters",
            missing_column(&table, &lacking.join(", ")),
        );
    }
    let mut missing = Vec::new();
    for index in lookups::indexes(&table) {
        match db::index_is_valid(client, &table.schema, &index.name).await {
            Ok(true) => {}
            Ok(false) => missing.push(format!("{} ({})", index.name, index.purpose)),
            Err(e) => return r.add(Mark::Warn, "dead letters", db::error_text(&e)),
        }
    }
    if missing.is_empty() {
        r.add(Mark::Ok, "dead letters", format!("{table} is ready"));
    } else {
        r.add(
            Mark::Warn,
            "dead letters",
            format!(
                "{table} lacks the index(es) {}: the relay's look at it every dead_letter.refresh_interval reads every open letter instead; run `outbox-relay migrate`",
                missing.join(", ")
            ),
        );
    }
}
