//! TLS against the cluster: which modes verify what, the fallback to plain
//! text when the server has no TLS, and the same settings for the
//! `tokio-postgres` sessions.

use super::*;

#[tokio::test]
async fn verify_full_accepts_the_right_ca_for_ip_and_name() {
    for host in ["127.0.0.1", "localhost"] {
        let config = config_on(host, cluster().pg.port, "relay_trust", None, "postgres");
        let options = tls(SslMode::VerifyFull, Some(cluster().ca()));
        let mut client = connect(&config, &options)
            .await
            .unwrap_or_else(|e| panic!("{host}: {e}"));
        assert_eq!(ssl_in_use(&mut client).await, "true");
    }
}

#[tokio::test]
async fn verify_full_rejects_a_foreign_ca_with_a_fix() {
    let config = config("relay_scram", Some(SCRAM_PASSWORD), "postgres");
    let options = tls(SslMode::VerifyFull, Some(cluster().foreign_ca()));
    let error = connect(&config, &options).await.expect_err("rejected");
    assert!(
        matches!(
            &error,
            ProtocolError::Tls(TlsError::CertificateRejected { .. })
        ),
        "{error:?}"
    );
    assert_eq!(error.kind(), ErrorKind::NeedsOperator);
    let message = error.to_string();
    assert!(message.contains("database.sslrootcert"), "{message}");
    assert!(message.contains("verify-full"), "{message}");
}

/// `hostaddr` connects to 127.0.0.1 while the certificate is checked against `host`.
#[tokio::test]
async fn only_verify_full_checks_the_host_name() {
    let mut config = config_on(
        "db.invalid",
        cluster().pg.port,
        "relay_trust",
        None,
        "postgres",
    );
    config.hostaddr([127, 0, 0, 1].into());
    let full = tls(SslMode::VerifyFull, Some(cluster().ca()));
    let error = connect(&config, &full).await.expect_err("wrong host name");
    assert!(
        error.to_string().contains("does not name the host"),
        "{error}"
    );
    let ca_only = tls(SslMode::VerifyCa, Some(cluster().ca()));
    let mut client = connect(&config, &ca_only)
        .await
        .expect("verify-ca ignores the name");
    assert_eq!(ssl_in_use(&mut client).await, "true");
}

#[tokio::test]
async fn require_and_prefer_encrypt_without_a_ca_and_disable_does_not() {
    let config = config("relay_trust", None, "postgres");
    for (mode, ssl) in [
        (SslMode::Require, "true"),
        (SslMode::Prefer, "true"),
        (SslMode::Disable, "false"),
    ] {
        let mut client = connect(&config, &tls(mode, None)).await.expect("connect");
        assert_eq!(ssl_in_use(&mut client).await, ssl, "{mode}");
    }
}

/// A front for the cluster that answers 'N' to SSLRequest, as a server without TLS does,
/// then relays the bytes both ways. Returns its port.
async fn tls_refusing_front() -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const SSL_REQUEST: [u8; 8] = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let port = listener.local_addr().expect("address").port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut first = [0u8; 8];
                client.read_exact(&mut first).await?;
                let mut server =
                    tokio::net::TcpStream::connect(("127.0.0.1", cluster().pg.port)).await?;
                if first == SSL_REQUEST {
                    client.write_all(b"N").await?;
                } else {
                    server.write_all(&first).await?;
                }
                tokio::io::copy_bidirectional(&mut client, &mut server).await?;
                std::io::Result::Ok(())
            });
        }
    });
    port
}

#[tokio::test]
async fn prefer_falls_back_to_plain_when_the_server_has_no_tls_and_require_does_not() {
    let port = tls_refusing_front().await;
    let config = config_on(
        "127.0.0.1",
        port,
        "relay_scram",
        Some(SCRAM_PASSWORD),
        "postgres",
    );
    let mut client = connect(&config, &tls(SslMode::Prefer, None))
        .await
        .expect("plain");
    assert_eq!(ssl_in_use(&mut client).await, "false");
    for mode in [SslMode::Require, SslMode::VerifyFull] {
        let error = connect(&config, &tls(mode, Some(cluster().ca())))
            .await
            .expect_err("no TLS");
        assert!(
            matches!(error, ProtocolError::TlsRefused { .. }),
            "{error:?}"
        );
        assert_eq!(error.kind(), ErrorKind::NeedsOperator);
        assert!(
            error
                .to_string()
                .contains(&format!("database.sslmode is {mode}"))
        );
    }
}

#[tokio::test]
async fn a_silent_server_times_out_and_is_transient() {
    let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = silent.local_addr().expect("address").port();
    let mut config = config_on("127.0.0.1", port, "relay_trust", None, "postgres");
    config.connect_timeout(Duration::from_millis(300));
    let error = connect(&config, &tls(SslMode::Prefer, None))
        .await
        .expect_err("no answer");
    assert!(
        matches!(error, ProtocolError::ConnectTimeout { .. }),
        "{error:?}"
    );
    assert_eq!(error.kind(), ErrorKind::Transient);
}

#[tokio::test]
async fn disable_against_a_hostssl_only_entry_fails_clearly() {
    let config = config("relay_tls_only", None, "postgres");
    let error = connect(&config, &tls(SslMode::Disable, None))
        .await
        .expect_err("rejected");
    assert_eq!(error.code(), Some("28000"), "{error}");
    assert_eq!(error.kind(), ErrorKind::NeedsOperator);
    assert!(error.to_string().contains("no encryption"), "{error}");
    connect(&config, &tls(SslMode::Require, None))
        .await
        .expect("TLS is accepted");
}

#[tokio::test]
async fn tokio_postgres_uses_the_same_tls_settings() {
    async fn ssl_via_tokio_postgres(options: TlsOptions) -> Result<bool, tokio_postgres::Error> {
        let mut config = config_on(
            "localhost",
            cluster().pg.port,
            "relay_scram",
            Some(SCRAM_PASSWORD),
            "postgres",
        );
        config.ssl_mode(tokio_postgres_ssl_mode(options.mode));
        let connector = make_tls_connector(&options).expect("connector");
        let (client, connection) = within("connect", config.connect(connector)).await?;
        tokio::spawn(connection);
        let sql = "SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()";
        Ok(within("query", client.query_one(sql, &[])).await?.get(0))
    }
    let verified = tls(SslMode::VerifyFull, Some(cluster().ca()));
    assert!(ssl_via_tokio_postgres(verified).await.expect("verify-full"));
    assert!(
        ssl_via_tokio_postgres(tls(SslMode::Require, None))
            .await
            .expect("require")
    );
    let foreign = tls(SslMode::VerifyCa, Some(cluster().foreign_ca()));
    let error = ssl_via_tokio_postgres(foreign)
        .await
        .expect_err("foreign CA rejected");
    let chain = std::iter::successors(Some(&error as &dyn std::error::Error), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ");
    assert!(chain.contains("certificate verify failed"), "{chain}");
}
