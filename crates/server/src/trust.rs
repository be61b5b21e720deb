//! The routes of what nodes trust beyond the CA (issue 21): the controller list nodes are given
//! (ADR 0028) and rotations of the bundle-signing key (ADR 0027) and of the mesh CA (ADR 0029). Each calls one decision.

use std::sync::Arc;

use axum::extract::State;
use axum::Json;
use trellis_controller::Controller;
use trellis_proto as proto;

use crate::auth::Admin;
use crate::body::Body;
use crate::error::{ApiError, Refusals};

type Shared = Arc<Controller>;
type Answer<T> = Result<Json<T>, ApiError>;

/// Logs a decision's outcome, as every decision is logged.
fn logged<T>(r: trellis_controller::Result<T>) -> Answer<T> {
    match &r {
        Ok(_) => tracing::info!("decided"),
        Err(e) => tracing::info!(code = e.code(), "refused: {e}"),
    }
    Ok(Json(r?))
}

#[utoipa::path(get, path = "/v1/admin/controllers", tag = "admin", security(("admin" = [])), responses((status = 200, description = "The controllers nodes are given in their bundles, in the order they try them, and the names the server certificate carries", body = proto::ControllerList), Refusals))]
pub(crate) async fn list_controllers(State(c): State<Shared>, _: Admin) -> Answer<proto::ControllerList> {
    Ok(Json(c.controllers().await?))
}

#[utoipa::path(post, path = "/v1/admin/controllers", tag = "admin", security(("admin" = [])), request_body = proto::ControllerChange, responses((status = 200, description = "The list with the address added at its end; every node is given it in its next bundle", body = proto::ControllerList), Refusals))]
pub(crate) async fn add_controller(
    State(c): State<Shared>,
    _: Admin,
    Body(req): Body<proto::ControllerChange>,
) -> Answer<proto::ControllerList> {
    logged(c.add_controller(&req.address).await)
}

#[utoipa::path(delete, path = "/v1/admin/controllers", tag = "admin", security(("admin" = [])), request_body = proto::ControllerChange, responses((status = 200, description = "The list without the address; every node is given it in its next bundle", body = proto::ControllerList), Refusals))]
pub(crate) async fn remove_controller(
    State(c): State<Shared>,
    _: Admin,
    Body(req): Body<proto::ControllerChange>,
) -> Answer<proto::ControllerList> {
    logged(c.remove_controller(&req.address).await)
}

#[utoipa::path(post, path = "/v1/admin/rotations/signing-key", tag = "admin", security(("admin" = [])), request_body = proto::SigningKeyRotation, responses((status = 200, description = "The rotation, started: the next key is announced in bundles signed by the current one", body = proto::Rotation), Refusals))]
pub(crate) async fn rotate_signing_key(
    State(c): State<Shared>,
    _: Admin,
    Body(req): Body<proto::SigningKeyRotation>,
) -> Answer<proto::Rotation> {
    logged(c.rotate_signing_key(&req).await)
}

#[utoipa::path(post, path = "/v1/admin/rotations/ca", tag = "admin", security(("admin" = [])), request_body = proto::CaRotation, responses((status = 200, description = "The rotation, started: the next CA is announced in signed bundles, and node and server certificates are issued under it", body = proto::Rotation), Refusals))]
pub(crate) async fn rotate_ca(State(c): State<Shared>, _: Admin, Body(req): Body<proto::CaRotation>) -> Answer<proto::Rotation> {
    logged(c.rotate_ca(&req).await)
}

#[utoipa::path(get, path = "/v1/admin/rotations", tag = "admin", security(("admin" = [])), responses((status = 200, description = "Every rotation, newest first, with the active nodes that confirmed it and those it waits for", body = Vec<proto::Rotation>), Refusals))]
pub(crate) async fn rotations(State(c): State<Shared>, _: Admin) -> Answer<Vec<proto::Rotation>> {
    Ok(Json(c.rotations().await?))
}
