//! A RabbitMQ node of a test's own, for what the shared one must not be
//! reconfigured for: a TLS listener with the test's certificates, a demand
//! for client certificates.
//!
//! Everything the node writes (data, logs, configuration, Erlang cookie) is
//! under one temporary folder; it listens on loopback only and registers with
//! the machine's epmd under a name of its own. A watchdog child starts the
//! node in a process group of its own and holds the only write end of a pipe
//! to the test process: however the test ends (a panic, SIGKILL), the group
//! is killed and the folder removed.

use lapin::{Connection, ConnectionProperties};
use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// How long a node may take to boot; about 8 s on an idle 2-core machine.
const STARTUP_LIMIT: Duration = Duration::from_secs(90);

/// The TLS listener's settings.
pub struct ServerTls {
    /// CAs the node trusts for client certificates (`ssl_options.cacertfile`).
    pub ca_pem: Vec<u8>,
    pub cert_pem: Vec<u8>,
    pub key_pem: Vec<u8>,
    /// `verify_peer` with `fail_if_no_peer_cert`, instead of `verify_none`.
    pub require_client_cert: bool,
}

pub struct RabbitNode {
    pub name: String,
    /// Plain AMQP, for the test's own consumers.
    pub amqp_port: u16,
    /// AMQP over TLS.
    pub amqps_port: u16,
    /// How long the node took to accept connections.
    pub startup: Duration,
    dir: PathBuf,
    watchdog: Child,
}

fn server_bin() -> PathBuf {
    if let Ok(dir) = std::env::var("RABBITMQ_BINDIR") {
        return PathBuf::from(dir);
    }
    // The scripts themselves: /usr/sbin's wrappers switch to the rabbitmq
    // user and its shared settings.
    PathBuf::from("/usr/lib/rabbitmq/bin")
}

impl RabbitNode {
    /// Boots a node with a TLS listener and waits until it accepts AMQP connections.
    pub async fn start(tls: &ServerTls) -> RabbitNode {
        let name = format!("{}@localhost", super::unique("tls-"));
        let (amqp_port, amqps_port, dist_port) = (
            crate::kit::free_port(),
            crate::kit::free_port(),
            crate::kit::free_port(),
        );
        let dir = std::env::temp_dir().join(super::unique("outbox-relay-rabbit-"));
        std::fs::create_dir_all(dir.join("conf.d")).unwrap();
        let path = |file: &str| dir.join(file).to_str().unwrap().to_owned();
        std::fs::write(path("ca.pem"), &tls.ca_pem).unwrap();
        std::fs::write(path("server.pem"), &tls.cert_pem).unwrap();
        std::fs::write(path("server.key"), &tls.key_pem).unwrap();
        let verify = if tls.require_client_cert {
            "verify_peer\nssl_options.fail_if_no_peer_cert = true"
        } else {
            "verify_none\nssl_options.fail_if_no_peer_cert = false"
        };
        std::fs::write(
            path("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = 127.0.0.1:{amqp_port}\n\
                 listeners.ssl.default = 127.0.0.1:{amqps_port}\n\
                 ssl_options.cacertfile = {}\n\
                 ssl_options.certfile = {}\n\
                 ssl_options.keyfile = {}\n\
                 ssl_options.verify = {verify}\n",
                path("ca.pem"),
                path("server.pem"),
                path("server.key"),
            ),
        )
        .unwrap();
        std::fs::write(path("enabled_plugins"), "[].\n").unwrap();
        std::fs::write(path("rabbitmq-env.conf"), "").unwrap();
        write_cookie(&dir.join(".erlang.cookie"));

        let started = Instant::now();
        let script = format!(
            "trap '' INT TERM HUP\n\
             setsid {server} >{out} 2>&1 </dev/null &\n\
             echo $! >{pid}\n\
             cat >/dev/null\n\
             kill -KILL -$(cat {pid}) 2>/dev/null\n\
             sleep 0.2\n\
             rm -rf {dir}\n",
            server = server_bin().join("rabbitmq-server").display(),
            out = path("server.out"),
            pid = path("server.pid"),
            dir = dir.display(),
        );
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg(script)
            .env("HOME", &dir)
            .env("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf"))
            .env("RABBITMQ_NODENAME", &name)
            .env("RABBITMQ_NODE_PORT", amqp_port.to_string())
            .env("RABBITMQ_DIST_PORT", dist_port.to_string())
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf"))
            .env("RABBITMQ_CONFIG_FILES", path("conf.d"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", path("advanced.config"))
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            .env("RABBITMQ_PID_FILE", path("beam.pid"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .env(
                "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS",
                "-kernel inet_dist_use_interface {127,0,0,1}",
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start the RabbitMQ watchdog");
        // Keep the pipe's write end open in this process only.
        let _ = watchdog.stdin.as_mut().map(|s| s.flush());
        let mut node = RabbitNode {
            name,
            amqp_port,
            amqps_port,
            startup: Duration::ZERO,
            dir,
            watchdog,
        };
        node.wait_ready(started).await;
        node.startup = started.elapsed();
        node
    }

    /// Polls a plain AMQP connection: the listeners open at the very end of
    /// the boot. (`rabbitmqctl await_startup` fails at once while the node has
    /// not registered yet, then checks only every 10 s.)
    async fn wait_ready(&mut self, started: Instant) {
        let url = self.amqp_url();
        loop {
            let attempt = tokio::time::timeout(
                Duration::from_secs(5),
                Connection::connect(&url, ConnectionProperties::default()),
            )
            .await;
            if let Ok(Ok(connection)) = attempt {
                let _ = connection.close(200, "ready".into()).await;
                return;
            }
            if let Ok(Some(status)) = self.watchdog.try_wait() {
                panic!(
                    "the RabbitMQ watchdog exited ({status}) before node {} started",
                    self.name
                );
            }
            if self.server_exited() {
                panic!(
                    "RabbitMQ node {} exited while starting:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            if started.elapsed() > STARTUP_LIMIT {
                panic!(
                    "RabbitMQ node {} did not accept connections within {STARTUP_LIMIT:?}:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    fn server_exited(&self) -> bool {
        std::fs::read_to_string(self.dir.join("server.pid"))
            .ok()
            .and_then(|pid| pid.trim().parse::<u32>().ok())
            .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists())
    }

    /// The end of the startup output and of the node's log, for a failure message.
    pub fn log_tail(&self) -> String {
        let mut text = std::fs::read_to_string(self.dir.join("server.out")).unwrap_or_default();
        let log = self.dir.join("log").join(format!("{}.log", self.name));
        text.push_str(&std::fs::read_to_string(log).unwrap_or_default());
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// `guest` on the plain listener (guest may log in from loopback).
    pub fn amqp_url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.amqp_port)
    }

    /// `guest` on the TLS listener, by the address the server certificate lists.
    pub fn amqps_url(&self) -> String {
        format!("amqps://guest:guest@127.0.0.1:{}/%2f", self.amqps_port)
    }

    /// Runs `rabbitmqctl <args>` against the node (a broker alarm, say);
    /// panics with its output when it fails.
    pub fn ctl(&self, args: &[&str]) -> String {
        let path = |file: &str| self.dir.join(file);
        let out = Command::new(server_bin().join("rabbitmqctl"))
            .args(["-n", &self.name])
            .args(args)
            .env("HOME", &self.dir)
            .env("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf"))
            .env("ERL_EPMD_ADDRESS", "127.0.0.1")
            .output()
            .expect("run rabbitmqctl");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "rabbitmqctl {args:?}: {text}");
        text
    }

    /// Writes a file (a CA, a client certificate) that goes away with the node.
    pub fn file(&self, name: &str, contents: &[u8]) -> PathBuf {
        let path = self.dir.join("client").join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, contents).unwrap();
        path
    }
}

impl Drop for RabbitNode {
    /// Closing the pipe tells the watchdog to kill the node; waiting for it
    /// frees the CPU and ports for the next test.
    fn drop(&mut self) {
        drop(self.watchdog.stdin.take());
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.watchdog.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// A cookie of the node's own: only [`RabbitNode::ctl`] (with the node's
/// home) reaches it.
fn write_cookie(path: &Path) {
    use std::os::unix::fs::OpenOptionsExt;
    let cookie = uuid::Uuid::new_v4().simple().to_string().to_uppercase();
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o400)
        .open(path)
        .unwrap();
    f.write_all(cookie.as_bytes()).unwrap();
}
