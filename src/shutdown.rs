//! Signals: the first SIGTERM or SIGINT starts a graceful shutdown (stop
//! reading, send what was read, wait for the confirmations, record
//! progress); a second one exits at once.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

/// Exit code after a second signal forced the exit.
pub const FORCED_EXIT: i32 = 130;

/// A token cancelled by the first SIGTERM/SIGINT.
pub fn on_signals() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM received"),
            _ = int.recv() => tracing::info!("SIGINT received"),
        }
        cancel.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::warn!("second signal: exiting without waiting for confirmations");
        std::process::exit(FORCED_EXIT);
    });
    Ok(token)
}
