//! The lab's timings: from token redemption to the first packet over the overlay, and from a
//! re-apply until every node converged.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ipnet::IpNet;

use crate::net::ns_cmd;
use crate::procs;
use crate::LabState;

/// The overlay address of the first peer a node dials itself (one with an `Endpoint`), read with
/// the core's `wireguard.conf` reader; none when the node has no file yet or dials no one.
fn dialled_peer(conf: &Path) -> Result<Option<IpAddr>> {
    let Ok(text) = std::fs::read_to_string(conf) else { return Ok(None) };
    let wg = trellis_core::wgconf::parse(&text).map_err(|e| anyhow::anyhow!("{}: {e}", conf.display()))?;
    let Some(peer) = wg.peers.iter().find(|p| p.endpoint.is_some()) else { return Ok(None) };
    let Some(first) = peer.allowed_ips.first() else { return Ok(None) };
    let net: IpNet = first.parse().with_context(|| format!("{}: AllowedIPs entry {first:?} is not an address/prefix", conf.display()))?;
    Ok(Some(net.addr()))
}

/// Every enrolled node at once pings a peer it dials itself; the milliseconds from its token's
/// redemption to the first answer, per node (nodes that dial no one, or get no answer within
/// 30 s, are left out).
pub(crate) fn first_packets(
    decl: &trellis_core::Declaration,
    host_ns: &HashMap<String, String>,
    redeemed: &HashMap<String, Instant>,
    st: &LabState,
) -> Result<BTreeMap<String, u64>> {
    let mut probes = Vec::new();
    for node in decl.nodes.iter().filter(|n| n.public_key.is_none()) {
        let conf = st.dir.join(format!("root-{}/{}", node.name, trellis_core::compile::WIREGUARD_CONF));
        let Some(target) = dialled_peer(&conf)? else { continue };
        let target = target.to_string();
        let (ns, since, name) = (host_ns[&node.name].clone(), redeemed[&node.name], node.name.clone());
        probes.push(std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if ns_cmd(&ns, &["ping", "-c", "1", "-W", "1", &target])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    return Some((name, since.elapsed().as_millis() as u64));
                }
            }
            None
        }));
    }
    let mut out = BTreeMap::new();
    for p in probes {
        if let Ok(Some((name, ms))) = p.join() {
            out.insert(name, ms);
        }
    }
    Ok(out)
}

/// Applies the declaration with one node more (which changes every node's zone) and times until
/// every node converged; the caller applies the original again.
pub(crate) fn reapply(ctl_ns: &str, decl_dir: &Path, st: &LabState) -> Result<Duration> {
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
    let t0 = Instant::now();
    procs::apply(ctl_ns, &changed, st)?;
    procs::converge(ctl_ns, st, Duration::from_secs(60))?;
    Ok(t0.elapsed())
}
