//! `source.mode = "auto"`: polling while the server does not allow CDC, CDC
//! once it does, and every event once, in order per aggregate, across the
//! switch. Each test has a private cluster, whose settings it changes.

use crate::kit::cluster::PrivatePg;
use crate::support::brokers::{RabbitExchange, Received};
use crate::support::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use uuid::Uuid;

const AGGREGATES: usize = 4;

fn auto_toml(db_url: &str, sink: &str) -> String {
    let t = set(&base_toml(db_url, sink), "source.mode", "\"auto\"");
    let t = set(&t, "source.auto.probe_interval", "\"1s\"");
    let t = set(&t, "source.cdc.status_interval", "\"200ms\"");
    set(&t, "source.cdc.slot", &format!("\"{}\"", unique("slot_")))
}

/// A private cluster with database `app`, migrated for `toml`'s outbox.
async fn app_database(pg: &PrivatePg, sink: &str) -> (tokio_postgres::Client, String) {
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let toml = auto_toml(&pg.url("app"), sink);
    migrate_at(&pg.url("app"), &parse(&toml)).await;
    (connect(&pg.url("app")).await, toml)
}

/// One committed event: (aggregate, id), in commit order.
pub(crate) type Committed = Vec<(String, String)>;

/// Commits `n` events, one per transaction, round robin over the aggregates.
pub(crate) async fn write(app: &tokio_postgres::Client, n: usize, into: &mut Committed) {
    write_as(app, "a", n, into).await;
}

/// As [`write`], for the aggregates named `prefix` and a number.
async fn write_as(app: &tokio_postgres::Client, prefix: &str, n: usize, into: &mut Committed) {
    for _ in 0..n {
        let aggregate = format!("{prefix}{}", into.len() % AGGREGATES);
        let id = Uuid::new_v4();
        app.execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'E', '{}')",
            &[&id, &aggregate],
        )
        .await
        .unwrap();
        into.push((aggregate, id.to_string()));
    }
}

/// A writer committing an event every few milliseconds until stopped.
struct Writer {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Committed>,
}

impl Writer {
    async fn start(url: &str) -> Writer {
        let app = connect(url).await;
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut committed = Committed::new();
            while !flag.load(Ordering::SeqCst) {
                write(&app, 1, &mut committed).await;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            committed
        });
        Writer { stop, task }
    }

    async fn stop(self) -> Committed {
        self.stop.store(true, Ordering::SeqCst);
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the writer stops")
            .expect("the writer did not panic")
    }
}

/// Waits until the relay reads with `mode`, as its metric says.
async fn wait_reading(port: u16, mode: &str) {
    let series = format!(
        "outbox_relay_source_mode{{pipeline=\"default\",mode=\"{mode}\",configured=\"auto\"}}"
    );
    wait_for(WAIT, &format!("the relay to read by {mode}"), || async {
        let (_, body) = http_get(port, "/metrics").await?;
        (metric(&body, &series) == Some(1.0)).then_some(())
    })
    .await;
}

/// Rows not sent: `relay_sent_at` NULL, or with ranges
/// (their function exists), by their predicate.
pub(crate) async fn unsent(app: &tokio_postgres::Client) -> i64 {
    let ranges: bool = app
        .query_one("SELECT to_regproc('outbox_relay_sent') IS NOT NULL", &[])
        .await
        .unwrap()
        .get(0);
    let sql = if ranges {
        "SELECT count(*) FROM outbox WHERE NOT outbox_relay_sent(relay_seq, relay_xid, relay_sent_at)"
    } else {
        "SELECT count(*) FROM outbox WHERE relay_sent_at IS NULL"
    };
    app.query_one(sql, &[]).await.unwrap().get(0)
}

/// `toml` with `relay.mark = "ranges"` when `ranges`.
fn marking(toml: &str, ranges: bool) -> String {
    if ranges {
        set(toml, "relay.mark", "\"ranges\"")
    } else {
        toml.to_owned()
    }
}

/// With ranges, the relay wrote no outbox row: every send was recorded.
async fn assert_recorded_by_ranges(app: &tokio_postgres::Client, ranges: bool) {
    if ranges {
        let row = app
            .query_one("SELECT count(*), count(relay_sent_at) FROM outbox", &[])
            .await
            .unwrap();
        let (rows, marked): (i64, i64) = (row.get(0), row.get(1));
        assert!(rows > 0 && marked == 0, "{rows} rows, {marked} marked");
    }
}

/// The relay serving its HTTP endpoints on `port`.
fn serve(toml: &str, port: u16) -> ChildRelay {
    ChildRelay::start(&with_http(toml, port))
}

/// Waits for every committed event and for the table to have none unsent
/// (so no re-send can still come), then checks each arrived exactly once
/// and each aggregate's in commit order.
pub(crate) async fn assert_each_once_in_order(
    broker: &RabbitExchange,
    app: &tokio_postgres::Client,
    committed: &Committed,
) {
    let ids: Vec<String> = committed.iter().map(|(_, id)| id.clone()).collect();
    broker.inbox.wait_ids(&ids, WAIT).await;
    wait_for(WAIT, "every row marked sent", || async {
        (unsent(app).await == 0).then_some(())
    })
    .await;
    let got: Vec<String> = broker
        .inbox
        .snapshot()
        .iter()
        .map(Received::event_id)
        .collect();
    let index: HashMap<&str, usize> = committed
        .iter()
        .enumerate()
        .map(|(i, (_, id))| (id.as_str(), i))
        .collect();
    let twice: Vec<String> = got
        .iter()
        .enumerate()
        .filter(|(at, id)| got[..*at].contains(id))
        .map(|(at, id)| {
            let committed_at = index.get(id.as_str()).map_or("?".into(), usize::to_string);
            format!("event {id} (commit {committed_at}) again at arrival {at}")
        })
        .collect();
    assert_eq!(
        got.len(),
        committed.len(),
        "each event exactly once; repeated: {twice:?}"
    );
    let aggregate_of: HashMap<&str, &str> = committed
        .iter()
        .map(|(a, id)| (id.as_str(), a.as_str()))
        .collect();
    let aggregates: std::collections::BTreeSet<&str> =
        committed.iter().map(|(a, _)| a.as_str()).collect();
    for a in aggregates {
        let want: Vec<&str> = committed
            .iter()
            .filter(|(x, _)| *x == a)
            .map(|(_, id)| id.as_str())
            .collect();
        let have: Vec<&str> = got
            .iter()
            .map(String::as_str)
            .filter(|id| aggregate_of.get(id) == Some(&a))
            .collect();
        assert_eq!(have, want, "aggregate {a}: commit order");
    }
}

fn status_json(toml: &str) -> serde_json::Value {
    let (code, out, err) = run_cli(&["status", "--config", &config_file(toml), "--json"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_polls_under_wal_level_replica_and_streams_after_a_restart_with_logical() {
    let pg = PrivatePg::start(&["wal_level = replica"]);
    let broker = RabbitExchange::new().await;
    let (app, toml) = app_database(&pg, &broker.sink_toml()).await;
    let (code, out, _) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert_eq!(code, 0, "polling is a working fallback: {out}");
    assert!(
        out.contains("[warn] source") && out.contains("wal_level"),
        "{out}"
    );

    let (mut relay, port) = ChildRelay::serving(&toml);
    let mut committed = Committed::new();
    write(&app, 40, &mut committed).await;
    wait_reading(port, "polling").await;
    let ids: Vec<String> = committed.iter().map(|(_, id)| id.clone()).collect();
    broker.inbox.wait_ids(&ids, WAIT).await;
    let status = status_json(&toml);
    assert_eq!(status["auto"]["reading"], "polling", "{status}");
    assert_eq!(status["auto"]["blocked_reason"], "wal_level", "{status}");

    // Everything is marked, so the restart cuts nothing in flight and
    // every event must arrive exactly once.
    wait_for(WAIT, "the polled rows marked", || async {
        (unsent(&app).await == 0).then_some(())
    })
    .await;
    pg.psql("ALTER SYSTEM SET wal_level = logical");
    pg.restart();
    let app = connect(&pg.url("app")).await;
    // Written while the relay reconnects: CDC's start-up read finds them.
    write(&app, 40, &mut committed).await;
    wait_reading(port, "cdc").await;
    // Streamed.
    write(&app, 40, &mut committed).await;
    assert_each_once_in_order(&broker, &app, &committed).await;
    let status = status_json(&toml);
    assert_eq!(status["auto"]["reading"], "cdc", "{status}");
    assert_eq!(relay.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_polls_while_no_slot_is_free_and_switches_to_cdc_under_load_once_one_is() {
    switches_to_cdc_under_load_once_a_slot_is_free(false).await;
}

/// Ranges: each reader starts from the frontier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_with_ranges_switches_to_cdc_under_load_once_a_slot_is_free() {
    switches_to_cdc_under_load_once_a_slot_is_free(true).await;
}

async fn switches_to_cdc_under_load_once_a_slot_is_free(ranges: bool) {
    let pg = PrivatePg::start(&["wal_level = logical", "max_replication_slots = 2"]);
    let broker = RabbitExchange::new().await;
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let toml = marking(&auto_toml(&pg.url("app"), &broker.sink_toml()), ranges);
    migrate_at(&pg.url("app"), &parse(&toml)).await;
    let app = connect(&pg.url("app")).await;
    // Other users of the server hold every slot.
    app.batch_execute(
        "SELECT pg_create_physical_replication_slot('other_a');
         SELECT pg_create_physical_replication_slot('other_b');",
    )
    .await
    .unwrap();

    let port = crate::kit::free_port();
    let mut relay = serve(&toml, port);
    wait_reading(port, "polling").await;
    let writer = Writer::start(&pg.url("app")).await;
    wait_for(WAIT, "events delivered by polling", || async {
        (broker.inbox.len() >= 20).then_some(())
    })
    .await;
    let status = status_json(&toml);
    assert_eq!(status["auto"]["reading"], "polling", "{status}");
    assert_eq!(status["auto"]["blocked_reason"], "no_free_slot", "{status}");

    // A slot is freed while events keep coming, and a burst keeps polling
    // busy: the relay drains what it has in flight, then streams, the
    // burst's rest coming from CDC's start-up read.
    app.batch_execute("SELECT pg_drop_replication_slot('other_a')")
        .await
        .unwrap();
    let mut burst = Committed::new();
    write_as(&app, "b", 300, &mut burst).await;
    wait_reading(port, "cdc").await;
    let at_switch = broker.inbox.len();
    wait_for(WAIT, "events delivered by CDC", || async {
        (broker.inbox.len() >= at_switch + 20).then_some(())
    })
    .await;
    let mut committed = writer.stop().await;
    committed.extend(burst);
    assert_each_once_in_order(&broker, &app, &committed).await;
    assert_recorded_by_ranges(&app, ranges).await;
    let status = status_json(&toml);
    assert_eq!(status["auto"]["reading"], "cdc", "{status}");
    assert_eq!(relay.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_polls_while_a_lost_slot_is_kept_and_streams_once_it_is_dropped() {
    polls_while_a_lost_slot_is_kept_and_streams_once_it_is_dropped(false).await;
}

/// Ranges: CDC, then polling from the frontier, then CDC
/// on a new slot whose start-up read goes by the frontier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_with_ranges_polls_while_a_lost_slot_is_kept_and_streams_once_it_is_dropped() {
    polls_while_a_lost_slot_is_kept_and_streams_once_it_is_dropped(true).await;
}

async fn polls_while_a_lost_slot_is_kept_and_streams_once_it_is_dropped(ranges: bool) {
    // Tiny WAL segments and retention, so a slot can be lost in seconds.
    let pg = cluster_that_loses_slots();
    let broker = RabbitExchange::new().await;
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let toml = set(
        &auto_toml(&pg.url("app"), &broker.sink_toml()),
        "source.cdc.on_lost_slot",
        "\"stop\"",
    );
    let toml = marking(&toml, ranges);
    migrate_at(&pg.url("app"), &parse(&toml)).await;
    let app = connect(&pg.url("app")).await;
    let slot = slot_of(&toml);

    // A first run creates the slot and streams.
    let port = crate::kit::free_port();
    let mut relay = serve(&toml, port);
    wait_reading(port, "cdc").await;
    let mut committed = Committed::new();
    write(&app, 20, &mut committed).await;
    let ids: Vec<String> = committed.iter().map(|(_, id)| id.clone()).collect();
    broker.inbox.wait_ids(&ids, WAIT).await;
    assert_eq!(relay.terminate().code(), Some(0));

    // While no relay runs, events arrive and the slot is lost.
    write(&app, 20, &mut committed).await;
    lose_slot(&app, &slot, Duration::from_secs(60)).await;

    // on_lost_slot = "stop" keeps the slot for the operator; auto polls meanwhile.
    let mut relay = serve(&toml, port);
    wait_reading(port, "polling").await;
    let ids: Vec<String> = committed.iter().map(|(_, id)| id.clone()).collect();
    broker.inbox.wait_ids(&ids, WAIT).await;
    let status = status_json(&toml);
    assert_eq!(status["auto"]["blocked_reason"], "lost_slot", "{status}");

    // The operator drops the slot: the relay creates a new one and streams.
    app.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
    wait_reading(port, "cdc").await;
    write(&app, 20, &mut committed).await;
    assert_each_once_in_order(&broker, &app, &committed).await;
    assert_recorded_by_ranges(&app, ranges).await;
    assert_eq!(relay.terminate().code(), Some(0));
}

#[test]
fn auto_with_unmarked_rows_is_refused_as_a_configuration_error() {
    let toml = set(
        &auto_toml("postgres://postgres@127.0.0.1:1/none", &rabbit_sink()),
        "relay.mark",
        "\"none\"",
    );
    let (code, out, err) = run_cli(&["check", "--config", &config_file(&toml)], &[]);
    assert_eq!(code, 2, "{out}{err}");
    assert!(
        err.contains(
            "source.mode: \"auto\" needs relay.mark = \"update\", \"delete\" or \"ranges\""
        ),
        "{err}"
    );
}

/// What keeps auto mode from CDC on a server that allows it, as `status`
/// and `check` name it: no slot when the relay may not create one, a role
/// without the REPLICATION attribute; and CDC possible once both are fixed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_names_a_missing_slot_and_a_role_that_may_not_stream() {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = auto_toml(&db.url, &broker.sink_toml());
    db.migrate(&parse(&toml)).await;
    let source_line = |toml: &str| {
        let (_, out, _) = run_cli(&["check", "--config", &config_file(toml)], &[]);
        check_line(&out, "source")
    };

    let no_slot = set(&toml, "source.cdc.create_slot", "false");
    let status = status_json(&no_slot);
    assert_eq!(status["auto"]["blocked_reason"], "no_slot", "{status}");
    assert!(
        status["auto"]["blocked"]
            .as_str()
            .is_some_and(|b| b.contains("source.cdc.create_slot = true")),
        "{status}"
    );
    assert!(source_line(&no_slot).starts_with("[warn]"));

    let role = unique("relay_nostream_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA public TO {role};"
        ))
        .await
        .expect("a role without REPLICATION");
    let limited = toml.replace(&db.url, &db.url_as(&role));
    let status = status_json(&limited);
    assert_eq!(
        status["auto"]["blocked_reason"], "replication_privilege",
        "{status}"
    );
    assert!(
        status["auto"]["blocked"]
            .as_str()
            .is_some_and(|b| b.contains("ALTER ROLE")),
        "{status}"
    );

    let status = status_json(&toml);
    assert_eq!(status["auto"]["cdc_possible"], true, "{status}");
    let line = source_line(&toml);
    assert!(
        line.starts_with("[ok  ]") && line.contains("CDC is possible"),
        "{line}"
    );
}
