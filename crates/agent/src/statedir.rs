//! The state directory (`--state-dir`) as a table: the name of every file the agent keeps there
//! and what it holds, and how its JSON files are read and written. A leaf: every module that
//! opens a file of the directory names it from here, and uses no other module of the agent to
//! do so.

use std::path::Path;

use anyhow::Result;
use serde::{Deserialize, Serialize};

/// Who the node is and where its controllers are (TOML).
pub const IDENTITY: &str = "identity.toml";
/// The node's WireGuard private key (base64), made at enrolment and kept.
pub const WIREGUARD_KEY: &str = "wireguard.key";
/// The node's TLS key (PEM).
pub const NODE_KEY: &str = "node.key";
/// The node's certificate (PEM).
pub const NODE_CERT: &str = "node.pem";
/// The mesh CA's certificate (PEM).
pub const CA_CERT: &str = "ca.pem";
/// The next mesh CA's certificate (PEM), announced in a signed bundle during a CA rotation
/// (ADR 0029): trusted beside `ca.pem` until the rotation completes, then in its place.
pub const CA_NEXT_CERT: &str = "ca.next.pem";
/// An enrolment sent and not yet answered (TOML).
pub const ENROL_PENDING: &str = "enrol.pending";
/// What the agent last applied (`Manifest`, JSON).
pub const MANIFEST: &str = "manifest.json";
/// The signed head (magic, signature, manifest) of the bundle last applied; its files are the
/// ones written under the root, which the head's manifest names by SHA-256 (ADR 0033).
pub const HELD_HEAD: &str = "bundle.head";
/// The signed head of the bundle being applied, written before its files: a crash after the
/// files and before the head is replaced leaves files this head verifies (ADR 0033).
pub const HELD_HEAD_NEXT: &str = "bundle.head.next";
/// The whole bundle last applied, as agents before ADR 0033 kept it: read once after an
/// upgrade, removed at the next apply.
pub const LAST_BUNDLE: &str = "bundle.last";
/// What the loop shows (`AgentStatus`, JSON).
pub const STATUS: &str = "agent-status.json";
/// Evidence waiting to be delivered, one JSON record a line.
pub const EVIDENCE: &str = "evidence.jsonl";
/// The sequence number of the next evidence record.
pub const EVIDENCE_NEXT: &str = "evidence.next";
/// The last record of an applied bundle the controller acknowledged, sent again after an outage
/// (a controller restored from a snapshot lost what it had acknowledged).
pub const EVIDENCE_LAST: &str = "evidence.last";
/// Locked (`flock`) by the agent that works on the directory, `run` or `apply`.
pub const LOCK: &str = "agent.lock";

/// A JSON state file, or the default when it is missing or unreadable.
pub(crate) fn read_json<T: for<'de> Deserialize<'de> + Default>(path: &Path) -> T {
    std::fs::read(path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

/// Writes a JSON state file atomically, mode 0600.
pub(crate) fn write_json<T: Serialize>(path: &Path, v: &T) -> Result<()> {
    Ok(trellis_files::replace(path, &serde_json::to_vec_pretty(v)?, 0o600)?)
}
