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

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use futures::{Stream, StreamExt};
use lapin::options::{
    BasicConsumeOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Connection, ConnectionProperties, ErrorKind, ExchangeKind};
use outbox_relay::config::redact_url;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Headers, Message as _};
use rdkafka::types::RDKafkaErrorCode;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::de::IgnoredAny;
use std::collections::HashMap;
use std::io::Write as _;
use std::pin::pin;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;

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

/// One received message, reduced to what is printed.
struct Shown {
    /// Where it was found: topic, partition and offset, or exchange and routing key.
    destination: String,
    key: Option<String>,
    /// AMQP properties (RabbitMQ only), in a fixed order.
    properties: Vec<(&'static str, String)>,
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.broker {
        Broker::Kafka(args) => tail_kafka(args, &cli.limits).await,
        Broker::RabbitMq(args) => tail_rabbitmq(args, &cli.limits).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("tail: error: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

async fn tail_kafka(args: KafkaArgs, limits: &Limits) -> Result<ExitCode> {
    if args.create_topic {
        create_topic(&args).await?;
    }
    let consumer: StreamConsumer = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        // Partitions are assigned, not subscribed: the group id only names the
        // client; nothing is committed under it.
        .set("group.id", "outbox-relay-tail")
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("allow.auto.create.topics", "false")
        .create()
        .context("creating the Kafka consumer")?;
    // The metadata request blocks; it runs once, before any message.
    let assignment = tokio::task::block_in_place(|| assignment(&consumer, &args))?;
    consumer
        .assign(&assignment)
        .context("assigning the topic's partitions")?;
    let since = match args.since {
        Some(t) => format!(
            ", showing messages since {}",
            humantime::format_rfc3339_millis(t)
        ),
        None => String::new(),
    };
    eprintln!(
        "ready: reading topic {} ({} partitions) from the beginning{since}",
        args.topic,
        assignment.count(),
    );
    let mut next_offsets = HashMap::new();
    let messages = consumer.stream().filter_map(|m| {
        let shown = match m {
            Err(e) => Some(Err(e.into())),
            Ok(m) => wanted(&m, args.since, &mut next_offsets).then(|| Ok(show_kafka(&m))),
        };
        std::future::ready(shown)
    });
    print_messages(messages, limits).await
}

async fn create_topic(args: &KafkaArgs) -> Result<()> {
    let admin: AdminClient<DefaultClientContext> = ClientConfig::new()
        .set("bootstrap.servers", &args.brokers)
        .create()
        .context("creating the Kafka admin client")?;
    let topic = NewTopic::new(&args.topic, args.partitions, TopicReplication::Fixed(1));
    let options = AdminOptions::new()
        .request_timeout(Some(BROKER_CALL))
        .operation_timeout(Some(BROKER_CALL));
    let results = tokio::time::timeout(BROKER_CALL * 2, admin.create_topics([&topic], &options))
        .await
        .map_err(|_| anyhow!("Kafka at {} did not answer in time", args.brokers))?
        .with_context(|| format!("creating topic {}", args.topic))?;
    for result in results {
        match result {
            Ok(name) => eprintln!(
                "tail: created topic {name} with {} partitions",
                args.partitions
            ),
            Err((name, RDKafkaErrorCode::TopicAlreadyExists)) => {
                eprintln!("tail: topic {name} already exists")
            }
            Err((name, code)) => bail!("creating topic {name}: {code}"),
        }
    }
    Ok(())
}

/// Every partition of the topic, from its first offset.
fn assignment(consumer: &StreamConsumer, args: &KafkaArgs) -> Result<TopicPartitionList> {
    let metadata = consumer
        .fetch_metadata(Some(&args.topic), BROKER_CALL)
        .with_context(|| format!("reading metadata from Kafka at {}", args.brokers))?;
    let topic = metadata
        .topics()
        .iter()
        .find(|t| t.name() == args.topic)
        .ok_or_else(|| anyhow!("Kafka returned no metadata for topic {}", args.topic))?;
    if topic.error().is_some() || topic.partitions().is_empty() {
        bail!(
            "topic {} does not exist on {}; create it, or pass --create-topic",
            args.topic,
            args.brokers
        );
    }
    let mut list = TopicPartitionList::new();
    for partition in topic.partitions() {
        list.add_partition_offset(&args.topic, partition.id(), Offset::Beginning)?;
    }
    Ok(list)
}

/// Whether to print `m`: not older than `--since`, and not a record printed
/// already. Offsets are unique within a partition, yet a broker may return a
/// record twice (tansu 0.6 does when a fetch starts inside a record batch);
/// `next_offsets` holds, per partition, the offset after the last one seen.
fn wanted(
    m: &BorrowedMessage<'_>,
    since: Option<SystemTime>,
    next_offsets: &mut HashMap<i32, i64>,
) -> bool {
    let next = next_offsets.entry(m.partition()).or_insert(0);
    if m.offset() < *next {
        eprintln!(
            "tail: skipped a repeated record ({} [{}] offset {})",
            m.topic(),
            m.partition(),
            m.offset()
        );
        return false;
    }
    *next = m.offset() + 1;
    let timestamp = m
        .timestamp()
        .to_millis()
        .and_then(|ms| u64::try_from(ms).ok())
        .and_then(|ms| SystemTime::UNIX_EPOCH.checked_add(Duration::from_millis(ms)));
    match (since, timestamp) {
        (Some(since), Some(t)) => t >= since,
        // Without a timestamp there is nothing to compare: show it.
        _ => true,
    }
}

fn show_kafka(m: &BorrowedMessage<'_>) -> Shown {
    let headers = m
        .headers()
        .map(|h| {
            h.iter()
                .map(|h| (h.key.to_owned(), text(h.value.unwrap_or_default())))
                .collect()
        })
        .unwrap_or_default();
    Shown {
        destination: format!(
            "topic {}, partition {}, offset {}",
            m.topic(),
            m.partition(),
            m.offset()
        ),
        key: m.key().map(text),
        properties: Vec::new(),
        headers,
        body: m.payload().unwrap_or_default().to_vec(),
    }
}

async fn tail_rabbitmq(args: RabbitArgs, limits: &Limits) -> Result<ExitCode> {
    let shown_url = redact_url(&args.url);
    let connection = tokio::time::timeout(
        BROKER_CALL,
        Connection::connect(&args.url, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| anyhow!("RabbitMQ at {shown_url} did not answer in time"))?
    .with_context(|| format!("connecting to RabbitMQ at {shown_url}"))?;
    let channel = ensure_exchange(&connection, &args.exchange).await?;
    let queue = bounded(
        "declaring a queue",
        channel.queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    bounded(
        "binding the queue",
        channel.queue_bind(
            queue.name().clone(),
            args.exchange.as_str().into(),
            args.binding.as_str().into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    let consumer = bounded(
        "starting the consumer",
        channel.basic_consume(
            queue.name().clone(),
            "outbox-relay-tail".into(),
            BasicConsumeOptions {
                no_ack: true,
                ..BasicConsumeOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    eprintln!(
        "ready: queue {} bound to exchange {} with binding key {:?}",
        queue.name(),
        args.exchange,
        args.binding
    );
    let messages = consumer.map(|d| {
        d.map_err(anyhow::Error::from).map(|d| {
            let p = &d.properties;
            let properties = [
                ("message_id", p.message_id().as_ref().map(|v| v.to_string())),
                ("type", p.kind().as_ref().map(|v| v.to_string())),
                (
                    "content_type",
                    p.content_type().as_ref().map(|v| v.to_string()),
                ),
                ("timestamp", p.timestamp().map(amqp_time)),
                ("delivery_mode", p.delivery_mode().map(|v| v.to_string())),
                ("app_id", p.app_id().as_ref().map(|v| v.to_string())),
            ]
            .into_iter()
            .filter_map(|(k, v)| Some((k, v?)))
            .collect();
            let headers = p
                .headers()
                .as_ref()
                .map(|t| {
                    t.inner()
                        .iter()
                        .map(|(k, v)| (k.to_string(), amqp_text(v)))
                        .collect()
                })
                .unwrap_or_default();
            Shown {
                destination: format!("exchange {}, routing key {}", d.exchange, d.routing_key),
                key: None,
                properties,
                headers,
                body: d.data,
            }
        })
    });
    let code = print_messages(messages, limits).await;
    // Closing deletes the exclusive queue at once; a failure here changes nothing.
    let _ = tokio::time::timeout(BROKER_CALL, connection.close(200, "tail finished".into())).await;
    code
}

/// Returns an open channel once `exchange` exists, declaring it (durable,
/// topic) if it did not.
async fn ensure_exchange(connection: &Connection, exchange: &str) -> Result<lapin::Channel> {
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    let missing = match tokio::time::timeout(
        BROKER_CALL,
        channel.exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            passive,
            FieldTable::default(),
        ),
    )
    .await
    {
        Err(_) => bail!("RabbitMQ did not answer in time (checking exchange {exchange})"),
        Ok(Ok(())) => return Ok(channel),
        Ok(Err(e)) => e,
    };
    if !matches!(missing.kind(), ErrorKind::ProtocolError(p) if p.get_id() == 404) {
        return Err(missing).context(format!("checking exchange {exchange}"));
    }
    // A failed passive declare closes the channel: declare on a new one.
    let channel = bounded("opening a channel", connection.create_channel()).await?;
    bounded(
        "declaring the exchange",
        channel.exchange_declare(
            exchange.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    eprintln!("tail: declared exchange {exchange} (durable, topic)");
    Ok(channel)
}

/// Awaits one RabbitMQ call for at most [`BROKER_CALL`].
async fn bounded<T>(what: &str, call: impl Future<Output = lapin::Result<T>>) -> Result<T> {
    tokio::time::timeout(BROKER_CALL, call)
        .await
        .map_err(|_| anyhow!("RabbitMQ did not answer in time ({what})"))?
        .with_context(|| what.to_owned())
}

/// An AMQP timestamp (seconds since the epoch) in RFC 3339, or as the number
/// when it is past what RFC 3339 can show (the year 9999).
fn amqp_time(secs: u64) -> String {
    const YEAR_10000: u64 = 253_402_300_800;
    if secs >= YEAR_10000 {
        return secs.to_string();
    }
    humantime::format_rfc3339_seconds(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
        .to_string()
}

fn amqp_text(value: &AMQPValue) -> String {
    match value {
        AMQPValue::LongString(s) => text(s.as_bytes()),
        AMQPValue::ShortString(s) => s.to_string(),
        AMQPValue::Boolean(b) => b.to_string(),
        AMQPValue::LongLongInt(i) => i.to_string(),
        AMQPValue::LongInt(i) => i.to_string(),
        AMQPValue::ShortInt(i) => i.to_string(),
        AMQPValue::Timestamp(t) => t.to_string(),
        other => format!("{other:?}"),
    }
}

/// Prints messages until `--count` is reached, `--timeout` passes without a
/// message, or Ctrl-C.
async fn print_messages(
    messages: impl Stream<Item = Result<Shown>>,
    limits: &Limits,
) -> Result<ExitCode> {
    let mut messages = pin!(messages);
    let mut interrupted = pin!(tokio::signal::ctrl_c());
    let mut received: u64 = 0;
    let mut deadline = Instant::now() + limits.timeout;
    let of_count = |n: u64| match limits.count {
        Some(c) => format!("{n} of {c}"),
        None => n.to_string(),
    };
    if limits.count == Some(0) {
        return Ok(ExitCode::SUCCESS);
    }
    loop {
        tokio::select! {
            biased;
            // 1. Ctrl-C ends the wait at once.
            _ = &mut interrupted => {
                eprintln!("tail: interrupted after {} message(s)", of_count(received));
                return Ok(ExitCode::from(130));
            }
            // 2. The next message, or its absence for `--timeout`.
            next = tokio::time::timeout_at(deadline, messages.next()) => match next {
                Err(_) => {
                    bail!(
                        "timed out: no message for {} (received {})",
                        humantime::format_duration(limits.timeout),
                        of_count(received)
                    );
                }
                Ok(None) => bail!("the broker ended the consumer (received {})", of_count(received)),
                // Connection trouble is reported and retried by the client; the
                // timeout still bounds the wait.
                Ok(Some(Err(e))) => eprintln!("tail: warning: {}", report(&e)),
                Ok(Some(Ok(shown))) => {
                    received += 1;
                    match print_one(received, &shown) {
                        Ok(()) => {}
                        // The reader went away (`tail ... | head`): nothing left to do.
                        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                            return Ok(ExitCode::SUCCESS);
                        }
                        Err(e) => return Err(e).context("writing to stdout"),
                    }
                    if limits.count.is_some_and(|c| received >= c) {
                        return Ok(ExitCode::SUCCESS);
                    }
                    deadline = Instant::now() + limits.timeout;
                }
            },
        }
    }
}

fn print_one(n: u64, m: &Shown) -> std::io::Result<()> {
    const INDENT: &str = "             ";
    let mut out = format!("── message {n} ── {}\n", m.destination);
    if let Some(key) = &m.key {
        out.push_str(&format!("key:         {key}\n"));
    }
    for (i, (k, v)) in m.properties.iter().enumerate() {
        let label = if i == 0 { "properties:  " } else { INDENT };
        out.push_str(&format!("{label}{k}: {v}\n"));
    }
    if m.headers.is_empty() {
        out.push_str("headers:     (none)\n");
    }
    for (i, (k, v)) in m.headers.iter().enumerate() {
        let label = if i == 0 { "headers:     " } else { INDENT };
        out.push_str(&format!("{label}{k}: {v}\n"));
    }
    out.push_str("body:\n");
    out.push_str(&body_text(&m.body));
    out.push('\n');
    // One write per message, so blocks stay whole when stdout is a pipe.
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()
}

/// The body indented when it is JSON, as text when it is UTF-8, and as a size
/// otherwise.
fn body_text(body: &[u8]) -> String {
    if body.is_empty() {
        return "(empty)\n".into();
    }
    let Ok(text) = std::str::from_utf8(body) else {
        return format!("({} bytes, not UTF-8)\n", body.len());
    };
    if serde_json::from_str::<IgnoredAny>(text).is_ok() {
        return indent_json(text) + "\n";
    }
    if text.ends_with('\n') {
        text.to_owned()
    } else {
        format!("{text}\n")
    }
}

/// Lays out valid JSON text two spaces per level. It works on the text rather
/// than on a parsed `serde_json::Value` so that keys keep their order and
/// numbers their exact digits (a `Value` sorts keys and rounds numbers past
/// 64 bits).
fn indent_json(json: &str) -> String {
    fn newline(out: &mut String, depth: usize) {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    }
    let mut out = String::with_capacity(json.len() * 2);
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = json.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.next_if(char::is_ascii_whitespace).is_some() {}
                // An empty object or array stays on one line.
                if let Some(close) = chars.next_if(|&c| c == '}' || c == ']') {
                    out.push(close);
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_ascii_whitespace() => {}
            c => out.push(c),
        }
    }
    out
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

/// Bytes shown as text, with invalid UTF-8 replaced.
fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
