//! A redrive larger than one look's batch: the relay looks again as soon as
//! a batch is published, so it goes on at the broker's pace, in order, and
//! its aggregate resumes at once, whatever `dead_letter.refresh_interval`.

use crate::dead_letters::{dlq_list, full_queue};
use crate::support::brokers::first_ids;
use crate::support::*;
use serde_json::json;

/// A polling relay to RabbitMQ whose periodic looks are an hour apart: only
/// the looks it hurries move a redrive on.
async fn looks_an_hour_apart() -> (TestDb, Broker, String) {
    setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[("dead_letter.refresh_interval", "\"1h\"")],
    )
    .await
}

/// Writes the dead letters `rows` selects (id, aggregate type, aggregate id,
/// reason, when they failed) and asks for every letter's redrive while no
/// relay runs: its first look finds them. Returns the configuration's path.
async fn requested_letters(db: &TestDb, toml: &str, rows: &str) -> String {
    let path = config_file(toml);
    db.client
        .execute(
            &format!(
                "INSERT INTO outbox_dead_letters (id, aggregate_type, aggregate_id, event_type, payload,
                                                  created_at, reason, attempts, first_failed_at, last_failed_at)
                 SELECT r.id, r.t, r.a, 'OrderCreated', '{{}}', now()::text, r.reason, 5, r.at, r.at
                 FROM ({rows}) AS r (id, t, a, reason, at)"
            ),
            &[],
        )
        .await
        .expect("dead letters");
    let (code, out, err) = run_cli(&["dlq", "redrive", "--all", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_of_many_batches_goes_on_without_waiting_for_the_next_look() {
    const LETTERS: usize = 1_200; // more than two looks' batches of 500
    let (db, broker, toml) = looks_an_hour_apart().await;
    let path = config_file(&toml);
    db.client
        .execute(
            "INSERT INTO outbox_dead_letters (id, aggregate_type, aggregate_id, event_type, payload,
                                              created_at, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'r' || lpad(g::text, 5, '0'), 'order', 'A', 'OrderCreated', '{}', now()::text,
                    'message too large', 5, now(), now()
             FROM generate_series(1, $1::int) g",
            &[&(LETTERS as i32)],
        )
        .await
        .expect("letters of one aggregate");
    let (code, out, err) = run_cli(
        &["dlq", "redrive", "--aggregate", "A", "--config", &path],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");

    // With a look an hour apart, only the relay's own looks move it on.
    let relay = InProcess::start(parse(&toml));
    let expected: Vec<String> = (1..=LETTERS).map(|i| format!("r{i:05}")).collect();
    let got = broker.inbox().wait_ids(&expected, WAIT).await;
    let order: Vec<String> = got.iter().map(|m| m.event_id()).collect();
    assert_eq!(order[..LETTERS], expected[..], "in order, each once");
    wait_for(WAIT, "every letter resolved", || {
        let path = path.clone();
        async move { dlq_list(&path).is_empty().then_some(()) }
    })
    .await;
    // The aggregate flows again: a new event of it is published.
    let later = uuid::Uuid::new_v4();
    db.insert(later, "order", "A", json!({})).await;
    broker.inbox().wait_ids(&[later.to_string()], WAIT).await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_on_many_followers_is_extended_look_after_look_without_waiting() {
    // More followers than one look extends (lookups::EXTEND_BATCH, 20,000).
    const LETTERS: i32 = 20_050;
    let (db, broker, toml) = looks_an_hour_apart().await;
    // As the relay leaves them: the operator asked for the aggregate's
    // oldest letter; its followers are not requested yet.
    db.client
        .execute(
            "INSERT INTO outbox_dead_letters (id, aggregate_type, aggregate_id, event_type, payload,
                                              created_at, reason, attempts, first_failed_at, last_failed_at,
                                              redrive_requested_at)
             SELECT 'r' || lpad(g::text, 5, '0'), 'order', 'A', 'OrderCreated', '{}', now()::text,
                    'message too large', 5, now(), now(), CASE WHEN g = 1 THEN now() END
             FROM generate_series(1, $1::int) g",
            &[&LETTERS],
        )
        .await
        .expect("letters of one aggregate");

    // The look on start extends the request to 20,000 followers and hands
    // nothing over (the aggregate is not covered yet); with the next look an
    // hour away, only an immediate one publishes anything.
    let relay = InProcess::start(parse(&toml));
    let first: Vec<String> = (1..=500).map(|i| format!("r{i:05}")).collect();
    let got = broker.inbox().wait_ids(&first, WAIT).await;
    let order: Vec<String> = got.iter().map(|m| m.event_id()).collect();
    assert_eq!(order[..first.len()], first[..], "in order, each once");
    let unrequested: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM outbox_dead_letters WHERE redrive_requested_at IS NULL AND resolution IS NULL",
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(unrequested, 0, "every follower is requested");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_goes_on_when_another_aggregates_redrive_ends_first() {
    // Aggregate A's one letter is published and resolved first: A resumes,
    // which makes the relay read again, while B's letters of the same look
    // are still queued or in flight. B's redrive must go on from there,
    // not an hour later.
    const LETTERS: usize = 1_200;
    let (db, broker, toml) = looks_an_hour_apart().await;
    let rows = format!(
        "SELECT CASE WHEN g = 0 THEN 'a' ELSE 'r' || lpad(g::text, 5, '0') END,
                'order', CASE WHEN g = 0 THEN 'A' ELSE 'B' END, 'message too large', now()
         FROM generate_series(0, {LETTERS}) g"
    );
    let path = requested_letters(&db, &toml, &rows).await;

    let relay = InProcess::start(parse(&toml));
    let mut expected = vec!["a".to_owned()];
    expected.extend((1..=LETTERS).map(|i| format!("r{i:05}")));
    let got = broker.inbox().wait_ids(&expected, WAIT).await;
    let firsts = first_ids(&got);
    assert_eq!(firsts.len(), got.len(), "each letter once");
    let b_order: Vec<&String> = firsts.iter().filter(|id| id.starts_with('r')).collect();
    assert_eq!(b_order.len(), LETTERS, "B's letters");
    assert!(
        b_order.iter().zip(&expected[1..]).all(|(a, b)| *a == b),
        "B's letters in order"
    );
    wait_for(WAIT, "every letter resolved", || {
        let path = path.clone();
        async move { dlq_list(&path).is_empty().then_some(()) }
    })
    .await;
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_refused_again_lets_the_others_go_on_without_waiting() {
    // B's 600 letters fill the first look's batch (500); D's 10 come after
    // them. B's go to a topic that does not exist: refused, which ends B's
    // request. D's letters must follow with the next look, at once, not
    // an hour later.
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Kafka,
        &["order"],
        &[("dead_letter.refresh_interval", "\"1h\"")],
    )
    .await;
    let rows = "SELECT CASE WHEN g <= 600 THEN 'b' ELSE 'd' END || lpad(g::text, 5, '0'),
                       CASE WHEN g <= 600 THEN 'nowhere' ELSE 'order' END,
                       CASE WHEN g <= 600 THEN 'B' ELSE 'D' END, 'topic missing', now()
                FROM generate_series(1, 610) g";
    requested_letters(&db, &toml, rows).await;

    let relay = InProcess::start(parse(&toml));
    let d: Vec<String> = (601..=610).map(|i| format!("d{i:05}")).collect();
    let got = broker.inbox().wait_ids(&d, WAIT).await;
    assert_eq!(first_ids(&got), d, "D's letters, in order, each once");
    // B's letters stay open and no longer requested; the first one carries
    // the new refusal.
    let row = db
        .client
        .query_one(
            "SELECT count(*) FILTER (WHERE resolution IS NULL AND redrive_requested_at IS NULL),
                    max(reason) FILTER (WHERE id = 'b00001')
             FROM outbox_dead_letters WHERE aggregate_id = 'B'",
            &[],
        )
        .await
        .expect("B's letters");
    assert_eq!(
        row.get::<_, i64>(0),
        600,
        "B's letters stay open, unrequested"
    );
    let reason: String = row.get(1);
    assert!(reason.contains("does not exist"), "{reason}");
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_pushed_back_by_a_full_queue_waits_for_the_next_look() {
    // The queue is full: every redriven letter is pushed back (a nack, not
    // a refusal that counts). The request stays, and the letters wait for
    // the next periodic look (an hour away) instead of going round again
    // and again on looks hurried for other aggregates' letters.
    let (db, broker, toml) = looks_an_hour_apart().await;
    let Broker::Rabbit(r) = &broker else {
        unreachable!()
    };
    let full = full_queue(0).await;
    let toml = toml.replace(
        &format!("exchange = \"{}\"", r.exchange),
        &format!("exchange = \"{}\"", full.exchange),
    );
    let rows = "SELECT 'l' || g, 'order', 'A' || g, 'message too large', now() - interval '1 day'
                FROM generate_series(1, 5) g";
    requested_letters(&db, &toml, rows).await;

    let relay = InProcess::start(parse(&toml));
    let failed_today = "SELECT count(*) FROM outbox_dead_letters
                        WHERE last_failed_at > now() - interval '1 hour'";
    wait_for(WAIT, "every letter pushed back once", || async {
        let n: i64 = db.client.query_one(failed_today, &[]).await.ok()?.get(0);
        (n == 5).then_some(())
    })
    .await;
    let pushed_back = "SELECT max(last_failed_at)::text, count(*) FILTER (WHERE redrive_requested_at IS NOT NULL),
                              count(*) FILTER (WHERE resolution IS NULL)
                       FROM outbox_dead_letters";
    let first = db
        .client
        .query_one(pushed_back, &[])
        .await
        .expect("letters");
    tokio::time::sleep(std::time::Duration::from_secs(2)).await;
    let later = db
        .client
        .query_one(pushed_back, &[])
        .await
        .expect("letters");
    assert_eq!(later.get::<_, i64>(1), 5, "the requests stay");
    assert_eq!(later.get::<_, i64>(2), 5, "the letters stay open");
    assert_eq!(
        first.get::<_, String>(0),
        later.get::<_, String>(0),
        "no letter was tried again before the next look"
    );
    relay.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn letters_without_an_aggregate_end_their_redrive_and_hold_no_others_back() {
    // 600 letters of rows without an aggregate id fill the first look's
    // batch (500); D's 10 come after them. Nothing holds the former back,
    // and they can never be published (an event needs an aggregate id):
    // they are refused again, which ends their request, and D's follow at
    // once, not an hour later.
    let (db, broker, toml) = looks_an_hour_apart().await;
    let rows = "SELECT CASE WHEN g <= 600 THEN 'n' ELSE 'd' END || lpad(g::text, 5, '0'), 'order',
                       CASE WHEN g <= 600 THEN NULL ELSE 'D' END, 'aggregate_id is NULL', now()
                FROM generate_series(1, 610) g";
    requested_letters(&db, &toml, rows).await;

    let relay = InProcess::start(parse(&toml));
    let d: Vec<String> = (601..=610).map(|i| format!("d{i:05}")).collect();
    let got = broker.inbox().wait_ids(&d, WAIT).await;
    assert_eq!(first_ids(&got), d, "D's letters, in order, each once");
    let still_asked = "SELECT count(*) FROM outbox_dead_letters
                       WHERE aggregate_id IS NULL AND resolution IS NULL AND redrive_requested_at IS NOT NULL";
    wait_for(WAIT, "every request without an aggregate ended", || async {
        let n: i64 = db.client.query_one(still_asked, &[]).await.ok()?.get(0);
        (n == 0).then_some(())
    })
    .await;
    assert_eq!(
        db.count("SELECT count(*) FROM outbox_dead_letters WHERE aggregate_id IS NULL AND resolution IS NULL")
            .await,
        600,
        "they stay open"
    );
    relay.stop().await;
}
