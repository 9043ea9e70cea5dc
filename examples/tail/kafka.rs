//! Kafka: every partition of the topic assigned (no consumer group, no
//! offset commits) and read from the beginning.

use crate::kit::consumers::{Received, TopicFailed, create_topic};
use crate::{BROKER_CALL, KafkaArgs, Limits};
use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
use rdkafka::consumer::{Consumer, StreamConsumer};
use rdkafka::message::{BorrowedMessage, Message as _};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

pub async fn tail(args: KafkaArgs, limits: &Limits) -> Result<ExitCode> {
    if args.create_topic {
        ensure_topic(&args).await?;
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
            Ok(m) => wanted(&m, args.since, &mut next_offsets).then(|| Ok(show(&m))),
        };
        std::future::ready(shown)
    });
    crate::print::print_messages(messages, limits).await
}

async fn ensure_topic(args: &KafkaArgs) -> Result<()> {
    let topic = &args.topic;
    let created = create_topic(&args.brokers, topic, args.partitions, BROKER_CALL)
        .await
        .map_err(|e| match e {
            TopicFailed::NoClient(e) => anyhow!(e).context("creating the Kafka admin client"),
            TopicFailed::Timeout => anyhow!("Kafka at {} did not answer in time", args.brokers),
            TopicFailed::Request(e) => anyhow!(e).context(format!("creating topic {topic}")),
            TopicFailed::Refused(code) => anyhow!("creating topic {topic}: {code}"),
        })?;
    if created {
        eprintln!(
            "tail: created topic {topic} with {} partitions",
            args.partitions
        );
    } else {
        eprintln!("tail: topic {topic} already exists");
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

/// The message, with where it was found.
fn show(m: &BorrowedMessage<'_>) -> Received {
    Received {
        destination: format!(
            "topic {}, partition {}, offset {}",
            m.topic(),
            m.partition(),
            m.offset()
        ),
        ..Received::from_kafka(m)
    }
}
