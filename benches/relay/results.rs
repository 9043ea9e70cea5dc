//! One result per measurement, printed as a JSON line as it comes (the
//! field names are what BENCHMARKS.md and the saved `.jsonl` files use).

use crate::latency::Percentiles;
use crate::options::{Backlog, BrokerKind, Mode};
use crate::pgcpu::PgCpuTotals;
use crate::system::CpuTimes;
use crate::workload::Shape;
use serde::Serialize;

/// Relay and PostgreSQL CPU over a scenario's window (each result says
/// which), per 100k events.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Cost {
    /// Relay CPU (user + system).
    pub cpu_s_per_100k: Option<f64>,
    /// CPU of the PostgreSQL processes serving the relay (sessions and WAL
    /// sender, see pgcpu.rs).
    pub pg_cpu_s_per_100k: Option<f64>,
    /// Autovacuum workers on the benchmark's database.
    pub pg_autovacuum_s_per_100k: Option<f64>,
    /// The window's PostgreSQL CPU seconds.
    pub pg_cpu: Option<PgCpuTotals>,
}

impl Cost {
    /// The PostgreSQL side, from the window's totals over `events`.
    pub fn set_pg(&mut self, pg_cpu: Option<PgCpuTotals>, events: u64) {
        let per_100k = |s: f64| s / events.max(1) as f64 * 1e5;
        self.pg_cpu_s_per_100k = pg_cpu.map(|t| per_100k(t.relay_s()));
        self.pg_autovacuum_s_per_100k = pg_cpu.map(|t| per_100k(t.autovacuum_s));
        self.pg_cpu = pg_cpu;
    }
}

/// The machine around a measurement, and what the relay logged.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Conditions {
    /// Seconds spent waiting for a quiet machine before measuring.
    pub quiet_wait_s: f64,
    /// Share of all cores busy in the second before measuring.
    pub busy_before: Option<f64>,
    /// Share of all cores busy while measuring (relay, database, broker and anything else).
    pub system_busy: Option<f64>,
    /// Share of all cores' time stolen by the hypervisor while measuring
    /// (part of `system_busy`).
    pub steal: Option<f64>,
    /// The broker's resident memory before measuring, in MiB.
    pub broker_rss_mib: Option<f64>,
    pub warnings: usize,
    pub errors: usize,
    pub notes: Vec<String>,
}

impl Conditions {
    /// How busy the machine was since `machine` (the start of the measurement).
    pub fn measured_since(&mut self, machine: Option<CpuTimes>) {
        let shares = machine.and_then(|m| m.shares_since());
        (self.system_busy, self.steal) = (shares.map(|s| s.0), shares.map(|s| s.1));
    }
}

/// A steady writer's run, and the latencies of its events.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Writing {
    pub written: u64,
    pub achieved_rate: Option<f64>,
    pub writer_connections: usize,
    pub writer_max_lag_ms: Option<f64>,
    /// From the writer's last commit until every event was received and marked.
    pub tail_s: Option<f64>,
    /// Commit → consumer receipt.
    pub consumer: Option<Percentiles>,
    /// Commit → `relay_sent_at` (after the broker's confirmation).
    pub sent_at: Option<Percentiles>,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct DrainResult {
    pub kind: &'static str,
    pub mode: &'static str,
    pub broker: &'static str,
    pub payload: usize,
    pub tx_events: u32,
    pub events: u64,
    /// `relay.mark` the relay ran with.
    pub mark: String,
    pub run: usize,
    /// `ok`, or what went wrong.
    pub status: String,
    /// What ended the drain (see drain.rs).
    pub end_from: &'static str,
    pub insert_s: Option<f64>,
    /// Relay spawn → last `relay_sent_at`.
    pub drain_s: Option<f64>,
    /// Relay spawn → first `relay_sent_at` (start-up, first batch).
    pub first_mark_s: Option<f64>,
    pub events_per_s: Option<f64>,
    /// Relay spawn → the first poll (every 50 ms) that found a message on the broker.
    pub first_on_broker_s: Option<f64>,
    /// Events / (end − `first_on_broker_s`): the rate once the relay publishes.
    pub flow_eps: Option<f64>,
    pub db_read_eps: Option<f64>,
    pub broker_eps: Option<f64>,
    /// Not part of the ratio: the database's rate of marking rows sent.
    pub db_mark_eps: Option<f64>,
    /// Not part of the ratio: the statements of `relay.mark = "ranges"`
    /// (`outbox::progress`) on a copy: recording consecutive and scattered
    /// batches, and the fold's first round, rows per second.
    pub db_record_eps: Option<f64>,
    pub db_record_scattered_eps: Option<f64>,
    pub db_fold_eps: Option<f64>,
    /// `events_per_s` / min(`db_read_eps`, `broker_eps`).
    pub ratio: Option<f64>,
    /// `flow_eps` / min(`db_read_eps`, `broker_eps`): without the start-up.
    pub flow_ratio: Option<f64>,
    /// From spawn to the last mark.
    #[serde(flatten)]
    pub cost: Cost,
    /// Relay CPU from spawn until it went idle (CDC: skipping included), per 100k.
    pub cpu_settled_s_per_100k: Option<f64>,
    /// PostgreSQL CPU (sessions and WAL sender) until the relay went idle, per 100k.
    pub pg_cpu_settled_s_per_100k: Option<f64>,
    /// VmHWM when the last row was marked.
    pub peak_rss_mib: Option<f64>,
    /// Time after the last mark until the relay went idle.
    pub settle_s: Option<f64>,
    /// VmHWM once idle.
    pub peak_rss_settled_mib: Option<f64>,
    /// The machine before and during the drain (from the relay's start), the relay's log.
    #[serde(flatten)]
    pub conditions: Conditions,
}

impl DrainResult {
    pub fn new(mode: Mode, broker: BrokerKind, shape: Shape, events: u64, run: usize) -> Self {
        DrainResult {
            kind: "drain",
            mode: mode.name(),
            broker: broker.name(),
            payload: shape.payload,
            tx_events: shape.tx_events,
            events,
            mark: "update".into(),
            run,
            status: "ok".into(),
            ..Default::default()
        }
    }

    /// A file-name-friendly name of the measurement.
    pub fn label(&self) -> String {
        format!(
            "drain-{}-{}-{}x{}-{}-{}-run{}",
            self.mode, self.broker, self.payload, self.tx_events, self.events, self.mark, self.run
        )
    }

    /// The drain without its mark: the rows of the marking comparison.
    pub fn comparison_key(&self) -> String {
        format!(
            "{:<7} {:<8} {:>5}x{:<3} {:>7}",
            self.mode, self.broker, self.payload, self.tx_events, self.events
        )
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct SteadyResult {
    pub kind: &'static str,
    pub mode: &'static str,
    pub broker: &'static str,
    pub payload: usize,
    pub tx_events: u32,
    pub rate: u32,
    pub seconds: u64,
    pub run: usize,
    pub status: String,
    #[serde(flatten)]
    pub writing: Writing,
    pub unreceived: u64,
    pub unmarked: u64,
    /// During the writer's run and the tail.
    #[serde(flatten)]
    pub cost: Cost,
    pub peak_rss_mib: Option<f64>,
    /// The machine before and while writing (writer, relay, database,
    /// broker, consumer, others), the relay's log.
    #[serde(flatten)]
    pub conditions: Conditions,
}

impl SteadyResult {
    pub fn new(
        mode: Mode,
        broker: BrokerKind,
        shape: Shape,
        rate: u32,
        seconds: u64,
        run: usize,
    ) -> Self {
        SteadyResult {
            kind: "steady",
            mode: mode.name(),
            broker: broker.name(),
            payload: shape.payload,
            tx_events: shape.tx_events,
            rate,
            seconds,
            run,
            status: "ok".into(),
            ..Default::default()
        }
    }

    /// A file-name-friendly name of the measurement.
    pub fn label(&self) -> String {
        format!(
            "steady-{}-{}-{}x{}-{}-run{}",
            self.mode, self.broker, self.payload, self.tx_events, self.rate, self.run
        )
    }
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct AfterResult {
    pub kind: &'static str,
    pub mode: &'static str,
    pub broker: &'static str,
    /// Events committed while the relay was stopped; 0 for the baseline.
    pub backlog_events: u64,
    pub backlog_tx_events: u32,
    pub payload: usize,
    /// The writer started with the relay: events/s, events per transaction, seconds.
    pub rate: u32,
    pub tx_events: u32,
    pub seconds: u64,
    pub mark: String,
    pub run: usize,
    pub status: String,
    pub insert_s: Option<f64>,
    /// The writer's events only.
    #[serde(flatten)]
    pub writing: Writing,
    /// `sent_at.p99_ms` / the same run's baseline's (the target: <= 1.2).
    pub p99_ratio: Option<f64>,
    /// `consumer.p99_ms` / the same run's baseline's.
    pub consumer_p99_ratio: Option<f64>,
    /// Commit → `relay_sent_at` of the events committed after the last backlog
    /// event's `relay_sent_at` (baseline: after the relay's first `relay_sent_at`).
    pub after_drain_sent_at: Option<Percentiles>,
    /// Commit → consumer receipt of the same events.
    pub after_drain_consumer: Option<Percentiles>,
    /// `after_drain_sent_at.p99_ms` / the same run's baseline's.
    pub after_drain_p99_ratio: Option<f64>,
    /// Relay spawn → its first `relay_sent_at` (the warm-up relay stopped
    /// cleanly, so the relay publishes at once; without that record a new
    /// owner publishes nothing during its first `relay.ownership_lease`).
    pub first_sent_s: Option<f64>,
    /// Relay spawn → the last backlog event's `relay_sent_at`.
    pub backlog_drain_s: Option<f64>,
    /// Relay spawn → the first new event's `relay_sent_at`.
    pub first_new_sent_s: Option<f64>,
    /// New events committed before the last backlog event's `relay_sent_at`.
    pub committed_during_backlog: u64,
    /// Over those: max(0, own `relay_sent_at` − the last backlog event's);
    /// `negative` counts those confirmed before it.
    pub behind: Option<Percentiles>,
    pub unreceived: u64,
    pub unmarked: u64,
    /// Backlog rows left unsent at the end.
    pub backlog_unsent: u64,
    /// From the relay's start to the end of the tail, per 100k events (backlog and new).
    #[serde(flatten)]
    pub cost: Cost,
    pub peak_rss_mib: Option<f64>,
    /// The machine before and while writing, the relay's log.
    #[serde(flatten)]
    pub conditions: Conditions,
}

impl AfterResult {
    pub fn new(
        mode: Mode,
        broker: BrokerKind,
        backlog: Option<Backlog>,
        rate: u32,
        tx_events: u32,
        seconds: u64,
        run: usize,
    ) -> Self {
        AfterResult {
            kind: "after_backlog",
            mode: mode.name(),
            broker: broker.name(),
            backlog_events: backlog.map_or(0, |b| b.events),
            backlog_tx_events: backlog.map_or(0, |b| b.tx_events),
            payload: 256,
            rate,
            tx_events,
            seconds,
            mark: "update".into(),
            run,
            status: "ok".into(),
            ..Default::default()
        }
    }

    pub fn is_baseline(&self) -> bool {
        self.backlog_events == 0
    }

    /// Compares with the same run's baseline.
    pub fn against(&mut self, baseline: &AfterResult) {
        let ratio = |a: Option<Percentiles>, b: Option<Percentiles>| match (a, b) {
            (Some(a), Some(b)) if b.p99_ms > 0.0 => Some(a.p99_ms / b.p99_ms),
            _ => None,
        };
        self.p99_ratio = ratio(self.writing.sent_at, baseline.writing.sent_at);
        self.consumer_p99_ratio = ratio(self.writing.consumer, baseline.writing.consumer);
        self.after_drain_p99_ratio = ratio(self.after_drain_sent_at, baseline.after_drain_sent_at);
    }

    fn backlog(&self) -> String {
        if self.is_baseline() {
            "none".into()
        } else {
            format!("{}x{}", self.backlog_events, self.backlog_tx_events)
        }
    }

    /// A file-name-friendly name of the measurement.
    pub fn label(&self) -> String {
        format!(
            "after-{}-{}-{}-{}x{}-run{}",
            self.mode,
            self.broker,
            self.backlog(),
            self.rate,
            self.tx_events,
            self.run
        )
    }
}

/// What the tables and the notes read alike from every kind of result.
pub trait Measured {
    /// The row a run belongs to: what it measured, without the run number.
    fn key(&self) -> String;
    fn run(&self) -> usize;
    fn status(&self) -> &str;
    fn cost(&self) -> &Cost;
    fn peak_rss_mib(&self) -> Option<f64>;
    fn conditions(&self) -> &Conditions;
}

/// The fields [`Measured`] reads, named alike in every result.
macro_rules! measured_fields {
    () => {
        fn run(&self) -> usize {
            self.run
        }
        fn status(&self) -> &str {
            &self.status
        }
        fn cost(&self) -> &Cost {
            &self.cost
        }
        fn peak_rss_mib(&self) -> Option<f64> {
            self.peak_rss_mib
        }
        fn conditions(&self) -> &Conditions {
            &self.conditions
        }
    };
}

impl Measured for DrainResult {
    fn key(&self) -> String {
        format!(
            "{:<7} {:<8} {:>5}x{:<3} {:>7} {:<6}",
            self.mode, self.broker, self.payload, self.tx_events, self.events, self.mark
        )
    }
    measured_fields!();
}

impl Measured for SteadyResult {
    fn key(&self) -> String {
        format!(
            "{:<7} {:<8} {:>5}x{:<3} {:>6}",
            self.mode, self.broker, self.payload, self.tx_events, self.rate
        )
    }
    measured_fields!();
}

impl Measured for AfterResult {
    fn key(&self) -> String {
        format!("{:<7} {:<8} {:>11}", self.mode, self.broker, self.backlog())
    }
    measured_fields!();
}
