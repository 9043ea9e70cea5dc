//! A PostgreSQL cluster of a test's own, for what the shared one must not
//! suffer: restarts, other `wal_level`s, lost slots, total idleness, or
//! authentication and TLS settings of its own.
//!
//! A watchdog child holds the only write end of a pipe to the test process:
//! however the test ends, the cluster is stopped and its folder removed.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub struct PrivatePg {
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
    _watchdog: Child,
}

/// `PG_BINDIR`, else the newest server under `/usr/lib/postgresql`.
fn pg_bin() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BINDIR") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql (or set PG_BINDIR)")
        .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("an initdb under /usr/lib/postgresql/*/bin")
}

fn as_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
        .unwrap_or(false)
}

/// `program` run as the cluster's owner (initdb and pg_ctl refuse root).
fn as_owner(program: &Path) -> Command {
    if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

/// Runs `cmd`; panics with its output unless it succeeds.
fn output(cmd: &mut Command) -> std::process::Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

impl PrivatePg {
    /// `initdb` and start, with extra `postgresql.conf` lines. About two seconds.
    pub fn start(conf: &[&str]) -> PrivatePg {
        Self::start_with(&[], conf)
    }

    /// As [`PrivatePg::start`], with extra `initdb` arguments.
    pub fn start_with(initdb: &[&str], conf: &[&str]) -> PrivatePg {
        let mut pg = Self::init(initdb);
        pg.launch(conf);
        pg
    }

    /// `initdb` only, so that a test can [`write`](PrivatePg::write) files
    /// (`pg_hba.conf`, certificates) before [`launch`](PrivatePg::launch).
    pub fn init(initdb: &[&str]) -> PrivatePg {
        let bin = pg_bin();
        let dir = std::env::temp_dir().join(crate::kit::unique("outbox-relay-pg-"));
        std::fs::create_dir_all(&dir).unwrap();
        if as_root() {
            output(Command::new("chown").arg("postgres").arg(&dir));
        }
        let data_s = dir.join("data").to_str().unwrap().to_owned();
        // The watchdog first: from here on, the folder goes when the test does.
        let mut watchdog = Command::new("sh")
            .arg("-c")
            .arg(format!(
                "trap '' INT TERM HUP; cat >/dev/null; {owner}{pg_ctl} -D {data_s} -m immediate stop >/dev/null 2>&1; rm -rf {dir}",
                owner = if as_root() { "runuser -u postgres -- " } else { "" },
                pg_ctl = bin.join("pg_ctl").display(),
                dir = dir.display()
            ))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("start the cluster watchdog");
        // Keep the pipe's write end open in this process only.
        let _ = watchdog.stdin.as_mut().map(|s| s.flush());
        let mut args = vec![
            "-D",
            &data_s,
            "-A",
            "trust",
            "-U",
            "postgres",
            "--no-sync",
            "-E",
            "UTF8",
        ];
        args.extend_from_slice(initdb);
        output(as_owner(&bin.join("initdb")).args(&args));
        PrivatePg {
            port: 0,
            dir,
            bin,
            _watchdog: watchdog,
        }
    }

    /// Starts the server on a free port with extra `postgresql.conf` lines
    /// (later lines win over the defaults here). Test processes run side by
    /// side, each with clusters: a port free a moment ago may be taken by the
    /// time the server binds it, so another is tried.
    pub fn launch(&mut self, conf: &[&str]) {
        let conf_path = self.dir.join("data").join("postgresql.conf");
        let original = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        for attempt in 1..=5 {
            self.port = crate::kit::free_port();
            let mut settings = format!(
                "{original}\nlisten_addresses = '127.0.0.1'\nport = {}\nunix_socket_directories = '{}'\nfsync = off\nmax_wal_senders = 10\nmax_replication_slots = 10\n",
                self.port,
                self.dir.display()
            );
            for line in conf {
                settings.push_str(line);
                settings.push('\n');
            }
            std::fs::write(&conf_path, settings).expect("write postgresql.conf");
            let started = self
                .pg_ctl_command(&["start", "-w", "-t", "60"])
                .status()
                .is_ok_and(|s| s.success());
            if started {
                return;
            }
            let log = std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            if attempt == 5 || !log.contains("Address already in use") {
                panic!("the private cluster did not start; its log:\n{log}");
            }
        }
    }

    fn pg_ctl_command(&self, args: &[&str]) -> Command {
        let data = self.dir.join("data");
        let log = self.dir.join("server.log");
        let mut cmd = as_owner(&self.bin.join("pg_ctl"));
        cmd.args(["-D", data.to_str().unwrap(), "-l", log.to_str().unwrap()])
            .args(args);
        cmd
    }

    /// The cluster's folder (its data directory is `data/` inside).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Writes `contents` to `relative` under the cluster's folder, private
    /// to the server's user (PostgreSQL refuses a readable key file).
    pub fn write(&self, relative: &str, contents: &[u8]) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.join(relative);
        std::fs::write(&path, contents).unwrap_or_else(|e| panic!("write {path:?}: {e}"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .unwrap_or_else(|e| panic!("make {path:?} private: {e}"));
        if as_root() {
            output(Command::new("chown").arg("postgres").arg(&path));
        }
        path
    }

    /// Runs `sql` as the superuser through `psql`, stopping at the first error.
    pub fn psql(&self, sql: &str) {
        output(
            Command::new(self.bin.join("psql"))
                .args(["-X", "-q", "-v", "ON_ERROR_STOP=1", "-U", "postgres"])
                .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
                .args(["-d", "postgres", "-c", sql]),
        );
    }

    /// A libpq key/value string over the Unix socket (trust even when TCP needs a password).
    pub fn socket_conninfo(&self, db: &str) -> String {
        format!(
            "host={} port={} user=postgres dbname={db}",
            self.dir.display(),
            self.port
        )
    }

    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// A fast shutdown and a start, as an operator or a crash-restart would.
    pub fn restart(&self) {
        output(&mut self.pg_ctl_command(&["restart", "-m", "fast", "-w", "-t", "60"]));
    }
}
