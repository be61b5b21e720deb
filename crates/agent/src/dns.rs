//! The mesh zone served on the node's overlay addresses by an embedded hickory-dns server,
//! reloaded when the zone changes.

use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub trait Resolver: Send {
    /// Serves the zone file on these addresses, replacing what was served before.
    fn apply<'a>(&'a mut self, zone: &'a Path, origin: &'a str, listen: &'a [SocketAddr]) -> BoxFuture<'a, Result<()>>;
    fn serving(&self) -> Vec<SocketAddr>;
}

#[derive(Default)]
pub struct Hickory {
    server: Option<hickory_server::Server<hickory_server::zone_handler::Catalog>>,
    listening: Vec<SocketAddr>,
}

impl Resolver for Hickory {
    fn apply<'a>(&'a mut self, zone: &'a Path, origin: &'a str, listen: &'a [SocketAddr]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            use hickory_server::proto::rr::{LowerName, Name};
            use hickory_server::store::file::{FileConfig, FileZoneHandler};
            use hickory_server::zone_handler::{AxfrPolicy, Catalog, ZoneType};
            let name = Name::from_str(&format!("{}.", origin.trim_end_matches('.'))).with_context(|| format!("zone origin {origin:?}"))?;
            // Load first: a zone that does not load leaves the running server as it is.
            let handler = FileZoneHandler::try_from_config(
                name.clone(),
                ZoneType::Primary,
                AxfrPolicy::Deny,
                None,
                &FileConfig { zone_path: zone.to_path_buf() },
            )
            .map_err(|e| anyhow::anyhow!("the mesh zone does not load: {e}"))?;
            let mut catalog = Catalog::new();
            catalog.upsert(LowerName::from(&name), vec![Arc::new(handler)]);
            if let Some(mut old) = self.server.take() {
                let _ = old.shutdown_gracefully().await;
            }
            let mut server = hickory_server::Server::new(catalog);
            for addr in listen {
                let udp = bind_udp(*addr).await.with_context(|| format!("cannot serve DNS on {addr} (udp)"))?;
                server.register_socket(udp);
                let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot serve DNS on {addr} (tcp)"))?;
                server.register_listener(tcp, Duration::from_secs(5), 64 * 1024);
            }
            self.server = Some(server);
            self.listening = listen.to_vec();
            Ok(())
        })
    }

    fn serving(&self) -> Vec<SocketAddr> {
        self.listening.clone()
    }
}

/// Binds a UDP socket, retrying briefly while a just-stopped server releases the address.
async fn bind_udp(addr: SocketAddr) -> std::io::Result<tokio::net::UdpSocket> {
    let mut tries = 0;
    loop {
        match tokio::net::UdpSocket::bind(addr).await {
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse && tries < 20 => {
                tries += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            other => return other,
        }
    }
}
