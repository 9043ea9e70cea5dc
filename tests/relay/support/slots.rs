//! Private clusters, replication slots and migrations, for the tests that
//! lose slots or run on a server of their own.

use crate::kit::cluster::PrivatePg;
use outbox_relay::config::Config;
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

/// Migrates the database at `url` the way `outbox-relay migrate` does.
pub async fn migrate_at(url: &str, config: &Config) {
    let mut c = super::connect(url).await;
    let opts = outbox_relay::ops::migrate::MigrateOptions::from_config(config, false);
    let steps = outbox_relay::ops::migrate::plan(&c, &opts).await.unwrap();
    outbox_relay::ops::migrate::apply(&mut c, &steps)
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
