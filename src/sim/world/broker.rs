//! The simulated broker: connections, sends, confirmations in any order,
//! refusals before and after a send, and lost connections.

use super::*;

/// A message the broker accepted (a delivery consumers see).
#[derive(Debug, Clone)]
pub struct Delivery {
    pub event_id: String,
    /// The reign of the instance that sent it.
    pub reign: u64,
    /// [`World::repeat_causes`] when it was sent.
    pub causes: u32,
}

/// A clean stop: the events delivered before it must not be delivered
/// again by a later owner unless something may repeat them since.
#[derive(Debug, Clone)]
pub struct CleanStop {
    pub reign: u64,
    /// [`World::repeat_causes`] at the stop.
    pub causes: u32,
    /// Deliveries before it.
    pub deliveries: usize,
    /// The slot's confirmed position then: it cannot pass an event the
    /// relay had not sent, so events whose only record is the WAL,
    /// committed from there on, are repeated from the stream.
    pub slot: Lsn,
    /// Events left for a later owner: rows still unsent in the table
    /// (with marking; one delivered before a crash of an earlier owner is
    /// sent again, as that incident allows) and open dead letters.
    pub pending: BTreeSet<String>,
}

pub(super) struct BrokerMsg {
    conn: u64,
    /// The ownership reign of the instance that sent it.
    reign: u64,
    /// [`World::repeat_causes`] when it was sent.
    causes: u32,
    event_id: String,
    topic: String,
    key: String,
    due: Instant,
    confirm_after: Duration,
    reply: oneshot::Sender<Result<(), SinkError>>,
}

pub(super) struct PendingConfirm {
    conn: u64,
    event_id: String,
    at: Instant,
    reply: oneshot::Sender<Result<(), SinkError>>,
    result: Result<(), SinkError>,
}

impl World {
    /// What may make the relay send an event again: incidents, and stops
    /// that were not clean (something they sent may be unconfirmed).
    pub fn repeat_causes(&self) -> u32 {
        self.incidents + self.unclean_stops
    }

    /// An incident: it may repeat up to a window of events (two without
    /// marking). An event whose only record is the WAL (every event without
    /// marking; a logical message with it) that waits for its confirmation,
    /// or for a retry after a refusal or a nack, keeps the slot before it
    /// until it is delivered (again) or dead-lettered, so the next stream
    /// also repeats every such event confirmed after it until then: the
    /// first such event is pinned, and [`World::repeats_behind_pins`]
    /// counts them in the end. With marking, rows confirmed after it are
    /// marked and not repeated.
    pub fn incident(&mut self) {
        self.incidents += 1;
        self.pin_waiting();
    }

    /// Pins the first event whose only record is the WAL and that waits
    /// (see [`World::incident`]): at an incident, and at a clean stop, which
    /// cannot tell the slot past it either (the README's clean-stop
    /// paragraph).
    pub fn pin_waiting(&mut self) {
        let delivered: BTreeSet<&str> = self
            .deliveries
            .iter()
            .map(|d| d.event_id.as_str())
            .collect();
        let lettered: BTreeSet<&str> = self.letters.iter().map(|l| l.event_id.as_str()).collect();
        let unconfirmed: BTreeSet<&str> = self
            .inflight
            .iter()
            .map(|m| m.event_id.as_str())
            .chain(self.confirms.iter().map(|c| c.event_id.as_str()))
            .chain(self.held.iter().map(|m| m.event_id.as_str()))
            .collect();
        let held = |id: &str| {
            let refused = self
                .events
                .get(id)
                .is_some_and(|f| f.refusals + f.nacks > 0)
                && !delivered.contains(id)
                && !lettered.contains(id);
            (refused || unconfirmed.contains(id))
                && self
                    .events
                    .get(id)
                    .is_some_and(|f| self.wal_only(f.message))
        };
        let pin = self
            .wal
            .iter()
            .flat_map(|tx| &tx.rows)
            .find(|r| held(&r.id))
            .map(|r| (r.id.clone(), self.deliveries.len()));
        self.pins.extend(pin);
    }

    /// Whether the WAL is an event's only record.
    pub fn wal_only(&self, message: bool) -> bool {
        !self.marks_rows || message
    }

    /// Events whose only record is the WAL, confirmed behind an event
    /// pinned at an incident before that event was delivered or
    /// dead-lettered after it (at most: a restart between repeats only
    /// those confirmed before it).
    pub fn repeats_behind_pins(&self) -> u64 {
        let mut first: BTreeMap<&str, usize> = BTreeMap::new();
        for (i, d) in self.deliveries.iter().enumerate() {
            first.entry(d.event_id.as_str()).or_insert(i);
        }
        let mut total = 0;
        for (pin, at_incident) in &self.pins {
            let resolved = self
                .deliveries
                .iter()
                .enumerate()
                .skip(*at_incident)
                .find(|(_, d)| &d.event_id == pin)
                .map(|(i, _)| i)
                .or_else(|| {
                    self.letters
                        .iter()
                        .find(|l| &l.event_id == pin && l.after_deliveries >= *at_incident)
                        .map(|l| l.after_deliveries)
                })
                .unwrap_or(self.deliveries.len());
            let Some(at) = self
                .wal
                .iter()
                .position(|tx| tx.rows.iter().any(|r| &r.id == pin))
            else {
                continue;
            };
            total += self.wal[at..]
                .iter()
                .flat_map(|tx| &tx.rows)
                .filter(|r| self.wal_only(r.message))
                .filter(|r| first.get(r.id.as_str()).is_some_and(|&i| i < resolved))
                .count() as u64;
        }
        total
    }

    pub fn connect(&mut self, instance: usize) -> Result<u64, SinkError> {
        if self.broker_down {
            return Err(SinkError::Unavailable("sim: the broker is down".into()));
        }
        let id = self.next_conn;
        self.next_conn += 1;
        self.conns.insert(id, (instance, false));
        Ok(id)
    }

    pub fn conn_ok(&self, conn: u64) -> bool {
        !self.broker_down && self.conns.get(&conn).is_some_and(|(_, broken)| !broken)
    }

    pub fn topic(&self, event_type: &str) -> String {
        if self.broker_kind.topic_per_type {
            format!("t.{event_type}")
        } else {
            "t".into()
        }
    }

    /// A send: the client's checks, then it writes the message (or holds
    /// it: see [`World::hand`]).
    pub fn send(
        &mut self,
        conn: u64,
        reign: u64,
        event_id: &str,
        key: &str,
        event_type: &str,
    ) -> Result<oneshot::Receiver<Result<(), SinkError>>, SinkError> {
        if !self.conn_ok(conn) {
            return Err(SinkError::Unavailable("sim: connection lost".into()));
        }
        let poison = self.events.get(event_id).map(|e| e.poison);
        if poison == Some(Poison::RefuseBeforeSend) {
            if let Some(e) = self.events.get_mut(event_id) {
                e.refusals_seen += 1;
            }
            return Err(SinkError::Rejected("sim: message too large".into()));
        }
        let (tx, rx) = oneshot::channel();
        let msg = ClientMsg {
            conn,
            reign,
            event_id: event_id.to_owned(),
            key: key.to_owned(),
            event_type: event_type.to_owned(),
            reply: tx,
        };
        self.hand(msg);
        Ok(rx)
    }

    /// The client writes a message to the broker: it is on its way.
    pub(super) fn write(&mut self, m: ClientMsg) {
        let ClientMsg {
            conn,
            reign,
            event_id,
            key,
            event_type,
            reply,
        } = m;
        let (event_id, key) = (event_id.as_str(), key.as_str());
        let instance = self.conns.get(&conn).map(|c| c.0).unwrap_or(usize::MAX);
        if reign < self.latest_publishing_reign {
            let v = format!(
                "instance {instance} (reign {reign}) published {event_id} after a newer owner (reign {}) had started publishing",
                self.latest_publishing_reign
            );
            self.violation(v);
        }
        self.latest_publishing_reign = self.latest_publishing_reign.max(reign);
        let topic = self.topic(&event_type);
        let now = Instant::now();
        let mut due = now + Duration::from_micros(self.rng.u64(200..20_000));
        if let Some(until) = self.stalled_until.filter(|u| *u > now) {
            due = due.max(until + Duration::from_micros(self.rng.u64(0..20_000)));
        }
        // Order holds per connection only: what another connection sent
        // may land before or after.
        let order_key = (conn, topic.clone(), key.to_owned());
        if let Some(last) = self.last_due.get(&order_key) {
            due = due.max(*last);
        }
        self.last_due.insert(order_key, due);
        // Now and then a confirmation comes after the relay gave up on it.
        let confirm_after = if self.rng.u32(0..200) == 0 {
            self.confirm_timeout + Duration::from_millis(self.rng.u64(1..2000))
        } else {
            Duration::from_micros(self.rng.u64(0..30_000))
        };
        if due + confirm_after >= now + self.confirm_timeout {
            self.incident();
        }
        let causes = self.repeat_causes();
        self.inflight.push(BrokerMsg {
            conn,
            reign,
            causes,
            event_id: event_id.to_owned(),
            topic,
            key: key.to_owned(),
            due,
            confirm_after,
            reply,
        });
        self.note(format!("instance {instance} sends {event_id} ({key})"));
        self.broker_notify.notify_one();
    }

    /// When the broker has something to do next.
    pub fn next_broker_step(&self) -> Option<Instant> {
        let a = self.inflight.iter().map(|m| m.due);
        let b = self.confirms.iter().map(|c| c.at);
        a.chain(b).chain(self.next_release()).min()
    }

    /// Delivers (or refuses) what is due and sends due confirmations.
    pub fn broker_step(&mut self, now: Instant) {
        self.release_held(now);
        while let Some(i) = self
            .inflight
            .iter()
            .enumerate()
            .filter(|(_, m)| m.due <= now)
            .min_by_key(|(_, m)| m.due)
            .map(|(i, _)| i)
        {
            let m = self.inflight.remove(i);
            let result = self.outcome(&m);
            if let Err(SinkError::Rejected(_)) = &result
                && self.broker_kind.gapless
            {
                // The producer stops: later messages of this partition fail,
                // or (librdkafka's gapless guarantee raising a fatal error)
                // every message it has in flight.
                let whole = self.rng.bool();
                let (later, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.inflight)
                    .into_iter()
                    .partition(|o| {
                        o.conn == m.conn && (whole || (o.topic == m.topic && o.key == m.key))
                    });
                self.inflight = keep;
                // Of another partition, what was already sent may still be
                // written, though the client says it failed: a prefix of
                // that partition's messages, in order.
                let mut later = later;
                later.sort_by_key(|o| o.due);
                let mut cut: BTreeSet<(String, String)> = BTreeSet::new();
                for o in later {
                    let partition = (o.topic.clone(), o.key.clone());
                    let other = o.topic != m.topic || o.key != m.key;
                    // A refusal there stops that partition too.
                    if other
                        && !cut.contains(&partition)
                        && !(self.rng.bool() && self.outcome(&o).is_ok())
                    {
                        cut.insert(partition);
                    }
                    self.note(format!(
                        "broker fails {} behind a refused message",
                        o.event_id
                    ));
                    let _ = o
                        .reply
                        .send(Err(SinkError::Unavailable("sim: producer fenced".into())));
                }
                // The producer is rebuilt: what was in flight on it is ambiguous.
                if let Some(c) = self.conns.get_mut(&m.conn)
                    && !c.1
                {
                    c.1 = true;
                    self.incident();
                }
            }
            self.confirms.push(PendingConfirm {
                conn: m.conn,
                event_id: m.event_id.clone(),
                at: now + m.confirm_after,
                reply: m.reply,
                result,
            });
        }
        let (due, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirms)
            .into_iter()
            .partition(|c| c.at <= now);
        self.confirms = keep;
        for c in due {
            let refused = matches!(c.result, Err(SinkError::Rejected(_)));
            if c.reply.send(c.result).is_ok()
                && refused
                && let Some(e) = self.events.get_mut(&c.event_id)
            {
                e.refusals_seen += 1;
            }
        }
    }

    fn outcome(&mut self, m: &BrokerMsg) -> Result<(), SinkError> {
        let Some(facts) = self.events.get_mut(&m.event_id) else {
            return Err(SinkError::Rejected("sim: unknown event".into()));
        };
        let refuse = match facts.poison {
            Poison::RefuseAfterSend => true,
            Poison::Flaky(n) if facts.refusals < n => true,
            _ => false,
        };
        if refuse {
            facts.refusals += 1;
            self.note(format!("broker refuses {}", m.event_id));
            return Err(SinkError::Rejected("sim: invalid destination".into()));
        }
        if self.busy_topics.contains(&m.topic) {
            facts.nacks += 1;
            self.note(format!("broker nacks {} (busy)", m.event_id));
            return Err(SinkError::Busy("sim: queue full".into()));
        }
        let instance = self.conns.get(&m.conn).map(|c| c.0).unwrap_or(usize::MAX);
        self.note(format!(
            "broker delivers {} ({}) from instance {instance}",
            m.event_id, m.key
        ));
        self.deliveries.push(Delivery {
            event_id: m.event_id.clone(),
            reign: m.reign,
            causes: m.causes,
        });
        let partition = (m.topic.clone(), m.key.clone());
        let newest = self.landed_reign.entry(partition).or_insert(m.reign);
        if *newest > m.reign {
            let v = format!(
                "{} ({}) sent by reign {} landed after a message of the same key from reign {}: a consumer sees an old owner's message after the new owner's",
                m.event_id, m.key, m.reign, *newest
            );
            self.violation(v);
        } else {
            *newest = m.reign;
        }
        Ok(())
    }

    /// The relay closes a connection: what it had written is still on the
    /// way and lands as it would have (a closing client does not call
    /// written bytes back); the confirmations are lost.
    pub fn close_conn(&mut self, conn: u64) {
        self.call_back(conn);
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.1 = true;
        for c in self.confirms.iter_mut().filter(|c| c.conn == conn) {
            c.result = Err(SinkError::Unavailable("sim: connection closed".into()));
        }
        let unconfirmed = self.inflight.iter().filter(|m| m.conn == conn).count();
        if unconfirmed > 0 {
            // Their fate is unknown to the relay: they will be sent again.
            self.incident();
            self.note(format!(
                "connection {conn} closed with {unconfirmed} messages on the way"
            ));
        }
    }

    /// Messages of `conn` the broker has not confirmed (its client's
    /// `in_flight_count`).
    pub fn unconfirmed_on(&self, conn: u64) -> usize {
        self.held.iter().filter(|m| m.conn == conn).count()
            + self.inflight.iter().filter(|m| m.conn == conn).count()
            + self.confirms.iter().filter(|c| c.conn == conn).count()
    }

    /// A connection dies: each message on it may or may not have arrived.
    pub fn kill_conn(&mut self, conn: u64) {
        self.call_back(conn);
        let Some(c) = self.conns.get_mut(&conn) else {
            return;
        };
        c.1 = true;
        let (mut mine, keep): (Vec<_>, Vec<_>) = std::mem::take(&mut self.inflight)
            .into_iter()
            .partition(|m| m.conn == conn);
        self.inflight = keep;
        // Confirmations on their way back are lost with the connection.
        for c in self.confirms.iter_mut().filter(|c| c.conn == conn) {
            c.result = Err(SinkError::Unavailable("sim: connection lost".into()));
        }
        // What was written before the cut arrived, in order; nothing after it.
        mine.sort_by_key(|m| m.due);
        let cut = self.rng.usize(0..=mine.len());
        let mut fenced = BTreeSet::new();
        for (i, m) in mine.into_iter().enumerate() {
            let partition = (m.topic.clone(), m.key.clone());
            if i < cut && !fenced.contains(&partition) {
                match self.outcome(&m) {
                    Ok(()) => self.note(format!(
                        "{} arrived although its connection died",
                        m.event_id
                    )),
                    Err(SinkError::Rejected(_)) if self.broker_kind.gapless => {
                        fenced.insert(partition);
                    }
                    Err(_) => {}
                }
            }
            let _ = m
                .reply
                .send(Err(SinkError::Unavailable("sim: connection lost".into())));
        }
    }

    /// The broker drops `instance`'s connections (a restart of its own, a
    /// proxy's idle cut): what the relay wrote before still lands when due,
    /// but every answer the relay waits for on them fails now.
    pub fn drop_conns_of(&mut self, instance: usize) {
        let now = Instant::now();
        let ids = self.open_conns_of(instance);
        let dropped = || {
            Err(SinkError::Unavailable(
                "sim: the broker dropped the connection".into(),
            ))
        };
        for conn in ids {
            if let Some(c) = self.conns.get_mut(&conn) {
                c.1 = true;
            }
            let mut on_the_way = 0;
            for m in self.inflight.iter_mut().filter(|m| m.conn == conn) {
                let reply = std::mem::replace(&mut m.reply, oneshot::channel().0);
                let _ = reply.send(dropped());
                on_the_way += 1;
            }
            for c in self.confirms.iter_mut().filter(|c| c.conn == conn) {
                c.result = dropped();
                c.at = now;
            }
            self.incident();
            self.note(format!(
                "the broker drops connection {conn} with {on_the_way} messages on the way"
            ));
        }
        self.broker_notify.notify_one();
    }

    fn open_conns_of(&self, instance: usize) -> Vec<u64> {
        self.conns
            .iter()
            .filter(|(_, (i, broken))| *i == instance && !broken)
            .map(|(id, _)| *id)
            .collect()
    }

    pub fn kill_conns_of(&mut self, instance: usize) {
        for id in self.open_conns_of(instance) {
            self.kill_conn(id);
        }
    }

    pub fn kill_all_conns(&mut self) {
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.kill_conn(id);
        }
    }
}
