//! Retention: the scheduled cleanup of sent outbox rows and resolved dead
//! letters.
//!
//! Only rows the relay marked sent (`relay_sent_at` set) before
//! `retention.sent_window` are deleted, and only dead letters an operator
//! redrove or dropped before `retention.dead_letter_window`. An unsent row or
//! an open dead letter is never deleted, whatever its age: the condition is in
//! every DELETE, not only in the query that picks the rows. The cutoffs are
//! taken once per run from the server's clock.
//!
//! Rows go in batches of `retention.batch_size`, one statement each (so each
//! batch is its own short transaction), with `retention.pause` between them:
//! row locks last milliseconds and WAL is written at a bounded rate. Rows are
//! picked `FOR UPDATE SKIP LOCKED`
//! (<https://www.postgresql.org/docs/current/sql-select.html#SQL-FOR-UPDATE-SHARE>),
//! so the cleanup never waits for a session working on one of them; a skipped
//! row is taken by a later run.
//!
//! Sent rows are found through `migrate`'s partial index on `relay_sent_at`
//! (oldest first, stopping after one batch) and deleted by `ctid`, a TID scan:
//! nothing else indexes the sent rows of every outbox (`relay_seq` is indexed
//! only while unsent, and an adopted table's id may have no index at all).
//! A row's `ctid` changes only when the row is updated or moved, and the row is
//! locked by the statement that reads and deletes it
//! (<https://www.postgresql.org/docs/current/ddl-system-columns.html>).
//! Without the index (a table `migrate` has not updated yet) the cleanup still
//! works, scanning in any order, and its report says to run `migrate`.
//!
//! With `relay.mark = "ranges"` no row has `relay_sent_at`: rows go by the
//! fold's frontier instead, through the index on `relay_xid` (see
//! [`crate::outbox::progress::retain`]), after the rows another mode marked
//! before.
//!
//! With `retention.mode = "partitions"` sent rows leave with their whole
//! partition instead, and partitions are created ahead of time: see
//! [`partitions`].
//!
//! One instance cleans at a time: the run holds a session advisory lock
//! (<https://www.postgresql.org/docs/current/explicit-locking.html#ADVISORY-LOCKS>)
//! whose key differs from the ownership lock's, so the cleanup does not depend
//! on which instance publishes. Another instance finds it taken and skips its
//! run. A run repeated (after a crash, or from cron beside `run`) is harmless:
//! it deletes what is still eligible.

use super::{ConfigFile, Failure, say};
use crate::config::{Config, MarkMode, RetentionMode};
use crate::config::{SENT_AT_COLUMN, TableName};
use crate::db::DbError;
use crate::errors::ErrorKind;
use crate::outbox::progress::Ranges;
use crate::outbox::sent_index;
use crate::sql::quote_ident;
use chrono::{DateTime, Utc};
use std::time::Duration;
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

pub mod partitions;
mod report;
mod schedule;

pub use report::{Cleanup, Partitions, Report, Skip};
pub use schedule::run_scheduled;

/// Longest wait for a table lock: the cleanup gives way to DDL (such as
/// `migrate`) and tries again at the next run instead of queueing writers
/// behind it.
pub const LOCK_TIMEOUT: Duration = Duration::from_secs(5);

/// The first scheduled run comes after this, or after one interval when that
/// is shorter, so a relay restarted more often than `retention.interval`
/// still cleans.
pub const FIRST_RUN_DELAY: Duration = Duration::from_secs(10);

/// After shutdown, how long a batch already sent to the server may take
/// before the run is abandoned (the server then finishes or rolls back that
/// one statement by itself).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(1);

/// Why a cleanup failed.
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("table {0} does not exist; run outbox-relay migrate, or set outbox.table")]
    MissingTable(TableName),
    #[error("the relay's column {SENT_AT_COLUMN:?} is missing from {0}; run outbox-relay migrate")]
    MissingColumn(TableName),
    /// The outbox's layout does not suit `retention.mode = "partitions"`; the message says why.
    #[error("{0}")]
    Partitions(String),
    /// A table of `relay.mark = "ranges"` is missing; the message names them.
    #[error("{0}")]
    MissingRanges(String),
}

impl RetentionError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            RetentionError::Db(e) => e.kind(),
            RetentionError::MissingTable(_)
            | RetentionError::MissingColumn(_)
            | RetentionError::Partitions(_)
            | RetentionError::MissingRanges(_) => ErrorKind::NeedsOperator,
        }
    }
}

/// `outbox-relay retention --once`: one cleanup of the pipeline, and its report.
pub async fn command(file: &ConfigFile, dry_run: bool) -> Result<(), Failure> {
    let mut config = file.load_one()?;
    let client = connect(&config).await.map_err(Failure::runtime)?;
    crate::ops::marking::choose(&client, &mut config)
        .await
        .map_err(Failure::runtime)?;
    let report = once(&client, &config, dry_run)
        .await
        .map_err(Failure::runtime)?;
    say!("{report}");
    Ok(())
}

/// The key of the session advisory lock held while cleaning `table`.
pub fn lock_key(table: &TableName) -> String {
    format!("{}:retention", crate::outbox::ownership_key(table))
}

/// A connection for the cleanup: `database.*`, plus a short `lock_timeout`.
pub async fn connect(config: &Config) -> Result<Client, RetentionError> {
    let client = crate::db::connect(&config.database, None).await?;
    client
        .batch_execute(&format!("SET lock_timeout = {}", LOCK_TIMEOUT.as_millis()))
        .await
        .map_err(|e| DbError::query("setting lock_timeout", e))?;
    Ok(client)
}

/// Runs one cleanup on `client` and reports it; see the module docs. With
/// `dry_run`, counts what would be deleted and deletes nothing (and takes no
/// lock). When another instance is cleaning, returns at once with
/// [`Report::is_busy`].
pub async fn once(
    client: &Client,
    config: &Config,
    dry_run: bool,
) -> Result<Report, RetentionError> {
    once_until(client, config, dry_run, &CancellationToken::new()).await
}

/// [`once`], stopping between two batches when `stop` is cancelled (the
/// report then says `interrupted`).
pub async fn once_until(
    client: &Client,
    config: &Config,
    dry_run: bool,
    stop: &CancellationToken,
) -> Result<Report, RetentionError> {
    let started = Instant::now();
    let r = &config.retention;
    let mut report = Report {
        dry_run,
        outbox: Cleanup::Skipped(Skip::Busy),
        dead_letters: Cleanup::Skipped(Skip::Busy),
        interrupted: false,
        duration: Duration::ZERO,
        sent_window: r.sent_window,
        dead_letter_window: r.dead_letter_window,
        hint: None,
        partitions: None,
    };
    let key = lock_key(&config.outbox.table);
    if !dry_run && !advisory(client, "pg_try_advisory_lock", &key).await? {
        report.duration = started.elapsed();
        return Ok(report);
    }
    let result = clean(client, config, dry_run, stop, &mut report).await;
    if !dry_run {
        let unlocked = advisory(client, "pg_advisory_unlock", &key).await;
        // A failed query has the better message; the lock goes with the session anyway.
        result?;
        unlocked?;
    } else {
        result?;
    }
    report.duration = started.elapsed();
    Ok(report)
}

async fn advisory(client: &Client, function: &str, key: &str) -> Result<bool, RetentionError> {
    Ok(client
        .query_one(
            &format!("SELECT {function}(hashtextextended($1, 0))"),
            &[&key],
        )
        .await
        .map_err(|e| DbError::query("taking or releasing the retention lock", e))?
        .get(0))
}

/// Cleans both tables into `report`.
async fn clean(
    client: &Client,
    config: &Config,
    dry_run: bool,
    stop: &CancellationToken,
    report: &mut Report,
) -> Result<(), RetentionError> {
    let table = &config.outbox.table;
    let (sent_cutoff, letters_cutoff): (DateTime<Utc>, DateTime<Utc>) = {
        let row = client
            .query_one(
                "SELECT now() - make_interval(secs => $1), now() - make_interval(secs => $2)",
                &[
                    &config.retention.sent_window.as_secs_f64(),
                    &config.retention.dead_letter_window.as_secs_f64(),
                ],
            )
            .await
            .map_err(|e| DbError::query("reading the server's clock", e))?;
        (row.get(0), row.get(1))
    };
    let batches = Batches::new(config, dry_run);
    // In partition mode only the default partition's sent rows go row by row.
    let mut rows_of = Some(table.clone());
    if config.retention.mode == RetentionMode::Partitions {
        let (done, default) = cycle_partitions(client, config, sent_cutoff, dry_run).await?;
        report.partitions = Some(done);
        rows_of = default;
    }
    let (outbox, interrupted) =
        clean_outbox(client, config, rows_of, &batches, sent_cutoff, stop, report).await?;
    report.outbox = outbox;
    report.interrupted = interrupted;
    report.dead_letters = if !config.dead_letter.enabled {
        Cleanup::Skipped(Skip::DeadLettersOff)
    } else if report.interrupted {
        Cleanup::Done {
            rows: 0,
            batches: 0,
        }
    } else {
        let dlq = config.dead_letter.table_name(table);
        if exists(client, &dlq).await? {
            let target = Target::dead_letters(&dlq);
            let (cleanup, interrupted) = batches.run(client, &target, letters_cutoff, stop).await?;
            report.interrupted = interrupted;
            cleanup
        } else {
            Cleanup::Skipped(Skip::NoDeadLetterTable(dlq))
        }
    };
    Ok(())
}

/// Cleans the sent rows of `rows_of` (the outbox, or its default partition;
/// `None`: sent rows leave with their partitions); says whether `stop`
/// ended it early.
async fn clean_outbox(
    client: &Client,
    config: &Config,
    rows_of: Option<TableName>,
    batches: &Batches,
    cutoff: DateTime<Utc>,
    stop: &CancellationToken,
    report: &mut Report,
) -> Result<(Cleanup, bool), RetentionError> {
    let table = &config.outbox.table;
    let rows_of = match (config.relay.mark, rows_of) {
        (MarkMode::Delete, _) => return Ok((Cleanup::Skipped(Skip::MarkDelete), false)),
        (MarkMode::None, _) => return Ok((Cleanup::Skipped(Skip::MarkNone), false)),
        (MarkMode::Update, None) => return Ok((Cleanup::Skipped(Skip::ByPartition), false)),
        (MarkMode::Ranges, None) => {
            prune_frontier(client, batches, cutoff, &Ranges::new(table)).await?;
            return Ok((Cleanup::Skipped(Skip::ByPartition), false));
        }
        (MarkMode::Update | MarkMode::Ranges, Some(rows_of)) => rows_of,
    };
    // The index is the outbox's: a partition's copy has another name.
    let indexed = check_outbox(client, table).await?;
    if !indexed {
        report.hint = Some(format!(
            "index {} is missing, so every batch scans the table: run outbox-relay migrate",
            sent_index(table)
        ));
    }
    // With ranges, rows marked by another mode before still go this way.
    let marked = Target::sent_rows(&rows_of, indexed);
    let (cleanup, interrupted) = batches.run(client, &marked, cutoff, stop).await?;
    if config.relay.mark != MarkMode::Ranges || interrupted {
        return Ok((cleanup, interrupted));
    }
    let ranges = Ranges::new(table);
    let recorded = Target::recorded_rows(&ranges, &rows_of);
    let (more, interrupted) = batches.run(client, &recorded, cutoff, stop).await?;
    prune_frontier(client, batches, cutoff, &ranges).await?;
    let sum = Cleanup::Done {
        rows: cleanup.rows() + more.rows(),
        batches: cleanup.batches() + more.batches(),
    };
    Ok((sum, interrupted))
}

/// Deletes the frontier history older than the cut-off's frontier (in a
/// dry run, nothing), in rows and partitions mode alike.
async fn prune_frontier(
    client: &Client,
    batches: &Batches,
    cutoff: DateTime<Utc>,
    ranges: &Ranges,
) -> Result<(), RetentionError> {
    if !batches.dry_run {
        client
            .execute(&ranges.prune_frontier_sql(), &[&cutoff])
            .await
            .map_err(|e| ranges_failure(ranges, "pruning the frontier's history", e))?;
    }
    Ok(())
}

/// A failed statement on the tables of ranges: a missing one is a setup
/// problem that says to run `migrate`.
fn ranges_failure(ranges: &Ranges, what: &str, e: tokio_postgres::Error) -> RetentionError {
    match ranges.missing_table_problem(&e) {
        Some(problem) => RetentionError::MissingRanges(problem),
        None => DbError::query(what.to_string(), e).into(),
    }
}

/// Creates the partitions due and drops the expired ones; returns what it
/// did and the default partition, if there is one.
async fn cycle_partitions(
    client: &Client,
    config: &Config,
    cutoff: DateTime<Utc>,
    dry_run: bool,
) -> Result<(Partitions, Option<TableName>), RetentionError> {
    let table = &config.outbox.table;
    let r = &config.retention;
    let layout = partitions::layout(client, table).await?;
    let existing = partitions::list(client, table, &layout).await?;
    // The clock, and every relation name of the schema (a partition's name
    // must be free of tables that are not partitions, too).
    let row = client
        .query_one(
            "SELECT now(), ARRAY(SELECT relname::text FROM pg_class
                                 WHERE relnamespace = to_regnamespace($1))",
            &[&table.schema],
        )
        .await
        .map_err(|e| DbError::query("reading the server's clock and the schema's names", e))?;
    let now: DateTime<Utc> = row.get(0);
    let mut done = Partitions::default();
    let wanted = partitions::wanted(now, r.partition_interval, r.partition_premake);
    let default = partitions::default_partition(&existing).cloned();
    let mut taken: Vec<TableName> = row
        .get::<_, Vec<String>>(1)
        .into_iter()
        .map(|name| TableName::new(&table.schema, &name))
        .collect();
    // Whole ranges, or the parts of them no partition holds yet.
    for range in partitions::missing(&wanted, &existing) {
        let name = partitions::name_for(table, range, r.partition_interval, &taken);
        taken.push(name.clone());
        let sql = partitions::create_sql(table, &name, range, &layout);
        let created = if dry_run {
            Ok(())
        } else {
            let at = (range, &layout);
            partitions::create_unless_default_holds(client, default.as_ref(), at, &sql, &name).await
        };
        if let Err(failure) = created {
            done.problems.push(failure.message);
            // The outbox locked is counted only when the range is due
            // soon: the next run retries it, but an outbox that stays
            // locked would let the partitions made ahead run out unseen.
            let due = range.0 - now;
            let soon = chrono::Duration::from_std(r.interval.saturating_mul(2))
                .unwrap_or(chrono::Duration::MAX);
            if !failure.locked || due <= soon {
                done.create_failures += 1;
            }
            if failure.ends_run {
                break;
            }
            continue;
        }
        done.created.push(name);
    }
    let ranges = (config.relay.mark == MarkMode::Ranges).then(|| Ranges::new(table));
    for p in partitions::expired(&existing, now, cutoff, r.partition_interval) {
        let dropped =
            partitions::drop_expired(client, table, &p.name, cutoff, ranges.as_ref(), dry_run);
        // Only an error of the run ends it; one partition's keeps that one.
        match dropped.await? {
            partitions::Outcome::Dropped => done.dropped.push(p.name.clone()),
            partitions::Outcome::Kept(why) => done.kept.push((p.name.clone(), why)),
            partitions::Outcome::Failed(why) => done.failed.push((p.name.clone(), why)),
        }
    }
    Ok((done, default))
}

async fn exists(client: &Client, table: &TableName) -> Result<bool, RetentionError> {
    Ok(client
        .query_one("SELECT to_regclass($1) IS NOT NULL", &[&table.quoted()])
        .await
        .map_err(|e| DbError::query(format!("looking up table {table}"), e))?
        .get(0))
}

/// Checks that the outbox exists and has `relay_sent_at` (so a failure
/// later is not a setup problem in disguise); returns whether the index of
/// sent rows exists.
async fn check_outbox(client: &Client, table: &TableName) -> Result<bool, RetentionError> {
    let index = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(&sent_index(table))
    );
    let row = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL,
                    EXISTS (SELECT 1 FROM pg_attribute
                            WHERE attrelid = to_regclass($1) AND attname = $2 AND NOT attisdropped),
                    to_regclass($3) IS NOT NULL",
            &[&table.quoted(), &SENT_AT_COLUMN, &index],
        )
        .await
        .map_err(|e| DbError::query(format!("looking up table {table}"), e))?;
    match (row.get(0), row.get(1)) {
        (false, _) => Err(RetentionError::MissingTable(table.clone())),
        (true, false) => Err(RetentionError::MissingColumn(table.clone())),
        (true, true) => Ok(row.get(2)),
    }
}

/// The statements of one table: `$1` is the cutoff, `$2` the batch size.
struct Target {
    what: String,
    delete: String,
    count: String,
    /// Rows recorded by these ranges: `delete` also takes `$3`, where the
    /// previous batch ended (text, `'0'` at first), and returns one row,
    /// the rows deleted and where this batch ended.
    recorded: Option<Ranges>,
}

impl Target {
    /// Oldest first through the index; without it, in any order, so a scan
    /// stops after one batch instead of sorting every eligible row. On a
    /// partitioned outbox a `ctid` names a row only within its partition, so
    /// a batch may also take rows of other partitions at the same `ctid`:
    /// each is eligible too (the condition is in the DELETE), and the
    /// batch's bound grows to `batch_size` per partition.
    fn sent_rows(table: &TableName, indexed: bool) -> Target {
        let t = table.quoted();
        let eligible = format!("{SENT_AT_COLUMN} IS NOT NULL AND {SENT_AT_COLUMN} < $1");
        let order = if indexed {
            format!("ORDER BY {SENT_AT_COLUMN} ")
        } else {
            String::new()
        };
        Target {
            what: format!("deleting sent rows from {table}"),
            delete: format!(
                "DELETE FROM {t} WHERE ctid = ANY(ARRAY(
                     SELECT ctid FROM {t} WHERE {eligible}
                     {order}LIMIT $2 FOR UPDATE SKIP LOCKED))
                   AND {eligible}"
            ),
            count: format!("SELECT count(*) FROM {t} WHERE {eligible}"),
            recorded: None,
        }
    }

    /// Rows recorded by ranges and folded before the cut-off (see
    /// [`crate::outbox::progress::retain`]), by transaction.
    fn recorded_rows(ranges: &Ranges, table: &TableName) -> Target {
        Target {
            what: format!("deleting recorded rows from {table}"),
            delete: ranges.retention_delete_sql(table),
            count: ranges.retention_count_sql(table),
            recorded: Some(ranges.clone()),
        }
    }

    fn dead_letters(table: &TableName) -> Target {
        let t = table.quoted();
        let eligible = "resolution IS NOT NULL AND resolved_at < $1";
        Target {
            what: format!("deleting resolved dead letters from {table}"),
            // The primary key gives the order; dead-letter tables stay small.
            delete: format!(
                "DELETE FROM {t} WHERE dead_letter_id = ANY(ARRAY(
                     SELECT dead_letter_id FROM {t} WHERE {eligible}
                     ORDER BY dead_letter_id LIMIT $2 FOR UPDATE SKIP LOCKED))
                   AND {eligible}"
            ),
            count: format!("SELECT count(*) FROM {t} WHERE {eligible}"),
            recorded: None,
        }
    }
}

/// How a run deletes: `batch_size` rows per statement, `pause` between statements.
struct Batches {
    size: u64,
    pause: Duration,
    dry_run: bool,
}

impl Batches {
    fn new(config: &Config, dry_run: bool) -> Self {
        Batches {
            size: config.retention.batch_size.max(1) as u64,
            pause: config.retention.pause,
            dry_run,
        }
    }

    /// Deletes (or counts) `target`'s rows older than `cutoff`; the flag is
    /// true when `stop` ended it early.
    async fn run(
        &self,
        client: &Client,
        target: &Target,
        cutoff: DateTime<Utc>,
        stop: &CancellationToken,
    ) -> Result<(Cleanup, bool), RetentionError> {
        let failed = |e| match &target.recorded {
            Some(ranges) => ranges_failure(ranges, &target.what, e),
            None => RetentionError::from(DbError::query(target.what.clone(), e)),
        };
        if self.dry_run {
            let rows: i64 = client
                .query_one(&target.count, &[&cutoff])
                .await
                .map_err(failed)?
                .get(0);
            let rows = rows.max(0) as u64;
            let batches = rows.div_ceil(self.size);
            return Ok((Cleanup::Done { rows, batches }, false));
        }
        let statement = client.prepare(&target.delete).await.map_err(failed)?;
        let limit = i64::try_from(self.size).unwrap_or(i64::MAX);
        let (mut rows, mut batches) = (0, 0);
        let mut from = String::from("0");
        loop {
            let deleted = if target.recorded.is_some() {
                let row = client
                    .query_one(&statement, &[&cutoff, &limit, &from])
                    .await
                    .map_err(failed)?;
                if let Some(end) = row.get::<_, Option<String>>(1) {
                    from = end;
                }
                row.get::<_, i64>(0).max(0) as u64
            } else {
                client
                    .execute(&statement, &[&cutoff, &limit])
                    .await
                    .map_err(failed)?
            };
            if deleted > 0 {
                rows += deleted;
                batches += 1;
            }
            // A short batch means the table is done (or the rest is locked
            // by someone else, and waits for the next run).
            if deleted < self.size {
                return Ok((Cleanup::Done { rows, batches }, false));
            }
            tokio::select! {
                biased;
                _ = stop.cancelled() => return Ok((Cleanup::Done { rows, batches }, true)),
                _ = tokio::time::sleep(self.pause) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lock_is_not_the_ownership_lock() {
        let t = TableName::new("public", "outbox");
        assert_ne!(lock_key(&t), crate::outbox::ownership_key(&t));
        assert!(lock_key(&t).ends_with(":retention"));
    }
}
