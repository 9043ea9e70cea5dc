//! The test kit shared by the integration-test binaries (`tests/relay`,
//! `tests/replication_protocol`), the benchmark (`benches/relay`) and the
//! `tail` example: a throwaway PostgreSQL cluster, a throwaway certificate
//! authority, consumers' ways with both brokers, free ports and unique names.
//!
//! Each includes it with `#[path = ".../kit/mod.rs"] mod kit;`, so the kit
//! is compiled once per binary and nothing here is duplicated in them.
#![allow(
    dead_code,
    reason = "each test binary includes the whole kit and uses a different part of it"
)]

pub mod certs;
pub mod cluster;
pub mod consumers;

/// A short random name for per-test objects (databases, slots, topics, folders).
pub fn unique(prefix: &str) -> String {
    format!(
        "{prefix}{}",
        &uuid::Uuid::new_v4().simple().to_string()[..12]
    )
}

/// A port nothing listens on at the moment of the call. Tests run side by
/// side, so whoever binds it later may lose the race and should retry.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .expect("a free port on 127.0.0.1")
        .port()
}
