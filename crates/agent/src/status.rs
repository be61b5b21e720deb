//! What the agent shows of itself: `AgentStatus`, written by the run loop to the state directory
//! and read by `trellis-agent status` and the metrics, with its parts (the interface's peers,
//! the service certificates, the ingress). A leaf beneath the phases that fill it in (`certs`,
//! `ingress`, `run`): it uses none of them.

use std::path::Path;

use anyhow::Result;
use serde::{Deserialize, Serialize};

use crate::statedir::{read_json, write_json, STATUS};

/// One peer as the interface sees it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerState {
    pub public_key: String,
    pub endpoint: Option<String>,
    /// Unix seconds of the last handshake, if any.
    pub last_handshake: Option<u64>,
    /// The prefixes the interface routes to this peer, as it reports them (`10.88.0.3/32`).
    #[serde(default)]
    pub allowed_ips: Vec<String>,
    /// Bytes received from and sent to this peer, as the interface counts them.
    #[serde(default)]
    pub rx_bytes: u64,
    #[serde(default)]
    pub tx_bytes: u64,
}

impl PeerState {
    /// A peer as known before the interface says more: its key, endpoint and last handshake.
    pub fn new(public_key: String, endpoint: Option<String>, last_handshake: Option<u64>) -> PeerState {
        PeerState { public_key, endpoint, last_handshake, allowed_ips: Vec::new(), rx_bytes: 0, tx_bytes: 0 }
    }
}

/// One relayed peer's path as this node takes it (ADR 0032): direct once a handshake at the
/// endpoint its hub observed completed, else through the hub.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PathStatus {
    /// The peer's node name and key.
    pub peer: String,
    pub public_key: String,
    /// The hub that relays the pair, and that observed the endpoint.
    pub hub: String,
    /// `trying`, `direct`, `relayed` or `backing-off`.
    pub state: String,
    /// Unix seconds since the path has been in this state.
    pub since: i64,
    /// The endpoint tried or used.
    pub endpoint: String,
    /// Why the pair is not direct, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// What `trellis-agent status` shows, written by the run loop.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentStatus {
    pub pid: u32,
    pub updated_at: i64,
    /// This node's WireGuard public key.
    #[serde(default)]
    pub public_key: Option<String>,
    pub last_contact: Option<i64>,
    /// The time in the controller's newest signed freshness stamp.
    pub fresh_at: Option<i64>,
    pub version: u64,
    pub last_error: Option<String>,
    pub interface: Option<String>,
    pub peers: Vec<PeerState>,
    /// The relayed peers this node may reach directly, each with its path now.
    #[serde(default)]
    pub paths: Vec<PathStatus>,
    pub ruleset_loaded: bool,
    pub dns_serving: Vec<String>,
    /// Milliseconds from a bundle's arrival to its files written and interface, ruleset and DNS
    /// updated, for the last one applied.
    pub last_apply_ms: Option<u64>,
    /// Where that time went, in milliseconds per phase (`files`, `wireguard`, `ruleset`, `dns`,
    /// ...).
    #[serde(default)]
    pub last_apply_phases_ms: std::collections::BTreeMap<String, f64>,
    pub buffered_evidence: usize,
    pub dropped_evidence: u64,
    /// The node's service certificates, and why the last request for one failed.
    #[serde(default)]
    pub certificates: Vec<CertStatus>,
    /// On an ingress node: Traefik, its routers and certificates (ADR 0026).
    #[serde(default)]
    pub ingress: Option<IngressStatus>,
}

impl AgentStatus {
    /// The status saved in `dir`; the default when there is none.
    pub fn load(dir: &Path) -> AgentStatus {
        read_json(&dir.join(STATUS))
    }

    pub fn save(&self, dir: &Path) -> Result<()> {
        write_json(&dir.join(STATUS), self)
    }
}

/// One certificate as the status shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertStatus {
    pub module: String,
    pub serial: Option<String>,
    pub not_after: Option<i64>,
    /// When it is renewed next.
    pub renew_at: Option<i64>,
    /// Why the last request for it failed (the files before it stay in place).
    pub error: Option<String>,
}

/// What the agent shows of its ingress.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IngressStatus {
    /// `running`, `stopped` (the operator runs Traefik: `--ingress none`) or `failed`.
    pub traefik: String,
    pub error: Option<String>,
    /// The routers of trellis's dynamic configuration, as Traefik's API shows them.
    pub routers: Vec<RouterState>,
    /// The certificates in the ACME storage.
    pub certificates: Vec<CertState>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterState {
    /// `shop-0` (the exposure and the host name's position), with `http` or `tcp`.
    pub name: String,
    pub kind: String,
    pub rule: String,
    /// Traefik's word: `enabled`, `warning` or `disabled`.
    pub status: String,
    pub errors: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertState {
    pub hostname: String,
    pub not_after: i64,
}
