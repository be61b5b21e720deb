//! `trellis serve`: HTTPS over rustls with optional client certificates, one task per
//! connection, the client certificate handed to handlers as a request extension; and the
//! background work a serving controller does (publishing what other replicas decided, writing
//! contacts).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt;
use trellis_controller::state::StateDir;
use trellis_controller::Controller;

use crate::auth::PeerCert;
use crate::routes::app;

pub struct Server {
    pub listener: TcpListener,
    pub controller: Arc<Controller>,
    acceptor: TlsAcceptor,
}

impl Server {
    /// Opens the store (running migrations), loads keys and binds the listener.
    pub async fn bind(state: &StateDir, database_url: Option<&str>, listen: Option<&str>) -> Result<Server> {
        let controller = Controller::open(state, database_url).await?;
        let tls = trellis_pki::tls::server_config(&state.read("server.pem")?, &state.read("server.key")?, &state.read("ca.pem")?)?;
        let addr: SocketAddr = listen.unwrap_or(&state.config.listen).parse().context("the listen address is not IP:PORT")?;
        let listener = TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr}"))?;
        Ok(Server { listener, controller: Arc::new(controller), acceptor: TlsAcceptor::from(Arc::new(tls)) })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound")
    }

    /// Serves until `shutdown` resolves.
    pub async fn run(self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        let router = app(self.controller.clone());
        // Publish what the database holds, then follow decisions made by other replicas.
        if let Err(e) = self.controller.publish().await {
            eprintln!("trellis serve: first publish failed: {e}");
        }
        let watcher = {
            let c = self.controller.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(500));
                let mut n = 0u64;
                loop {
                    tick.tick().await;
                    if let Err(e) = c.publish_if_moved().await {
                        eprintln!("trellis serve: publishing failed: {e}");
                    }
                    n += 1;
                    if n % 10 == 0 {
                        c.flush_contacts().await;
                    }
                }
            })
        };
        let result = self.accept_loop(router, shutdown).await;
        watcher.abort();
        self.controller.flush_contacts().await;
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
