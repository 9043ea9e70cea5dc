//! Reading outbox rows with SQL, shared by the polling reader and the CDC
//! start-up read: every contract column is selected as text (absent optional
//! ones as NULL), after `relay_seq`, in [`RawRow`] order.

use crate::outbox::{RawRow, ResolvedColumns, SEQ_COLUMN, quote_ident};
use tokio_postgres::Row;

/// `relay_seq, <id>::text, ..., <created_at>::text`.
pub fn select_list(columns: &ResolvedColumns) -> String {
    let mut list = vec![SEQ_COLUMN.to_owned()];
    for col in columns.in_row_order() {
        list.push(match col {
            Some(c) => format!("{}::text", quote_ident(c)),
            None => "NULL::text".to_owned(),
        });
    }
    list.join(", ")
}

/// Reads `relay_seq` and the row at `offset` (where the select list starts);
/// `None` when `relay_seq` is NULL (the empty side of an outer join).
pub fn read_row(row: &Row, offset: usize) -> Option<(i64, RawRow)> {
    let seq: Option<i64> = row.get(offset);
    let text = |i: usize| row.get::<_, Option<String>>(offset + 1 + i);
    seq.map(|seq| {
        (
            seq,
            RawRow {
                id: text(0),
                aggregate_type: text(1),
                aggregate_id: text(2),
                event_type: text(3),
                event_version: text(4),
                payload: text(5),
                headers: text(6),
                created_at: text(7),
            },
        )
    })
}
