//! Results: one JSON line each as they come, then tables of medians and the
//! issue's targets, met or missed.

use crate::latency::Percentiles;
use crate::options::{Backlog, BrokerKind, Mode};
use crate::pgcpu::PgCpuTotals;
use crate::workload::Shape;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Clone, Serialize)]
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
    /// `events_per_s` / min(`db_read_eps`, `broker_eps`).
    pub ratio: Option<f64>,
    /// `flow_eps` / min(`db_read_eps`, `broker_eps`): without the start-up.
    pub flow_ratio: Option<f64>,
    /// Relay CPU (user + system) from spawn to the last mark, per 100k events.
    pub cpu_s_per_100k: Option<f64>,
    /// CPU of the PostgreSQL processes serving the relay (sessions and WAL
    /// sender, see pgcpu.rs) over the same window, per 100k events.
    pub pg_cpu_s_per_100k: Option<f64>,
    /// Autovacuum workers on the benchmark's database, same window, per 100k events.
    pub pg_autovacuum_s_per_100k: Option<f64>,
    /// The same window's PostgreSQL CPU seconds.
    pub pg_cpu: Option<PgCpuTotals>,
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
    /// Seconds spent waiting for a quiet machine before measuring.
    pub quiet_wait_s: f64,
    /// Share of all cores busy in the second before the relay started.
    pub busy_before: Option<f64>,
    /// Share of all cores busy during the drain (relay, database, broker and anything else).
    pub system_busy: Option<f64>,
    pub warnings: usize,
    pub errors: usize,
    pub notes: Vec<String>,
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
            end_from: "",
            insert_s: None,
            drain_s: None,
            first_mark_s: None,
            events_per_s: None,
            first_on_broker_s: None,
            flow_eps: None,
            db_read_eps: None,
            broker_eps: None,
            db_mark_eps: None,
            ratio: None,
            flow_ratio: None,
            cpu_s_per_100k: None,
            pg_cpu_s_per_100k: None,
            pg_autovacuum_s_per_100k: None,
            pg_cpu: None,
            cpu_settled_s_per_100k: None,
            pg_cpu_settled_s_per_100k: None,
            peak_rss_mib: None,
            settle_s: None,
            peak_rss_settled_mib: None,
            quiet_wait_s: 0.0,
            busy_before: None,
            system_busy: None,
            warnings: 0,
            errors: 0,
            notes: Vec::new(),
        }
    }

    /// A file-name-friendly name of the measurement.
    pub fn label(&self) -> String {
        format!(
            "drain-{}-{}-{}x{}-{}-{}-run{}",
            self.mode, self.broker, self.payload, self.tx_events, self.events, self.mark, self.run
        )
    }

    fn key(&self) -> String {
        format!(
            "{:<7} {:<8} {:>5}x{:<3} {:>7} {:<6}",
            self.mode, self.broker, self.payload, self.tx_events, self.events, self.mark
        )
    }

    /// The drain without its mark: the rows of the marking comparison.
    fn comparison_key(&self) -> String {
        format!(
            "{:<7} {:<8} {:>5}x{:<3} {:>7}",
            self.mode, self.broker, self.payload, self.tx_events, self.events
        )
    }
}

#[derive(Debug, Clone, Serialize)]
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
    pub written: u64,
    pub achieved_rate: Option<f64>,
    pub writer_connections: usize,
    pub writer_max_lag_ms: Option<f64>,
    /// From the writer's last commit until everything was received and marked.
    pub tail_s: Option<f64>,
    /// Commit → consumer receipt.
    pub consumer: Option<Percentiles>,
    /// Commit → `relay_sent_at` (after the broker's confirmation).
    pub sent_at: Option<Percentiles>,
    pub unreceived: u64,
    pub unmarked: u64,
    /// Relay CPU during the writer's run and the tail, per 100k events.
    pub cpu_s_per_100k: Option<f64>,
    /// PostgreSQL CPU serving the relay (sessions, WAL sender), same window, per 100k.
    pub pg_cpu_s_per_100k: Option<f64>,
    /// Autovacuum workers on the benchmark's database, same window, per 100k.
    pub pg_autovacuum_s_per_100k: Option<f64>,
    pub pg_cpu: Option<PgCpuTotals>,
    pub peak_rss_mib: Option<f64>,
    /// Seconds spent waiting for a quiet machine before the writer started.
    pub quiet_wait_s: f64,
    /// Share of all cores busy in the second before the writer started.
    pub busy_before: Option<f64>,
    /// Share of all cores busy while writing (writer, relay, database, broker, consumer, others).
    pub system_busy: Option<f64>,
    pub warnings: usize,
    pub errors: usize,
    pub notes: Vec<String>,
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
            written: 0,
            achieved_rate: None,
            writer_connections: 0,
            writer_max_lag_ms: None,
            tail_s: None,
            consumer: None,
            sent_at: None,
            unreceived: 0,
            unmarked: 0,
            cpu_s_per_100k: None,
            pg_cpu_s_per_100k: None,
            pg_autovacuum_s_per_100k: None,
            pg_cpu: None,
            peak_rss_mib: None,
            quiet_wait_s: 0.0,
            busy_before: None,
            system_busy: None,
            warnings: 0,
            errors: 0,
            notes: Vec::new(),
        }
    }

    /// A file-name-friendly name of the measurement.
    pub fn label(&self) -> String {
        format!(
            "steady-{}-{}-{}x{}-{}-run{}",
            self.mode, self.broker, self.payload, self.tx_events, self.rate, self.run
        )
    }

    fn key(&self) -> String {
        format!(
            "{:<7} {:<8} {:>5}x{:<3} {:>6}",
            self.mode, self.broker, self.payload, self.tx_events, self.rate
        )
    }
}

#[derive(Debug, Clone, Serialize)]
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
    pub written: u64,
    pub achieved_rate: Option<f64>,
    pub writer_connections: usize,
    pub writer_max_lag_ms: Option<f64>,
    /// From the writer's last commit until every event was received and marked.
    pub tail_s: Option<f64>,
    /// Commit → consumer receipt, the writer's events only.
    pub consumer: Option<Percentiles>,
    /// Commit → `relay_sent_at`, the writer's events only.
    pub sent_at: Option<Percentiles>,
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
    /// Relay spawn → its first `relay_sent_at` (a new owner publishes nothing
    /// during its first `relay.ownership_lease`).
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
    /// Relay CPU from its start to the end of the tail, per 100k events (backlog and new).
    pub cpu_s_per_100k: Option<f64>,
    /// PostgreSQL CPU serving the relay (sessions, WAL sender), same window and events.
    pub pg_cpu_s_per_100k: Option<f64>,
    pub pg_autovacuum_s_per_100k: Option<f64>,
    pub pg_cpu: Option<PgCpuTotals>,
    pub peak_rss_mib: Option<f64>,
    pub quiet_wait_s: f64,
    pub busy_before: Option<f64>,
    pub system_busy: Option<f64>,
    pub warnings: usize,
    pub errors: usize,
    pub notes: Vec<String>,
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
            insert_s: None,
            written: 0,
            achieved_rate: None,
            writer_connections: 0,
            writer_max_lag_ms: None,
            tail_s: None,
            consumer: None,
            sent_at: None,
            p99_ratio: None,
            consumer_p99_ratio: None,
            after_drain_sent_at: None,
            after_drain_consumer: None,
            after_drain_p99_ratio: None,
            first_sent_s: None,
            backlog_drain_s: None,
            first_new_sent_s: None,
            committed_during_backlog: 0,
            behind: None,
            unreceived: 0,
            unmarked: 0,
            backlog_unsent: 0,
            cpu_s_per_100k: None,
            pg_cpu_s_per_100k: None,
            pg_autovacuum_s_per_100k: None,
            pg_cpu: None,
            peak_rss_mib: None,
            quiet_wait_s: 0.0,
            busy_before: None,
            system_busy: None,
            warnings: 0,
            errors: 0,
            notes: Vec::new(),
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
        self.p99_ratio = ratio(self.sent_at, baseline.sent_at);
        self.consumer_p99_ratio = ratio(self.consumer, baseline.consumer);
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

    fn key(&self) -> String {
        format!("{:<7} {:<8} {:>11}", self.mode, self.broker, self.backlog())
    }
}

/// Collects results, printing each as a JSON line (and appending it to a file).
pub struct Report {
    pub drains: Vec<DrainResult>,
    pub steadies: Vec<SteadyResult>,
    pub afters: Vec<AfterResult>,
    json: Option<PathBuf>,
}

impl Report {
    pub fn new(json: Option<PathBuf>) -> Report {
        Report {
            drains: Vec::new(),
            steadies: Vec::new(),
            afters: Vec::new(),
            json,
        }
    }

    pub fn after(&mut self, r: AfterResult) {
        self.emit(&r);
        self.afters.push(r);
    }

    pub fn emit(&self, value: &impl Serialize) {
        let line = serde_json::to_string(value).unwrap_or_default();
        println!("{line}");
        if let Some(path) = &self.json {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path);
            if let Err(e) = file.and_then(|mut f| writeln!(f, "{line}")) {
                eprintln!("bench: cannot append to {}: {e}", path.display());
            }
        }
    }

    pub fn drain(&mut self, r: DrainResult) {
        self.emit(&r);
        self.drains.push(r);
    }

    pub fn steady(&mut self, r: SteadyResult) {
        self.emit(&r);
        self.steadies.push(r);
    }
}

/// Median of the values present.
pub fn median(values: impl IntoIterator<Item = Option<f64>>) -> Option<f64> {
    let mut v: Vec<f64> = values
        .into_iter()
        .flatten()
        .filter(|x| x.is_finite())
        .collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// Results grouped by key, in first-seen order.
fn groups<T>(items: &[T], key: impl Fn(&T) -> String) -> Vec<(String, Vec<&T>)> {
    let mut out: Vec<(String, Vec<&T>)> = Vec::new();
    for item in items {
        let k = key(item);
        match out.iter_mut().find(|(g, _)| *g == k) {
            Some((_, v)) => v.push(item),
            None => out.push((k, vec![item])),
        }
    }
    out
}

fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.decimals$}"))
}

fn ok_runs<T>(runs: &[&T], status: impl Fn(&T) -> &str) -> String {
    let ok = runs.iter().filter(|r| status(r) == "ok").count();
    format!("{ok}/{}", runs.len())
}

/// The median-of-runs tables (the JSON lines hold every run).
pub fn print_tables(report: &Report) {
    if !report.drains.is_empty() {
        print_drains(&report.drains);
    }
    if !report.drains.is_empty() {
        print_marks(&report.drains);
    }
    if !report.steadies.is_empty() {
        print_steadies(&report.steadies);
    }
    if !report.afters.is_empty() {
        print_afters(&report.afters);
    }
    for r in report
        .drains
        .iter()
        .filter(|r| r.status != "ok" || !r.notes.is_empty())
    {
        println!(
            "note: drain {} run {}: {} {:?}",
            r.key(),
            r.run,
            r.status,
            r.notes
        );
    }
    for r in report
        .steadies
        .iter()
        .filter(|r| r.status != "ok" || !r.notes.is_empty())
    {
        println!(
            "note: steady {} run {}: {} {:?}",
            r.key(),
            r.run,
            r.status,
            r.notes
        );
    }
    for r in report
        .afters
        .iter()
        .filter(|r| r.status != "ok" || !r.notes.is_empty())
    {
        println!(
            "note: after-backlog {} run {}: {} {:?}",
            r.key(),
            r.run,
            r.status,
            r.notes
        );
    }
}

fn print_drains(drains: &[DrainResult]) {
    println!(
        "\nBacklog drain (medians of runs; ratio = drain / min(db read, broker publish), per run; \
         flow = from the first message on the broker (after the relay's start-up and ownership lease); \
         cpu/100k: the relay's CPU s per 100k events, pg/100k: PostgreSQL's serving it)"
    );
    println!(
        "{:<7} {:<8} {:>9} {:>7} {:<6} | {:>8} {:>8} {:>8} {:>8} {:>5} | {:>8} | {:>8} {:>7} {:>7} {:>6} {:>7} | {:>4} {:>4} {:>4}",
        "mode",
        "broker",
        "shape",
        "events",
        "mark",
        "drain/s",
        "flow/s",
        "dbread/s",
        "broker/s",
        "ratio",
        "dbmark/s",
        "cpu/100k",
        "pg/100k",
        "rss MiB",
        "settle",
        "rss end",
        "busy",
        "ok",
        "errs"
    );
    for (key, runs) in groups(drains, DrainResult::key) {
        let m = |f: fn(&DrainResult) -> Option<f64>| median(runs.iter().map(|r| f(r)));
        println!(
            "{key} | {:>8} {:>8} {:>8} {:>8} {:>5} | {:>8} | {:>8} {:>7} {:>7} {:>6} {:>7} | {:>4} {:>4} {:>4}",
            num(m(|r| r.events_per_s), 0),
            num(m(|r| r.flow_eps), 0),
            num(m(|r| r.db_read_eps), 0),
            num(m(|r| r.broker_eps), 0),
            num(m(|r| r.ratio), 2),
            num(m(|r| r.db_mark_eps), 0),
            num(m(|r| r.cpu_s_per_100k), 2),
            num(m(|r| r.pg_cpu_s_per_100k), 2),
            num(m(|r| r.peak_rss_mib), 1),
            num(m(|r| r.settle_s), 1),
            num(m(|r| r.peak_rss_settled_mib), 1),
            percent(m(|r| r.system_busy)),
            ok_runs(&runs, |r| &r.status),
            runs.iter().map(|r| r.errors).sum::<usize>(),
        );
    }
}

fn print_steadies(steadies: &[SteadyResult]) {
    println!("\nSteady state (medians of runs; latency in ms from COMMIT returning)");
    println!(
        "{:<7} {:<8} {:>9} {:>6} {:>6} | {:>27} | {:>27} | {:>8} {:>7} {:>7} {:>4} | {:>4} {:>6} {:>6}",
        "mode",
        "broker",
        "shape",
        "rate",
        "actual",
        "commit->sent_at p50/95/99/max",
        "commit->consumer p50/95/99/max",
        "cpu/100k",
        "pg/100k",
        "rss MiB",
        "busy",
        "ok",
        "unrecv",
        "unmark"
    );
    for (key, runs) in groups(steadies, SteadyResult::key) {
        let m = |f: fn(&SteadyResult) -> Option<f64>| median(runs.iter().map(|r| f(r)));
        println!(
            "{key} {:>6} | {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6} {:>6} {:>6} | {:>8} {:>7} {:>7} {:>4} | {:>4} {:>6} {:>6}",
            num(m(|r| r.achieved_rate), 0),
            num(m(|r| r.sent_at.map(|p| p.p50_ms)), 1),
            num(m(|r| r.sent_at.map(|p| p.p95_ms)), 1),
            num(m(|r| r.sent_at.map(|p| p.p99_ms)), 1),
            num(m(|r| r.sent_at.map(|p| p.max_ms)), 0),
            num(m(|r| r.consumer.map(|p| p.p50_ms)), 1),
            num(m(|r| r.consumer.map(|p| p.p95_ms)), 1),
            num(m(|r| r.consumer.map(|p| p.p99_ms)), 1),
            num(m(|r| r.consumer.map(|p| p.max_ms)), 0),
            num(m(|r| r.cpu_s_per_100k), 2),
            num(m(|r| r.pg_cpu_s_per_100k), 2),
            num(m(|r| r.peak_rss_mib), 1),
            percent(m(|r| r.system_busy)),
            ok_runs(&runs, |r| &r.status),
            runs.iter().map(|r| r.unreceived).sum::<u64>(),
            runs.iter().map(|r| r.unmarked).sum::<u64>(),
        );
    }
}

/// Drain rate and cost per `relay.mark`, when a drain ran with more than one.
fn print_marks(drains: &[DrainResult]) {
    let compared: Vec<_> = groups(drains, DrainResult::comparison_key)
        .into_iter()
        .filter(|(_, runs)| {
            let mut marks: Vec<&str> = runs.iter().map(|r| r.mark.as_str()).collect();
            marks.sort_unstable();
            marks.dedup();
            marks.len() > 1
        })
        .collect();
    if compared.is_empty() {
        return;
    }
    println!(
        "\nMarking (flow events/s, medians of runs; ratios of flow rates within each run; \
         cpu in s per 100k events: relay / PostgreSQL serving it / autovacuum on its database)"
    );
    println!(
        "{:<7} {:<8} {:>9} {:>7} | {:>8} {:>8} {:>8} | {:>11} {:>11} {:>13} | {:>16} {:>16} {:>16}",
        "mode",
        "broker",
        "shape",
        "events",
        "update",
        "delete",
        "none",
        "update/none",
        "delete/none",
        "delete/update",
        "cpu update",
        "cpu delete",
        "cpu none"
    );
    for (key, runs) in compared {
        let of = |mark: &str, f: fn(&DrainResult) -> Option<f64>| {
            median(
                runs.iter()
                    .filter(|r| r.mark == mark && r.status == "ok")
                    .map(|r| f(r)),
            )
        };
        // Ratios within each run, then their median.
        let ratio = |a: &str, b: &str| {
            median(runs.iter().filter(|r| r.mark == a).map(|x| {
                let y = runs.iter().find(|y| y.mark == b && y.run == x.run)?;
                Some(x.flow_eps? / y.flow_eps?)
            }))
        };
        let cpu = |mark: &str| {
            format!(
                "{}/{}/{}",
                num(of(mark, |r| r.cpu_s_per_100k), 2),
                num(of(mark, |r| r.pg_cpu_s_per_100k), 2),
                num(of(mark, |r| r.pg_autovacuum_s_per_100k), 2)
            )
        };
        println!(
            "{key} | {:>8} {:>8} {:>8} | {:>11} {:>11} {:>13} | {:>16} {:>16} {:>16}",
            num(of("update", |r| r.flow_eps), 0),
            num(of("delete", |r| r.flow_eps), 0),
            num(of("none", |r| r.flow_eps), 0),
            num(ratio("update", "none"), 2),
            num(ratio("delete", "none"), 2),
            num(ratio("delete", "update"), 2),
            cpu("update"),
            cpu("delete"),
            cpu("none"),
        );
    }
}

fn print_afters(afters: &[AfterResult]) {
    println!(
        "\nAfter a backlog (medians of runs; the writer started with the relay; latency in ms from COMMIT \
         returning, its events only; ratio = p99 / p99 of the same run without backlog; after drain = \
         commit->sent_at of events committed after the last backlog confirmation (baseline: after the \
         relay's first); pub s = spawn to the first confirmation; behind = how much later than the last \
         backlog event an event committed during the backlog was confirmed)"
    );
    println!(
        "{:<7} {:<8} {:>11} {:>6} | {:>27} {:>5} | {:>27} {:>5} | {:>20} {:>5} | {:>5} {:>7} {:>6} {:>15} | {:>8} {:>7} {:>7} {:>4} | {:>4} {:>6} {:>6}",
        "mode",
        "broker",
        "backlog",
        "actual",
        "commit->sent_at p50/95/99/max",
        "ratio",
        "commit->consumer p50/95/99/max",
        "ratio",
        "after drain p50/99/max",
        "ratio",
        "pub s",
        "drain s",
        "during",
        "behind p99/max",
        "cpu/100k",
        "pg/100k",
        "rss MiB",
        "busy",
        "ok",
        "unrecv",
        "unmark"
    );
    for (key, runs) in groups(afters, AfterResult::key) {
        let m = |f: fn(&AfterResult) -> Option<f64>| median(runs.iter().map(|r| f(r)));
        println!(
            "{key} {:>6} | {:>6} {:>6} {:>6} {:>6} {:>5} | {:>6} {:>6} {:>6} {:>6} {:>5} | {:>6} {:>6} {:>6} {:>5} | {:>5} {:>7} {:>6} {:>7} {:>7} | {:>8} {:>7} {:>7} {:>4} | {:>4} {:>6} {:>6}",
            num(m(|r| r.achieved_rate), 0),
            num(m(|r| r.sent_at.map(|p| p.p50_ms)), 1),
            num(m(|r| r.sent_at.map(|p| p.p95_ms)), 1),
            num(m(|r| r.sent_at.map(|p| p.p99_ms)), 1),
            num(m(|r| r.sent_at.map(|p| p.max_ms)), 0),
            num(m(|r| r.p99_ratio), 2),
            num(m(|r| r.consumer.map(|p| p.p50_ms)), 1),
            num(m(|r| r.consumer.map(|p| p.p95_ms)), 1),
            num(m(|r| r.consumer.map(|p| p.p99_ms)), 1),
            num(m(|r| r.consumer.map(|p| p.max_ms)), 0),
            num(m(|r| r.consumer_p99_ratio), 2),
            num(m(|r| r.after_drain_sent_at.map(|p| p.p50_ms)), 1),
            num(m(|r| r.after_drain_sent_at.map(|p| p.p99_ms)), 1),
            num(m(|r| r.after_drain_sent_at.map(|p| p.max_ms)), 0),
            num(m(|r| r.after_drain_p99_ratio), 2),
            num(m(|r| r.first_sent_s), 1),
            num(m(|r| r.backlog_drain_s), 2),
            num(m(|r| Some(r.committed_during_backlog as f64)), 0),
            num(m(|r| r.behind.map(|p| p.p99_ms)), 0),
            num(m(|r| r.behind.map(|p| p.max_ms)), 0),
            num(m(|r| r.cpu_s_per_100k), 2),
            num(m(|r| r.pg_cpu_s_per_100k), 2),
            num(m(|r| r.peak_rss_mib), 1),
            percent(m(|r| r.system_busy)),
            ok_runs(&runs, |r| &r.status),
            runs.iter().map(|r| r.unreceived).sum::<u64>(),
            runs.iter()
                .map(|r| r.unmarked + r.backlog_unsent)
                .sum::<u64>(),
        );
    }
}

fn percent(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{:.0}%", x * 100.0))
}

/// The targets, each with the medians it was judged on.
pub fn print_targets(report: &Report, one_million: bool) {
    println!("\nTargets (on medians)");
    let verdict = |ok: bool| if ok { "met   " } else { "MISSED" };
    for (key, runs) in groups(&report.drains, DrainResult::key) {
        let ratio = median(runs.iter().map(|r| r.ratio));
        let flow = median(runs.iter().map(|r| r.flow_ratio));
        println!(
            "{} drain >= 70% of the lower ceiling: {key}: {} (flow: {})",
            verdict(ratio.is_some_and(|x| x >= 0.70)),
            num(ratio, 2),
            num(flow, 2)
        );
        if one_million {
            let rss = median(
                runs.iter()
                    .map(|r| r.peak_rss_settled_mib.or(r.peak_rss_mib)),
            );
            let clean = runs.iter().all(|r| r.status == "ok" && r.errors == 0);
            println!(
                "{} 1M backlog: RSS <= 128 MiB and no error: {key}: {} MiB, {}",
                verdict(clean && rss.is_some_and(|x| x <= 128.0)),
                num(rss, 1),
                if clean {
                    "no error"
                } else {
                    "errors or failed runs"
                }
            );
        }
    }
    for (key, runs) in groups(&report.steadies, SteadyResult::key) {
        let first = runs[0];
        let p99 = median(runs.iter().map(|r| r.sent_at.map(|p| p.p99_ms)));
        let limit = match (first.mode, first.rate) {
            ("cdc", 1000) => Some(50.0),
            ("polling", 1000) => Some(100.0),
            _ => None,
        };
        if let Some(limit) = limit {
            println!(
                "{} p99 commit->confirm <= {limit} ms at 1k/s: {key}: {} ms",
                verdict(p99.is_some_and(|x| x <= limit)),
                num(p99, 1)
            );
        }
        let rss = median(runs.iter().map(|r| r.peak_rss_mib));
        println!(
            "{} steady RSS <= 64 MiB: {key}: {} MiB",
            verdict(rss.is_some_and(|x| x <= 64.0)),
            num(rss, 1)
        );
    }
    for (key, runs) in groups(&report.afters, AfterResult::key) {
        if runs[0].is_baseline() {
            continue;
        }
        // Issue 11: 100-event transactions: p99 within 1.2x of no backlog;
        // one-event transactions: nothing waits over 1 s behind the backlog.
        if runs[0].backlog_tx_events > 1 {
            let ratio = median(runs.iter().map(|r| r.p99_ratio));
            println!(
                "{} p99 commit->confirm after a backlog <= 1.2 x without: {key}: {}",
                verdict(ratio.is_some_and(|x| x <= 1.2)),
                num(ratio, 2)
            );
            let ratio = median(runs.iter().map(|r| r.after_drain_p99_ratio));
            println!(
                "{} the same, events committed after the drain: {key}: {}",
                verdict(ratio.is_some_and(|x| x <= 1.2)),
                num(ratio, 2)
            );
        } else {
            // No event committed during the backlog: none waited.
            let behind = median(runs.iter().map(|r| match (r.behind, r.backlog_drain_s) {
                (Some(p), _) => Some(p.max_ms),
                (None, Some(_)) if r.status == "ok" => Some(0.0),
                _ => None,
            }));
            println!(
                "{} no event > 1 s behind the last backlog confirmation: {key}: max {} ms",
                verdict(behind.is_some_and(|x| x <= 1_000.0)),
                num(behind, 0)
            );
        }
    }
}
