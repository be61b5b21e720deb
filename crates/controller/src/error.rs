//! The controller's refusals: one variant per reason, each one sentence and a stable code a
//! script can match. Which HTTP status a variant becomes is decided once, in `trellis-server`.

use trellis_proto::{Diagnostic, TokenState};
use trellis_store::StoreError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    // --- the request itself ------------------------------------------------------------------
    /// The request is malformed in a way the body's type could not say.
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    TooLarge(String),

    // --- administrators ----------------------------------------------------------------------
    #[error("this needs the admin credential (Authorization: Bearer ...)")]
    AdminRequired,
    #[error("the admin credential is wrong")]
    AdminDenied,

    // --- declarations ------------------------------------------------------------------------
    /// The declaration does not validate; nothing was changed.
    #[error("{message}")]
    InvalidDeclaration { message: String, diagnostics: Vec<Diagnostic> },
    #[error("the current revision is {current}, not {expected}: someone applied in between; re-check and apply again")]
    RevisionConflict { current: i64, expected: i64 },
    #[error("{0}")]
    NoDeclaration(&'static str),

    // --- tokens ------------------------------------------------------------------------------
    #[error("node `{node}` is not declared in revision {revision}; declare it and apply first")]
    NodeNotDeclared { node: String, revision: i64 },
    #[error("pool `{pool}` is not declared in revision {revision}; declare it as a [[pool]] and apply first")]
    PoolNotDeclared { pool: String, revision: i64 },
    #[error("node `{0}` declares a public_key: it is managed outside trellis and does not enrol")]
    NodeManagedOutside(String),
    #[error("no token {0}")]
    TokenNotFound(String),
    #[error("token {id} is {state}; only an unused token can be revoked")]
    TokenNotRevocable { id: String, state: TokenState },

    // --- enrolment ---------------------------------------------------------------------------
    #[error("{0}")]
    Redemption(#[from] Redemption),
    #[error("WireGuard public key is already held by node `{0}`")]
    KeyTaken(String),

    // --- nodes -------------------------------------------------------------------------------
    #[error("{0}")]
    Node(#[from] NodeRefusal),
    #[error("{0}")]
    ServiceCert(#[from] crate::certs::ServiceCertRefusal),
    #[error("node `{0}` is not pending approval")]
    NotPending(String),
    #[error("node `{0}` is not enrolled: nothing to revoke (a token not yet used is revoked with `trellis token revoke`)")]
    NotRevocable(String),
    #[error("no bundle has been published for node `{0}` yet")]
    NoBundleYet(String),
    /// The database cannot be reached (or is restarting): nothing was decided.
    #[error("the database is unavailable ({0}); nothing was changed: try again once it is back (nodes keep their bundles meanwhile)")]
    DatabaseUnavailable(String),
    /// The decisions stand, but publishing has not covered them within the time asked.
    #[error("publishing has not caught up with the decisions made here within {0} s; they stand and will be published")]
    PublishingBehind(u64),

    #[error("no {0}")]
    NotFound(String),
    /// A node speaks a protocol major this controller does not.
    #[error("node `{node}` speaks trellis protocol {theirs} (agent {release}); this controller speaks {ours}: run an agent that speaks {major}.x, or a controller that speaks {theirs}", major = ours.major)]
    ProtocolUnsupported { node: String, theirs: trellis_proto::version::Protocol, release: String, ours: trellis_proto::version::Protocol },
    /// A node's agent is older than the declaration's `min_agent_version`.
    #[error("node `{node}` runs agent {release}, older than this mesh's min_agent_version {min}: upgrade trellis-agent on it")]
    AgentTooOld { node: String, release: String, min: String },
    /// A node's clock is further from the controller's than is tolerated.
    #[error("the clock of node `{node}` is {skew} the controller's, more than the {max} s tolerated: set its clock (NTP) and try again", max = trellis_proto::version::MAX_SKEW_SECS)]
    ClockSkew { node: String, skew: String },
    /// A node asked for more of something that is audited when it is done or refused (service
    /// certificates, renewals) than it may in a while.
    #[error("node `{node}` asked for {what} more often than it may; try again in {wait} s")]
    TooOften { node: String, what: String, wait: i64 },

    // --- inside ------------------------------------------------------------------------------
    /// Something failed inside the controller; the detail goes to its log, not to the client.
    #[error("{context} failed inside the controller; see its log")]
    Internal { context: &'static str, detail: String },
}

/// Why a token redemption was refused.
#[derive(Debug, thiserror::Error)]
pub enum Redemption {
    #[error("the enrolment request is malformed (token id, node name or CSR size)")]
    Malformed,
    #[error("the token secret is malformed")]
    SecretMalformed,
    #[error("token is not known to this controller")]
    Unknown,
    #[error("token secret does not match; copy the token again")]
    Wrong,
    #[error("token has been revoked")]
    Revoked,
    #[error("token already used")]
    Used,
    #[error("token has expired; ask for a new one")]
    Expired,
    #[error("token is for node `{token}`, not `{asked}`")]
    OtherNode { token: String, asked: String },
    #[error("no declaration has been applied")]
    NoDeclaration,
    #[error("node `{node}` is no longer declared (revision {revision})")]
    NodeUndeclared { node: String, revision: i64 },
    #[error("node `{0}` declares a public_key and does not enrol")]
    NodeManagedOutside(String),
    #[error("wireguard_public_key is not a WireGuard public key (44 characters of base64)")]
    BadKey,
    #[error("{0}")]
    BadCsr(String),
    #[error("too many refused enrolments from {from}; try again in {wait} s")]
    TooMany { from: String, wait: i64 },
    #[error("pool `{pool}` holds {size} members already, its size; wait for one to be removed or raise `size`")]
    PoolFull { pool: String, size: u32 },
    #[error("pool `{pool}` is no longer declared (revision {revision})")]
    PoolUndeclared { pool: String, revision: i64 },
}

/// Why a node's request was refused before it was heard.
#[derive(Debug, thiserror::Error)]
pub enum NodeRefusal {
    #[error("this needs a node certificate (mutual TLS)")]
    CertificateRequired,
    #[error("{0}")]
    BadCertificate(String),
    #[error("node `{0}` is not enrolled")]
    Unknown(String),
    #[error("node `{0}` has been revoked")]
    Revoked(String),
    #[error("this certificate of node `{0}` has been replaced; enrol again")]
    CertificateReplaced(String),
    /// A service certificate (issued by the services CA) presented where a node's is needed.
    #[error("the certificate presented for `{0}` is a service certificate, not a node certificate")]
    ServiceCertificate(String),
    #[error("node `{0}` is pending approval; an operator runs `trellis node approve {0}`")]
    PendingApproval(String),
    #[error("this certificate of node `{0}` has been renewed already; renew with the newest one")]
    Superseded(String),
    #[error(
        "`{node}` was a member of pool `{pool}`, and the declaration now names a declared node `{node}`; the member is no part of the mesh"
    )]
    Replaced { node: String, pool: String },
}

impl Error {
    /// Something failed inside. The detail goes to the controller's log now, where the failure
    /// happens (a publish in the background has no client to answer), and never to a client.
    pub fn internal(context: &'static str, detail: impl std::fmt::Display) -> Self {
        let detail = detail.to_string();
        tracing::error!("{context}: {detail}");
        Error::Internal { context, detail }
    }

    /// The stable code of the error body.
    pub fn code(&self) -> &'static str {
        match self {
            Error::BadRequest(_) => "bad_request",
            Error::ProtocolUnsupported { .. } => "protocol_unsupported",
            Error::AgentTooOld { .. } => "agent_too_old",
            Error::ClockSkew { .. } => "clock_skew",
            Error::TooOften { .. } => "too_often",
            Error::TooLarge(_) => "too_large",
            Error::AdminRequired => "admin_required",
            Error::AdminDenied => "admin_denied",
            Error::InvalidDeclaration { .. } => "invalid_declaration",
            Error::RevisionConflict { .. } => "revision_conflict",
            Error::NoDeclaration(_) => "no_declaration",
            Error::NodeNotDeclared { .. } | Error::PoolNotDeclared { .. } | Error::TokenNotFound(_) => "not_found",
            Error::NodeManagedOutside(_) => "node_managed_outside",
            Error::TokenNotRevocable { .. } => "token_not_revocable",
            Error::Redemption(r) => r.code(),
            Error::KeyTaken(_) => "key_taken",
            Error::Node(n) => n.code(),
            Error::ServiceCert(r) => r.code(),
            Error::NotPending(_) => "not_pending",
            Error::NotRevocable(_) => "not_revocable",
            Error::NoBundleYet(_) => "no_bundle_yet",
            Error::PublishingBehind(_) => "publishing_behind",
            Error::DatabaseUnavailable(_) => "database_unavailable",
            Error::NotFound(_) => "not_found",
            Error::Internal { .. } => "internal",
        }
    }

    pub fn diagnostics(&self) -> &[Diagnostic] {
        match self {
            Error::InvalidDeclaration { diagnostics, .. } => diagnostics,
            _ => &[],
        }
    }
}

impl Redemption {
    pub fn code(&self) -> &'static str {
        match self {
            Redemption::Malformed | Redemption::SecretMalformed | Redemption::BadKey | Redemption::BadCsr(_) => "bad_request",
            Redemption::Unknown => "token_unknown",
            Redemption::Wrong => "token_wrong",
            Redemption::Revoked => "token_revoked",
            Redemption::Used => "token_used",
            Redemption::TooMany { .. } => "too_many_refusals",
            Redemption::Expired => "token_expired",
            Redemption::OtherNode { .. } => "token_node",
            Redemption::NoDeclaration => "no_declaration",
            Redemption::NodeUndeclared { .. } => "node_undeclared",
            Redemption::NodeManagedOutside(_) => "node_managed_outside",
            Redemption::PoolFull { .. } => "pool_full",
            Redemption::PoolUndeclared { .. } => "pool_undeclared",
        }
    }
}

impl NodeRefusal {
    pub fn code(&self) -> &'static str {
        match self {
            NodeRefusal::CertificateRequired => "node_certificate_required",
            NodeRefusal::BadCertificate(_) => "bad_certificate",
            NodeRefusal::Unknown(_) => "unknown_node",
            NodeRefusal::Revoked(_) => "node_revoked",
            NodeRefusal::CertificateReplaced(_) => "certificate_replaced",
            NodeRefusal::ServiceCertificate(_) => "service_certificate",
            NodeRefusal::PendingApproval(_) => "pending_approval",
            NodeRefusal::Superseded(_) => "certificate_superseded",
            NodeRefusal::Replaced { .. } => "member_replaced",
        }
    }
}

impl From<StoreError> for Error {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { current, expected } => Error::RevisionConflict { current, expected },
            StoreError::TokenUsed => Error::Redemption(Redemption::Used),
            StoreError::KeyTaken(holder) => Error::KeyTaken(holder),
            StoreError::NotFound(what) => Error::NotFound(what),
            other => match other.unavailable() {
                Some(reason) => {
                    tracing::error!("the database is unavailable: {other}");
                    Error::DatabaseUnavailable(reason)
                }
                None => Error::internal("database access", other),
            },
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
