//! Entering `relay.mark = "ranges"` from `update` (set it, `migrate`,
//! restart: nothing published again) and leaving it: `run` with `update`
//! refuses while ranges hold what was sent, `fold --into-sent-at` refuses
//! while an instance runs, then writes what ranges recorded into
//! `relay_sent_at`; the `update` relay that follows publishes only what was
//! never sent. And a sequence set back below what ranges recorded is
//! refused.

use crate::ranges_delivery::{count, insert, once_each};
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::outbox::progress::Ranges;

/// Rows that do not count as sent, by the predicate of ranges.
pub(crate) async fn unsent(db: &TestDb) -> i64 {
    let sent = Ranges::new(&TableName::new("public", "outbox")).sent_function;
    let sql = format!(
        "SELECT count(*) FROM outbox WHERE NOT {}(relay_seq, relay_xid, relay_sent_at)",
        sent.quoted()
    );
    count(db, &sql).await
}

/// An outbox relayed with `update` switches as the README says: every
/// instance stops, `relay.mark = "ranges"` is set, `migrate` runs, the
/// relay starts again. Rows marked before stay sent (and are not published
/// again), rows written meanwhile and after go out once, recorded by
/// ranges: their `relay_sent_at` stays NULL.
async fn entering_ranges_publishes_nothing_again(mode: Mode) {
    let (db, broker, toml) = setup(mode, Kind::Rabbit, &["order"], &[]).await;
    let mut ids = insert(&db, "a", 30, 3).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "the first rows marked by update", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.terminate();
    let meanwhile = insert(&db, "b", 10, 2).await;
    let path = config_file(&set(&toml, "relay.mark", "\"ranges\""));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "migrate: {out}{err}");
    let _relay = ChildRelay::start(&std::fs::read_to_string(&path).unwrap());
    broker.inbox().wait_ids(&meanwhile, WAIT).await;
    let after = insert(&db, "c", 10, 1).await;
    broker.inbox().wait_ids(&after, WAIT).await;
    wait_for(WAIT, "every row to count as sent", || async {
        (unsent(&db).await == 0).then_some(())
    })
    .await;
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL"
        )
        .await,
        30,
        "only the rows sent before the switch are marked by relay_sent_at"
    );
    ids.extend(meanwhile);
    ids.extend(after);
    once_each(&broker, &ids, &format!("{mode:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_enters_ranges_from_update_and_publishes_nothing_again() {
    entering_ranges_publishes_nothing_again(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_enters_ranges_from_update_and_publishes_nothing_again() {
    entering_ranges_publishes_nothing_again(Mode::Cdc).await;
}

/// A rolling switch: an instance still on `update`, standing by while the
/// owner runs ranges, takes ownership when the owner stops and refuses to
/// relay, naming the way out, instead of publishing again what ranges
/// recorded; new events wait for an instance on ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_update_standby_refuses_to_take_over_from_ranges() {
    let sets = [("relay.mark", "\"ranges\"")];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let ids = insert(&db, "a", 20, 4).await;
    let mut owner = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    let (owner_pid, _) = db.owner_session().await;
    let standby = ChildRelay::start_logged(&set(&toml, "relay.mark", "\"update\""));
    wait_for(WAIT, "the update instance to stand by", || async {
        standby
            .logged("standby: another instance is active")
            .then_some(())
    })
    .await;
    assert!(owner.terminate().success());
    let waiting = insert(&db, "b", 5, 1).await;
    wait_for(
        WAIT,
        "the update instance to refuse, once it owns the outbox",
        || async { standby.logged("fold --into-sent-at").then_some(()) },
    )
    .await;
    let (pid, _) = db.owner_session().await;
    assert_ne!(pid, owner_pid, "the standby took ownership");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(
        broker.inbox().len(),
        ids.len(),
        "nothing published again, nothing new published by update"
    );
    assert_eq!(unsent(&db).await, waiting.len() as i64);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_ranges_marks_what_was_recorded_and_publishes_nothing_again() {
    let sets = [
        ("relay.mark", "\"ranges\""),
        ("relay.fold_interval", "\"1s\""),
    ];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let frontier = format!("SELECT count(*) FROM {}", ranges.frontier.quoted());
    let progress = format!("SELECT count(*) FROM {}", ranges.progress.quoted());
    let mut ids = insert(&db, "a", 40, 4).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "a frontier", || async {
        (count(&db, &frontier).await > 0).then_some(())
    })
    .await;
    // Recorded after the frontier: only in the progress table.
    let more = insert(&db, "b", 10, 1).await;
    broker.inbox().wait_ids(&more, WAIT).await;
    ids.extend(more);
    let update = config_file(&set(&toml, "relay.mark", "\"update\""));
    let fold = ["fold", "--into-sent-at", "--config", update.as_str()];
    let (code, out, err) = run_cli(&fold, &[]);
    assert!(
        code == 1 && err.contains("an instance is running") && err.contains("stop every instance"),
        "{code} {out}{err}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL")
            .await,
        0
    );
    relay.terminate();
    assert!(
        count(&db, &progress).await + count(&db, &frontier).await > 0,
        "ranges hold what was sent"
    );
    let waiting = insert(&db, "c", 5, 1).await;

    let (_, out, _) = run_cli(&["check", "--config", &update], &[]);
    assert!(out.contains("fold --into-sent-at"), "check fails: {out}");
    let log = crate::schema::run_until_logged_with_env(&update, "fold --into-sent-at", &[]);
    assert!(
        log.contains("would publish them again") && log.contains("fold --into-sent-at"),
        "{log}"
    );
    assert_eq!(broker.inbox().len(), ids.len(), "update refused to start");

    let (code, out, err) = run_cli(&fold, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("marked 50 row(s) sent"), "{out}");
    assert_eq!(db.unsent().await, 5, "only the rows never sent are unsent");
    let objects = format!(
        "SELECT count(*) FROM pg_class WHERE relname IN ('{}', '{}', '{}', '{}')
         UNION ALL SELECT count(*) FROM pg_proc WHERE proname = '{}'",
        ranges.progress.name,
        ranges.frontier.name,
        ranges.held.name,
        ranges.xid_index,
        ranges.sent_function.name
    );
    let left: Vec<i64> = db
        .client
        .query(&objects, &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        left,
        [0, 0],
        "the tables, the index and the function of ranges are dropped"
    );
    let (code, out, _) = run_cli(&fold, &[]);
    assert!(code == 0 && out.contains("nothing to do"), "{out}");

    let _relay = ChildRelay::start(&std::fs::read_to_string(&update).unwrap());
    broker.inbox().wait_ids(&waiting, WAIT).await;
    wait_for(WAIT, "the new rows marked", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    ids.extend(waiting);
    once_each(&broker, &ids, "leaving ranges");
}

/// A sequence set back below what ranges recorded would hand out values
/// already counted as sent: `check` fails and `run` refuses, naming the
/// `setval` that fixes it; once it is moved past, the new row is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sequence_set_back_below_the_recorded_rows_is_refused() {
    let sets = [("relay.mark", "\"ranges\"")];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let ids = insert(&db, "a", 20, 5).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    relay.terminate();
    db.client
        .batch_execute(
            "DELETE FROM outbox; ALTER TABLE outbox ALTER COLUMN relay_seq RESTART WITH 1",
        )
        .await
        .unwrap();
    let path = config_file(&toml);
    // Refused before any row takes a value again.
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        code == 1 && out.contains("stands at 0, below 20"),
        "{code} {out}"
    );
    // It reuses relay_seq 1: sent or not depends on whether a progress row
    // still names 1, which is the hazard.
    insert(&db, "b", 1, 1).await;
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        code == 1 && out.contains("stands at 1, below 20") && out.contains("setval("),
        "{code} {out}"
    );
    let log = crate::schema::run_until_logged_with_env(&path, "setval(", &[]);
    assert!(
        log.contains("would count as sent and never be published"),
        "{log}"
    );
    assert_eq!(
        broker.inbox().len(),
        ids.len(),
        "nothing published meanwhile"
    );
    db.client
        .batch_execute("SELECT setval(pg_get_serial_sequence('public.outbox', 'relay_seq'), 20)")
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(!out.contains("setval("), "{code} {out}");
    // Rows written after the fix are published.
    let _relay = ChildRelay::start(&toml);
    let after = insert(&db, "c", 3, 1).await;
    broker.inbox().wait_ids(&after, WAIT).await;
}

/// An `update` relay whose role may not read the tables ranges left
/// cannot tell whether they hold sent rows: `check` names the GRANT.
#[tokio::test]
async fn update_that_may_not_read_the_tables_of_ranges_says_which_grant() {
    let db = TestDb::new().await;
    let ranges = set(
        &base_toml(&db.url, &rabbit_sink()),
        "relay.mark",
        "\"ranges\"",
    );
    db.migrate(&parse(&ranges)).await;
    let role = crate::kit::unique("relay_update_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT USAGE ON SCHEMA public TO {role};
             GRANT ALL ON public.outbox, public.outbox_dead_letters, public.outbox_relay_owners TO {role};"
        ))
        .await
        .unwrap();
    let update = base_toml(&db.url_as(&role), &rabbit_sink());
    let (code, out, err) = run_cli(&["check", "--config", &config_file(&update)], &[]);
    assert!(
        code == 1 && out.contains("GRANT SELECT ON public.outbox_relay_progress"),
        "{code} {out}{err}"
    );
}

/// Leaving ranges on a partitioned outbox: its index on `relay_xid` cannot
/// be dropped concurrently, so it goes at once, and the rows ranges
/// recorded are marked in their partitions.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leaving_ranges_drops_the_index_of_a_partitioned_outbox() {
    let sets = [("relay.mark", "\"ranges\"")];
    let (db, broker, toml) =
        crate::partitions::partitioned(Mode::Polling, Kind::Rabbit, &sets).await;
    let mut ids = Vec::new();
    for _ in 0..6 {
        let id = uuid::Uuid::new_v4();
        crate::partitions::insert_at(&db, id, "2020-06-01 00:00:00+00")
            .await
            .unwrap();
        ids.push(id.to_string());
    }
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row to count as sent", || async {
        (unsent(&db).await == 0).then_some(())
    })
    .await;
    assert!(relay.terminate().success());
    let index = Ranges::new(&TableName::new("public", "outbox")).xid_index;
    let indexes = format!("SELECT count(*) FROM pg_class WHERE relname = '{index}'");
    assert_eq!(
        count(&db, &indexes).await,
        1,
        "migrate built it on the root"
    );
    let fold = ["fold", "--into-sent-at", "--config", &config_file(&toml)];
    let (code, out, err) = run_cli(&fold, &[]);
    assert!(
        code == 0 && out.contains("marked 6 row(s) sent"),
        "{out}{err}"
    );
    assert_eq!(count(&db, &indexes).await, 0, "dropped");
    assert_eq!(
        count(
            &db,
            "SELECT count(*) FROM outbox WHERE relay_sent_at IS NULL"
        )
        .await,
        0
    );
}

/// A frontier copied from another server (a dump restored) whose
/// transaction ids ran higher would count every row written here as sent:
/// `check` fails and `run` refuses, and the steps the message gives
/// (`fold --into-sent-at`, the UPDATE it names, `migrate`) publish the
/// rows written here once and the rows sent before not again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontier_recorded_on_another_server_is_refused() {
    let sets = [
        ("relay.mark", "\"ranges\""),
        ("relay.fold_interval", "\"1s\""),
    ];
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let mut ids = insert(&db, "a", 20, 5).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    let frontier = format!("SELECT count(*) FROM {}", ranges.frontier.quoted());
    wait_for(WAIT, "a frontier", || async {
        (count(&db, &frontier).await > 0).then_some(())
    })
    .await;
    relay.terminate();
    // As after a restore on a server whose transaction ids run lower.
    db.client
        .batch_execute(&format!(
            "UPDATE {f} SET snapshot = '4000000000:4000000000:' WHERE id = (SELECT max(id) FROM {f})",
            f = ranges.frontier.quoted()
        ))
        .await
        .unwrap();
    let here = insert(&db, "b", 3, 1).await;
    assert_eq!(
        unsent(&db).await,
        0,
        "the hazard: rows written here count as sent"
    );
    let path = config_file(&toml);
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert!(
        code == 1
            && out.contains("recorded on another server")
            && out.contains("SET relay_sent_at = NULL WHERE relay_seq > 20"),
        "{code} {out}"
    );
    let log = crate::schema::run_until_logged_with_env(&path, "recorded on another server", &[]);
    assert!(log.contains("fold --into-sent-at"), "{log}");
    // Retention runs beside the refused relay, and from cron: with the
    // frontier past its cut-off it would delete the rows written here.
    db.client
        .batch_execute(&format!(
            "UPDATE {} SET folded_at = now() - interval '30 days'",
            ranges.frontier.quoted()
        ))
        .await
        .unwrap();
    let cleanup = config_file(&set(&toml, "retention.sent_window", "\"1h\""));
    let (code, out, err) = run_cli(&["retention", "--once", "--config", &cleanup], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        count(&db, "SELECT count(*) FROM outbox WHERE aggregate_id = 'b'").await,
        3,
        "retention deleted rows written here: {out}"
    );
    assert_eq!(
        broker.inbox().len(),
        ids.len(),
        "nothing published meanwhile"
    );

    let update = config_file(&set(&toml, "relay.mark", "\"update\""));
    let (code, out, err) = run_cli(&["fold", "--into-sent-at", "--config", &update], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .batch_execute("UPDATE public.outbox SET relay_sent_at = NULL WHERE relay_seq > 20")
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let _relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&here, WAIT).await;
    ids.extend(here);
    once_each(&broker, &ids, "after the steps");
}

/// One of ranges' objects missing (dropped by hand, a partial restore):
/// `check` fails, and `migrate` makes the missing ones again.
#[tokio::test]
async fn migrate_makes_missing_objects_of_ranges_again() {
    let sets = [("relay.mark", "\"ranges\"")];
    let (db, _broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &sets).await;
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    let path = config_file(&toml);
    db.client
        .batch_execute(&format!(
            "DROP TABLE {}; DROP FUNCTION {}(bigint, xid8, timestamptz)",
            ranges.held.quoted(),
            ranges.sent_function.quoted()
        ))
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (_, out, _) = run_cli(&["migrate", "--config", &path], &[]);
    assert!(out.contains("nothing to do"), "{out}");
}
