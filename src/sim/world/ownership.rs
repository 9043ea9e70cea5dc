//! The ownership lock as the database holds it: who owns the outbox, in
//! which reign, and what a clean stop recorded.

use super::{CleanStop, World};
use crate::relay::handoff::Takeover;

impl World {
    pub fn try_lock(&mut self, instance: usize) -> Option<u64> {
        if self.lock_reign.is_some() {
            return None;
        }
        let reign = self.next_reign;
        self.next_reign += 1;
        self.lock_reign = Some(reign);
        self.reign_instance.insert(reign, instance);
        self.note(format!(
            "instance {instance} owns the outbox (reign {reign})"
        ));
        Some(reign)
    }

    /// A new owner claims the lock (see `relay::handoff`): was the last
    /// claim's owner stopped cleanly?
    pub fn claim(&mut self, reign: u64) -> Takeover {
        // `migrate` created the outbox and the owners table together, with
        // the genesis row: the first claim finds nothing else.
        let first = self.claimed.is_none();
        let clean = self.claimed.is_some() && self.stopped_cleanly == self.claimed;
        self.claimed = Some(reign);
        self.stopped_cleanly = None;
        if first {
            self.note(format!("reign {reign} is the new outbox's first owner"));
            Takeover::NewOutbox
        } else if clean {
            self.clean_takeovers += 1;
            self.note(format!("reign {reign} takes over after a clean stop"));
            Takeover::AfterCleanStop
        } else {
            Takeover::Unknown
        }
    }

    /// `reign` records a clean stop; nothing changes if a newer owner claimed since.
    pub fn stopped_cleanly(&mut self, reign: u64) {
        if self.claimed == Some(reign) {
            self.stopped_cleanly = Some(reign);
            self.note(format!("reign {reign} stopped cleanly"));
            // Rows the table still names unsent (with marking) and open
            // letters are sent by a later owner, repeats or not.
            let pending = self
                .unsent()
                .filter(|_| self.marks_rows)
                .map(|r| r.id.clone())
                .chain(self.open_letters().map(|l| l.event_id.clone()))
                .collect();
            self.clean_stops.push(CleanStop {
                reign,
                causes: self.repeat_causes(),
                deliveries: self.deliveries.len(),
                slot: self.slot_confirmed,
                pending,
            });
        }
    }

    pub fn owns(&self, reign: u64) -> bool {
        self.lock_reign == Some(reign)
    }

    /// The ownership session of `reign` closes (its connection was dropped).
    /// When the relay drops it of its own accord (it gave ownership up:
    /// the session did not answer within the lease, or a failure restarted
    /// it), not stopped and not crashed by the schedule, that is an
    /// incident: what it had confirmed and not recorded is sent again.
    pub fn release(&mut self, reign: u64) {
        if self.lock_reign == Some(reign) {
            self.lock_reign = None;
            self.note(format!("reign {reign} ends"));
            let stopping = self
                .reign_instance
                .get(&reign)
                .is_some_and(|i| self.stopping.contains(i));
            if !stopping && self.stopped_cleanly != Some(reign) {
                self.incident();
            }
        }
    }

    /// The instance's ownership session ends (crash, terminated backend).
    pub fn end_sessions(&mut self, instance: usize) {
        if let Some(r) = self.lock_reign
            && self.reign_instance.get(&r) == Some(&instance)
        {
            self.lock_reign = None;
            self.note(format!(
                "instance {instance} lost its ownership session (reign {r})"
            ));
        }
    }
}
