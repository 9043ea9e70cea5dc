//! A message whose properties do not fit in one AMQP frame.

use crate::dead_letters::{dlq_list, wait_dead_letters};
use crate::support::*;
use serde_json::json;
use uuid::Uuid;

/// RabbitMQ takes a message's properties (its headers) in one frame of
/// at most `frame_max` (128 KiB): a longer aggregate id, sent as the
/// `cloudEvents:subject` header in binary mode, is refused and
/// dead-lettered, and the events after it flow, instead of the
/// connection failing on it again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn properties_larger_than_a_frame_are_dead_lettered() {
    let sets = [
        ("envelope.mode", "\"binary\""),
        ("dead_letter.max_attempts", "2"),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
    ];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let path = config_file(&toml);
    let poison = Uuid::new_v4();
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES ($1, 'order', repeat('x', 200000), 'Happened', '{}')",
            &[&poison],
        )
        .await
        .unwrap();
    let after = Uuid::new_v4();
    db.insert(after, "order", "g", json!({})).await;
    let relay = InProcess::start(parse(&toml));
    broker.inbox().wait_ids(&[after.to_string()], WAIT).await;
    wait_dead_letters(&path, 1, "the event dead-lettered").await;
    let letter = &dlq_list(&path)[0];
    assert_eq!(letter["id"], poison.to_string());
    assert!(
        letter["reason"]
            .as_str()
            .unwrap_or_default()
            .contains("frame_max"),
        "{letter}"
    );
    assert_eq!(
        broker.inbox().len(),
        1,
        "only the other event was published"
    );
    relay.stop().await;
}
