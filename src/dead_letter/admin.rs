//! `outbox-relay dlq list | redrive | drop`.
//!
//! A redrive puts events back into the outbox as new rows, in order: the
//! aggregate's open dead letters (oldest first), then its rows still unsent
//! (which, being later, must follow them). Original rows are deleted in the
//! same transaction, so ids stay unique and nothing is published twice by
//! design; the relay publishes the new rows like any others.

use crate::outbox::inspect::TableInfo;
use crate::outbox::{ResolvedColumns, SENT_AT_COLUMN, SEQ_COLUMN, TableName, quote_ident};
use crate::source::rows::{read_row, select_list};
use chrono::{DateTime, Utc};
use serde::Serialize;
use tokio_postgres::Client;

/// A dead letter as `dlq list` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct Entry {
    pub dead_letter_id: i64,
    pub id: String,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub event_type: Option<String>,
    pub reason: String,
    pub attempts: i32,
    pub first_failed_at: DateTime<Utc>,
    pub last_failed_at: DateTime<Utc>,
    pub dead_lettered_at: DateTime<Utc>,
    pub resolution: Option<String>,
    pub resolved_at: Option<DateTime<Utc>>,
}

/// Which dead letters a command acts on.
#[derive(Debug, Clone)]
pub enum Target {
    /// One event id.
    Id(String),
    /// Every open dead letter of an aggregate.
    Aggregate(String),
    All,
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    #[error("{0}")]
    Db(#[from] tokio_postgres::Error),
    #[error("{0}")]
    Refused(String),
}

pub async fn list(
    client: &Client,
    table: &TableName,
    aggregate: Option<&str>,
    include_resolved: bool,
    limit: i64,
) -> Result<Vec<Entry>, AdminError> {
    let rows = client
        .query(
            &format!(
                "SELECT dead_letter_id, id, aggregate_type, aggregate_id, event_type, reason, attempts,
                        first_failed_at, last_failed_at, dead_lettered_at, resolution, resolved_at
                 FROM {} WHERE ($1::text IS NULL OR aggregate_id = $1) AND ($2 OR resolution IS NULL)
                 ORDER BY dead_letter_id LIMIT $3",
                table.quoted()
            ),
            &[&aggregate, &include_resolved, &limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| Entry {
            dead_letter_id: r.get(0),
            id: r.get(1),
            aggregate_type: r.get(2),
            aggregate_id: r.get(3),
            event_type: r.get(4),
            reason: r.get(5),
            attempts: r.get(6),
            first_failed_at: r.get(7),
            last_failed_at: r.get(8),
            dead_lettered_at: r.get(9),
            resolution: r.get(10),
            resolved_at: r.get(11),
        })
        .collect())
}

/// Takes the per-aggregate locks (sorted, so two commands cannot deadlock)
/// of every aggregate the target names, before reading its dead letters: a
/// follower the relay is writing meanwhile is then either seen or told the
/// aggregate is resolved.
async fn lock_aggregates(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
) -> Result<std::collections::HashSet<String>, AdminError> {
    let aggregates: Vec<String> = match target {
        Target::Aggregate(a) => vec![a.clone()],
        Target::Id(id) => tx
            .query(
                &format!(
                    "SELECT DISTINCT aggregate_id FROM {} WHERE id = $1 AND resolution IS NULL",
                    table.quoted()
                ),
                &[id],
            )
            .await?
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect(),
        Target::All => tx
            .query(
                &format!(
                    "SELECT DISTINCT aggregate_id FROM {} WHERE resolution IS NULL",
                    table.quoted()
                ),
                &[],
            )
            .await?
            .iter()
            .filter_map(|r| r.get::<_, Option<String>>(0))
            .collect(),
    };
    let mut aggregates = aggregates;
    aggregates.sort();
    for a in &aggregates {
        tx.execute(
            super::AGGREGATE_LOCK_SQL,
            &[&super::aggregate_lock_key(table, a)],
        )
        .await?;
    }
    Ok(aggregates.into_iter().collect())
}

/// The targeted dead letters of the aggregates locked by [`lock_aggregates`]:
/// an aggregate whose first letter arrived after the locks were taken is left
/// for the next command.
async fn targeted_locked(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
) -> Result<Vec<(i64, String, Option<String>, Option<i64>)>, AdminError> {
    let locked = lock_aggregates(tx, table, target).await?;
    let mut letters = targeted(tx, table, target).await?;
    letters.retain(|l| l.2.as_ref().is_none_or(|a| locked.contains(a)));
    Ok(letters)
}

/// The open dead letters a target names, oldest first: `(dead_letter_id, id, aggregate_id, outbox_seq)`.
async fn targeted(
    tx: &tokio_postgres::Transaction<'_>,
    table: &TableName,
    target: &Target,
) -> Result<Vec<(i64, String, Option<String>, Option<i64>)>, AdminError> {
    let (id, aggregate, all) = match target {
        Target::Id(i) => (Some(i.as_str()), None, false),
        Target::Aggregate(a) => (None, Some(a.as_str()), false),
        Target::All => (None, None, true),
    };
    let rows = tx
        .query(
            &format!(
                "SELECT dead_letter_id, id, aggregate_id, outbox_seq FROM {} WHERE resolution IS NULL
                   AND ($3 OR id = $1 OR aggregate_id = $2)
                 ORDER BY dead_letter_id FOR UPDATE",
                table.quoted()
            ),
            &[&id, &aggregate, &all],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect())
}

/// Marks the targeted dead letters as dropped; returns how many.
pub async fn drop(
    client: &mut Client,
    table: &TableName,
    target: &Target,
) -> Result<usize, AdminError> {
    let tx = client.transaction().await?;
    let letters = targeted_locked(&tx, table, target).await?;
    let ids: Vec<i64> = letters.iter().map(|l| l.0).collect();
    tx.execute(
        &format!(
            "UPDATE {} SET resolution = 'dropped', resolved_at = now() WHERE dead_letter_id = ANY($1)",
            table.quoted()
        ),
        &[&ids],
    )
    .await?;
    tx.commit().await?;
    Ok(ids.len())
}

/// The outbox the events go back into.
pub struct Outbox<'a> {
    pub table: &'a TableName,
    pub columns: &'a ResolvedColumns,
    pub info: &'a TableInfo,
    /// With `none`, unsent rows cannot be told from published ones, so no
    /// waiting row goes back with the dead letters (there are none to wait:
    /// with `mark = "none"` only `follow` applies).
    pub mark: crate::config::MarkMode,
}

/// Re-publishes the targeted dead letters (see the module docs); returns how
/// many dead letters and how many held rows went back.
pub async fn redrive(
    client: &mut Client,
    dead_letters: &TableName,
    outbox: &Outbox<'_>,
    target: &Target,
) -> Result<(usize, usize), AdminError> {
    let tx = client.transaction().await?;
    let letters = targeted_locked(&tx, dead_letters, target).await?;
    if let Target::Id(id) = target {
        let Some(first) = letters.first() else {
            return Err(AdminError::Refused(format!(
                "no open dead letter with id {id:?}"
            )));
        };
        // Redriving a later event alone would publish it before earlier ones.
        let earlier: i64 = tx
            .query_one(
                &format!(
                    "SELECT count(*) FROM {} WHERE resolution IS NULL AND aggregate_id = $1 AND dead_letter_id < $2",
                    dead_letters.quoted()
                ),
                &[&first.2, &first.0],
            )
            .await?
            .get(0);
        if earlier > 0 {
            return Err(AdminError::Refused(format!(
                "{id} has {earlier} earlier open dead letter(s) of its aggregate; redrive the aggregate (--aggregate) or those first"
            )));
        }
    }
    let mut aggregates: Vec<Option<String>> = Vec::new();
    for l in &letters {
        if !aggregates.contains(&l.2) {
            aggregates.push(l.2.clone());
        }
    }
    let t = outbox.table.quoted();
    let insert = insert_sql(outbox);
    let mut held_total = 0;
    for aggregate in &aggregates {
        let mine: Vec<i64> = letters
            .iter()
            .filter(|l| &l.2 == aggregate)
            .map(|l| l.0)
            .collect();
        // The aggregate's rows still unsent come after its dead letters.
        let held = if outbox.mark == crate::config::MarkMode::None {
            Vec::new()
        } else {
            tx.query(
                &format!(
                    "SELECT {} FROM {t} WHERE {SENT_AT_COLUMN} IS NULL AND {}::text = $1 ORDER BY {SEQ_COLUMN} FOR UPDATE",
                    select_list(outbox.columns),
                    quote_ident(&outbox.columns.aggregate_id)
                ),
                &[aggregate],
            )
            .await?
        };
        let held: Vec<_> = held.iter().filter_map(|r| read_row(r, 0)).collect();
        let originals: Vec<i64> = letters
            .iter()
            .filter(|l| &l.2 == aggregate)
            .filter_map(|l| l.3)
            .chain(held.iter().map(|(seq, _)| *seq))
            .collect();
        tx.execute(
            &format!("DELETE FROM {t} WHERE {SEQ_COLUMN} = ANY($1)"),
            &[&originals],
        )
        .await?;
        let stored = tx
            .query(
                &format!(
                    "SELECT id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at
                     FROM {} WHERE dead_letter_id = ANY($1) ORDER BY dead_letter_id",
                    dead_letters.quoted()
                ),
                &[&mine],
            )
            .await?;
        for r in &stored {
            let values: Vec<Option<String>> = (0..8).map(|i| r.get(i)).collect();
            insert_row(&tx, &insert, &values).await?;
        }
        for (_, raw) in &held {
            let values = vec![
                raw.id.clone(),
                raw.aggregate_type.clone(),
                raw.aggregate_id.clone(),
                raw.event_type.clone(),
                raw.event_version.clone(),
                raw.payload.clone(),
                raw.headers.clone(),
                raw.created_at.clone(),
            ];
            insert_row(&tx, &insert, &values).await?;
        }
        held_total += held.len();
    }
    let ids: Vec<i64> = letters.iter().map(|l| l.0).collect();
    tx.execute(
        &format!(
            "UPDATE {} SET resolution = 'redriven', resolved_at = now() WHERE dead_letter_id = ANY($1)",
            dead_letters.quoted()
        ),
        &[&ids],
    )
    .await?;
    tx.commit().await?;
    Ok((ids.len(), held_total))
}

/// `INSERT INTO outbox (<present contract columns>) VALUES (CAST($n AS <column type>), ...)`,
/// and which [`crate::outbox::RawRow`]-ordered values fill its parameters.
fn insert_sql(outbox: &Outbox<'_>) -> (String, Vec<usize>) {
    let mut names = Vec::new();
    let mut values = Vec::new();
    let mut present = Vec::new();
    for (i, column) in outbox.columns.in_row_order().iter().enumerate() {
        if let Some(c) = column {
            let ty = outbox
                .info
                .column(c)
                .map(|c| c.type_name.clone())
                .unwrap_or_else(|| "text".into());
            present.push(i);
            names.push(quote_ident(c));
            values.push(format!("CAST(${}::text AS {ty})", present.len()));
        }
    }
    let sql = format!(
        "INSERT INTO {} ({}) VALUES ({})",
        outbox.table.quoted(),
        names.join(", "),
        values.join(", ")
    );
    (sql, present)
}

async fn insert_row(
    tx: &tokio_postgres::Transaction<'_>,
    (sql, present): &(String, Vec<usize>),
    values: &[Option<String>],
) -> Result<(), AdminError> {
    let params: Vec<&(dyn tokio_postgres::types::ToSql + Sync)> = present
        .iter()
        .map(|&i| &values[i] as &(dyn tokio_postgres::types::ToSql + Sync))
        .collect();
    tx.execute(sql.as_str(), &params).await.map_err(|e| {
        AdminError::Refused(format!(
            "event {} cannot go back into the outbox: {}; fix the dead letter's values or drop it",
            values[0].as_deref().unwrap_or("?"),
            crate::db::error_text(&e)
        ))
    })?;
    Ok(())
}
