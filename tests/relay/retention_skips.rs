//! Retention leaves alone what it must not or cannot clean: tables of
//! modes that never mark rows sent, missing dead-letter tables, rows
//! another session holds.

use crate::retention::{client, count_of, outbox, rows};
use crate::support::*;
use outbox_relay::errors::ErrorKind;
use outbox_relay::ops::retention::{self, Cleanup, Skip};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tables_it_must_not_or_cannot_clean_are_skipped_with_a_note() {
    let (db, toml) = outbox(&[("relay.mark", "\"delete\"")]).await;
    rows(&db, "old", 5, "30 days", Some("8 days")).await;
    let config = parse(&toml);
    let c = client(&config).await;
    let report = retention::once(&c, &config, false).await.expect("cleanup");
    assert_eq!(report.outbox, Cleanup::Skipped(Skip::MarkDelete));
    assert_eq!(count_of(&db, "old").await, 5, "left alone");
    assert!(
        report
            .to_string()
            .contains("sent rows skipped: relay.mark = \"delete\""),
        "{report}"
    );

    // Without marking (CDC) no row is known to be sent: none is cleaned.
    let unmarked = set(
        &set(&toml, "source.mode", "\"cdc\""),
        "relay.mark",
        "\"none\"",
    );
    let report = retention::once(&c, &parse(&unmarked), false).await.unwrap();
    assert_eq!(report.outbox, Cleanup::Skipped(Skip::MarkNone));
    assert_eq!(count_of(&db, "old").await, 5, "left alone");

    let config = parse(&set(&toml, "dead_letter.enabled", "false"));
    let report = retention::once(&c, &config, false).await.unwrap();
    assert_eq!(report.dead_letters, Cleanup::Skipped(Skip::DeadLettersOff));

    let config = parse(&set(&toml, "dead_letter.table", "\"public.elsewhere\""));
    let report = retention::once(&c, &config, false).await.unwrap();
    assert!(
        matches!(
            report.dead_letters,
            Cleanup::Skipped(Skip::NoDeadLetterTable(_))
        ),
        "{report}"
    );

    let missing = set(&toml, "outbox.table", "\"public.missing\"");
    let config = parse(&set(&missing, "relay.mark", "\"update\""));
    let e = retention::once(&c, &config, false).await.unwrap_err();
    assert!(e.to_string().contains("outbox-relay migrate"), "{e}");
    assert_eq!(e.kind(), ErrorKind::NeedsOperator);
}

/// Rows another session holds locked are skipped, not waited for, and
/// cleaned by the next run once free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locked_rows_are_left_for_the_next_run() {
    let (db, toml) = outbox(&[]).await;
    rows(&db, "old", 20, "30 days", Some("8 days")).await;
    rows(&db, "held", 5, "30 days", Some("8 days")).await;
    let config = parse(&toml);
    let c = client(&config).await;
    let mut holder = connect(&db.url).await;
    let tx = holder.transaction().await.unwrap();
    tx.execute(
        "SELECT 1 FROM outbox WHERE aggregate_type = 'held' FOR UPDATE",
        &[],
    )
    .await
    .unwrap();
    let report = tokio::time::timeout(WAIT, retention::once(&c, &config, false))
        .await
        .expect("the cleanup does not wait for the lock")
        .expect("cleanup");
    assert!(
        matches!(report.outbox, Cleanup::Done { rows: 20, .. }),
        "{report}"
    );
    assert_eq!(
        (count_of(&db, "old").await, count_of(&db, "held").await),
        (0, 5)
    );
    tx.rollback().await.unwrap();
    let report = retention::once(&c, &config, false).await.expect("cleanup");
    assert!(
        matches!(report.outbox, Cleanup::Done { rows: 5, .. }),
        "{report}"
    );
    assert_eq!(count_of(&db, "held").await, 0);
}
