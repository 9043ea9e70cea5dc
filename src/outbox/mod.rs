//! The outbox table: its public contract, the relay's bookkeeping columns,
//! and the decoding of a row into an [`OutboxEvent`].
//!
//! Applications insert only the contract columns (`id`, `aggregate_type`,
//! `aggregate_id`, `event_type`, `event_version`, `payload`, `headers`,
//! `created_at`), under their own names if a [`crate::config::ColumnMap`] says so. The relay
//! adds three columns with defaults, so no application INSERT mentions them:
//!
//! - `relay_seq`: an identity; orders events of one aggregate (see `source::polling`);
//! - `relay_xid`: the inserting transaction (`pg_current_xact_id()`), which tells
//!   the polling source which transactions' rows it has already seen;
//! - `relay_sent_at`: NULL until the broker confirmed the event.
//!
//! The names themselves (the table's, the column map's and these three) are
//! configuration values, declared in [`crate::config`] so that configuration
//! stays a leaf; this module is what the relay does with them.

pub mod emit;
mod event;
pub mod inspect;
pub mod names;
pub mod progress;
mod shard;

pub use event::{OutboxEvent, RawRow, RowError};
pub use shard::Shard;

use crate::config::{MarkMode, SENT_AT_COLUMN, SEQ_COLUMN, TableName};

/// The statement that records confirmed rows (by `relay_seq`, `$1`; with
/// ranges by the runs of them, see [`MarkStatement`]), or `None` when rows
/// are left alone. It may write no outbox row at all
/// (`ranges`): what it returns counts rows marked only with `update` and
/// `delete`.
pub fn mark_sql(table: &TableName, mark: MarkMode) -> Option<String> {
    let t = table.quoted();
    match mark {
        MarkMode::Update => Some(format!(
            "UPDATE {t} SET {SENT_AT_COLUMN} = now() WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} = ANY($1)"
        )),
        MarkMode::Delete => Some(format!(
            "DELETE FROM {t} WHERE {SENT_AT_COLUMN} IS NULL AND {SEQ_COLUMN} = ANY($1)"
        )),
        MarkMode::Ranges => Some(progress::Ranges::new(table).record_sql()),
        MarkMode::None => None,
    }
}

pub use names::sent_index;

/// The prepared [`mark_sql`] statement, and how it takes the rows.
#[derive(Debug, Clone)]
pub struct MarkStatement {
    statement: tokio_postgres::Statement,
    by_runs: bool,
}

impl MarkStatement {
    /// `statement`: [`mark_sql`] of `mark`, prepared.
    pub fn new(statement: tokio_postgres::Statement, mark: MarkMode) -> Self {
        MarkStatement {
            statement,
            by_runs: mark == MarkMode::Ranges,
        }
    }

    /// Records the rows `seqs` as sent; returns what the statement counts.
    pub async fn execute(
        &self,
        client: &impl tokio_postgres::GenericClient,
        seqs: &[i64],
    ) -> Result<u64, tokio_postgres::Error> {
        if self.by_runs {
            let (first, last) = progress::runs(seqs);
            client.execute(&self.statement, &[&first, &last]).await
        } else {
            client.execute(&self.statement, &[&seqs]).await
        }
    }
}

/// The trigger that keeps unsent rows as inserted (`migrate` installs it,
/// `check` looks for it).
pub const WRITE_ONCE_TRIGGER: &str = "outbox_relay_write_once";

/// The trigger that refuses an INSERT giving `relay_xid` a value other
/// than the inserting transaction's (`migrate` installs it with its UPDATE
/// twin [`OWN_XID_UPDATE_TRIGGER`], `check` looks for it).
pub const OWN_XID_TRIGGER: &str = "outbox_relay_own_xid";

/// The trigger that refuses an UPDATE changing an unsent row's `relay_xid`.
pub const OWN_XID_UPDATE_TRIGGER: &str = "outbox_relay_own_xid_update";

/// The key of the session advisory lock that makes one instance active per
/// outbox (the pipeline takes it; `status`, `check` and retention read it).
pub fn ownership_key(table: &TableName) -> String {
    format!("outbox-relay:{table}")
}
