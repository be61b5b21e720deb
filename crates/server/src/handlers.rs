//! The API's operations: each handler parses, calls one decision, and answers, and `api` lists
//! them with their own `#[utoipa::path]` descriptions, from which both the router (`routes::app`)
//! and the API document (`openapi::document`) are made. A bundle long-poll waits in the
//! controller's decision, which returns what to answer.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use trellis_controller::metrics::Decision;
use trellis_controller::{BundleAnswer, BundleRequest, Controller, Error};
use trellis_proto as proto;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

use crate::auth::{Admin, Node, Peer};
use crate::body::{Body, Declaration, DECLARATION_BODY, EVIDENCE_BODY, SMALL_BODY};
use crate::error::{ApiError, Refusals};
use crate::params::{Path, Query};

pub(crate) type Shared = Arc<Controller>;
type Answer<T> = Result<Json<T>, ApiError>;

/// The routes with their descriptions, before the shared layers.
pub(crate) fn api() -> OpenApiRouter<Shared> {
    OpenApiRouter::new()
        .routes(routes!(health))
        .routes(routes!(openapi_json))
        .routes(routes!(enrol).layer(DefaultBodyLimit::max(SMALL_BODY)))
        .routes(routes!(renew).layer(DefaultBodyLimit::max(SMALL_BODY)))
        .routes(routes!(whoami))
        .routes(routes!(bundle))
        .routes(routes!(evidence).layer(DefaultBodyLimit::max(EVIDENCE_BODY)))
        .routes(routes!(status))
        .routes(routes!(apply).layer(DefaultBodyLimit::max(DECLARATION_BODY)))
        .routes(routes!(create_token, list_tokens))
        .routes(routes!(revoke_token))
        .routes(routes!(list_nodes))
        .routes(routes!(approve))
        .routes(routes!(revoke))
        .routes(routes!(revocation))
        .routes(routes!(audit_log))
        .routes(routes!(audit_checkpoint))
        .routes(routes!(graph))
        .routes(routes!(explain))
        .routes(
            routes!(crate::certs::node_certificates, crate::certs::sign_certificate)
                .layer(DefaultBodyLimit::max(crate::certs::CERTIFICATE_BODY)),
        )
        .routes(routes!(crate::certs::report_held).layer(DefaultBodyLimit::max(crate::certs::HELD_BODY)))
        .routes(routes!(crate::certs::report_ingress).layer(DefaultBodyLimit::max(crate::certs::INGRESS_BODY)))
        .routes(routes!(crate::certs::report_paths).layer(DefaultBodyLimit::max(crate::certs::PATHS_BODY)))
        .routes(routes!(crate::certs::list_certificates))
        .routes(routes!(crate::trust::list_controllers, crate::trust::add_controller, crate::trust::remove_controller))
        .routes(routes!(crate::trust::rotate_signing_key))
        .routes(routes!(crate::trust::rotate_ca))
        .routes(routes!(crate::trust::rotations))
        .routes(routes!(crate::ui::page))
}

/// `GET /v1/health`: the process answers.
#[utoipa::path(get, path = "/v1/health", tag = "health", responses((status = 200, description = "The controller answers", body = String, content_type = "text/plain")))]
async fn health() -> &'static str {
    "ok\n"
}

/// `GET /v1/openapi.json`: this document, made once from the routes' own descriptions.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "health", responses((status = 200, description = "The OpenAPI 3.1 description of this API", content_type = "application/json")))]
async fn openapi_json(Extension(document): Extension<&'static utoipa::openapi::OpenApi>) -> Json<&'static utoipa::openapi::OpenApi> {
    // Handed over by the router (`routes::app`): the document is made from this list.
    Json(document)
}

/// A decision's answer, counted by kind and logged with the audit head after it when it was
/// taken.
async fn decided<T>(c: &Controller, kind: Decision, r: Result<T, Error>) -> Answer<T> {
    let span = tracing::Span::current();
    span.record("decision", kind.as_str());
    match &r {
        Ok(_) => {
            c.count_decision(kind);
            if let Ok(seq) = c.audit_head().await {
                span.record("audit_seq", seq);
            }
            tracing::info!("decided");
        }
        Err(e) => tracing::info!(code = e.code(), "refused: {e}"),
    }
    Ok(Json(r?))
}

// --- administrators --------------------------------------------------------------------------

#[utoipa::path(post, path = "/v1/admin/apply", tag = "admin", security(("admin" = [])), request_body(content((proto::ApplyRequest = "application/json"), (Vec<u8> = "application/vnd.trellis.declaration")), description = "The declaration: JSON, or the same in trellis's own form (`TRDECL1`, lengths before the files' bytes), which spares both ends a JSON pass over megabytes of TOML"), responses((status = 200, description = "The declaration is the current revision (or was already)", body = proto::ApplyResponse), Refusals))]
async fn apply(State(c): State<Shared>, _: Admin, Declaration(req): Declaration) -> Answer<proto::ApplyResponse> {
    decided(&c, Decision::Apply, c.apply(&req.files, req.expect_revision).await).await
}

#[utoipa::path(post, path = "/v1/admin/tokens", tag = "admin", security(("admin" = [])), request_body = proto::TokenRequest, responses((status = 200, description = "A one-time enrolment token for the node", body = proto::TokenCreated), Refusals))]
async fn create_token(State(c): State<Shared>, _: Admin, Body(req): Body<proto::TokenRequest>) -> Answer<proto::TokenCreated> {
    decided(&c, Decision::TokenCreate, c.create_token(&req).await).await
}

#[utoipa::path(get, path = "/v1/admin/tokens", tag = "admin", security(("admin" = [])), responses((status = 200, description = "Every token, without its secret", body = Vec<proto::TokenInfo>), Refusals))]
async fn list_tokens(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::TokenInfo>> {
    Ok(Json(c.tokens().await?))
}

#[utoipa::path(delete, path = "/v1/admin/tokens/{id}", tag = "admin", security(("admin" = [])), params(("id" = String, Path, description = "The token's id")), responses((status = 200, description = "The token, revoked", body = proto::TokenInfo), Refusals))]
async fn revoke_token(State(c): State<Shared>, _: Admin, Path(id): Path<String>) -> Answer<proto::TokenInfo> {
    decided(&c, Decision::TokenRevoke, c.revoke_token(&id).await).await
}

#[utoipa::path(get, path = "/v1/admin/nodes", tag = "admin", security(("admin" = [])), responses((status = 200, description = "The roster: declared and enrolled nodes", body = Vec<proto::NodeInfo>), Refusals))]
async fn list_nodes(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::NodeInfo>> {
    Ok(Json(c.nodes().await?))
}

#[utoipa::path(post, path = "/v1/admin/nodes/{name}/approve", tag = "admin", security(("admin" = [])), params(("name" = String, Path, description = "The node")), responses((status = 200, description = "The node, active", body = proto::WhoAmI), Refusals))]
async fn approve(State(c): State<Shared>, _: Admin, Path(name): Path<String>) -> Answer<proto::WhoAmI> {
    tracing::Span::current().record("node", &*proto::text::printable(&name));
    decided(&c, Decision::Approve, c.approve(&name).await).await
}

#[utoipa::path(post, path = "/v1/admin/nodes/{name}/revoke", tag = "admin", security(("admin" = [])), params(("name" = String, Path, description = "The node")), responses((status = 200, description = "The node, revoked", body = proto::WhoAmI), Refusals))]
async fn revoke(State(c): State<Shared>, _: Admin, Path(name): Path<String>) -> Answer<proto::WhoAmI> {
    tracing::Span::current().record("node", &*proto::text::printable(&name));
    decided(&c, Decision::Revoke, c.revoke(&name).await).await
}

#[utoipa::path(get, path = "/v1/admin/nodes/{name}/revocation", tag = "admin", security(("admin" = [])), params(("name" = String, Path, description = "The revoked node")), responses((status = 200, description = "How far the node's revocation has reached: revoking while a node that held its key has not applied a bundle without it", body = proto::Revocation), Refusals))]
async fn revocation(State(c): State<Shared>, _: Admin, Path(name): Path<String>) -> Answer<proto::Revocation> {
    Ok(Json(c.revocation(&name).await?))
}

#[utoipa::path(get, path = "/v1/admin/status", tag = "admin", security(("admin" = [])), responses((status = 200, description = "Per node: desired and applied versions, staleness, last error, evidence", body = Vec<proto::NodeStatus>), Refusals))]
async fn status(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::NodeStatus>> {
    Ok(Json(c.status().await?))
}

#[utoipa::path(get, path = "/v1/admin/graph", tag = "admin", security(("admin" = [])), responses((status = 200, description = "The current declaration's nodes, where they are drawn and their state, and the links between them", body = proto::MeshGraph), Refusals))]
async fn graph(State(c): State<Shared>, _: Admin) -> Answer<proto::MeshGraph> {
    Ok(Json(c.graph().await?))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct ExplainQuery {
    /// One node of the current declaration.
    from: String,
    /// The other.
    to: String,
}

#[utoipa::path(get, path = "/v1/admin/explain", tag = "admin", security(("admin" = [])), params(ExplainQuery), responses((status = 200, description = "Why the two nodes connect the way they do, and what passes each way (as `trellis explain` says)", body = proto::Explanation), Refusals))]
async fn explain(State(c): State<Shared>, _: Admin, Query(q): Query<ExplainQuery>) -> Answer<proto::Explanation> {
    Ok(Json(c.explain(&q.from, &q.to).await?))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
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
#[utoipa::path(get, path = "/v1/admin/audit", tag = "admin", security(("admin" = [])), params(AuditQuery), responses((status = 200, description = "One page of the audit chain, oldest first", body = Vec<proto::AuditRecord>), Refusals))]
async fn audit_log(State(c): State<Shared>, _: Admin, Query(q): Query<AuditQuery>) -> Answer<Vec<proto::AuditRecord>> {
    Ok(Json(c.audit_page(q.after, q.limit).await?))
}

#[utoipa::path(get, path = "/v1/admin/audit/checkpoint", tag = "admin", security(("admin" = [])), responses((status = 200, description = "The signed audit head, once the publish run covering earlier decisions is done", body = proto::audit::Checkpoint), Refusals))]
async fn audit_checkpoint(State(c): State<Shared>, _: Admin) -> Answer<proto::audit::Checkpoint> {
    // The checkpoint is signed by the publish run that covers a decision: it waits for the run
    // that covers every decision made before this request.
    Ok(Json(c.checkpoint().await?))
}

// --- nodes -----------------------------------------------------------------------------------

#[utoipa::path(post, path = "/v1/enrol", tag = "node", request_body = proto::EnrolRequest, responses((status = 200, description = "The node's certificate and what it needs to verify its bundles", body = proto::EnrolResponse), Refusals))]
async fn enrol(
    State(c): State<Shared>,
    Peer(source): Peer,
    headers: axum::http::HeaderMap,
    Body(req): Body<proto::EnrolRequest>,
) -> Answer<proto::EnrolResponse> {
    tracing::Span::current().record("node", &*proto::text::printable(&req.node));
    // A node whose clock is too far from the controller's would hold a certificate it cannot
    // use: refused before the token is redeemed, naming the skew.
    let time = headers.get(proto::version::TIME_HEADER).map(|v| v.to_str().unwrap_or("\u{fffd}"));
    if let Err(e) = c.check_clock(&proto::text::printable(&req.node), time) {
        return decided(&c, Decision::Enrol, Err(e)).await;
    }
    let r = c.enrol_from(req, source).await;
    c.count_enrolment(&r);
    decided(&c, Decision::Enrol, r).await
}

#[utoipa::path(post, path = "/v1/renew", tag = "node", security(("node" = [])), request_body = proto::RenewRequest, responses((status = 200, description = "A new certificate for the CSR's key", body = proto::RenewResponse), Refusals))]
async fn renew(State(c): State<Shared>, Node(who): Node, Body(req): Body<proto::RenewRequest>) -> Answer<proto::RenewResponse> {
    decided(&c, Decision::Renew, c.renew(&who, &req).await).await
}

#[utoipa::path(get, path = "/v1/whoami", tag = "node", security(("node" = [])), responses((status = 200, description = "The node the client certificate names", body = proto::WhoAmI), Refusals))]
async fn whoami(Node(who): Node) -> Json<proto::WhoAmI> {
    Json(proto::WhoAmI { node: who.name, state: who.state })
}

#[utoipa::path(post, path = "/v1/evidence", tag = "node", security(("node" = [])), request_body = proto::EvidenceBatch, responses((status = 200, description = "Records taken and re-sends ignored", body = proto::EvidenceAck), Refusals))]
async fn evidence(
    State(c): State<Shared>,
    Node(who): Node,
    Body(batch): Body<proto::EvidenceBatch, EVIDENCE_BODY>,
) -> Answer<proto::EvidenceAck> {
    Ok(Json(c.evidence(&who, &batch).await?))
}

#[derive(serde::Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
#[into_params(parameter_in = Query)]
pub struct BundleQuery {
    /// Seconds to wait for a newer bundle than the one named in If-None-Match (at most 60;
    /// more is taken as 60).
    #[serde(default)]
    #[param(minimum = 0, maximum = 60)]
    wait: u64,
}

/// `GET /v1/bundle`: the node's current signed bundle, `304` when it already holds it. With
/// `wait`, the answer comes as soon as a newer one exists. A node whose `Accept` names
/// `proto::DELTA_TYPE` may get the edits from the version it holds instead. Every answer carries a signed
/// freshness stamp. What to answer is the controller's decision (`BundleAnswer`); this writes it.
#[utoipa::path(get, path = "/v1/bundle", tag = "node", security(("node" = [])), params(BundleQuery, ("If-None-Match" = Option<String>, Header, description = "The bundle held, as its ETag (\"7.0123456789abcdef\": its version and the start of its content digest; \"7\", the version alone, is read too)"), ("X-Trellis-Held-Files" = Option<String>, Header, description = "The files the node holds, by the first 8 bytes of each SHA-256 in hex, comma-separated: a delta keeps or edits only these (ADR 0033)")), responses((status = 200, description = "The signed bundle (application/octet-stream, ADR 0012), or, to a node that accepts them and names the files it holds, a signed delta from the bundle it holds (application/vnd.trellis.delta2, ADR 0033)", content(("application/octet-stream"), ("application/vnd.trellis.delta2")), headers(("ETag" = String, description = "The bundle sent: its version and the first 8 bytes of its content digest in hex, quoted (\"7.0123456789abcdef\")"), ("X-Trellis-Freshness" = String, description = "A signed freshness stamp of now (base64, ADR 0012)"))), (status = 304, description = "The bundle held is current", headers(("ETag" = String, description = "The bundle held, as its ETag"), ("X-Trellis-Freshness" = String, description = "A signed freshness stamp of now (base64, ADR 0012)"))), Refusals))]
async fn bundle(State(c): State<Shared>, Node(who): Node, headers: HeaderMap, Query(q): Query<BundleQuery>) -> Result<Response, ApiError> {
    let ask = BundleRequest {
        held: headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()).and_then(proto::etag::BundleTag::parse),
        takes_delta: headers.get_all(header::ACCEPT).iter().any(|v| v.to_str().is_ok_and(|v| v.contains(proto::DELTA_TYPE))),
        held_files: headers
            .get(proto::HELD_FILES_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(proto::parse_held_files)
            .unwrap_or_default(),
        wait: Duration::from_secs(q.wait),
    };
    // The request's headers share the connection's read buffer (several KiB): a long-poll keeps
    // only what it read from them, or ten thousand waiting nodes hold ten thousand such buffers.
    drop(headers);
    let freshness = header::HeaderName::from_static(proto::FRESHNESS_HEADER);
    Ok(match c.bundle_answer(&who, ask).await? {
        BundleAnswer::Delta { tag, body, stamp } => {
            let headers =
                [(header::CONTENT_TYPE, proto::DELTA_TYPE.to_string()), (header::ETAG, tag.etag()), (freshness, stamp.to_string())];
            (headers, axum::body::Body::new(Chunks(body))).into_response()
        }
        BundleAnswer::Whole { tag, body, stamp } => {
            let headers = [
                (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                (header::ETAG, tag.etag()),
                (freshness, stamp.to_string()),
            ];
            (headers, axum::body::Body::new(Chunks(body))).into_response()
        }
        BundleAnswer::Current { tag, stamp } => {
            (StatusCode::NOT_MODIFIED, [(header::ETAG, tag.etag()), (freshness, stamp.to_string())]).into_response()
        }
    })
}

/// A response body sent from the bundle as it is held (`publish::Body`): shared pieces as they
/// are, small ones gathered one chunk at a time, never the whole bundle in one buffer.
struct Chunks(trellis_controller::publish::Body);

impl http_body::Body for Chunks {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        std::task::Poll::Ready(self.0.next().map(|b| Ok(http_body::Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.remaining() == 0
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.0.remaining() as u64)
    }
}
