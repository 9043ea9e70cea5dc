//! The least-privilege role of docs/operations.md, made by exactly the SQL
//! there: `check` passes and the relay delivers and dead-letters, in both
//! modes, and with a new outbox (ranges) records and folds.

use crate::dead_letters::{insert_big, poison_settings, wait_dead_letters};
use crate::support::*;
use serde_json::json;

/// The `sql` blocks of the operations guide's section on database roles,
/// in order (polling, what CDC adds, what ranges add, the operators').
fn documented_grants() -> Vec<String> {
    let guide = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations.md"))
        .expect("docs/operations.md");
    let section = guide
        .split("## Database roles with least privilege")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("the section on database roles");
    section
        .split("```sql\n")
        .skip(1)
        .map(|block| block.split("```").next().unwrap_or_default().to_owned())
        .collect()
}

/// The documented statements for `mode` (and for an outbox that records
/// by ranges), for a role named `role`.
fn grants_for(mode: Mode, ranges: bool, role: &str) -> String {
    let blocks = documented_grants();
    assert_eq!(
        blocks.len(),
        4,
        "polling, CDC, ranges, then operators: {blocks:?}"
    );
    let wanted = [true, mode == Mode::Cdc, ranges];
    blocks
        .iter()
        .zip(wanted)
        .filter(|(_, wanted)| *wanted)
        .map(|(b, _)| rename_role(b, role))
        .collect()
}

/// `sql` with the role `outbox_relay` (a whole word, not the prefix of a
/// table name) called `role`.
fn rename_role(sql: &str, role: &str) -> String {
    const NAME: &str = "outbox_relay";
    let mut out = String::new();
    let mut rest = sql;
    while let Some(at) = rest.find(NAME) {
        let after = &rest[at + NAME.len()..];
        let whole = !after.starts_with(|c: char| c.is_alphanumeric() || c == '_')
            && !rest[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_' || c == '.');
        out.push_str(&rest[..at]);
        out.push_str(if whole { role } else { NAME });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// A role made by the documented statements (with ranges' when `ranges`),
/// and `toml` connecting as it: the role, the config, its file, and
/// `check`'s output, which passed.
async fn as_documented_role(
    db: &TestDb,
    mode: Mode,
    ranges: bool,
    toml: &str,
) -> (String, String, String, String) {
    let role = crate::kit::unique("relay_least_");
    db.client
        .batch_execute(&grants_for(mode, ranges, &role))
        .await
        .expect("the documented statements run");
    let toml = toml.replace(&db.url, &db.url_as(&role));
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "check as the documented role: {out}{err}");
    (role, toml, path, out)
}

every_mode!(the_documented_role_is_enough);
async fn the_documented_role_is_enough(mode: Mode, kind: Kind) {
    let (db, broker, toml) = setup(mode, kind, &["order"], &poison_settings("\"follow\"")).await;
    let (_, toml, path, _) = as_documented_role(&db, mode, false, &toml).await;

    let relay = InProcess::start(parse(&toml));
    let events = ids(3);
    for (i, id) in events.iter().enumerate() {
        db.insert(*id, "order", &format!("g{i}"), json!({})).await;
    }
    let poison = uuid::Uuid::new_v4();
    insert_big(&db, poison, "P").await;
    broker.inbox().wait_ids(&strings(&events), WAIT).await;
    wait_dead_letters(&path, 1, "the poison event in the dead-letter table").await;
    wait_for(WAIT, "every row marked", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;
}

/// A new outbox, which records by ranges (`relay.mark` unset): the
/// documented statements, ranges' included, are enough to check, relay
/// and fold.
async fn the_documented_role_records_by_ranges(mode: Mode) {
    let db = TestDb::new().await;
    let broker = Broker::new(Kind::Rabbit, &["order"]).await;
    let toml = with_mode(&base_toml(&db.url, &broker.sink_toml()), mode);
    let toml = unset(&toml, "relay.mark");
    cli_ok_migrate(&toml);
    let (role, toml, path, out) = as_documented_role(&db, mode, true, &toml).await;
    assert!(out.contains("ranges: relay.mark is unset"), "{out}");

    // The binary, which runs the fold beside the relay.
    let mut relay = ChildRelay::start(&toml);
    let events = ids(5);
    for (i, id) in events.iter().enumerate() {
        db.insert(*id, "order", &format!("g{i}"), json!({})).await;
    }
    broker.inbox().wait_ids(&strings(&events), WAIT).await;
    let frontier = "SELECT count(*) FROM outbox_relay_frontier";
    wait_for(WAIT, "every row sent, and a fold", || async {
        let unsent = crate::ranges_downgrade::unsent(&db).await;
        (unsent == 0 && db.count(frontier).await > 0).then_some(())
    })
    .await;
    assert!(relay.terminate().success());
    // Leaving ranges drops tables: the owner's work, as migrate is.
    let (code, out, err) = run_cli(&["fold", "--into-sent-at", "--config", &path], &[]);
    assert!(
        code == 1 && err.contains("does not own") && err.contains("nothing was changed"),
        "{code} {out}{err}"
    );
    assert!(db.count(frontier).await > 0, "the tables stay");
    let marked = "SELECT count(*) FROM outbox WHERE relay_sent_at IS NOT NULL";
    assert_eq!(db.count(marked).await, 0, "no row marked");
    let owner = config_file(&toml.replace(&db.url_as(&role), &db.url));
    let (code, out, err) = run_cli(&["fold", "--into-sent-at", "--config", &owner], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(db.count(marked).await, 5);
}

fn cli_ok_migrate(toml: &str) {
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(toml)], &[]);
    assert_eq!(code, 0, "migrate as the owner: {out}{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_the_documented_role_records_by_ranges() {
    the_documented_role_records_by_ranges(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_the_documented_role_records_by_ranges() {
    the_documented_role_records_by_ranges(Mode::Cdc).await;
}

/// What CDC's `migrate` cannot do itself it refuses before changing
/// anything, saying what to run: publishing a table the role does not own,
/// and creating a slot without the REPLICATION attribute.
#[tokio::test]
async fn cdc_migrate_names_what_the_role_lacks() {
    let db = TestDb::new().await;
    let polling = base_toml(&db.url, &rabbit_sink());
    let (code, out, err) = run_cli(&["migrate", "--config", &config_file(&polling)], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let cdc = with_mode(&polling, Mode::Cdc);

    // Not the table's owner: no publication of it.
    let stranger = crate::kit::unique("relay_stranger_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {stranger} LOGIN REPLICATION;
             GRANT SELECT, UPDATE ON ALL TABLES IN SCHEMA public TO {stranger};"
        ))
        .await
        .expect("a role that does not own the table");
    let path = config_file(&cdc.replace(&db.url, &db.url_as(&stranger)));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("needs ownership of the table") && err.contains("CREATE PUBLICATION"),
        "{err}"
    );

    // The owner without REPLICATION: the publication is made, no slot.
    let owner = crate::kit::unique("relay_owner_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {owner} LOGIN;
             ALTER TABLE outbox OWNER TO {owner};
             CREATE PUBLICATION outbox_relay_outbox FOR TABLE outbox WITH (publish = 'insert');"
        ))
        .await
        .expect("a role that owns the table");
    let path = config_file(&cdc.replace(&db.url, &db.url_as(&owner)));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_ne!(code, 0, "{out}");
    assert!(
        err.contains("needs the REPLICATION attribute")
            && err.contains(&format!(
                "run ALTER ROLE {owner} REPLICATION; as a superuser"
            )),
        "{err}"
    );

    // A role the URL's options set does not lend its REPLICATION to the
    // login role, which the replication connection is authorised by.
    let streamer = crate::kit::unique("relay_streamer_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {streamer} NOLOGIN REPLICATION; GRANT {streamer} TO {owner};"
        ))
        .await
        .expect("a role with REPLICATION the owner may set");
    let as_streamer = format!("{}?options=-c%20role%3D{streamer}", db.url_as(&owner));
    let path = config_file(&cdc.replace(&db.url, &as_streamer));
    let (_, out, err) = run_cli(&["check", "--config", &path], &[]);
    let line = check_line(&out, "replication");
    assert!(
        line.starts_with("[FAIL]")
            && line.contains(&format!("({owner})"))
            && line.contains(&format!("ALTER ROLE {owner} REPLICATION;"))
            && !line.contains(&streamer),
        "{line}\n{out}{err}"
    );
    let slots = db
        .count("SELECT count(*) FROM pg_replication_slots WHERE database = current_database()")
        .await;
    assert_eq!(slots, 0, "nothing was created");
}

/// The operators' role of the guide, made by exactly its statements, lists,
/// redrives and drops dead letters.
#[tokio::test]
async fn the_documented_operator_role_runs_dlq() {
    let db = TestDb::new().await;
    let owner = config_file(&base_toml(&db.url, &rabbit_sink()));
    cli_ok_migrate(&std::fs::read_to_string(&owner).expect("config"));
    db.client
        .batch_execute(
            "INSERT INTO outbox_dead_letters (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'e' || g, 'a' || (g % 2), 'refused', 5, now(), now() FROM generate_series(1, 4) g",
        )
        .await
        .expect("letters");
    let role = crate::kit::unique("operator_");
    let statements = documented_grants()[3].replace("outbox_operator", &role);
    db.client
        .batch_execute(&statements)
        .await
        .expect("the documented statements run");
    let path = config_file(&base_toml(&db.url_as(&role), &rabbit_sink()));
    for command in [
        &["list"][..],
        &["redrive", "--aggregate", "a0"],
        &["redrive", "--all"],
        &["drop", "--aggregate", "a1"],
        &["drop", "--all"],
    ] {
        let mut args = vec!["dlq"];
        args.extend_from_slice(command);
        args.extend_from_slice(&["--config", &path]);
        let (code, out, err) = run_cli(&args, &[]);
        assert_eq!(code, 0, "{command:?} as the operator: {out}{err}");
    }
    let open: i64 = db
        .client
        .query_one(
            "SELECT count(*) FROM outbox_dead_letters WHERE resolution IS NULL",
            &[],
        )
        .await
        .expect("count")
        .get(0);
    assert_eq!(open, 0, "all dropped");
}
