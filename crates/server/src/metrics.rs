//! `GET /metrics` in plain HTTP on its own address (`trellis serve --metrics-listen`), for
//! Prometheus (OpenMetrics when asked for, the classic text format otherwise): the controller's counters, with the roster gauges read from the database at each
//! scrape. Separate from the API so that a scraper needs neither the CA nor a credential, and the
//! API's port need not be opened to it.

use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use tokio::net::TcpListener;
use trellis_controller::Controller;
use trellis_proto::exposition::Format;

/// The metrics router.
pub fn app(controller: Arc<Controller>) -> Router {
    Router::new().route("/metrics", get(scrape)).with_state(controller)
}

/// Answers in OpenMetrics when the scraper's `Accept` asks for it, in the classic Prometheus
/// text format otherwise.
async fn scrape(State(c): State<Arc<Controller>>, headers: HeaderMap) -> impl IntoResponse {
    let format = Format::negotiate(headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()));
    ([(header::CONTENT_TYPE, format.content_type()), (header::VARY, "Accept")], format.render(c.scrape().await))
}

/// Serves the metrics on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, controller: Arc<Controller>) {
    if let Err(e) = axum::serve(listener, app(controller)).await {
        tracing::error!("the metrics listener stopped: {e}");
    }
}
