//! The pipeline simulation: the real supervisor, pipeline, scheduler, CDC
//! reader and ackers, driven over an in-memory database and broker through
//! thousands of seeded schedules of writers, refusals, nacks, lost
//! connections, connections the broker drops, broker pauses, out-of-order
//! confirmations, crashes at any await point, terminated ownership sessions
//! (a zombie owner next to a new one, a statement that took effect but
//! whose answer was lost), statements slower than the ownership lease,
//! replication connections dropped in the middle of a transaction,
//! database restarts that take the slot back to its last saved position,
//! start-up reads without a settled WAL position, graceful hand-overs, and
//! operators redriving and dropping dead letters. A quarter of the
//! schedules record sent rows by ranges (`relay.mark = "ranges"`): the
//! readers ask the predicate, and every instance folds (`fold.rs`, a
//! double of the fold's two steps over `world/ranges.rs`), crashing and
//! losing its connection between any two statements; a third of those
//! start with `update` and switch to ranges while running (`upgrade.rs`).
//!
//! Each schedule runs on a single-threaded runtime with tokio's paused
//! clock, so a seed replays the same schedule:
//! `OUTBOX_RELAY_SIM_SEED=<seed> cargo nextest run sim::`. The suite runs
//! `OUTBOX_RELAY_SIM_SEEDS` schedules (defaults below) from
//! `OUTBOX_RELAY_SIM_BASE` (default 0) in each of its two tests: one of
//! every kind of fault, one of hand-overs during broker pauses
//! ([`params::Focus`]); a longer hunt is just a larger count.
//!
//! After every schedule the checks in [`check`] must hold: no loss, nothing
//! rolled back published, per-aggregate order of first deliveries, rows
//! marked and WAL acknowledged only after the broker confirmed (with
//! ranges, after every fold round: no row counts as sent unless the broker
//! confirmed it or it was dead-lettered, and no sent row counts as unsent
//! again), no
//! publishing by an old owner once a new one published, no old owner's
//! message landing after a new owner's of the same key, duplicates within
//! the window per incident and none from a clean stop beyond what only the
//! WAL records and the slot could not be told, dead letters only for
//! events the broker refused `max_attempts` times (or that follow such a
//! letter), never for back-pressure or a replay, and liveness (every
//! refused event ends delivered or dead-lettered; everything flows once
//! the broker is fixed, and in a third of the schedules the redrive that
//! follows runs with looks at the dead-letter table an hour apart, so past
//! the look each restart brings it must go on by the looks the relay
//! hurries; then the fold folds every progress row and holds no row
//! open, and the CDC slot holds no WAL back).

mod backend;
mod cdc;
mod check;
mod db;
mod faults;
mod fold;
mod handover;
mod params;
mod scenario;
mod sink;
mod upgrade;
mod world;

use params::Focus;
use scenario::Totals;
use std::sync::mpsc::RecvTimeoutError;

/// Schedules per suite run, of every kind of fault.
const DEFAULT_SEEDS: u64 = 1_000;
/// Schedules per suite run of hand-overs during broker pauses.
const DEFAULT_HAND_OVER_SEEDS: u64 = 300;
/// Seeds beyond the default range that once broke a guarantee (longer
/// hunts found them), replayed in every default run of every kind of fault:
/// 60680, events confirmed before their aggregate's dead letter recorded
/// after it, and read again after a crash as its followers; 60543,
/// logical messages repeated behind a held-back one with marking; 64752,
/// events repeated behind one pushed back (not refused) without marking;
/// 82375, logical messages confirmed behind an unconfirmed event repeated
/// by the next owner with marking; 208811, events read as an aggregate's
/// redrive ended, before the table showed it resolved, dead-lettered as
/// followers of letters already published (and so ahead of earlier events
/// of the aggregate); 405406, an owner that gave ownership up after two
/// slow statements (an incident the simulation did not count); 408482,
/// more than a window of confirmations left unreported to the slot
/// without marking when a crash struck; 419262, a follower written between
/// a redrive's look at the table and its end, left open and unrequested:
/// its aggregate waited for the redrive to end, for ever; 429080, the
/// relay's loop polling a look at the dead-letter table again after the
/// acker had failed to answer it (a panic); 573319, a stop that sent the
/// first of a transaction's logical messages and not the rest, which the
/// next owner sent again (the slot cannot pass a transaction in part);
/// 5200328, a former owner whose session went silent reporting its
/// position after the new owner moved the slot past it (the slot went
/// back); 5200533, a snapshot that missed a commit a stream had already
/// decoded (the simulation's fault: a settled position read later lies
/// past it). A seed's schedule
/// changes whenever the simulation does, so one may stop reproducing what
/// it found.
const FOUND_SEEDS: &[u64] = &[
    60543, 60680, 64752, 82375, 208811, 405406, 408482, 419262, 429080, 573319, 1101235, 5200328,
    5200533,
];

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// Runs the seeds the environment names (else `default_seeds` from 0 and
/// the `found` ones) and fails the test, after printing each failed
/// schedule, if any broke a guarantee. Returns the totals for the caller's
/// own checks.
fn run_seeds(focus: Focus, default_seeds: u64, found: &[u64]) -> Totals {
    if std::env::var("OUTBOX_RELAY_SIM_TRACE").is_ok() {
        // The relay's own logs, and the simulation's notes as they happen,
        // for replaying one seed.
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(
                "outbox_relay=debug,sim=info",
            ))
            .with_test_writer()
            .without_time()
            .try_init();
    }
    let seeds: Vec<u64> = match env_u64("OUTBOX_RELAY_SIM_SEED") {
        Some(seed) => vec![seed],
        None => {
            let base = env_u64("OUTBOX_RELAY_SIM_BASE").unwrap_or(0);
            match env_u64("OUTBOX_RELAY_SIM_SEEDS") {
                Some(n) => (base..base + n).collect(),
                None => (base..base + default_seeds)
                    .chain(found.iter().copied())
                    .collect(),
            }
        }
    };
    let mut failures = Vec::new();
    let mut totals = Totals::default();
    for seed in seeds {
        match run_bounded(seed, focus) {
            Ok(t) => totals.add(&t),
            Err(report) => {
                eprintln!("{report}");
                failures.push(seed);
                if failures.len() as u64 >= env_u64("OUTBOX_RELAY_SIM_MAX_FAILURES").unwrap_or(3) {
                    break;
                }
            }
        }
    }
    eprintln!("simulation ({focus:?}): {totals}");
    assert!(
        failures.is_empty(),
        "simulation seeds {failures:?} ({focus:?}) broke a guarantee (reports above); replay one with OUTBOX_RELAY_SIM_SEED=<seed> cargo nextest run sim::"
    );
    totals
}

/// Wall time one schedule may take (they take well under a second): a
/// task that never yields keeps the paused clock from moving, and the
/// schedule would never end.
const SCHEDULE_WALL_LIMIT: std::time::Duration = std::time::Duration::from_secs(60);

/// Runs schedule `seed` on a thread of its own, and reports it failed when
/// it is not done within [`SCHEDULE_WALL_LIMIT`] (the thread is left
/// spinning; the test fails and its process ends).
fn run_bounded(seed: u64, focus: Focus) -> Result<Totals, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(scenario::run(seed, focus));
    });
    match rx.recv_timeout(SCHEDULE_WALL_LIMIT) {
        Ok(outcome) => outcome,
        Err(RecvTimeoutError::Timeout) => Err(format!(
            "simulation seed {seed} ({focus:?}) did not finish within {SCHEDULE_WALL_LIMIT:?} of wall time: a task that never yields (a busy loop) stops the simulated clock"
        )),
        Err(RecvTimeoutError::Disconnected) => Err(format!(
            "simulation seed {seed} ({focus:?}) panicked (message above)"
        )),
    }
}

#[test]
fn seeded_schedules_keep_every_guarantee() {
    let totals = run_seeds(Focus::Mixed, DEFAULT_SEEDS, FOUND_SEEDS);
    // A hunt of any length must drive auto mode back from polling to CDC,
    // or the schedules stopped exercising the switch.
    assert!(
        totals.schedules < 100 || totals.switches > 0,
        "no auto-mode schedule switched back to CDC: {totals}"
    );
    // And drive every kind of fold round, or ranges go unproven.
    let f = &totals.folds;
    assert!(
        totals.schedules < 100
            || (f.advances > 0
                && f.unsettled > 0
                && f.deleted_unsettled > 0
                && f.held > 0
                && f.backlogs > 0
                && f.upgrades > 0),
        "the schedules did not drive every kind of fold round: {totals}"
    );
}

/// Stops during broker pauses, some clean, some leaving messages of the
/// stopped owner or of its failed run before on the way, while the writers
/// commit on a few aggregates: a next owner that published at once after a
/// stop that was not clean would have its messages land before those.
#[test]
fn hand_overs_during_broker_pauses_keep_order() {
    let totals = run_seeds(Focus::HandOver, DEFAULT_HAND_OVER_SEEDS, &[]);
    // Both kinds of stop happen, or the schedules test neither.
    assert!(
        totals.schedules < 100 || (totals.clean_takeovers > 0 && totals.unclean_stops > 0),
        "the hand-over schedules did not drive both clean and unclean stops: {totals}"
    );
}
