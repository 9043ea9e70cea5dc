//! RabbitMQ over TLS, against a private node listening with certificates the
//! test makes: a verified connection relays events, a certificate from the
//! wrong CA is refused with the key to fix, and a node that demands client
//! certificates gets one from `sink.tls_cert`/`sink.tls_key`.
//!
//! Each test boots its own node (about 8 s), so the two run in parallel.

use crate::kit::certs::{Ca, Issued};
use crate::support::rabbit_node::{RabbitNode, ServerTls};
use crate::support::*;
use lapin::options::{
    BasicGetOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties, ExchangeKind};
use outbox_relay::config::{RabbitMqConfig, SinkConfig};
use outbox_relay::sink::{RabbitMqSink, Sink, SinkCheck, SinkError};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The test CA, and the node's certificate signed by it for 127.0.0.1 and localhost.
pub(crate) fn pki() -> (Ca, Issued) {
    let ca = Ca::new("outbox-relay test CA");
    let server = ca.server(&["localhost"], &["127.0.0.1"]);
    (ca, server)
}

pub(crate) async fn start_node(ca: &Ca, server: &Issued, require_client_cert: bool) -> RabbitNode {
    let node = RabbitNode::start(&ServerTls {
        ca_pem: ca.cert_pem(),
        cert_pem: server.cert_pem.clone(),
        key_pem: server.key_pem.clone(),
        require_client_cert,
    })
    .await;
    eprintln!(
        "RabbitMQ node {} accepted connections after {:.1?}",
        node.name, node.startup
    );
    node
}

/// A relay configuration publishing to `exchange` on the node's TLS port;
/// `tls` holds extra `[sink]` lines.
fn relay_toml(db_url: &str, node: &RabbitNode, exchange: &str, tls: &str) -> String {
    base_toml(
        db_url,
        &format!(
            "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{exchange}\"\n{tls}",
            node.amqps_url()
        ),
    )
}

fn rabbit(toml: &str) -> RabbitMqConfig {
    match parse(toml).sink {
        SinkConfig::RabbitMq(r) => r,
        SinkConfig::Kafka(_) => unreachable!(),
    }
}

async fn connect(config: &RabbitMqConfig) -> Result<RabbitMqSink, SinkError> {
    tokio::time::timeout(WAIT, RabbitMqSink::connect(config))
        .await
        .expect("connecting ends within the wait")
}

fn fatal_message(result: Result<RabbitMqSink, SinkError>) -> String {
    match result {
        Err(SinkError::Fatal(m)) => {
            eprintln!("refused: {m}");
            m.to_string()
        }
        Err(other) => panic!("expected an error for the operator to fix, got {other:?}"),
        Ok(_) => panic!("expected the connection to be refused"),
    }
}

fn tls_lines(keys: &[(&str, &std::path::Path)]) -> String {
    keys.iter()
        .map(|(k, p)| format!("{k} = \"{}\"\n", p.display()))
        .collect()
}

/// An exchange with a queue bound to every routing key, over plain AMQP.
pub(crate) async fn declare_exchange(
    node: &RabbitNode,
    exchange: &str,
) -> (Connection, lapin::Channel) {
    let connection = Connection::connect(&node.amqp_url(), ConnectionProperties::default())
        .await
        .expect("plain AMQP to the private node");
    let ch = connection.create_channel().await.unwrap();
    ch.exchange_declare(
        exchange.into(),
        ExchangeKind::Topic,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_declare(
        exchange.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch.queue_bind(
        exchange.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    (connection, ch)
}

/// The relay binary, its log going to a file the test reads.
struct LoggedRelay {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl LoggedRelay {
    fn start(node: &RabbitNode, toml: &str) -> LoggedRelay {
        let config = node.file("relay.toml", toml.as_bytes());
        let log = node.file("relay.log", b"");
        let child = Command::new(crate::support::relay_bin())
            .args(["run", "--config"])
            .arg(&config)
            .env("RUST_LOG", "outbox_relay=info,warn")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start outbox-relay");
        LoggedRelay { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits until `needle` appears `n` times in the log.
    fn wait_log(&mut self, needle: &str, n: usize) -> String {
        let start = Instant::now();
        loop {
            let log = self.log();
            if log.matches(needle).count() >= n {
                return log;
            }
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the relay exited ({status}) instead of retrying:\n{log}");
            }
            if start.elapsed() > WAIT {
                panic!("timed out after {WAIT:?} waiting for {n} × {needle:?} in:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn terminate(mut self) -> std::process::ExitStatus {
        terminate(&mut self.child)
    }
}

impl Drop for LoggedRelay {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_broker_certificate_is_checked_against_tls_ca() {
    let (ca, server) = pki();
    let node = start_node(&ca, &server, false).await;
    let ca_path = node.file("ca.pem", &ca.cert_pem());
    let stranger = node.file("other-ca.pem", &Ca::new("some other CA").cert_pem());
    let db = TestDb::new().await;
    let exchange = unique("tls");
    let (_consumer, ch) = declare_exchange(&node, &exchange).await;

    // 1. The right CA: `check` passes, and an event crosses the TLS connection.
    let toml = relay_toml(
        &db.url,
        &node,
        &exchange,
        &tls_lines(&[("tls_ca", &ca_path)]),
    );
    db.migrate(&parse(&toml)).await;
    let config_path = node.file("good.toml", toml.as_bytes());
    let (code, out, err) = run_cli(&["check", "--config", config_path.to_str().unwrap()], &[]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("rabbitmq reachable"), "{out}");
    let relay = InProcess::start(parse(&toml));
    let id = uuid::Uuid::new_v4();
    db.insert(id, "order", "o-1", serde_json::json!({"over": "tls"}))
        .await;
    let message = wait_for(WAIT, "the event through TLS", || {
        let ch = ch.clone();
        let exchange = exchange.clone();
        async move {
            ch.basic_get(exchange.as_str().into(), BasicGetOptions { no_ack: true })
                .await
                .unwrap()
        }
    })
    .await;
    assert_eq!(
        message
            .delivery
            .properties
            .message_id()
            .as_ref()
            .map(|s| s.to_string()),
        Some(id.to_string())
    );
    wait_for(WAIT, "the row marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    relay.stop().await;

    // 2. A CA that did not sign the node's certificate: refused, naming the key to fix.
    let wrong = relay_toml(
        &db.url,
        &node,
        &exchange,
        &tls_lines(&[("tls_ca", &stranger)]),
    );
    let m = fatal_message(connect(&rabbit(&wrong)).await);
    assert!(
        m.contains("presented a certificate the relay does not trust (")
            && m.contains(
                "check that sink.tls_ca holds the CA that signed the broker's certificate"
            ),
        "{m}"
    );
    assert!(!m.contains("guest:guest"), "no password in errors: {m}");
    // Without tls_ca only the system's CAs are trusted, and the message says so.
    let unset = relay_toml(&db.url, &node, &exchange, "");
    let m = fatal_message(connect(&rabbit(&unset)).await);
    assert!(m.contains("sink.tls_ca is unset"), "{m}");
    // amqps:// to the plain listener: the port is named, not the certificate.
    let plain_port = wrong.replace(
        &format!(":{}/", node.amqps_port),
        &format!(":{}/", node.amqp_port),
    );
    let m = fatal_message(connect(&rabbit(&plain_port)).await);
    assert!(
        m.contains(&format!("does not speak TLS on port {}", node.amqp_port)),
        "{m}"
    );
    // `check` shows it on the broker line.
    let wrong_path = node.file("wrong.toml", wrong.as_bytes());
    let (code, out, _) = run_cli(&["check", "--config", wrong_path.to_str().unwrap()], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(
        out.contains("[FAIL] broker") && out.contains("sink.tls_ca"),
        "{out}"
    );
    // `run` logs it and keeps retrying, without a panic, until stopped.
    let mut relay = LoggedRelay::start(&node, &wrong);
    let log = relay.wait_log("check that sink.tls_ca holds the CA", 2);
    assert!(
        !log.contains("panicked") && !log.contains("guest:guest"),
        "{log}"
    );
    let status = relay.terminate();
    assert!(
        status.success(),
        "SIGTERM while retrying ends cleanly: {status}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_demands_client_certificates_gets_tls_cert() {
    let (ca, server) = pki();
    let node = start_node(&ca, &server, true).await;
    let ca_path = node.file("ca.pem", &ca.cert_pem());
    let client = ca.client("outbox-relay");
    let (cert, key) = (
        node.file("relay.pem", &client.cert_pem),
        node.file("relay.key", &client.key_pem),
    );
    let toml = |tls: &[(&str, &std::path::Path)]| {
        let mut keys = vec![("tls_ca", ca_path.as_path())];
        keys.extend_from_slice(tls);
        rabbit(&relay_toml(
            "postgres://postgres@127.0.0.1/unused",
            &node,
            "amq.topic",
            &tls_lines(&keys),
        ))
    };

    // Without a client certificate: refused, naming the keys to set.
    let m = fatal_message(connect(&toml(&[])).await);
    assert!(
        m.contains("requires a client certificate")
            && m.contains("set sink.tls_cert and sink.tls_key"),
        "{m}"
    );

    // A client certificate the node's CA did not sign: refused as such.
    let stranger = Ca::new("some other CA").client("outbox-relay");
    let (other_cert, other_key) = (
        node.file("other.pem", &stranger.cert_pem),
        node.file("other.key", &stranger.key_pem),
    );
    let m =
        fatal_message(connect(&toml(&[("tls_cert", &other_cert), ("tls_key", &other_key)])).await);
    assert!(
        m.contains("refused the client certificate in sink.tls_cert"),
        "{m}"
    );

    // A key that is not the certificate's: found before any handshake.
    let m = fatal_message(connect(&toml(&[("tls_cert", &cert), ("tls_key", &other_key)])).await);
    assert!(
        m.contains("sink.tls_key") && m.contains("is not the key of the certificate"),
        "{m}"
    );

    // The right pair: connected, and the sink works.
    let mut sink = connect(&toml(&[("tls_cert", &cert), ("tls_key", &key)]))
        .await
        .unwrap_or_else(|e| panic!("a client certificate signed by the node's CA: {e}"));
    sink.probe().await.expect("connected");
    let destination = sink
        .check_destination("order", "Created")
        .await
        .expect("amq.topic exists");
    assert!(destination.contains("amq.topic"), "{destination}");
    sink.close().await;
}
