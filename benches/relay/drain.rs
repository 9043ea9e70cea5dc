//! Backlog drain: N events committed while no relay runs, then the relay
//! started; the time from its spawn to the last row marked sent.
//!
//! Before the relay starts, on the same backlog: the database's read
//! ceiling, and the broker's publish ceiling (on a destination of its own,
//! removed before the relay starts). Nothing consumes during the drain, so
//! the benchmark process takes no CPU from the relay.
//!
//! The end of the drain: the last `relay_sent_at` with `relay.mark =
//! "update"`; with "delete", the 50 ms poll that found no row left; with
//! "none" (CDC), the 50 ms poll that found every event on the broker. The
//! "flow" rate runs from the 50 ms poll that found the first message on the
//! broker to that end: without the relay's start-up (connecting, claiming
//! the outbox; `migrate` created it, so its first owner waits no lease).

use crate::ceiling;
use crate::infra::{BrokerCount, Services, bounded};
use crate::options::{BrokerKind, Mark};
use crate::pgcpu::PgCpu;
use crate::process::{RelayProcess, epoch_micros};
use crate::results::DrainResult;
use crate::stage::{Case, Ctx, Stage, create_destination, mark_in, stop_relay};
use crate::system::CpuTimes;
use crate::workload::{Shape, backlog_sql, new_tag, relay_messages};
use anyhow::{Result, anyhow};
use std::time::{Duration, Instant, SystemTime};

/// Messages published for the broker ceiling, at most: enough for a steady rate.
const CEILING_MAX: u64 = 200_000;

pub async fn run(case: Case<'_>, shape: Shape, mark: Option<Mark>, run: usize) -> DrainResult {
    let plan = &case.ctx.plan;
    let mut result = DrainResult::new(case.mode, case.broker, shape, plan.events, run);
    result.mark = mark.map_or_else(|| mark_in(&plan.relay_env), |m| m.name().to_owned());
    // Whatever hangs, the run goes on: the drain's own limit plus room for
    // inserting the backlog, the ceilings and cleaning up.
    let limit = plan.drain_timeout * 3 + std::time::Duration::from_secs(300);
    result.status = case
        .status(limit, measure(case, shape, mark, &mut result))
        .await;
    result
}

async fn measure(
    case: Case<'_>,
    shape: Shape,
    mark: Option<Mark>,
    r: &mut DrainResult,
) -> Result<()> {
    let Case { ctx, mode, broker } = case;
    let events = ctx.plan.events;
    let mut stage = Stage::with_mark(ctx, mode, broker, mark).await?;
    let started = Instant::now();
    insert_backlog(&stage, shape, events, ctx.plan.aggregates).await?;
    r.insert_s = Some(started.elapsed().as_secs_f64());

    if ctx.plan.ceilings {
        case.quiet(&mut r.conditions).await;
        r.db_read_eps = Some(ceiling::database(&stage.db.url, events).await?);
        r.db_mark_eps = Some(ceiling::database_mark(&stage.db.url, events).await?);
        let record = ceiling::database_record(&stage.db.url, events).await?;
        r.db_record_eps = Some(record.contiguous_eps);
        r.db_record_scattered_eps = Some(record.scattered_eps);
        r.db_fold_eps = Some(record.fold_eps);
        r.broker_eps = Some(broker_ceiling(ctx, broker, shape).await?);
    }

    // The broker's count of messages: when the first arrived, and with mark =
    // "none", where nothing in the table changes, when all did.
    let counter = match broker {
        BrokerKind::Kafka => BrokerCount::kafka(&ctx.services, &stage.inbox(broker)).await?,
        BrokerKind::Rabbitmq => BrokerCount::rabbitmq(&ctx.services, &stage.inbox(broker)).await?,
    };
    let by_broker = stage.mark() == "none";
    r.end_from = match stage.mark().as_str() {
        "none" if counter.exact() => "broker holds every event (50 ms poll)",
        "none" => "last change of the topic's high watermarks (50 ms poll), then read back",
        "delete" => "no row left (50 ms poll)",
        "ranges" => "last recorded batch",
        _ => "last relay_sent_at",
    };

    r.conditions.busy_before = case.quiet(&mut r.conditions).await;
    let machine = CpuTimes::now();
    let pg = PgCpu::start(&ctx.services, &stage.db.name).await?;
    let mut relay = RelayProcess::spawn(&stage.dir, &stage.env)?;
    let perf = case.perf(&r.label(), &relay)?;
    let outcome = wait_drained(ctx, &stage, &mut relay, &counter, by_broker).await;
    if let Some(perf) = perf {
        perf.stop().await;
    }
    let cpu = relay.cpu_seconds();
    let pg_cpu = pg.totals().await;
    r.conditions.measured_since(machine);
    r.peak_rss_mib = relay.peak_rss_mib();
    let (seen, first_on_broker) = match outcome {
        Ok(seen) => seen,
        Err(e) => {
            stage.dir.keep = true;
            stop_relay(&mut relay, &mut r.conditions, false).await;
            return Err(e);
        }
    };
    let spawned = epoch_micros(relay.spawned_at) as f64 / 1e6;
    if by_broker && !counter.exact() {
        let topic = stage.inbox(broker);
        let held = BrokerCount::read_all(&ctx.services, &topic).await?;
        if held < events {
            return Err(anyhow!(
                "the broker's count stood still for 2s, but the topic holds {held} of {events} events"
            ));
        }
    }
    let (first, last) = if by_broker {
        (None, None)
    } else {
        mark_times(&stage).await?
    };
    // With relay.mark = "delete" no row is left to say when: the poll that saw none.
    let last = last.unwrap_or(epoch_micros(seen) as f64 / 1e6);
    r.drain_s = Some(last - spawned);
    r.first_mark_s = first.map(|f| f - spawned);
    r.events_per_s = Some(events as f64 / (last - spawned));
    if let Some(at) = first_on_broker {
        let at = epoch_micros(at) as f64 / 1e6;
        r.first_on_broker_s = Some(at - spawned);
        r.flow_eps = Some(events as f64 / (last - at).max(1e-3));
    }
    let per_100k = |s: f64| s / events as f64 * 1e5;
    r.cost.cpu_s_per_100k = cpu.map(per_100k);
    r.cost.set_pg(pg_cpu, events);
    if ctx.plan.ceilings {
        let lower = r
            .db_read_eps
            .unwrap_or(f64::MAX)
            .min(r.broker_eps.unwrap_or(f64::MAX));
        r.ratio = r.events_per_s.map(|eps| eps / lower);
        r.flow_ratio = r.flow_eps.map(|eps| eps / lower);
    }

    // The relay may have work left after the last mark (the CDC stream skips
    // what the start-up read covered); its peak memory includes that.
    let limit = Duration::from_secs(60 + events / 5_000);
    match relay.settle(limit).await {
        Ok(took) => r.settle_s = Some(took.as_secs_f64()),
        Err(e) => r.conditions.notes.push(format!("{e:#}")),
    }
    // The whole cost of the backlog, the stream's skipping after the last mark included.
    r.cpu_settled_s_per_100k = relay.cpu_seconds().map(per_100k);
    r.pg_cpu_settled_s_per_100k = pg.totals().await.map(|t| per_100k(t.relay_s()));
    r.peak_rss_settled_mib = relay.peak_rss_mib();
    stage.dir.keep |= stop_relay(&mut relay, &mut r.conditions, false).await;
    Ok(())
}

/// Commits the backlog server-side, `shape.tx_events` per transaction, then
/// VACUUM ANALYZE so the ceiling read and the relay see the same table state.
pub async fn insert_backlog(
    stage: &Stage,
    shape: Shape,
    events: u64,
    aggregates: u32,
) -> Result<()> {
    let client = &stage.db.client;
    client.batch_execute("SET synchronous_commit = off").await?;
    let tag = new_tag();
    let limit = Duration::from_secs(120 + events / 1_000);
    bounded(limit, "inserting the backlog", async {
        Ok(client
            .batch_execute(&backlog_sql(tag, 0, events, shape, aggregates))
            .await?)
    })
    .await?;
    client.batch_execute("RESET synchronous_commit").await?;
    bounded(limit, "VACUUM ANALYZE of the backlog", async {
        Ok(client.batch_execute("VACUUM (ANALYZE) outbox").await?)
    })
    .await
}

/// The broker's confirmed-publish rate for this shape's messages, on a
/// destination removed right after.
async fn broker_ceiling(ctx: &Ctx, broker: BrokerKind, shape: Shape) -> Result<f64> {
    let mark = ctx.cleanup.mark();
    let name = crate::kit::unique("bench_");
    let messages = relay_messages(shape, ctx.plan.aggregates);
    let count = ctx.plan.events.min(CEILING_MAX);
    let services: &Services = &ctx.services;
    let result = async {
        create_destination(ctx, broker, &name).await?;
        match broker {
            BrokerKind::Kafka => {
                let topic = crate::process::kafka_topic(&name);
                ceiling::kafka(services, &topic, &messages, count).await
            }
            BrokerKind::Rabbitmq => ceiling::rabbitmq(services, &name, &messages, count).await,
        }
    }
    .await;
    ctx.cleanup.run_from(mark).await;
    result
}

/// Polls until no row is unsent (or, `by_broker`, the broker holds every
/// event), the relay dies, or the plan's timeout. Returns when that poll
/// began, and when the first poll that found a message on the broker began.
async fn wait_drained(
    ctx: &Ctx,
    stage: &Stage,
    relay: &mut RelayProcess,
    counter: &BrokerCount,
    by_broker: bool,
) -> Result<(SystemTime, Option<SystemTime>)> {
    let start = Instant::now();
    let mut first: Option<SystemTime> = None;
    // Without by_broker the count only times the first message: not worth failing for.
    let mut counting = true;
    let mut last_count = None;
    // An inexact count (tansu): the end is its last change, once it has not
    // moved for STILL; the caller reads the topic back to check it is all there.
    const STILL: Duration = Duration::from_secs(2);
    let mut changed: Option<(Instant, SystemTime)> = None;
    let mut last_db_poll = Instant::now();
    loop {
        // 50 ms: the poll's time is a result (the first message; the end
        // unless the rows carry their relay_sent_at).
        tokio::time::sleep(Duration::from_millis(50)).await;
        relay.ensure_running()?;
        let polled = SystemTime::now();
        if (first.is_none() && counting) || by_broker {
            match counter.count().await {
                Ok(count) => {
                    if last_count != Some(count) {
                        changed = Some((Instant::now(), polled));
                    }
                    last_count = Some(count);
                    if first.is_none() && count > 0 {
                        first = Some(polled);
                    }
                    if by_broker && count >= ctx.plan.events {
                        return Ok((polled, first));
                    }
                    if by_broker
                        && !counter.exact()
                        && count > 0
                        && let Some((at, when)) = changed
                        && at.elapsed() >= STILL
                    {
                        return Ok((when, first));
                    }
                }
                Err(e) if by_broker => return Err(e),
                Err(e) => {
                    eprintln!("bench: no flow rate: the broker's message count failed: {e:#}");
                    counting = false;
                }
            }
        }
        // The end's time comes from the table itself: ask less often.
        let precise = matches!(stage.mark().as_str(), "update" | "ranges");
        if !by_broker && (!precise || last_db_poll.elapsed() >= Duration::from_millis(200)) {
            last_db_poll = Instant::now();
            let drained = if stage.mark() == "ranges" {
                ranges_covered(stage).await?
            } else {
                stage.all_sent().await?
            };
            if drained {
                return Ok((polled, first));
            }
        }
        if start.elapsed() > ctx.plan.drain_timeout {
            return Err(match (by_broker, last_count) {
                (true, Some(n)) => anyhow!(
                    "timeout: the broker holds {n} of {} events after {}s",
                    ctx.plan.events,
                    ctx.plan.drain_timeout.as_secs()
                ),
                _ => anyhow!(
                    "timeout: rows still unsent after {}s",
                    ctx.plan.drain_timeout.as_secs()
                ),
            });
        }
    }
}

/// The drain's end with ranges, cheaply enough to ask every 50 ms (the
/// backlog's count reads every row the frontier does not cover yet, and
/// during a drain that is all of them): nothing held open, and the recorded
/// ranges cover every `relay_seq` above the frontier's highest. True only
/// for a backlog committed before the relay started, as here; the full
/// count confirms it afterwards ([`mark_times`]).
async fn ranges_covered(stage: &Stage) -> Result<bool> {
    let r = crate::stage::outbox_ranges();
    let sql = format!(
        "WITH above AS (SELECT int8range(COALESCE((SELECT max_seq FROM {f} ORDER BY id DESC LIMIT 1), 0),
                                         (SELECT max(relay_seq) FROM outbox), '(]') AS r)
         SELECT NOT EXISTS (SELECT 1 FROM {h})
            AND (isempty((SELECT r FROM above))
                 OR COALESCE(({recorded}) @> (SELECT r FROM above), false))",
        f = r.frontier.quoted(),
        h = r.held.quoted(),
        recorded = r.recorded(),
    );
    Ok(stage.db.client.query_one(&sql, &[]).await?.get(0))
}

/// Seconds since the epoch of the first and last `relay_sent_at` (none when
/// rows were deleted); with ranges, only the last recorded batch's time.
async fn mark_times(stage: &Stage) -> Result<(Option<f64>, Option<f64>)> {
    if stage.mark() == "ranges" {
        if !stage.all_sent().await? {
            return Err(anyhow!("rows unsent after the drain"));
        }
        let last = format!(
            "SELECT extract(epoch FROM ({}))::float8",
            crate::stage::outbox_ranges().last_recorded_sql()
        );
        return Ok((None, stage.db.client.query_one(&last, &[]).await?.get(0)));
    }
    let row = stage
        .db
        .client
        .query_one(
            "SELECT extract(epoch FROM min(relay_sent_at))::float8, extract(epoch FROM max(relay_sent_at))::float8, count(*) FILTER (WHERE relay_sent_at IS NULL) FROM outbox",
            &[],
        )
        .await?;
    let unsent: i64 = row.get(2);
    if unsent > 0 {
        return Err(anyhow!("{unsent} rows unsent after the drain"));
    }
    Ok((row.get(0), row.get(1)))
}
