//! `GET /metrics` in plain HTTP on its own address (`trellis serve --metrics-listen`), for
//! Prometheus: the controller's counters, with the roster gauges read from the database at each
//! scrape. Separate from the API so that a scraper needs neither the CA nor a credential, and the
//! API's port need not be opened to it.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use trellis_controller::Controller;

/// The metrics router.
pub fn app(controller: Arc<Controller>) -> Router {
    Router::new().route("/metrics", get(scrape)).with_state(controller)
}

async fn scrape(State(c): State<Arc<Controller>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, trellis_controller::metrics::CONTENT_TYPE)], c.scrape().await)
}

/// Serves the metrics on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, controller: Arc<Controller>) {
    if let Err(e) = axum::serve(listener, app(controller)).await {
        tracing::error!("the metrics listener stopped: {e}");
    }
}
