//! `source.mode = "auto"`: read by CDC while the server allows it, poll the
//! table while it does not.
//!
//! Both readers start from the table's unsent rows (polling's first tick,
//! CDC's start-up read), and with `relay.mark` `update`, `delete` or
//! `ranges` the table (with, for ranges, its progress and frontier) is the
//! record of what is unsent. So the relay can stop one reader, let the
//! broker confirm and the acker mark what is in flight, and start the other:
//! nothing is skipped, and since each start reads every unsent row in
//! `relay_seq` order before anything newer, no event overtakes an earlier
//! one of its aggregate.
//!
//! This module decides which reader can run: [`probe`] asks the server
//! whether CDC is possible now, and names what blocks it otherwise, with the
//! fix. Only what the relay cannot change and polling can do without makes
//! it poll: `wal_level` not `logical`, no free replication slot, a role
//! without the REPLICATION attribute, a lost slot that
//! `source.cdc.on_lost_slot = "stop"` keeps, a missing slot the relay may
//! not create. A missing publication or a slot of the wrong kind is a
//! mistake in the setup, reported as in CDC mode.

use super::SourceError;
use super::cdc::setup;
use crate::config::Config;
use crate::db::DbError;
use tokio_postgres::Client;

/// What a source reads with now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reading {
    Cdc,
    /// Polling, and why CDC is not possible.
    Polling(Blocked),
}

impl Reading {
    pub fn name(&self) -> &'static str {
        match self {
            Reading::Cdc => "cdc",
            Reading::Polling(_) => "polling",
        }
    }
}

/// Why CDC cannot run now: a short reason for logs and `status --json`, and
/// the message that says what to fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocked {
    /// `wal_level`, `no_free_slot`, `replication_privilege`, `lost_slot`,
    /// `no_slot` (missing, and `create_slot` off) or `slot_creation` (the
    /// slot could not be created although it looked possible).
    pub reason: &'static str,
    pub message: String,
}

impl std::fmt::Display for Blocked {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// Whether CDC can run now. `Err` only when the server could not be asked.
pub async fn probe(client: &Client, config: &Config) -> Result<Reading, DbError> {
    let cdc = &config.source.cdc;
    let slot = cdc.slot_name(&config.outbox.table);
    let blocked = |reason, message: String| Ok(Reading::Polling(Blocked { reason, message }));
    if let Some(problem) = setup::wal_level_problem(&setup::wal_level(client).await?) {
        return blocked("wal_level", problem);
    }
    let info = setup::slot_info(client, &slot).await?;
    let lacking = setup::roles_without_replication(client).await?;
    if !lacking.is_empty() {
        let kept = if info.is_some() {
            format!(" (meanwhile slot {slot:?} keeps WAL from removal)")
        } else {
            String::new()
        };
        return blocked(
            "replication_privilege",
            format!(
                "the relay's role ({}) lacks the REPLICATION attribute CDC needs: run {} as a superuser{kept}",
                lacking.join(", "),
                setup::grant_replication(&lacking)
            ),
        );
    }
    match info {
        Some(info) if info.is_lost() && !cdc.recreates_lost_slot(config.relay.mark) => blocked(
            "lost_slot",
            setup::lost_slot_message(&slot, config.relay.mark != crate::config::MarkMode::None),
        ),
        Some(_) => Ok(Reading::Cdc),
        // migrate leaves the slot to run in auto mode: someone must create it.
        None if !cdc.create_slot => blocked(
            "no_slot",
            format!(
                "replication slot {slot:?} does not exist and source.cdc.create_slot = false: create it \
                 ({}) or set source.cdc.create_slot = true",
                setup::slot_sql(&slot, cdc.failover)
            ),
        ),
        None => {
            if setup::free_slots(client).await? <= 0 {
                return blocked(
                    "no_free_slot",
                    format!(
                        "replication slot {slot:?} does not exist and every replication slot is in use: \
                         raise max_replication_slots (restart needed) or drop an unused slot"
                    ),
                );
            }
            Ok(Reading::Cdc)
        }
    }
}

/// A failure to start CDC that the probe could not foresee (another session
/// took the last free slot in between): poll instead of failing.
pub fn blocked_by(e: &SourceError) -> Option<Blocked> {
    match e {
        SourceError::Setup(message)
            if message.ends_with(setup::NO_FREE_SLOT_HINT)
                || message.ends_with(setup::WAL_LEVEL_HINT) =>
        {
            Some(Blocked {
                reason: "slot_creation",
                message: message.clone(),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_slot_the_server_could_not_create_falls_back() {
        let full = SourceError::Setup(format!(
            "cannot create replication slot \"s\": all replication slots are in use{}",
            setup::NO_FREE_SLOT_HINT
        ));
        assert_eq!(blocked_by(&full).map(|b| b.reason), Some("slot_creation"));
        let missing = SourceError::Setup(
            "publication \"p\" does not exist; run `outbox-relay migrate`".into(),
        );
        assert_eq!(blocked_by(&missing), None);
        assert_eq!(
            blocked_by(&SourceError::Stream("ended".into())),
            None,
            "a stream failure is retried as in CDC mode"
        );
    }
}
