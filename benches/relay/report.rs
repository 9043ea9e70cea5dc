//! Results: one JSON line each as they come, then tables of medians
//! (tables.rs) and the targets, met or missed (targets.rs).

use crate::results::{AfterResult, DrainResult, Measured, SteadyResult};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;

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
pub fn groups<T>(items: &[T], key: impl Fn(&T) -> String) -> Vec<(String, Vec<&T>)> {
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

pub fn num(v: Option<f64>, decimals: usize) -> String {
    v.map_or("-".into(), |x| format!("{x:.decimals$}"))
}

pub fn percent(v: Option<f64>) -> String {
    v.map_or("-".into(), |x| format!("{:.0}%", x * 100.0))
}

/// The median-of-runs tables (the JSON lines hold every run), then a note
/// for each run that failed or noted something.
pub fn print_tables(report: &Report) {
    if !report.drains.is_empty() {
        crate::tables::print_drains(&report.drains);
        crate::tables::print_marks(&report.drains);
    }
    if !report.steadies.is_empty() {
        crate::tables::print_steadies(&report.steadies);
    }
    if !report.afters.is_empty() {
        crate::tables::print_afters(&report.afters);
    }
    print_notes("drain", &report.drains);
    print_notes("steady", &report.steadies);
    print_notes("after-backlog", &report.afters);
}

fn print_notes<R: Measured>(kind: &str, results: &[R]) {
    for r in results {
        let notes = &r.conditions().notes;
        if r.status() != "ok" || !notes.is_empty() {
            println!(
                "note: {kind} {} run {}: {} {:?}",
                r.key(),
                r.run(),
                r.status(),
                notes
            );
        }
    }
}
