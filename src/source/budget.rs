//! The memory budget of events between their read and their end
//! (`relay.max_in_flight_bytes`).
//!
//! Each event read carries a [`Charge`] of its size against the pipeline's
//! [`Budget`]; the charge travels with the event (waiting, parked, in flight,
//! answered) and is given back when the event is dropped. While a message is
//! with the broker client, its encoded size is charged too: the client holds
//! a copy until the broker answers. The reader reads only while the budget
//! has room, and no more than the room left (at least one event, so a single
//! event larger than the budget still goes, alone).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Notify;

#[derive(Debug)]
pub struct Budget {
    limit: usize,
    used: AtomicUsize,
    freed: Notify,
}

impl Budget {
    pub fn new(limit: usize) -> Arc<Budget> {
        Arc::new(Budget {
            limit: limit.max(1),
            used: AtomicUsize::new(0),
            freed: Notify::new(),
        })
    }

    pub fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Bytes that may still be read (0 when the budget is spent or overdrawn).
    pub fn room(&self) -> usize {
        self.limit.saturating_sub(self.used())
    }

    /// Charges `bytes`; they are given back when the charge is dropped.
    pub fn charge(self: &Arc<Self>, bytes: usize) -> Charge {
        self.used.fetch_add(bytes, Ordering::SeqCst);
        Charge {
            budget: Some(self.clone()),
            bytes,
        }
    }

    /// Waits until there is room. Cancel-safe.
    pub async fn has_room(&self) {
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            if self.room() > 0 {
                return;
            }
            freed.await;
        }
    }

    fn give_back(&self, bytes: usize) {
        self.used.fetch_sub(bytes, Ordering::SeqCst);
        self.freed.notify_waiters();
    }
}

/// Bytes an event holds against a [`Budget`], given back on drop. A clone
/// (or a default) charges nothing: the bytes are given back once.
#[derive(Debug, Default)]
pub struct Charge {
    budget: Option<Arc<Budget>>,
    bytes: usize,
}

impl Charge {
    /// Charges `bytes` more to the same budget (nothing if uncharged).
    pub fn grow(&mut self, bytes: usize) {
        if let Some(b) = &self.budget {
            b.used.fetch_add(bytes, Ordering::SeqCst);
            self.bytes += bytes;
        }
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Clone for Charge {
    fn clone(&self) -> Self {
        Charge::default()
    }
}

impl PartialEq for Charge {
    /// Charges never make events differ.
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl Eq for Charge {}

impl Drop for Charge {
    fn drop(&mut self) {
        if let Some(b) = self.budget.take() {
            b.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn charges_are_given_back_once_and_wake_the_reader() {
        let budget = Budget::new(100);
        let mut a = budget.charge(60);
        a.grow(40);
        assert_eq!(budget.room(), 0);
        let copy = a.clone();
        drop(copy);
        assert_eq!(budget.used(), 100, "a clone gives nothing back");
        let b = budget.clone();
        let waiter = tokio::spawn(async move { b.has_room().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiter.is_finished(), "no room, no read");
        drop(a);
        tokio::time::timeout(Duration::from_secs(1), waiter)
            .await
            .expect("dropping the charge wakes the reader")
            .unwrap();
        assert_eq!(budget.used(), 0);
    }
}
