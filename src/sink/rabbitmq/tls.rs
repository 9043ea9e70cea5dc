//! TLS for RabbitMQ (`amqps://`, <https://www.rabbitmq.com/docs/ssl>): lapin's
//! settings from `sink.tls_*`, and the diagnosis of a connection that failed.
//!
//! lapin's OpenSSL backend verifies the broker's certificate against the
//! system's CAs plus `cert_chain`, and the host of the URL against the
//! certificate's names. Its "PKCS8" identity takes the client certificate and
//! key as the PEM they are configured in, so nothing is converted; the files
//! are parsed here first, so that a wrong file is reported by its key.
//!
//! lapin reports a failed handshake as an I/O error, and with TLS 1.3 a
//! missing or refused client certificate is not even that: the broker's alert
//! comes after the client has finished its side of the handshake, and lapin
//! sees a broken pipe. So when an `amqps://` connection fails, [`diagnose`]
//! repeats the handshake on a connection of its own, where OpenSSL's verify
//! result and the broker's alert can be read, and names the key to fix.

use crate::config::RabbitMqConfig;
use crate::sink::{Reason, SinkError};
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use openssl::pkey::PKey;
use openssl::ssl::{SslConnector, SslMethod};
use openssl::x509::{X509, X509VerifyResult};
use std::path::Path;
use std::pin::Pin;
use std::time::Duration;
use tokio::io::AsyncReadExt;

/// Bounds each step of the diagnosis (connect, handshake).
const DIAGNOSIS_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a broker that accepted the handshake may take to send an alert
/// about the client certificate; one that accepts the certificate sends
/// nothing until the client speaks.
const ALERT_WAIT: Duration = Duration::from_secs(2);
/// OpenSSL's `X509_V_ERR_HOSTNAME_MISMATCH` and `X509_V_ERR_IP_ADDRESS_MISMATCH`.
const NAME_MISMATCH: [i32; 2] = [62, 64];

/// The certificate files the config names, read and checked.
struct Files {
    ca: Option<(String, Vec<X509>)>,
    identity: Option<(String, String)>,
}

fn read_files(config: &RabbitMqConfig) -> Result<Files, SinkError> {
    let ca = match &config.tls_ca {
        Some(path) => {
            let pem = read_pem("sink.tls_ca", path)?;
            let certs = certificates("sink.tls_ca", path, &pem)?;
            Some((pem, certs))
        }
        None => None,
    };
    // Validation pairs the two keys.
    let identity = match (&config.tls_cert, &config.tls_key) {
        (Some(cert_path), Some(key_path)) => {
            let cert_pem = read_pem("sink.tls_cert", cert_path)?;
            let leaf = certificates("sink.tls_cert", cert_path, &cert_pem)?.remove(0);
            let key_pem = read_pem("sink.tls_key", key_path)?;
            let key = PKey::private_key_from_pem(key_pem.as_bytes()).map_err(|e| {
                SinkError::Fatal(Reason::caused_by(
                    format!(
                        "sink.tls_key {} is not an unencrypted PEM private key: {e}",
                        key_path.display()
                    ),
                    e,
                ))
            })?;
            if !leaf.public_key().is_ok_and(|public| public.public_eq(&key)) {
                return Err(SinkError::Fatal(
                    format!(
                        "sink.tls_key {} is not the key of the certificate in sink.tls_cert {}",
                        key_path.display(),
                        cert_path.display()
                    )
                    .into(),
                ));
            }
            Some((cert_pem, key_pem))
        }
        _ => None,
    };
    Ok(Files { ca, identity })
}

/// lapin's TLS settings; files are read at every connect, so a renewed
/// certificate is picked up by the next reconnect.
pub(super) fn tls_config(config: &RabbitMqConfig) -> Result<OwnedTLSConfig, SinkError> {
    let files = read_files(config)?;
    Ok(OwnedTLSConfig {
        cert_chain: files.ca.map(|(pem, _)| pem),
        identity: files.identity.map(|(cert, key)| OwnedIdentity::PKCS8 {
            pem: cert.into_bytes(),
            key: key.into_bytes(),
        }),
    })
}

fn read_pem(key: &str, path: &Path) -> Result<String, SinkError> {
    let bytes = std::fs::read(path).map_err(|e| {
        SinkError::Fatal(Reason::caused_by(
            format!("cannot read {key} {}: {e}", path.display()),
            e,
        ))
    })?;
    String::from_utf8(bytes)
        .map_err(|_| SinkError::Fatal(format!("{key} {} is not a PEM file", path.display()).into()))
}

fn certificates(key: &str, path: &Path, pem: &str) -> Result<Vec<X509>, SinkError> {
    match X509::stack_from_pem(pem.as_bytes()) {
        Ok(certs) if !certs.is_empty() => Ok(certs),
        Ok(_) => Err(SinkError::Fatal(
            format!("{key} {} contains no certificate", path.display()).into(),
        )),
        Err(e) => Err(SinkError::Fatal(Reason::caused_by(
            format!("{key} {} is not a valid PEM file: {e}", path.display()),
            e,
        ))),
    }
}

/// The same trust and identity as lapin's connector, built with OpenSSL directly.
fn connector(config: &RabbitMqConfig) -> Result<SslConnector, SinkError> {
    let files = read_files(config)?;
    let setup = |e: openssl::error::ErrorStack| {
        SinkError::Fatal(Reason::caused_by(format!("cannot set up TLS: {e}"), e))
    };
    let mut builder = SslConnector::builder(SslMethod::tls()).map_err(setup)?;
    if let Some((_, certs)) = files.ca {
        for cert in certs {
            builder.cert_store_mut().add_cert(cert).map_err(setup)?;
        }
    }
    if let Some((cert, key)) = files.identity {
        let mut chain = X509::stack_from_pem(cert.as_bytes())
            .map_err(setup)?
            .into_iter();
        if let Some(leaf) = chain.next() {
            builder.set_certificate(&leaf).map_err(setup)?;
        }
        for extra in chain {
            builder.add_extra_chain_cert(extra).map_err(setup)?;
        }
        let key = PKey::private_key_from_pem(key.as_bytes()).map_err(setup)?;
        builder.set_private_key(&key).map_err(setup)?;
    }
    Ok(builder.build())
}

/// Repeats the TLS handshake with the broker of an `amqps://` URL whose
/// connection failed; returns the problem an operator must fix, if it is one
/// of TLS. `shown` is the URL without its password.
pub(super) async fn diagnose(config: &RabbitMqConfig, shown: &str) -> Option<SinkError> {
    let url = url::Url::parse(config.url.expose()).ok()?;
    if url.scheme() != "amqps" {
        return None;
    }
    let host = match url.host()? {
        url::Host::Domain(d) => d.to_owned(),
        url::Host::Ipv4(ip) => ip.to_string(),
        url::Host::Ipv6(ip) => ip.to_string(),
    };
    let port = url.port().unwrap_or(5671);
    let connector = match connector(config) {
        Ok(c) => c,
        Err(e) => return Some(e),
    };
    let tcp = tokio::time::timeout(
        DIAGNOSIS_TIMEOUT,
        tokio::net::TcpStream::connect((host.as_str(), port)),
    )
    .await
    .ok()?
    .ok()?;
    let ssl = connector.configure().ok()?.into_ssl(&host).ok()?;
    let mut tls = tokio_openssl::SslStream::new(ssl, tcp).ok()?;
    let fatal = |what: String| {
        Some(SinkError::Fatal(
            format!("RabbitMQ at {shown} {what}").into(),
        ))
    };
    match tokio::time::timeout(DIAGNOSIS_TIMEOUT, Pin::new(&mut tls).connect()).await {
        Err(_) => None,
        Ok(Err(e)) => {
            let verify = tls.ssl().verify_result();
            if verify != X509VerifyResult::OK {
                let fix = if NAME_MISMATCH.contains(&verify.as_raw()) {
                    "the certificate does not name the host in sink.url; connect by a name or address it lists"
                } else if config.tls_ca.is_some() {
                    "check that sink.tls_ca holds the CA that signed the broker's certificate"
                } else {
                    "sink.tls_ca is unset, so only the system's CAs are trusted; set sink.tls_ca to the CA that signed the broker's certificate"
                };
                return fatal(format!(
                    "presented a certificate the relay does not trust ({}); {fix}",
                    verify.error_string()
                ));
            }
            from_alert(config, &e.to_string(), port).and_then(fatal)
        }
        // TLS 1.3: the broker judges the client certificate after the
        // client's side of the handshake; its verdict is the first record.
        Ok(Ok(())) => {
            let mut byte = [0u8; 1];
            match tokio::time::timeout(ALERT_WAIT, tls.read(&mut byte)).await {
                Ok(Err(e)) => from_alert(config, &e.to_string(), port).and_then(fatal),
                _ => None,
            }
        }
    }
}

/// What the broker's TLS alert (or OpenSSL's complaint) asks the operator to fix.
fn from_alert(config: &RabbitMqConfig, text: &str, port: u16) -> Option<String> {
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    if has(&["certificate required"])
        || (config.tls_cert.is_none() && has(&["alert handshake failure"]))
    {
        Some(format!(
            "requires a client certificate ({text}); set sink.tls_cert and sink.tls_key"
        ))
    } else if has(&[
        "unknown ca",
        "bad certificate",
        "certificate unknown",
        "certificate expired",
        "unsupported certificate",
        "certificate revoked",
    ]) {
        Some(format!(
            "refused the client certificate in sink.tls_cert ({text}); it must be valid and signed by a CA the broker trusts"
        ))
    } else if has(&["wrong version number", "packet length too long"]) {
        Some(format!(
            "does not speak TLS on port {port} ({text}); use the broker's TLS port (5671 by default) in sink.url, or amqp://"
        ))
    } else {
        None
    }
}
