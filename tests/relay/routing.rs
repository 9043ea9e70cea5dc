//! Per-row routing (`outbox.columns.destination`, `outbox.columns.key`): a
//! row's own topic or exchange and its own key or routing key, in both
//! source modes and on both brokers; NULL falls back to the configuration;
//! a value the broker's rules refuse is dead-lettered with a reason naming
//! the column and the value, and a corrected letter is redriven to it.

use crate::dead_letters::dlq_list;
use crate::support::brokers::{RabbitExchange, Received};
use crate::support::*;
use uuid::Uuid;

/// The columns of the test table, mapped.
const ROUTING: &[(&str, &str)] = &[
    ("outbox.columns.destination", "\"route_to\""),
    ("outbox.columns.key", "\"route_key\""),
];

/// Where rows with a destination value go: a second Kafka topic, or a
/// second RabbitMQ exchange with its own consumer.
enum Elsewhere {
    Topic(String),
    Exchange(Box<RabbitExchange>),
}

impl Elsewhere {
    async fn new(broker: &Broker) -> Elsewhere {
        match broker {
            Broker::Kafka(k) => {
                k.create("routed").await;
                Elsewhere::Topic(k.topic("routed"))
            }
            Broker::Rabbit(_) => Elsewhere::Exchange(Box::new(RabbitExchange::new().await)),
        }
    }

    /// The value a row's destination column holds to go there.
    fn name(&self) -> &str {
        match self {
            Elsewhere::Topic(t) => t,
            Elsewhere::Exchange(x) => &x.exchange,
        }
    }

    /// The messages that arrived there, and those at the configured destination.
    fn split(&self, broker: &Broker) -> (Vec<Received>, Vec<Received>) {
        match self {
            Elsewhere::Topic(t) => broker
                .inbox()
                .snapshot()
                .into_iter()
                .partition(|m| &m.destination == t),
            Elsewhere::Exchange(x) => (x.inbox.snapshot(), broker.inbox().snapshot()),
        }
    }
}

/// A migrated outbox with the routing columns added as an application
/// table would have them, and the relay config that maps them.
pub(crate) async fn setup_routing(
    mode: Mode,
    kind: Kind,
    sets: &[(&str, &str)],
) -> (TestDb, Broker, String) {
    let (db, broker, mut toml) = setup(mode, kind, &["order"], sets).await;
    db.client
        .batch_execute("ALTER TABLE outbox ADD COLUMN route_to text, ADD COLUMN route_key text")
        .await
        .unwrap();
    for (k, v) in ROUTING {
        toml = set(&toml, k, v);
    }
    (db, broker, toml)
}

pub(crate) async fn insert(
    db: &TestDb,
    id: Uuid,
    aggregate: &str,
    to: Option<&str>,
    key: Option<&str>,
) {
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, route_to, route_key)
             VALUES ($1, 'order', $2, 'OrderPlaced', '{}', $3, $4)",
            &[&id, &aggregate, &to, &key],
        )
        .await
        .unwrap();
}

pub(crate) fn by_id<'a>(got: &'a [Received], id: &Uuid) -> Option<&'a Received> {
    got.iter().find(|m| m.event_id() == id.to_string())
}

/// The message's key as the broker carries it: the Kafka record key, the
/// RabbitMQ routing key.
fn key_of(kind: Kind, m: &Received) -> Option<&str> {
    match kind {
        Kind::Kafka => m.key.as_deref(),
        Kind::Rabbit => Some(m.destination.as_str()),
    }
}

every_mode!(rows_choose_their_destination_and_key);
async fn rows_choose_their_destination_and_key(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup_routing(mode, kind, &[]).await;
    let elsewhere = Elsewhere::new(&broker).await;
    let to = Some(elsewhere.name());
    // Read from the table (in CDC mode, by the start-up read)...
    let early = Uuid::new_v4();
    insert(&db, early, "o-1", to, Some("k-early")).await;
    let relay = InProcess::start(parse(&toml));
    // ...and, the relay running, streamed in CDC mode. One aggregate's
    // events alternate between the two destinations.
    let (both, neither, key_only, dest_only) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    insert(&db, both, "o-1", to, Some("k-1")).await;
    insert(&db, neither, "o-1", None, None).await;
    insert(&db, key_only, "o-1", None, Some("k-2")).await;
    insert(&db, dest_only, "o-1", to, None).await;
    wait_for(WAIT, "every row to be marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    let all = [early, both, neither, key_only, dest_only];
    let (routed, configured) = wait_for(WAIT, "the five messages", || {
        let split = elsewhere.split(&broker);
        async move {
            let arrived = all
                .iter()
                .all(|id| by_id(&split.0, id).or(by_id(&split.1, id)).is_some());
            arrived.then_some(split)
        }
    })
    .await;
    for id in [early, both, dest_only] {
        assert!(
            by_id(&routed, &id).is_some(),
            "{id} went to its own destination"
        );
        assert!(
            by_id(&configured, &id).is_none(),
            "{id} went to one place only"
        );
    }
    for id in [neither, key_only] {
        assert!(
            by_id(&configured, &id).is_some(),
            "NULL: {id} went as configured"
        );
        assert!(by_id(&routed, &id).is_none());
    }
    let key = |got: &[Received], id| key_of(kind, by_id(got, &id).unwrap()).map(str::to_owned);
    assert_eq!(key(&routed, early).as_deref(), Some("k-early"));
    assert_eq!(key(&routed, both).as_deref(), Some("k-1"));
    assert_eq!(key(&configured, key_only).as_deref(), Some("k-2"));
    // NULL key: the aggregate id (Kafka), the routing-key template (RabbitMQ).
    let fallback = match kind {
        Kind::Kafka => "o-1",
        Kind::Rabbit => "order.OrderPlaced",
    };
    assert_eq!(key(&configured, neither).as_deref(), Some(fallback));
    assert_eq!(key(&routed, dest_only).as_deref(), Some(fallback));
    // The routing columns are not published as headers unless listed as extra columns.
    let m = by_id(&routed, &both).unwrap();
    assert!(
        !m.headers.iter().any(|(_, v)| v == "k-1"),
        "{:?}",
        m.headers
    );
    relay.stop().await;
}

every_mode!(a_refused_routing_value_is_dead_lettered_with_its_reason);
async fn a_refused_routing_value_is_dead_lettered_with_its_reason(mode: Mode, kind: Kind) {
    let sets = [
        ("dead_letter.max_attempts", "1"),
        ("dead_letter.refresh_interval", "\"300ms\""),
        ("relay.reject_retry_base", "\"100ms\""),
        ("relay.reject_retry_max", "\"200ms\""),
    ];
    let (db, broker, toml) = setup_routing(mode, kind, &sets).await;
    let elsewhere = Elsewhere::new(&broker).await;
    let path = config_file(&toml);
    let relay = InProcess::start(parse(&toml));
    // Characters no broker takes in a topic or exchange; an empty key; and
    // a later event of the first aggregate, which follows it.
    let (bad_to, follower, empty_key, fine) = (
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
        Uuid::new_v4(),
    );
    insert(&db, bad_to, "P", Some("no such/place"), None).await;
    insert(&db, follower, "P", None, None).await;
    insert(&db, empty_key, "Q", None, Some("")).await;
    insert(&db, fine, "R", None, None).await;
    broker.inbox().wait_ids(&[fine.to_string()], WAIT).await;
    let letters = wait_for(WAIT, "three dead letters", || {
        let path = path.clone();
        async move {
            let l = dlq_list(&path);
            (l.len() == 3).then_some(l)
        }
    })
    .await;
    relay.stop().await;
    let reason = |id: &Uuid| {
        letters
            .iter()
            .find(|l| l["id"] == id.to_string())
            .unwrap_or_else(|| panic!("no letter for {id}: {letters:?}"))["reason"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let why = reason(&bad_to);
    assert!(
        why.contains("column \"route_to\" (outbox.columns.destination) holds \"no such/place\""),
        "{why}"
    );
    assert!(why.contains("contains ' '"), "{why}");
    assert!(reason(&follower).contains(&bad_to.to_string()));
    let why = reason(&empty_key);
    assert!(
        why.contains("column \"route_key\" (outbox.columns.key) holds \"\": the value is empty"),
        "{why}"
    );
    assert_eq!(
        db.unsent().await,
        0,
        "dead-lettered rows are no longer pending"
    );
    for id in [bad_to, follower, empty_key] {
        assert!(
            by_id(&broker.inbox().snapshot(), &id).is_none(),
            "{id} was not published"
        );
    }
    // The operator corrects the value where the letter keeps it, and redrives.
    let corrected = serde_json::json!({ "route_to": elsewhere.name() }).to_string();
    db.client
        .execute(
            "UPDATE outbox_dead_letters SET extra = $1 WHERE id = $2",
            &[&corrected, &bad_to.to_string()],
        )
        .await
        .unwrap();
    let (code, out, err) = run_cli(
        &["dlq", "redrive", "--config", &path, "--aggregate", "P"],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    let relay = InProcess::start(parse(&toml));
    let (routed, configured) = wait_for(WAIT, "the redriven letters", || {
        let split = elsewhere.split(&broker);
        async move {
            (by_id(&split.0, &bad_to).is_some() && by_id(&split.1, &follower).is_some())
                .then_some(split)
        }
    })
    .await;
    assert!(by_id(&configured, &bad_to).is_none());
    assert!(
        by_id(&routed, &follower).is_none(),
        "the follower has no value: as configured"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_names_the_key_of_a_missing_routing_column() {
    let (_db, _broker, mut toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &[]).await;
    for (k, v) in ROUTING {
        toml = set(&toml, k, v);
    }
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    let all = format!("{out}{err}");
    assert_ne!(code, 0, "{all}");
    for expected in [
        "column \"route_to\" (outbox.columns.destination) does not exist",
        "column \"route_key\" (outbox.columns.key) does not exist",
    ] {
        assert!(all.contains(expected), "{expected:?} not in {all}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_looks_up_the_destinations_rows_name() {
    let (db, broker, toml) = setup_routing(Mode::Polling, Kind::Rabbit, &[]).await;
    let elsewhere = Elsewhere::new(&broker).await;
    let missing = unique("missing_");
    insert(&db, Uuid::new_v4(), "a", Some(elsewhere.name()), None).await;
    insert(&db, Uuid::new_v4(), "b", Some(&missing), None).await;
    let (code, out, err) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    let all = format!("{out}{err}");
    assert_ne!(code, 0, "{all}");
    for expected in [
        format!(
            "exchange {:?} (named by rows' outbox.columns.destination) exists",
            elsewhere.name()
        ),
        format!("named by rows' outbox.columns.destination: exchange {missing:?} does not exist"),
    ] {
        assert!(all.contains(&expected), "{expected:?} not in {all}");
    }
}
