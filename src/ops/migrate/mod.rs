//! `outbox-relay migrate`: creates the outbox table, or adds to an existing
//! table only what the relay needs. Every step checks first, so running it
//! again changes nothing; `--dry-run` prints the SQL without running it.

use crate::config::{ColumnMap, SENT_AT_COLUMN, SEQ_COLUMN, TableName};
use crate::config::{Config, SourceMode};
use crate::ops::{ConfigFile, Failure, say};
use crate::outbox::inspect::table_info;
use crate::outbox::progress::Ranges;
use crate::outbox::sent_index;
use crate::source::cdc::setup;
use crate::source::polling::notify_channel;
use tokio_postgres::Client;

mod apply;
pub mod emit;
mod indexes;
mod table;
mod triggers;

pub use apply::apply;
pub use indexes::seq_index;
use indexes::{Index, seq_unique_steps, unsent_index};
use table::{alter_table, create_table, event_columns};

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
    // Reading a large table to plan may take longer than the relay's
    // statement timeout; lock waits are bounded where they matter (apply).
    client
        .batch_execute("SET statement_timeout = 0")
        .await
        .map_err(|e| Failure::runtime(MigrateError::Database(e)))?;
    let options = MigrateOptions::from_config(config, mark_existing_sent);
    let steps = plan(&client, &options).await.map_err(Failure::runtime)?;
    // A table migrate creates has no rows to mark.
    let creates = steps.first() == Some(&create_table(&options));
    if mark_existing_sent
        && !creates
        && !steps
            .iter()
            .any(|s| s.description == table::MARK_EXISTING_STEP)
    {
        say!(
            "-- --mark-existing-sent marks nothing: it marks the rows present when migrate adds \
             relay_sent_at, and {} has that column already; its unsent rows stay unsent and will be published",
            options.table
        );
    }
    if steps.is_empty() {
        say!(
            "-- nothing to do: {} is ready for outbox-relay",
            options.table
        );
        return Ok(());
    }
    for (i, step) in steps.iter().enumerate() {
        say!("-- {}. {}\n{};\n", i + 1, step.description, step.sql);
    }
    if dry_run {
        say!("-- dry run: nothing was changed");
        return Ok(());
    }
    apply(&mut client, &steps, &config.database)
        .await
        .map_err(Failure::runtime)?;
    say!("-- applied {} step(s)", steps.len());
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
    /// The table of ownership claims (clean hand-offs between owners).
    pub owners: TableName,
    /// Whether the tables that record sent rows by ranges are set up.
    pub ranges: RangesTables,
}

/// When `migrate` sets up the tables of `relay.mark = "ranges"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RangesTables {
    /// `relay.mark = "ranges"`.
    Always,
    /// `relay.mark` unset: when this run creates the outbox table on
    /// PostgreSQL 14 or later, so the new outbox chooses ranges
    /// ([`crate::ops::marking`]), or the outbox chose ranges already. An
    /// existing outbox keeps its marking.
    ForNewOutbox,
    /// Another marking is set.
    Never,
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
            owners: crate::relay::handoff::owners_table(table),
            ranges: match config.relay.mark_setting {
                Some(crate::config::MarkMode::Ranges) => RangesTables::Always,
                None => RangesTables::ForNewOutbox,
                Some(_) => RangesTables::Never,
            },
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
    #[error("{step}: {}", apply::step_error(.source))]
    Step {
        step: String,
        #[source]
        source: tokio_postgres::Error,
    },
}

/// The steps still needed, in order. Empty when everything is in place.
pub async fn plan(client: &Client, opts: &MigrateOptions) -> Result<Vec<Step>, MigrateError> {
    if let Some(problem) = crate::outbox::names::shared_problem(client, &opts.table).await? {
        return Err(MigrateError::Prerequisite(problem));
    }
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
    let unsent = Index {
        table: &opts.table,
        concurrently: existing,
        name: unsent_index(&opts.table),
        definition: format!("({SEQ_COLUMN}) WHERE {SENT_AT_COLUMN} IS NULL"),
        purpose: "unsent rows in order",
        unique: false,
    };
    unsent.steps(client, &mut steps).await?;
    // Marking, redrives and the start-up reads name rows by relay_seq: it
    // must name one row (explicit values, copied rows or a reset sequence
    // would make twins).
    if !info.as_ref().is_some_and(|i| i.seq_unique()) {
        seq_unique_steps(client, opts, info.as_ref(), existing, &mut steps).await?;
    }
    // Retention finds the oldest sent rows through it, a batch at a time,
    // instead of scanning the whole table for every batch.
    let sent = Index {
        name: sent_index(&opts.table),
        definition: format!("({SENT_AT_COLUMN}) WHERE {SENT_AT_COLUMN} IS NOT NULL"),
        purpose: "sent rows by age, for retention",
        ..unsent
    };
    sent.steps(client, &mut steps).await?;
    let ranges = wants_ranges(client, opts, info.is_none()).await?;
    if ranges {
        steps.extend(ranges_steps(client, opts, existing).await?);
    }
    match &opts.notify_channel {
        Some(channel) => steps.extend(triggers::notify(client, opts, channel).await?),
        None => steps.extend(triggers::drop_notify(client, &opts.table).await?),
    }
    let columns = event_columns(info.as_ref(), &opts.columns);
    steps.extend(triggers::write_once(client, &opts.table, &columns).await?);
    steps.extend(triggers::own_xid(client, &opts.table).await?);
    if let Some(dlq) = &opts.dead_letters {
        steps.extend(dead_letter_steps(client, dlq).await?);
    }
    steps.extend(owners_steps(client, opts, info.is_none()).await?);
    if let Some(cdc) = &opts.cdc {
        steps.extend(cdc_steps(client, &opts.table, cdc, partitioning.is_some()).await?);
    }
    Ok(steps)
}

/// Whether this run sets up the tables of ranges ([`RangesTables`]);
/// `new_outbox`: it creates the outbox table.
async fn wants_ranges(
    client: &Client,
    opts: &MigrateOptions,
    new_outbox: bool,
) -> Result<bool, MigrateError> {
    Ok(match opts.ranges {
        RangesTables::Always => true,
        // A new outbox on 14 or later, or one that chose ranges already
        // (its other objects are completed).
        RangesTables::ForNewOutbox if new_outbox => {
            crate::outbox::progress::version_problem(client)
                .await
                .map_err(MigrateError::Prerequisite)?
                .is_none()
        }
        RangesTables::ForNewOutbox => Ranges::new(&opts.table).exists(client).await?,
        RangesTables::Never => false,
    })
}

/// With `relay.mark = "ranges"` (PostgreSQL 14 or later): the progress,
/// frontier and held tables and the predicate's function when the progress
/// table is missing, and the index on `relay_xid`.
async fn ranges_steps(
    client: &Client,
    opts: &MigrateOptions,
    existing: bool,
) -> Result<Vec<Step>, MigrateError> {
    if let Some(problem) = crate::outbox::progress::version_problem(client)
        .await
        .map_err(MigrateError::Prerequisite)?
    {
        return Err(MigrateError::Prerequisite(problem));
    }
    let ranges = Ranges::new(&opts.table);
    let mut steps = Vec::new();
    // All four, when any is missing (a manual drop, a partial restore):
    // each statement leaves one that exists as it is.
    let function: bool = client
        .query_one(
            "SELECT to_regprocedure($1) IS NOT NULL",
            &[&format!(
                "{}(bigint, xid8, timestamptz)",
                ranges.sent_function.quoted()
            )],
        )
        .await?
        .get(0);
    let mut complete = function;
    for table in [&ranges.progress, &ranges.frontier, &ranges.held] {
        complete &= table_info(client, table).await?.is_some();
    }
    if !complete {
        let what = [
            format!(
                "create {}, one row of relay_seq ranges per confirmed batch",
                ranges.progress
            ),
            format!(
                "create {}, the snapshots the fold moved the frontier to",
                ranges.frontier
            ),
            format!(
                "create {}, rows the frontier passed before they were recorded",
                ranges.held
            ),
            format!(
                "create the function {}, which says whether a row was sent",
                ranges.sent_function
            ),
        ];
        for (description, sql) in what.into_iter().zip(ranges.tables_sql()) {
            steps.push(Step::new(description, sql));
        }
    }
    let xid = Index {
        table: &opts.table,
        concurrently: existing,
        name: ranges.xid_index.clone(),
        definition: crate::outbox::progress::Ranges::xid_index_definition(),
        purpose: "unsent rows by transaction, for the fold and the reads",
        unique: false,
    };
    xid.steps(client, &mut steps).await?;
    Ok(steps)
}

/// The owners table when it is missing; with a `new_outbox` (created in
/// this run, so nobody can have relayed it) its genesis row too, so the
/// first owner need not wait out a predecessor's lease.
async fn owners_steps(
    client: &Client,
    opts: &MigrateOptions,
    new_outbox: bool,
) -> Result<Vec<Step>, MigrateError> {
    let mut steps = Vec::new();
    if table_info(client, &opts.owners).await?.is_some() {
        return Ok(steps);
    }
    steps.push(Step::new(
        format!(
            "create {}, where owners record clean stops so the next starts at once",
            opts.owners
        ),
        crate::relay::handoff::create_sql(&opts.owners),
    ));
    if new_outbox {
        steps.push(Step::new(
            format!(
                "record in {} that the new outbox was never relayed, so its first owner starts at once",
                opts.owners
            ),
            crate::relay::handoff::genesis_sql(&opts.owners),
        ));
    }
    Ok(steps)
}

/// The dead-letter table, or the columns an older one lacks.
async fn dead_letter_steps(client: &Client, dlq: &TableName) -> Result<Vec<Step>, MigrateError> {
    let mut steps = Vec::new();
    match table_info(client, dlq).await? {
        None => {
            let indexes = crate::dead_letter::lookups::indexes(dlq);
            let mut sql = crate::dead_letter::create_sql(dlq).into_iter();
            steps
                .extend(sql.next().map(|create| {
                    Step::new(format!("create the dead-letter table {dlq}"), create)
                }));
            for (index, sql) in indexes.iter().zip(sql) {
                steps.push(Step::new(
                    format!("create index {} ({})", index.name, index.purpose),
                    sql,
                ));
            }
        }
        Some(info) => {
            if let Some(sql) = crate::dead_letter::upgrade_sql(dlq, &info.names()) {
                steps.push(Step::new(
                    format!("add the columns redrives and CDC replays need to {dlq}"),
                    sql,
                ));
            }
            // Indexes a later version added, built without blocking the
            // relay's writes to the table.
            for index in crate::dead_letter::lookups::indexes(dlq) {
                Index {
                    table: dlq,
                    concurrently: true,
                    name: index.name,
                    definition: index.definition.to_owned(),
                    purpose: index.purpose,
                    unique: false,
                }
                .steps(client, &mut steps)
                .await?;
            }
        }
    }
    Ok(steps)
}

/// The step that makes the publication carry the table's inserts, unless it
/// does; refused when the role may not add the table to a publication.
async fn publication_step(
    client: &Client,
    table: &TableName,
    cdc: &CdcObjects,
    partitioned: bool,
) -> Result<Option<Step>, MigrateError> {
    Ok(
        match setup::publication_covers(client, &cdc.publication, table).await? {
            Some(true) => None,
            _ if partitioned
                && setup::publishes_partitions(client, &cdc.publication, table).await? =>
            {
                Some(Step::new(
                    format!(
                        "publish inserts into {table} under its own name (publication {} names its partitions)",
                        cdc.publication
                    ),
                    setup::via_root_sql(&cdc.publication),
                ))
            }
            exists => {
                let (member, publish) = match exists {
                    Some(_) => setup::publication_gaps(client, &cdc.publication, table).await?,
                    None => (false, None),
                };
                // A member already (the publication lacks only inserts):
                // adding it again would fail.
                let mut sql = if member {
                    String::new()
                } else {
                    setup::publication_sql(&cdc.publication, table, exists.is_some(), partitioned)
                };
                if let Some(publish) = publish {
                    sql = [sql, publish]
                        .join(";\n")
                        .trim_start_matches(";\n")
                        .to_owned();
                }
                if !may_publish(client, table).await? {
                    return Err(MigrateError::Prerequisite(format!(
                        "publishing {table} (publication {}) needs ownership of the table: run migrate as its owner, \
                     or have the owner run: {sql}",
                        cdc.publication,
                    )));
                }
                Some(Step::new(
                    format!(
                        "publish inserts into {table} as publication {}",
                        cdc.publication
                    ),
                    sql,
                ))
            }
        },
    )
}

/// Whether this role may add `table` to a publication: it owns the table
/// (or is a member of its owner, or a superuser), or the table does not
/// exist yet (migrate creates it).
async fn may_publish(client: &Client, table: &TableName) -> Result<bool, MigrateError> {
    Ok(client
        .query_opt(
            "SELECT pg_has_role(current_user, c.relowner, 'USAGE') FROM pg_class c WHERE c.oid = to_regclass($1)",
            &[&table.quoted()],
        )
        .await?
        .is_none_or(|row| row.get(0)))
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
        // A relay streaming meanwhile would skip every event written with
        // the new prefix, and its slot would pass them for good.
        if crate::outbox::emit::prefix_problem(client, table, prefix)
            .await?
            .is_some()
            && setup::slot_info(client, &cdc.slot)
                .await?
                .is_some_and(|s| s.active)
        {
            return Err(MigrateError::Prerequisite(format!(
                "the function that writes logical messages would change to prefix {prefix:?} while a relay \
                 streams from slot {:?} and skips them: stop every relay of this outbox, run migrate, then \
                 start them again",
                cdc.slot
            )));
        }
        steps.extend(emit::step(client, table, prefix).await?);
    }
    if let Some(problem) = crate::outbox::names::slot_problem(client, table, &cdc.slot).await? {
        return Err(MigrateError::Prerequisite(problem));
    }
    steps.extend(publication_step(client, table, cdc, partitioned).await?);
    if cdc.slot_now && setup::slot_info(client, &cdc.slot).await?.is_none() {
        let lacking = setup::roles_without_replication(client).await?;
        if !lacking.is_empty() {
            return Err(MigrateError::Prerequisite(format!(
                "creating replication slot {:?} needs the REPLICATION attribute: run {} as a superuser",
                cdc.slot,
                setup::grant_replication(&lacking)
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
