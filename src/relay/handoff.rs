//! Clean hand-offs: a new owner starts publishing at once when the previous
//! owner of its lock stopped cleanly, instead of waiting out a lease.
//!
//! A new owner waits a lease (see [`super::lease`]) because the previous one
//! may have lost its session without knowing and still be publishing. An
//! owner that stops cleanly knows better: once its broker confirmed
//! everything it sent and its broker connection is closed, nothing of it can
//! reach the broker any more. It says so in a small relay-owned table
//! (`<outbox>_relay_owners`, made by `migrate`), one row per ownership lock:
//!
//! - on taking the lock, an owner *claims* the row: it writes a fresh token
//!   and clears `stopped_at`, in the same statement that reads whether the
//!   previous owner had set it. Only then does it publish, so an owner that
//!   later becomes a zombie has always cleared the mark first;
//! - on a clean stop it sets `stopped_at`, only where the row still holds its
//!   own token (a newer owner's claim is never overwritten).
//!
//! So `stopped_at` is set exactly when the last owner that claimed the row
//! has stopped publishing for good.
//!
//! When `migrate` creates the outbox table and this one in the same run,
//! nothing can ever have relayed that outbox: it also writes a *genesis*
//! row (an empty `lock_key`, stopped), and the first owner to claim while
//! the table holds nothing else publishes at once. Any claim ends that: the
//! next owner finds the claimer's row. Rows of another shard count that were
//! claimed and not stopped make every takeover wait the lease (owners of
//! other locks over the same rows could still be publishing). Without the
//! table nobody can leave the mark, and every takeover waits, as before.

use crate::config::TableName;
use crate::db::DbError;
use tokio_postgres::Client;
use tokio_postgres::error::SqlState;

pub use crate::outbox::names::owners_table;

/// `CREATE TABLE` for `migrate`.
pub fn create_sql(owners: &TableName) -> String {
    format!(
        "CREATE TABLE IF NOT EXISTS {} (
    lock_key text PRIMARY KEY,
    shards integer NOT NULL,
    owner text NOT NULL,
    claimed_at timestamptz NOT NULL,
    stopped_at timestamptz
)",
        owners.quoted()
    )
}

/// The genesis row's key: no ownership lock is named by an empty string.
const GENESIS_KEY: &str = "";

/// The genesis row, for `migrate` when it creates the outbox table and this
/// table in one run (see the module docs).
pub fn genesis_sql(owners: &TableName) -> String {
    format!(
        "INSERT INTO {} (lock_key, shards, owner, claimed_at, stopped_at)
VALUES ('{GENESIS_KEY}', 0, 'migrate: a new outbox, never relayed', now(), now())
ON CONFLICT (lock_key) DO NOTHING",
        owners.quoted()
    )
}

/// What a new owner knows about the one before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// The previous owner of this lock stopped cleanly: publish at once.
    AfterCleanStop,
    /// Nobody ever claimed this outbox, which `migrate` created: publish at once.
    NewOutbox,
    /// No such record: wait out the previous owner's lease.
    Unknown,
}

/// This owner's claim, to mark a clean stop with.
#[derive(Debug, Clone)]
pub struct Claim {
    table: TableName,
    key: String,
    token: String,
}

/// Claims `key` (a lock this session holds) for a new owner; `None` for
/// the claim when the table does not exist (nothing to mark later).
pub async fn claim(
    client: &Client,
    outbox: &TableName,
    key: &str,
    shards: u32,
) -> Result<(Takeover, Option<Claim>), DbError> {
    let table = owners_table(outbox);
    let t = table.quoted();
    let token = uuid::Uuid::new_v4().to_string();
    let sql = format!(
        "WITH prev AS (SELECT stopped_at FROM {t} WHERE lock_key = $1),
              fresh AS (SELECT bool_and(lock_key = '{GENESIS_KEY}') AND count(*) > 0 AS yes FROM {t}),
              others AS (SELECT count(*) AS n FROM {t} WHERE shards <> $2 AND stopped_at IS NULL),
              mine AS (INSERT INTO {t} (lock_key, shards, owner, claimed_at) VALUES ($1, $2, $3, now())
                       ON CONFLICT (lock_key) DO UPDATE SET shards = EXCLUDED.shards,
                           owner = EXCLUDED.owner, claimed_at = EXCLUDED.claimed_at, stopped_at = NULL)
         SELECT coalesce((SELECT stopped_at IS NOT NULL FROM prev), false) AND (SELECT n FROM others) = 0,
                coalesce((SELECT yes FROM fresh), false)"
    );
    let shards = i32::try_from(shards).unwrap_or(i32::MAX);
    match client.query_one(&sql, &[&key, &shards, &token]).await {
        Ok(row) => {
            let (clean, fresh): (bool, bool) = (row.get(0), row.get(1));
            let takeover = if fresh {
                Takeover::NewOutbox
            } else if clean {
                Takeover::AfterCleanStop
            } else {
                Takeover::Unknown
            };
            let claim = Claim {
                table,
                key: key.to_owned(),
                token,
            };
            Ok((takeover, Some(claim)))
        }
        // Nobody can have left a mark: wait the lease, as without hand-offs.
        Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => {
            tracing::info!(
                table = %table,
                "{table} is missing, so every takeover waits relay.ownership_lease: run outbox-relay migrate to let a new owner start at once after a clean stop"
            );
            Ok((Takeover::Unknown, None))
        }
        // Publishing without having cleared the previous mark would let a
        // later owner trust it while this one might still publish.
        Err(e) => Err(DbError::query(
            format!(
                "claiming ownership in {table} (the relay's role needs SELECT, INSERT and UPDATE on it)"
            ),
            e,
        )),
    }
}

/// Records that the owner of `claim` stopped cleanly: the broker confirmed
/// everything it sent and its broker connection is closed. On any
/// connection; it changes nothing if a newer owner claimed the lock since.
pub async fn stopped(client: &Client, claim: &Claim) -> Result<bool, tokio_postgres::Error> {
    let n = client
        .execute(
            &format!(
                "UPDATE {} SET stopped_at = now() WHERE lock_key = $1 AND owner = $2",
                claim.table.quoted()
            ),
            &[&claim.key, &claim.token],
        )
        .await?;
    Ok(n == 1)
}
