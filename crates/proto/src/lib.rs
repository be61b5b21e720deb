//! The JSON shapes of the controller's HTTP API. Shared by the controller, the admin CLI and the
//! agent so the three cannot drift apart. Every request type refuses unknown fields.

use serde::{Deserialize, Serialize};

pub mod audit;
pub mod certs;
pub mod declaration;
pub mod etag;
pub mod exposition;
pub mod ingress;
pub mod paths;
pub mod state;
pub mod text;
pub mod version;

pub use audit::{AuditAction, AuditRecord};
pub use certs::{
    HeldServiceCert, HeldServiceCerts, HeldServiceCertsAck, ServiceCertInfo, ServiceCertList, ServiceCertRequest, ServiceCertResponse,
    ServiceCertSpec,
};
pub use ingress::{IngressAck, IngressCertificate, IngressReport, IngressRouter, IngressState};
pub use paths::{ObservedEndpoint, PairPath, PathAck, PathReport, PathState};
pub use state::{EnrolledState, EvidenceResult, FileResult, NodeState, Shown, TokenState, Withdrawal};

/// Every error answer: one sentence, and a stable code a script can match.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ErrorBody {
    pub error: String,
    pub code: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub diagnostics: Vec<Diagnostic>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Diagnostic {
    pub severity: String,
    pub file: String,
    pub line: u32,
    pub column: u32,
    pub message: String,
}

impl std::fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}:{}:{}: {}: {}", self.file, self.line, self.column, self.severity, self.message)
    }
}

/// One declaration file, named relative to the declaration directory (`mesh.toml`,
/// `modules/postgres.toml`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct DeclFile {
    pub path: String,
    pub text: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ApplyRequest {
    pub files: Vec<DeclFile>,
    /// Fail with a conflict unless the current revision is this one (0: none yet).
    #[serde(default)]
    pub expect_revision: Option<i64>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApplyResponse {
    pub revision: i64,
    pub diagnostics: Vec<Diagnostic>,
    pub unchanged: bool,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TokenRequest {
    /// The declared node the token enrols; empty for a pool token.
    #[serde(default)]
    pub node: String,
    pub ttl_secs: u64,
    #[serde(default)]
    pub require_approval: bool,
    /// The pool whose members the token enrols (instead of `node`), each named by the controller.
    #[serde(default)]
    pub pool: Option<String>,
    /// How many redemptions a pool token allows (default 1).
    #[serde(default)]
    pub uses: Option<u32>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenCreated {
    pub token: String,
    pub id: String,
    /// The node, or for a pool token the pool.
    pub node: String,
    pub expires_at: i64,
    #[serde(default)]
    pub pool: Option<String>,
    #[serde(default = "one")]
    pub uses: i64,
}

fn one() -> i64 {
    1
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TokenInfo {
    pub id: String,
    pub node: String,
    pub created_at: i64,
    pub expires_at: i64,
    pub used_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub require_approval: bool,
    pub state: TokenState,
    /// For a pool token: the pool (also in `node`), and its redemptions allowed and made.
    #[serde(default)]
    pub pool: Option<String>,
    #[serde(default = "one")]
    pub uses: i64,
    #[serde(default)]
    pub used: i64,
}

/// Sent by `trellis-agent enrol`: the token's id and secret, and the public halves of the keys
/// the node made.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EnrolRequest {
    pub token_id: String,
    /// Base64 of the 24-byte secret.
    pub secret: String,
    pub node: String,
    pub csr_pem: String,
    pub wireguard_public_key: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EnrolResponse {
    pub node: String,
    pub mesh: String,
    /// Active, or pending until an operator approves the node.
    pub state: EnrolledState,
    pub node_cert_pem: String,
    pub ca_pem: String,
    /// Base64 of the controller's ed25519 bundle-signing public key.
    pub signing_public_key: String,
    pub controllers: Vec<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct RenewRequest {
    pub csr_pem: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RenewResponse {
    pub node_cert_pem: String,
    pub not_after: i64,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeInfo {
    pub name: String,
    pub state: NodeState,
    pub ipv4: Option<String>,
    pub ipv6: Option<String>,
    /// SHA-256 of the WireGuard public key, first 16 hex digits.
    pub key_fingerprint: Option<String>,
    pub wireguard_public_key: Option<String>,
    pub cert_not_after: Option<i64>,
    pub last_contact: Option<i64>,
    /// The pool this node is a member of, if any.
    #[serde(default)]
    pub pool: Option<String>,
    /// For a revoked node: how far its revocation has reached (ADR 0022).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocation: Option<Revocation>,
    /// The protocol (`MAJOR.MINOR`) and release its agent last said it speaks (`version`).
    #[serde(default)]
    pub agent_protocol: Option<String>,
    #[serde(default)]
    pub agent_release: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WhoAmI {
    pub node: String,
    pub state: EnrolledState,
}

/// The controllers nodes are given in their bundles, in the order they try them (ADR 0028),
/// and the names the controllers' server certificate carries.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ControllerList {
    pub controllers: Vec<String>,
    pub server_names: Vec<String>,
}

/// A controller address to add to the list, or remove from it.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ControllerChange {
    /// `HOST:PORT`, as nodes dial it.
    pub address: String,
}

/// Starts a rotation of the bundle-signing key to the key the controller's state directory
/// holds as `signing.next.key`, whose public half this names.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct SigningKeyRotation {
    /// Base64 of the next key's ed25519 public key.
    pub next_public_key: String,
    /// How long nodes that are away are waited for, at most, in seconds.
    pub overlap_secs: u64,
}

/// Starts a rotation of the mesh CA to the CA the controller's state directory holds as
/// `ca.next.pem` and `ca.next.key` (ADR 0029), whose SHA-256 fingerprint this names.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CaRotation {
    /// SHA-256 of the next CA's certificate (DER), 64 hex digits.
    pub next_ca_fingerprint: String,
    /// How long nodes that are away are waited for, at most, in seconds.
    pub overlap_secs: u64,
}

/// A rotation as the controller follows it (ADR 0027, 0029): announced in bundles signed by the
/// current key, then, once every active node applied a bundle announcing it (or the overlap
/// passed), the only key bundles are signed with.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Rotation {
    /// What is rotated: `signing-key` or `ca`.
    pub kind: String,
    /// The next key: base64 of a signing key's public half, or the next CA's SHA-256 (hex).
    pub next_key: String,
    pub started_at: i64,
    pub overlap_secs: i64,
    /// When it completes by itself if nodes are still away (`started_at + overlap_secs`).
    pub completes_by: i64,
    pub completed_at: Option<i64>,
    /// `evidence` (every active node confirmed) or `overlap`.
    pub completed_by: Option<String>,
    /// Active nodes that applied a bundle announcing the key (for a CA, and that hold a node
    /// certificate it issued).
    pub confirmed: Vec<String>,
    /// Active nodes that have not yet.
    pub waiting: Vec<String>,
}

/// The media type of a bundle sent as a delta from the one the node holds (ADR 0033: `TRD2`,
/// the new bundle's signed head and, per file, keep, whole or edits). An agent that sent the
/// older [`LEGACY_DELTA_TYPE`] (`TRD1`) is answered whole. Neither names the other: an older
/// controller looked for its type anywhere in `Accept`, and would answer `TRD1` to this one.
pub const DELTA_TYPE: &str = "application/vnd.trellis.delta2";

/// The media type of the unsigned whole-bundle deltas (`TRD1`) before ADR 0033: never sent now.
pub const LEGACY_DELTA_TYPE: &str = "application/x-trellis-delta";

/// The request header in which a node that takes deltas names the files it holds: the first 8
/// bytes of each one's SHA-256, in hex, separated by commas (ADR 0033). A delta keeps or edits
/// only these; the node checks every file it builds against the signed manifest.
pub const HELD_FILES_HEADER: &str = "x-trellis-held-files";

/// The held files' header value for these file digests.
pub fn held_files(digests: &[[u8; 32]]) -> String {
    digests.iter().map(|d| hex::encode(&d[..8])).collect::<Vec<_>>().join(",")
}

/// Reads a held files' header: at most `trellis_core`'s file bound of entries (256), each 16
/// lowercase hex digits; `None` for anything else (then the node is answered whole).
pub fn parse_held_files(text: &str) -> Option<Vec<[u8; 8]>> {
    if text.is_empty() || text.len() > 256 * 17 {
        return None;
    }
    text.split(',')
        .map(|d| match d.len() == 16 && d.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            true => hex::decode(d).ok()?.try_into().ok(),
            false => None,
        })
        .collect()
}

/// The header of a bundle answer (whole, delta or `304`) that carries the controller's signed
/// freshness stamp of now, in base64 (ADR 0012).
pub const FRESHNESS_HEADER: &str = "x-trellis-freshness";

/// The most audit records one `GET /v1/admin/audit` answers (`?after=SEQ&limit=N` pages on).
pub const AUDIT_PAGE: i64 = 1000;

/// The largest evidence batch an agent may send.
pub const MAX_EVIDENCE_BATCH: usize = 1000;

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EvidenceBatch {
    pub records: Vec<Evidence>,
}

/// What an agent did with one bundle: append-only, numbered per node from 1.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Evidence {
    pub seq: i64,
    pub version: i64,
    pub result: EvidenceResult,
    #[serde(default)]
    pub error: Option<String>,
    #[serde(default)]
    pub files: Vec<EvidenceFile>,
    /// Unix seconds, by the node's clock.
    pub at: i64,
    /// The agent manages no WireGuard interface (`--wireguard none`, `--files-only`): what it
    /// applied says nothing of the data plane. Sent only when true, so a controller older than
    /// the field hears agents that manage their interface as before.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub unmanaged: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EvidenceFile {
    pub path: String,
    pub sha256: String,
    pub result: FileResult,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EvidenceAck {
    pub accepted: usize,
    pub duplicates: usize,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NodeStatus {
    pub name: String,
    pub state: NodeState,
    pub desired_version: Option<i64>,
    pub applied_version: Option<i64>,
    pub last_contact: Option<i64>,
    pub cert_not_after: Option<i64>,
    /// The node has not applied its desired version.
    pub stale: bool,
    /// Seconds since the desired version was issued, while stale.
    pub stale_for: Option<i64>,
    pub last_result: Option<EvidenceResult>,
    pub last_error: Option<String>,
    pub evidence_records: i64,
    /// Sequence numbers missing between 1 and the highest received.
    pub evidence_missing: i64,
    /// For a revoked node: how far its revocation has reached (ADR 0022).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revocation: Option<Revocation>,
    /// Why the node's requests are refused, when its agent (as it last said) is older than the
    /// declaration's `min_agent_version`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_refused: Option<String>,
    /// When the node's clock, as its last request said it, is further from the controller's
    /// than tolerated: the sentence that says how far (its requests are served all the same).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clock_skew: Option<String>,
    /// On an ingress node: its Traefik as its agent last reported it (ADR 0026).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<IngressState>,
    /// Each pair this node's traffic is relayed in, and its path now (ADR 0032).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub paths: Vec<PairPath>,
}

/// A revocation as the controller follows it (ADR 0022), computed from the database, so every
/// replica answers the same: `revoking` from the decision until every node that held the key
/// (each node whose published bundle named it as a WireGuard peer: its peers, a hub relaying for
/// it, a router of its routes) has reported applying a version without it, then `revoked`. A
/// holder that is revoked too, or no longer declared, no longer counts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Revocation {
    pub node: String,
    /// A revocation, or the removal of a pool's member by the sweep (followed the same way:
    /// `removing`, then `removed`).
    #[serde(default)]
    pub kind: Withdrawal,
    pub decided_at: i64,
    /// When the last holder applied a version without the key (by the controller's clock, as
    /// its evidence arrived); absent while revoking.
    pub completed_at: Option<i64>,
    /// Seconds from the decision to completion, or to now while revoking.
    pub seconds: i64,
    /// Whether a publish run has recorded who held the key yet (until then it is revoking).
    pub holders_known: bool,
    /// The nodes that held the key and still count.
    pub holders: usize,
    /// Those of them that still hold it, by name.
    pub holding: Vec<KeyHolder>,
    /// Those that reported applying a bundle without the key from an agent that manages no
    /// WireGuard interface (`--wireguard none`, `--files-only`): counted, but what they reported
    /// proves nothing of their data plane.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unverified: Vec<String>,
}

/// A node that held a revoked node's key and has not reported applying a version without it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct KeyHolder {
    pub name: String,
    /// The first version of its bundle without the key (absent: not published yet).
    pub dropped_in: Option<i64>,
    /// The newest version it reported applied.
    pub applied_version: Option<i64>,
    pub last_contact: Option<i64>,
    /// The error of its newest evidence, if that apply failed.
    pub last_error: Option<String>,
}

/// A holder not heard from for longer than this is said to be offline: an agent in contact
/// long-polls, which counts as contact at least every minute.
pub const OFFLINE_AFTER: i64 = 120;

impl Revocation {
    pub fn complete(&self) -> bool {
        self.completed_at.is_some()
    }

    /// What the roster and `status` show: `revoked (in 4 s, 3 peers dropped its key)`, or
    /// `revoking (2 of 3 peers still hold its key: db-1 applied v12 < v13, offline 3 h; ...)`.
    pub fn summary(&self, now: i64) -> String {
        use text::{duration, printable};
        let (doing, done, dropped, hold) = match self.kind {
            Withdrawal::Revocation => ("revoking", "revoked", "dropped its key", "still hold its key"),
            Withdrawal::Removal => ("removing", "removed", "dropped its key", "still hold its key"),
            Withdrawal::Routes => ("withdrawing routes", "routes withdrawn", "stopped routing through it", "still route through it"),
        };
        let unverified = if self.unverified.is_empty() {
            String::new()
        } else {
            let names: Vec<String> = self.unverified.iter().map(|n| printable(n).into_owned()).collect();
            format!("; unverified, managing no WireGuard interface: {}", names.join(", "))
        };
        if self.complete() {
            return format!("{done} (in {}, {} peer(s) {dropped}{unverified})", duration(self.seconds), self.holders);
        }
        if !self.holders_known {
            return format!("{doing} (for {}: the publish run that drops its key has not run yet)", duration(self.seconds));
        }
        let held: Vec<String> = self.holding.iter().map(|h| format!("{} {}", printable(&h.name), h.why(now))).collect();
        format!(
            "{doing} (for {}; {} of {} peer(s) {hold}: {}{unverified})",
            duration(self.seconds),
            self.holding.len(),
            self.holders,
            held.join("; ")
        )
    }
}

impl KeyHolder {
    /// Why it still holds the key: `applied v12 < v13, offline 3 h, failing: ...`.
    pub fn why(&self, now: i64) -> String {
        use text::{duration, printable};
        let mut parts = vec![match (self.applied_version, self.dropped_in) {
            (_, None) => "has no bundle without it published yet".to_string(),
            (Some(a), Some(d)) => format!("applied v{a} < v{d}"),
            (None, Some(d)) => format!("applied nothing yet < v{d}"),
        }];
        match self.last_contact {
            None => parts.push("never in contact".to_string()),
            Some(t) if now - t > OFFLINE_AFTER => parts.push(format!("offline {}", duration(now - t))),
            Some(_) => {}
        }
        if let Some(e) = &self.last_error {
            parts.push(format!("failing: {}", printable(e)));
        }
        parts.join(", ")
    }
}

/// Why two nodes connect the way they do, and what passes each way: `GET /v1/admin/explain` and
/// `trellis explain --json`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Explanation {
    pub from: String,
    pub to: String,
    /// `direct`, `relayed` or `none`.
    pub path: String,
    /// The hub a relayed path goes through.
    pub hub: Option<String>,
    /// Sentences saying why.
    pub reasons: Vec<String>,
    /// The rules that let `from` reach `to`.
    pub forward: Vec<RuleMatch>,
    /// The rules that let `to` reach `from`.
    pub reverse: Vec<RuleMatch>,
    /// What `trellis explain` prints.
    pub text: String,
}

/// A rule that lets traffic through in one direction.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RuleMatch {
    pub module: String,
    /// The rule's number in its module, from 1.
    pub rule: usize,
    /// FILE:LINE:COL of the rule.
    pub at: String,
    pub proto: String,
    pub ports: Vec<String>,
    /// The rule's sources that contain the sending node, and how.
    pub matched: Vec<String>,
}

/// The live picture of the mesh (`GET /v1/admin/graph`): the current declaration's nodes where
/// they are drawn, with their state, and the links between them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MeshGraph {
    /// The declaration revision drawn (absent before the first apply).
    pub revision: Option<i64>,
    pub nodes: Vec<GraphNode>,
    pub links: Vec<GraphLink>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GraphNode {
    pub name: String,
    pub hub: bool,
    pub networks: Vec<String>,
    /// Where it is drawn, on a 1000 by 1000 canvas.
    pub x: f64,
    pub y: f64,
    pub state: NodeState,
    pub shown: Shown,
    pub desired_version: Option<i64>,
    pub applied_version: Option<i64>,
    pub stale_for: Option<i64>,
    pub last_contact: Option<i64>,
    pub last_error: Option<String>,
    /// The revoked or removed nodes whose key this node still holds: it has not reported
    /// applying a bundle without them (ADR 0022).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub holds: Vec<String>,
    /// The modules whose service certificate on this node expires within a quarter of its
    /// lifetime (or has expired): the page marks the node (ADR 0023).
    #[serde(default)]
    pub certificates_expiring: Vec<String>,
}

/// Two nodes with allowed traffic between them, or a node and the hub that relays for it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct GraphLink {
    pub a: String,
    pub b: String,
    /// `direct` (a WireGuard peering), `relayed` (through `hub`) or `none` (no path).
    pub reach: String,
    pub hub: Option<String>,
    /// For a relayed pair, its path as its first node's agent last said (ADR 0032): `direct
    /// since 12:00:03 (punched through hub-1)`, or why it stays relayed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// How it is drawn: SVG path data on the nodes' canvas.
    pub d: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The review of ADR 0033: a controller before it answered the old unsigned deltas to any
    /// request whose `Accept` contained its media type anywhere, as it checked. An agent asking
    /// for the new deltas must not read as asking for the old ones (it would take them for a
    /// bundle, refuse it, and stay on its version until the next publish).
    #[test]
    fn the_delta_type_asked_for_is_not_the_old_one_as_an_older_controller_looks_for_it() {
        let accept = format!("application/octet-stream, {DELTA_TYPE}");
        assert!(!accept.contains(LEGACY_DELTA_TYPE), "an older controller would answer TRD1 to {accept}");
        assert!(!LEGACY_DELTA_TYPE.contains(DELTA_TYPE));
        let held = held_files(&[[0xab; 32], [0x01; 32]]);
        assert_eq!(held, "abababababababab,0101010101010101");
        assert_eq!(parse_held_files(&held), Some(vec![[0xab; 8], [0x01; 8]]));
        for bad in ["", "ABABABABABABABAB", "abab", "abababababababab,", &"abababababababab,".repeat(300)] {
            assert_eq!(parse_held_files(bad), None, "{bad:?}");
        }
    }

    fn holder(name: &str, applied: Option<i64>, dropped: Option<i64>, contact: Option<i64>, error: Option<&str>) -> KeyHolder {
        KeyHolder {
            name: name.into(),
            dropped_in: dropped,
            applied_version: applied,
            last_contact: contact,
            last_error: error.map(String::from),
        }
    }

    /// What `trellis nodes` says of a revocation: who still holds the key and why, in one line
    /// that a name or an error from the network cannot break.
    #[test]
    fn a_revocation_says_who_still_holds_the_key_and_why() {
        let now = 100_000;
        let r = Revocation {
            node: "gone-1".into(),
            kind: Withdrawal::Revocation,
            decided_at: now - 40,
            completed_at: None,
            seconds: 40,
            holders_known: true,
            holders: 41,
            holding: vec![
                holder("db-1", Some(12), Some(13), Some(now - 3 * 3600), None),
                holder("web-2", None, Some(4), Some(now - 5), Some("nft: error\n  at line 3")),
                holder("ci-1", Some(2), None, None, None),
            ],
            unverified: Vec::new(),
        };
        assert_eq!(
            r.summary(now),
            "revoking (for 40 s; 3 of 41 peer(s) still hold its key: db-1 applied v12 < v13, offline 3 h; \
             web-2 applied nothing yet < v4, failing: nft: error\\n  at line 3; ci-1 has no bundle without it published yet, never in contact)"
        );
        let unknown = Revocation { holders_known: false, holding: vec![], holders: 0, ..r.clone() };
        assert_eq!(unknown.summary(now), "revoking (for 40 s: the publish run that drops its key has not run yet)");
        let done = Revocation { completed_at: Some(now - 33), seconds: 7, holding: vec![], holders: 3, ..r };
        assert!(done.complete());
        assert_eq!(done.summary(now), "revoked (in 7 s, 3 peer(s) dropped its key)");
        let removing = Revocation {
            kind: Withdrawal::Removal,
            completed_at: None,
            holders: 1,
            holding: vec![holder("ci-1", Some(3), Some(4), Some(now - 5), None)],
            ..done
        };
        assert_eq!(removing.summary(now), "removing (for 7 s; 1 of 1 peer(s) still hold its key: ci-1 applied v3 < v4)");
        let routes = Revocation { kind: Withdrawal::Routes, ..removing };
        assert_eq!(routes.summary(now), "withdrawing routes (for 7 s; 1 of 1 peer(s) still route through it: ci-1 applied v3 < v4)");
        let withdrawn = Revocation { completed_at: Some(now), holding: vec![], ..routes };
        assert_eq!(withdrawn.summary(now), "routes withdrawn (in 7 s, 1 peer(s) stopped routing through it)");
    }
}
