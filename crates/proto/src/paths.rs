//! Direct paths through a hub as agents report them (ADR 0032): `POST /v1/node/paths`, and each
//! relayed pair's path as operators see it (`trellis status`, the live page, the metrics).

use serde::{Deserialize, Serialize};

/// The most entries one report may hold (a hub with this many peers reports the first ones), and
/// the longest text in it (longer is cut by the controller).
pub const MAX_PATH_ITEMS: usize = 100_000;
pub const MAX_PATH_TEXT: usize = 256;

/// What an agent reports of its paths: on a hub, the endpoint each peer it has a session with
/// sends from (what a STUN server would say); on every node, the path of each relayed peer its
/// `paths.toml` names. Only a hub's observations are ever taken: a node's word about itself or
/// its peers is never published.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PathReport {
    #[serde(default)]
    pub observed: Vec<ObservedEndpoint>,
    #[serde(default)]
    pub paths: Vec<PathState>,
}

/// One peer as a hub's interface sees it: its key and the address its packets come from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ObservedEndpoint {
    pub public_key: String,
    /// `IP:PORT`.
    pub endpoint: String,
}

/// One relayed peer's path as a node takes it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct PathState {
    /// The peer's node name.
    pub peer: String,
    /// `trying`, `direct` or `backing-off`.
    pub state: String,
    /// Unix seconds, by the node's clock, since it has been in this state.
    pub since: i64,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PathAck {
    /// How many of the report's observations were kept: none from a node that is not a hub.
    pub observed: usize,
}

/// One relayed pair as `trellis status` shows it, from one side.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PairPath {
    pub peer: String,
    pub hub: String,
    /// `direct`, `trying` or `relayed`.
    pub path: String,
    /// Unix seconds since it has been so, when an agent said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub since: Option<i64>,
    /// What `trellis status` prints: `direct since 12:00:03 (punched through hub-1)`, or
    /// `relayed by hub-1: b-1's NAT maps by destination (hubs saw ports 40001 and 40517)`.
    pub text: String,
}
