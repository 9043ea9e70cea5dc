//! Stopping a process with SIGSTOP for a while: what it was sent meanwhile
//! waits unread in its sockets.

use std::process::Command;
use std::time::Duration;

/// A process stopped with SIGSTOP until [`Paused::resume`], or until dropped
/// (so a failing test leaves nothing stopped behind).
pub struct Paused(Option<u32>);

fn signal(pid: u32, name: &str) {
    let ok = Command::new("kill")
        .args([&format!("-{name}"), &pid.to_string()])
        .status()
        .is_ok_and(|s| s.success());
    assert!(ok, "kill -{name} {pid}");
}

/// Whether every thread of `pid` is stopped by a signal (state `T`).
fn all_threads_stopped(pid: u32) -> bool {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return false;
    };
    tasks.flatten().all(|task| {
        let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
        // `tid (comm) state ...`: the name may hold spaces and parentheses.
        stat.rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            == Some("T")
    })
}

impl Paused {
    /// Returns once every thread has stopped. `kill` returns earlier: the
    /// kernel wakes one thread to take the stop, and until it runs (later,
    /// on a loaded machine) the other threads go on running.
    pub fn pause(pid: u32) -> Paused {
        signal(pid, "STOP");
        let paused = Paused(Some(pid));
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while !all_threads_stopped(pid) {
            assert!(
                std::time::Instant::now() < until,
                "process {pid} did not stop within 10 s of SIGSTOP"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        paused
    }

    pub fn resume(mut self) {
        if let Some(pid) = self.0.take() {
            signal(pid, "CONT");
        }
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            let _ = Command::new("kill")
                .args(["-CONT", &pid.to_string()])
                .status();
        }
    }
}
