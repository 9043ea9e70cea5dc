//! Reading an existing table's shape and the relay's privileges on it, and
//! judging whether the relay can use it.

use crate::config::MarkMode;
use crate::config::{
    ColumnMap, ResolvedColumns, SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN,
};
use crate::errors::ErrorKind;
use tokio_postgres::GenericClient;

/// One column of the table as PostgreSQL describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ColumnInfo {
    pub name: String,
    /// `format_type()` output, e.g. `text`, `character varying(255)`, `jsonb`.
    pub type_name: String,
    pub not_null: bool,
    /// Has a default or is an identity column.
    pub has_default: bool,
}

/// What the relay needs to know about the outbox table.
#[derive(Debug, Clone)]
pub struct TableInfo {
    pub columns: Vec<ColumnInfo>,
    pub can_select: bool,
    pub can_update: bool,
    pub can_delete: bool,
    pub is_owner: bool,
    /// Columns with a unique index of their own (valid, not partial).
    pub unique_columns: Vec<String>,
    /// UPDATE and DELETE work under a publication that replicates them: a
    /// primary key, `REPLICA IDENTITY FULL` or a replica identity index.
    pub has_replica_identity: bool,
    /// Publications of the table that replicate updates or deletes: `(name,
    /// updates, deletes)`.
    pub replicating: Vec<(String, bool, bool)>,
    /// The table's own (not internal) triggers, by name.
    pub triggers: Vec<String>,
    /// The key of a partitioned table (`PARTITION BY`); `None` for a plain table.
    pub partitioning: Option<Partitioning>,
    /// The key columns of each valid, non-partial unique index without
    /// expressions, in index order.
    pub unique_indexes: Vec<Vec<String>>,
}

/// How a partitioned table is split.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Partitioning {
    /// `range`, `list` or `hash`.
    pub strategy: String,
    /// The key's plain columns, in key order.
    pub columns: Vec<String>,
    /// Part of the key is an expression, which no unique index can include.
    pub expressions: bool,
}

/// Why a table partitioned by an expression is refused, and what to use instead.
pub const EXPRESSION_KEY_PROBLEM: &str = "the table is partitioned by an expression, which outbox-relay cannot use: \
     the relay needs relay_seq unique, and a partitioned table's unique indexes must include the partition key, \
     which PostgreSQL allows only for plain columns; partition by columns, e.g. PARTITION BY RANGE (created_at)";

/// The columns of the unique index that lets `relay_seq` name one row:
/// `relay_seq` alone on a plain table; on a partitioned table, whose unique
/// indexes must include the partition key, `relay_seq` followed by the key.
pub fn seq_key(partitioning: Option<&Partitioning>) -> Vec<String> {
    let mut key = vec![SEQ_COLUMN.to_owned()];
    if let Some(p) = partitioning {
        key.extend(p.columns.iter().filter(|c| *c != SEQ_COLUMN).cloned());
    }
    key
}

impl TableInfo {
    pub fn column(&self, name: &str) -> Option<&ColumnInfo> {
        self.columns.iter().find(|c| c.name == name)
    }

    pub fn names(&self) -> Vec<String> {
        self.columns.iter().map(|c| c.name.clone()).collect()
    }

    pub fn partitioned(&self) -> bool {
        self.partitioning.is_some()
    }

    /// Whether a unique index lets `relay_seq` name one row: one on
    /// `relay_seq` alone, or, on a partitioned table, one that leads with
    /// `relay_seq` and adds only partition key columns. The latter is as good
    /// because every partition takes `relay_seq` from the root's one sequence
    /// (its default), so values repeat only when someone writes them
    /// explicitly, which the plain table's index would refuse and this one
    /// refuses within a partition key value.
    pub fn seq_unique(&self) -> bool {
        self.unique_with_key(SEQ_COLUMN)
    }

    /// Whether a unique index holds `column` alone or, on a partitioned
    /// table, `column` followed by partition key columns.
    pub fn unique_with_key(&self, column: &str) -> bool {
        let key_columns = self
            .partitioning
            .as_ref()
            .map(|p| p.columns.as_slice())
            .unwrap_or_default();
        self.unique_indexes.iter().any(|index| {
            index.first().map(String::as_str) == Some(column)
                && index[1..].iter().all(|c| key_columns.contains(c))
        })
    }
}

/// Reads the table's columns and privileges; `None` when the table does not exist.
pub async fn table_info(
    client: &impl GenericClient,
    table: &TableName,
) -> Result<Option<TableInfo>, tokio_postgres::Error> {
    let qualified = table.quoted();
    let row = client
        .query_one(
            "SELECT to_regclass($1)::oid,
                    CASE WHEN to_regclass($1) IS NULL THEN false ELSE has_table_privilege(to_regclass($1), 'SELECT') END,
                    CASE WHEN to_regclass($1) IS NULL THEN false ELSE has_table_privilege(to_regclass($1), 'UPDATE') END,
                    CASE WHEN to_regclass($1) IS NULL THEN false ELSE has_table_privilege(to_regclass($1), 'DELETE') END,
                    COALESCE((SELECT pg_has_role(relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass($1)), false)",
            &[&qualified],
        )
        .await?;
    let oid: Option<u32> = row.get(0);
    let Some(oid) = oid else { return Ok(None) };
    let unique_indexes = unique_indexes(client, oid).await?;
    let unique_columns = unique_indexes
        .iter()
        .filter(|i| i.len() == 1)
        .map(|i| i[0].clone())
        .collect();
    let partitioning = partitioning(client, oid).await?;
    let has_replica_identity = has_replica_identity(client, oid).await?;
    let replicating = replicating(client, table).await?;
    let triggers = texts(
        client,
        "SELECT tgname::text FROM pg_trigger WHERE tgrelid = $1 AND NOT tgisinternal",
        oid,
    )
    .await?;
    Ok(Some(TableInfo {
        columns: columns(client, oid).await?,
        can_select: row.get(1),
        can_update: row.get(2),
        can_delete: row.get(3),
        is_owner: row.get(4),
        unique_columns,
        has_replica_identity,
        replicating,
        triggers,
        partitioning,
        unique_indexes,
    }))
}

/// The first column of every row `sql` (with the table's oid as `$1`) returns.
async fn texts<T: for<'a> tokio_postgres::types::FromSql<'a>>(
    client: &impl GenericClient,
    sql: &str,
    oid: u32,
) -> Result<Vec<T>, tokio_postgres::Error> {
    Ok(client
        .query(sql, &[&oid])
        .await?
        .iter()
        .map(|r| r.get(0))
        .collect())
}

/// The key columns of each valid, plain (no predicate, no expression)
/// unique index.
async fn unique_indexes(
    client: &impl GenericClient,
    oid: u32,
) -> Result<Vec<Vec<String>>, tokio_postgres::Error> {
    texts(
        client,
        "SELECT ARRAY(SELECT a.attname::text
                      FROM unnest(i.indkey::int2[]) WITH ORDINALITY k(attnum, n)
                      JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
                      WHERE k.n <= i.indnkeyatts ORDER BY k.n)
         FROM pg_index i
         WHERE i.indrelid = $1 AND i.indisunique AND i.indisvalid
           AND i.indpred IS NULL AND i.indexprs IS NULL",
        oid,
    )
    .await
}

async fn partitioning(
    client: &impl GenericClient,
    oid: u32,
) -> Result<Option<Partitioning>, tokio_postgres::Error> {
    Ok(client
        .query_opt(
            "SELECT CASE p.partstrat WHEN 'r' THEN 'range' WHEN 'l' THEN 'list' ELSE 'hash' END,
                    ARRAY(SELECT a.attname::text
                          FROM unnest(p.partattrs::int2[]) WITH ORDINALITY k(attnum, n)
                          JOIN pg_attribute a ON a.attrelid = p.partrelid AND a.attnum = k.attnum
                          ORDER BY k.n),
                    p.partexprs IS NOT NULL
             FROM pg_partitioned_table p WHERE p.partrelid = $1",
            &[&oid],
        )
        .await?
        .map(|r| Partitioning {
            strategy: r.get(0),
            columns: r.get(1),
            expressions: r.get(2),
        }))
}

async fn has_replica_identity(
    client: &impl GenericClient,
    oid: u32,
) -> Result<bool, tokio_postgres::Error> {
    Ok(client
        .query_one(
            "SELECT CASE c.relreplident
                      WHEN 'f' THEN true
                      WHEN 'd' THEN EXISTS (SELECT 1 FROM pg_index WHERE indrelid = c.oid AND indisprimary)
                      WHEN 'i' THEN EXISTS (SELECT 1 FROM pg_index WHERE indrelid = c.oid AND indisreplident)
                      ELSE false END
             FROM pg_class c WHERE c.oid = $1",
            &[&oid],
        )
        .await?
        .get(0))
}

/// The publications that replicate the table's updates or deletes.
async fn replicating(
    client: &impl GenericClient,
    table: &TableName,
) -> Result<Vec<(String, bool, bool)>, tokio_postgres::Error> {
    Ok(client
        .query(
            "SELECT p.pubname::text, p.pubupdate, p.pubdelete FROM pg_publication p
             JOIN pg_publication_tables t ON t.pubname = p.pubname
             WHERE t.schemaname = $1 AND t.tablename = $2 AND (p.pubupdate OR p.pubdelete)
             ORDER BY 1",
            &[&table.schema, &table.name],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

async fn columns(
    client: &impl GenericClient,
    oid: u32,
) -> Result<Vec<ColumnInfo>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT attname::text, format_type(atttypid, atttypmod), attnotnull,
                    atthasdef OR attidentity <> ''
             FROM pg_attribute
             WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped
             ORDER BY attnum",
            &[&oid],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| ColumnInfo {
            name: r.get(0),
            type_name: r.get(1),
            not_null: r.get(2),
            has_default: r.get(3),
        })
        .collect())
}

/// The table's generated columns (`GENERATED ALWAYS AS (...)`), by name;
/// none when the table does not exist. Polling reads them as any column,
/// but pgoutput leaves them out of its tuples unless the publication
/// publishes them (stored ones, from PostgreSQL 18), so CDC refuses one it
/// would read (`source::cdc::setup::streaming_problems`).
pub async fn generated_columns(
    client: &impl GenericClient,
    table: &TableName,
) -> Result<Vec<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT attname::text FROM pg_attribute
             WHERE attrelid = to_regclass($1) AND attnum > 0 AND NOT attisdropped AND attgenerated <> ''
             ORDER BY attnum",
            &[&table.quoted()],
        )
        .await?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

const TEXTUAL: &[&str] = &["text", "character varying", "character", "uuid", "name"];

fn type_is(type_name: &str, accepted: &[&str]) -> bool {
    accepted.contains(&base_type(type_name).as_str())
}

/// A type as `format_type` prints it, without its modifiers: `character
/// varying(255)` is `character varying`, and `timestamp(3) with time
/// zone` is `timestamp with time zone`.
pub fn base_type(type_name: &str) -> String {
    let mut base = String::with_capacity(type_name.len());
    let mut depth = 0usize;
    for c in type_name.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            _ if depth == 0 => base.push(c),
            _ => {}
        }
    }
    base.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// What is wrong with the table for this column map, one message per problem,
/// each saying what to fix. Empty means the relay can use the table.
/// `deletes`: the relay deletes rows (`relay.mark = "delete"`, or retention).
pub fn verify(info: &TableInfo, map: &ColumnMap, mark: MarkMode, deletes: bool) -> Vec<String> {
    let mut problems = event_column_problems(info, map);
    problems.extend(relay_column_problems(info));
    problems.extend(privilege_problems(info, mark));
    problems.extend(seq_key_problems(info));
    problems.extend(replication_problems(info, mark, deletes));
    problems
}

/// The event columns [outbox.columns] names: present, and of a usable type.
fn event_column_problems(info: &TableInfo, map: &ColumnMap) -> Vec<String> {
    let mut problems = Vec::new();
    let mut expect = |key: &str, column: &str, accepted: &[&str], what: &str| {
        match info.column(column) {
        None => problems.push(format!(
            "column {column:?} (outbox.columns.{key}) does not exist; rename it in [outbox.columns] or add it"
        )),
        Some(c) if !type_is(&c.type_name, accepted) => problems.push(format!(
            "column {column:?} (outbox.columns.{key}) is {}, expected {what}",
            c.type_name
        )),
        Some(_) => {}
    }
    };
    expect(
        "id",
        &map.id,
        &["uuid", "text", "character varying", "bigint", "integer"],
        "uuid, text or an integer",
    );
    expect("aggregate_type", &map.aggregate_type, TEXTUAL, "text");
    expect(
        "aggregate_id",
        &map.aggregate_id,
        &[TEXTUAL, &["bigint", "integer"]].concat(),
        "text, uuid or an integer",
    );
    expect("event_type", &map.event_type, TEXTUAL, "text");
    expect(
        "payload",
        &map.payload,
        &["jsonb", "json", "text", "character varying"],
        "jsonb, json or text holding JSON",
    );
    let resolved = map.resolve(&info.names());
    let optional: [(&str, &Option<String>, &[&str], &str); 3] = [
        (
            "event_version",
            &resolved.event_version,
            &["integer", "smallint", "bigint"],
            "an integer",
        ),
        (
            "headers",
            &resolved.headers,
            &["jsonb", "json"],
            "jsonb or json",
        ),
        (
            "created_at",
            &resolved.created_at,
            &["timestamp with time zone", "timestamp without time zone"],
            "timestamptz",
        ),
    ];
    for (key, column, accepted, what) in optional {
        if let Some(column) = column {
            expect(key, column, accepted, what);
        }
    }
    // Any type will do: the value travels as its text form.
    for (i, x) in map.extra.iter().enumerate() {
        if info.column(&x.column).is_none() {
            problems.push(format!(
                "column {:?} (outbox.columns.extra[{i}].column) does not exist; rename it in [[outbox.columns.extra]] or add it",
                x.column
            ));
        }
    }
    // Any type will do here too; a value the broker would refuse is the
    // row's problem, refused when it is published.
    for (key, column) in map.routing() {
        if info.column(column).is_none() {
            problems.push(format!(
                "column {column:?} (outbox.columns.{key}) does not exist; rename it in [outbox.columns] or add it"
            ));
        }
    }
    problems
}

/// The relay's own columns: present, typed and defaulted as `migrate` makes them.
fn relay_column_problems(info: &TableInfo) -> Vec<String> {
    let mut problems = Vec::new();
    for (column, accepted, what) in [
        (SEQ_COLUMN, &["bigint"][..], "bigint"),
        (XID_COLUMN, &["xid8"][..], "xid8"),
        (
            SENT_AT_COLUMN,
            &["timestamp with time zone"][..],
            "timestamptz",
        ),
    ] {
        match info.column(column) {
            None => problems.push(format!(
                "the relay's column {column:?} is missing; run `outbox-relay migrate`"
            )),
            Some(c) if !type_is(&c.type_name, accepted) => problems.push(format!(
                "column {column:?} is {}, expected {what}; the relay owns this column name",
                c.type_name
            )),
            Some(c) if column != SENT_AT_COLUMN && !c.has_default => problems.push(format!(
                "column {column:?} has no default, so applications would have to fill it; run `outbox-relay migrate`"
            )),
            // A row without one is never read, and recording by ranges
            // cannot name it.
            Some(c) if column != SENT_AT_COLUMN && !c.not_null => problems.push(format!(
                "column {column:?} allows NULL, and a row without a value would never be relayed; \
                 make it NOT NULL (ALTER TABLE ... ALTER COLUMN {column} SET NOT NULL)"
            )),
            Some(_) => {}
        }
    }
    problems
}

/// What the relay's database user may do with the table.
fn privilege_problems(info: &TableInfo, mark: MarkMode) -> Vec<String> {
    let mut problems = Vec::new();
    if !info.can_select {
        problems
            .push("the relay's database user cannot SELECT from the table; GRANT SELECT".into());
    }
    match mark {
        MarkMode::Update if !info.can_update => problems.push(
            "the relay's database user cannot UPDATE the table to mark rows sent; GRANT UPDATE".into(),
        ),
        MarkMode::Delete if !info.can_delete => problems.push(
            "the relay's database user cannot DELETE from the table (relay.mark = \"delete\"); GRANT DELETE".into(),
        ),
        _ => {}
    }
    problems
}

/// relay_seq must name one row (with the partition key, when partitioned).
fn seq_key_problems(info: &TableInfo) -> Vec<String> {
    let mut problems = Vec::new();
    if info.partitioning.as_ref().is_some_and(|p| p.expressions) {
        problems.push(EXPRESSION_KEY_PROBLEM.into());
    } else if info.column(SEQ_COLUMN).is_some() && !info.seq_unique() {
        let key = seq_key(info.partitioning.as_ref()).join(", ");
        problems.push(format!(
            "{SEQ_COLUMN} has no unique index ({key}): explicit values, copied rows or a reset sequence would let \
             marking mark an unsent twin; run `outbox-relay migrate` to build it"
        ));
    }
    problems
}

/// A publication that replicates updates or deletes makes PostgreSQL refuse
/// them on a table without a replica identity (SQLSTATE 55000): marking rows
/// sent, or deleting them, would fail every time.
fn replication_problems(info: &TableInfo, mark: MarkMode, deletes: bool) -> Vec<String> {
    if info.has_replica_identity {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (publication, updates, deletes_published) in &info.replicating {
        let blocked = match (
            mark == MarkMode::Update && *updates,
            deletes && *deletes_published,
        ) {
            (true, true) => "marking rows sent (UPDATE) and deleting them",
            (true, false) => "marking rows sent (UPDATE)",
            (false, true) => "deleting rows (relay.mark = \"delete\" or retention)",
            (false, false) => continue,
        };
        out.push(format!(
            "publication {publication:?} replicates updates or deletes of the table, which has no replica identity, \
             so PostgreSQL refuses {blocked} (SQLSTATE 55000); give the table a primary key, \
             or run ALTER TABLE ... REPLICA IDENTITY FULL, \
             or let the publication carry inserts only: ALTER PUBLICATION \"{publication}\" SET (publish = 'insert')"
        ));
    }
    out
}

/// Warnings that do not stop the relay: uniqueness the relay relies on but
/// cannot enforce by itself on an adopted table.
pub fn warnings(info: &TableInfo, map: &ColumnMap) -> Vec<String> {
    let mut out = Vec::new();
    // On a partitioned table the best PostgreSQL allows is (id, partition key).
    if info.column(&map.id).is_some() && !info.unique_with_key(&map.id) {
        out.push(format!(
            "column {:?} (outbox.columns.id) has no unique index: consumers deduplicate by the event id, \
             so two events with one id would be taken for one; add a unique index on it",
            map.id
        ));
    }
    if !info.triggers.iter().any(|t| t == super::WRITE_ONCE_TRIGGER) {
        out.push(format!(
            "no trigger keeps unsent events as inserted: an UPDATE of an unsent row would be published \
             as inserted or as updated depending on how the relay reads it; run `outbox-relay migrate` \
             to add {}",
            super::WRITE_ONCE_TRIGGER
        ));
    }
    let has = |name: &str| info.triggers.iter().any(|t| t == name);
    if !(has(super::OWN_XID_TRIGGER) && has(super::OWN_XID_UPDATE_TRIGGER)) {
        out.push(format!(
            "no trigger keeps relay_xid to the inserting transaction's id: a row inserted with a value \
             of its own (an INSERT ... SELECT * from a copy of the outbox) could count as sent and never \
             be published; run `outbox-relay migrate` to add {} and {}",
            super::OWN_XID_TRIGGER,
            super::OWN_XID_UPDATE_TRIGGER
        ));
    }
    out
}

/// Resolves the column map against the table, or explains why the table is unusable.
pub async fn resolve_table(
    client: &impl GenericClient,
    table: &TableName,
    map: &ColumnMap,
    mark: MarkMode,
    deletes: bool,
) -> Result<ResolvedColumns, TableProblem> {
    let info = table_info(client, table)
        .await
        .map_err(TableProblem::Query)?
        .ok_or_else(|| TableProblem::Unusable(vec![format!(
            "table {table} does not exist (or the relay's user cannot see it); run `outbox-relay migrate` or set outbox.table"
        )]))?;
    let problems = verify(&info, map, mark, deletes);
    if !problems.is_empty() {
        return Err(TableProblem::Unusable(problems));
    }
    for w in warnings(&info, map) {
        tracing::warn!(table = %table, "{w}");
    }
    Ok(map.resolve(&info.names()))
}

/// Why the outbox table cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TableProblem {
    #[error("cannot inspect the outbox table: {0}")]
    Query(#[source] tokio_postgres::Error),
    #[error("the outbox table cannot be used:\n  - {}", .0.join("\n  - "))]
    Unusable(Vec<String>),
}

impl TableProblem {
    pub fn kind(&self) -> ErrorKind {
        match self {
            TableProblem::Query(e) => crate::errors::postgres(e),
            TableProblem::Unusable(_) => ErrorKind::NeedsOperator,
        }
    }
}

#[cfg(test)]
mod tests;
