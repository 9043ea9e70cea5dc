//! The relay under test: in the test process, as a child process, or as a
//! command run to completion.

use super::{WAIT, relay_bin, unique, wait_for};
use crate::support::brokers::Inbox;
use outbox_relay::config::Config;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// A relay running inside the test process.
pub struct InProcess {
    pub shutdown: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl InProcess {
    pub fn start(config: Config) -> InProcess {
        // The relay's own log, when debugging a test.
        if std::env::var("OUTBOX_RELAY_TEST_LOG").is_ok() {
            outbox_relay::telemetry::init(&config.log);
        }
        let shutdown = CancellationToken::new();
        let token = shutdown.clone();
        // As `run` does: with relay.mark unset, the outbox chooses first.
        let task = tokio::spawn(async move {
            let config = outbox_relay::ops::marking::chosen(&config)
                .await
                .expect("the outbox's marking can be read");
            outbox_relay::relay::run(&config, token).await
        });
        InProcess { shutdown, task }
    }

    /// Graceful stop; panics if it takes longer than `WAIT`.
    pub async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("relay stops within the wait")
            .expect("relay task did not panic");
    }

    /// Drops the relay abruptly (no drain): the in-process stand-in for a crash.
    pub fn abort(self) {
        self.task.abort();
    }
}

/// The relay binary as a child process, for tests that kill it.
pub struct ChildRelay {
    child: Child,
    /// Its log so far, when started with [`ChildRelay::start_logged`].
    log: Option<Arc<Mutex<String>>>,
}

impl ChildRelay {
    pub fn start(config_toml: &str) -> ChildRelay {
        Self::start_with_env(config_toml, &[])
    }

    /// The relay serving its HTTP endpoints on a free port, which it returns.
    pub fn serving(config_toml: &str) -> (ChildRelay, u16) {
        let port = crate::kit::free_port();
        (Self::start(&super::with_http(config_toml, port)), port)
    }

    pub fn start_with_env(config_toml: &str, envs: &[(&str, &str)]) -> ChildRelay {
        let child = Self::spawn(config_toml, envs, Stdio::inherit());
        ChildRelay { child, log: None }
    }

    /// As [`ChildRelay::start`], with its log sent to `stderr`.
    pub fn start_into(config_toml: &str, stderr: Stdio) -> ChildRelay {
        let child = Self::spawn(config_toml, &[], stderr);
        ChildRelay { child, log: None }
    }

    /// As [`ChildRelay::start`], keeping its log for [`ChildRelay::logged`]
    /// (and passing it on to the test's output).
    pub fn start_logged(config_toml: &str) -> ChildRelay {
        let mut child = Self::spawn(config_toml, &[], Stdio::piped());
        let log = Arc::new(Mutex::new(String::new()));
        let (stderr, kept) = (child.stderr.take(), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr.expect("piped stderr")).lines() {
                let Ok(line) = line else { return };
                eprintln!("{line}");
                let mut kept = kept.lock().unwrap_or_else(|e| e.into_inner());
                kept.push_str(&line);
                kept.push('\n');
            }
        });
        ChildRelay {
            child,
            log: Some(log),
        }
    }

    fn spawn(config_toml: &str, envs: &[(&str, &str)], stderr: Stdio) -> Child {
        let dir = std::env::temp_dir().join(unique("outbox-relay-test-"));
        std::fs::create_dir_all(&dir).unwrap();
        let config_path = dir.join("relay.toml");
        std::fs::write(&config_path, config_toml).unwrap();
        Command::new(relay_bin())
            .args(["run", "--config"])
            .arg(&config_path)
            .env("RUST_LOG", "outbox_relay=info,warn")
            .envs(envs.iter().copied())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start outbox-relay")
    }

    /// Whether a relay started with [`ChildRelay::start_logged`] logged
    /// `text` so far.
    pub fn logged(&self, text: &str) -> bool {
        self.log_count(text) > 0
    }

    /// How many times a relay started with [`ChildRelay::start_logged`]
    /// logged `text` so far.
    pub fn log_count(&self, text: &str) -> usize {
        let log = self.log.as_ref().expect("started with start_logged");
        log.lock()
            .unwrap_or_else(|e| e.into_inner())
            .matches(text)
            .count()
    }

    /// Waits for the process to exit by itself; `None` if it is still running after `limit`.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        exit_within(&mut self.child, limit)
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits for the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        terminate(&mut self.child)
    }
}

impl Drop for ChildRelay {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Sends SIGTERM to a relay process and waits for its exit status; kills it
/// and panics if it is still running after [`WAIT`].
pub fn terminate(child: &mut Child) -> ExitStatus {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    exit_within(child, WAIT).unwrap_or_else(|| {
        let _ = child.kill();
        let _ = child.wait();
        panic!("the relay did not exit within {WAIT:?} of SIGTERM");
    })
}

/// The exit status of `child` once it exits by itself; `None` if it is
/// still running after `limit`.
fn exit_within(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    None
}

/// The line of `check`'s output (`out`) for `what` ("[mark] what ..."),
/// empty when there is none.
pub fn check_line(out: &str, what: &str) -> String {
    out.lines()
        .find(|l| l.get(7..).is_some_and(|rest| rest.starts_with(what)))
        .unwrap_or_default()
        .to_owned()
}

/// Runs `outbox-relay <args>` to completion; asserts it exits with `code`
/// and that its stdout holds each of `says`. Returns stdout.
pub fn cli_says(args: &[&str], code: i32, says: &[&str]) -> String {
    cli_expect(args, code, says, |(out, _)| out)
}

/// Runs `outbox-relay <args>` to completion; asserts it exits with `code`
/// and that its stderr holds each of `complains`. Returns stderr.
pub fn cli_complains(args: &[&str], code: i32, complains: &[&str]) -> String {
    cli_expect(args, code, complains, |(_, err)| err)
}

/// What [`cli_says`] and [`cli_complains`] share: `stream` picks stdout or stderr.
fn cli_expect(
    args: &[&str],
    code: i32,
    fragments: &[&str],
    stream: fn((String, String)) -> String,
) -> String {
    let (got, out, err) = run_cli(args, &[]);
    assert_eq!(got, code, "{out}{err}");
    let text = stream((out, err));
    for fragment in fragments {
        assert!(text.contains(fragment), "{fragment:?} in:\n{text}");
    }
    text
}

/// Runs the binary to completion with arguments; returns (exit code, stdout, stderr).
pub fn run_cli(args: &[&str], envs: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(relay_bin());
    cmd.args(args);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run outbox-relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs the binary to completion with its standard output and error sent
/// to `stdout` and `stderr` (a closed pipe, `/dev/full`); returns (exit
/// code, standard error when `stderr` is `Stdio::piped()`).
pub fn run_cli_into(args: &[&str], stdout: Stdio, stderr: Stdio) -> (i32, String) {
    let out = Command::new(relay_bin())
        .args(args)
        .stdout(stdout)
        .stderr(stderr)
        .output()
        .expect("run outbox-relay");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Starts the relay `kills` times, each time killing it (SIGKILL) once it
/// published `per_run` more messages: crashes while busy.
pub async fn kill_while_busy(toml: &str, inbox: &Inbox, kills: usize, per_run: usize) {
    kill_while_busy_with_env(toml, &[], inbox, kills, per_run).await
}

/// [`kill_while_busy`] with the relay's environment extended by `envs`.
pub async fn kill_while_busy_with_env(
    toml: &str,
    envs: &[(&str, &str)],
    inbox: &Inbox,
    kills: usize,
    per_run: usize,
) {
    for _ in 0..kills {
        let mut child = ChildRelay::start_with_env(toml, envs);
        let before = inbox.len();
        wait_for(WAIT, "the relay to publish", || async {
            (inbox.len() >= before + per_run).then_some(())
        })
        .await;
        child.kill();
    }
}
