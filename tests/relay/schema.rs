//! What the relay assumes of the outbox table, checked rather than assumed:
//! `relay_seq` names one row, ids that repeat are told apart, and marking
//! is not blocked by a publication that replicates updates.

use crate::support::*;
use serde_json::json;
use uuid::Uuid;

/// Runs the relay until its log says `needle` (it keeps retrying a table it
/// cannot use, and says why each time); returns the log so far.
fn run_until_logged(path: &str, needle: &str) -> String {
    run_until_logged_with_env(path, needle, &[])
}

/// [`run_until_logged`] with more environment variables.
pub(crate) fn run_until_logged_with_env(path: &str, needle: &str, envs: &[(&str, &str)]) -> String {
    let log = std::path::Path::new(path).with_extension("log");
    let file = std::fs::File::create(&log).unwrap();
    let mut child = std::process::Command::new(crate::support::relay_bin())
        .args(["run", "--config", path])
        .env("RUST_LOG", "outbox_relay=info,warn")
        .envs(envs.iter().copied())
        .stdout(std::process::Stdio::null())
        .stderr(file)
        .spawn()
        .unwrap();
    let start = std::time::Instant::now();
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        if text.contains(needle) || start.elapsed() > WAIT {
            break text;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let _ = child.kill();
    let _ = child.wait();
    text
}

async fn seq_index_is_unique_and_valid(db: &TestDb) -> bool {
    db.count(
        "SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
         WHERE c.relname = 'outbox_relay_seq_outbox' AND i.indisunique AND i.indisvalid",
    )
    .await
        == 1
}

#[tokio::test]
async fn migrate_makes_relay_seq_unique_and_check_insists_on_it() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        seq_index_is_unique_and_valid(&db).await,
        "a new table gets the index"
    );

    // A table from before the index (or one whose index was dropped).
    db.client
        .batch_execute("DROP INDEX outbox_relay_seq_outbox")
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] outbox table") && out.contains("relay_seq has no unique index"),
        "{out}"
    );
    let log = run_until_logged(&path, "relay_seq has no unique index");
    assert!(
        log.contains("cannot work until this is fixed")
            && log.contains("relay_seq has no unique index"),
        "{log}"
    );

    // Twins (an explicit value, a copied row): migrate names them and the fix.
    let (a, b) = (Uuid::new_v4(), Uuid::new_v4());
    db.insert(a, "order", "1", json!({})).await;
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, relay_seq)
             SELECT $1, aggregate_type, aggregate_id, event_type, payload, relay_seq FROM outbox WHERE id = $2",
            &[&b, &a],
        )
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("relay_seq repeats values") && err.contains("SET relay_seq = DEFAULT"),
        "{err}"
    );
    // A concurrent build that failed on the twins leaves an invalid index.
    let failed = db
        .client
        .batch_execute(
            "CREATE UNIQUE INDEX CONCURRENTLY outbox_relay_seq_outbox ON outbox (relay_seq)",
        )
        .await;
    assert!(failed.is_err(), "the twins make the build fail");

    // The operator renumbers the twin as the message says; migrate drops
    // the invalid index and builds it again, concurrently.
    db.client
        .batch_execute(
            "UPDATE outbox SET relay_seq = DEFAULT
             WHERE ctid NOT IN (SELECT min(ctid) FROM outbox GROUP BY relay_seq)",
        )
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["migrate", "--config", &path, "--dry-run"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("DROP INDEX CONCURRENTLY")
            && out.contains(
                "CREATE UNIQUE INDEX CONCURRENTLY IF NOT EXISTS \"outbox_relay_seq_outbox\""
            ),
        "{out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(seq_index_is_unique_and_valid(&db).await);
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}");
}

/// A concurrent build of the unsent-rows index that failed (a statement
/// timeout on a large table, a cancel) leaves an invalid index of that
/// name, which serves no read: `migrate` drops and builds it again rather
/// than call it done.
#[tokio::test]
async fn migrate_rebuilds_an_unsent_index_a_failed_build_left_invalid() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.insert(Uuid::new_v4(), "order", "1", json!({})).await;
    let valid = || async {
        db.client
            .query_one(
                "SELECT i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
                 WHERE c.relname = 'outbox_relay_unsent_outbox'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, bool>(0)
    };
    assert!(valid().await);
    // A build that fails on the row it reaches (division by zero).
    db.client
        .batch_execute("DROP INDEX outbox_relay_unsent_outbox")
        .await
        .unwrap();
    let failed = db
        .client
        .batch_execute(
            "CREATE INDEX CONCURRENTLY outbox_relay_unsent_outbox ON outbox ((1 / (relay_seq - relay_seq)))",
        )
        .await;
    assert!(failed.is_err(), "the build fails");
    assert!(!valid().await, "and leaves the index invalid");
    let (code, out, err) = run_cli(&["migrate", "--config", &path, "--dry-run"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("drop index outbox_relay_unsent_outbox (an earlier build of it failed)"),
        "{out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(valid().await, "built again, valid");
}

#[tokio::test]
async fn a_publication_that_blocks_marking_is_named_by_check_and_run() {
    let db = TestDb::new().await;
    let toml = base_toml(&db.url, &rabbit_sink());
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    // An adopted table without a primary key (so no replica identity, and
    // ids that may repeat), and another tool's publication of every table.
    let publication = unique("other_tool_");
    db.client
        .batch_execute(&format!(
            "ALTER TABLE outbox DROP CONSTRAINT outbox_pkey;
             CREATE PUBLICATION {publication} FOR ALL TABLES"
        ))
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains(&format!("publication \"{publication}\""))
            && out.contains("marking rows sent (UPDATE)")
            && out.contains("REPLICA IDENTITY FULL")
            && out.contains("publish = 'insert'"),
        "{out}"
    );
    assert!(
        out.contains("[warn] outbox table")
            && out.contains("(outbox.columns.id) has no unique index"),
        "a repeating id is pointed out: {out}"
    );
    let log = run_until_logged(&path, "SQLSTATE 55000");
    assert!(
        log.contains(&format!("publication \"{publication}\"")) && log.contains("SQLSTATE 55000"),
        "{log}"
    );

    // Any one of the fixes the message names clears it.
    db.client
        .batch_execute("ALTER TABLE outbox REPLICA IDENTITY FULL")
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}");
    db.client
        .batch_execute(&format!(
            "ALTER TABLE outbox REPLICA IDENTITY DEFAULT;
             ALTER PUBLICATION {publication} SET (publish = 'insert')"
        ))
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}");
    db.client
        .batch_execute(&format!("DROP PUBLICATION {publication}"))
        .await
        .unwrap();
}

#[tokio::test]
async fn unsent_events_are_write_once() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let id = Uuid::new_v4();
    db.insert(id, "order", "1", json!({"v": 1})).await;
    let refused = db
        .client
        .execute(
            "UPDATE outbox SET payload = '{\"v\": 2}' WHERE id = $1",
            &[&id],
        )
        .await
        .expect_err("an unsent event cannot be changed");
    let text = format!("{refused:?}");
    assert!(
        text.contains("write-once") && text.contains("insert a new event instead"),
        "{text}"
    );
    // Marking is not an event change; a sent row may be changed.
    db.client
        .execute(
            "UPDATE outbox SET relay_sent_at = now() WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();
    db.client
        .execute(
            "UPDATE outbox SET payload = '{\"v\": 3}' WHERE id = $1",
            &[&id],
        )
        .await
        .unwrap();

    // Without the trigger, check says what is at stake and migrate puts it back.
    db.client
        .batch_execute("DROP TRIGGER outbox_relay_write_once ON outbox")
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "a warning, not a failure: {out}");
    assert!(
        out.contains("[warn] outbox table")
            && out.contains("no trigger keeps unsent events as inserted"),
        "{out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("create trigger outbox_relay_write_once"),
        "{out}"
    );
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("[warn]"), "{out}");
}

/// With ranges `relay_sent_at` stays NULL: the trigger
/// asks the predicate, so a recorded row may be changed (say, to redact
/// it) and an unsent one still may not; migrate run again changes nothing.
#[tokio::test]
async fn with_ranges_a_recorded_event_may_be_changed_and_an_unsent_one_not() {
    let db = TestDb::new().await;
    let toml = set(
        &base_toml(&db.url, &rabbit_sink()),
        "relay.mark",
        "\"ranges\"",
    );
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (sent, unsent) = (Uuid::new_v4(), Uuid::new_v4());
    db.insert(sent, "order", "1", json!({"v": 1})).await;
    db.insert(unsent, "order", "2", json!({"v": 1})).await;
    let ranges = outbox_relay::outbox::progress::Ranges::new(
        &outbox_relay::config::TableName::new("public", "outbox"),
    );
    let seq: i64 = db
        .client
        .query_one("SELECT relay_seq FROM outbox WHERE id = $1", &[&sent])
        .await
        .unwrap()
        .get(0);
    ranges.record(&db.client, &[seq]).await.unwrap();
    let change = "UPDATE outbox SET payload = '{\"v\": 2}' WHERE id = $1";
    db.client
        .execute(change, &[&sent])
        .await
        .expect("a recorded event may change");
    let refused = db
        .client
        .execute(change, &[&unsent])
        .await
        .expect_err("an unsent one may not");
    assert!(format!("{refused:?}").contains("write-once"), "{refused:?}");
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(!out.contains("create trigger"), "nothing to do: {out}");
    // Another outbox of the schema, without ranges, shares the function:
    // its unsent rows stay write-once (its own table has no predicate), and
    // the first outbox's recorded row may still change.
    let other = set(&toml, "outbox.table", "\"public.other_outbox\"");
    let other = set(&other, "relay.mark", "\"update\"");
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(&other)], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .batch_execute(
            "INSERT INTO other_outbox (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'order', '3', 'created', '{}')",
        )
        .await
        .unwrap();
    let refused = db
        .client
        .execute("UPDATE other_outbox SET payload = '{\"v\": 2}'", &[])
        .await
        .expect_err("the other outbox's unsent event may not change");
    assert!(
        format!("{refused:?}").contains("unsent event of public.other_outbox"),
        "{refused:?}"
    );
    db.client
        .execute(
            "UPDATE outbox SET payload = '{\"v\": 4}' WHERE id = $1",
            &[&sent],
        )
        .await
        .expect("the recorded event of the first may still change");
}

/// Two outboxes of one schema whose long names end alike would share the
/// tables the relay keeps beside them (PostgreSQL keeps 63 bytes of a name):
/// each relay would take the other's claims, and with ranges its recorded
/// events, for its own. `migrate` refuses the second; once such a table
/// exists anyway, `check` fails and the relay refuses to publish.
#[tokio::test]
async fn outboxes_whose_cut_names_meet_are_refused() {
    let db = TestDb::new().await;
    let middle = "x".repeat(50);
    let (first, second) = (format!("a_{middle}_events"), format!("b_{middle}_events"));
    let toml = |table: &str| {
        let t = set(
            &base_toml(&db.url, &rabbit_sink()),
            "outbox.table",
            &format!("\"{table}\""),
        );
        config_file(&t)
    };
    let (path_a, path_b) = (toml(&first), toml(&second));
    // A long name alone is fine: nothing meets it.
    let (code, out, err) = run_cli(&["migrate", "--config", &path_a], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let (code, out, err) = run_cli(&["migrate", "--config", &path_b], &[]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains(&format!(
            "public.{second} and public.{first} would share the relay's owners table"
        )) && err.contains("rename one of the two tables"),
        "{err}"
    );
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM pg_class WHERE relname = '{second}'"
        ))
        .await,
        0,
        "migrate created nothing for the second outbox"
    );

    let client = &db.client;
    let sql = |statement: String| async move { client.batch_execute(&statement).await.unwrap() };
    let check_passes = || {
        let (code, out, _) = run_cli(&["check", "--config", &path_a], &[]);
        // No names line at all: neither a refusal nor a failed look.
        assert!(!out.contains("] names"), "{out}");
        assert_eq!(code, 0, "{out}");
    };
    // A copy made with LIKE is no outbox: nothing is refused for it.
    let copy = format!("a_{middle}_copy");
    sql(format!(
        "CREATE TABLE \"{copy}\" (LIKE \"{first}\" INCLUDING ALL)"
    ))
    .await;
    check_passes();

    // The second outbox made anyway, as by a version without this check:
    // migrated while the first had another name.
    sql(format!("ALTER TABLE \"{first}\" RENAME TO a_aside")).await;
    let (code, out, err) = run_cli(&["migrate", "--config", &path_b], &[]);
    assert_eq!(code, 0, "{out}{err}");
    sql(format!("ALTER TABLE a_aside RENAME TO \"{first}\"")).await;
    let id = Uuid::new_v4();
    db.client
        .execute(
            &format!(
                "INSERT INTO \"{first}\" (id, aggregate_type, aggregate_id, event_type, payload)
                 VALUES ($1, 'order', '1', 'created', '{{}}')"
            ),
            &[&id],
        )
        .await
        .unwrap();
    let (code, out, _) = run_cli(&["check", "--config", &path_a], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] names")
            && out.contains(&format!("public.{first} and public.{second} would share")),
        "{out}"
    );
    // An outbox adopted without the write-once trigger is one all the same
    // (the relay's own index names it).
    sql(format!(
        "DROP TRIGGER outbox_relay_write_once ON \"{second}\""
    ))
    .await;
    let (code, out, _) = run_cli(&["check", "--config", &path_a], &[]);
    assert!(code == 1 && out.contains("[FAIL] names"), "{out}");
    let log = run_until_logged(&path_a, "would share the relay's");
    assert!(log.contains("rename one of the two tables"), "{log}");
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM \"{first}\" WHERE relay_sent_at IS NULL"
        ))
        .await,
        1,
        "nothing was published beside the other outbox"
    );

    // Renamed so that the names differ where they are kept: both go on.
    sql(format!("ALTER TABLE \"{second}\" RENAME TO b_other_events")).await;
    check_passes();
}

/// `shop.orders` and `public.shop_orders` get the same default publication
/// and slot names. A second relay on the first's slot would move it past
/// the first's events: `migrate` refuses it, `check` fails and `run`
/// refuses to start. Sharing the publication alone, with a slot of its
/// own, is harmless and goes on.
#[tokio::test]
async fn outboxes_whose_default_replication_names_meet_are_refused() {
    let db = TestDb::new().await;
    db.client.batch_execute("CREATE SCHEMA shop").await.unwrap();
    // The tests give every CDC relay a slot of its own; the default here.
    let cdc = |table: &str| {
        let toml = set(
            &base_toml(&db.url, &rabbit_sink()),
            "outbox.table",
            &format!("\"{table}\""),
        );
        with_mode(&toml, Mode::Cdc)
    };
    let (code, out, err) = run_cli(
        &["migrate", "--config", &config_file(&cdc("shop.orders"))],
        &[],
    );
    assert_eq!(code, 0, "{out}{err}");
    let second = cdc("public.shop_orders");
    let default_slot = config_file(&unset(&second, "source.cdc.slot"));
    let (code, out, err) = run_cli(&["migrate", "--config", &default_slot], &[]);
    assert_ne!(code, 0, "{out}{err}");
    assert!(
        err.contains("the replication slot outbox_relay_shop_orders is the one the relay of shop.orders uses by default")
            && err.contains("source.cdc.slot"),
        "{err}"
    );
    let (code, out, _) = run_cli(&["check", "--config", &default_slot], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] names") && out.contains("the relay of shop.orders"),
        "{out}"
    );
    // A slot of its own, the publication shared: both go on.
    let own = config_file(&second);
    let (code, out, err) = run_cli(&["migrate", "--config", &own], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains("outbox_relay_shop_orders"),
        "the second table joins the shared publication: {out}"
    );
    let (code, out, _) = run_cli(&["check", "--config", &own], &[]);
    assert!(!out.contains("] names"), "{out}");
    assert_eq!(code, 0, "{out}");
    // Run asks again: set back to the default slot after migrate, the
    // relay refuses to stream from the first relay's slot.
    db.client
        .batch_execute(
            "INSERT INTO public.shop_orders (id, aggregate_type, aggregate_id, event_type, payload)
             VALUES (gen_random_uuid(), 'order', 'o-1', 'created', '{}')",
        )
        .await
        .unwrap();
    let log = run_until_logged(&default_slot, "uses by default");
    assert!(
        log.contains("the replication slot outbox_relay_shop_orders is the one the relay of shop.orders uses by default"),
        "{log}"
    );
    assert_eq!(
        db.count("SELECT count(*) FROM public.shop_orders WHERE relay_sent_at IS NULL")
            .await,
        1,
        "nothing was published from the other relay's slot"
    );
}

/// Twins in a `relay_seq` made by hand, of another type and with NULLs:
/// `migrate` names them (and not the NULLs, which a unique index allows)
/// instead of failing to read them.
#[tokio::test]
async fn migrate_names_twins_in_a_hand_made_relay_seq() {
    let db = TestDb::new().await;
    db.client
        .batch_execute(
            "CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL, aggregate_id text NOT NULL,
                                  event_type text NOT NULL, payload jsonb NOT NULL, relay_seq integer);
             INSERT INTO outbox VALUES
                 (gen_random_uuid(), 'order', 'a', 'Happened', '{}', 7),
                 (gen_random_uuid(), 'order', 'b', 'Happened', '{}', 7),
                 (gen_random_uuid(), 'order', 'c', 'Happened', '{}', NULL),
                 (gen_random_uuid(), 'order', 'd', 'Happened', '{}', NULL)",
        )
        .await
        .unwrap();
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    for dry_run in [true, false] {
        let mut args = vec!["migrate", "--config", &path];
        if dry_run {
            args.push("--dry-run");
        }
        let (code, out, err) = run_cli(&args, &[]);
        assert_eq!(code, 1, "dry run {dry_run}: {out}{err}");
        assert!(
            err.contains("relay_seq repeats values (for example 7)"),
            "dry run {dry_run}: {err}"
        );
    }
}
