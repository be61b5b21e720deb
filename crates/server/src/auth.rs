//! Who is calling: `Admin` (the admin credential as a bearer token) and `Node` (a client
//! certificate issued by the mesh CA). Both ask the controller; neither decides anything here.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use trellis_controller::{Controller, NodeIdentity};

use crate::error::ApiError;

/// The DER of the client certificate of this connection, if one was presented.
#[derive(Clone, Debug, Default)]
pub struct PeerCert(pub Option<Arc<Vec<u8>>>);

/// The address the connection came from (absent in process).
#[derive(Clone, Copy, Debug)]
pub struct Peer(pub Option<std::net::IpAddr>);

impl<S: Send + Sync> FromRequestParts<S> for Peer {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(parts.extensions.get::<Peer>().copied().unwrap_or(Peer(None)))
    }
}

/// An administrator.
pub struct Admin;

impl FromRequestParts<Arc<Controller>> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, c: &Arc<Controller>) -> Result<Self, ApiError> {
        let given =
            parts.headers.get(axum::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok()).and_then(|v| v.strip_prefix("Bearer "));
        c.authenticate_admin(given)?;
        Ok(Admin)
    }
}

/// A node, proven by its certificate.
pub struct Node(pub NodeIdentity);

impl FromRequestParts<Arc<Controller>> for Node {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, c: &Arc<Controller>) -> Result<Self, ApiError> {
        let cert = parts.extensions.get::<PeerCert>().and_then(|p| p.0.clone());
        let who = c.authenticate_node(cert.as_deref().map(Vec::as_slice)).await?;
        tracing::Span::current().record("node", who.name.as_str());
        let header = |name: &str| parts.headers.get(name).map(|v| v.to_str().unwrap_or("\u{fffd}"));
        use trellis_proto::version::{AGENT_HEADER, PROTOCOL_HEADER, TIME_HEADER};
        c.hello(&who, header(PROTOCOL_HEADER), header(AGENT_HEADER), header(TIME_HEADER)).await?;
        Ok(Node(who))
    }
}
