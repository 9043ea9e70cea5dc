//! Clean hand-offs: after an owner stopped cleanly the next one publishes
//! at once; after a crash, a stop that left messages unconfirmed, or a stop
//! while still waiting out a crashed owner's lease, it waits out
//! `relay.ownership_lease`.

use crate::support::proxy::{CutBroker, setup_cut};
use crate::support::*;
use outbox_relay::telemetry::metrics;
use serde_json::json;
use std::time::Duration;
use uuid::Uuid;

/// Long enough that an event arriving well within it was not held back by it.
const LONG_LEASE: &str = "\"60s\"";
/// Well within the 66 s a new owner waits when it must.
const AT_ONCE: Duration = Duration::from_secs(20);

/// An outbox of "order" events whose new owners wait [`LONG_LEASE`] when they must.
async fn long_lease(mode: Mode, kind: Kind) -> (TestDb, Broker, String) {
    setup(
        mode,
        kind,
        &["order"],
        &[("relay.ownership_lease", LONG_LEASE)],
    )
    .await
}

/// The owners table's row of the whole outbox: (owner token, stopped).
async fn claim_row(db: &TestDb) -> Option<(String, bool)> {
    db.client
        .query_opt(
            "SELECT owner, stopped_at IS NOT NULL FROM outbox_relay_owners WHERE lock_key = 'outbox-relay:public.outbox'",
            &[],
        )
        .await
        .expect("read the owners table")
        .map(|r| (r.get(0), r.get(1)))
}

async fn insert_one(db: &TestDb, i: i64) -> String {
    let id = Uuid::new_v4();
    db.insert(id, "order", "o1", json!({ "i": i })).await;
    id.to_string()
}

/// Asserts that `id` does not arrive within `secs` seconds: the new owner
/// is held back (`why` says by what).
async fn assert_held(inbox: &crate::support::brokers::Inbox, id: &str, secs: u64, why: &str) {
    let held = inbox
        .try_wait_ids(&[id.to_owned()], Duration::from_secs(secs))
        .await;
    assert!(held.is_err(), "{why}");
}

/// Starts an owner as if an earlier one had stopped cleanly (so it need
/// not wait the long lease either) and waits for its first event.
async fn start_after_a_clean_stop(db: &TestDb, broker: &Broker, toml: &str) -> InProcess {
    db.client
        .execute(
            "INSERT INTO outbox_relay_owners (lock_key, shards, owner, claimed_at, stopped_at)
             VALUES ('outbox-relay:public.outbox', 1, 'earlier', now(), now())",
            &[],
        )
        .await
        .expect("seed the owners table");
    let relay = InProcess::start(parse(toml));
    let first = insert_one(db, 1).await;
    broker.inbox().wait_ids(&[first], AT_ONCE).await;
    relay
}

/// Starts an owner that must wait out the lease, and asserts that an event
/// inserted then is held back for a while (`why` says by what).
async fn start_held(db: &TestDb, broker: &Broker, toml: &str, why: &str) -> (InProcess, String) {
    let relay = InProcess::start(parse(toml));
    let id = insert_one(db, 2).await;
    assert_held(broker.inbox(), &id, 6, why).await;
    (relay, id)
}

/// An owner that claimed after `previous` stopped during its lease wait:
/// its claim stands unmarked and `held` stays unsent, for the next owner.
async fn assert_stopped_unclean(db: &TestDb, previous: &str, held: &str) {
    let (token, stopped) = claim_row(db).await.expect("the owner claimed the outbox");
    assert_ne!(
        token, previous,
        "the owner claimed the outbox with its own token"
    );
    assert!(
        !stopped,
        "a stop before the previous owner's lease ran out is not recorded as clean"
    );
    assert!(
        db.unsent_ids().await.contains(held),
        "the held event stays unsent, for the next owner"
    );
}

every_mode!(a_clean_stop_hands_over_at_once_and_a_crash_does_not);
async fn a_clean_stop_hands_over_at_once_and_a_crash_does_not(mode: Mode, kind: Kind) {
    let (db, broker, toml) = long_lease(mode, kind).await;
    let a = start_after_a_clean_stop(&db, &broker, &toml).await;
    let (token_a, stopped) = claim_row(&db).await.expect("A claimed the outbox");
    assert_ne!(token_a, "earlier", "A wrote its own token");
    assert!(!stopped, "a running owner's claim is not marked stopped");
    a.stop().await;
    assert_eq!(
        claim_row(&db).await,
        Some((token_a, true)),
        "A's clean stop is recorded"
    );

    // B takes over from a clean stop: well within the lease.
    let b = InProcess::start(parse(&toml));
    let second = insert_one(&db, 2).await;
    broker.inbox().wait_ids(&[second], AT_ONCE).await;

    // B crashes (no drain, nothing recorded): C must wait the lease out.
    let token_b = wait_for(WAIT, "B to claim the outbox", || async {
        claim_row(&db)
            .await
            .filter(|(_, stopped)| !stopped)
            .map(|(token, _)| token)
    })
    .await;
    b.abort();
    let (c, third) = start_held(
        &db,
        &broker,
        &toml,
        "after a crash the next owner publishes nothing within its first lease",
    )
    .await;
    // C stops while still waiting out B's lease: nothing of its own is
    // unconfirmed, but B's last messages may still reach the broker, so
    // this is no clean stop either and D waits too. Nothing is lost.
    c.stop().await;
    assert_stopped_unclean(&db, &token_b, &third).await;
    let d = InProcess::start(parse(&toml));
    assert_held(
        broker.inbox(),
        &third,
        6,
        "after a stop during the wait for a crashed owner the next owner waits too",
    )
    .await;
    d.stop().await;
    assert!(
        db.unsent_ids().await.contains(&third),
        "the held event stays unsent, for the next owner"
    );
}

/// Records an earlier owner's claim that it never marked stopped (it
/// crashed, or may still be publishing).
async fn seed_unclean_claim(db: &TestDb) {
    db.client
        .execute(
            "INSERT INTO outbox_relay_owners (lock_key, shards, owner, claimed_at)
             VALUES ('outbox-relay:public.outbox', 1, 'crashed', now())",
            &[],
        )
        .await
        .expect("seed the owners table");
}

every_mode!(the_first_owner_of_a_new_outbox_publishes_at_once);
/// `migrate` created the outbox, so nobody can have relayed it: the first
/// owner publishes at once, well within a long lease. Its claim ends that:
/// after it crashes the next owner waits.
async fn the_first_owner_of_a_new_outbox_publishes_at_once(mode: Mode, kind: Kind) {
    let (db, broker, toml) = long_lease(mode, kind).await;
    let a = InProcess::start(parse(&toml));
    let first = insert_one(&db, 1).await;
    broker.inbox().wait_ids(&[first], AT_ONCE).await;
    let (token, stopped) = claim_row(&db).await.expect("A claimed the outbox");
    assert!(!stopped, "A's claim is open while it runs");
    a.abort();
    let (b, held) = start_held(
        &db,
        &broker,
        &toml,
        "after the first owner crashed the next one waits its lease",
    )
    .await;
    b.stop().await;
    assert_stopped_unclean(&db, &token, &held).await;
}

/// A stop while the CDC start-up still waits (here for a transaction that
/// runs on to settle) after an owner that crashed: nothing was sent, but
/// the crashed owner's messages may still be on their way, so the stop is
/// not recorded as clean and the next owner waits out the lease too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_the_cdc_start_after_a_crash_is_not_a_clean_one() {
    let (db, _broker, toml) = long_lease(Mode::Cdc, Kind::Rabbit).await;
    seed_unclean_claim(&db).await;
    // A transaction with an id, running on: the start-up read waits up to
    // 2 s for it before it reads the table.
    let running = connect(&db.url).await;
    running
        .batch_execute("BEGIN; SELECT pg_current_xact_id();")
        .await
        .expect("a transaction with an id");
    let relay = InProcess::start(parse(&toml));
    wait_for(WAIT, "the relay to claim the outbox", || async {
        claim_row(&db)
            .await
            .filter(|(token, _)| token != "crashed")
            .map(drop)
    })
    .await;
    relay.stop().await;
    let (_, stopped) = claim_row(&db).await.expect("the relay claimed the outbox");
    assert!(
        !stopped,
        "a stop before the crashed owner's lease ran out is not recorded as clean"
    );
    drop(running);
}

/// A polling outbox to RabbitMQ with a long lease, as a database looks
/// that `migrate` last saw before hand-offs came: no owners table.
async fn without_owners_table() -> (TestDb, Broker, String) {
    let (db, broker, toml) = long_lease(Mode::Polling, Kind::Rabbit).await;
    db.client
        .batch_execute("DROP TABLE outbox_relay_owners")
        .await
        .expect("drop the owners table");
    (db, broker, toml)
}

/// `migrate` run on an outbox that already existed (created by hand, or by
/// a version before hand-offs) cannot know who relayed it: no genesis row,
/// and the first owner waits out the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_existing_outbox_gets_no_genesis_row_and_its_first_owner_waits() {
    let (db, broker, toml) = without_owners_table().await;
    db.migrate(&parse(&toml)).await;
    let rows: i64 = db
        .client
        .query_one("SELECT count(*) FROM outbox_relay_owners", &[])
        .await
        .expect("count owners rows")
        .get(0);
    assert_eq!(
        rows, 0,
        "migrate wrote no genesis row for an existing outbox"
    );
    let (relay, id) = start_held(
        &db,
        &broker,
        &toml,
        "the first owner of an outbox migrate did not create waits its lease",
    )
    .await;
    relay.stop().await;
    assert!(db.unsent_ids().await.contains(&id), "nothing was lost");
}

/// An owner that had to wait out a lease (an earlier owner recorded no clean
/// stop) and stops once it is over, with everything confirmed, stops
/// cleanly: the wait settled whatever its predecessor might have left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_after_the_lease_wait_is_a_clean_one() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[("relay.ownership_lease", "\"1s\"")],
    )
    .await;
    seed_unclean_claim(&db).await;
    let a = InProcess::start(parse(&toml));
    let first = insert_one(&db, 1).await;
    broker.inbox().wait_ids(&[first], WAIT).await;
    wait_for(WAIT, "the first event marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    a.stop().await;
    let (_, stopped) = claim_row(&db).await.expect("A claimed the outbox");
    assert!(
        stopped,
        "A's stop after its lease wait is recorded as clean"
    );
}

/// A polling relay (with `sets`) that delivered one event, then sent a
/// second into a broker connection that went silent: the second waits for
/// its confirmation (`relay.confirm_timeout` is a minute). Returns the
/// relay and the second event's id.
async fn one_in_flight_to_a_frozen_broker(
    sets: &[(&str, &str)],
) -> (TestDb, CutBroker, ChildRelay, String) {
    let mut all = vec![("relay.confirm_timeout", "\"60s\"")];
    all.extend_from_slice(sets);
    let (db, broker, toml) = setup_cut(Mode::Polling, Kind::Rabbit, &all).await;
    let (relay, port) = ChildRelay::serving(&toml);
    let first = insert_one(&db, 1).await;
    broker.inbox.wait_ids(&[first], WAIT).await;
    assert!(
        broker.proxy().freeze_all() > 0,
        "the relay's broker connection goes through the proxy"
    );
    let second = insert_one(&db, 2).await;
    let in_flight = format!("{}{{pipeline=\"default\"}}", metrics::IN_FLIGHT);
    wait_for(WAIT, "the second event to be in flight", || async {
        let (_, body) = http_get(port, "/metrics").await?;
        (metric(&body, &in_flight)? >= 1.0).then_some(())
    })
    .await;
    (db, broker, relay, second)
}

/// A stop whose `shutdown_timeout` ran out with a message unconfirmed (the
/// broker connection went silent) leaves no clean mark: the broker may
/// still take that message, so the next owner must wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_with_unconfirmed_messages_is_not_a_clean_one() {
    let (db, broker, mut a, second) = one_in_flight_to_a_frozen_broker(&[
        ("relay.ownership_lease", "\"1s\""),
        ("relay.shutdown_timeout", "\"1s\""),
    ])
    .await;
    let status = a.terminate();
    assert!(status.success(), "the relay exits cleanly: {status}");
    let (_, stopped) = claim_row(&db).await.expect("A claimed the outbox");
    assert!(
        !stopped,
        "a stop that left a message unconfirmed is not recorded as clean"
    );
    assert!(
        !broker.inbox.event_ids().contains(&second),
        "the frozen connection delivered nothing"
    );
    assert_eq!(db.unsent().await, 1, "the unconfirmed event stays unsent");
}

/// The first SIGTERM waits (up to `relay.shutdown_timeout`) for what is in
/// flight; a second one exits at once, with 130, marking nothing the broker
/// did not confirm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_signal_exits_at_once() {
    let (db, _broker, mut a, _) =
        one_in_flight_to_a_frozen_broker(&[("relay.shutdown_timeout", "\"60s\"")]).await;
    let signal = |pid: u32| {
        std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()
            .expect("kill")
    };
    signal(a.pid());
    assert!(
        a.wait_exit(Duration::from_secs(2)).is_none(),
        "the first signal waits for the confirmation"
    );
    signal(a.pid());
    let status = a
        .wait_exit(Duration::from_secs(10))
        .expect("the second signal ends the relay at once");
    assert_eq!(status.code(), Some(130), "{status}");
    assert_eq!(db.unsent().await, 1, "the unconfirmed event stays unsent");
}

/// A stop that cannot finish (the ownership session went silent while
/// marking a confirmed event, and a lease of a minute keeps the relay from
/// giving up on it) ends anyway once `relay.shutdown_timeout` and
/// `STOP_GRACE` have passed: exit 1, with an error saying so, well within
/// the grace the shipped unit and manifest give. Nothing unmarked counts as
/// sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_that_cannot_finish_ends_after_the_grace() {
    use outbox_relay::shutdown::{OVERRAN_EXIT, STOP_GRACE};
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &[],
        &[
            ("relay.ownership_lease", "\"60s\""),
            ("relay.shutdown_timeout", "\"1s\""),
        ],
    )
    .await;
    let (proxy, toml) = db.behind_proxy(&toml).await;
    let mut relay = ChildRelay::start_logged(&toml);
    let first = insert_one(&db, 1).await;
    broker.inbox().wait_ids(&[first], WAIT).await;
    wait_for(WAIT, "the first event marked sent", || async {
        (db.unsent().await == 0).then_some(())
    })
    .await;
    let (_, port) = db.owner_session().await;
    assert!(proxy.freeze(port), "the ownership session is proxied");
    let second = insert_one(&db, 2).await;
    broker.inbox().wait_ids(&[second], WAIT).await;
    let signalled = std::time::Instant::now();
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &relay.pid().to_string()])
        .status();
    let limit = Duration::from_secs(1) + STOP_GRACE;
    let status = relay
        .wait_exit(limit + Duration::from_secs(5))
        .unwrap_or_else(|| panic!("the relay was still stopping {limit:?} after SIGTERM"));
    let took = signalled.elapsed();
    assert_eq!(status.code(), Some(OVERRAN_EXIT), "{status}");
    assert!(
        took >= limit - Duration::from_millis(500),
        "the stop waited for its grace ({took:?}): the marking was stuck"
    );
    assert!(
        relay.logged(&format!(
            "the stop did not end within relay.shutdown_timeout plus {}s",
            STOP_GRACE.as_secs()
        )),
        "the error says why the relay exited"
    );
    assert_eq!(
        db.unsent().await,
        1,
        "the event whose mark never reached the database stays unsent"
    );
}

/// When the clean stop cannot be recorded (here the database refuses the
/// write) the stop still ends promptly, the claim stays unmarked, and the
/// next owner waits the lease out: a lost record costs latency, never order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_that_cannot_be_recorded_costs_the_next_owner_the_lease() {
    let (db, broker, toml) = long_lease(Mode::Polling, Kind::Rabbit).await;
    let a = start_after_a_clean_stop(&db, &broker, &toml).await;
    db.client
        .batch_execute(
            "CREATE FUNCTION refuse_stop() RETURNS trigger LANGUAGE plpgsql AS
               $$ BEGIN RAISE EXCEPTION 'stop records refused by the test'; END $$;
             CREATE TRIGGER refuse_stop BEFORE UPDATE ON outbox_relay_owners
               FOR EACH ROW WHEN (NEW.stopped_at IS NOT NULL) EXECUTE FUNCTION refuse_stop();",
        )
        .await
        .expect("make recording a clean stop fail");
    let began = std::time::Instant::now();
    a.stop().await;
    assert!(
        began.elapsed() < Duration::from_secs(15),
        "the stop did not wait on the failed record: {:?}",
        began.elapsed()
    );
    let (token_a, stopped) = claim_row(&db).await.expect("A claimed the outbox");
    assert_ne!(token_a, "earlier", "A wrote its own token");
    assert!(!stopped, "the refused record left the claim unmarked");

    let (b, second) = start_held(
        &db,
        &broker,
        &toml,
        "without the record the next owner publishes nothing within its first lease",
    )
    .await;
    // With the record possible again, B's stop is still not a clean one: it
    // stops while waiting out A's lease, and cannot know what A left.
    db.client
        .batch_execute("DROP TRIGGER refuse_stop ON outbox_relay_owners")
        .await
        .expect("allow stop records again");
    b.stop().await;
    assert_stopped_unclean(&db, &token_a, &second).await;
}

/// Without the owners table (a database `migrate` has not seen since
/// hand-offs came) `check` says what it costs, and the relay runs as
/// before: every new owner waits the lease out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_owners_table_check_warns_and_every_start_waits_the_lease() {
    let (db, broker, toml) = without_owners_table().await;
    let path = config_file(&toml);
    let (code, out, err) = run_cli(&["check", "--config", &path], &[]);
    assert_eq!(code, 0, "a missing owners table is a warning: {out}{err}");
    assert!(
        out.contains("public.outbox_relay_owners is missing")
            && out.contains("run outbox-relay migrate"),
        "{out}"
    );

    let relay = InProcess::start(parse(&toml));
    let id = insert_one(&db, 1).await;
    assert_held(
        broker.inbox(),
        &id,
        5,
        "without the table a new owner waits the lease",
    )
    .await;
    relay.stop().await;
    assert_eq!(db.unsent().await, 1, "nothing was lost");
}

/// A role that may read the owners table but not write it: `check` fails
/// naming the grant, and the relay publishes nothing (it could not clear a
/// previous owner's clean mark) until the grant is made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_role_that_cannot_claim_is_told_what_to_grant_and_publishes_nothing() {
    let (db, broker, toml) = setup(
        Mode::Polling,
        Kind::Rabbit,
        &["order"],
        &[("relay.retry_max", "\"1s\"")],
    )
    .await;
    let role = crate::kit::unique("relay_role_");
    db.client
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN;
             GRANT ALL ON ALL TABLES IN SCHEMA public TO {role};
             GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO {role};
             REVOKE ALL ON outbox_relay_owners FROM {role};
             GRANT SELECT ON outbox_relay_owners TO {role};"
        ))
        .await
        .expect("create a role without write access to the owners table");
    let toml = toml.replace(&db.url, &db.url_as(&role));

    let path = config_file(&toml);
    let (code, out, _) = run_cli(&["check", "--config", &path], &[]);
    assert_ne!(code, 0, "{out}");
    assert!(
        out.contains("GRANT SELECT, INSERT, UPDATE ON public.outbox_relay_owners"),
        "{out}"
    );

    let relay = InProcess::start(parse(&toml));
    let id = insert_one(&db, 1).await;
    assert_held(
        broker.inbox(),
        &id,
        5,
        "nothing is published without a claim",
    )
    .await;
    db.client
        .batch_execute(&format!(
            "GRANT INSERT, UPDATE ON outbox_relay_owners TO {role}"
        ))
        .await
        .expect("grant the rights");
    broker.inbox().wait_ids(&[id], WAIT).await;
    relay.stop().await;
}
