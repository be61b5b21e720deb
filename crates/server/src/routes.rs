//! The router: the API's operations (`handlers::api`) with the answers to a path or method no
//! route serves, the shared layers (the default body bound, the request span and timing) and the
//! API document the operation `GET /v1/openapi.json` serves.

use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::Response;
use axum::{Extension, Router};
use trellis_controller::metrics;

use crate::body::SMALL_BODY;
use crate::error::ApiError;
use crate::handlers::{api, Shared};

/// The API's router. Every route is registered through its handler's `#[utoipa::path]`, so the
/// router and the API description (`openapi::document`) are made from the same list and cannot
/// drift apart.
pub fn app(controller: Shared) -> Router {
    let (router, _) = api().split_for_parts();
    router
        .fallback(no_route)
        .method_not_allowed_fallback(no_method)
        .layer(DefaultBodyLimit::max(SMALL_BODY))
        .layer(Extension(crate::openapi::document()))
        .layer(axum::middleware::from_fn_with_state(controller.clone(), timed))
        .with_state(controller)
}

/// A path no route serves: refused in the error shape, as every refusal is.
async fn no_route() -> ApiError {
    ApiError::body(StatusCode::NOT_FOUND, "no_route", "no such path in this API (see /v1/openapi.json)")
}

/// A method the path does not take (the `Allow` header names those it does).
async fn no_method(method: axum::http::Method) -> ApiError {
    // A method as sent may be kilobytes long: only a known one is named.
    let message = match metrics::method_label(method.as_str()) {
        "other" => "this path does not take this method".to_string(),
        known => format!("this path does not take {known}"),
    };
    ApiError::body(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", message)
}

/// Every request runs in a span (method, route, and, once known, the node, the decision and the
/// audit head after it) and is timed by the route it matched (never the raw path: names in paths
/// would make one series per node; and the controller counts made-up methods as one).
async fn timed(State(c): State<Shared>, req: Request, next: Next) -> Response {
    use tracing::Instrument;
    let route = req.extensions().get::<MatchedPath>().map_or(metrics::UNMATCHED, MatchedPath::as_str).to_string();
    let method = metrics::method_label(req.method().as_str());
    let span = tracing::info_span!(
        "request",
        method,
        route = %route,
        node = tracing::field::Empty,
        decision = tracing::field::Empty,
        audit_seq = tracing::field::Empty,
    );
    let started = std::time::Instant::now();
    let response = next.run(req).instrument(span.clone()).await;
    let took = started.elapsed();
    let status = response.status().as_u16();
    c.request_answered(method, &route, status, took);
    span.in_scope(|| tracing::debug!(status, ms = took.as_millis() as u64, "answered"));
    response
}
