//! `relay.mark` unset: the outbox chooses (`ops::marking`). A new outbox
//! that `migrate` creates (PostgreSQL 14 or later) runs ranges; an outbox
//! relayed by `update` keeps `update` through `migrate` and restarts;
//! `fold --into-sent-at` turns a ranges outbox back to `update`. Nothing is
//! published twice on the way. (13: `versions.rs`.)

use crate::ranges_delivery::{count, insert, once_each};
use crate::ranges_downgrade::unsent;
use crate::support::*;

const MARKED: &str = "SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL";

/// Whether the progress table of ranges exists, which decides.
async fn has_progress_table(db: &TestDb) -> bool {
    count(
        db,
        "SELECT count(*) FROM pg_class WHERE relname = 'outbox_relay_progress'",
    )
    .await
        == 1
}

/// `check`'s line for the marking the outbox chose, and `status`'s, which
/// shows the fold's frontier only with ranges.
fn check_says(path: &str, chosen: &str) {
    let (_, out, err) = run_cli(&["check", "--config", path], &[]);
    assert!(
        out.contains(&format!("{chosen}: relay.mark is unset")),
        "check names the choice ({chosen}): {out}{err}"
    );
    let (code, out, err) = run_cli(&["status", "--config", path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out.contains("frontier"),
        chosen == "ranges",
        "status: {out}"
    );
    let marking = format!("{chosen} (relay.mark is unset: the outbox chose)");
    assert!(out.contains(&marking), "status names the choice: {out}");
    let (_, out, err) = run_cli(&["status", "--config", path, "--json"], &[]);
    let json: serde_json::Value = serde_json::from_str(&out).expect(&err);
    assert_eq!(json["marking"], chosen, "{out}");
    assert_eq!(json["marking_chosen_by_outbox"], true, "{out}");
}

async fn a_new_outbox_runs_ranges_until_folded_into_sent_at(mode: Mode) {
    let db = TestDb::new().await;
    let broker = Broker::new(Kind::Rabbit, &["order"]).await;
    let toml = with_mode(&base_toml(&db.url, &broker.sink_toml()), mode);
    let toml = unset(&toml, "relay.mark");
    assert!(!toml.contains("mark ="), "{toml}");
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "migrate: {out}{err}");
    assert!(
        has_progress_table(&db).await,
        "{mode:?}: migrate gives a new outbox the tables of ranges: {out}"
    );
    check_says(&path, "ranges");

    let mut ids = insert(&db, "a", 30, 3).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row to count as sent", || async {
        (unsent(&db).await == 0).then_some(())
    })
    .await;
    assert_eq!(count(&db, MARKED).await, 0, "{mode:?}: recorded by ranges");
    // `migrate` at the next deploy leaves the choice alone.
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert!(code == 0 && out.contains("nothing to do"), "{out}{err}");
    assert!(relay.terminate().success());

    let fold = ["fold", "--into-sent-at", "--config", path.as_str()];
    let (code, out, err) = run_cli(&fold, &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("marked 30 row(s) sent") && out.contains("dropped"),
        "{out}"
    );
    assert!(!has_progress_table(&db).await, "{mode:?}: dropped");
    check_says(&path, "update");

    let after = insert(&db, "b", 10, 2).await;
    let _relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&after, WAIT).await;
    db.wait_all_marked().await;
    assert!(!has_progress_table(&db).await, "{mode:?}: still update");
    ids.extend(after);
    once_each(&broker, &ids, &format!("{mode:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_a_new_outbox_runs_ranges_until_folded_into_sent_at() {
    a_new_outbox_runs_ranges_until_folded_into_sent_at(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_a_new_outbox_runs_ranges_until_folded_into_sent_at() {
    a_new_outbox_runs_ranges_until_folded_into_sent_at(Mode::Cdc).await;
}

/// An outbox an earlier version relayed with `update` (the default then):
/// the upgraded relay, with `relay.mark` unset, runs `migrate` and starts,
/// and the outbox stays on `update`, so an earlier instance left in the
/// standby set would publish nothing again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_relayed_by_update_keeps_update_when_mark_is_unset() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &[]).await;
    assert!(toml.contains("mark = \"update\""), "{toml}");
    let mut ids = insert(&db, "a", 20, 4).await;
    let mut relay = ChildRelay::start(&toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    db.wait_all_marked().await;
    assert!(relay.terminate().success());

    let upgraded = unset(&toml, "relay.mark");
    let path = config_file(&upgraded);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "migrate: {out}{err}");
    assert!(!has_progress_table(&db).await, "an existing outbox: {out}");
    check_says(&path, "update");
    let after = insert(&db, "b", 10, 2).await;
    let mut relay = ChildRelay::start(&upgraded);
    broker.inbox().wait_ids(&after, WAIT).await;
    db.wait_all_marked().await;
    assert_eq!(count(&db, MARKED).await, 30, "every row marked by update");
    ids.extend(after);
    once_each(&broker, &ids, "update kept");
    assert!(relay.terminate().success());

    // Empty tables of ranges, as an earlier version's fold left them: the
    // outbox chooses ranges until fold --into-sent-at drops them.
    let ranges = config_file(&set(&toml, "relay.mark", "\"ranges\""));
    let (code, out, err) = run_cli(&["migrate", "--config", &ranges], &[]);
    assert_eq!(code, 0, "migrate: {out}{err}");
    check_says(&path, "ranges");
    let (code, out, err) = run_cli(&["fold", "--into-sent-at", "--config", &path], &[]);
    assert!(code == 0 && out.contains("marked 0 row(s)"), "{out}{err}");
    check_says(&path, "update");
}

/// Started before `migrate` (pods beside a migration job), with
/// `relay.mark` unset: the relay waits for the outbox instead of choosing
/// `update` for a table that does not exist, then runs what `migrate` gave
/// the new outbox. While it waits it says so as any run that cannot work
/// until something is fixed: not ready, at error level, counted as a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn started_before_migrate_it_waits_and_runs_what_the_new_outbox_chose() {
    let db = TestDb::new().await;
    let broker = Broker::new(Kind::Rabbit, &["order"]).await;
    let toml = unset(&base_toml(&db.url, &broker.sink_toml()), "relay.mark");
    let port = crate::kit::free_port();
    let relay = ChildRelay::start_logged(&with_http(&toml, port));
    let missing = "the outbox chooses its marking once it exists";
    let waiting = wait_for(WAIT, "/readyz to say why the relay waits", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 503 && body.contains("failing: choosing the marking")).then_some(body)
    })
    .await;
    assert!(waiting.contains(missing), "{waiting}");
    assert!(
        relay.logged("ERROR") && relay.logged(missing),
        "a missing outbox is logged as an error"
    );
    let (_, metrics) = http_get(port, "/metrics").await.expect("/metrics answers");
    let restarts = metrics
        .lines()
        .find(|l| l.starts_with("outbox_relay_restarts_total"))
        .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok());
    assert!(restarts.is_some_and(|n| n >= 1.0), "{metrics}");
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(&toml)], &[]);
    assert_eq!(code, 0, "migrate: {out}{err}");
    wait_for(WAIT, "/readyz to turn ready after migrate", || async {
        let (code, body) = http_get(port, "/readyz").await?;
        (code == 200 && body.contains("default: active")).then_some(())
    })
    .await;
    let ids = insert(&db, "a", 10, 2).await;
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row to count as sent", || async {
        (unsent(&db).await == 0).then_some(())
    })
    .await;
    assert_eq!(count(&db, MARKED).await, 0, "recorded by ranges");
    assert!(relay.logged("mark=Ranges"), "it chose ranges");
    once_each(&broker, &ids, "after migrate");
}

/// An instance chooses at start. One that chose `update`, standing by while
/// the tables of ranges are created, refuses once it owns the outbox,
/// naming the restart, and publishes nothing by `update`; restarted, it
/// relays by ranges.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_chose_before_the_tables_came_refuses_until_restarted() {
    let (db, broker, toml) = setup(Mode::Polling, Kind::Rabbit, &["order"], &[]).await;
    let unset_toml = unset(&toml, "relay.mark");
    let holder = connect(&db.url).await;
    let key = outbox_relay::outbox::ownership_key(&outbox_relay::config::TableName::new(
        "public", "outbox",
    ));
    holder
        .execute("SELECT pg_advisory_lock(hashtextextended($1, 0))", &[&key])
        .await
        .unwrap();
    let standby = ChildRelay::start_logged(&unset_toml);
    wait_for(
        WAIT,
        "the instance to choose update and stand by",
        || async { (standby.logged("mark=Update") && standby.logged("standby")).then_some(()) },
    )
    .await;
    let ranges = config_file(&set(&toml, "relay.mark", "\"ranges\""));
    let (code, out, err) = run_cli(&["migrate", "--config", &ranges], &[]);
    assert_eq!(code, 0, "migrate: {out}{err}");
    let ids = insert(&db, "a", 10, 2).await;
    drop(holder);
    wait_for(
        WAIT,
        "the instance to refuse, naming the restart",
        || async { standby.logged("restart it").then_some(()) },
    )
    .await;
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    assert_eq!(broker.inbox().len(), 0, "nothing published by update");
    assert_eq!(count(&db, MARKED).await, 0);
    drop(standby);

    let _relay = ChildRelay::start(&unset_toml);
    broker.inbox().wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row to count as sent", || async {
        (unsent(&db).await == 0).then_some(())
    })
    .await;
    assert_eq!(count(&db, MARKED).await, 0, "recorded by ranges");
    once_each(&broker, &ids, "after the restart");
}
