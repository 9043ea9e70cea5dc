//! The gauges read from the database (backlog, oldest unsent age, dead
//! letters, frontier, slot), refreshed by the daemon every
//! `http.sample_interval` from the same snapshot as `status`.
//!
//! Counting the backlog reads every unsent row: for a large backlog it is a
//! query of seconds on the database for millions of rows (with
//! `relay.mark = "ranges"`, 0.15 s per 300,000 rows on a 2-core benchmark
//! machine, JIT off as in every relay session), run beside the relay's own
//! reads of the same rows. So the count has a schedule of its own: after a
//! count that took `t`, the next starts no sooner than [`QUIET`] × `t`
//! after it started, so counts that take up to [`MAX_PAUSE`] / [`QUIET`]
//! keep PostgreSQL busy at most 1 / [`QUIET`] of the time; longer ones run
//! every [`MAX_PAUSE`] (or interval, when longer); one that failed waits
//! [`QUIET`] times as long as it took, up to [`FAILED_MAX_PAUSE`]. The oldest unsent row's
//! age reads up to the first unsent row only: with ranges it steps over
//! the runs of rows a drain recorded since the last fold, but looks
//! through the index entries of every transaction since then, 0.05–0.15 s
//! for 300,000 rows.
//! It has the same schedule, so it keeps the interval until it takes
//! longer than a twentieth of it.
//! Where the table cannot date that row (no `created_at` column, or NULL
//! in the row), the age counts from when this sampler first saw it oldest
//! and unsent ([`OldestAge`]).
//! The other gauges keep the interval.

use super::status::{OldestUnsent, Reads, backlog, snapshot};
use super::status::{oldest_unsent_sql, read_oldest_unsent};
use crate::config::Config;
use crate::db::DbError;
use std::time::Duration;
use tokio::time::Instant;

/// How many times as long as a count took the next one waits at least,
/// from the count's start.
const QUIET: u32 = 20;

/// The longest pause between two counts of the backlog (unless the
/// interval is longer): how stale its gauges may get while reads succeed
/// (after a failed one, up to [`FAILED_MAX_PAUSE`]).
const MAX_PAUSE: Duration = Duration::from_secs(60);

/// Refreshes the active, backlog, oldest-unsent, dead-letter, frontier and
/// slot gauges until `shutdown`.
pub async fn sample(
    config: Config,
    telemetry: crate::telemetry::PipelineTelemetry,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let interval = config.http.sample_interval;
    let mut state = Sampler {
        client: None,
        count_at: Instant::now(),
        age_at: Instant::now(),
        oldest: OldestAge::default(),
        warned: Vec::new(),
    };
    loop {
        telemetry.show_active();
        // A read may take long (a count of a large backlog): a stop does
        // not wait for it.
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = state.once(&config, &telemetry) => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => {}
        }
    }
}

/// What the sampler keeps between rounds.
struct Sampler {
    client: Option<tokio_postgres::Client>,
    count_at: Instant,
    age_at: Instant,
    oldest: OldestAge,
    /// When each kind of read that is failing was last logged at warn
    /// level (a kind leaves once it succeeds).
    warned: Vec<(&'static str, Instant)>,
}

/// The sampler's kinds of read, as its warnings name them.
const CONNECT: &str = "connecting to sample the gauges";
const BACKLOG: &str = "counting the backlog";
const AGE: &str = "reading the oldest unsent age";
const LETTERS: &str = "counting the dead letters";
const OTHERS: &str = "reading the dead-letter, frontier and slot gauges";

/// How often a sampler that keeps failing says so at warn level.
const WARN_EVERY: Duration = Duration::from_secs(600);

impl Sampler {
    /// A read failed, and its gauges keep their last values: said at warn
    /// level at once and every [`WARN_EVERY`] while that read keeps failing
    /// (a stale gauge must not pass for a current one unseen), else at
    /// debug.
    fn failed(&mut self, what: &'static str, error: &dyn std::fmt::Display) {
        let now = Instant::now();
        match self.warned.iter_mut().find(|(w, _)| *w == what) {
            Some((_, at)) if now.duration_since(*at) < WARN_EVERY => {
                return tracing::debug!(%error, "{what} failed");
            }
            Some((_, at)) => *at = now,
            None => self.warned.push((what, now)),
        }
        tracing::warn!(%error, "{what} failed: the gauges it feeds keep their last values until a read succeeds");
    }

    /// A read succeeded: its next failure is said at warn level again.
    fn read(&mut self, what: &'static str) {
        self.warned.retain(|(w, _)| *w != what);
    }

    /// One round of reads, each gauge when it is due.
    async fn once(&mut self, config: &Config, telemetry: &crate::telemetry::PipelineTelemetry) {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            match crate::db::connect(&config.database, None).await {
                Ok(c) => {
                    self.read(CONNECT);
                    self.client = Some(c);
                }
                Err(e) => return self.failed(CONNECT, &e),
            }
        }
        let Some(c) = self.client.take() else {
            return;
        };
        self.sample(&c, config, telemetry).await;
        self.client = Some(c);
    }

    async fn sample(
        &mut self,
        c: &tokio_postgres::Client,
        config: &Config,
        telemetry: &crate::telemetry::PipelineTelemetry,
    ) {
        let m = &telemetry.metrics;
        let interval = config.http.sample_interval;
        // Each read of the unsent rows paced by what it took; failed
        // or not, a slow one waits its pause, and a failure keeps the
        // gauge's last value.
        if Instant::now() >= self.count_at {
            let started = Instant::now();
            let counted = backlog(c, config).await;
            self.count_at = started + pause_after(interval, started.elapsed(), counted.is_err());
            match counted {
                // Zero with mark = "none": the slot's gauges measure the lag.
                Ok(backlog) => {
                    self.read(BACKLOG);
                    m.backlog.set(backlog.unwrap_or(0) as f64);
                }
                Err(e) => self.failed(BACKLOG, &e),
            }
        }
        if Instant::now() >= self.age_at {
            let started = Instant::now();
            let read = self.oldest.read(c, config).await;
            self.age_at = started + pause_after(interval, started.elapsed(), read.is_err());
            match read {
                Ok(age) => {
                    self.read(AGE);
                    m.oldest_unsent_age.set(age);
                }
                Err(e) => self.failed(AGE, &e),
            }
        }
        let reads = Reads {
            backlog: false,
            oldest_age: false,
            last_publish: false,
        };
        match snapshot(c, config, reads).await {
            Ok(s) => {
                self.read(OTHERS);
                if let Some(n) = s.dead_letters {
                    self.read(LETTERS);
                    m.dead_letters.set(n as f64);
                }
                if let Some(e) = &s.dead_letters_error {
                    self.failed(LETTERS, e);
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
            Err(e) => self.failed(OTHERS, &e),
        }
    }
}

/// The oldest unsent row's age for the gauge. Its `created_at` dates it;
/// where nothing does (the table has no such column, or the row's is NULL)
/// the age counts from when this sampler first saw that row oldest and
/// unsent: a lower bound, which starts again when the relay restarts, so
/// that `OutboxBacklogAging` still sees a row that does not move.
#[derive(Debug, Default)]
struct OldestAge {
    /// The statement, kept while rows are dated: it is built again after
    /// an error or an undated row (the table's columns may have changed).
    sql: Option<String>,
    /// The oldest unsent row's `relay_seq`, and when it was first seen.
    seen: Option<(i64, Instant)>,
}

impl OldestAge {
    async fn read(
        &mut self,
        client: &tokio_postgres::Client,
        config: &Config,
    ) -> Result<f64, DbError> {
        let sql = match self.sql.take() {
            Some(sql) => sql,
            None => match oldest_unsent_sql(client, config).await? {
                Some(sql) => sql,
                None => return Ok(self.age(None, Instant::now())),
            },
        };
        let oldest = read_oldest_unsent(client, &sql).await?;
        if oldest.is_none_or(|o| o.age.is_some()) {
            self.sql = Some(sql);
        }
        Ok(self.age(oldest, Instant::now()))
    }

    /// The age of `oldest` at `now`, 0 when nothing is unsent.
    fn age(&mut self, oldest: Option<OldestUnsent>, now: Instant) -> f64 {
        let Some(o) = oldest else {
            self.seen = None;
            return 0.0;
        };
        let since = match self.seen {
            Some((seq, since)) if seq == o.seq => since,
            _ => now,
        };
        self.seen = Some((o.seq, since));
        o.age
            .unwrap_or_else(|| now.duration_since(since).as_secs_f64())
    }
}

/// How long after a count that took `took` the next one may run: the
/// interval, or [`QUIET`] times `took` when that is longer, at most
/// [`MAX_PAUSE`] (or the interval, when longer).
fn pause_after(interval: Duration, took: Duration, failed: bool) -> Duration {
    // A read that failed after long (the statement timeout, on a backlog
    // too large to count in it) would fail again: it waits its full quiet
    // time, or the count would run all the time.
    let cap = if failed { FAILED_MAX_PAUSE } else { MAX_PAUSE };
    took.saturating_mul(QUIET).min(cap).max(interval)
}

/// The longest pause after a read of the unsent rows that failed.
const FAILED_MAX_PAUSE: Duration = Duration::from_secs(30 * 60);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_undated_oldest_row_ages_from_when_it_was_first_seen() {
        let mut gauge = OldestAge::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let row = |seq: i64, age: Option<f64>| Some(OldestUnsent { seq, age });
        assert_eq!(gauge.age(row(7, None), at(0)), 0.0, "first seen now");
        assert_eq!(gauge.age(row(7, None), at(30)), 30.0, "still there");
        // A dated row's own age wins; an undated one after it starts again.
        assert_eq!(gauge.age(row(8, Some(100.0)), at(40)), 100.0);
        assert_eq!(gauge.age(row(9, None), at(50)), 0.0, "a newer oldest row");
        assert_eq!(gauge.age(row(9, None), at(65)), 15.0);
        // Nothing unsent: 0, and the same row later counts afresh.
        assert_eq!(gauge.age(None, at(70)), 0.0);
        assert_eq!(gauge.age(row(9, None), at(80)), 0.0);
    }

    #[test]
    fn a_slow_count_puts_the_next_further_off() {
        let interval = Duration::from_secs(15);
        // Quick counts keep the interval.
        assert_eq!(
            pause_after(interval, Duration::from_millis(40), false),
            interval
        );
        assert_eq!(
            pause_after(interval, Duration::from_millis(750), false),
            interval
        );
        // A count of a large backlog that took 2 s: the next 40 s after it
        // started, PostgreSQL busy counting 2 s in 40.
        assert_eq!(
            pause_after(interval, Duration::from_secs(2), false),
            Duration::from_secs(40)
        );
        // Never more than a minute, unless the interval is.
        assert_eq!(
            pause_after(interval, Duration::from_secs(10), false),
            MAX_PAUSE
        );
        assert_eq!(pause_after(interval, Duration::MAX, false), MAX_PAUSE);
        let long = Duration::from_secs(300);
        assert_eq!(pause_after(long, Duration::from_secs(10), false), long);
        // A count cut off by the 60 s statement timeout does not start
        // again at once: twenty minutes later.
        let timed_out = Duration::from_secs(60);
        assert_eq!(
            pause_after(interval, timed_out, true),
            Duration::from_secs(1200)
        );
        assert_eq!(pause_after(interval, Duration::MAX, true), FAILED_MAX_PAUSE);
        // A quick failure (the connection gone) keeps the interval.
        assert_eq!(
            pause_after(interval, Duration::from_millis(5), true),
            interval
        );
    }
}

#[cfg(test)]
mod stop_tests {
    use super::*;

    /// A round that hangs (here: connecting to a server that accepts and
    /// never answers, within a 30 s connect timeout) does not hold up a
    /// stop: the sampler ends at once.
    #[tokio::test]
    async fn a_stop_does_not_wait_for_a_round_of_reads() {
        let (port, held) = crate::db::silent_server().await;
        let config = crate::config::load_str(&format!(
            "[database]\nurl = \"postgres://relay@127.0.0.1:{port}/app\"\nconnect_timeout = \"30s\"\n[sink]\ntype = \"kafka\"\nbrokers = \"k:9092\"\n"
        ))
        .unwrap();
        let telemetry = crate::telemetry::PipelineTelemetry::new(&config);
        let shutdown = tokio_util::sync::CancellationToken::new();
        let sampler = tokio::spawn(sample(config, telemetry, shutdown.clone()));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(
            !sampler.is_finished(),
            "the round hangs on the silent server"
        );
        shutdown.cancel();
        tokio::time::timeout(Duration::from_secs(5), sampler)
            .await
            .expect("the sampler stops without waiting for the round")
            .unwrap();
        held.abort();
    }
}
