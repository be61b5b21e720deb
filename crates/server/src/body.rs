//! Request bodies: JSON whose every rejection (wrong content type, malformed JSON, unknown or
//! missing fields, too large) is one clear sentence in the API's error shape.

use axum::extract::rejection::JsonRejection;
use axum::http::StatusCode;
use axum::Json;

use crate::error::ApiError;

pub const SMALL_BODY: usize = 64 * 1024;
pub const DECLARATION_BODY: usize = 16 * 1024 * 1024;
pub const EVIDENCE_BODY: usize = 4 * 1024 * 1024;

/// A JSON body of type `T`, at most `MAX` bytes: one announced as larger is refused from its
/// headers, before a byte of it is read; one that turns out larger while read (chunked) is cut
/// off by the route's `DefaultBodyLimit`.
pub struct Body<T, const MAX: usize = SMALL_BODY>(pub T);

/// Refuses a body announced as larger than `max` from its headers, before a byte of it is read;
/// else how long it has to arrive (a request must not hold its connection for ever).
fn bounds(req: &axum::extract::Request, max: usize) -> Result<std::time::Duration, ApiError> {
    let announced = req.headers().get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if announced.is_some_and(|n| n > max as u64) {
        return Err(too_large());
    }
    Ok(req.extensions().get::<crate::limits::Limits>().copied().unwrap_or_default().body_timeout)
}

/// A body that did not arrive within `timeout`.
fn late(timeout: std::time::Duration) -> ApiError {
    ApiError::body(
        StatusCode::REQUEST_TIMEOUT,
        "body_timeout",
        format!("the request body did not arrive within {} seconds", timeout.as_secs()),
    )
}

fn too_large() -> ApiError {
    ApiError::body(StatusCode::PAYLOAD_TOO_LARGE, "too_large", "the request body is larger than this endpoint accepts")
}

impl<T: serde::de::DeserializeOwned, S: Send + Sync, const MAX: usize> axum::extract::FromRequest<S> for Body<T, MAX> {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        let timeout = bounds(&req, MAX)?;
        let Ok(read) = tokio::time::timeout(timeout, Json::<T>::from_request(req, state)).await else {
            return Err(late(timeout));
        };
        match read {
            Ok(Json(v)) => Ok(Body(v)),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::body(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "content_type",
                "the request body must be JSON (Content-Type: application/json)",
            )),
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(ApiError::body(StatusCode::BAD_REQUEST, "bad_request", format!("the request body is not valid JSON: {}", inner(&e))))
            }
            Err(JsonRejection::JsonDataError(e)) => {
                Err(ApiError::body(StatusCode::UNPROCESSABLE_ENTITY, "bad_fields", format!("the request body does not fit: {}", inner(&e))))
            }
            Err(JsonRejection::BytesRejection(_)) => Err(too_large()),
            Err(other) => Err(ApiError::body(StatusCode::BAD_REQUEST, "bad_request", other.body_text())),
        }
    }
}

/// `POST /v1/admin/apply`'s body: the JSON `ApplyRequest`, or the same in trellis's own form
/// (`proto::declaration`, Content-Type `application/vnd.trellis.declaration`), which spares both
/// ends a JSON pass over megabytes of TOML. Bounded in size and time as [`Body`] is.
pub struct Declaration(pub trellis_proto::ApplyRequest);

impl<S: Send + Sync> axum::extract::FromRequest<S> for Declaration {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        let binary =
            req.headers().get(axum::http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).is_some_and(|t| {
                t.split(';').next().is_some_and(|t| t.trim().eq_ignore_ascii_case(trellis_proto::declaration::MEDIA_TYPE))
            });
        if !binary {
            let Body(r) = Body::<trellis_proto::ApplyRequest, DECLARATION_BODY>::from_request(req, state).await?;
            return Ok(Declaration(r));
        }
        let timeout = bounds(&req, DECLARATION_BODY)?;
        let bytes = match tokio::time::timeout(timeout, axum::body::Bytes::from_request(req, state)).await {
            Ok(Ok(b)) => b,
            Ok(Err(_)) => return Err(too_large()),
            Err(_) => return Err(late(timeout)),
        };
        trellis_proto::declaration::decode(&bytes)
            .map(Declaration)
            .map_err(|e| ApiError::body(StatusCode::BAD_REQUEST, "bad_request", format!("the declaration body does not read: {e}")))
    }
}

/// The innermost cause: serde's sentence without axum's wrapping.
pub(crate) fn inner(e: &dyn std::error::Error) -> String {
    let mut e = e;
    while let Some(s) = e.source() {
        e = s;
    }
    e.to_string()
}
