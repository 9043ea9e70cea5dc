//! RabbitMQ exchanges the relay publishes to: required to exist by default
//! (`check` and the refusal say how to fix it), or declared on first use
//! with `sink.declare_exchange`, of `sink.exchange_type`.

use crate::support::brokers::RabbitExchange;
use crate::support::*;
use lapin::options::ExchangeDeclareOptions;
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use serde_json::json;

/// Declares `exchange` as `kind` (durable), or only looks for it when
/// `passive`; false when the broker refuses (absent, or of another kind).
async fn declare(
    connection: &Connection,
    exchange: &str,
    kind: ExchangeKind,
    passive: bool,
) -> bool {
    let Ok(channel) = connection.create_channel().await else {
        return false;
    };
    let options = ExchangeDeclareOptions {
        passive,
        durable: true,
        ..Default::default()
    };
    channel
        .exchange_declare(exchange.into(), kind, options, FieldTable::default())
        .await
        .is_ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_exchange_is_declared_on_first_use_when_asked() {
    let db = TestDb::new().await;
    let exchange = unique("t");
    let sink = RabbitExchange::with_name(&exchange, false)
        .await
        .sink_toml();
    let toml = set(
        &base_toml(&db.url, &sink),
        "relay.reject_retry_base",
        "\"100ms\"",
    );
    db.migrate(&parse(&toml)).await;
    let id = uuid::Uuid::new_v4();
    db.insert(id, "order", "a1", json!({})).await;
    let (_, out, _) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert!(
        out.contains("does not exist")
            && out.contains("declare it, or set sink.declare_exchange = true"),
        "check names the missing exchange and the fix: {out}"
    );

    let toml = set(
        &set(&toml, "sink.declare_exchange", "true"),
        "sink.exchange_type",
        "\"fanout\"",
    );
    let relay = InProcess::start(parse(&toml));
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    wait_for(WAIT, "the relay to declare the exchange", || async {
        declare(&connection, &exchange, ExchangeKind::Fanout, true)
            .await
            .then_some(())
    })
    .await;
    assert!(
        declare(&connection, &exchange, ExchangeKind::Fanout, false).await,
        "declared durable, of sink.exchange_type"
    );
    // Until a queue is bound the event is unroutable, refused and retried.
    let consumer = RabbitExchange::bind_existing(&exchange, "#").await;
    consumer.inbox.wait_ids(&[id.to_string()], WAIT).await;
    db.wait_all_marked().await;
    relay.stop().await;
}
