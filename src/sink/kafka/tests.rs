//! The sink against librdkafka's mock cluster, for what a real broker here
//! cannot do on demand: go away for a while.

use super::*;
use crate::config::{SinkConfig, load_str};
use rdkafka::mocking::MockCluster;
use std::borrow::Cow;
use std::sync::Arc;

fn config(brokers: &str, topic: &str) -> KafkaConfig {
    let toml = format!(
        "[database]\nurl = \"postgres://relay@db/app\"\n[sink]\ntype = \"kafka\"\nbrokers = \"{brokers}\"\ntopic = \"{topic}\"\ndelivery_timeout = \"1s\"\n"
    );
    match load_str(&toml).unwrap_or_else(|e| panic!("{e}")).sink {
        SinkConfig::Kafka(k) => k,
        SinkConfig::RabbitMq(_) => unreachable!(),
    }
}

fn message(id: &str) -> Message<'static> {
    Message {
        id: Cow::Owned(id.to_owned()),
        key: Cow::Borrowed("a"),
        body: b"{}".to_vec(),
        headers: Vec::new(),
        content_type: "application/json",
        event_type: Cow::Borrowed("E"),
        timestamp_secs: 0,
    }
}

fn route(topic: &str) -> Route {
    Route {
        destination: Arc::from(topic),
        key: "a".into(),
        key_from: "the aggregate id",
        lane: Some(Arc::from(topic)),
    }
}

/// A message waits out a broker outage however long, instead of timing
/// out in librdkafka (after which a later message of its partition could
/// be written before its re-send): here three times `sink.delivery_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waits_out_an_outage_longer_than_the_delivery_timeout() {
    let cluster = MockCluster::new(1).expect("a mock cluster");
    cluster.create_topic("t", 1, 1).expect("a topic");
    let mut sink = KafkaSink::connect(&config(&cluster.bootstrap_servers(), "t"))
        .await
        .expect("connected");
    let first = sink.send(route("t"), message("1")).await.expect("queued");
    tokio::time::timeout(Duration::from_secs(30), first)
        .await
        .expect("answered")
        .expect("delivered");
    cluster.broker_down(1).expect("broker down");
    let mut second = sink.send(route("t"), message("2")).await.expect("queued");
    if let Ok(answer) = tokio::time::timeout(Duration::from_secs(3), &mut second).await {
        panic!("answered during the outage: {answer:?}");
    }
    cluster.broker_up(1).expect("broker up");
    tokio::time::timeout(Duration::from_secs(30), second)
        .await
        .expect("answered after the outage")
        .expect("delivered after the outage");
}
