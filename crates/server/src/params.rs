//! Path and query parameters: every rejection (a query string that does not fit its type, a path
//! segment that is not text) is one sentence in the API's error shape, never axum's plain text.

use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::StatusCode;

use crate::error::ApiError;

/// The query string as `T`; refused `400 bad_query`.
pub struct Query<T>(pub T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(Query(v)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => Err(ApiError::body(
                StatusCode::BAD_REQUEST,
                "bad_query",
                format!("the query string does not fit: {}", crate::body::inner(&e)),
            )),
            Err(e) => {
                Err(ApiError::body(StatusCode::BAD_REQUEST, "bad_query", format!("the query string does not fit: {}", e.body_text())))
            }
        }
    }
}

/// The path's parameters as `T`; refused `400 bad_path`.
pub struct Path<T>(pub T);

impl<T: serde::de::DeserializeOwned + Send, S: Send + Sync> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(Path(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(ApiError::body(StatusCode::BAD_REQUEST, "bad_path", format!("the path does not fit: {}", e.body_text())))
            }
            Err(e) => Err(ApiError::body(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.body_text())),
        }
    }
}
