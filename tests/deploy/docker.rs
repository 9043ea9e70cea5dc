//! The Dockerfile (linted by hadolint; no container engine runs here) and
//! `docker-compose.yml`, which must stay in step with the configurations it
//! mounts (`config/docker-*.toml`): host names, ports, credentials, the
//! topic and exchange its init containers create.

use super::*;
use outbox_relay::config::{self, SinkConfig};
use std::collections::HashMap;

#[test]
fn the_dockerfile_passes_hadolint() {
    let mut cmd = Command::new(tool("hadolint"));
    cmd.arg("--failure-threshold")
        .arg("style")
        .arg(root().join("Dockerfile"));
    let out = run(cmd);
    assert!(out.success, "hadolint finds problems:\n{}", out.text);
}

/// The compose file's services, with `<<: *anchor` merges applied.
fn compose_services() -> serde_json::Map<String, Value> {
    let docs = yaml_documents(&root().join("docker-compose.yml"));
    let services = docs[0]["services"]
        .as_object()
        .expect("docker-compose.yml has services")
        .clone();
    services
        .into_iter()
        .map(|(name, mut service)| {
            if let Some(Value::Object(base)) = service.as_object_mut().and_then(|s| s.remove("<<"))
            {
                let own = service.as_object_mut().unwrap();
                for (k, v) in base {
                    own.entry(k).or_insert(v);
                }
            }
            (name, service)
        })
        .collect()
}

fn env_of(service: &Value) -> HashMap<String, String> {
    service["environment"]
        .as_object()
        .map(|m| {
            m.iter()
                .map(|(k, v)| (k.clone(), v.as_str().map_or(v.to_string(), str::to_owned)))
                .collect()
        })
        .unwrap_or_default()
}

/// The command of an init container as one string.
fn command_text(service: &Value) -> String {
    match &service["command"] {
        Value::Array(parts) => parts
            .iter()
            .map(|p| p.as_str().unwrap_or_default())
            .collect::<Vec<_>>()
            .join(" "),
        other => other.as_str().unwrap_or_default().to_owned(),
    }
}

fn host_port(url: &url::Url) -> (String, u16) {
    (
        url.host_str().unwrap_or_default().to_owned(),
        url.port_or_known_default().unwrap_or_default(),
    )
}

#[test]
fn docker_compose_matches_the_configurations_it_mounts() {
    let services = compose_services();
    let service = |name: &str| {
        services
            .get(name)
            .unwrap_or_else(|| panic!("docker-compose.yml has no service {name:?}"))
    };
    let relay = service("relay");
    let relay_env = env_of(relay);
    let postgres_env = env_of(service("postgres"));

    // The mounted configuration: config/${RELAY_CONFIG:-docker-kafka.toml}.
    let mount = relay["volumes"][0]
        .as_str()
        .expect("the relay mounts its configuration");
    assert!(
        mount.starts_with(
            "./config/${RELAY_CONFIG:-docker-kafka.toml}:/etc/outbox-relay/relay.toml"
        ),
        "{mount}"
    );
    assert!(root().join("config/docker-kafka.toml").is_file());
    assert_eq!(
        relay["command"],
        Value::Null,
        "the relay runs the image's default command"
    );

    // CDC needs logical WAL, so either configuration can be switched to it.
    assert!(command_text(service("postgres")).contains("wal_level=logical"));

    // The relay drains for relay.shutdown_timeout on SIGTERM and exits at the
    // latest STOP_GRACE later: Docker must wait longer.
    let grace = relay["stop_grace_period"]
        .as_str()
        .and_then(|s| humantime::parse_duration(s).ok())
        .expect("the relay service sets stop_grace_period");

    let mut brokers_seen = Vec::new();
    for file in ["docker-kafka.toml", "docker-rabbitmq.toml"] {
        let text = read(&format!("config/{file}"));
        let envs: Vec<(String, String)> = relay_env.clone().into_iter().collect();
        relay_accepts(&text, &envs);
        let cfg = config::load_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"));
        let longest = cfg.relay.shutdown_timeout + outbox_relay::shutdown::STOP_GRACE;
        assert!(
            grace > longest,
            "{file}: stop_grace_period {grace:?} must exceed the longest stop {longest:?} (relay.shutdown_timeout {:?} and the grace after it)",
            cfg.relay.shutdown_timeout
        );

        // The database: the postgres service, its port, database and password.
        let db = url::Url::parse(cfg.database.url.expose()).unwrap();
        assert_eq!(host_port(&db), ("postgres".into(), 5432), "{file}");
        assert_eq!(
            db.path().trim_start_matches('/'),
            postgres_env["POSTGRES_DB"],
            "{file}: the database docker-compose.yml creates"
        );
        assert_eq!(
            relay_env.get("OUTBOX_RELAY__DATABASE__PASSWORD"),
            postgres_env.get("POSTGRES_PASSWORD"),
            "the relay's password is the postgres service's"
        );

        match &cfg.sink {
            SinkConfig::Kafka(k) => {
                let kafka_env = env_of(service("kafka"));
                let (host, port) = k.brokers.split_once(':').expect("host:port");
                assert_eq!(host, "kafka", "{file}");
                assert!(
                    kafka_env["KAFKA_ADVERTISED_LISTENERS"].contains(&format!("//kafka:{port}")),
                    "{file}: kafka does not advertise kafka:{port} to other containers"
                );
                assert!(kafka_env["KAFKA_LISTENERS"].contains(&format!(":{port}")));
                // kafka-init creates the topic of the demo's aggregate type.
                let topic = k.topic.as_str().replace("{aggregate_type}", "order");
                assert!(
                    command_text(service("kafka-init")).contains(&format!("--topic={topic}")),
                    "{file}: kafka-init must create {topic}"
                );
                brokers_seen.push("kafka");
            }
            SinkConfig::RabbitMq(r) => {
                let rabbit_env = env_of(service("rabbitmq"));
                let url = url::Url::parse(r.url.expose()).unwrap();
                assert_eq!(host_port(&url), ("rabbitmq".into(), 5672), "{file}");
                assert_eq!(
                    url.username(),
                    rabbit_env["RABBITMQ_DEFAULT_USER"],
                    "{file}"
                );
                assert_eq!(
                    url.password(),
                    Some(rabbit_env["RABBITMQ_DEFAULT_PASS"].as_str()),
                    "{file}"
                );
                let init = command_text(service("rabbitmq-init"));
                assert!(
                    init.contains(&format!("declare exchange name={} ", r.exchange.as_str())),
                    "{file}: rabbitmq-init must declare exchange {:?}",
                    r.exchange
                );
                assert!(
                    init.contains(&format!("declare binding source={} ", r.exchange.as_str())),
                    "{file}: a queue must be bound, or every message is unroutable"
                );
                brokers_seen.push("rabbitmq");
            }
        }
    }
    assert_eq!(brokers_seen, ["kafka", "rabbitmq"]);
}
