//! `outbox-relay check`: a readable report of everything the relay needs.

use super::{ConfigFile, Failure, say};
use crate::config::{Config, SourceMode, TableName};
use crate::db;
use crate::outbox::inspect;
use crate::source::auto::Reading;
use crate::source::cdc::setup;
use peers::{check_broker, check_traces};
use wakeups::check_wakeups;

mod dead_letters;
mod names;
mod peers;
mod ranges;
mod streamed;
mod wakeups;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    Ok,
    Warn,
    Fail,
}

#[derive(Default)]
struct Report {
    lines: Vec<(Mark, String, String)>,
    /// `(aggregate_type, event_type)` of unsent events that go where the
    /// templates say, to check their destinations.
    pending_kinds: Vec<(String, String)>,
    /// Destinations unsent rows name themselves (`outbox.columns.destination`).
    routed: Vec<String>,
}

impl Report {
    fn add(&mut self, mark: Mark, item: &str, detail: impl Into<String>) {
        let detail = detail.into();
        let tag = match mark {
            Mark::Ok => "ok  ",
            Mark::Warn => "warn",
            Mark::Fail => "FAIL",
        };
        // Print as we go: a slow broker should not hide the database result.
        say!(
            "[{tag}] {item:<14} {}",
            detail.replace('\n', "\n                      ")
        );
        self.lines.push((mark, item.to_owned(), detail));
    }

    fn failures(&self) -> usize {
        self.lines
            .iter()
            .filter(|(m, _, _)| *m == Mark::Fail)
            .count()
    }
}

/// `outbox-relay check`: the report of each pipeline; fails when a check
/// failed.
pub async fn command(file: &ConfigFile) -> Result<(), Failure> {
    super::for_each(&file.load_all()?, |c| async move {
        if run(c).await {
            Ok(())
        } else {
            Err(Failure::Reported)
        }
    })
    .await
}

/// A database that stores any bytes as text, which the server then
/// refuses to send to the relay (a UTF8 client) when they are not UTF-8.
const SQL_ASCII: &str = "server_encoding is SQL_ASCII, so text values may hold bytes that are not UTF-8, \
     and an outbox row with one stops the relay (\"invalid byte sequence for encoding UTF8\") until \
     it is fixed: keep event text ASCII or UTF-8, or move the data to a UTF8 database";

/// Prints the report; true when every check passed.
pub async fn run(config: &Config) -> bool {
    let mut r = Report::default();
    r.add(
        Mark::Ok,
        "config",
        format!(
            "valid: {} source, {} sink, table {}",
            config.source.mode.name(),
            config.sink.kind(),
            config.outbox.table
        ),
    );
    check_database(config, &mut r).await;
    check_broker(config, &mut r).await;
    check_traces(config, &mut r).await;
    let failures = r.failures();
    if failures == 0 {
        say!("\nall checks passed");
        true
    } else {
        say!("\n{failures} check(s) failed");
        false
    }
}

async fn check_database(config: &Config, r: &mut Report) {
    let target = db::pg_config(&config.database)
        .map(|c| db::describe_target(&c))
        .unwrap_or_default();
    let client = match db::connect(&config.database, None).await {
        Ok(c) => c,
        Err(e) => return r.add(Mark::Fail, "database", e.to_string()),
    };
    let settings = "SELECT current_setting('server_version'), current_setting('server_encoding')";
    let (version, encoding): (String, String) = match client.query_one(settings, &[]).await {
        Ok(row) => (row.get(0), row.get(1)),
        Err(e) => return r.add(Mark::Fail, "database", db::error_text(&e)),
    };
    let connected = format!("connected to {target} (PostgreSQL {version})");
    r.add(Mark::Ok, "database", connected);
    if encoding == "SQL_ASCII" {
        r.add(Mark::Warn, "database", SQL_ASCII);
    }
    let Some(config) = &ranges::choose(config, &client, r).await else {
        return;
    };
    check_table(config, &client, r).await;
    dead_letters::check_dead_letters(config, &client, r).await;
    ranges::check_ranges(config, &client, r).await;
    check_wakeups(config, &client, r).await;
    if config.retention.mode == crate::config::RetentionMode::Partitions {
        check_partitions(config, &client, r).await;
    }
    match config.source.mode {
        SourceMode::Cdc => check_cdc(config, &client, r).await,
        SourceMode::Auto => check_auto(config, &client, r).await,
        SourceMode::Polling => {}
    }
    check_ownership(config, &client, r).await;
    names::check_owners_table(config, &client, r).await;
    names::check_shared_names(config, &client, r).await;
}

/// The outbox table: columns, types, privileges, then its backlog.
async fn check_table(config: &Config, client: &tokio_postgres::Client, r: &mut Report) {
    let table = &config.outbox.table;
    match inspect::table_info(client, table).await {
        Err(e) => r.add(Mark::Fail, "outbox table", db::error_text(&e)),
        Ok(None) => r.add(
            Mark::Fail,
            "outbox table",
            format!(
                "{table} does not exist or is not visible to this user; run `outbox-relay migrate`"
            ),
        ),
        Ok(Some(info)) => {
            let problems = inspect::verify(
                &info,
                &config.outbox.columns,
                config.relay.mark,
                config.deletes_rows(),
            );
            if problems.is_empty() {
                let resolved = config.outbox.columns.resolve(&info.names());
                let absent: Vec<&str> = [
                    ("event_version", &resolved.event_version),
                    ("headers", &resolved.headers),
                    ("created_at", &resolved.created_at),
                ]
                .iter()
                .filter(|(_, c)| c.is_none())
                .map(|(k, _)| *k)
                .collect();
                let mut note = if absent.is_empty() {
                    String::new()
                } else {
                    format!(" (no {} column: defaults apply)", absent.join(", "))
                };
                if let Some(p) = &info.partitioning {
                    note.push_str(&format!(
                        "; partitioned by {} ({})",
                        p.strategy,
                        p.columns.join(", ")
                    ));
                }
                // A column CDC cannot stream fails the table: no "fit" first.
                let streamed = streamed::streamed_problems(config, client, &resolved).await;
                if !streamed.iter().any(|(mark, _)| *mark == Mark::Fail) {
                    r.add(
                        Mark::Ok,
                        "outbox table",
                        format!("{table}: columns, types and privileges fit{note}"),
                    );
                }
                for (mark, problem) in streamed {
                    r.add(mark, "outbox table", problem);
                }
            }
            for w in inspect::warnings(&info, &config.outbox.columns) {
                r.add(Mark::Warn, "outbox table", w);
            }
            for p in problems {
                r.add(Mark::Fail, "outbox table", p);
            }
            check_backlog(config, client, r).await;
        }
    }
}

/// Whether another instance holds the outbox now.
async fn check_ownership(config: &Config, client: &tokio_postgres::Client, r: &mut Report) {
    let key = crate::outbox::ownership_key(&config.outbox.table);
    match client
        .query_one(
            "SELECT pg_try_advisory_lock(hashtextextended($1, 0)) AS free,
                    pg_advisory_unlock(hashtextextended($1, 0))",
            &[&key],
        )
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => r.add(
            Mark::Ok,
            "ownership",
            "no instance is active on this outbox now",
        ),
        Ok(_) => r.add(
            Mark::Ok,
            "ownership",
            "another instance is active on this outbox (a new one would wait as standby)",
        ),
        Err(e) => r.add(Mark::Warn, "ownership", db::error_text(&e)),
    }
}

/// `retention.mode = "partitions"`: the layout suits it, and partitions hold
/// the current time and the ranges made ahead (an insert into a time no
/// partition holds fails, unless a default partition takes it).
async fn check_partitions(config: &Config, client: &tokio_postgres::Client, r: &mut Report) {
    use crate::ops::retention::partitions;
    let table = &config.outbox.table;
    let layout = match partitions::layout(client, table).await {
        Ok(layout) => layout,
        Err(e) => return r.add(Mark::Fail, "partitions", e.to_string()),
    };
    let existing = match partitions::list(client, table, &layout).await {
        Ok(existing) => existing,
        Err(e) => return r.add(Mark::Fail, "partitions", e.to_string()),
    };
    let now: chrono::DateTime<chrono::Utc> = match client.query_one("SELECT now()", &[]).await {
        Ok(row) => row.get(0),
        Err(e) => return r.add(Mark::Fail, "partitions", db::error_text(&e)),
    };
    let retention = &config.retention;
    let described = format!(
        "{} partitions of {table} by range on {}; retention creates {} ahead and drops those older than {}",
        existing.len(),
        layout.column,
        retention.partition_premake,
        humantime::format_duration(retention.sent_window.max(retention.partition_interval))
    );
    let gaps = partitions::coverage::gaps_ahead(
        now,
        retention.partition_interval,
        retention.partition_premake,
        &existing,
    );
    let Some(gap) = partitions::coverage::describe_gaps(now, &gaps) else {
        return r.add(Mark::Ok, "partitions", described);
    };
    if partitions::default_partition(&existing).is_some() {
        let detail = format!("{described}; {gap}: the default partition takes those rows");
        return r.add(Mark::Ok, "partitions", detail);
    }
    let when = if gaps[0].0 <= now { "now" } else { "then" };
    r.add(
        Mark::Warn,
        "partitions",
        format!(
            "{described}; {gap}, so inserts fail {when} until retention creates the missing \
             partitions (at start-up of `run` and every retention.interval, or with \
             `outbox-relay retention --once`)"
        ),
    );
}

async fn check_backlog(config: &Config, client: &tokio_postgres::Client, r: &mut Report) {
    if config.relay.mark == crate::config::MarkMode::None {
        return r.add(Mark::Ok, "backlog", crate::ops::status::UNMARKED);
    }
    let ranges = (config.relay.mark == crate::config::MarkMode::Ranges)
        .then(|| crate::outbox::progress::Ranges::new(&config.outbox.table));
    let sql = match &ranges {
        Some(r) => r.read_sql(crate::config::SEQ_COLUMN, "").backlog,
        None => format!(
            "SELECT count(*) FROM {} WHERE {} IS NULL",
            config.outbox.table.quoted(),
            crate::config::SENT_AT_COLUMN
        ),
    };
    match client.query_one(&sql, &[]).await {
        Ok(row) => r.add(
            Mark::Ok,
            "backlog",
            format!("{} unsent row(s)", row.get::<_, i64>(0)),
        ),
        Err(e) => r.add(Mark::Warn, "backlog", db::error_text(&e)),
    }
    let c = &config.outbox.columns;
    let table = config.outbox.table.quoted();
    let unsent = match &ranges {
        Some(r) => r.unsent(&table),
        None => format!("{} IS NULL", crate::config::SENT_AT_COLUMN),
    };
    // Rows that name their own destination do not use the templates'.
    let own = c.destination.as_deref().map(crate::sql::quote_ident);
    let templated = own
        .as_ref()
        .map(|d| format!(" AND {d} IS NULL"))
        .unwrap_or_default();
    // A row missing either is dead-lettered by the relay, not routed.
    let (aggregate_type, event_type) = (
        crate::sql::quote_ident(&c.aggregate_type),
        crate::sql::quote_ident(&c.event_type),
    );
    let kinds = format!(
        "SELECT DISTINCT {aggregate_type}::text, {event_type}::text FROM {table}
         WHERE {unsent}{templated} AND {aggregate_type} IS NOT NULL AND {event_type} IS NOT NULL LIMIT 20"
    );
    if let Ok(rows) = client.query(&kinds, &[]).await {
        r.pending_kinds = rows.iter().map(|row| (row.get(0), row.get(1))).collect();
    }
    if let Some(d) = own {
        let named = format!(
            "SELECT DISTINCT {d}::text FROM {table} WHERE {unsent} AND {d} IS NOT NULL LIMIT 20"
        );
        if let Ok(rows) = client.query(&named, &[]).await {
            r.routed = rows.iter().map(|row| row.get(0)).collect();
        }
    }
}

async fn check_cdc(config: &Config, client: &tokio_postgres::Client, r: &mut Report) {
    let table = &config.outbox.table;
    let cdc = &config.source.cdc;
    let (slot, publication) = (cdc.slot_name(table), cdc.publication_name(table));
    match setup::wal_level(client).await {
        Ok(level) => match setup::wal_level_problem(&level) {
            None => r.add(Mark::Ok, "wal_level", "logical"),
            Some(p) => r.add(Mark::Fail, "wal_level", p),
        },
        Err(e) => r.add(Mark::Fail, "wal_level", e.to_string()),
    }
    match setup::roles_without_replication(client).await {
        Ok(lacking) if lacking.is_empty() => {
            r.add(Mark::Ok, "replication", "the role may stream (REPLICATION)")
        }
        Ok(lacking) => r.add(
            Mark::Fail,
            "replication",
            format!(
                "the relay's role ({}) lacks the REPLICATION attribute; run {} as a superuser",
                lacking.join(", "),
                setup::grant_replication(&lacking)
            ),
        ),
        Err(e) => r.add(Mark::Warn, "replication", e.to_string()),
    }
    check_publication(client, &publication, table, r).await;
    check_slot(config, client, &slot, r).await;
    if cdc.failover {
        check_failover(client, &slot, r).await;
    }
    if let Some(prefix) = cdc.message_prefix(&config.outbox.table) {
        check_messages(client, &config.outbox.table, &prefix, r).await;
    }
}

/// The publication exists and publishes the table's inserts.
async fn check_publication(
    client: &tokio_postgres::Client,
    publication: &str,
    table: &TableName,
    r: &mut Report,
) {
    match setup::publication_covers(client, publication, table).await {
        Ok(Some(true)) => r.add(
            Mark::Ok,
            "publication",
            format!("{publication} publishes inserts into {table}"),
        ),
        Ok(Some(false)) => r.add(
            Mark::Fail,
            "publication",
            setup::not_published_problem(client, publication, table)
                .await
                .unwrap_or_else(|e| e.to_string()),
        ),
        Ok(None) => r.add(
            Mark::Fail,
            "publication",
            format!("{publication} does not exist; run `outbox-relay migrate`"),
        ),
        Err(e) => r.add(Mark::Fail, "publication", e.to_string()),
    }
}

/// The slot exists on this database, is usable, and how far behind it is.
async fn check_slot(config: &Config, client: &tokio_postgres::Client, slot: &str, r: &mut Report) {
    let cdc = &config.source.cdc;
    let database: String = client
        .query_one("SELECT current_database()::text", &[])
        .await
        .map(|row| row.get(0))
        .unwrap_or_default();
    match setup::slot_info(client, slot).await {
        Ok(Some(info)) => {
            let problems = setup::slot_problems(&info, slot, &database);
            if problems.is_empty() && !info.is_lost() {
                r.add(
                    Mark::Ok,
                    "slot",
                    format!(
                        "{slot}: {}, WAL status {}, retains {}, {} behind the server",
                        if info.active {
                            "streaming"
                        } else {
                            "not streaming"
                        },
                        info.wal_status.as_deref().unwrap_or("?"),
                        super::mib(info.retained_bytes),
                        super::mib(info.lag_bytes)
                    ),
                );
            }
            for p in problems {
                r.add(Mark::Fail, "slot", p);
            }
            if info.is_lost() {
                report_lost_slot(config, slot, r);
            }
        }
        Ok(None) if cdc.create_slot => match setup::free_slots(client).await {
            Ok(free) if free <= 0 => r.add(
                Mark::Fail,
                "slot",
                format!(
                    "{slot} does not exist and every replication slot is in use, so `run` cannot create it: \
                     raise max_replication_slots (restart needed) or drop an unused slot"
                ),
            ),
            Ok(_) => r.add(
                Mark::Warn,
                "slot",
                format!("{slot} does not exist yet; `run` creates it (or run `outbox-relay migrate`)"),
            ),
            Err(e) => r.add(Mark::Fail, "slot", e.to_string()),
        },
        Ok(None) => r.add(
            Mark::Fail,
            "slot",
            format!("{slot} does not exist; run `outbox-relay migrate`"),
        ),
        Err(e) => r.add(Mark::Fail, "slot", e.to_string()),
    }
}

/// A lost slot fails the check, unless `run` recreates it.
fn report_lost_slot(config: &Config, slot: &str, r: &mut Report) {
    let cdc = &config.source.cdc;
    let marked = config.relay.mark != crate::config::MarkMode::None && !cdc.messages;
    if cdc.recreates_lost_slot(config.relay.mark) {
        r.add(
            Mark::Warn,
            "slot",
            format!(
                "{slot} is lost (PostgreSQL removed WAL it still needed); `run` drops it, creates a new one \
                 and publishes the unsent rows from the table first (source.cdc.on_lost_slot = \"recreate\")"
            ),
        );
    } else {
        r.add(Mark::Fail, "slot", setup::lost_slot_message(slot, marked));
    }
}

/// `source.cdc.messages`: the server sends logical messages, and the
/// function applications write them with is installed.
async fn check_messages(
    client: &tokio_postgres::Client,
    table: &crate::config::TableName,
    prefix: &str,
    r: &mut Report,
) {
    match setup::messages_problem(client).await {
        Ok(Some(problem)) => return r.add(Mark::Fail, "messages", problem),
        Err(e) => return r.add(Mark::Fail, "messages", e),
        Ok(None) => {}
    }
    match crate::outbox::emit::prefix_problem(client, table, prefix).await {
        Ok(Some(problem)) => return r.add(Mark::Fail, "messages", problem),
        Err(e) => return r.add(Mark::Fail, "messages", crate::db::error_text(&e)),
        Ok(None) => {}
    }
    let function = crate::outbox::emit::signature(table);
    match client
        .query_one("SELECT to_regprocedure($1) IS NOT NULL", &[&function])
        .await
    {
        Ok(row) if row.get::<_, bool>(0) => r.add(
            Mark::Ok,
            "messages",
            format!("events sent as logical messages with prefix {prefix:?} are published; {function} writes them"),
        ),
        Ok(_) => r.add(
            Mark::Warn,
            "messages",
            format!(
                "{function} does not exist: run `outbox-relay migrate` to install it, or write events with \
                 pg_logical_emit_message(true, {prefix:?}, <json>) yourself"
            ),
        ),
        Err(e) => r.add(Mark::Fail, "messages", crate::db::error_text(&e)),
    }
}

/// `source.mode = "auto"`: which way `run` would read now. When CDC is
/// possible, the CDC checks follow; when not, why, as a warning: polling
/// works meanwhile.
async fn check_auto(config: &Config, client: &tokio_postgres::Client, r: &mut Report) {
    match crate::source::auto::probe(client, config).await {
        Ok(Reading::Cdc) => {
            r.add(
                Mark::Ok,
                "source",
                "auto: CDC is possible, `run` reads by CDC",
            );
            check_cdc(config, client, r).await;
        }
        Ok(Reading::Polling(blocked)) => r.add(
            Mark::Warn,
            "source",
            format!(
                "auto: `run` polls, since CDC is not possible now ({}): {blocked}; it switches to CDC within source.auto.probe_interval ({}) once it is",
                blocked.reason,
                humantime::format_duration(config.source.auto.probe_interval)
            ),
        ),
        Err(e) => r.add(Mark::Fail, "source", e.to_string()),
    }
}

/// `source.cdc.failover`: the server can make failover slots, and the slot is one.
async fn check_failover(client: &tokio_postgres::Client, slot: &str, r: &mut Report) {
    match setup::failover_problem(client).await {
        Ok(Some(problem)) => return r.add(Mark::Fail, "failover", problem),
        Err(e) => return r.add(Mark::Fail, "failover", e),
        Ok(None) => {}
    }
    match setup::slot_failover(client, slot).await {
        Ok(Some(true)) => r.add(Mark::Ok, "failover", format!("{slot} is a failover slot")),
        Ok(Some(false)) => r.add(
            Mark::Warn,
            "failover",
            format!(
                "{slot} is not a failover slot, so it would not survive a failover: run \
                 ALTER_REPLICATION_SLOT {slot} (FAILOVER true) on a replication connection \
                 (dropping it for `run` to create again loses what it had not delivered \
                 when rows are not marked)"
            ),
        ),
        Ok(None) => r.add(
            Mark::Ok,
            "failover",
            format!("{slot} will be created as a failover slot"),
        ),
        Err(e) => r.add(Mark::Fail, "failover", e),
    }
}
