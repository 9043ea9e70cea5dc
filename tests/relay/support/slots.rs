//! Private clusters, replication slots and migrations, for the tests that
//! lose slots or run on a server of their own.

use super::wait_for;
use crate::kit::cluster::PrivatePg;
use outbox_relay::config::Config;
use outbox_relay::replication::Lsn;
use std::time::Duration;
use tokio_postgres::Client;

/// The slot name a test config sets (`source.cdc.slot`).
pub fn slot_of(toml: &str) -> String {
    toml.lines()
        .find_map(|l| l.strip_prefix("slot = "))
        .expect("a slot line")
        .trim_matches('"')
        .to_owned()
}

/// The slot's `wal_status` (`lost` once the server removed WAL it needs);
/// `None` when there is no such slot.
pub async fn wal_status(client: &Client, slot: &str) -> Option<String> {
    client
        .query_opt(
            "SELECT wal_status FROM pg_replication_slots WHERE slot_name = $1",
            &[&slot],
        )
        .await
        .unwrap()
        .and_then(|r| r.get(0))
}

/// A position of `slot`: `column` of `pg_replication_slots`.
pub async fn slot_position(client: &Client, slot: &str, column: &str) -> Lsn {
    let sql = format!("SELECT {column}::text FROM pg_replication_slots WHERE slot_name = $1");
    let lsn: String = client.query_one(&sql, &[&slot]).await.unwrap().get(0);
    lsn.parse().unwrap()
}

/// Where decoding `slot` starts again (`restart_lsn`).
pub async fn restart_position(client: &Client, slot: &str) -> Lsn {
    slot_position(client, slot, "restart_lsn").await
}

/// The WAL insert position now.
pub async fn wal_insert_position(client: &Client) -> Lsn {
    let lsn: String = client
        .query_one("SELECT pg_current_wal_insert_lsn()::text", &[])
        .await
        .unwrap()
        .get(0);
    lsn.parse().unwrap()
}

/// The replication slots whose names start with `prefix`.
pub async fn slots_named(client: &Client, prefix: &str) -> Vec<String> {
    client
        .query(
            "SELECT slot_name::text FROM pg_replication_slots WHERE starts_with(slot_name::text, $1)",
            &[&prefix],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// Waits until a WAL sender streams from `slot` and returns its pid. The
/// slot is also active while the relay moves it in fast-forward during a
/// start-up read, from an ordinary session: that does not count.
pub async fn wait_streaming(client: &Client, slot: &str) -> i32 {
    wait_for(
        super::WAIT,
        "a WAL sender streaming from the slot",
        || async {
            client
                .query_opt(
                    "SELECT s.active_pid FROM pg_replication_slots s \
                 JOIN pg_stat_replication r ON r.pid = s.active_pid \
                 WHERE s.slot_name = $1",
                    &[&slot],
                )
                .await
                .unwrap()
                .map(|r| r.get(0))
        },
    )
    .await
}

/// Writes WAL (and checkpoints) until the cluster, one of
/// [`cluster_that_loses_slots`], loses `slot`; panics after `limit`.
pub async fn lose_slot(app: &Client, slot: &str, limit: Duration) {
    app.batch_execute("CREATE TABLE filler (pad text)")
        .await
        .unwrap();
    wait_for(limit, "the slot to be lost", || async {
        app.batch_execute("INSERT INTO filler SELECT repeat('x', 1000) FROM generate_series(1, 3000); SELECT pg_switch_wal(); CHECKPOINT;")
            .await
            .unwrap();
        (wal_status(app, slot).await.as_deref() == Some("lost")).then_some(())
    })
    .await;
}

/// Asserts the relay left the lost `slot` alone, then recovers the way the
/// operator is told to: drops it.
pub async fn drop_lost_slot(app: &Client, slot: &str) {
    assert_eq!(
        wal_status(app, slot).await.as_deref(),
        Some("lost"),
        "the slot is left alone"
    );
    app.execute("SELECT pg_drop_replication_slot($1)", &[&slot])
        .await
        .unwrap();
}

/// Migrates the database at `url` the way `outbox-relay migrate` does.
pub async fn migrate_at(url: &str, config: &Config) {
    let mut c = super::connect(url).await;
    let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(config, false);
    let steps = outbox_relay::ops::migrate::plan(&c, &opts).await.unwrap();
    outbox_relay::ops::migrate::apply(&mut c, &steps, &config.database)
        .await
        .unwrap();
}

/// A private cluster that loses a slot within seconds of WAL: 1 MB
/// segments, `max_slot_wal_keep_size = 1MB`.
pub fn cluster_that_loses_slots() -> PrivatePg {
    PrivatePg::start_with(
        &["--wal-segsize=1"],
        &[
            "wal_level = logical",
            "max_slot_wal_keep_size = 1MB",
            "min_wal_size = 2MB",
            "max_wal_size = 4MB",
        ],
    )
}
