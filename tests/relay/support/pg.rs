//! A PostgreSQL cluster of a test's own, for what the shared one must not
//! suffer: restarts, other `wal_level`s, lost slots, total idleness.
//!
//! A watchdog child holds the only write end of a pipe to the test process:
//! however the test ends, the cluster is stopped and its folder removed.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

pub struct PrivatePg {
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
    _watchdog: Child,
}

fn pg_bin() -> PathBuf {
    if let Ok(dir) = std::env::var("PG_BINDIR") {
        return PathBuf::from(dir);
    }
    let mut versions: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL server binaries under /usr/lib/postgresql")
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

/// Runs a server binary as its owner (initdb and pg_ctl refuse root).
fn run_as_owner(program: &Path, args: &[&str]) -> std::process::Output {
    let mut cmd = if as_root() {
        let mut c = Command::new("runuser");
        c.args(["-u", "postgres", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    };
    let out = cmd.args(args).output().expect("run a PostgreSQL binary");
    assert!(
        out.status.success(),
        "{} {args:?} failed: {}{}",
        program.display(),
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
        let bin = pg_bin();
        let port = super::proxy::free_port();
        let dir = std::env::temp_dir().join(super::unique("outbox-relay-pg-"));
        std::fs::create_dir_all(&dir).unwrap();
        if as_root() {
            let ok = Command::new("chown")
                .args(["postgres"])
                .arg(&dir)
                .status()
                .unwrap();
            assert!(ok.success());
        }
        let data = dir.join("data");
        let data_s = data.to_str().unwrap().to_owned();
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
        run_as_owner(&bin.join("initdb"), &args);
        let mut settings = format!(
            "listen_addresses = '127.0.0.1'\nport = {port}\nunix_socket_directories = '{}'\nfsync = off\nmax_wal_senders = 10\nmax_replication_slots = 10\n",
            dir.display()
        );
        for line in conf {
            settings.push_str(line);
            settings.push('\n');
        }
        let conf_path = data.join("postgresql.conf");
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(&conf_path)
            .unwrap();
        f.write_all(settings.as_bytes()).unwrap();
        let pg = PrivatePg {
            port,
            dir,
            bin,
            _watchdog: watchdog,
        };
        pg.pg_ctl(&["start", "-w", "-t", "60"]);
        pg
    }

    fn pg_ctl(&self, args: &[&str]) {
        let data = self.dir.join("data");
        let log = self.dir.join("server.log");
        let mut all = vec!["-D", data.to_str().unwrap(), "-l", log.to_str().unwrap()];
        all.extend_from_slice(args);
        run_as_owner(&self.bin.join("pg_ctl"), &all);
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
        self.pg_ctl(&["restart", "-m", "fast", "-w", "-t", "60"]);
    }
}

use std::os::unix::process::CommandExt;
