//! What every session the relay opens on the outbox's database sets, so its
//! statements read and run alike on any server: UTC timestamps in ISO form,
//! a statement timeout, and no JIT compilation; and server-side keepalives,
//! so that the session (and the ownership lock) of a relay whose node died
//! ends in seconds (README, `[database]`).

use crate::support::*;
use outbox_relay::config::Config;

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
    let names = [
        "TimeZone",
        "DateStyle",
        "statement_timeout",
        "jit",
        "application_name",
        "tcp_keepalives_idle",
        "tcp_keepalives_interval",
        "tcp_keepalives_count",
        "tcp_user_timeout",
    ];
    assert_eq!(
        relay_session_settings(&config, &names).await,
        [
            "UTC",
            "ISO, MDY",
            "1min",
            "off",
            "outbox-relay",
            "10",
            "5",
            "3",
            "30000"
        ]
    );
}

/// The settings `names` of a session the relay opens with `config`.
async fn relay_session_settings(config: &Config, names: &[&str]) -> Vec<String> {
    let client = outbox_relay::db::connect(&config.database, None)
        .await
        .expect("connect as the relay does");
    client
        .query(
            "SELECT current_setting(n) FROM unnest($1::text[]) WITH ORDINALITY s(n, i) ORDER BY i",
            &[&names],
        )
        .await
        .expect("read the relay session's settings")
        .iter()
        .map(|r| r.get(0))
        .collect()
}

/// A `database.url` may carry its own session settings (`options=-c
/// lock_timeout=...`, `-c search_path=...`): the relay keeps them on its query and
/// replication sessions, and its own settings win where both set one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_urls_own_options_are_kept_beside_the_relays() {
    let (db, _broker, toml) = setup(Mode::Polling, Kind::Rabbit, &[], &[]).await;
    let with_options = format!(
        "{}{}options=-c%20work_mem%3D7MB%20-c%20TimeZone%3DAsia/Tokyo",
        db.url,
        if db.url.contains('?') { '&' } else { '?' }
    );
    let config = parse(&toml.replace(&db.url, &with_options));
    assert_eq!(
        relay_session_settings(&config, &["work_mem", "TimeZone", "jit"]).await,
        ["7MB", "UTC", "off"],
        "query session"
    );

    use outbox_relay::replication::protocol::ReplicationClient;
    let pg = outbox_relay::db::pg_config(&config.database).expect("the URL parses");
    let mut replication = ReplicationClient::connect(&pg, &config.database.tls())
        .await
        .expect("open a replication session as the relay does");
    let mut shown = Vec::new();
    for setting in ["work_mem", "TimeZone", "jit"] {
        let rows = replication
            .simple_query(&format!("SHOW {setting}"))
            .await
            .expect("SHOW on the replication session");
        shown.push(rows[0][0].clone().unwrap_or_default());
    }
    assert_eq!(shown, ["7MB", "UTC", "off"], "replication session");
}
