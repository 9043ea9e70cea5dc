//! `relay.mark = "ranges"` (polling and CDC) end to end, against real
//! PostgreSQL and brokers: every event published once, no outbox row
//! written, the fold moving the frontier past what was recorded, and a
//! restart publishing only what is new.

use crate::support::brokers::Received;
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::outbox::progress::Ranges;
use std::collections::HashMap;
use uuid::Uuid;

/// Inserts `n` events of aggregate `agg` in transactions of `per_tx`.
pub(crate) async fn insert(db: &TestDb, agg: &str, n: usize, per_tx: usize) -> Vec<String> {
    let mut ids = Vec::new();
    for (c, chunk) in super::support::ids(n).chunks(per_tx).enumerate() {
        let values: Vec<String> = chunk
            .iter()
            .enumerate()
            .map(|(i, id)| {
                let i = c * per_tx + i;
                format!("('{id}', 'order', '{agg}', 'created', '{{\"i\": {i}}}')")
            })
            .collect();
        db.client
            .batch_execute(&format!(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES {}",
                values.join(", ")
            ))
            .await
            .unwrap();
        ids.extend(chunk.iter().map(Uuid::to_string));
    }
    ids
}

pub(crate) fn deliveries(got: &[Received]) -> HashMap<String, usize> {
    let mut n = HashMap::new();
    for m in got {
        *n.entry(m.event_id()).or_default() += 1;
    }
    n
}

/// Every id published exactly once, and nothing else.
pub(crate) fn once_each(broker: &Broker, ids: &[String], what: &str) {
    let got = broker.inbox().snapshot();
    let n = deliveries(&got);
    let other: Vec<_> = ids.iter().filter(|id| n.get(*id) != Some(&1)).collect();
    assert!(
        other.is_empty(),
        "{what}: published other than once: {other:?}"
    );
    assert_eq!(got.len(), ids.len(), "{what}: nothing published again");
}

pub(crate) async fn count(db: &TestDb, sql: &str) -> i64 {
    db.client.query_one(sql, &[]).await.unwrap().get(0)
}

async fn publishes_once_and_writes_no_row(mode: Mode, kind: Kind, extra: &[(&str, &str)]) {
    let mut sets = vec![("relay.mark", "\"ranges\"")];
    sets.extend_from_slice(extra);
    let (db, broker, toml) = setup(mode, kind, &["order"], &sets).await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    // A late committer: it takes relay_seq values below rows committed
    // before it.
    let late_client = connect(&db.url).await;
    late_client.batch_execute("BEGIN").await.unwrap();
    late_client
        .batch_execute("INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
                        VALUES ('00000000-0000-0000-0000-00000000000a', 'order', 'late', 'created', '{}')")
        .await
        .unwrap();
    let mut ids = insert(&db, "a", 200, 10).await;
    for agg in ["d", "e", "f", "g", "h"] {
        ids.extend(insert(&db, agg, 4, 2).await);
    }
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    late_client.batch_execute("COMMIT").await.unwrap();
    ids.push("00000000-0000-0000-0000-00000000000a".into());
    ids.extend(insert(&db, "b", 100, 1).await);
    broker.inbox().wait_ids(&ids, WAIT).await;
    // The fold moves the frontier past everything and deletes the
    // progress rows it covers; the table says nothing is unsent.
    let progress = format!("SELECT count(*) FROM {}", ranges.progress.quoted());
    wait_for(WAIT, "the fold to cover every recorded batch", || async {
        (count(&db, &progress).await == 0).then_some(())
    })
    .await;
    let backlog = ranges.read_sql("relay_seq", "").backlog;
    assert_eq!(count(&db, &backlog).await, 0);
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL"
        )
        .await,
        0
    );
    let frontier = format!("SELECT count(*) FROM {}", ranges.frontier.quoted());
    assert!(count(&db, &frontier).await >= 1);
    let status = outbox_relay::ops::status::snapshot(
        &db.client,
        &parse(&toml),
        outbox_relay::ops::status::Reads::ALL,
    )
    .await
    .unwrap();
    assert_eq!(status.backlog, Some(0));
    assert!(
        status.last_publish.is_some(),
        "the last publish time comes from the progress"
    );
    let (_, out, err) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert!(
        out.contains("0 unsent row(s)"),
        "check counts by the frontier: {out}{err}"
    );
    // A crash, new events, a restart: only the new ones are published.
    relay.kill();
    let before = broker.inbox().len();
    let new = insert(&db, "c", 50, 5).await;
    let _relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&new, WAIT).await;
    let got = broker.inbox().snapshot();
    let n = deliveries(&got);
    let twice: Vec<_> = ids.iter().filter(|id| n.get(*id) != Some(&1)).collect();
    assert!(twice.is_empty(), "published other than once: {twice:?}");
    assert_eq!(got.len(), before + new.len(), "nothing old published again");
    assert_each_aggregate_in_order(&got);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_with_ranges_to_rabbitmq_publishes_once_and_writes_no_row() {
    publishes_once_and_writes_no_row(Mode::Polling, Kind::Rabbit, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_with_ranges_to_kafka_publishes_once_and_writes_no_row() {
    publishes_once_and_writes_no_row(Mode::Polling, Kind::Kafka, &[]).await;
}

/// Shards: every branch of each shard's reads carries the shard's
/// condition, and the late committer's row is its shard's straggler.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sharded_polling_with_ranges_publishes_once_and_writes_no_row() {
    publishes_once_and_writes_no_row(Mode::Polling, Kind::Rabbit, &[("relay.shards", "4")]).await;
}

/// CDC: the start-up read after the kill goes by the frontier, and the
/// stream skips what it read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_with_ranges_to_rabbitmq_publishes_once_and_writes_no_row() {
    publishes_once_and_writes_no_row(Mode::Cdc, Kind::Rabbit, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_with_ranges_to_kafka_publishes_once_and_writes_no_row() {
    publishes_once_and_writes_no_row(Mode::Cdc, Kind::Kafka, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_are_recorded_with_their_transaction_and_not_read_again() {
    use crate::dead_letters::{dlq_list, insert_big, poison_settings, wait_dead_letters};
    let mut sets = poison_settings("\"follow\"");
    sets.push(("relay.mark", "\"ranges\""));
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let path = config_file(&toml);
    insert_big(&db, Uuid::new_v4(), "P").await;
    insert(&db, "P", 2, 1).await;
    let others = insert(&db, "g", 20, 4).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&others, WAIT).await;
    wait_dead_letters(
        &path,
        3,
        "the poison event and its two followers dead-lettered",
    )
    .await;
    let backlog = ranges.read_sql("relay_seq", "").backlog;
    assert_eq!(
        count(&db, &backlog).await,
        0,
        "dead-lettered rows are recorded"
    );
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL"
        )
        .await,
        0
    );
    relay.kill();
    let before = broker.inbox().len();
    let new = insert(&db, "h", 1, 1).await;
    let _relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&new, WAIT).await;
    assert_eq!(
        broker.inbox().len(),
        before + 1,
        "nothing read again after the restart"
    );
    assert_eq!(dlq_list(&path).len(), 3, "nothing dead-lettered again");
}

/// SIGKILLs while a writer is busy: every event arrives, each aggregate's
/// first deliveries in order, and what comes again is at most what was in
/// flight or confirmed and not yet recorded at each kill.
async fn sigkills_lose_nothing_and_repeat_at_most_the_window(mode: Mode) {
    const WINDOW: usize = 100;
    const KILLS: usize = 3;
    let (db, broker, toml) = setup(
        mode,
        Kind::Kafka,
        &["order"],
        &[("relay.mark", "\"ranges\"")],
    )
    .await;
    let toml = set(&toml, "relay.max_in_flight", &WINDOW.to_string());
    let toml = set(&toml, "relay.ownership_lease", "\"1s\"");
    let writer = crate::duplicates::start_writer(db.url.clone(), 2100);
    kill_while_busy_with_env(&toml, &[], broker.inbox(), KILLS, 300).await;
    let ids = writer.await.unwrap();
    let mut child = ChildRelay::start(&toml);
    let got = broker.inbox().wait_ids(&ids, WAIT).await;
    let duplicates = got.len() - ids.len();
    assert!(
        duplicates <= KILLS * WINDOW,
        "{duplicates} duplicates exceed {KILLS} kills x {WINDOW}"
    );
    assert_each_aggregate_in_order(&got);
    assert_eq!(child.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_sigkills_with_ranges_lose_nothing_and_repeat_at_most_the_window() {
    sigkills_lose_nothing_and_repeat_at_most_the_window(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_sigkills_with_ranges_lose_nothing_and_repeat_at_most_the_window() {
    sigkills_lose_nothing_and_repeat_at_most_the_window(Mode::Cdc).await;
}

/// An outbox migrated for another mode: the relay with ranges stops
/// starting with what to run, not a bare "relation does not exist".
#[tokio::test]
async fn a_missing_progress_table_says_to_run_migrate() {
    use outbox_relay::config::MarkMode;
    use outbox_relay::source::record::RowRecorder;
    let (db, _broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &[]).await;
    let config = parse(&toml);
    let refused = RowRecorder::new(
        connect(&db.url).await,
        &config.outbox.table,
        MarkMode::Ranges,
        None,
        false,
    )
    .await
    .err()
    .expect("refused");
    assert_eq!(
        refused.to_string(),
        "relay.mark = \"ranges\" records sent rows in public.outbox_relay_progress, which does not exist: run outbox-relay migrate"
    );
    assert_eq!(
        refused.kind(),
        outbox_relay::errors::ErrorKind::NeedsOperator
    );
}

/// The backend holding the fold's lock in this test's database, if one
/// does (other tests' databases have outboxes of the same name).
async fn fold_backend(db: &TestDb) -> Option<i32> {
    db.client
        .query_opt(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted
               AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
               AND ((classid::int8 << 32) | objid::int8) = hashtextextended('outbox-relay-fold:public.outbox', 0)",
            &[],
        )
        .await
        .unwrap()
        .map(|r| r.get(0))
}

/// The fold's session is ended five times while events flow (whatever it
/// was doing: a capture, a round's transaction, waiting): the relay goes
/// on publishing, the fold comes back on a new session and covers every
/// recorded batch, and nothing is published twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fold_comes_back_after_losing_its_session() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[("relay.mark", "\"ranges\"")],
    )
    .await;
    let toml = set(&toml, "relay.retry_max", "\"1s\"");
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let progress = format!("SELECT count(*) FROM {}", ranges.progress.quoted());
    let _relay = ChildRelay::start(&toml);
    let mut ids = Vec::new();
    let mut ended = Vec::new();
    for round in 0..5 {
        ids.extend(insert(&db, &format!("k{round}"), 40, 4).await);
        let pid = wait_for(WAIT, "a session to hold the fold's lock", || async {
            fold_backend(&db).await.filter(|p| !ended.contains(p))
        })
        .await;
        let ended_now: bool = db
            .client
            .query_one("SELECT pg_terminate_backend($1)", &[&pid])
            .await
            .unwrap()
            .get(0);
        assert!(ended_now, "the fold's backend {pid} was ended");
        ended.push(pid);
    }
    ids.extend(insert(&db, "after", 20, 2).await);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "a new fold session to cover every batch", || async {
        let back = fold_backend(&db).await.is_some_and(|p| !ended.contains(&p));
        (back && count(&db, &progress).await == 0).then_some(())
    })
    .await;
    let backlog = ranges.read_sql("relay_seq", "").backlog;
    assert_eq!(count(&db, &backlog).await, 0);
    let got = broker.inbox().snapshot();
    assert_eq!(got.len(), ids.len(), "each event published once");
    assert_each_aggregate_in_order(&got);
}

/// `check` with ranges: ready after migrate; a warning for a missing xid
/// index and for progress no fold covered; a failure naming the GRANT a
/// role lacks, and one saying to run migrate when a table is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_reports_the_tables_that_record_what_was_sent() {
    let (db, _broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[("relay.mark", "\"ranges\"")],
    )
    .await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let check = |toml: &str| {
        let (code, out, err) = run_cli(&["check", "--config", &config_file(toml)], &[]);
        let line = out
            .lines()
            .skip_while(|l| !l.contains("] ranges"))
            .take_while(|l| l.contains("] ranges") || l.starts_with("       "))
            .collect::<Vec<_>>()
            .join("\n");
        (code, line, format!("{out}{err}"))
    };
    let (code, line, all) = check(&toml);
    assert_eq!(code, 0, "{all}");
    assert!(
        line.starts_with("[ok  ] ranges") && line.contains("(0 progress row(s))"),
        "{all}"
    );

    db.client
        .batch_execute(&format!(
            "DROP INDEX {};
             INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'order', 'o', 'created', '{{}}');
             INSERT INTO {} (seqs, recorded_at) VALUES ('{{[1,2)}}', now() - interval '5 minutes')",
            ranges.xid_index,
            ranges.progress.quoted()
        ))
        .await
        .unwrap();
    let (code, line, all) = check(&toml);
    assert_eq!(code, 0, "warnings only: {all}");
    assert!(line.starts_with("[warn] ranges"), "{all}");
    assert!(line.contains(&ranges.xid_index), "{all}");
    assert!(line.contains("no fold has covered them"), "{all}");

    let role = crate::kit::unique("relay_ranges_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT ALL ON ALL TABLES IN SCHEMA public TO {role};
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role};
             REVOKE INSERT ON {progress} FROM {role};",
            progress = ranges.progress.quoted()
        ))
        .await
        .unwrap();
    let (code, line, all) = check(&toml.replace(&db.url, &db.url_as(&role)));
    assert_ne!(code, 0, "{all}");
    assert!(
        line.starts_with("[FAIL] ranges")
            && line.contains("GRANT INSERT ON public.outbox_relay_progress"),
        "{all}"
    );

    db.client
        .batch_execute(&format!("DROP TABLE {}", ranges.frontier.quoted()))
        .await
        .unwrap();
    let (code, line, all) = check(&toml);
    assert_ne!(code, 0, "{all}");
    assert!(
        line.starts_with("[FAIL] ranges")
            && line.contains("public.outbox_relay_frontier does not exist")
            && line.contains("outbox-relay migrate"),
        "{all}"
    );
}

/// `relay.fold_interval` paces the fold: at a minute, nothing recorded is
/// folded within seconds of its publication.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fold_waits_its_interval() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[
            ("relay.mark", "\"ranges\""),
            ("relay.fold_interval", "\"60s\""),
        ],
    )
    .await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let _relay = ChildRelay::start(&toml);
    let ids = insert(&db, "p", 20, 5).await;
    broker.inbox().wait_ids(&ids, WAIT).await;
    // Three default intervals: a 2 s fold would have covered them by then.
    tokio::time::sleep(std::time::Duration::from_secs(6)).await;
    let progress = format!("SELECT count(*) FROM {}", ranges.progress.quoted());
    assert!(
        count(&db, &progress).await > 0,
        "folded before its interval"
    );
    let frontier = format!("SELECT count(*) FROM {}", ranges.frontier.quoted());
    assert_eq!(count(&db, &frontier).await, 0, "no frontier yet");
}

/// A table of ranges dropped after migrate: each source's reader says
/// which tables it reads and to run migrate, and publishes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_frontier_says_to_run_migrate_in_each_mode() {
    for mode in [Mode::Polling, Mode::Cdc] {
        let (db, broker, toml) = setup(
            mode,
            Kind::Rabbit,
            &["order"],
            &[("relay.mark", "\"ranges\"")],
        )
        .await;
        let ranges = Ranges::new(&TableName::new("public", "outbox"));
        db.client
            .batch_execute(&format!("DROP TABLE {}", ranges.frontier.quoted()))
            .await
            .unwrap();
        insert(&db, "m", 3, 1).await;
        let log = crate::schema::run_until_logged_with_env(
            &config_file(&toml),
            "run outbox-relay migrate",
            &[],
        );
        assert!(
            log.contains("public.outbox_relay_frontier")
                && log.contains("run outbox-relay migrate"),
            "{mode:?}: {log}"
        );
        assert_eq!(broker.inbox().len(), 0, "{mode:?}: nothing published");
    }
}

/// Scheduled retention in `run` deletes what the fold covered, and only
/// that: every event once, the outbox empties, new events still flow. The
/// window is longer than the fold's interval: retention needs a frontier
/// from before its cut-off while the fold keeps moving the newest.
async fn retention_deletes_what_was_recorded_and_folded(mode: Mode) {
    let sets = [
        ("relay.mark", "\"ranges\""),
        ("relay.fold_interval", "\"1s\""),
        ("retention.interval", "\"1s\""),
        ("retention.sent_window", "\"2s\""),
    ];
    let (db, broker, toml) = setup(mode, Kind::Rabbit, &["order"], &sets).await;
    let mut ids = insert(&db, "a", 60, 6).await;
    let _relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    for round in ["b", "c"] {
        wait_for(WAIT, "retention to empty the outbox", || async {
            (count(&db, "SELECT count(*) FROM outbox").await == 0).then_some(())
        })
        .await;
        let more = insert(&db, round, 20, 2).await;
        broker.inbox().wait_ids(&more, WAIT).await;
        ids.extend(more);
    }
    once_each(&broker, &ids, "");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_with_ranges_retention_deletes_what_was_recorded_and_folded() {
    retention_deletes_what_was_recorded_and_folded(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_with_ranges_retention_deletes_what_was_recorded_and_folded() {
    retention_deletes_what_was_recorded_and_folded(Mode::Cdc).await;
}
