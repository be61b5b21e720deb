//! The routes: each handler parses, calls one decision, and answers. The long-poll for bundles
//! waits here, on the publisher's change channel.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use trellis_controller::{Controller, Error};
use trellis_proto as proto;

use crate::auth::{Admin, Node, Peer};
use crate::body::{Body, DECLARATION_BODY, EVIDENCE_BODY, SMALL_BODY};
use crate::error::ApiError;

type Shared = Arc<Controller>;
type Answer<T> = Result<Json<T>, ApiError>;

pub fn app(controller: Shared) -> Router {
    Router::new()
        .route("/v1/health", get(|| async { "ok\n" }))
        .route("/v1/enrol", post(enrol).layer(DefaultBodyLimit::max(SMALL_BODY)))
        .route("/v1/renew", post(renew).layer(DefaultBodyLimit::max(SMALL_BODY)))
        .route("/v1/whoami", get(whoami))
        .route("/v1/bundle", get(bundle))
        .route("/v1/evidence", post(evidence).layer(DefaultBodyLimit::max(EVIDENCE_BODY)))
        .route("/v1/admin/status", get(status))
        .route("/v1/admin/apply", post(apply).layer(DefaultBodyLimit::max(DECLARATION_BODY)))
        .route("/v1/admin/tokens", post(create_token).get(list_tokens))
        .route("/v1/admin/tokens/{id}", delete(revoke_token))
        .route("/v1/admin/nodes", get(list_nodes))
        .route("/v1/admin/nodes/{name}/approve", post(approve))
        .route("/v1/admin/nodes/{name}/revoke", post(revoke))
        .route("/v1/admin/audit", get(audit_log))
        .route("/v1/admin/audit/checkpoint", get(audit_checkpoint))
        .layer(DefaultBodyLimit::max(SMALL_BODY))
        .with_state(controller)
}

// --- administrators --------------------------------------------------------------------------

async fn apply(State(c): State<Shared>, _: Admin, Body(req): Body<proto::ApplyRequest, DECLARATION_BODY>) -> Answer<proto::ApplyResponse> {
    Ok(Json(c.apply(&req.files, req.expect_revision).await?))
}

async fn create_token(State(c): State<Shared>, _: Admin, Body(req): Body<proto::TokenRequest>) -> Answer<proto::TokenCreated> {
    Ok(Json(c.create_token(&req).await?))
}

async fn list_tokens(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::TokenInfo>> {
    Ok(Json(c.tokens().await?))
}

async fn revoke_token(State(c): State<Shared>, _: Admin, Path(id): Path<String>) -> Answer<proto::TokenInfo> {
    Ok(Json(c.revoke_token(&id).await?))
}

async fn list_nodes(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::NodeInfo>> {
    Ok(Json(c.nodes().await?))
}

async fn approve(State(c): State<Shared>, _: Admin, Path(name): Path<String>) -> Answer<proto::WhoAmI> {
    Ok(Json(c.approve(&name).await?))
}

async fn revoke(State(c): State<Shared>, _: Admin, Path(name): Path<String>) -> Answer<proto::WhoAmI> {
    Ok(Json(c.revoke(&name).await?))
}

async fn status(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::NodeStatus>> {
    Ok(Json(c.status().await?))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuditQuery {
    /// Records after this sequence number (default 0: from the first).
    #[serde(default)]
    after: i64,
    /// At most this many (default and bound: `proto::AUDIT_PAGE`).
    #[serde(default = "audit_page")]
    limit: i64,
}

fn audit_page() -> i64 {
    proto::AUDIT_PAGE
}

/// `GET /v1/admin/audit?after=SEQ&limit=N`: one page of the chain, oldest first; a page shorter
/// than asked is the last.
async fn audit_log(State(c): State<Shared>, _: Admin, Query(q): Query<AuditQuery>) -> Answer<Vec<proto::AuditRecord>> {
    Ok(Json(c.audit_page(q.after, q.limit).await?))
}

async fn audit_checkpoint(State(c): State<Shared>, _: Admin) -> Answer<proto::audit::Checkpoint> {
    // The checkpoint is signed by the publish run that covers a decision: wait for the run that
    // covers every decision made before this request.
    c.settle(SETTLE).await?;
    Ok(Json(c.checkpoint()?))
}

// --- nodes -----------------------------------------------------------------------------------

async fn enrol(State(c): State<Shared>, Peer(source): Peer, Body(req): Body<proto::EnrolRequest>) -> Answer<proto::EnrolResponse> {
    Ok(Json(c.enrol_from(req, source).await?))
}

async fn renew(State(c): State<Shared>, Node(who): Node, Body(req): Body<proto::RenewRequest>) -> Answer<proto::RenewResponse> {
    Ok(Json(c.renew(&who, &req).await?))
}

async fn whoami(Node(who): Node) -> Json<proto::WhoAmI> {
    Json(proto::WhoAmI { node: who.name, state: who.state })
}

async fn evidence(
    State(c): State<Shared>,
    Node(who): Node,
    Body(batch): Body<proto::EvidenceBatch, EVIDENCE_BODY>,
) -> Answer<proto::EvidenceAck> {
    Ok(Json(c.evidence(&who, &batch).await?))
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleQuery {
    /// Seconds to wait for a newer bundle than the one named in If-None-Match (at most 60).
    #[serde(default)]
    wait: u64,
}

pub const MAX_WAIT: u64 = 60;

/// How long a request that needs the decisions before it published (a node's first bundle, the
/// audit checkpoint) waits for the publish run that covers them.
const SETTLE: Duration = Duration::from_secs(20);

fn etag(version: i64) -> String {
    format!("\"{version}\"")
}

/// `GET /v1/bundle`: the node's current signed bundle, `304` when it already holds it. With
/// `wait`, the answer comes as soon as a newer one exists. Every answer carries a signed
/// freshness stamp.
async fn bundle(State(c): State<Shared>, Node(who): Node, headers: HeaderMap, Query(q): Query<BundleQuery>) -> Result<Response, ApiError> {
    c.require_approved(&who)?;
    let held = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()).map(str::to_string);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(q.wait.min(MAX_WAIT));
    let mut changes = c.publisher.subscribe();
    let freshness = header::HeaderName::from_static("x-trellis-freshness");
    if c.publisher.current(&who.name).is_none() {
        // A node that just enrolled: its first bundle follows the publish run that covers the
        // enrolment, which has not finished yet.
        c.settle(SETTLE).await?;
    }
    // A node that can rebuild a bundle from the one it holds takes the edits instead.
    let takes_delta = headers.get_all(header::ACCEPT).iter().any(|v| v.to_str().is_ok_and(|v| v.contains(proto::DELTA_TYPE)));
    loop {
        let current = c.publisher.current(&who.name);
        let stamp = c.stamp();
        if let Some(p) = &current {
            if let Some((_, delta)) = p.delta.as_ref().filter(|(base, _)| takes_delta && held.as_deref() == Some(etag(*base).as_str())) {
                let headers = [
                    (header::CONTENT_TYPE, proto::DELTA_TYPE.to_string()),
                    (header::ETAG, etag(p.version)),
                    (freshness, stamp.to_string()),
                ];
                return Ok((headers, delta.clone()).into_response());
            }
            if held.as_deref() != Some(etag(p.version).as_str()) {
                let body = axum::body::Body::new(Chunks(p.signed.head.clone(), p.signed.contents.iter().cloned().collect()));
                let headers = [
                    (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                    (header::ETAG, etag(p.version)),
                    (freshness, stamp.to_string()),
                ];
                return Ok((headers, body).into_response());
            }
        }
        let changed = tokio::select! {
            r = tokio::time::timeout_at(deadline, changes.changed()) => matches!(r, Ok(Ok(()))),
            // The controller is stopping: the node hears now that what it holds is current, and
            // asks again (another replica, or this one once it is back).
            _ = c.stopped() => false,
        };
        if !changed {
            return match current {
                Some(p) => {
                    Ok((StatusCode::NOT_MODIFIED, [(header::ETAG, etag(p.version)), (freshness, stamp.to_string())]).into_response())
                }
                None => Err(Error::NoBundleYet(who.name).into()),
            };
        }
    }
}

/// A response body made of shared chunks: the bundle's head and its contents, sent without
/// copying them into one buffer.
struct Chunks(bytes::Bytes, std::collections::VecDeque<bytes::Bytes>);

impl http_body::Body for Chunks {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let next = if self.0.is_empty() { self.1.pop_front() } else { Some(std::mem::take(&mut self.0)) };
        std::task::Poll::Ready(next.map(|b| Ok(http_body::Frame::data(b))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact((self.0.len() + self.1.iter().map(bytes::Bytes::len).sum::<usize>()) as u64)
    }
}
