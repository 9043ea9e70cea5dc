//! Results: one JSON line each as they come, then tables of medians and the
//! issue's targets, met or missed.

use crate::latency::Percentiles;
use crate::options::{BrokerKind, Mode};
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
    pub run: usize,
    /// `ok`, or what went wrong.
    pub status: String,
    pub insert_s: Option<f64>,
    /// Relay spawn → last `relay_sent_at`.
    pub drain_s: Option<f64>,
    /// Relay spawn → first `relay_sent_at` (start-up, first batch).
    pub first_mark_s: Option<f64>,
    pub events_per_s: Option<f64>,
    pub db_read_eps: Option<f64>,
    pub broker_eps: Option<f64>,
    /// Not part of the ratio: the database's rate of marking rows sent.
    pub db_mark_eps: Option<f64>,
    /// `events_per_s` / min(`db_read_eps`, `broker_eps`).
    pub ratio: Option<f64>,
    /// Relay CPU (user + system) from spawn to the last mark, per 100k events.
    pub cpu_s_per_100k: Option<f64>,
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
            run,
            status: "ok".into(),
            insert_s: None,
            drain_s: None,
            first_mark_s: None,
            events_per_s: None,
            db_read_eps: None,
            broker_eps: None,
            db_mark_eps: None,
            ratio: None,
            cpu_s_per_100k: None,
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
            "drain-{}-{}-{}x{}-{}-run{}",
            self.mode, self.broker, self.payload, self.tx_events, self.events, self.run
        )
    }

    fn key(&self) -> String {
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

/// Collects results, printing each as a JSON line (and appending it to a file).
pub struct Report {
    pub drains: Vec<DrainResult>,
    pub steadies: Vec<SteadyResult>,
    json: Option<PathBuf>,
}

impl Report {
    pub fn new(json: Option<PathBuf>) -> Report {
        Report {
            drains: Vec::new(),
            steadies: Vec::new(),
            json,
        }
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
    if !report.steadies.is_empty() {
        print_steadies(&report.steadies);
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
}

fn print_drains(drains: &[DrainResult]) {
    println!(
        "\nBacklog drain (medians of runs; ratio = drain / min(db read, broker publish), per run)"
    );
    println!(
        "{:<7} {:<8} {:>9} {:>7} | {:>8} {:>8} {:>8} {:>5} | {:>8} | {:>8} {:>7} {:>6} {:>7} | {:>4} {:>4} {:>4}",
        "mode",
        "broker",
        "shape",
        "events",
        "drain/s",
        "dbread/s",
        "broker/s",
        "ratio",
        "dbmark/s",
        "cpu/100k",
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
            "{key} | {:>8} {:>8} {:>8} {:>5} | {:>8} | {:>8} {:>7} {:>6} {:>7} | {:>4} {:>4} {:>4}",
            num(m(|r| r.events_per_s), 0),
            num(m(|r| r.db_read_eps), 0),
            num(m(|r| r.broker_eps), 0),
            num(m(|r| r.ratio), 2),
            num(m(|r| r.db_mark_eps), 0),
            num(m(|r| r.cpu_s_per_100k), 2),
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
        "{:<7} {:<8} {:>9} {:>6} {:>6} | {:>27} | {:>27} | {:>8} {:>7} {:>4} | {:>4} {:>6} {:>6}",
        "mode",
        "broker",
        "shape",
        "rate",
        "actual",
        "commit->sent_at p50/95/99/max",
        "commit->consumer p50/95/99/max",
        "cpu/100k",
        "rss MiB",
        "busy",
        "ok",
        "unrecv",
        "unmark"
    );
    for (key, runs) in groups(steadies, SteadyResult::key) {
        let m = |f: fn(&SteadyResult) -> Option<f64>| median(runs.iter().map(|r| f(r)));
        println!(
            "{key} {:>6} | {:>6} {:>6} {:>6} {:>6} | {:>6} {:>6} {:>6} {:>6} | {:>8} {:>7} {:>4} | {:>4} {:>6} {:>6}",
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
            num(m(|r| r.peak_rss_mib), 1),
            percent(m(|r| r.system_busy)),
            ok_runs(&runs, |r| &r.status),
            runs.iter().map(|r| r.unreceived).sum::<u64>(),
            runs.iter().map(|r| r.unmarked).sum::<u64>(),
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
        println!(
            "{} drain >= 70% of the lower ceiling: {key}: {}",
            verdict(ratio.is_some_and(|x| x >= 0.70)),
            num(ratio, 2)
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
}
