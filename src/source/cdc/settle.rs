//! The start-up read's settled position: the WAL insert position before
//! which every committed transaction has ended, so that the slot can be
//! moved past the backlog instead of decoding it. A transaction that runs
//! on, anywhere on the server, keeps it from settling: the stream then
//! decodes the backlog's WAL before new events reach the broker (a wait,
//! never a loss), and the operator is told which transaction it was.

use super::server::{parse_lsn, parse_snapshot};
use super::snapshot::Snapshot;
use crate::db::DbError;
use crate::replication::Lsn;
use crate::source::SourceError;
use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;
use tokio_postgres::Client;

/// How long the start-up read waits for transactions running when it began
/// to end; and how often it looks.
const SETTLE_WAIT: Duration = Duration::from_secs(2);
const SETTLE_POLL: Duration = Duration::from_millis(10);

async fn current_snapshot(client: &Client) -> Result<Snapshot, SourceError> {
    let text: String = client
        .query_one("SELECT pg_current_snapshot()::text", &[])
        .await
        .map_err(|e| DbError::query("reading the current snapshot", e))?
        .get(0);
    parse_snapshot(&text)
}

/// The transaction the last warning named, per pipeline, in this process: a
/// pipeline that starts run after run while one transaction holds on (with
/// the broker down, say) names it once, not at every run.
static LAST_NAMED: Mutex<BTreeMap<String, String>> = Mutex::new(BTreeMap::new());

/// Whether the transaction `key` was not the one last named for
/// `pipeline` (and is now).
fn first_naming(pipeline: &str, key: &str) -> bool {
    let mut last = LAST_NAMED.lock().unwrap_or_else(|e| e.into_inner());
    if last.get(pipeline).is_some_and(|k| k == key) {
        return false;
    }
    last.insert(pipeline.to_owned(), key.to_owned());
    true
}

/// The WAL insert position before which every committed transaction has
/// ended (left the process array), so that a snapshot taken next sees them
/// all; `None` when one ran on for longer than [`SETTLE_WAIT`]. The first
/// time in a run that happens (`told` false), a warning names the oldest
/// transaction still running, unless an earlier run of `pipeline` named it
/// already.
pub(super) async fn settled_position(
    client: &Client,
    pipeline: &str,
    told: &mut bool,
) -> Result<Option<Lsn>, SourceError> {
    let text: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .map_err(|e| DbError::query("reading the WAL insert position", e))?
        .get(0);
    let position = parse_lsn(&text)?;
    // A transaction whose commit record lies before the position had its
    // id by then, so its id is below one assigned now. A snapshot's xip
    // does not list every running transaction (none from its xmax on,
    // and xmax is the latest *completed* id + 1: a commit waiting for its
    // WAL flush is past it), so the wait is for a snapshot whose oldest
    // running id is past this one.
    let assigned: String = client
        .query_one("SELECT pg_current_xact_id()::text", &[])
        .await
        .map_err(|e| DbError::query("reading a transaction id", e))?
        .get(0);
    let assigned: u64 = assigned
        .parse()
        .map_err(|e| SourceError::Stream(format!("unreadable transaction id {assigned:?}: {e}")))?;
    let deadline = tokio::time::Instant::now() + SETTLE_WAIT;
    loop {
        let now = current_snapshot(client).await?;
        if now.xmin > assigned {
            return Ok(Some(position));
        }
        if tokio::time::Instant::now() >= deadline {
            if std::mem::replace(told, true) {
                tracing::debug!(
                    "a transaction outlived the wait; the stream skips what the start-up read covered"
                );
            } else {
                let holder = match oldest_transaction(client).await {
                    Some((what, key)) if !first_naming(pipeline, &key) => {
                        tracing::debug!(
                            transaction = %what,
                            "the transaction named before still keeps the start-up read from moving the slot"
                        );
                        return Ok(None);
                    }
                    Some((what, _)) => what,
                    None => "none any more, or the question failed".into(),
                };
                tracing::warn!(
                    transaction = %holder,
                    "a transaction running for more than {}s kept the start-up read from moving the slot past the WAL it covers: \
                     the stream decodes that WAL (the backlog, if any) before newer events reach the broker (nothing is lost); \
                     end long transactions on this server, or expect that wait after each restart while one runs",
                    SETTLE_WAIT.as_secs()
                );
            }
            return Ok(None);
        }
        tokio::time::sleep(SETTLE_POLL).await;
    }
}

/// The oldest transaction holding an id on the server, other than this
/// session's own: a session, or a prepared transaction, described, and a
/// key that tells it from others. `None` when there is none (it ended
/// meanwhile), or the question failed (it only serves a warning).
async fn oldest_transaction(client: &Client) -> Option<(String, String)> {
    let sql = "SELECT what, key FROM (
                   SELECT format('pid %s (database %s, user %s, application %L, %s)',
                                 pid, datname, usename, application_name,
                                 COALESCE(state || ', started '
                                          || round(extract(epoch FROM now() - xact_start)) || ' s ago',
                                          'state and age hidden from this role: grant it pg_read_all_stats')) AS what,
                          format('%s:%s', pid, backend_xid) AS key,
                          age(backend_xid) AS age
                   FROM pg_stat_activity
                   WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
                   UNION ALL
                   SELECT format('prepared transaction %L (database %s, prepared %s s ago)',
                                 gid, database, round(extract(epoch FROM now() - prepared))),
                          format('prepared:%s:%s', gid, transaction),
                          age(transaction)
                   FROM pg_prepared_xacts
               ) t ORDER BY age DESC LIMIT 1";
    match client.query_opt(sql, &[]).await {
        Ok(row) => row.map(|r| (r.get(0), r.get(1))),
        Err(e) => {
            tracing::debug!(error = %crate::db::error_text(&e), "could not look up the oldest transaction");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::first_naming;

    #[test]
    fn a_transaction_is_named_again_only_after_another_was() {
        assert!(first_naming("a", "1"));
        assert!(!first_naming("a", "1"), "the same one, run after run");
        assert!(first_naming("b", "1"), "another pipeline names it too");
        assert!(first_naming("a", "2"));
        assert!(first_naming("a", "1"), "named again after another");
        assert!(!first_naming("b", "1"), "each pipeline remembers its own");
    }
}
