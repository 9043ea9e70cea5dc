//! One seeded schedule: the settings, the writers, the faults and the
//! operators, then a calm phase and a cure phase, then the checks.

use super::backend::SimBackend;
use super::check;
use super::db::admin;
use super::faults;
use super::fold;
use super::params::{Focus, Params};
use super::upgrade::{self, Upgrade};
use super::world::{BrokerKind, EventFacts, FoldCounts, Poison, Shared, World, lock};
use crate::config::{Config, MarkMode, SourceMode};
use crate::dead_letter::admin::Target;
use crate::relay::shards::{Balance, Shard};
use crate::telemetry::PipelineTelemetry;
use std::collections::BTreeSet;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// Counts over many schedules.
#[derive(Debug, Default)]
pub struct Totals {
    pub schedules: u64,
    pub events: u64,
    pub deliveries: u64,
    pub dead_letters: u64,
    pub incidents: u64,
    /// Auto mode's switches from polling back to CDC.
    pub switches: u64,
    /// Takeovers that started at once after a clean stop.
    pub clean_takeovers: u64,
    /// Stops not recorded as clean.
    pub unclean_stops: u64,
    /// Sends that waited for room in the broker client.
    pub waited_for_room: u64,
    /// Messages a broker client held and called back at a fence or close.
    pub called_back: u64,
    /// Deliveries of the stopping owner, of events whose only record is
    /// the WAL, repeated after its clean stop (the slot could not be told
    /// past an event left unsent).
    pub clean_stop_repeats: u64,
    /// What the folds did (`relay.mark = "ranges"`).
    pub folds: FoldCounts,
    pub simulated: Duration,
}

impl Totals {
    pub fn add(&mut self, t: &Totals) {
        self.schedules += t.schedules;
        self.events += t.events;
        self.deliveries += t.deliveries;
        self.dead_letters += t.dead_letters;
        self.incidents += t.incidents;
        self.switches += t.switches;
        self.clean_takeovers += t.clean_takeovers;
        self.unclean_stops += t.unclean_stops;
        self.waited_for_room += t.waited_for_room;
        self.called_back += t.called_back;
        self.clean_stop_repeats += t.clean_stop_repeats;
        self.folds.advances += t.folds.advances;
        self.folds.unsettled += t.folds.unsettled;
        self.folds.backlogs += t.folds.backlogs;
        self.folds.held += t.folds.held;
        self.folds.deleted_unsettled += t.folds.deleted_unsettled;
        self.folds.upgrades += t.folds.upgrades;
        self.simulated += t.simulated;
    }
}

impl fmt::Display for Totals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} schedules, {} committed events, {} deliveries, {} dead letters, {} incidents, {} switches from polling to CDC, {} takeovers after a clean stop, {} stops that were not clean, {} sends that waited for room, {} held sends called back, {} repeats after clean stops, {} fold rounds that moved the frontier ({} unsettled, deleting {} progress rows; {} rows held open) and {} that found a drain, {} switches from update to ranges, {:.0} simulated minutes",
            self.schedules,
            self.events,
            self.deliveries,
            self.dead_letters,
            self.incidents,
            self.switches,
            self.clean_takeovers,
            self.unclean_stops,
            self.waited_for_room,
            self.called_back,
            self.clean_stop_repeats,
            self.folds.advances,
            self.folds.unsettled,
            self.folds.deleted_unsettled,
            self.folds.held,
            self.folds.backlogs,
            self.folds.upgrades,
            self.simulated.as_secs_f64() / 60.0
        )
    }
}

/// What one schedule did, for the totals line.
fn totals(w: &World, simulated: Duration) -> Totals {
    Totals {
        schedules: 1,
        events: w.order.values().map(|v| v.len() as u64).sum(),
        deliveries: w.deliveries.len() as u64,
        dead_letters: w.letters.len() as u64,
        incidents: u64::from(w.incidents),
        switches: u64::from(w.switches),
        clean_takeovers: u64::from(w.clean_takeovers),
        waited_for_room: w.waited_for_room,
        called_back: w.called_back,
        unclean_stops: u64::from(w.unclean_stops),
        clean_stop_repeats: check::repeats_after_clean_stops(w),
        folds: w.progress.counts,
        simulated,
    }
}

/// Runs schedule `seed` of `focus`; `Err` is a printable report.
pub fn run(seed: u64, focus: Focus) -> Result<Totals, String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .map_err(|e| format!("cannot build a runtime: {e}"))?;
    // The relay's own jitter draws from this thread's generator.
    fastrand::seed(seed);
    let mut rng = fastrand::Rng::with_seed(seed);
    let params = Params::random(focus, &mut rng);
    let mut config = crate::config::load_str(&params.toml())
        .map_err(|e| format!("seed {seed}: the simulated configuration is invalid: {e}"))?;
    // Below what a configuration may say, to make a few events fill it.
    config.relay.max_in_flight_bytes = params.max_in_flight_bytes;
    let (config, fold_settings, upgrade) = upgrade::plan(seed, &params, config);
    let world: Shared = Arc::new(Mutex::new(World::new(
        seed,
        BrokerKind {
            gapless: params.kafka,
            topic_per_type: params.topic_per_type,
        },
        config.relay.confirm_timeout,
        params.mark != MarkMode::None,
    )));
    lock(&world).progress.settings = fold_settings;
    let outcome = rt.block_on(drive(
        seed,
        rng,
        params.clone(),
        (config, upgrade),
        world.clone(),
    ));
    let w = lock(&world);
    let mut problems = w.violations.clone();
    if let Err(e) = &outcome {
        problems.push(e.clone());
    }
    problems.extend(check::finally(&w, &params));
    problems.extend(check::nothing_repeated_after_a_clean_stop(&w));
    if problems.is_empty() {
        return Ok(totals(&w, outcome.unwrap_or_default()));
    }
    let mut report = format!(
        "simulation seed {seed} failed ({params:?}):\n  - {}\n  last events:\n",
        problems.join("\n  - ")
    );
    // Replaying one seed prints the whole history.
    let keep = if std::env::var("OUTBOX_RELAY_SIM_SEED").is_ok() {
        usize::MAX
    } else {
        120
    };
    for line in w
        .log
        .iter()
        .rev()
        .take(keep)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
    {
        report.push_str("    ");
        report.push_str(line);
        report.push('\n');
    }
    Err(report)
}

pub(super) struct Instance {
    pub(super) id: usize,
    handle: Option<JoinHandle<()>>,
    token: CancellationToken,
}

impl Instance {
    pub(super) fn start(world: &Shared, config: &Config, id: usize) -> Instance {
        let token = CancellationToken::new();
        let backend = SimBackend {
            world: world.clone(),
            instance: id,
            config: config.clone(),
        };
        let t = token.clone();
        let folding = lock(world)
            .progress
            .settings
            .map(|s| fold::run(world.clone(), id, s, token.clone()));
        let (w, fold_world) = (world.clone(), world.clone());
        let handle = tokio::spawn(async move {
            let telemetry = PipelineTelemetry::new(&backend.config);
            let run = crate::relay::supervise::supervise(
                &backend.config,
                &backend,
                Shard::whole(),
                Balance::unlimited(),
                telemetry,
                t,
            );
            let folding = async move {
                if let Some(f) = folding {
                    f.await
                }
            };
            tokio::join!(
                reporting_panics(w, format!("instance {id}"), run),
                reporting_panics(fold_world, format!("instance {id}'s fold"), folding),
            );
        });
        lock(world).note(format!("instance {id} starts"));
        Instance {
            id,
            handle: Some(handle),
            token,
        }
    }

    /// SIGKILL: the task stops at whatever await it is in; its sessions and
    /// connections end.
    pub(super) async fn crash(&mut self, world: &Shared) {
        {
            // The session ends with the process: before its task is
            // dropped, so the drop does not count the incident again.
            let mut w = lock(world);
            w.note(format!("instance {} crashes", self.id));
            w.incident();
            w.end_sessions(self.id);
            w.release_fold_lock(self.id);
        }
        if let Some(h) = self.handle.take() {
            h.abort();
            let _ = h.await;
        }
        lock(world).kill_conns_of(self.id);
    }

    /// SIGTERM: drain, record, exit.
    pub(super) async fn stop(&mut self, world: &Shared) -> Result<(), String> {
        lock(world).stopping.insert(self.id);
        self.token.cancel();
        if let Some(h) = self.handle.take()
            && tokio::time::timeout(Duration::from_secs(120), h)
                .await
                .is_err()
        {
            return Err(format!(
                "instance {} did not stop within 120 s of SIGTERM",
                self.id
            ));
        }
        let mut w = lock(world);
        w.stopping.remove(&self.id);
        w.note(format!("instance {} stopped", self.id));
        // What waits at the stop keeps the slot before it: the events
        // confirmed behind it are sent again by the next owner.
        w.pin_waiting();
        w.kill_conns_of(self.id);
        w.end_sessions(self.id);
        Ok(())
    }
}

/// Runs `task`; a panic in it is a violation (a bug, whatever the
/// guarantees say afterwards), reported as `who` panicked.
async fn reporting_panics(world: Shared, who: String, task: impl Future<Output = ()>) {
    use futures::FutureExt;
    if let Err(panic) = std::panic::AssertUnwindSafe(task).catch_unwind().await {
        let message = panic
            .downcast_ref::<&str>()
            .map(|m| (*m).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        lock(&world).violation(format!("{who} panicked: {message}"));
    }
}

/// The whole schedule; returns the simulated time it took.
async fn drive(
    seed: u64,
    mut rng: fastrand::Rng,
    params: Params,
    (mut config, mut upgrade): (Config, Option<Upgrade>),
    world: Shared,
) -> Result<Duration, String> {
    let started = Instant::now();
    let broker = tokio::spawn(broker(world.clone()));
    let mut instances: Vec<Instance> = (0..params.instances)
        .map(|i| Instance::start(&world, &config, i))
        .collect();
    let writers = tokio::spawn(write(
        world.clone(),
        fastrand::Rng::with_seed(seed.wrapping_mul(31).wrapping_add(7)),
        params.clone(),
    ));
    for n in 0..params.faults {
        tokio::time::sleep(faults::gap(&params, &mut rng)).await;
        if let Some(u) = upgrade.take_if(|u| u.before_fault == n) {
            config = u.perform(&world, &mut instances).await?;
        }
        faults::fault(&world, &config, &params, &mut rng, &mut instances).await;
    }
    if let Some(u) = upgrade {
        // After the last fault, or in a schedule without any.
        tokio::time::sleep(u.delay).await;
        u.perform(&world, &mut instances).await?;
    }
    writers
        .await
        .map_err(|e| format!("the writers failed: {e}"))?;
    {
        let mut w = lock(&world);
        w.broker_down = false;
        w.busy_topics.clear();
        w.note("calm: no more faults".into());
    }
    // Calm: every refused event ends in the dead-letter table or is delivered.
    wait_until(&world, Duration::from_secs(1800), "calm phase", |w| {
        check::quiescent(w, &params)
    })
    .await?;
    cure(&world);
    redrive_until_delivered(&world, params.long_looks.then_some(&config), &mut instances).await?;
    // Every row is marked in the end (a restart re-sends what was
    // confirmed but not marked), then every instance stops cleanly.
    let marks = params.mark != MarkMode::None;
    wait_until(
        &world,
        Duration::from_secs(600),
        "marking of delivered rows",
        |w| !marks || w.unsent().next().is_none(),
    )
    .await?;
    // With ranges, the fold catches up: every progress row folded, no row
    // held open.
    wait_until(
        &world,
        Duration::from_secs(600),
        "fold of every progress row",
        |w| params.mark != MarkMode::Ranges || w.fold_caught_up(),
    )
    .await?;
    // Nothing left to send: the slot holds no WAL back (a held-back or
    // dead-lettered event included, which the table keeps).
    let streams = params.mode != SourceMode::Polling;
    wait_until(
        &world,
        Duration::from_secs(600),
        "slot's confirmed position, to the end of the WAL,",
        |w| !streams || w.cdc_blocked || w.slot_confirmed >= w.insert_lsn(),
    )
    .await?;
    for i in instances.iter_mut() {
        i.stop(&world).await?;
    }
    broker.abort();
    Ok(started.elapsed())
}

/// The broker takes everything now, and operators correct the unreadable
/// rows, in the table and in the letters.
fn cure(world: &Shared) {
    let mut w = lock(world);
    w.note("cure: the broker accepts everything; redrive all".into());
    for e in w.events.values_mut() {
        e.poison = Poison::None;
    }
    for l in w.letters.iter_mut() {
        l.raw.headers = Some("{}".into());
    }
    for r in w.rows.values_mut() {
        r.headers = "{}".into();
    }
}

/// Operators redrive every letter until every event is delivered. With
/// `long_looks` (the relay's configuration, run with looks an hour apart)
/// every instance restarts, cleanly, first and after each new request, and
/// so looks at once; from there on only the looks the relay hurries move
/// the redrive on, and the deadline (half an hour) holds it to that: a
/// redrive that waited for the periodic look would miss it.
async fn redrive_until_delivered(
    world: &Shared,
    long_looks: Option<&Config>,
    instances: &mut [Instance],
) -> Result<(), String> {
    let long_looks = long_looks.map(|c| {
        let mut c = c.clone();
        c.dead_letter.refresh_interval = Duration::from_secs(3600);
        c
    });
    let deadline = Instant::now() + Duration::from_secs(1800);
    let mut first = true;
    loop {
        let unasked = std::mem::take(&mut first) || admin::unasked(&lock(world));
        if lock(world).open_letters().next().is_some() {
            let _ = admin::redrive(world, &Target::All);
        }
        if let Some(config) = long_looks.as_ref().filter(|_| unasked) {
            for i in instances.iter_mut() {
                i.stop(world).await?;
                *i = Instance::start(world, config, i.id);
            }
        }
        if check::all_delivered(&lock(world)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(
                "liveness: after the cure and redrives, events were still undelivered after 30 simulated minutes"
                    .into(),
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_until(
    world: &Shared,
    limit: Duration,
    what: &str,
    done: impl Fn(&World) -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + limit;
    loop {
        if done(&lock(world)) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!(
                "liveness: the {what} did not settle within {} simulated seconds",
                limit.as_secs()
            ));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The broker: delivers and confirms when due.
async fn broker(world: Shared) {
    loop {
        let (notify, next) = {
            let w = lock(&world);
            (w.broker_notify.clone(), w.next_broker_step())
        };
        let woken = notify.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        match next {
            Some(at) if at <= Instant::now() => {}
            Some(at) => {
                tokio::select! {
                    biased;
                    _ = woken => {}
                    _ = tokio::time::sleep_until(at) => {}
                }
            }
            None => woken.await,
        }
        lock(&world).broker_step(Instant::now());
    }
}

/// Applications: transactions over a few aggregates, serialised per aggregate,
/// some held open (committing out of `relay_seq` order), some rolled back.
async fn write(world: Shared, mut rng: fastrand::Rng, params: Params) {
    let busy: Arc<Mutex<BTreeSet<usize>>> = Arc::default();
    let mut open = Vec::new();
    let mut n = 0u64;
    for _ in 0..params.transactions {
        tokio::time::sleep(Duration::from_millis(rng.u64(0..60))).await;
        let free: Vec<usize> = {
            let b = busy.lock().unwrap_or_else(|e| e.into_inner());
            (0..params.aggregates).filter(|a| !b.contains(a)).collect()
        };
        if free.is_empty() {
            continue;
        }
        let mine = pick_aggregates(&mut rng, &free);
        busy.lock()
            .unwrap_or_else(|e| e.into_inner())
            .extend(mine.iter().copied());
        let xid = {
            let mut w = lock(&world);
            let xid = w.begin();
            for _ in 0..rng.usize(1..4) {
                let a = mine[rng.usize(0..mine.len())];
                n += 1;
                write_event(&mut w, xid, &format!("e{n}"), a, &mut rng, &params);
            }
            xid
        };
        let hold = if rng.u32(0..4) == 0 {
            Duration::from_millis(rng.u64(0..800))
        } else {
            Duration::ZERO
        };
        let abort = rng.u32(0..10) == 0;
        let (shared, busy) = (world.clone(), busy.clone());
        open.push(tokio::spawn(async move {
            tokio::time::sleep(hold).await;
            let mut w = lock(&shared);
            if abort {
                w.abort(xid);
            } else {
                w.commit(xid);
            }
            let mut b = busy.lock().unwrap_or_else(|e| e.into_inner());
            for a in mine {
                b.remove(&a);
            }
        }));
        if rng.u32(0..5) == 0 {
            lock(&world).unrelated_commit();
        }
    }
    for t in open {
        let _ = t.await;
    }
}

/// One to three aggregates of the `free` ones.
fn pick_aggregates(rng: &mut fastrand::Rng, free: &[usize]) -> Vec<usize> {
    let mut mine: Vec<usize> = Vec::new();
    for _ in 0..rng.usize(1..4) {
        let a = free[rng.usize(0..free.len())];
        if !mine.contains(&a) {
            mine.push(a);
        }
    }
    mine
}

/// One event of aggregate `a` in transaction `xid`, as a row or a logical
/// message, perhaps poisoned.
fn write_event(
    w: &mut World,
    xid: u64,
    id: &str,
    a: usize,
    rng: &mut fastrand::Rng,
    params: &Params,
) {
    let poison = match rng.u32(0..100) {
        0..2 if params.dead_letter => Poison::RefuseAfterSend,
        2..3 if params.dead_letter => Poison::RefuseBeforeSend,
        3..4 if params.dead_letter => Poison::BadRow,
        4..9 => Poison::Flaky(rng.u32(1..4)),
        _ => Poison::None,
    };
    let headers = if poison == Poison::BadRow {
        "[1]"
    } else {
        "{}"
    };
    w.events.insert(
        id.to_owned(),
        EventFacts {
            aggregate: format!("a{a}"),
            committed: false,
            aborted: false,
            poison,
            refusals: 0,
            refusals_seen: 0,
            nacks: 0,
            dropped: false,
            poisoned: poison != Poison::None,
            message: false,
        },
    );
    let event_type = ["Created", "Changed", "Closed"][rng.usize(0..3)];
    if params.as_message(a, rng) {
        if let Some(facts) = w.events.get_mut(id) {
            facts.message = true;
        }
        w.emit_message(xid, id, &format!("a{a}"), event_type, headers);
    } else {
        w.insert(xid, id, &format!("a{a}"), event_type, headers);
    }
}
