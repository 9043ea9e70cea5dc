//! The CDC source's settings, resolved once from the configuration.

use super::REREAD_ROWS;
use super::STREAM_SKIP_WAL;
use crate::config::{Config, MarkMode, TableName};
use std::time::Duration;

/// CDC settings resolved from the configuration.
#[derive(Debug, Clone)]
pub struct CdcSettings {
    pub slot: String,
    pub publication: String,
    pub create_slot: bool,
    /// Create the slot as a failover slot.
    pub failover: bool,
    pub status_interval: Duration,
    /// How long a committed transaction waits for later ones to join its
    /// batch (`source.cdc.batch_wait`).
    pub batch_wait: Duration,
    pub heartbeat_interval: Option<Duration>,
    /// Rows are marked, so unsent rows can be read from the table at start-up.
    pub read_table: bool,
    /// Sent rows are recorded by ranges (`relay.mark = "ranges"`): the
    /// start-up read goes by the frontier (`startup_rows`).
    pub ranges: bool,
    /// A lost slot is dropped and created again (`source.cdc.on_lost_slot`).
    pub recreate_lost_slot: bool,
    /// The pipeline's name, for metrics.
    pub pipeline: String,
    /// The dead-letter table, when dead-lettering is on.
    pub dead_letters: Option<TableName>,
    /// The prefix of the logical messages that are events (`source.cdc.messages`).
    pub messages: Option<String>,
    /// Report the flushed position once this many events were confirmed
    /// since the last report (the in-flight window): without marking, what
    /// a crash sends again is what the slot was not told.
    pub report_every: u64,
    /// A start-up read that handed over this many rows is repeated
    /// ([`REREAD_ROWS`]).
    pub reread_rows: u64,
    /// With ranges, WAL ahead of the slot that the stream may decode and
    /// skip when it takes over from the start-up read, in bytes
    /// ([`STREAM_SKIP_WAL`]).
    pub stream_skip_wal: u64,
}

impl CdcSettings {
    pub fn from_config(config: &Config) -> Self {
        let cdc = &config.source.cdc;
        let table = &config.outbox.table;
        CdcSettings {
            slot: cdc.slot_name(table),
            publication: cdc.publication_name(table),
            create_slot: cdc.create_slot,
            failover: cdc.failover,
            status_interval: cdc.status_interval,
            batch_wait: cdc.batch_wait,
            heartbeat_interval: cdc.heartbeat_interval,
            read_table: config.relay.mark != MarkMode::None,
            ranges: config.relay.mark == MarkMode::Ranges,
            recreate_lost_slot: cdc.recreates_lost_slot(config.relay.mark),
            pipeline: config.name.clone(),
            dead_letters: config
                .dead_letter
                .enabled
                .then(|| config.dead_letter.table_name(table)),
            messages: cdc.message_prefix(table),
            report_every: config.relay.max_in_flight as u64,
            reread_rows: REREAD_ROWS,
            stream_skip_wal: STREAM_SKIP_WAL,
        }
    }
}
