//! What the services can do without the relay, measured in the same run so a
//! drain rate can be quoted as a fraction of it:
//!
//! - Kafka: librdkafka's idempotent producer (`acks=all`, `linger.ms=5`, the
//!   relay's other producer settings) publishing the relay's exact messages
//!   with at most [`window`] unconfirmed;
//! - RabbitMQ: one confirm-mode channel publishing them persistent and
//!   `mandatory`, at most `window` unconfirmed;
//! - PostgreSQL: the relay's read of unsent rows (`relay_sent_at IS NULL AND
//!   relay_seq > $1 ORDER BY relay_seq LIMIT 500`, every column as text),
//!   paged through the whole backlog without marking anything.
//!
//! And, to explain the gap between the two: the database's rate of marking
//! the same rows sent (the relay's UPDATE by `relay_seq = ANY($1)`, 1,000 rows
//! per statement, each its own transaction) on a copy of the backlog.

use crate::infra::{Services, bounded, connect, rabbit_connect};
use crate::workload::{AGGREGATE_TYPE, EVENT_TYPE};
use anyhow::{Result, anyhow};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation};
use outbox_relay::envelope::Message;
use rdkafka::ClientConfig;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::future_producer::OwnedDeliveryResult;
use rdkafka::producer::{FutureProducer, FutureRecord, Producer};
use std::time::{Duration, Instant};

/// The relay's default `relay.max_in_flight`: a broker's rate depends on
/// how much is unconfirmed at once, so its ceiling is measured with the
/// relay's own window.
pub fn window() -> usize {
    outbox_relay::config::defaults::max_in_flight()
}

/// Rows per page, the relay's default `source.batch_size`.
const PAGE: i64 = 500;

fn limit_for(count: u64) -> Duration {
    Duration::from_secs(60 + count / 1_000)
}

/// Events per second confirmed by Kafka.
pub async fn kafka(
    services: &Services,
    topic: &str,
    messages: &[Message<'_>],
    count: u64,
) -> Result<f64> {
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &services.kafka)
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("enable.gapless.guarantee", "true")
        .set("linger.ms", "5")
        .set("message.timeout.ms", "30000")
        .set("queue.buffering.max.messages", "200000")
        .create()?;
    // Metadata first, as the relay looks the topic up before its first send.
    let (p, t) = (producer.clone(), topic.to_owned());
    tokio::task::spawn_blocking(move || {
        p.client().fetch_metadata(Some(&t), Duration::from_secs(10))
    })
    .await??;
    let elapsed = bounded(limit_for(count), "the Kafka ceiling", async {
        let start = Instant::now();
        let mut in_flight = FuturesUnordered::new();
        for i in 0..count {
            while in_flight.len() >= window() {
                kafka_confirmed(in_flight.next().await)?;
            }
            let m = &messages[(i % messages.len() as u64) as usize];
            let mut headers = OwnedHeaders::new_with_capacity(m.headers.len());
            for (k, v) in &m.headers {
                headers = headers.insert(Header {
                    key: k,
                    value: Some(v.as_bytes()),
                });
            }
            let mut record = FutureRecord::to(topic)
                .key(m.key.as_bytes())
                .payload(&m.body)
                .headers(headers);
            loop {
                match producer.send_result(record) {
                    Ok(delivery) => break in_flight.push(delivery),
                    Err((KafkaError::MessageProduction(RDKafkaErrorCode::QueueFull), back)) => {
                        record = back;
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                    Err((e, _)) => return Err(anyhow!("Kafka refused a send: {e}")),
                }
            }
        }
        while let Some(done) = in_flight.next().await {
            kafka_confirmed(Some(done))?;
        }
        Ok(start.elapsed())
    })
    .await?;
    Ok(count as f64 / elapsed.as_secs_f64())
}

type Delivery = Result<OwnedDeliveryResult, futures::channel::oneshot::Canceled>;

fn kafka_confirmed(done: Option<Delivery>) -> Result<()> {
    match done {
        Some(Ok(Ok(_))) | None => Ok(()),
        Some(Ok(Err((e, _)))) => Err(anyhow!("Kafka delivery failed: {e}")),
        Some(Err(_)) => Err(anyhow!("the Kafka producer was dropped")),
    }
}

/// Events per second confirmed by RabbitMQ, published to `exchange` with the
/// relay's routing key and message properties.
pub async fn rabbitmq(
    services: &Services,
    exchange: &str,
    messages: &[Message<'_>],
    count: u64,
) -> Result<f64> {
    let conn = rabbit_connect(services).await?;
    let result = bounded(limit_for(count), "the RabbitMQ ceiling", async {
        let ch = conn.create_channel().await?;
        ch.confirm_select(ConfirmSelectOptions::default()).await?;
        let routing_key = format!("{AGGREGATE_TYPE}.{EVENT_TYPE}");
        let properties: Vec<BasicProperties> = messages.iter().map(amqp_properties).collect();
        let start = Instant::now();
        let mut in_flight = FuturesUnordered::new();
        for i in 0..count {
            while in_flight.len() >= window() {
                rabbit_confirmed(in_flight.next().await)?;
            }
            let at = (i % messages.len() as u64) as usize;
            let confirm = ch
                .basic_publish(
                    exchange.into(),
                    routing_key.as_str().into(),
                    BasicPublishOptions {
                        mandatory: true,
                        ..Default::default()
                    },
                    &messages[at].body,
                    properties[at].clone(),
                )
                .await?;
            in_flight.push(confirm);
        }
        while let Some(done) = in_flight.next().await {
            rabbit_confirmed(Some(done))?;
        }
        Ok(start.elapsed())
    })
    .await;
    let _ = conn.close(200, "bench ceiling done".into()).await;
    Ok(count as f64 / result?.as_secs_f64())
}

/// The properties the relay sets on every message.
fn amqp_properties(m: &Message<'_>) -> BasicProperties {
    let mut headers = FieldTable::default();
    for (k, v) in &m.headers {
        headers.insert(
            k.as_ref().into(),
            AMQPValue::LongString(LongString::from(v.as_bytes().to_vec())),
        );
    }
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_message_id(m.id.as_ref().into())
        .with_content_type(m.content_type.into())
        .with_type(m.event_type.as_ref().into())
        .with_timestamp(m.timestamp_secs)
        .with_app_id("outbox-relay".into())
        .with_headers(headers)
}

fn rabbit_confirmed(done: Option<lapin::Result<Confirmation>>) -> Result<()> {
    match done {
        None | Some(Ok(Confirmation::Ack(None))) => Ok(()),
        Some(Ok(Confirmation::Ack(Some(_)))) => {
            Err(anyhow!("RabbitMQ returned a message as unroutable"))
        }
        Some(Ok(other)) => Err(anyhow!("RabbitMQ did not confirm a message: {other:?}")),
        Some(Err(e)) => Err(anyhow!("RabbitMQ publish failed: {e}")),
    }
}

/// Rows per second of the relay's read query, paged through every unsent row.
pub async fn database(db_url: &str, expected: u64) -> Result<f64> {
    let client = connect(db_url).await?;
    client
        .batch_execute("SET TimeZone = 'UTC'; SET DateStyle = 'ISO'")
        .await?;
    let page = client
        .prepare(
            "SELECT relay_seq, id::text, aggregate_type::text, aggregate_id::text, event_type::text,
                    event_version::text, payload::text, headers::text, created_at::text
             FROM outbox WHERE relay_sent_at IS NULL AND relay_seq > $1
             ORDER BY relay_seq LIMIT $2",
        )
        .await?;
    let (rows, elapsed) = bounded(limit_for(expected), "the database read ceiling", async {
        let start = Instant::now();
        let (mut cursor, mut rows) = (0i64, 0u64);
        loop {
            let page = client.query(&page, &[&cursor, &PAGE]).await?;
            for row in &page {
                cursor = row.get(0);
                // Decode every column, as the relay does.
                let text: usize = (1..9)
                    .map(|i| row.get::<_, Option<String>>(i).map_or(0, |s| s.len()))
                    .sum();
                std::hint::black_box(text);
            }
            rows += page.len() as u64;
            if (page.len() as i64) < PAGE {
                break;
            }
        }
        Ok((rows, start.elapsed()))
    })
    .await?;
    if rows != expected {
        return Err(anyhow!(
            "the read ceiling saw {rows} rows, expected {expected}"
        ));
    }
    Ok(rows as f64 / elapsed.as_secs_f64())
}

/// A copy of the backlog with the outbox's indexes, `bench_mark_copy`.
async fn copy_backlog(client: &tokio_postgres::Client, limit: Duration) -> Result<()> {
    let setup = [
        "DROP TABLE IF EXISTS bench_mark_copy",
        "CREATE TABLE bench_mark_copy AS SELECT * FROM outbox",
        "ALTER TABLE bench_mark_copy ADD PRIMARY KEY (id)",
        "CREATE INDEX ON bench_mark_copy (relay_seq) WHERE relay_sent_at IS NULL",
        "CREATE UNIQUE INDEX ON bench_mark_copy (relay_seq)",
        // One by one: VACUUM refuses to run in a transaction block.
        "VACUUM (ANALYZE) bench_mark_copy",
    ];
    bounded(
        limit,
        "copying the backlog for the marking ceiling",
        async {
            for sql in setup {
                client.batch_execute(sql).await?;
            }
            Ok(())
        },
    )
    .await
}

/// Rows per statement of the marking ceiling (the relay merges up to 5,000).
const MARK_BATCH: i64 = 1_000;

/// Rows per second of the relay's marking statement, on a copy of the
/// backlog with the same indexes (dropped afterwards).
pub async fn database_mark(db_url: &str, expected: u64) -> Result<f64> {
    let client = connect(db_url).await?;
    let limit = limit_for(expected) + Duration::from_secs(expected / 5_000);
    copy_backlog(&client, limit).await?;
    let mark = client
        .prepare(
            "UPDATE bench_mark_copy SET relay_sent_at = now()
             WHERE relay_sent_at IS NULL AND relay_seq = ANY($1)",
        )
        .await?;
    let row = client
        .query_one(
            "SELECT min(relay_seq), max(relay_seq) FROM bench_mark_copy",
            &[],
        )
        .await?;
    let (first, last): (Option<i64>, Option<i64>) = (row.get(0), row.get(1));
    let result = bounded(limit, "the database marking ceiling", async {
        let start = Instant::now();
        let mut marked = 0u64;
        let mut from = first.unwrap_or(1);
        while from <= last.unwrap_or(0) {
            let seqs: Vec<i64> = (from..(from + MARK_BATCH).min(last.unwrap_or(0) + 1)).collect();
            marked += client.execute(&mark, &[&seqs]).await?;
            from += MARK_BATCH;
        }
        Ok((marked, start.elapsed()))
    })
    .await;
    let _ = client
        .batch_execute("DROP TABLE IF EXISTS bench_mark_copy")
        .await;
    let (marked, elapsed) = result?;
    if marked != expected {
        return Err(anyhow!(
            "the marking ceiling marked {marked} rows, expected {expected}"
        ));
    }
    Ok(marked as f64 / elapsed.as_secs_f64())
}

/// What recording "sent" by ranges (`outbox::progress`, not yet used by the
/// relay) costs the database on a copy of the backlog.
#[derive(Debug, Clone, Copy)]
pub struct RecordCeiling {
    /// Rows per second recorded in batches of 1,000 consecutive `relay_seq`
    /// values, one INSERT each (as Kafka confirms).
    pub contiguous_eps: f64,
    /// The same with every batch every other value of 2,000 (1,000 ranges
    /// of one: the worst a RabbitMQ drain of many aggregates could give).
    pub scattered_eps: f64,
    /// Rows per second of the fold's first round over the recorded copy
    /// (no frontier yet: it looks at every row once).
    pub fold_eps: f64,
}

pub async fn database_record(db_url: &str, expected: u64) -> Result<RecordCeiling> {
    use outbox_relay::config::TableName;
    use outbox_relay::outbox::progress::Ranges;
    use outbox_relay::outbox::progress::fold::Advance;
    let mut client = connect(db_url).await?;
    let limit = limit_for(expected) + Duration::from_secs(expected / 5_000);
    copy_backlog(&client, limit).await?;
    let ranges = Ranges::new(&TableName::new("public", "bench_mark_copy"));
    let drop = format!(
        "DROP TABLE IF EXISTS bench_mark_copy, {}, {}, {}; DROP FUNCTION IF EXISTS {}",
        ranges.progress.quoted(),
        ranges.frontier.quoted(),
        ranges.held.quoted(),
        ranges.sent_function.quoted()
    );
    let result = bounded(limit, "the database recording ceiling", async {
        for sql in ranges.create_sql() {
            client.batch_execute(&sql).await?;
        }
        // Prepared and given runs as the relay does.
        let record = outbox_relay::outbox::MarkStatement::new(
            client.prepare(&ranges.record_sql()).await?,
            outbox_relay::config::MarkMode::Ranges,
        );
        let row = client
            .query_one(
                "SELECT min(relay_seq), max(relay_seq) FROM bench_mark_copy",
                &[],
            )
            .await?;
        let (first, last): (i64, i64) = (
            row.get::<_, Option<i64>>(0).unwrap_or(1),
            row.get::<_, Option<i64>>(1).unwrap_or(0),
        );
        let mut timed = Vec::new();
        for scattered in [false, true] {
            client
                .batch_execute(&format!("TRUNCATE {}", ranges.progress.quoted()))
                .await?;
            let batches: Vec<Vec<i64>> = if scattered {
                (first..=last)
                    .step_by(2 * MARK_BATCH as usize)
                    .flat_map(|from| {
                        let to = (from + 2 * MARK_BATCH).min(last + 1);
                        [
                            (from..to).step_by(2).collect(),
                            (from + 1..to).step_by(2).collect(),
                        ]
                    })
                    .collect()
            } else {
                (first..=last)
                    .step_by(MARK_BATCH as usize)
                    .map(|from| (from..(from + MARK_BATCH).min(last + 1)).collect())
                    .collect()
            };
            let rows: usize = batches.iter().map(Vec::len).sum();
            let start = Instant::now();
            for batch in &batches {
                record.execute(&client, batch).await?;
            }
            timed.push(rows as f64 / start.elapsed().as_secs_f64());
        }
        let capture = ranges.capture(&client, Duration::from_secs(5)).await?;
        let start = Instant::now();
        let advanced = ranges.advance(&mut client, &capture, 1_000).await?;
        let fold_eps = expected as f64 / start.elapsed().as_secs_f64();
        if !matches!(advanced, Advance::Advanced { .. }) {
            return Err(anyhow!(
                "the fold did not advance over the recorded copy: {advanced:?}"
            ));
        }
        Ok(RecordCeiling {
            contiguous_eps: timed[0],
            scattered_eps: timed[1],
            fold_eps,
        })
    })
    .await;
    let _ = client.batch_execute(&drop).await;
    result
}
