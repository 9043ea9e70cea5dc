//! The triggers `migrate` installs on the outbox table.

use super::{MigrateError, MigrateOptions, Step};
use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, TableName, XID_COLUMN};
use crate::outbox::{OWN_XID_TRIGGER, OWN_XID_UPDATE_TRIGGER, WRITE_ONCE_TRIGGER};
use crate::sql::{quote_ident, quote_literal};
use tokio_postgres::Client;

const NOTIFY_TRIGGER: &str = "outbox_relay_notify";

/// The NOTIFY trigger, when it is missing or names another channel.
pub(super) async fn notify(
    client: &Client,
    opts: &MigrateOptions,
    channel: &str,
) -> Result<Vec<Step>, MigrateError> {
    let schema = quote_ident(&opts.table.schema);
    let function = format!("{schema}.{}", quote_ident(NOTIFY_TRIGGER));
    // The trigger passes its channel as an argument, so one function serves every table.
    let current: Option<Vec<u8>> = client
        .query_opt(
            "SELECT t.tgargs FROM pg_trigger t
             WHERE t.tgrelid = to_regclass($1) AND t.tgname = $2 AND NOT t.tgisinternal",
            &[&opts.table.quoted(), &NOTIFY_TRIGGER],
        )
        .await?
        .map(|r| r.get(0));
    let wanted = format!("{channel}\0");
    if current.as_deref() == Some(wanted.as_bytes()) {
        return Ok(Vec::new());
    }
    Ok(vec![
        Step::new(
            format!("create function {}.{}", opts.table.schema, NOTIFY_TRIGGER),
            format!(
                "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $fn$
BEGIN
    PERFORM pg_notify(TG_ARGV[0], '');
    RETURN NULL;
END
$fn$"
            ),
        ),
        Step::new(
            format!(
                "create trigger {} on {} (NOTIFY {channel} once per INSERT statement)",
                NOTIFY_TRIGGER, opts.table
            ),
            // Not CREATE OR REPLACE TRIGGER, which needs PostgreSQL 14: the
            // drop and the create run in migrate's one transaction, so no
            // insert commits in between without the trigger.
            format!(
                "DROP TRIGGER IF EXISTS {trigger} ON {table};
CREATE TRIGGER {trigger} AFTER INSERT ON {table} FOR EACH STATEMENT EXECUTE FUNCTION {function}({channel})",
                trigger = quote_ident(NOTIFY_TRIGGER),
                table = opts.table.quoted(),
                channel = quote_literal(channel)
            ),
        ),
    ])
}

/// Drops the NOTIFY trigger when wake-ups are off (`source.polling.notify =
/// false`, or CDC): it would still make every inserting transaction hold a
/// lock for the whole database until its commit is on disk, so concurrent
/// commits could not share a WAL flush. Its function goes too, unless a
/// trigger of another table still uses it.
pub(super) async fn drop_notify(
    client: &Client,
    table: &TableName,
) -> Result<Option<Step>, MigrateError> {
    let installed = client
        .query_one(
            "SELECT count(*) FROM pg_trigger t
             WHERE t.tgrelid = to_regclass($1) AND t.tgname = $2 AND NOT t.tgisinternal",
            &[&table.quoted(), &NOTIFY_TRIGGER],
        )
        .await?
        .get::<_, i64>(0)
        > 0;
    if !installed {
        return Ok(None);
    }
    let function = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(NOTIFY_TRIGGER)
    );
    Ok(Some(Step::new(
        format!(
            "drop trigger {NOTIFY_TRIGGER} on {table} (wake-ups are off; its NOTIFY serialises the commits of inserting transactions)"
        ),
        format!(
            "DROP TRIGGER IF EXISTS {trigger} ON {quoted};
DO $do$
BEGIN
    IF to_regprocedure({function_literal}) IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM pg_trigger WHERE tgfoid = to_regprocedure({function_literal})) THEN
        DROP FUNCTION {function}();
    END IF;
END
$do$",
            trigger = quote_ident(NOTIFY_TRIGGER),
            quoted = table.quoted(),
            function_literal = quote_literal(&format!("{function}()")),
        ),
    )))
}

/// Outbox rows are write-once while unsent. The relay publishes a row as it
/// was inserted when it streams the WAL (CDC), and as it stands when it
/// reads the table (polling, CDC start-up reads): an update of an unsent
/// row's event columns would be published in one form or the other
/// depending on restarts. The trigger refuses such updates with the fix.
/// It names the event columns as arguments, not in its definition, so it
/// does not stand in the way of altering or dropping them; the relay's own
/// marking (setting `relay_sent_at`) does not run it, and a sent row may be
/// changed freely. With `relay.mark = "ranges"` `relay_sent_at` stays NULL,
/// so before it refuses, the body asks the outbox's own predicate
/// (`<outbox>_relay_sent`, of the partitioned table when the row is in a
/// partition), if it has one. The function is shared by the outboxes of a
/// schema, so it names none of them.
pub(super) async fn write_once(
    client: &Client,
    table: &TableName,
    columns: &[String],
) -> Result<Option<Step>, MigrateError> {
    let function = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(WRITE_ONCE_TRIGGER)
    );
    // Installed already, for the same columns, with this body: nothing to do.
    let current: Option<(Vec<u8>, String)> = client
        .query_opt(
            "SELECT t.tgargs, p.prosrc FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE t.tgrelid = to_regclass($1) AND t.tgname = $2 AND NOT t.tgisinternal",
            &[&table.quoted(), &WRITE_ONCE_TRIGGER],
        )
        .await?
        .map(|r| (r.get(0), r.get(1)));
    let wanted: String = columns.iter().map(|c| format!("{c}\0")).collect();
    let body = write_once_body();
    if let Some((args, installed)) = &current
        && args == wanted.as_bytes()
        && installed.trim() == body.trim()
    {
        return Ok(None);
    }
    let arguments: Vec<String> = columns.iter().map(|c| quote_literal(c)).collect();
    Ok(Some(Step::new(
        format!(
            "create trigger {WRITE_ONCE_TRIGGER} on {table} (refuses updates of unsent events)"
        ),
        format!(
            "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $fn${body}$fn$;
DROP TRIGGER IF EXISTS {trigger} ON {quoted};
CREATE TRIGGER {trigger} BEFORE UPDATE ON {quoted} FOR EACH ROW
    WHEN (OLD.{sent} IS NULL AND NEW.{sent} IS NULL)
    EXECUTE FUNCTION {function}({arguments})",
            trigger = quote_ident(WRITE_ONCE_TRIGGER),
            quoted = table.quoted(),
            sent = SENT_AT_COLUMN,
            arguments = arguments.join(", "),
        ),
    )))
}

/// The body of the write-once function (see [`write_once`]), between its
/// `$fn$` quotes; `migrations/0003_outbox_write_once.sql` has the same.
fn write_once_body() -> String {
    let hint = quote_literal(
        "insert a new event instead; outbox-relay publishes a row as inserted when it streams \
         the WAL and as it stands when it reads the table, so an updated event would reach \
         consumers in one form or the other",
    );
    format!(
        "
DECLARE
    old_row jsonb := to_jsonb(OLD);
    new_row jsonb := to_jsonb(NEW);
    outbox_schema text;
    outbox_name text;
    predicate regproc;
    sent boolean;
    i int;
BEGIN
    FOR i IN 0 .. TG_NARGS - 1 LOOP
        IF old_row -> TG_ARGV[i] IS DISTINCT FROM new_row -> TG_ARGV[i] THEN
            SELECT n.nspname, c.relname INTO outbox_schema, outbox_name
            FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
            WHERE c.oid = COALESCE(pg_partition_root(TG_RELID), TG_RELID);
            -- relay.mark = \"ranges\": relay_sent_at stays NULL; the outbox's predicate knows.
            predicate := to_regproc(format('%I.%I', outbox_schema, right(outbox_name || '_relay_sent', 63)));
            IF predicate IS NOT NULL THEN
                EXECUTE format('SELECT %s($1, $2, $3)', predicate) INTO sent
                    USING OLD.{SEQ_COLUMN}, OLD.{XID_COLUMN}, OLD.{SENT_AT_COLUMN};
                IF sent THEN
                    RETURN NEW;
                END IF;
            END IF;
            RAISE EXCEPTION USING ERRCODE = 'check_violation',
                MESSAGE = format('outbox rows are write-once until sent: this UPDATE changes an unsent event of %I.%I', outbox_schema, outbox_name),
                HINT = {hint};
        END IF;
    END LOOP;
    RETURN NEW;
END
"
    )
}

/// The session setting that lets rows keep the `relay_xid` they carry
/// (moving rows between partitions, a data-only restore): `on`.
pub const KEEP_XID_SETTING: &str = "outbox_relay.keep_xid";

/// `relay_xid` is the inserting transaction's id, from its default: the
/// readers tell by it which transactions they have read, and with
/// `relay.mark = "ranges"` a row naming an older, committed transaction
/// counts as sent. An INSERT that gives it a value of its own (an `INSERT
/// ... SELECT *` from a copy of the outbox) would lose that event silently,
/// or hold it back until a restart; these triggers refuse it, and any
/// UPDATE that changes the column, instead. Their conditions run without
/// calling the function, so an INSERT that leaves the column to its default
/// pays one comparison. A row inserted with `relay_sent_at` set is sent
/// whatever its `relay_xid`, so it passes. A row moved to another partition
/// is inserted there with the `relay_xid` it had: the session that moves
/// rows sets [`KEEP_XID_SETTING`]. Rows a logical replication subscription
/// applies pass too: its workers run no ordinary trigger.
pub(super) async fn own_xid(
    client: &Client,
    table: &TableName,
) -> Result<Option<Step>, MigrateError> {
    let function = format!(
        "{}.{}",
        quote_ident(&table.schema),
        quote_ident(OWN_XID_TRIGGER)
    );
    let body = own_xid_body();
    // Both, enabled, calling this body (which names their conditions).
    let installed: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_trigger t JOIN pg_proc p ON p.oid = t.tgfoid
             WHERE t.tgrelid = to_regclass($1) AND t.tgname IN ($2, $3) AND NOT t.tgisinternal
               AND t.tgenabled <> 'D' AND btrim(p.prosrc) = btrim($4)",
            &[
                &table.quoted(),
                &OWN_XID_TRIGGER,
                &OWN_XID_UPDATE_TRIGGER,
                &body,
            ],
        )
        .await?
        .get(0);
    if installed == 2 {
        return Ok(None);
    }
    Ok(Some(Step::new(
        format!(
            "create triggers {OWN_XID_TRIGGER} and {OWN_XID_UPDATE_TRIGGER} on {table} \
             (refuse a {XID_COLUMN} other than the inserting transaction's)"
        ),
        format!(
            "CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $fn${body}$fn$;
DROP TRIGGER IF EXISTS {insert} ON {quoted};
CREATE TRIGGER {insert} BEFORE INSERT ON {quoted} FOR EACH ROW
    WHEN (NEW.{SENT_AT_COLUMN} IS NULL AND NEW.{XID_COLUMN} IS DISTINCT FROM pg_current_xact_id())
    EXECUTE FUNCTION {function}();
DROP TRIGGER IF EXISTS {update} ON {quoted};
CREATE TRIGGER {update} BEFORE UPDATE OF {XID_COLUMN} ON {quoted} FOR EACH ROW
    WHEN (NEW.{XID_COLUMN} IS DISTINCT FROM OLD.{XID_COLUMN})
    EXECUTE FUNCTION {function}()",
            insert = quote_ident(OWN_XID_TRIGGER),
            update = quote_ident(OWN_XID_UPDATE_TRIGGER),
            quoted = table.quoted(),
        ),
    )))
}

/// The body of the `relay_xid` function (see [`own_xid`]), between its
/// `$fn$` quotes; `migrations/0012_outbox_relay_own_xid.sql` has the same.
/// It names the triggers' conditions, so that a change of them changes it
/// and `migrate` installs them again.
fn own_xid_body() -> String {
    let hint = quote_literal(&format!(
        "leave relay_seq, relay_xid and relay_sent_at to their defaults (an INSERT ... SELECT * \
         copies them): outbox-relay tells by relay_xid which transaction wrote a row, and a row \
         naming an earlier transaction can count as sent and never be published; to move rows \
         to another partition, or to restore them, with the relay_xid they have, \
         SET {KEEP_XID_SETTING} = on in that session first"
    ));
    format!(
        "
-- Called by {OWN_XID_TRIGGER} (BEFORE INSERT, WHEN NEW.{SENT_AT_COLUMN} IS NULL AND
-- NEW.{XID_COLUMN} IS DISTINCT FROM pg_current_xact_id()) and {OWN_XID_UPDATE_TRIGGER}
-- (BEFORE UPDATE OF {XID_COLUMN}, WHEN NEW.{XID_COLUMN} IS DISTINCT FROM OLD.{XID_COLUMN}).
DECLARE
    outbox regclass := COALESCE(pg_partition_root(TG_RELID), TG_RELID::regclass);
BEGIN
    IF current_setting('{KEEP_XID_SETTING}', true) = 'on' THEN
        RETURN NEW;
    END IF;
    IF TG_OP = 'INSERT' THEN
        RAISE EXCEPTION USING ERRCODE = 'generated_always',
            MESSAGE = format('%s.{XID_COLUMN} is set by its default to the inserting transaction''s id: this INSERT gives it %s, in transaction %s', outbox, NEW.{XID_COLUMN}, pg_current_xact_id()),
            HINT = {hint};
    END IF;
    RAISE EXCEPTION USING ERRCODE = 'generated_always',
        MESSAGE = format('%s.{XID_COLUMN} is the inserting transaction''s id: this UPDATE changes it from %s to %s', outbox, OLD.{XID_COLUMN}, NEW.{XID_COLUMN}),
        HINT = {hint};
END
"
    )
}
