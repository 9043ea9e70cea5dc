//! The SQL files under `migrations/`, for teams that manage the schema with
//! their own migration tool: applied in order to an empty database, they
//! leave what `outbox-relay migrate` makes, and `check` passes.

use crate::support::*;
use std::io::{BufRead, BufReader};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_postgres::Client;

/// The `.sql` files of `migrations/<under>` in name order, as a migration tool applies them.
fn migration_files(under: &str) -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("migrations")
        .join(under);
    let mut files: Vec<(String, String)> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "sql"))
        .map(|p| {
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let sql = std::fs::read_to_string(&p).unwrap();
            (name, sql)
        })
        .collect();
    files.sort();
    files
}

/// Applies the files the way the tools do: each in a transaction of its own.
pub async fn apply_files(client: &Client, files: &[(String, String)]) {
    for (name, sql) in files {
        assert!(
            !sql.lines().any(|l| l.trim_start().starts_with('\\')),
            "{name} has a psql meta-command, which migration tools do not understand"
        );
        client
            .batch_execute(&format!("BEGIN;\n{sql}\n;COMMIT;"))
            .await
            .unwrap_or_else(|e| panic!("applying {name}: {e:?}"));
    }
}

/// The files a database in `mode` needs: the common ones, and the publication in CDC mode.
pub fn files_for(mode: Mode) -> Vec<(String, String)> {
    files_with(mode, &[])
}

/// The files for `mode`, then those of the optional folders `extra`
/// (`notify`: wake-ups; `messages`: `source.cdc.messages`; `ranges`: the
/// `relay.mark = "ranges"`).
pub fn files_with(mode: Mode, extra: &[&str]) -> Vec<(String, String)> {
    let mut files = migration_files("");
    assert!(
        files.len() >= 3,
        "migrations/ has the outbox, write-once and dead-letter files: {files:?}"
    );
    if mode == Mode::Cdc {
        files.extend(migration_files("cdc"));
    }
    for under in extra {
        files.extend(migration_files(under));
    }
    files
}

/// What the relay depends on in a database's `public` schema and publications,
/// one line per object, sorted: columns with types, defaults and identity,
/// constraints, indexes, triggers, function bodies, publications.
async fn schema_catalog(client: &Client) -> Vec<String> {
    let rows = client
        .query(
            "SELECT 'column ' || c.relname || '.' || a.attname || ' ' || format_type(a.atttypid, a.atttypmod)
                    || ' not null ' || a.attnotnull || ' identity ' || a.attidentity::text
                    || ' default ' || coalesce(pg_get_expr(d.adbin, d.adrelid), '-')
             FROM pg_attribute a
             JOIN pg_class c ON c.oid = a.attrelid
             LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
             WHERE c.relnamespace = 'public'::regnamespace AND c.relkind = 'r'
               AND a.attnum > 0 AND NOT a.attisdropped
             UNION ALL
             SELECT 'table ' || relname || ' replica identity ' || relreplident::text
             FROM pg_class WHERE relnamespace = 'public'::regnamespace AND relkind = 'r'
             UNION ALL
             SELECT 'constraint ' || conrelid::regclass::text || ' ' || conname || ' ' || pg_get_constraintdef(oid)
             FROM pg_constraint WHERE connamespace = 'public'::regnamespace
             UNION ALL
             SELECT 'index ' || pg_get_indexdef(i.indexrelid) || ' valid ' || i.indisvalid
             FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
             WHERE c.relnamespace = 'public'::regnamespace
             UNION ALL
             SELECT 'trigger ' || pg_get_triggerdef(t.oid) || ' enabled ' || t.tgenabled::text
             FROM pg_trigger t JOIN pg_class c ON c.oid = t.tgrelid
             WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal
             UNION ALL
             SELECT 'function ' || p.proname || '(' || pg_get_function_identity_arguments(p.oid) || ') '
                    || pg_get_function_result(p.oid) || ' ' || l.lanname || ' ' || p.prosrc
             FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang
             WHERE p.pronamespace = 'public'::regnamespace
             UNION ALL
             SELECT 'publication ' || pubname || ' insert ' || pubinsert || ' update ' || pubupdate
                    || ' delete ' || pubdelete || ' truncate ' || pubtruncate || ' all ' || puballtables
             FROM pg_publication
             UNION ALL
             SELECT 'published ' || pubname || ' ' || schemaname || '.' || tablename
             FROM pg_publication_tables
             ORDER BY 1",
            &[],
        )
        .await
        .expect("read the schema catalog");
    rows.iter().map(|r| r.get(0)).collect()
}

fn write_config(toml: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(config_file(toml))
}

/// Applies the files (twice: they must be safe to run again) to one database
/// and `outbox-relay migrate` to another; then `check` passes on the first,
/// `migrate --dry-run` finds nothing left but `left`, and the catalogs agree.
async fn files_match_migrate(mode: Mode, extra: &[&str], left: &[&str]) {
    let by_files = TestDb::new().await;
    let by_migrate = TestDb::new().await;
    let files = files_with(mode, extra);
    apply_files(&by_files.client, &files).await;
    apply_files(&by_files.client, &files).await;

    let config = |url: &str| {
        let mut toml = with_mode(&base_toml(url, &rabbit_sink()), mode);
        if extra.contains(&"messages") {
            toml = set(&toml, "source.cdc.messages", "true");
        }
        if extra.contains(&"notify") {
            toml = set(&toml, "source.polling.notify", "true");
        }
        if extra.contains(&"ranges") {
            // What migrate gives a new outbox with relay.mark unset.
            toml = unset(&toml, "relay.mark");
        }
        toml
    };
    let files_config = write_config(&config(&by_files.url));
    let files_config = files_config.to_str().unwrap();
    let (code, out, err) = run_cli(&["check", "--config", files_config], &[]);
    assert_eq!(
        code, 0,
        "check on the migrated-by-files database: {out}{err}"
    );
    assert!(out.contains("all checks passed"), "{out}");

    let (code, out, err) = run_cli(&["migrate", "--config", files_config, "--dry-run"], &[]);
    assert_eq!(code, 0, "{err}");
    if left.is_empty() {
        assert!(
            out.contains("nothing to do"),
            "migrate would still do: {out}"
        );
    } else {
        let steps: Vec<&str> = out
            .lines()
            .filter(|l| l.starts_with("-- ") && !l.starts_with("-- dry run"))
            .collect();
        assert_eq!(steps.len(), left.len(), "migrate would still do: {out}");
        for (step, wanted) in steps.iter().zip(left) {
            assert!(
                step.contains(wanted),
                "expected {wanted:?}, migrate would do: {out}"
            );
        }
    }

    // The reference: what migrate makes (in CDC mode also a slot, which is not schema).
    let mut client = connect(&by_migrate.url).await;
    let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(
        &parse(&config(&by_migrate.url)),
        false,
    );
    let steps = outbox_relay::ops::migrate::plan(&client, &opts)
        .await
        .expect("plan");
    outbox_relay::ops::migrate::apply(
        &mut client,
        &steps,
        &parse(&config(&by_migrate.url)).database,
    )
    .await
    .expect("migrate");
    let made = schema_catalog(&by_migrate.client).await;
    let from_files = schema_catalog(&by_files.client).await;
    let missing: Vec<&String> = made.iter().filter(|l| !from_files.contains(l)).collect();
    let extra: Vec<&String> = from_files.iter().filter(|l| !made.contains(l)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "the files drift from migrate ({mode:?}):\nonly from migrate:\n{missing:#?}\nonly from the files:\n{extra:#?}"
    );
    assert!(made.len() > 30, "the catalog was read: {made:#?}");
    drop(client);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_make_what_migrate_makes_for_polling() {
    files_match_migrate(Mode::Polling, &[], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_make_what_migrate_makes_for_polling_with_notify() {
    files_match_migrate(Mode::Polling, &["notify"], &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_make_what_migrate_makes_for_cdc_but_the_slot() {
    files_match_migrate(Mode::Cdc, &[], &["create logical replication slot"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_make_what_migrate_makes_for_logical_messages_but_the_slot() {
    files_match_migrate(
        Mode::Cdc,
        &["messages"],
        &["create logical replication slot"],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_files_make_what_migrate_makes_for_ranges() {
    files_match_migrate(Mode::Polling, &["ranges"], &[]).await;
}

/// A database with an outbox table the application made, not yet migrated.
async fn with_a_plain_outbox() -> TestDb {
    let db = TestDb::new().await;
    db.client
        .batch_execute(
            "CREATE TABLE outbox (id uuid PRIMARY KEY, aggregate_type text NOT NULL,
                 aggregate_id text NOT NULL, event_type text NOT NULL, payload jsonb NOT NULL)",
        )
        .await
        .unwrap();
    db
}

/// `migrate` behind a long transaction on the outbox gives up its place
/// in the lock queue within seconds, so the application's inserts, which
/// queue behind it, go on; it says why, and runs once the transaction ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_behind_a_long_transaction_does_not_hold_inserts_up() {
    let db = with_a_plain_outbox().await;
    // A report left open on the outbox.
    let holder = connect(&db.url).await;
    holder
        .batch_execute("BEGIN; SELECT count(*) FROM outbox")
        .await
        .unwrap();
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let migrate = {
        let path = path.clone();
        tokio::task::spawn_blocking(move || run_cli(&["migrate", "--config", &path], &[]))
    };
    tokio::time::sleep(Duration::from_secs(1)).await;
    let insert = db.client.execute(
        "INSERT INTO outbox VALUES (gen_random_uuid(), 'order', 'a', 'E', '{}')",
        &[],
    );
    tokio::time::timeout(Duration::from_secs(12), insert)
        .await
        .expect("the insert did not wait for migrate's lock for long")
        .unwrap();
    let (code, out, err) = migrate.await.unwrap();
    assert_eq!(code, 1, "{out}{err}");
    assert!(
        err.contains("a transaction holds a lock on the table"),
        "{err}"
    );
    holder.batch_execute("COMMIT").await.unwrap();
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
}

/// The steps outside migrate's transaction wait for every transaction that
/// began before them, however long: migrate says which sessions it waits
/// for, and finishes once they end. Here the indexes, built concurrently on
/// an existing table, behind a session with a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_says_which_transactions_an_index_build_waits_for() {
    let db = with_a_plain_outbox().await;
    let toml = base_toml(&db.url, &rabbit_sink());
    says_what_it_waits_for(
        &db,
        &toml,
        "BEGIN ISOLATION LEVEL REPEATABLE READ; SELECT 1",
    )
    .await;
}

/// The same for the replication slot, behind a transaction that wrote.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrate_says_which_transactions_a_slot_creation_waits_for() {
    let db = TestDb::new().await;
    let toml = with_mode(&base_toml(&db.url, &rabbit_sink()), Mode::Cdc);
    says_what_it_waits_for(&db, &toml, "BEGIN; SELECT txid_current()").await;
}

/// Runs `migrate` for `toml` while a session sits in the transaction
/// `begin` opens; checks it names that session, then ends it.
async fn says_what_it_waits_for(db: &TestDb, toml: &str, begin: &str) {
    let holder = connect(&db.url).await;
    let pid: i32 = holder
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    holder.batch_execute(begin).await.unwrap();
    let path = config_file(toml);
    let mut child = std::process::Command::new(relay_bin())
        .args(["migrate", "--config", &path])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start migrate");
    let out = Arc::new(Mutex::new(String::new()));
    let reader = {
        let (stdout, out) = (child.stdout.take().unwrap(), out.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let mut out = out.lock().unwrap();
                out.push_str(&line);
                out.push('\n');
            }
        })
    };
    let said = format!("pid {pid} (application");
    let line = wait_for(WAIT, "migrate to say what it waits for", || async {
        let out = out.lock().unwrap();
        out.lines()
            .find(|l| l.contains("still running after") && l.contains(&said))
            .map(str::to_owned)
    })
    .await;
    assert!(line.contains("idle in transaction"), "{line}");
    assert_eq!(child.try_wait().unwrap(), None, "migrate still waits");
    holder.batch_execute("COMMIT").await.unwrap();
    let until = std::time::Instant::now() + WAIT;
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        assert!(std::time::Instant::now() < until, "migrate did not finish");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    reader.join().unwrap();
    let out = out.lock().unwrap().clone();
    assert_eq!(status.code(), Some(0), "{out}");
    assert!(out.contains("-- applied"), "{out}");
}
