//! The readable form of a status snapshot, as `outbox-relay status` prints it.

use super::{AutoStatus, SlotStatus, Snapshot};

/// The backlog with `relay.mark = "none"`.
pub const UNMARKED: &str =
    "not known from the table (relay.mark = \"none\"): the slot's lag says how far behind";

/// A readable block for one snapshot.
pub fn render(s: &Snapshot) -> String {
    let mut out = format!(
        "pipeline {} ({} -> {}, table {})\n",
        s.pipeline, s.mode, s.sink, s.table
    );
    let mut line = |k: &str, v: String| out.push_str(&format!("  {k:<22} {v}\n"));
    let (owner_key, owner) = owner(s);
    line(owner_key, owner);
    line(
        "backlog",
        match (&s.backlog_error, s.backlog) {
            (Some(e), _) => e.clone(),
            (None, Some(n)) => format!("{n} unsent event(s)"),
            (None, None) => UNMARKED.into(),
        },
    );
    line("oldest unsent", oldest_unsent(s));
    let chosen = if s.marking_chosen_by_outbox {
        " (relay.mark is unset: the outbox chose)"
    } else {
        ""
    };
    line("marking", format!("{}{chosen}", s.marking));
    line(
        "dead letters",
        match (&s.dead_letters_error, s.dead_letters) {
            (Some(e), _) => e.clone(),
            (None, Some(n)) => format!("{n} open"),
            (None, None) => "dead-lettering off".into(),
        },
    );
    line(
        "last publish",
        s.last_publish.map_or("unknown".into(), |t| {
            t.format("%Y-%m-%d %H:%M:%S UTC").to_string()
        }),
    );
    if let Some(auto) = &s.auto {
        line("reading by", reading_by(auto));
    }
    if let Some(slot) = &s.slot {
        line("slot", slot_line(slot));
    }
    if let Some(f) = &s.frontier {
        let ago = |a: f64| humantime::format_duration(std::time::Duration::from_secs(a as u64));
        let age = match (f.folded_at, f.age_seconds) {
            (Some(_), Some(a)) => format!("moved {} ago", ago(a)),
            (None, Some(a)) => format!("never moved; the oldest batch waits {}", ago(a)),
            _ => "nothing recorded yet".into(),
        };
        line(
            "frontier",
            format!(
                "{age}, {} row(s) held open, {} batch(es) not folded yet",
                f.held_rows, f.progress_rows
            ),
        );
    }
    out
}

/// Who publishes: the shards owned, or the active instance.
fn owner(s: &Snapshot) -> (&'static str, String) {
    match (&s.active, s.shards_owned) {
        (_, Some((held, n))) => (
            "active shards",
            format!("{held} of {n} owned by running instances"),
        ),
        (Some(h), None) => (
            "active instance",
            format!(
                "pid {} ({}{})",
                h.pid,
                if h.application_name.is_empty() {
                    "?"
                } else {
                    &h.application_name
                },
                h.client_addr
                    .as_ref()
                    .map(|a| format!(" from {a}"))
                    .unwrap_or_default()
            ),
        ),
        (None, None) => ("active instance", "none: no relay holds this outbox".into()),
    }
}

fn oldest_unsent(s: &Snapshot) -> String {
    match s.oldest_unsent_age_seconds {
        Some(a) => {
            humantime::format_duration(std::time::Duration::from_secs(a as u64)).to_string()
                + " old"
        }
        None if s.backlog_error.is_some() => "unknown".into(),
        None if s.backlog.is_none_or(|n| n == 0) => "-".into(),
        None => "unknown (no created_at column, or NULL in the oldest row)".into(),
    }
}

fn reading_by(auto: &AutoStatus) -> String {
    match (auto.reading, &auto.blocked) {
        ("none", _) => "nothing: no instance is active".into(),
        ("cdc", _) => "cdc (the slot is streaming)".into(),
        (_, Some(blocked)) => format!("polling: CDC is not possible: {blocked}"),
        (_, None) => "polling; CDC is possible, the relay switches at its next probe".into(),
    }
}

fn slot_line(slot: &SlotStatus) -> String {
    if slot.exists {
        format!(
            "{}: {}, WAL {}, retains {}, {} behind",
            slot.name,
            if slot.streaming { "streaming" } else { "idle" },
            slot.wal_status.as_deref().unwrap_or("?"),
            crate::ops::mib(slot.retained_wal_bytes),
            crate::ops::mib(slot.confirmed_lag_bytes)
        )
    } else {
        format!("{} does not exist", slot.name)
    }
}
