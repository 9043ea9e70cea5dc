//! `relay.mark = "ranges"`: the server can hold multiranges, the three
//! tables that record "sent" are there and the relay's user may use them,
//! the index that finds late committers exists, and the fold keeps up.

use super::{Mark, Report};
use crate::config::{Config, MarkMode, TableName};
use crate::db;
use crate::outbox::inspect;
use crate::outbox::progress::{Ranges, version_problem};
use tokio_postgres::Client;

/// Progress rows older than this (or 20 fold intervals, if longer) mean
/// no fold covers them: the fold is not running, or a transaction
/// outlives its settle wait.
const STALE_PROGRESS_SECONDS: f64 = 60.0;

const ITEM: &str = "ranges";

/// `config` with its marking chosen; with `relay.mark` unset, a line says
/// what the outbox chose. `None` when the choice could not be read.
pub(super) async fn choose(config: &Config, client: &Client, r: &mut Report) -> Option<Config> {
    let mut chosen = config.clone();
    if let Err(e) = crate::ops::marking::choose(client, &mut chosen).await {
        r.add(Mark::Fail, "marking", e.to_string());
        return None;
    }
    if config.mark_chosen_by_outbox() {
        let why = match chosen.relay.mark {
            MarkMode::Ranges => {
                "ranges: relay.mark is unset and the outbox's progress table exists"
            }
            _ => "update: relay.mark is unset and the outbox has no progress table",
        };
        r.add(Mark::Ok, "marking", why);
    }
    Some(chosen)
}

/// Records left by an earlier `ranges`, which another mode would publish
/// again.
async fn check_leftover(config: &Config, client: &Client, r: &mut Report) {
    let ranges = Ranges::new(&config.outbox.table);
    match ranges.leftover_problem(client, config.relay.mark).await {
        Ok(None) => {}
        Ok(Some(problem)) => r.add(Mark::Fail, ITEM, problem),
        Err(e) => r.add(Mark::Warn, ITEM, db::error_text(&e)),
    }
}

pub(super) async fn check_ranges(config: &Config, client: &Client, r: &mut Report) {
    if config.relay.mark != MarkMode::Ranges {
        return check_leftover(config, client, r).await;
    }
    match version_problem(client).await {
        Ok(None) => {}
        Ok(Some(problem)) => return r.add(Mark::Fail, ITEM, problem),
        Err(e) => return r.add(Mark::Warn, ITEM, e),
    }
    let ranges = Ranges::new(&config.outbox.table);
    // Only once the tables exist (a missing one is reported below).
    if let Ok(Some(problem)) = ranges.new_rows_problem(client).await {
        return r.add(Mark::Fail, ITEM, problem);
    }
    // The recorder inserts progress rows; the fold reads and writes all
    // three (holding a row again updates it); retention prunes the
    // frontier's history.
    let needs: [(&TableName, &[&str]); 3] = [
        (&ranges.progress, &["SELECT", "INSERT", "DELETE"]),
        (&ranges.frontier, &["SELECT", "INSERT", "UPDATE", "DELETE"]),
        (&ranges.held, &["SELECT", "INSERT", "UPDATE", "DELETE"]),
    ];
    let mut problems = Vec::new();
    for (table, privileges) in needs {
        match missing_privileges(client, table, privileges).await {
            Ok(None) => problems.push(format!(
                "{table} does not exist (it records what was sent): run `outbox-relay migrate`"
            )),
            Ok(Some(lacking)) if !lacking.is_empty() => problems.push(format!(
                "the relay's database user lacks {} on {table}; GRANT {} ON {table}",
                lacking.join(", "),
                lacking.join(", ")
            )),
            Ok(Some(_)) => {}
            Err(e) => return r.add(Mark::Warn, ITEM, e),
        }
    }
    if !problems.is_empty() {
        return r.add(Mark::Fail, ITEM, problems.join("\n"));
    }
    let mut warnings = Vec::new();
    let schema = &config.outbox.table.schema;
    if !db::index_is_valid(client, schema, &ranges.xid_index)
        .await
        .unwrap_or(false)
    {
        warnings.push(format!(
            "the index {} is missing or invalid: every read looks for late committers through the whole table; run `outbox-relay migrate`",
            ranges.xid_index
        ));
    }
    let sql = format!(
        "SELECT count(*), COALESCE(extract(epoch FROM now() - min(recorded_at))::float8, 0) FROM {}",
        ranges.progress.quoted()
    );
    let (rows, oldest): (i64, f64) = match client.query_one(&sql, &[]).await {
        Ok(row) => (row.get(0), row.get(1)),
        Err(e) => return r.add(Mark::Warn, ITEM, db::error_text(&e)),
    };
    let stale = STALE_PROGRESS_SECONDS.max(20.0 * config.relay.fold_interval.as_secs_f64());
    if oldest > stale {
        warnings.push(format!(
            "{rows} progress row(s), the oldest {oldest:.0} s old: no fold has covered them (is a relay running, or a transaction open that long?)"
        ));
    }
    if warnings.is_empty() {
        r.add(
            Mark::Ok,
            ITEM,
            format!(
                "{}, {} and {} are ready ({rows} progress row(s))",
                ranges.progress, ranges.frontier, ranges.held
            ),
        );
    } else {
        r.add(Mark::Warn, ITEM, warnings.join("\n"));
    }
}

/// The privileges the relay's user lacks on `table`; `None` when the
/// table does not exist.
async fn missing_privileges(
    client: &Client,
    table: &TableName,
    privileges: &[&str],
) -> Result<Option<Vec<String>>, String> {
    if inspect::table_info(client, table)
        .await
        .map_err(|e| db::error_text(&e))?
        .is_none()
    {
        return Ok(None);
    }
    let mut lacking = Vec::new();
    for privilege in privileges {
        let has: bool = client
            .query_one(
                "SELECT has_table_privilege($1::text::regclass, $2)",
                &[&table.quoted(), privilege],
            )
            .await
            .map_err(|e| db::error_text(&e))?
            .get(0);
        if !has {
            lacking.push((*privilege).to_owned());
        }
    }
    Ok(Some(lacking))
}
