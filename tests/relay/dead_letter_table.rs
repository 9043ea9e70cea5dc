//! The dead-letter table itself (real PostgreSQL): what `migrate` and
//! `check` make of it, how a follower is written, and which of its WAL
//! places a CDC replay may skip.

use crate::dead_letter_lookups::{Letter, dead_letter_table, write};
use crate::support::*;

/// The look's indexes on the dead-letter table, valid ones.
async fn look_indexes(db: &TestDb) -> Vec<String> {
    let mut names: Vec<String> = db
        .client
        .query(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
             WHERE i.indrelid = 'public.outbox_dead_letters'::regclass AND i.indisvalid
               AND NOT i.indisprimary",
            &[],
        )
        .await
        .expect("indexes")
        .iter()
        .map(|r| r.get(0))
        .collect();
    names.sort();
    names
}

#[tokio::test]
async fn migrate_gives_an_older_dead_letter_table_the_looks_indexes() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let all = look_indexes(&db).await;
    assert_eq!(
        all,
        [
            "outbox_dead_letters_open",
            "outbox_dead_letters_placed",
            "outbox_dead_letters_requested",
            "outbox_dead_letters_waiting"
        ],
        "a new dead-letter table gets every index"
    );
    // A table from before the look used them, with a letter in it.
    db.client
        .batch_execute(
            "DROP INDEX outbox_dead_letters_placed, outbox_dead_letters_requested, outbox_dead_letters_waiting;
             INSERT INTO outbox_dead_letters (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             VALUES ('e1', 'a', 'refused', 5, now(), now())",
        )
        .await
        .expect("an older table");
    let checked = dead_letters_line(&path);
    assert!(
        checked.starts_with("[warn]") && checked.contains("lacks the index(es)"),
        "check names what migrate would build: {checked}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path, "--dry-run"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(
        out.matches("CREATE INDEX CONCURRENTLY IF NOT EXISTS")
            .count(),
        3,
        "the missing indexes are built without blocking writers: {out}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(look_indexes(&db).await, all, "migrate built them again");
    let checked = dead_letters_line(&path);
    assert!(
        checked.starts_with("[ok  ]") && checked.contains("is ready"),
        "{checked}"
    );
    let (code, out, err) = run_cli(&["migrate", "--config", &path, "--dry-run"], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        !out.contains("CREATE INDEX"),
        "nothing is left to build: {out}"
    );
}

/// A CDC replay (without marking, or of logical messages) skips the events
/// at the WAL places of dead letters as done: only places recorded on this
/// server and counted as this relay counts may be skipped, or a letter
/// carried over from another server (or written with `source.cdc.messages`
/// set otherwise) could name an event that was never sent.
#[tokio::test]
async fn a_replay_skips_only_places_recorded_on_this_server_as_it_counts() {
    use outbox_relay::dead_letter::wal_positions_since;
    use outbox_relay::replication::Lsn;
    let db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let system = db.system_identifier().await;
    let counting_messages = format!("{system}+messages");
    let letters: Vec<Letter> = vec![
        (
            Some("a"),
            Some(&system),
            Some("0/100"),
            Some(1),
            false,
            false,
        ),
        (
            Some("a"),
            Some(&counting_messages),
            Some("0/100"),
            Some(2),
            false,
            false,
        ),
        (
            Some("a"),
            Some("another server"),
            Some("0/100"),
            Some(3),
            false,
            false,
        ),
        (Some("a"), None, Some("0/100"), Some(4), false, false),
        (
            Some("a"),
            Some(&system),
            Some("0/10"),
            Some(5),
            false,
            false,
        ),
        (
            Some("a"),
            Some(&system),
            Some("0/200"),
            Some(6),
            false,
            true,
        ),
    ];
    write(&db.client, &table, &letters).await;
    let from: Lsn = "0/50".parse().expect("lsn");
    let at = |index: u64| {
        let lsn: Lsn = if index == 6 { "0/200" } else { "0/100" }
            .parse()
            .expect("lsn");
        (lsn, index)
    };
    let mut counted_apart = wal_positions_since(&db.client, &table, from, false)
        .await
        .expect("positions");
    counted_apart.sort();
    assert_eq!(
        counted_apart,
        [at(1), at(6)],
        "this server, messages not counted"
    );
    let counted_with = wal_positions_since(&db.client, &table, from, true)
        .await
        .expect("positions");
    assert_eq!(counted_with, [at(2)], "this server, messages counted");
}

/// `check`'s line on the dead-letter table.
fn dead_letters_line(path: &str) -> String {
    let (_, out, _) = run_cli(&["check", "--config", path], &[]);
    check_line(&out, "dead letters")
}

/// A dead-letter table the relay cannot use fails `check` with what to do,
/// as `run` would fail.
#[tokio::test]
async fn check_fails_a_dead_letter_table_that_is_missing_or_lacks_a_column() {
    let db = TestDb::new().await;
    let path = config_file(&base_toml(&db.url, &rabbit_sink()));
    let (code, out, err) = run_cli(&["migrate", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    db.client
        .batch_execute("ALTER TABLE outbox_dead_letters DROP COLUMN source_system")
        .await
        .expect("an older table");
    let checked = dead_letters_line(&path);
    assert!(
        checked.starts_with("[FAIL]")
            && checked.contains("lacks a column this version uses (source_system)")
            && checked.contains("run `outbox-relay migrate`"),
        "{checked}"
    );
    db.client
        .batch_execute("DROP TABLE outbox_dead_letters")
        .await
        .expect("no table");
    let checked = dead_letters_line(&path);
    assert!(
        checked.starts_with("[FAIL]")
            && checked.contains("does not exist; run `outbox-relay migrate`"),
        "{checked}"
    );
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 1, "{out}");
}

/// A follower written while its aggregate's letters wait to be redriven is
/// asked for too, so it goes with them (an operator's request covers the
/// followers written meanwhile): else the redrive would end with it left
/// open, and the aggregate dead until asked again.
#[tokio::test]
async fn a_follower_of_letters_being_redriven_goes_with_them() {
    use outbox_relay::dead_letter::{DeadLetter, Recorder};
    use outbox_relay::outbox::RawRow;
    let mut db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let letters: Vec<Letter> = vec![
        (Some("asked"), None, None, None, true, false),
        (Some("waiting"), None, None, None, false, false),
    ];
    write(&db.client, &table, &letters).await;
    let recorder = Recorder::new(&db.client, &table, None, false)
        .await
        .expect("recorder");
    let follower = |aggregate: &str, id: &str| DeadLetter {
        position: (),
        seq: None,
        wal: None,
        raw: RawRow {
            id: Some(id.to_owned()),
            aggregate_id: Some(aggregate.to_owned()),
            ..RawRow::default()
        },
        reason: "follows".to_owned(),
        attempts: 0,
        first_failed_at: chrono::Utc::now(),
        last_failed_at: chrono::Utc::now(),
        follows: Some("e0".to_owned()),
    };
    let written = recorder
        .write(
            &mut db.client,
            &[
                follower("asked", "f1"),
                follower("waiting", "f2"),
                follower("gone", "f3"),
            ],
            None,
        )
        .await
        .expect("write");
    assert_eq!(
        written.written,
        [0, 1],
        "no follower of an aggregate with no open letter"
    );
    assert!(written.resolved.contains("gone"));
    let requested: Vec<(String, bool)> = db
        .client
        .query(
            &format!(
                "SELECT id, redrive_requested_at IS NOT NULL FROM {} WHERE id LIKE 'f%' ORDER BY id",
                table.quoted()
            ),
            &[],
        )
        .await
        .expect("followers")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        requested,
        [("f1".to_owned(), true), ("f2".to_owned(), false)],
        "asked for exactly when its aggregate's earliest letter is"
    );
}

/// A look hands over no letter of an aggregate whose request the
/// extension has not yet carried to every follower (it marks a bounded
/// batch per look): published first, those letters would leave a follower
/// nobody asked for as the aggregate's earliest, and the request ended.
#[tokio::test]
async fn a_look_hands_over_only_aggregates_the_extension_has_covered() {
    use outbox_relay::dead_letter::{Recorder, lookups};
    let db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let t = table.quoted();
    // "a" sorts first and has more followers than one look marks; "b" has
    // a requested letter, then one nobody asked for yet.
    let many = lookups::EXTEND_BATCH + 10;
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at, redrive_requested_at)
             VALUES ('a0', 'a', 'refused', 5, now(), now(), now()), ('b0', 'b', 'refused', 5, now(), now(), now());
             INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'a' || g, 'a', 'follows', 0, now(), now() FROM generate_series(1, {many}) g;
             INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             VALUES ('b1', 'b', 'follows', 0, now(), now());"
        ))
        .await
        .expect("letters");
    let recorder = Recorder::new(&db.client, &table, None, false)
        .await
        .expect("recorder");
    let unrequested_sql = format!(
        "SELECT count(*) FROM {t} WHERE resolution IS NULL AND redrive_requested_at IS NULL"
    );
    let first = recorder
        .requested(&db.client, usize::MAX)
        .await
        .expect("a look");
    assert!(
        db.count(&unrequested_sql).await > 0,
        "one look marks a bounded batch"
    );
    assert!(
        first.letters.is_empty(),
        "nothing handed over while followers wait: {}",
        first.letters.len()
    );
    assert!(first.extending, "a full batch extended: look again soon");
    let mut looks = 1;
    let handed = loop {
        let handed = recorder
            .requested(&db.client, usize::MAX)
            .await
            .expect("a look");
        looks += 1;
        if !handed.letters.is_empty() || looks > 10 {
            break handed;
        }
    };
    assert_eq!(
        db.count(&unrequested_sql).await,
        0,
        "every follower is asked for by now"
    );
    assert!(!handed.extending, "the extension is done");
    assert_eq!(
        handed.letters.len(),
        500,
        "then a look's batch, oldest first"
    );
    assert_eq!(handed.letters[0].raw.id.as_deref(), Some("a0"));
}

/// A look asks to be followed at once only while a request has followers
/// left to reach: letters without an aggregate nobody asked for, however
/// many, do not make it look again and again.
#[tokio::test]
async fn a_look_asks_for_another_only_while_a_request_has_followers_left() {
    use outbox_relay::dead_letter::{Recorder, lookups};
    let db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let t = table.quoted();
    let many = lookups::EXTEND_BATCH + 5;
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'n' || g, NULL, 'refused', 1, now(), now() FROM generate_series(1, {many}) g"
        ))
        .await
        .expect("letters");
    let recorder = Recorder::new(&db.client, &table, None, false)
        .await
        .expect("recorder");
    let look = recorder
        .requested(&db.client, usize::MAX)
        .await
        .expect("a look");
    assert!(
        !look.extending && look.letters.is_empty(),
        "nothing asked for"
    );

    // Asked for the oldest: two looks reach every follower, then it goes.
    db.client
        .batch_execute(&format!(
            "UPDATE {t} SET redrive_requested_at = now() WHERE id = 'n1'"
        ))
        .await
        .expect("request");
    let look = recorder
        .requested(&db.client, usize::MAX)
        .await
        .expect("a look");
    assert!(look.extending && look.letters.is_empty(), "a full batch");
    let look = recorder
        .requested(&db.client, usize::MAX)
        .await
        .expect("a look");
    assert!(!look.extending, "the rest");
    assert_eq!(look.letters.len(), 500);
    assert_eq!(look.letters[0].raw.id.as_deref(), Some("n1"));
}

/// A redriven letter an operator dropped while the relay published it
/// (`dlq drop` does not call back a letter on its way): once the broker
/// confirmed it, it is recorded as redriven, which is what happened, and
/// reported; a confirmation repeated after a restart changes nothing.
#[tokio::test]
async fn a_letter_dropped_while_on_its_way_is_recorded_redriven() {
    let db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    // e0 requested and still open; e1 requested, then dropped.
    write(
        &db.client,
        &table,
        &[
            (Some("a"), None, None, None, true, false),
            (Some("b"), None, None, None, true, true),
        ],
    )
    .await;
    let ids: Vec<i64> = db
        .client
        .query(
            "SELECT dead_letter_id FROM outbox_dead_letters ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let recorder = outbox_relay::dead_letter::Recorder::new(&db.client, &table, None, false)
        .await
        .expect("the recorder");
    let dropped = recorder.sent(&db.client, &ids).await.expect("sent");
    assert_eq!(dropped, [ids[1]], "the dropped one is reported");
    let redriven = "SELECT count(*) FROM outbox_dead_letters WHERE resolution = 'redriven'";
    assert_eq!(db.count(redriven).await, 2);
    let again = recorder.sent(&db.client, &ids).await.expect("sent again");
    assert!(again.is_empty(), "{again:?}");
    assert_eq!(db.count(redriven).await, 2);
}

/// A refused redrive ends its aggregate's requests (an operator asks again
/// once the cause is fixed), but not when an operator asked for the letter
/// again while the relay was publishing it: that request is heard.
#[tokio::test]
async fn a_refusal_keeps_a_request_made_after_the_letter_was_taken() {
    use outbox_relay::dead_letter::Recorder;
    let db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let t = table.quoted();
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at, redrive_requested_at)
             VALUES ('x0', 'x', 'refused', 5, now(), now(), now()), ('x1', 'x', 'follows', 0, now(), now(), now()),
                    ('y0', 'y', 'refused', 5, now(), now(), now()), ('y1', 'y', 'follows', 0, now(), now(), now()),
                    ('z0', 'z', 'refused', 5, now(), now(), now()), ('z1', 'z', 'follows', 0, now(), now(), now()),
                    ('n0', NULL, 'refused', 5, now(), now(), now()), ('n1', NULL, 'follows', 0, now(), now(), now()),
                    ('v0', 'v', 'refused', 5, now(), now(), now())"
        ))
        .await
        .unwrap();
    let recorder = Recorder::new(&db.client, &table, None, false)
        .await
        .expect("recorder");
    let handed = recorder
        .requested(&db.client, usize::MAX)
        .await
        .expect("a look");
    let letter = |id: &str| {
        handed
            .letters
            .iter()
            .find(|l| l.raw.id.as_deref() == Some(id))
            .map(|l| l.letter_id)
            .expect("handed over")
    };
    // The operator fixed the cause and asks for x again meanwhile; v's next
    // event is filed behind its letter, and v is asked for again too.
    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at)
             VALUES ('v1', 'v', 'follows', 0, now(), now());
             UPDATE {t} SET redrive_requested_at = now() WHERE id IN ('x0', 'z0', 'v0')"
        ))
        .await
        .unwrap();
    // z0 is confirmed, z1 refused: the request made while both were out
    // stands, though it was on a letter no longer open. v0 is confirmed: the
    // request passes to v1, which had none.
    let dropped = recorder
        .sent(&db.client, &[letter("z0"), letter("v0")])
        .await;
    assert_eq!(dropped.expect("recorded"), Vec::<i64>::new());
    let v1 =
        format!("SELECT count(*) FROM {t} WHERE id = 'v1' AND redrive_requested_at IS NOT NULL");
    assert_eq!(db.count(&v1).await, 1, "v was asked for again");
    for id in ["x0", "y0", "z1", "n0"] {
        recorder
            .refused(&db.client, letter(id), "refused again", true)
            .await
            .expect("recorded");
    }
    let requested = |aggregate: &str| {
        format!(
            "SELECT count(*) FROM {t} WHERE aggregate_id = '{aggregate}' AND redrive_requested_at IS NOT NULL"
        )
    };
    assert_eq!(db.count(&requested("y")).await, 0, "y's requests end");
    let unnamed = format!(
        "SELECT count(*) FROM {t} WHERE aggregate_id IS NULL AND redrive_requested_at IS NOT NULL"
    );
    assert_eq!(
        db.count(&unnamed).await,
        0,
        "those without an aggregate end together"
    );
    // A refusal of a letter gone meanwhile ends no request.
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, reason, attempts, first_failed_at, last_failed_at, redrive_requested_at)
             VALUES ('u0', NULL, 'refused', 5, now(), now(), now())"
        ))
        .await
        .unwrap();
    recorder
        .refused(&db.client, i64::MAX, "refused again", true)
        .await
        .expect("recorded");
    assert_eq!(db.count(&unnamed).await, 1, "u0 keeps its request");
    assert_eq!(db.count(&requested("x")).await, 2, "x was asked for again");
    let open_requested = format!(
        "SELECT count(*) FROM {t} WHERE id = 'z1' AND resolution IS NULL AND redrive_requested_at IS NOT NULL"
    );
    assert_eq!(db.count(&open_requested).await, 1, "z was asked for again");
    // Asked for again, x is handed over again, and its next refusal ends it.
    let again = recorder
        .requested(&db.client, usize::MAX)
        .await
        .expect("a look");
    let x0 = again
        .letters
        .iter()
        .find(|l| l.raw.id.as_deref() == Some("x0"))
        .expect("x0 handed over again");
    recorder
        .refused(&db.client, x0.letter_id, "refused again", true)
        .await
        .expect("recorded");
    assert_eq!(db.count(&requested("x")).await, 0);
}

/// A look hands over no more requested letters than the pipeline's budget
/// has room for (the first always); the rest come with a later look, in
/// order.
#[tokio::test]
async fn a_look_hands_over_the_requested_letters_its_room_holds() {
    use outbox_relay::dead_letter::Recorder;
    let db = TestDb::new().await;
    let table = dead_letter_table(&db).await;
    let t = table.quoted();
    db.client
        .batch_execute(&format!(
            "INSERT INTO {t} (id, aggregate_id, payload, reason, attempts, first_failed_at, last_failed_at,
                              redrive_requested_at)
             SELECT 'a' || g, 'a', repeat('x', 1000), 'refused', 5, now(), now(), now()
             FROM generate_series(0, 4) g"
        ))
        .await
        .expect("letters");
    let recorder = Recorder::new(&db.client, &table, None, false)
        .await
        .expect("recorder");
    let ids = |letters: &[outbox_relay::dead_letter::Requested]| {
        letters
            .iter()
            .map(|l| l.raw.id.clone().unwrap_or_default())
            .collect::<Vec<_>>()
    };
    // Each letter holds a little over 1,000 bytes: the third passes 2,500.
    let first = recorder.requested(&db.client, 2_500).await.expect("a look");
    assert_eq!(ids(&first.letters), ["a0", "a1", "a2"]);
    assert!(
        !first.extending,
        "the next look comes once these are confirmed, not at once"
    );
    let alone = recorder.requested(&db.client, 1).await.expect("a look");
    assert_eq!(
        ids(&alone.letters),
        ["a0"],
        "the first goes, whatever the room"
    );
    let sent: Vec<i64> = first.letters.iter().map(|l| l.letter_id).collect();
    let dropped = recorder.sent(&db.client, &sent).await.expect("recorded");
    assert!(dropped.is_empty());
    let rest = recorder.requested(&db.client, 2_500).await.expect("a look");
    assert_eq!(ids(&rest.letters), ["a3", "a4"]);
    assert!(!rest.extending, "none left");
}
