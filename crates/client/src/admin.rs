//! The admin client: how `trellis apply`, `token`, `nodes`, `node`, `status` and `audit` reach
//! the controller, with the admin credential as a bearer token.

use std::path::Path;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use trellis_proto as proto;

use crate::Error;

pub struct AdminClient {
    http: reqwest::Client,
    base: String,
    token: String,
}

/// The controller's base URL for a `HOST:PORT`.
pub fn base_url(hostport: &str) -> String {
    format!("https://{hostport}")
}

fn read(path: &Path) -> Result<String, Error> {
    std::fs::read_to_string(path).map_err(|source| Error::File { path: path.to_path_buf(), source })
}

impl AdminClient {
    /// A client for the controller at `base` (`https://HOST:PORT`), trusting only `ca_pem`.
    pub fn new(base: &str, ca_pem: &str, token: &str) -> Result<AdminClient, Error> {
        let tls = trellis_pki::tls::client_config(ca_pem, None)?;
        let http = crate::http_client(tls, Duration::from_secs(10), Duration::from_secs(120))?;
        Ok(AdminClient { http, base: base.trim_end_matches('/').to_string(), token: token.trim().to_string() })
    }

    /// A client from `--server` (HOST:PORT or https://...), `--admin-token-file` and `--ca-file`.
    pub fn from_args(server: &str, token_file: &Path, ca_file: &Path) -> Result<AdminClient, Error> {
        let base = if server.starts_with("https://") { server.to_string() } else { base_url(server) };
        Self::new(&base, &read(ca_file)?, &read(token_file)?)
    }

    async fn send<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<T, Error> {
        let resp = req.bearer_auth(&self.token).send().await.map_err(|source| Error::UnreachableAt { base: self.base.clone(), source })?;
        if resp.status().is_success() {
            return resp.json().await.map_err(|source| Error::Unexpected { who: "trellis", source });
        }
        Err(crate::refusal(resp).await)
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T, Error> {
        self.send(self.http.post(self.url(path)).json(body)).await
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, Error> {
        self.send(self.http.get(self.url(path))).await
    }

    /// Sends the declaration in trellis's own form (`proto::declaration`: no JSON pass over
    /// megabytes of TOML on either end); a controller that takes only JSON (an older one,
    /// answering 415) is sent the JSON.
    pub async fn apply(&self, req: &proto::ApplyRequest) -> Result<proto::ApplyResponse, Error> {
        let body = self
            .http
            .post(self.url("/v1/admin/apply"))
            .header(reqwest::header::CONTENT_TYPE, proto::declaration::MEDIA_TYPE)
            .body(proto::declaration::encode(req));
        match self.send(body).await {
            Err(e) if e.refused().is_some_and(|r| r.status == 415) => self.post("/v1/admin/apply", req).await,
            other => other,
        }
    }

    pub async fn create_token(&self, req: &proto::TokenRequest) -> Result<proto::TokenCreated, Error> {
        self.post("/v1/admin/tokens", req).await
    }

    pub async fn tokens(&self) -> Result<Vec<proto::TokenInfo>, Error> {
        self.get("/v1/admin/tokens").await
    }

    pub async fn revoke_token(&self, id: &str) -> Result<proto::TokenInfo, Error> {
        self.send(self.http.delete(self.url(&format!("/v1/admin/tokens/{id}")))).await
    }

    pub async fn nodes(&self) -> Result<Vec<proto::NodeInfo>, Error> {
        self.get("/v1/admin/nodes").await
    }

    pub async fn approve(&self, node: &str) -> Result<proto::WhoAmI, Error> {
        self.post(&format!("/v1/admin/nodes/{node}/approve"), &()).await
    }

    pub async fn revoke(&self, node: &str) -> Result<proto::WhoAmI, Error> {
        self.post(&format!("/v1/admin/nodes/{node}/revoke"), &()).await
    }

    /// How far a revoked node's revocation has reached (ADR 0022).
    pub async fn revocation(&self, node: &str) -> Result<proto::Revocation, Error> {
        self.get(&format!("/v1/admin/nodes/{node}/revocation")).await
    }

    pub async fn status(&self) -> Result<Vec<proto::NodeStatus>, Error> {
        self.get("/v1/admin/status").await
    }

    /// Every service certificate (ADR 0023).
    pub async fn certificates(&self) -> Result<Vec<proto::ServiceCertInfo>, Error> {
        self.get("/v1/admin/certificates").await
    }

    /// The controllers nodes are given in their bundles (ADR 0028).
    pub async fn controllers(&self) -> Result<proto::ControllerList, Error> {
        self.get("/v1/admin/controllers").await
    }

    pub async fn add_controller(&self, address: &str) -> Result<proto::ControllerList, Error> {
        self.post("/v1/admin/controllers", &proto::ControllerChange { address: address.to_string() }).await
    }

    pub async fn remove_controller(&self, address: &str) -> Result<proto::ControllerList, Error> {
        let body = proto::ControllerChange { address: address.to_string() };
        self.send(self.http.delete(self.url("/v1/admin/controllers")).json(&body)).await
    }

    /// Starts a rotation of the bundle-signing key (ADR 0027).
    pub async fn rotate_signing_key(&self, req: &proto::SigningKeyRotation) -> Result<proto::Rotation, Error> {
        self.post("/v1/admin/rotations/signing-key", req).await
    }

    /// Starts a rotation of the mesh CA (ADR 0029).
    pub async fn rotate_ca(&self, req: &proto::CaRotation) -> Result<proto::Rotation, Error> {
        self.post("/v1/admin/rotations/ca", req).await
    }

    pub async fn rotations(&self) -> Result<Vec<proto::Rotation>, Error> {
        self.get("/v1/admin/rotations").await
    }

    /// One page of the audit chain: at most `limit` records after sequence number `after`.
    pub async fn audit_page(&self, after: i64, limit: i64) -> Result<Vec<proto::AuditRecord>, Error> {
        self.get(&format!("/v1/admin/audit?after={after}&limit={limit}")).await
    }

    /// The controller's signed checkpoint of the audit head; `None` before the first decision.
    pub async fn audit_checkpoint(&self) -> Result<Option<proto::audit::Checkpoint>, Error> {
        match self.get("/v1/admin/audit/checkpoint").await {
            Ok(cp) => Ok(Some(cp)),
            Err(e) if e.refused().is_some_and(|r| r.status == 404) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, SystemTime};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A controller that takes the declaration only as JSON (an older one): it answers the
    /// declaration in trellis's own form 415, as axum's JSON extractor does, and the JSON with a
    /// revision. Returns its address and the content types it was sent, in order.
    async fn json_only_controller(ca: &trellis_pki::Ca) -> (String, Arc<Mutex<Vec<String>>>) {
        let server = ca.server_cert(&["127.0.0.1".into()], SystemTime::now(), Duration::from_secs(3600), [2; 16]).unwrap();
        let cfg = trellis_pki::tls::server_config(&server.cert_pem, &server.key_pem, ca.cert_pem(), ca.cert_pem()).unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(cfg));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        tokio::spawn(async move {
            while let Ok((tcp, _)) = listener.accept().await {
                let Ok(mut tls) = acceptor.accept(tcp).await else { continue };
                let mut request = Vec::new();
                let mut buf = [0u8; 64 * 1024];
                // The head, then as many bytes as it says the body has.
                let (head, start, length) = loop {
                    let n = tls.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the request ended early");
                    request.extend_from_slice(&buf[..n]);
                    if let Some(end) = request.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&request[..end]).to_lowercase();
                        let length =
                            head.lines().find_map(|l| l.strip_prefix("content-length:")).map_or(0, |v| v.trim().parse::<usize>().unwrap());
                        break (head, end + 4, end + 4 + length);
                    }
                };
                while request.len() < length {
                    let n = tls.read(&mut buf).await.unwrap();
                    request.extend_from_slice(&buf[..n]);
                }
                let kind = head.lines().find_map(|l| l.strip_prefix("content-type:")).unwrap_or("").trim().to_string();
                log.lock().unwrap().push(kind.clone());
                let (status, body) = if kind == "application/json" {
                    let sent: super::proto::ApplyRequest = serde_json::from_slice(&request[start..length]).unwrap();
                    assert_eq!(sent.files.len(), 1);
                    ("200 OK", r#"{"revision":7,"diagnostics":[],"unchanged":false}"#.to_string())
                } else {
                    (
                        "415 Unsupported Media Type",
                        r#"{"code":"content_type","error":"the request body must be JSON (Content-Type: application/json)"}"#.to_string(),
                    )
                };
                let answer = format!(
                    "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                tls.write_all(answer.as_bytes()).await.unwrap();
                let _ = tls.shutdown().await;
            }
        });
        (format!("https://{addr}"), seen)
    }

    /// `trellis apply` against a controller that takes only JSON: refused the declaration in
    /// trellis's own form (415), it sends the JSON, and the apply goes through.
    #[tokio::test]
    async fn a_controller_that_takes_only_json_is_sent_json() {
        let pair = trellis_pki::create_ca("t", SystemTime::now(), [1; 16]).unwrap();
        let ca = trellis_pki::Ca::load(&pair.cert_pem, &pair.key_pem).unwrap();
        let (base, seen) = json_only_controller(&ca).await;
        let client = super::AdminClient::new(&base, ca.cert_pem(), "trellis-admin-x").unwrap();
        let req = super::proto::ApplyRequest {
            files: vec![super::proto::DeclFile { path: "mesh.toml".into(), text: "[mesh]\n".into() }],
            expect_revision: None,
        };
        let answer = client.apply(&req).await.unwrap();
        assert_eq!(answer.revision, 7);
        assert_eq!(*seen.lock().unwrap(), [super::proto::declaration::MEDIA_TYPE, "application/json"]);
    }
}
