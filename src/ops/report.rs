//! The commands' reports on standard output, and their complaints on
//! standard error.
//!
//! A reader that stops early (`outbox-relay status | head -3`) must not stop
//! the command: what it acts on is still done, and its exit code still says
//! how it went; only the rest of the report is dropped. Any other failure to
//! write the report (a full disk under a redirect) is kept, the rest of the
//! report is dropped, and the command fails once it has finished, so a
//! cut-off report never passes for a whole one. A complaint that cannot be
//! written is dropped: the exit code still tells.

use std::fmt;
use std::io::{self, Write};
use std::sync::Mutex;

/// How writing the report has gone so far.
enum Writing {
    Going,
    /// The reader went away: the rest is dropped, and that is no failure.
    ReaderGone,
    /// Writing failed otherwise; taken by [`finish`].
    Failed(io::Error),
    /// [`finish`] took the failure.
    Reported,
}

static WRITING: Mutex<Writing> = Mutex::new(Writing::Going);

fn stopped_by(e: io::Error) -> Writing {
    match e.kind() {
        io::ErrorKind::BrokenPipe | io::ErrorKind::ConnectionReset => Writing::ReaderGone,
        _ => Writing::Failed(e),
    }
}

/// Writes one line of the report, unless writing has already stopped.
pub fn line(args: fmt::Arguments<'_>) {
    let mut writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    if !matches!(*writing, Writing::Going) {
        return;
    }
    let mut out = io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.write_all(b"\n")) {
        *writing = stopped_by(e);
    }
}

/// Writes one line to standard error, and drops it if it cannot.
pub fn complaint(args: fmt::Arguments<'_>) {
    let mut err = io::stderr().lock();
    let _ = err.write_fmt(args).and_then(|()| err.write_all(b"\n"));
}

/// Flushes the report; returns why it could not be written whole, unless
/// the reader simply stopped reading.
pub fn finish() -> Option<io::Error> {
    let mut writing = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    if matches!(*writing, Writing::Going)
        && let Err(e) = io::stdout().flush()
    {
        *writing = stopped_by(e);
    }
    match std::mem::replace(&mut *writing, Writing::Reported) {
        Writing::Failed(e) => Some(e),
        other => {
            *writing = other;
            None
        }
    }
}

/// `println!` for reports: see the module's docs.
macro_rules! say {
    ($($arg:tt)*) => {
        $crate::ops::report::line(format_args!($($arg)*))
    };
}
pub(crate) use say;

/// `eprintln!` that never panics: see the module's docs.
macro_rules! complain {
    ($($arg:tt)*) => {
        $crate::ops::report::complaint(format_args!($($arg)*))
    };
}
pub(crate) use complain;
