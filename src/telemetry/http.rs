//! The HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (the
//! process answers) and `/readyz` (see [`super::health`]).
//!
//! The server is the relay's own accept loop around hyper, so that a client
//! cannot hold the relay: at most [`LIMITS`]`.connections` connections are
//! served at once (more wait in the listen queue), a request's head must
//! arrive within `head_within` (an idle kept-alive connection closes then
//! too), a head is at most [`MAX_HEAD_BYTES`], a connection lives at most
//! `lifetime`, and a stop waits `grace` for the answers being written
//! before it closes what is left.

use super::health::Health;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// The paths served; the deployment files under deploy/ probe and scrape them.
pub const METRICS_PATH: &str = "/metrics";
pub const HEALTHZ_PATH: &str = "/healthz";
pub const READYZ_PATH: &str = "/readyz";

/// The largest request head read (hyper's smallest buffer); a longer one
/// closes the connection.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;

/// After a failed accept (out of file descriptors, say), before the next.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// What one client may hold of the server.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Connections served at once; a scraper and the probes need a few.
    pub connections: usize,
    /// A request's head must arrive within this, counted from the end of
    /// the previous answer on a kept-alive connection.
    pub head_within: Duration,
    /// How long a connection lives at most: a client that stops reading a
    /// long answer does not hold its room for ever.
    pub lifetime: Duration,
    /// How long a stop waits for answers being written.
    pub grace: Duration,
}

/// The limits the relay serves with.
pub const LIMITS: Limits = Limits {
    connections: 64,
    head_within: Duration::from_secs(10),
    lifetime: Duration::from_secs(60),
    grace: Duration::from_secs(2),
};

#[derive(Clone)]
struct Endpoints {
    health: Arc<Health>,
    prometheus: Option<PrometheusHandle>,
}

/// Binds `address` now (so a port conflict is reported at start), then serves
/// until `shutdown`.
pub async fn bind(
    address: SocketAddr,
    health: Arc<Health>,
    prometheus: Option<PrometheusHandle>,
    shutdown: CancellationToken,
) -> std::io::Result<impl std::future::Future<Output = ()>> {
    let listener = TcpListener::bind(address).await?;
    if let Some(handle) = prometheus.clone() {
        // Histograms are folded on upkeep; keep it regular.
        let token = shutdown.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = token.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(5)) => handle.run_upkeep(),
                }
            }
        });
    }
    Ok(serve(
        listener,
        router(health, prometheus),
        LIMITS,
        shutdown,
    ))
}

fn router(health: Arc<Health>, prometheus: Option<PrometheusHandle>) -> Router {
    Router::new()
        .route(METRICS_PATH, get(metrics))
        .route(HEALTHZ_PATH, get(|| async { "ok\n" }))
        .route(READYZ_PATH, get(readyz))
        .with_state(Endpoints { health, prometheus })
}

/// Serves `app` on `listener` within `limits` until `shutdown`.
async fn serve(listener: TcpListener, app: Router, limits: Limits, shutdown: CancellationToken) {
    let room = Arc::new(Semaphore::new(limits.connections.max(1)));
    let graceful = GracefulShutdown::new();
    let mut connections = JoinSet::new();
    let mut builder = http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.head_within)
        .max_buf_size(MAX_HEAD_BYTES);
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = room.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        let stream = tokio::select! {
            _ = shutdown.cancelled() => break,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    tracing::warn!(error = %e, "the HTTP endpoint could not accept a connection");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
        };
        while connections.try_join_next().is_some() {}
        let service = TowerToHyperService::new(app.clone());
        let connection = graceful.watch(builder.serve_connection(TokioIo::new(stream), service));
        connections.spawn(async move {
            // An error is a client that went away, timed out or sent too
            // much: its connection is closed, nothing else to do.
            let _ = tokio::time::timeout(limits.lifetime, connection).await;
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(limits.grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::debug!("HTTP connections still open at the stop are closed");
    }
    connections.abort_all();
}

async fn metrics(State(e): State<Endpoints>) -> impl IntoResponse {
    match e.prometheus {
        Some(h) => (
            StatusCode::OK,
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            h.render(),
        ),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
            "metrics are not recorded by this process\n".to_owned(),
        ),
    }
}

async fn readyz(State(e): State<Endpoints>) -> impl IntoResponse {
    let (ready, body) = e.health.readiness();
    let code = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, body)
}

#[cfg(test)]
mod tests;
