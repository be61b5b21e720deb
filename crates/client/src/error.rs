//! The client's one error type: what went wrong talking to a controller, each variant naming
//! the controller, file or bound at fault.

use std::path::PathBuf;

use trellis_proto as proto;

/// An error answer from the controller, with its diagnostics. Displays as the controller's
/// sentence.
#[derive(Debug, Clone)]
pub struct Refused {
    pub status: u16,
    pub body: proto::ErrorBody,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.body.error)
    }
}

impl std::error::Error for Refused {}

/// The controllers tried, each with why it could not be reached.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tried(pub Vec<(String, String)>);

impl std::fmt::Display for Tried {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            return f.write_str("no controller is named");
        }
        let parts: Vec<String> = self.0.iter().map(|(c, e)| format!("{c}: {e}")).collect();
        f.write_str(&parts.join("; "))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The request did not get an answer (connection refused, TLS, timeout): the failover loop
    /// moves on to the next controller.
    #[error(transparent)]
    Send(reqwest::Error),
    #[error("cannot reach the controller: {0}")]
    Unreachable(Tried),
    #[error("cannot reach any controller named in the token: {0}")]
    UnreachableFromToken(Tried),
    #[error("cannot reach the controller at {base}")]
    UnreachableAt { base: String, source: reqwest::Error },
    /// The first contact of a node: the controller's CA is not the one the token names.
    #[error("{controller}: {message}")]
    Pinned { controller: String, message: String },
    #[error("{0}")]
    Refused(Refused),
    /// An error answer whose body is not the controller's error shape.
    #[error("the controller answered {status}: {text}")]
    Answered { status: reqwest::StatusCode, text: String },
    #[error("the controller's answer is not what this {who} expects")]
    Unexpected { who: &'static str, source: reqwest::Error },
    #[error("reading the bundle")]
    Read { source: reqwest::Error },
    #[error("the bundle is {len} bytes, over the bound of {max}")]
    TooLarge { len: u64, max: usize },
    #[error("the bundle is over the bound of {max} bytes")]
    OverBound { max: usize },
    #[error("cannot read {}", path.display())]
    File { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Pki(#[from] trellis_pki::PkiError),
    #[error("cannot build the HTTP client")]
    Build { source: reqwest::Error },
}

impl Error {
    /// Whether the request may have been carried out although no answer says so: it got no
    /// answer, an answer cut short, or a controller that could not decide (5xx). Repeating a
    /// request that is idempotent is then the way to learn its outcome.
    pub fn outcome_unknown(&self) -> bool {
        match self {
            Error::Send(_) | Error::Unreachable(_) | Error::UnreachableFromToken(_) | Error::UnreachableAt { .. } => true,
            Error::Unexpected { .. } | Error::Read { .. } => true,
            Error::Refused(r) => r.status >= 500,
            Error::Answered { status, .. } => status.is_server_error(),
            _ => false,
        }
    }

    /// The controller's refusal, when this is one.
    pub fn refused(&self) -> Option<&Refused> {
        match self {
            Error::Refused(r) => Some(r),
            _ => None,
        }
    }
}
