//! Each message as a block of text: where it was found, its key,
//! properties and headers, and its body (JSON laid out, text as it is).

use crate::Limits;
use crate::kit::consumers::Received;
use anyhow::{Context, Result, bail};
use futures::{Stream, StreamExt};
use serde::de::IgnoredAny;
use std::io::Write as _;
use std::pin::pin;
use std::process::ExitCode;
use tokio::time::Instant;

/// Prints messages until `--count` is reached, `--timeout` passes without a
/// message, or Ctrl-C.
pub async fn print_messages(
    messages: impl Stream<Item = Result<Received>>,
    limits: &Limits,
) -> Result<ExitCode> {
    let mut messages = pin!(messages);
    let mut interrupted = pin!(tokio::signal::ctrl_c());
    let mut received: u64 = 0;
    let mut deadline = Instant::now() + limits.timeout;
    let of_count = |n: u64| match limits.count {
        Some(c) => format!("{n} of {c}"),
        None => n.to_string(),
    };
    if limits.count == Some(0) {
        return Ok(ExitCode::SUCCESS);
    }
    loop {
        tokio::select! {
            biased;
            // 1. Ctrl-C ends the wait at once.
            _ = &mut interrupted => {
                eprintln!("tail: interrupted after {} message(s)", of_count(received));
                return Ok(ExitCode::from(130));
            }
            // 2. The next message, or its absence for `--timeout`.
            next = tokio::time::timeout_at(deadline, messages.next()) => match next {
                Err(_) => {
                    bail!(
                        "timed out: no message for {} (received {})",
                        humantime::format_duration(limits.timeout),
                        of_count(received)
                    );
                }
                Ok(None) => bail!("the broker ended the consumer (received {})", of_count(received)),
                // Connection trouble is reported and retried by the client; the
                // timeout still bounds the wait.
                Ok(Some(Err(e))) => eprintln!("tail: warning: {}", crate::report(&e)),
                Ok(Some(Ok(shown))) => {
                    received += 1;
                    match print_one(received, &shown) {
                        Ok(()) => {}
                        // The reader went away (`tail ... | head`): nothing left to do.
                        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                            return Ok(ExitCode::SUCCESS);
                        }
                        Err(e) => return Err(e).context("writing to stdout"),
                    }
                    if limits.count.is_some_and(|c| received >= c) {
                        return Ok(ExitCode::SUCCESS);
                    }
                    deadline = Instant::now() + limits.timeout;
                }
            },
        }
    }
}

fn print_one(n: u64, m: &Received) -> std::io::Result<()> {
    const INDENT: &str = "             ";
    let mut out = format!("── message {n} ── {}\n", m.destination);
    if let Some(key) = &m.key {
        out.push_str(&format!("key:         {key}\n"));
    }
    for (i, (k, v)) in m.properties.iter().enumerate() {
        let label = if i == 0 { "properties:  " } else { INDENT };
        out.push_str(&format!("{label}{k}: {v}\n"));
    }
    if m.headers.is_empty() {
        out.push_str("headers:     (none)\n");
    }
    for (i, (k, v)) in m.headers.iter().enumerate() {
        let label = if i == 0 { "headers:     " } else { INDENT };
        out.push_str(&format!("{label}{k}: {v}\n"));
    }
    out.push_str("body:\n");
    out.push_str(&body_text(&m.body));
    out.push('\n');
    // One write per message, so blocks stay whole when stdout is a pipe.
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(out.as_bytes())?;
    stdout.flush()
}

/// The body indented when it is JSON, as text when it is UTF-8, and as a size
/// otherwise.
fn body_text(body: &[u8]) -> String {
    if body.is_empty() {
        return "(empty)\n".into();
    }
    let Ok(text) = std::str::from_utf8(body) else {
        return format!("({} bytes, not UTF-8)\n", body.len());
    };
    if serde_json::from_str::<IgnoredAny>(text).is_ok() {
        return indent_json(text) + "\n";
    }
    if text.ends_with('\n') {
        text.to_owned()
    } else {
        format!("{text}\n")
    }
}

/// Lays out valid JSON text two spaces per level. It works on the text rather
/// than on a parsed `serde_json::Value` so that keys keep their order and
/// numbers their exact digits (a `Value` sorts keys and rounds numbers past
/// 64 bits).
fn indent_json(json: &str) -> String {
    fn newline(out: &mut String, depth: usize) {
        out.push('\n');
        out.push_str(&"  ".repeat(depth));
    }
    let mut out = String::with_capacity(json.len() * 2);
    let mut depth = 0usize;
    let (mut in_string, mut escaped) = (false, false);
    let mut chars = json.chars().peekable();
    while let Some(c) = chars.next() {
        if in_string {
            out.push(c);
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_string = true;
                out.push(c);
            }
            '{' | '[' => {
                out.push(c);
                while chars.next_if(char::is_ascii_whitespace).is_some() {}
                // An empty object or array stays on one line.
                if let Some(close) = chars.next_if(|&c| c == '}' || c == ']') {
                    out.push(close);
                } else {
                    depth += 1;
                    newline(&mut out, depth);
                }
            }
            '}' | ']' => {
                depth = depth.saturating_sub(1);
                newline(&mut out, depth);
                out.push(c);
            }
            ',' => {
                out.push(c);
                newline(&mut out, depth);
            }
            ':' => out.push_str(": "),
            c if c.is_ascii_whitespace() => {}
            c => out.push(c),
        }
    }
    out
}
