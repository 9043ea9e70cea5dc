//! What every scenario starts from: a fresh database with a migrated outbox,
//! a destination of its own on the broker, and the relay's config file.

use crate::infra::{BenchDb, Cleanup, Services, create_topic, declare_rabbit, measurement};
use crate::kit::unique;
use crate::options::{BrokerKind, Mark, Mode, Plan};
use crate::process::{Perf, RelayProcess, Target, Workdir, config_toml, kafka_topic, migrate};
use crate::results::Conditions;
use crate::system::{resident_mib, wait_quiet};
use anyhow::{Context, Result};
use std::future::Future;
use std::time::Duration;

/// Shared by every scenario of one invocation.
pub struct Ctx {
    pub services: Services,
    pub cleanup: Cleanup,
    pub plan: Plan,
}

/// What one scenario runs against: the invocation's context, the source
/// mode and the broker.
#[derive(Clone, Copy)]
pub struct Case<'a> {
    pub ctx: &'a Ctx,
    pub mode: Mode,
    pub broker: BrokerKind,
}

impl Case<'_> {
    /// Runs one measurement within `limit` and cleans up after it; its status.
    pub async fn status(
        &self,
        limit: Duration,
        measure: impl Future<Output = Result<()>>,
    ) -> String {
        measurement(&self.ctx.cleanup, limit, measure)
            .await
            .unwrap_or_else(|| "ok".to_owned())
    }

    /// Waits for a quiet machine, noting how long; returns the last second's busy share.
    pub async fn quiet(&self, conditions: &mut Conditions) -> Option<f64> {
        let (waited, busy) = wait_quiet(self.ctx.plan.quiet_wait).await;
        conditions.quiet_wait_s += waited.as_secs_f64();
        conditions.broker_rss_mib = resident_mib(self.broker.process_name());
        busy
    }

    /// `perf record` of the relay while it is measured, when the plan asks for it.
    pub fn perf(&self, label: &str, relay: &RelayProcess) -> Result<Option<Perf>> {
        self.ctx
            .plan
            .perf
            .as_deref()
            .map(|dir| Perf::start(dir, label, relay.pid()))
            .transpose()
    }
}

/// Stops the relay and notes its exit and the problems it logged, the first
/// of them too when it logged errors or the measurement `failed`. Returns
/// whether the relay's folder is worth keeping for a look.
pub async fn stop_relay(relay: &mut RelayProcess, c: &mut Conditions, failed: bool) -> bool {
    match relay.stop().await {
        Ok(status) if status.success() => {}
        Ok(status) => c.notes.push(format!("relay exit: {status}")),
        Err(e) => c.notes.push(format!("{e:#}")),
    }
    (c.warnings, c.errors) = relay.problems();
    let worth_a_look = c.errors > 0 || failed;
    if worth_a_look && let Some(line) = relay.first_problem() {
        c.notes.push(line);
    }
    worth_a_look
}

/// With `relay.mark = "ranges"`: a copy of each progress row as inserted.
const RECORDED_LOG: &str = "
CREATE TABLE bench_recorded (seqs int8multirange NOT NULL, at timestamptz NOT NULL);
CREATE INDEX ON bench_recorded USING gist (seqs);
CREATE FUNCTION bench_log_recorded() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO bench_recorded VALUES (NEW.seqs, NEW.recorded_at); RETURN NULL; END $$;
CREATE TRIGGER bench_log_recorded AFTER INSERT ON outbox_relay_progress
    FOR EACH ROW EXECUTE FUNCTION bench_log_recorded();";

/// The benchmark outbox's ranges, for `relay.mark = "ranges"`.
pub fn outbox_ranges() -> outbox_relay::outbox::progress::Ranges {
    outbox_relay::outbox::progress::Ranges::new(&outbox_relay::config::TableName::new(
        "public", "outbox",
    ))
}

/// The configuration override of `relay.mark`.
pub const MARK_ENV: &str = "OUTBOX_RELAY__RELAY__MARK";

pub struct Stage {
    pub db: BenchDb,
    /// Kafka topic prefix or RabbitMQ exchange (and queue) name.
    pub destination: String,
    pub dir: Workdir,
    /// The relay's configuration overrides: `--relay-env`, then the mark.
    pub env: Vec<(String, String)>,
}

impl Stage {
    pub async fn new(ctx: &Ctx, mode: Mode, broker: BrokerKind) -> Result<Stage> {
        Stage::with_mark(ctx, mode, broker, None).await
    }

    /// A stage whose relay runs with this `relay.mark` (`None`: as configured).
    pub async fn with_mark(
        ctx: &Ctx,
        mode: Mode,
        broker: BrokerKind,
        mark: Option<Mark>,
    ) -> Result<Stage> {
        let mut env = ctx.plan.relay_env.clone();
        if let Some(mark) = mark {
            env.retain(|(k, _)| k != MARK_ENV);
            env.push((MARK_ENV.to_owned(), mark.name().to_owned()));
        }
        let ranges = mark_in(&env) == "ranges";
        let db = BenchDb::create(&ctx.services, &ctx.cleanup).await?;
        let destination = unique("bench_");
        let slot = destination.clone();
        create_destination(ctx, broker, &destination).await?;
        let target = Target {
            mode,
            broker,
            db_url: &db.url,
            destination: &destination,
            slot: &slot,
        };
        let dir = Workdir::new(&config_toml(&ctx.services, &target))?;
        migrate(&dir, &env).await?;
        if ranges {
            // Each recorded batch with its time, kept after the fold
            // deletes it: the steady state's commit -> recorded latency.
            db.client
                .batch_execute(RECORDED_LOG)
                .await
                .context("logging recorded batches")?;
        }
        Ok(Stage {
            db,
            destination,
            dir,
            env,
        })
    }

    /// Whether every row is sent: marked, or with ranges recorded or
    /// passed by the frontier.
    pub async fn all_sent(&self) -> Result<bool> {
        if self.mark() != "ranges" {
            return self.db.all_sent().await;
        }
        let backlog = outbox_ranges().read_sql("relay_seq", "").backlog;
        let unsent: i64 = self.db.client.query_one(&backlog, &[]).await?.get(0);
        Ok(unsent == 0)
    }

    /// The `relay.mark` the relay runs with.
    pub fn mark(&self) -> String {
        mark_in(&self.env)
    }

    /// The Kafka topic (or RabbitMQ queue) messages arrive in.
    pub fn inbox(&self, broker: BrokerKind) -> String {
        match broker {
            BrokerKind::Kafka => kafka_topic(&self.destination),
            BrokerKind::Rabbitmq => self.destination.clone(),
        }
    }
}

/// The `relay.mark` of a relay run with these configuration overrides.
pub fn mark_in(env: &[(String, String)]) -> String {
    env.iter()
        .rev()
        .find(|(k, _)| k == MARK_ENV)
        .map_or("update".to_owned(), |(_, v)| v.to_lowercase())
}

/// A Kafka topic `<name>.bench`, or a RabbitMQ exchange and queue `<name>`.
pub async fn create_destination(ctx: &Ctx, broker: BrokerKind, name: &str) -> Result<()> {
    match broker {
        BrokerKind::Kafka => create_topic(&ctx.services, &ctx.cleanup, &kafka_topic(name)).await,
        BrokerKind::Rabbitmq => {
            declare_rabbit(&ctx.services, &ctx.cleanup, name, ctx.plan.rabbitmq_queue).await
        }
    }
}
