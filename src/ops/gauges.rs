//! The gauges read from the database (backlog, oldest unsent age, dead
//! letters, frontier, slot), refreshed by the daemon every
//! `http.sample_interval` from the same snapshot as `status`.
//!
//! Counting the backlog reads every unsent row: for a large backlog it is a
//! query of seconds on the database (with `relay.mark = "ranges"`, about a
//! second per 300,000 rows on a busy benchmark machine), run beside the
//! relay's own reads of the same rows. So the count, and the oldest unsent
//! row's age that comes with it, has a schedule of its own: after a count
//! that took `t`, the next waits at least [`QUIET`] × `t`, so counting keeps
//! PostgreSQL busy at most about 1 / ([`QUIET`] + 1) of the time, up to
//! [`MAX_PAUSE`] between counts. The other gauges keep the interval.

use super::status::{Reads, snapshot};
use crate::config::Config;
use std::time::Duration;
use tokio::time::Instant;

/// How many times as long as a count took the next one waits at least.
const QUIET: u32 = 20;

/// The longest pause between two counts of the backlog (unless the
/// interval is longer): how stale its gauges may get.
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// Refreshes the backlog, oldest-unsent, dead-letter and slot gauges until `shutdown`.
pub async fn sample(
    config: Config,
    telemetry: crate::telemetry::PipelineTelemetry,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let m = &telemetry.metrics;
    let interval = config.http.sample_interval;
    let mut client: Option<tokio_postgres::Client> = None;
    let mut count_at = Instant::now();
    loop {
        m.active.set(if telemetry.health.is_active() {
            1.0
        } else {
            0.0
        });
        if client.as_ref().is_none_or(|c| c.is_closed()) {
            client = crate::db::connect(&config.database, None).await.ok();
        }
        if let Some(c) = &client {
            let started = Instant::now();
            let reads = Reads {
                backlog: started >= count_at,
                last_publish: false,
            };
            match snapshot(c, &config, reads).await {
                Ok(s) => {
                    if reads.backlog {
                        let took = started.elapsed();
                        count_at = started + pause_after(interval, took);
                        // Zero with mark = "none": the slot's gauges measure the lag.
                        m.backlog.set(s.backlog.unwrap_or(0) as f64);
                        m.oldest_unsent_age
                            .set(s.oldest_unsent_age_seconds.unwrap_or(0.0));
                    }
                    if let Some(n) = s.dead_letters {
                        m.dead_letters.set(n as f64);
                    }
                    if let Some(f) = &s.frontier {
                        m.frontier_age.set(f.age_seconds.unwrap_or(0.0));
                        m.held_rows.set(f.held_rows as f64);
                    }
                    if let Some(slot) = s.slot {
                        m.slot_retained_wal
                            .set(slot.retained_wal_bytes.unwrap_or(0) as f64);
                        m.slot_confirmed_lag
                            .set(slot.confirmed_lag_bytes.unwrap_or(0) as f64);
                    }
                }
                Err(e) => tracing::debug!(error = %e, "metrics sample failed"),
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// How long after a count that took `took` the next one may run: the
/// interval, or [`QUIET`] times `took` when that is longer, at most
/// [`MAX_PAUSE`] (or the interval, when longer).
fn pause_after(interval: Duration, took: Duration) -> Duration {
    took.saturating_mul(QUIET).min(MAX_PAUSE).max(interval)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slow_count_puts_the_next_further_off() {
        let interval = Duration::from_secs(15);
        // Quick counts keep the interval.
        assert_eq!(pause_after(interval, Duration::from_millis(40)), interval);
        assert_eq!(pause_after(interval, Duration::from_millis(750)), interval);
        // A count of a large backlog that took 2 s: 40 s before the next,
        // PostgreSQL busy counting 2 s in 42.
        assert_eq!(
            pause_after(interval, Duration::from_secs(2)),
            Duration::from_secs(40)
        );
        // Never more than a minute between counts, unless the interval is.
        assert_eq!(pause_after(interval, Duration::from_secs(10)), MAX_PAUSE);
        assert_eq!(pause_after(interval, Duration::MAX), MAX_PAUSE);
        let long = Duration::from_secs(300);
        assert_eq!(pause_after(long, Duration::from_secs(10)), long);
    }
}
