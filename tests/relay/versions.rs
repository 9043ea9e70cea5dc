//! Every PostgreSQL major version the README promises, each with a cluster
//! of its own from `scripts/pg-versions.sh` (`OUTBOX_RELAY_TEST_PG<major>`):
//! the migration files and `migrate`, polling delivery (with the marking
//! a new outbox chooses there), CDC delivery, and a relay killed and
//! restarted without loss. The main suite runs on 15
//! (`OUTBOX_RELAY_TEST_PG`). A version whose cluster is missing fails.

use crate::migrations::{apply_files, files_for, files_with};
use crate::support::brokers::RabbitExchange;
use crate::support::*;
use serde_json::json;

pub(crate) fn admin_url(major: u32) -> String {
    let var = format!("OUTBOX_RELAY_TEST_PG{major}");
    std::env::var(&var).unwrap_or_else(|_| {
        panic!("{var} is not set: run scripts/pg-versions.sh start (scripts/test.sh does) and export what it prints")
    })
}

fn cli_ok(args: &[&str]) -> String {
    let (code, out, err) = run_cli(args, &[]);
    assert_eq!(code, 0, "outbox-relay {args:?}: {out}{err}");
    out
}

async fn insert_events(db: &TestDb, n: usize) -> Vec<String> {
    let ids = strings(&ids(n));
    for (i, id) in ids.iter().enumerate() {
        db.insert(id.parse().unwrap(), "order", "a", json!({ "i": i }))
            .await;
    }
    ids
}

async fn check_server_version(admin: &str, major: u32) {
    let client = connect(admin).await;
    let num: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .unwrap()
        .get(0);
    let num: u32 = num.parse().unwrap();
    assert_eq!(num / 10000, major, "{admin} runs PostgreSQL {num}");
}

/// The files (with the optional NOTIFY trigger) on an empty database leave
/// nothing for `migrate` to do.
async fn migration_files_apply(admin: &str) {
    let db = TestDb::new_on(admin).await;
    apply_files(&db.client, &files_with(Mode::Polling, &["notify"])).await;
    let toml = base_toml(&db.url, &RabbitExchange::new().await.sink_toml());
    let toml = set(&toml, "source.polling.notify", "true");
    let out = cli_ok(&["migrate", "--config", &config_file(&toml), "--dry-run"]);
    assert!(out.contains("nothing to do"), "after the files: {out}");
}

/// `migrate` (with its NOTIFY trigger), `check`, and events delivered by
/// polling, with `relay.mark` unset: the new outbox runs ranges from 14
/// on, `update` on 13.
async fn polling_delivers(admin: &str, major: u32) {
    let db = TestDb::new_on(admin).await;
    let rabbit = RabbitExchange::new().await;
    let toml = unset(&base_toml(&db.url, &rabbit.sink_toml()), "relay.mark");
    let toml = set(&toml, "source.polling.notify", "true");
    let path = config_file(&toml);
    cli_ok(&["migrate", "--config", &path]);
    let out = cli_ok(&["check", "--config", &path]);
    assert!(out.contains("all checks passed"), "{out}");
    let ranges = major >= 14;
    let chosen = if ranges { "ranges" } else { "update" };
    let chosen = format!("{chosen}: relay.mark is unset");
    assert!(
        out.contains(&chosen),
        "PostgreSQL {major} chooses {chosen} {out}"
    );
    let relay = InProcess::start(parse(&toml));
    let sent = insert_events(&db, 20).await;
    let got = rabbit.inbox.wait_ids(&sent, WAIT).await;
    let order: Vec<String> = got.iter().map(|m| m.event_id()).collect();
    assert_eq!(order, sent, "one aggregate, in insert order");
    wait_for(WAIT, "every row to count as sent", || async {
        let unsent = if ranges {
            crate::ranges_downgrade::unsent(&db).await
        } else {
            db.unsent().await
        };
        (unsent == 0).then_some(())
    })
    .await;
    let marked = db
        .count("SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL")
        .await;
    assert_eq!(marked, if ranges { 0 } else { 20 }, "PostgreSQL {major}");
    relay.stop().await;
}

/// `migrate` in CDC mode (publication and slot), streaming, and a relay
/// killed with SIGKILL and started again: everything committed arrives.
async fn cdc_survives_a_kill(admin: &str) {
    let db = TestDb::new_on(admin).await;
    let rabbit = RabbitExchange::new().await;
    let toml = with_mode(&base_toml(&db.url, &rabbit.sink_toml()), Mode::Cdc);
    let path = config_file(&toml);
    cli_ok(&["migrate", "--config", &path]);
    let out = cli_ok(&["check", "--config", &path]);
    assert!(out.contains("all checks passed"), "{out}");
    let mut relay = ChildRelay::start(&toml);
    let first = insert_events(&db, 20).await;
    rabbit.inbox.wait_ids(&first, WAIT).await;
    relay.kill();
    let second = insert_events(&db, 20).await;
    let mut relay = ChildRelay::start(&toml);
    let got = rabbit
        .inbox
        .wait_ids(&[first.clone(), second.clone()].concat(), WAIT)
        .await;
    // Duplicates are allowed after a kill; first deliveries keep commit order.
    let firsts = crate::support::brokers::first_ids(&got);
    assert_eq!(firsts, [first, second].concat());
    assert!(relay.terminate().success(), "the relay exits 0 on SIGTERM");
}

async fn supported(major: u32) {
    let admin = admin_url(major);
    check_server_version(&admin, major).await;
    migration_files_apply(&admin).await;
    polling_delivers(&admin, major).await;
    cdc_survives_a_kill(&admin).await;
}

macro_rules! versions {
    ($($name:ident => $major:literal),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $name() {
                supported($major).await
            }
        )*
    };
}

versions! {
    postgres_13 => 13,
    postgres_14 => 14,
    postgres_16 => 16,
    postgres_17 => 17,
    postgres_18 => 18,
}

async fn slot_failover(db: &TestDb, slot: &str) -> Option<bool> {
    db.client
        .query_opt(
            "SELECT failover FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .expect("read pg_replication_slots.failover")
        .map(|r| r.get(0))
}

/// `source.cdc.failover` creates failover slots on 17, by `migrate` and by `run`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_slots_on_17() {
    let admin = admin_url(17);
    check_server_version(&admin, 17).await;
    let rabbit = RabbitExchange::new().await;
    let failover = |url: &str| {
        let toml = with_mode(&base_toml(url, &rabbit.sink_toml()), Mode::Cdc);
        set(&toml, "source.cdc.failover", "true")
    };
    let slot_of = |toml: &str| -> String {
        let line = toml.lines().find(|l| l.starts_with("slot = ")).unwrap();
        line.trim_start_matches("slot = ")
            .trim_matches('"')
            .to_owned()
    };

    let by_migrate = TestDb::new_on(&admin).await;
    let toml = failover(&by_migrate.url);
    let path = config_file(&toml);
    cli_ok(&["migrate", "--config", &path]);
    assert_eq!(
        slot_failover(&by_migrate, &slot_of(&toml)).await,
        Some(true),
        "migrate made a failover slot"
    );
    let out = cli_ok(&["check", "--config", &path]);
    assert!(out.contains("is a failover slot"), "{out}");
    // A slot made without failover is pointed out.
    let plain = set(&toml, "source.cdc.failover", "false");
    let plain = set(
        &plain,
        "source.cdc.slot",
        &format!("\"{}\"", unique("slot_")),
    );
    cli_ok(&["migrate", "--config", &config_file(&plain)]);
    let flagged = set(&plain, "source.cdc.failover", "true");
    let out = cli_ok(&["check", "--config", &config_file(&flagged)]);
    assert!(out.contains("is not a failover slot"), "{out}");

    // The schema from the files, the slot from `run`.
    let by_run = TestDb::new_on(&admin).await;
    apply_files(&by_run.client, &files_for(Mode::Cdc)).await;
    let toml = failover(&by_run.url);
    let slot = slot_of(&toml);
    let relay = InProcess::start(parse(&toml));
    wait_for(WAIT, "run to create the slot", || async {
        slot_failover(&by_run, &slot).await
    })
    .await;
    assert_eq!(slot_failover(&by_run, &slot).await, Some(true));
    let sent = insert_events(&by_run, 5).await;
    rabbit.inbox.wait_ids(&sent, WAIT).await;
    relay.stop().await;
}

/// Before 17 a failover slot is refused with the reason, not created without failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failover_is_refused_before_17() {
    let admin = admin_url(16);
    let db = TestDb::new_on(&admin).await;
    let rabbit = RabbitExchange::new().await;
    let toml = set(
        &with_mode(&base_toml(&db.url, &rabbit.sink_toml()), Mode::Cdc),
        "source.cdc.failover",
        "true",
    );
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("source.cdc.failover needs PostgreSQL 17"),
        "the reason is named: {out}{err}"
    );
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("source.cdc.failover needs PostgreSQL 17"),
        "check names it too: {out}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")
            .await,
        0,
        "no slot without failover was made instead"
    );
}

/// `run` refuses a failover slot before 17 as `migrate` and `check` do:
/// not ready, naming the reason, nothing published; neither by creating a
/// slot without failover, nor by streaming from one that exists already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_refuses_failover_before_17() {
    let admin = admin_url(16);
    check_server_version(&admin, 16).await;
    let db = TestDb::new_on(&admin).await;
    apply_files(&db.client, &files_for(Mode::Cdc)).await;
    let rabbit = RabbitExchange::new().await;
    let toml = set(
        &with_mode(&base_toml(&db.url, &rabbit.sink_toml()), Mode::Cdc),
        "source.cdc.failover",
        "true",
    );
    let slot = slot_of(&toml);
    let (mut relay, port) = ChildRelay::serving(&toml);
    let sent = insert_events(&db, 5).await;
    let refused = || async {
        wait_for(WAIT, "readiness to name the refusal", || async {
            let (code, body) = http_get(port, "/readyz").await?;
            (code == 503 && body.contains("source.cdc.failover needs PostgreSQL 17")).then_some(())
        })
        .await;
        // And it stays so, between its retries too.
        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while std::time::Instant::now() < until {
            let (code, body) = http_get(port, "/readyz").await.expect("readyz answers");
            assert_eq!(code, 503, "{body}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    };
    refused().await;
    let slots = "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()";
    assert_eq!(
        db.count(slots).await,
        0,
        "no slot without failover was made"
    );

    // A slot made without failover (by an older configuration, say) is no
    // way around it.
    db.client
        .execute(
            "SELECT pg_create_logical_replication_slot($1, 'pgoutput')",
            &[&slot],
        )
        .await
        .unwrap();
    refused().await;
    assert_eq!(rabbit.inbox.len(), 0, "nothing published: {sent:?}");
    assert_eq!(db.unsent().await, 5);
    assert!(relay.terminate().success(), "the relay exits 0 on SIGTERM");
}

/// Events as logical messages need pgoutput's `messages` option, from 14 on:
/// refused on 13 with the reason, delivered on 14.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logical_messages_from_14_on() {
    let messages = |url: &str, rabbit: &RabbitExchange| {
        let toml = with_mode(&base_toml(url, &rabbit.sink_toml()), Mode::Cdc);
        set(&toml, "source.cdc.messages", "true")
    };
    let old = TestDb::new_on(&admin_url(13)).await;
    let rabbit = RabbitExchange::new().await;
    let path = config_file(&messages(&old.url, &rabbit));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("source.cdc.messages needs PostgreSQL 14"),
        "the reason is named: {out}{err}"
    );

    let db = TestDb::new_on(&admin_url(14)).await;
    let toml = messages(&db.url, &rabbit);
    cli_ok(&["migrate", "--config", &config_file(&toml)]);
    let relay = InProcess::start(parse(&toml));
    let id: uuid::Uuid = db
        .client
        .query_one(
            "SELECT outbox_relay_emit_outbox('order', 'a', 'E', '{}')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    rabbit.inbox.wait_ids(&[id.to_string()], WAIT).await;
    relay.stop().await;
}

/// `relay.mark = "ranges"` records multiranges, from 14 on:
/// `migrate` refuses it on 13 with the reason; on 14 and 18 the relay
/// delivers with it, the fold covers what it recorded, nothing is unsent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranges_from_14_on() {
    use outbox_relay::config::TableName;
    use outbox_relay::outbox::progress::Ranges;
    use outbox_relay::outbox::progress::fold::Advance;
    let rabbit = RabbitExchange::new().await;
    let ranges_toml = |url: &str| {
        set(
            &base_toml(url, &rabbit.sink_toml()),
            "relay.mark",
            "\"ranges\"",
        )
    };
    let old = TestDb::new_on(&admin_url(13)).await;
    let (code, out, err) = run_cli(
        &["migrate", "--config", &config_file(&ranges_toml(&old.url))],
        &[],
    );
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("relay.mark = \"ranges\" needs PostgreSQL 14"),
        "the reason is named: {out}{err}"
    );
    // An outbox migrated for update, then run with ranges: `run` names the
    // version too, not the tables `migrate` would refuse to create.
    cli_ok(&[
        "migrate",
        "--config",
        &config_file(&base_toml(&old.url, &rabbit.sink_toml())),
    ]);
    let log = crate::schema::run_until_logged_with_env(
        &config_file(&ranges_toml(&old.url)),
        "relay.mark = \"ranges\" needs PostgreSQL 14",
        &[],
    );
    assert!(
        log.contains("relay.mark = \"ranges\" needs PostgreSQL 14"),
        "run names the version: {log}"
    );
    let ranges = Ranges::new(&TableName::new("public", "outbox"));
    for major in [14, 18] {
        let db = TestDb::new_on(&admin_url(major)).await;
        let toml = ranges_toml(&db.url);
        cli_ok(&["migrate", "--config", &config_file(&toml)]);
        let relay = InProcess::start(parse(&toml));
        let sent = insert_events(&db, 20).await;
        rabbit.inbox.wait_ids(&sent, WAIT).await;
        relay.stop().await;
        let mut fold = connect(&db.url).await;
        let capture = ranges
            .capture(&fold, std::time::Duration::from_secs(5))
            .await
            .unwrap();
        let advanced = ranges.advance(&mut fold, &capture, 100).await.unwrap();
        assert!(
            matches!(advanced, Advance::Advanced { held: 0, .. }),
            "{major}: {advanced:?}"
        );
        let backlog = ranges.read_sql("relay_seq", "").backlog;
        let unsent: i64 = db.client.query_one(&backlog, &[]).await.unwrap().get(0);
        assert_eq!(unsent, 0, "PostgreSQL {major}");
        assert_eq!(
            db.count("SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL")
                .await,
            0
        );
        // Retention by the frontier, and leaving ranges, on this version.
        let config = parse(&set(&toml, "retention.sent_window", "\"0s\""));
        let c = outbox_relay::ops::retention::connect(&config)
            .await
            .unwrap();
        let report = outbox_relay::ops::retention::once(&c, &config, false)
            .await
            .unwrap();
        assert_eq!(report.outbox.rows(), 20, "PostgreSQL {major}: {report}");
        insert_events(&db, 3).await;
        let update = set(&toml, "relay.mark", "\"update\"");
        let out = cli_ok(&["fold", "--into-sent-at", "--config", &config_file(&update)]);
        assert!(out.contains("marked 0 row(s)"), "PostgreSQL {major}: {out}");
        assert_eq!(db.unsent().await, 3, "PostgreSQL {major}");
    }
}
