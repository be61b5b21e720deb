//! The one mapping from a controller refusal to an HTTP status and the API's error body, and the
//! one description of those refusals in the API document (`Refusals`).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use trellis_controller::{Error, NodeRefusal, Redemption, ServiceCertRefusal};
use trellis_pki::CsrRefusal;
use trellis_proto::ErrorBody;

/// The answers every operation that decides may give besides its own, as the API document
/// describes them: each an `ErrorBody`. A `401` is described per operation, with its challenge
/// (`openapi::challenges`).
#[derive(utoipa::IntoResponses)]
pub enum Refusals {
    #[response(status = "4XX", description = "Refused: one sentence and a stable code")]
    Refused(ErrorBody),
    #[response(
        status = "5XX",
        description = "The controller cannot answer now (database unavailable, publishing behind) or failed inside"
    )]
    Unavailable(ErrorBody),
}

/// A refusal on its way to the client: a decision's, or the HTTP layer's own when a request
/// body could not be read as its type.
#[derive(Debug)]
pub enum ApiError {
    Refused(Error),
    Body { status: StatusCode, code: &'static str, message: String },
}

impl From<Error> for ApiError {
    fn from(e: Error) -> Self {
        ApiError::Refused(e)
    }
}

impl ApiError {
    pub fn body(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError::Body { status, code, message: message.into() }
    }
}

/// The HTTP status of each refusal.
pub fn status(e: &Error) -> StatusCode {
    match e {
        Error::BadRequest(_) | Error::ProtocolUnsupported { .. } | Error::ClockSkew { .. } => StatusCode::BAD_REQUEST,
        Error::AgentTooOld { .. } => StatusCode::FORBIDDEN,
        Error::TooOften { .. } => StatusCode::TOO_MANY_REQUESTS,
        Error::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
        Error::AdminRequired | Error::AdminDenied => StatusCode::UNAUTHORIZED,
        Error::InvalidDeclaration { .. } => StatusCode::UNPROCESSABLE_ENTITY,
        Error::RevisionConflict { .. } | Error::NoDeclaration(_) => StatusCode::CONFLICT,
        Error::NodeNotDeclared { .. } | Error::PoolNotDeclared { .. } | Error::TokenNotFound(_) | Error::NotFound(_) => {
            StatusCode::NOT_FOUND
        }
        Error::NodeManagedOutside(_) | Error::TokenNotRevocable { .. } | Error::KeyTaken(_) => StatusCode::CONFLICT,
        Error::NotPending(_) | Error::NotRevocable(_) => StatusCode::CONFLICT,
        Error::Redemption(r) => match r {
            Redemption::Malformed | Redemption::SecretMalformed | Redemption::BadKey | Redemption::BadCsr(_) => StatusCode::BAD_REQUEST,
            Redemption::Unknown | Redemption::Wrong | Redemption::Revoked | Redemption::Expired => StatusCode::UNAUTHORIZED,
            Redemption::Used | Redemption::NoDeclaration | Redemption::PoolFull { .. } => StatusCode::CONFLICT,
            Redemption::PoolUndeclared { .. } => StatusCode::FORBIDDEN,
            Redemption::TooMany { .. } => StatusCode::TOO_MANY_REQUESTS,
            Redemption::OtherNode { .. } | Redemption::NodeUndeclared { .. } | Redemption::NodeManagedOutside(_) => StatusCode::FORBIDDEN,
        },
        Error::Node(n) => match n {
            NodeRefusal::CertificateRequired | NodeRefusal::BadCertificate(_) => StatusCode::UNAUTHORIZED,
            NodeRefusal::Unknown(_)
            | NodeRefusal::Revoked(_)
            | NodeRefusal::CertificateReplaced(_)
            | NodeRefusal::ServiceCertificate(_)
            | NodeRefusal::PendingApproval(_)
            | NodeRefusal::Superseded(_)
            | NodeRefusal::Replaced { .. } => StatusCode::FORBIDDEN,
        },
        Error::ServiceCert(r) => match r {
            ServiceCertRefusal::Malformed | ServiceCertRefusal::Csr(CsrRefusal::Invalid(_)) => StatusCode::BAD_REQUEST,
            ServiceCertRefusal::NoServicesCa => StatusCode::SERVICE_UNAVAILABLE,
            ServiceCertRefusal::NotServed { .. }
            | ServiceCertRefusal::Pending(_)
            | ServiceCertRefusal::Revoked(_)
            | ServiceCertRefusal::Csr(_) => StatusCode::FORBIDDEN,
        },
        Error::NoBundleYet(_) | Error::PublishingBehind(_) | Error::DatabaseUnavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
        Error::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

/// The admin credential's challenge: a bearer token (RFC 6750), the one `trellis init` writes to
/// `admin.token`.
pub const ADMIN_CHALLENGE: &str = "Bearer realm=\"trellis-admin\"";

/// A node's challenge: its certificate, presented in the TLS handshake (no HTTP scheme carries
/// one, so the challenge names it).
pub const NODE_CHALLENGE: &str = "ClientCertificate realm=\"trellis-node\"";

/// An enrolment's challenge: the token, sent in the request body.
pub const ENROLMENT_CHALLENGE: &str = "EnrolmentToken realm=\"trellis-enrolment\"";

/// What a `401` asks for (`WWW-Authenticate`, which every 401 carries): the admin credential, a
/// node's certificate or an enrolment token.
pub fn challenge(e: &Error) -> Option<&'static str> {
    match e {
        Error::AdminRequired => Some(ADMIN_CHALLENGE),
        Error::AdminDenied => Some("Bearer realm=\"trellis-admin\", error=\"invalid_token\""),
        Error::Node(NodeRefusal::CertificateRequired | NodeRefusal::BadCertificate(_)) => Some(NODE_CHALLENGE),
        Error::Redemption(Redemption::Unknown | Redemption::Wrong | Redemption::Revoked | Redemption::Expired) => Some(ENROLMENT_CHALLENGE),
        _ => None,
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, body, challenge) = match self {
            ApiError::Refused(e) => {
                // An internal error's detail was logged where it happened; the client gets the
                // context only.
                let body = ErrorBody { error: e.to_string(), code: e.code().to_string(), diagnostics: e.diagnostics().to_vec() };
                (status(&e), body, challenge(&e))
            }
            ApiError::Body { status, code, message } => {
                (status, ErrorBody { error: message, code: code.to_string(), diagnostics: Vec::new() }, None)
            }
        };
        let mut response = (status, Json(body)).into_response();
        if let Some(c) = challenge {
            response.headers_mut().insert(axum::http::header::WWW_AUTHENTICATE, axum::http::HeaderValue::from_static(c));
        }
        response
    }
}
