//! The node's side of the API: enrolment with the CA pinned by the token, and, over mutual TLS,
//! renewal, the bundle long-poll, evidence and `whoami`. Each request tries the controllers in
//! turn.

use std::time::Duration;

use base64::Engine;
use serde::de::DeserializeOwned;
use trellis_core::token::EnrolmentToken;
use trellis_proto as proto;

use crate::{each_controller, Error};

const CONNECT: Duration = Duration::from_secs(5);
const TIMEOUT: Duration = Duration::from_secs(30);

/// The enrolment request for a decoded token, the node's CSR and its WireGuard public key.
pub fn enrol_request(token: &EnrolmentToken, csr_pem: String, wireguard_public_key: String) -> proto::EnrolRequest {
    proto::EnrolRequest {
        token_id: trellis_core::token::hex(&token.id),
        secret: base64::engine::general_purpose::STANDARD.encode(token.secret),
        node: token.node.clone(),
        csr_pem,
        wireguard_public_key,
    }
}

/// A request carrying this node's clock (`Trellis-Time`), read as it is sent, so that a
/// controller can refuse a clock too far from its own, naming the skew.
fn stamped(req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
    req.header(trellis_proto::version::TIME_HEADER, trellis_files::unix_now().to_string())
}

async fn answer<T: DeserializeOwned>(resp: reqwest::Response) -> Result<T, Error> {
    if resp.status().is_success() {
        return resp.json().await.map_err(|source| Error::Unexpected { who: "agent", source });
    }
    Err(crate::refusal(resp).await)
}

/// Enrols with the first controller that answers, trusting only a CA whose SHA-256 is
/// `ca_fingerprint`. A controller presenting another CA fails the handshake, so the token's
/// secret is never sent to it, and the enrolment stops there ([`Error::Pinned`]).
pub async fn enrol(controllers: &[String], ca_fingerprint: [u8; 32], req: &proto::EnrolRequest) -> Result<proto::EnrolResponse, Error> {
    let result = each_controller(controllers, |controller| async move {
        let (tls, report) = trellis_pki::tls::pinned_client_config(ca_fingerprint);
        let client = crate::http_client(tls, CONNECT, TIMEOUT)?;
        match stamped(client.post(format!("https://{controller}/v1/enrol"))).json(req).send().await {
            Ok(resp) => answer(resp).await,
            Err(e) => match report.lock().expect("pin report").mismatch.clone() {
                Some(message) => Err(Error::Pinned { controller, message }),
                None => Err(Error::Send(e)),
            },
        }
    })
    .await;
    result.map_err(|e| match e {
        Error::Unreachable(tried) => Error::UnreachableFromToken(tried),
        e => e,
    })
}

/// What a bundle request got from the controller that answered.
#[derive(Debug)]
pub struct BundleAnswer {
    pub controller: String,
    /// The signed freshness stamp, decoded from base64, when the answer carries one.
    pub freshness: Option<Vec<u8>>,
    /// The bundle the answer names (its ETag): its version and the start of its content digest.
    pub tag: Option<trellis_proto::etag::BundleTag>,
    /// The bundle's bytes; `None` when the held version is current (304).
    pub body: Result<Option<Vec<u8>>, Error>,
    /// The body is a delta from the held version (`trellis_core::delta`), not a bundle.
    pub delta: bool,
}

/// A node's client over mutual TLS: its certificate, trusting only the mesh CA.
pub struct NodeClient {
    http: reqwest::Client,
    controllers: Vec<String>,
    /// The controller that answered last: asked first next time.
    last: std::sync::atomic::AtomicUsize,
}

impl NodeClient {
    pub fn new(controllers: Vec<String>, ca_pem: &str, cert_pem: &str, key_pem: &str) -> Result<NodeClient, Error> {
        let tls = trellis_pki::tls::client_config(ca_pem, Some((cert_pem, key_pem)))?;
        // Every node request says the protocol it speaks and the agent's release (this crate's
        // release is the workspace's, the agent's).
        use trellis_proto::version::{AGENT_HEADER, PROTOCOL, PROTOCOL_HEADER};
        let mut headers = reqwest::header::HeaderMap::new();
        headers
            .insert(PROTOCOL_HEADER, reqwest::header::HeaderValue::from_str(&PROTOCOL.to_string()).expect("a version is a header value"));
        headers.insert(AGENT_HEADER, reqwest::header::HeaderValue::from_static(env!("CARGO_PKG_VERSION")));
        Ok(NodeClient { http: crate::http_client_with(tls, CONNECT, TIMEOUT, headers)?, controllers, last: Default::default() })
    }

    /// The controllers asked, in order.
    pub fn controllers(&self) -> &[String] {
        &self.controllers
    }

    /// Asks `controllers` from now on (a list delivered in a bundle, ADR 0028), starting with
    /// the one that answered last if it is still listed.
    pub fn set_controllers(&mut self, controllers: Vec<String>) {
        use std::sync::atomic::Ordering;
        let last =
            self.controllers.get(self.last.load(Ordering::Relaxed)).and_then(|c| controllers.iter().position(|n| n == c)).unwrap_or(0);
        self.controllers = controllers;
        self.last.store(last, Ordering::Relaxed);
    }

    pub async fn renew(&self, csr_pem: &str) -> Result<proto::RenewResponse, Error> {
        let req = proto::RenewRequest { csr_pem: csr_pem.to_string() };
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = stamped(self.http.post(format!("https://{c}/v1/renew"))).json(&req).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    /// The service certificates this node is to hold (ADR 0023).
    pub async fn service_certificates(&self) -> Result<proto::ServiceCertList, Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = stamped(self.http.get(format!("https://{c}/v1/node/certificates"))).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    /// A CSR for one module's service certificate, signed or refused.
    pub async fn sign_service_certificate(&self, req: &proto::ServiceCertRequest) -> Result<proto::ServiceCertResponse, Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = stamped(self.http.post(format!("https://{c}/v1/node/certificates"))).json(req).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    /// Reports what this node holds, per module (ADR 0023).
    pub async fn report_held_certificates(&self, report: &proto::HeldServiceCerts) -> Result<proto::HeldServiceCertsAck, Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = self.http.post(format!("https://{c}/v1/node/certificates/held")).json(report).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    /// Reports this ingress node's Traefik (ADR 0026).
    pub async fn report_ingress(&self, report: &proto::IngressReport) -> Result<proto::IngressAck, Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = self.http.post(format!("https://{c}/v1/node/ingress")).json(report).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    /// Reports this node's direct paths and, on a hub, the endpoints it observes (ADR 0032).
    pub async fn report_paths(&self, report: &proto::PathReport) -> Result<proto::PathAck, Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = self.http.post(format!("https://{c}/v1/node/paths")).json(report).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    pub async fn whoami(&self) -> Result<proto::WhoAmI, Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = stamped(self.http.get(format!("https://{c}/v1/whoami"))).send();
            async move { answer(send.await.map_err(Error::Send)?).await }
        })
        .await
    }

    /// Delivers a batch of evidence records.
    pub async fn post_evidence(&self, batch: &proto::EvidenceBatch) -> Result<(), Error> {
        crate::each_controller_from(&self.controllers, &self.last, |c| {
            let send = stamped(self.http.post(format!("https://{c}/v1/evidence"))).json(batch).send();
            async move {
                let resp = send.await.map_err(Error::Send)?;
                if resp.status().is_success() {
                    return Ok(());
                }
                Err(crate::refusal(resp).await)
            }
        })
        .await
    }

    /// The bundle, long-polling up to `wait` seconds for another than `held` (its tag, sent as
    /// If-None-Match). The outer error says no controller answered; an answer that is an error
    /// is in [`BundleAnswer::body`], with the freshness stamp it carried.
    pub async fn bundle(&self, wait: u64, held: Option<trellis_proto::etag::BundleTag>) -> Result<BundleAnswer, Error> {
        self.bundle_or_delta(wait, held, None).await
    }

    /// [`NodeClient::bundle`]; with `files` (the SHA-256 of each file the node holds, of the
    /// bundle `held` names), the answer may be a delta from it ([`BundleAnswer::delta`], ADR 0033).
    pub async fn bundle_or_delta(
        &self,
        wait: u64,
        held: Option<trellis_proto::etag::BundleTag>,
        files: Option<&[[u8; 32]]>,
    ) -> Result<BundleAnswer, Error> {
        let files = files.filter(|f| !f.is_empty() && held.is_some()).map(trellis_proto::held_files);
        crate::each_controller_from(&self.controllers, &self.last, |controller| {
            let mut req =
                stamped(self.http.get(format!("https://{controller}/v1/bundle?wait={wait}"))).timeout(Duration::from_secs(wait + 30));
            if let Some(tag) = held {
                req = req.header("if-none-match", tag.etag());
            }
            if let Some(files) = &files {
                req = req
                    .header("accept", format!("application/octet-stream, {}", trellis_proto::DELTA_TYPE))
                    .header(trellis_proto::HELD_FILES_HEADER, files);
            }
            let send = req.send();
            async move {
                let resp = send.await.map_err(Error::Send)?;
                let freshness = resp
                    .headers()
                    .get(proto::FRESHNESS_HEADER)
                    .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v.as_bytes()).ok());
                let tag = resp.headers().get("etag").and_then(|v| v.to_str().ok()).and_then(trellis_proto::etag::BundleTag::parse);
                let status = resp.status();
                let is_delta = resp.headers().get("content-type").is_some_and(|v| v.as_bytes() == trellis_proto::DELTA_TYPE.as_bytes());
                let body = if status == reqwest::StatusCode::NOT_MODIFIED {
                    Ok(None)
                } else if status.is_success() {
                    read_bounded(resp).await.map(Some)
                } else {
                    Err(crate::refusal(resp).await)
                };
                Ok(BundleAnswer { controller, freshness, tag, body, delta: is_delta })
            }
        })
        .await
    }
}

/// Reads a bundle from the network, refusing one larger than the bound before holding it: the
/// announced length is checked first, then every chunk as it arrives.
pub async fn read_bounded(mut resp: reqwest::Response) -> Result<Vec<u8>, Error> {
    let max = trellis_core::bundle::MAX_BUNDLE;
    if let Some(len) = resp.content_length() {
        if len as usize > max {
            return Err(Error::TooLarge { len, max });
        }
    }
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await.map_err(|source| Error::Read { source })? {
        if out.len() + chunk.len() > max {
            return Err(Error::OverBound { max });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}
