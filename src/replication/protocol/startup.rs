//! Opening a replication connection: socket, TLS negotiation, start-up message and
//! authentication (<https://www.postgresql.org/docs/current/protocol-flow.html#PROTOCOL-FLOW-START-UP>).
use super::error::ProtocolError;
use super::wire::{Connection, Io, message_name};
use crate::config::{SslMode, TlsOptions};
use crate::db::tls::{TlsConnector, tls_server_end_point};
use postgres_protocol::authentication::md5_hash;
use postgres_protocol::authentication::sasl::{
    ChannelBinding, SCRAM_SHA_256, SCRAM_SHA_256_PLUS, ScramSha256,
};
use postgres_protocol::message::backend::{AuthenticationSaslBody, Message};
use postgres_protocol::message::frontend;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio_postgres::Config;
use tokio_postgres::config::{ChannelBinding as ChannelBindingPolicy, Host};
use tokio_postgres::fallible_iterator::FallibleIterator;

/// Applied when the configuration sets no `connect_timeout`: a server that accepts the socket
/// but never answers must not stall the source forever.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(30);
const DEFAULT_PORT: u16 = 5432;

/// Where to connect, from one entry of the configuration's host list.
enum Target {
    Tcp {
        /// The host name (or address) the certificate must name, and shown in errors.
        host: String,
        /// `hostaddr`: skips name resolution when set.
        addr: Option<IpAddr>,
        port: u16,
    },
    #[cfg(unix)]
    Unix(PathBuf),
}

impl Target {
    fn describe(&self) -> String {
        match self {
            Target::Tcp { host, port, .. } => format!("{host}:{port}"),
            #[cfg(unix)]
            Target::Unix(path) => path.display().to_string(),
        }
    }
}

/// An authenticated connection, ready for queries.
pub(super) struct Established {
    pub(super) conn: Connection,
    pub(super) server_version: Option<String>,
}

/// Tries each configured host in turn, as libpq does, and returns the last failure.
pub(super) async fn connect(
    config: &Config,
    tls: &TlsOptions,
) -> Result<Established, ProtocolError> {
    let user = config
        .get_user()
        .ok_or_else(|| ProtocolError::Config("no user is configured".to_owned()))?;
    let connector = match tls.mode {
        SslMode::Disable => None,
        _ => Some(TlsConnector::cached(tls)?),
    };
    let timeout = config
        .get_connect_timeout()
        .copied()
        .unwrap_or(DEFAULT_CONNECT_TIMEOUT);
    let mut last_error = None;
    for target in targets(config)? {
        let attempt = connect_one(config, user, &target, connector.as_ref());
        let error = match tokio::time::timeout(timeout, attempt).await {
            Ok(Ok(established)) => return Ok(established),
            Ok(Err(error)) => error,
            Err(_) => ProtocolError::ConnectTimeout {
                addr: target.describe(),
                timeout,
            },
        };
        tracing::debug!(addr = %target.describe(), error = %error, "replication connect failed");
        last_error = Some(error);
    }
    Err(last_error.unwrap_or_else(|| ProtocolError::Config("no host is configured".to_owned())))
}

fn targets(config: &Config) -> Result<Vec<Target>, ProtocolError> {
    let (hosts, addrs, ports) = (
        config.get_hosts(),
        config.get_hostaddrs(),
        config.get_ports(),
    );
    let count = hosts.len().max(addrs.len());
    if ports.len() > 1 && ports.len() != count {
        return Err(ProtocolError::Config(format!(
            "{} ports for {count} hosts: give one port, or one per host",
            ports.len()
        )));
    }
    let mut targets = Vec::with_capacity(count);
    for i in 0..count {
        let port = ports
            .get(i)
            .or(ports.first())
            .copied()
            .unwrap_or(DEFAULT_PORT);
        let addr = addrs.get(i).copied();
        targets.push(match (hosts.get(i), addr) {
            (Some(Host::Tcp(host)), _) => Target::Tcp {
                host: host.clone(),
                addr,
                port,
            },
            #[cfg(unix)]
            (Some(Host::Unix(dir)), _) => Target::Unix(dir.join(format!(".s.PGSQL.{port}"))),
            (None, Some(ip)) => Target::Tcp {
                host: ip.to_string(),
                addr,
                port,
            },
            (None, None) => break,
        });
    }
    Ok(targets)
}

async fn connect_one(
    config: &Config,
    user: &str,
    target: &Target,
    connector: Option<&TlsConnector>,
) -> Result<Established, ProtocolError> {
    let (io, channel_binding): (Box<dyn Io>, _) = match target {
        Target::Tcp { host, addr, port } => {
            let stream = tcp_connect(host, *addr, *port, config.get_keepalives()).await?;
            negotiate_tls(stream, connector, host, &target.describe()).await?
        }
        // libpq ignores sslmode on Unix sockets: the kernel is the transport.
        #[cfg(unix)]
        Target::Unix(path) => {
            let stream = tokio::net::UnixStream::connect(path)
                .await
                .map_err(|source| ProtocolError::Connect {
                    addr: target.describe(),
                    source,
                })?;
            (Box::new(stream), None)
        }
    };
    let mut conn = Connection::new(io);
    let dbname = config.get_dbname().unwrap_or(user);
    let mut params = vec![
        ("user", user),
        ("database", dbname),
        ("replication", "database"),
        ("client_encoding", "UTF8"),
    ];
    params.extend(
        config
            .get_application_name()
            .map(|a| ("application_name", a)),
    );
    params.extend(config.get_options().map(|o| ("options", o)));
    conn.queue(|buf| frontend::startup_message(params.iter().copied(), buf))?;
    conn.flush().await?;
    authenticate(&mut conn, config, user, channel_binding).await?;
    let server_version = wait_until_ready(&mut conn).await?;
    Ok(Established {
        conn,
        server_version,
    })
}

async fn tcp_connect(
    host: &str,
    addr: Option<IpAddr>,
    port: u16,
    keepalive: bool,
) -> Result<TcpStream, ProtocolError> {
    let failed = |source| ProtocolError::Connect {
        addr: format!("{host}:{port}"),
        source,
    };
    let candidates: Vec<SocketAddr> = match addr {
        Some(ip) => vec![SocketAddr::new(ip, port)],
        None => tokio::net::lookup_host((host, port))
            .await
            .map_err(failed)?
            .collect(),
    };
    let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the host name has no address");
    for candidate in candidates {
        let socket = match candidate {
            SocketAddr::V4(_) => TcpSocket::new_v4(),
            SocketAddr::V6(_) => TcpSocket::new_v6(),
        }
        .map_err(failed)?;
        socket.set_keepalive(keepalive).map_err(failed)?;
        match socket.connect(candidate).await {
            Ok(stream) => {
                stream.set_nodelay(true).map_err(failed)?;
                return Ok(stream);
            }
            Err(error) => last_error = error,
        }
    }
    Err(failed(last_error))
}

/// SSLRequest, then the TLS handshake when the server agrees. Returns the channel binding
/// data of the TLS session, if any. The one-byte answer is read straight from the socket so
/// that nothing sent before the handshake can be mistaken for encrypted data.
async fn negotiate_tls(
    mut stream: TcpStream,
    connector: Option<&TlsConnector>,
    host: &str,
    addr: &str,
) -> Result<(Box<dyn Io>, Option<Vec<u8>>), ProtocolError> {
    let Some(connector) = connector else {
        return Ok((Box::new(stream), None));
    };
    let mut request = bytes::BytesMut::new();
    frontend::ssl_request(&mut request);
    stream
        .write_all(&request)
        .await
        .map_err(ProtocolError::Io)?;
    let mut answer = [0u8; 1];
    stream
        .read_exact(&mut answer)
        .await
        .map_err(|e| match e.kind() {
            io::ErrorKind::UnexpectedEof => ProtocolError::Closed,
            _ => ProtocolError::Io(e),
        })?;
    match (answer[0], connector.mode()) {
        (b'S', _) => {
            let tls = connector.connect(host, stream).await?;
            let binding = tls_server_end_point(tls.ssl());
            Ok((Box::new(tls), binding))
        }
        (b'N', SslMode::Prefer) => Ok((Box::new(stream), None)),
        (b'N', mode) => Err(ProtocolError::TlsRefused {
            addr: addr.to_owned(),
            mode,
        }),
        (other, _) => Err(ProtocolError::Protocol(format!(
            "answer {:?} to SSLRequest, expected 'S' or 'N'",
            char::from(other)
        ))),
    }
}

async fn authenticate(
    conn: &mut Connection,
    config: &Config,
    user: &str,
    channel_binding: Option<Vec<u8>>,
) -> Result<(), ProtocolError> {
    let password = || {
        config
            .get_password()
            .ok_or_else(|| ProtocolError::MissingPassword {
                user: user.to_owned(),
            })
    };
    loop {
        match conn.read_ok().await? {
            Message::AuthenticationOk => return Ok(()),
            Message::AuthenticationCleartextPassword => {
                let password = password()?;
                conn.queue(|buf| frontend::password_message(password, buf))?;
            }
            Message::AuthenticationMd5Password(body) => {
                let hash = md5_hash(user.as_bytes(), password()?, body.salt());
                conn.queue(|buf| frontend::password_message(hash.as_bytes(), buf))?;
            }
            Message::AuthenticationSasl(body) => {
                let policy = config.get_channel_binding();
                scram(conn, &body, password()?, channel_binding.clone(), policy).await?;
            }
            Message::AuthenticationKerberosV5 => return Err(unsupported("Kerberos V5")),
            Message::AuthenticationScmCredential => return Err(unsupported("SCM credential")),
            Message::AuthenticationGss | Message::AuthenticationGssContinue(_) => {
                return Err(unsupported("GSSAPI"));
            }
            Message::AuthenticationSspi => return Err(unsupported("SSPI")),
            other => {
                return Err(ProtocolError::unexpected(
                    message_name(&other),
                    "during authentication",
                ));
            }
        }
        conn.flush().await?;
    }
}

fn unsupported(method: &str) -> ProtocolError {
    ProtocolError::UnsupportedAuth {
        method: method.to_owned(),
    }
}

/// SCRAM-SHA-256 (RFC 7677), with `tls-server-end-point` channel binding when the session is
/// encrypted and the server offers SCRAM-SHA-256-PLUS.
async fn scram(
    conn: &mut Connection,
    body: &AuthenticationSaslBody,
    password: &[u8],
    binding_data: Option<Vec<u8>>,
    policy: ChannelBindingPolicy,
) -> Result<(), ProtocolError> {
    let (mut plain, mut plus) = (false, false);
    let mut mechanisms = body.mechanisms();
    while let Some(mechanism) = mechanisms
        .next()
        .map_err(|e| ProtocolError::malformed(b'R', e))?
    {
        plain |= mechanism == SCRAM_SHA_256;
        plus |= mechanism == SCRAM_SHA_256_PLUS;
    }
    let wanted = !matches!(policy, ChannelBindingPolicy::Disable);
    let (mechanism, binding) = match binding_data {
        Some(data) if plus && wanted => (
            SCRAM_SHA_256_PLUS,
            ChannelBinding::tls_server_end_point(data),
        ),
        _ if matches!(policy, ChannelBindingPolicy::Require) => {
            return Err(ProtocolError::Scram(
                "channel binding is required, but the connection has no TLS or the server \
                 does not offer SCRAM-SHA-256-PLUS"
                    .to_owned(),
            ));
        }
        // 'y': this client could bind but the server did not offer to.
        Some(_) if plain && wanted => (SCRAM_SHA_256, ChannelBinding::unrequested()),
        _ if plain => (SCRAM_SHA_256, ChannelBinding::unsupported()),
        _ => return Err(unsupported("SASL without SCRAM-SHA-256")),
    };
    let mut scram = ScramSha256::new(password, binding);
    conn.queue(|buf| frontend::sasl_initial_response(mechanism, scram.message(), buf))?;
    conn.flush().await?;
    let Message::AuthenticationSaslContinue(server_first) = conn.read_ok().await? else {
        return Err(ProtocolError::Scram(
            "the server did not send its SCRAM challenge".to_owned(),
        ));
    };
    scram
        .update(server_first.data())
        .map_err(|e| ProtocolError::Scram(e.to_string()))?;
    conn.queue(|buf| frontend::sasl_response(scram.message(), buf))?;
    conn.flush().await?;
    let Message::AuthenticationSaslFinal(server_final) = conn.read_ok().await? else {
        return Err(ProtocolError::Scram(
            "the server did not send its SCRAM proof".to_owned(),
        ));
    };
    scram
        .finish(server_final.data())
        .map_err(|e| ProtocolError::Scram(format!("the server's proof is wrong: {e}")))
}

/// Reads the parameter reports up to ReadyForQuery; returns `server_version`.
async fn wait_until_ready(conn: &mut Connection) -> Result<Option<String>, ProtocolError> {
    let mut server_version = None;
    loop {
        match conn.read_ok().await? {
            Message::ReadyForQuery(_) => return Ok(server_version),
            Message::ParameterStatus(body) => {
                let name = body.name().map_err(|e| ProtocolError::malformed(b'S', e))?;
                if name == "server_version" {
                    let value = body
                        .value()
                        .map_err(|e| ProtocolError::malformed(b'S', e))?;
                    server_version = Some(value.to_owned());
                }
            }
            Message::BackendKeyData(_) => {}
            other => {
                return Err(ProtocolError::unexpected(
                    message_name(&other),
                    "after authentication",
                ));
            }
        }
    }
}
