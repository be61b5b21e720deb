//! The routes of service certificates (ADR 0023): a node asks which certificates it is to hold
//! and sends a CSR for one; an operator lists them all. Each calls one decision.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use trellis_controller::Controller;
use trellis_proto as proto;

use crate::auth::{Admin, Node};
use crate::body::Body;
use crate::error::{ApiError, Refusals};

type Shared = Arc<Controller>;
type Answer<T> = Result<Json<T>, ApiError>;

/// The largest body of a service certificate request: the CSR's bound and room for the module.
pub const CERTIFICATE_BODY: usize = 16 * 1024;
/// The largest report of held certificates: 64 modules, each with a serial and an error of
/// 512 bytes, with room for JSON's escapes.
pub const HELD_BODY: usize = 96 * 1024;

#[utoipa::path(get, path = "/v1/node/certificates", tag = "node", security(("node" = [])), responses((status = 200, description = "The service certificates this node is to hold, one per module it runs that asks for one, with their names; any other it holds it removes", body = proto::ServiceCertList), Refusals))]
pub(crate) async fn node_certificates(State(c): State<Shared>, Node(who): Node) -> Answer<proto::ServiceCertList> {
    Ok(Json(c.service_cert_specs(&who).await?))
}

#[utoipa::path(post, path = "/v1/node/certificates", tag = "node", security(("node" = [])), request_body = proto::ServiceCertRequest, responses((status = 200, description = "The certificate for the CSR's key, naming exactly what the current declaration gives this node for the module, with the services CA and the mesh CA", body = proto::ServiceCertResponse), Refusals))]
pub(crate) async fn sign_certificate(
    State(c): State<Shared>,
    Node(who): Node,
    Body(req): Body<proto::ServiceCertRequest, CERTIFICATE_BODY>,
) -> Answer<proto::ServiceCertResponse> {
    let r = c.sign_service_cert(&who, &req).await;
    match &r {
        Ok(issued) => tracing::info!(module = %issued.module, serial = %issued.serial, "service certificate issued"),
        Err(e) => tracing::info!(code = e.code(), "refused: {e}"),
    }
    Ok(Json(r?))
}

#[utoipa::path(post, path = "/v1/node/certificates/held", tag = "node", security(("node" = [])), request_body = proto::HeldServiceCerts, responses((status = 200, description = "Recorded: per module the declaration gives this node a certificate for, the serial on its disk and why its last attempt failed there; other modules are left out", body = proto::HeldServiceCertsAck), Refusals))]
pub(crate) async fn report_held(
    State(c): State<Shared>,
    Node(who): Node,
    Body(report): Body<proto::HeldServiceCerts, HELD_BODY>,
) -> Answer<proto::HeldServiceCertsAck> {
    Ok(Json(proto::HeldServiceCertsAck { recorded: c.report_held_certs(&who, &report).await? }))
}

/// The largest ingress report: 256 routers and 256 certificates with their texts.
pub const INGRESS_BODY: usize = 256 * 1024;

#[utoipa::path(post, path = "/v1/node/ingress", tag = "node", security(("node" = [])), request_body = proto::IngressReport, responses((status = 200, description = "Whether the report was recorded: it is, when the current declaration makes this node an ingress node (the via of an exposure)", body = proto::IngressAck), Refusals))]
pub(crate) async fn report_ingress(
    State(c): State<Shared>,
    Node(who): Node,
    Body(report): Body<proto::IngressReport, INGRESS_BODY>,
) -> Answer<proto::IngressAck> {
    Ok(Json(proto::IngressAck { recorded: c.report_ingress(&who, &report).await? }))
}

/// The largest path report: a hub's `MAX_PATH_ITEMS` observations at about 100 bytes each.
pub const PATHS_BODY: usize = 12 * 1024 * 1024;

#[utoipa::path(post, path = "/v1/node/paths", tag = "node", security(("node" = [])), request_body = proto::PathReport, responses((status = 200, description = "Recorded: a hub's observed endpoints (a node that is not a hub has its observations dropped: no node's word about itself is published) and the node's direct paths (ADR 0032)", body = proto::PathAck), Refusals))]
pub(crate) async fn report_paths(
    State(c): State<Shared>,
    Node(who): Node,
    Body(report): Body<proto::PathReport, PATHS_BODY>,
) -> Answer<proto::PathAck> {
    Ok(Json(c.report_paths(&who, &report).await?))
}

#[utoipa::path(get, path = "/v1/admin/certificates", tag = "admin", security(("admin" = [])), responses((status = 200, description = "Every service certificate: its node, module, names, serial and expiry, whether the declaration still gives it, and its last refusal", body = Vec<proto::ServiceCertInfo>), Refusals))]
pub(crate) async fn list_certificates(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::ServiceCertInfo>> {
    Ok(Json(c.service_certs().await?))
}
