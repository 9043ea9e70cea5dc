//! The commands' reports on standard output.
//!
//! A reader that stops early (`outbox-relay status | head -3`) must not stop
//! the command: what it acts on is still done, and its exit code still says
//! how it went; only the rest of the report is dropped. Any other failure to
//! write (a full disk under a redirect) is kept, the rest of the report is
//! dropped, and the command fails once it has finished, so a cut-off report
//! never passes for a whole one.

use std::fmt;
use std::io::{self, Write};
use std::sync::Mutex;

/// `None` while the report is written; `Some(None)` once the reader has gone;
/// `Some(Some(e))` once a write failed otherwise.
static STOPPED: Mutex<Option<Option<io::Error>>> = Mutex::new(None);

/// Writes one line of the report, unless writing has already stopped.
pub fn line(args: fmt::Arguments<'_>) {
    let mut stopped = STOPPED.lock().unwrap_or_else(|e| e.into_inner());
    if stopped.is_some() {
        return;
    }
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        *stopped = Some((e.kind() != io::ErrorKind::BrokenPipe).then_some(e));
    }
}

/// Flushes the report and says why it could not be written whole, if it
/// could not and the reader did not simply stop reading.
pub fn finish() -> Option<io::Error> {
    let mut stopped = STOPPED.lock().unwrap_or_else(|e| e.into_inner());
    if stopped.is_none()
        && let Err(e) = io::stdout().flush()
    {
        *stopped = Some((e.kind() != io::ErrorKind::BrokenPipe).then_some(e));
    }
    stopped.as_mut().and_then(Option::take)
}

/// `println!` for reports: see the module's docs.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::ops::report::line(format_args!($($arg)*))
    };
}
pub(crate) use say;
