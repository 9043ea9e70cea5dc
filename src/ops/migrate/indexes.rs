//! The relay's indexes: unsent rows, sent rows, and the unique `relay_seq`,
//! built `CONCURRENTLY` on a table that already exists.

use super::{MigrateError, MigrateOptions, Step};
use crate::config::{SEQ_COLUMN, TableName};
use crate::outbox::inspect::TableInfo;
use crate::sql::quote_ident;
use tokio_postgres::Client;

pub use crate::outbox::names::{seq_index, unsent_index};

/// An index the relay needs on the outbox table.
pub(super) struct Index<'a> {
    pub table: &'a TableName,
    /// Built `CONCURRENTLY`, so writers are not blocked while it builds: the
    /// table exists already (and is not partitioned).
    pub concurrently: bool,
    pub name: String,
    /// What follows `ON table`: the columns, and any `WHERE`.
    pub definition: String,
    pub purpose: &'a str,
    pub unique: bool,
}

impl Index<'_> {
    /// The step creating it, unless it exists.
    pub(super) async fn step(&self, client: &Client) -> Result<Option<Step>, MigrateError> {
        let exists: bool = client
            .query_one(
                "SELECT to_regclass($1) IS NOT NULL",
                &[&format!(
                    "{}.{}",
                    quote_ident(&self.table.schema),
                    quote_ident(&self.name)
                )],
            )
            .await?
            .get(0);
        Ok((!exists).then(|| self.create()))
    }

    /// The steps that leave it built and valid: dropped first when a
    /// concurrent build that failed left it invalid, then created unless it
    /// exists.
    pub(super) async fn steps(
        &self,
        client: &Client,
        steps: &mut Vec<Step>,
    ) -> Result<(), MigrateError> {
        match drop_invalid_index(client, self.table, &self.name, self.concurrently).await? {
            Some(drop) => steps.extend([drop, self.create()]),
            None => steps.extend(self.step(client).await?),
        }
        Ok(())
    }

    /// The step creating it.
    fn create(&self) -> Step {
        Step {
            description: format!("create index {} ({})", self.name, self.purpose),
            sql: format!(
                "CREATE {}INDEX {}IF NOT EXISTS {} ON {} {}",
                if self.unique { "UNIQUE " } else { "" },
                if self.concurrently {
                    "CONCURRENTLY "
                } else {
                    ""
                },
                quote_ident(&self.name),
                self.table.quoted(),
                self.definition,
            ),
            outside_transaction: self.concurrently,
        }
    }
}

/// Fails when `relay_seq` repeats: a unique index cannot be built until
/// each row has its own number, and only the operator can say which twin
/// keeps it.
pub(super) async fn refuse_seq_twins(
    client: &Client,
    table: &TableName,
) -> Result<(), MigrateError> {
    // As text: a column made by hand may be of another type. NULLs do not
    // collide in a unique index (the relay refuses them elsewhere).
    let twins: Vec<String> = client
        .query(
            &format!(
                "SELECT {SEQ_COLUMN}::text FROM {} WHERE {SEQ_COLUMN} IS NOT NULL
                 GROUP BY {SEQ_COLUMN} HAVING count(*) > 1 ORDER BY {SEQ_COLUMN} LIMIT 5",
                table.quoted()
            ),
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect();
    if twins.is_empty() {
        return Ok(());
    }
    Err(MigrateError::Prerequisite(format!(
        "{table}.{SEQ_COLUMN} repeats values (for example {}), so it cannot get the unique index the relay \
         needs to name a row: give every twin but one a new number, e.g. \
         UPDATE {t} SET {SEQ_COLUMN} = DEFAULT WHERE ctid NOT IN (SELECT min(ctid) FROM {t} GROUP BY {SEQ_COLUMN}); \
         renumbered unsent rows are published after the rows already there. Then run migrate again",
        twins.join(", "),
        t = table.quoted(),
    )))
}

/// A step dropping `index` when it exists but is invalid (a `CREATE INDEX
/// CONCURRENTLY` that failed), so it can be built again.
async fn drop_invalid_index(
    client: &Client,
    table: &TableName,
    index: &str,
    concurrently: bool,
) -> Result<Option<Step>, MigrateError> {
    let qualified = format!("{}.{}", quote_ident(&table.schema), quote_ident(index));
    let invalid: bool = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass($1) AND NOT indisvalid)",
            &[&qualified],
        )
        .await?
        .get(0);
    Ok(invalid.then(|| Step {
        description: format!("drop index {index} (an earlier build of it failed)"),
        sql: format!(
            "DROP INDEX {}IF EXISTS {qualified}",
            if concurrently { "CONCURRENTLY " } else { "" }
        ),
        outside_transaction: concurrently,
    }))
}

/// The unique index that makes relay_seq name one row (with the partition
/// key on a partitioned table), after checking no twins exist.
pub(super) async fn seq_unique_steps(
    client: &Client,
    opts: &MigrateOptions,
    info: Option<&TableInfo>,
    existing: bool,
    steps: &mut Vec<Step>,
) -> Result<(), MigrateError> {
    if info.is_some_and(|i| i.column(SEQ_COLUMN).is_some()) {
        refuse_seq_twins(client, &opts.table).await?;
    }
    // A partitioned table's unique index must hold its partition key.
    let key: Vec<String> =
        crate::outbox::inspect::seq_key(info.and_then(|i| i.partitioning.as_ref()))
            .iter()
            .map(|c| quote_ident(c))
            .collect();
    Index {
        table: &opts.table,
        concurrently: existing,
        name: seq_index(&opts.table),
        definition: format!("({})", key.join(", ")),
        purpose: "one row per relay_seq",
        unique: true,
    }
    .steps(client, steps)
    .await
}
