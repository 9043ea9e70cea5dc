//! The names of the relay's own objects beside an outbox, all derived from
//! the outbox table's name, and the outboxes that would share them.
//!
//! PostgreSQL keeps 63 bytes of a name: a table beside the outbox
//! ([`TableName::sibling`]) keeps the end of `<outbox><suffix>`, an index or
//! function ([`TableName::derived`]) the start of `<prefix>_<outbox>`. Two
//! outboxes of one schema whose long names differ only in the part cut away
//! would therefore share objects: the progress tables of ranges (each relay
//! would count the other's recorded ranges as its own, and skip events), the
//! owners table (hand-overs would wait on, or pass, the other's claims), the
//! emitting function (one outbox's events written with the other's prefix),
//! an index (built for one table only). [`shared_problem`] finds such an
//! outbox, and `migrate` and the relay refuse to go on beside it.
//! [`slot_problem`] finds another outbox whose relay uses this one's slot
//! by default, which `migrate` refuses.

use crate::config::{SENT_AT_COLUMN, SEQ_COLUMN, TableName, default_replication_name};
use crate::outbox::WRITE_ONCE_TRIGGER;
use crate::outbox::progress::Ranges;
use tokio_postgres::GenericClient;

/// PostgreSQL's longest name, in bytes; a longer one is cut to it.
const NAME_BYTES: usize = 63;

/// The partial index of unsent rows in `relay_seq` order.
pub fn unsent_index(table: &TableName) -> String {
    table.derived("outbox_relay_unsent")
}

/// The unique index on `relay_seq`.
pub fn seq_index(table: &TableName) -> String {
    table.derived("outbox_relay_seq")
}

/// The partial index on `relay_sent_at` of sent rows, which retention reads
/// through (`migrate` creates it).
pub fn sent_index(table: &TableName) -> String {
    table.derived("outbox_relay_sent")
}

/// The function applications call to write an event as a logical message
/// (`source.cdc.messages`): `outbox_relay_emit_<table>`, in its schema.
pub fn emit_function(table: &TableName) -> String {
    table.derived("outbox_relay_emit")
}

/// The relay-owned table of ownership claims next to the outbox.
pub fn owners_table(outbox: &TableName) -> TableName {
    outbox.sibling("_relay_owners")
}

/// Every object the relay may create in the outbox's schema, by name, with
/// what it is. Tables, indexes and functions are compared alike: a name
/// shared across kinds is as confusing to an operator.
pub fn objects(table: &TableName) -> Vec<(String, &'static str)> {
    let ranges = Ranges::new(table);
    vec![
        (owners_table(table).name, "owners table"),
        (ranges.progress.name, "progress table"),
        (ranges.frontier.name, "frontier table"),
        (ranges.held.name, "held table"),
        (ranges.sent_function.name, "sent function"),
        (ranges.xid_index, "index on relay_xid"),
        (unsent_index(table), "index of unsent rows"),
        (seq_index(table), "unique index on relay_seq"),
        (sent_index(table), "index of sent rows"),
        (emit_function(table), "emitting function"),
        (
            crate::config::DeadLetterConfig::default()
                .table_name(table)
                .name,
            "dead-letter table (by default)",
        ),
    ]
}

/// The objects `a` and `b`, two outboxes of one schema, would share.
pub fn shared(a: &TableName, b: &TableName) -> Vec<(String, &'static str)> {
    if a.schema != b.schema || a.name == b.name {
        return Vec::new();
    }
    let theirs = objects(b);
    objects(a)
        .into_iter()
        .filter(|(name, _)| theirs.iter().any(|(n, _)| n == name))
        .collect()
}

/// Bytes of the outbox's name that its longest derived name keeps
/// (`outbox_relay_unsent_[<schema>_]<name>`).
fn kept_start(table: &TableName) -> usize {
    let schema = if table.schema == "public" {
        0
    } else {
        table.schema.len() + 1
    };
    NAME_BYTES.saturating_sub("outbox_relay_unsent_".len() + schema)
}

/// Whether a name of `table`'s objects comes near the limit: only then can
/// another outbox's names meet it. A name is cut a character at a time, so
/// a cut name may end up to 3 bytes short of the limit (a 4-byte
/// character removed), and meet a name of that length that was not cut.
fn at_limit(table: &TableName) -> bool {
    objects(table)
        .iter()
        .any(|(n, _)| n.len() + 3 >= NAME_BYTES)
}

/// Another outbox of `table`'s schema (a table `migrate` made an outbox:
/// with the relay's columns `relay_seq` and `relay_sent_at`, and its
/// write-once trigger or an index of the relay's by the name it gives that
/// table; not a partition, nor a copy made with `LIKE`) whose relay objects
/// would have the names of `table`'s: what to tell the operator, or `None`.
/// Asks the database only when one of `table`'s names is long enough.
pub async fn shared_problem(
    client: &impl GenericClient,
    table: &TableName,
) -> Result<Option<String>, tokio_postgres::Error> {
    if !at_limit(table) {
        return Ok(None);
    }
    let rows = client
        .query(
            "SELECT c.relname::text,
                    EXISTS (SELECT 1 FROM pg_trigger t WHERE t.tgrelid = c.oid AND t.tgname = $5),
                    ARRAY(SELECT ic.relname::text FROM pg_index i
                          JOIN pg_class ic ON ic.oid = i.indexrelid WHERE i.indrelid = c.oid)
             FROM pg_class c
             JOIN pg_namespace n ON n.oid = c.relnamespace
             WHERE n.nspname = $1 AND c.relname <> $2 AND c.relkind IN ('r', 'p')
               AND NOT c.relispartition
               AND (SELECT count(*) FROM pg_attribute a
                    WHERE a.attrelid = c.oid AND NOT a.attisdropped
                      AND a.attname IN ($3, $4)) = 2
             ORDER BY 1",
            &[
                &table.schema,
                &table.name,
                &SEQ_COLUMN,
                &SENT_AT_COLUMN,
                &WRITE_ONCE_TRIGGER,
            ],
        )
        .await?;
    let migrated = |name: &TableName, trigger: bool, indexes: &[String]| {
        let own = [unsent_index(name), seq_index(name)];
        trigger || indexes.iter().any(|i| own.contains(i))
    };
    for row in rows {
        let other = TableName::new(&table.schema, row.get::<_, &str>(0));
        if !migrated(&other, row.get(1), &row.get::<_, Vec<String>>(2)) {
            continue;
        }
        let both = shared(table, &other);
        if let Some((name, what)) = both.first() {
            let fix = match kept_start(table) {
                0 => format!(
                    "give the schema {} a shorter name: the relay's index names keep none \
                     of its tables' names after it",
                    table.schema
                ),
                start => format!(
                    "rename one of the two tables so that their names differ within about \
                     their first {start} and their last {end} bytes",
                    end = NAME_BYTES - "_relay_progress".len()
                ),
            };
            return Ok(Some(format!(
                "the outbox tables {table} and {other} would share the relay's {what} \
                 {schema}.{name} ({n} shared in all): PostgreSQL keeps {NAME_BYTES} bytes of a \
                 name, and the relay names its objects after the outbox's; {fix}",
                schema = table.schema,
                n = both.len(),
            )));
        }
    }
    Ok(None)
}

/// The slot `slot` is another outbox's by default: the relay names its
/// publication and slot `outbox_relay_[<schema>_]<table>` (lowercased,
/// other characters as `_`, so `shop.orders` and `public.shop_orders` both
/// get `outbox_relay_shop_orders`), and the publication of that name
/// publishes another table with that default name, whose relay therefore
/// streams from this slot too. Two relays on one slot each move it past the
/// other's events. (A publication shared by two relays with slots of their
/// own is harmless: each stream keeps its own table's rows.) What to tell
/// the operator, or `None`.
pub async fn slot_problem(
    client: &impl GenericClient,
    table: &TableName,
    slot: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = $1",
            &[&slot],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|row| TableName::new(row.get(0), row.get(1)))
        .find(|other| other != table && default_replication_name(other) == slot)
        .map(|other| {
            format!(
                "the replication slot {slot} is the one the relay of {other} uses by default \
                 (its publication of that name publishes it): a relay of {table} on it would \
                 move it past that relay's events. Give one of the two relays a slot and \
                 publication of its own (source.cdc.slot, source.cdc.publication), preferably \
                 the one set up second: a new slot starts from now, and its start-up read \
                 publishes what is unsent"
            )
        }))
}

/// The configured outbox's name problems, as `check` and the relay ask
/// them: [`shared_problem`], then, when the source may stream,
/// [`slot_problem`] for the slot it would stream from.
pub async fn problems(
    client: &impl GenericClient,
    config: &crate::config::Config,
) -> Vec<Result<Option<String>, tokio_postgres::Error>> {
    let table = &config.outbox.table;
    let mut problems = vec![shared_problem(client, table).await];
    if config.source.mode.may_use_cdc() {
        let slot = config.source.cdc.slot_name(table);
        problems.push(slot_problem(client, table, &slot).await);
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name of `len` bytes: `start`, then `x`s, then `end`.
    fn long(start: &str, end: &str, len: usize) -> TableName {
        let fill = "x".repeat(len - start.len() - end.len());
        TableName::new("public", &format!("{start}{fill}{end}"))
    }

    #[test]
    fn short_names_share_nothing_and_never_ask() {
        let (a, b) = (
            TableName::new("public", "outbox"),
            TableName::new("public", "orders_outbox"),
        );
        assert!(shared(&a, &b).is_empty());
        assert!(!at_limit(&a));
        assert!(!at_limit(&long("a", "z", 36)));
    }

    #[test]
    fn long_names_with_one_end_share_the_tables_or_the_indexes() {
        // Same last 48 bytes: the tables beside them are one.
        let (a, b) = (long("a_", "_outbox", 60), long("b_", "_outbox", 60));
        let tables: Vec<&str> = shared(&a, &b).iter().map(|(_, w)| *w).collect();
        assert!(tables.contains(&"progress table"), "{tables:?}");
        assert!(tables.contains(&"owners table"), "{tables:?}");
        assert!(
            tables.contains(&"dead-letter table (by default)"),
            "{tables:?}"
        );
        assert!(at_limit(&a));
        // Same first 43 bytes: the indexes and the function are one.
        let (c, d) = (long("outbox_", "_c", 60), long("outbox_", "_d", 60));
        let indexes: Vec<&str> = shared(&c, &d).iter().map(|(_, w)| *w).collect();
        assert!(indexes.contains(&"index of unsent rows"), "{indexes:?}");
        assert!(indexes.contains(&"emitting function"), "{indexes:?}");
        assert!(!indexes.contains(&"progress table"), "{indexes:?}");
    }

    #[test]
    fn names_cut_by_characters_are_asked_about() {
        // Cut a character at a time, `<name>_relay_owners` comes to 62
        // bytes, and the same name after another first character meets it.
        let rest = format!("{}{}{}", "é".repeat(5), "m".repeat(29), "中".repeat(6));
        let (a, b) = (
            TableName::new("public", &format!("é{rest}")),
            TableName::new("public", &format!("è{rest}")),
        );
        let shared: Vec<&str> = shared(&a, &b).iter().map(|(_, w)| *w).collect();
        assert!(shared.contains(&"owners table"), "{shared:?}");
        assert!(objects(&a).iter().all(|(n, _)| n.len() < NAME_BYTES));
        assert!(at_limit(&a));
    }

    #[test]
    fn other_schemas_and_the_table_itself_share_nothing() {
        let a = long("a_", "_outbox", 60);
        let mut b = long("b_", "_outbox", 60);
        b.schema = "shop".into();
        assert!(shared(&a, &b).is_empty());
        assert!(shared(&a, &a).is_empty());
    }

    #[test]
    fn names_that_differ_where_they_are_kept_share_nothing() {
        let (a, b) = (long("a_", "_outbox_a", 60), long("b_", "_outbox_b", 60));
        // Different ends and different starts.
        assert!(shared(&a, &b).is_empty());
    }
}
