//! Which time ranges the outbox's partitions hold, and which they should:
//! the arithmetic of partition retention, free of the database.
//!
//! A range the relay wants may already be held in part: by partitions made
//! by hand (bounds at local midnight, say) or made under another
//! `retention.partition_interval` (switching from `6h` to `1d` at 10:00
//! leaves `6h` partitions up to 06:00 the next day). The relay then creates
//! only the parts no partition holds, each ending where an existing one
//! begins, so no partition it creates overlaps another (PostgreSQL refuses
//! that) and no instant of the wanted ranges is left without a partition
//! (an insert there fails, or lands in the default partition).

use super::Partition;
use chrono::{DateTime, TimeZone, Utc};
use std::time::Duration;

/// A half-open time range `[from, to)`.
pub type Range = (DateTime<Utc>, DateTime<Utc>);

/// The ranges that should exist: the one holding `now` and `premake` after
/// it, each `interval` long and aligned to the Unix epoch.
pub fn wanted(now: DateTime<Utc>, interval: Duration, premake: u32) -> Vec<Range> {
    let step = interval.as_secs().max(60) as i64;
    let first = now.timestamp().div_euclid(step) * step;
    (0..=i64::from(premake))
        .filter_map(|k| {
            let from = Utc.timestamp_opt(first + k * step, 0).single()?;
            let to = Utc.timestamp_opt(first + (k + 1) * step, 0).single()?;
            Some((from, to))
        })
        .collect()
}

/// The parts of the wanted ranges that no partition holds, in order: what
/// to create. The default partition holds nothing here: it takes only rows
/// no other partition does, and a range created later is refused while it
/// holds rows of it.
pub fn missing(wanted: &[Range], existing: &[Partition]) -> Vec<Range> {
    wanted
        .iter()
        .flat_map(|&range| uncovered(range, existing))
        .collect()
}

/// The parts of `[now, end of the ranges made ahead)` no partition holds:
/// an insert there finds no partition (or lands in the default one).
pub fn gaps_ahead(
    now: DateTime<Utc>,
    interval: Duration,
    premake: u32,
    existing: &[Partition],
) -> Vec<Range> {
    match wanted(now, interval, premake).last() {
        Some(&(_, end)) if now < end => uncovered((now, end), existing),
        _ => Vec::new(),
    }
}

/// Where the gaps [`gaps_ahead`] found are, for an operator; `None` when
/// there are none.
pub fn describe_gaps(now: DateTime<Utc>, gaps: &[Range]) -> Option<String> {
    let &(from, to) = gaps.first()?;
    let at = |t: DateTime<Utc>| t.format("%Y-%m-%d %H:%M:%SZ");
    let more = match gaps.len() {
        1 => String::new(),
        n => format!(" (and {} more gaps)", n - 1),
    };
    Some(if from <= now {
        format!(
            "no partition holds the current time ({} to {}){more}",
            at(now),
            at(to)
        )
    } else {
        format!(
            "no partition holds {} to {}{more}, within the ranges made ahead",
            at(from),
            at(to)
        )
    })
}

/// The parts of `range` outside every partition but the default one.
fn uncovered((from, to): Range, existing: &[Partition]) -> Vec<Range> {
    // PostgreSQL keeps partitions from overlapping each other: sorted by
    // their lower bound (unbounded first), each one that overlaps `range`
    // takes the next piece of it.
    let mut held: Vec<&Partition> = existing
        .iter()
        .filter(|p| {
            !p.default
                && p.lower.is_none_or(|lower| lower < to)
                && p.upper.is_none_or(|upper| upper > from)
        })
        .collect();
    held.sort_by_key(|p| p.lower);
    let mut gaps = Vec::new();
    let mut at = from;
    for p in held {
        if let Some(lower) = p.lower
            && lower > at
        {
            gaps.push((at, lower));
        }
        match p.upper {
            Some(upper) => at = at.max(upper),
            None => return gaps,
        }
        if at >= to {
            return gaps;
        }
    }
    gaps.push((at, to));
    gaps
}

/// The partitions whose whole range ends at or before `cutoff` (`now() -
/// retention.sent_window`) and at least one `interval` before `now`: a
/// transaction shorter than `interval` that began before a range's end (its
/// `now()` falls there) and inserts a while later still finds its
/// partition, however short the window.
pub fn expired(
    partitions: &[Partition],
    now: DateTime<Utc>,
    cutoff: DateTime<Utc>,
    interval: Duration,
) -> Vec<&Partition> {
    let margin = chrono::Duration::from_std(interval).unwrap_or(chrono::Duration::MAX);
    let before = now
        .checked_sub_signed(margin)
        .map_or(cutoff, |m| m.min(cutoff));
    partitions
        .iter()
        .filter(|p| !p.default && p.upper.is_some_and(|upper| upper <= before))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TableName;

    fn at(s: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(s).unwrap().with_timezone(&Utc)
    }

    fn day(d: u32, hour: u32) -> DateTime<Utc> {
        at(&format!("2026-12-{d:02}T{hour:02}:00:00Z"))
    }

    fn part(name: &str, lower: Option<&str>, upper: Option<&str>) -> Partition {
        Partition {
            name: TableName::new("public", name),
            lower: lower.map(at),
            upper: upper.map(at),
            default: false,
        }
    }

    fn hours(name: &str, lower: DateTime<Utc>, upper: DateTime<Utc>) -> Partition {
        Partition {
            name: TableName::new("public", name),
            lower: Some(lower),
            upper: Some(upper),
            default: false,
        }
    }

    fn default_partition() -> Partition {
        Partition {
            default: true,
            ..part("outbox_default", None, None)
        }
    }

    const DAY: Duration = Duration::from_secs(86_400);
    const SIX_HOURS: Duration = Duration::from_secs(6 * 3600);

    #[test]
    fn ranges_are_aligned_and_made_ahead() {
        let w = wanted(at("2026-12-01T15:30:00Z"), DAY, 2);
        assert_eq!(
            w,
            vec![
                (day(1, 0), day(2, 0)),
                (day(2, 0), day(3, 0)),
                (day(3, 0), day(4, 0)),
            ]
        );
        let w = wanted(at("2026-12-01T15:30:00Z"), Duration::from_secs(3600), 1);
        assert_eq!(w[0].0, day(1, 15));
        assert_eq!(w[1].1, day(1, 17));
    }

    #[test]
    fn ranges_an_existing_partition_holds_wholly_are_not_made() {
        let w = wanted(at("2026-12-01T15:30:00Z"), DAY, 3);
        let existing = vec![
            // made by hand, a whole month: holds the first two days wanted
            part(
                "outbox_dec",
                Some("2026-11-15T00:00:00Z"),
                Some("2026-12-03T00:00:00Z"),
            ),
            default_partition(),
        ];
        assert_eq!(
            missing(&w, &existing),
            vec![(day(3, 0), day(4, 0)), (day(4, 0), day(5, 0))]
        );
    }

    /// Switching `partition_interval` from 6h to 1d at 10:00 on Dec 1: the
    /// 6h partitions (made from midnight on, 3 ahead) reach 06:00 on Dec 2,
    /// and the rest of Dec 2 is made.
    #[test]
    fn an_interval_switch_makes_the_rest_of_a_range_partly_held() {
        let now = day(1, 10);
        let six_hourly: Vec<Partition> = wanted(day(1, 0), SIX_HOURS, 4)
            .into_iter()
            .map(|(from, to)| hours("outbox_6h", from, to))
            .collect();
        assert_eq!(six_hourly.last().unwrap().upper, Some(day(2, 6)));
        assert_eq!(
            missing(&wanted(now, DAY, 2), &six_hourly),
            vec![(day(2, 6), day(3, 0)), (day(3, 0), day(4, 0))]
        );
    }

    /// Partitions made by hand from local midnight (05:00 UTC): the wanted
    /// UTC days are made up to where they begin and from where they end.
    #[test]
    fn parts_held_at_either_end_leave_the_middle_or_the_ends() {
        let local_days = vec![
            hours("outbox_local_1130", at("2026-11-30T05:00:00Z"), day(1, 5)),
            hours("outbox_local_1201", day(1, 5), day(2, 5)),
        ];
        // Held at the start of Dec 2 (until 05:00): the rest is made.
        assert_eq!(
            missing(&[(day(2, 0), day(3, 0))], &local_days),
            vec![(day(2, 5), day(3, 0))]
        );
        // Held at the end of a range only: the start is made.
        let late = vec![hours("outbox_late", day(3, 18), day(4, 6))];
        assert_eq!(
            missing(&[(day(3, 0), day(4, 0))], &late),
            vec![(day(3, 0), day(3, 18))]
        );
        // Held at both ends: the hole in the middle is made.
        let ends = vec![
            hours("outbox_am", day(5, 0), day(5, 6)),
            hours("outbox_pm", day(5, 18), day(6, 0)),
        ];
        assert_eq!(
            missing(&[(day(5, 0), day(6, 0))], &ends),
            vec![(day(5, 6), day(5, 18))]
        );
        // Held in the middle: both ends are made, in order.
        let middle = vec![hours("outbox_noon", day(7, 11), day(7, 13))];
        assert_eq!(
            missing(&[(day(7, 0), day(8, 0))], &middle),
            vec![(day(7, 0), day(7, 11)), (day(7, 13), day(8, 0))]
        );
        // Adjacent partitions leave no gap between them.
        let halves = vec![
            hours("outbox_b", day(9, 12), day(10, 0)),
            hours("outbox_a", day(9, 0), day(9, 12)),
        ];
        assert!(missing(&[(day(9, 0), day(10, 0))], &halves).is_empty());
    }

    #[test]
    fn unbounded_and_default_partitions() {
        let w = wanted(at("2026-12-01T15:30:00Z"), DAY, 3);
        // MAXVALUE holds everything after its start.
        let open = vec![part("outbox_rest", Some("2026-12-02T12:00:00Z"), None)];
        assert_eq!(
            missing(&w, &open),
            vec![(day(1, 0), day(2, 0)), (day(2, 0), day(2, 12))]
        );
        // MINVALUE holds everything before its end.
        let past = vec![part("outbox_past", None, Some("2026-12-02T12:00:00Z"))];
        assert_eq!(
            missing(&w, &past),
            vec![
                (day(2, 12), day(3, 0)),
                (day(3, 0), day(4, 0)),
                (day(4, 0), day(5, 0))
            ]
        );
        let all = vec![part("outbox_all", None, None)];
        assert!(missing(&w, &all).is_empty());
        // The default partition holds no range of its own.
        assert_eq!(missing(&w, &[default_partition()]), w);
    }

    #[test]
    fn gaps_ahead_start_at_now_and_end_with_the_ranges_made_ahead() {
        let now = day(1, 10);
        // Held until 06:00 today, not at 10:00: the current time is in a gap.
        let early = vec![hours("outbox_early", day(1, 0), day(1, 6))];
        let gaps = gaps_ahead(now, DAY, 1, &early);
        assert_eq!(gaps, vec![(now, day(3, 0))]);
        let said = describe_gaps(now, &gaps).unwrap();
        assert!(
            said.contains("no partition holds the current time"),
            "{said}"
        );
        // Held now, but not through the ranges made ahead.
        let six_hourly = vec![hours("outbox_6h", day(1, 6), day(2, 6))];
        let gaps = gaps_ahead(now, DAY, 2, &six_hourly);
        assert_eq!(gaps, vec![(day(2, 6), day(4, 0))]);
        let said = describe_gaps(now, &gaps).unwrap();
        assert!(
            said.contains("2026-12-02 06:00:00Z to 2026-12-04 00:00:00Z"),
            "{said}"
        );
        // The part of the current range before now does not matter.
        let from_now = vec![hours("outbox_now", day(1, 9), day(4, 0))];
        assert!(gaps_ahead(now, DAY, 2, &from_now).is_empty());
        assert_eq!(describe_gaps(now, &[]), None);
        // The default partition takes rows, but holds no range.
        assert_eq!(gaps_ahead(now, DAY, 0, &[default_partition()]).len(), 1);
    }

    #[test]
    fn only_ranges_wholly_before_the_cutoff_expire() {
        let parts = vec![
            part(
                "a",
                Some("2026-11-20T00:00:00Z"),
                Some("2026-11-21T00:00:00Z"),
            ),
            part(
                "b",
                Some("2026-11-21T00:00:00Z"),
                Some("2026-11-22T00:00:00Z"),
            ),
            part("old", None, Some("2026-01-01T00:00:00Z")),
            part("open", Some("2026-11-22T00:00:00Z"), None),
            default_partition(),
        ];
        let day = Duration::from_secs(86_400);
        let later = at("2026-12-01T00:00:00Z");
        let names: Vec<&str> = expired(&parts, later, at("2026-11-21T12:00:00Z"), day)
            .iter()
            .map(|p| p.name.name.as_str())
            .collect();
        assert_eq!(names, ["a", "old"]);
        // A range ending exactly at the cutoff is wholly before it.
        assert_eq!(
            expired(&parts, later, at("2026-11-22T00:00:00Z"), day).len(),
            3
        );
        // With no window, a range that ended less than an interval ago stays.
        let now = at("2026-11-21T06:00:00Z");
        let names: Vec<&str> = expired(&parts, now, now, day)
            .iter()
            .map(|p| p.name.name.as_str())
            .collect();
        assert_eq!(names, ["old"], "a ended 6 h ago");
        let names: Vec<&str> = expired(&parts, now + chrono::Duration::days(1), now, day)
            .iter()
            .map(|p| p.name.name.as_str())
            .collect();
        assert_eq!(names, ["a", "old"], "a day after its end");
    }
}
