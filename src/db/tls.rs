//! TLS for PostgreSQL connections, shared by the ordinary `tokio-postgres` connection and the
//! replication client.
//!
//! Both paths are configured from one [`TlsConnector`], so `database.sslmode` means the same on
//! each, with libpq's meanings
//! (<https://www.postgresql.org/docs/current/libpq-ssl.html#LIBPQ-SSL-PROTECTION>):
//! `prefer` and `require` encrypt without checking the certificate, `verify-ca` checks the chain
//! against `database.sslrootcert` (the system store when unset), `verify-full` also checks that
//! the certificate names the host. Unlike libpq, `require` stays unverified even when a root
//! certificate is configured: the mode alone says what is checked.
use crate::config::{SslMode, TlsOptions};
use crate::errors::ErrorKind;
use openssl::error::ErrorStack;
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::PKey;
use openssl::ssl::{ConnectConfiguration, Ssl, SslConnector, SslMethod, SslRef, SslVerifyMode};
use openssl::x509::store::X509StoreBuilder;
use openssl::x509::{X509, X509VerifyResult};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Mutex;
use std::time::SystemTime;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;

const ROOT_CERT_KEY: &str = "database.sslrootcert";
const CLIENT_CERT_KEY: &str = "database.sslcert";
const CLIENT_KEY_KEY: &str = "database.sslkey";
/// OpenSSL's `X509_V_ERR_HOSTNAME_MISMATCH` and `X509_V_ERR_IP_ADDRESS_MISMATCH`.
const NAME_MISMATCH: [i32; 2] = [62, 64];

/// A TLS setting that cannot be used, or a handshake that failed.
///
/// Each message is complete on its own (log lines print only the top error), and names the
/// configuration key to fix.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {key} {}: {source}", path.display())]
    ReadFile {
        key: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{key} {} is not a valid PEM file: {source}", path.display())]
    InvalidPem {
        key: &'static str,
        path: PathBuf,
        #[source]
        source: ErrorStack,
    },
    #[error("{key} {} contains no certificate", path.display())]
    NoCertificate { key: &'static str, path: PathBuf },
    #[error("{present} is set but {missing} is not: a client certificate needs both")]
    IncompleteClientCert {
        present: &'static str,
        missing: &'static str,
    },
    #[error("database.sslkey does not match the certificate in database.sslcert: {0}")]
    KeyMismatch(#[source] ErrorStack),
    #[error("cannot set up TLS: {0}")]
    Setup(#[from] ErrorStack),
    #[error(
        "the certificate of PostgreSQL server {host} was rejected ({reason}) under \
         database.sslmode {mode}: {fix}"
    )]
    CertificateRejected {
        host: String,
        mode: SslMode,
        reason: String,
        fix: &'static str,
    },
    #[error("TLS handshake with PostgreSQL server {host} failed: {source}")]
    Handshake {
        host: String,
        #[source]
        source: openssl::ssl::Error,
    },
}

impl TlsError {
    /// Only a handshake cut short (the server restarting, a network fault) can succeed on
    /// another try without changing the configuration.
    pub fn kind(&self) -> ErrorKind {
        match self {
            TlsError::Handshake { .. } => ErrorKind::Transient,
            _ => ErrorKind::NeedsOperator,
        }
    }
}

/// A TLS client context built once from [`TlsOptions`] (certificate files are read here);
/// cheap to clone.
#[derive(Clone)]
pub struct TlsConnector {
    connector: SslConnector,
    mode: SslMode,
    has_root_cert: bool,
}

impl fmt::Debug for TlsConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TlsConnector")
            .field("mode", &self.mode)
            .finish()
    }
}

impl TlsConnector {
    /// Reads the certificate files named in `opts` and builds the context.
    pub fn new(opts: &TlsOptions) -> Result<Self, TlsError> {
        let mut builder = SslConnector::builder(SslMethod::tls_client())?;
        let verify = matches!(opts.mode, SslMode::VerifyCa | SslMode::VerifyFull);
        builder.set_verify(if verify {
            SslVerifyMode::PEER
        } else {
            SslVerifyMode::NONE
        });
        if let Some(path) = &opts.root_cert {
            // The file replaces the system store, as libpq's sslrootcert does.
            let mut store = X509StoreBuilder::new()?;
            for cert in read_certificates(ROOT_CERT_KEY, path)? {
                store.add_cert(cert)?;
            }
            builder.set_cert_store(store.build());
        }
        match (&opts.client_cert, &opts.client_key) {
            (None, None) => {}
            (Some(_), None) => return Err(incomplete(CLIENT_CERT_KEY, CLIENT_KEY_KEY)),
            (None, Some(_)) => return Err(incomplete(CLIENT_KEY_KEY, CLIENT_CERT_KEY)),
            (Some(cert_path), Some(key_path)) => {
                let mut chain = read_certificates(CLIENT_CERT_KEY, cert_path)?.into_iter();
                if let Some(leaf) = chain.next() {
                    builder.set_certificate(&leaf)?;
                }
                for intermediate in chain {
                    builder.add_extra_chain_cert(intermediate)?;
                }
                let pem = read_file(CLIENT_KEY_KEY, key_path)?;
                let key =
                    PKey::private_key_from_pem(&pem).map_err(|source| TlsError::InvalidPem {
                        key: CLIENT_KEY_KEY,
                        path: key_path.clone(),
                        source,
                    })?;
                builder.set_private_key(&key)?;
                builder.check_private_key().map_err(TlsError::KeyMismatch)?;
            }
        }
        Ok(TlsConnector {
            connector: builder.build(),
            mode: opts.mode,
            has_root_cert: opts.root_cert.is_some(),
        })
    }

    /// The context for `opts`, built once and shared by later connections.
    ///
    /// Building one loads the system's CA store, tens of milliseconds of
    /// CPU, and the relay opens connections throughout a run (the CDC
    /// start-up read's slot moves and streams, the fold, retention). The
    /// context is built again when `opts` or the modification time of a
    /// file it names changes, so a rotated client certificate or CA bundle
    /// takes effect at the next connection, as before.
    pub fn cached(opts: &TlsOptions) -> Result<Self, TlsError> {
        type Entry = (TlsOptions, Vec<Option<SystemTime>>, TlsConnector);
        static BUILT: Mutex<Vec<Entry>> = Mutex::new(Vec::new());
        let stamps: Vec<Option<SystemTime>> =
            [&opts.root_cert, &opts.client_cert, &opts.client_key]
                .into_iter()
                .map(|p| {
                    p.as_ref()
                        .and_then(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok())
                })
                .collect();
        let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((_, _, connector)) = built.iter().find(|(o, t, _)| o == opts && *t == stamps) {
            return Ok(connector.clone());
        }
        let connector = TlsConnector::new(opts)?;
        // One context per set of options: a changed file replaces it.
        built.retain(|(o, _, _)| o != opts);
        built.push((opts.clone(), stamps, connector.clone()));
        Ok(connector)
    }

    /// The `sslmode` this context was built for.
    pub fn mode(&self) -> SslMode {
        self.mode
    }

    /// A TLS session for `host` (a name or an IP address), checked as the mode requires.
    pub fn ssl_for_host(&self, host: &str) -> Result<Ssl, TlsError> {
        let mut config = self.connector.configure()?;
        configure_session(self.mode, &mut config);
        Ok(config.into_ssl(host)?)
    }

    /// Performs the handshake for `host` over `stream`, telling a rejected certificate (fix
    /// the configuration) from a failed exchange (try again).
    pub async fn connect<S>(&self, host: &str, stream: S) -> Result<SslStream<S>, TlsError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let mut tls = SslStream::new(self.ssl_for_host(host)?, stream)?;
        match Pin::new(&mut tls).connect().await {
            Ok(()) => Ok(tls),
            Err(source) => {
                let verify = tls.ssl().verify_result();
                // Without verification (require, prefer) OpenSSL still notes
                // what it would have found (a self-signed certificate, say),
                // which did not fail this handshake.
                let verifying = matches!(self.mode, SslMode::VerifyCa | SslMode::VerifyFull);
                if verify == X509VerifyResult::OK || !verifying {
                    Err(TlsError::Handshake {
                        host: host.to_owned(),
                        source,
                    })
                } else {
                    Err(TlsError::CertificateRejected {
                        host: host.to_owned(),
                        mode: self.mode,
                        reason: verify.error_string().to_owned(),
                        fix: self.fix_for(verify),
                    })
                }
            }
        }
    }

    fn fix_for(&self, verify: X509VerifyResult) -> &'static str {
        if NAME_MISMATCH.contains(&verify.as_raw()) {
            "the certificate does not name the host connected to; connect by a name it lists, \
             or use database.sslmode verify-ca"
        } else if self.has_root_cert {
            "check that database.sslrootcert holds the CA that signed the server's certificate"
        } else {
            "database.sslrootcert is unset, so the system's CAs were used; set it to the CA \
             that signed the server's certificate"
        }
    }
}

/// Host-name checking is per session; only `verify-full` asks for it.
fn configure_session(mode: SslMode, config: &mut ConnectConfiguration) {
    config.set_verify_hostname(mode == SslMode::VerifyFull);
}

/// The connector for `tokio_postgres::Config::connect`; pair it with
/// [`tokio_postgres_ssl_mode`].
pub fn make_tls_connector(
    opts: &TlsOptions,
) -> Result<postgres_openssl::MakeTlsConnector, TlsError> {
    let TlsConnector {
        connector, mode, ..
    } = TlsConnector::cached(opts)?;
    let mut make = postgres_openssl::MakeTlsConnector::new(connector);
    make.set_callback(move |config, _host| {
        configure_session(mode, config);
        Ok(())
    });
    Ok(make)
}

/// `tokio-postgres` knows only disable/prefer/require: verification is the connector's job.
pub fn tokio_postgres_ssl_mode(mode: SslMode) -> tokio_postgres::config::SslMode {
    use tokio_postgres::config::SslMode as Pg;
    match mode {
        SslMode::Disable => Pg::Disable,
        SslMode::Prefer => Pg::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => Pg::Require,
    }
}

/// The `tls-server-end-point` channel binding data of a TLS session (RFC 5929 section 4.1):
/// the hash of the server certificate, with SHA-256 standing in for MD5 and SHA-1.
pub fn tls_server_end_point(ssl: &SslRef) -> Option<Vec<u8>> {
    let cert = ssl.peer_certificate()?;
    let algorithms = cert
        .signature_algorithm()
        .object()
        .nid()
        .signature_algorithms()?;
    let digest = match algorithms.digest {
        Nid::MD5 | Nid::SHA1 => MessageDigest::sha256(),
        nid => MessageDigest::from_nid(nid)?,
    };
    cert.digest(digest).ok().map(|hash| hash.to_vec())
}

fn incomplete(present: &'static str, missing: &'static str) -> TlsError {
    TlsError::IncompleteClientCert { present, missing }
}

fn read_file(key: &'static str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::ReadFile {
        key,
        path: path.to_owned(),
        source,
    })
}

fn read_certificates(key: &'static str, path: &Path) -> Result<Vec<X509>, TlsError> {
    let certs =
        X509::stack_from_pem(&read_file(key, path)?).map_err(|source| TlsError::InvalidPem {
            key,
            path: path.to_owned(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            key,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(mode: SslMode) -> TlsOptions {
        TlsOptions {
            mode,
            ..TlsOptions::default()
        }
    }

    #[test]
    fn missing_root_cert_names_the_key_and_the_path() {
        let options = TlsOptions {
            root_cert: Some(PathBuf::from("/nonexistent/root.crt")),
            ..opts(SslMode::VerifyFull)
        };
        let err = TlsConnector::new(&options).expect_err("the file does not exist");
        let message = err.to_string();
        assert!(
            message.starts_with("cannot read database.sslrootcert /nonexistent/root.crt: "),
            "{message}"
        );
        assert_eq!(err.kind(), ErrorKind::NeedsOperator);
    }

    #[test]
    fn a_file_without_certificates_is_rejected() {
        let dir = std::env::temp_dir().join(format!("outbox-relay-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("empty.crt");
        std::fs::write(&path, b"not a certificate\n").expect("write");
        let options = TlsOptions {
            root_cert: Some(path.clone()),
            ..opts(SslMode::VerifyCa)
        };
        let err = TlsConnector::new(&options).expect_err("no certificate in the file");
        assert!(err.to_string().contains("database.sslrootcert"), "{err}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn a_client_cert_needs_its_key() {
        let options = TlsOptions {
            client_cert: Some(PathBuf::from("/x/client.crt")),
            ..opts(SslMode::Require)
        };
        let err = TlsConnector::new(&options).expect_err("key missing");
        assert_eq!(
            err.to_string(),
            "database.sslcert is set but database.sslkey is not: a client certificate needs both"
        );
    }

    #[test]
    fn verify_modes_map_to_require_for_tokio_postgres() {
        use tokio_postgres::config::SslMode as Pg;
        assert!(matches!(
            tokio_postgres_ssl_mode(SslMode::Disable),
            Pg::Disable
        ));
        assert!(matches!(
            tokio_postgres_ssl_mode(SslMode::Prefer),
            Pg::Prefer
        ));
        for mode in [SslMode::Require, SslMode::VerifyCa, SslMode::VerifyFull] {
            assert!(matches!(tokio_postgres_ssl_mode(mode), Pg::Require));
        }
    }

    /// A second connection with the same options shares the context; a
    /// certificate file written again (rotated) gets a new one.
    #[test]
    fn contexts_are_shared_until_a_file_changes() {
        let dir =
            std::env::temp_dir().join(format!("outbox-relay-tls-cache-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let root = dir.join("root.crt");
        let key = PKey::generate_ed25519().expect("key");
        let mut name = openssl::x509::X509NameBuilder::new().expect("name");
        name.append_entry_by_text("CN", "outbox-relay test CA")
            .expect("cn");
        let name = name.build();
        let mut builder = openssl::x509::X509::builder().expect("builder");
        builder.set_subject_name(&name).expect("subject");
        builder.set_issuer_name(&name).expect("issuer");
        builder.set_pubkey(&key).expect("pubkey");
        builder
            .set_not_before(&openssl::asn1::Asn1Time::days_from_now(0).expect("now"))
            .expect("not before");
        builder
            .set_not_after(&openssl::asn1::Asn1Time::days_from_now(1).expect("later"))
            .expect("not after");
        builder.sign(&key, MessageDigest::null()).expect("sign");
        let pem = builder.build().to_pem().expect("pem");
        std::fs::write(&root, &pem).expect("write");
        let options = TlsOptions {
            root_cert: Some(root.clone()),
            ..opts(SslMode::VerifyCa)
        };
        let context = |c: &TlsConnector| std::ptr::from_ref(c.connector.context()) as usize;
        let first = TlsConnector::cached(&options).expect("built");
        let again = TlsConnector::cached(&options).expect("cached");
        assert_eq!(context(&first), context(&again), "shared");
        let other = TlsConnector::cached(&opts(SslMode::Require)).expect("built");
        assert_ne!(
            context(&first),
            context(&other),
            "other options, other context"
        );
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&root)
            .and_then(|f| f.set_modified(later))
            .expect("touch");
        let rotated = TlsConnector::cached(&options).expect("rebuilt");
        assert_ne!(
            context(&first),
            context(&rotated),
            "a changed file, a new context"
        );
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn modes_display_as_configured() {
        assert_eq!(SslMode::VerifyFull.to_string(), "verify-full");
        assert_eq!(SslMode::Prefer.to_string(), "prefer");
        assert!(TlsConnector::new(&opts(SslMode::Require)).is_ok());
    }
}
