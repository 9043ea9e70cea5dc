//! What every scenario starts from: a fresh database with a migrated outbox,
//! a destination of its own on the broker, and the relay's config file.

use crate::infra::{BenchDb, Cleanup, Services, create_topic, declare_rabbit, unique};
use crate::options::{BrokerKind, Mark, Mode, Plan};
use crate::process::{Target, Workdir, config_toml, kafka_topic, migrate};
use anyhow::Result;

/// Shared by every scenario of one invocation.
pub struct Ctx {
    pub services: Services,
    pub cleanup: Cleanup,
    pub plan: Plan,
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
        Ok(Stage {
            db,
            destination,
            dir,
            env,
        })
    }

    /// The `relay.mark` the relay runs with.
    pub fn mark(&self) -> String {
        self.env
            .iter()
            .rev()
            .find(|(k, _)| k == MARK_ENV)
            .map_or("update".to_owned(), |(_, v)| v.to_lowercase())
    }

    /// The Kafka topic (or RabbitMQ queue) messages arrive in.
    pub fn inbox(&self, broker: BrokerKind) -> String {
        match broker {
            BrokerKind::Kafka => kafka_topic(&self.destination),
            BrokerKind::Rabbitmq => self.destination.clone(),
        }
    }
}

/// A Kafka topic `<name>.bench`, or a RabbitMQ exchange and queue `<name>`.
pub async fn create_destination(ctx: &Ctx, broker: BrokerKind, name: &str) -> Result<()> {
    match broker {
        BrokerKind::Kafka => create_topic(&ctx.services, &ctx.cleanup, &kafka_topic(name)).await,
        BrokerKind::Rabbitmq => declare_rabbit(&ctx.services, &ctx.cleanup, name).await,
    }
}
