//! A broker's pause of all publishing on a connection: RabbitMQ's
//! `connection.blocked`, sent during a memory or disk alarm. The broker
//! stops reading from the connection until the alarm clears; what was sent
//! is neither lost nor refused, only late. So the time paused does not
//! count against `relay.confirm_timeout`: a timeout would end the run, and
//! the blocked connection, which cannot even send its close, would be left
//! behind, one more at every timeout for as long as the alarm lasts.

use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;

/// Whether the broker pauses a sink's publishing; see the module docs.
/// Cheap to clone: one per message in flight.
#[derive(Debug, Clone, Default)]
pub struct Pause(Option<watch::Receiver<bool>>);

impl Pause {
    /// Follows `paused`, which the sink sets while the broker pauses it and
    /// drops when its connection fails: a pause ends with its connection.
    pub fn following(paused: watch::Receiver<bool>) -> Self {
        Pause(Some(paused))
    }

    pub fn is_paused(&self) -> bool {
        self.0
            .as_ref()
            .is_some_and(|p| p.has_changed().is_ok() && *p.borrow())
    }

    /// Waits until the broker no longer pauses publishing; `false` when the
    /// connection went first.
    pub async fn resumed(&mut self) -> bool {
        match &mut self.0 {
            Some(p) => p.wait_for(|paused| !paused).await.is_ok(),
            None => true,
        }
    }

    /// `work`'s output, unless `limit` passes first, counting only time the
    /// broker did not pause publishing: the clock stops during a pause and
    /// starts afresh when it ends (what waited is written only then).
    pub async fn within<F: Future>(mut self, limit: Duration, work: F) -> Option<F::Output> {
        tokio::pin!(work);
        let mut deadline = Instant::now() + limit;
        loop {
            let paused = match &mut self.0 {
                Some(p) => p.has_changed().is_ok() && *p.borrow_and_update(),
                None => false,
            };
            tokio::select! {
                biased;
                out = &mut work => return Some(out),
                () = tokio::time::sleep_until(deadline), if !paused => return None,
                changed = changed(&mut self.0) => match changed {
                    // A pause that ended: the broker reads again from now on.
                    true if !self.is_paused() => deadline = Instant::now() + limit,
                    true => {}
                    // The connection is gone: its messages' clock runs on.
                    false => self.0 = None,
                },
            }
        }
    }
}

/// Waits for the next change of `paused`; `false` when its sender is gone,
/// never for a sink that is never paused.
async fn changed(paused: &mut Option<watch::Receiver<bool>>) -> bool {
    match paused {
        Some(p) => p.changed().await.is_ok(),
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_clock_stops_while_paused_and_starts_afresh_after() {
        let limit = Duration::from_secs(3);
        let (tx, rx) = watch::channel(false);
        let answered = async {
            tokio::time::sleep(Duration::from_secs(100)).await;
        };
        let waited = tokio::spawn(Pause::following(rx).within(limit, answered));
        tokio::time::sleep(Duration::from_secs(2)).await;
        tx.send_replace(true);
        // Far past the limit while paused: still waiting.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!waited.is_finished());
        tx.send_replace(false);
        // The clock starts afresh: 3 s more, not the 1 s left before.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        assert!(!waited.is_finished());
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(waited.await.ok(), Some(None), "timed out");
    }

    #[tokio::test(start_paused = true)]
    async fn without_a_pause_or_a_connection_the_limit_holds() {
        let limit = Duration::from_secs(3);
        let never = || std::future::pending::<()>();
        let start = Instant::now();
        assert_eq!(Pause::default().within(limit, never()).await, None);
        assert_eq!(start.elapsed(), limit);

        // Paused when the connection failed: the clock runs on from its start.
        let (tx, rx) = watch::channel(true);
        let start = Instant::now();
        let waited = tokio::spawn(Pause::following(rx).within(limit, never()));
        tokio::time::sleep(Duration::from_secs(10)).await;
        drop(tx);
        assert_eq!(waited.await.ok(), Some(None));
        assert_eq!(start.elapsed(), Duration::from_secs(10));

        let (tx, rx) = watch::channel(true);
        let pause = Pause::following(rx);
        assert!(pause.is_paused());
        drop(tx);
        assert!(!pause.is_paused(), "a pause ends with its connection");
        assert!(!pause.clone().resumed().await);

        let quick = async { 7 };
        assert_eq!(Pause::default().within(limit, quick).await, Some(7));
    }
}
