//! What the relay talks to besides PostgreSQL: the broker, the
//! destinations events would go to, and the trace collector.

use super::{Mark, Report};
use crate::config::Config;
use crate::sink::{AnySink, Sink, SinkCheck, SinkError};
use std::time::Duration;

/// How long `check` waits for the broker's answer to one question.
const ANSWER_WITHIN: Duration = Duration::from_secs(15);

/// How long `check` waits for a connection: longer than a sink's own
/// connect limit (15 s for RabbitMQ), so that the sink's error, which says
/// what went silent, comes first; two equal limits raced.
const CONNECTED_WITHIN: Duration = Duration::from_secs(20);

/// `asked`, or an error when the broker has not answered it in time (a
/// broker that accepts the connection and then goes silent).
async fn answered<T>(
    asked: impl std::future::Future<Output = Result<T, SinkError>>,
) -> Result<T, SinkError> {
    answered_within(ANSWER_WITHIN, asked).await
}

async fn answered_within<T>(
    limit: Duration,
    asked: impl std::future::Future<Output = Result<T, SinkError>>,
) -> Result<T, SinkError> {
    tokio::time::timeout(limit, asked)
        .await
        .unwrap_or_else(|_| {
            Err(SinkError::Unavailable(
                format!("the broker did not answer within {}s", limit.as_secs()).into(),
            ))
        })
}

/// The destinations events would go to: the one fixed destination, or those
/// of the events waiting now; and those unsent rows name themselves.
async fn check_destinations(sink: &mut AnySink, r: &mut Report) {
    let kinds = if sink.fixed_destination() {
        vec![(String::new(), String::new())]
    } else {
        std::mem::take(&mut r.pending_kinds)
    };
    let routed = std::mem::take(&mut r.routed);
    if kinds.is_empty() && routed.is_empty() {
        r.add(
            Mark::Ok,
            "destinations",
            "named per event by the templates; no unsent event to check one for now",
        );
    }
    for (aggregate_type, event_type) in kinds {
        match answered(sink.check_destination(&aggregate_type, &event_type)).await {
            Ok(d) => r.add(Mark::Ok, "destination", format!("{d} exists")),
            Err(e) => r.add(Mark::Fail, "destination", e.to_string()),
        }
    }
    const NAMED: &str = "named by rows' outbox.columns.destination";
    for name in routed {
        let checked = if name.is_empty() {
            Err(SinkError::Rejected("an empty value".into()))
        } else {
            answered(sink.check_named_destination(&name)).await
        };
        match checked {
            Ok(d) => r.add(Mark::Ok, "destination", format!("{d} ({NAMED}) exists")),
            Err(e) => r.add(Mark::Fail, "destination", format!("{NAMED}: {e}")),
        }
    }
}

pub(super) async fn check_broker(config: &Config, r: &mut Report) {
    match answered_within(CONNECTED_WITHIN, AnySink::connect(&config.sink)).await {
        Ok(mut sink) => {
            match answered(sink.probe()).await {
                Ok(()) => {
                    r.add(
                        Mark::Ok,
                        "broker",
                        format!("{} reachable", config.sink.kind()),
                    );
                    check_destinations(&mut sink, r).await;
                }
                Err(e) => r.add(Mark::Fail, "broker", e.to_string()),
            }
            // Nothing to report: a close that hangs only holds the exit.
            let _ = tokio::time::timeout(ANSWER_WITHIN, sink.close()).await;
        }
        Err(e) => r.add(Mark::Fail, "broker", e.to_string()),
    }
}

/// The OTLP collector, when spans are exported: a failure to reach it is a
/// warning (delivery never waits for it), a CA the relay cannot use fails
/// (the relay would not start).
pub(super) async fn check_traces(config: &Config, r: &mut Report) {
    match crate::telemetry::trace::probe(&config.telemetry.otlp).await {
        Ok(None) => {}
        Ok(Some(Ok(answer))) => r.add(Mark::Ok, "traces", answer),
        Ok(Some(Err(reason))) => r.add(
            Mark::Warn,
            "traces",
            format!(
                "cannot export spans: {reason}; events are delivered without them. Check telemetry.otlp.endpoint{}",
                if config.telemetry.otlp.endpoint.as_deref().is_some_and(|e| e.starts_with("https")) {
                    " and telemetry.otlp.ca"
                } else {
                    ""
                }
            ),
        ),
        Err(e) => r.add(Mark::Fail, "traces", e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A broker that accepted the connection and then went silent fails
    /// the check after the bound instead of holding it.
    #[tokio::test(start_paused = true)]
    async fn a_broker_that_never_answers_fails_the_question_in_time() {
        let silent = std::future::pending::<Result<(), SinkError>>();
        match answered(silent).await {
            Err(SinkError::Unavailable(reason)) => {
                assert!(reason.to_string().contains("did not answer within 15s"))
            }
            other => panic!("{other:?}"),
        }
    }
}
