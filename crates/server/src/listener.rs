//! `trellis serve`: HTTPS over rustls with optional client certificates, one task per
//! connection, the client certificate handed to handlers as a request extension. It starts the
//! controller's own tasks (publishing, and `housekeeping`: its periodic duties) and stops them.

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

use crate::auth::{Peer, PeerCert};
use crate::limits::Limits;
use crate::routes::app;

/// Open connections, in total and per source address.
#[derive(Default)]
struct Open {
    total: usize,
    by_source: std::collections::HashMap<std::net::IpAddr, usize>,
}

/// One admitted connection; its slot is given back when it ends.
struct Slot {
    open: Arc<std::sync::Mutex<Open>>,
    source: std::net::IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.open.lock().expect("open connections");
        o.total -= 1;
        if let Some(n) = o.by_source.get_mut(&self.source) {
            *n -= 1;
            if *n == 0 {
                o.by_source.remove(&self.source);
            }
        }
    }
}

fn admit(open: &Arc<std::sync::Mutex<Open>>, source: std::net::IpAddr, limits: &Limits) -> Option<Slot> {
    let mut o = open.lock().expect("open connections");
    let from_source = o.by_source.get(&source).copied().unwrap_or(0);
    if o.total >= limits.max_connections || from_source >= limits.per_source {
        return None;
    }
    o.total += 1;
    o.by_source.insert(source, from_source + 1);
    Some(Slot { open: open.clone(), source })
}

/// The TLS configuration connections are accepted with, built again when what the controller
/// presents or accepts changes (a renewed server certificate, a CA rotation; ADR 0029).
struct Tls {
    generation: u64,
    acceptor: TlsAcceptor,
}

fn tls_for(controller: &Controller) -> Result<Tls> {
    let generation = controller.tls_generation();
    let m = controller.tls_material().context("this controller has no server certificate")?;
    let cfg = trellis_pki::tls::server_config(&m.server_pem, &m.server_key_pem, &m.chain_pem, &m.client_roots_pem)?;
    Ok(Tls { generation, acceptor: TlsAcceptor::from(Arc::new(cfg)) })
}

/// The acceptor for the next connection: the one held, or a new one if the controller's
/// certificates moved (a configuration that cannot be built keeps the one held, and says why).
fn current_acceptor(controller: &Controller, tls: &mut Tls) -> TlsAcceptor {
    if controller.tls_generation() != tls.generation {
        match tls_for(controller) {
            Ok(t) => {
                tracing::info!("serving with the controller's new certificates");
                *tls = t;
            }
            Err(e) => {
                tracing::error!("the controller's new certificates cannot be served, the previous ones are: {e:#}");
                tls.generation = controller.tls_generation();
            }
        }
    }
    tls.acceptor.clone()
}

pub struct Server {
    pub listener: TcpListener,
    pub controller: Arc<Controller>,
    tls: Tls,
    limits: Limits,
    open: Arc<std::sync::Mutex<Open>>,
    /// Plain HTTP for Prometheus (`GET /metrics`), when asked for.
    metrics: Option<TcpListener>,
}

/// How many connections the kernel holds for the controller before it accepts them (capped by
/// `net.core.somaxconn`, 4096 on current kernels). A fleet's agents reconnect together after a
/// controller restart: with tokio's default of 1,024, a burst of thousands overflowed the queue
/// while the runtime was busy with TLS handshakes, and each connection dropped from it cost its
/// agent a SYN retry of a second or more.
pub const LISTEN_BACKLOG: u32 = 4096;

/// A listening socket on `addr` with the address reusable at once after a restart (as
/// `TcpListener::bind` does) and a queue of `LISTEN_BACKLOG`.
fn listen_on(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(LISTEN_BACKLOG)
}

impl Server {
    /// Opens the store (running migrations), loads keys and binds the listener.
    pub async fn bind(state: &StateDir, database_url: Option<&str>, listen: Option<&str>) -> Result<Server> {
        Self::bind_restored(state, database_url, listen, false).await
    }

    /// As [`Server::bind`]; with `restored`, a database behind the controller's checkpoint is
    /// taken as restored from a backup and recovered from, not refused (`Controller::open`).
    pub async fn bind_restored(state: &StateDir, database_url: Option<&str>, listen: Option<&str>, restored: bool) -> Result<Server> {
        let controller = Controller::open(state, database_url, restored).await?;
        let tls = tls_for(&controller)?;
        let addr: SocketAddr = listen.unwrap_or(&state.config.listen).parse().context("the listen address is not IP:PORT")?;
        let listener = listen_on(addr).with_context(|| format!("cannot listen on {addr}"))?;
        Ok(Server { listener, controller: Arc::new(controller), tls, limits: Limits::default(), open: Default::default(), metrics: None })
    }

    /// The same server with other limits.
    pub fn with_limits(mut self, limits: Limits) -> Server {
        self.limits = limits;
        self
    }

    /// Also serves the metrics, in plain HTTP, on this address.
    pub async fn with_metrics(mut self, listen: &str) -> Result<Server> {
        let addr: SocketAddr = listen.parse().context("the metrics listen address is not IP:PORT")?;
        self.metrics = Some(TcpListener::bind(addr).await.with_context(|| format!("cannot listen on {addr} for metrics"))?);
        Ok(self)
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("bound")
    }

    /// Serves until `shutdown` resolves; then stops accepting, answers long-polls at once, lets
    /// every request in flight finish (for at most [`DRAIN`]) and returns.
    pub async fn run(mut self, shutdown: impl std::future::Future<Output = ()>) -> Result<()> {
        let router = app(self.controller.clone());
        // Publish what the database holds, then follow decisions made by other replicas.
        if let Err(e) = self.controller.publish().await {
            tracing::error!("first publish failed: {e}");
        }
        // The controller's periodic duties: following other replicas, renewals, sweeps.
        let housekeeping = tokio::spawn(self.controller.clone().housekeeping());
        // Decisions ask for publish runs; this task makes them, one at a time.
        let publishing = tokio::spawn(self.controller.clone().publishing());
        let metrics = self.metrics.take().map(|l| tokio::spawn(crate::metrics::serve(l, self.controller.clone())));
        let Server { listener, controller, tls, limits, open, .. } = self;
        let result = accept_loop(listener, &controller, tls, limits, &open, router, shutdown).await;
        // The listener is closed: no new connection. Long-polls answer now; requests in flight
        // (a decision among them) finish and are answered.
        controller.stop();
        let in_flight = open.lock().expect("open connections").total;
        let deadline = tokio::time::Instant::now() + DRAIN;
        let left = loop {
            let left = open.lock().expect("open connections").total;
            if left == 0 || tokio::time::Instant::now() >= deadline {
                break left;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if in_flight > 0 {
            tracing::info!(
                "{} of {in_flight} open connections finished{}",
                in_flight - left,
                if left > 0 { format!("; {left} cut after {} s", DRAIN.as_secs()) } else { String::new() }
            );
        }
        housekeeping.abort();
        publishing.abort();
        if let Some(m) = metrics {
            m.abort();
        }
        controller.flush().await;
        result
    }
}

/// How long a stopping controller waits for the requests in flight.
pub const DRAIN: Duration = Duration::from_secs(20);

async fn accept_loop(
    listener: TcpListener,
    controller: &Arc<Controller>,
    mut tls: Tls,
    limits: Limits,
    open: &Arc<std::sync::Mutex<Open>>,
    router: axum::Router,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<()> {
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            _ = &mut shutdown => return Ok(()),
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let Some(slot) = admit(open, peer.ip(), &limits) else {
            // Over a bound: closed at once, before any TLS work is spent on it.
            drop(tcp);
            continue;
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = current_acceptor(controller, &mut tls);
        let router = router.clone();
        let stopped = controller.stopped();
        tokio::spawn(async move {
            let _slot = slot;
            let tls = match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(tcp)).await {
                Ok(Ok(t)) => t,
                _ => return,
            };
            let cert = PeerCert(tls.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| Arc::new(c.to_vec())));
            let source = Peer(Some(peer.ip()));
            let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
                req.extensions_mut().insert(cert.clone());
                req.extensions_mut().insert(source);
                req.extensions_mut().insert(limits);
                router.clone().oneshot(req.map(axum::body::Body::new))
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(30))
                .serve_connection(TokioIo::new(tls), svc);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                // Stopping: the request in flight, if any, is answered; then the connection closes.
                _ = stopped => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
        });
    }
}
