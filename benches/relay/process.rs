//! The relay under test: the release binary as a child process with a config
//! file in a temporary directory, and what `/proc` says about its cost.

use crate::infra::Services;
use crate::options::{BrokerKind, Mode};
use crate::workload::AGGREGATE_TYPE;
use anyhow::{Context, Result, anyhow};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime};

/// The binary cargo built for this benchmark (the release profile, `target/release/outbox-relay`).
pub fn binary() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_outbox-relay"))
}

/// Where one scenario's relay publishes.
pub struct Target<'a> {
    pub mode: Mode,
    pub broker: BrokerKind,
    pub db_url: &'a str,
    /// Kafka topic prefix, or RabbitMQ exchange name.
    pub destination: &'a str,
    /// The CDC slot (cluster-wide, so unique per scenario).
    pub slot: &'a str,
}

/// The relay's configuration: the documented defaults, except what places
/// it (database, destination, slot), JSON logs for counting problems, and
/// `relay.mark` pinned to `update` (a new outbox would choose ranges);
/// `--marks` overrides it through the environment.
pub fn config_toml(services: &Services, t: &Target) -> String {
    let source = match t.mode {
        Mode::Polling => "[source]\nmode = \"polling\"\n".to_owned(),
        Mode::Cdc => format!(
            "[source]\nmode = \"cdc\"\n\n[source.cdc]\nslot = \"{}\"\n",
            t.slot
        ),
    };
    let sink = match t.broker {
        BrokerKind::Kafka => format!(
            "[sink]\ntype = \"kafka\"\nbrokers = \"{}\"\ntopic = \"{}.{{aggregate_type}}\"\n",
            services.kafka, t.destination
        ),
        BrokerKind::Rabbitmq => format!(
            "[sink]\ntype = \"rabbitmq\"\nurl = \"{}\"\nexchange = \"{}\"\n",
            services.amqp, t.destination
        ),
    };
    format!(
        "[database]\nurl = \"{}\"\n\n{source}\n[relay]\nmark = \"update\"\n\n[log]\nformat = \"json\"\nlevel = \"info\"\n\n{sink}",
        t.db_url
    )
}

/// The Kafka topic the relay publishes to for a destination prefix.
pub fn kafka_topic(prefix: &str) -> String {
    format!("{prefix}.{AGGREGATE_TYPE}")
}

/// A scratch directory with the config file; removed on drop unless kept.
pub struct Workdir {
    pub path: PathBuf,
    pub keep: bool,
}

impl Workdir {
    pub fn new(config: &str) -> Result<Workdir> {
        let path = std::env::temp_dir().join(crate::kit::unique("outbox-relay-bench-"));
        std::fs::create_dir_all(&path)?;
        std::fs::write(path.join("relay.toml"), config)?;
        Ok(Workdir { path, keep: false })
    }

    pub fn config(&self) -> PathBuf {
        self.path.join("relay.toml")
    }

    pub fn log(&self) -> PathBuf {
        self.path.join("relay.log")
    }
}

impl Drop for Workdir {
    fn drop(&mut self) {
        if self.keep {
            eprintln!("bench: relay log kept in {}", self.path.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The relay binary with only the benchmark's configuration overrides: none
/// inherited from the caller's environment.
fn relay_command(env: &[(String, String)]) -> Command {
    let mut cmd = Command::new(binary());
    for (name, _) in std::env::vars() {
        if name.starts_with("OUTBOX_RELAY_") || name == "RUST_LOG" {
            cmd.env_remove(name);
        }
    }
    cmd.envs(env.iter().map(|(k, v)| (k, v)));
    cmd
}

/// `outbox-relay migrate`: the table, index, trigger (polling) or publication and slot (CDC).
pub async fn migrate(dir: &Workdir, env: &[(String, String)]) -> Result<()> {
    let mut child = relay_command(env)
        .args(["migrate", "--config"])
        .arg(dir.config())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting outbox-relay migrate")?;
    let started = Instant::now();
    loop {
        if let Some(status) = child.try_wait()? {
            if status.success() {
                return Ok(());
            }
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            return Err(anyhow!("outbox-relay migrate failed ({status}): {err}"));
        }
        if started.elapsed() > crate::infra::STEP {
            let _ = child.kill();
            let _ = child.wait();
            return Err(anyhow!("outbox-relay migrate did not finish within 30s"));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A running relay; killed when dropped.
pub struct RelayProcess {
    child: Child,
    log: PathBuf,
    /// Wall-clock time of the spawn, comparable with server timestamps.
    pub spawned_at: SystemTime,
}

impl RelayProcess {
    pub fn spawn(dir: &Workdir, env: &[(String, String)]) -> Result<RelayProcess> {
        let log = std::fs::File::create(dir.log())?;
        let spawned_at = SystemTime::now();
        let child = relay_command(env)
            .args(["run", "--config"])
            .arg(dir.config())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting outbox-relay run")?;
        Ok(RelayProcess {
            child,
            log: dir.log(),
            spawned_at,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `Some` once the process has exited (it never should by itself).
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The relay must still run: an error naming its exit status otherwise.
    pub fn ensure_running(&mut self) -> Result<()> {
        match self.exited() {
            Some(status) => Err(anyhow!("the relay exited ({status}); see its log")),
            None => Ok(()),
        }
    }

    /// User + system CPU seconds so far.
    pub fn cpu_seconds(&self) -> Option<f64> {
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).ok()?;
        // Fields after the command name, which is in parentheses and may hold spaces.
        let rest = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let utime: f64 = fields.get(11)?.parse().ok()?;
        let stime: f64 = fields.get(12)?.parse().ok()?;
        Some((utime + stime) / clock_ticks())
    }

    /// Peak resident set size so far (VmHWM), in MiB.
    pub fn peak_rss_mib(&self) -> Option<f64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid())).ok()?;
        let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
        let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kib / 1024.0)
    }

    /// Waits until the relay has used less than 5% of a core for a second
    /// (e.g. the CDC stream has skipped what the start-up read covered), at
    /// most `limit`; returns how long that took.
    pub async fn settle(&mut self, limit: Duration) -> Result<Duration> {
        let start = Instant::now();
        let mut last = self.cpu_seconds().unwrap_or_default();
        while start.elapsed() < limit {
            tokio::time::sleep(Duration::from_secs(1)).await;
            self.ensure_running()?;
            let now = self.cpu_seconds().unwrap_or_default();
            if now - last < 0.05 {
                return Ok(start.elapsed());
            }
            last = now;
        }
        Err(anyhow!(
            "the relay was still busy after {}s",
            limit.as_secs()
        ))
    }

    /// SIGTERM, then a bounded wait for the graceful exit (SIGKILL after it).
    pub async fn stop(&mut self) -> Result<ExitStatus> {
        if let Some(status) = self.exited() {
            return Ok(status);
        }
        let _ = Command::new("kill")
            .args(["-TERM", &self.pid().to_string()])
            .status();
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(40) {
            if let Some(status) = self.exited() {
                return Ok(status);
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.kill();
        Err(anyhow!(
            "the relay did not exit within 40s of SIGTERM; killed"
        ))
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Warnings and errors in the relay's JSON log.
    pub fn problems(&self) -> (usize, usize) {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let count = |level: &str| {
            let needle = format!("\"level\":\"{level}\"");
            text.lines().filter(|l| l.contains(&needle)).count()
        };
        (count("WARN"), count("ERROR"))
    }

    /// The first error (or warning) line of the log, for the report.
    pub fn first_problem(&self) -> Option<String> {
        let text = std::fs::read_to_string(&self.log).ok()?;
        let pick = |level: &str| {
            let needle = format!("\"level\":\"{level}\"");
            text.lines()
                .find(|l| l.contains(&needle))
                .map(str::to_owned)
        };
        pick("ERROR").or_else(|| pick("WARN"))
    }
}

impl Drop for RelayProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Clock ticks per second for `/proc/<pid>/stat` (`getconf CLK_TCK`, normally 100).
pub fn clock_ticks() -> f64 {
    static TICKS: OnceLock<f64> = OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(100.0)
    })
}

/// Microseconds since the Unix epoch.
pub fn epoch_micros(t: SystemTime) -> i64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_micros() as i64)
        .unwrap_or_default()
}

/// `perf record` of the relay (call graphs) and of the whole machine while
/// one measurement runs; stopped with SIGINT so the files are complete.
pub struct Perf {
    children: Vec<Child>,
}

impl Perf {
    /// Starts recording into `dir/<label>.relay.data` and `dir/<label>.system.data`.
    pub fn start(dir: &Path, label: &str, pid: u32) -> Result<Perf> {
        std::fs::create_dir_all(dir)?;
        let record = |args: &[&str], file: PathBuf| {
            Command::new("perf")
                .args(["record", "-e", "cpu-clock", "-F", "499", "-o"])
                .arg(file)
                .args(args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .context("starting perf record (apt-get install linux-perf)")
        };
        let pid = pid.to_string();
        let relay = record(
            &["--call-graph", "dwarf,16384", "-p", &pid],
            dir.join(format!("{label}.relay.data")),
        )?;
        let system = record(&["-a"], dir.join(format!("{label}.system.data")))?;
        Ok(Perf {
            children: vec![relay, system],
        })
    }

    /// Stops recording; waits (bounded) for perf to write its files.
    pub async fn stop(mut self) {
        for child in &self.children {
            let _ = Command::new("kill")
                .args(["-INT", &child.id().to_string()])
                .status();
        }
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(60) {
            if self
                .children
                .iter_mut()
                .all(|c| c.try_wait().ok().flatten().is_some())
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Perf {
    fn drop(&mut self) {
        for child in &mut self.children {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
