//! The median-of-runs tables. BENCHMARKS.md quotes them, so their layout is
//! part of the output: each is one [`Table`] of column groups separated by
//! `|`, a row beginning with its key under the first group's headings.

use crate::latency::Percentiles;
use crate::report::{groups, median, num, percent};
use crate::results::{AfterResult, DrainResult, Measured, SteadyResult};

#[derive(Clone, Copy)]
enum Align {
    Left,
    Right,
}

fn pad(text: &str, width: usize, align: Align) -> String {
    match align {
        Align::Left => format!("{text:<width$}"),
        Align::Right => format!("{text:>width$}"),
    }
}

/// A heading: its text, its width and where the text stands in it. A heading
/// may span several cells (one latency heading over four values).
struct Head(&'static str, usize, Align);

/// A cell's text for a row's runs.
type Text<'a, R> = Box<dyn Fn(&[&R]) -> String + 'a>;

/// A column of the rows: its width (right-aligned) and its text.
struct Cell<'a, R>(usize, Text<'a, R>);

/// Columns between two `|`.
struct Group<'a, R> {
    heads: Vec<Head>,
    cells: Vec<Cell<'a, R>>,
}

impl<'a, R> Group<'a, R> {
    fn new(heads: Vec<Head>, cells: Vec<Cell<'a, R>>) -> Self {
        Group { heads, cells }
    }

    /// More columns in the same group.
    fn and(mut self, more: Group<'a, R>) -> Self {
        self.heads.extend(more.heads);
        self.cells.extend(more.cells);
        self
    }

    /// Columns side by side, in one group.
    fn of(columns: impl IntoIterator<Item = Group<'a, R>>) -> Self {
        columns
            .into_iter()
            .fold(Group::new(Vec::new(), Vec::new()), Group::and)
    }
}

/// Prints the title, the headings and one row per key.
fn print_table<R>(title: &str, table: &[Group<R>], rows: Vec<(String, Vec<&R>)>) {
    println!("\n{title}");
    let heads: Vec<String> = table
        .iter()
        .map(|g| {
            let cells: Vec<String> = g.heads.iter().map(|h| pad(h.0, h.1, h.2)).collect();
            cells.join(" ")
        })
        .collect();
    println!("{}", heads.join(" | "));
    for (key, runs) in rows {
        let mut line = key;
        for (i, group) in table.iter().enumerate() {
            if i > 0 {
                line.push_str(" |");
            }
            for Cell(width, text) in &group.cells {
                line.push(' ');
                line.push_str(&pad(&text(&runs), *width, Align::Right));
            }
        }
        println!("{line}");
    }
}

fn left(text: &'static str, width: usize) -> Head {
    Head(text, width, Align::Left)
}

fn right(text: &'static str, width: usize) -> Head {
    Head(text, width, Align::Right)
}

/// A cell computed from the runs.
fn cell<'a, R>(width: usize, text: impl Fn(&[&R]) -> String + 'a) -> Cell<'a, R> {
    Cell(width, Box::new(text))
}

/// A cell holding the median of the runs' values.
fn median_of<'a, R>(
    width: usize,
    decimals: usize,
    value: impl Fn(&R) -> Option<f64> + 'a,
) -> Cell<'a, R> {
    cell(width, move |runs: &[&R]| {
        num(median(runs.iter().map(|r| value(r))), decimals)
    })
}

/// The key columns every table starts with.
fn key_heads(more: &[Head]) -> Vec<Head> {
    let mut heads = vec![left("mode", 7), left("broker", 8)];
    heads.extend(more.iter().map(|h| Head(h.0, h.1, h.2)));
    heads
}

/// A latency's p50/95/99/max under one heading.
fn latency<'a, R: 'a>(head: &'static str, of: fn(&R) -> Option<Percentiles>) -> Group<'a, R> {
    let at =
        move |decimals, p: fn(Percentiles) -> f64| median_of(6, decimals, move |r| of(r).map(p));
    Group::new(
        vec![right(head, 27)],
        vec![
            at(1, |p| p.p50_ms),
            at(1, |p| p.p95_ms),
            at(1, |p| p.p99_ms),
            at(0, |p| p.max_ms),
        ],
    )
}

/// One column of medians.
fn column<'a, R: 'a>(
    head: &'static str,
    width: usize,
    decimals: usize,
    of: fn(&R) -> Option<f64>,
) -> Group<'a, R> {
    Group::new(
        vec![right(head, width)],
        vec![median_of(width, decimals, of)],
    )
}

/// The relay's and PostgreSQL's CPU, the relay's memory, the machine's load.
fn cost<'a, R: Measured + 'a>() -> Group<'a, R> {
    let col = column::<R>;
    Group::of([
        col("cpu/100k", 8, 2, |r| r.cost().cpu_s_per_100k),
        col("pg/100k", 7, 2, |r| r.cost().pg_cpu_s_per_100k),
        col("rss MiB", 7, 1, |r| r.peak_rss_mib()),
        Group::new(vec![right("busy", 4)], vec![busy()]),
        Group::new(vec![right("steal", 5)], vec![steal()]),
    ])
}

fn busy<'a, R: Measured + 'a>() -> Cell<'a, R> {
    cell(4, |runs: &[&R]| {
        percent(median(runs.iter().map(|r| r.conditions().system_busy)))
    })
}

/// The hypervisor's share of the machine while measuring (part of "busy").
fn steal<'a, R: Measured + 'a>() -> Cell<'a, R> {
    cell(5, |runs: &[&R]| {
        percent(median(runs.iter().map(|r| r.conditions().steal)))
    })
}

/// Runs that ended well, of all.
fn ok_runs<'a, R: Measured + 'a>() -> Cell<'a, R> {
    cell(4, |runs: &[&R]| {
        let ok = runs.iter().filter(|r| r.status() == "ok").count();
        format!("{ok}/{}", runs.len())
    })
}

/// A count summed over the runs.
fn total<'a, R: 'a>(width: usize, of: fn(&R) -> u64) -> Cell<'a, R> {
    cell(width, move |runs: &[&R]| {
        runs.iter().map(|r| of(r)).sum::<u64>().to_string()
    })
}

/// Runs that ended well, and events never received or never marked.
fn outcome<'a, R: Measured + 'a>(
    unreceived: fn(&R) -> u64,
    unmarked: fn(&R) -> u64,
) -> Group<'a, R> {
    Group::new(
        vec![right("ok", 4), right("unrecv", 6), right("unmark", 6)],
        vec![ok_runs(), total(6, unreceived), total(6, unmarked)],
    )
}

pub fn print_drains(drains: &[DrainResult]) {
    let col = column::<DrainResult>;
    let table = [
        Group::new(
            key_heads(&[right("shape", 9), right("events", 7), left("mark", 6)]),
            vec![],
        ),
        Group::of([
            col("drain/s", 8, 0, |r| r.events_per_s),
            col("flow/s", 8, 0, |r| r.flow_eps),
            col("dbread/s", 8, 0, |r| r.db_read_eps),
            col("broker/s", 8, 0, |r| r.broker_eps),
            col("ratio", 5, 2, |r| r.ratio),
        ]),
        Group::of([
            col("dbmark/s", 8, 0, |r| r.db_mark_eps),
            col("dbrec/s", 8, 0, |r| r.db_record_eps),
            col("scat/s", 8, 0, |r| r.db_record_scattered_eps),
            col("fold/s", 8, 0, |r| r.db_fold_eps),
        ]),
        Group::of([
            col("cpu/100k", 8, 2, |r| r.cost.cpu_s_per_100k),
            col("pg/100k", 7, 2, |r| r.cost.pg_cpu_s_per_100k),
            col("rss MiB", 7, 1, |r| r.peak_rss_mib),
            col("settle", 6, 1, |r| r.settle_s),
            col("rss end", 7, 1, |r| r.peak_rss_settled_mib),
        ]),
        Group::new(
            vec![right("busy", 4), right("ok", 4), right("errs", 4)],
            vec![
                busy(),
                ok_runs(),
                total(4, |r: &DrainResult| r.conditions.errors as u64),
            ],
        ),
    ];
    print_table(
        "Backlog drain (medians of runs; ratio = drain / min(db read, broker publish), per run; \
         flow = from the first message on the broker (after the relay's start-up); \
         cpu/100k: the relay's CPU s per 100k events, pg/100k: PostgreSQL's serving it)",
        &table,
        groups(drains, DrainResult::key),
    );
}

pub fn print_steadies(steadies: &[SteadyResult]) {
    let table = [
        Group::new(
            key_heads(&[right("shape", 9), right("rate", 6), right("actual", 6)]),
            vec![median_of(6, 0, |r: &SteadyResult| r.writing.achieved_rate)],
        ),
        latency("commit->sent_at p50/95/99/max", |r: &SteadyResult| {
            r.writing.sent_at
        }),
        latency("commit->consumer p50/95/99/max", |r: &SteadyResult| {
            r.writing.consumer
        }),
        cost(),
        outcome(|r: &SteadyResult| r.unreceived, |r| r.unmarked),
    ];
    print_table(
        "Steady state (medians of runs; latency in ms from COMMIT returning)",
        &table,
        groups(steadies, SteadyResult::key),
    );
}

/// Drain rate and cost per `relay.mark`, when a drain ran with more than one.
pub fn print_marks(drains: &[DrainResult]) {
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
    fn of(runs: &[&DrainResult], mark: &str, f: fn(&DrainResult) -> Option<f64>) -> Option<f64> {
        median(
            runs.iter()
                .filter(|r| r.mark == mark && r.status == "ok")
                .map(|r| f(r)),
        )
    }
    let flow = |mark: &'static str| {
        cell(8, move |runs: &[&DrainResult]| {
            num(of(runs, mark, |r| r.flow_eps), 0)
        })
    };
    // Ratios within each run, then their median.
    let within = |width: usize, a: &'static str, b: &'static str| {
        cell(width, move |runs: &[&DrainResult]| {
            num(
                median(runs.iter().filter(|r| r.mark == a).map(|x| {
                    let y = runs.iter().find(|y| y.mark == b && y.run == x.run)?;
                    Some(x.flow_eps? / y.flow_eps?)
                })),
                2,
            )
        })
    };
    let cpu = |mark: &'static str| {
        cell(16, move |runs: &[&DrainResult]| {
            format!(
                "{}/{}/{}",
                num(of(runs, mark, |r| r.cost.cpu_s_per_100k), 2),
                num(of(runs, mark, |r| r.cost.pg_cpu_s_per_100k), 2),
                num(of(runs, mark, |r| r.cost.pg_autovacuum_s_per_100k), 2)
            )
        })
    };
    let table = [
        Group::new(key_heads(&[right("shape", 9), right("events", 7)]), vec![]),
        Group::new(
            vec![
                right("update", 8),
                right("delete", 8),
                right("none", 8),
                right("ranges", 8),
            ],
            vec![flow("update"), flow("delete"), flow("none"), flow("ranges")],
        ),
        Group::new(
            vec![
                right("update/none", 11),
                right("delete/none", 11),
                right("delete/update", 13),
                right("ranges/update", 13),
                right("ranges/none", 11),
            ],
            vec![
                within(11, "update", "none"),
                within(11, "delete", "none"),
                within(13, "delete", "update"),
                within(13, "ranges", "update"),
                within(11, "ranges", "none"),
            ],
        ),
        Group::new(
            vec![
                right("cpu update", 16),
                right("cpu delete", 16),
                right("cpu none", 16),
                right("cpu ranges", 16),
            ],
            vec![cpu("update"), cpu("delete"), cpu("none"), cpu("ranges")],
        ),
    ];
    print_table(
        "Marking (flow events/s, medians of runs; ratios of flow rates within each run; \
         cpu in s per 100k events: relay / PostgreSQL serving it / autovacuum on its database)",
        &table,
        compared,
    );
}

pub fn print_afters(afters: &[AfterResult]) {
    let col = column::<AfterResult>;
    let after_drain = |decimals, p: fn(Percentiles) -> f64| {
        median_of(6, decimals, move |r: &AfterResult| {
            r.after_drain_sent_at.map(p)
        })
    };
    let table = [
        Group::new(
            key_heads(&[right("backlog", 11), right("actual", 6)]),
            vec![median_of(6, 0, |r: &AfterResult| r.writing.achieved_rate)],
        ),
        latency("commit->sent_at p50/95/99/max", |r: &AfterResult| {
            r.writing.sent_at
        })
        .and(col("ratio", 5, 2, |r| r.p99_ratio)),
        latency("commit->consumer p50/95/99/max", |r: &AfterResult| {
            r.writing.consumer
        })
        .and(col("ratio", 5, 2, |r| r.consumer_p99_ratio)),
        Group::new(
            vec![right("after drain p50/99/max", 20)],
            vec![
                after_drain(1, |p| p.p50_ms),
                after_drain(1, |p| p.p99_ms),
                after_drain(0, |p| p.max_ms),
            ],
        )
        .and(col("ratio", 5, 2, |r| r.after_drain_p99_ratio)),
        Group::of([
            col("pub s", 5, 1, |r| r.first_sent_s),
            col("drain s", 7, 2, |r| r.backlog_drain_s),
            col("during", 6, 0, |r| Some(r.committed_during_backlog as f64)),
            Group::new(
                vec![right("behind p99/max", 15)],
                vec![
                    median_of(7, 0, |r: &AfterResult| r.behind.map(|p| p.p99_ms)),
                    median_of(7, 0, |r: &AfterResult| r.behind.map(|p| p.max_ms)),
                ],
            ),
        ]),
        cost(),
        outcome(
            |r: &AfterResult| r.unreceived,
            |r| r.unmarked + r.backlog_unsent,
        ),
    ];
    print_table(
        "After a backlog (medians of runs; the writer started with the relay; latency in ms from COMMIT \
         returning, its events only; ratio = p99 / p99 of the same run without backlog; after drain = \
         commit->sent_at of events committed after the last backlog confirmation (baseline: after the \
         relay's first); pub s = spawn to the first confirmation; behind = how much later than the last \
         backlog event an event committed during the backlog was confirmed)",
        &table,
        groups(afters, AfterResult::key),
    );
}
