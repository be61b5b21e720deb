//! `trellis-client`: the one HTTP client of trellis, used by the agent and by the admin CLI. It
//! holds the controller failover loop, the parsing of error answers and the request builders;
//! it decides nothing and keeps no state.

mod admin;
mod declfs;
mod error;
#[cfg(feature = "log")]
pub mod log;
mod node;

use std::future::Future;
use std::time::Duration;

pub use admin::{base_url, AdminClient};
pub use declfs::{declaration_files, DeclDirError};
pub use error::{Error, Refused, Tried};
pub use node::{enrol, enrol_request, read_bounded, BundleAnswer, NodeClient};

/// A reqwest client over a rustls configuration made by `trellis_pki::tls`.
fn http_client(tls: rustls::ClientConfig, connect: Duration, timeout: Duration) -> Result<reqwest::Client, Error> {
    http_client_with(tls, connect, timeout, reqwest::header::HeaderMap::new())
}

/// As [`http_client`], sending `headers` with every request.
fn http_client_with(
    tls: rustls::ClientConfig,
    connect: Duration,
    timeout: Duration,
    headers: reqwest::header::HeaderMap,
) -> Result<reqwest::Client, Error> {
    reqwest::Client::builder()
        .default_headers(headers)
        .use_preconfigured_tls(tls)
        .connect_timeout(connect)
        .timeout(timeout)
        .build()
        .map_err(|source| Error::Build { source })
}

/// Tries each controller in turn: a connection failure ([`Error::Send`]) moves on to the next;
/// an answer of any status, or any other error, stops the loop and is returned. When none
/// answered, [`Error::Unreachable`] names every controller tried with its failure.
pub async fn each_controller<T, F, Fut>(controllers: &[String], attempt: F) -> Result<T, Error>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    each_controller_from(controllers, &std::sync::atomic::AtomicUsize::new(0), attempt).await
}

/// As [`each_controller`], starting at the controller `last` names, the one that answered
/// last, and remembering in it the one that answers now: a controller that went silent costs
/// its connect timeout once, not on every request (issue 21, item 4).
pub async fn each_controller_from<T, F, Fut>(
    controllers: &[String],
    last: &std::sync::atomic::AtomicUsize,
    mut attempt: F,
) -> Result<T, Error>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    use std::sync::atomic::Ordering;
    let mut tried = Tried::default();
    let start = last.load(Ordering::Relaxed);
    for i in 0..controllers.len() {
        let k = (start + i) % controllers.len();
        let c = &controllers[k];
        match attempt(c.clone()).await {
            Err(Error::Send(e)) => tried.0.push((c.clone(), with_causes(&e))),
            other => {
                last.store(k, Ordering::Relaxed);
                return other;
            }
        }
    }
    Err(Error::Unreachable(tried))
}

/// An error with what caused it, innermost last, each told once: "error sending request for
/// url (…)" alone does not say that the TLS handshake failed, or why.
pub fn with_causes(e: &dyn std::error::Error) -> String {
    let mut parts = vec![e.to_string()];
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !parts.iter().any(|p| p.contains(&text)) {
            parts.push(text);
        }
        source = s.source();
    }
    parts.join(": ")
}

/// Parses an error answer: the controller's [`proto::ErrorBody`](trellis_proto::ErrorBody) when
/// the body is one, the status and the text otherwise.
pub async fn refusal(resp: reqwest::Response) -> Error {
    let status = resp.status();
    let text = resp.text().await.unwrap_or_default();
    refusal_from(status, &text)
}

fn refusal_from(status: reqwest::StatusCode, text: &str) -> Error {
    match serde_json::from_str::<trellis_proto::ErrorBody>(text) {
        Ok(body) => Error::Refused(Refused { status: status.as_u16(), body }),
        Err(_) => Error::Answered { status, text: text.to_string() },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_body_is_a_refusal_that_reads_as_the_controllers_sentence() {
        let e = refusal_from(reqwest::StatusCode::CONFLICT, r#"{"error":"token already used","code":"conflict"}"#);
        let r = e.refused().expect("a refusal");
        assert_eq!((r.status, r.body.code.as_str()), (409, "conflict"));
        assert_eq!(e.to_string(), "token already used");
    }

    #[test]
    fn another_body_is_shown_with_the_status() {
        let e = refusal_from(reqwest::StatusCode::BAD_GATEWAY, "upstream down");
        assert!(e.refused().is_none());
        assert_eq!(e.to_string(), "the controller answered 502 Bad Gateway: upstream down");
    }

    #[test]
    fn unreachable_names_every_controller_tried() {
        let tried = Tried(vec![("a:1".into(), "refused".into()), ("b:2".into(), "timed out".into())]);
        assert_eq!(Error::Unreachable(tried.clone()).to_string(), "cannot reach the controller: a:1: refused; b:2: timed out");
        assert_eq!(
            Error::UnreachableFromToken(tried).to_string(),
            "cannot reach any controller named in the token: a:1: refused; b:2: timed out"
        );
    }
}
