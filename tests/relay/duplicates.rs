//! The duplicate bound after crashes, in CDC mode with the default status
//! interval (PostgreSQL hears of the flushed position only now and then, so
//! the slot's position trails what was sent): a restart must not re-send
//! what was already confirmed beyond the documented window.

use crate::support::*;
use serde_json::json;
use std::time::Duration;
use uuid::Uuid;

const WINDOW: usize = 100;
const KILLS: usize = 3;

/// Writes `n` events over eight aggregates at a steady pace.
pub(crate) fn start_writer(url: String, n: usize) -> tokio::task::JoinHandle<Vec<String>> {
    tokio::spawn(async move {
        let c = connect(&url).await;
        let mut ids = Vec::new();
        for i in 0..n {
            let id = Uuid::new_v4();
            c.execute(
                "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload) VALUES ($1, 'order', $2, 'E', $3)",
                &[&id, &format!("agg{}", i % 8), &json!({"i": i})],
            )
            .await
            .unwrap();
            ids.push(id.to_string());
            if i % 10 == 0 {
                tokio::time::sleep(Duration::from_millis(30)).await;
            }
        }
        ids
    })
}

async fn sigkills_repeat_at_most_the_window(mark: &str, bound_per_kill: usize) {
    let (db, broker, toml) = setup(Mode::Cdc, Kind::Kafka, &["order"], &[]).await;
    let toml = set(&toml, "source.cdc.status_interval", "\"10s\""); // the default
    let toml = set(&toml, "relay.mark", &format!("\"{mark}\""));
    let toml = set(&toml, "relay.max_in_flight", &WINDOW.to_string());
    let toml = set(&toml, "relay.ownership_lease", "\"1s\"");
    let writer = start_writer(db.url.clone(), 2100);
    // Killed while busy: after it has published a good deal.
    kill_while_busy(&toml, broker.inbox(), KILLS, 300).await;
    let ids = writer.await.unwrap();
    let mut child = ChildRelay::start(&toml);
    let got = broker.inbox().wait_ids(&ids, Duration::from_secs(60)).await;
    let duplicates = got.len() - ids.len();
    println!(
        "mark = {mark}: {} events, {KILLS} SIGKILLs, {duplicates} duplicates",
        ids.len()
    );
    assert!(
        duplicates <= KILLS * bound_per_kill,
        "{duplicates} duplicates exceed {KILLS} kills x {bound_per_kill}"
    );
    // Per aggregate, first deliveries follow the insert order.
    assert_each_aggregate_in_order(&got);
    assert_eq!(child.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_marking_rows_repeats_at_most_the_window_per_sigkill() {
    // The table says what was sent: only what was unconfirmed or unmarked
    // at the kill comes again.
    sigkills_repeat_at_most_the_window("update", WINDOW).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_without_marking_repeats_at_most_twice_the_window_per_sigkill() {
    // Only the slot says what was sent, told every `max_in_flight`
    // confirmations.
    sigkills_repeat_at_most_the_window("none", 2 * WINDOW).await;
}
