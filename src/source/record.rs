//! Recording progress in the outbox table, shared by both ackers: marking
//! confirmed rows, writing dead letters, all on the ownership connection (so
//! an instance that lost ownership records nothing).

use super::SourceError;
use crate::config::MarkMode;
use crate::db::DbError;
use crate::dead_letter::{DeadLetter, Recorder, Written};
use crate::outbox::{TableName, mark_sql};
use std::collections::HashSet;
use tokio_postgres::{Client, Statement};

pub struct RowRecorder {
    client: Client,
    mark: Option<Statement>,
    dead_letters: Option<Recorder>,
}

impl RowRecorder {
    /// `dead_letters`: the dead-letter table, when dead-lettering is on.
    pub async fn new(
        client: Client,
        table: &TableName,
        mark: MarkMode,
        dead_letters: Option<&TableName>,
    ) -> Result<Self, SourceError> {
        let mark = match mark_sql(table, mark) {
            Some(sql) => Some(
                client
                    .prepare(&sql)
                    .await
                    .map_err(|e| DbError::query("preparing the mark-sent statement", e))?,
            ),
            None => None,
        };
        let dead_letters = match dead_letters {
            Some(t) => Some(Recorder::new(&client, t, mark.is_some().then_some(table)).await.map_err(|e| {
                if e.code().is_some_and(|c| c.code() == "42P01") {
                    SourceError::Setup(format!(
                        "the dead-letter table {t} does not exist; run `outbox-relay migrate` (or set dead_letter.enabled = false)"
                    ))
                } else {
                    DbError::query("preparing the dead-letter statements", e).into()
                }
            })?),
            None => None,
        };
        Ok(RowRecorder {
            client,
            mark,
            dead_letters,
        })
    }

    /// Marks (or deletes) the rows; nothing when rows are left alone.
    pub async fn mark(&self, seqs: &[i64]) -> Result<(), SourceError> {
        if let Some(mark) = &self.mark
            && !seqs.is_empty()
        {
            self.client
                .execute(mark, &[&seqs])
                .await
                .map_err(|e| DbError::query("marking rows sent", e))?;
        }
        Ok(())
    }

    /// Writes dead letters and marks their rows in one transaction.
    pub async fn dead_letter<P>(
        &mut self,
        letters: &[DeadLetter<P>],
    ) -> Result<Written, SourceError> {
        let Some(recorder) = &self.dead_letters else {
            return Ok(Written::default());
        };
        recorder
            .write(&mut self.client, letters, self.mark.as_ref())
            .await
            .map_err(|e| DbError::query("writing dead letters", e).into())
    }

    /// Aggregates with open dead letters.
    pub async fn open_dead_letters(&self) -> Result<HashSet<String>, SourceError> {
        match &self.dead_letters {
            Some(r) => r
                .open_aggregates(&self.client)
                .await
                .map_err(|e| DbError::query("reading open dead letters", e).into()),
            None => Ok(HashSet::new()),
        }
    }

    pub async fn heartbeat(&self) -> Result<(), SourceError> {
        self.client
            .simple_query("SELECT 1")
            .await
            .map_err(|e| DbError::query("checking the ownership connection", e))?;
        Ok(())
    }
}
