//! The mesh zone served on the node's overlay addresses by an embedded hickory-dns server,
//! reloaded when the zone changes.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};

use crate::plan::TextFile;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

pub trait Resolver: Send {
    /// Serves the zone on these addresses, replacing what was served before: its files one after
    /// the other (`mesh.zone` and its parts, ADR 0043) are the zone. Only the files that differ
    /// from those served are read, by the regions of their edits when they came as edits of the
    /// file served (ADR 0035), and their address records changed one by one (ADR 0037).
    fn apply<'a>(&'a mut self, zone: &'a [TextFile], origin: &'a str, listen: &'a [SocketAddr]) -> BoxFuture<'a, Result<()>>;
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

/// The thread the server answers on, its own: the agent's runtime has one thread, which an
/// apply, or the status of 50,000 peers read from the interface, holds for a second or more
/// (a name went unanswered for 2 s at 50,000 peers while it shared that thread).
struct Thread(Option<tokio::runtime::Runtime>);

impl Thread {
    fn new() -> Result<Thread> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("trellis-dns")
            .enable_all()
            .build()
            .context("cannot start the resolver's thread")?;
        Ok(Thread(Some(rt)))
    }

    /// Runs `f` on the resolver's thread (its sockets, and the tasks the server spawns, are
    /// that thread's) and waits for it.
    async fn run<T: Send + 'static>(&self, f: impl std::future::Future<Output = T> + Send + 'static) -> Result<T> {
        self.0.as_ref().expect("a running thread").spawn(f).await.context("the resolver's thread stopped")
    }
}

impl Drop for Thread {
    fn drop(&mut self) {
        // Dropped from inside the agent's runtime, where waiting for it is not allowed.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

#[derive(Default)]
pub struct Hickory {
    server: Option<hickory_server::Server<Answering>>,
    /// The thread the server answers on, from its first start.
    thread: Option<Thread>,
    zones: Answering,
    listening: Vec<SocketAddr>,
    /// The zone served, which the next one is compared with.
    served: Option<Served>,
    /// How many times a server was started (bound its sockets).
    starts: u32,
    /// How many zones were built whole (the rest changed the served one in place).
    builds: u32,
    /// How many changes were read by their regions (ADR 0035).
    by_regions: u32,
}

/// The zone being answered: its handler, which a new zone that differs in some names' addresses
/// only changes in place, and the files it was made from (path, SHA-256, content).
struct Served {
    handler: Arc<hickory_server::store::in_memory::InMemoryZoneHandler>,
    origin: hickory_server::proto::rr::Name,
    files: Vec<(String, [u8; 32], bytes::Bytes)>,
    ttl: u32,
    nameserver: String,
    /// Whether every address record of the text reads as the whole read reads it, its name
    /// spelled as trellis spells names (`counts_of`). Only then is a change read by its regions.
    counted: bool,
    /// How many times the text lists each address of each name, when counted: what a change read
    /// from the lines of its regions is counted against (ADR 0037). A name may be in several
    /// runs (a module's, in a zone in parts: ADR 0043).
    counts: Counts,
}

/// How many times a zone lists each address of each name (relative, as written): a name's
/// records change one by one when a change of lines takes an address to none or from none,
/// however many addresses the name has (a module's name has one per node that runs it).
type Counts = std::collections::HashMap<(Box<str>, std::net::IpAddr), u32>;

/// The counts of a zone's text; `None` when an address record does not read as the whole read
/// reads it, or its name is not spelled as trellis spells names.
fn counts_of(text: &str) -> Option<Counts> {
    let lines = Lines::of(text)?;
    let mut counts = Counts::with_capacity(lines.records.len());
    for (name, a) in lines.records {
        *counts.entry((name.into(), a)).or_default() += 1;
    }
    Some(counts)
}

/// A zone file as the agent reads it whole: its header, and each name's addresses (relative, as
/// written; sorted, without repeats).
struct Read {
    ttl: u32,
    serial: u32,
    nameserver: String,
    nameserver_addresses: Vec<std::net::IpAddr>,
    names: std::collections::HashMap<String, Vec<std::net::IpAddr>>,
}

impl Read {
    /// The zone `text`, the files of `zone` one after the other, read; an error names the file
    /// and its line.
    fn of(text: &str, zone: &[TextFile], origin: &hickory_server::proto::rr::Name) -> Result<Read> {
        let parsed = trellis_core::zone::parse(text).map_err(|e| anyhow::anyhow!("{}", located(zone, &e)))?;
        let wanted = format!("{}.", parsed.origin);
        if !origin.to_ascii().eq_ignore_ascii_case(&wanted) {
            anyhow::bail!("the zone's origin is {wanted}, not {origin}");
        }
        // Grouped by the name as written (a string: cheap to hash, where a hickory `Name`
        // compares label by label).
        let mut names: std::collections::HashMap<String, Vec<std::net::IpAddr>> = std::collections::HashMap::new();
        for r in parsed.records {
            names.entry(r.name).or_default().push(r.address);
        }
        Ok(Read {
            ttl: parsed.ttl.unwrap_or(60),
            serial: parsed.serial.context("the zone has no SOA record")?,
            nameserver: parsed.nameserver.context("the zone has no NS record")?,
            nameserver_addresses: parsed.nameserver_addresses,
            names,
        })
    }
}

/// A line of the zone's text (the files of `zone` one after the other) that does not read, named
/// by its file and its line there.
fn located(zone: &[TextFile], e: &trellis_core::zone::ZoneError) -> String {
    match crate::plan::place_of(zone.iter().map(|f| (f.path.as_str(), &f.content[..])), e.line) {
        Some((path, line)) => format!("{path} line {line}: {}", e.problem),
        None => e.to_string(),
    }
}

/// A zone's text as its frame (every line that is not an address record, the SOA's serial left
/// out) and each name's run of address records (the lines trellis writes for one name are
/// together). `None` for a text trellis did not write so: a name in two runs, or in upper case.
struct Cut<'t> {
    frame: Vec<&'t str>,
    serial: Option<&'t str>,
    runs: std::collections::HashMap<&'t str, &'t str>,
}

impl<'t> Cut<'t> {
    fn of(text: &'t str) -> Option<Cut<'t>> {
        let mut frame = Vec::new();
        let mut serial = None;
        let mut runs: std::collections::HashMap<&str, &str> = std::collections::HashMap::new();
        // The run being read: its name and where it starts.
        let mut run: Option<(&str, usize)> = None;
        let mut at = 0;
        let close = |run: &mut Option<(&'t str, usize)>, end: usize, runs: &mut std::collections::HashMap<&'t str, &'t str>| {
            if let Some((name, start)) = run.take() {
                runs.insert(name, &text[start..end]).is_none()
            } else {
                true
            }
        };
        for line in text.split_inclusive('\n') {
            let start = at;
            at += line.len();
            // A comment is no record and no SOA (the whole read skips it), whatever it says.
            let commented = line.split(';').next().unwrap_or("").trim().is_empty();
            let mut fields = line.split_whitespace().filter(|_| !commented);
            let (name, class, kind) = (fields.next(), fields.next(), fields.next());
            if let (Some(name), Some("IN"), Some("A" | "AAAA")) = (name, class, kind) {
                // Only names as trellis spells them (relative, lower-case ASCII labels): a name
                // has one spelling, so its runs are its records (`db-1.`, `db\-1`, `DB-1` or an
                // IDNA name would be one name to hickory under two strings here).
                if !spelled(name) {
                    return None;
                }
                if run.is_some_and(|(n, _)| n == name) {
                    continue;
                }
                if !close(&mut run, start, &mut runs) {
                    return None;
                }
                run = Some((name, start));
                continue;
            }
            if !close(&mut run, start, &mut runs) {
                return None;
            }
            if let (Some(_), Some("IN"), Some("SOA")) = (name, class, kind) {
                let (before, field, after) = soa_serial(line)?;
                serial = Some(field);
                frame.extend([before, after]);
                continue;
            }
            frame.push(line);
        }
        if !close(&mut run, at, &mut runs) {
            return None;
        }
        Some(Cut { frame, serial, runs })
    }
}

impl Resolver for Hickory {
    fn apply<'a>(&'a mut self, zone: &'a [TextFile], origin: &'a str, listen: &'a [SocketAddr]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            use hickory_server::proto::rr::{LowerName, Name};
            use hickory_server::zone_handler::Catalog;
            let name = Name::from_str(&format!("{}.", origin.trim_end_matches('.'))).with_context(|| format!("zone origin {origin:?}"))?;
            let started = std::time::Instant::now();
            let running = self.server.is_some() && self.listening == listen;
            let held = || zone.iter().map(|f| (f.path.clone(), f.sha256, f.content.clone())).collect::<Vec<_>>();
            // By the regions of the files that differ from those served: the address records of
            // their lines, changed in place (ADR 0035, 0037, 0043).
            if let Some(served) = self.served.as_mut().filter(|s| running && s.origin == name && s.counted) {
                let by_regions =
                    file_changes(&served.files, zone).and_then(|(serial, lines)| Some((serial, tally(&served.counts, &lines)?)));
                if let Some((serial, tally)) = by_regions {
                    if let Some(changed) = patch_records(served, serial, &tally).await? {
                        for (key, n) in tally.counts {
                            match n {
                                0 => served.counts.remove(&key),
                                n => served.counts.insert(key, n),
                            };
                        }
                        served.files = held();
                        self.by_regions += 1;
                        tracing::info!(
                            records = changed,
                            ms = started.elapsed().as_millis() as u64,
                            "mesh zone changed in place, by its regions"
                        );
                        return Ok(());
                    }
                }
            }
            // Read first: a zone that does not load leaves the running server as it is.
            let mut text = String::with_capacity(zone.iter().map(|f| f.content.len()).sum());
            for f in zone {
                text.push_str(
                    std::str::from_utf8(&f.content).map_err(|_| anyhow::anyhow!("the mesh zone does not load: {} is not UTF-8", f.path))?,
                );
            }
            if let Some(served) = self.served.as_mut().filter(|s| running && s.origin == name) {
                let before: String = served.files.iter().map(|f| String::from_utf8_lossy(&f.2)).collect();
                if let Some((serial, names, counts)) = changes(&before, &text) {
                    let read_ms = started.elapsed().as_millis() as u64;
                    if let Some(changed) = patch(served, serial, &names).await? {
                        served.files = held();
                        served.counted = true;
                        served.counts = counts;
                        tracing::info!(names = changed, read_ms, ms = started.elapsed().as_millis() as u64, "mesh zone changed in place");
                        return Ok(());
                    }
                }
            }
            let read = Read::of(&text, zone, &name).map_err(|e| anyhow::anyhow!("the mesh zone does not load: {e}"))?;
            let handler = Arc::new(build(&read, &name).map_err(|e| anyhow::anyhow!("the mesh zone does not load: {e}"))?);
            self.builds += 1;
            let loaded = started.elapsed();
            let mut catalog = Catalog::new();
            catalog.upsert(LowerName::from(&name), vec![handler.clone()]);
            let old = std::mem::replace(&mut *self.zones.0 .0.write().expect("zones"), Arc::new(catalog));
            // The catalog replaced is dropped here, not under the lock.
            drop(old);
            let counts = counts_of(&text);
            let counted = counts.is_some();
            let counts = counts.unwrap_or_default();
            self.served =
                Some(Served { handler, origin: name, ttl: read.ttl, nameserver: read.nameserver, files: held(), counted, counts });
            if running {
                tracing::info!(load_ms = loaded.as_millis() as u64, "mesh zone served (the same sockets)");
                return Ok(());
            }
            if self.thread.is_none() {
                self.thread = Some(Thread::new()?);
            }
            let thread = self.thread.as_ref().expect("started above");
            if let Some(mut old) = self.server.take() {
                let _ = thread.run(async move { old.shutdown_gracefully().await }).await;
            }
            let stopped = started.elapsed() - loaded;
            let (zones, addrs) = (self.zones.clone(), listen.to_vec());
            let server = thread
                .run(async move {
                    let mut server = hickory_server::Server::new(zones);
                    for addr in addrs {
                        let udp = bind_udp(addr).await.with_context(|| format!("cannot serve DNS on {addr} (udp)"))?;
                        server.register_socket(udp);
                        let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("cannot serve DNS on {addr} (tcp)"))?;
                        server.register_listener(tcp, Duration::from_secs(5), 64 * 1024);
                    }
                    Ok::<_, anyhow::Error>(server)
                })
                .await??;
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

/// The record sets of one name: its A and AAAA sets (one absent when it has no such address).
fn name_sets(
    name: &hickory_server::proto::rr::Name,
    list: &[std::net::IpAddr],
    ttl: u32,
    serial: u32,
) -> [(hickory_server::proto::rr::RecordType, Option<hickory_server::proto::rr::RecordSet>); 2] {
    use hickory_server::proto::rr::rdata::{A, AAAA};
    use hickory_server::proto::rr::{RData, Record, RecordSet, RecordType};
    [(RecordType::A, false), (RecordType::AAAA, true)].map(|(kind, v6)| {
        let records: Vec<Record> = list
            .iter()
            .filter(|a| a.is_ipv6() == v6)
            .map(|a| {
                let data = match *a {
                    std::net::IpAddr::V4(v4) => RData::A(A(v4)),
                    std::net::IpAddr::V6(v6) => RData::AAAA(AAAA(v6)),
                };
                Record::from_rdata(name.clone(), ttl, data)
            })
            .collect();
        (
            kind,
            (!records.is_empty()).then(|| {
                let mut set = RecordSet::new(name.clone(), kind, serial);
                set.set_ttl(ttl);
                set.set_records(records);
                set
            }),
        )
    })
}

/// The SOA of a zone of `origin` with this serial.
fn soa_set(
    origin: &hickory_server::proto::rr::Name,
    nameserver: &hickory_server::proto::rr::Name,
    ttl: u32,
    serial: u32,
) -> Result<hickory_server::proto::rr::RecordSet> {
    use hickory_server::proto::rr::rdata::SOA;
    use hickory_server::proto::rr::{Name, RData, Record, RecordSet, RecordType};
    let hostmaster = Name::from_str("hostmaster")?.append_domain(origin)?;
    let soa = RData::SOA(SOA::new(nameserver.clone(), hostmaster, serial, 3600, 600, 86400, 60));
    let mut set = RecordSet::new(origin.clone(), RecordType::SOA, serial);
    set.set_ttl(ttl);
    set.set_records(vec![Record::from_rdata(origin.clone(), ttl, soa)]);
    Ok(set)
}

/// A name relative to `origin` as written in the zone (`@` is the origin itself).
fn absolute(relative: &str, origin: &hickory_server::proto::rr::Name) -> Result<hickory_server::proto::rr::Name> {
    use hickory_server::proto::rr::Name;
    if relative == "@" {
        return Ok(origin.clone());
    }
    Ok(Name::from_str(relative)?.append_domain(origin)?)
}

/// The zone as hickory serves it, built from the core's reading of the file (the one trellis
/// wrote): its SOA, NS and address records, each name's records set at once. hickory's own file
/// loader adds records one by one, each compared with those of its name before it, which takes
/// seconds for a module that runs on ten thousand nodes (`trellis-dev bench agent`); records
/// are grouped by the name as written (a string), and each set is made once, straight into the
/// handler's map (20,000 records in a release build on a loaded machine: medians 115 -> 83 ms, best 84 -> 33 ms).
fn build(read: &Read, origin: &hickory_server::proto::rr::Name) -> Result<hickory_server::store::in_memory::InMemoryZoneHandler> {
    use hickory_server::proto::rr::rdata::NS;
    use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordSet, RecordType, RrKey};
    use hickory_server::store::in_memory::InMemoryZoneHandler;
    use hickory_server::zone_handler::{AxfrPolicy, ZoneType};

    let (ttl, serial) = (read.ttl, read.serial);
    let nameserver = Name::from_str(&read.nameserver)?;
    // By the name itself, the name server's addresses with them.
    let mut addresses: std::collections::HashMap<Name, Vec<std::net::IpAddr>> =
        std::collections::HashMap::with_capacity(read.names.len() + 1);
    addresses.entry(nameserver.clone()).or_default().extend(&read.nameserver_addresses);
    for (relative, list) in &read.names {
        addresses.entry(absolute(relative, origin)?).or_default().extend(list);
    }
    // Each set made once and put in its place: no map of our own in between.
    let mut handler = InMemoryZoneHandler::empty(origin.clone(), ZoneType::Primary, AxfrPolicy::Deny);
    let records = handler.records_get_mut();
    records.insert(RrKey::new(LowerName::from(origin), RecordType::SOA), Arc::new(soa_set(origin, &nameserver, ttl, serial)?));
    let mut ns = RecordSet::new(origin.clone(), RecordType::NS, serial);
    ns.set_ttl(ttl);
    ns.set_records(vec![Record::from_rdata(origin.clone(), ttl, RData::NS(NS(nameserver.clone())))]);
    records.insert(RrKey::new(LowerName::from(origin), RecordType::NS), Arc::new(ns));
    for (name, mut list) in addresses {
        // A name's same address twice is one record (the name server's own, named twice).
        list.sort_unstable();
        list.dedup();
        let key = LowerName::from(&name);
        for (kind, set) in name_sets(&name, &list, ttl, serial) {
            if let Some(set) = set {
                records.insert(RrKey::new(key.clone(), kind), Arc::new(set));
            }
        }
    }
    Ok(handler)
}

/// A name (relative, as written) and its addresses in the new zone (none: it is gone).
type NameChange = (String, Vec<std::net::IpAddr>);

/// The names whose addresses differ from `old` to `new`, each with its new addresses (none for
/// a name gone), and the new serial, when nothing else differs. `None` when anything else does,
/// or when a line of a changed name is not an address record: the zone is then read whole,
/// which names what is wrong and where.
fn changes(old: &str, new: &str) -> Option<(u32, Vec<NameChange>, Counts)> {
    let (before, after) = (Cut::of(old)?, Cut::of(new)?);
    if before.frame != after.frame {
        return None;
    }
    let serial: u32 = after.serial?.parse().ok()?;
    let mut names = Vec::new();
    for (&name, &run) in &after.runs {
        if before.runs.get(name) == Some(&run) {
            continue;
        }
        names.push((name.to_string(), addresses(run)?));
    }
    for &name in before.runs.keys().filter(|n| !after.runs.contains_key(*n)) {
        names.push((name.to_string(), Vec::new()));
    }
    Some((serial, names, counts_of(new)?))
}

/// A change of the zone read from the lines of its regions (ADR 0035, 0037), instead of from both
/// texts whole: its new serial, and each address record line the regions take away (-1) or
/// bring (+1), as (name, address). A cost that follows the change, not the zone, nor the number
/// of addresses a name has. `None` when the regions differ in anything but address records and
/// the SOA's serial, or a record does not read as the whole read reads it, or a name is spelled
/// as trellis does not: the zone is read whole, which names what is wrong and where.
fn record_changes(old: &str, new: &str, hunks: &[trellis_core::delta::Hunk]) -> Option<(Option<u32>, Vec<RecordLine>)> {
    let regions = trellis_core::delta::widen(old.as_bytes(), new.as_bytes(), hunks, b"\n", |_, _| true)?;
    let mut serial = None;
    let mut lines = Vec::new();
    for r in regions.iter().filter(|r| old.as_bytes()[r.old.clone()] != new.as_bytes()[r.new.clone()]) {
        let (o, n) = (Lines::of(old.get(r.old.clone())?)?, Lines::of(new.get(r.new.clone())?)?);
        if o.frame != n.frame {
            return None;
        }
        serial = n.serial.or(serial);
        lines.extend(o.records.into_iter().map(|(name, a)| (name.into(), a, -1)));
        lines.extend(n.records.into_iter().map(|(name, a)| (name.into(), a, 1)));
    }
    let serial = match serial {
        Some(s) => Some(s.parse().ok()?),
        None => None,
    };
    Some((serial, lines))
}

/// The change from the zone's files served to `files` (ADR 0043), read from the regions of each
/// file that differs (`record_changes`): a file that came as edits of the one served by their
/// hunks, any other that differs, new or gone as a whole. A file served as it is (its SHA-256)
/// is not read at all, so that a change of one part costs that part. The new serial, and the
/// record lines; `None` when a file does not read so, or no region gives a serial: the zone is
/// read whole.
fn file_changes(served: &[(String, [u8; 32], bytes::Bytes)], files: &[TextFile]) -> Option<(u32, Vec<RecordLine>)> {
    use trellis_core::delta::Hunk;
    let (mut serial, mut lines) = (None, Vec::new());
    // The serial is `mesh.zone`'s: a part that gives one is read whole (and refused there).
    let mut read = |path: &str, old: &[u8], new: &[u8], hunks: &[Hunk]| -> Option<()> {
        let (s, l) = record_changes(std::str::from_utf8(old).ok()?, std::str::from_utf8(new).ok()?, hunks)?;
        match (s, path == trellis_core::plan::MESH_ZONE) {
            (Some(_), false) => return None,
            (Some(s), true) => serial = Some(s),
            (None, _) => {}
        }
        lines.extend(l);
        Some(())
    };
    for f in files {
        match served.iter().find(|(path, ..)| *path == f.path) {
            Some((_, sha, _)) if *sha == f.sha256 => {}
            Some((_, sha, old)) => read(&f.path, old, &f.content, &f.hunks_from(sha, old.len()))?,
            None => read(&f.path, b"", &f.content, &[Hunk { old: 0..0, new: 0..f.content.len() }])?,
        }
    }
    for (path, _, old) in served.iter().filter(|(path, ..)| !files.iter().any(|f| f.path == *path)) {
        read(path, old, b"", &[Hunk { old: 0..old.len(), new: 0..0 }])?;
    }
    Some((serial?, lines))
}

/// An address record line a change takes away (-1) or brings (+1): its name and address.
type RecordLine = (Box<str>, std::net::IpAddr, i64);

/// A run of a zone's lines as [`Cut`] sees them, without gathering names: its frame (the SOA's
/// serial left out, and the comments, which the whole read skips) and its address records,
/// each read as the whole read reads it.
struct Lines<'t> {
    frame: Vec<&'t str>,
    serial: Option<&'t str>,
    records: Vec<(&'t str, std::net::IpAddr)>,
}

impl<'t> Lines<'t> {
    fn of(text: &'t str) -> Option<Lines<'t>> {
        let mut out = Lines { frame: Vec::new(), serial: None, records: Vec::new() };
        for line in text.split_inclusive('\n') {
            // A comment or a blank line is no part of the zone, as the whole read reads it
            // (a part of a zone in parts comes or goes with its comment line: ADR 0043); a
            // commented SOA is no SOA.
            if line.split(';').next().unwrap_or("").trim().is_empty() {
                continue;
            }
            let mut fields = line.split_whitespace();
            match (fields.next(), fields.next(), fields.next()) {
                (Some(name), Some("IN"), Some("A" | "AAAA")) => {
                    if !spelled(name) {
                        return None;
                    }
                    let address = addresses(line)?;
                    out.records.push((name, *address.first()?));
                }
                (Some(_), Some("IN"), Some("SOA")) => {
                    let (before, field, after) = soa_serial(line)?;
                    out.serial = Some(field);
                    out.frame.extend([before, after]);
                }
                _ => out.frame.push(line),
            }
        }
        Some(out)
    }
}

/// An SOA line cut around its serial (the third field of its data): the frame holds the line
/// before and after it, so that a new serial alone is no change of the frame.
fn soa_serial(line: &str) -> Option<(&str, &str, &str)> {
    let field = line.split_whitespace().nth(5)?;
    let from = field.as_ptr() as usize - line.as_ptr() as usize;
    Some((&line[..from], field, &line[from + field.len()..]))
}

/// Whether a record's name is spelled as trellis spells names (relative, lower-case ASCII
/// labels): then a name has one spelling, and its string is the name.
fn spelled(name: &str) -> bool {
    name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.' || b == b'*')
        && !name.ends_with('.')
        && !name.starts_with('.')
        && !name.contains("..")
}

/// What the record lines of a change do to the zone served: the addresses each name gains (its
/// count from none) and loses (its count to none), and the counts after. `None` when a line
/// taken away is not counted (the served text is not what the change was made from).
struct Tally {
    added: Vec<(Box<str>, std::net::IpAddr)>,
    removed: Vec<(Box<str>, std::net::IpAddr)>,
    counts: Vec<((Box<str>, std::net::IpAddr), u32)>,
}

fn tally(counts: &Counts, lines: &[RecordLine]) -> Option<Tally> {
    let mut net: std::collections::HashMap<(&str, std::net::IpAddr), i64> = std::collections::HashMap::new();
    for (name, a, d) in lines {
        *net.entry((name, *a)).or_default() += d;
    }
    let mut out = Tally { added: Vec::new(), removed: Vec::new(), counts: Vec::new() };
    for ((name, a), d) in net.into_iter().filter(|(_, d)| *d != 0) {
        let key: (Box<str>, std::net::IpAddr) = (name.into(), a);
        let before = i64::from(counts.get(&key).copied().unwrap_or(0));
        let after = u32::try_from(before + d).ok()?;
        match (before, after) {
            (0, _) => out.added.push(key.clone()),
            (_, 0) => out.removed.push(key.clone()),
            _ => {}
        }
        out.counts.push((key, after));
    }
    Some(out)
}

/// The addresses of a run of address records, each of its record's kind, as a whole read
/// requires.
fn addresses(run: &str) -> Option<Vec<std::net::IpAddr>> {
    let mut list = Vec::new();
    for line in run.lines() {
        let mut fields = line.split_whitespace().skip(2);
        let (Some(kind), Some(address), None) = (fields.next(), fields.next(), fields.next()) else { return None };
        list.push(match kind {
            "A" => std::net::IpAddr::V4(address.parse().ok()?),
            "AAAA" => std::net::IpAddr::V6(address.parse().ok()?),
            _ => return None,
        });
    }
    Some(list)
}

/// Serves a zone that differs from the one served in these names' addresses and its serial, by
/// changing the served zone in place: each name's records and the SOA, under the handler's lock,
/// so that a query sees the zone before or after, never between. Every record is made before the
/// lock is taken (a name that does not read changes nothing). The number of names changed;
/// `None`, changing nothing, when a name changed is the name server's, whose records hold its
/// addresses too (a zone trellis writes never names it; one that does is built whole).
async fn patch(served: &Served, serial: u32, names: &[NameChange]) -> Result<Option<usize>> {
    use hickory_server::proto::rr::{LowerName, Name, RrKey};
    let origin = &served.origin;
    let nameserver = Name::from_str(&served.nameserver)?;
    let mut sets = Vec::new();
    for (relative, list) in names {
        let name = absolute(relative, origin)?;
        if name == nameserver {
            return Ok(None);
        }
        let mut list = list.clone();
        // A name's same address twice is one record, as hickory's loader makes it.
        list.sort_unstable();
        list.dedup();
        let key = LowerName::from(&name);
        for (kind, set) in name_sets(&name, &list, served.ttl, serial) {
            sets.push((RrKey::new(key.clone(), kind), set));
        }
    }
    let soa = soa_set(origin, &nameserver, served.ttl, serial)?;
    let mut records = served.handler.records_mut().await;
    for (key, set) in sets {
        match set {
            Some(set) => records.insert(key, Arc::new(set)),
            None => records.remove(&key),
        };
    }
    records.insert(RrKey::new(LowerName::from(origin), hickory_server::proto::rr::RecordType::SOA), Arc::new(soa));
    Ok(Some(names.len()))
}

/// As [`patch`], record by record: each address a name gains is added to its set, each it
/// loses taken out of it, the rest of the set as it was (ADR 0037). The number of records
/// changed; `None` when one is the name server's.
async fn patch_records(served: &Served, serial: u32, tally: &Tally) -> Result<Option<usize>> {
    use hickory_server::proto::rr::rdata::{A, AAAA};
    use hickory_server::proto::rr::{LowerName, Name, RData, Record, RecordSet, RecordType, RrKey};
    let origin = &served.origin;
    let nameserver = Name::from_str(&served.nameserver)?;
    // (key, name, record, added)
    let mut edits: Vec<(RrKey, Record, bool)> = Vec::with_capacity(tally.added.len() + tally.removed.len());
    let listed = tally.added.iter().map(|r| (r, true)).chain(tally.removed.iter().map(|r| (r, false)));
    for ((relative, address), added) in listed {
        let name = absolute(relative, origin)?;
        if name == nameserver {
            return Ok(None);
        }
        let (kind, data) = match *address {
            std::net::IpAddr::V4(v4) => (RecordType::A, RData::A(A(v4))),
            std::net::IpAddr::V6(v6) => (RecordType::AAAA, RData::AAAA(AAAA(v6))),
        };
        edits.push((RrKey::new(LowerName::from(&name), kind), Record::from_rdata(name, served.ttl, data), added));
    }
    let soa = soa_set(origin, &nameserver, served.ttl, serial)?;
    let mut records = served.handler.records_mut().await;
    for (key, record, added) in &edits {
        // The set itself when no answer holds it (no copy of a module's ten thousand records).
        let mut set = match records.remove(key) {
            Some(set) => Arc::unwrap_or_clone(set),
            None => {
                let mut set = RecordSet::new(record.name.clone(), key.record_type, serial);
                set.set_ttl(served.ttl);
                set
            }
        };
        match added {
            true => set.insert(record.clone(), serial),
            false => set.remove(record, serial),
        };
        if !set.is_empty() {
            records.insert(key.clone(), Arc::new(set));
        }
    }
    records.insert(RrKey::new(LowerName::from(origin), RecordType::SOA), Arc::new(soa));
    Ok(Some(edits.len()))
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
        let mut handler = super::build(&super::Read::of(&zone, &[], &origin).unwrap(), &origin).unwrap();
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
        let refused = super::Read::of(&zone, &[], &other).err().expect("another origin is refused").to_string();
        assert!(refused.contains("origin is t.mesh."), "{refused}");
    }

    /// A name a zone of trellis may hold: not the name server's (`check` refuses a node `ns`).
    fn name() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::strategy::Strategy;
        "[a-z]{1,3}".prop_filter("the name server's name", |n| n != "ns")
    }

    proptest::proptest! {
        /// Whatever names two zones hold, `changes` names every name whose addresses differ (a
        /// name gone with none), with its new addresses, and no other: applied to the old
        /// zone's names it gives the new zone's.
        #[test]
        fn the_changes_take_the_old_names_to_the_new(
            old in proptest::collection::btree_map(name(), proptest::collection::btree_set(0u8..8, 1..4), 0..30),
            new in proptest::collection::btree_map(name(), proptest::collection::btree_set(0u8..8, 1..4), 0..30),
        ) {
            use std::collections::{BTreeMap, BTreeSet};
            let zone = |serial: u32, names: &BTreeMap<String, BTreeSet<u8>>| {
                let mut z = format!("; a zone\n$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n");
                for (name, addrs) in names {
                    for a in addrs {
                        z.push_str(&format!("{name}\tIN\tA\t10.1.0.{a}\n"));
                    }
                }
                z
            };
            let (before, after) = (zone(1, &old), zone(2, &new));
            let found = super::changes(&before, &after);
            proptest::prop_assert!(found.is_some(), "only names' addresses differ:\n{}\n{}", before, after);
            let (serial, changes, _) = found.unwrap();
            proptest::prop_assert_eq!(serial, 2);
            let as_ips = |s: &BTreeSet<u8>| s.iter().map(|a| std::net::IpAddr::from([10, 1, 0, *a])).collect::<BTreeSet<_>>();
            let mut names: BTreeMap<String, BTreeSet<std::net::IpAddr>> = old.iter().map(|(n, s)| (n.clone(), as_ips(s))).collect();
            names.insert("ns".into(), [std::net::IpAddr::from([10, 0, 0, 1])].into());
            let mut seen = BTreeSet::new();
            for (name, list) in changes {
                proptest::prop_assert!(seen.insert(name.clone()), "{} named twice", name);
                let list: BTreeSet<_> = list.into_iter().collect();
                proptest::prop_assert_ne!(names.get(&name).cloned().unwrap_or_default(), list.clone(), "{} did not change", name);
                if list.is_empty() {
                    names.remove(&name);
                } else {
                    names.insert(name, list);
                }
            }
            let mut want: BTreeMap<String, BTreeSet<std::net::IpAddr>> = new.iter().map(|(n, s)| (n.clone(), as_ips(s))).collect();
            want.insert("ns".into(), [std::net::IpAddr::from([10, 0, 0, 1])].into());
            proptest::prop_assert_eq!(names, want);
        }
    }

    /// A zone whose names are spelled otherwise than trellis spells them, or whose record holds
    /// an address of the other kind, is no change of names: it is read whole (which merges the
    /// spellings as hickory does, or refuses the record), never patched by the strings.
    #[test]
    fn a_name_spelled_two_ways_or_an_address_of_the_other_kind_is_read_whole() {
        let zone = |serial: u32, records: &str| {
            format!("$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n{records}")
        };
        let plain = zone(1, "db-1\tIN\tA\t10.0.0.2\n");
        assert!(super::changes(&plain, &zone(2, "db-1\tIN\tA\t10.0.0.3\n")).is_some(), "a change trellis writes");
        for (what, records) in [
            ("a trailing dot", "db-1\tIN\tA\t10.0.0.2\ndb-1.\tIN\tA\t10.0.0.3\n"),
            ("an escape", "db\\-1\tIN\tA\t10.0.0.3\n"),
            ("a capital", "DB-1\tIN\tA\t10.0.0.3\n"),
            ("a name beyond ASCII", "d\u{e4}-1\tIN\tA\t10.0.0.3\n"),
            ("an IPv6 address in an A record", "db-1\tIN\tA\tfd00::1\n"),
            ("an IPv4 address in an AAAA record", "db-1\tIN\tAAAA\t10.0.0.3\n"),
        ] {
            assert_eq!(super::changes(&plain, &zone(2, records)), None, "{what}");
        }
    }

    /// A loopback address with a port free for the test's server.
    /// A loopback port free for both UDP and TCP now: the resolver binds both (a port free for
    /// UDP alone was once taken for TCP by another test: "Address already in use").
    fn free_listen() -> [std::net::SocketAddr; 1] {
        for _ in 0..100 {
            let tcp = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            let at = tcp.local_addr().unwrap();
            if std::net::UdpSocket::bind(at).is_ok() {
                return [at];
            }
        }
        panic!("no loopback port free for both UDP and TCP in 100 tries");
    }

    /// One A query for `name` over UDP to `server`: the addresses answered.
    async fn ask(server: std::net::SocketAddr, name: &str) -> Vec<String> {
        ask_for(server, name, RecordType::A).await
    }

    /// One query of this type for `name` over UDP to `server`: the data answered.
    async fn ask_for(server: std::net::SocketAddr, name: &str, kind: RecordType) -> Vec<String> {
        use hickory_server::proto::op::{Message, Query};
        use hickory_server::proto::serialize::binary::{BinDecodable, BinEncodable};
        let mut m = Message::query();
        m.add_query(Query::query(Name::from_str(name).unwrap(), kind));
        m.metadata.recursion_desired = false;
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        socket.send_to(&m.to_bytes().unwrap(), server).await.unwrap();
        let mut buf = [0u8; 4096];
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), socket.recv(&mut buf)).await.unwrap().unwrap();
        let answer = Message::from_bytes(&buf[..n]).unwrap();
        answer.answers.iter().map(|r| r.data.to_string()).collect()
    }

    /// The attack of a busy agent: its runtime's one thread held (an apply, or the status of
    /// 50,000 peers read from the interface) while a name is asked. The resolver answers on a
    /// thread of its own; before, it shared the agent's, and the name went unanswered.
    #[tokio::test]
    async fn the_resolver_answers_while_the_agents_thread_is_held() {
        use super::Resolver;
        use hickory_server::proto::op::{Message, Query};
        use hickory_server::proto::serialize::binary::{BinDecodable, BinEncodable};
        let dir = trellis_testing::TempDir::new("dns-busy");
        let listen = free_listen();
        let file = dir.join("mesh.zone");
        std::fs::write(&file, "$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. 1 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\ndb-1\tIN\tA\t10.1.0.1\n").unwrap();
        let mut dns = super::Hickory::default();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        let server = listen[0];
        let asker = std::thread::spawn(move || -> std::io::Result<Vec<String>> {
            let mut m = Message::query();
            m.add_query(Query::query(Name::from_str("db-1.t.mesh.").unwrap(), RecordType::A));
            let socket = std::net::UdpSocket::bind("127.0.0.1:0")?;
            socket.set_read_timeout(Some(std::time::Duration::from_secs(1)))?;
            socket.send_to(&m.to_bytes().unwrap(), server)?;
            let mut buf = [0u8; 4096];
            let n = socket.recv(&mut buf)?;
            Ok(Message::from_bytes(&buf[..n]).unwrap().answers.iter().map(|r| r.data.to_string()).collect())
        });
        // This test's runtime has one thread, as the agent's has: held here while the name is asked.
        std::thread::sleep(std::time::Duration::from_millis(1500));
        let answered = asker.join().unwrap().expect("the name is answered within a second while the agent's thread is held");
        assert_eq!(answered, ["10.1.0.1"]);
    }

    /// A new zone on the same addresses is answered from the next query on, by the same server:
    /// its sockets are not bound again (an apply that changes one name among ten thousand spent
    /// most of its DNS time stopping and starting the server).
    #[tokio::test]
    async fn a_new_zone_is_answered_at_once_by_the_same_server() {
        use super::Resolver;
        let dir = trellis_testing::TempDir::new("dns-swap");
        let listen = free_listen();
        let zone = |serial: u32, extra: &str| {
            format!("$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\ndb-1\tIN\tA\t10.1.0.1\n{extra}")
        };
        let file = dir.join("mesh.zone");
        std::fs::write(&file, zone(1, "")).unwrap();
        let mut dns = super::Hickory::default();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!(ask(listen[0], "db-1.t.mesh.").await, ["10.1.0.1"]);
        assert!(ask(listen[0], "db-2.t.mesh.").await.is_empty());
        assert_eq!(dns.starts, 1);
        std::fs::write(&file, zone(2, "db-2\tIN\tA\t10.1.0.2\n")).unwrap();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!(ask(listen[0], "db-2.t.mesh.").await, ["10.1.0.2"]);
        assert_eq!(dns.starts, 1, "the same server answers, its sockets bound once");
        // A zone that does not load leaves the one served.
        std::fs::write(&file, "not a zone").unwrap();
        assert!(dns.apply(&on_disk(&file), "t.mesh", &listen).await.is_err());
        assert_eq!(ask(listen[0], "db-2.t.mesh.").await, ["10.1.0.2"]);
    }

    /// A zone that differs in some names' addresses is served by changing those names in the
    /// served zone, not by building it again: a name renumbered, one come, one gone, and the
    /// SOA's serial, each answered from the next query on. Anything else (here the TTL) builds
    /// the zone whole, and is answered as well.
    #[tokio::test]
    async fn a_zone_changed_in_some_names_is_changed_in_place() {
        use super::Resolver;
        let dir = trellis_testing::TempDir::new("dns-patch");
        let listen = free_listen();
        let zone = |serial: u32, ttl: u32, names: &str| {
            format!("$ORIGIN t.mesh.\n$TTL {ttl}\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n{names}")
        };
        // As trellis writes a zone: each name's records together (the nodes', then a module's).
        let mut many = String::new();
        for i in 0..5000u32 {
            many.push_str(&format!("n-{i}\tIN\tA\t10.1.{}.{}\n", i / 250, i % 250));
        }
        for i in 0..5000u32 {
            many.push_str(&format!("ssh\tIN\tA\t10.1.{}.{}\n", i / 250, i % 250));
        }
        let file = dir.join("mesh.zone");
        std::fs::write(&file, zone(1, 60, &format!("{many}db-1\tIN\tA\t10.2.0.1\ndb-3\tIN\tA\t10.2.0.3\n"))).unwrap();
        let mut dns = super::Hickory::default();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!(ask(listen[0], "db-3.t.mesh.").await, ["10.2.0.3"]);
        assert_eq!((dns.builds, dns.starts), (1, 1));
        std::fs::write(&file, zone(2, 60, &format!("{many}db-1\tIN\tA\t10.2.0.9\ndb-2\tIN\tA\t10.2.0.2\ndb-2\tIN\tAAAA\tfd00::2\n")))
            .unwrap();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.starts), (1, 1), "changed in place, by the same server");
        assert_eq!(ask(listen[0], "db-1.t.mesh.").await, ["10.2.0.9"]);
        assert_eq!(ask(listen[0], "db-2.t.mesh.").await, ["10.2.0.2"]);
        assert_eq!(ask_for(listen[0], "db-2.t.mesh.", RecordType::AAAA).await, ["fd00::2"]);
        assert!(ask(listen[0], "db-3.t.mesh.").await.is_empty(), "a name gone is no longer answered");
        assert_eq!(ask(listen[0], "n-4999.t.mesh.").await, ["10.1.19.249"], "the names unchanged are still answered");
        let soa = ask_for(listen[0], "t.mesh.", RecordType::SOA).await;
        assert!(soa.len() == 1 && soa[0].contains(" 2 3600 600 86400 60"), "{soa:?}");
        // A changed name's line that is not an address record: read whole, and refused.
        std::fs::write(&file, zone(3, 60, &format!("{many}db-1\tIN\tA\t10.2.0.9 extra\n"))).unwrap();
        assert!(dns.apply(&on_disk(&file), "t.mesh", &listen).await.is_err());
        assert_eq!(ask(listen[0], "db-1.t.mesh.").await, ["10.2.0.9"], "the zone served stays");
        // Another TTL: built whole.
        std::fs::write(&file, zone(4, 30, "db-1\tIN\tA\t10.2.0.1\n")).unwrap();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.starts), (2, 1));
        assert_eq!(ask(listen[0], "db-1.t.mesh.").await, ["10.2.0.1"]);
        assert!(ask(listen[0], "db-2.t.mesh.").await.is_empty());
        // A name written in two runs (a module's name is in every part of a zone in parts, ADR
        // 0043): changed in place by its lines all the same, and answered merged.
        std::fs::write(&file, zone(5, 30, "db-1\tIN\tA\t10.2.0.1\ndb-2\tIN\tA\t10.2.0.2\ndb-1\tIN\tA\t10.2.0.7\n")).unwrap();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.starts), (2, 1));
        let mut both = ask(listen[0], "db-1.t.mesh.").await;
        both.sort();
        assert_eq!(both, ["10.2.0.1", "10.2.0.7"]);
    }
    fn change_of(old: &str, new: &str) -> crate::plan::TextChange {
        crate::plan::TextChange::between(old, new)
    }

    /// The zone as one `mesh.zone` of this content, not edits of any.
    fn whole(content: &[u8]) -> Vec<crate::plan::TextFile> {
        let f = trellis_core::bundle::BundleFile::new(trellis_core::plan::MESH_ZONE, 0o644, content.to_vec());
        vec![crate::plan::TextFile { path: f.path, sha256: f.sha256, content: f.content, change: None }]
    }

    /// The zone as the `mesh.zone` written at `file`.
    fn on_disk(file: &std::path::Path) -> Vec<crate::plan::TextFile> {
        whole(&std::fs::read(file).unwrap())
    }

    /// The zone as one `mesh.zone` that came as these edits.
    fn edits(change: crate::plan::TextChange) -> Vec<crate::plan::TextFile> {
        let mut files = whole(&change.new);
        files[0].change = Some(change);
        files
    }

    /// A change that came as edits of the zone served is read from its regions only: the names
    /// there changed in place, answered from the next query on. A name given a second run
    /// outside them is read by its lines and answered merged, as hickory's whole read does;
    /// edits of another zone than the one served are not taken for edits of it (the file is
    /// compared with the one served whole).
    #[tokio::test]
    async fn a_change_by_its_regions_is_changed_in_place_and_edits_of_another_zone_are_not_taken() {
        use super::Resolver;
        let dir = trellis_testing::TempDir::new("dns-regions");
        let listen = free_listen();
        let zone = |serial: u32, skip: u32, extra: &str| {
            let mut z = format!("$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n");
            for i in (0..3000u32).filter(|i| *i != skip) {
                let last = if i == 1500 && serial > 1 { 200 } else { i % 250 };
                z.push_str(&format!("n-{i}\tIN\tA\t10.1.{}.{last}\n", i / 250));
            }
            // A module's name: an address of each node that runs it.
            for i in (0..3000u32).filter(|i| *i != skip) {
                z.push_str(&format!("ssh\tIN\tA\t10.1.{}.{}\n", i / 250, i % 250));
            }
            z.push_str(extra);
            z
        };
        // The addresses of the module's name as the served zone holds them.
        async fn module(dns: &super::Hickory) -> std::collections::BTreeSet<String> {
            use hickory_server::proto::rr::{LowerName, Name, RrKey};
            let served = dns.served.as_ref().unwrap();
            let key = RrKey::new(LowerName::from(Name::from_str("ssh.t.mesh.").unwrap()), RecordType::A);
            let records = served.handler.records().await;
            records.get(&key).map(|set| set.records_without_rrsigs().map(|r| r.data.to_string()).collect()).unwrap_or_default()
        }
        let file = dir.join("mesh.zone");
        let first = zone(1, 3000, "db-1\tIN\tA\t10.2.0.1\n");
        std::fs::write(&file, &first).unwrap();
        let mut dns = super::Hickory::default();
        dns.apply(&on_disk(&file), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 0));
        // n-7 gone, n-1500 renumbered, db-2 come; the file on disk says otherwise, to show that
        // the regions, not the file, were read.
        let second = zone(2, 7, "db-1\tIN\tA\t10.2.0.1\ndb-2\tIN\tA\t10.2.0.2\n");
        std::fs::write(&file, "not read").unwrap();
        dns.apply(&edits(change_of(&first, &second)), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 1), "read by its regions");
        assert!(ask(listen[0], "n-7.t.mesh.").await.is_empty());
        assert_eq!(ask(listen[0], "n-1500.t.mesh.").await, ["10.1.6.200"]);
        assert_eq!(ask(listen[0], "db-2.t.mesh.").await, ["10.2.0.2"]);
        assert_eq!(ask(listen[0], "n-2999.t.mesh.").await, ["10.1.11.249"], "the names outside the regions are still answered");
        let soa = ask_for(listen[0], "t.mesh.", RecordType::SOA).await;
        assert!(soa.len() == 1 && soa[0].contains(" 2 3600 600 86400 60"), "{soa:?}");
        // The module's name lost one address of three thousand, record by record (ADR 0037).
        let held = module(&dns).await;
        assert_eq!(held.len(), 2999);
        assert!(!held.contains("10.1.0.7"));
        // n-3 again at the end: a second run of a name served outside the region, read by its
        // lines all the same, and answered merged as the whole read answers it.
        let third = zone(3, 7, "db-1\tIN\tA\t10.2.0.1\ndb-2\tIN\tA\t10.2.0.2\nn-3\tIN\tA\t10.9.9.9\n");
        std::fs::write(&file, &third).unwrap();
        dns.apply(&edits(change_of(&second, &third)), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 2), "read by its lines");
        let mut both = ask(listen[0], "n-3.t.mesh.").await;
        both.sort();
        assert_eq!(both, ["10.1.0.3", "10.9.9.9"]);
        // Edits made from another zone than the one served are not taken for edits of it: the
        // file is compared with the one served as a whole, and still changed in place.
        let fourth = zone(4, 7, "db-1\tIN\tA\t10.2.0.4\n");
        std::fs::write(&file, &fourth).unwrap();
        dns.apply(&edits(change_of(&second, &fourth)), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 3));
        assert_eq!(module(&dns).await, held, "the whole read holds what the records did");
        assert_eq!(ask(listen[0], "db-1.t.mesh.").await, ["10.2.0.4"]);
        assert!(ask(listen[0], "db-2.t.mesh.").await.is_empty());
        assert_eq!(ask(listen[0], "n-3.t.mesh.").await, ["10.1.0.3"]);
    }

    /// ADR 0043: a zone in parts is served as `mesh.zone` and its parts one after the other. A
    /// bundle that edits one part, drops another, adds a third and keeps the rest changes the
    /// zone served by the regions of the files that changed (a part served as it is is not read),
    /// a module's name spread over every part losing one address of its set; and the zone then
    /// served counts exactly what the new files hold, read whole.
    #[tokio::test]
    async fn a_zone_in_parts_is_served_as_one_and_changed_by_the_regions_of_its_files() {
        use super::Resolver;
        use trellis_core::bundle::{Bundle, BundleFile, Edited};
        use trellis_core::plan::{zone_part, MESH_ZONE};
        let listen = free_listen();
        let main = |serial: u32| {
            format!("; zone\n$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n; names in parts\n")
        };
        // Part p holds the names n-i with i % 4 == p, then the module's address of each.
        let part = |p: u32, skip: u32| {
            let mut t = format!("; part {p:02}\n");
            for i in (0..2000u32).filter(|i| i % 4 == p && *i != skip) {
                t.push_str(&format!("n-{i}\tIN\tA\t10.1.{}.{}\n", i / 250, i % 250));
            }
            for i in (0..2000u32).filter(|i| i % 4 == p && *i != skip) {
                t.push_str(&format!("ssh\tIN\tA\t10.1.{}.{}\n", i / 250, i % 250));
            }
            t
        };
        let bundle = |version: u64, files: Vec<(&str, String)>| Bundle {
            mesh: "t".into(),
            node: "a".into(),
            version,
            issued_at: 1,
            files: files.into_iter().map(|(p, t)| BundleFile::new(p, 0o644, t.into_bytes())).collect(),
        };
        let first = bundle(
            1,
            vec![(MESH_ZONE, main(1)), (zone_part(0), part(0, 9999)), (zone_part(1), part(1, 9999)), (zone_part(2), part(2, 9999))],
        );
        // Part 1 loses n-5 (and its address of ssh) by edits; part 2 is gone; part 3 is new.
        let edited_1 = part(1, 5);
        let second = bundle(
            2,
            vec![(MESH_ZONE, main(2)), (zone_part(0), part(0, 9999)), (zone_part(1), edited_1.clone()), (zone_part(3), part(3, 9999))],
        );
        let mut dns = super::Hickory::default();
        dns.apply(&crate::plan::zone_of(&first, &Default::default()), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 0));
        assert_eq!(ask(listen[0], "n-6.t.mesh.").await, ["10.1.0.6"]);
        assert!(ask(listen[0], "n-7.t.mesh.").await.is_empty(), "part 3 is not held yet");
        // The addresses of the module's name as the served zone holds them (more than an answer
        // over UDP carries).
        async fn module(dns: &super::Hickory) -> std::collections::BTreeSet<String> {
            use hickory_server::proto::rr::{LowerName, Name, RrKey};
            let key = RrKey::new(LowerName::from(Name::from_str("ssh.t.mesh.").unwrap()), RecordType::A);
            let records = dns.served.as_ref().unwrap().handler.records().await;
            records.get(&key).map(|set| set.records_without_rrsigs().map(|r| r.data.to_string()).collect()).unwrap_or_default()
        }
        assert_eq!(module(&dns).await.len(), 1500);

        let main_change = change_of(&main(1), &main(2));
        let part_change = change_of(&part(1, 9999), &edited_1);
        let edited = [
            Edited { path: MESH_ZONE.into(), base: main_change.base, hunks: main_change.hunks.clone() },
            Edited { path: zone_part(1).into(), base: part_change.base, hunks: part_change.hunks.clone() },
        ];
        let changes = crate::plan::text_changes(Some(&first), &second, &edited);
        let files = crate::plan::zone_of(&second, &changes);
        assert_eq!(
            files.iter().map(|f| (f.path.as_str(), f.change.is_some())).collect::<Vec<_>>(),
            [(MESH_ZONE, true), (zone_part(0), false), (zone_part(1), true), (zone_part(3), false)]
        );
        dns.apply(&files, "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 1), "read by the regions of its files");
        assert!(ask(listen[0], "n-5.t.mesh.").await.is_empty(), "gone from part 1");
        assert!(ask(listen[0], "n-6.t.mesh.").await.is_empty(), "part 2 is gone");
        assert_eq!(ask(listen[0], "n-7.t.mesh.").await, ["10.1.0.7"], "part 3 came");
        assert_eq!(ask(listen[0], "n-4.t.mesh.").await, ["10.1.0.4"], "part 0 as it was");
        let ssh = module(&dns).await;
        assert_eq!(ssh.len(), 1999 - 500, "part 1 lost one address, part 2's 500 went, part 3's 500 came");
        assert!(!ssh.contains("10.1.0.5") && !ssh.contains("10.1.0.6") && ssh.contains("10.1.0.7"));
        let soa = ask_for(listen[0], "t.mesh.", RecordType::SOA).await;
        assert!(soa.len() == 1 && soa[0].contains(" 2 3600 600 86400 60"), "{soa:?}");
        let joined = |b: &Bundle| b.files.iter().flat_map(|f| f.content.iter().copied()).collect::<Vec<u8>>();
        let whole = String::from_utf8(joined(&second)).unwrap();
        assert_eq!(dns.served.as_ref().unwrap().counts, super::counts_of(&whole).unwrap(), "what the new files hold, counted whole");

        // Read whole, the files are the zone, one after the other.
        let mut fresh = super::Hickory::default();
        let other = free_listen();
        fresh.apply(&crate::plan::zone_of(&second, &Default::default()), "t.mesh", &other).await.unwrap();
        assert_eq!(fresh.served.as_ref().unwrap().counts, dns.served.as_ref().unwrap().counts);
        assert_eq!(ask(other[0], "n-7.t.mesh.").await, ["10.1.0.7"]);

        // A part's comment that reads like an SOA is a comment: the serial is mesh.zone's.
        let mut commented = part(0, 9999);
        commented.push_str(";x\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. 777 3600 600 86400 60\n");
        let third = bundle(
            3,
            vec![(MESH_ZONE, main(3)), (zone_part(0), commented), (zone_part(1), edited_1.clone()), (zone_part(3), part(3, 9999))],
        );
        dns.apply(&crate::plan::zone_of(&third, &Default::default()), "t.mesh", &listen).await.unwrap();
        assert_eq!((dns.builds, dns.by_regions), (1, 2));
        let soa = ask_for(listen[0], "t.mesh.", RecordType::SOA).await;
        assert!(soa.len() == 1 && soa[0].contains(" 3 3600 600 86400 60"), "{soa:?}");

        // A zone that does not load, read whole, names the file and its line there.
        let broken =
            bundle(4, vec![(MESH_ZONE, main(4)), (zone_part(1), "; part 01\nn-1\tIN\tA\t10.1.0.1\nn-5\tIN\tA\tnot-an-address\n".into())]);
        let e = fresh.apply(&crate::plan::zone_of(&broken, &Default::default()), "t.mesh", &other).await.unwrap_err().to_string();
        assert!(e.contains("etc/trellis/zone.d/names-01.zone line 3:"), "{e}");
        assert_eq!(ask(other[0], "n-7.t.mesh.").await, ["10.1.0.7"], "the zone served stays");
    }

    /// Fields apart by any white space, as the zone's parser reads them: a run of one name whose
    /// lines are written with a vertical tab is still one run to the regions (a review found a
    /// region starting inside it, and the name's other addresses dropped).
    #[test]
    fn the_regions_split_fields_as_the_whole_read_does() {
        let zone = |first: &str| {
            let mut z = String::from("$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. 1 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n");
            for i in 0..200 {
                z.push_str(&format!("a-{i}\tIN\tA\t10.1.0.{}\n", i % 250));
            }
            z.push_str(&format!("n-1\tIN\tA\t{first}\nn-1\x0bIN\x0bA\x0b1.1.1.2\n"));
            for i in 0..200 {
                z.push_str(&format!("z-{i}\tIN\tA\t10.2.0.{}\n", i % 250));
            }
            z
        };
        let (before, after) = (zone("1.1.1.1"), zone("1.1.1.9").replace(" 1 3600", " 2 3600"));
        let whole = super::changes(&before, &after).expect("a change of names");
        assert_eq!(by_lines(&before, &after), Some(whole.2), "the lines give the whole read's counts");
        let n1: Vec<std::net::IpAddr> = whole.1.iter().find(|(n, _)| n == "n-1").unwrap().1.clone();
        assert_eq!(n1, ["1.1.1.9".parse::<std::net::IpAddr>().unwrap(), "1.1.1.2".parse().unwrap()]);
    }

    /// The counts of the zone `after`, as a change from `before` read from the lines of its
    /// regions makes them from `before`'s; `None` when the lines say nothing.
    fn by_lines(before: &str, after: &str) -> Option<super::Counts> {
        let c = change_of(before, after);
        let (_, lines) = super::record_changes(before, after, &c.hunks)?;
        let mut counts = super::counts_of(before).unwrap();
        let tally = super::tally(&counts, &lines)?;
        for (key, n) in tally.counts {
            match n {
                0 => counts.remove(&key),
                n => counts.insert(key, n),
            };
        }
        Some(counts)
    }

    proptest::proptest! {
        /// Any change of a zone of hundreds of names as trellis writes them, and of a module's
        /// name holding an address of each: the lines of the regions take the old zone's counts
        /// to the new one's, exactly as the whole read counts them, and they always say it.
        #[test]
        fn the_lines_never_say_other_than_the_whole_read(
            old in proptest::collection::btree_map(0u16..600, proptest::collection::btree_set(0u8..4, 1..3), 200..300),
            gone in proptest::collection::vec(0u16..600, 0..4),
            come in proptest::collection::btree_map(0u16..600, proptest::collection::btree_set(0u8..4, 1..3), 0..4),
        ) {
            use std::collections::{BTreeMap, BTreeSet};
            let zone = |serial: u32, names: &BTreeMap<u16, BTreeSet<u8>>| {
                let mut z = format!("$ORIGIN t.mesh.\n$TTL 60\n@\tIN\tSOA\tns.t.mesh. hostmaster.t.mesh. {serial} 3600 600 86400 60\n@\tIN\tNS\tns.t.mesh.\nns\tIN\tA\t10.0.0.1\n");
                for (name, addrs) in names {
                    for a in addrs {
                        z.push_str(&format!("n-{name}\tIN\tA\t10.1.{}.{a}\n", name % 200));
                    }
                }
                for (name, addrs) in names {
                    z.push_str(&format!("ssh\tIN\tA\t10.1.{}.{}\n", name % 200, addrs.first().unwrap()));
                }
                z
            };
            let mut new = old.clone();
            for g in &gone {
                new.remove(g);
            }
            new.extend(come);
            let (before, after) = (zone(1, &old), zone(2, &new));
            let whole = super::changes(&before, &after).expect("only names' addresses differ");
            proptest::prop_assert_eq!(by_lines(&before, &after), Some(whole.2));
        }
    }
}
