//! API errors: one sentence and a stable code, mapped to an HTTP status once, here.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use trellis_proto::{Diagnostic, ErrorBody};
use trellis_store::StoreError;

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    pub diagnostics: Vec<Diagnostic>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        ApiError { status, code, message: message.into(), diagnostics: Vec::new() }
    }

    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", message)
    }

    pub fn unauthorized(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, code, message)
    }

    pub fn forbidden(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, code, message)
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    pub fn conflict(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, code, message)
    }

    pub fn internal(context: &str, e: impl std::fmt::Display) -> Self {
        // The detail goes to the controller's log, not to the client.
        eprintln!("trellis serve: {context}: {e}");
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", format!("{context} failed inside the controller; see its log"))
    }
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> Self {
        match e {
            StoreError::Conflict { .. } => ApiError::conflict("revision_conflict", e.to_string()),
            StoreError::TokenUsed => ApiError::conflict("token_used", "token already used"),
            StoreError::KeyTaken(_) => ApiError::conflict("key_taken", e.to_string()),
            StoreError::NotFound(what) => ApiError::not_found(format!("no {what}")),
            other => ApiError::internal("database access", other),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody { error: self.message, code: self.code.to_string(), diagnostics: self.diagnostics };
        (self.status, Json(body)).into_response()
    }
}
