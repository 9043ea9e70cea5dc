//! Memory is bounded in bytes, not only in events: 1 MiB payloads through a
//! relay whose byte budget is a fraction of the backlog, with the process's
//! peak resident memory measured.

use crate::support::*;
use std::time::Duration;

const MIB: u64 = 1 << 20;
const EVENTS: usize = 120;
const BUDGET_MIB: u64 = 16;

/// The process's peak resident set (VmHWM), in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("read /proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc status");
    kib * 1024
}

async fn relays_large_payloads_within_the_byte_budget(mode: Mode) {
    let budget = (BUDGET_MIB * MIB).to_string();
    let (db, broker, toml) = setup(
        mode,
        Kind::Rabbit,
        &[],
        &[
            ("relay.max_in_flight_bytes", budget.as_str()),
            ("relay.ownership_lease", "\"1s\""),
        ],
    )
    .await;
    // The whole backlog is several times the budget.
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
             SELECT gen_random_uuid(), 'order', 'a' || (i % 10), 'Big',
                    jsonb_build_object('i', i, 'x', repeat('x', 1048576))
             FROM generate_series(1, $1::int) i",
            &[&(EVENTS as i32)],
        )
        .await
        .unwrap();
    let mut child = ChildRelay::start(&toml);
    broker
        .inbox()
        .wait_len(EVENTS, Duration::from_secs(120))
        .await;
    wait_for(WAIT, "every row marked", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    let peak = peak_rss(child.pid());
    println!(
        "{mode:?}: {EVENTS} events of 1 MiB, budget {BUDGET_MIB} MiB: peak RSS {} MiB",
        peak / MIB
    );
    // The budget counts each event and, while the broker client holds it,
    // its message: the rest is the process itself and allocator slack.
    let limit = 2 * BUDGET_MIB * MIB + 64 * MIB;
    assert!(
        peak < limit,
        "peak RSS {} MiB is over {} MiB",
        peak / MIB,
        limit / MIB
    );
    assert_eq!(child.terminate().code(), Some(0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn polling_relays_large_payloads_within_the_byte_budget() {
    relays_large_payloads_within_the_byte_budget(Mode::Polling).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cdc_relays_large_payloads_within_the_byte_budget() {
    relays_large_payloads_within_the_byte_budget(Mode::Cdc).await;
}

/// The budget counts a row's every text value, not only its payload: rows
/// with small payloads and large headers are read a few at a time, not a
/// full batch at once (500 rows of 60 KiB against a 1 MiB budget).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_headers_count_against_the_byte_budget() {
    const ROWS: usize = 1_500;
    let budget = MIB.to_string();
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[("relay.max_in_flight_bytes", budget.as_str())],
    )
    .await;
    db.client
        .execute(
            "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload, headers)
             SELECT gen_random_uuid(), 'order', 'a' || i, 'Tagged', jsonb_build_object('i', i),
                    jsonb_build_object('tag', repeat('x', 61440))
             FROM generate_series(1, $1::int) i",
            &[&(ROWS as i32)],
        )
        .await
        .unwrap();
    let mut child = ChildRelay::start(&toml);
    broker
        .inbox()
        .wait_len(ROWS, Duration::from_secs(120))
        .await;
    let peak = peak_rss(child.pid());
    println!(
        "{ROWS} events with 60 KiB of headers, budget 1 MiB: peak RSS {} MiB",
        peak / MIB
    );
    let limit = 2 * MIB + 64 * MIB;
    assert!(
        peak < limit,
        "peak RSS {} MiB is over {} MiB",
        peak / MIB,
        limit / MIB
    );
    assert_eq!(child.terminate().code(), Some(0));
}

/// A redrive is read within the budget too: 120 requested letters of 1 MiB
/// (a look's batch is 500) go out through a 16 MiB budget, each look
/// handing over what the room holds. Before, the first look held them all:
/// 353 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redrive_of_large_letters_is_read_within_the_byte_budget() {
    let budget = (BUDGET_MIB * MIB).to_string();
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[
            ("relay.max_in_flight_bytes", budget.as_str()),
            ("dead_letter.refresh_interval", "\"1h\""),
        ],
    )
    .await;
    let path = config_file(&toml);
    db.client
        .execute(
            "INSERT INTO outbox_dead_letters (id, aggregate_type, aggregate_id, event_type, payload,
                                              created_at, reason, attempts, first_failed_at, last_failed_at)
             SELECT 'r' || lpad(i::text, 4, '0'), 'order', 'a' || (i % 10), 'Big',
                    jsonb_build_object('i', i, 'x', repeat('x', 1048576))::text, now()::text,
                    'message too large', 5, now(), now()
             FROM generate_series(1, $1::int) i",
            &[&(EVENTS as i32)],
        )
        .await
        .expect("letters");
    let (code, out, err) = run_cli(&["dlq", "redrive", "--all", "--config", &path], &[]);
    assert_eq!(code, 0, "{out}{err}");
    let mut child = ChildRelay::start(&toml);
    broker
        .inbox()
        .wait_len(EVENTS, Duration::from_secs(120))
        .await;
    let peak = peak_rss(child.pid());
    println!(
        "a redrive of {EVENTS} letters of 1 MiB, budget {BUDGET_MIB} MiB: peak RSS {} MiB",
        peak / MIB
    );
    // A look while letters are out reads them again (skipped, then
    // dropped), up to the room: one more budget's worth at most.
    let limit = 3 * BUDGET_MIB * MIB + 64 * MIB;
    assert!(
        peak < limit,
        "peak RSS {} MiB is over {} MiB",
        peak / MIB,
        limit / MIB
    );
    assert_eq!(child.terminate().code(), Some(0));
}
