//! The HTTP endpoints: `/metrics` (Prometheus text format), `/healthz` (the
//! process answers) and `/readyz` (see [`super::health`]).

use super::health::Health;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The paths served; the deployment files under deploy/ probe and scrape them.
pub const METRICS_PATH: &str = "/metrics";
pub const HEALTHZ_PATH: &str = "/healthz";
pub const READYZ_PATH: &str = "/readyz";

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
    let listener = tokio::net::TcpListener::bind(address).await?;
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
    let app = Router::new()
        .route(METRICS_PATH, get(metrics))
        .route(HEALTHZ_PATH, get(|| async { "ok\n" }))
        .route(READYZ_PATH, get(readyz))
        .with_state(Endpoints { health, prometheus });
    Ok(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "the HTTP endpoint stopped");
        }
    })
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
