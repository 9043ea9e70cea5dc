//! The events a benchmark writes.
//!
//! Every event id carries a per-run tag in its high 64 bits and the event's
//! sequence number in its low 64 bits, so a consumer (or a query on the
//! table) maps a message back to the moment its transaction committed
//! without parsing the body. Aggregates are used in rotation; the payload is
//! a JSON object padded so that its text form (as `payload::text` prints it,
//! and as the relay reads it) is exactly the requested size.

use outbox_relay::config::EnvelopeConfig;
use outbox_relay::envelope::{Binding, Envelope, Message};
use outbox_relay::outbox::RawRow;
use std::fmt;
use std::str::FromStr;
use uuid::Uuid;

pub const AGGREGATE_TYPE: &str = "bench";
pub const EVENT_TYPE: &str = "Happened";

/// Payload size and events per transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub payload: usize,
    pub tx_events: u32,
}

impl Shape {
    pub const ALL: [Shape; 4] = [
        Shape::new(256, 1),
        Shape::new(256, 100),
        Shape::new(1024, 1),
        Shape::new(1024, 100),
    ];

    pub const fn new(payload: usize, tx_events: u32) -> Shape {
        Shape { payload, tx_events }
    }
}

impl FromStr for Shape {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?} is not a shape: write PAYLOAD_BYTESxEVENTS_PER_TX, e.g. 256x1");
        let (bytes, events) = s.split_once('x').ok_or_else(bad)?;
        let payload: usize = bytes.trim().parse().map_err(|_| bad())?;
        let tx_events: u32 = events.trim().parse().map_err(|_| bad())?;
        if !(MIN_PAYLOAD..=1_000_000).contains(&payload) || tx_events == 0 {
            return Err(format!(
                "{s:?}: the payload must be {MIN_PAYLOAD} to 1000000 bytes and a transaction must hold at least 1 event"
            ));
        }
        Ok(Shape { payload, tx_events })
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}x{}", self.payload, self.tx_events)
    }
}

/// `{"pad": ""}`: the smallest payload.
const MIN_PAYLOAD: usize = 11;

/// A JSON object whose jsonb text form is `size` bytes.
pub fn payload(size: usize) -> String {
    format!(
        "{{\"pad\": \"{}\"}}",
        "x".repeat(size.saturating_sub(MIN_PAYLOAD))
    )
}

/// A random tag for one run's event ids (positive as a bigint, for SQL).
pub fn new_tag() -> u64 {
    fastrand::u64(1..i64::MAX as u64)
}

pub fn event_id(tag: u64, seq: u64) -> Uuid {
    Uuid::from_u64_pair(tag, seq)
}

/// The sequence number in an event id of this run's tag.
pub fn seq_of(id: &str, tag: u64) -> Option<u64> {
    let (high, low) = Uuid::parse_str(id).ok()?.as_u64_pair();
    (high == tag).then_some(low)
}

pub fn aggregate_id(seq: u64, aggregates: u32) -> String {
    format!("agg-{}", seq % u64::from(aggregates))
}

/// Server-side insert of events `first .. first + count`, committing every
/// `shape.tx_events` events (a procedure-style loop, one transaction per
/// iteration). Meant for a session with `synchronous_commit = off`: the
/// backlog is set up, not measured.
pub fn backlog_sql(tag: u64, first: u64, count: u64, shape: Shape, aggregates: u32) -> String {
    let per_tx = u64::from(shape.tx_events);
    let transactions = count.div_ceil(per_tx);
    let last = first + count - 1;
    let payload = payload(shape.payload);
    format!(
        "DO $bench$
DECLARE tx bigint;
BEGIN
  FOR tx IN 0..{max_tx} LOOP
    INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
    SELECT (lpad(to_hex({tag}::bigint), 16, '0') || lpad(to_hex(i), 16, '0'))::uuid,
           '{AGGREGATE_TYPE}', 'agg-' || (i % {aggregates}), '{EVENT_TYPE}', '{payload}'::jsonb
    FROM generate_series({first} + tx * {per_tx}, least({first} + tx * {per_tx} + {per_tx} - 1, {last})) AS i;
    COMMIT;
  END LOOP;
END
$bench$",
        max_tx = transactions - 1,
    )
}

/// The statement a steady-state writer commits: `$1` ids, `$2` aggregate ids, `$3` payload.
pub const INSERT_SQL: &str = "INSERT INTO outbox (id, aggregate_type, aggregate_id, event_type, payload)
     SELECT id, 'bench', agg, 'Happened', $3::text::jsonb FROM unnest($1::uuid[], $2::text[]) AS t(id, agg)";

/// Messages exactly as the relay builds them for this shape, one per
/// aggregate, for publishing straight to a broker (the ceiling).
pub fn relay_messages(shape: Shape, aggregates: u32) -> Vec<Message<'static>> {
    // Structured mode (the default) is the same for every binding.
    let envelope = Envelope::new(&EnvelopeConfig::default(), Binding::Kafka);
    let tag = new_tag();
    (0..u64::from(aggregates))
        .map(|seq| {
            let row = RawRow {
                id: Some(event_id(tag, seq).to_string()),
                aggregate_type: Some(AGGREGATE_TYPE.into()),
                aggregate_id: Some(aggregate_id(seq, aggregates)),
                event_type: Some(EVENT_TYPE.into()),
                event_version: Some("1".into()),
                payload: Some(payload(shape.payload)),
                headers: Some("{}".into()),
                created_at: Some("2026-11-29 16:00:00.123456+00".into()),
                extra: None,
            };
            let event = row
                .decode(chrono::Utc::now())
                .expect("the benchmark's row decodes");
            envelope.build(&event).into_owned()
        })
        .collect()
}
