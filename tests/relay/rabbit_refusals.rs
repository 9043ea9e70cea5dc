//! RabbitMQ refusing a message after it was published: unroutable
//! messages, whose returns lapin hands to whichever confirmations complete
//! next, and exchanges that refuse publishes by closing the channel. Each
//! is a refusal of its own event, dead-lettered, while the others flow.

use crate::dead_letters::{dlq_list, only_orders_routed};
use crate::routing::{by_id, insert, setup_routing};
use crate::support::*;
use uuid::Uuid;

/// Many unroutable messages among routed ones, in one transaction: the
/// broker answers them with returns that lapin hands to whichever
/// confirmations its (multiple) acks complete. Every one of them is still
/// a refusal, dead-lettered, and none is counted delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_one_of_many_unroutable_messages_is_a_refusal() {
    let (db, _broker, toml, bound) = only_orders_routed().await;
    let (mut routed_ids, mut unroutable) = (Vec::new(), Vec::new());
    let client = connect(&db.url).await;
    client.batch_execute("BEGIN").await.unwrap();
    for i in 0..120 {
        let id = Uuid::new_v4();
        let (kind, ids) = if i % 3 == 0 {
            ("invoice", &mut unroutable)
        } else {
            ("order", &mut routed_ids)
        };
        client
            .execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) \
                 VALUES ($1, $2, $3, 'created', '{}')",
                &[&id, &kind, &format!("a{i}")],
            )
            .await
            .unwrap();
        ids.push(id.to_string());
    }
    client.batch_execute("COMMIT").await.unwrap();
    let relay = InProcess::start(parse(&toml));
    bound.inbox.wait_ids(&routed_ids, WAIT).await;
    let path = config_file(&toml);
    let mut lettered = wait_for(WAIT, "every unroutable event dead-lettered", || {
        let path = path.clone();
        let want = unroutable.len();
        async move {
            let l = dlq_list(&path);
            (l.len() >= want).then_some(l)
        }
    })
    .await
    .iter()
    .map(|l| l["id"].as_str().unwrap().to_owned())
    .collect::<Vec<_>>();
    lettered.sort();
    unroutable.sort();
    assert_eq!(lettered, unroutable, "each unroutable event, once");
    relay.stop().await;
}

/// An exchange the broker refuses publishing to (an internal one here; no
/// write permission or a deleted exchange close the channel the same way)
/// closes the relay's publishing channel. The event routed there is a
/// refusal, dead-lettered with the broker's reason, and the other
/// aggregates flow; it no longer closes the channel at every run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_that_refuses_publishes_is_dead_lettered_and_others_flow() {
    let sets = [
        ("dead_letter.max_attempts", "2"),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
    ];
    let (db, broker, toml) = setup_routing(Mode::Polling, Kind::Rabbit, &sets).await;
    let internal = crate::kit::unique("internal");
    let connection = lapin::Connection::connect(&amqp_url(), Default::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    let options = lapin::options::ExchangeDeclareOptions {
        durable: true,
        internal: true,
        ..Default::default()
    };
    channel
        .exchange_declare(
            internal.as_str().into(),
            lapin::ExchangeKind::Topic,
            options,
            Default::default(),
        )
        .await
        .unwrap();
    // Messages to the configured exchange before and after it, so that
    // some are in flight when the broker closes the channel over it.
    let refused = Uuid::new_v4();
    let mut others = Vec::new();
    for i in 0..120 {
        if i == 60 {
            insert(&db, refused, "P", Some(&internal), None).await;
        }
        let id = Uuid::new_v4();
        insert(&db, id, &format!("o{i}"), None, None).await;
        others.push(id.to_string());
    }
    let says = ["closed the channel", "internal exchange"];
    others_flow_and_one_is_dead_lettered(&toml, &broker, &others, refused, &says).await;
    let _ = channel
        .exchange_delete(internal.as_str().into(), Default::default())
        .await;
}

/// RabbitMQ's own `max_message_size` for the test, put back when dropped.
/// Set above the relay's default `sink.message_max_bytes` (16 MiB), so
/// that other tests, sending less, never meet it.
struct MaxMessageSize(String);

impl MaxMessageSize {
    fn set(bytes: u64) -> Self {
        let before = rabbitmqctl_eval("application:get_env(rabbit, max_message_size).");
        let before = before
            .trim()
            .strip_prefix("{ok,")
            .and_then(|v| v.strip_suffix('}'))
            .unwrap_or("134217728")
            .to_owned();
        rabbitmqctl_eval(&format!(
            "application:set_env(rabbit, max_message_size, {bytes})."
        ));
        Self(before)
    }
}

impl Drop for MaxMessageSize {
    fn drop(&mut self) {
        rabbitmqctl_eval(&format!(
            "application:set_env(rabbit, max_message_size, {}).",
            self.0
        ));
    }
}

fn rabbitmqctl_eval(expr: &str) -> String {
    let out = std::process::Command::new("rabbitmqctl")
        .args(["-q", "eval", expr])
        .output()
        .expect("rabbitmqctl runs");
    assert!(out.status.success(), "rabbitmqctl eval {expr}: {out:?}");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A message under `sink.message_max_bytes` but over the broker's
/// `max_message_size`: RabbitMQ closes the channel over it. That is the
/// event's refusal, dead-lettered with the broker's reason, and the others
/// flow; before, the channel closed at every run and nothing got through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_over_the_brokers_size_limit_is_dead_lettered_and_others_flow() {
    let limit: u64 = 17 * 1024 * 1024;
    let sets = [
        ("sink.message_max_bytes", "18874368"),
        ("dead_letter.max_attempts", "2"),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
    ];
    let (db, broker, toml) = setup_routing(Mode::Polling, Kind::Rabbit, &sets).await;
    let _limit = MaxMessageSize::set(limit);
    let large = Uuid::new_v4();
    let payload = format!("{{\"b\":\"{}\"}}", "x".repeat(limit as usize + 4096));
    let mut others = Vec::new();
    for i in 0..40 {
        if i == 20 {
            db.client
                .execute(
                    "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                     VALUES ($1, 'order', 'L', 'OrderPlaced', $2::text::jsonb)",
                    &[&large, &payload],
                )
                .await
                .unwrap();
        }
        let id = Uuid::new_v4();
        insert(&db, id, &format!("o{i}"), None, None).await;
        others.push(id.to_string());
    }
    let says = ["closed the channel", "max_message_size"];
    others_flow_and_one_is_dead_lettered(&toml, &broker, &others, large, &says).await;
}

/// Runs the relay on `toml` until `others` arrived and one event is
/// dead-lettered: `refused`, with a reason that says each of `says`, and
/// never delivered.
async fn others_flow_and_one_is_dead_lettered(
    toml: &str,
    broker: &Broker,
    others: &[String],
    refused: Uuid,
    says: &[&str],
) {
    let path = config_file(toml);
    let relay = InProcess::start(parse(toml));
    broker.inbox().wait_ids(others, WAIT).await;
    let letters = wait_for(WAIT, "the refused event dead-lettered", || {
        let path = path.clone();
        async move {
            let l = dlq_list(&path);
            (!l.is_empty()).then_some(l)
        }
    })
    .await;
    relay.stop().await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0]["id"], refused.to_string());
    let why = letters[0]["reason"].as_str().unwrap();
    assert!(says.iter().all(|s| why.contains(s)), "{why}");
    assert!(by_id(&broker.inbox().snapshot(), &refused).is_none());
}
