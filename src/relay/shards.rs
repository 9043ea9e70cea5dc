//! Virtual shards: several instances sharing one (polling) outbox.
//!
//! The outbox is split by a hash of `aggregate_id` into `relay.shards`
//! parts; each part has its own ownership lock and pipeline, so an aggregate
//! is always published by one owner, in order. Instances count each other
//! through member locks (two-key advisory locks, visible in `pg_locks`) and
//! aim for an even share, ceil(shards / instances): one that holds more
//! releases the extra shards (draining them first) and one that holds fewer
//! takes free ones. When an instance dies, its sessions and locks go, and
//! the others take its shards within `relay.standby_poll` or two.
//!
//! An instance whose shard runs keep failing (its broker unreachable from
//! where it runs, say) steps back for a while ([`Balance::step_back`]): it
//! gives up its member lock, so the others count one instance fewer and
//! take its shards, then it joins again and tries once more.
//!
//! An instance without shards, or with another count, is kept out by a
//! shared lock on the outbox's ownership key and by the member locks:
//! the member session holds them, and so does each shard's ownership
//! session ([`guard`]), since a shard drains on after the member session
//! is gone (a stop ends it at once).

use crate::config::Config;
use crate::db::DbError;
pub use crate::outbox::Shard;
use crate::telemetry::health::PipelineHealth;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_postgres::Client;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

/// Member slots available (instances beyond this wait as standbys).
const MEMBER_SLOTS: i32 = 256;

/// The member-lock slot each shard's ownership session and the member
/// session hold (shared), past the members' own: counted by no one, seen
/// by an instance with another shard count.
const GUARD_SLOT: i32 = MEMBER_SLOTS;

/// How many shards this instance holds, and how many it should.
#[derive(Debug)]
pub struct Balance {
    target: AtomicUsize,
    owned: AtomicUsize,
    /// Until when this instance stays out of the count of members.
    stepped_back_until: Mutex<Option<Instant>>,
}

impl Balance {
    /// One instance owning everything (no sharding).
    pub fn unlimited() -> Arc<Balance> {
        Arc::new(Balance {
            target: AtomicUsize::new(usize::MAX),
            owned: AtomicUsize::new(0),
            stepped_back_until: Mutex::new(None),
        })
    }

    fn new(target: usize) -> Arc<Balance> {
        Arc::new(Balance {
            target: AtomicUsize::new(target),
            owned: AtomicUsize::new(0),
            stepped_back_until: Mutex::new(None),
        })
    }

    /// May this instance take one more shard?
    pub fn may_acquire(&self) -> bool {
        self.owned.load(Ordering::SeqCst) < self.target.load(Ordering::SeqCst)
    }

    pub fn acquired(&self) {
        self.owned.fetch_add(1, Ordering::SeqCst);
    }

    pub fn released(&self) {
        let _ = self
            .owned
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
    }

    /// Claims the duty to give one shard back when over target; at most
    /// `owned - target` callers get `true`.
    pub fn should_release(&self) -> bool {
        let target = self.target.load(Ordering::SeqCst);
        self.owned
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n > target).then(|| n - 1)
            })
            .is_ok()
    }

    pub fn owned(&self) -> usize {
        self.owned.load(Ordering::SeqCst)
    }

    /// Steps this instance back from sharing for `wait`, unless it already
    /// is: its runs keep failing, so its shards go to the other instances
    /// (if there are any) meanwhile. True when this call began it.
    pub fn step_back(&self, wait: Duration) -> bool {
        let mut until = self
            .stepped_back_until
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        if until.is_some_and(|t| now < t) {
            return false;
        }
        *until = Some(now + wait);
        true
    }

    pub fn stepping_back(&self) -> bool {
        self.stepped_back_until
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some_and(|t| Instant::now() < t)
    }
}

/// How long an instance whose shard runs keep failing stays out: long
/// enough for another to take its shards, wait out its lease and publish.
pub fn step_back_wait(relay: &crate::config::RelayConfig) -> Duration {
    relay
        .retry_max
        .max(relay.standby_poll * 10)
        .max(relay.ownership_lease * 3)
}

/// Runs one supervised pipeline per shard, balanced with other instances.
pub async fn run(
    config: &Config,
    telemetry: crate::telemetry::PipelineTelemetry,
    shutdown: CancellationToken,
) {
    let count = config.relay.shards;
    // Nothing is taken before this instance is a member (see count_members).
    let balance = Balance::new(0);
    // Both are aborted when this future is dropped, like a single-pipeline relay.
    let _members = AbortOnDropHandle::new(tokio::spawn(count_members(
        config.clone(),
        balance.clone(),
        telemetry.health.clone(),
        shutdown.clone(),
    )));
    let mut workers = JoinSet::new();
    for index in 0..count {
        let (config, balance, shutdown) = (config.clone(), balance.clone(), shutdown.clone());
        let telemetry = telemetry.clone();
        let shard = Shard { index, count };
        workers.spawn(async move {
            super::supervise_shard(&config, shard, balance, telemetry, shutdown).await
        });
    }
    while workers.join_next().await.is_some() {}
}

/// The key under which [`PipelineHealth`] keeps the member session's
/// failure, beside the shards' own.
const MEMBERSHIP: u32 = u32::MAX;

/// Why this instance does not share the shards (yet).
#[derive(Debug, thiserror::Error)]
enum NotShared {
    /// Another instance is in the way: this one waits, a healthy standby.
    #[error("{0}")]
    Waiting(String),
    #[error(transparent)]
    Db(#[from] DbError),
}

/// Holds a member lock and keeps the target share up to date; tells
/// `health` when the member session fails (a standby kept out by an
/// instance with other shard settings is healthy).
async fn count_members(
    config: Config,
    balance: Arc<Balance>,
    health: Arc<PipelineHealth>,
    shutdown: CancellationToken,
) {
    let base = crate::outbox::ownership_key(&config.outbox.table);
    let count = config.relay.shards as usize;
    loop {
        let result = match member_session(&config, &base, count).await {
            Ok((client, slot)) => {
                tracing::info!(
                    member = slot,
                    shards = count,
                    "sharing the outbox's shards with other instances"
                );
                health.healthy(MEMBERSHIP);
                let member = Member {
                    client: &client,
                    base: &base,
                    count,
                };
                match member.share(&balance, slot, &config, &shutdown).await {
                    Ok(()) => return,
                    Err(e) => Err(e),
                }
            }
            Err(e) => Err(e),
        };
        // Without a member session, hold nothing: give every shard back.
        balance.target.store(0, Ordering::SeqCst);
        match result {
            Err(NotShared::Waiting(why)) => {
                health.healthy(MEMBERSHIP);
                tracing::warn!(reason = %why, "cannot share the outbox's shards yet; waiting");
            }
            Err(NotShared::Db(e)) => {
                health.failing(MEMBERSHIP, &format!("sharing the outbox's shards: {e}"));
                tracing::warn!(error = %e, "cannot share the outbox's shards; retrying");
            }
            Ok(()) => {}
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(config.relay.standby_poll) => {}
        }
    }
}

/// This instance's member session.
struct Member<'a> {
    client: &'a Client,
    base: &'a str,
    count: usize,
}

impl Member<'_> {
    /// Keeps the target share up to date, stepping out of the count of
    /// members while the balance says so; returns on shutdown.
    async fn share(
        &self,
        balance: &Balance,
        slot: i32,
        config: &Config,
        shutdown: &CancellationToken,
    ) -> Result<(), NotShared> {
        let mut slot = Some(slot);
        loop {
            match (balance.stepping_back(), slot) {
                (true, Some(held)) => {
                    self.client
                        .execute(
                            "SELECT pg_advisory_unlock(hashtext($1), $2)",
                            &[&member_key(self.base, self.count), &held],
                        )
                        .await
                        .map_err(|e| DbError::query("stepping back as a shard member", e))?;
                    slot = None;
                    tracing::info!(
                        "stepped out of the count of shard members while this instance's runs fail"
                    );
                }
                (false, None) => {
                    let held = register(self.client, self.base, self.count).await?;
                    tracing::info!(member = held, "sharing the outbox's shards again");
                    slot = Some(held);
                }
                _ => {}
            }
            let live = live_members(self.client, self.base, self.count).await?;
            let target = match slot {
                Some(_) => self.count.div_ceil(live.max(1)),
                // Out of the count: nothing while others share, everything alone.
                None if live > 0 => 0,
                None => self.count,
            };
            balance.target.store(target, Ordering::SeqCst);
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                _ = tokio::time::sleep(config.relay.standby_poll) => {}
            }
        }
    }
}

/// The key of the member locks of instances running with `count` shards.
fn member_key(base: &str, count: usize) -> String {
    format!("{base}:members:{count}")
}

/// Registers this instance: a shared lock on the outbox's ownership key (so
/// no instance without shards can be active at the same time, and the other
/// way round), a check that no instance runs with another shard count, and a
/// member slot.
async fn member_session(
    config: &Config,
    base: &str,
    count: usize,
) -> Result<(Client, i32), NotShared> {
    let client = crate::db::connect(&config.database, None).await?;
    let shared: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock_shared(hashtextextended($1, 0))",
            &[&base],
        )
        .await
        .map_err(|e| DbError::query("taking the shared ownership lock", e))?
        .get(0);
    if !shared {
        return Err(busy(
            "an instance without relay.shards is active on this outbox; waiting for it to stop",
        ));
    }
    // Seen by instances with another shard count for as long as the
    // session lasts, also while this one steps out of the count.
    client
        .execute(
            "SELECT pg_advisory_lock_shared(hashtext($1), $2)",
            &[&member_key(base, count), &GUARD_SLOT],
        )
        .await
        .map_err(|e| DbError::query("taking the shard members' shared lock", e))?;
    let slot = register(&client, base, count).await?;
    Ok((client, slot))
}

/// Takes a member slot on `client`'s session (which holds the shared
/// ownership lock), after checking that no instance runs with another
/// shard count.
async fn register(client: &Client, base: &str, count: usize) -> Result<i32, NotShared> {
    // Registering is one instance at a time: two starting together with
    // different shard counts would otherwise both find the other absent. (On
    // any error below the session ends, and the lock with it.)
    let registering = registering_key(base);
    client
        .execute(
            "SELECT pg_advisory_lock(hashtextextended($1, 0))",
            &[&registering],
        )
        .await
        .map_err(|e| DbError::query("waiting to register as a shard member", e))?;
    if let Some(other) = other_count(client, base, count).await? {
        return Err(busy(format!(
            "instances with relay.shards = {other} are running on this outbox; every instance must use the same value (this one has {count})"
        )));
    }
    let key = member_key(base, count);
    for slot in 0..MEMBER_SLOTS {
        let locked: bool = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtext($1), $2)",
                &[&key, &slot],
            )
            .await
            .map_err(|e| DbError::query("taking a member lock", e))?
            .get(0);
        if locked {
            client
                .execute(
                    "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
                    &[&registering],
                )
                .await
                .map_err(|e| DbError::query("registering as a shard member", e))?;
            return Ok(slot);
        }
    }
    Err(busy(format!("all {MEMBER_SLOTS} member slots are taken")))
}

/// The lock held while an instance registers, or a shard's guard checks,
/// so that each sees the others' shard counts.
fn registering_key(base: &str) -> String {
    format!("{base}:registering")
}

/// How often a shard's guard tries for its turn before the next poll.
const GUARD_TRIES: usize = 8;

/// A shard count other than `count` some instance holds member locks of
/// (its member session, or a shard's guard).
async fn other_count(client: &Client, base: &str, count: usize) -> Result<Option<i32>, DbError> {
    let other = client
        .query_opt(
            "SELECT m FROM generate_series(2, 256) AS m
             WHERE m <> $2 AND EXISTS (
                 SELECT 1 FROM pg_locks l
                 WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
                   AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
                   AND l.classid = hashtext($1 || ':members:' || m)::oid)
             LIMIT 1",
            &[&base, &(count as i32)],
        )
        .await
        .map_err(|e| DbError::query("looking for instances with other shard counts", e))?;
    Ok(other.map(|r| r.get(0)))
}

/// Sharing must wait: another instance is in the way.
fn busy(message: impl Into<String>) -> NotShared {
    NotShared::Waiting(message.into())
}

/// Taken on a shard's ownership session once it holds the shard: the
/// locks that keep instances without shards, or with another count, from
/// taking the outbox, as the member session does. A member session can go
/// (a stop, a lost connection) while its shards still drain; their own
/// sessions then still keep the others out. False when an instance
/// without shards holds the outbox, or one with another shard count runs:
/// this instance's own count may be out of date (its member session died
/// unnoticed, and another count registered meanwhile). Checked as
/// registering is, one instance at a time: false too while another
/// instance registers (the next poll tries again). On an error the caller
/// drops the session, and the locks with it.
pub async fn guard(client: &Client, base: &str, count: usize) -> Result<bool, DbError> {
    let registering = registering_key(base);
    // Held for a few statements at a time: this instance's other shards,
    // taken at once after a failover, wait their turn briefly.
    let mut turn = false;
    for _ in 0..GUARD_TRIES {
        turn = client
            .query_one(
                "SELECT pg_try_advisory_lock(hashtextextended($1, 0))",
                &[&registering],
            )
            .await
            .map_err(|e| DbError::query("checking the shard counts", e))?
            .get(0);
        if turn {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(fastrand::u64(10..60))).await;
    }
    if !turn {
        return Ok(false);
    }
    let held: bool = client
        .query_one(
            "SELECT pg_try_advisory_lock_shared(hashtextextended($1, 0))
                    AND pg_try_advisory_lock_shared(hashtext($2), $3)",
            &[&base, &member_key(base, count), &GUARD_SLOT],
        )
        .await
        .map_err(|e| DbError::query("taking the shard's shared ownership locks", e))?
        .get(0);
    let alone = held && other_count(client, base, count).await?.is_none();
    client
        .execute(
            "SELECT pg_advisory_unlock(hashtextextended($1, 0))",
            &[&registering],
        )
        .await
        .map_err(|e| DbError::query("checking the shard counts", e))?;
    Ok(alone)
}

async fn live_members(client: &Client, base: &str, count: usize) -> Result<usize, DbError> {
    let n: i64 = client
        .query_one(
            "SELECT count(*) FROM pg_locks
             WHERE locktype = 'advisory' AND objsubid = 2 AND granted AND objid <> $2::int::oid
               AND classid = hashtext($1)::oid AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
            &[&member_key(base, count), &GUARD_SLOT],
        )
        .await
        .map_err(|e| DbError::query("counting relay instances", e))?
        .get(0);
    Ok(usize::try_from(n).unwrap_or(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balance_gives_back_only_the_excess() {
        let b = Balance::new(4);
        for _ in 0..4 {
            assert!(b.may_acquire());
            b.acquired();
        }
        assert!(!b.may_acquire());
        b.target.store(2, Ordering::SeqCst);
        assert!(b.should_release());
        assert!(b.should_release());
        assert!(
            !b.should_release(),
            "only owned - target shards are given back"
        );
        assert_eq!(b.owned(), 2);
    }

    #[test]
    fn shard_conditions_and_keys() {
        assert_eq!(Shard::whole().condition("\"aggregate_id\""), None);
        assert_eq!(Shard::whole().lock_key("k"), "k");
        let s = Shard { index: 2, count: 4 };
        assert_eq!(s.lock_key("k"), "k:shard:2/4");
        assert!(s.condition("\"a\"").unwrap().ends_with("% 4 = 2"));
    }
}
