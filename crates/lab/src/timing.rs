//! The lab's timings: from token redemption to the first packet over the overlay, from an
//! apply until every node it changed converged, and from a controller's kill until every agent
//! moved to another, and from a revocation until every node that held the key dropped it.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ipnet::IpNet;
use trellis_proto::{NodeState, NodeStatus};

use crate::net::ns_cmd;
use crate::procs;
use crate::LabState;

/// The overlay address of the first peer a node dials itself (one with an `Endpoint`), read with
/// the core's `wireguard.conf` reader; none when the node has no file yet or dials no one.
fn dialled_peer(root: &Path) -> Result<Option<IpAddr>> {
    let Some(peers) = held_peers(root)? else { return Ok(None) };
    let conf = root.join(trellis_core::compile::WIREGUARD_CONF);
    let Some(peer) = peers.iter().find(|p| p.endpoint.is_some()) else { return Ok(None) };
    let Some(first) = peer.allowed_ips.first() else { return Ok(None) };
    let net: IpNet = first.parse().with_context(|| format!("{}: AllowedIPs entry {first:?} is not an address/prefix", conf.display()))?;
    Ok(Some(net.addr()))
}

/// A probe's answer: its node and milliseconds, or none when the node dials no one or got no answer.
type Probe = std::thread::JoinHandle<Result<Option<(String, u64)>>>;

/// The first-packet probes of the nodes the lab enrols, each started as soon as its node's agent
/// runs, so that a node enrolled early is timed from its own token, not from the last one.
#[derive(Default)]
pub(crate) struct FirstPackets {
    probes: Vec<Probe>,
    /// Set once every node holds its bundle: a probe whose node still dials no one gives up.
    settled: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

/// How long a probe waits for an answer, from its token's redemption.
const FIRST_PACKET_LIMIT: Duration = Duration::from_secs(30);

impl FirstPackets {
    /// Starts `node`'s probe (in namespace `ns`, its token redeemed at `since`): it waits until
    /// the node's wireguard.conf names a peer the node dials itself, then pings that peer's
    /// overlay address every 20 ms until the first answer.
    pub(crate) fn start(&mut self, node: &str, ns: &str, since: Instant, st: &LabState) {
        let conf = st.dir.join(format!("root-{node}"));
        let (node, ns, settled) = (node.to_string(), ns.to_string(), self.settled.clone());
        self.probes.push(std::thread::spawn(move || {
            let deadline = since + FIRST_PACKET_LIMIT;
            let target = loop {
                if let Some(t) = dialled_peer(&conf)? {
                    break t.to_string();
                }
                if settled.load(std::sync::atomic::Ordering::Relaxed) || Instant::now() > deadline {
                    return Ok(None);
                }
                std::thread::sleep(Duration::from_millis(10));
            };
            while Instant::now() < deadline {
                // One ping that sends every 20 ms until an answer or its deadline; it ends at
                // once while the node has no route to the overlay yet.
                let left = deadline.saturating_duration_since(Instant::now()).as_secs().max(1).to_string();
                let answered = ns_cmd(&ns, &["ping", "-n", "-q", "-c", "1", "-i", "0.02", "-w", &left, &target])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if answered {
                    return Ok(Some((node, since.elapsed().as_millis() as u64)));
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(None)
        }));
    }

    /// Once every node holds its bundle: the milliseconds from each node's token redemption to
    /// the first answer over the overlay (nodes that dial no one, or got no answer within 30 s,
    /// are left out).
    pub(crate) fn finish(self) -> Result<BTreeMap<String, u64>> {
        self.settled.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut out = BTreeMap::new();
        for p in self.probes {
            if let Some((name, ms)) = p.join().map_err(|_| anyhow::anyhow!("a first-packet probe panicked"))?? {
                out.insert(name, ms);
            }
        }
        Ok(out)
    }
}

/// WireGuard's REKEY_TIMEOUT: a handshake initiation that got no answer is sent again only
/// after it.
const REKEY_TIMEOUT: Duration = Duration::from_secs(5);

/// The nodes whose first packet came later than the rekey timeout after their token's
/// redemption: their tunnel waited for a handshake's retry (an initiation lost while the peer
/// was not up, or crossing the peer's), which prompted handshakes avoid. A bound that tells that
/// wait apart, not a speed limit: without it every shipped lab is well under.
pub(crate) fn waited_for_retry(first_packet_ms: &BTreeMap<String, u64>) -> Vec<String> {
    let bound = REKEY_TIMEOUT.as_millis() as u64;
    first_packet_ms.iter().filter(|(_, ms)| **ms > bound).map(|(node, ms)| format!("{node} {ms} ms")).collect()
}

/// What an apply changed, and how long until every node it changed had applied it.
pub(crate) struct Converged {
    pub took: Duration,
    /// Nodes given a new bundle by the apply, of the active nodes.
    pub changed: usize,
    pub nodes: usize,
}

/// Applies `dir` through a running controller and waits until every node the apply gave a new
/// bundle has applied it. Publishing runs after the apply has answered (ADR 0016), so right then
/// every node still shows its old desired version as applied; the controller answers for the
/// audit checkpoint only once the publish run covering earlier decisions is done, so the chain is
/// verified (`trellis audit verify`) before the versions are read.
pub(crate) fn apply_and_wait(dir: &Path, st: &LabState, limit: Duration) -> Result<Converged> {
    let before: HashMap<String, Option<i64>> = procs::status(st)?.into_iter().map(|n| (n.name, n.desired_version)).collect();
    let t0 = Instant::now();
    procs::apply(st, dir)?;
    procs::admin(st, &["audit", "verify"])?;
    loop {
        let list = procs::status(st)?;
        let active: Vec<&NodeStatus> = list.iter().filter(|n| n.state == NodeState::Active).collect();
        let pending: Vec<&str> = active.iter().filter(|n| n.desired_version != n.applied_version).map(|n| n.name.as_str()).collect();
        if pending.is_empty() {
            let changed = active.iter().filter(|n| before.get(&n.name).is_none_or(|v| *v != n.desired_version)).count();
            return Ok(Converged { took: t0.elapsed(), changed, nodes: active.len() });
        }
        if t0.elapsed() > limit {
            bail!("nodes did not apply what {} changed within {} s: {}", dir.display(), limit.as_secs(), pending.join(", "));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Applies the declaration with one node more and times until every node it changed converged;
/// the caller applies the declaration in force again.
pub(crate) fn reapply(decl_dir: &Path, st: &LabState) -> Result<Converged> {
    let changed = st.dir.join("reapply");
    let _ = std::fs::remove_dir_all(&changed);
    let modules = changed.join("modules");
    std::fs::create_dir_all(&modules).with_context(|| format!("cannot create {}", modules.display()))?;
    let mesh_path = decl_dir.join(trellis_core::load::MESH_FILE);
    let mesh = std::fs::read_to_string(&mesh_path).with_context(|| format!("cannot read {}", mesh_path.display()))?;
    let changed_mesh = changed.join(trellis_core::load::MESH_FILE);
    std::fs::write(&changed_mesh, format!("{mesh}\n[[node]]\nname = \"lab-probe\"\n"))
        .with_context(|| format!("cannot write {}", changed_mesh.display()))?;
    if let Ok(entries) = std::fs::read_dir(decl_dir.join("modules")) {
        for e in entries.flatten() {
            std::fs::copy(e.path(), modules.join(e.file_name())).with_context(|| format!("cannot copy {}", e.path().display()))?;
        }
    }
    apply_and_wait(&changed, st, Duration::from_secs(60))
}

/// Whether the agent of `node` holds an established TCP connection to one of `controllers`
/// (HOST:PORT), as `ss` shows it in the node's namespace.
pub(crate) fn holds(st: &LabState, node: &str, controllers: &[&str]) -> bool {
    let ns = format!("{}-{node}", st.prefix);
    let out = ns_cmd(&ns, &["ss", "-tnH", "state", "established"]).output().map(|o| o.stdout).unwrap_or_default();
    // With a state filter, `ss` prints the queues, then the local and the peer address.
    String::from_utf8_lossy(&out).lines().any(|l| l.split_whitespace().nth(3).is_some_and(|peer| controllers.contains(&peer)))
}

/// The local addresses of the connections `node`'s agent holds to `controllers` (HOST:PORT).
pub(crate) fn control_sources(st: &LabState, node: &str, controllers: &[&str]) -> Vec<std::net::IpAddr> {
    let ns = format!("{}-{node}", st.prefix);
    let out = ns_cmd(&ns, &["ss", "-tnH", "state", "established"]).output().map(|o| o.stdout).unwrap_or_default();
    String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().skip(2);
            let (local, peer) = (f.next()?, f.next()?);
            controllers
                .contains(&peer)
                .then(|| local.rsplit_once(':').map(|(a, _)| a.trim_matches(['[', ']']).parse().ok()))
                .flatten()
                .flatten()
        })
        .collect()
}

/// After a controller was killed: the time from `since` until every agent holds a connection to
/// a controller still running (its long-poll moved over).
pub(crate) fn failover(st: &LabState, since: Instant, limit: Duration) -> Result<Duration> {
    let running: Vec<&str> = st.controllers.iter().filter(|r| !r.killed).map(|r| r.address.as_str()).collect();
    let mut waiting: Vec<&str> = st.agents.iter().map(String::as_str).collect();
    loop {
        waiting.retain(|node| !holds(st, node, &running));
        if waiting.is_empty() {
            return Ok(since.elapsed());
        }
        if since.elapsed() > limit {
            bail!(
                "the agents of {} hold no connection to a running controller ({}) {} s after the kill",
                waiting.join(", "),
                running.join(", "),
                limit.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// How long a stopped pool member took to go: from the stop until the controller removed it
/// (`trellis nodes` lists it `removing`, or no more), until no other agent's wireguard.conf held
/// its key, and until `trellis nodes` no longer listed it (every holder reported applying a
/// bundle without it, ADR 0022).
pub(crate) struct Removed {
    pub listed: Duration,
    pub peers: Duration,
    pub complete: Duration,
}

/// Waits until the controller has removed `host` (a stopped pool member holding `key`) and every
/// running agent's wireguard.conf, read with the core's reader, has dropped the key.
pub(crate) fn removal(st: &LabState, host: &str, key: &str, since: Instant, limit: Duration) -> Result<Removed> {
    let deadline = since + limit;
    let listed = loop {
        if !procs::nodes(st)?.iter().any(|n| n.name == host && n.state != NodeState::Removing) {
            break since.elapsed();
        }
        if Instant::now() > deadline {
            bail!("`{host}` is still listed by `trellis nodes` {} s after its agent stopped", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(250));
    };
    let peers = loop {
        let holding = key_holders(st, key)?;
        if holding.is_empty() {
            break since.elapsed();
        }
        if Instant::now() > deadline {
            bail!("{} still hold(s) `{host}` as a peer {} s after its agent stopped", holding.join(", "), limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    loop {
        let Some(n) = procs::nodes(st)?.into_iter().find(|n| n.name == host) else {
            return Ok(Removed { listed, peers, complete: since.elapsed() });
        };
        if Instant::now() > deadline {
            let said = n.revocation.map(|r| r.summary(trellis_files::unix_now())).unwrap_or_else(|| n.state.to_string());
            bail!("`{host}` is still listed by `trellis nodes` {} s after its agent stopped: {said}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The peers a node's files under `root` hold, read with the core's reader: those of its
/// `wireguard.conf` and of its parts (ADR 0039); `None` without a `wireguard.conf`.
pub(crate) fn held_peers(root: &Path) -> Result<Option<Vec<std::sync::Arc<trellis_core::wgconf::WgPeer>>>> {
    let conf = root.join(trellis_core::compile::WIREGUARD_CONF);
    let Ok(text) = std::fs::read_to_string(&conf) else { return Ok(None) };
    let mut peers = trellis_core::wgconf::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", conf.display()))?.peers;
    for i in 0..trellis_core::plan::WIREGUARD_PARTS {
        let part = root.join(trellis_core::plan::wireguard_part(i));
        let Ok(text) = std::fs::read_to_string(&part) else { continue };
        let read = trellis_core::wgconf::read_part(&text, &part.display().to_string()).map_err(|e| anyhow::anyhow!("{e}"))?;
        peers.extend(read.conf.peers.iter().cloned());
    }
    Ok(Some(peers))
}

/// The agents whose WireGuard files, read with the core's reader, hold `key` as a peer.
pub(crate) fn key_holders<'a>(st: &'a LabState, key: &str) -> Result<Vec<&'a str>> {
    let mut holding = Vec::new();
    for a in &st.agents {
        let Some(peers) = held_peers(&st.dir.join(format!("root-{a}")))? else { continue };
        // A direct candidate (ADR 0032) is a peer of the interface too.
        let paths = st.dir.join(format!("root-{a}/{}", trellis_core::plan::PATHS_TOML));
        let direct = match std::fs::read_to_string(&paths) {
            Ok(text) => trellis_core::paths::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", paths.display()))?,
            Err(_) => Vec::new(),
        };
        if peers.iter().any(|p| p.public_key == key) || direct.iter().any(|c| c.public_key.to_string() == key) {
            holding.push(a.as_str());
        }
    }
    Ok(holding)
}

/// `trellis node revoke NODE --wait`: the time from the request until the node is `revoked`
/// (every node that held its key applied a bundle without it), said as the step prints it. While
/// an agent is paused the revocation cannot complete: it waits 10 s and says that the node is
/// still `revoking`, held by the paused agents and no other (an error otherwise).
pub(crate) fn revocation(st: &LabState, node: &str) -> Result<String> {
    let timeout = if st.paused.is_empty() { "60s" } else { "10s" };
    let at = Instant::now();
    let (_, text) = procs::admin_answer(st, &["node", "revoke", node, "--wait", "--timeout", timeout, "--json"])?;
    let took = at.elapsed();
    let r: trellis_proto::Revocation = serde_json::from_str(&text)
        .with_context(|| format!("`trellis node revoke {node} --json` printed something else than a revocation"))?;
    let now = trellis_files::unix_now();
    if r.complete() {
        return Ok(format!(
            "revoked, every node that held its key ({} peer(s)) applied a bundle without it: {} ms",
            r.holders,
            took.as_millis()
        ));
    }
    let holding: Vec<&str> = r.holding.iter().map(|h| h.name.as_str()).collect();
    if st.paused.is_empty() || holding.is_empty() || holding.iter().any(|h| !st.paused.iter().any(|p| p == h)) {
        bail!("node {node} is still {} after {timeout}", r.summary(now));
    }
    Ok(format!("still {} after {} ms, held by the paused agent(s) only", r.summary(now), took.as_millis()))
}

/// The nodes `revoking` now, as `trellis nodes` says.
pub(crate) fn revoking(st: &LabState) -> Result<Vec<String>> {
    Ok(procs::nodes(st)?.into_iter().filter(|n| n.state == NodeState::Revoking).map(|n| n.name).collect())
}

/// Waits until each of `nodes` is `revoked`: for each, the time from `since` until `trellis
/// nodes` first said so, and its revocation.
pub(crate) fn revoked(
    st: &LabState,
    nodes: &[String],
    since: Instant,
    limit: Duration,
) -> Result<Vec<(String, Duration, trellis_proto::Revocation)>> {
    let mut done: Vec<(String, Duration, trellis_proto::Revocation)> = Vec::new();
    let deadline = since + limit;
    loop {
        let list = procs::nodes(st)?;
        let took = since.elapsed();
        for n in list.into_iter().filter(|n| nodes.contains(&n.name) && n.state == NodeState::Revoked) {
            if !done.iter().any(|(d, _, _)| *d == n.name) {
                if let Some(r) = n.revocation {
                    done.push((n.name, took, r));
                }
            }
        }
        if done.len() == nodes.len() {
            return Ok(done);
        }
        if Instant::now() > deadline {
            let left: Vec<&String> = nodes.iter().filter(|n| !done.iter().any(|(d, _, _)| d == *n)).collect();
            bail!("still revoking after {} s: {}", limit.as_secs(), left.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", "));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One service certificate replaced by its agent's renewal.
pub(crate) struct Renewed {
    pub module: String,
    pub old_serial: String,
    pub new_serial: String,
    /// From the step's start until the new file was seen.
    pub after: Duration,
    /// When the new certificate begins, as a share of the old one's lifetime.
    pub at_percent: i64,
    pub lifetime: i64,
}

/// The service certificates `node`'s agent holds now, by module: serial, not before, not after.
fn held_certs(st: &LabState, node: &str) -> Result<BTreeMap<String, (String, i64, i64)>> {
    let dir = st.dir.join(format!("root-{node}/{}", trellis_core::certs::CERTS_DIR));
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).with_context(|| format!("`{node}` holds no service certificate: cannot read {}", dir.display()))? {
        let path = entry?.path().join("cert.pem");
        let Ok(pem) = std::fs::read_to_string(&path) else { continue };
        let info = trellis_pki::services::inspect_service(&pem).with_context(|| format!("{} is no certificate", path.display()))?;
        let module = path.parent().and_then(|p| p.file_name()).map(|m| m.to_string_lossy().into_owned()).unwrap_or_default();
        out.insert(module, (info.serial, info.not_before, info.not_after));
    }
    Ok(out)
}

/// Waits until `node`'s agent has replaced every service certificate it holds by renewing it,
/// each at most 30 s after the old one expires, and checks that the controller lists each new
/// serial (`trellis certs --json`): a renewal is the agent's CSR signed by the controller, not
/// files appearing.
pub(crate) fn renewal(st: &LabState, node: &str) -> Result<Vec<Renewed>> {
    let before = held_certs(st, node)?;
    if before.is_empty() {
        bail!("`{node}` holds no service certificate to renew");
    }
    let at = Instant::now();
    let now = trellis_files::unix_now();
    let mut done: Vec<Renewed> = Vec::new();
    loop {
        let held = held_certs(st, node)?;
        for (module, (old, old_from, old_until)) in &before {
            if done.iter().any(|d| d.module == *module) {
                continue;
            }
            if let Some((new, from, _)) = held.get(module).filter(|(new, _, _)| new != old) {
                // Lifetimes count from issuance: a certificate begins a little before it.
                let issued = old_from + trellis_pki::services::SERVICE_BACKDATE_SECS;
                let lifetime = (old_until - issued).max(1);
                done.push(Renewed {
                    module: module.clone(),
                    old_serial: old.clone(),
                    new_serial: new.clone(),
                    after: at.elapsed(),
                    at_percent: (from + trellis_pki::services::SERVICE_BACKDATE_SECS - issued) * 100 / lifetime,
                    lifetime,
                });
            } else if trellis_files::unix_now() > old_until + 30 {
                bail!(
                    "`{node}`'s certificate for {module} ({old}) expired {} s ago and its agent has not renewed it",
                    trellis_files::unix_now() - old_until
                );
            }
        }
        if done.len() == before.len() {
            break;
        }
        let waited = before.values().map(|(_, _, until)| until - now).max().unwrap_or(0);
        if at.elapsed() > Duration::from_secs(waited.max(0) as u64 + 60) {
            bail!("`{node}`'s certificates were not all renewed within {} s", at.elapsed().as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let text = procs::admin(st, &["certs", "--json"])?;
    let listed: Vec<trellis_proto::ServiceCertInfo> =
        serde_json::from_str(&text).context("`trellis certs --json` printed something else than a certificate list")?;
    for r in &done {
        let serial = listed.iter().find(|c| c.node == node && c.module == r.module).and_then(|c| c.serial.as_deref());
        if serial != Some(r.new_serial.as_str()) {
            bail!(
                "`{node}`'s agent wrote certificate {} for {}, but the controller lists {}",
                r.new_serial,
                r.module,
                serial.unwrap_or("none")
            );
        }
    }
    Ok(done)
}

/// The withdrawals of routes (ADR 0022) decided at or after `since` (Unix seconds, the apply's
/// start), waited for until each is complete, as `trellis nodes` says: for each node routes were
/// taken from, its withdrawal and the time from `at` until the lab first saw it complete.
pub(crate) fn withdrawals(st: &LabState, since: i64, at: Instant, limit: Duration) -> Result<Vec<(String, Withdrawn)>> {
    let mut done: BTreeMap<String, Withdrawn> = BTreeMap::new();
    loop {
        let open: Vec<(String, trellis_proto::Revocation)> = procs::nodes(st)?
            .into_iter()
            .filter_map(|n| n.revocation.map(|r| (n.name, r)))
            .filter(|(_, r)| r.kind == trellis_proto::Withdrawal::Routes && r.decided_at >= since)
            .collect();
        let took = at.elapsed();
        for (name, r) in &open {
            if r.complete() && !done.contains_key(name) {
                done.insert(name.clone(), Withdrawn { holders: r.holders, took });
            }
        }
        let left: Vec<String> = open
            .iter()
            .filter(|(n, _)| !done.contains_key(n))
            .map(|(n, r)| format!("{n}: {}", r.summary(trellis_files::unix_now())))
            .collect();
        if left.is_empty() {
            return Ok(done.into_iter().collect());
        }
        if at.elapsed() > limit {
            bail!("routes still withdrawing {} s after the apply: {}", limit.as_secs(), left.join("; "));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// A withdrawal of routes seen complete: its holders, and when.
pub(crate) struct Withdrawn {
    pub holders: usize,
    pub took: Duration,
}

/// From `at` (an apply's start) until an HTTPS request from `from` for `host` to `addr:port` is
/// answered with a certificate that verifies against the lab's ACME root (ADR 0026); failing
/// past `limit`.
pub(crate) fn served(st: &LabState, from: &str, host: &str, addr: &str, port: u16, at: Instant, limit: Duration) -> Result<Duration> {
    let ns = format!("{}-{from}", st.prefix);
    let mut last = None;
    while at.elapsed() < limit {
        match crate::checks::https_once(st, &ns, host, addr, port)? {
            crate::checks::Served::Answered(_) => return Ok(at.elapsed()),
            other => last = Some(other),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    bail!("https://{host}/ was not served to {from} within {}s (last: {last:?})", limit.as_secs())
}

/// How many answers in a row `only_by` wants from the runners left.
pub(crate) const IN_A_ROW: usize = 8;

/// From `at` (a revocation's start) until the edge no longer sends to the revoked runner: the
/// start of the first of `IN_A_ROW` HTTPS requests in a row each answered by one of `by`. A
/// request the edge sent to the revoked runner hangs, so each is given a second: the figure is
/// good to about that. Failing past `limit`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn only_by(
    st: &LabState,
    from: &str,
    host: &str,
    addr: &str,
    port: u16,
    by: &[String],
    at: Instant,
    limit: Duration,
) -> Result<Duration> {
    let ns = format!("{}-{from}", st.prefix);
    let mut row = 0;
    let mut last = None;
    let mut first_good = None;
    while at.elapsed() < limit {
        let sent = at.elapsed();
        match crate::checks::https_within(st, &ns, host, addr, port, 1)? {
            crate::checks::Served::Answered(b) if by.contains(&b) => {
                first_good.get_or_insert(sent);
                row += 1;
                if row == IN_A_ROW {
                    return Ok(first_good.unwrap_or_default());
                }
            }
            other => {
                row = 0;
                first_good = None;
                last = Some(other);
            }
        }
    }
    bail!("{host} was not answered by {} only within {}s (last: {last:?})", by.join(", "), limit.as_secs())
}

/// What a rotation of the signing key took (ADR 0027).
pub(crate) struct Rotated {
    /// From `trellis rotate signing-key` until every agent running held only the new key.
    pub took: Duration,
    /// `evidence` or `overlap`, as `trellis rotate status` says.
    pub completed_by: String,
    /// How many agents refused a bundle signed with the retired key.
    pub refused: usize,
}

/// Rotates the signing key through the controller, waits (at most `limit`) until every agent
/// running holds only the new key in its identity, then performs the attack of a leaked old key
/// on each: the bundle it applied last, 100 versions on, signed with the retired key, given to
/// `trellis-agent verify`. Fails unless every agent refuses it for its signature.
pub(crate) fn rotate_signing_key(st: &LabState, limit: Duration) -> Result<Rotated> {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD;
    let r = st.serving()?;
    let trellis = procs::exe("trellis")?;
    let state = procs::path_str(&r.state_dir)?;
    let read_key = |file: &str| -> Result<ed25519_dalek::SigningKey> {
        let path = r.state_dir.join(file);
        let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
        let seed: [u8; 32] =
            b64.decode(text.trim()).ok().and_then(|b| b.try_into().ok()).with_context(|| format!("{} holds no key", path.display()))?;
        Ok(ed25519_dalek::SigningKey::from_bytes(&seed))
    };
    // Taken before the rotation, as an attacker who copied the state directory then would: the
    // controller keeps only the public half once the key is retired.
    let retired = read_key("signing.key")?;
    let at = Instant::now();
    crate::net::in_ns(&r.ns, &[procs::path_str(&trellis)?, "rotate", "signing-key", "--overlap", "1h", "--state-dir", state])?;
    let next = b64.encode(read_key("signing.next.key")?.verifying_key().to_bytes());
    let running: Vec<&String> = st.agents.iter().filter(|a| !st.paused.contains(a)).collect();
    let identity = |node: &str| -> toml::Value {
        let text = std::fs::read_to_string(st.dir.join(format!("agent-{node}/identity.toml"))).unwrap_or_default();
        toml::from_str(&text).unwrap_or(toml::Value::Table(Default::default()))
    };
    loop {
        let left: Vec<&String> = running
            .iter()
            .copied()
            .filter(|n| {
                let id = identity(n);
                id.get("signing_public_key").and_then(|k| k.as_str()) != Some(next.as_str()) || id.get("next_signing_public_key").is_some()
            })
            .collect();
        if left.is_empty() {
            break;
        }
        if at.elapsed() > limit {
            bail!("{} s after the rotation started, these agents do not hold only the new key: {left:?}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = at.elapsed();
    let status: serde_json::Value = serde_json::from_str(&procs::admin(st, &["rotate", "status", "--json"])?)?;
    let completed_by = status[0]["completed_by"].as_str().unwrap_or("nothing: not completed").to_string();
    let agent = procs::exe("trellis-agent")?;
    let mut refused = 0;
    for node in &running {
        let dir = st.dir.join(format!("agent-{node}"));
        let id = identity(node);
        let mesh = id.get("mesh").and_then(|m| m.as_str()).unwrap_or_default().to_string();
        let key: [u8; 32] = b64.decode(&next)?.try_into().map_err(|_| anyhow::anyhow!("the new key is not 32 bytes"))?;
        let current = ed25519_dalek::VerifyingKey::from_bytes(&key)?;
        let head = std::fs::read(dir.join("bundle.head")).with_context(|| format!("{node} holds no bundle"))?;
        let root = st.dir.join(format!("root-{node}"));
        let held = trellis_core::bundle::held_bytes(head, |path, _, _| std::fs::read(root.join(path)).map_err(|e| e.to_string()))
            .map_err(anyhow::Error::msg)?;
        let mut bundle = trellis_core::bundle::verify(&held, &current, &mesh, node, None)
            .map_err(|e| anyhow::anyhow!("{node}'s last bundle is not signed by the new key: {e}"))?
            .bundle;
        bundle.version += 100;
        let forged = st.dir.join(format!("forged-{node}.bundle"));
        std::fs::write(&forged, bundle.sign(&retired).to_vec()).with_context(|| format!("cannot write {}", forged.display()))?;
        let out = std::process::Command::new(&agent)
            .args(["verify", procs::path_str(&forged)?, "--state-dir", procs::path_str(&dir)?])
            .output()
            .context("cannot run trellis-agent verify")?;
        let said = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !said.contains("bundle signature does not verify") {
            bail!("{node} did not refuse a bundle signed with the retired key: {}", said.trim());
        }
        refused += 1;
    }
    Ok(Rotated { took, completed_by, refused })
}

/// What a rotation of the mesh CA took (ADR 0029).
pub(crate) struct CaRotated {
    /// From `trellis rotate ca` until every agent running trusted only the new CA and held a
    /// certificate it issued.
    pub took: Duration,
    /// `evidence` or `overlap`, as `trellis rotate status` says.
    pub completed_by: String,
    /// How many nodes' certificates, issued with the retired CA's key, the controller refused.
    pub refused: usize,
    /// Enrolments recorded during the rotation (none: no node enrolled again).
    pub enrolled_again: usize,
}

/// Rotates the mesh CA through the controller and waits (at most `limit`) until every agent
/// running trusts only the new CA and holds a node certificate it issued; then performs the
/// attack of a leaked old CA key on each node: a certificate for the node issued with the old
/// key, presented from the node's namespace by a client that trusts the new CA. Fails unless the
/// controller refuses every one (`UnknownCA`).
pub(crate) fn rotate_ca(st: &LabState, limit: Duration) -> Result<CaRotated> {
    let r = st.serving()?;
    let trellis = procs::exe("trellis")?;
    let state = procs::path_str(&r.state_dir)?;
    let read = |path: &std::path::Path| std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()));
    let old = trellis_pki::Ca::load(&read(&r.state_dir.join("ca.pem"))?, &read(&r.state_dir.join("ca.key"))?)?;
    let enrolments = || -> Result<usize> {
        let audit: serde_json::Value = serde_json::from_str(&procs::admin(st, &["audit", "list", "--json"])?)?;
        Ok(audit.as_array().map_or(0, |a| a.iter().filter(|r| r["action"] == "node enrolled").count()))
    };
    let enrolled_before = enrolments()?;
    let at = Instant::now();
    crate::net::in_ns(&r.ns, &[procs::path_str(&trellis)?, "rotate", "ca", "--overlap", "1h", "--state-dir", state])?;
    let next_pem = read(&r.state_dir.join("ca.next.pem"))?;
    let next = trellis_pki::inspect_pem(&next_pem)?.fingerprint;
    let running: Vec<&String> = st.agents.iter().filter(|a| !st.paused.contains(a)).collect();
    let agent_dir = |node: &str| st.dir.join(format!("agent-{node}"));
    let done = |node: &str| {
        let dir = agent_dir(node);
        let trusts = read(&dir.join("ca.pem")).ok().and_then(|p| trellis_pki::inspect_pem(&p).ok()).map(|i| i.fingerprint);
        let holds = read(&dir.join("node.pem")).ok().and_then(|c| trellis_pki::issued_by_ca(&c, &next_pem).ok());
        trusts == Some(next) && !dir.join("ca.next.pem").exists() && holds == Some(true)
    };
    loop {
        let left: Vec<&String> = running.iter().copied().filter(|n| !done(n)).collect();
        if left.is_empty() {
            break;
        }
        if at.elapsed() > limit {
            bail!("{} s after the CA rotation started, these agents do not trust only the new CA: {left:?}", limit.as_secs());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = at.elapsed();
    let status: serde_json::Value = serde_json::from_str(&procs::admin(st, &["rotate", "status", "--json"])?)?;
    let rotation = status.as_array().and_then(|a| a.iter().find(|r| r["kind"] == "ca")).cloned().unwrap_or_default();
    let completed_by = rotation["completed_by"].as_str().unwrap_or("nothing: not completed").to_string();
    let agent = procs::exe("trellis-agent")?;
    let mut refused = 0;
    for node in &running {
        let (dir, forged) = (agent_dir(node), st.dir.join(format!("forged-ca-{node}")));
        let _ = std::fs::remove_dir_all(&forged);
        trellis_files::private_dir(&forged)?;
        for f in ["identity.toml", "ca.pem"] {
            std::fs::copy(dir.join(f), forged.join(f)).with_context(|| format!("cannot copy {node}'s {f}"))?;
        }
        let mesh = read(&dir.join("identity.toml"))?
            .lines()
            .find_map(|l| l.strip_prefix("mesh = \"").map(|m| m.trim_end_matches('"').to_string()))
            .unwrap_or_default();
        let (key, csr) = trellis_pki::node_key_and_csr(node)?;
        // Any serial: the attacker picks it.
        let mut serial = [0x5a; 16];
        for (s, b) in serial.iter_mut().zip(node.bytes()) {
            *s ^= b;
        }
        let cert = old.sign_node(&csr, node, &mesh, std::time::SystemTime::now(), Duration::from_secs(3600), serial)?;
        trellis_files::replace(&forged.join("node.key"), key.as_bytes(), 0o600)?;
        trellis_files::replace(&forged.join("node.pem"), cert.cert_pem.as_bytes(), 0o644)?;
        let out = crate::net::ns_cmd(&format!("{}-{node}", st.prefix), &[procs::path_str(&agent)?])
            .args(["renew", "--force", "--state-dir", procs::path_str(&forged)?])
            .output()
            .context("cannot run trellis-agent renew")?;
        let said = String::from_utf8_lossy(&out.stderr);
        if out.status.success() || !said.contains("UnknownCA") {
            bail!("the controller did not refuse {node}'s certificate issued with the retired CA's key: {}", said.trim());
        }
        refused += 1;
    }
    Ok(CaRotated { took, completed_by, refused, enrolled_again: enrolments()? - enrolled_before })
}
