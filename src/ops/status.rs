//! What an operator asks first: is it working, and how far behind is it?
//! One snapshot per pipeline, read from the database, used by
//! `outbox-relay status` and by the metrics sampler.

use super::{ConfigFile, Failure, complain, say};
use crate::config::{Config, MarkMode, SourceMode};
use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, TableName};
use crate::db::DbError;
use crate::outbox::ownership_key;
use crate::source::auto::Reading;
use crate::source::cdc::setup;
use crate::sql::quote_ident;
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Client;

mod render;
pub use render::{UNMARKED, render};

/// The session holding a pipeline's ownership lock.
#[derive(Debug, Clone, Serialize)]
pub struct Holder {
    pub pid: i32,
    pub application_name: String,
    pub client_addr: Option<String>,
    pub since: Option<DateTime<Utc>>,
}

#[derive(Debug, Clone, Serialize)]
pub struct SlotStatus {
    pub name: String,
    pub exists: bool,
    pub streaming: bool,
    pub wal_status: Option<String>,
    pub retained_wal_bytes: Option<i64>,
    pub confirmed_lag_bytes: Option<i64>,
}

/// `source.mode = "auto"`: how the pipeline reads now, and why not by CDC.
#[derive(Debug, Clone, Serialize)]
pub struct AutoStatus {
    /// `cdc` (the slot is streaming), `polling` (an instance is active and
    /// the slot is not streaming), or `none` (no instance is active).
    pub reading: &'static str,
    /// Whether the server allows CDC now.
    pub cdc_possible: bool,
    /// What keeps CDC from running (see `source::auto::Blocked`).
    pub blocked_reason: Option<&'static str>,
    /// ... and what to fix.
    pub blocked: Option<String>,
}

/// `relay.mark = "ranges"`: how the fold keeps up.
#[derive(Debug, Clone, Serialize)]
pub struct FrontierStatus {
    /// When the fold last moved the frontier (`None`: never).
    pub folded_at: Option<DateTime<Utc>>,
    /// Seconds since then; before the first fold, since the oldest batch
    /// was recorded (`None`: neither yet). What the gauge exports.
    pub age_seconds: Option<f64>,
    /// Unsent rows the frontier passed (late commits, rows behind a dead letter).
    pub held_rows: i64,
    /// Recorded batches no frontier covers yet.
    pub progress_rows: i64,
}

/// One pipeline's state.
#[derive(Debug, Clone, Serialize)]
pub struct Snapshot {
    pub pipeline: String,
    pub mode: &'static str,
    pub table: String,
    pub sink: &'static str,
    /// The active instance, if any holds the ownership lock (whole outbox).
    pub active: Option<Holder>,
    /// With shards: how many shard locks are held, of how many.
    pub shards_owned: Option<(i64, u32)>,
    /// Unsent rows; `None` with `relay.mark = "none"`, where the table does
    /// not say what was sent (the slot's lag does), when not read
    /// ([`Reads::backlog`]), or when the count failed (`backlog_error`).
    pub backlog: Option<i64>,
    /// Why the unsent rows could not be counted (a backlog too large to
    /// count within the statement timeout, say).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backlog_error: Option<String>,
    pub oldest_unsent_age_seconds: Option<f64>,
    pub dead_letters: Option<i64>,
    /// Why the open dead letters could not be counted, when dead-lettering
    /// is on (their table missing, or not readable by this role).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dead_letters_error: Option<String>,
    pub last_publish: Option<DateTime<Utc>>,
    pub slot: Option<SlotStatus>,
    /// In auto mode.
    pub auto: Option<AutoStatus>,
    /// With `relay.mark = "ranges"`.
    pub frontier: Option<FrontierStatus>,
    /// How sent rows are recorded (`relay.mark`, or the outbox's choice).
    pub marking: &'static str,
    /// Whether `relay.mark` is unset, so the outbox chose `marking`.
    pub marking_chosen_by_outbox: bool,
}

fn q(context: &str) -> impl Fn(tokio_postgres::Error) -> DbError + '_ {
    move |e| DbError::query(context, e)
}

/// What a [`snapshot`] reads besides the cheap parts.
#[derive(Debug, Clone, Copy)]
pub struct Reads {
    /// The backlog (a count of every unsent row).
    pub backlog: bool,
    /// The oldest unsent row's age (a read up to the first unsent row).
    pub oldest_age: bool,
    /// The last publish time.
    pub last_publish: bool,
}

impl Reads {
    /// Everything, as `outbox-relay status` shows it.
    pub const ALL: Reads = Reads {
        backlog: true,
        oldest_age: true,
        last_publish: true,
    };
}

pub async fn snapshot(client: &Client, config: &Config, reads: Reads) -> Result<Snapshot, DbError> {
    let table = &config.outbox.table;
    let t = table.quoted();
    let with_last_publish = reads.last_publish;
    let (backlog, backlog_error) = match reads.backlog {
        true => match backlog(client, config).await {
            Ok(n) => (n, None),
            Err(e) => (None, Some(backlog_problem(&e))),
        },
        false => (None, None),
    };
    let oldest_unsent_age_seconds = match reads.oldest_age {
        true => oldest_unsent_age(client, config).await?,
        false => None,
    };
    let (dead_letters, dead_letters_error) = match open_dead_letters(client, config).await {
        Some(Ok(n)) => (Some(n), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    let last_publish = match config.relay.mark {
        // A mark set by hand to 'infinity' (or past the years a timestamp
        // here can hold) is no publish time: left out.
        MarkMode::Update if with_last_publish => client
            .query_one(
                &format!(
                    "SELECT max({SENT_AT_COLUMN}) FILTER (WHERE isfinite({SENT_AT_COLUMN}) AND {SENT_AT_COLUMN} < '100000-01-01') FROM {t}"
                ),
                &[],
            )
            .await
            .map_err(q("reading the last publish time"))?
            .get(0),
        MarkMode::Ranges if with_last_publish => {
            let ranges = crate::outbox::progress::Ranges::new(table);
            client
                .query_one(&ranges.last_recorded_sql(), &[])
                .await
                .map_err(q("reading the last publish time"))?
                .get(0)
        }
        _ => None,
    };
    let key = ownership_key(table);
    let active = active_instance(client, &key).await?;
    let shards_owned = shards_owned(client, config, &key).await?;
    let slot = slot_status(client, config).await?;
    let auto = auto_status(client, config, slot.as_ref(), active.is_some()).await?;
    let frontier = match config.relay.mark {
        MarkMode::Ranges => Some(frontier_status(client, table).await?),
        _ => None,
    };
    Ok(Snapshot {
        pipeline: config.name.clone(),
        mode: config.source.mode.name(),
        table: table.to_string(),
        sink: config.sink.kind(),
        active,
        shards_owned,
        backlog,
        backlog_error,
        oldest_unsent_age_seconds,
        dead_letters,
        dead_letters_error,
        last_publish,
        slot,
        auto,
        frontier,
        marking: config.relay.mark.name(),
        marking_chosen_by_outbox: config.mark_chosen_by_outbox(),
    })
}

/// The unsent rows: a count of every unsent row, seconds on the database
/// for a backlog of millions. `None` with `relay.mark = "none"`, where
/// every row looks unsent (counting them would count the table).
pub async fn backlog(client: &Client, config: &Config) -> Result<Option<i64>, DbError> {
    let sql = match config.relay.mark {
        MarkMode::None => return Ok(None),
        MarkMode::Ranges => {
            crate::outbox::progress::Ranges::new(&config.outbox.table)
                .read_sql(SEQ_COLUMN, "")
                .backlog
        }
        _ => format!(
            "SELECT count(*) FROM {} WHERE {SENT_AT_COLUMN} IS NULL",
            config.outbox.table.quoted()
        ),
    };
    Ok(Some(
        client
            .query_one(&sql, &[])
            .await
            .map_err(q("counting unsent rows"))?
            .get(0),
    ))
}

/// What `status` says when the unsent rows could not be counted; the rest
/// of the snapshot is still read and shown.
fn backlog_problem(e: &DbError) -> String {
    match e {
        DbError::Query { source, .. }
            if source.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) =>
        {
            format!(
                "not counted: the count of unsent rows was cancelled, past the {} s statement timeout (a backlog of many millions) or by an administrator; the oldest unsent row's age says how far behind the relay is",
                crate::db::STATEMENT_TIMEOUT.as_secs()
            )
        }
        _ => format!("not counted: {e}"),
    }
}

async fn frontier_status(client: &Client, table: &TableName) -> Result<FrontierStatus, DbError> {
    let ranges = crate::outbox::progress::Ranges::new(table);
    let row = client
        .query_one(
            &format!(
                "WITH f AS (SELECT folded_at FROM {f} ORDER BY id DESC LIMIT 1)
                 SELECT EXTRACT(EPOCH FROM now() - COALESCE(
                            (SELECT folded_at FROM f), (SELECT min(recorded_at) FROM {p})))::float8,
                        (SELECT count(*) FROM {h}), (SELECT count(*) FROM {p}),
                        (SELECT folded_at FROM f)",
                f = ranges.frontier.quoted(),
                h = ranges.held.quoted(),
                p = ranges.progress.quoted()
            ),
            &[],
        )
        .await
        .map_err(q("reading the frontier"))?;
    Ok(FrontierStatus {
        age_seconds: row.get::<_, Option<f64>>(0).map(|a| a.max(0.0)),
        held_rows: row.get(1),
        progress_rows: row.get(2),
        folded_at: row.get(3),
    })
}

/// Seconds since the oldest unsent row was written, when the table has a
/// `created_at` column and the row a value in it (`None` with
/// `relay.mark = "none"`).
pub async fn oldest_unsent_age(client: &Client, config: &Config) -> Result<Option<f64>, DbError> {
    let Some(sql) = oldest_unsent_sql(client, config).await? else {
        return Ok(None);
    };
    Ok(read_oldest_unsent(client, &sql).await?.and_then(|o| o.age))
}

/// The oldest unsent row, as [`oldest_unsent_sql`] reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OldestUnsent {
    pub seq: i64,
    /// Seconds since its `created_at`; `None` without the column, or when
    /// the row's is NULL.
    pub age: Option<f64>,
}

/// The statement that reads the oldest unsent row's `relay_seq` and age:
/// it reads up to the first unsent row only (its cost during a drain:
/// `ops::gauges`). `None` with `relay.mark = "none"` (every row looks
/// unsent) or while the table does not exist.
pub async fn oldest_unsent_sql(
    client: &Client,
    config: &Config,
) -> Result<Option<String>, DbError> {
    let table = &config.outbox.table;
    if config.relay.mark == MarkMode::None {
        return Ok(None);
    }
    let Some(info) = crate::outbox::inspect::table_info(client, table)
        .await
        .map_err(q("reading the outbox table"))?
    else {
        return Ok(None);
    };
    let age = match config.outbox.columns.resolve(&info.names()).created_at {
        Some(c) => format!(
            "EXTRACT(EPOCH FROM now() - {}::timestamptz)::float8",
            quote_ident(&c)
        ),
        None => "NULL::float8".to_owned(),
    };
    Ok(Some(match config.relay.mark {
        MarkMode::Ranges => {
            crate::outbox::progress::Ranges::new(table)
                .read_sql(&format!("{SEQ_COLUMN}, {age} AS age"), "")
                .oldest
        }
        _ => format!(
            "SELECT {SEQ_COLUMN}, {age} FROM {} WHERE {SENT_AT_COLUMN} IS NULL ORDER BY {SEQ_COLUMN} LIMIT 1",
            table.quoted()
        ),
    }))
}

/// Runs [`oldest_unsent_sql`]'s statement: `None` when nothing is unsent.
pub async fn read_oldest_unsent(
    client: &Client,
    sql: &str,
) -> Result<Option<OldestUnsent>, DbError> {
    let Some(r) = client
        .query_opt(sql, &[])
        .await
        .map_err(q("reading the oldest unsent row"))?
    else {
        return Ok(None);
    };
    let read = q("reading the oldest unsent row");
    let seq: Option<i64> = r.try_get(0).map_err(&read)?;
    // NULL when the row's created_at is, or without the column.
    let age: Option<f64> = r.try_get(1).map_err(&read)?;
    Ok(seq.map(|seq| OldestUnsent {
        seq,
        age: age.map(|a| a.max(0.0)),
    }))
}

/// Open dead letters when dead-lettering is on (`None` when it is off),
/// or why they could not be counted.
async fn open_dead_letters(client: &Client, config: &Config) -> Option<Result<i64, String>> {
    let table = &config.outbox.table;
    if config.dead_letter.enabled {
        let dlq = config.dead_letter.table_name(table);
        Some(
            client
                .query_one(
                    &format!(
                        "SELECT count(*) FROM {} WHERE resolution IS NULL",
                        dlq.quoted()
                    ),
                    &[],
                )
                .await
                .map(|r| r.get(0))
                .map_err(|e| format!("cannot count them in {dlq}: {}", crate::db::error_text(&e))),
        )
    } else {
        None
    }
}

/// The session holding the ownership lock, if any.
async fn active_instance(client: &Client, key: &str) -> Result<Option<Holder>, DbError> {
    Ok(client
        .query_opt(
            "WITH k AS (SELECT hashtextextended($1, 0) AS key)
         SELECT a.pid, coalesce(a.application_name, ''), a.client_addr::text, a.backend_start
         FROM pg_locks l JOIN pg_stat_activity a USING (pid), k
         WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
           AND l.mode = 'ExclusiveLock'
           AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
           AND l.classid = ((k.key >> 32) & 4294967295)::oid AND l.objid = (k.key & 4294967295)::oid
         LIMIT 1",
            &[&key],
        )
        .await
        .map_err(q("looking for the active instance"))?
        .map(|r| Holder {
            pid: r.get(0),
            application_name: r.get(1),
            client_addr: r.get(2),
            since: r.get(3),
        }))
}

/// Shards owned (by any instance) out of how many, when sharded.
async fn shards_owned(
    client: &Client,
    config: &Config,
    key: &str,
) -> Result<Option<(i64, u32)>, DbError> {
    Ok(if config.relay.shards > 1 {
        let keys: Vec<String> = (0..config.relay.shards)
            .map(|i| format!("{key}:shard:{i}/{}", config.relay.shards))
            .collect();
        let held: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_locks l, unnest($1::text[]) AS k(name)
             WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
               AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND l.classid = ((hashtextextended(k.name, 0) >> 32) & 4294967295)::oid
               AND l.objid = (hashtextextended(k.name, 0) & 4294967295)::oid",
                &[&keys],
            )
            .await
            .map_err(q("counting owned shards"))?
            .get(0);
        Some((held, config.relay.shards))
    } else {
        None
    })
}

/// The replication slot, in CDC and auto mode.
async fn slot_status(client: &Client, config: &Config) -> Result<Option<SlotStatus>, DbError> {
    let table = &config.outbox.table;
    Ok(if config.source.mode.may_use_cdc() {
        let name = config.source.cdc.slot_name(table);
        let info = setup::slot_info(client, &name).await?;
        Some(SlotStatus {
            exists: info.is_some(),
            streaming: info.as_ref().is_some_and(|i| i.active),
            wal_status: info.as_ref().and_then(|i| i.wal_status.clone()),
            retained_wal_bytes: info.as_ref().and_then(|i| i.retained_bytes),
            confirmed_lag_bytes: info.as_ref().and_then(|i| i.lag_bytes),
            name,
        })
    } else {
        None
    })
}

/// Which way auto mode reads now, and why not CDC if it cannot.
async fn auto_status(
    client: &Client,
    config: &Config,
    slot: Option<&SlotStatus>,
    active: bool,
) -> Result<Option<AutoStatus>, DbError> {
    Ok(if config.source.mode == SourceMode::Auto {
        let blocked = match crate::source::auto::probe(client, config).await? {
            Reading::Cdc => None,
            Reading::Polling(b) => Some(b),
        };
        Some(AutoStatus {
            reading: if slot.is_some_and(|s| s.streaming) {
                "cdc"
            } else if active {
                "polling"
            } else {
                "none"
            },
            cdc_possible: blocked.is_none(),
            blocked_reason: blocked.as_ref().map(|b| b.reason),
            blocked: blocked.map(|b| b.message),
        })
    } else {
        None
    })
}

/// `outbox-relay status`: a block (or a JSON object) per pipeline; fails
/// (after printing the others) when a pipeline's database cannot be read,
/// or its unsent rows or dead letters cannot be counted.
pub async fn command(file: &ConfigFile, json: bool) -> Result<(), Failure> {
    let mut failed = false;
    for config in &file.load_all()? {
        let snapshot = match crate::db::connect(&config.database, None).await {
            Ok(client) => {
                let mut config = config.clone();
                match crate::ops::marking::choose(&client, &mut config).await {
                    Ok(()) => snapshot(&client, &config, Reads::ALL).await,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        // A count it could not read fails the command too, after the rest.
        failed |= snapshot
            .as_ref()
            .is_ok_and(|s| s.dead_letters_error.is_some() || s.backlog_error.is_some());
        match snapshot {
            Ok(s) if json => say!("{}", serde_json::to_string(&s).unwrap_or_default()),
            Ok(s) => say!("{}", render(&s)),
            Err(e) => {
                failed = true;
                complain!("error: pipeline {}: {e}", config.name);
            }
        }
    }
    if failed {
        Err(Failure::Reported)
    } else {
        Ok(())
    }
}
