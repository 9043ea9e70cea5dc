//! The targets, each judged on the medians of its runs.

use crate::report::{Report, groups, median, num};
use crate::results::{AfterResult, DrainResult, Measured, SteadyResult};

/// The targets, each with the medians it was judged on.
pub fn print_targets(report: &Report, one_million: bool) {
    println!("\nTargets (on medians)");
    let verdict = |ok: bool| if ok { "met   " } else { "MISSED" };
    for (key, runs) in groups(&report.drains, DrainResult::key) {
        let ratio = median(runs.iter().map(|r| r.ratio));
        let flow = median(runs.iter().map(|r| r.flow_ratio));
        match ratio {
            Some(ratio) => println!(
                "{} drain >= 70% of the lower ceiling: {key}: {} (flow: {})",
                verdict(ratio >= 0.70),
                num(Some(ratio), 2),
                num(flow, 2)
            ),
            None => println!(
                "not measured: drain >= 70% of the lower ceiling: {key}: no ceiling (--no-ceilings, or it failed)"
            ),
        }
        if one_million {
            let rss = median(
                runs.iter()
                    .map(|r| r.peak_rss_settled_mib.or(r.peak_rss_mib)),
            );
            let clean = runs
                .iter()
                .all(|r| r.status == "ok" && r.conditions.errors == 0);
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
        let p99 = median(runs.iter().map(|r| r.writing.sent_at.map(|p| p.p99_ms)));
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
