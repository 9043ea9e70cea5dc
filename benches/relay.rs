//! Benchmarks of the release `outbox-relay` binary against the local
//! services (`scripts/services.sh`): backlog drain against the broker's and
//! the database's own ceilings, commit-to-confirm latency at fixed rates,
//! CPU and memory. A command that prints figures, never a test that fails;
//! BENCHMARKS.md records the method and the results.
//!
//! ```sh
//! scripts/services.sh
//! cargo bench --bench relay -- --help
//! cargo bench --bench relay -- --smoke
//! ```
//!
//! `cargo bench` builds the relay binary with the benchmark (release
//! settings) before running it, so the binary measured is never stale; its
//! path and modification time are printed first.

// The modules live in benches/relay/ (a crate root's modules would otherwise be its siblings).
// The kit (unique names) is the tests' own, shared.
#[path = "relay/after.rs"]
mod after;
#[path = "relay/ceiling.rs"]
mod ceiling;
#[path = "relay/drain.rs"]
mod drain;
#[path = "relay/infra.rs"]
mod infra;
#[path = "../tests/kit/mod.rs"]
mod kit;
#[path = "relay/latency.rs"]
mod latency;
#[path = "relay/options.rs"]
mod options;
#[path = "relay/pgcpu.rs"]
mod pgcpu;
#[path = "relay/process.rs"]
mod process;
#[path = "relay/report.rs"]
mod report;
#[path = "relay/results.rs"]
mod results;
#[path = "relay/stage.rs"]
mod stage;
#[path = "relay/steady.rs"]
mod steady;
#[path = "relay/system.rs"]
mod system;
#[path = "relay/tables.rs"]
mod tables;
#[path = "relay/targets.rs"]
mod targets;
#[path = "relay/workload.rs"]
mod workload;

use anyhow::{Context, Result, anyhow};
use clap::Parser;
use infra::{Cleanup, Services, connect, rabbit_connect};
use options::{Backlog, Mark, Mode, Options, Phase, Plan};
use report::Report;
use stage::{Case, Ctx};
use std::process::ExitCode;
use tokio::signal::unix::{SignalKind, signal};

fn main() -> ExitCode {
    let options = Options::parse();
    let plan = options.plan();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(plan, options.json)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(plan: Plan, json: Option<std::path::PathBuf>) -> Result<()> {
    let services = Services::from_env();
    let mut report = Report::new(json);
    report.emit(&environment(&services, &plan).await?);
    preflight(&services, &plan).await?;
    let ctx = Ctx {
        cleanup: Cleanup::new(&services),
        services,
        plan,
    };
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let interrupted = tokio::select! {
        _ = measure_all(&ctx, &mut report) => false,
        _ = term.recv() => true,
        _ = int.recv() => true,
    };
    if interrupted {
        // The scenario's relay was killed when its future was dropped.
        eprintln!("bench: interrupted; removing what the current scenario created");
    }
    ctx.cleanup.run().await;
    report::print_tables(&report);
    targets::print_targets(&report, ctx.plan.one_million);
    if interrupted {
        return Err(anyhow!("interrupted"));
    }
    Ok(())
}

/// Every combination, run 1 of all of them first, then run 2, and so on,
/// so that noise from other users spreads over the combinations.
async fn measure_all(ctx: &Ctx, report: &mut Report) {
    let p = &ctx.plan;
    let steady_per_run = if p.phases.contains(&Phase::Steady) {
        p.rates.len()
    } else {
        0
    };
    let drains = |mode: Mode| -> Vec<Option<Mark>> {
        if !p.phases.contains(&Phase::Drain) {
            return Vec::new();
        }
        p.marks
            .iter()
            .copied()
            .filter(|m| m.is_none_or(|m| m.allowed(mode)))
            .collect()
    };
    let after: Vec<Option<Backlog>> = if p.phases.contains(&Phase::AfterBacklog) {
        std::iter::once(None)
            .chain(p.backlogs.iter().copied().map(Some))
            .collect()
    } else {
        Vec::new()
    };
    if p.marks.contains(&Some(Mark::None)) && p.modes.contains(&Mode::Polling) {
        eprintln!("bench: relay.mark = \"none\" needs CDC; polling drains skip it");
    }
    let per_run: usize = p
        .modes
        .iter()
        .map(|&mode| {
            p.brokers.len() * (p.shapes.len() * (drains(mode).len() + steady_per_run) + after.len())
        })
        .sum();
    let total = per_run * p.runs;
    let mut done = 0;
    for run in 1..=p.runs {
        for &mode in &p.modes {
            for &broker in &p.brokers {
                let case = Case { ctx, mode, broker };
                for &shape in &p.shapes {
                    for mark in drains(mode) {
                        done += 1;
                        eprintln!(
                            "bench: [{done}/{total}] drain {} {} {shape} events={}{} run {run}",
                            mode.name(),
                            broker.name(),
                            p.events,
                            mark.map_or(String::new(), |m| format!(" mark={}", m.name()))
                        );
                        let r = drain::run(case, shape, mark, run).await;
                        eprintln!(
                            "bench:   {} drain/s={:.0} flow/s={:.0} ratio={:.2} rss={:.1}MiB cpu/100k={:.2} pg/100k={:.2}",
                            r.status,
                            r.events_per_s.unwrap_or(f64::NAN),
                            r.flow_eps.unwrap_or(f64::NAN),
                            r.ratio.unwrap_or(f64::NAN),
                            r.peak_rss_settled_mib.unwrap_or(f64::NAN),
                            r.cost.cpu_s_per_100k.unwrap_or(f64::NAN),
                            r.cost.pg_cpu_s_per_100k.unwrap_or(f64::NAN)
                        );
                        report.drain(r);
                    }
                    for &rate in p.rates.iter().take(steady_per_run) {
                        done += 1;
                        eprintln!(
                            "bench: [{done}/{total}] steady {} {} {shape} {rate}/s for {}s run {run}",
                            mode.name(),
                            broker.name(),
                            p.seconds
                        );
                        let r = steady::run(case, shape, rate, run).await;
                        eprintln!(
                            "bench:   {} p99 sent_at={:.1}ms consumer={:.1}ms rss={:.1}MiB pg/100k={:.2}",
                            r.status,
                            r.writing.sent_at.map_or(f64::NAN, |p| p.p99_ms),
                            r.writing.consumer.map_or(f64::NAN, |p| p.p99_ms),
                            r.peak_rss_mib.unwrap_or(f64::NAN),
                            r.cost.pg_cpu_s_per_100k.unwrap_or(f64::NAN)
                        );
                        report.steady(r);
                    }
                }
                let mut baseline: Option<results::AfterResult> = None;
                for &backlog in &after {
                    done += 1;
                    eprintln!(
                        "bench: [{done}/{total}] after-backlog {} {} backlog={} writer {}/s x{} for {}s run {run}",
                        mode.name(),
                        broker.name(),
                        backlog.map_or("none".into(), |b| b.to_string()),
                        p.after_rate,
                        p.after_tx_events,
                        p.seconds
                    );
                    let mut r = after::run(case, backlog, run).await;
                    if let Some(base) = &baseline {
                        r.against(base);
                    }
                    eprintln!(
                        "bench:   {} p99 sent_at={:.1}ms (x{:.2}) consumer={:.1}ms backlog drain={:.2}s behind max={:.0}ms",
                        r.status,
                        r.writing.sent_at.map_or(f64::NAN, |p| p.p99_ms),
                        r.p99_ratio.unwrap_or(f64::NAN),
                        r.writing.consumer.map_or(f64::NAN, |p| p.p99_ms),
                        r.backlog_drain_s.unwrap_or(f64::NAN),
                        r.behind.map_or(f64::NAN, |p| p.max_ms)
                    );
                    if backlog.is_none() {
                        baseline = Some(r.clone());
                    }
                    report.after(r);
                }
            }
        }
    }
}

/// Fails early, with the fix, when a service is missing.
async fn preflight(services: &Services, plan: &Plan) -> Result<()> {
    let hint = "start the services with scripts/services.sh";
    let admin = connect(&services.pg_admin).await.context(hint)?;
    if plan.modes.contains(&Mode::Cdc) {
        let level: String = admin.query_one("SHOW wal_level", &[]).await?.get(0);
        if level != "logical" {
            return Err(anyhow!("wal_level is {level}; CDC needs logical ({hint})"));
        }
    }
    if plan.brokers.contains(&options::BrokerKind::Rabbitmq) {
        let conn = rabbit_connect(services).await.context(hint)?;
        let _ = conn.close(200, "bench preflight".into()).await;
    }
    if plan.brokers.contains(&options::BrokerKind::Kafka) {
        use rdkafka::producer::{BaseProducer, Producer};
        let producer: BaseProducer = rdkafka::ClientConfig::new()
            .set("bootstrap.servers", &services.kafka)
            .create()?;
        tokio::task::spawn_blocking(move || {
            producer
                .client()
                .fetch_metadata(None, std::time::Duration::from_secs(10))
                .map(|_| ())
        })
        .await?
        .with_context(|| format!("no Kafka-protocol broker at {}; {hint}", services.kafka))?;
    }
    Ok(())
}

/// The machine, the versions and the binary, printed and emitted as the first JSON line.
async fn environment(services: &Services, plan: &Plan) -> Result<serde_json::Value> {
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_owned())
        .unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_gib = read("/proc/meminfo")
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next()?.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_owned();
    let postgres: String = match connect(&services.pg_admin).await {
        Ok(c) => c
            .query_one("SHOW server_version", &[])
            .await
            .map(|r| r.get(0))
            .unwrap_or_default(),
        Err(_) => String::new(),
    };
    let binary = process::binary();
    let built = std::fs::metadata(binary)
        .and_then(|m| m.modified())
        .map(|t| chrono::DateTime::<chrono::Utc>::from(t).to_rfc3339())
        .unwrap_or_default();
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .unwrap_or_default()
    };
    let commit = git(&["rev-parse", "--short", "HEAD"]);
    let dirty = git(&[
        "status",
        "--porcelain",
        "--",
        "src",
        "Cargo.toml",
        "Cargo.lock",
    ]);
    let env = serde_json::json!({
        "kind": "environment",
        "date": chrono::Utc::now().to_rfc3339(),
        "cpu": cpu,
        "cores": cores,
        "mem_gib": (mem_gib * 10.0).round() / 10.0,
        "kernel": kernel,
        "postgres": postgres,
        "binary": binary.display().to_string(),
        "binary_built": built,
        "commit": commit,
        "src_modified_files": dirty.lines().count(),
        "events": plan.events,
        "rates": plan.rates,
        "seconds": plan.seconds,
        "runs": plan.runs,
        "aggregates": plan.aggregates,
        "rabbitmq_queue": plan.rabbitmq_queue.name(),
        "smoke": plan.smoke,
        "ceilings": plan.ceilings,
        "phases": plan.phases.iter().map(|p| format!("{p:?}")).collect::<Vec<_>>(),
        "marks": plan.marks.iter().map(|m| m.map_or("default", |m| m.name())).collect::<Vec<_>>(),
        "backlogs": plan.backlogs.iter().map(|b| b.to_string()).collect::<Vec<_>>(),
        "after_rate": plan.after_rate,
        "after_tx_events": plan.after_tx_events,
        "relay_env": plan.relay_env,
    });
    eprintln!(
        "bench: {cpu}, {cores} cores, {mem_gib:.1} GiB, Linux {kernel}, PostgreSQL {postgres}"
    );
    eprintln!(
        "bench: relay binary {} (built {built}), commit {commit}{}",
        binary.display(),
        if dirty.is_empty() {
            ""
        } else {
            " + uncommitted changes"
        }
    );
    Ok(env)
}
