//! `trellis serve`: HTTPS over rustls with optional client certificates, one task per
//! connection, the client certificate handed to handlers as a request extension.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;

use crate::api::{app, Ctx, PeerCert};
use crate::state::StateDir;

pub struct Server {
    pub listener: TcpListener,
    pub ctx: Arc<Ctx>,
    acceptor: TlsAcceptor,
}

impl Server {
    /// Opens the store (running migrations), loads keys and binds the listener.
    pub async fn bind(state: &StateDir, database_url: Option<&str>, listen: Option<&str>) -> Result<Server> {
        let url = database_url.unwrap_or(&state.config.database_url);
        let store = trellis_store::Store::open(url).await.with_context(|| format!("cannot open the database {}", redact(url)))?;
        let ca = trellis_pki::Ca::load(&state.read("ca.pem")?, &state.read("ca.key")?)?;
        let tls = trellis_pki::tls::server_config(&state.read("server.pem")?, &state.read("server.key")?, &state.read("ca.pem")?)?;
        let signing = state.signing_key()?;
        let admin_sha256: [u8; 32] = hex::decode(&state.config.admin_token_sha256)
            .ok()
            .and_then(|b| b.try_into().ok())
            .context("admin_token_sha256 in controller.toml is not 64 hex digits")?;
        let ctx = Arc::new(Ctx {
            store,
            ca,
            config: state.config.clone(),
            signing_public_key: signing.verifying_key().to_bytes(),
            signing_key: signing,
            publisher: Default::default(),
            admin_sha256,
            declaration: Default::default(),
        });
        let addr: SocketAddr = listen.unwrap_or(&state.config.listen).parse().context("the listen address is not IP:PORT")?;
        let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        Ok(Server { listener, ctx, acceptor: TlsAcceptor::from(Arc::new(tls)) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound")
    }

    /// Serves until `shutdown` resolves.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        let router = app(self.ctx.clone());
        // Publish what the database holds, then follow decisions made by other replicas.
        if let Err(e) = self.ctx.publisher.publish(&self.ctx).await {
            eprintln!("trellis serve: first publish failed: {}", e.message);
        }
        let watcher = {
            let ctx = self.ctx.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(500));
                let mut n = 0u64;
                loop {
                    tick.tick().await;
                    if let Err(e) = ctx.publisher.publish_if_moved(&ctx).await {
                        eprintln!("trellis serve: publishing failed: {}", e.message);
                    }
                    n += 1;
                    if n % 10 == 0 {
                        ctx.publisher.flush_contacts(&ctx).await;
                    }
                }
            })
        };
        let result = self.accept_loop(router, shutdown).await;
        watcher.abort();
        self.ctx.publisher.flush_contacts(&self.ctx).await;
        result
    }

    async fn accept_loop(&self, router: axum::Router, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        tokio::pin!(shutdown);
        loop {
            let (tcp, _peer) = tokio::select! {
                _ = &mut shutdown => return Ok(()),
                r = self.listener.accept() => match r {
                    Ok(c) => c,
                    Err(e) => {
                        eprintln!("trellis serve: accept: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let acceptor = self.acceptor.clone();
            let router = router.clone();
            tokio::spawn(async move {
                let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                    Ok(Ok(t)) => t,
                    _ => return,
                };
                let peer = PeerCert(tls.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| Arc::new(c.to_vec())));
                let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
                    req.extensions_mut().insert(peer.clone());
                    router.clone().oneshot(req.map(axum::body::Body::new))
                });
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(hyper_util::rt::TokioTimer::new())
                    .header_read_timeout(Duration::from_secs(30))
                    .serve_connection(TokioIo::new(tls), svc);
                let _ = conn.await;
            });
        }
    }
}

/// A database URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..s + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// SHA-256 fingerprint of the mesh CA, hex, for display.
pub fn ca_fingerprint_hex(state: &StateDir) -> Result<String> {
    let der = trellis_pki::pem_to_der(&state.read("ca.pem")?, "CERTIFICATE")?;
    Ok(hex::encode(Sha256::digest(der)))
}
