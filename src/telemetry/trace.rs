//! A span per published event, exported over OTLP when
//! `telemetry.otlp.endpoint` is set.
//!
//! The span starts when the event's batch reaches the pipeline (read) and
//! ends when its row is marked sent or its WAL position acknowledged, with
//! events `published` (handed to the broker client), `confirmed` and
//! `marked` on the way. It continues the row's `traceparent`
//! (<https://www.w3.org/TR/trace-context/>) and names itself in the
//! message's `traceparent`, so consumers' spans nest under the relay's.
//!
//! Spans are built with the OpenTelemetry SDK directly rather than as
//! `tracing` spans: one lives from read to mark across the pipeline loop, its
//! in-flight futures and the acker task, which a handle that is moved along
//! expresses plainly; it needs no global subscriber (so the log filter never
//! decides what is exported, and in-process tests see their own spans); and
//! when export is off nothing is built at all: [`EventSpan`] is an empty
//! `Option`, and the message is built exactly as without this module.
//!
//! Export never slows delivery down: finished spans go into a bounded queue
//! (`telemetry.otlp.max_queue_size`, 2048 spans by default) drained by
//! the SDK's batch processor on its own thread, each request bounded by
//! [`EXPORT_TIMEOUT`]. When the collector is slow or gone, spans that do not
//! fit are dropped; memory stays bounded and the pipeline never waits.

use crate::config::OtlpConfig;
use crate::outbox::OutboxEvent;
use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{Span as _, SpanKind, Status, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{
    BatchConfigBuilder, BatchSpanProcessor, Sampler, SdkTracer, SdkTracerProvider, SpanData,
    SpanExporter,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

/// Spans sent in one export request.
pub const MAX_EXPORT_BATCH: usize = 512;
/// How long finished spans wait before they are sent (unless a batch is full).
pub const EXPORT_DELAY: Duration = Duration::from_secs(1);
/// One export request's time limit.
pub const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
/// The least time the exporter gets to send what is queued at shutdown,
/// even when draining the pipelines used all of `relay.shutdown_timeout`.
pub const MIN_FLUSH: Duration = Duration::from_secs(1);
/// Where OTLP/HTTP receivers take traces, below the configured base URL.
pub const TRACES_PATH: &str = "/v1/traces";

/// The instrumentation scope the spans are reported under.
const SCOPE: &str = "outbox-relay";

/// The attribute names of an event's span.
pub mod attribute {
    pub const MESSAGING_SYSTEM: &str = "messaging.system";
    pub const OPERATION: &str = "messaging.operation.type";
    pub const EVENT_ID: &str = "messaging.message.id";
    pub const DESTINATION: &str = "messaging.destination.name";
    pub const AGGREGATE_TYPE: &str = "outbox.aggregate_type";
    pub const AGGREGATE_ID: &str = "outbox.aggregate_id";
    pub const EVENT_TYPE: &str = "outbox.event_type";
    pub const OUTCOME: &str = "outbox.outcome";
    pub const PIPELINE: &str = "outbox.pipeline";
}

/// What became of an event, as the `outbox.outcome` attribute says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The broker confirmed it.
    Published,
    /// It went to the dead-letter table.
    DeadLettered,
    /// The broker refused it (it is retried later) or could not be reached
    /// (it is sent again), or the run ended before its answer.
    Failed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Published => "published",
            Outcome::DeadLettered => "dead-lettered",
            Outcome::Failed => "failed",
        }
    }
}

/// Makes event spans when export is on; cheap to clone, off by default.
#[derive(Clone, Default)]
pub struct EventTracer {
    export: Option<Arc<Export>>,
    /// The pipeline's name and broker kind, for the spans' attributes.
    pipeline: Arc<str>,
    system: &'static str,
}

struct Export {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    propagator: TraceContextPropagator,
}

impl std::fmt::Debug for EventTracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.export.is_some() {
            "EventTracer(on)"
        } else {
            "EventTracer(off)"
        })
    }
}

/// Why export could not start as configured.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(
        "telemetry.otlp.ca: cannot use {path}: {reason}; point it at a PEM file of the collector's CA certificates"
    )]
    Ca { path: PathBuf, reason: String },
    #[error("cannot build the OTLP exporter's HTTP client: {0}")]
    Client(String),
}

/// The exporter's HTTP client: the system's CAs, and those in `ca`.
///
/// Built on a thread of its own: the blocking client runs a runtime of its
/// own, which may not be started from inside the relay's.
fn http_client(ca: Option<&Path>) -> Result<reqwest::blocking::Client, TraceError> {
    let mut builder = reqwest::blocking::Client::builder().timeout(EXPORT_TIMEOUT);
    if let Some(path) = ca {
        let bad = |reason: String| TraceError::Ca {
            path: path.to_owned(),
            reason,
        };
        let pem = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
        let certs = reqwest::Certificate::from_pem_bundle(&pem)
            .map_err(|e| bad(format!("not PEM certificates ({e})")))?;
        if certs.is_empty() {
            return Err(bad("holds no PEM certificate".into()));
        }
        for cert in certs {
            builder = builder.add_root_certificate(cert);
        }
    }
    std::thread::spawn(move || builder.build())
        .join()
        .map_err(|_| TraceError::Client("the thread building it failed".into()))?
        .map_err(|e| TraceError::Client(e.to_string()))
}

/// Sends an empty export request (which a receiver accepts and ignores) to
/// `config.endpoint`, for `outbox-relay check`: `Ok(None)` when export is
/// off, `Ok(Some(status))` when the collector answered, an error when the
/// CA cannot be used; a collector that cannot be reached or verified is
/// `Ok(Some(reason))` with the reason.
pub async fn probe(config: &OtlpConfig) -> Result<Option<Result<String, String>>, TraceError> {
    let Some(endpoint) = config.endpoint.as_deref() else {
        return Ok(None);
    };
    let url = format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/'));
    // The endpoint may carry credentials (user:token@host).
    let shown = crate::config::redact_url(&url);
    let client = http_client(config.ca.as_deref())?;
    let answer = tokio::task::spawn_blocking(move || {
        let sent = client
            .post(&url)
            .header("content-type", "application/x-protobuf")
            .body(Vec::new())
            .send();
        // The client is dropped here, off the async runtime.
        match sent {
            Ok(r) if r.status().is_success() => {
                Ok(format!("{shown} accepted an export ({})", r.status()))
            }
            Ok(r) => Err(format!("{shown} answered {}", r.status())),
            Err(e) => Err(format!("{shown}: {}", error_chain(&e.without_url()))),
        }
    })
    .await
    .map_err(|e| TraceError::Client(e.to_string()))?;
    Ok(Some(answer))
}

/// An error and its sources, as one line (TLS failures hide the reason in
/// a source).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

impl EventTracer {
    /// Starts exporting when `config.endpoint` is set; off otherwise, or
    /// (logged) when the exporter cannot be built. A `telemetry.otlp.ca`
    /// that cannot be read or holds no certificate is an error: the
    /// operator asked for that trust, and running without it would only
    /// show as spans that never arrive.
    pub fn start(config: &OtlpConfig) -> Result<EventTracer, TraceError> {
        let Some(endpoint) = config.endpoint.as_deref() else {
            return Ok(EventTracer::default());
        };
        let url = format!("{}{TRACES_PATH}", endpoint.trim_end_matches('/'));
        let shown = crate::config::redact_url(&url);
        let client = http_client(config.ca.as_deref())?;
        let exporter = match opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_protocol(Protocol::HttpBinary)
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
        {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(error = %e, endpoint = %shown, "cannot export traces; continuing without them");
                return Ok(EventTracer::default());
            }
        };
        let batch = BatchConfigBuilder::default()
            .with_max_queue_size(config.max_queue_size)
            .with_max_export_batch_size(MAX_EXPORT_BATCH.min(config.max_queue_size))
            .with_scheduled_delay(EXPORT_DELAY)
            .build();
        let processor = BatchSpanProcessor::builder(Reported::new(exporter, shown.clone()))
            .with_batch_config(batch)
            .build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            // An upstream decision not to sample is kept; a new trace is sampled.
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::AlwaysOn)))
            .with_resource(
                Resource::builder()
                    .with_service_name(config.service_name.clone())
                    .build(),
            )
            .build();
        let tracer = provider.tracer(SCOPE);
        tracing::info!(endpoint = %shown, max_queue_size = config.max_queue_size, "exporting a span per event over OTLP");
        Ok(EventTracer {
            export: Some(Arc::new(Export {
                provider,
                tracer,
                propagator: TraceContextPropagator::new(),
            })),
            ..EventTracer::default()
        })
    }

    /// The same exporter, for the spans of one pipeline publishing to `system`.
    pub fn for_pipeline(&self, pipeline: &str, system: &'static str) -> EventTracer {
        EventTracer {
            export: self.export.clone(),
            pipeline: pipeline.into(),
            system,
        }
    }

    pub fn is_on(&self) -> bool {
        self.export.is_some()
    }

    /// The span of `event`, read at `read_at`, on its way to `destination`;
    /// nothing when export is off.
    pub fn span(
        &self,
        event: &OutboxEvent,
        destination: Option<String>,
        read_at: SystemTime,
    ) -> EventSpan {
        let Some(export) = &self.export else {
            return EventSpan(None);
        };
        let parent = export
            .propagator
            .extract_with_context(&Context::new(), &RowHeaders(&event.headers));
        let mut attributes = vec![
            KeyValue::new(attribute::MESSAGING_SYSTEM, self.system),
            KeyValue::new(attribute::OPERATION, "send"),
            KeyValue::new(attribute::EVENT_ID, event.id.clone()),
            KeyValue::new(attribute::AGGREGATE_TYPE, event.aggregate_type.clone()),
            KeyValue::new(attribute::AGGREGATE_ID, event.aggregate_id.clone()),
            KeyValue::new(attribute::EVENT_TYPE, event.event_type.clone()),
            KeyValue::new(attribute::PIPELINE, self.pipeline.to_string()),
        ];
        if let Some(d) = destination {
            attributes.push(KeyValue::new(attribute::DESTINATION, d));
        }
        let span = export
            .tracer
            .span_builder("publish")
            .with_kind(SpanKind::Producer)
            .with_start_time(read_at)
            .with_attributes(attributes)
            .start_with_context(&export.tracer, &parent);
        let cx = span.span_context();
        let traceparent = format!(
            "00-{}-{}-{:02x}",
            cx.trace_id(),
            cx.span_id(),
            cx.trace_flags().to_u8()
        );
        EventSpan(Some(Box::new(Live {
            span,
            traceparent,
            outcome: None,
        })))
    }

    /// Once `shutdown` is cancelled and `drained` (the pipelines) is done,
    /// sends what is queued and stops the exporter, within what is left of
    /// `timeout` after the signal (and at least [`MIN_FLUSH`]).
    pub async fn run_until_stopped(
        &self,
        shutdown: &tokio_util::sync::CancellationToken,
        timeout: Duration,
        drained: impl Future<Output = ()>,
    ) {
        if !self.is_on() {
            return drained.await;
        }
        let signalled = {
            let token = shutdown.clone();
            tokio::spawn(async move {
                token.cancelled().await;
                tokio::time::Instant::now()
            })
        };
        drained.await;
        let now = tokio::time::Instant::now();
        let signalled = match futures::FutureExt::now_or_never(signalled) {
            Some(Ok(at)) => at,
            _ => now,
        };
        let left = (signalled + timeout).saturating_duration_since(now);
        self.shutdown(left.max(MIN_FLUSH)).await;
    }

    /// Sends what is queued and stops the exporter, waiting at most `timeout`.
    pub async fn shutdown(&self, timeout: Duration) {
        let Some(export) = self.export.clone() else {
            return;
        };
        // The SDK blocks until its export thread answers.
        let stopped =
            tokio::task::spawn_blocking(move || export.provider.shutdown_with_timeout(timeout));
        match tokio::time::timeout(timeout + Duration::from_secs(1), stopped).await {
            Ok(Ok(Ok(()))) => tracing::debug!("trace exporter flushed"),
            Ok(Ok(Err(e))) => tracing::warn!(error = %e, "trace exporter did not flush everything"),
            _ => tracing::warn!("trace exporter did not stop in time"),
        }
    }
}

/// The span of one event while the relay handles it; empty when export is off.
#[derive(Default)]
pub struct EventSpan(Option<Box<Live>>);

struct Live {
    span: opentelemetry_sdk::trace::Span,
    /// `00-<trace id>-<this span's id>-<flags>`, for the message.
    traceparent: String,
    outcome: Option<Outcome>,
}

impl std::fmt::Debug for EventSpan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(l) => write!(f, "EventSpan({})", l.traceparent),
            None => f.write_str("EventSpan(off)"),
        }
    }
}

impl EventSpan {
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// The `traceparent` that names this span, for the message.
    pub fn traceparent(&self) -> Option<&str> {
        self.0.as_deref().map(|l| l.traceparent.as_str())
    }

    /// Something happened to the event now: `published`, `confirmed`, `marked`.
    pub fn step(&mut self, name: &'static str) {
        if let Some(l) = &mut self.0 {
            l.span.add_event(name, Vec::new());
        }
    }

    /// Records what became of the event; the span ends when dropped.
    pub fn outcome(&mut self, outcome: Outcome, reason: Option<&str>) {
        let Some(l) = &mut self.0 else {
            return;
        };
        l.outcome = Some(outcome);
        l.span
            .set_attribute(KeyValue::new(attribute::OUTCOME, outcome.as_str()));
        if outcome != Outcome::Published {
            l.span
                .set_status(Status::error(reason.unwrap_or("").to_owned()));
        }
    }
}

impl Drop for Live {
    fn drop(&mut self) {
        if self.outcome.is_none() {
            // The run ended before the broker answered: it is sent again.
            self.span
                .set_attribute(KeyValue::new(attribute::OUTCOME, Outcome::Failed.as_str()));
            self.span.set_status(Status::error(
                "no answer from the broker before the run ended",
            ));
        }
        self.span.end();
    }
}

/// The row's headers, for reading its trace context.
struct RowHeaders<'a>(&'a [(String, String)]);

impl Extractor for RowHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(key))
            .map(|(_, v)| v.as_str())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|(k, _)| k.as_str()).collect()
    }
}

/// The OTLP exporter, saying once when exports start failing and once
/// when they work again (the SDK itself stays quiet).
#[derive(Debug)]
struct Reported<E> {
    inner: E,
    endpoint: String,
    failing: AtomicBool,
}

impl<E> Reported<E> {
    fn new(inner: E, endpoint: String) -> Self {
        Reported {
            inner,
            endpoint,
            failing: AtomicBool::new(false),
        }
    }
}

impl<E: SpanExporter> SpanExporter for Reported<E> {
    async fn export(&self, batch: Vec<SpanData>) -> OTelSdkResult {
        let spans = batch.len();
        let result = self.inner.export(batch).await;
        match &result {
            Err(e) if !self.failing.swap(true, Ordering::Relaxed) => tracing::warn!(
                error = %e,
                endpoint = %self.endpoint,
                spans,
                "cannot export spans; events are still delivered, spans are dropped while this lasts"
            ),
            Ok(()) if self.failing.swap(false, Ordering::Relaxed) => {
                tracing::info!(endpoint = %self.endpoint, "exporting spans again")
            }
            _ => {}
        }
        result
    }

    fn shutdown_with_timeout(&mut self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn force_flush(&mut self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn set_resource(&mut self, resource: &Resource) {
        self.inner.set_resource(resource);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use chrono::Utc;
    use serde_json::value::RawValue;

    fn event(headers: Vec<(String, String)>) -> OutboxEvent {
        OutboxEvent {
            id: "e-1".into(),
            aggregate_type: "order".into(),
            aggregate_id: "o-1".into(),
            event_type: "OrderPlaced".into(),
            event_version: 1,
            payload: RawValue::from_string("{}".into()).unwrap(),
            headers,
            created_at: Utc::now(),
            extra: vec![],
        }
    }

    fn on() -> EventTracer {
        // Port 9 (discard) on loopback: nothing listens; spans are dropped.
        EventTracer::start(&OtlpConfig {
            endpoint: Some("http://127.0.0.1:9".into()),
            ..OtlpConfig::default()
        })
        .unwrap()
    }

    /// `check`'s look at the collector says where it looked without the
    /// credentials an endpoint may carry.
    #[tokio::test]
    async fn the_probe_does_not_show_the_endpoints_credentials() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        // A collector that accepts whatever it is sent.
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let collector = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 4096];
            let _ = socket.read(&mut request).await;
            let _ = socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                .await;
        });
        let config = OtlpConfig {
            endpoint: Some(format!("http://relay:t0ken@127.0.0.1:{port}")),
            ..OtlpConfig::default()
        };
        let answer = probe(&config).await.unwrap().expect("export is on");
        collector.abort();
        let text = answer.expect("the collector accepted");
        assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
        assert!(!text.contains("t0ken"), "{text}");
    }

    #[test]
    fn off_builds_nothing() {
        let span = EventTracer::default().span(&event(vec![]), None, SystemTime::now());
        assert!(!span.is_on());
        assert_eq!(span.traceparent(), None);
        assert_eq!(
            std::mem::size_of::<EventSpan>(),
            std::mem::size_of::<usize>()
        );
    }

    #[tokio::test]
    async fn continues_the_rows_trace() {
        let tracer = on();
        let row = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let span = tracer.span(
            &event(vec![("TraceParent".into(), row.into())]),
            None,
            SystemTime::now(),
        );
        let tp = span.traceparent().unwrap().to_owned();
        let parts: Vec<&str> = tp.split('-').collect();
        assert_eq!(parts[0], "00");
        assert_eq!(parts[1], "0af7651916cd43dd8448eb211c80319c", "{tp}");
        assert_ne!(parts[2], "b7ad6b7169203331", "the relay's own span");
        assert_eq!(parts[2].len(), 16);
        assert_eq!(parts[3], "01");
        drop(span);
        tracer.shutdown(Duration::from_millis(200)).await;
    }

    #[tokio::test]
    async fn starts_a_trace_without_or_with_a_bad_traceparent() {
        let tracer = on();
        for headers in [vec![], vec![("traceparent".into(), "00-garbage".into())]] {
            let span = tracer.span(&event(headers), None, SystemTime::now());
            let tp = span.traceparent().unwrap();
            assert_eq!(tp.len(), 55, "{tp}");
            assert!(tp.ends_with("-01"), "a new trace is sampled: {tp}");
        }
        tracer.shutdown(Duration::from_millis(200)).await;
    }
}
