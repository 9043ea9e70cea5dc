//! CPU time of the PostgreSQL server processes that serve the relay.
//!
//! Every measurement has a database of its own, and every session the
//! benchmark opens carries `application_name = outbox-relay-bench`. So the
//! server processes working for the relay are those of the benchmark's
//! database with another `application_name`: its ordinary sessions (reading,
//! marking, the sampler), their parallel workers and, in CDC mode, the WAL
//! sender decoding for its slot. Autovacuum workers on the benchmark's
//! database are counted apart: they clean up after the marking, but their
//! timing is the server's choice. Processes shared by the whole cluster (WAL
//! writer, checkpointer, background writer) serve every user of the shared
//! server and are not counted.
//!
//! A sampler lists those processes in `pg_stat_activity` every 200 ms and
//! reads user + system time from `/proc/<pid>/stat` (the server must run on
//! this machine). A process already running when the window opens counts
//! from there; one that appears later counts from its start; one that ends
//! between two samples loses up to 200 ms of its time (the relay keeps its
//! sessions open, so this concerns autovacuum workers mostly).

use crate::infra::{BENCH_APPLICATION, Services, connect};
use anyhow::Result;
use serde::Serialize;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_postgres::Client;

const EVERY: Duration = Duration::from_millis(200);

/// CPU seconds of the relay's server processes within a window.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct PgCpuTotals {
    /// Ordinary sessions (and their parallel workers).
    pub backends_s: f64,
    /// The WAL sender of the relay's replication connection (CDC).
    pub walsender_s: f64,
    /// Autovacuum workers on the benchmark's database.
    pub autovacuum_s: f64,
    /// Server processes seen.
    pub processes: usize,
}

impl PgCpuTotals {
    /// Sessions and WAL sender: what the relay's own work costs the server.
    pub fn relay_s(&self) -> f64 {
        self.backends_s + self.walsender_s
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Backend,
    Walsender,
    Autovacuum,
}

struct Seen {
    kind: Kind,
    /// Start time (clock ticks after boot), against pid reuse.
    start: u64,
    first: f64,
    last: f64,
}

struct Inner {
    client: Client,
    database: String,
    seen: Mutex<HashMap<u32, Seen>>,
    /// Whether a sample found a server process on this machine at all.
    local: Mutex<bool>,
}

/// The sampler of one window; stops when dropped.
pub struct PgCpu {
    inner: Arc<Inner>,
    task: tokio::task::JoinHandle<()>,
}

impl PgCpu {
    /// Opens the window: what the relay's server processes have used so far is the baseline.
    pub async fn start(services: &Services, database: &str) -> Result<PgCpu> {
        let client = connect(&services.pg_admin).await?;
        let inner = Arc::new(Inner {
            client,
            database: database.to_owned(),
            seen: Mutex::default(),
            local: Mutex::new(false),
        });
        inner.sample(true).await;
        let looping = inner.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(EVERY).await;
                looping.sample(false).await;
            }
        });
        Ok(PgCpu { inner, task })
    }

    /// CPU used since the window opened, sampled now; `None` when the
    /// server's processes are not visible from here.
    pub async fn totals(&self) -> Option<PgCpuTotals> {
        self.inner.sample(false).await;
        if !*self.inner.local.lock().unwrap() {
            return None;
        }
        let seen = self.inner.seen.lock().unwrap();
        let mut t = PgCpuTotals {
            processes: seen.len(),
            ..Default::default()
        };
        for s in seen.values() {
            let used = (s.last - s.first).max(0.0);
            match s.kind {
                Kind::Backend => t.backends_s += used,
                Kind::Walsender => t.walsender_s += used,
                Kind::Autovacuum => t.autovacuum_s += used,
            }
        }
        Some(t)
    }
}

impl Drop for PgCpu {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Inner {
    async fn sample(&self, baseline: bool) {
        let rows = self
            .client
            .query(
                "SELECT pid, backend_type FROM pg_stat_activity
                 WHERE datname = $1 AND coalesce(application_name, '') <> $2
                   AND backend_type IN ('client backend', 'parallel worker', 'walsender', 'autovacuum worker')",
                &[&self.database, &BENCH_APPLICATION],
            )
            .await
            .unwrap_or_default();
        let listed: Vec<(u32, Kind)> = rows
            .iter()
            .map(|r| {
                let kind = match r.get::<_, &str>(1) {
                    "walsender" => Kind::Walsender,
                    "autovacuum worker" => Kind::Autovacuum,
                    _ => Kind::Backend,
                };
                (r.get::<_, i32>(0) as u32, kind)
            })
            .collect();
        let mut seen = self.seen.lock().unwrap();
        // Known processes first (a session that ended keeps its last reading).
        for (pid, s) in seen.iter_mut() {
            if let Some((start, cpu)) = proc_stat(*pid)
                && start == s.start
            {
                s.last = cpu;
            }
        }
        for (pid, kind) in listed {
            let Some((start, cpu)) = proc_stat(pid) else {
                continue;
            };
            *self.local.lock().unwrap() = true;
            let fresh = seen.get(&pid).is_none_or(|s| s.start != start);
            if fresh {
                seen.insert(
                    pid,
                    Seen {
                        kind,
                        start,
                        // Running when the window opened: count from there; later: from its start.
                        first: if baseline { cpu } else { 0.0 },
                        last: cpu,
                    },
                );
            }
        }
    }
}

/// Start time (ticks after boot) and user + system CPU seconds of a PostgreSQL process.
fn proc_stat(pid: u32) -> Option<(u64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    if !stat[open + 1..close].starts_with("postgres") {
        return None;
    }
    let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    let start: u64 = fields.get(19)?.parse().ok()?;
    Some((start, (utime + stime) / crate::process::clock_ticks()))
}
