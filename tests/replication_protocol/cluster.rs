//! The throwaway PostgreSQL cluster of this test binary, and its TLS certificates.
use openssl::asn1::Asn1Time;
use openssl::bn::BigNum;
use openssl::ec::{EcGroup, EcKey};
use openssl::hash::MessageDigest;
use openssl::nid::Nid;
use openssl::pkey::{PKey, Private};
use openssl::x509::extension::{BasicConstraints, ExtendedKeyUsage, SubjectAlternativeName};
use openssl::x509::{X509, X509NameBuilder};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::Instant;

pub const PLAIN_PASSWORD: &str = "plain-secret";
pub const MD5_PASSWORD: &str = "md5-secret";
pub const SCRAM_PASSWORD: &str = "scram-secret";

pub struct Cluster {
    pub port: u16,
    pub dir: PathBuf,
    /// Its stdin is the only write end of a pipe: when this process exits, the child reads
    /// end-of-file and stops the cluster.
    _watchdog: Child,
}

static CLUSTER: OnceLock<Cluster> = OnceLock::new();

pub fn cluster() -> &'static Cluster {
    CLUSTER.get_or_init(Cluster::start)
}

impl Cluster {
    /// `initdb` (as the `postgres` user when run as root, since initdb refuses root), then
    /// `pg_ctl start`, then the roles. About two seconds.
    fn start() -> Cluster {
        let started = Instant::now();
        let bindir = std::env::var("PG_BINDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|_| {
                PathBuf::from(output(Command::new("pg_config").arg("--bindir")).trim())
            });
        let dir = std::env::temp_dir().join(format!("outbox-relay-pgrepl-{}", std::process::id()));
        let data = dir.join("data");
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the cluster folder");
        write_certificates(&dir);
        let as_root = output(Command::new("id").arg("-u")).trim() == "0";
        if as_root {
            output(
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&dir),
            );
        }
        // Spawned first, so that a failed initdb or start still leaves no folder behind.
        let pg_ctl = bindir.join("pg_ctl");
        let watchdog = {
            use std::os::unix::process::CommandExt;
            let script = r#"trap '' INT TERM HUP; cat >/dev/null; "$0" -D "$1" -m fast -w stop; rm -rf "$2""#;
            as_owner(as_root, Path::new("sh"))
                .args(["-c".as_ref(), script.as_ref(), pg_ctl.as_os_str()])
                .args([data.as_os_str(), dir.as_os_str()])
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .expect("start the watchdog that stops the cluster")
        };
        output(as_owner(as_root, &bindir.join("initdb")).args([
            "-D".as_ref(),
            data.as_os_str(),
            "-U".as_ref(),
            "postgres".as_ref(),
            "-A".as_ref(),
            "trust".as_ref(),
            "-E".as_ref(),
            "UTF8".as_ref(),
            "--locale=C".as_ref(),
            "--no-sync".as_ref(),
        ]));
        std::fs::write(data.join("pg_hba.conf"), HBA).expect("write pg_hba.conf");
        let log = dir.join("server.log");
        let settings = data.join("postgresql.conf");
        let original = std::fs::read_to_string(&settings).expect("read postgresql.conf");
        // Test processes run side by side, each with a cluster: a port free a
        // moment ago may be taken by the time the server binds it; try another.
        let mut port = 0;
        for attempt in 1..=5 {
            port = free_port();
            std::fs::write(
                &settings,
                format!("{original}{}", server_settings(port, &dir)),
            )
            .expect("write postgresql.conf");
            let start = as_owner(as_root, &pg_ctl)
                .args([
                    "-D".as_ref(),
                    data.as_os_str(),
                    "-l".as_ref(),
                    log.as_os_str(),
                    "-w".as_ref(),
                    "-t".as_ref(),
                    "60".as_ref(),
                    "start".as_ref(),
                ])
                .status();
            if start.is_ok_and(|status| status.success()) {
                break;
            }
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            if attempt == 5 || !text.contains("Address already in use") {
                panic!("the test cluster did not start; its log:\n{text}");
            }
        }
        output(
            Command::new(bindir.join("psql"))
                .args([
                    "-X",
                    "-q",
                    "-v",
                    "ON_ERROR_STOP=1",
                    "-h",
                    "127.0.0.1",
                    "-U",
                    "postgres",
                ])
                .args([
                    "-p",
                    &port.to_string(),
                    "-d",
                    "postgres",
                    "-c",
                    &roles_sql(),
                ]),
        );
        eprintln!(
            "test cluster on port {port} in {dir:?}, ready in {:?}",
            started.elapsed()
        );
        Cluster {
            port,
            dir,
            _watchdog: watchdog,
        }
    }

    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    pub fn foreign_ca(&self) -> PathBuf {
        self.dir.join("foreign-ca.crt")
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

fn server_settings(port: u16, dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "\nport = {port}\nlisten_addresses = '127.0.0.1'\nunix_socket_directories = '{dir}'\n\
         wal_level = logical\nmax_wal_senders = 20\nmax_replication_slots = 20\n\
         wal_sender_timeout = '6s'\nfsync = off\nsynchronous_commit = off\n\
         ssl = on\nssl_cert_file = '{dir}/server.crt'\nssl_key_file = '{dir}/server.key'\n"
    )
}

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

fn as_owner(as_root: bool, program: &Path) -> Command {
    if as_root {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--"]).arg(program);
        command
    } else {
        Command::new(program)
    }
}

fn output(command: &mut Command) -> String {
    let out = command
        .output()
        .unwrap_or_else(|e| panic!("cannot run {command:?}: {e}"));
    assert!(
        out.status.success(),
        "{command:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Any free port.
fn free_port() -> u16 {
    let listener = TcpListener::bind(("127.0.0.1", 0))
        .or_else(|_| TcpListener::bind(("127.0.0.1", 0)))
        .expect("a free port");
    listener.local_addr().expect("local address").port()
}

fn key() -> PKey<Private> {
    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).expect("P-256");
    PKey::from_ec_key(EcKey::generate(&group).expect("EC key")).expect("key")
}

/// A certificate for `cn`, self-signed when `issuer` is `None`.
fn certificate(cn: &str, key: &PKey<Private>, issuer: Option<(&X509, &PKey<Private>)>) -> X509 {
    let mut name = X509NameBuilder::new().expect("name");
    name.append_entry_by_text("CN", cn).expect("CN");
    let name = name.build();
    let mut cert = X509::builder().expect("builder");
    cert.set_version(2).expect("v3");
    let serial = BigNum::from_u32(rand_serial()).and_then(|n| n.to_asn1_integer());
    cert.set_serial_number(&serial.expect("serial"))
        .expect("serial");
    cert.set_subject_name(&name).expect("subject");
    cert.set_pubkey(key).expect("public key");
    cert.set_not_before(&Asn1Time::days_from_now(0).expect("now"))
        .expect("not before");
    cert.set_not_after(&Asn1Time::days_from_now(30).expect("later"))
        .expect("not after");
    let (issuer_cert, signer) = match issuer {
        None => {
            cert.set_issuer_name(&name).expect("issuer");
            let ca = BasicConstraints::new().critical().ca().build().expect("ca");
            cert.append_extension(ca).expect("ca extension");
            (None, key)
        }
        Some((ca_cert, ca_key)) => {
            cert.set_issuer_name(ca_cert.subject_name())
                .expect("issuer");
            (Some(ca_cert), ca_key)
        }
    };
    if let Some(ca_cert) = issuer_cert {
        let san = SubjectAlternativeName::new()
            .dns("localhost")
            .ip("127.0.0.1")
            .build(&cert.x509v3_context(Some(ca_cert), None))
            .expect("subject alternative names");
        cert.append_extension(san).expect("san");
        let usage = ExtendedKeyUsage::new()
            .server_auth()
            .build()
            .expect("usage");
        cert.append_extension(usage).expect("usage extension");
    }
    cert.sign(signer, MessageDigest::sha256()).expect("sign");
    cert.build()
}

fn rand_serial() -> u32 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(1);
    nanos | 1
}

/// `ca.crt` signs `server.crt` (for 127.0.0.1 and localhost); `foreign-ca.crt` signs nothing.
fn write_certificates(dir: &Path) {
    let (ca_key, server_key) = (key(), key());
    let ca = certificate("outbox-relay test CA", &ca_key, None);
    let server = certificate("localhost", &server_key, Some((&ca, &ca_key)));
    let foreign = certificate("some other CA", &key(), None);
    let pem = |cert: &X509| cert.to_pem().expect("pem");
    std::fs::write(dir.join("ca.crt"), pem(&ca)).expect("write ca.crt");
    std::fs::write(dir.join("foreign-ca.crt"), pem(&foreign)).expect("write foreign-ca.crt");
    std::fs::write(dir.join("server.crt"), pem(&server)).expect("write server.crt");
    let key_path = dir.join("server.key");
    let key_pem = server_key.private_key_to_pem_pkcs8().expect("key pem");
    std::fs::write(&key_path, key_pem).expect("write server.key");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&key_path, std::fs::Permissions::from_mode(0o600))
        .expect("server.key must be private for PostgreSQL to use it");
}
