//! What a cleanup run did, and the line an operator reads.

use crate::config::TableName;
use std::fmt;
use std::time::Duration;

/// What a run did to one table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cleanup {
    /// Rows deleted (in a dry run: that would be), and the statements that
    /// deleted them.
    Done { rows: u64, batches: u64 },
    /// The table was left alone.
    Skipped(Skip),
}

impl Cleanup {
    /// Rows deleted (or, in a dry run, that would be); 0 when skipped.
    pub fn rows(&self) -> u64 {
        match self {
            Cleanup::Done { rows, .. } => *rows,
            Cleanup::Skipped(_) => 0,
        }
    }

    /// Statements that deleted rows; 0 when skipped.
    pub fn batches(&self) -> u64 {
        match self {
            Cleanup::Done { batches, .. } => *batches,
            Cleanup::Skipped(_) => 0,
        }
    }
}

/// Why a table was left alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skip {
    /// Another instance holds the retention lock and is cleaning.
    Busy,
    /// `relay.mark = "delete"`: rows are deleted as soon as they are confirmed.
    MarkDelete,
    /// `relay.mark = "none"`: rows are never marked, so none is known to be sent.
    MarkNone,
    /// `dead_letter.enabled = false`.
    DeadLettersOff,
    /// `retention.mode = "partitions"` on an outbox without a default
    /// partition: sent rows leave with their partition.
    ByPartition,
    /// The dead-letter table does not exist (nothing was ever dead-lettered
    /// into it, or `migrate` has not run).
    NoDeadLetterTable(TableName),
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Skip::Busy => f.write_str("another instance is cleaning"),
            Skip::MarkDelete => {
                f.write_str("relay.mark = \"delete\" deletes rows as soon as they are confirmed")
            }
            Skip::MarkNone => f.write_str(
                "relay.mark = \"none\" never marks rows sent, so none can be told apart",
            ),
            Skip::DeadLettersOff => f.write_str("dead_letter.enabled = false"),
            Skip::ByPartition => {
                f.write_str("retention.mode = \"partitions\" drops them with their partition")
            }
            Skip::NoDeadLetterTable(t) => write!(f, "table {t} does not exist"),
        }
    }
}

/// The outcome of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Report {
    pub dry_run: bool,
    /// Sent rows of the outbox.
    pub outbox: Cleanup,
    /// Redriven or dropped dead letters.
    pub dead_letters: Cleanup,
    /// Shutdown stopped the run between two batches; the rest waits for the next run.
    pub interrupted: bool,
    pub duration: Duration,
    pub sent_window: Duration,
    pub dead_letter_window: Duration,
    /// Something the operator should fix, such as a missing index.
    pub hint: Option<String>,
    /// Partitions created and dropped (`retention.mode = "partitions"`).
    pub partitions: Option<Partitions>,
}

/// What a run did to the outbox's partitions (in a dry run: would do).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Partitions {
    pub created: Vec<TableName>,
    pub dropped: Vec<TableName>,
    /// Partitions past the cutoff that stay, each with the reason.
    pub kept: Vec<(TableName, String)>,
    /// Partitions past the cutoff the server refused to drop, each with the
    /// error and what to do: they stay, and the run went on without them.
    pub failed: Vec<(TableName, String)>,
    /// Partitions that could not be created, each with what to do.
    pub problems: Vec<String>,
    /// How many of `problems` count as failures: all but the outbox being
    /// locked for a range not due within two `retention.interval`s (the
    /// next run retries it, as a matter of course).
    pub create_failures: usize,
}

impl Partitions {
    /// `partitions: created a, b; dropped c; kept d: it holds unsent rows`
    /// (`would create`, `would drop` in a dry run).
    pub fn describe(&self, dry_run: bool) -> String {
        let (create, drop, could) = if dry_run {
            ("would create", "would drop", "would")
        } else {
            ("created", "dropped", "could")
        };
        let list = |names: &[TableName]| {
            names
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        };
        let mut parts = Vec::new();
        if !self.created.is_empty() {
            parts.push(format!("{create} {}", list(&self.created)));
        }
        if !self.dropped.is_empty() {
            parts.push(format!("{drop} {}", list(&self.dropped)));
        }
        for (name, why) in &self.kept {
            parts.push(format!("kept {name}: {why}"));
        }
        for (name, why) in &self.failed {
            parts.push(format!("kept {name}, which {could} not be dropped: {why}"));
        }
        parts.extend(self.problems.iter().cloned());
        if parts.is_empty() {
            "partitions: nothing to do".into()
        } else {
            format!("partitions: {}", parts.join("; "))
        }
    }
}

impl Report {
    /// Nothing was done because another instance holds the retention lock.
    pub fn is_busy(&self) -> bool {
        self.outbox == Cleanup::Skipped(Skip::Busy)
    }
}

/// One line for operators, e.g. `deleted 12,345 sent rows older than 7d in 13
/// batches; 3 dead letters older than 30d; took 1.2s`.
impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_busy() {
            return write!(f, "skipped: {}", Skip::Busy);
        }
        let mut done = Vec::new();
        let mut notes = Vec::new();
        match &self.outbox {
            Cleanup::Done { rows, batches } => done.push(format!(
                "{} older than {} in {}",
                counted(*rows, "sent row", "sent rows"),
                compact(self.sent_window),
                counted(*batches, "batch", "batches")
            )),
            Cleanup::Skipped(why) => notes.push(format!("sent rows skipped: {why}")),
        }
        match &self.dead_letters {
            Cleanup::Done { rows, .. } => done.push(format!(
                "{} older than {}",
                counted(*rows, "dead letter", "dead letters"),
                compact(self.dead_letter_window)
            )),
            Cleanup::Skipped(why) => notes.push(format!("dead letters skipped: {why}")),
        }
        if done.is_empty() {
            f.write_str("nothing to clean")?;
        } else {
            let verb = if self.dry_run {
                "would delete"
            } else {
                "deleted"
            };
            write!(f, "{verb} {}", done.join("; "))?;
        }
        write!(f, "; took {}", took(self.duration))?;
        for note in notes {
            write!(f, "; {note}")?;
        }
        if self.interrupted {
            f.write_str("; stopped early by shutdown, the rest waits for the next run")?;
        }
        if let Some(p) = &self.partitions {
            write!(f, "; {}", p.describe(self.dry_run))?;
        }
        if let Some(hint) = &self.hint {
            write!(f, "; hint: {hint}")?;
        }
        Ok(())
    }
}

/// `1 batch`, `13 batches`, `12,345 sent rows`.
fn counted(n: u64, one: &str, many: &str) -> String {
    let digits = n.to_string();
    let mut grouped = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            grouped.push(',');
        }
        grouped.push(c);
    }
    format!("{grouped} {}", if n == 1 { one } else { many })
}

/// `7d`, `12h`, `30m`, `45s`, or humantime's form for anything else.
fn compact(d: Duration) -> String {
    let secs = d.as_secs();
    if d.subsec_nanos() != 0 || secs == 0 {
        return humantime::format_duration(d).to_string();
    }
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if secs.is_multiple_of(size) {
            return format!("{}{unit}", secs / size);
        }
    }
    format!("{secs}s")
}

/// `340ms` or `1.2s`.
fn took(d: Duration) -> String {
    if d < Duration::from_secs(1) {
        format!("{}ms", d.as_millis())
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(outbox: Cleanup, dead_letters: Cleanup, dry_run: bool) -> Report {
        Report {
            dry_run,
            outbox,
            dead_letters,
            interrupted: false,
            duration: Duration::from_millis(1234),
            sent_window: Duration::from_secs(7 * 86_400),
            dead_letter_window: Duration::from_secs(30 * 86_400),
            hint: None,
            partitions: None,
        }
    }

    #[test]
    fn summaries_read_well() {
        let r = report(
            Cleanup::Done {
                rows: 12_345,
                batches: 13,
            },
            Cleanup::Done {
                rows: 3,
                batches: 1,
            },
            false,
        );
        assert_eq!(
            r.to_string(),
            "deleted 12,345 sent rows older than 7d in 13 batches; 3 dead letters older than 30d; took 1.2s"
        );
        let r = report(
            Cleanup::Done {
                rows: 1,
                batches: 1,
            },
            Cleanup::Skipped(Skip::DeadLettersOff),
            true,
        );
        assert_eq!(
            r.to_string(),
            "would delete 1 sent row older than 7d in 1 batch; took 1.2s; dead letters skipped: dead_letter.enabled = false"
        );
        let r = report(
            Cleanup::Skipped(Skip::MarkDelete),
            Cleanup::Skipped(Skip::DeadLettersOff),
            false,
        );
        assert!(r.to_string().starts_with("nothing to clean; took"), "{r}");
        let r = report(
            Cleanup::Skipped(Skip::Busy),
            Cleanup::Skipped(Skip::Busy),
            false,
        );
        assert!(r.is_busy());
        assert_eq!(r.to_string(), "skipped: another instance is cleaning");
    }

    #[test]
    fn partition_work_is_listed() {
        let mut r = report(
            Cleanup::Skipped(Skip::ByPartition),
            Cleanup::Skipped(Skip::DeadLettersOff),
            true,
        );
        r.partitions = Some(Partitions {
            created: vec![TableName::new("public", "outbox_p20261202")],
            dropped: vec![TableName::new("public", "outbox_p20261120")],
            kept: vec![(
                TableName::new("public", "outbox_p20261121"),
                "it holds unsent rows".into(),
            )],
            failed: Vec::new(),
            problems: Vec::new(),
            create_failures: 0,
        });
        let shown = r.to_string();
        assert!(
            shown.contains(
                "partitions: would create public.outbox_p20261202; would drop public.outbox_p20261120; \
                 kept public.outbox_p20261121: it holds unsent rows"
            ),
            "{shown}"
        );
        r.dry_run = false;
        if let Some(p) = &mut r.partitions {
            p.failed.push((
                TableName::new("public", "outbox_hand_made"),
                "must be owner of table outbox_hand_made; ...".into(),
            ));
        }
        let shown = r.to_string();
        assert!(
            shown.contains(
                "kept public.outbox_hand_made, which could not be dropped: must be owner"
            ),
            "{shown}"
        );
    }

    #[test]
    fn numbers_and_durations_are_compact() {
        assert_eq!(counted(0, "row", "rows"), "0 rows");
        assert_eq!(counted(999, "row", "rows"), "999 rows");
        assert_eq!(counted(1_000, "row", "rows"), "1,000 rows");
        assert_eq!(counted(1_234_567, "row", "rows"), "1,234,567 rows");
        assert_eq!(compact(Duration::from_secs(86_400)), "1d");
        assert_eq!(compact(Duration::from_secs(7_200)), "2h");
        assert_eq!(compact(Duration::from_secs(90)), "90s");
        assert_eq!(compact(Duration::from_secs(120)), "2m");
        assert_eq!(compact(Duration::ZERO), "0s");
        assert_eq!(took(Duration::from_millis(340)), "340ms");
        assert_eq!(took(Duration::from_millis(1_240)), "1.2s");
    }
}
