//! `[source]`: how the relay reads the outbox (polling, CDC or auto), with
//! the keys of each mode.

use super::{MarkMode, TableName, defaults, duration};
use serde::Deserialize;
use std::time::Duration;

/// How the relay learns about new rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum SourceMode {
    /// Query the table for unsent rows (optionally woken by LISTEN/NOTIFY).
    #[default]
    Polling,
    /// Tail the write-ahead log through a logical replication slot.
    Cdc,
    /// CDC while the server allows it, polling while it does not (needs
    /// rows marked, so either reader can pick up where the other stopped).
    Auto,
}

super::keyword_enum!(SourceMode { Polling = "polling", Cdc = "cdc", Auto = "auto" });

impl SourceMode {
    /// The keyword, as written in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            SourceMode::Polling => "polling",
            SourceMode::Cdc => "cdc",
            SourceMode::Auto => "auto",
        }
    }

    /// Whether this mode may read by logical replication (and so needs the
    /// publication, and the slot name to itself).
    pub fn may_use_cdc(self) -> bool {
        matches!(self, SourceMode::Cdc | SourceMode::Auto)
    }

    /// Whether this mode may poll the table.
    pub fn may_poll(self) -> bool {
        matches!(self, SourceMode::Polling | SourceMode::Auto)
    }
}

/// `[source]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SourceConfig {
    #[serde(default)]
    pub mode: SourceMode,
    /// Rows read per query (polling) or events handed to the relay at once (CDC).
    #[serde(default = "defaults::batch_size")]
    pub batch_size: usize,
    #[serde(default)]
    pub polling: PollingConfig,
    #[serde(default)]
    pub cdc: CdcConfig,
    #[serde(default)]
    pub auto: AutoConfig,
}

impl Default for SourceConfig {
    fn default() -> Self {
        SourceConfig {
            mode: SourceMode::default(),
            batch_size: defaults::batch_size(),
            polling: PollingConfig::default(),
            cdc: CdcConfig::default(),
            auto: AutoConfig::default(),
        }
    }
}

/// `[source.auto]`: switching between CDC and polling (`source.mode = "auto"`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AutoConfig {
    /// While polling, how often the relay looks whether CDC has become possible.
    #[serde(default = "defaults::probe_interval", with = "duration")]
    pub probe_interval: Duration,
}

impl Default for AutoConfig {
    fn default() -> Self {
        AutoConfig {
            probe_interval: defaults::probe_interval(),
        }
    }
}

/// `[source.cdc]`: logical replication.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CdcConfig {
    /// The logical replication slot; default `outbox_relay_<table>`.
    #[serde(default)]
    pub slot: Option<String>,
    /// The publication (inserts into the outbox table only); default `outbox_relay_<table>`.
    #[serde(default)]
    pub publication: Option<String>,
    /// `run` creates the slot when it is missing.
    #[serde(default = "defaults::yes")]
    pub create_slot: bool,
    /// Longest time between two status updates to the server (also bounded by
    /// half of the server's `wal_sender_timeout`).
    #[serde(default = "defaults::status_interval", with = "duration")]
    pub status_interval: Duration,
    /// How long a committed transaction waits in the reader for later ones
    /// to join its batch, when the stream has no more at hand and the batch
    /// is not full: one hand-over for several small transactions instead of
    /// one each. 0 hands over at once.
    #[serde(default = "defaults::batch_wait", with = "duration")]
    pub batch_wait: Duration,
    /// When set, write a tiny logical message this often so the slot moves on
    /// even when the database is otherwise idle.
    #[serde(default, with = "duration::option")]
    pub heartbeat_interval: Option<Duration>,
    /// What `run` does when PostgreSQL removed WAL the slot still needed;
    /// `None`: recreate when rows are marked, stop otherwise.
    #[serde(default)]
    pub on_lost_slot: Option<LostSlot>,
    /// Create the slot as a failover slot (PostgreSQL 17+), which standbys
    /// with `sync_replication_slots` keep in step so it survives a failover.
    #[serde(default)]
    pub failover: bool,
    /// Also publish the application's transactional logical decoding
    /// messages (`pg_logical_emit_message`) that carry [`Self::message_prefix`]:
    /// the table-less outbox.
    #[serde(default)]
    pub messages: bool,
    /// The prefix of those messages; default `outbox_relay_<table>`.
    #[serde(default)]
    pub message_prefix: Option<String>,
}

/// The prefix of the CDC source's own heartbeat messages, which are never events.
pub const HEARTBEAT_MESSAGE_PREFIX: &str = "outbox-relay";

/// What the relay does with a lost slot (its WAL removed past
/// `max_slot_wal_keep_size`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum LostSlot {
    /// Drop it, create a new one and publish the unsent rows from the table
    /// first: nothing is lost while rows are marked.
    Recreate,
    /// Fail with the recovery spelled out, until an operator acts.
    Stop,
}

super::keyword_enum!(LostSlot { Recreate = "recreate", Stop = "stop" });

impl Default for CdcConfig {
    fn default() -> Self {
        CdcConfig {
            slot: None,
            publication: None,
            create_slot: true,
            status_interval: defaults::status_interval(),
            batch_wait: defaults::batch_wait(),
            heartbeat_interval: None,
            on_lost_slot: None,
            failover: false,
            messages: false,
            message_prefix: None,
        }
    }
}

impl CdcConfig {
    pub fn slot_name(&self, table: &TableName) -> String {
        self.slot
            .clone()
            .unwrap_or_else(|| default_replication_name(table))
    }

    /// Whether `run` recreates a lost slot: as configured, else whenever
    /// rows are marked (the table then still holds every unsent event) and
    /// no events come as logical messages (which the WAL alone holds).
    pub fn recreates_lost_slot(&self, mark: MarkMode) -> bool {
        match self.on_lost_slot {
            Some(choice) => choice == LostSlot::Recreate,
            None => mark != MarkMode::None && !self.messages,
        }
    }

    /// The prefix of the logical messages that are events, when they are on.
    pub fn message_prefix(&self, table: &TableName) -> Option<String> {
        self.messages.then(|| {
            self.message_prefix
                .clone()
                .unwrap_or_else(|| default_replication_name(table))
        })
    }

    pub fn publication_name(&self, table: &TableName) -> String {
        self.publication
            .clone()
            .unwrap_or_else(|| default_replication_name(table))
    }
}

/// `outbox_relay_<table>`, lowercased, with anything but `a-z0-9_` as `_`
/// (slot names allow nothing else).
pub fn default_replication_name(table: &TableName) -> String {
    table
        .derived("outbox_relay")
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '_') => c,
            _ => '_',
        })
        .collect()
}

/// `[source.polling]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PollingConfig {
    /// Longest wait between two looks at the table when nothing woke the relay.
    #[serde(default = "defaults::poll_interval", with = "duration")]
    pub poll_interval: Duration,
    /// LISTEN for the insert trigger's NOTIFY so new rows are read at once.
    /// Off by default: a NOTIFY makes every inserting transaction take one
    /// lock for the whole database from its commit until the commit is on
    /// disk, so those commits no longer share WAL flushes.
    #[serde(default)]
    pub notify: bool,
    /// The NOTIFY channel; default `outbox_relay_<table>`.
    #[serde(default)]
    pub notify_channel: Option<String>,
}

impl Default for PollingConfig {
    fn default() -> Self {
        PollingConfig {
            poll_interval: defaults::poll_interval(),
            notify: false,
            notify_channel: None,
        }
    }
}
