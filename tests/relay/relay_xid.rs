//! `relay_xid` is the inserting transaction's id, and only its default sets
//! it: with ranges a row naming an earlier, folded transaction would count
//! as sent and never be published, so the outbox's triggers refuse it.

use crate::marking_ranges::INSERT;
use crate::support::*;
use outbox_relay::config::TableName;
use outbox_relay::outbox::progress::Ranges;
use outbox_relay::outbox::progress::fold::Advance;
use std::time::Duration;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

/// What PostgreSQL said, with its SQLSTATE, or a failure when it took it.
fn refusal(result: Result<u64, tokio_postgres::Error>, what: &str) -> (SqlState, String) {
    let error = result.expect_err(what);
    let db = error
        .as_db_error()
        .unwrap_or_else(|| panic!("{what}: {error:?}"));
    (
        db.code().clone(),
        format!("{} {}", db.message(), db.hint().unwrap_or_default()),
    )
}

#[tokio::test]
async fn a_row_naming_another_transaction_is_refused() {
    let db = TestDb::new().await;
    let path = config_file(&set(
        &base_toml(&db.url, &rabbit_sink()),
        "relay.mark",
        "\"ranges\"",
    ));
    let out = cli_says(
        &["migrate", "--config", &path],
        0,
        &["create triggers outbox_relay_own_xid and outbox_relay_own_xid_update"],
    );
    assert!(
        out.contains("relay_progress"),
        "a new outbox runs ranges: {out}"
    );
    let ranges = Ranges::new(&TableName::new("public", "outbox"));

    // One event, confirmed and folded: its transaction is in the frontier.
    db.client.batch_execute(INSERT).await.unwrap();
    let row = db
        .client
        .query_one("SELECT relay_seq, relay_xid::text FROM outbox", &[])
        .await
        .unwrap();
    let (seq, xid): (i64, String) = (row.get(0), row.get(1));
    ranges.record(&db.client, &[seq]).await.unwrap();
    let mut fold = connect(&db.url).await;
    // Settled or not (another test's long transaction), the frontier moves.
    let capture = ranges.capture(&fold, Duration::from_secs(2)).await.unwrap();
    let advanced = ranges.advance(&mut fold, &capture, 100).await.unwrap();
    assert!(
        matches!(advanced, Advance::Advanced { held: 0, .. }),
        "{advanced:?}"
    );

    // A new event that names the folded transaction, and a copy of the
    // outbox put back after retention deleted its rows.
    let named =
        "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, relay_xid)
                 VALUES ($1, 'order', 'o', 'created', '{}', $2::text::xid8)";
    let (code, text) = refusal(
        db.client.execute(named, &[&Uuid::new_v4(), &xid]).await,
        "an INSERT naming another transaction",
    );
    assert_eq!(code, SqlState::GENERATED_ALWAYS, "{text}");
    assert!(
        text.contains(&format!(
            "outbox.relay_xid is set by its default to the inserting transaction's id: this INSERT gives it {xid}, "
        )) && text.contains("leave relay_seq, relay_xid and relay_sent_at to their defaults")
            && text.contains("SET outbox_relay.keep_xid = on"),
        "{text}"
    );
    db.client
        .batch_execute("CREATE TABLE outbox_copy AS SELECT * FROM outbox; DELETE FROM outbox")
        .await
        .unwrap();
    let (code, text) = refusal(
        db.client
            .execute("INSERT INTO outbox SELECT * FROM outbox_copy", &[])
            .await,
        "a copy put back",
    );
    assert_eq!(code, SqlState::GENERATED_ALWAYS, "{text}");

    // Its own transaction's id, given explicitly, is what the default gives.
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, relay_xid)
             VALUES ($1, 'order', 'o', 'created', '{}', pg_current_xact_id())",
            &[&Uuid::new_v4()],
        )
        .await
        .expect("the inserting transaction's own id");
    // A row inserted as sent is sent whatever it names.
    let marked = "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, relay_xid, relay_sent_at)
                  VALUES ($1, 'order', 'o', 'created', '{}', $2::text::xid8, now())";
    db.client
        .execute(marked, &[&Uuid::new_v4(), &xid])
        .await
        .expect("a row inserted as sent");
    // A row keeps its transaction's id, marked or not.
    for which in ["relay_sent_at IS NULL", "relay_sent_at IS NOT NULL"] {
        let (code, text) = refusal(
            db.client
                .execute(
                    &format!("UPDATE outbox SET relay_xid = '3'::xid8 WHERE {which}"),
                    &[],
                )
                .await,
            "an UPDATE of relay_xid",
        );
        assert_eq!(code, SqlState::GENERATED_ALWAYS, "{text}");
        assert!(text.contains("this UPDATE changes it from"), "{text}");
    }
    // A session that moves or restores rows keeps what they carry: the
    // copy put back counts as sent, as its row did.
    db.client
        .batch_execute(
            "BEGIN; SET LOCAL outbox_relay.keep_xid = on;
             INSERT INTO outbox SELECT * FROM outbox_copy; COMMIT",
        )
        .await
        .expect("rows restored as they were");
    assert_eq!(
        db.count(&format!(
            "SELECT count(*) FROM outbox WHERE relay_seq = {seq} AND {}(relay_seq, relay_xid, relay_sent_at)",
            ranges.sent_function.quoted()
        ))
        .await,
        1
    );
    let out = cli_says(&["migrate", "--dry-run", "--config", &path], 0, &[]);
    assert!(!out.contains("own_xid"), "nothing left to do: {out}");

    // Why: without the triggers the first INSERT is taken, and its event
    // counts as sent. `check` says what is at stake, `migrate` puts them back.
    db.client
        .batch_execute("DROP TRIGGER outbox_relay_own_xid ON outbox")
        .await
        .unwrap();
    let lost = Uuid::new_v4();
    db.client.execute(named, &[&lost, &xid]).await.unwrap();
    let sent: bool = db
        .client
        .query_one(
            &format!(
                "SELECT {}(relay_seq, relay_xid, relay_sent_at) FROM outbox WHERE id = $1",
                ranges.sent_function.quoted()
            ),
            &[&lost],
        )
        .await
        .unwrap()
        .get(0);
    assert!(sent, "a row naming a folded transaction counts as sent");
    cli_says(
        &["check", "--config", &path],
        0,
        &["[warn] outbox table", "no trigger keeps relay_xid"],
    );
    cli_says(
        &["migrate", "--config", &path],
        0,
        &["create triggers outbox_relay_own_xid"],
    );
    let out = cli_says(&["check", "--config", &path], 0, &[]);
    assert!(!out.contains("[warn]"), "{out}");
    // One of the two disabled is one to install again.
    db.client
        .batch_execute("ALTER TABLE outbox DISABLE TRIGGER outbox_relay_own_xid_update")
        .await
        .unwrap();
    cli_says(
        &["migrate", "--config", &path],
        0,
        &["create triggers outbox_relay_own_xid"],
    );
    refusal(
        db.client
            .execute("UPDATE outbox SET relay_xid = '3'::xid8", &[])
            .await,
        "the UPDATE trigger enabled again",
    );
}
