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

/// The catalog the server answers from, replaced whole when the zone changes: a new zone is
/// served from the next query on, without stopping the server or binding its sockets again.
#[derive(Default)]
struct Zones(std::sync::RwLock<Arc<hickory_server::zone_handler::Catalog>>);

/// What the server is given to answer with: the current catalog, whichever it is.
#[derive(Clone, Default)]
struct Answering(Arc<Zones>);

#[async_trait::async_trait]
impl hickory_server::server::RequestHandler for Answering {
    async fn handle_request<R: hickory_server::server::ResponseHandler, T: hickory_server::net::runtime::Time>(
        &self,
        request: &hickory_server::server::Request,
        response_handle: R,
    ) -> hickory_server::server::ResponseInfo {
        let catalog = self.0 .0.read().expect("zones").clone();
        catalog.handle_request::<R, T>(request, response_handle).await
    }
}

#[derive(Default)]
pub struct Hickory {
    server: Option<hickory_server::Server<Answering>>,
    zones: Answering,
    listening: Vec<SocketAddr>,
    /// How many times a server was started (bound its sockets).
    starts: u32,
}

impl Resolver for Hickory {
    fn apply<'a>(&'a mut self, zone: &'a Path, origin: &'a str, listen: &'a [SocketAddr]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            use hickory_server::proto::rr::{LowerName, Name};
            use hickory_server::zone_handler::Catalog;
            let name = Name::from_str(&format!("{}.", origin.trim_end_matches('.'))).with_context(|| format!("zone origin {origin:?}"))?;
            // Load first: a zone that does not load leaves the running server as it is.
            let started = std::time::Instant::now();
            let text = std::fs::read_to_string(zone).with_context(|| format!("cannot read {}", zone.display()))?;
            let handler = load(&text, &name).map_err(|e| anyhow::anyhow!("the mesh zone does not load: {e}"))?;
            let loaded = started.elapsed();
            let mut catalog = Catalog::new();
            catalog.upsert(LowerName::from(&name), vec![Arc::new(handler)]);
            let old = std::mem::replace(&mut *self.zones.0 .0.write().expect("zones"), Arc::new(catalog));
            // The catalog replaced is dropped here, not under the lock.
            drop(old);
            if self.server.is_some() && self.listening == listen {
                tracing::info!(load_ms = loaded.as_millis() as u64, "mesh zone served (the same sockets)");
                return Ok(());
            }
            if let Some(mut old) = self.server.take() {
                let _ = old.shutdown_gracefully().await;
            }
            let stopped = started.elapsed() - loaded;
            let mut server = hickory_server::Server::new(self.zones.clone());
            for addr in listen {
                let udp = bind_udp(*addr).await.with_context(|| format!("cannot serve DNS on {addr} (udp)"))?;
                server.register_socket(udp);
                let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot serve DNS on {addr} (tcp)"))?;
                server.register_listener(tcp, Duration::from_secs(5), 64 * 1024);
            }
            self.server = Some(server);
            self.listening = listen.to_vec();
            self.starts += 1;
            tracing::info!(
                load_ms = loaded.as_millis() as u64,
                stop_ms = stopped.as_millis() as u64,
                bind_ms = (started.elapsed() - loaded - stopped).as_millis() as u64,
                "mesh zone served"
            );
            Ok(())
        })
    }

    fn serving(&self) -> Vec<SocketAddr> {
        self.listening.clone()
    }
}

/// The zone as hickory serves it, built from the core's reading of the file (the one trellis
/// wrote): its SOA, NS and address records, each name's records set at once. hickory's own file
/// loader adds records one by one, each compared with those of its name before it, which takes
/// seconds for a module that runs on ten thousand nodes (`trellis-dev bench agent`); records
/// are grouped by the name as written (a string), and each set is made once, straight into the
/// handler's map (20,000 records in a release build on a loaded machine: medians 115 -> 83 ms, best 84 -> 33 ms).
fn load(text: &str, origin: &hickory_server::proto::rr::Name) -> Result<hickory_server::store::in_memory::InMemoryZoneHandler> {
    use hickory_server::proto::rr::rdata::{A, AAAA, NS, SOA};
    use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordSet, RecordType, RrKey};
    use hickory_server::store::in_memory::InMemoryZoneHandler;
    use hickory_server::zone_handler::{AxfrPolicy, ZoneType};

    let parsed = trellis_core::zone::parse(text).map_err(|e| anyhow::anyhow!("{e}"))?;
    let wanted = format!("{}.", parsed.origin);
    if !origin.to_ascii().eq_ignore_ascii_case(&wanted) {
        anyhow::bail!("the zone's origin is {wanted}, not {origin}");
    }
    let ttl = parsed.ttl.unwrap_or(60);
    let serial = parsed.serial.context("the zone has no SOA record")?;
    let nameserver = Name::from_str(parsed.nameserver.as_deref().context("the zone has no NS record")?)?;
    let name_of = |relative: &str| -> Result<Name> {
        if relative == "@" {
            return Ok(origin.clone());
        }
        Ok(Name::from_str(relative)?.append_domain(origin)?)
    };
    // Each name's addresses, grouped by the name as written (a string: cheap to hash, where a
    // hickory `Name` compares label by label) and without repeats (a name's same address twice
    // is one record, as hickory's loader makes it).
    let mut by_name: std::collections::HashMap<&str, Vec<std::net::IpAddr>> = std::collections::HashMap::new();
    for r in &parsed.records {
        by_name.entry(r.name.as_str()).or_default().push(r.address);
    }
    // Then by the name itself, the name server's addresses with them.
    let mut addresses: std::collections::HashMap<Name, Vec<std::net::IpAddr>> = std::collections::HashMap::with_capacity(by_name.len() + 1);
    addresses.entry(nameserver.clone()).or_default().extend(&parsed.nameserver_addresses);
    for (relative, list) in by_name {
        addresses.entry(name_of(relative)?).or_default().extend(list);
    }
    // Each set made once and put in its place: no map of our own in between.
    let mut handler = InMemoryZoneHandler::empty(origin.clone(), ZoneType::Primary, AxfrPolicy::Deny);
    let records = handler.records_get_mut();
    let mut put = |name: &Name, kind: RecordType, list: Vec<Record>| {
        let mut set = RecordSet::new(name.clone(), kind, serial);
        set.set_ttl(ttl);
        set.set_records(list);
        records.insert(RrKey::new(LowerName::from(name), kind), Arc::new(set));
    };
    let hostmaster = Name::from_str("hostmaster")?.append_domain(origin)?;
    let soa = RData::SOA(SOA::new(nameserver.clone(), hostmaster, serial, 3600, 600, 86400, 60));
    put(origin, RecordType::SOA, vec![Record::from_rdata(origin.clone(), ttl, soa)]);
    put(origin, RecordType::NS, vec![Record::from_rdata(origin.clone(), ttl, RData::NS(NS(nameserver.clone())))]);
    for (name, mut list) in addresses {
        // A name's same address twice is one record.
        list.sort_unstable();
        list.dedup();
        for (kind, v6) in [(RecordType::A, false), (RecordType::AAAA, true)] {
            let set: Vec<Record> =
                list.iter().filter(|a| a.is_ipv6() == v6).map(|a| Record::from_rdata(name.clone(), ttl, address_data(*a))).collect();
            if !set.is_empty() {
                put(&name, kind, set);
            }
        }
    }
    fn address_data(ip: std::net::IpAddr) -> RData {
        match ip {
            std::net::IpAddr::V4(v4) => RData::A(A(v4)),
            std::net::IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
        }
    }
    Ok(handler)
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

#[cfg(test)]
mod tests {
    use std::str::FromStr;

    use hickory_server::proto::rr::{LowerName, Name, RData, RecordType, RrKey};

    /// The zone trellis writes, read into hickory's records as its file loader would make them:
    /// the SOA with its serial, the NS and the name server's address, every name's addresses in
    /// one set (a module on 10,000 nodes: one set of 10,000), names relative to the origin.
    #[test]
    fn the_zone_loads_into_one_record_set_per_name_and_type() {
        let mut zone = String::from(
            "$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. 7 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n",
        );
        for i in 0..10_000u32 {
            zone.push_str(&format!("n-{i}\tIN\tA\t10.1.{}.{}\nssh\tIN\tA\t10.1.{}.{}\n", i / 250, i % 250, i / 250, i % 250));
        }
        // Written twice: one record.
        zone.push_str("ssh\tIN\tA\t10.1.0.0\n");
        zone.push_str("n-0\tIN\tAAAA\tfd00::1\n");
        let origin = Name::from_str("t.mesh.").unwrap();
        let mut handler = super::load(&zone, &origin).unwrap();
        let records = handler.records_get_mut();
        let set = |name: &str, kind: RecordType| records.get(&RrKey::new(LowerName::from(&Name::from_str(name).unwrap()), kind)).cloned();
        let soa = set("t.mesh.", RecordType::SOA).unwrap();
        assert!(matches!(&soa.records_without_rrsigs().next().unwrap().data, RData::SOA(s) if s.serial == 7));
        assert_eq!(set("t.mesh.", RecordType::NS).unwrap().records_count(), 1);
        assert_eq!(set("ns.t.mesh.", RecordType::A).unwrap().records_count(), 1);
        assert_eq!(set("ssh.t.mesh.", RecordType::A).unwrap().records_count(), 10_000);
        assert_eq!(set("n-9999.t.mesh.", RecordType::A).unwrap().ttl(), 60);
        assert_eq!(set("n-0.t.mesh.", RecordType::AAAA).unwrap().records_count(), 1);
        assert!(set("nosuch.t.mesh.", RecordType::A).is_none());
        // Another origin than the one served is refused.
        let other = Name::from_str("u.mesh.").unwrap();
        let refused = super::load(&zone, &other).err().expect("another origin is refused").to_string();
        assert!(refused.contains("origin is t.mesh."), "{refused}");
    }

    /// One A query for `name` over UDP to `server`: the addresses answered.
    async fn ask(server: std::net::SocketAddr, name: &str) -> Vec<String> {
        use hickory_server::proto::op::{Message, Query};
        use hickory_server::proto::serialize::binary::{BinDecodable, BinEncodable};
        let mut m = Message::query();
        m.add_query(Query::query(Name::from_str(name).unwrap(), RecordType::A));
        m.metadata.recursion_desired = false;
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        socket.send_to(&m.to_bytes().unwrap(), server).await.unwrap();
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), socket.recv(&mut buf)).await.unwrap().unwrap();
        let answer = Message::from_bytes(&buf[..n]).unwrap();
        answer.answers.iter().map(|r| r.data.to_string()).collect()
    }

    /// A new zone on the same addresses is answered from the next query on, by the same server:
    /// its sockets are not bound again (an apply that changes one name among ten thousand spent
    /// most of its DNS time stopping and starting the server).
    #[tokio::test]
    async fn a_new_zone_is_answered_at_once_by_the_same_server() {
        use super::Resolver;
        let dir = trellis_testing::TempDir::new("dns-swap");
        let port = std::net::UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let listen = [std::net::SocketAddr::from(([127, 0, 0, 1], port))];
        let zone = |serial: u32, extra: &str| {
            format!("$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\ndb-1\tIN\tA\t10.1.0.1\n{extra}")
        };
        let file = dir.join("mesh.zone");
        std::fs::write(&file, zone(1, "")).unwrap();
        let mut dns = super::Hickory::default();
        dns.apply(&file, "t.mesh", &listen).await.unwrap();
        assert_eq!(ask(listen[0], "db-1.t.mesh.").await, ["10.1.0.1"]);
        assert!(ask(listen[0], "db-2.t.mesh.").await.is_empty());
        assert_eq!(dns.starts, 1);
        std::fs::write(&file, zone(2, "db-2\tIN\tA\t10.1.0.2\n")).unwrap();
        dns.apply(&file, "t.mesh", &listen).await.unwrap();
        assert_eq!(ask(listen[0], "db-2.t.mesh.").await, ["10.1.0.2"]);
        assert_eq!(dns.starts, 1, "the same server answers, its sockets bound once");
        // A zone that does not load leaves the one served.
        std::fs::write(&file, "not a zone").unwrap();
        assert!(dns.apply(&file, "t.mesh", &listen).await.is_err());
        assert_eq!(ask(listen[0], "db-2.t.mesh.").await, ["10.1.0.2"]);
    }
}
