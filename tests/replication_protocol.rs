//! The replication client and the TLS settings against a real PostgreSQL.
//!
//! The binary starts its own throwaway cluster (see `cluster.rs`, built on the shared kit in
//! `tests/kit/`): one `initdb` under the temp folder, `wal_level=logical`, TLS on with a CA
//! made here, one role per authentication method. A watchdog child stops the cluster and deletes its folder when this process exits,
//! however it exits. Every test uses its own database and slot, and bounds every wait. The
//! TLS modes' tests are in `replication_protocol/tls.rs`.
#[path = "replication_protocol/cluster.rs"]
mod cluster;
#[path = "kit/mod.rs"]
mod kit;
#[path = "replication_protocol/tls.rs"]
mod tls;

use bytes::Bytes;
use cluster::{MD5_PASSWORD, PLAIN_PASSWORD, SCRAM_PASSWORD, cluster};
use outbox_relay::config::{SslMode, TlsOptions};
use outbox_relay::db::tls::{TlsError, make_tls_connector, tokio_postgres_ssl_mode};
use outbox_relay::errors::ErrorKind;
use outbox_relay::replication::Lsn;
use outbox_relay::replication::protocol::{
    ProtocolError, ReplicationClient, ReplicationMessage, ReplicationStream, publication_names,
    quote_identifier,
};
use std::future::Future;
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(20);

async fn within<T>(what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future)
        .await
        .unwrap_or_else(|_| panic!("timed out after {WAIT:?}: {what}"))
}

fn config(user: &str, password: Option<&str>, dbname: &str) -> tokio_postgres::Config {
    config_on("127.0.0.1", cluster().pg.port, user, password, dbname)
}

fn config_on(
    host: &str,
    port: u16,
    user: &str,
    password: Option<&str>,
    dbname: &str,
) -> tokio_postgres::Config {
    let mut config = tokio_postgres::Config::new();
    config
        .host(host)
        .port(port)
        .user(user)
        .dbname(dbname)
        .application_name("outbox-relay-protocol-test")
        .connect_timeout(Duration::from_secs(10));
    if let Some(password) = password {
        config.password(password);
    }
    config
}

fn tls(mode: SslMode, root_cert: Option<PathBuf>) -> TlsOptions {
    TlsOptions {
        mode,
        root_cert,
        ..TlsOptions::default()
    }
}

async fn connect(
    config: &tokio_postgres::Config,
    tls: &TlsOptions,
) -> Result<ReplicationClient, ProtocolError> {
    within(
        "replication connect",
        ReplicationClient::connect(config, tls),
    )
    .await
}

/// A superuser connection over plain TCP.
async fn admin(dbname: &str) -> tokio_postgres::Client {
    let config = config("postgres", None, dbname);
    let (client, connection) = within("admin connect", config.connect(tokio_postgres::NoTls))
        .await
        .expect("admin connection");
    tokio::spawn(connection);
    client
}

/// A new, empty database named `name` with an outbox table and a publication for it.
async fn fresh_database(name: &str, publication: &str) {
    let admin = admin("postgres").await;
    for sql in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        within("create database", admin.batch_execute(&sql))
            .await
            .expect("create database");
    }
    let db = self::admin(name).await;
    let sql = format!(
        "CREATE TABLE outbox (id bigserial PRIMARY KEY, payload text NOT NULL);
         CREATE PUBLICATION {} FOR TABLE outbox;",
        quote_identifier(publication)
    );
    within("create outbox", db.batch_execute(&sql))
        .await
        .expect("create outbox");
}

async fn ssl_in_use(client: &mut ReplicationClient) -> String {
    let sql = "SELECT ssl::text FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
    let rows = within("pg_stat_ssl", client.simple_query(sql))
        .await
        .expect("query");
    rows[0][0].clone().expect("ssl column")
}

/// A stream of slot `slot` (created here) of database `db`, as relay_scram over TLS.
async fn start_stream(db: &str, slot: &str, publication: &str) -> ReplicationStream {
    let config = config("relay_scram", Some(SCRAM_PASSWORD), db);
    let mut client = connect(&config, &tls(SslMode::Require, None))
        .await
        .expect("connect");
    let create = format!(
        "CREATE_REPLICATION_SLOT {} LOGICAL pgoutput",
        quote_identifier(slot)
    );
    within("create slot", client.simple_query(&create))
        .await
        .expect("create slot");
    let names = publication_names(&[publication]);
    let options = [
        ("proto_version", "1"),
        ("publication_names", names.as_str()),
    ];
    within(
        "start",
        client.start_logical_replication(slot, Lsn(0), &options),
    )
    .await
    .expect("start replication")
}

async fn next(stream: &mut ReplicationStream) -> ReplicationMessage {
    within("next replication message", stream.next())
        .await
        .expect("replication message")
        .expect("the stream goes on")
}

#[tokio::test]
async fn each_auth_method_connects_with_and_without_tls() {
    let users = [
        ("relay_trust", None),
        ("relay_plain", Some(PLAIN_PASSWORD)),
        ("relay_md5", Some(MD5_PASSWORD)),
        ("relay_scram", Some(SCRAM_PASSWORD)),
    ];
    for (user, password) in users {
        for (mode, ssl) in [(SslMode::Disable, "false"), (SslMode::Require, "true")] {
            let config = config(user, password, "postgres");
            let mut client = connect(&config, &tls(mode, None))
                .await
                .unwrap_or_else(|e| panic!("{user} with sslmode {mode}: {e}"));
            let identity = within("identify", client.identify_system())
                .await
                .expect("identify");
            assert_eq!(identity.dbname.as_deref(), Some("postgres"));
            assert_eq!(
                ssl_in_use(&mut client).await,
                ssl,
                "{user} with sslmode {mode}"
            );
            within("close", client.close()).await.expect("close");
        }
    }
}

#[tokio::test]
async fn scram_binds_to_the_tls_channel() {
    let mut config = config("relay_scram", Some(SCRAM_PASSWORD), "postgres");
    config.channel_binding(tokio_postgres::config::ChannelBinding::Require);
    let mut client = connect(&config, &tls(SslMode::Require, None))
        .await
        .expect("SCRAM-SHA-256-PLUS over TLS");
    assert_eq!(ssl_in_use(&mut client).await, "true");
    let error = connect(&config, &tls(SslMode::Disable, None))
        .await
        .expect_err("no channel to bind to without TLS");
    assert!(matches!(error, ProtocolError::Scram(_)), "{error:?}");
    assert!(
        error.to_string().contains("channel binding is required"),
        "{error}"
    );
}

#[tokio::test]
async fn wrong_password_is_28p01_and_final() {
    for user in ["relay_plain", "relay_md5", "relay_scram"] {
        let config = config(user, Some("wrong"), "postgres");
        let error = connect(&config, &tls(SslMode::Prefer, None))
            .await
            .expect_err("rejected");
        assert_eq!(error.code(), Some("28P01"), "{user}: {error}");
        assert_eq!(error.kind(), ErrorKind::NeedsOperator);
        let message = error.to_string();
        assert!(message.contains(&format!(
            "password authentication failed for user \"{user}\""
        )));
    }
}

#[tokio::test]
async fn missing_password_names_the_user() {
    let config = config("relay_scram", None, "postgres");
    let error = connect(&config, &tls(SslMode::Disable, None))
        .await
        .expect_err("rejected");
    assert!(
        matches!(error, ProtocolError::MissingPassword { .. }),
        "{error}"
    );
    assert!(error.to_string().contains("\"relay_scram\""), "{error}");
    assert_eq!(error.kind(), ErrorKind::NeedsOperator);
}

#[tokio::test]
async fn identify_system_matches_the_cluster() {
    let admin = admin("postgres").await;
    let row = within(
        "control",
        admin.query_one(
            "SELECT system_identifier::text, pg_current_wal_lsn()::text FROM pg_control_system()",
            &[],
        ),
    )
    .await
    .expect("control data");
    let config = config("relay_trust", None, "postgres");
    let mut client = connect(&config, &tls(SslMode::Disable, None))
        .await
        .expect("connect");
    let identity = within("identify", client.identify_system())
        .await
        .expect("identify");
    assert_eq!(identity.system_id.to_string(), row.get::<_, String>(0));
    assert_eq!(identity.timeline, 1);
    assert!(identity.xlogpos >= row.get::<_, String>(1).parse::<Lsn>().expect("lsn"));
    assert!(
        client
            .server_version()
            .is_some_and(|v| v.starts_with(char::is_numeric))
    );
}

#[tokio::test]
async fn unix_socket_connects() {
    let mut config = tokio_postgres::Config::new();
    config
        .host_path(cluster().pg.dir())
        .port(cluster().pg.port)
        .user("relay_trust")
        .dbname("postgres");
    // sslmode does not apply to Unix sockets, as in libpq.
    let mut client = connect(&config, &tls(SslMode::Require, None))
        .await
        .expect("connect");
    within("identify", client.identify_system())
        .await
        .expect("identify");
    assert_eq!(ssl_in_use(&mut client).await, "false");
}

/// Inserts, streams them, acknowledges the commit and sees the slot follow.
#[tokio::test]
async fn streams_changes_and_confirms_the_flushed_position() {
    // A publication name that needs quoting at every level, backslash included.
    let publication = r#"outbox "pub" 'q' \ b"#;
    fresh_database("stream_changes", publication).await;
    let mut stream = start_stream("stream_changes", "stream_changes", publication).await;
    let db = admin("stream_changes").await;
    let insert = "INSERT INTO outbox (payload) SELECT 'event-' || n FROM generate_series(1, 3) n";
    within("insert", db.execute(insert, &[]))
        .await
        .expect("insert");

    let (mut kinds, mut commit_lsn, mut keepalive) = (Vec::new(), None, false);
    while commit_lsn.is_none() || !keepalive {
        match next(&mut stream).await {
            ReplicationMessage::XLogData {
                wal_start, data, ..
            } => {
                kinds.push(char::from(data[0]));
                if data[0] == b'C' {
                    commit_lsn = Some(wal_start);
                }
            }
            ReplicationMessage::PrimaryKeepalive { .. } => keepalive = true,
        }
    }
    assert_eq!(kinds, ['B', 'R', 'I', 'I', 'I', 'C']);
    let commit_lsn = commit_lsn.expect("commit seen");

    let send = stream.send_standby_status(commit_lsn, commit_lsn, commit_lsn, false);
    within("status update", send).await.expect("status update");
    let deadline = Instant::now() + WAIT;
    let query = "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = $1";
    loop {
        let row = within("slot", db.query_one(query, &[&"stream_changes"]))
            .await
            .expect("slot");
        let confirmed: Lsn = row.get::<_, String>(0).parse().expect("lsn");
        if confirmed >= commit_lsn {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "confirmed_flush_lsn stuck at {confirmed}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    within("finish", stream.finish()).await.expect("finish");
}

/// `next()` dropped at every await point (a branch of `select!` that loses) loses no byte.
#[tokio::test]
async fn next_is_cancel_safe_in_select() {
    fresh_database("cancel_safe", "cancel_pub").await;
    let mut stream = start_stream("cancel_safe", "cancel_safe", "cancel_pub").await;
    let db = admin("cancel_safe").await;
    let insert = "INSERT INTO outbox (payload)
                  SELECT lpad(n::text, 6, '0') || repeat('x', 30000) FROM generate_series(1, 150) n";
    within("insert", db.execute(insert, &[]))
        .await
        .expect("insert");

    let (mut inserts, mut dropped) = (Vec::<Bytes>::new(), 0u32);
    let deadline = Instant::now() + WAIT;
    loop {
        assert!(
            Instant::now() < deadline,
            "only {} inserts arrived",
            inserts.len()
        );
        tokio::select! {
            message = stream.next() => match message.expect("message").expect("stream goes on") {
                ReplicationMessage::XLogData { data, .. } if data[0] == b'I' => inserts.push(data),
                ReplicationMessage::XLogData { data, .. } if data[0] == b'C' => break,
                _ => {}
            },
            () = tokio::task::yield_now() => dropped += 1,
        }
    }
    assert!(dropped > 0, "the test never dropped a pending next()");
    assert_eq!(inserts.len(), 150);
    for (i, data) in inserts.iter().enumerate() {
        let marker = format!("{:06}xxx", i + 1);
        assert!(
            data.windows(marker.len()).any(|w| w == marker.as_bytes()),
            "insert {i} is corrupted or out of order"
        );
    }
}

#[tokio::test]
async fn a_second_client_on_an_active_slot_gets_55006_until_the_first_finishes() {
    fresh_database("slot_owner", "owner_pub").await;
    let first = start_stream("slot_owner", "slot_owner", "owner_pub").await;
    let names = publication_names(&["owner_pub"]);
    let options = [
        ("proto_version", "1"),
        ("publication_names", names.as_str()),
    ];
    let config = config("relay_scram", Some(SCRAM_PASSWORD), "slot_owner");
    let standby = || async {
        let client = connect(&config, &tls(SslMode::Require, None)).await?;
        client
            .start_logical_replication("slot_owner", Lsn(0), &options)
            .await
    };

    let error = within("standby", standby())
        .await
        .expect_err("the slot is taken");
    assert_eq!(error.code(), Some("55006"), "{error}");
    assert_eq!(error.kind(), ErrorKind::Transient);
    assert!(error.to_string().contains("is active for PID"), "{error}");

    within("finish", first.finish()).await.expect("finish");
    let deadline = Instant::now() + WAIT;
    let second = loop {
        match within("standby", standby()).await {
            Ok(stream) => break stream,
            Err(e) if e.code() == Some("55006") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("the standby could not take over: {e}"),
        }
    };

    // An administrator ending the walsender is an error worth retrying.
    let mut second = second;
    let db = admin("slot_owner").await;
    let kill = "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots
                WHERE slot_name = 'slot_owner'";
    within("terminate", db.execute(kill, &[]))
        .await
        .expect("terminate");
    let error = loop {
        match within("next", second.next()).await {
            Ok(Some(_)) => {}
            Ok(None) => panic!("the stream ended without an error"),
            Err(e) => break e,
        }
    };
    assert_eq!(error.code(), Some("57P01"), "{error}");
    assert_eq!(error.kind(), ErrorKind::Transient);
}

#[tokio::test]
async fn a_missing_slot_is_42704_and_hostile_names_stay_names() {
    let config = config("relay_trust", None, "postgres");
    for slot in ["no_such_slot", r#"x" LOGICAL 0/0 ("a"#] {
        let client = connect(&config, &tls(SslMode::Disable, None))
            .await
            .expect("connect");
        let options = [("proto_version", "1"), ("publication_names", "p")];
        let start = client.start_logical_replication(slot, Lsn(0), &options);
        let error = within("start", start).await.expect_err("no such slot");
        assert_eq!(error.code(), Some("42704"), "{error}");
        assert_eq!(error.kind(), ErrorKind::NeedsOperator);
        assert!(error.to_string().contains(slot), "{error}");
    }
}
