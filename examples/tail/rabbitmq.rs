//! RabbitMQ: a queue of tail's own (exclusive, deleted when tail exits)
//! bound to the exchange, which is declared if it does not exist yet.

use crate::kit::consumers::{Received, bind_consumer};
use crate::{BROKER_CALL, Limits, RabbitArgs};
use anyhow::{Context, Result, anyhow, bail};
use futures::StreamExt;
use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ErrorKind, ExchangeKind};
use outbox_relay::config::redact_url;
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

pub async fn tail(args: RabbitArgs, limits: &Limits) -> Result<ExitCode> {
    let shown_url = redact_url(&args.url);
    let connection = tokio::time::timeout(
        BROKER_CALL,
        Connection::connect(&args.url, ConnectionProperties::default()),
    )
    .await
    .map_err(|_| anyhow!("RabbitMQ at {shown_url} did not answer in time"))?
    .with_context(|| format!("connecting to RabbitMQ at {shown_url}"))?;
    let channel = ensure_exchange(&connection, &args.exchange).await?;
    let tag = "outbox-relay-tail";
    let consumer = bind_consumer(
        &channel,
        &args.exchange,
        &args.binding,
        tag,
        true,
        BROKER_CALL,
    )
    .await
    .map_err(|failed| match failed.error {
        Some(e) => anyhow!(e).context(failed.step),
        None => anyhow!("RabbitMQ did not answer in time ({})", failed.step),
    })?;
    eprintln!(
        "ready: queue {} bound to exchange {} with binding key {:?}",
        consumer.queue(),
        args.exchange,
        args.binding
    );
    let messages = consumer.map(|d| {
        d.map_err(anyhow::Error::from).map(|d| Received {
            destination: format!("exchange {}, routing key {}", d.exchange, d.routing_key),
            ..Received::from_amqp(d, amqp_time)
        })
    });
    let code = crate::print::print_messages(messages, limits).await;
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
