//! `source.mode = "auto"` in the relay: the probe that ends a polling run
//! once CDC is possible, and the one log line per switch. Why a switch loses
//! and reorders nothing: [`crate::source::auto`].
//!
//! A switch from polling to CDC ends the run the way a shutdown does (the
//! reader stops, what was read is sent, the broker confirms and the acker
//! marks it, at most `relay.shutdown_timeout`); the supervisor then starts a new run
//! at once, which reads by CDC. A switch from CDC to polling follows a
//! failure (the server restarted with another `wal_level`, the slot was
//! lost): the next run's probe finds CDC impossible and polls.

use crate::config::Config;
use crate::source::auto::{self, Reading};
use std::convert::Infallible;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;

/// What this pipeline reads with, kept across runs so that each switch is
/// logged once.
#[derive(Default)]
pub struct Modes {
    last: Mutex<Option<Reading>>,
}

impl Modes {
    fn last(&self) -> std::sync::MutexGuard<'_, Option<Reading>> {
        self.last.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A run starts reading with `now`: logs it when it differs from
    /// before (and says whether it did).
    pub fn starting(&self, now: &Reading, config: &Config) -> bool {
        let mut last = self.last();
        let changed = match (&*last, now) {
            (Some(Reading::Cdc), Reading::Cdc) => false,
            (Some(Reading::Polling(a)), Reading::Polling(b)) => a.reason != b.reason,
            _ => true,
        };
        if changed {
            announce(last.as_ref(), now, config.source.auto.probe_interval);
        }
        *last = Some(now.clone());
        changed
    }
}

fn announce(before: Option<&Reading>, now: &Reading, every: Duration) {
    let every = humantime::format_duration(every).to_string();
    match (before, now) {
        (Some(Reading::Polling(b)), Reading::Cdc) => tracing::info!(
            from = "polling",
            to = "cdc",
            was_blocked_by = b.reason,
            "source auto: switched from polling to CDC, since CDC is possible now"
        ),
        (_, Reading::Cdc) => {
            tracing::info!(
                mode = "cdc",
                "source auto: reading by CDC (logical replication)"
            )
        }
        (Some(Reading::Cdc), Reading::Polling(b)) => tracing::warn!(
            from = "cdc",
            to = "polling",
            reason = b.reason,
            probe_every = %every,
            problem = %b,
            "source auto: switched from CDC to polling, since CDC is not possible; back to CDC once it is"
        ),
        (_, Reading::Polling(b)) => tracing::warn!(
            mode = "polling",
            reason = b.reason,
            probe_every = %every,
            problem = %b,
            "source auto: CDC is not possible; polling until it is"
        ),
    }
}

/// Runs beside a polling run: every `source.auto.probe_interval` asks the
/// server whether CDC has become possible; when it has, sets `switch` and
/// cancels `pipeline`, which drains and ends the run. Never completes.
pub async fn watch(
    config: &Config,
    modes: &Modes,
    pipeline: &CancellationToken,
    switch: &AtomicBool,
) -> Infallible {
    let every = config.source.auto.probe_interval;
    let mut client: Option<Client> = None;
    loop {
        tokio::select! {
            biased;
            _ = pipeline.cancelled() => return std::future::pending().await,
            _ = tokio::time::sleep(every) => {}
        }
        if client.as_ref().is_none_or(Client::is_closed) {
            client = match crate::db::connect(&config.database, None).await {
                Ok(c) => Some(c),
                Err(e) => {
                    tracing::debug!(error = %e, "source auto: cannot connect to probe for CDC; polling on");
                    continue;
                }
            };
        }
        let Some(c) = &client else { continue };
        match auto::probe(c, config).await {
            Ok(Reading::Cdc) => {
                let was = match &*modes.last() {
                    Some(Reading::Polling(b)) => b.reason,
                    _ => "",
                };
                tracing::info!(
                    from = "polling",
                    to = "cdc",
                    was_blocked_by = was,
                    "source auto: CDC is possible now; switching from polling to CDC once what is in flight is confirmed and marked"
                );
                *modes.last() = Some(Reading::Cdc);
                switch.store(true, Ordering::SeqCst);
                pipeline.cancel();
                return std::future::pending().await;
            }
            Ok(Reading::Polling(_)) => {}
            Err(e) => {
                tracing::debug!(error = %e, "source auto: probing for CDC failed; polling on");
                client = None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::auto::Blocked;

    fn polling(reason: &'static str) -> Reading {
        Reading::Polling(Blocked {
            reason,
            message: format!("{reason} blocks CDC"),
        })
    }

    #[test]
    fn each_switch_and_each_new_reason_is_announced_once() {
        let config = crate::config::load_str(
            "[database]\nurl = \"postgres://u@h/d\"\n[source]\nmode = \"auto\"\n[sink]\ntype = \"kafka\"\nbrokers = \"k:9092\"\n",
        )
        .unwrap();
        let modes = Modes::default();
        let said: Vec<bool> = [
            polling("wal_level"),
            polling("wal_level"),
            polling("no_free_slot"),
            Reading::Cdc,
            Reading::Cdc,
            polling("lost_slot"),
        ]
        .iter()
        .map(|r| modes.starting(r, &config))
        .collect();
        assert_eq!(said, [true, false, true, true, false, true]);
    }
}
