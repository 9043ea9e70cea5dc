//! A local OTLP/HTTP trace receiver: decodes the protobuf requests the relay
//! posts to `/v1/traces` and keeps their spans for the tests to inspect.
//! Also a collector that never answers, for the tests of a dead one.

use crate::kit::certs::Issued;
use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::routing::post;
use axum::serve::Listener;
use openssl::pkey::PKey;
use openssl::ssl::{Ssl, SslAcceptor, SslMethod};
use openssl::x509::X509;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use prost::Message;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_openssl::SslStream;
use tokio_util::sync::{CancellationToken, DropGuard};

/// One span as received, ids in lowercase hex (empty when absent).
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub trace_id: String,
    pub span_id: String,
    pub parent_span_id: String,
    pub name: String,
    /// String, integer and boolean attributes, as text.
    pub attributes: HashMap<String, String>,
    pub events: Vec<String>,
    pub service_name: Option<String>,
}

impl ReceivedSpan {
    pub fn attribute(&self, key: &str) -> Option<&str> {
        self.attributes.get(key).map(String::as_str)
    }
}

/// Serves `/v1/traces` on 127.0.0.1 (port 0) until dropped.
pub struct OtlpReceiver {
    pub port: u16,
    scheme: &'static str,
    refused: Arc<AtomicUsize>,
    spans: Arc<Mutex<Vec<ReceivedSpan>>>,
    _stop: DropGuard,
}

/// What a listener says about failed TLS handshakes.
trait Tls {
    fn refused(&self) -> Arc<AtomicUsize>;
}

impl Tls for tokio::net::TcpListener {
    fn refused(&self) -> Arc<AtomicUsize> {
        Arc::default()
    }
}

/// Accepts TCP connections and completes a TLS handshake on each.
struct TlsListener {
    tcp: tokio::net::TcpListener,
    acceptor: SslAcceptor,
    refused: Arc<AtomicUsize>,
}

impl Tls for TlsListener {
    fn refused(&self) -> Arc<AtomicUsize> {
        self.refused.clone()
    }
}

impl Listener for TlsListener {
    type Io = SslStream<tokio::net::TcpStream>;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            let Ok((socket, addr)) = self.tcp.accept().await else {
                continue;
            };
            let Ok(ssl) = Ssl::new(self.acceptor.context()) else {
                continue;
            };
            let Ok(mut stream) = SslStream::new(ssl, socket) else {
                continue;
            };
            match std::pin::Pin::new(&mut stream).accept().await {
                Ok(()) => return (stream, addr),
                Err(_) => {
                    self.refused.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        self.tcp.local_addr()
    }
}

impl OtlpReceiver {
    pub async fn start() -> OtlpReceiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        OtlpReceiver::serve(listener, false)
    }

    /// The same over TLS, with the certificate `server` (issued for
    /// 127.0.0.1). Connections whose handshake fails are counted.
    pub async fn start_tls(server: &Issued) -> OtlpReceiver {
        let tcp = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the OTLP receiver");
        let mut acceptor = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls()).unwrap();
        acceptor
            .set_certificate(&X509::from_pem(&server.cert_pem).unwrap())
            .unwrap();
        acceptor
            .set_private_key(&PKey::private_key_from_pem(&server.key_pem).unwrap())
            .unwrap();
        OtlpReceiver::serve(
            TlsListener {
                tcp,
                acceptor: acceptor.build(),
                refused: Arc::new(AtomicUsize::new(0)),
            },
            true,
        )
    }

    fn serve<L: Listener<Addr = std::net::SocketAddr> + Tls>(
        listener: L,
        tls: bool,
    ) -> OtlpReceiver {
        let port = listener.local_addr().unwrap().port();
        let refused = listener.refused();
        let spans = Arc::new(Mutex::new(Vec::new()));
        let app = Router::new()
            .route("/v1/traces", post(receive))
            .with_state(spans.clone());
        let stop = CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move { token.cancelled().await })
                .await;
        });
        OtlpReceiver {
            port,
            scheme: if tls { "https" } else { "http" },
            refused,
            spans,
            _stop: stop.drop_guard(),
        }
    }

    /// The value for `telemetry.otlp.endpoint`.
    pub fn endpoint(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.port)
    }

    /// TLS handshakes that failed (always 0 without TLS).
    pub fn refused_handshakes(&self) -> usize {
        self.refused.load(Ordering::Relaxed)
    }

    pub fn spans(&self) -> Vec<ReceivedSpan> {
        self.spans.lock().unwrap().clone()
    }

    /// Waits until every event in `ids` has a span with `outcome`; panics
    /// with what did arrive after `limit`.
    pub async fn wait_outcomes(
        &self,
        ids: &[String],
        outcome: &str,
        limit: Duration,
    ) -> Vec<ReceivedSpan> {
        let done = |spans: &[ReceivedSpan]| {
            ids.iter().all(|id| {
                spans.iter().any(|s| {
                    s.attribute("messaging.message.id") == Some(id)
                        && s.attribute("outbox.outcome") == Some(outcome)
                })
            })
        };
        let started = std::time::Instant::now();
        loop {
            let spans = self.spans();
            if done(&spans) {
                return spans;
            }
            if started.elapsed() > limit {
                panic!(
                    "timed out after {limit:?} waiting for {outcome} spans of {ids:?}; received: {spans:#?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

async fn receive(
    State(spans): State<Arc<Mutex<Vec<ReceivedSpan>>>>,
    body: Bytes,
) -> (StatusCode, [(header::HeaderName, &'static str); 1], Vec<u8>) {
    let protobuf = [(header::CONTENT_TYPE, "application/x-protobuf")];
    let Ok(request) = ExportTraceServiceRequest::decode(body) else {
        return (StatusCode::BAD_REQUEST, protobuf, Vec::new());
    };
    let mut found = Vec::new();
    for resource in request.resource_spans {
        let service_name = resource.resource.as_ref().and_then(|r| {
            r.attributes
                .iter()
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| text(kv.value.as_ref()?.value.as_ref()?))
        });
        for scope in resource.scope_spans {
            for span in scope.spans {
                found.push(ReceivedSpan {
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent_span_id: hex(&span.parent_span_id),
                    name: span.name,
                    attributes: span
                        .attributes
                        .iter()
                        .filter_map(|kv| {
                            Some((kv.key.clone(), text(kv.value.as_ref()?.value.as_ref()?)?))
                        })
                        .collect(),
                    events: span.events.into_iter().map(|e| e.name).collect(),
                    service_name: service_name.clone(),
                });
            }
        }
    }
    spans.lock().unwrap().extend(found);
    // An empty ExportTraceServiceResponse: all accepted.
    (StatusCode::OK, protobuf, Vec::new())
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::StringValue(s) => Some(s.clone()),
        Value::IntValue(i) => Some(i.to_string()),
        Value::BoolValue(b) => Some(b.to_string()),
        _ => None,
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A collector that accepts connections and never answers: every export
/// waits for its timeout.
pub struct SilentCollector {
    pub port: u16,
    _stop: DropGuard,
}

impl SilentCollector {
    pub async fn start() -> SilentCollector {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the silent collector");
        let port = listener.local_addr().unwrap().port();
        let stop = CancellationToken::new();
        let token = stop.clone();
        tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    accepted = listener.accept() => match accepted {
                        Ok((socket, _)) => held.push(socket),
                        Err(_) => return,
                    },
                }
            }
        });
        SilentCollector {
            port,
            _stop: stop.drop_guard(),
        }
    }

    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}
