//! `outbox-relay migrate`: creates the outbox table, or adds to an existing
//! table only what the relay needs. Every step checks first, so running it
//! again changes nothing; `--dry-run` prints the SQL without running it.

use crate::config::{ColumnMap, SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
use crate::config::{Config, SourceMode};
use crate::ops::{ConfigFile, Failure};
use crate::outbox::inspect::{TableInfo, table_info};
use crate::outbox::sent_index;
use crate::source::cdc::setup;
use crate::source::polling::notify_channel;
use crate::sql::quote_ident;
use tokio_postgres::Client;

pub mod emit;
mod triggers;

/// `outbox-relay migrate`: plans each pipeline's steps, prints them, and
/// applies them unless `dry_run`.
pub async fn command(
    file: &ConfigFile,
    dry_run: bool,
    mark_existing_sent: bool,
) -> Result<(), Failure> {
    super::for_each(&file.load_all()?, |c| {
        migrate_one(c, dry_run, mark_existing_sent)
    })
    .await
}

async fn migrate_one(
    config: &Config,
    dry_run: bool,
    mark_existing_sent: bool,
) -> Result<(), Failure> {
    let mut client = crate::db::connect(&config.database, None)
        .await
        .map_err(Failure::runtime)?;
    let options = MigrateOptions::from_config(config, mark_existing_sent);
    let steps = plan(&client, &options).await.map_err(Failure::runtime)?;
    if steps.is_empty() {
        println!(
            "-- nothing to do: {} is ready for outbox-relay",
            options.table
        );
        return Ok(());
    }
    for (i, step) in steps.iter().enumerate() {
        println!("-- {}. {}\n{};\n", i + 1, step.description, step.sql);
    }
    if dry_run {
        println!("-- dry run: nothing was changed");
        return Ok(());
    }
    apply(&mut client, &steps).await.map_err(Failure::runtime)?;
    println!("-- applied {} step(s)", steps.len());
    Ok(())
}

/// What `migrate` should set up.
#[derive(Debug, Clone)]
pub struct MigrateOptions {
    pub table: TableName,
    pub columns: ColumnMap,
    /// The NOTIFY channel of the insert trigger, when LISTEN wake-ups are on.
    pub notify_channel: Option<String>,
    /// When the relay's columns are added to a table that already has rows,
    /// mark those rows as sent instead of publishing them.
    pub mark_existing_sent: bool,
    /// The publication and slot, in CDC mode.
    pub cdc: Option<CdcObjects>,
    /// The dead-letter table, when dead-lettering is on.
    pub dead_letters: Option<TableName>,
}

/// The replication objects of the CDC source.
#[derive(Debug, Clone)]
pub struct CdcObjects {
    pub publication: String,
    pub slot: String,
    /// Create the slot as a failover slot (PostgreSQL 17+).
    pub failover: bool,
    /// Create the slot (CDC mode). In auto mode the relay creates it once
    /// the server allows CDC, so migrate works whatever `wal_level` is.
    pub slot_now: bool,
    /// The prefix of events sent as logical messages (`source.cdc.messages`):
    /// the function that writes them is installed.
    pub message_prefix: Option<String>,
}

impl MigrateOptions {
    pub fn from_config(config: &Config, mark_existing_sent: bool) -> Self {
        let table = &config.outbox.table;
        let mode = config.source.mode;
        MigrateOptions {
            table: table.clone(),
            columns: config.outbox.columns.clone(),
            // CDC needs no wake-ups: the stream is the wake-up.
            notify_channel: if mode.may_poll() {
                notify_channel(&config.source.polling, table)
            } else {
                None
            },
            mark_existing_sent,
            cdc: mode.may_use_cdc().then(|| CdcObjects {
                publication: config.source.cdc.publication_name(table),
                slot: config.source.cdc.slot_name(table),
                failover: config.source.cdc.failover,
                slot_now: mode == SourceMode::Cdc,
                message_prefix: config.source.cdc.message_prefix(table),
            }),
            dead_letters: config
                .dead_letter
                .enabled
                .then(|| config.dead_letter.table_name(table)),
        }
    }
}

/// One piece of DDL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub description: String,
    pub sql: String,
    /// `CREATE INDEX CONCURRENTLY` cannot run inside a transaction.
    pub outside_transaction: bool,
}

impl Step {
    fn new(description: impl Into<String>, sql: impl Into<String>) -> Self {
        Step {
            description: description.into(),
            sql: sql.into(),
            outside_transaction: false,
        }
    }
}

/// Why migrate could not plan or apply.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    #[error("{}", crate::db::error_text(.0))]
    Database(#[from] tokio_postgres::Error),
    #[error(
        "table {table} exists but lacks the required column(s) {missing}; map your column names in [outbox.columns]"
    )]
    MissingColumns { table: TableName, missing: String },
    /// The server or the role lacks something migrate cannot change; the message says what.
    #[error("{0}")]
    Prerequisite(String),
    #[error("{0}")]
    Source(#[from] crate::db::DbError),
    #[error("{step}: {}", crate::db::error_text(.source))]
    Step {
        step: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

fn unsent_index(table: &TableName) -> String {
    table.derived("outbox_relay_unsent")
}

/// The unique index on `relay_seq`.
pub fn seq_index(table: &TableName) -> String {
    table.derived("outbox_relay_seq")
}

/// `CREATE INDEX` unless the index exists; `CONCURRENTLY` on an existing
/// table, so writers are not blocked while it builds.
async fn index_step(
    client: &Client,
    table: &TableName,
    existing_table: bool,
    index: &str,
    definition: &str,
    purpose: &str,
) -> Result<Option<Step>, MigrateError> {
    index_step_kind(
        client,
        table,
        existing_table,
        index,
        definition,
        purpose,
        "",
    )
    .await
}

/// [`index_step`] for an index of `kind` (`""` or `"UNIQUE "`).
async fn index_step_kind(
    client: &Client,
    table: &TableName,
    existing_table: bool,
    index: &str,
    definition: &str,
    purpose: &str,
    kind: &str,
) -> Result<Option<Step>, MigrateError> {
    let exists: bool = client
        .query_one(
            "SELECT to_regclass($1) IS NOT NULL",
            &[&format!(
                "{}.{}",
                quote_ident(&table.schema),
                quote_ident(index)
            )],
        )
        .await?
        .get(0);
    Ok((!exists).then(|| create_index(table, existing_table, index, definition, purpose, kind)))
}

/// The step creating an index (concurrently on a table that already exists).
fn create_index(
    table: &TableName,
    existing_table: bool,
    index: &str,
    definition: &str,
    purpose: &str,
    kind: &str,
) -> Step {
    Step {
        description: format!("create index {index} ({purpose})"),
        sql: format!(
            "CREATE {kind}INDEX {}IF NOT EXISTS {} ON {} {definition}",
            if existing_table { "CONCURRENTLY " } else { "" },
            quote_ident(index),
            table.quoted(),
        ),
        outside_transaction: existing_table,
    }
}

/// Fails when `relay_seq` repeats: a unique index cannot be built until
/// each row has its own number, and only the operator can say which twin
/// keeps it.
async fn refuse_seq_twins(client: &Client, table: &TableName) -> Result<(), MigrateError> {
    let twins: Vec<i64> = client
        .query(
            &format!(
                "SELECT {SEQ_COLUMN} FROM {} GROUP BY 1 HAVING count(*) > 1 ORDER BY 1 LIMIT 5",
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
    let shown: Vec<String> = twins.iter().map(i64::to_string).collect();
    Err(MigrateError::Prerequisite(format!(
        "{table}.{SEQ_COLUMN} repeats values (for example {}), so it cannot get the unique index the relay \
         needs to name a row: give every twin but one a new number, e.g. \
         UPDATE {t} SET {SEQ_COLUMN} = DEFAULT WHERE ctid NOT IN (SELECT min(ctid) FROM {t} GROUP BY {SEQ_COLUMN}); \
         renumbered unsent rows are published after the rows already there. Then run migrate again",
        shown.join(", "),
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

/// The steps still needed, in order. Empty when everything is in place.
pub async fn plan(client: &Client, opts: &MigrateOptions) -> Result<Vec<Step>, MigrateError> {
    let info = table_info(client, &opts.table).await?;
    let partitioning = info.as_ref().and_then(|i| i.partitioning.as_ref());
    if partitioning.is_some_and(|p| p.expressions) {
        return Err(MigrateError::Prerequisite(format!(
            "{}: {}",
            opts.table,
            crate::outbox::inspect::EXPRESSION_KEY_PROBLEM
        )));
    }
    let mut steps = match &info {
        None => vec![create_table(opts)],
        Some(info) => alter_table(info, opts)?,
    };
    // PostgreSQL builds no index CONCURRENTLY on a partitioned table: there
    // the indexes are built on the root in migrate's transaction (each
    // partition gets its own, and partitions created later too), and writers
    // wait while they build.
    let existing = info.is_some() && partitioning.is_none();
    let index = unsent_index(&opts.table);
    steps.extend(
        index_step(
            client,
            &opts.table,
            existing,
            &index,
            &format!("({SEQ_COLUMN}) WHERE {SENT_AT_COLUMN} IS NULL"),
            "unsent rows in order",
        )
        .await?,
    );
    // Marking, redrives and the start-up reads name rows by relay_seq: it
    // must name one row (explicit values, copied rows or a reset sequence
    // would make twins).
    if !info.as_ref().is_some_and(|i| i.seq_unique()) {
        seq_unique_steps(client, opts, info.as_ref(), existing, &mut steps).await?;
    }
    // Retention finds the oldest sent rows through it, a batch at a time,
    // instead of scanning the whole table for every batch.
    let index = sent_index(&opts.table);
    steps.extend(
        index_step(
            client,
            &opts.table,
            existing,
            &index,
            &format!("({SENT_AT_COLUMN}) WHERE {SENT_AT_COLUMN} IS NOT NULL"),
            "sent rows by age, for retention",
        )
        .await?,
    );
    if let Some(channel) = &opts.notify_channel {
        steps.extend(triggers::notify(client, opts, channel).await?);
    }
    if let Some(step) = triggers::write_once(
        client,
        &opts.table,
        &event_columns(info.as_ref(), &opts.columns),
    )
    .await?
    {
        steps.push(step);
    }
    if let Some(dlq) = &opts.dead_letters {
        steps.extend(dead_letter_steps(client, dlq).await?);
    }
    if let Some(cdc) = &opts.cdc {
        steps.extend(cdc_steps(client, &opts.table, cdc, partitioning.is_some()).await?);
    }
    Ok(steps)
}

/// The unique index that makes relay_seq name one row (with the partition
/// key on a partitioned table), after checking no twins exist.
async fn seq_unique_steps(
    client: &Client,
    opts: &MigrateOptions,
    info: Option<&TableInfo>,
    existing: bool,
    steps: &mut Vec<Step>,
) -> Result<(), MigrateError> {
    let index = seq_index(&opts.table);
    if info.is_some_and(|i| i.column(SEQ_COLUMN).is_some()) {
        refuse_seq_twins(client, &opts.table).await?;
        // A concurrent build that failed leaves an invalid index behind.
        if let Some(drop) = drop_invalid_index(client, &opts.table, &index, existing).await? {
            steps.push(drop);
        }
    }
    // A partitioned table's unique index must hold its partition key.
    let key: Vec<String> =
        crate::outbox::inspect::seq_key(info.and_then(|i| i.partitioning.as_ref()))
            .iter()
            .map(|c| quote_ident(c))
            .collect();
    let (definition, purpose) = (format!("({})", key.join(", ")), "one row per relay_seq");
    if steps
        .last()
        .is_some_and(|s| s.sql.starts_with("DROP INDEX"))
    {
        steps.push(create_index(
            &opts.table,
            existing,
            &index,
            &definition,
            purpose,
            "UNIQUE ",
        ));
    } else {
        steps.extend(
            index_step_kind(
                client,
                &opts.table,
                existing,
                &index,
                &definition,
                purpose,
                "UNIQUE ",
            )
            .await?,
        );
    }
    Ok(())
}

/// The dead-letter table, or the columns an older one lacks.
async fn dead_letter_steps(client: &Client, dlq: &TableName) -> Result<Vec<Step>, MigrateError> {
    let mut steps = Vec::new();
    match table_info(client, dlq).await? {
        None => {
            for (i, sql) in crate::dead_letter::create_sql(dlq).into_iter().enumerate() {
                let what = if i == 0 {
                    "create the dead-letter table"
                } else {
                    "index its open dead letters"
                };
                steps.push(Step::new(format!("{what} {dlq}"), sql));
            }
        }
        Some(info) => {
            if let Some(sql) = crate::dead_letter::upgrade_sql(dlq, &info.names()) {
                steps.push(Step::new(
                    format!("add the columns redrives and CDC replays need to {dlq}"),
                    sql,
                ));
            }
        }
    }
    Ok(steps)
}

/// The publication (inserts only) and the slot, after checking what migrate cannot fix.
/// `partitioned`: the publication must publish through the root.
async fn cdc_steps(
    client: &Client,
    table: &TableName,
    cdc: &CdcObjects,
    partitioned: bool,
) -> Result<Vec<Step>, MigrateError> {
    if cdc.slot_now
        && let Some(problem) = setup::wal_level_problem(&setup::wal_level(client).await?)
    {
        return Err(MigrateError::Prerequisite(problem));
    }
    let mut steps = Vec::new();
    if let Some(prefix) = &cdc.message_prefix {
        if let Some(problem) = setup::messages_problem(client)
            .await
            .map_err(MigrateError::Prerequisite)?
        {
            return Err(MigrateError::Prerequisite(problem));
        }
        steps.extend(emit::step(client, table, prefix).await?);
    }
    match setup::publication_covers(client, &cdc.publication, table).await? {
        Some(true) => {}
        _ if partitioned && setup::publishes_partitions(client, &cdc.publication, table).await? => {
            steps.push(Step::new(
                format!(
                    "publish inserts into {table} under its own name (publication {} names its partitions)",
                    cdc.publication
                ),
                setup::via_root_sql(&cdc.publication),
            ))
        }
        exists => steps.push(Step::new(
            format!(
                "publish inserts into {table} as publication {}",
                cdc.publication
            ),
            setup::publication_sql(&cdc.publication, table, exists.is_some(), partitioned),
        )),
    }
    if cdc.slot_now && setup::slot_info(client, &cdc.slot).await?.is_none() {
        if !setup::can_replicate(client).await? {
            return Err(MigrateError::Prerequisite(format!(
                "creating replication slot {:?} needs the REPLICATION attribute: run ALTER ROLE <relay role> REPLICATION; as a superuser",
                cdc.slot
            )));
        }
        if setup::free_slots(client).await? <= 0 {
            return Err(MigrateError::Prerequisite(
                "every replication slot is in use: raise max_replication_slots (restart needed) or drop an unused slot".into(),
            ));
        }
        if cdc.failover
            && let Some(problem) = setup::failover_problem(client)
                .await
                .map_err(MigrateError::Prerequisite)?
        {
            return Err(MigrateError::Prerequisite(problem));
        }
        steps.push(Step {
            description: format!(
                "create logical replication slot {} (pgoutput{})",
                cdc.slot,
                if cdc.failover { ", failover" } else { "" }
            ),
            sql: setup::slot_sql(&cdc.slot, cdc.failover),
            outside_transaction: true,
        });
    }
    Ok(steps)
}

fn create_table(opts: &MigrateOptions) -> Step {
    let c = &opts.columns;
    let q = quote_ident;
    let optional = |name: &Option<String>, default: &str| q(name.as_deref().unwrap_or(default));
    Step::new(
        format!("create table {}", opts.table),
        format!(
            "CREATE TABLE {table} (
    {id} uuid PRIMARY KEY,
    {aggregate_type} text NOT NULL,
    {aggregate_id} text NOT NULL,
    {event_type} text NOT NULL,
    {event_version} integer NOT NULL DEFAULT 1,
    {payload} jsonb NOT NULL,
    {headers} jsonb NOT NULL DEFAULT '{{}}',
    {created_at} timestamptz NOT NULL DEFAULT now(),
    {seq} bigint GENERATED BY DEFAULT AS IDENTITY,
    {xid} xid8 NOT NULL DEFAULT pg_current_xact_id(),
    {sent} timestamptz
)",
            table = opts.table.quoted(),
            id = q(&c.id),
            aggregate_type = q(&c.aggregate_type),
            aggregate_id = q(&c.aggregate_id),
            event_type = q(&c.event_type),
            event_version = optional(
                &c.event_version,
                crate::config::columns::DEFAULT_EVENT_VERSION
            ),
            payload = q(&c.payload),
            headers = optional(&c.headers, crate::config::columns::DEFAULT_HEADERS),
            created_at = optional(&c.created_at, crate::config::columns::DEFAULT_CREATED_AT),
            seq = SEQ_COLUMN,
            xid = XID_COLUMN,
            sent = SENT_AT_COLUMN,
        ),
    )
}

/// The event columns of the table (after `migrate`), which stay as inserted
/// until the row is sent.
fn event_columns(info: Option<&TableInfo>, map: &ColumnMap) -> Vec<String> {
    let names = match info {
        Some(info) => info.names(),
        // The table `create_table` makes has every optional column.
        None => vec![
            map.event_version
                .clone()
                .unwrap_or(crate::config::columns::DEFAULT_EVENT_VERSION.into()),
            map.headers
                .clone()
                .unwrap_or(crate::config::columns::DEFAULT_HEADERS.into()),
            map.created_at
                .clone()
                .unwrap_or(crate::config::columns::DEFAULT_CREATED_AT.into()),
        ],
    };
    let resolved = map.resolve(&names);
    let mut columns: Vec<String> = resolved
        .in_row_order()
        .into_iter()
        .flatten()
        .map(str::to_owned)
        .collect();
    // Extra columns are published too, so they stay as inserted as well
    // (those the table has: `run` and `check` report a missing one).
    for x in resolved.extra {
        if names.contains(&x) && !columns.contains(&x) {
            columns.push(x);
        }
    }
    columns
}

fn alter_table(info: &TableInfo, opts: &MigrateOptions) -> Result<Vec<Step>, MigrateError> {
    let c = &opts.columns;
    let missing: Vec<&str> = [
        &c.id,
        &c.aggregate_type,
        &c.aggregate_id,
        &c.event_type,
        &c.payload,
    ]
    .into_iter()
    .filter(|name| info.column(name).is_none())
    .map(String::as_str)
    .collect();
    if !missing.is_empty() {
        return Err(MigrateError::MissingColumns {
            table: opts.table.clone(),
            missing: missing.join(", "),
        });
    }
    let table = opts.table.quoted();
    let mut steps = Vec::new();
    if info.column(SEQ_COLUMN).is_none() && info.partitioned() {
        steps.extend(partitioned_seq(&opts.table));
    } else if info.column(SEQ_COLUMN).is_none() {
        steps.push(Step::new(
            format!("add {SEQ_COLUMN} to {} (numbers existing rows; rewrites the table)", opts.table),
            format!("ALTER TABLE {table} ADD COLUMN {SEQ_COLUMN} bigint GENERATED BY DEFAULT AS IDENTITY"),
        ));
    }
    if info.column(XID_COLUMN).is_none() {
        steps.push(Step::new(
            format!("add {XID_COLUMN} to {}", opts.table),
            format!("ALTER TABLE {table} ADD COLUMN {XID_COLUMN} xid8 NOT NULL DEFAULT pg_current_xact_id()"),
        ));
    }
    if info.column(SENT_AT_COLUMN).is_none() {
        steps.push(Step::new(
            format!("add {SENT_AT_COLUMN} to {}", opts.table),
            format!("ALTER TABLE {table} ADD COLUMN {SENT_AT_COLUMN} timestamptz"),
        ));
        if opts.mark_existing_sent {
            steps.push(Step::new(
                "mark the rows already in the table as sent (--mark-existing-sent)",
                format!(
                    "UPDATE {table} SET {SENT_AT_COLUMN} = now() WHERE {SENT_AT_COLUMN} IS NULL"
                ),
            ));
        }
    }
    Ok(steps)
}

/// The sequence behind `relay_seq` on a partitioned table. PostgreSQL 15
/// cannot add an identity column to a partitioned table that has
/// partitions, so `relay_seq` takes its default from a sequence the column
/// owns: every partition, those created later too, inherits the default,
/// so all rows draw from one sequence wherever they are routed.
fn seq_sequence(table: &TableName) -> String {
    let mut name = format!("{}_{SEQ_COLUMN}_seq", table.name);
    while name.len() > 63 {
        name.pop();
    }
    format!("{}.{}", quote_ident(&table.schema), quote_ident(&name))
}

/// Adds `relay_seq` to a partitioned table (see [`seq_sequence`]).
fn partitioned_seq(table: &TableName) -> Vec<Step> {
    let sequence = seq_sequence(table);
    let t = table.quoted();
    vec![Step::new(
        format!(
            "add {SEQ_COLUMN} to {table} from sequence {sequence} (numbers existing rows; rewrites every partition)"
        ),
        format!(
            "CREATE SEQUENCE IF NOT EXISTS {sequence} AS bigint;
ALTER TABLE {t} ADD COLUMN {SEQ_COLUMN} bigint NOT NULL DEFAULT nextval({seq_literal}::regclass);
ALTER SEQUENCE {sequence} OWNED BY {t}.{SEQ_COLUMN}",
            seq_literal = crate::sql::quote_literal(&sequence),
        ),
    )]
}

/// Runs the steps: the transactional ones in one transaction, then the others.
pub async fn apply(client: &mut Client, steps: &[Step]) -> Result<(), MigrateError> {
    let tx = client.transaction().await?;
    for step in steps.iter().filter(|s| !s.outside_transaction) {
        tx.batch_execute(&step.sql)
            .await
            .map_err(|source| MigrateError::Step {
                step: step.description.clone(),
                source,
            })?;
    }
    tx.commit().await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_partitioned_table_gets_relay_seq_from_a_sequence_it_owns() {
        let steps = partitioned_seq(&TableName::new("shop", "outbox"));
        assert_eq!(steps.len(), 1);
        assert!(!steps[0].outside_transaction);
        assert_eq!(
            steps[0].sql,
            "CREATE SEQUENCE IF NOT EXISTS \"shop\".\"outbox_relay_seq_seq\" AS bigint;
ALTER TABLE \"shop\".\"outbox\" ADD COLUMN relay_seq bigint NOT NULL DEFAULT nextval('\"shop\".\"outbox_relay_seq_seq\"'::regclass);
ALTER SEQUENCE \"shop\".\"outbox_relay_seq_seq\" OWNED BY \"shop\".\"outbox\".relay_seq"
        );
        let long = seq_sequence(&TableName::new("public", &"x".repeat(70)));
        assert_eq!(long.len(), "\"public\".".len() + 63 + 2);
    }
}
