//! After a backlog: how long events committed right after a restart wait
//! while the relay works through what piled up while it was stopped.
//!
//! 1. A consumer is attached, the relay started and one warm-up event sent
//!    all the way through; the relay is stopped (SIGTERM, graceful).
//! 2. The backlog is committed while no relay runs: 256 B events in
//!    transactions of a given size, server-side (as for the drain), then
//!    `VACUUM ANALYZE`. The baseline commits none.
//! 3. The relay is started again and at once (its first transaction is due
//!    100 ms after the spawn) the steady-state writer commits `after_rate`
//!    events/s in `after_tx_events`-event transactions for `seconds`.
//! 4. The benchmark waits until every new event was received and every row
//!    marked (bounded by the backlog's drain timeout).
//!
//! Latencies (commit → consumer receipt, commit → `relay_sent_at`) are over
//! the writer's events only: all of them, and those committed "after the
//! drain" (after the last backlog event's `relay_sent_at`; in the baseline,
//! after the relay's first `relay_sent_at`, i.e. once it publishes; the
//! warm-up relay's clean stop lets it publish at once). "Behind" is, for
//! each new event committed before the last backlog event's
//! `relay_sent_at`, how much later than that its own `relay_sent_at` is (0
//! when earlier): how long it waited for the backlog.

use crate::drain::insert_backlog;
use crate::latency::{Percentiles, Times, watch};
use crate::options::Backlog;
use crate::pgcpu::PgCpu;
use crate::process::{RelayProcess, epoch_micros};
use crate::results::AfterResult;
use crate::stage::{Case, Stage, stop_relay};
use crate::steady::{Writer, receipts, wait_tail, warm_up};
use crate::system::CpuTimes;
use crate::workload::{Shape, new_tag};
use anyhow::{Result, anyhow};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Payload of the backlog's and the writer's events.
const PAYLOAD: usize = 256;

/// `backlog`: `None` for the baseline.
pub async fn run(case: Case<'_>, backlog: Option<Backlog>, run: usize) -> AfterResult {
    let p = &case.ctx.plan;
    let (rate, tx_events) = (p.after_rate, p.after_tx_events);
    let mut result = AfterResult::new(
        case.mode,
        case.broker,
        backlog,
        rate,
        tx_events,
        p.seconds,
        run,
    );
    let events = backlog.map_or(0, |b| b.events);
    // Inserting (a million one-event transactions take a while), the drain,
    // the writer and the tail, and room for setting up and cleaning up.
    let limit =
        p.timeout_for(events) * 2 + Duration::from_secs(p.seconds * 2 + 300 + events / 2_000);
    result.status = case
        .status(limit, measure(case, backlog, &mut result))
        .await;
    result
}

/// The time the last of the rows up to `$1` was marked, and how many are not.
const LAST_BACKLOG_MARKED: &str = "SELECT (extract(epoch FROM max(relay_sent_at)) * 1000000)::int8, \
     count(*) FILTER (WHERE relay_sent_at IS NULL) FROM outbox WHERE relay_seq <= $1";

/// The same with ranges: the last recorded batch naming one of those rows
/// (a later repeat of a row counts, an upper bound), and how many of them
/// no batch names.
const LAST_BACKLOG_RECORDED: &str = "SELECT (extract(epoch FROM max(b.at)) * 1000000)::int8, \
     (SELECT count(*) FROM outbox o WHERE o.relay_seq <= $1 \
        AND NOT COALESCE((SELECT range_agg(r) FROM bench_recorded, unnest(seqs) r) @> o.relay_seq, false)) \
     FROM bench_recorded b WHERE b.seqs && int8multirange(int8range(NULL, $1, '(]'))";

async fn measure(case: Case<'_>, backlog: Option<Backlog>, r: &mut AfterResult) -> Result<()> {
    let Case { ctx, mode, broker } = case;
    let p = &ctx.plan;
    let total = u64::from(r.rate) * r.seconds;
    let mut stage = Stage::new(ctx, mode, broker).await?;
    r.mark = stage.mark();
    let times = Arc::new(Times::new(new_tag(), new_tag(), total));
    let _watchers = watch(&ctx.services, broker, &stage.inbox(broker), times.clone()).await?;

    // Connections, topic metadata and the consumer warm; then the outage.
    let mut relay = RelayProcess::spawn(&stage.dir, &stage.env)?;
    let warm = warm_up(&stage, &mut relay, &times, p.aggregates).await;
    let stopped = relay.stop().await;
    warm?;
    if !stopped?.success() {
        return Err(anyhow!("the warm-up relay did not exit cleanly"));
    }
    drop(relay);

    if let Some(b) = backlog {
        let started = std::time::Instant::now();
        insert_backlog(
            &stage,
            Shape::new(PAYLOAD, b.tx_events),
            b.events,
            p.aggregates,
        )
        .await?;
        r.insert_s = Some(started.elapsed().as_secs_f64());
    }
    // Everything up to here is the backlog (and the warm-up event).
    let backlog_last_seq: i64 = stage
        .db
        .client
        .query_one("SELECT coalesce(max(relay_seq), 0) FROM outbox", &[])
        .await?
        .get(0);

    let writer = Writer::new(
        r.rate,
        Shape::new(PAYLOAD, r.tx_events),
        p.aggregates,
        total,
    );
    r.writing.writer_connections = writer.connections;
    let clients = writer.connect(&stage.db.url).await?;
    r.conditions.busy_before = case.quiet(&mut r.conditions).await;

    let machine = CpuTimes::now();
    let pg = PgCpu::start(&ctx.services, &stage.db.name).await?;
    let mut relay = RelayProcess::spawn(&stage.dir, &stage.env)?;
    let outcome = async {
        let perf = case.perf(&r.label(), &relay)?;
        let report = writer.run(clients, times.clone()).await?;
        report.note(&mut r.writing);
        let limit = p.timeout_for(backlog.map_or(0, |b| b.events));
        let tail = wait_tail(&stage, &mut relay, &times, report.events, limit).await;
        r.writing.tail_s = Some(tail.as_secs_f64());
        let pg_cpu = pg.totals().await;
        r.conditions.measured_since(machine);
        if let Some(perf) = perf {
            perf.stop().await;
        }
        // Everything the relay did since its start: the backlog and the new events.
        let events = backlog.map_or(0, |b| b.events) + report.events;
        let per_100k = |s: f64| s / events.max(1) as f64 * 1e5;
        r.cost.cpu_s_per_100k = relay.cpu_seconds().map(per_100k);
        r.cost.set_pg(pg_cpu, events);
        Ok::<_, anyhow::Error>(())
    }
    .await;
    r.peak_rss_mib = relay.peak_rss_mib();
    stage.dir.keep |= stop_relay(&mut relay, &mut r.conditions, outcome.is_err()).await;
    outcome?;

    let got = receipts(&mut stage, &times, backlog_last_seq, &mut r.writing).await?;
    (r.unreceived, r.unmarked) = (got.unreceived, got.unmarked);
    let marked = got.marked;
    let spawned = epoch_micros(relay.spawned_at);
    let first_new = marked.iter().map(|(_, sent)| *sent).min();
    r.first_new_sent_s = first_new.map(|s| (s - spawned) as f64 / 1e6);
    let ranges = stage.mark() == "ranges";
    let first_sent: Option<i64> = stage
        .db
        .client
        .query_one(
            if ranges {
                "SELECT (extract(epoch FROM min(at)) * 1000000)::int8 FROM bench_recorded WHERE at >= to_timestamp($1::float8)"
            } else {
                "SELECT (extract(epoch FROM min(relay_sent_at)) * 1000000)::int8 FROM outbox WHERE relay_sent_at >= to_timestamp($1::float8)"
            },
            &[&(spawned as f64 / 1e6)],
        )
        .await?
        .get(0);
    r.first_sent_s = first_sent.map(|s| (s - spawned) as f64 / 1e6);
    // "After the drain": events committed once the backlog was confirmed or,
    // without one, once the relay confirmed anything (it was publishing).
    let mut cut = first_sent;
    if backlog.is_some() {
        let row = stage
            .db
            .client
            .query_one(
                if ranges {
                    LAST_BACKLOG_RECORDED
                } else {
                    LAST_BACKLOG_MARKED
                },
                &[&backlog_last_seq],
            )
            .await?;
        let last_backlog: Option<i64> = row.get(0);
        r.backlog_unsent = row.get::<_, i64>(1) as u64;
        cut = last_backlog;
        if let Some(last) = last_backlog {
            r.backlog_drain_s = Some((last - spawned) as f64 / 1e6);
            let behind: Vec<i64> = marked
                .iter()
                .filter(|(commit, _)| *commit < last)
                .map(|(_, sent)| sent - last)
                .collect();
            r.committed_during_backlog = behind.len() as u64;
            r.behind = Percentiles::of(behind);
        }
    }
    if let Some(cut) = cut {
        r.after_drain_sent_at = Percentiles::of(
            marked
                .iter()
                .filter(|(commit, _)| *commit >= cut)
                .map(|(commit, sent)| sent - commit)
                .collect(),
        );
        r.after_drain_consumer = Percentiles::of(
            times
                .commit
                .iter()
                .zip(&times.received)
                .filter_map(|(c, rcv)| {
                    let (c, rcv) = (c.load(Ordering::Relaxed), rcv.load(Ordering::Relaxed));
                    (c >= cut && rcv > 0).then_some(rcv - c)
                })
                .collect(),
        );
    }
    Ok(())
}
