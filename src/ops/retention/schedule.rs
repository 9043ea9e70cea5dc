//! The cleanup `run` schedules: every `retention.interval`, retried with
//! backoff, each run logged and counted.

use super::{Cleanup, FIRST_RUN_DELAY, Report, SHUTDOWN_GRACE, connect, once_until};
use crate::backoff::Backoff;
use crate::config::{Config, MarkMode, RetentionMode};
use crate::telemetry::events::{InternalEvent, RetentionFailed};
use crate::telemetry::metrics::PipelineMetrics;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Runs the cleanup every `retention.interval` until `shutdown`, on a
/// connection of its own, at most one instance at a time. Failures are
/// logged and retried with backoff; they never end it. Returns at once when
/// `retention.enabled` is false or there is nothing it could ever delete.
pub async fn run_scheduled(
    config: &Config,
    metrics: Option<PipelineMetrics>,
    shutdown: CancellationToken,
) {
    if !has_work(config) {
        return;
    }
    let r = &config.retention;
    let pipeline = config.name.as_str();
    let by_partition = r.mode == RetentionMode::Partitions;
    let mut backoff = Backoff::new(
        config.relay.retry_base,
        config.relay.retry_max.min(r.interval),
    );
    // Partitions are created ahead at once, so no insert finds its range missing.
    let mut wait = if by_partition {
        Duration::ZERO
    } else {
        r.interval.min(FIRST_RUN_DELAY)
    };
    loop {
        // 1. shutdown, 2. the next run.
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(wait) => {}
        }
        let run = async {
            let client = connect(config).await?;
            once_until(&client, config, false, &shutdown).await
        };
        let abandoned = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        };
        // 1. a batch that outlives the shutdown grace, 2. the run.
        let result = tokio::select! {
            biased;
            _ = abandoned => {
                tracing::debug!(pipeline, "retention abandoned at shutdown");
                return;
            }
            result = run => result,
        };
        wait = r.interval;
        match result {
            Ok(report) if report.is_busy() => {
                tracing::debug!(pipeline, "retention skipped: another instance is cleaning");
            }
            Ok(report) => {
                backoff.reset();
                cleaned(pipeline, &report, metrics.as_ref());
            }
            Err(e) => {
                wait = backoff.next_delay();
                if let Some(m) = &metrics {
                    m.retention_failed_cleanup.increment(1);
                }
                RetentionFailed {
                    pipeline,
                    error: &e,
                    kind: e.kind(),
                    attempt: backoff.attempts(),
                    retry_in: wait,
                }
                .emit();
            }
        }
        if shutdown.is_cancelled() {
            return;
        }
    }
}

/// Whether the schedule has anything to do; says why not, and when it has,
/// that it is scheduled.
fn has_work(config: &Config) -> bool {
    let r = &config.retention;
    let pipeline = config.name.as_str();
    if !r.enabled {
        tracing::debug!(pipeline, "retention disabled");
        return false;
    }
    let by_partition = r.mode == RetentionMode::Partitions;
    let keeps_sent = matches!(config.relay.mark, MarkMode::Update | MarkMode::Ranges);
    if !keeps_sent && !config.dead_letter.enabled && !by_partition {
        tracing::info!(pipeline, mark = ?config.relay.mark, "retention has nothing to clean: sent rows are not kept and dead-lettering is off");
        return false;
    }
    tracing::info!(pipeline, interval = ?r.interval, sent_window = ?r.sent_window, dead_letter_window = ?r.dead_letter_window, "retention scheduled");
    true
}

/// A cleanup done: counted, and logged at info when rows were deleted, else
/// at debug (a quiet outbox would log the same line every interval).
fn cleaned(pipeline: &str, report: &Report, metrics: Option<&PipelineMetrics>) {
    if let Some(m) = metrics {
        m.retention_outbox.increment(report.outbox.rows());
        m.retention_dead_letters
            .increment(report.dead_letters.rows());
        if let Some(p) = &report.partitions {
            m.partitions_created.increment(p.created.len() as u64);
            m.partitions_dropped.increment(p.dropped.len() as u64);
            m.retention_failed_create
                .increment(p.create_failures as u64);
            m.retention_failed_drop.increment(p.failed.len() as u64);
        }
    }
    if let Some(hint) = &report.hint {
        tracing::warn!(pipeline, hint = %hint, "retention is slow");
    }
    let (outbox, letters) = (report.outbox.rows(), report.dead_letters.rows());
    let batches = match report.outbox {
        Cleanup::Done { batches, .. } => batches,
        Cleanup::Skipped(_) => 0,
    };
    let took_ms = report.duration.as_millis() as u64;
    if let Some(p) = &report.partitions {
        for name in &p.created {
            tracing::info!(pipeline, partition = %name, "retention created partition");
        }
        for name in &p.dropped {
            tracing::info!(pipeline, partition = %name, "retention dropped partition");
        }
        for (name, why) in &p.kept {
            tracing::debug!(pipeline, partition = %name, reason = %why, "retention kept expired partition");
        }
        for (name, why) in &p.failed {
            tracing::warn!(pipeline, partition = %name, error = %why, "retention could not drop expired partition; kept, the run went on");
        }
        for problem in &p.problems {
            tracing::warn!(pipeline, problem = %problem, "retention could not create a partition");
        }
    }
    if outbox + letters > 0 || report.interrupted {
        tracing::info!(
            pipeline,
            sent_rows = outbox,
            batches,
            dead_letters = letters,
            took_ms,
            interrupted = report.interrupted,
            "retention cleanup done"
        );
    } else {
        tracing::debug!(pipeline, took_ms, summary = %report, "retention cleanup found nothing to delete");
    }
}
