//! Progress: transactions, confirmations, and the flushed position.
use super::*;

fn pos(lsn: u64, index: u64) -> CdcPosition {
    CdcPosition {
        commit_lsn: Lsn(lsn),
        index,
        seq: None,
        xid: None,
    }
}

#[test]
fn flushes_only_complete_confirmed_prefixes() {
    let mut p = Progress::new(Lsn(10), 100);
    p.begin(Lsn(100));
    assert!(p.event(&pos(100, 0)));
    assert!(p.event(&pos(100, 1)));
    p.commit(Lsn(110));
    p.begin(Lsn(200));
    assert!(p.event(&pos(200, 0)));
    p.commit(Lsn(210));
    // The later transaction confirms first: nothing may be flushed yet.
    p.confirm(&pos(200, 0));
    assert_eq!(p.flushed(), Lsn(10));
    p.confirm(&pos(100, 1));
    assert_eq!(p.flushed(), Lsn(10));
    p.confirm(&pos(100, 0));
    assert_eq!(
        p.flushed(),
        Lsn(210),
        "both transactions complete, in order"
    );
    assert!(p.idle());
}

/// The reader is woken as soon as a window of confirmations piled up,
/// whatever it is waiting for: a crash then repeats no more than that.
#[tokio::test]
async fn a_report_falls_due_when_a_window_of_confirmations_piled_up() {
    let mut p = Progress::new(Lsn(10), 100);
    p.report_every(2);
    let due = p.report_due();
    p.begin(Lsn(100));
    for i in 0..5 {
        p.event(&pos(100, i));
    }
    p.commit(Lsn(110));
    let woken = |due: &Notify| {
        let mut waiting = std::pin::pin!(due.notified());
        let waker = std::task::Waker::noop();
        waiting
            .as_mut()
            .poll(&mut std::task::Context::from_waker(waker))
            .is_ready()
    };
    p.confirm(&pos(100, 0));
    assert!(!woken(&due), "one confirmation is no window");
    p.confirm(&pos(100, 1));
    assert!(woken(&due), "two are");
    p.reported(Lsn(0), 2);
    p.confirm(&pos(100, 2));
    assert!(!woken(&due), "counted again from the report");
    // A report of that one is being sent while two more come (their
    // wake-up goes to the report under way): once sent, it covers only
    // what it counted, and the two are a window, due at once.
    p.confirm(&pos(100, 3));
    assert!(woken(&due));
    p.confirm(&pos(100, 4));
    p.reported(Lsn(0), 1);
    assert_eq!(p.unreported(), 2);
    assert!(woken(&due), "what came meanwhile is a window");
}

#[test]
fn a_transaction_is_not_flushed_before_its_commit_arrives() {
    let mut p = Progress::new(Lsn(0), 100);
    p.begin(Lsn(100));
    p.event(&pos(100, 0));
    p.confirm(&pos(100, 0));
    assert_eq!(p.flushed(), Lsn(0), "a large transaction still streaming");
    p.server_end(Lsn(5000));
    assert_eq!(
        p.flushed(),
        Lsn(0),
        "keepalives do not move past unfinished work"
    );
    p.commit(Lsn(120));
    assert_eq!(
        p.flushed(),
        Lsn(5000),
        "complete, and then idle: the keepalive's end counts"
    );
}

#[test]
fn empty_transactions_and_idle_keepalives_advance() {
    let mut p = Progress::new(Lsn(0), 100);
    p.begin(Lsn(50));
    p.commit(Lsn(60));
    assert_eq!(p.flushed(), Lsn(60));
    p.server_end(Lsn(900));
    assert_eq!(p.flushed(), Lsn(900));
    p.server_end(Lsn(800));
    assert_eq!(p.flushed(), Lsn(900), "never backwards");
}

#[test]
fn after_a_restart_confirmed_events_are_skipped() {
    let mut p = Progress::new(Lsn(0), 100);
    p.begin(Lsn(100));
    p.event(&pos(100, 0));
    p.event(&pos(100, 1));
    p.commit(Lsn(110));
    p.begin(Lsn(200));
    p.event(&pos(200, 0));
    p.commit(Lsn(210));
    p.confirm(&pos(100, 1)); // 100/0 is held back (refused)
    p.confirm(&pos(200, 0));
    p.restart(Lsn(0), None);
    assert_eq!(p.flushed(), Lsn(0));
    // The stream replays both transactions.
    p.begin(Lsn(100));
    assert!(p.event(&pos(100, 0)), "the refused event is sent again");
    assert!(!p.event(&pos(100, 1)), "the confirmed one is skipped");
    p.commit(Lsn(110));
    p.begin(Lsn(200));
    assert!(!p.event(&pos(200, 0)));
    p.commit(Lsn(210));
    assert_eq!(p.flushed(), Lsn(0));
    p.confirm(&pos(100, 0));
    assert_eq!(p.flushed(), Lsn(210));
    assert!(
        p.confirmed_ahead.is_empty(),
        "flushed transactions forget their confirmations"
    );
}

/// A restart keeps what the relay flushed beyond the slot, told or not
/// (the same server's slot lags what it did not save yet), but on a new
/// timeline (a promoted standby) with the slot behind what it was told
/// the stream starts from the slot and skips nothing it holds.
#[test]
fn after_a_failover_behind_what_was_told_the_stream_starts_from_the_slot() {
    let flushed_to = |p: &mut Progress, lsn: u64| {
        p.begin(Lsn(lsn));
        p.event(&pos(lsn, 0));
        p.commit(Lsn(lsn + 10));
        p.confirm(&pos(lsn, 0));
    };
    let mut p = Progress::new(Lsn(0), 100);
    p.restart(Lsn(0), Some(1));
    flushed_to(&mut p, 100);
    flushed_to(&mut p, 200);
    p.reported(p.flushed(), 2);
    // Confirmed ahead of a held-back event of a later transaction.
    p.begin(Lsn(300));
    p.event(&pos(300, 0));
    p.event(&pos(300, 1));
    p.commit(Lsn(310));
    p.confirm(&pos(300, 1));
    // The same server forgot the last report (restarted before saving it).
    p.restart(Lsn(110), Some(1));
    assert_eq!(p.flushed(), Lsn(210), "the same WAL: kept");
    p.begin(Lsn(300));
    assert!(!p.event(&pos(300, 1)), "confirmed: skipped");
    // A promoted standby, its slot behind what was told.
    p.restart(Lsn(110), Some(2));
    assert_eq!(p.flushed(), Lsn(110), "from the slot");
    p.begin(Lsn(200));
    assert!(p.event(&pos(200, 0)), "streamed again, not skipped");
    p.commit(Lsn(210));
    p.begin(Lsn(300));
    assert!(p.event(&pos(300, 1)), "nothing past the slot is skipped");
    // An unknown timeline (a standby server) changes nothing.
    p.restart(Lsn(50), None);
    assert_eq!(p.flushed(), Lsn(110));
}

#[test]
fn empty_transactions_behind_unfinished_work_fold_into_it() {
    let mut p = Progress::new(Lsn(0), 100);
    p.begin(Lsn(100));
    p.event(&pos(100, 0));
    p.commit(Lsn(110));
    for i in 0..10_000u64 {
        p.begin(Lsn(200 + i * 10));
        p.commit(Lsn(205 + i * 10));
    }
    assert_eq!(p.outstanding(), 1, "unrelated transactions do not pile up");
    assert_eq!(p.flushed(), Lsn(0));
    p.confirm(&pos(100, 0));
    assert_eq!(
        p.flushed(),
        Lsn(205 + 9_999 * 10),
        "flushed past all of them"
    );
    assert!(p.idle());
}

#[test]
fn many_transactions_confirmed_out_of_order_all_flush() {
    let mut p = Progress::new(Lsn(0), 1_000_000);
    let n = 50_000u64;
    for i in 0..n {
        p.begin(Lsn(100 + i * 10));
        p.event(&pos(100 + i * 10, 0));
        p.commit(Lsn(105 + i * 10));
    }
    // Confirm the second half first (remembered for skipping), then the first.
    for i in (n / 2..n).chain(0..n / 2) {
        p.confirm(&pos(100 + i * 10, 0));
    }
    assert!(p.idle());
    assert_eq!(p.flushed(), Lsn(105 + (n - 1) * 10));
    assert!(p.confirmed_ahead.is_empty());
}

#[test]
fn one_held_back_event_keeps_the_tracker_bounded() {
    let mut p = Progress::new(Lsn(0), 1_000_000);
    p.begin(Lsn(100));
    p.event(&pos(100, 0)); // held back: never confirmed
    p.commit(Lsn(105));
    for i in 1..10_000u64 {
        let lsn = 100 + i * 10;
        p.begin(Lsn(lsn));
        p.event(&pos(lsn, 0));
        p.commit(Lsn(lsn + 5));
        p.confirm(&pos(lsn, 0));
    }
    assert_eq!(
        p.outstanding(),
        2,
        "the held transaction and one merged run behind it"
    );
    assert_eq!(p.flushed(), Lsn(0), "without marking, the WAL waits for it");
    p.release(&pos(100, 0));
    assert_eq!(p.flushed(), Lsn(100 + 9_999 * 10 + 5));
    assert!(p.idle());
}

#[test]
fn a_released_event_is_not_skipped_when_replayed() {
    let mut p = Progress::new(Lsn(0), 100);
    p.begin(Lsn(100));
    p.event(&pos(100, 0));
    p.commit(Lsn(110));
    p.release(&pos(100, 0));
    assert_eq!(p.flushed(), Lsn(110));
    p.restart(Lsn(0), None);
    p.begin(Lsn(100));
    assert!(p.event(&pos(100, 0)), "read again, not skipped");
}

#[test]
fn the_skip_memory_is_capped() {
    let mut p = Progress::new(Lsn(0), 2);
    p.begin(Lsn(100));
    for i in 0..5 {
        p.event(&pos(100, i));
    }
    for i in 1..5 {
        p.confirm(&pos(100, i));
    }
    assert_eq!(p.confirmed_ahead.len(), 2);
    assert_eq!(p.outstanding(), 1);
}

/// The relay confirmed past what it told the old server (status updates go
/// out every so often), and the promoted standby's slot holds what was
/// told: its WAL past that may be another history, so the stream starts
/// from the slot, not from the relay's own position, and skips nothing.
#[test]
fn after_a_failover_behind_what_was_confirmed_unreported_the_stream_starts_from_the_slot() {
    let mut p = Progress::new(Lsn(0), 100);
    p.restart(Lsn(0), Some(1));
    p.begin(Lsn(100));
    p.event(&pos(100, 0));
    p.commit(Lsn(110));
    p.confirm(&pos(100, 0));
    p.reported(p.flushed(), 1);
    let told = p.flushed();
    p.begin(Lsn(200));
    p.event(&pos(200, 0));
    p.commit(Lsn(210));
    p.confirm(&pos(200, 0));
    assert!(p.flushed() > told, "confirmed, not told yet");
    p.restart(told, Some(2));
    assert_eq!(p.flushed(), told, "from the promoted server's slot");
    p.begin(Lsn(200));
    assert!(p.event(&pos(200, 0)), "streamed again, not skipped");
}

/// One event held back (its aggregate waits for a retry) while thousands
/// after it are confirmed, far past the skip memory's cap: when the stream
/// restarts from the flushed position to read it again, the transactions
/// complete behind it are skipped whole, not only the two confirmations
/// the memory kept (its own transaction's others): the held one alone is
/// read again.
#[test]
fn transactions_complete_behind_a_held_event_are_skipped_past_the_memorys_cap() {
    let mut p = Progress::new(Lsn(0), 2);
    let stream = |p: &mut Progress, confirm: bool| {
        let mut read = Vec::new();
        for t in 1..=1_000u64 {
            let lsn = t * 100;
            p.begin(Lsn(lsn));
            for i in 0..3 {
                if p.event(&pos(lsn, i)) {
                    read.push((lsn, i));
                }
            }
            p.commit(Lsn(lsn + 10));
        }
        if confirm {
            for &(lsn, i) in &read {
                // The first transaction's second event is held back.
                if (lsn, i) != (100, 1) {
                    p.confirm(&pos(lsn, i));
                }
            }
        }
        read
    };
    assert_eq!(stream(&mut p, true).len(), 3_000);
    assert_eq!(p.flushed(), Lsn(0), "held by the first transaction");
    assert_eq!(p.confirmed_ahead.len(), 2, "the memory's cap");
    p.restart(Lsn(0), None);
    let again = stream(&mut p, false);
    assert_eq!(again, vec![(100, 1)], "only the held event");
    // Confirmed this time: everything flushes, the spans go with it.
    p.confirm(&pos(100, 1));
    assert_eq!(p.flushed(), Lsn(100_010));
    assert!(p.done_spans.is_empty() && p.confirmed_ahead.is_empty());
}

/// A transaction with a released event (held back in the table, read again
/// by the start-up read) is never skipped whole.
#[test]
fn a_transaction_with_a_released_event_is_not_skipped_whole() {
    let mut p = Progress::new(Lsn(0), 100);
    for lsn in [100, 200] {
        p.begin(Lsn(lsn));
        p.event(&pos(lsn, 0));
        p.event(&pos(lsn, 1));
        p.commit(Lsn(lsn + 10));
    }
    // Held: the first transaction's first event. The second's first is
    // released, its second confirmed.
    p.confirm(&pos(100, 1));
    p.release(&pos(200, 0));
    p.confirm(&pos(200, 1));
    assert_eq!(p.flushed(), Lsn(0));
    p.restart(Lsn(0), None);
    assert!(p.done_spans.is_empty());
    p.begin(Lsn(200));
    assert!(p.event(&pos(200, 0)), "the released event is read again");
    assert!(!p.event(&pos(200, 1)), "the confirmed one is remembered");
}

/// A span ends where its last transaction's commit record does, which is
/// where the next one's may start: that one is not skipped with it.
#[test]
fn a_span_does_not_reach_the_transaction_that_starts_where_it_ends() {
    let mut p = Progress::new(Lsn(0), 100);
    for (lsn, end) in [(100, 200), (200, 300), (300, 400)] {
        p.begin(Lsn(lsn));
        p.event(&pos(lsn, 0));
        p.commit(Lsn(end));
    }
    p.confirm(&pos(200, 0));
    p.restart(Lsn(0), None);
    assert_eq!(p.done_spans, vec![(Lsn(200), Lsn(300))]);
    for (lsn, read) in [(100, true), (200, false), (300, true)] {
        p.begin(Lsn(lsn));
        assert_eq!(p.event(&pos(lsn, 0)), read, "the transaction at {lsn}");
        p.commit(Lsn(lsn + 100));
    }
}

/// A failover whose slot stands where the relay's position does: past it
/// the promoted server's WAL may hold other transactions at the positions
/// confirmed on the old one, so none of them is skipped.
#[test]
fn after_a_failover_at_the_relays_position_nothing_remembered_is_skipped() {
    let mut p = Progress::new(Lsn(0), 100);
    p.restart(Lsn(0), Some(1));
    for lsn in [100, 200] {
        p.begin(Lsn(lsn));
        p.event(&pos(lsn, 0));
        p.commit(Lsn(lsn + 10));
    }
    // The first waits; the second is confirmed behind it.
    p.confirm(&pos(200, 0));
    assert_eq!(p.flushed(), Lsn(0));
    p.restart(Lsn(0), Some(2));
    assert!(p.done_spans.is_empty() && p.confirmed_ahead.is_empty());
    for lsn in [100, 200] {
        p.begin(Lsn(lsn));
        assert!(p.event(&pos(lsn, 0)), "the transaction at {lsn} is read");
        p.commit(Lsn(lsn + 10));
    }
}
