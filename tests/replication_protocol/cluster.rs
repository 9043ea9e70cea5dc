//! The throwaway PostgreSQL cluster of this test binary: the kit's private
//! cluster with logical replication, TLS signed by a CA made here, and one
//! role per authentication method.
use crate::kit::certs::Ca;
use crate::kit::cluster::PrivatePg;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Instant;

pub const PLAIN_PASSWORD: &str = "plain-secret";
pub const MD5_PASSWORD: &str = "md5-secret";
pub const SCRAM_PASSWORD: &str = "scram-secret";

pub struct Cluster {
    pub pg: PrivatePg,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();

/// The cluster, started by the first test that asks; it lives as long as the
/// process (the kit's watchdog stops it then).
pub fn cluster() -> &'static Cluster {
    CLUSTER.get_or_init(Cluster::start)
}

impl Cluster {
    fn start() -> Cluster {
        let started = Instant::now();
        let mut pg = PrivatePg::init(&["--locale=C"]);
        pg.write("data/pg_hba.conf", HBA.as_bytes());
        write_certificates(&pg);
        let dir = pg.dir().display().to_string();
        pg.launch(&[
            "wal_level = logical",
            "max_wal_senders = 20",
            "max_replication_slots = 20",
            "wal_sender_timeout = '6s'",
            "synchronous_commit = off",
            "ssl = on",
            &format!("ssl_cert_file = '{dir}/server.crt'"),
            &format!("ssl_key_file = '{dir}/server.key'"),
        ]);
        pg.psql(&roles_sql());
        eprintln!(
            "test cluster on port {} in {dir}, ready in {:?}",
            pg.port,
            started.elapsed()
        );
        Cluster { pg }
    }

    pub fn ca(&self) -> PathBuf {
        self.pg.dir().join("ca.crt")
    }

    pub fn foreign_ca(&self) -> PathBuf {
        self.pg.dir().join("foreign-ca.crt")
    }
}

const HBA: &str = "\
local   all all                          trust
hostssl all relay_tls_only 127.0.0.1/32  trust
host    all postgres       127.0.0.1/32  trust
host    all relay_trust    127.0.0.1/32  trust
host    all relay_plain    127.0.0.1/32  password
host    all relay_md5      127.0.0.1/32  md5
host    all relay_scram    127.0.0.1/32  scram-sha-256
";

fn roles_sql() -> String {
    format!(
        "CREATE ROLE relay_trust LOGIN REPLICATION;
         CREATE ROLE relay_tls_only LOGIN REPLICATION;
         CREATE ROLE relay_plain LOGIN REPLICATION PASSWORD '{PLAIN_PASSWORD}';
         SET password_encryption = 'md5';
         CREATE ROLE relay_md5 LOGIN REPLICATION PASSWORD '{MD5_PASSWORD}';
         SET password_encryption = 'scram-sha-256';
         CREATE ROLE relay_scram LOGIN REPLICATION PASSWORD '{SCRAM_PASSWORD}';"
    )
}

/// `ca.crt` signs `server.crt` (for 127.0.0.1 and localhost); `foreign-ca.crt` signs nothing.
fn write_certificates(pg: &PrivatePg) {
    let ca = Ca::new("outbox-relay test CA");
    let server = ca.server(&["localhost"], &["127.0.0.1"]);
    pg.write("ca.crt", &ca.cert_pem());
    pg.write("foreign-ca.crt", &Ca::new("some other CA").cert_pem());
    pg.write("server.crt", &server.cert_pem);
    pg.write("server.key", &server.key_pem);
}
