//! Service certificates on the wire (ADR 0023): what a node is to hold (`GET
//! /v1/node/certificates`), a CSR for one module and its answer (`POST /v1/node/certificates`),
//! what the node holds as it reports it (`POST /v1/node/certificates/held`), and every node's
//! certificates as operators see them (`GET /v1/admin/certificates`, `trellis certs`).

use serde::{Deserialize, Serialize};

/// One certificate a node is to hold, for a module it runs: the names it carries, who may read
/// its key, what is reloaded after a renewal and how long it lasts.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceCertSpec {
    pub module: String,
    /// `MODULE.DOMAIN`, then `NODE.DOMAIN`.
    pub dns: Vec<String>,
    /// The node's overlay addresses.
    pub ips: Vec<String>,
    /// `spiffe://DOMAIN/module/MODULE`.
    pub uri: String,
    /// The group the key file belongs to (mode 0640); none: root only (0600).
    pub group: Option<String>,
    /// The systemd unit reloaded (`reload-or-restart`) after the certificate is replaced.
    pub reload: Option<String>,
    pub lifetime_secs: u64,
}

/// The certificates a node is to hold; any other it holds is to be removed.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceCertList {
    pub certificates: Vec<ServiceCertSpec>,
}

/// A CSR for the certificate of one module the node runs, made with a key born on the node.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ServiceCertRequest {
    pub module: String,
    pub csr_pem: String,
}

/// A signed service certificate, with what a server presents after it and what clients trust.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceCertResponse {
    pub module: String,
    /// The leaf certificate.
    pub cert_pem: String,
    /// The services intermediate CA that signed it.
    pub chain_pem: String,
    /// The mesh CA: what clients trust.
    pub ca_pem: String,
    /// Lower-case hex.
    pub serial: String,
    /// Unix seconds.
    pub not_after: i64,
}

/// The most modules a node reports on at once, and the longest error it says for one (longer
/// ones are cut at a character boundary).
pub const MAX_HELD_REPORTED: usize = 64;
pub const MAX_HELD_ERROR: usize = 512;

/// What a node holds, as its agent reports after each look at its certificates: per module, the
/// serial on its disk and why its last attempt failed there, if it did.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HeldServiceCerts {
    pub certificates: Vec<HeldServiceCert>,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct HeldServiceCert {
    pub module: String,
    /// Lower-case hex; none while the node holds no certificate for the module.
    pub serial: Option<String>,
    /// When the certificate on its disk expires, Unix seconds.
    pub not_after: Option<i64>,
    /// Why the node's last attempt failed (the request refused, the key's group missing, the
    /// unit not reloaded): its certificate in place, if any, stays until it expires.
    pub error: Option<String>,
}

/// The answer to a node's report: how many of its modules were recorded (those the declaration
/// gives it a certificate for).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct HeldServiceCertsAck {
    pub recorded: usize,
}

/// A node's certificate for one module, as the controller last issued or refused it.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ServiceCertInfo {
    pub node: String,
    pub module: String,
    /// Whether the current declaration still gives the node this certificate.
    pub declared: bool,
    pub names: Vec<String>,
    pub serial: Option<String>,
    pub issued_at: Option<i64>,
    pub not_after: Option<i64>,
    /// The lifetime the declaration gives, in seconds.
    pub lifetime_secs: Option<u64>,
    pub refused_at: Option<i64>,
    pub refusal: Option<String>,
    /// What the node last reported holding (ADR 0023): the serial on its disk, why its last
    /// attempt failed there, and when it said so; `held_not_after` is when that one expires.
    #[serde(default)]
    pub held_serial: Option<String>,
    #[serde(default)]
    pub held_not_after: Option<i64>,
    #[serde(default)]
    pub node_error: Option<String>,
    #[serde(default)]
    pub reported_at: Option<i64>,
}
