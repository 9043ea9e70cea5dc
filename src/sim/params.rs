//! The settings of a seeded schedule, drawn at random, and the relay
//! configuration they make.

use crate::config::{HoldPolicy, MarkMode, SourceMode};

/// Which faults a schedule draws.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Focus {
    /// Every kind of fault and operator action.
    Mixed,
    /// Only broker pauses with an instance stopped during them (half the
    /// time just after the broker dropped its connections, failing its run),
    /// under a short `relay.shutdown_timeout`, while the writers still
    /// commit on a few aggregates: stops that leave messages of this owner
    /// or of its failed run on the way, and the next owner's publishing
    /// right behind them.
    HandOver,
}

/// The settings of one schedule.
#[derive(Debug, Clone)]
pub struct Params {
    pub focus: Focus,
    pub mode: SourceMode,
    pub mark: MarkMode,
    pub kafka: bool,
    pub topic_per_type: bool,
    pub policy: HoldPolicy,
    pub dead_letter: bool,
    pub max_attempts: u32,
    pub max_in_flight: usize,
    /// The byte budget: unbounded in effect, or a few events' worth.
    pub max_in_flight_bytes: usize,
    pub batch_size: usize,
    pub instances: usize,
    pub transactions: usize,
    pub aggregates: usize,
    pub faults: usize,
    /// CDC: some events are logical messages (`source.cdc.messages`); with
    /// rows marked, the odd aggregates' (one aggregate is written one way),
    /// without marking, any event's.
    pub messages: bool,
    /// `relay.shutdown_timeout`: usually ample, now and then shorter than
    /// a broker stall, so that a stop leaves messages on the way.
    pub shutdown_timeout_ms: u64,
    /// `source.cdc.batch_wait`: none, or long enough for several commits.
    pub batch_wait_ms: u64,
    /// After the cure, the redrive runs with `dead_letter.refresh_interval`
    /// an hour long: only the looks the relay hurries move it on.
    pub long_looks: bool,
    /// `relay.confirm_timeout` in seconds: now and then shorter than a
    /// client's hold or a broker stall, so that the relay gives up on
    /// messages its client still holds.
    pub confirm_timeout_s: u64,
}

/// `source.cdc.batch_wait` in milliseconds: none, or long enough for
/// several commits. Drawn from a generator of its own, so that the rest of
/// a seed's schedule stays as it was before the setting existed.
fn batch_wait_ms(rng: &fastrand::Rng) -> u64 {
    let mut own = fastrand::Rng::with_seed(rng.get_seed() ^ 0xba7c_4a17);
    if own.bool() { 0 } else { own.u64(1..30) }
}

/// `relay.confirm_timeout` in seconds, drawn like [`batch_wait_ms`]:
/// mostly 8, a quarter of the schedules 2 (shorter than most holds of the
/// Kafka client), a few 30 (longer than any stall).
fn confirm_timeout_s(rng: &fastrand::Rng) -> u64 {
    match fastrand::Rng::with_seed(rng.get_seed() ^ 0xc0f1_7173).u32(0..8) {
        0 | 1 => 2,
        2 => 30,
        _ => 8,
    }
}

/// Whether the redrive after the cure runs with looks an hour apart (a
/// third of the schedules), drawn like [`batch_wait_ms`].
fn long_looks(rng: &fastrand::Rng) -> bool {
    fastrand::Rng::with_seed(rng.get_seed() ^ 0x100c_5a9a).u32(0..3) == 0
}

impl Params {
    pub(super) fn random(focus: Focus, rng: &mut fastrand::Rng) -> Self {
        let params = Self::mixed(rng);
        match focus {
            Focus::Mixed => params,
            Focus::HandOver => Params {
                focus,
                instances: rng.usize(1..3),
                transactions: rng.usize(150..400),
                aggregates: rng.usize(1..4),
                faults: rng.usize(3..10),
                shutdown_timeout_ms: 100,
                // A dead letter holds its aggregate back: on a few
                // aggregates, little would be left to publish.
                dead_letter: false,
                ..params
            },
        }
    }

    fn mixed(rng: &mut fastrand::Rng) -> Self {
        let mode = match rng.u32(0..5) {
            0 | 1 => SourceMode::Polling,
            2 | 3 => SourceMode::Cdc,
            _ => SourceMode::Auto,
        };
        let mark = match (mode, rng.u32(0..4)) {
            (_, 0) => MarkMode::Update,
            (_, 1) => MarkMode::Delete,
            (_, 3) => MarkMode::Ranges,
            (SourceMode::Cdc, _) => MarkMode::None,
            _ => MarkMode::Update,
        };
        let kafka = rng.bool();
        Params {
            focus: Focus::Mixed,
            mode,
            mark,
            kafka,
            topic_per_type: rng.bool(),
            policy: if mode == SourceMode::Polling && rng.u32(0..3) == 0 {
                HoldPolicy::Wait
            } else {
                HoldPolicy::Follow
            },
            dead_letter: rng.u32(0..8) != 0,
            max_attempts: rng.u32(1..5),
            max_in_flight: rng.usize(3..40),
            batch_size: rng.usize(1..30),
            instances: rng.usize(1..3),
            transactions: rng.usize(20..120),
            aggregates: rng.usize(2..12),
            faults: rng.usize(0..12),
            max_in_flight_bytes: if rng.bool() {
                64 << 20
            } else {
                rng.usize(300..6000)
            },
            messages: mode == SourceMode::Cdc && rng.u32(0..3) == 0,
            shutdown_timeout_ms: if rng.bool() { 100 } else { 5_000 },
            batch_wait_ms: batch_wait_ms(rng),
            long_looks: long_looks(rng),
            confirm_timeout_s: confirm_timeout_s(rng),
        }
    }

    /// Whether an event of aggregate `a` goes as a logical message.
    pub(super) fn as_message(&self, a: usize, rng: &mut fastrand::Rng) -> bool {
        self.messages
            && match self.mark {
                MarkMode::None => rng.bool(),
                _ => a % 2 == 1,
            }
    }

    pub(super) fn toml(&self) -> String {
        let sink = if self.kafka {
            format!(
                "type = \"kafka\"\nbrokers = \"sim:9092\"\ntopic = \"{}\"",
                if self.topic_per_type {
                    "t.{event_type}"
                } else {
                    "t"
                }
            )
        } else {
            format!(
                "type = \"rabbitmq\"\nurl = \"amqp://sim\"\nexchange = \"x\"\nrouting_key = \"{}\"",
                if self.topic_per_type {
                    "{event_type}"
                } else {
                    "all"
                }
            )
        };
        format!(
            r#"
[database]
url = "postgres://sim@sim/sim"
[source]
mode = "{mode}"
batch_size = {batch}
[source.polling]
poll_interval = "1s"
[source.auto]
probe_interval = "1s"
[source.cdc]
messages = {messages}
batch_wait = "{batch_wait}ms"
[relay]
mark = "{mark}"
max_in_flight = {window}
confirm_timeout = "{confirm}s"
shutdown_timeout = "{shutdown}ms"
retry_base = "50ms"
retry_max = "1s"
reject_retry_base = "50ms"
reject_retry_max = "500ms"
standby_poll = "300ms"
[dead_letter]
enabled = {dl}
max_attempts = {attempts}
aggregate = "{policy}"
refresh_interval = "500ms"
[http]
enabled = false
[retention]
enabled = false
[sink]
{sink}
"#,
            mode = self.mode.name(),
            batch = self.batch_size,
            messages = self.messages,
            batch_wait = self.batch_wait_ms,
            mark = match self.mark {
                MarkMode::Update => "update",
                MarkMode::Delete => "delete",
                MarkMode::None => "none",
                MarkMode::Ranges => "ranges",
            },
            window = self.max_in_flight,
            confirm = self.confirm_timeout_s,
            shutdown = self.shutdown_timeout_ms,
            dl = self.dead_letter,
            attempts = self.max_attempts,
            policy = match self.policy {
                HoldPolicy::Follow => "follow",
                HoldPolicy::Wait => "wait",
            },
        )
    }
}
