//! A replication stream held back by the broker stays open. While nothing
//! is confirmed the relay stops reading the stream, and once both sockets'
//! buffers are full it advertises a zero window; Linux ends a connection
//! whose peer does that for longer than the server's `tcp_user_timeout`
//! (30 s on the relay's other sessions), however promptly the probes are
//! acknowledged. So streams leave that setting out.

use crate::support::proxy::setup_cut;
use crate::support::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_held_back_past_the_user_timeout_stays_open() {
    let sets = [
        ("relay.confirm_timeout", "\"120s\""),
        ("relay.max_in_flight", "100"),
    ];
    let (db, broker, toml) = setup_cut(Mode::Cdc, Kind::Rabbit, &sets).await;
    let _relay = ChildRelay::start(&toml);
    let first = uuid::Uuid::new_v4();
    db.insert(first, "order", "a", serde_json::json!({})).await;
    broker.inbox.wait_ids(&[first.to_string()], WAIT).await;
    let slot = slot_of(&toml);
    let pid = wait_streaming(&db.client, &slot).await;
    assert!(
        broker.proxy().freeze_all() > 0,
        "the relay's broker connection goes through the proxy"
    );
    // About 30 MB decoded: more than both sockets' buffers hold.
    let ids: Vec<String> = db
        .client
        .query(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'a' || (g % 50), 'Happened',
                    jsonb_build_object('pad', repeat(md5(g::text), 160))
             FROM generate_series(1, 6000) g RETURNING id::text",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    wait_for(
        WAIT,
        "the WAL sender to wait for the relay to read",
        || async {
            let waiting: Option<String> = db
                .client
                .query_one(
                    "SELECT wait_event FROM pg_stat_activity WHERE pid = $1",
                    &[&pid],
                )
                .await
                .unwrap()
                .get(0);
            (waiting.as_deref() == Some("WalSenderWriteData")).then_some(())
        },
    )
    .await;
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(
        wait_streaming(&db.client, &slot).await,
        pid,
        "the stream held back for 40 s is the same"
    );
    // The broker back: everything goes out. (A frozen connection ends
    // once the proxy has seen the cut.)
    broker.proxy().cut();
    tokio::time::sleep(Duration::from_secs(1)).await;
    broker.proxy().restore();
    broker.inbox.wait_ids(&ids, Duration::from_secs(120)).await;
}
