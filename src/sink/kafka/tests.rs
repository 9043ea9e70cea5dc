//! The sink against librdkafka's mock cluster, for what a real broker here
//! cannot do on demand: go away for a while, or answer a produce request
//! with a given error.

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

/// A mock cluster with topic `t`, and a sink that delivered one message there.
async fn one_delivered() -> (
    MockCluster<'static, rdkafka::producer::DefaultProducerContext>,
    KafkaSink,
) {
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
    (cluster, sink)
}

/// A message waits out a broker outage however long, instead of timing
/// out in librdkafka (after which a later message of its partition could
/// be written before its re-send): here three times `sink.delivery_timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_waits_out_an_outage_longer_than_the_delivery_timeout() {
    let (cluster, mut sink) = one_delivered().await;
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

/// At the end of the ownership lease the producer gives up a message it
/// holds for a broker that is away, instead of writing it once the broker
/// is back (after a new owner's messages, by then): the confirmation fails
/// at once, and the broker never gets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fence_calls_back_a_message_held_for_a_broker_that_is_away() {
    let (cluster, mut sink) = one_delivered().await;
    // The first delivery's report may still count as the client's until
    // its thread has served it.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while sink.producer.in_flight_count() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the client still holds something after its only message was delivered"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let fence = sink.fence().expect("Kafka's client holds messages back");
    assert_eq!(fence().await, 0, "nothing held: nothing to call back");
    cluster.broker_down(1).expect("broker down");
    let mut held = sink
        .send(route("t"), message("2"))
        .await
        .expect("a fence that called nothing back leaves the producer open");
    if let Ok(answer) = tokio::time::timeout(Duration::from_secs(1), &mut held).await {
        panic!("answered during the outage: {answer:?}");
    }
    // At least the held message (the count includes reports not yet served).
    assert!(fence().await >= 1, "the held message was called back");
    assert!(
        matches!(
            sink.send(route("t"), message("4")).await,
            Err(SinkError::Unavailable(_))
        ),
        "a fenced producer takes nothing more: it could overtake what was called back"
    );
    let answer = tokio::time::timeout(Duration::from_secs(10), held)
        .await
        .expect("the held message is answered once fenced");
    assert!(
        matches!(answer, Err(SinkError::Unavailable(_))),
        "a called-back message's fate is unknown to the relay: {answer:?}"
    );
    cluster.broker_up(1).expect("broker up");
    // The next message written lands right after the first: the held one
    // never reached the broker.
    let delivery = tokio::time::timeout(
        Duration::from_secs(30),
        sink.producer
            .send(FutureRecord::to("t").key("a").payload("3"), Duration::ZERO),
    )
    .await
    .expect("answered after the outage")
    .expect("delivered after the outage");
    assert_eq!(
        delivery.offset, 1,
        "only the first message was written before this one"
    );
}

/// A topic without a leader yet (auto-creation under way, or an election)
/// pushes a message back, counting no attempt towards its dead letter,
/// and takes it once it has one; a topic the relay may not write to, one
/// whose creation failed, or one that does not exist, refuses it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_topic_without_a_leader_pushes_back_and_a_forbidden_one_refuses() {
    use rdkafka::types::RDKafkaRespErr as E;
    let cluster = MockCluster::new(1).expect("a mock cluster");
    cluster.create_topic("t", 1, 1).expect("a topic");
    cluster
        .topic_error("t", E::RD_KAFKA_RESP_ERR_LEADER_NOT_AVAILABLE)
        .expect("a topic error");
    let mut sink = KafkaSink::connect(&config(&cluster.bootstrap_servers(), "t"))
        .await
        .expect("connected");
    let pushed = sink.send(route("t"), message("1")).await;
    assert!(
        matches!(&pushed, Err(SinkError::Busy(r)) if r.to_string().contains("no leader for topic \"t\"")),
        "{:?}",
        pushed.err()
    );
    cluster
        .topic_error("t", E::RD_KAFKA_RESP_ERR_NO_ERROR)
        .expect("the error cleared");
    let sent = sink.send(route("t"), message("1")).await.expect("queued");
    tokio::time::timeout(Duration::from_secs(30), sent)
        .await
        .expect("answered")
        .expect("delivered");

    for (code, says) in [
        (
            E::RD_KAFKA_RESP_ERR_TOPIC_AUTHORIZATION_FAILED,
            "give the relay's user write access",
        ),
        (
            E::RD_KAFKA_RESP_ERR_INVALID_REPLICATION_FACTOR,
            "fix what the broker says",
        ),
        (E::RD_KAFKA_RESP_ERR_UNKNOWN_TOPIC_OR_PART, "does not exist"),
    ] {
        let got = topic_problem("u", Some((Some(code), true)));
        assert!(
            matches!(&got, Err(SinkError::Rejected(r)) if r.to_string().contains(says)),
            "{code:?}: {got:?}"
        );
    }
    assert!(matches!(
        topic_problem("u", None),
        Err(SinkError::Rejected(_))
    ));
    assert!(matches!(
        topic_problem("u", Some((None, true))),
        Err(SinkError::Busy(_))
    ));
}

/// What the broker says of a produce request reaches the relay as librdkafka
/// decides: a message too large, a batch over the segment size and a
/// message format the topic cannot store are this message's refusal
/// (retried, then dead-lettered: sent again unchanged they fail again); a
/// corrupt message (a CRC error on the way) is retried by the client
/// itself and delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_the_broker_says_of_a_produce_request_decides_a_refusal() {
    use rdkafka::types::{RDKafkaApiKey, RDKafkaRespErr as E};
    for (code, refused) in [
        (E::RD_KAFKA_RESP_ERR_MSG_SIZE_TOO_LARGE, true),
        (E::RD_KAFKA_RESP_ERR_RECORD_LIST_TOO_LARGE, true),
        (E::RD_KAFKA_RESP_ERR_UNSUPPORTED_FOR_MESSAGE_FORMAT, true),
        (E::RD_KAFKA_RESP_ERR_INVALID_MSG, false),
    ] {
        let (cluster, mut sink) = one_delivered().await;
        cluster.request_errors(RDKafkaApiKey::Produce, &[code]);
        let sent = sink.send(route("t"), message("2")).await.expect("queued");
        let answer = tokio::time::timeout(Duration::from_secs(30), sent)
            .await
            .expect("answered");
        match (answer, refused) {
            (Err(SinkError::Rejected(_)), true) | (Ok(()), false) => {}
            (other, _) => panic!("{code:?}: {other:?}"),
        }
    }
}
