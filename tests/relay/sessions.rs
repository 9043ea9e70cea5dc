//! What every session the relay opens on the outbox's database sets, so its
//! statements read and run alike on any server: UTC timestamps in ISO form,
//! a statement timeout, and no JIT compilation (README, `[database]`).

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relay_sessions_set_utc_iso_a_timeout_and_no_jit() {
    let (db, _broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let config = parse(&toml);
    // The server's own defaults differ, so each value below is the relay's.
    let defaults = db
        .client
        .query_one(
            "SELECT current_setting('jit'), current_setting('statement_timeout')",
            &[],
        )
        .await
        .expect("read the test session's settings");
    assert_eq!(
        (defaults.get::<_, String>(0), defaults.get::<_, String>(1)),
        ("on".to_string(), "0".to_string()),
        "the test server's defaults"
    );
    let client = outbox_relay::db::connect(&config.database, None)
        .await
        .expect("connect as the relay does");
    let row = client
        .query_one(
            "SELECT current_setting('TimeZone'), current_setting('DateStyle'),
                    current_setting('statement_timeout'), current_setting('jit'),
                    current_setting('application_name')",
            &[],
        )
        .await
        .expect("read the relay session's settings");
    let settings: Vec<String> = (0..5).map(|i| row.get(i)).collect();
    assert_eq!(settings, ["UTC", "ISO, MDY", "1min", "off", "outbox-relay"]);
}
