//! The benchmark's command line, and the plan it resolves to.

use crate::workload::Shape;
use clap::{Parser, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;

#[derive(Debug, Parser)]
#[command(
    name = "cargo bench --bench relay --",
    about = "Measures outbox-relay (the release binary) against the local PostgreSQL, \
             Kafka-protocol broker and RabbitMQ started by scripts/services.sh: backlog drain \
             rate against the broker's and the database's own ceilings, commit-to-confirm \
             latency at fixed rates, CPU and peak RSS. Prints a table and one JSON line per \
             result; asserts nothing."
)]
pub struct Options {
    /// Tiny sizes and short runs, to check that the benchmark works (CI); the figures mean nothing.
    #[arg(long)]
    pub smoke: bool,
    /// Source modes to measure.
    #[arg(long, value_delimiter = ',')]
    pub modes: Option<Vec<Mode>>,
    /// Brokers to measure.
    #[arg(long, value_delimiter = ',')]
    pub brokers: Option<Vec<BrokerKind>>,
    /// Workload shapes, PAYLOAD_BYTES x EVENTS_PER_TRANSACTION.
    #[arg(long, value_delimiter = ',', value_name = "BYTESxEVENTS")]
    pub shapes: Option<Vec<Shape>>,
    /// Events in the backlog of a drain [default: 200000; smoke: 2000].
    #[arg(long)]
    pub events: Option<u64>,
    /// Steady-state writer rates, events per second [default: 1000,5000; smoke: 200].
    #[arg(long, value_delimiter = ',')]
    pub rates: Option<Vec<u32>>,
    /// Length of each steady-state run in seconds [default: 20; smoke: 3].
    #[arg(long)]
    pub seconds: Option<u64>,
    /// Repeat every measurement K times and report medians.
    #[arg(long, default_value_t = 1, value_name = "K")]
    pub runs: usize,
    /// Drain a backlog of 1,000,000 events (first shape; polling x kafka unless
    /// --modes/--brokers say otherwise) and report peak RSS. Skips the steady state.
    #[arg(long)]
    pub one_million: bool,
    /// What to measure: the backlog drain, the steady state, and the latency
    /// of a writer started together with the relay after a backlog.
    #[arg(long, value_delimiter = ',', default_value = "drain,steady")]
    pub phases: Vec<Phase>,
    /// Run each drain once per `relay.mark` listed, in the same invocation, and
    /// compare the rates ("none" is measured in CDC mode only: polling needs marking)
    /// [default: "update", pinned in the bench's configuration].
    #[arg(long, value_delimiter = ',')]
    pub marks: Option<Vec<Mark>>,
    /// after-backlog: backlogs committed while the relay is stopped, EVENTSxEVENTS_PER_TX
    /// of 256 B events; a run without backlog (the baseline) always comes first
    /// [default: 100000x100,1000000x1; smoke: 2000x100,2000x1].
    #[arg(long, value_delimiter = ',', value_name = "EVENTSxEVENTS")]
    pub backlogs: Option<Vec<Backlog>>,
    /// after-backlog: the writer's rate in events per second, started with the relay
    /// [default: 1000; smoke: 200].
    #[arg(long)]
    pub after_rate: Option<u32>,
    /// after-backlog: events per writer transaction.
    #[arg(long, default_value_t = 10)]
    pub after_tx_events: u32,
    /// Distinct aggregate ids, used in rotation.
    #[arg(long, default_value_t = 1000)]
    pub aggregates: u32,
    /// The type of the RabbitMQ queue the benchmark declares and reads.
    #[arg(long, value_enum, default_value_t = QueueType::Classic)]
    pub rabbitmq_queue: QueueType,
    /// Longest wait for a drain, in seconds [default: 60 + events / 500].
    #[arg(long)]
    pub timeout: Option<u64>,
    /// Before each measurement, wait up to this many seconds for the machine
    /// to be quiet (under 35% busy for a second); 0 does not wait.
    #[arg(long, default_value_t = 60, value_name = "SECONDS")]
    pub quiet_wait: u64,
    /// Drains only: skip the database's and the broker's ceilings, and
    /// their ratios. For comparing marks: a drain then follows its backlog
    /// within seconds, with no ceiling's own WAL (100k rows marked and
    /// recorded) between them for the slot to pass or decode.
    #[arg(long)]
    pub no_ceilings: bool,
    /// Record `perf` profiles during each measurement into this directory:
    /// the relay with DWARF call graphs, and the whole machine by process.
    #[arg(long, value_name = "DIR")]
    pub perf: Option<PathBuf>,
    /// Run the relay with this configuration override, e.g.
    /// OUTBOX_RELAY__SINK__LINGER=20ms, or with this setting of its runtime,
    /// e.g. TOKIO_WORKER_THREADS=1 (repeatable; for experiments).
    #[arg(long, value_name = "OUTBOX_RELAY__SECTION__KEY=VALUE", value_parser = relay_env)]
    pub relay_env: Vec<(String, String)>,
    /// Also append the JSON lines to this file.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    Polling,
    Cdc,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Polling => "polling",
            Mode::Cdc => "cdc",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BrokerKind {
    Kafka,
    Rabbitmq,
}

impl BrokerKind {
    pub fn name(self) -> &'static str {
        match self {
            BrokerKind::Kafka => "kafka",
            BrokerKind::Rabbitmq => "rabbitmq",
        }
    }

    /// The broker's process name on this machine (`/proc/<pid>/comm`).
    pub fn process_name(self) -> &'static str {
        match self {
            BrokerKind::Kafka => "tansu",
            BrokerKind::Rabbitmq => "beam.smp",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Phase {
    Drain,
    Steady,
    AfterBacklog,
}

/// A RabbitMQ queue type (`x-queue-type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QueueType {
    Classic,
    Quorum,
}

impl QueueType {
    pub fn name(self) -> &'static str {
        match self {
            QueueType::Classic => "classic",
            QueueType::Quorum => "quorum",
        }
    }
}

/// `relay.mark`: what the relay does with a row once the broker confirmed it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mark {
    Update,
    Delete,
    None,
    /// Recorded by ranges of `relay_seq` (PostgreSQL 14 or later).
    Ranges,
}

impl Mark {
    pub fn name(self) -> &'static str {
        match self {
            Mark::Update => "update",
            Mark::Delete => "delete",
            Mark::None => "none",
            Mark::Ranges => "ranges",
        }
    }

    /// The relay refuses `mark = "none"` with the polling source.
    pub fn allowed(self, mode: Mode) -> bool {
        match self {
            Mark::None => mode == Mode::Cdc,
            _ => true,
        }
    }
}

/// A backlog for the after-backlog stage: `events` committed in transactions of `tx_events`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backlog {
    pub events: u64,
    pub tx_events: u32,
}

impl std::str::FromStr for Backlog {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || format!("{s:?}: write EVENTSxEVENTS_PER_TX, e.g. 100000x100");
        let (events, tx) = s.split_once('x').ok_or_else(bad)?;
        let events: u64 = events.trim().replace('_', "").parse().map_err(|_| bad())?;
        let tx_events: u32 = tx.trim().parse().map_err(|_| bad())?;
        if events == 0 || tx_events == 0 {
            return Err(bad());
        }
        Ok(Backlog { events, tx_events })
    }
}

impl std::fmt::Display for Backlog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}x{}", self.events, self.tx_events)
    }
}

/// What one invocation measures, with every default applied.
#[derive(Debug, Clone)]
pub struct Plan {
    pub modes: Vec<Mode>,
    pub brokers: Vec<BrokerKind>,
    pub shapes: Vec<Shape>,
    pub events: u64,
    pub rates: Vec<u32>,
    pub seconds: u64,
    pub runs: usize,
    pub phases: Vec<Phase>,
    /// `relay.mark` per drain; `None`: the relay's default (or `--relay-env`'s).
    pub marks: Vec<Option<Mark>>,
    pub backlogs: Vec<Backlog>,
    pub after_rate: u32,
    pub after_tx_events: u32,
    pub aggregates: u32,
    pub rabbitmq_queue: QueueType,
    pub drain_timeout: Duration,
    /// `--timeout`, when given.
    pub timeout: Option<Duration>,
    pub one_million: bool,
    pub smoke: bool,
    pub quiet_wait: Duration,
    pub ceilings: bool,
    pub perf: Option<PathBuf>,
    pub relay_env: Vec<(String, String)>,
}

impl Options {
    pub fn plan(&self) -> Plan {
        let million = self.one_million;
        let modes = self.modes.clone().unwrap_or_else(|| {
            if million {
                vec![Mode::Polling]
            } else {
                vec![Mode::Polling, Mode::Cdc]
            }
        });
        let brokers = self.brokers.clone().unwrap_or_else(|| {
            if million {
                vec![BrokerKind::Kafka]
            } else {
                vec![BrokerKind::Kafka, BrokerKind::Rabbitmq]
            }
        });
        let mut shapes = self.shapes.clone().unwrap_or_else(|| {
            if self.smoke {
                vec![Shape::new(256, 1)]
            } else {
                Shape::ALL.to_vec()
            }
        });
        if million {
            shapes.truncate(1);
        }
        let events = match (million, self.events, self.smoke) {
            (true, _, _) => 1_000_000,
            (false, Some(n), _) => n,
            (false, None, true) => 2_000,
            (false, None, false) => 200_000,
        };
        let events = events.max(1);
        let rates = self.rates.clone().unwrap_or_else(|| {
            if self.smoke {
                vec![200]
            } else {
                vec![1_000, 5_000]
            }
        });
        let rates = rates.into_iter().filter(|r| *r > 0).collect();
        let seconds = self
            .seconds
            .unwrap_or(if self.smoke { 3 } else { 20 })
            .max(1);
        let phases = if million {
            vec![Phase::Drain]
        } else {
            self.phases.clone()
        };
        let marks = match &self.marks {
            Some(m) if !m.is_empty() && !million => m.iter().copied().map(Some).collect(),
            _ => vec![None],
        };
        let backlogs = self.backlogs.clone().unwrap_or_else(|| {
            let events = if self.smoke { 2_000 } else { 0 };
            if events > 0 {
                vec![
                    Backlog {
                        events,
                        tx_events: 100,
                    },
                    Backlog {
                        events,
                        tx_events: 1,
                    },
                ]
            } else {
                vec![
                    Backlog {
                        events: 100_000,
                        tx_events: 100,
                    },
                    Backlog {
                        events: 1_000_000,
                        tx_events: 1,
                    },
                ]
            }
        });
        let after_rate = self
            .after_rate
            .unwrap_or(if self.smoke { 200 } else { 1_000 })
            .max(1);
        Plan {
            modes,
            brokers,
            shapes,
            events,
            rates,
            seconds,
            runs: self.runs.max(1),
            phases,
            marks,
            backlogs,
            after_rate,
            after_tx_events: self.after_tx_events.max(1),
            aggregates: self.aggregates.max(1),
            rabbitmq_queue: self.rabbitmq_queue,
            drain_timeout: Duration::from_secs(self.timeout.unwrap_or(60 + events / 500)),
            timeout: self.timeout.map(Duration::from_secs),
            one_million: million,
            smoke: self.smoke,
            quiet_wait: Duration::from_secs(if self.smoke { 0 } else { self.quiet_wait }),
            ceilings: !self.no_ceilings,
            perf: self.perf.clone(),
            relay_env: self.relay_env.clone(),
        }
    }
}

impl Plan {
    /// Longest wait for a backlog of `events` to be sent.
    pub fn timeout_for(&self, events: u64) -> Duration {
        self.timeout
            .unwrap_or(Duration::from_secs(60 + events / 500))
    }
}

fn relay_env(s: &str) -> Result<(String, String), String> {
    match s.split_once('=') {
        Some((name, value)) if name.starts_with("OUTBOX_RELAY__") || name.starts_with("TOKIO_") => {
            Ok((name.to_owned(), value.to_owned()))
        }
        _ => Err(format!(
            "{s:?}: write OUTBOX_RELAY__SECTION__KEY=VALUE (or TOKIO_NAME=VALUE for the relay's runtime), e.g. OUTBOX_RELAY__RELAY__MARK=delete"
        )),
    }
}
