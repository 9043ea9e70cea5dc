//! A TCP proxy the tests can cut and restore: the network failing between
//! the relay and a broker, without touching the broker. It can also freeze
//! one connection (a silent partition: nothing passes, nothing is closed).

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

type Connections = Arc<Mutex<Vec<(u16, watch::Sender<bool>)>>>;

pub struct Proxy {
    pub port: u16,
    up: Arc<watch::Sender<bool>>,
    /// Per forwarded connection: the local port of its upstream side (what
    /// the server sees as the client's port) and its freeze switch.
    connections: Connections,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Listens on a free port and forwards to `upstream`; `up` says whether it starts open.
    pub async fn start(upstream: SocketAddr, up: bool) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        Self::with_listener(listener, upstream, up)
    }

    pub fn with_listener(listener: TcpListener, upstream: SocketAddr, up: bool) -> Proxy {
        let port = listener.local_addr().unwrap().port();
        let (tx, rx) = watch::channel(up);
        let connections = Arc::new(Mutex::new(Vec::new()));
        let registry = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    return;
                };
                if !*rx.borrow() {
                    drop(client); // cut: refuse by closing at once
                    continue;
                }
                let mut rx = rx.clone();
                let registry = registry.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (freeze, mut frozen) = watch::channel(false);
                    let port = server.local_addr().map(|a| a.port()).unwrap_or(0);
                    registry.lock().unwrap().push((port, freeze));
                    let (mut client, mut server) = (client, server);
                    let froze = tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => false,
                        _ = rx.wait_for(|up| !*up) => false,
                        _ = frozen.wait_for(|f| *f) => true,
                    };
                    if froze {
                        // Nothing passes either way, and both sockets stay
                        // open until the proxy is cut.
                        let _ = rx.wait_for(|up| !*up).await;
                    }
                });
            }
        });
        Proxy {
            port,
            up: Arc::new(tx),
            connections,
            task,
        }
    }

    /// Freezes the connection whose upstream side has local port
    /// `upstream_port` (the client port the server reports); false if there
    /// is none.
    pub fn freeze(&self, upstream_port: u16) -> bool {
        let connections = self.connections.lock().unwrap();
        match connections.iter().find(|(p, _)| *p == upstream_port) {
            Some((_, freeze)) => {
                freeze.send_replace(true);
                true
            }
            None => false,
        }
    }

    /// Freezes every connection forwarded so far; how many.
    pub fn freeze_all(&self) -> usize {
        let connections = self.connections.lock().unwrap();
        for (_, freeze) in connections.iter() {
            freeze.send_replace(true);
        }
        connections.len()
    }

    /// Drops every connection and refuses new ones.
    pub fn cut(&self) {
        self.up.send_replace(false);
    }

    pub fn restore(&self) {
        self.up.send_replace(true);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A Kafka-protocol broker of the test's own (tansu, in memory) behind a
/// [`Proxy`]: it advertises the proxy's port, so every client connection,
/// metadata-directed ones included, goes through the proxy.
pub struct PrivateKafka {
    pub proxy: Proxy,
    child: Child,
}

impl PrivateKafka {
    pub async fn start(up: bool) -> PrivateKafka {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let advertised = listener.local_addr().unwrap().port();
        let internal = crate::kit::free_port();
        let child = Command::new("tansu")
            .args(["broker", "--storage-engine", "memory://tansu/"])
            .args(["--listener-url", &format!("tcp://127.0.0.1:{internal}")])
            .args([
                "--advertised-listener-url",
                &format!("tcp://127.0.0.1:{advertised}"),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start tansu (is it installed? scripts/services.sh installs it)");
        let upstream: SocketAddr = format!("127.0.0.1:{internal}").parse().unwrap();
        super::wait_for(super::WAIT, "tansu to listen", || async move {
            TcpStream::connect(upstream).await.ok().map(|_| ())
        })
        .await;
        PrivateKafka {
            proxy: Proxy::with_listener(listener, upstream, up),
            child,
        }
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.proxy.port)
    }
}

impl Drop for PrivateKafka {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A broker reached through a proxy the test can cut.
pub struct CutBroker {
    proxy_of: ProxyOwner,
    pub inbox: super::brokers::Inbox,
    pub sink: String,
    _kafka: Option<super::brokers::KafkaTopics>,
    _rabbit: Option<super::brokers::RabbitExchange>,
}

enum ProxyOwner {
    Kafka(PrivateKafka),
    Rabbit(Proxy),
}

/// [`super::setup`] with the broker behind a proxy the test can cut.
pub async fn setup_cut(
    mode: super::Mode,
    kind: super::Kind,
    sets: &[(&str, &str)],
) -> (super::TestDb, CutBroker, String) {
    let broker = CutBroker::new(kind).await;
    let db = super::TestDb::new().await;
    let mut toml = super::with_mode(&super::base_toml(&db.url, &broker.sink), mode);
    for (k, v) in sets {
        toml = super::set(&toml, k, v);
    }
    db.migrate(&super::parse(&toml)).await;
    (db, broker, toml)
}

impl CutBroker {
    pub async fn new(kind: super::Kind) -> CutBroker {
        match kind {
            super::Kind::Kafka => {
                let k = PrivateKafka::start(true).await;
                let topics = super::brokers::KafkaTopics::with_brokers(&k.brokers());
                topics.create("order").await;
                CutBroker {
                    inbox: topics.inbox.clone(),
                    sink: topics.sink_toml(),
                    proxy_of: ProxyOwner::Kafka(k),
                    _kafka: Some(topics),
                    _rabbit: None,
                }
            }
            super::Kind::Rabbit => {
                let r = super::brokers::RabbitExchange::new().await;
                let proxy = Proxy::start("127.0.0.1:5672".parse().unwrap(), true).await;
                let sink = r
                    .sink_toml()
                    .replace("127.0.0.1:5672", &format!("127.0.0.1:{}", proxy.port));
                CutBroker {
                    inbox: r.inbox.clone(),
                    sink,
                    proxy_of: ProxyOwner::Rabbit(proxy),
                    _kafka: None,
                    _rabbit: Some(r),
                }
            }
        }
    }

    pub fn proxy(&self) -> &Proxy {
        match &self.proxy_of {
            ProxyOwner::Kafka(k) => &k.proxy,
            ProxyOwner::Rabbit(p) => p,
        }
    }
}
