//! Slot and publication: inspection, creation, and the checks that say what
//! to fix (`wal_level`, free slots, the REPLICATION privilege, ownership).

use crate::config::TableName;
use crate::db::{DbError, error_text};
use crate::replication::Lsn;
use crate::sql::{quote_ident, quote_literal};
use tokio_postgres::Client;

mod generated;
mod narrowed;

/// Why a CDC stream could not carry the outbox's events as the relay reads
/// them: columns it reads that `publication` does not stream (generated
/// ones, ones its column list leaves out, `relay_seq` when rows are marked:
/// `marks`) and a row filter. One message each, naming the fix.
pub async fn streaming_problems(
    client: &Client,
    publication: &str,
    table: &TableName,
    columns: &crate::config::ResolvedColumns,
    marks: bool,
) -> Result<Vec<String>, DbError> {
    let version: i32 = client
        .query_one("SELECT current_setting('server_version_num')::int", &[])
        .await
        .map_err(|e| q("reading server_version_num", e))?
        .get(0);
    let generated = crate::outbox::inspect::generated_columns(client, table)
        .await
        .map_err(|e| q("reading the outbox table's generated columns", e))?;
    let read = (columns, generated.as_slice());
    let mut problems =
        generated::generated_problems(client, version, publication, table, read).await?;
    problems.extend(
        narrowed::narrowing_problems(client, version, publication, table, read, marks).await?,
    );
    Ok(problems)
}

/// What `pg_replication_slots` says about a slot.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub plugin: Option<String>,
    pub database: Option<String>,
    pub logical: bool,
    /// `reserved`, `extended`, `unreserved` or `lost`.
    pub wal_status: Option<String>,
    pub confirmed_flush: Option<Lsn>,
    pub active: bool,
    /// WAL the slot keeps from removal: `pg_current_wal_lsn() - restart_lsn`.
    pub retained_bytes: Option<i64>,
    /// `pg_current_wal_lsn() - confirmed_flush_lsn`.
    pub lag_bytes: Option<i64>,
}

fn q(context: &str, e: tokio_postgres::Error) -> DbError {
    DbError::query(context, e)
}

pub async fn slot_info(client: &Client, slot: &str) -> Result<Option<SlotInfo>, DbError> {
    let row = client
        .query_opt(
            "SELECT plugin::text, database::text, slot_type = 'logical', wal_status,
                    confirmed_flush_lsn::text, active,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
                    pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
             FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map_err(|e| q("reading pg_replication_slots", e))?;
    Ok(row.map(|r| SlotInfo {
        plugin: r.get(0),
        database: r.get(1),
        logical: r.get(2),
        wal_status: r.get(3),
        confirmed_flush: r.get::<_, Option<String>>(4).and_then(|s| s.parse().ok()),
        active: r.get(5),
        retained_bytes: r.get(6),
        lag_bytes: r.get(7),
    }))
}

/// The confirmed position of `slot` while the process `pid` (a walsender)
/// holds it: `None` when it does not, `Some(None)` when the slot has none.
pub async fn held_slot_confirmed(
    client: &Client,
    slot: &str,
    pid: i32,
) -> Result<Option<Option<Lsn>>, DbError> {
    let row = client
        .query_opt(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots
             WHERE slot_name = $1 AND active_pid = $2",
            &[&slot, &pid],
        )
        .await
        .map_err(|e| q("reading the position of the slot the stream holds", e))?;
    Ok(row.map(|r| r.get::<_, Option<String>>(0).and_then(|s| s.parse().ok())))
}

/// Problems that make the slot unusable for this database, each with its fix.
pub fn slot_problems(info: &SlotInfo, slot: &str, database: &str) -> Vec<String> {
    let mut out = Vec::new();
    if !info.logical || info.plugin.as_deref() != Some("pgoutput") {
        out.push(format!(
            "replication slot {slot:?} is not a logical pgoutput slot (plugin {:?}); choose another source.cdc.slot or drop it",
            info.plugin.as_deref().unwrap_or("none")
        ));
    }
    if info.database.as_deref().is_some_and(|d| d != database) {
        out.push(format!(
            "replication slot {slot:?} belongs to database {:?}, not {database:?}; choose another source.cdc.slot",
            info.database.as_deref().unwrap_or("?")
        ));
    }
    out
}

impl SlotInfo {
    /// PostgreSQL removed WAL the slot still needed: it can never stream again.
    pub fn is_lost(&self) -> bool {
        self.wal_status.as_deref() == Some("lost")
    }
}

/// The specific error for a slot whose WAL was removed, with the recovery.
/// `marked`: rows are marked, so the table still holds every unsent event.
/// `marked`: every event the lost WAL held is still an unsent row (rows are
/// marked and no events come as logical messages).
pub fn lost_slot_message(slot: &str, marked: bool) -> String {
    let cause = format!(
        "replication slot {slot:?} is lost: PostgreSQL removed WAL it still needed (max_slot_wal_keep_size was exceeded while the relay was behind or down)"
    );
    if marked {
        format!(
            "{cause}. Nothing is lost from the outbox: unsent rows are still in the table. To recover, set \
             source.cdc.on_lost_slot = \"recreate\" (the default when rows are marked), or drop the slot \
             (SELECT pg_drop_replication_slot('{slot}');) and start the relay: it creates a new slot and first publishes the unsent rows from the table"
        )
    } else {
        format!(
            "{cause}. With relay.mark = \"none\", or events sent as logical messages (source.cdc.messages = true), \
             the events in the removed WAL exist nowhere else the relay can read, \
             so a new slot would skip them: decide which to emit again (the outbox table still shows them unless your \
             application deletes its rows), then drop the slot (SELECT pg_drop_replication_slot('{slot}');) and start \
             the relay, which creates a new one at the current position"
        )
    }
}

/// How long writing a restart point waits for the transactions that were
/// running when it wrote one (see [`write_restart_point`]).
const RESTART_POINT_WAIT: &str = "1s";

/// Writes a record of the running transactions to the WAL: a logical slot's
/// restart position (where every decode of it begins: a move, a new stream)
/// moves only to such records, which the server otherwise writes every 15
/// seconds at most. Written just before a position the slot is then moved
/// past, it lets the slot restart from there rather than from before a
/// backlog that every later decode would read again.
///
/// Creating a logical slot writes one, and needs no more than the
/// REPLICATION attribute the relay has, so this creates a temporary slot
/// named after `slot` and drops it. The creation then waits for the
/// transactions already running to end; that wait is cut short after
/// [`RESTART_POINT_WAIT`], the record being written by then.
pub async fn write_restart_point(client: &Client, slot: &str) -> Result<(), DbError> {
    let base = slot.get(..slot.len().min(54)).unwrap_or(slot);
    let temporary = format!("{base}_restart");
    client
        .batch_execute(&format!("SET statement_timeout = '{RESTART_POINT_WAIT}'"))
        .await
        .map_err(|e| q("limiting the wait for a restart point", e))?;
    let created = client
        .execute(
            "SELECT 1 FROM pg_create_logical_replication_slot($1, 'pgoutput', true)",
            &[&temporary],
        )
        .await;
    match created {
        Ok(_) => {
            client
                .execute("SELECT pg_drop_replication_slot($1)", &[&temporary])
                .await
                .map_err(|e| q("dropping the temporary slot of a restart point", e))?;
            Ok(())
        }
        // Cancelled while waiting for running transactions: written.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED) => Ok(()),
        Err(e) => Err(q("writing a restart point", e)),
    }
}

/// Drops a slot (a lost one, before it is created again).
pub async fn drop_slot(client: &Client, slot: &str) -> Result<(), DbError> {
    client
        .execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .map_err(|e| q("dropping the lost replication slot", e))?;
    Ok(())
}

pub async fn wal_level(client: &Client) -> Result<String, DbError> {
    Ok(client
        .query_one("SHOW wal_level", &[])
        .await
        .map_err(|e| q("reading wal_level", e))?
        .get(0))
}

pub fn wal_level_problem(level: &str) -> Option<String> {
    (level != "logical").then(|| {
        format!(
            "wal_level is {level:?}, but CDC needs \"logical\": run ALTER SYSTEM SET wal_level = logical; and restart PostgreSQL \
             (on a managed service, enable logical replication in its settings), or use source.mode = \"polling\""
        )
    })
}

/// `Some(true)` when the publication exists and publishes the table's inserts,
/// `Some(false)` when it exists without doing so, `None` when it does not exist.
pub async fn publication_covers(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<Option<bool>, DbError> {
    let row = client
        .query_opt(
            "SELECT p.pubinsert,
                    EXISTS (SELECT 1 FROM pg_publication_tables t
                            WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3)
             FROM pg_publication p WHERE p.pubname = $1",
            &[&publication, &table.schema, &table.name],
        )
        .await
        .map_err(|e| q("reading pg_publication", e))?;
    Ok(row.map(|r| r.get::<_, bool>(0) && r.get::<_, bool>(1)))
}

/// For an existing publication that does not publish `table`'s inserts:
/// whether the table is a member already, and, when the publication
/// publishes no inserts at all, the statement that adds them to what it
/// publishes.
pub async fn publication_gaps(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<(bool, Option<String>), DbError> {
    let row = client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_publication_tables t
                            WHERE t.pubname = p.pubname AND t.schemaname = $2 AND t.tablename = $3),
                    p.pubinsert,
                    concat_ws(', ', 'insert', CASE WHEN p.pubupdate THEN 'update' END,
                              CASE WHEN p.pubdelete THEN 'delete' END,
                              CASE WHEN p.pubtruncate THEN 'truncate' END)
             FROM pg_publication p WHERE p.pubname = $1",
            &[&publication, &table.schema, &table.name],
        )
        .await
        .map_err(|e| q("reading pg_publication", e))?;
    let (member, inserts, publish): (bool, bool, String) = (row.get(0), row.get(1), row.get(2));
    Ok((
        member,
        (!inserts).then(|| {
            format!(
                "ALTER PUBLICATION {} SET (publish = '{publish}')",
                quote_ident(publication)
            )
        }),
    ))
}

/// The roles that lack what CDC needs (REPLICATION or superuser), as SQL
/// identifiers: the login role, which the replication connection is
/// authorised by, and the current role, which the slot functions check
/// (they differ when `database.url`'s options set `role`).
pub async fn roles_without_replication(client: &Client) -> Result<Vec<String>, DbError> {
    let rows = client
        .query(
            "SELECT quote_ident(rolname) FROM pg_roles \
             WHERE rolname IN (session_user, current_user) AND NOT (rolreplication OR rolsuper) \
             ORDER BY rolname = session_user DESC",
            &[],
        )
        .await
        .map_err(|e| q("reading the role's privileges", e))?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// What a superuser runs to give `roles` (from [`roles_without_replication`]) the attribute.
pub fn grant_replication(roles: &[String]) -> String {
    roles
        .iter()
        .map(|r| format!("ALTER ROLE {r} REPLICATION;"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Free replication slots (`max_replication_slots` minus those in use).
pub async fn free_slots(client: &Client) -> Result<i64, DbError> {
    Ok(client
        .query_one(
            "SELECT current_setting('max_replication_slots')::bigint - (SELECT count(*) FROM pg_replication_slots)",
            &[],
        )
        .await
        .map_err(|e| q("counting replication slots", e))?
        .get(0))
}

/// `wal_sender_timeout` in milliseconds (0: disabled).
pub async fn wal_sender_timeout_ms(client: &Client) -> Result<i64, DbError> {
    Ok(client
        .query_one(
            "SELECT setting::bigint FROM pg_settings WHERE name = 'wal_sender_timeout'",
            &[],
        )
        .await
        .map_err(|e| q("reading wal_sender_timeout", e))?
        .get(0))
}

/// What a failure to create the slot adds to the server's "all replication
/// slots are in use" (SQLSTATE 53400): `source.mode = "auto"` polls then.
pub const NO_FREE_SLOT_HINT: &str =
    "; raise max_replication_slots (restart needed) or drop an unused slot";
/// ... and when `wal_level` is not `logical` (SQLSTATE 55000).
pub const WAL_LEVEL_HINT: &str = "; wal_level must be logical";

/// Creates the slot; returns its consistent point. Must run outside a
/// transaction that wrote anything.
pub async fn create_slot(client: &Client, slot: &str, failover: bool) -> Result<Lsn, String> {
    if failover && let Some(problem) = failover_problem(client).await? {
        return Err(problem);
    }
    let sql = if failover {
        // Arguments: temporary, two-phase, failover (PostgreSQL 17+).
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput', false, false, true)"
    } else {
        "SELECT lsn::text FROM pg_create_logical_replication_slot($1, 'pgoutput')"
    };
    let row = client.query_one(sql, &[&slot]).await.map_err(|e| {
        let hint = match e.code().map(|c| c.code()) {
            Some("42501") => {
                "; the relay's role needs the REPLICATION attribute (ALTER ROLE ... REPLICATION)"
            }
            Some("53400") => NO_FREE_SLOT_HINT,
            Some("55000") => WAL_LEVEL_HINT,
            _ => "",
        };
        format!(
            "cannot create replication slot {slot:?}: {}{hint}",
            error_text(&e)
        )
    })?;
    let lsn: String = row.get(0);
    lsn.parse()
        .map_err(|e| format!("slot {slot:?} created at an unreadable LSN: {e}"))
}

/// The SQL that creates the publication, or adds the table to an existing one.
/// A `partitioned` table is published through its root
/// (`publish_via_partition_root`): pgoutput then names the root in its
/// Relation messages, whatever partition a row lands in, and partitions
/// created later are published without another change
/// (<https://www.postgresql.org/docs/15/sql-createpublication.html>).
pub fn publication_sql(
    publication: &str,
    table: &TableName,
    exists: bool,
    partitioned: bool,
) -> String {
    match (exists, partitioned) {
        (true, false) => format!(
            "ALTER PUBLICATION {} ADD TABLE {}",
            quote_ident(publication),
            table.quoted()
        ),
        (true, true) => format!(
            "ALTER PUBLICATION {} ADD TABLE {};\n{}",
            quote_ident(publication),
            table.quoted(),
            via_root_sql(publication)
        ),
        (false, false) => format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert')",
            quote_ident(publication),
            table.quoted()
        ),
        (false, true) => format!(
            "CREATE PUBLICATION {} FOR TABLE {} WITH (publish = 'insert', publish_via_partition_root = true)",
            quote_ident(publication),
            table.quoted()
        ),
    }
}

/// Makes an existing publication publish partitioned tables through their
/// roots (it applies to every partitioned table the publication holds).
pub fn via_root_sql(publication: &str) -> String {
    format!(
        "ALTER PUBLICATION {} SET (publish_via_partition_root = true)",
        quote_ident(publication)
    )
}

/// Whether the publication publishes partitions of `table` under their own
/// names (`publish_via_partition_root` off): the relay, which reads the
/// root's Relation messages, would see none of their inserts.
pub async fn publishes_partitions(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<bool, DbError> {
    Ok(client
        .query_one(
            "SELECT EXISTS (
                 SELECT 1 FROM pg_publication_tables t
                 JOIN pg_partition_tree(to_regclass($2)) tree
                   ON tree.relid = to_regclass(format('%I.%I', t.schemaname, t.tablename))
                 WHERE t.pubname = $1 AND tree.level > 0)",
            &[&publication, &table.quoted()],
        )
        .await
        .map_err(|e| q("reading pg_publication_tables", e))?
        .get(0))
}

/// What to say when the publication does not publish the table's inserts
/// under the table's name.
pub async fn not_published_problem(
    client: &Client,
    publication: &str,
    table: &TableName,
) -> Result<String, DbError> {
    Ok(if publishes_partitions(client, publication, table).await? {
        format!(
            "publication {publication:?} publishes the partitions of {table} under their own names \
             (publish_via_partition_root is off), so the relay would see none of their inserts; run \
             `outbox-relay migrate`, or {}",
            via_root_sql(publication)
        )
    } else {
        format!(
            "publication {publication:?} does not publish inserts into {table}; run `outbox-relay migrate`"
        )
    })
}

/// The SQL that creates the slot (shown by `migrate --dry-run`).
pub fn slot_sql(slot: &str, failover: bool) -> String {
    format!(
        "SELECT pg_create_logical_replication_slot({}, 'pgoutput'{})",
        quote_literal(slot),
        if failover { ", false, false, true" } else { "" }
    )
}

/// Whether the slot is a failover slot; `None` when it does not exist. PostgreSQL 17+ only.
pub async fn slot_failover(client: &Client, slot: &str) -> Result<Option<bool>, String> {
    client
        .query_opt(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .map(|row| row.map(|r| r.get(0)))
        .map_err(|e| format!("reading pg_replication_slots.failover: {}", error_text(&e)))
}

/// Why `source.cdc.failover` cannot be honoured here: failover slots came with PostgreSQL 17.
pub async fn failover_problem(client: &Client) -> Result<Option<String>, String> {
    let version = crate::db::server_version_num(client).await?;
    Ok((version < 170_000).then(|| {
        format!(
            "source.cdc.failover needs PostgreSQL 17 or later (failover slots); this server is version {version}: \
             set source.cdc.failover = false, or upgrade"
        )
    }))
}

/// Why `source.cdc.messages` cannot work on this server, if it cannot:
/// pgoutput sends logical messages from PostgreSQL 14 on.
pub async fn messages_problem(client: &Client) -> Result<Option<String>, String> {
    let version = crate::db::server_version_num(client).await?;
    Ok((version < 140_000).then(|| {
        format!(
            "source.cdc.messages needs PostgreSQL 14 or later (pgoutput sends logical messages from 14 on); \
             this server is version {version}: set source.cdc.messages = false and write events as rows, or upgrade"
        )
    }))
}

/// The major version in a `server_version` report (`13.23`, `17.10 (Debian ...)`, `18beta1`).
pub fn major_version(report: Option<&str>) -> Option<u32> {
    let digits: String = report?
        .trim_start()
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitioned_tables_are_published_through_their_root() {
        let t = TableName::new("public", "outbox");
        assert_eq!(
            publication_sql("p", &t, false, false),
            "CREATE PUBLICATION \"p\" FOR TABLE \"public\".\"outbox\" WITH (publish = 'insert')"
        );
        assert_eq!(
            publication_sql("p", &t, false, true),
            "CREATE PUBLICATION \"p\" FOR TABLE \"public\".\"outbox\" \
             WITH (publish = 'insert', publish_via_partition_root = true)"
        );
        assert_eq!(
            publication_sql("p", &t, true, true),
            "ALTER PUBLICATION \"p\" ADD TABLE \"public\".\"outbox\";\n\
             ALTER PUBLICATION \"p\" SET (publish_via_partition_root = true)"
        );
    }

    #[test]
    fn major_version_of_server_reports() {
        assert_eq!(major_version(Some("13.23")), Some(13));
        assert_eq!(
            major_version(Some("17.10 (Debian 17.10-1.pgdg120+1)")),
            Some(17)
        );
        assert_eq!(major_version(Some("18beta1")), Some(18));
        assert_eq!(major_version(Some("")), None);
        assert_eq!(major_version(Some("devel")), None);
        assert_eq!(major_version(None), None);
    }
}
