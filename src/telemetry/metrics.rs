//! Every metric the relay exports, declared once. Names are `outbox_relay_*`;
//! labels are bounded (the pipeline name, the broker kind, an outcome, a
//! table kind, a source mode), never an aggregate or event id.

use crate::errors::Outcome;
use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};

pub const EVENTS_PUBLISHED: &str = "outbox_relay_events_published_total";
pub const EVENTS_FAILED: &str = "outbox_relay_events_failed_total";
pub const EVENTS_DEAD_LETTERED: &str = "outbox_relay_events_dead_lettered_total";
pub const DEAD_LETTERS: &str = "outbox_relay_dead_letters";
pub const BACKLOG: &str = "outbox_relay_backlog_events";
pub const OLDEST_UNSENT_AGE: &str = "outbox_relay_oldest_unsent_age_seconds";
pub const COMMIT_TO_CONFIRM: &str = "outbox_relay_commit_to_confirm_seconds";
pub const BATCH_SIZE: &str = "outbox_relay_batch_size";
pub const IN_FLIGHT: &str = "outbox_relay_in_flight";
pub const IN_FLIGHT_BYTES: &str = "outbox_relay_in_flight_bytes";
pub const SLOT_RETAINED_WAL: &str = "outbox_relay_slot_retained_wal_bytes";
pub const SLOT_CONFIRMED_LAG: &str = "outbox_relay_slot_confirmed_lag_bytes";
pub const SLOTS_RECREATED: &str = "outbox_relay_slots_recreated_total";
pub const RETENTION_DELETED: &str = "outbox_relay_retention_deleted_total";
pub const RETENTION_PARTITIONS: &str = "outbox_relay_retention_partitions_total";
pub const RETENTION_FAILURES: &str = "outbox_relay_retention_failures_total";
pub const ACTIVE: &str = "outbox_relay_active";
pub const RESTARTS: &str = "outbox_relay_restarts_total";
pub const LAST_PUBLISH: &str = "outbox_relay_last_publish_timestamp_seconds";
pub const SOURCE_MODE: &str = "outbox_relay_source_mode";
pub const FRONTIER_AGE: &str = "outbox_relay_frontier_age_seconds";
pub const HELD_ROWS: &str = "outbox_relay_held_rows";
pub const FOLD_ROUNDS: &str = "outbox_relay_fold_rounds_total";

/// Every metric name above, for the checks that dashboards and alert rules
/// only use what the relay exports.
pub const ALL: &[&str] = &[
    EVENTS_PUBLISHED,
    EVENTS_FAILED,
    EVENTS_DEAD_LETTERED,
    DEAD_LETTERS,
    BACKLOG,
    OLDEST_UNSENT_AGE,
    COMMIT_TO_CONFIRM,
    BATCH_SIZE,
    IN_FLIGHT,
    IN_FLIGHT_BYTES,
    SLOT_RETAINED_WAL,
    SLOT_CONFIRMED_LAG,
    SLOTS_RECREATED,
    RETENTION_DELETED,
    RETENTION_PARTITIONS,
    RETENTION_FAILURES,
    ACTIVE,
    RESTARTS,
    LAST_PUBLISH,
    SOURCE_MODE,
    FRONTIER_AGE,
    HELD_ROWS,
    FOLD_ROUNDS,
];
/// The histograms among them: exported as `_bucket`, `_sum` and `_count` series.
pub const HISTOGRAMS: &[&str] = &[COMMIT_TO_CONFIRM, BATCH_SIZE];

/// Buckets of the latency histogram, in seconds.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
/// Buckets of the batch-size histogram.
pub const BATCH_BUCKETS: &[f64] = &[
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0, 5000.0,
];

/// The metric handles of one pipeline, made once.
#[derive(Clone)]
pub struct PipelineMetrics {
    pub published: Counter,
    refused: Counter,
    unavailable: Counter,
    pub dead_lettered: Counter,
    pub dead_letters: Gauge,
    pub backlog: Gauge,
    pub oldest_unsent_age: Gauge,
    pub commit_to_confirm: Histogram,
    pub batch_size: Histogram,
    pub in_flight: Gauge,
    pub in_flight_bytes: Gauge,
    pub slot_retained_wal: Gauge,
    pub slot_confirmed_lag: Gauge,
    pub retention_outbox: Counter,
    pub retention_dead_letters: Counter,
    /// Outbox partitions created ahead and dropped (`retention.mode = "partitions"`).
    pub partitions_created: Counter,
    pub partitions_dropped: Counter,
    /// Retention's failures, by `action`: a whole cleanup, a partition not
    /// created, an expired partition the server refused to drop.
    pub retention_failed_cleanup: Counter,
    pub retention_failed_create: Counter,
    pub retention_failed_drop: Counter,
    pub active: Gauge,
    pub restarts: Counter,
    /// Lost replication slots dropped and created again (CDC).
    pub slots_recreated: Counter,
    pub last_publish: Gauge,
    /// 1 for the way this instance reads the outbox now, by `mode`; the
    /// `configured` label (`source.mode`) tells an auto pipeline that fell
    /// back to polling from one that was told to poll.
    reading_cdc: Gauge,
    reading_polling: Gauge,
    /// With `relay.mark = "ranges"`: seconds since the fold last moved the
    /// frontier, and the rows it holds open (sampled from the database).
    pub frontier_age: Gauge,
    pub held_rows: Gauge,
    /// The fold's rounds on this instance, by outcome.
    fold_advanced: Counter,
    fold_unsettled: Counter,
    fold_draining: Counter,
    fold_stale: Counter,
    fold_failed: Counter,
}

/// How a round of the fold ended, for [`PipelineMetrics::fold_round`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FoldOutcome {
    /// The frontier moved.
    Advanced,
    /// The frontier moved, but a long transaction kept the capture from
    /// settling: only batches counted visible were deleted.
    Unsettled,
    /// Too many rows unrecorded: the relay is draining; the round gave up.
    Draining,
    /// The capture was older than the frontier; the round gave up.
    Stale,
    /// A query failed; the round is retried.
    Failed,
}

impl PipelineMetrics {
    pub fn new(pipeline: &str, destination: &'static str, configured: &'static str) -> Self {
        let p = pipeline.to_owned();
        PipelineMetrics {
            published: counter!(EVENTS_PUBLISHED, "pipeline" => p.clone(), "destination" => destination),
            refused: counter!(EVENTS_FAILED, "pipeline" => p.clone(), "destination" => destination, "outcome" => Outcome::Refused.label()),
            unavailable: counter!(EVENTS_FAILED, "pipeline" => p.clone(), "destination" => destination, "outcome" => Outcome::Unavailable.label()),
            dead_lettered: counter!(EVENTS_DEAD_LETTERED, "pipeline" => p.clone()),
            dead_letters: gauge!(DEAD_LETTERS, "pipeline" => p.clone()),
            backlog: gauge!(BACKLOG, "pipeline" => p.clone()),
            oldest_unsent_age: gauge!(OLDEST_UNSENT_AGE, "pipeline" => p.clone()),
            commit_to_confirm: histogram!(COMMIT_TO_CONFIRM, "pipeline" => p.clone(), "destination" => destination),
            batch_size: histogram!(BATCH_SIZE, "pipeline" => p.clone()),
            in_flight: gauge!(IN_FLIGHT, "pipeline" => p.clone()),
            in_flight_bytes: gauge!(IN_FLIGHT_BYTES, "pipeline" => p.clone()),
            slot_retained_wal: gauge!(SLOT_RETAINED_WAL, "pipeline" => p.clone()),
            slot_confirmed_lag: gauge!(SLOT_CONFIRMED_LAG, "pipeline" => p.clone()),
            retention_outbox: counter!(RETENTION_DELETED, "pipeline" => p.clone(), "table" => "outbox"),
            retention_dead_letters: counter!(RETENTION_DELETED, "pipeline" => p.clone(), "table" => "dead_letters"),
            partitions_created: counter!(RETENTION_PARTITIONS, "pipeline" => p.clone(), "action" => "created"),
            partitions_dropped: counter!(RETENTION_PARTITIONS, "pipeline" => p.clone(), "action" => "dropped"),
            retention_failed_cleanup: counter!(RETENTION_FAILURES, "pipeline" => p.clone(), "action" => "cleanup"),
            retention_failed_create: counter!(RETENTION_FAILURES, "pipeline" => p.clone(), "action" => "create"),
            retention_failed_drop: counter!(RETENTION_FAILURES, "pipeline" => p.clone(), "action" => "drop"),
            active: gauge!(ACTIVE, "pipeline" => p.clone()),
            restarts: counter!(RESTARTS, "pipeline" => p.clone()),
            slots_recreated: counter!(SLOTS_RECREATED, "pipeline" => p.clone()),
            last_publish: gauge!(LAST_PUBLISH, "pipeline" => p.clone()),
            reading_cdc: gauge!(SOURCE_MODE, "pipeline" => p.clone(), "mode" => "cdc", "configured" => configured),
            reading_polling: gauge!(SOURCE_MODE, "pipeline" => p.clone(), "mode" => "polling", "configured" => configured),
            frontier_age: gauge!(FRONTIER_AGE, "pipeline" => p.clone()),
            held_rows: gauge!(HELD_ROWS, "pipeline" => p.clone()),
            fold_advanced: counter!(FOLD_ROUNDS, "pipeline" => p.clone(), "outcome" => "advanced"),
            fold_unsettled: counter!(FOLD_ROUNDS, "pipeline" => p.clone(), "outcome" => "unsettled"),
            fold_draining: counter!(FOLD_ROUNDS, "pipeline" => p.clone(), "outcome" => "draining"),
            fold_stale: counter!(FOLD_ROUNDS, "pipeline" => p.clone(), "outcome" => "stale"),
            fold_failed: counter!(FOLD_ROUNDS, "pipeline" => p, "outcome" => "failed"),
        }
    }

    /// The source this instance reads with now (`"cdc"` or `"polling"`), or
    /// none while it does not relay.
    pub fn reading(&self, mode: Option<&str>) {
        let is = |m: &str| if mode == Some(m) { 1.0 } else { 0.0 };
        self.reading_cdc.set(is("cdc"));
        self.reading_polling.set(is("polling"));
    }

    /// Counts one round of the fold.
    pub fn fold_round(&self, outcome: FoldOutcome) {
        match outcome {
            FoldOutcome::Advanced => self.fold_advanced.increment(1),
            FoldOutcome::Unsettled => self.fold_unsettled.increment(1),
            FoldOutcome::Draining => self.fold_draining.increment(1),
            FoldOutcome::Stale => self.fold_stale.increment(1),
            FoldOutcome::Failed => self.fold_failed.increment(1),
        }
    }

    /// Counts `n` events that failed with `why` (see [`crate::errors::policy`]).
    pub fn failed(&self, why: Outcome, n: u64) {
        match why {
            Outcome::Refused => self.refused.increment(n),
            Outcome::Unavailable => self.unavailable.increment(n),
        }
    }
}

/// Installs the Prometheus recorder; the handle renders the text format.
/// `None` when a recorder is already installed (tests running several relays).
pub fn install() -> Option<metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(COMMIT_TO_CONFIRM.into()), LATENCY_BUCKETS)
        .ok()?
        .set_buckets_for_metric(Matcher::Full(BATCH_SIZE.into()), BATCH_BUCKETS)
        .ok()?
        .install_recorder()
        .ok()
}
