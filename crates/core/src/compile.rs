//! The compiler: a validated declaration, the known WireGuard keys and the previous address
//! allocation in; every node's plan and file resources out. Pure: no IO, no clock.
//!
//! A recompile given the previous output recomputes every node's plan (cheap: proportional to the
//! allowed-traffic relation) and renders files only for nodes whose plan changed.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use crate::alloc::{allocate, Allocation};
use crate::decl::{Declaration, PublicKey};
use crate::diag::{self, Diagnostic};
use crate::par;
use crate::render;
use crate::topology::{Path, Topology};

pub const WIREGUARD_CONF: &str = "etc/trellis/wireguard.conf";
pub const NFTABLES_CONF: &str = "etc/trellis/nftables.conf";
pub const MESH_ZONE: &str = "etc/trellis/mesh.zone";
pub const NODE_TOML: &str = "etc/trellis/node.toml";
/// The mesh CA and the node's certificate, added to each bundle by the controller.
pub const CA_PEM: &str = "etc/trellis/ca.pem";
pub const NODE_PEM: &str = "etc/trellis/node.pem";
/// Every file a bundle may carry; an agent writes nothing else.
pub const DELIVERED: &[&str] = &[WIREGUARD_CONF, NFTABLES_CONF, MESH_ZONE, NODE_TOML, CA_PEM, NODE_PEM];

/// One file to write on a node, relative to the agent's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileResource {
    pub path: String,
    pub mode: u32,
    pub content: Arc<str>,
}

/// Everything that decides one node's files. Two equal plans render to equal files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    pub node: Arc<str>,
    pub common: Arc<Common>,
    pub hub: bool,
    pub ipv4: Option<std::net::Ipv4Addr>,
    pub ipv6: Option<std::net::Ipv6Addr>,
    pub peers: Vec<PeerPlan>,
    /// Nodes this one has traffic with whose key is not known yet.
    pub left_out: Vec<Arc<str>>,
    /// Nodes this one has traffic with but no path to.
    pub no_path: Vec<Arc<str>>,
    /// Pre-rendered filter blocks of the rules of the modules this node runs.
    pub rules: Vec<Arc<str>>,
    /// The names this node may resolve, in record order: itself and every node it has allowed
    /// traffic with (either direction), in name order; then each module it may reach, in name
    /// order, once per node that runs it. Nothing else: other names are NXDOMAIN.
    pub zone: Vec<ZoneName>,
}

/// One name of a node's zone and the overlay addresses it resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneName {
    pub name: Arc<str>,
    pub ipv4: Option<std::net::Ipv4Addr>,
    pub ipv6: Option<std::net::Ipv6Addr>,
}

/// What every node of the mesh shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Common {
    pub mesh: String,
    pub interface: String,
    pub port: u16,
    pub mtu: u16,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    /// The DNS zone's name (the mesh domain).
    pub domain: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerPlan {
    pub name: Arc<str>,
    pub key: PublicKey,
    /// The endpoint this node dials, if it dials this peer.
    pub endpoint: Option<SocketAddr>,
    /// Set on the side that dials a peer which cannot dial back.
    pub keepalive: bool,
    /// Overlay addresses routed to this peer: its own, then those of nodes it relays for.
    pub allowed: Vec<IpAddr>,
    /// Nodes whose traffic this peer relays (it is a hub).
    pub relays_for: Vec<Arc<str>>,
}

#[derive(Clone, Debug)]
pub struct NodeOutput {
    pub plan: NodePlan,
    pub files: Vec<FileResource>,
}

#[derive(Clone, Debug)]
pub struct Compiled {
    pub allocation: Allocation,
    pub nodes: BTreeMap<String, NodeOutput>,
    /// Warnings about the compiled mesh: pairs with no path, nodes left out for want of a key.
    pub diagnostics: Vec<Diagnostic>,
    /// Names of the nodes whose files were rendered by this compile (all of them on a first
    /// compile; on a recompile, those whose plan changed).
    pub rendered: Vec<String>,
    /// The filter block of every rule, shared by the plans of the nodes that run its module.
    pub rule_blocks: Vec<Arc<str>>,
}

/// Compiles every node. `previous` is the output of the last compile, if any: its allocation keeps
/// addresses stable and its plans let unchanged nodes keep their files without rendering.
pub fn compile(
    decl: &Declaration,
    keys: &HashMap<String, PublicKey>,
    previous_allocation: &Allocation,
    previous: Option<&Compiled>,
) -> Result<Compiled, Diagnostic> {
    let allocation = allocate(decl, previous.map_or(previous_allocation, |p| &p.allocation))?;
    let topo = Topology::new(decl, &allocation, keys);
    let (plans, rule_blocks) = plan(&topo, previous);
    let mut diagnostics = diagnose(&topo, &plans);
    diag::sort(&mut diagnostics);

    let render_needed: Vec<bool> =
        plans.iter().map(|p| previous.and_then(|c| c.nodes.get(&*p.node)).is_none_or(|o| o.plan != *p)).collect();
    let files = par::map(plans.len(), |i| render_needed[i].then(|| render::files(&plans[i])));
    let mut nodes = BTreeMap::new();
    let mut rendered = Vec::new();
    for (plan, files) in plans.into_iter().zip(files) {
        let name = plan.node.to_string();
        let files = match files {
            Some(f) => {
                rendered.push(name.clone());
                f
            }
            None => previous.expect("only re-used with a previous compile").nodes[&name].files.clone(),
        };
        nodes.insert(name, NodeOutput { plan, files });
    }
    Ok(Compiled { allocation, nodes, diagnostics, rendered, rule_blocks })
}

/// Every node's plan, in name order. Parts shared by many nodes (the common settings and zone,
/// the rendered rules) are taken from `previous` when unchanged, so that comparing a node's plan
/// with its previous one is a pointer comparison for them.
pub fn plan(topo: &Topology, previous: Option<&Compiled>) -> (Vec<NodePlan>, Vec<Arc<str>>) {
    let n = topo.nodes.len();
    let names: Vec<Arc<str>> = topo.nodes.iter().map(|n| Arc::from(n.name.as_str())).collect();
    let partners = topo.partners();
    let paths: Vec<Vec<(u32, Path)>> = par::map(n, |a| partners[a].iter().map(|&b| (b, topo.path(a as u32, b, true))).collect());
    // Hubs keep a peer entry for every node they relay for.
    let mut relayed_by: Vec<Vec<u32>> = vec![Vec::new(); n];
    for (a, list) in paths.iter().enumerate() {
        for &(_, p) in list {
            if let Path::Relay { hub } = p {
                relayed_by[hub as usize].push(a as u32);
            }
        }
    }
    for list in &mut relayed_by {
        list.sort_unstable();
        list.dedup();
    }
    let reached = topo.modules_reached();
    let common = Common {
        mesh: topo.decl.mesh.name.clone(),
        interface: topo.decl.mesh.interface.clone(),
        port: topo.decl.mesh.port,
        mtu: topo.decl.mesh.mtu,
        ipv4_prefix: topo.decl.mesh.overlay_ipv4.map_or(32, |p| p.prefix_len()),
        ipv6_prefix: topo.decl.mesh.overlay_ipv6.map_or(128, |p| p.prefix_len()),
        domain: topo.decl.mesh.domain.clone(),
    };
    let old_common = previous.and_then(|c| c.nodes.values().next()).map(|o| &o.plan.common);
    let common = match old_common {
        Some(old) if **old == common => old.clone(),
        _ => Arc::new(common),
    };
    let old_blocks: HashMap<&str, &Arc<str>> = previous.into_iter().flat_map(|c| c.rule_blocks.iter()).map(|b| (&**b, b)).collect();
    let rule_blocks: Vec<Arc<str>> = topo
        .rules
        .iter()
        .map(|r| {
            let text = render::rule_block(topo, r);
            old_blocks.get(text.as_str()).map_or_else(|| Arc::from(text), |b| (*b).clone())
        })
        .collect();
    let plans = par::map(n, |a| {
        let me = a as u32;
        let addrs = |i: u32| -> Vec<IpAddr> {
            let i = i as usize;
            topo.ipv4[i].map(IpAddr::V4).into_iter().chain(topo.ipv6[i].map(IpAddr::V6)).collect()
        };
        let mut peers: BTreeMap<u32, PeerPlan> = BTreeMap::new();
        let entry = |peers: &mut BTreeMap<u32, PeerPlan>, b: u32| {
            let dials = topo.dials(me, b);
            let dialled = topo.dials(b, me).is_some();
            let key = topo.keys[b as usize].expect("peers have keys");
            peers.entry(b).or_insert_with(|| PeerPlan {
                name: names[b as usize].clone(),
                key,
                endpoint: dials.map(|e| topo.nodes[b as usize].endpoints[e].address),
                keepalive: dials.is_some() && !dialled,
                allowed: addrs(b),
                relays_for: Vec::new(),
            });
        };
        let mut left_out = Vec::new();
        let mut no_path = Vec::new();
        for &(b, path) in &paths[a] {
            if topo.keys[b as usize].is_none() {
                left_out.push(names[b as usize].clone());
                continue;
            }
            match path {
                Path::Direct { .. } => entry(&mut peers, b),
                Path::Relay { hub } => {
                    entry(&mut peers, hub);
                    let p = peers.get_mut(&hub).expect("just inserted");
                    p.allowed.extend(addrs(b));
                    p.relays_for.push(names[b as usize].clone());
                }
                Path::None => no_path.push(names[b as usize].clone()),
            }
        }
        for &c in &relayed_by[a] {
            if topo.keys[c as usize].is_some() {
                entry(&mut peers, c);
            }
        }
        let rules = topo.inbound_rules(me).map(|(i, _)| rule_blocks[i].clone()).collect();
        let zone_name = |name: &Arc<str>, i: u32| ZoneName { name: name.clone(), ipv4: topo.ipv4[i as usize], ipv6: topo.ipv6[i as usize] };
        let mut zone = Vec::with_capacity(partners[a].len() + 1);
        let mut own = Some(me);
        for &b in &partners[a] {
            if let Some(m) = own.filter(|&m| m < b) {
                zone.push(zone_name(&names[m as usize], m));
                own = None;
            }
            zone.push(zone_name(&names[b as usize], b));
        }
        if let Some(m) = own {
            zone.push(zone_name(&names[m as usize], m));
        }
        for (module, runners) in &reached[a] {
            for &r in runners.iter() {
                zone.push(zone_name(module, r));
            }
        }
        NodePlan {
            node: names[a].clone(),
            common: common.clone(),
            hub: topo.nodes[a].hub,
            ipv4: topo.ipv4[a],
            ipv6: topo.ipv6[a],
            peers: peers.into_values().collect(),
            left_out,
            no_path,
            rules,
            zone,
        }
    });
    (plans, rule_blocks)
}

fn diagnose(topo: &Topology, plans: &[NodePlan]) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let mut wanted_by: BTreeMap<&str, usize> = BTreeMap::new();
    for p in plans {
        for b in &p.left_out {
            *wanted_by.entry(b).or_default() += 1;
        }
        for b in &p.no_path {
            if *p.node < **b {
                let node = topo.nodes[topo.index[&*p.node] as usize];
                out.push(Diagnostic::warning(&node.loc, no_path_message(topo, &p.node, b)));
            }
        }
    }
    for (b, count) in wanted_by {
        let node = topo.nodes[topo.index[b] as usize];
        out.push(Diagnostic::warning(
            &node.loc,
            format!(
                "node `{b}` has no public key yet (not enrolled); it is left out of the peer lists of {count} node(s) until it has one"
            ),
        ));
    }
    out
}

/// Why two nodes with allowed traffic have no path.
pub fn no_path_message(topo: &Topology, a: &str, b: &str) -> String {
    if let Path::Relay { hub } = topo.path(topo.index[a], topo.index[b], false) {
        return format!(
            "no path between `{a}` and `{b}` yet: hub `{}` could relay for them but has no public key yet (not enrolled)",
            topo.name(hub)
        );
    }
    let hubs =
        if topo.hubs.is_empty() { "the mesh declares no hub".to_string() } else { "no declared hub can be reached by both".to_string() };
    format!("no path between `{a}` and `{b}`: neither can dial an endpoint of the other and {hubs}; declare an endpoint reachable from the other's networks, or a hub both can reach")
}
