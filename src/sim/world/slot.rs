//! The simulated replication slot: the stream reading it, the confirmed
//! position a status update moves, and what a database restart forgets.

use super::*;

impl World {
    pub fn open_stream(&mut self) -> Option<u64> {
        if self.slot_active.is_some() {
            return None;
        }
        let id = self.next_stream;
        self.next_stream += 1;
        self.slot_active = Some(id);
        Some(id)
    }

    pub fn close_stream(&mut self, id: u64) {
        if self.slot_active == Some(id) {
            self.slot_active = None;
        }
    }

    /// A status update: the slot's confirmed position moves to `flushed`,
    /// which must not pass an event nobody has accounted for. Backwards
    /// too, as older minor releases of PostgreSQL do (recent ones, 15.20
    /// among them, ignore it): the relay must never report that, or a
    /// stream starting from the slot later sends what follows again.
    pub fn confirm_slot(&mut self, flushed: Lsn) {
        if flushed.0 == 0 || flushed == self.slot_confirmed {
            return;
        }
        if flushed < self.slot_confirmed {
            let v = format!(
                "a status update moves the slot back from {} to {flushed}",
                self.slot_confirmed
            );
            self.violation(v);
            self.slot_confirmed = flushed;
            self.slot_saved = self.slot_saved.min(flushed);
            return;
        }
        let mut problems = Vec::new();
        for tx in self
            .wal
            .iter()
            .filter(|t| t.end_lsn <= flushed && t.commit_lsn >= self.slot_confirmed)
        {
            for r in &tx.rows {
                if !self.accounted(&r.id) {
                    problems.push(format!(
                        "slot confirmed to {flushed} past event {} (xid {}, commit {}), which was neither delivered, dead-lettered nor left unsent in the table",
                        r.id, tx.xid, tx.commit_lsn
                    ));
                }
            }
        }
        for p in problems {
            self.violation(p);
        }
        self.slot_confirmed = flushed;
        self.slot_moves += 1;
        if self.slot_moves.is_multiple_of(3) {
            self.slot_saved = flushed;
        }
    }

    /// The database crashes and restarts: every session ends, and the slot
    /// goes back to its last saved position. Events delivered since then
    /// whose only record is the WAL may be repeated: they are counted.
    pub fn database_restart(&mut self) {
        let (saved, confirmed) = (self.slot_saved, self.slot_confirmed);
        self.note(format!(
            "the database restarts: the slot goes back from {confirmed} to {saved}"
        ));
        self.incident();
        let delivered: BTreeSet<&str> = self
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        let forgotten = self
            .wal
            .iter()
            .filter(|t| t.commit_lsn >= saved && t.commit_lsn < confirmed)
            .flat_map(|t| &t.rows)
            .filter(|r| self.wal_only(r.message) && delivered.contains(r.id.as_str()))
            .count();
        self.repeats_forgotten += forgotten as u64;
        self.slot_confirmed = saved;
        // The folding session ends too: its next statement fails.
        self.progress.fold_lock = None;
        if let Some(id) = self.slot_active {
            self.cut_stream = Some(id);
        }
        if let Some(r) = self.lock_reign
            && let Some(&owner) = self.reign_instance.get(&r)
        {
            self.end_sessions(owner);
        }
    }

    /// The event is safe whatever happens to the WAL before it.
    fn accounted(&self, id: &str) -> bool {
        self.deliveries.iter().any(|d| d.event_id == id)
            || self.letters.iter().any(|l| l.event_id == id)
            || self.events.get(id).is_some_and(|e| e.dropped)
            || (self.marks_rows && self.unsent().any(|r| r.id == id))
    }
}
