//! Carrying the steps out: the transactional ones in one transaction whose
//! lock waits are bounded, then the others.

use super::{MigrateError, Step};
use tokio_postgres::Client;

/// How long a step in the transaction waits for a lock (see [`apply`]).
const LOCK_WAIT: &str = "5s";

/// How many times the transaction is tried when a lock was not granted.
const LOCK_TRIES: u32 = 3;

/// Runs the steps: the transactional ones in one transaction, then the
/// others. A statement may take as long as it needs (a large table's new
/// columns, an index built concurrently), but in the transaction each
/// waits at most [`LOCK_WAIT`] for a lock: waiting behind a long
/// transaction on the outbox, migrate would hold every insert of the
/// application up behind it. It tries again a few times, then says so.
pub async fn apply(client: &mut Client, steps: &[Step]) -> Result<(), MigrateError> {
    client.batch_execute("SET statement_timeout = 0").await?;
    for attempt in 1..=LOCK_TRIES {
        match in_transaction(client, steps).await {
            Err(MigrateError::Step { source, .. })
                if attempt < LOCK_TRIES
                    && source.code()
                        == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE) =>
            {
                println!("-- a transaction holds a lock migrate needs; trying again");
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            }
            other => {
                other?;
                break;
            }
        }
    }
    for step in steps.iter().filter(|s| s.outside_transaction) {
        client
            .batch_execute(&step.sql)
            .await
            .map_err(|source| MigrateError::Step {
                step: step.description.clone(),
                source,
            })?;
    }
    Ok(())
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
