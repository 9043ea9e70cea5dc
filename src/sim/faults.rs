//! Faults and operator actions, one at a time, between the writers' commits.

use super::db::admin;
use super::params::{Focus, Params};
use super::scenario::Instance;
use super::world::{Shared, lock};
use crate::config::{Config, MarkMode, SourceMode};
use crate::dead_letter::admin::Target;
use std::time::Duration;
use tokio::time::Instant;

/// One fault or operator action.
pub(super) async fn fault(
    world: &Shared,
    config: &Config,
    params: &Params,
    rng: &mut fastrand::Rng,
    instances: &mut [Instance],
) {
    let i = rng.usize(0..instances.len());
    if params.focus == Focus::HandOver {
        return broker_stall(world, config, params, rng, &mut instances[i]).await;
    }
    if params.mode == SourceMode::Auto && rng.bool() {
        return toggle_cdc(world);
    }
    match rng.u32(0..10) {
        0 | 1 => crash(world, config, params, rng, &mut instances[i]).await,
        2 => session_goes_silent(world, config, rng),
        3 => {
            let mut w = lock(world);
            w.note(format!("instance {i} loses its broker connections"));
            w.incident();
            w.kill_conns_of(instances[i].id);
        }
        4 if rng.bool() => broker_outage(world, rng).await,
        4 => broker_stall(world, config, params, rng, &mut instances[i]).await,
        // Drawn from a generator of its own, so that the rest of the
        // schedule stays as it was before this fault existed.
        5 if params.kafka && fastrand::Rng::with_seed(rng.get_seed() ^ 0x401d_5eed).bool() => {
            leaders_move(world, config, rng, instances[i].id);
        }
        5 if params.kafka => broker_stall(world, config, params, rng, &mut instances[i]).await,
        5 => {
            let topic = lock(world).topic(["Created", "Changed", "Closed"][rng.usize(0..3)]);
            lock(world).busy_topics.insert(topic.clone());
            lock(world).note(format!("queue of {topic} full"));
            tokio::time::sleep(Duration::from_millis(rng.u64(100..3_000))).await;
            lock(world).busy_topics.remove(&topic);
        }
        6 => restart(world, config, &mut instances[i]).await,
        7 | 8 => resolve_a_dead_letter(world, rng).await,
        9 if params.mode != SourceMode::Polling && rng.bool() => {
            // The replication connection drops, between two messages of a
            // transaction as likely as not; or the database restarts.
            let mut w = lock(world);
            if rng.u32(0..3) == 0 {
                w.database_restart();
            } else if let Some(id) = w.slot_active {
                w.note(format!("stream {id} loses its connection"));
                w.incident();
                w.cut_stream = Some(id);
            }
        }
        _ => {
            for _ in 0..rng.usize(1..20) {
                lock(world).unrelated_commit();
            }
        }
    }
}

/// The time before the next fault. Hand-over schedules leave a gap longer
/// than `relay.ownership_lease` now and then, so that the owner stopped
/// next has waited out its predecessor's lease and may stop cleanly.
pub(super) fn gap(params: &Params, rng: &mut fastrand::Rng) -> Duration {
    let ms = if params.focus == Focus::HandOver && rng.u32(0..3) == 0 {
        rng.u64(3_400..5_000)
    } else {
        rng.u64(50..1_000)
    };
    Duration::from_millis(ms)
}

/// SIGTERM, then the instance starts again at once.
async fn restart(world: &Shared, config: &Config, instance: &mut Instance) {
    lock(world).incident();
    if let Err(e) = instance.stop(world).await {
        lock(world).violation(e);
    }
    *instance = Instance::start(world, config, instance.id);
}

/// The ownership session ends, the process does not notice yet; half the
/// time silently (a network cut: its statements never answer) while its
/// broker client has no room, or (Kafka's) holds what it is given, for a
/// while: past its lease and a new owner's first sends.
fn session_goes_silent(world: &Shared, config: &Config, rng: &mut fastrand::Rng) {
    let room_in = config.relay.ownership_lease * rng.u32(10..25) / 10;
    let mut w = lock(world);
    let reign = w.lock_reign;
    let owner = reign.and_then(|r| w.reign_instance.get(&r).copied());
    if let (Some(o), Some(r)) = (owner, reign) {
        w.incident();
        w.end_sessions(o);
        if rng.bool() {
            w.silent_reigns.insert(r);
            let holds = w.broker_kind.gapless && rng.bool();
            let (what, until) = if holds {
                ("holds what it is given", &mut w.holds)
            } else {
                ("has no room", &mut w.no_room)
            };
            until.insert(o, Instant::now() + room_in);
            if holds {
                // Every partition.
                w.held_partitions.remove(&o);
            }
            w.note(format!(
                "reign {r}'s session goes silent, and instance {o}'s broker client {what} for {room_in:?}"
            ));
        }
    }
}

/// Leaders move while the ownership session stays healthy: the client of
/// `instance` holds what it is given for the partitions whose leaders
/// moved (half the time every partition, else a third, a half or a
/// quarter of them) until they are elected, at times past
/// `relay.confirm_timeout`. Messages of the other partitions, sent later,
/// go on to the broker. No incident of its own: a confirmation given up
/// on ends the run, whose end counts one, and calls back what is held.
fn leaders_move(world: &Shared, config: &Config, rng: &mut fastrand::Rng, instance: usize) {
    let timeout = config.relay.confirm_timeout.as_millis() as u64;
    let hold = Duration::from_millis(rng.u64(timeout / 4..timeout * 2));
    // Drawn from a generator of its own, as the fault's choice is.
    let mut own = fastrand::Rng::with_seed(rng.get_seed() ^ 0x9a27_1710);
    let some = own.bool().then(|| {
        let of = own.u64(2..5);
        (of, own.u64(0..of))
    });
    let mut w = lock(world);
    w.holds.insert(instance, Instant::now() + hold);
    let which = match some {
        Some((of, is)) => {
            w.held_partitions.insert(instance, (of, is));
            format!("the partitions whose hash modulo {of} is {is}")
        }
        None => {
            w.held_partitions.remove(&instance);
            "every partition".to_owned()
        }
    };
    w.note(format!(
        "instance {instance}'s broker client holds what it is given for {which} for {hold:?} (leaders move)"
    ));
}

/// The broker pauses (a long collection, a slow disk): what is sent
/// meanwhile lands after the pause, in no order across connections; now and
/// then an instance is restarted during it, so that a short
/// `relay.shutdown_timeout` leaves messages on the way. The pause stays
/// under a tenth of `relay.ownership_lease`: a new owner that waits out a
/// lease publishes that much after the last message the previous one sent.
/// Hand-over schedules restart an instance in every pause, half the time
/// after its run failed.
async fn broker_stall(
    world: &Shared,
    config: &Config,
    params: &Params,
    rng: &mut fastrand::Rng,
    instance: &mut Instance,
) {
    let pause_ms = rng.u64(150..250);
    pause_broker(world, config, pause_ms);
    match params.focus {
        Focus::Mixed if rng.u32(0..3) == 0 => {}
        Focus::HandOver if rng.bool() => {
            // The run fails with messages sent into the pause; the instance
            // claims the outbox again and waits out its own lease, and is
            // stopped during that wait: the next owner must wait as well.
            tokio::time::sleep(Duration::from_millis(rng.u64(10..40))).await;
            lock(world).drop_conns_of(instance.id);
            let wait = rng.u64(60..120).min(pause_ms - 50);
            tokio::time::sleep(Duration::from_millis(wait)).await;
            restart(world, config, instance).await;
        }
        _ => restart_during(pause_ms, world, config, rng, instance).await,
    }
}

/// Restarts `instance` late enough in a pause of `pause_ms` for messages to
/// be sent into it, early enough for the pause to outlast a short shutdown
/// timeout.
async fn restart_during(
    pause_ms: u64,
    world: &Shared,
    config: &Config,
    rng: &mut fastrand::Rng,
    instance: &mut Instance,
) {
    tokio::time::sleep(Duration::from_millis(rng.u64(20..pause_ms - 105))).await;
    restart(world, config, instance).await;
}

/// The broker pauses from now for `pause_ms`.
fn pause_broker(world: &Shared, config: &Config, pause_ms: u64) {
    let pause = Duration::from_millis(pause_ms);
    debug_assert!(pause + Duration::from_millis(20) < config.relay.ownership_lease / 10);
    let mut w = lock(world);
    w.stalled_until = Some(Instant::now() + pause);
    w.note(format!("the broker pauses for {pause:?}"));
}

/// The server stops or starts allowing logical replication (auto mode).
fn toggle_cdc(world: &Shared) {
    let mut w = lock(world);
    w.cdc_blocked = !w.cdc_blocked;
    if w.cdc_blocked {
        // A stream that ends leaves what was in flight unconfirmed.
        w.incident();
    }
    let now = if w.cdc_blocked {
        "impossible"
    } else {
        "possible again"
    };
    w.note(format!("logical replication {now}"));
}

/// A crash, and a restart after a while; meanwhile the slot may be lost.
async fn crash(
    world: &Shared,
    config: &Config,
    params: &Params,
    rng: &mut fastrand::Rng,
    instance: &mut Instance,
) {
    instance.crash(world).await;
    tokio::time::sleep(Duration::from_millis(rng.u64(0..1_500))).await;
    // While no relay streams, WAL the slot needed may be removed
    // (max_slot_wal_keep_size); with rows marked the relay recreates
    // the slot and the table holds what the lost WAL did.
    // Not with logical messages: a lost slot stops the relay then.
    if params.mode != SourceMode::Polling
        && params.mark != MarkMode::None
        && !params.messages
        && rng.u32(0..4) == 0
    {
        let mut w = lock(world);
        if w.slot_active.is_none() {
            w.note("the slot is lost".into());
            w.slot_lost = true;
        }
    }
    *instance = Instance::start(world, config, instance.id);
}

/// The broker goes away for a while, with every connection.
async fn broker_outage(world: &Shared, rng: &mut fastrand::Rng) {
    {
        let mut w = lock(world);
        w.note("broker outage".into());
        w.incident();
        w.broker_down = true;
        w.kill_all_conns();
    }
    tokio::time::sleep(Duration::from_millis(rng.u64(200..4_000))).await;
    let mut w = lock(world);
    w.broker_down = false;
    w.note("broker back".into());
}

/// The operator redrives or drops dead letters: one, an aggregate's, or all.
async fn resolve_a_dead_letter(world: &Shared, rng: &mut fastrand::Rng) {
    let (by_id, by_aggregate) = {
        let w = lock(world);
        let open: Vec<_> = w.open_letters().collect();
        if open.is_empty() {
            return;
        }
        let l = open[rng.usize(0..open.len())];
        (l.event_id.clone(), l.aggregate.clone())
    };
    let target = match rng.u32(0..3) {
        0 => Target::Id(by_id),
        1 => Target::Aggregate(by_aggregate),
        _ => Target::All,
    };
    if rng.u32(0..4) == 0 {
        // A transaction per batch, the relay going on between them.
        while admin::drop_batch(world, &target, 2) == 2 {
            tokio::time::sleep(Duration::from_millis(rng.u64(0..50))).await;
        }
    } else if let (Target::Aggregate(aggregate), 0) = (&target, rng.u32(0..2)) {
        request_oldest_by_hand(world, aggregate);
    } else if let Err(refused) = admin::redrive(world, &target) {
        lock(world).note(format!("redrive refused: {refused}"));
    }
}

/// The operator asks for the aggregate's oldest open letter only, by hand
/// in SQL (or a relay of an earlier version wrote followers unrequested):
/// the relay's looks extend the request to the followers.
fn request_oldest_by_hand(world: &Shared, aggregate: &str) {
    let mut w = lock(world);
    let Some(l) = w
        .letters
        .iter_mut()
        .find(|l| l.resolution.is_none() && l.aggregate == aggregate)
    else {
        return;
    };
    l.requested = true;
    let note = format!(
        "the oldest letter of {aggregate}, {}, requested by hand",
        l.event_id
    );
    w.note(note);
}
