//! How busy the whole machine is, from `/proc/stat`.
//!
//! The services are shared: other users' builds and test suites can take
//! both cores for minutes. Each measurement first waits (bounded) for the
//! machine to be quiet, and records how busy it was while measuring, so a
//! noisy result can be recognised.

use std::time::{Duration, Instant};

/// Above this share of all cores, the machine is not quiet.
const QUIET: f64 = 0.35;

/// Cumulative CPU time of all cores, in clock ticks.
#[derive(Debug, Clone, Copy)]
pub struct CpuTimes {
    busy: u64,
    steal: u64,
    total: u64,
}

impl CpuTimes {
    pub fn now() -> Option<CpuTimes> {
        let stat = std::fs::read_to_string("/proc/stat").ok()?;
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let fields: Vec<u64> = line
            .split_whitespace()
            .filter_map(|f| f.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest time is inside user)
        let total: u64 = fields.iter().take(8).sum();
        let idle = fields.get(3)? + fields.get(4)?;
        Some(CpuTimes {
            busy: total - idle,
            steal: *fields.get(7)?,
            total,
        })
    }

    /// Share of all cores busy since `self` (0 to 1).
    pub fn busy_since(&self) -> Option<f64> {
        self.shares_since().map(|(busy, _)| busy)
    }

    /// Shares of all cores' time since `self` (0 to 1): busy, and the part
    /// of it the hypervisor gave to other guests (steal). On a shared host
    /// steal makes a slow day look like a slow relay.
    pub fn shares_since(&self) -> Option<(f64, f64)> {
        let now = CpuTimes::now()?;
        let total = now.total.checked_sub(self.total)?;
        let share = |part: u64| part as f64 / total as f64;
        (total > 0).then(|| (share(now.busy - self.busy), share(now.steal - self.steal)))
    }
}

/// Resident memory of the processes named `comm` (as in `/proc/<pid>/comm`),
/// summed, in MiB; `None` when none runs. A broker that keeps every message
/// in memory grows over a long invocation and slows the machine with it.
pub fn resident_mib(comm: &str) -> Option<f64> {
    let mut total_kib = None;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let dir = entry.path();
        let comm_of = std::fs::read_to_string(dir.join("comm"));
        if !comm_of.is_ok_and(|c| c.trim_end() == comm) {
            continue;
        }
        let Ok(status) = std::fs::read_to_string(dir.join("status")) else {
            continue;
        };
        let kib = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
        if let Some(kib) = kib {
            *total_kib.get_or_insert(0) += kib;
        }
    }
    total_kib.map(|k| k as f64 / 1024.0)
}

/// Waits until the machine was quiet for a whole second, at most `limit`;
/// returns the time waited and the last second's busy share.
pub async fn wait_quiet(limit: Duration) -> (Duration, Option<f64>) {
    let start = Instant::now();
    loop {
        let Some(before) = CpuTimes::now() else {
            return (start.elapsed(), None);
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let busy = before.busy_since();
        if busy.is_none_or(|b| b < QUIET) || start.elapsed() >= limit {
            return (start.elapsed(), busy);
        }
    }
}
