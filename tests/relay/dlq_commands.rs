//! `outbox-relay dlq`: what an operator sees and asks for, on letters written
//! straight into the dead-letter table (no relay runs: requests stay
//! pending, as they do until the active relay takes them).

use crate::kit::cluster::PrivatePg;
use crate::support::*;
use serde_json::Value;

fn dlq(args: &[&str], path: &str) -> String {
    let mut all = vec!["dlq"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--config", path]);
    let (code, out, err) = run_cli(&all, &[]);
    assert_eq!(code, 0, "dlq {args:?}: {out}{err}");
    out
}

fn listed(args: &[&str], path: &str) -> Vec<Value> {
    let mut all = vec!["list", "--json"];
    all.extend_from_slice(args);
    dlq(&all, path)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// `(id, aggregate)` of each letter listed.
fn letters(listed: &[Value]) -> Vec<(String, String)> {
    listed
        .iter()
        .map(|l| {
            (
                l["id"].as_str().unwrap_or_default().to_owned(),
                l["aggregate_id"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

/// A migrated outbox with these `(id, aggregate)` letters written straight
/// into its dead-letter table; returns the database and the config's path.
async fn with_letters(written: &[(&str, &str)]) -> (TestDb, String) {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    for (id, aggregate) in written {
        db.client
            .execute(
                "INSERT INTO outbox_dead_letters (id, aggregate_type, aggregate_id, event_type, reason,
                                                  attempts, first_failed_at, last_failed_at)
                 VALUES ($1, 'order', $2, 'OrderCreated', 'message too large', 5, now(), now())",
                &[id, aggregate],
            )
            .await
            .expect("a letter");
    }
    (db, path)
}

#[tokio::test]
async fn an_operator_lists_redrives_and_drops_dead_letters() {
    let (_db, path) = with_letters(&[("e1", "a"), ("e2", "a"), ("e3", "b"), ("e4", "c")]).await;
    assert_eq!(letters(&listed(&[], &path)).len(), 4);
    assert_eq!(
        letters(&listed(&["--aggregate", "a"], &path)),
        [("e1".into(), "a".into()), ("e2".into(), "a".into())],
        "one aggregate's, oldest first"
    );

    // Requests stay pending until the active relay takes them: both forms say so.
    dlq(&["redrive", "--aggregate", "a"], &path);
    dlq(&["redrive", "--id", "e3"], &path);
    let requested: Vec<String> = listed(&[], &path)
        .iter()
        .filter(|l| !l["redrive_requested_at"].is_null())
        .map(|l| l["id"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(requested, ["e1", "e2", "e3"]);
    let text = dlq(&["list"], &path);
    for (id, pending) in [("e1", true), ("e2", true), ("e3", true), ("e4", false)] {
        let row = text.lines().find(|l| l.starts_with(id)).unwrap_or_default();
        assert_eq!(row.contains("[redrive requested]"), pending, "{text}");
    }

    // Dropped letters leave the open list and stay in the table.
    dlq(&["drop", "--aggregate", "c"], &path);
    assert!(!letters(&listed(&[], &path)).iter().any(|(_, a)| a == "c"));
    let everything = dlq(&["list", "--all"], &path);
    let dropped = everything
        .lines()
        .find(|l| l.starts_with("e4"))
        .unwrap_or_default();
    assert!(dropped.contains("[dropped]"), "{everything}");
    dlq(&["drop", "--all"], &path);
    assert_eq!(dlq(&["list"], &path).trim(), "no dead letters");
    assert_eq!(
        letters(&listed(&["--all"], &path)).len(),
        4,
        "kept for the record"
    );
}

/// A reader that stops early (`outbox-relay dlq list | head`) cuts the
/// report short but not the command: no panic, the same exit code, the
/// redrive still asked for; a complaint on a closed standard error too
/// (`2>&1 | head`). A report that cannot be written for another reason (a
/// full disk) fails the command.
#[tokio::test]
async fn a_reader_that_stops_early_does_not_stop_the_command() {
    let (_db, path) = with_letters(&[("e1", "a"), ("e2", "b")]).await;
    let closed = || {
        let (reader, writer) = std::io::pipe().expect("a pipe");
        drop(reader);
        std::process::Stdio::from(writer)
    };
    let reports: [&[&str]; 5] = [
        &["dlq", "list"],
        &["status"],
        &["check"],
        &["migrate", "--dry-run"],
        // Fails, and says why on standard error.
        &["dlq", "redrive", "--id", "e9"],
    ];
    for args in reports {
        let args = [args, &["--config", &path][..]].concat();
        let (code, out, err) = run_cli(&args, &[]);
        assert!(
            !out.is_empty() || !err.is_empty(),
            "{args:?} says something"
        );
        let (got, err) = run_cli_into(&args, closed(), std::process::Stdio::piped());
        assert_eq!(
            (got, err.contains("panicked")),
            (code, false),
            "{args:?}: {err}"
        );
        let (got, _) = run_cli_into(&args, closed(), closed());
        assert_eq!(got, code, "{args:?} with standard error closed too");
    }
    let redrive = ["dlq", "redrive", "--aggregate", "b", "--config", &path];
    let (code, err) = run_cli_into(&redrive, closed(), std::process::Stdio::piped());
    assert_eq!(code, 0, "{err}");
    let requested: Vec<String> = listed(&[], &path)
        .iter()
        .filter(|l| !l["redrive_requested_at"].is_null())
        .map(|l| l["id"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(requested, ["e2"], "the redrive was asked for");

    let full = std::fs::File::options()
        .write(true)
        .open("/dev/full")
        .expect("/dev/full");
    let list = ["dlq", "list", "--config", &path];
    let (code, err) = run_cli_into(&list, full.into(), std::process::Stdio::piped());
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("writing the report to standard output failed"),
        "{err}"
    );
    assert!(err.contains("the command itself did its work"), "{err}");
}

/// A file with several pipelines: commands that act on one outbox need
/// `--pipeline`, and an unknown name is refused with the ones there are.
#[tokio::test]
async fn commands_on_one_outbox_choose_their_pipeline() {
    let db = TestDb::new().await;
    let toml = format!(
        "{}\n[pipelines.orders.outbox]\ntable = \"public.orders_outbox\"\n\n[pipelines.billing.outbox]\ntable = \"public.billing_outbox\"\n",
        base_toml(&db.url, &rabbit_sink())
    );
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .execute(
            "INSERT INTO billing_outbox_dead_letters (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             VALUES ('e1', 'b', 'refused', 5, now(), now())",
            &[],
        )
        .await
        .expect("a billing letter");
    for command in [
        &["dlq", "list"][..],
        &["retention", "--once", "--dry-run"][..],
    ] {
        let mut args = command.to_vec();
        args.extend_from_slice(&["--config", &path]);
        let (code, out, err) = run_cli(&args, &[]);
        assert_ne!(code, 0, "{command:?}: {out}");
        assert!(
            err.contains("defines 2 pipelines") && err.contains("choose it with --pipeline"),
            "{command:?}: {err}"
        );
    }
    assert_eq!(letters(&listed(&["--pipeline", "billing"], &path)).len(), 1);
    assert!(listed(&["--pipeline", "orders"], &path).is_empty());
    let (code, _, err) = run_cli(
        &["dlq", "list", "--config", &path, "--pipeline", "shipping"],
        &[],
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("has no pipeline \"shipping\"")
            && err.contains("orders")
            && err.contains("billing"),
        "{err}"
    );
}

/// An id names one event, but where the outbox's ids repeat it may name
/// letters of several aggregates: `--id` is then refused (for drop and
/// redrive alike) and nothing changes, rather than act on aggregates
/// nobody looked at. Letters of one aggregate with that id still go.
#[tokio::test]
async fn an_id_that_names_letters_of_several_aggregates_is_refused() {
    let (_db, path) =
        with_letters(&[("twin", "a"), ("twin", "b"), ("solo", "c"), ("solo", "c")]).await;
    for command in ["drop", "redrive"] {
        let (code, out, err) = run_cli(&["dlq", command, "--id", "twin", "--config", &path], &[]);
        assert_ne!(code, 0, "{command}: {out}");
        assert!(
            err.contains("2 open dead letters of 2 aggregates have id \"twin\"")
                && err.contains("--aggregate"),
            "{command}: {err}"
        );
    }
    let open = listed(&[], &path);
    assert_eq!(open.len(), 4, "nothing dropped");
    assert!(
        open.iter().all(|l| l["redrive_requested_at"].is_null()),
        "nothing requested"
    );
    dlq(&["drop", "--id", "solo"], &path);
    assert_eq!(
        letters(&listed(&[], &path)),
        [("twin".into(), "a".into()), ("twin".into(), "b".into())]
    );
}

/// An id or an aggregate that names no open letter (a typo, or letters
/// already dropped) fails with the name, instead of passing for success.
#[tokio::test]
async fn a_name_that_matches_no_open_letter_fails() {
    let (_db, path) = with_letters(&[("e1", "a")]).await;
    for (args, named) in [
        (["drop", "--id", "nope"], "with id \"nope\""),
        (["drop", "--aggregate", "typo"], "of aggregate \"typo\""),
        (["redrive", "--aggregate", "typo"], "of aggregate \"typo\""),
        (["redrive", "--id", "nope"], "with id \"nope\""),
    ] {
        let mut all = vec!["dlq"];
        all.extend(args);
        all.extend(["--config", &path]);
        let (code, out, err) = run_cli(&all, &[]);
        assert_eq!(code, 1, "{args:?}: {out}{err}");
        assert!(
            err.contains(&format!("no open dead letter {named}")),
            "{args:?}: {err}"
        );
    }
    dlq(&["drop", "--aggregate", "a"], &path);
    let (code, _, err) = run_cli(&["dlq", "drop", "--aggregate", "a", "--config", &path], &[]);
    assert_eq!(code, 1, "dropped already: {err}");
    assert_eq!(
        dlq(&["drop", "--all"], &path).trim(),
        "dropped 0 dead letter(s)"
    );
}

/// `--all` over more aggregates than PostgreSQL's lock table holds at once
/// (each is locked while its letters change; `max_locks_per_transaction`
/// × `max_connections` entries, shared by every session) goes a share of
/// them at a time. A small server makes the table small.
#[tokio::test]
async fn all_letters_of_many_aggregates_are_redriven_and_dropped() {
    let pg = PrivatePg::start(&["max_connections = 20", "max_locks_per_transaction = 64"]);
    let admin = connect(&pg.url("postgres")).await;
    admin.batch_execute("CREATE DATABASE app").await.unwrap();
    let app = connect(&pg.url("app")).await;
    let path = config_file(&base_toml(&pg.url("app"), &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let n: i64 = 20_000;
    app.execute(
        "INSERT INTO outbox_dead_letters (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
         SELECT 'e' || g, 'a' || g, 'refused', 5, now(), now() FROM generate_series(1, $1::bigint) g
         UNION ALL SELECT 'loose', NULL, 'refused', 5, now(), now()",
        &[&n],
    )
    .await
    .expect("the letters");
    let count = |sql: &'static str| {
        let app = &app;
        async move { app.query_one(sql, &[]).await.unwrap().get::<_, i64>(0) }
    };
    let all = |command: &str| {
        let (code, out, err) = run_cli(&["dlq", command, "--all", "--config", &path], &[]);
        assert_eq!(code, 0, "{command}: {out}{err}");
    };
    all("redrive");
    let requested =
        count("SELECT count(*) FROM outbox_dead_letters WHERE redrive_requested_at IS NOT NULL");
    assert_eq!(requested.await, n + 1, "every letter requested once");
    all("drop");
    let dropped = count("SELECT count(*) FROM outbox_dead_letters WHERE resolution = 'dropped'");
    assert_eq!(dropped.await, n + 1);
}

/// `status` with dead-lettering on and the letters' table unreadable says
/// why it cannot count them, instead of "dead-lettering off".
#[tokio::test]
async fn status_says_why_it_cannot_count_dead_letters() {
    let (db, path) = with_letters(&[]).await;
    db.client
        .batch_execute("DROP TABLE outbox_dead_letters")
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["status", "--config", &path], &[]);
    let line = out
        .lines()
        .find(|l| l.contains("dead letters"))
        .unwrap_or_default();
    assert!(
        line.contains("cannot count them in") && line.contains("does not exist"),
        "{out}{err}"
    );
    // The rest is printed, and a script sees the failure.
    assert!(out.contains("backlog"), "{out}");
    assert_eq!(code, 1, "{out}{err}");
    // The gauge sampler says it too, at warn level: its gauge is stale.
    let toml = std::fs::read_to_string(&path).unwrap();
    let relay = ChildRelay::start_logged(&set(&toml, "http.sample_interval", "\"1s\""));
    wait_for(WAIT, "the sampler's warning", || async {
        relay
            .logged("counting the dead letters failed: the gauges it feeds keep their last values")
            .then_some(())
    })
    .await;
}

/// An aggregate the relay kept filing followers for can hold a million
/// letters. Neither command holds its lock (which the relay filing a
/// follower waits for, on the session that keeps its lease) for longer
/// than a bounded batch: a redrive marks the earliest open letter only, and
/// the relay carries the request on (`dlq list` shows it on every letter
/// it covers); a drop calls that request off, then goes newest first,
/// [`admin::DROP_BATCH`] letters a transaction, the earliest last.
#[tokio::test]
async fn commands_on_a_huge_aggregate_change_a_bounded_batch_per_transaction() {
    use outbox_relay::dead_letter::admin;
    let (db, path) = with_letters(&[("other", "o")]).await;
    let n = 2 * admin::DROP_BATCH + 500;
    db.client
        .batch_execute(&format!(
            "INSERT INTO outbox_dead_letters (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'h' || g, 'huge', 'follows', 0, now(), now() FROM generate_series(1, {n}) g;
             CREATE TABLE changes (dead_letter_id bigint, tx xid8, resolution text, requested bool);
             CREATE FUNCTION record_change() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO changes VALUES (NEW.dead_letter_id, pg_current_xact_id(), NEW.resolution,
                                             NEW.redrive_requested_at IS NOT NULL);
                 RETURN NEW;
             END $$;
             CREATE TRIGGER record_change AFTER UPDATE ON outbox_dead_letters
                 FOR EACH ROW EXECUTE FUNCTION record_change();"
        ))
        .await
        .expect("the letters");
    let earliest: i64 = db
        .client
        .query_one(
            "SELECT min(dead_letter_id) FROM outbox_dead_letters WHERE aggregate_id = 'huge'",
            &[],
        )
        .await
        .expect("earliest")
        .get(0);
    let changes = || async {
        db.client
            .query(
                "SELECT tx::text, count(*), min(dead_letter_id), bool_and(requested)
                 FROM changes GROUP BY tx ORDER BY tx::text::bigint",
                &[],
            )
            .await
            .expect("changes")
            .iter()
            .map(|r| (r.get::<_, i64>(1), r.get::<_, i64>(2), r.get::<_, bool>(3)))
            .collect::<Vec<(i64, i64, bool)>>()
    };

    let out = dlq(&["redrive", "--aggregate", "huge"], &path);
    assert!(
        out.contains(&format!("redrive of {n} dead letter(s)")),
        "{out}"
    );
    assert_eq!(changes().await, [(1, earliest, true)], "the earliest only");
    let shown = listed(&["--aggregate", "huge", "--limit", "100000"], &path);
    assert_eq!(shown.len() as i64, n);
    assert!(
        shown.iter().all(|l| !l["redrive_requested_at"].is_null()),
        "every letter the request covers shows it"
    );
    assert!(listed(&["--aggregate", "o"], &path)[0]["redrive_requested_at"].is_null());

    db.client.execute("TRUNCATE changes", &[]).await.unwrap();
    let out = dlq(&["drop", "--aggregate", "huge"], &path);
    assert_eq!(out.trim(), format!("dropped {n} dead letter(s)"));
    let per_transaction = changes().await;
    assert_eq!(
        per_transaction.iter().map(|c| c.0).collect::<Vec<_>>(),
        [admin::DROP_BATCH + 1, admin::DROP_BATCH, 500],
        "newest first, a batch at a time (the first also calls the redrive off)"
    );
    assert_eq!(
        per_transaction[0].1, earliest,
        "the first transaction clears the earliest letter's request"
    );
    assert_eq!(per_transaction[2].1, earliest, "the earliest goes last");
    assert_eq!(letters(&listed(&[], &path)), [("other".into(), "o".into())]);
}

/// The relay marks a confirmed letter redriven without the aggregates'
/// locks. A redrive of its aggregate at that moment lands on the next open
/// letter, not on the one just resolved: else the request was lost while
/// the command counted it.
#[tokio::test]
async fn a_redrive_racing_a_confirmation_lands_on_the_next_open_letter() {
    let (db, path) = with_letters(&[("a0", "a"), ("a1", "a"), ("b0", "b"), ("b1", "b")]).await;
    // The relay confirming a0: the letter locked and marked, not committed.
    let relay = connect(&db.url).await;
    relay
        .batch_execute(
            "BEGIN; UPDATE outbox_dead_letters SET resolution = 'redriven', resolved_at = now()
             WHERE id = 'a0'",
        )
        .await
        .expect("a0 confirmed, uncommitted");
    let cli = tokio::task::spawn_blocking(move || {
        run_cli(&["dlq", "redrive", "--all", "--config", &path], &[])
    });
    wait_for(WAIT, "the redrive to wait for a0's lock", || async {
        let waiting: i64 = db
            .client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity
                 WHERE datname = current_database() AND wait_event_type = 'Lock'
                   AND query LIKE '%SET redrive_requested_at%'",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        (waiting > 0).then_some(())
    })
    .await;
    relay.batch_execute("COMMIT").await.expect("committed");
    let (code, out, err) = cli.await.expect("the command");
    assert_eq!(code, 0, "{out}{err}");
    let requested: Vec<String> = db
        .client
        .query(
            "SELECT id FROM outbox_dead_letters WHERE redrive_requested_at IS NOT NULL ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        requested,
        ["a1", "b0"],
        "each aggregate's earliest open letter"
    );
}
