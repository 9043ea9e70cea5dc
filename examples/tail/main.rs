//! `tail`: prints what outbox-relay publishes, to watch events flow.
//!
//! ```text
//! cargo run --example tail -- kafka --brokers 127.0.0.1:9092 --topic outbox.event.order --count 5
//! cargo run --example tail -- rabbitmq --url amqp://guest:guest@127.0.0.1:5672/%2f --exchange outbox
//! ```
//!
//! Kafka: every partition of the topic is *assigned* (no consumer group, no
//! offset commits), so tail disturbs no real consumer and reads the topic from
//! the beginning each time; `--since` leaves out older messages by their
//! timestamp. RabbitMQ has no log to re-read: tail binds a queue of its own
//! (exclusive, deleted when tail exits) to the exchange and sees what is
//! published after that; the exchange is declared as a durable topic exchange
//! if it does not exist yet.
//!
//! Once it can receive, tail writes `ready: ...` to stderr; scripts wait for
//! that line before they publish. Exit status: 0 after `--count` messages, 1
//! when `--timeout` passes without a message or on an error, 130 on Ctrl-C.

// The consumers' code is the test kit's, shared with the tests' recording consumers.
#[path = "../../tests/kit/mod.rs"]
mod kit;

mod kafka;
mod print;
mod rabbitmq;

use clap::{Args, Parser, Subcommand};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

/// How long one call to a broker (connect, metadata, declare) may take.
const BROKER_CALL: Duration = Duration::from_secs(10);

#[derive(Debug, Parser)]
#[command(
    name = "tail",
    about = "Prints the messages outbox-relay publishes to a Kafka topic or a RabbitMQ exchange."
)]
struct Cli {
    #[command(subcommand)]
    broker: Broker,
    #[command(flatten)]
    limits: Limits,
}

#[derive(Debug, Args)]
struct Limits {
    /// Exit (status 0) after this many messages.
    #[arg(long, global = true, value_name = "N")]
    count: Option<u64>,
    /// Exit (status 1) when no message arrived for this long, e.g. `30s`, `2m`.
    #[arg(long, global = true, default_value = "30s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

#[derive(Debug, Subcommand)]
enum Broker {
    /// Read a Kafka topic by assigning all its partitions (no consumer group).
    Kafka(KafkaArgs),
    /// Bind a temporary queue to a RabbitMQ exchange and print what is routed to it.
    #[command(name = "rabbitmq")]
    RabbitMq(RabbitArgs),
}

#[derive(Debug, Args)]
struct KafkaArgs {
    /// Comma-separated `host:port` list.
    #[arg(long, default_value = "127.0.0.1:9092")]
    brokers: String,
    #[arg(long)]
    topic: String,
    /// Print only messages timestamped at or after this time (RFC 3339, e.g.
    /// `2026-01-31T09:00:00Z`); older ones are read and skipped.
    #[arg(long, value_name = "TIME", value_parser = humantime::parse_rfc3339_weak)]
    since: Option<SystemTime>,
    /// Create the topic first if it does not exist (brokers that do not create
    /// topics on first use need this before the relay publishes).
    #[arg(long)]
    create_topic: bool,
    /// Partitions of a topic created by `--create-topic`.
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(i32).range(1..))]
    partitions: i32,
}

#[derive(Debug, Args)]
struct RabbitArgs {
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    url: String,
    #[arg(long)]
    exchange: String,
    /// Binding key of the queue; `#` matches every routing key of a topic exchange.
    #[arg(long, default_value = "#")]
    binding: String,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.broker {
        Broker::Kafka(args) => kafka::tail(args, &cli.limits).await,
        Broker::RabbitMq(args) => rabbitmq::tail(args, &cli.limits).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tail: error: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: the Kafka and AMQP clients'
/// messages already repeat their cause's text.
fn report(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}
