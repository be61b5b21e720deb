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
}

/// What `trellis-agent status` shows, written by the run loop.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AgentStatus {
    pub pid: u32,
    pub updated_at: i64,
    pub last_contact: Option<i64>,
    /// The time in the controller's newest signed freshness stamp.
    pub fresh_at: Option<i64>,
    pub version: u64,
    pub last_error: Option<String>,
    pub interface: Option<String>,
    pub peers: Vec<PeerState>,
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
