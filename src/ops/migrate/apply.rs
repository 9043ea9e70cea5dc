//! Carrying the steps out: the transactional ones in one transaction whose
//! lock waits are bounded, then the others.

use super::{MigrateError, Step};
use crate::config::DatabaseConfig;
use crate::ops::say;
use std::time::Duration;
use tokio::time::Instant;
use tokio_postgres::Client;

/// How long a step in the transaction waits for a lock (see [`apply`]).
const LOCK_WAIT: &str = "5s";

/// How many times the transaction is tried when a lock was not granted.
const LOCK_TRIES: u32 = 3;

/// How often a step outside the transaction, which waits as long as it
/// must, says what it waits for.
const WAIT_REPORT: Duration = Duration::from_secs(5);

/// Runs the steps: the transactional ones in one transaction, then the
/// others. A statement may take as long as it needs (a large table's new
/// columns, an index built concurrently), but in the transaction each
/// waits at most [`LOCK_WAIT`] for a lock: waiting behind a long
/// transaction on the outbox, migrate would hold every insert of the
/// application up behind it. It tries again a few times, then says so.
/// The steps outside it (an index built concurrently, a replication slot)
/// wait for every transaction that began before them: they say which ones
/// every few seconds.
pub async fn apply(
    client: &mut Client,
    steps: &[Step],
    database: &DatabaseConfig,
) -> Result<(), MigrateError> {
    client.batch_execute("SET statement_timeout = 0").await?;
    for attempt in 1..=LOCK_TRIES {
        match in_transaction(client, steps).await {
            Err(MigrateError::Step { source, .. })
                if attempt < LOCK_TRIES
                    && source.code()
                        == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                say!("-- a transaction holds a lock migrate needs; trying again");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            other => {
                other?;
                break;
            }
        }
    }
    for step in steps.iter().filter(|s| s.outside_transaction) {
        outside_transaction(client, step, database).await?;
    }
    Ok(())
}

/// Runs one step outside the transaction, saying every [`WAIT_REPORT`]
/// what it waits for (read on a session of its own).
async fn outside_transaction(
    client: &Client,
    step: &Step,
    database: &DatabaseConfig,
) -> Result<(), MigrateError> {
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await?
        .get(0);
    let started = Instant::now();
    let run = client.batch_execute(&step.sql);
    tokio::pin!(run);
    let mut watcher = None;
    loop {
        tokio::select! {
            done = &mut run => {
                return done.map_err(|source| MigrateError::Step {
                    step: step.description.clone(),
                    source,
                });
            }
            _ = tokio::time::sleep(WAIT_REPORT) => {
                let waits = waiting_for(&mut watcher, database, pid).await;
                say!(
                    "-- {}: still running after {} s; {waits}",
                    step.description,
                    started.elapsed().as_secs()
                );
            }
        }
    }
}

/// The sessions whose transactions the session `pid` waits for, as a
/// sentence; `watcher` is connected on first use.
async fn waiting_for(watcher: &mut Option<Client>, database: &DatabaseConfig, pid: i32) -> String {
    if watcher.as_ref().is_none_or(|c| c.is_closed()) {
        *watcher = crate::db::connect(database, None).await.ok();
    }
    let Some(client) = watcher.as_ref() else {
        return "cannot connect to see what it waits for".into();
    };
    let blockers = client
        .query(
            "SELECT a.pid, coalesce(nullif(a.application_name, ''), '-'), coalesce(a.state, '-'),
                    coalesce(extract(epoch FROM now() - a.xact_start)::bigint, 0)
             FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids($1))
             ORDER BY a.xact_start",
            &[&pid],
        )
        .await;
    let rows = match blockers {
        Ok(rows) => rows,
        Err(e) => {
            return format!(
                "cannot see what it waits for: {}",
                crate::db::error_text(&e)
            );
        }
    };
    if rows.is_empty() {
        return "nothing blocks it: it is working".into();
    }
    let sessions: Vec<String> = rows
        .iter()
        .map(|r| {
            let (blocker, app, state, open): (i32, String, String, i64) =
                (r.get(0), r.get(1), r.get(2), r.get(3));
            format!("pid {blocker} (application {app:?}, {state}, its transaction open {open} s)")
        })
        .collect();
    format!(
        "it waits for the transactions of {} to end: it needs every transaction that began before it          to finish; end them (COMMIT, or pg_terminate_backend(pid)) or let them finish",
        sessions.join(", ")
    )
}

pub(super) fn step_error(e: &tokio_postgres::Error) -> String {
    let text = crate::db::error_text(e);
    if e.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) {
        format!(
            "{text}: a transaction holds a lock on the table (see pg_stat_activity); migrate waits at most \
             {LOCK_WAIT} for one, so that the application's inserts do not queue behind it: run it again \
             once that transaction ends"
        )
    } else {
        text
    }
}

/// The transactional steps, in one transaction whose lock waits are bounded.
async fn in_transaction(client: &mut Client, steps: &[Step]) -> Result<(), MigrateError> {
    let tx = client.transaction().await?;
    tx.batch_execute(&format!("SET LOCAL lock_timeout = '{LOCK_WAIT}'"))
        .await?;
    for step in steps.iter().filter(|s| !s.outside_transaction) {
        tx.batch_execute(&step.sql)
            .await
            .map_err(|source| MigrateError::Step {
                step: step.description.clone(),
                source,
            })?;
    }
    tx.commit().await?;
    Ok(())
}
