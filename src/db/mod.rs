//! Ordinary (non-replication) connections to the outbox's database.
//!
//! Every connection starts with `TimeZone=UTC` and `DateStyle=ISO`, so the
//! text form of timestamps is the one [`crate::outbox::RawRow`] decodes, and
//! with a `statement_timeout`, so no query waits forever on a stuck server.
//! JIT compilation is off: the relay's statements are short, and compiling
//! one costs more than it saves. A backlog count of 300,000 rows, whose
//! cost estimate passes the default `jit_above_cost`, took 0.71 s with JIT
//! (0.60 s of it compiling) and 0.15 s without.

pub mod tls;

use crate::config::DatabaseConfig;
use crate::errors::{self, ErrorKind};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Notify;
use tokio_postgres::{AsyncMessage, Client};

/// Longest time any relay query may run.
pub const STATEMENT_TIMEOUT: Duration = Duration::from_secs(60);

/// Why a database connection or query failed; [`DbError::kind`] says whether trying again helps.
#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("invalid database.url: {0}")]
    Url(String),
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    #[error("cannot connect to PostgreSQL at {target}: {message}")]
    Connect {
        target: String,
        message: String,
        kind: ErrorKind,
        /// The driver's error, when the driver reported one.
        #[source]
        source: Option<tokio_postgres::Error>,
    },
    // The driver's own text of a server error is only "db error".
    #[error("{context}: {}", error_text(.source))]
    Query {
        context: String,
        #[source]
        source: tokio_postgres::Error,
    },
    /// An object the relay needs is not there; the message says what to run.
    #[error("{0}")]
    Missing(String),
}

impl DbError {
    pub fn query(context: impl Into<String>, source: tokio_postgres::Error) -> Self {
        DbError::Query {
            context: context.into(),
            source,
        }
    }

    /// Network faults, restarts and too many connections pass by themselves;
    /// a bad URL or certificate, a wrong password or a missing object do not.
    pub fn kind(&self) -> ErrorKind {
        match self {
            DbError::Url(_) => ErrorKind::NeedsOperator,
            DbError::Tls(e) => e.kind(),
            DbError::Connect { kind, .. } => *kind,
            DbError::Query { source, .. } => errors::postgres(source),
            DbError::Missing(_) => ErrorKind::NeedsOperator,
        }
    }
}

/// The connection parameters of `database.*`, with the password override applied.
pub fn pg_config(db: &DatabaseConfig) -> Result<tokio_postgres::Config, DbError> {
    config_of(db, Peer::Answers)
}

/// [`pg_config`] for a replication stream, with no `tcp_user_timeout`
/// on the server's side. The relay stops reading one while the broker
/// holds events back, and a user timeout would then end it: Linux aborts
/// a connection whose peer advertises a zero window for longer than the
/// timeout, however promptly the peer acknowledges the probes. The
/// walsender ends a stream whose relay went silent after
/// `wal_sender_timeout` instead (the relay's status updates keep a stream
/// held back alive).
pub fn replication_config(db: &DatabaseConfig) -> Result<tokio_postgres::Config, DbError> {
    config_of(db, Peer::MayStopReading)
}

/// Whether the relay reads everything the server sends on a connection
/// promptly.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Peer {
    /// Queries and their answers: the server's `tcp_user_timeout` applies.
    Answers,
    /// A replication stream, read as the broker allows.
    MayStopReading,
}

fn config_of(db: &DatabaseConfig, peer: Peer) -> Result<tokio_postgres::Config, DbError> {
    let mut config: tokio_postgres::Config = db
        .url
        .expose()
        .parse()
        .map_err(|e: tokio_postgres::Error| DbError::Url(e.to_string()))?;
    if let Some(password) = &db.password {
        config.password(password.expose());
    }
    let options = session_options(config.get_options(), peer)?;
    config
        .application_name(&db.application_name)
        .connect_timeout(db.connect_timeout)
        .keepalives(true)
        .keepalives_idle(Duration::from_secs(30))
        .keepalives_interval(Duration::from_secs(5))
        .keepalives_retries(3)
        .tcp_user_timeout(Duration::from_secs(30))
        .ssl_mode(tls::tokio_postgres_ssl_mode(db.sslmode))
        .options(options);
    Ok(config)
}

/// The `options` startup parameter: the URL's own (`options=-c
/// lock_timeout=...`, `-c search_path=...`) first, then the relay's
/// settings, which win where both set the same one: decoding rows depends
/// on them. The URL's are kept as written (a trailing escaped space is
/// part of a value); ending in a lone backslash they would escape the
/// space before the relay's, so they are refused.
fn session_options(url_options: Option<&str>, peer: Peer) -> Result<String, DbError> {
    // The server's keepalives end the session of a relay whose node died
    // (no FIN, no RST) in about 25 s, not the operating system's two
    // hours: its ownership lock goes with it, so a standby takes over.
    let mut relay = format!(
        "-c TimeZone=UTC -c DateStyle=ISO -c client_encoding=UTF8 -c statement_timeout={} -c jit=off \
         -c tcp_keepalives_idle=10 -c tcp_keepalives_interval=5 -c tcp_keepalives_count=3",
        STATEMENT_TIMEOUT.as_millis()
    );
    relay.push_str(match peer {
        Peer::Answers => " -c tcp_user_timeout=30000",
        // None, whatever postgresql.conf or the role says.
        Peer::MayStopReading => " -c tcp_user_timeout=0",
    });
    let Some(own) = url_options.filter(|o| !o.trim().is_empty()) else {
        return Ok(relay);
    };
    let trailing = own.len() - own.trim_end_matches('\\').len();
    if trailing % 2 == 1 {
        return Err(DbError::Url(format!(
            "the options in database.url end in an unescaped backslash: {own:?}"
        )));
    }
    Ok(format!("{own} {relay}"))
}

/// Where a config points, for messages (never the password).
pub fn describe_target(config: &tokio_postgres::Config) -> String {
    let host = config
        .get_hosts()
        .first()
        .map(|h| match h {
            tokio_postgres::config::Host::Tcp(h) => h.clone(),
            tokio_postgres::config::Host::Unix(p) => p.display().to_string(),
        })
        .unwrap_or_else(|| "localhost".into());
    let port = config.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{host}:{port}/{} as {}",
        config.get_dbname().unwrap_or("?"),
        config.get_user().unwrap_or("?")
    )
}

/// Connects; the connection is driven by a spawned task. When `wakeups` is
/// given, every NOTIFY on the connection wakes it.
pub async fn connect(db: &DatabaseConfig, wakeups: Option<Arc<Notify>>) -> Result<Client, DbError> {
    let config = pg_config(db)?;
    let connector = tls::make_tls_connector(&db.tls())?;
    let target = describe_target(&config);
    // tokio-postgres bounds the TCP connect alone; a server (or a proxy)
    // that accepts and then says nothing would hold the TLS handshake and
    // the login for ever. The whole attempt gets the timeout, per host.
    let hosts = u32::try_from(config.get_hosts().len().max(1)).unwrap_or(u32::MAX);
    let limit = db.connect_timeout.saturating_mul(hosts);
    let attempt = tokio::time::timeout(limit, config.connect(connector))
        .await
        .map_err(|_| DbError::Connect {
            target: target.clone(),
            message: format!(
                "no answer within {}s (database.connect_timeout): the server accepted the connection \
                 and did not finish the handshake; is PostgreSQL running and reachable there?",
                limit.as_secs()
            ),
            kind: ErrorKind::Transient,
            source: None,
        })?;
    let (client, mut connection) = attempt.map_err(|e| {
        let kind = errors::postgres(&e);
        let hint = match e.code().map(|c| c.code()) {
            Some("28P01") | Some("28000") => {
                "; check the user and password (database.url, database.password)"
            }
            Some("3D000") => "; create the database or fix the name in database.url",
            _ if kind == ErrorKind::Transient => "; is PostgreSQL running and reachable?",
            _ => "",
        };
        DbError::Connect {
            target: target.clone(),
            message: format!("{}{hint}", error_text(&e)),
            kind,
            source: Some(e),
        }
    })?;
    tokio::spawn(async move {
        loop {
            match futures::future::poll_fn(|cx| connection.poll_message(cx)).await {
                Some(Ok(AsyncMessage::Notification(_))) => {
                    if let Some(w) = &wakeups {
                        w.notify_one();
                    }
                }
                Some(Ok(AsyncMessage::Notice(n))) => {
                    tracing::debug!(notice = %n.message(), "postgres notice");
                }
                Some(Ok(_)) => {}
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "database connection ended");
                    break;
                }
                None => break,
            }
        }
        // Wake the reader so it notices the closed connection at once.
        if let Some(w) = &wakeups {
            w.notify_one();
        }
    });
    Ok(client)
}

/// The server's message for a database error (with detail and hint), or the
/// client-side description.
pub fn error_text(e: &tokio_postgres::Error) -> String {
    match e.as_db_error() {
        Some(db) => {
            let mut s = db.message().to_owned();
            if let Some(d) = db.detail() {
                s.push_str(" (");
                s.push_str(d);
                s.push(')');
            }
            if let Some(h) = db.hint() {
                s.push_str("; hint: ");
                s.push_str(h);
            }
            s
        }
        None => {
            let mut s = e.to_string();
            let mut source = std::error::Error::source(e);
            while let Some(inner) = source {
                s.push_str(": ");
                s.push_str(&inner.to_string());
                source = inner.source();
            }
            s
        }
    }
}

/// The server's `server_version_num` (150020 for 15.20; 0 if unreadable).
pub async fn server_version_num(client: &Client) -> Result<u32, String> {
    let version: String = client
        .query_one("SHOW server_version_num", &[])
        .await
        .map_err(|e| format!("reading server_version_num: {}", error_text(&e)))?
        .get(0);
    Ok(version.trim().parse().unwrap_or(0))
}

/// Whether the index `name` in `schema` exists and is valid (a `CREATE
/// INDEX CONCURRENTLY` that failed leaves an invalid one).
pub async fn index_is_valid(
    client: &Client,
    schema: &str,
    name: &str,
) -> Result<bool, tokio_postgres::Error> {
    let qualified = format!(
        "{}.{}",
        crate::sql::quote_ident(schema),
        crate::sql::quote_ident(name)
    );
    Ok(client
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_index WHERE indexrelid = to_regclass($1) AND indisvalid)",
            &[&qualified],
        )
        .await?
        .get(0))
}

/// For tests: a server on 127.0.0.1 that accepts connections and never
/// answers (a stuck proxy). Its port, and the task holding the connections
/// (abort it when done).
#[cfg(test)]
pub(crate) async fn silent_server() -> (u16, tokio::task::JoinHandle<()>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind on loopback");
    let port = listener.local_addr().expect("a bound address").port();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            open.push(socket);
        }
    });
    (port, held)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that accepts the connection and then says nothing (a
    /// stuck proxy) fails the attempt after database.connect_timeout.
    #[tokio::test]
    async fn a_server_that_never_answers_fails_the_connect_in_time() {
        let (port, held) = silent_server().await;
        let toml = format!(
            "[database]\nurl = \"postgres://relay@127.0.0.1:{port}/app\"\nconnect_timeout = \"1s\"\n\
             [sink]\ntype = \"kafka\"\nbrokers = \"k:9092\"\n"
        );
        let config = crate::config::load_str(&toml).expect("valid");
        let started = std::time::Instant::now();
        let failed = connect(&config.database, None).await;
        held.abort();
        match failed {
            Err(DbError::Connect { message, .. }) => {
                assert!(message.contains("no answer within 1s"), "{message}")
            }
            other => panic!("{:?}", other.map(|_| ())),
        }
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn the_urls_options_go_before_the_relays_as_written() {
        let relay = session_options(None, Peer::Answers).expect("none");
        assert!(
            relay.starts_with("-c TimeZone=UTC") && relay.ends_with("-c tcp_user_timeout=30000")
        );
        assert_eq!(
            session_options(Some("  "), Peer::Answers).expect("blank"),
            relay
        );
        assert_eq!(
            session_options(Some("-c search_path=app"), Peer::Answers).expect("one"),
            format!("-c search_path=app {relay}")
        );
        // An escaped trailing space is the value's own.
        assert_eq!(
            session_options(Some(r"-c x=a\ "), Peer::Answers).expect("escaped space"),
            format!(r"-c x=a\  {relay}")
        );
        assert_eq!(
            session_options(Some(r"-c x=a\\"), Peer::Answers).expect("an escaped backslash"),
            format!(r"-c x=a\\ {relay}")
        );
        let refused =
            session_options(Some(r"-c x=a\"), Peer::Answers).expect_err("a lone backslash");
        assert!(refused.to_string().contains("database.url"), "{refused}");
    }

    /// A replication stream is read as the broker allows: the server's
    /// tcp_user_timeout would end one held back longer than it.
    #[test]
    fn a_stream_leaves_out_the_servers_user_timeout() {
        let stream = session_options(None, Peer::MayStopReading).expect("none");
        assert!(
            stream.contains("tcp_keepalives_idle=10") && stream.ends_with("-c tcp_user_timeout=0"),
            "{stream}"
        );
    }
}
