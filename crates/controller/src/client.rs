//! The admin client: how `trellis apply`, `token`, `nodes` and `node` reach the controller,
//! found through a state directory on the same machine or `--server` from elsewhere.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::de::DeserializeOwned;
use serde::Serialize;
use trellis_proto as proto;

use crate::state::StateDir;
use trellis_files as files;

pub struct AdminClient {
    http: reqwest::Client,
    base: String,
    token: String,
}

/// An error answer from the controller, with its diagnostics.
#[derive(Debug)]
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

pub fn base_url(hostport: &str) -> String {
    format!("https://{hostport}")
}

impl AdminClient {
    pub fn new(base: &str, ca_pem: &str, token: &str) -> Result<AdminClient> {
        let tls = trellis_pki::tls::client_config(ca_pem, None)?;
        let http = reqwest::Client::builder()
            .use_preconfigured_tls(tls)
            .connect_timeout(std::time::Duration::from_secs(10))
            .timeout(std::time::Duration::from_secs(120))
            .build()?;
        Ok(AdminClient { http, base: base.trim_end_matches('/').to_string(), token: token.trim().to_string() })
    }

    pub fn from_state_dir(dir: &Path) -> Result<AdminClient> {
        let state = StateDir::load(dir)?;
        let host = state.config.advertise.first().context("controller.toml advertises no address")?;
        Self::new(&base_url(host), &state.read("ca.pem")?, &state.read("admin.token")?)
    }

    pub fn from_args(server: &str, token_file: &Path, ca_file: &Path) -> Result<AdminClient> {
        let base = if server.starts_with("https://") { server.to_string() } else { base_url(server) };
        Self::new(&base, &files::read(ca_file)?, &files::read(token_file)?)
    }

    async fn send<T: DeserializeOwned>(&self, req: reqwest::RequestBuilder) -> Result<T> {
        let resp = req.bearer_auth(&self.token).send().await.with_context(|| format!("cannot reach the controller at {}", self.base))?;
        let status = resp.status();
        if status.is_success() {
            return resp.json().await.context("the controller's answer is not what this trellis expects");
        }
        let text = resp.text().await.unwrap_or_default();
        match serde_json::from_str::<proto::ErrorBody>(&text) {
            Ok(body) => Err(Refused { status: status.as_u16(), body }.into()),
            Err(_) => bail!("the controller answered {status}: {text}"),
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    async fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<T> {
        self.send(self.http.post(self.url(path)).json(body)).await
    }

    async fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T> {
        self.send(self.http.get(self.url(path))).await
    }

    pub async fn apply(&self, req: &proto::ApplyRequest) -> Result<proto::ApplyResponse> {
        self.post("/v1/admin/apply", req).await
    }

    pub async fn create_token(&self, req: &proto::TokenRequest) -> Result<proto::TokenCreated> {
        self.post("/v1/admin/tokens", req).await
    }

    pub async fn tokens(&self) -> Result<Vec<proto::TokenInfo>> {
        self.get("/v1/admin/tokens").await
    }

    pub async fn revoke_token(&self, id: &str) -> Result<proto::TokenInfo> {
        self.send(self.http.delete(self.url(&format!("/v1/admin/tokens/{id}")))).await
    }

    pub async fn nodes(&self) -> Result<Vec<proto::NodeInfo>> {
        self.get("/v1/admin/nodes").await
    }

    pub async fn approve(&self, node: &str) -> Result<proto::WhoAmI> {
        self.post(&format!("/v1/admin/nodes/{node}/approve"), &()).await
    }

    pub async fn revoke(&self, node: &str) -> Result<proto::WhoAmI> {
        self.post(&format!("/v1/admin/nodes/{node}/revoke"), &()).await
    }

    pub async fn status(&self) -> Result<Vec<proto::NodeStatus>> {
        self.get("/v1/admin/status").await
    }

    pub async fn audit(&self) -> Result<Vec<proto::AuditRecord>> {
        self.get("/v1/admin/audit").await
    }
}
