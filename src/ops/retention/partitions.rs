//! Partition retention (`retention.mode = "partitions"`): on an outbox
//! partitioned by range on a time column, sent events leave a whole
//! partition at a time, and partitions are created ahead so no insert finds
//! its range missing.
//!
//! Each run, under the retention lock:
//!
//! 1. **Create ahead.** The ranges are `retention.partition_interval` long,
//!    aligned to the Unix epoch in UTC (a `1d` interval starts at midnight
//!    UTC); the one holding the server's `now()` and the next
//!    `retention.partition_premake` are created, each where no partition
//!    holds it yet: partitions made by hand, by another tool or under
//!    another interval are left alone, whatever their bounds, and only the
//!    parts of a range they leave uncovered are created (see [`coverage`]).
//!    They are named `<table>_p<YYYYMMDD>`, or `<table>_p<YYYYMMDD>_<HHMM>`
//!    for intervals that are not whole days and for such parts.
//! 2. **Drop.** A partition is dropped only when its whole range ends at or
//!    before the retention cutoff (`now() - retention.sent_window`) and at
//!    least one `partition_interval` ago (see [`coverage::expired`]), no row
//!    in it is unsent, and none was sent after the cutoff. It is detached
//!    first (`ALTER TABLE ... DETACH PARTITION`, which takes an ACCESS
//!    EXCLUSIVE lock on the outbox for a moment, under a short
//!    `lock_timeout` so writers never queue behind a long wait) and checked
//!    again under that lock, then dropped in the same transaction: a row
//!    written into the range meanwhile keeps the partition. Dead letters keep
//!    their own copy of the event, so they never hold a partition. A
//!    partition the server refuses to drop (the relay's role does not own
//!    it, a view depends on it, a statement timed out) is kept and reported
//!    with the fix; the run goes on with the others.
//!
//! The default partition (if the application made one) is never dropped and
//! never created: its sent rows are deleted row by row like a plain table's.
//! PostgreSQL refuses to create a partition whose range holds rows of the
//! default partition; the run reports it and goes on with the next ranges,
//! which then take the new rows, while the default partition's rows are
//! delivered and later deleted as usual.
//!
//! <https://www.postgresql.org/docs/15/ddl-partitioning.html>

use super::RetentionError;
use crate::config::{SENT_AT_COLUMN, TableName};
use crate::db::DbError;
use crate::outbox::inspect::table_info;
use crate::outbox::progress::Ranges;
use chrono::{DateTime, Utc};
use std::time::Duration;
use tokio_postgres::Client;

pub mod coverage;
pub use coverage::{Range, expired, missing, wanted};

/// The longest wait for the outbox's lock when creating or detaching a
/// partition: long enough for the relay's own statements to finish, short
/// enough that inserts never queue behind the DDL for long.
pub const LOCK_WAIT: Duration = Duration::from_secs(1);

/// The longest a partition's creation may hold the outbox's lock: the
/// scan of a default partition that holds many rows would otherwise stop
/// inserts for up to the session's statement timeout, at every run.
pub const CREATE_WITHIN: Duration = Duration::from_secs(5);

/// How the outbox is partitioned, when partition retention can use it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    /// The one range key column.
    pub column: String,
    /// `timestamptz` (else `timestamp`, read as UTC).
    pub with_zone: bool,
}

/// One partition of the outbox. A bound of `None` is unbounded
/// (`MINVALUE`, `MAXVALUE`) or not a single time value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partition {
    pub name: TableName,
    pub lower: Option<DateTime<Utc>>,
    pub upper: Option<DateTime<Utc>>,
    pub default: bool,
}

/// Reads the table's partitioning; explains why partition retention cannot
/// use it (the message names `retention.mode`).
pub async fn layout(client: &Client, table: &TableName) -> Result<Layout, RetentionError> {
    let info = table_info(client, table)
        .await
        .map_err(|e| DbError::query(format!("inspecting {table}"), e))?
        .ok_or_else(|| RetentionError::MissingTable(table.clone()))?;
    let unusable = |why: String| {
        RetentionError::Partitions(format!(
            "retention.mode = \"partitions\" needs {table} partitioned by RANGE on one timestamptz or \
             timestamp column (e.g. PARTITION BY RANGE (created_at)), but {why}; \
             partition it so, or set retention.mode = \"rows\""
        ))
    };
    let Some(p) = &info.partitioning else {
        return Err(unusable("it is not partitioned".into()));
    };
    if p.strategy != "range" {
        return Err(unusable(format!("it is partitioned by {}", p.strategy)));
    }
    let [column] = p.columns.as_slice() else {
        return Err(unusable(format!(
            "its partition key is ({}{})",
            p.columns.join(", "),
            if p.expressions { ", an expression" } else { "" }
        )));
    };
    if p.expressions {
        return Err(unusable("its partition key holds an expression".into()));
    }
    let type_name = info
        .column(column)
        .map(|c| c.type_name.clone())
        .unwrap_or_default();
    let with_zone = match crate::outbox::inspect::base_type(&type_name).as_str() {
        "timestamp with time zone" => true,
        "timestamp without time zone" => false,
        _ => {
            return Err(unusable(format!(
                "its key column {column:?} is {type_name}"
            )));
        }
    };
    Ok(Layout {
        column: column.clone(),
        with_zone,
    })
}

/// The outbox's partitions with their bounds, read from the catalog
/// (`pg_get_expr` of each partition bound, whose values PostgreSQL writes as
/// literals of the key's type).
pub async fn list(
    client: &Client,
    table: &TableName,
    layout: &Layout,
) -> Result<Vec<Partition>, RetentionError> {
    // MINVALUE, MAXVALUE and ±infinity leave a side unbounded (NULL).
    let value = |i: usize| {
        let literal = format!("btrim(m[{i}], '''')");
        if layout.with_zone {
            format!(
                "CASE WHEN m[{i}] LIKE '''%' AND isfinite({literal}::timestamptz) THEN {literal}::timestamptz END"
            )
        } else {
            format!(
                "CASE WHEN m[{i}] LIKE '''%' AND isfinite({literal}::timestamp) \
                 THEN {literal}::timestamp AT TIME ZONE 'UTC' END"
            )
        }
    };
    let sql = format!(
        "SELECT n.nspname::text, c.relname::text, b.bound = 'DEFAULT', {lower}, {upper}
         FROM pg_inherits i
         JOIN pg_class c ON c.oid = i.inhrelid
         JOIN pg_namespace n ON n.oid = c.relnamespace
         CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
         LEFT JOIN LATERAL regexp_match(
             b.bound, '^FOR VALUES FROM \\((MINVALUE|''[^'']*'')\\) TO \\((MAXVALUE|''[^'']*'')\\)$') m ON true
         WHERE i.inhparent = to_regclass($1)
         ORDER BY 4 NULLS FIRST, 2",
        lower = value(1),
        upper = value(2),
    );
    let rows = client
        .query(&sql, &[&table.quoted()])
        .await
        .map_err(|e| DbError::query(format!("listing the partitions of {table}"), e))?;
    let read = |r: &tokio_postgres::Row| -> Result<Partition, tokio_postgres::Error> {
        Ok(Partition {
            name: TableName::new(r.try_get(0)?, r.try_get(1)?),
            default: r.try_get(2)?,
            lower: r.try_get(3)?,
            upper: r.try_get(4)?,
        })
    };
    // A bound past the years chrono holds (PostgreSQL's run to 294276)
    // is an error to report, not a panic.
    rows.iter()
        .map(read)
        .collect::<Result<_, _>>()
        .map_err(|e| DbError::query(format!("reading the partition bounds of {table}"), e).into())
}

/// The name of the partition to create for `range`, within PostgreSQL's
/// 63-byte names: `<table>_p20261201` for a whole range, or
/// `<table>_p20261201_1530` when the interval is not whole days; its start
/// to the minute for a part of one (see [`missing`]); and
/// `_2`, `_3`, ... after it when a partition has that name already (one of
/// `taken`).
pub fn name_for(
    table: &TableName,
    (from, to): Range,
    interval: Duration,
    taken: &[TableName],
) -> TableName {
    let whole = (to - from).to_std().is_ok_and(|d| d == interval);
    let stamp = stamp(from, if whole { interval } else { MINUTE });
    let mut candidate = within_name_limit(table, &stamp);
    let mut k = 2;
    while taken.contains(&candidate) {
        candidate = within_name_limit(table, &format!("{stamp}_{k}"));
        k += 1;
    }
    candidate
}

const MINUTE: Duration = Duration::from_secs(60);

/// `_p20261201`, or `_p20261201_1530` when `interval` is not whole days.
fn stamp(from: DateTime<Utc>, interval: Duration) -> String {
    if interval.as_secs().is_multiple_of(86_400) {
        from.format("_p%Y%m%d").to_string()
    } else {
        from.format("_p%Y%m%d_%H%M").to_string()
    }
}

/// The table's name and `suffix`, the name cut so it fits PostgreSQL's 63
/// bytes.
fn within_name_limit(table: &TableName, suffix: &str) -> TableName {
    let mut base = table.name.clone();
    while base.len() + suffix.len() > 63 {
        base.pop();
    }
    TableName::new(&table.schema, &format!("{base}{suffix}"))
}

/// A bound as a literal of the key's type, in UTC.
fn literal(at: DateTime<Utc>, layout: &Layout) -> String {
    if layout.with_zone {
        at.format("'%Y-%m-%d %H:%M:%S+00'").to_string()
    } else {
        at.format("'%Y-%m-%d %H:%M:%S'").to_string()
    }
}

/// The statement creating one partition of `table`. Without `IF NOT
/// EXISTS`: a table of that name that is not this partition (one detached by
/// hand, say) is reported, never counted as created.
pub fn create_sql(
    table: &TableName,
    partition: &TableName,
    (from, to): (DateTime<Utc>, DateTime<Utc>),
    layout: &Layout,
) -> String {
    format!(
        "CREATE TABLE {} PARTITION OF {} FOR VALUES FROM ({}) TO ({})",
        partition.quoted(),
        table.quoted(),
        literal(from, layout),
        literal(to, layout)
    )
}

/// Creates the partition `sql` makes (`partition`, for `range`), unless
/// the default partition holds rows of the range: PostgreSQL would refuse
/// it after scanning the default partition with the outbox locked, so the
/// run looks first, without that lock. A row that lands there after the
/// look is still refused by PostgreSQL.
pub async fn create_unless_default_holds(
    client: &Client,
    default: Option<&TableName>,
    (range, layout): ((DateTime<Utc>, DateTime<Utc>), &Layout),
    sql: &str,
    partition: &TableName,
) -> Result<(), CreateFailure> {
    if let Some(default) = default {
        let key = crate::sql::quote_ident(&layout.column);
        let look = format!(
            "SELECT EXISTS (SELECT 1 FROM {} WHERE {key} >= {} AND {key} < {})",
            default.quoted(),
            literal(range.0, layout),
            literal(range.1, layout)
        );
        match client.query_one(&look, &[]).await {
            Ok(row) if row.get::<_, bool>(0) => return Err(default_holds(partition)),
            Ok(_) => {}
            Err(e) => {
                return Err(CreateFailure {
                    message: format!(
                        "cannot create partition {partition}: looking for rows of its range in the \
                         default partition {default} failed: {}",
                        crate::db::error_text(&e)
                    ),
                    locked: false,
                    ends_run: true,
                });
            }
        }
    }
    create(client, sql, partition).await
}

/// What the run says of a range the default partition holds rows of.
const DEFAULT_HOLDS: &str = "the default partition holds rows of its range, so PostgreSQL refuses it until they \
     are gone: they are delivered like any other row and deleted once sent and older than \
     retention.sent_window, and the ranges made ahead take the rows after them";

/// The failure of a range the default partition holds rows of.
fn default_holds(partition: &TableName) -> CreateFailure {
    CreateFailure {
        message: format!("cannot create partition {partition}: {DEFAULT_HOLDS}"),
        locked: false,
        ends_run: false,
    }
}

/// Why a partition could not be created.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateFailure {
    /// What to tell the operator.
    pub message: String,
    /// The outbox was locked: the other ranges would wait the same, so the
    /// run leaves them to the next one.
    pub locked: bool,
    /// The other ranges would fail the same way: the run leaves them.
    pub ends_run: bool,
}

/// Creates one partition. Creating a partition locks the outbox (ACCESS
/// EXCLUSIVE in PostgreSQL 15), so it waits for the lock at most
/// [`LOCK_WAIT`] rather than let inserts queue behind it, and holds it at
/// most [`CREATE_WITHIN`]: with a default partition, PostgreSQL scans it
/// under that lock for rows of the new range.
pub async fn create(
    client: &Client,
    sql: &str,
    partition: &TableName,
) -> Result<(), CreateFailure> {
    let statement = format!(
        "BEGIN; SET LOCAL lock_timeout = {}; SET LOCAL statement_timeout = {}; {sql}; COMMIT",
        LOCK_WAIT.as_millis(),
        CREATE_WITHIN.as_millis()
    );
    let Err(e) = client.batch_execute(&statement).await else {
        return Ok(());
    };
    // The failed statement left the transaction open and aborted.
    let _ = client.batch_execute("ROLLBACK").await;
    Err({
        let code = e.code().map(|c| c.code().to_owned());
        let hint = match code.as_deref() {
            // check_violation: the default partition holds rows of the range.
            Some("23514") => &format!("; {DEFAULT_HOLDS}"),
            Some("55P03") => "; the outbox was locked, the next run tries again",
            Some("57014") => {
                "; with a default partition, PostgreSQL scans it for rows of the new range while the \
                 outbox is locked, and it is too large to scan in time: it shrinks as its rows are sent \
                 and deleted (retention deletes them row by row once older than retention.sent_window; \
                 never detach it with unsent rows, which would then not be delivered), and the next \
                 run tries again"
            }
            _ => "",
        };
        let locked = code.as_deref() == Some("55P03");
        CreateFailure {
            message: format!(
                "cannot create partition {partition}: {}{hint}",
                crate::db::error_text(&e)
            ),
            locked,
            ends_run: locked || code.as_deref() == Some("57014"),
        }
    })
}

/// Why a partition past the cutoff is kept, or `None` when it may go; and,
/// with ranges, the look's snapshot's xmin, from which a look with `since`
/// (that xmin) reads only the rows the earlier look could not see.
async fn keep_reason(
    client: &Client,
    partition: &TableName,
    cutoff: DateTime<Utc>,
    ranges: Option<&Ranges>,
    since: Option<&str>,
) -> Result<(Option<String>, Option<String>), tokio_postgres::Error> {
    let row = match ranges {
        Some(ranges) => {
            let sql = ranges.partition_keep_sql(partition, since.is_some());
            match since {
                Some(xmin) => client.query_one(&sql, &[&cutoff, &xmin]).await?,
                None => client.query_one(&sql, &[&cutoff]).await?,
            }
        }
        None => {
            let sql = format!(
                "SELECT EXISTS (SELECT 1 FROM {p} WHERE {SENT_AT_COLUMN} IS NULL),
                        EXISTS (SELECT 1 FROM {p} WHERE {SENT_AT_COLUMN} >= $1),
                        NULL::text",
                p = partition.quoted()
            );
            client.query_one(&sql, &[&cutoff]).await?
        }
    };
    let why = match (row.get(0), row.get(1)) {
        (true, _) => Some("it holds unsent rows".into()),
        (false, true) => Some("rows in it were sent after the retention cutoff".into()),
        (false, false) => None,
    };
    Ok((why, row.get(2)))
}

/// What happened to one expired partition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Dropped,
    /// It must stay for now (unsent rows, the outbox locked): the reason.
    Kept(String),
    /// The server refused to drop it: the error and what to do. It stays,
    /// and the next run tries again.
    Failed(String),
}

/// Detaches and drops `partition` when it may go (see the module docs);
/// with `dry_run`, only says whether it would. An error of this partition
/// is its [`Outcome::Failed`], so the run goes on with the others.
pub async fn drop_expired(
    client: &Client,
    table: &TableName,
    partition: &TableName,
    cutoff: DateTime<Utc>,
    ranges: Option<&Ranges>,
    dry_run: bool,
) -> Result<Outcome, RetentionError> {
    let detach = format!(
        "BEGIN;
         SET LOCAL lock_timeout = {};
         ALTER TABLE {} DETACH PARTITION {}",
        LOCK_WAIT.as_millis(),
        table.quoted(),
        partition.quoted()
    );
    let attempt = async {
        // Without a lock first, so a partition that must stay costs no lock.
        let (why, xmin) = keep_reason(client, partition, cutoff, ranges, None).await?;
        if let Some(why) = why {
            return Ok::<_, tokio_postgres::Error>(Outcome::Kept(why));
        }
        if dry_run {
            return Ok(Outcome::Dropped);
        }
        client.batch_execute(&detach).await?;
        // Under the lock now: nothing can be written into it any more. With
        // ranges, only what the first look could not see is read again.
        let (why, _) = keep_reason(client, partition, cutoff, ranges, xmin.as_deref()).await?;
        if let Some(why) = why {
            client.batch_execute("ROLLBACK").await?;
            return Ok(Outcome::Kept(why));
        }
        client
            .batch_execute(&format!("DROP TABLE {}; COMMIT", partition.quoted()))
            .await?;
        Ok(Outcome::Dropped)
    };
    match attempt.await {
        Ok(outcome) => Ok(outcome),
        Err(e) => {
            // Undoes the detach, if any (outside a transaction, a warning only).
            let _ = client.batch_execute("ROLLBACK").await;
            refused(e, partition, ranges)
        }
    }
}

/// The outcome of an error while dropping `partition`: this partition's
/// problem (no privilege, objects depending on it, a timeout), which keeps
/// it with the fix; or the run's (the connection or the server failing, a
/// table of ranges missing), which ends the run.
fn refused(
    e: tokio_postgres::Error,
    partition: &TableName,
    ranges: Option<&Ranges>,
) -> Result<Outcome, RetentionError> {
    if let Some(problem) = ranges.and_then(|r| r.missing_table_problem(&e)) {
        return Err(RetentionError::MissingRanges(problem));
    }
    let code = e.code().map(|c| c.code().to_owned()).unwrap_or_default();
    // Connection, resources, operator intervention, system and internal errors.
    let of_the_run = code.is_empty()
        || ["08", "53", "57P", "58", "XX"]
            .iter()
            .any(|class| code.starts_with(class));
    if of_the_run {
        return Err(DbError::query(format!("dropping partition {partition}"), e).into());
    }
    let fix = match code.as_str() {
        "55P03" => {
            return Ok(Outcome::Kept(
                "the outbox was locked; the next run tries again".into(),
            ));
        }
        "42501" => format!(
            "the relay's role must own it to detach and drop it: ALTER TABLE {} OWNER TO \
             <the relay's role>, or drop it yourself",
            partition.quoted()
        ),
        "2BP01" => {
            "other objects depend on it: drop or change them, or drop the partition yourself".into()
        }
        "57014" => "a statement was cancelled, by statement_timeout or by hand: raise \
             statement_timeout for the relay's role, or drop the partition yourself"
            .into(),
        _ => "fix the cause, or drop the partition yourself".into(),
    };
    Ok(Outcome::Failed(format!(
        "{}; {fix}; the next run tries again",
        crate::db::error_text(&e)
    )))
}

/// The default partition, whose sent rows are deleted row by row.
pub fn default_partition(partitions: &[Partition]) -> Option<&TableName> {
    partitions.iter().find(|p| p.default).map(|p| &p.name)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The name of a whole range starting at `from`.
    fn name(table: &TableName, from: DateTime<Utc>, interval: Duration) -> TableName {
        let to = from + chrono::Duration::from_std(interval).unwrap();
        name_for(table, (from, to), interval, &[])
    }

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    const DAY: Duration = Duration::from_secs(86_400);

    #[test]
    fn names_and_statements() {
        let t = TableName::new("shop", "outbox");
        let from = at("2026-12-01T00:00:00Z");
        assert_eq!(name(&t, from, DAY).name, "outbox_p20261201");
        assert_eq!(
            name(&t, at("2026-12-01T15:30:00Z"), Duration::from_secs(1800)).name,
            "outbox_p20261201_1530"
        );
        let long = TableName::new("public", &"x".repeat(70));
        assert_eq!(name(&long, from, DAY).name.len(), 63);
        assert!(name(&long, from, DAY).name.ends_with("_p20261201"));
        let zoned = Layout {
            column: "created_at".into(),
            with_zone: true,
        };
        assert_eq!(
            create_sql(
                &t,
                &name(&t, from, DAY),
                (from, at("2026-12-02T00:00:00Z")),
                &zoned
            ),
            "CREATE TABLE \"shop\".\"outbox_p20261201\" PARTITION OF \"shop\".\"outbox\" \
             FOR VALUES FROM ('2026-12-01 00:00:00+00') TO ('2026-12-02 00:00:00+00')"
        );
        let plain = Layout {
            with_zone: false,
            ..zoned
        };
        assert!(
            create_sql(
                &t,
                &name(&t, from, DAY),
                (from, at("2026-12-02T00:00:00Z")),
                &plain
            )
            .ends_with("FROM ('2026-12-01 00:00:00') TO ('2026-12-02 00:00:00')")
        );
    }

    #[test]
    fn a_part_of_a_range_is_named_by_its_start_to_the_minute_and_never_twice() {
        let t = TableName::new("public", "outbox");
        let (from, to) = (at("2026-12-02T06:00:00Z"), at("2026-12-03T00:00:00Z"));
        let whole = (at("2026-12-02T00:00:00Z"), to);
        assert_eq!(name_for(&t, whole, DAY, &[]).name, "outbox_p20261202");
        assert_eq!(
            name_for(&t, (from, to), DAY, &[]).name,
            "outbox_p20261202_0600"
        );
        // Partitions made by hand under the names the relay would choose.
        let taken = [
            TableName::new("public", "outbox_p20261202_0600"),
            TableName::new("public", "outbox_p20261202_0600_2"),
        ];
        assert_eq!(
            name_for(&t, (from, to), DAY, &taken).name,
            "outbox_p20261202_0600_3"
        );
        let long = TableName::new("public", &"x".repeat(70));
        let named = name_for(&long, (from, to), DAY, &[]).name;
        assert!(
            named.len() == 63 && named.ends_with("_p20261202_0600"),
            "{named}"
        );
    }
}
