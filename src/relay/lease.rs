//! Fencing: an owner publishes only while it can prove it still owns the outbox.
//!
//! Ownership is a session advisory lock. An instance can lose its session
//! (terminated backend, network cut) while its reader and broker
//! connections still work; without fencing it would go on publishing next to
//! the standby that took the lock over. So publishing is bound to a lease:
//! every answered round trip on the ownership session (a mark, a dead
//! letter, a poll for visibility, or a heartbeat when nothing else renewed
//! the lease for a quarter of it) proves the lock was held when it was
//! sent, and extends the lease to that moment plus `relay.ownership_lease`. The
//! pipeline sends nothing once the lease ran out, until a round trip renews it;
//! what the broker client still holds to write then is called back
//! ([`crate::sink::Sink::fence`]) and sent again in the next run.
//!
//! A new owner cannot know when the previous one last renewed, only that it
//! was before the lock was released, which was before it was acquired. So a
//! new owner publishes nothing during its first lease (plus a tenth, for
//! clocks that run at different rates): by then any previous owner's lease
//! has run out. The cost is that much latency after each start or takeover.
//! Every instance of an outbox must use the same `relay.ownership_lease`.
//!
//! An owner whose lease stayed expired for one more lease gives ownership up
//! and starts over (a standby, if the lock is taken): its session is gone
//! without a word, and what else it holds, a CDC slot, must be let go.

use std::sync::Mutex;
use std::time::Duration;
use tokio::sync::Notify;
use tokio::time::Instant;

#[derive(Debug)]
pub struct Lease {
    duration: Duration,
    /// Publishing may start (the previous owner's lease has run out).
    from: Instant,
    until: Mutex<Instant>,
    renewed: Notify,
}

impl Lease {
    /// The lease of an owner that just took the lock, at `now`.
    pub fn acquired(duration: Duration, now: Instant) -> Lease {
        Lease {
            duration,
            from: now + duration + duration / 10,
            until: Mutex::new(now + duration),
            renewed: Notify::new(),
        }
    }

    /// The lease of an owner that took the lock from one that stopped
    /// cleanly (see [`super::handoff`]): nothing of it can still be
    /// published, so publishing may start at once.
    pub fn after_clean_stop(duration: Duration, now: Instant) -> Lease {
        Lease {
            from: now,
            ..Lease::acquired(duration, now)
        }
    }

    /// The round trip that won ownership was sent at `sent_at`: the lease
    /// counts from there, as a renewal does, not from when its answer
    /// arrived (which a slow network can hold back).
    pub fn proven_at(self, sent_at: Instant) -> Lease {
        let until =
            (sent_at + self.duration).min(*self.until.lock().unwrap_or_else(|e| e.into_inner()));
        Lease {
            until: Mutex::new(until),
            ..self
        }
    }

    /// A round trip sent at `sent_at` on the ownership session succeeded.
    pub fn renew(&self, sent_at: Instant) {
        let mut until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        let next = sent_at + self.duration;
        if next > *until {
            *until = next;
            drop(until);
            self.renewed.notify_waiters();
        }
    }

    /// Has the previous owner's lease run out (or did it stop cleanly)? Only
    /// then can nothing it sent still reach the broker.
    pub fn previous_owner_settled(&self, now: Instant) -> bool {
        now >= self.from
    }

    /// May this instance publish now?
    pub fn valid(&self, now: Instant) -> bool {
        now >= self.from && now < self.until()
    }

    pub fn until(&self) -> Instant {
        *self.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resolves once the lease has stayed expired for one more lease (and
    /// at least a lease after `since`, when the caller began to watch), with
    /// how long the ownership session has not answered. The session is
    /// presumed gone by then; holding on would keep what else the owner
    /// holds (a replication slot) from the standby that took the lock.
    pub async fn lost(&self, since: Instant) -> Duration {
        let give_up = || self.until().max(since) + self.duration;
        loop {
            tokio::time::sleep_until(give_up()).await;
            if Instant::now() >= give_up() {
                return Instant::now().saturating_duration_since(self.until()) + self.duration;
            }
        }
    }

    /// Resolves once the lease has run out (a renewal meanwhile moves the
    /// moment on).
    pub async fn ran_out(&self) {
        loop {
            tokio::time::sleep_until(self.until()).await;
            if Instant::now() >= self.until() {
                return;
            }
        }
    }

    /// When a heartbeat should renew the lease, unless something else does first.
    pub fn renew_by(&self) -> Instant {
        self.until() - self.duration * 3 / 4
    }

    /// Waits until the lease is valid (for the pipeline while it may not publish).
    pub async fn wait_valid(&self) {
        loop {
            let woken = self.renewed.notified();
            tokio::pin!(woken);
            woken.as_mut().enable();
            let now = Instant::now();
            if self.valid(now) {
                return;
            }
            if now < self.from {
                tokio::select! {
                    _ = tokio::time::sleep_until(self.from) => {}
                    _ = woken => {}
                }
            } else {
                woken.await;
            }
        }
    }
}

impl crate::source::record::Renew for Lease {
    fn renew(&self, sent: Instant) {
        Lease::renew(self, sent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_new_owner_waits_out_the_previous_lease_then_renews() {
        let d = Duration::from_secs(3);
        let start = Instant::now();
        let lease = std::sync::Arc::new(Lease::acquired(d, start));
        assert!(
            !lease.valid(start),
            "nothing is published during the first lease"
        );
        lease.renew(start + d);
        assert!(!lease.valid(start + d), "still within the embargo");
        assert!(lease.valid(start + d + d / 10));
        assert!(!lease.valid(start + d * 2), "no renewal: expired");
        // Once expired, a waiter waits for a renewal, however long.
        tokio::time::sleep(d * 3).await;
        let l = lease.clone();
        let waiter = tokio::spawn(async move { l.wait_valid().await });
        tokio::time::sleep(d * 10).await;
        assert!(
            !waiter.is_finished(),
            "an expired lease waits for a renewal"
        );
        waiter.abort();
    }

    /// A send waiting for room is called off when the lease runs out,
    /// not before: a renewal meanwhile moves the moment on.
    #[tokio::test(start_paused = true)]
    async fn ran_out_follows_renewals() {
        let d = Duration::from_secs(3);
        let start = Instant::now();
        let lease = std::sync::Arc::new(Lease::after_clean_stop(d, start));
        let l = lease.clone();
        let waiter = tokio::spawn(async move {
            l.ran_out().await;
            Instant::now()
        });
        tokio::time::sleep(d / 2).await;
        lease.renew(start + d / 2);
        let ran_out = waiter.await.expect("the waiter");
        assert_eq!(
            ran_out,
            start + d / 2 + d,
            "at the renewed end, not the first"
        );
    }

    /// The answer that won ownership came late: the lease counts from
    /// when the question was sent, as a renewal's does.
    #[test]
    fn a_lease_counts_from_the_question_that_won_it() {
        let d = Duration::from_secs(3);
        let asked = Instant::now();
        let answered = asked + Duration::from_secs(1);
        let lease = Lease::after_clean_stop(d, answered).proven_at(asked);
        assert!(lease.valid(answered));
        assert_eq!(lease.until(), asked + d);
        assert!(
            !lease.valid(asked + d),
            "not valid until the answer's time + d"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn after_a_clean_stop_a_new_owner_publishes_at_once_and_still_renews() {
        let d = Duration::from_secs(3);
        let start = Instant::now();
        let lease = Lease::after_clean_stop(d, start);
        assert!(lease.valid(start), "no embargo after a clean stop");
        assert!(!lease.valid(start + d), "no renewal: expired");
        lease.renew(start + d / 2);
        assert!(lease.valid(start + d));
    }

    #[tokio::test(start_paused = true)]
    async fn wait_valid_returns_once_renewed() {
        let d = Duration::from_secs(1);
        let lease = std::sync::Arc::new(Lease::acquired(d, Instant::now()));
        let l = lease.clone();
        let waiter = tokio::spawn(async move { l.wait_valid().await });
        tokio::time::sleep(d * 2).await;
        lease.renew(Instant::now());
        tokio::time::timeout(Duration::from_millis(10), waiter)
            .await
            .expect("renewal wakes the waiter")
            .unwrap();
    }

    #[tokio::test(start_paused = true)]
    async fn an_owner_gives_up_a_lease_after_it_stayed_expired_for_another() {
        let d = Duration::from_secs(2);
        let start = Instant::now();
        let lease = std::sync::Arc::new(Lease::acquired(d, start));
        let l = lease.clone();
        let lost = tokio::spawn(async move { l.lost(start).await });
        // Renewed at 1.5 s: valid until 3.5 s, given up at 5.5 s.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        lease.renew(Instant::now());
        tokio::time::sleep(Duration::from_millis(3900)).await;
        assert!(!lost.is_finished(), "a renewal postpones giving up");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(lost.is_finished());
        let silent = lost.await.unwrap();
        assert_eq!(
            silent,
            Duration::from_secs(4),
            "silent since the renewal was sent"
        );
    }
}
