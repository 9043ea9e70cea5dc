//! Signals: the first SIGTERM or SIGINT starts a graceful shutdown (stop
//! reading, send what was read, wait for the confirmations, record
//! progress); a second one exits at once, and so does a stop that
//! overruns `relay.shutdown_timeout` by more than [`STOP_GRACE`].

use std::time::Duration;
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Exit code after a second signal forced the exit.
pub const FORCED_EXIT: i32 = 130;

/// What a stop may take beyond `relay.shutdown_timeout` to record what was
/// confirmed, let the reader report its position, close the broker
/// connection, record the clean stop (5 s at most each) and flush traces
/// (2 s at most once the timeout has passed): more than those bounds add up
/// to, so that only a stop stuck where no bound applies (the final hand-over
/// to the acker, on a silent ownership session) meets it, and well before a
/// supervisor's grace of `relay.shutdown_timeout` plus this runs out.
pub const STOP_GRACE: Duration = Duration::from_secs(20);

/// Exit code of a stop that overran `relay.shutdown_timeout` plus
/// [`STOP_GRACE`]: a runtime failure.
pub const OVERRAN_EXIT: i32 = 1;

/// A token cancelled by the first SIGTERM/SIGINT. `stop_within` is the
/// longest `relay.shutdown_timeout` of the run's pipelines: once it and
/// [`STOP_GRACE`] have passed since the signal (or since the token was
/// cancelled otherwise), the process exits.
pub fn on_signals(stop_within: Duration) -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        // A stop the relay asks for itself (after a panic) is bounded too.
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
            _ = cancel.cancelled() => {}
        }
        cancel.cancel();
        let limit = stop_within + STOP_GRACE;
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
            _ = tokio::time::sleep(limit) => {
                // Nothing unconfirmed was marked: the next owner sends it
                // again, after waiting out this one's lease.
                tracing::error!(
                    "the stop did not end within relay.shutdown_timeout plus {}s: exiting; \
                     events not yet marked sent will be sent again by the next owner",
                    STOP_GRACE.as_secs()
                );
                std::process::exit(OVERRAN_EXIT);
            }
        }
        tracing::warn!("second signal: exiting without waiting for confirmations");
        std::process::exit(FORCED_EXIT);
    });
    Ok(token)
}
