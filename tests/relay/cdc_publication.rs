//! What CDC needs of the publication of the outbox: every column the
//! relay reads, and every row.

use crate::cdc::cdc_toml;
use crate::support::brokers::RabbitExchange;
use crate::support::*;
use serde_json::json;
use uuid::Uuid;

/// A publication narrowed by a column list without `relay_seq`, or by a
/// row filter, is refused before streaming, by `check` and by every run
/// (not only by the run that meets the first row, after which a start-up
/// read would publish it and the refusal would vanish until the next one);
/// once the publication is whole again, the event goes out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publication_that_narrows_the_outbox_is_refused_until_it_is_whole() {
    let db = TestDb::new().await;
    let broker = RabbitExchange::new().await;
    let toml = cdc_toml(&db.url, &broker.sink_toml());
    let config = parse(&toml);
    db.migrate(&config).await;
    let publication = config.source.cdc.publication_name(&config.outbox.table);
    let narrowings = [
        (
            "(id, aggregate_type, aggregate_id, event_type, event_version, payload, headers, created_at)",
            "leaves column \"relay_seq\" (relay.mark: rows are marked sent by it) of public.outbox out of its column list",
        ),
        (
            "WHERE (aggregate_id <> 'b')",
            "streams only the rows of public.outbox WHERE (aggregate_id <> 'b'::text)",
        ),
    ];
    let path = config_file(&toml);
    let id = Uuid::new_v4();
    db.insert(id, "order", "a", json!({})).await;
    for (narrowing, refusal) in narrowings {
        db.client
            .batch_execute(&format!(
                "ALTER PUBLICATION {publication} SET TABLE outbox {narrowing}"
            ))
            .await
            .unwrap();
        let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
        assert!(
            code != 0 && out.contains(refusal),
            "{narrowing}: {out}{err}"
        );
        assert!(out.contains("ALTER PUBLICATION"), "says what to run: {out}");
        let relay = ChildRelay::start_logged(&toml);
        // Refused by run after run, each logging it.
        wait_for(
            WAIT,
            "the narrowed publication to be refused twice",
            || async { (relay.log_count(refusal) >= 2).then_some(()) },
        )
        .await;
        drop(relay);
        assert_eq!(db.unsent().await, 1, "{narrowing}: the row stays unsent");
    }
    assert!(broker.inbox.snapshot().is_empty(), "nothing was published");
    db.client
        .batch_execute(&format!("ALTER PUBLICATION {publication} SET TABLE outbox"))
        .await
        .unwrap();
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let relay = ChildRelay::start_logged(&toml);
    broker.inbox.wait_ids(&[id.to_string()], WAIT).await;
    db.wait_all_marked().await;
    // Narrowed while streaming: the stream refuses at the Relation message.
    db.client
        .batch_execute(&format!(
            "ALTER PUBLICATION {publication} SET TABLE outbox {}",
            narrowings[0].0
        ))
        .await
        .unwrap();
    let late = Uuid::new_v4();
    db.insert(late, "order", "a", json!({})).await;
    wait_for(
        WAIT,
        "the stream to refuse the narrowed publication",
        || async {
            relay
                .logged("the publication does not replicate relay_seq")
                .then_some(())
        },
    )
    .await;
    assert_eq!(db.unsent().await, 1, "the new row stays unsent");
    drop(relay);
    assert_eq!(broker.inbox.snapshot().len(), 1, "nothing more published");
}
