//! Typed internal events: each type is one thing that happened, and
//! [`InternalEvent::emit`] writes its log line and bumps the metrics that go
//! with it, in one place, so a line and its counter cannot drift apart and
//! a reader finds every message of a kind together. Lines follow the
//! crate's style: lowercase fragments, fields first, never payloads or
//! secrets. (The publish path's refusals and dead letters still log and
//! count where they happen, in `relay::pipeline::publish`.)

use super::metrics::{PipelineMetrics, SLOTS_RECREATED};
use crate::errors::{self, ErrorKind};
use std::fmt::Display;
use std::time::Duration;
use tracing::Level;

/// Something the relay reports: a log line, and the metrics that count it.
pub trait InternalEvent {
    fn emit(self);
}

/// A missing replication slot was created.
pub struct SlotCreated<'a> {
    pub slot: &'a str,
    pub consistent_point: &'a dyn Display,
}

impl InternalEvent for SlotCreated<'_> {
    fn emit(self) {
        tracing::info!(slot = %self.slot, consistent_point = %self.consistent_point, "created the replication slot");
    }
}

/// A lost slot was dropped and created again
/// (`source.cdc.on_lost_slot = "recreate"`).
pub struct SlotRecreated<'a> {
    pub pipeline: &'a str,
    pub slot: &'a str,
    pub consistent_point: &'a dyn Display,
}

impl InternalEvent for SlotRecreated<'_> {
    fn emit(self) {
        metrics::counter!(SLOTS_RECREATED, "pipeline" => self.pipeline.to_owned()).increment(1);
        tracing::error!(
            slot = %self.slot,
            consistent_point = %self.consistent_point,
            "the replication slot was lost (PostgreSQL removed WAL it still needed; raise max_slot_wal_keep_size \
             or keep the relay running): dropped it and created a new one; unsent rows are published from the table first"
        );
    }
}

/// Streaming started from the slot.
pub struct SlotStreaming<'a> {
    pub slot: &'a str,
    pub from: &'a dyn Display,
}

impl InternalEvent for SlotStreaming<'_> {
    fn emit(self) {
        tracing::info!(slot = %self.slot, from = %self.from, "streaming from the replication slot");
    }
}

/// The slot was moved past the WAL a start-up read covered, or could not be.
pub enum SlotAdvanced<'a> {
    Moved {
        slot: &'a str,
        from: &'a dyn Display,
        to: &'a dyn Display,
    },
    /// The server refused the move: the stream skips those transactions.
    Refused { error: &'a dyn Display },
    /// The task moving it ended without an answer.
    Stopped { error: &'a dyn Display },
}

impl InternalEvent for SlotAdvanced<'_> {
    fn emit(self) {
        match self {
            SlotAdvanced::Moved { slot, from, to } => {
                tracing::info!(slot = %slot, from = %from, to = %to,
                "moved the replication slot past the WAL the start-up read covered")
            }
            SlotAdvanced::Refused { error } => tracing::warn!(error = %error,
                "could not move the replication slot past the start-up read; the stream skips those transactions instead"),
            SlotAdvanced::Stopped { error } => {
                tracing::warn!(error = %error, "moving the replication slot stopped")
            }
        }
    }
}

/// The replication stream was closed, having reported `flushed`.
pub struct StreamClosed<'a> {
    pub slot: &'a str,
    pub flushed: &'a dyn Display,
}

impl InternalEvent for StreamClosed<'_> {
    fn emit(self) {
        tracing::info!(slot = %self.slot, flushed = %self.flushed, "replication stream closed");
    }
}

/// Dead letters were redriven or dropped, so their aggregates flow again.
pub enum AggregatesResumed {
    /// Told by the acker, as the letters were resolved.
    Resolved,
    /// Seen in the dead-letter table: this many aggregates have no open letter left.
    Refreshed { aggregates: usize },
}

impl InternalEvent for AggregatesResumed {
    fn emit(self) {
        match self {
            AggregatesResumed::Resolved => {
                tracing::info!("dead letters were redriven or dropped; their aggregates resume")
            }
            AggregatesResumed::Refreshed { aggregates } => tracing::info!(
                aggregates,
                "dead letters redriven or dropped; their aggregates resume"
            ),
        }
    }
}

/// Redriven dead letters were queued to be published, ahead of the batch.
pub struct LettersRedriven {
    pub letters: usize,
    pub aggregates: usize,
}

impl InternalEvent for LettersRedriven {
    fn emit(self) {
        tracing::info!(
            letters = self.letters,
            aggregates = self.aggregates,
            "publishing redriven dead letters"
        );
    }
}

/// Aggregates held back after a refusal are tried again.
pub struct RefusalsRetried {
    pub aggregates: usize,
}

impl InternalEvent for RefusalsRetried {
    fn emit(self) {
        tracing::info!(aggregates = self.aggregates, "retrying refused events");
    }
}

/// A pipeline run ended with an error and is restarted after `retry_in`.
pub struct PipelineInterrupted<'a> {
    pub metrics: &'a PipelineMetrics,
    pub error: &'a dyn Display,
    pub kind: ErrorKind,
    pub attempt: u32,
    pub retry_in: Duration,
}

impl InternalEvent for PipelineInterrupted<'_> {
    fn emit(self) {
        let Self {
            error,
            attempt,
            retry_in,
            ..
        } = self;
        self.metrics.restarts.increment(1);
        if errors::policy(self.kind).level == Level::WARN {
            tracing::warn!(error = %error, attempt, retry_in = ?retry_in, "relay interrupted; reconnecting");
        } else {
            tracing::error!(error = %error, attempt, retry_in = ?retry_in, "relay cannot work until this is fixed; retrying");
        }
    }
}

/// A scheduled retention cleanup failed and is retried after `retry_in`.
pub struct RetentionFailed<'a> {
    pub pipeline: &'a str,
    pub error: &'a dyn Display,
    pub kind: ErrorKind,
    pub attempt: u32,
    pub retry_in: Duration,
}

impl InternalEvent for RetentionFailed<'_> {
    fn emit(self) {
        let Self {
            pipeline,
            error,
            attempt,
            retry_in,
            ..
        } = self;
        if errors::policy(self.kind).level == Level::WARN {
            tracing::warn!(pipeline, error = %error, attempt, retry_in = ?retry_in, "retention cleanup failed; retrying");
        } else {
            tracing::error!(pipeline, error = %error, attempt, retry_in = ?retry_in, "retention cleanup cannot work until this is fixed; retrying");
        }
    }
}
