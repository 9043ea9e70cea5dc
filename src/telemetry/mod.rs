//! Logging: text or JSON lines on stderr, filtered by `log.level` (or `RUST_LOG`).

use crate::config::{LogConfig, LogFormat};
use std::io::IsTerminal;
use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; a second call does nothing.
pub fn init(config: &LogConfig) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(&config.level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only on a terminal: not in files, journald or `docker logs`.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_target(false);
    let _ = match config.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
