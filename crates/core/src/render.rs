//! Rendering plans into the files a node receives: `wireguard.conf` (wg-quick format without
//! `PrivateKey`), `nftables.conf` (one `table inet trellis`, replaced atomically by `nft -f`) and
//! `mesh.zone` (a master file for the mesh domain holding only the names the node may reach).

use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use sha2::{Digest, Sha256};

use crate::compile::{FileResource, NodePlan, NodeText, MESH_ZONE, NFTABLES_CONF, NODE_TOML, WIREGUARD_CONF};
use crate::decl::{Proto, PublicKey, KEEPALIVE_SECS};
use crate::text::{Text, TextBuilder};
use crate::topology::{ResolvedRule, Topology};

pub fn files(plan: &NodePlan) -> Vec<FileResource> {
    vec![
        FileResource { path: WIREGUARD_CONF.into(), mode: 0o600, content: wireguard(plan) },
        FileResource { path: NFTABLES_CONF.into(), mode: 0o644, content: nftables(plan) },
        FileResource { path: MESH_ZONE.into(), mode: 0o644, content: zone(plan) },
        FileResource { path: NODE_TOML.into(), mode: 0o644, content: node_toml(plan).into() },
    ]
}

/// What the agent needs to know about its own node beyond the three files: the interface, the
/// zone's name, and whether it relays for others (a hub forwards between overlay peers).
pub fn node_toml(plan: &NodePlan) -> String {
    let c = &plan.common;
    format!(
        "# trellis: settings of node {} in mesh {}. Generated; do not edit.\nnode = \"{}\"\nmesh = \"{}\"\ninterface = \"{}\"\nzone = \"{}\"\nhub = {}\n",
        plan.node, c.mesh, plan.node, c.mesh, c.interface, c.domain, plan.hub
    )
}

/// A node's `wireguard.conf`. A peer that relays for no one is written the same way in every
/// file that has it the same way (key, endpoint, keepalive), so that text is made once and
/// shared (`NodeText::peer_block`).
pub fn wireguard(plan: &NodePlan) -> Text {
    let c = &plan.common;
    let mut s = TextBuilder::with_capacity(plan.peers.len() + 2, 256);
    let _ = writeln!(s, "# trellis: WireGuard overlay of node {} in mesh {}. Generated; do not edit.", plan.node, c.mesh);
    s.push_str("# The agent adds the PrivateKey it holds; the controller never sees it.\n");
    s.push_str("[Interface]\n");
    let mut addrs = Vec::new();
    if let Some(a) = plan.ipv4 {
        addrs.push(format!("{a}/{}", c.ipv4_prefix));
    }
    if let Some(a) = plan.ipv6 {
        addrs.push(format!("{a}/{}", c.ipv6_prefix));
    }
    let _ = writeln!(s, "Address = {}", addrs.join(", "));
    let _ = writeln!(s, "ListenPort = {}", c.port);
    let _ = writeln!(s, "MTU = {}", c.mtu);
    for p in &plan.peers {
        s.push_shared(&p.block);
        for r in &p.relays_for {
            s.push_shared(&r.relay_lines);
        }
    }
    if !plan.left_out.is_empty() {
        let names: Vec<&str> = plan.left_out.iter().map(|n| &**n).collect();
        let _ = writeln!(s, "\n# Left out until they enrol (no public key yet): {}", names.join(", "));
    }
    if !plan.no_path.is_empty() {
        let names: Vec<&str> = plan.no_path.iter().map(|n| &**n).collect();
        let _ = writeln!(s, "\n# No path (see `trellis explain`): {}", names.join(", "));
    }
    s.finish()
}

/// The head of one `[Peer]` section, with the blank line before it: `node` with `key`, dialled
/// at `endpoint` (kept open with `keepalive`). A hub that relays for the holder is followed by
/// the `relay_lines` of each node it relays for (one more `AllowedIPs` line each: WireGuard
/// adds up the lines of a peer), so a node joining behind a hub adds its lines and leaves the
/// rest of the section as it was.
pub fn peer_block(node: &NodeText, key: PublicKey, endpoint: Option<SocketAddr>, keepalive: bool, relays: bool) -> String {
    let mut s = String::with_capacity(256);
    s.push('\n');
    let how = match (endpoint, keepalive) {
        (Some(_), true) => "this node dials it and keeps the path open",
        (Some(_), false) => "either side dials",
        (None, _) => "it dials this node",
    };
    let _ = write!(s, "# {}: {how}", node.name);
    if relays {
        s.push_str("; relays for the nodes named below");
    }
    s.push('\n');
    s.push_str("[Peer]\n");
    let _ = writeln!(s, "PublicKey = {key}");
    if !node.allowed.is_empty() {
        let _ = writeln!(s, "AllowedIPs = {}", node.allowed);
    }
    if let Some(e) = endpoint {
        let _ = writeln!(s, "Endpoint = {e}");
    }
    if keepalive {
        let _ = writeln!(s, "PersistentKeepalive = {KEEPALIVE_SECS}");
    }
    s
}

/// A relayed node's lines in the `[Peer]` section of the hub that relays for it.
pub fn relay_lines(name: &str, allowed: &str) -> String {
    if allowed.is_empty() {
        return format!("# relays for {name}\n");
    }
    format!("# relays for {name}\nAllowedIPs = {allowed}\n")
}

pub fn nftables(plan: &NodePlan) -> Text {
    let iface = &plan.common.interface;
    let mut s = TextBuilder::with_capacity(plan.rules.len() * 2 + 2, 512);
    let _ = writeln!(s, "# trellis: inbound filter of node {} in mesh {}. Generated; do not edit.", plan.node, plan.common.mesh);
    s.push_str("# Loaded with `nft -f`: the whole file is one transaction, so the table is replaced atomically.\n");
    s.push_str("table inet trellis {\n}\ndelete table inet trellis\n\n");
    s.push_str("table inet trellis {\n\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n");
    let _ = writeln!(s, "\t\tiifname != \"{iface}\" accept");
    s.push_str("\t\tct state established,related accept\n\t\tct state invalid drop\n");
    for r in &plan.rules {
        s.push_shared(r);
    }
    let _ = writeln!(s, "\t\tiifname \"{iface}\" drop comment \"trellis: no rule admits this new inbound traffic\"");
    s.push_str("\t}\n}\n");
    s.finish()
}

/// The filter lines of one rule: the same on every node that runs the module.
pub fn rule_block(topo: &Topology, r: &ResolvedRule) -> String {
    let iface = &topo.decl.mesh.interface;
    let from: Vec<String> = r.rule.from.iter().map(|s| s.to_string()).collect();
    let from = from.join(", ");
    let ports: Vec<String> = r.rule.ports.iter().map(|p| p.to_string()).collect();
    let what = match r.rule.proto {
        Proto::Icmp => "icmp".to_string(),
        p => format!("{p} {}", ports.join(", ")),
    };
    let mut s = String::new();
    let _ = writeln!(s, "\t\t# module {}, rule {}: {what} from {from}", r.module, r.number);
    let mut comment = format!("{} rule {}: from {from}", r.module, r.number);
    if comment.len() > 120 {
        let mut cut = 117;
        while !comment.is_char_boundary(cut) {
            cut -= 1;
        }
        comment.truncate(cut);
        comment.push_str("...");
    }
    let mut v4: Vec<_> = r.sources.iter().filter_map(|&i| topo.ipv4[i as usize]).collect();
    let mut v6: Vec<_> = r.sources.iter().filter_map(|&i| topo.ipv6[i as usize]).collect();
    v4.sort_unstable();
    v6.sort_unstable();
    if v4.is_empty() && v6.is_empty() {
        s.push_str("\t\t# its sources name no node: nothing is accepted\n");
        return s;
    }
    let family = |s: &mut String, fam: &str, l4: &str, addrs: &[String]| {
        let _ = write!(s, "\t\tiifname \"{iface}\" {fam} saddr {{ {} }} ", addrs.join(", "));
        match r.rule.proto {
            Proto::Icmp => {
                let _ = write!(s, "meta l4proto {l4}");
            }
            p => {
                let _ = write!(s, "{p} dport {{ {} }}", ports.join(", "));
            }
        }
        let _ = writeln!(s, " accept comment \"{comment}\"");
    };
    if !v4.is_empty() {
        family(&mut s, "ip", "icmp", &v4.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    }
    if !v6.is_empty() {
        family(&mut s, "ip6", "ipv6-icmp", &v6.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    }
    s
}

/// Address records, one line each, for names with their addresses.
pub fn zone_records<'n>(names: impl Iterator<Item = (&'n str, Option<Ipv4Addr>, Option<Ipv6Addr>)>) -> String {
    let mut records = String::new();
    for (name, v4, v6) in names {
        if let Some(a) = v4 {
            let _ = writeln!(records, "{name}\tIN\tA\t{a}");
        }
        if let Some(a) = v6 {
            let _ = writeln!(records, "{name}\tIN\tAAAA\t{a}");
        }
    }
    records
}

/// A node's zone: the names it may resolve (see `NodePlan::zone`) and nothing else. The serial is
/// derived from the records (the module blocks by their digests), so it changes when they do.
pub fn zone(plan: &NodePlan) -> Text {
    let domain = &plan.common.domain;
    let mut hash = Sha256::new();
    for z in &plan.zone {
        hash.update(z.records_hash);
    }
    for m in &plan.zone_modules {
        hash.update(m.digest);
    }
    let digest = hash.finalize();
    let serial = u32::from_be_bytes(digest[..4].try_into().expect("4 bytes")) & 0x7fff_ffff;
    let mut s = TextBuilder::with_capacity(plan.zone_modules.len() + 1, 256 + plan.zone.iter().map(|z| z.records.len()).sum::<usize>());
    let _ = writeln!(s, "; trellis: zone {domain} of mesh {} as node {} sees it. Generated; do not edit.", plan.common.mesh, plan.node);
    let _ = writeln!(s, "$ORIGIN {domain}.");
    s.push_str("$TTL 60\n");
    let _ = writeln!(s, "@\tIN\tSOA\tns.{domain}. hostmaster.{domain}. {serial} 3600 600 86400 60");
    let _ = writeln!(s, "@\tIN\tNS\tns.{domain}.");
    // A node's records are a line or two: copied, which costs less than sharing them.
    for z in &plan.zone {
        s.push_str(&z.records);
    }
    for m in &plan.zone_modules {
        s.push_shared(&m.records);
    }
    s.finish()
}
