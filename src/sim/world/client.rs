//! The broker client's own queue: a Kafka client holds what it is given
//! while its partitions have no reachable leader (a lost connection, a
//! leader's move) and writes it, or writes it again, once they have one,
//! however late. A fence or a close calls back what it holds.

use super::*;

/// A message the client was given, not written yet.
pub(crate) struct ClientMsg {
    pub conn: u64,
    /// The ownership reign of the instance that sent it.
    pub reign: u64,
    pub event_id: String,
    pub key: String,
    pub event_type: String,
    pub reply: oneshot::Sender<Result<(), SinkError>>,
}

impl World {
    /// The client writes `m` now, or holds it while its instance's client
    /// holds its partition (after what it holds already: order per client).
    pub(super) fn hand(&mut self, m: ClientMsg) {
        // Behind what a client whose hold just ended still holds.
        let now = Instant::now();
        self.release_held(now);
        let instance = self.conns.get(&m.conn).map(|c| c.0);
        let holding =
            instance.is_some_and(|i| self.holds.get(&i).is_some_and(|until| *until > now));
        let topic = self.topic(&m.event_type);
        let partition = partition_hash(&topic, &m.key);
        // Behind what the client holds of its partition already (a hold
        // that took over from a wider one), whatever the hold covers now.
        let behind = || {
            self.held
                .iter()
                .any(|h| h.conn == m.conn && h.key == m.key && self.topic(&h.event_type) == topic)
        };
        let held = holding
            && (instance
                .and_then(|i| self.held_partitions.get(&i))
                .is_none_or(|(of, is)| partition % of == *is)
                || behind());
        if holding && !held {
            self.note(format!(
                "the client of instance {} sends {} past the partitions it holds",
                instance.unwrap_or(usize::MAX),
                m.event_id
            ));
        }
        if held {
            self.note(format!(
                "the client of instance {} holds {}",
                instance.unwrap_or(usize::MAX),
                m.event_id
            ));
            self.held.push(m);
            self.broker_notify.notify_one();
        } else {
            self.write(m);
        }
    }

    /// When a client that holds messages writes them.
    pub(super) fn next_release(&self) -> Option<Instant> {
        self.held
            .iter()
            .filter_map(|m| self.conns.get(&m.conn))
            .filter_map(|(instance, _)| self.holds.get(instance))
            .min()
            .copied()
    }

    /// Clients whose hold ended write what they held, in order; what was
    /// held on a connection since closed was called back with it.
    pub(super) fn release_held(&mut self, now: Instant) {
        let ended: BTreeSet<usize> = self
            .holds
            .iter()
            .filter(|(_, until)| **until <= now)
            .map(|(i, _)| *i)
            .collect();
        if ended.is_empty() {
            return;
        }
        self.holds.retain(|i, _| !ended.contains(i));
        self.held_partitions.retain(|i, _| !ended.contains(i));
        let (due, keep): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.held).into_iter().partition(|m| {
                self.conns
                    .get(&m.conn)
                    .is_some_and(|c| ended.contains(&c.0))
            });
        self.held = keep;
        for m in due {
            if self.conn_ok(m.conn) {
                self.write(m);
            } else {
                let _ = m
                    .reply
                    .send(Err(SinkError::Unavailable("sim: connection lost".into())));
            }
        }
    }

    /// The relay calls back what the client of `conn` holds (a fence, a
    /// close, a client rebuilt): none of it reaches the broker.
    pub fn call_back(&mut self, conn: u64) {
        let (mine, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.held)
            .into_iter()
            .partition(|m| m.conn == conn);
        self.held = keep;
        for m in mine {
            self.note(format!("the client calls back {}", m.event_id));
            self.called_back += 1;
            let _ = m
                .reply
                .send(Err(SinkError::Unavailable("sim: called back".into())));
        }
    }
}

/// A partition's hash, the same in every run (a topic and a key are one
/// partition in the simulation, as per-key order makes them).
fn partition_hash(topic: &str, key: &str) -> u64 {
    topic
        .bytes()
        .chain([0])
        .chain(key.bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        })
}
