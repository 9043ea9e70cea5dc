//! `database.sslmode` and the certificate paths, as plain values; the
//! connector that uses them is [`crate::db::tls`].

use serde::Deserialize;
use std::fmt;
use std::path::PathBuf;

/// How to use TLS with PostgreSQL, with libpq's `sslmode` meanings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum SslMode {
    /// Plain TCP only.
    Disable,
    /// TLS when the server offers it, without certificate verification; plain otherwise.
    #[default]
    Prefer,
    /// TLS required, without certificate verification.
    Require,
    /// TLS required; the server certificate must chain to `sslrootcert`.
    VerifyCa,
    /// As `verify-ca`, and the certificate must name the host connected to.
    VerifyFull,
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        })
    }
}

/// TLS settings shared by the normal and the replication connection.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsOptions {
    pub mode: SslMode,
    /// CA bundle (PEM) used by `verify-ca` and `verify-full`; the system store when unset.
    pub root_cert: Option<PathBuf>,
    /// Client certificate (PEM) for certificate authentication.
    pub client_cert: Option<PathBuf>,
    /// Private key (PEM) of `client_cert`.
    pub client_key: Option<PathBuf>,
}
