//! Steady state: a writer commits events at a fixed rate while the relay
//! runs; latency from each commit to (a) a consumer receiving the message
//! and (b) the relay marking the row, which it does only after the broker
//! confirmed it (`relay_sent_at`, the server's clock at the start of the
//! marking statement).
//!
//! The writer is open-loop: transaction *i* is due at `start + i * interval`
//! whatever happened before, spread over enough connections for the
//! server's group commit to keep up (each commit waits for a WAL flush).
//! Its commit time is taken when COMMIT returns.

use crate::infra::{bounded, connect};
use crate::latency::{Percentiles, Times, watch};
use crate::pgcpu::PgCpu;
use crate::process::{RelayProcess, epoch_micros};
use crate::results::{SteadyResult, Writing};
use crate::stage::{Case, Stage, stop_relay};
use crate::system::CpuTimes;
use crate::workload::{INSERT_SQL, Shape, aggregate_id, event_id, new_tag, payload};
use anyhow::{Result, anyhow};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant, SystemTime};

/// Longest wait, after the writer stops, for the last events to arrive.
const TAIL: Duration = Duration::from_secs(10);

pub async fn run(case: Case<'_>, shape: Shape, rate: u32, run: usize) -> SteadyResult {
    let seconds = case.ctx.plan.seconds;
    let mut result = SteadyResult::new(case.mode, case.broker, shape, rate, seconds, run);
    // Whatever hangs (a service, a consumer), the run goes on: the writer's
    // time, the tail and generous room for setting up and cleaning up.
    let limit = Duration::from_secs(seconds * 2 + 180);
    result.status = case.status(limit, measure(case, shape, &mut result)).await;
    // Latencies at a lower rate than asked say nothing about the asked rate.
    if let Some(actual) = result.writing.achieved_rate
        && result.status == "ok"
        && actual < 0.95 * f64::from(rate)
    {
        result.status = "writer-short".into();
        result.conditions.notes.push(format!(
            "the writer committed {actual:.0} events/s of the {rate} asked: the database or the machine could not take more"
        ));
    }
    result
}

async fn measure(case: Case<'_>, shape: Shape, r: &mut SteadyResult) -> Result<()> {
    let Case { ctx, mode, broker } = case;
    let total = u64::from(r.rate) * r.seconds;
    let mut stage = Stage::new(ctx, mode, broker).await?;
    let times = Arc::new(Times::new(new_tag(), new_tag(), total));
    let inbox = stage.inbox(broker);
    // Consumers stop when dropped, at the end of the scenario.
    let _watchers = watch(&ctx.services, broker, &inbox, times.clone()).await?;
    let mut relay = RelayProcess::spawn(&stage.dir, &stage.env)?;
    let outcome = async {
        warm_up(&stage, &mut relay, &times, ctx.plan.aggregates).await?;
        r.conditions.busy_before = case.quiet(&mut r.conditions).await;
        let perf = case.perf(&r.label(), &relay)?;
        let writer = Writer::new(r.rate, shape, ctx.plan.aggregates, total);
        r.writing.writer_connections = writer.connections;
        let clients = writer.connect(&stage.db.url).await?;
        let machine = CpuTimes::now();
        let pg = PgCpu::start(&ctx.services, &stage.db.name).await?;
        let cpu_before = relay.cpu_seconds();
        let report = writer.run(clients, times.clone()).await?;
        report.note(&mut r.writing);
        r.writing.tail_s = Some(
            wait_tail(&stage, &mut relay, &times, report.events, TAIL)
                .await
                .as_secs_f64(),
        );
        let pg_cpu = pg.totals().await;
        r.conditions.measured_since(machine);
        if let Some(perf) = perf {
            perf.stop().await;
        }
        r.cost.cpu_s_per_100k = match (cpu_before, relay.cpu_seconds()) {
            (Some(a), Some(b)) if report.events > 0 => Some((b - a) / report.events as f64 * 1e5),
            _ => None,
        };
        r.cost.set_pg(pg_cpu, report.events);
        Ok::<_, anyhow::Error>(())
    }
    .await;
    r.peak_rss_mib = relay.peak_rss_mib();
    stage.dir.keep |= stop_relay(&mut relay, &mut r.conditions, outcome.is_err()).await;
    outcome?;
    let got = receipts(&mut stage, &times, 0, &mut r.writing).await?;
    (r.unreceived, r.unmarked) = (got.unreceived, got.unmarked);
    Ok(())
}

/// What became of the writer's events (those with `relay_seq > after`).
pub struct Receipts {
    /// (commit, `relay_sent_at`) in microseconds of each marked event.
    pub marked: Vec<(i64, i64)>,
    pub unreceived: u64,
    pub unmarked: u64,
}

/// The writer's events as the consumer received them and the relay marked
/// them: their latencies into `writing`.
pub async fn receipts(
    stage: &mut Stage,
    times: &Times,
    after: i64,
    writing: &mut Writing,
) -> Result<Receipts> {
    let received = times.received_count.load(Ordering::Relaxed);
    writing.consumer = Percentiles::of(times.consumer_latencies());
    let (marked, unmarked) = marked_times(stage, times, after).await?;
    writing.sent_at = Percentiles::of(marked.iter().map(|(commit, sent)| sent - commit).collect());
    if unmarked > 0 {
        // Worth a look: every confirmed event should have been marked.
        stage.dir.keep = true;
    }
    Ok(Receipts {
        marked,
        unreceived: writing.written.saturating_sub(received),
        unmarked,
    })
}

/// One event through the whole path before measuring: connections made,
/// topic metadata cached, consumer attached.
pub async fn warm_up(
    stage: &Stage,
    relay: &mut RelayProcess,
    times: &Times,
    aggregates: u32,
) -> Result<()> {
    stage
        .db
        .client
        .execute(
            INSERT_SQL,
            &[
                &vec![event_id(times.warmup_tag, 0)],
                &vec![aggregate_id(0, aggregates)],
                &payload(64),
            ],
        )
        .await?;
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(60) {
        relay.ensure_running()?;
        if times.warmup_seen.load(Ordering::Relaxed) && stage.all_sent().await? {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Err(anyhow!(
        "timeout: the warm-up event did not arrive within 60s"
    ))
}

/// Waits (at most `limit`) until every event is received and marked; returns how long it took.
pub async fn wait_tail(
    stage: &Stage,
    relay: &mut RelayProcess,
    times: &Times,
    written: u64,
    limit: Duration,
) -> Duration {
    let start = Instant::now();
    while start.elapsed() < limit && relay.exited().is_none() {
        let received = times.received_count.load(Ordering::Relaxed) >= written;
        if received && stage.all_sent().await.unwrap_or(false) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    start.elapsed()
}

/// (commit, `relay_sent_at`) in microseconds for every marked event of
/// this run's writer with `relay_seq > after`, and how many are unmarked.
pub async fn marked_times(
    stage: &Stage,
    times: &Times,
    after: i64,
) -> Result<(Vec<(i64, i64)>, u64)> {
    // With ranges, the time the batch holding the row was recorded.
    let sent_at = if stage.mark() == "ranges" {
        "(SELECT min(b.at) FROM bench_recorded b WHERE b.seqs @> relay_seq)"
    } else {
        "relay_sent_at"
    };
    let rows = stage
        .db
        .client
        .query(
            &format!(
                "SELECT id, (extract(epoch FROM {sent_at}) * 1000000)::int8, relay_seq FROM outbox WHERE relay_seq > $1 ORDER BY relay_seq"
            ),
            &[&after],
        )
        .await?;
    let mut latencies = Vec::with_capacity(rows.len());
    let mut unmarked = 0;
    for row in rows {
        let (high, seq) = row.get::<_, uuid::Uuid>(0).as_u64_pair();
        if high != times.tag {
            continue;
        }
        let commit = times
            .commit
            .get(seq as usize)
            .map_or(0, |c| c.load(Ordering::Relaxed));
        match row.get::<_, Option<i64>>(1) {
            Some(sent) if commit > 0 => latencies.push((commit, sent)),
            Some(_) => {}
            None => {
                unmarked += 1;
                if unmarked <= 20 {
                    eprintln!(
                        "bench: unmarked row relay_seq={} event #{seq}",
                        row.get::<_, i64>(2)
                    );
                }
            }
        }
    }
    Ok((latencies, unmarked))
}

/// The open-loop writer's plan.
pub struct Writer {
    rate: u32,
    shape: Shape,
    aggregates: u32,
    total: u64,
    pub connections: usize,
}

pub struct WriterReport {
    pub events: u64,
    /// From the first due time to the last commit.
    pub span: Duration,
    /// Longest delay of a transaction's start behind its due time.
    pub max_lag: Duration,
}

impl WriterReport {
    /// What the writer achieved, into the result.
    pub fn note(&self, writing: &mut Writing) {
        writing.written = self.events;
        writing.achieved_rate = Some(self.events as f64 / self.span.as_secs_f64());
        writing.writer_max_lag_ms = Some(self.max_lag.as_secs_f64() * 1e3);
    }
}

impl Writer {
    pub fn new(rate: u32, shape: Shape, aggregates: u32, total: u64) -> Writer {
        // Each commit waits for a WAL flush (~3.5 ms on this disk, much more
        // when other users write): enough connections let the server share
        // one flush among many commits (group commit).
        let tx_per_s = f64::from(rate) / f64::from(shape.tx_events);
        let connections = ((tx_per_s / 40.0).ceil() as usize).clamp(1, 48);
        Writer {
            rate,
            shape,
            aggregates,
            total,
            connections,
        }
    }

    /// The writer's sessions, opened before it starts.
    pub async fn connect(&self, db_url: &str) -> Result<Vec<tokio_postgres::Client>> {
        let mut clients = Vec::with_capacity(self.connections);
        for _ in 0..self.connections {
            clients.push(connect(db_url).await?);
        }
        Ok(clients)
    }

    /// Writes; the first transaction is due 100 ms after the call.
    pub async fn run(
        &self,
        clients: Vec<tokio_postgres::Client>,
        times: Arc<Times>,
    ) -> Result<WriterReport> {
        let per_tx = u64::from(self.shape.tx_events);
        let transactions = self.total.div_ceil(per_tx);
        let interval = Duration::from_secs_f64(per_tx as f64 / f64::from(self.rate));
        let payload: Arc<str> = payload(self.shape.payload).into();
        let start = tokio::time::Instant::now() + Duration::from_millis(100);
        let planned = Duration::from_secs_f64(self.total as f64 / f64::from(self.rate));
        let stop_at = start + planned.mul_f64(1.5);
        let mut tasks = Vec::new();
        for (w, client) in clients.into_iter().enumerate() {
            let (times, payload) = (times.clone(), payload.clone());
            let (total, aggregates, step) = (self.total, self.aggregates, self.connections);
            tasks.push(tokio::spawn(async move {
                let insert = client.prepare(INSERT_SQL).await?;
                let mut max_lag = Duration::ZERO;
                let mut last = SystemTime::now();
                for tx in (w as u64..transactions).step_by(step) {
                    let due = start + interval.mul_f64(tx as f64);
                    tokio::time::sleep_until(due).await;
                    if tokio::time::Instant::now() > stop_at {
                        break; // too far behind: the run reports the rate achieved
                    }
                    max_lag = max_lag.max(tokio::time::Instant::now() - due);
                    let seqs = tx * per_tx..((tx + 1) * per_tx).min(total);
                    let ids: Vec<uuid::Uuid> =
                        seqs.clone().map(|s| event_id(times.tag, s)).collect();
                    let aggs: Vec<String> =
                        seqs.clone().map(|s| aggregate_id(s, aggregates)).collect();
                    client.execute(&insert, &[&ids, &aggs, &&*payload]).await?;
                    last = SystemTime::now();
                    let at = epoch_micros(last);
                    for s in seqs {
                        times.commit[s as usize].store(at, Ordering::Relaxed);
                    }
                }
                Ok::<_, anyhow::Error>((max_lag, last))
            }));
        }
        let start_wall = SystemTime::now() + Duration::from_millis(100);
        let limit = planned.mul_f64(1.5) + Duration::from_secs(30);
        let mut report = WriterReport {
            events: 0,
            span: Duration::ZERO,
            max_lag: Duration::ZERO,
        };
        let mut last = start_wall;
        for task in tasks {
            let (lag, done) =
                bounded(limit, "the steady-state writer", async { task.await? }).await?;
            report.max_lag = report.max_lag.max(lag);
            last = last.max(done);
        }
        report.events = times
            .commit
            .iter()
            .filter(|c| c.load(Ordering::Relaxed) > 0)
            .count() as u64;
        report.span = last
            .duration_since(start_wall)
            .unwrap_or(Duration::from_millis(1));
        Ok(report)
    }
}
