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
use crate::topology::{NodeSet, Path, Reach, Topology};

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
    /// What the next compile starts from.
    cache: Option<Box<Cache>>,
}

/// What a compile keeps so that the next one, given only new keys, recomputes only the nodes the
/// change reaches. Positions are node positions in name order.
#[derive(Clone, Debug)]
struct Cache {
    decl: Arc<Declaration>,
    names: Vec<Arc<str>>,
    /// Position in name order to index in `decl.nodes`.
    order: Vec<u32>,
    index: HashMap<Arc<str>, u32>,
    ipv4: Vec<Option<std::net::Ipv4Addr>>,
    ipv6: Vec<Option<std::net::Ipv6Addr>>,
    keys: Vec<Option<PublicKey>>,
    reach: Reach,
    partners: Vec<NodeSet>,
    paths: Vec<Vec<(u32, Path)>>,
    relayed_by: Vec<Vec<u32>>,
}

impl Cache {
    fn loc(&self, a: u32) -> crate::Loc {
        self.decl.nodes[self.order[a as usize] as usize].loc.clone()
    }

    fn endpoint(&self, b: u32, e: usize) -> SocketAddr {
        self.decl.nodes[self.order[b as usize] as usize].endpoints[e].address
    }
}

/// Compiles every node. `previous` is the output of the last compile, if any: its allocation keeps
/// addresses stable, its plans let unchanged nodes keep their files without rendering, and when
/// only keys changed (the same declaration: a node enrolled, was re-keyed, approved or revoked)
/// only the changed nodes, the nodes they have traffic with and the hubs that relay for them are
/// recomputed. The result is the same as a compile without `previous`, byte for byte.
pub fn compile(
    decl: &Arc<Declaration>,
    keys: &HashMap<String, PublicKey>,
    previous_allocation: &Allocation,
    previous: Option<Compiled>,
) -> Result<Compiled, Diagnostic> {
    let previous = match previous {
        Some(p) => match rekey(decl, keys, p) {
            Rekeyed::Done(done) => return Ok(done),
            Rekeyed::NotApplicable(p) => Some(p),
        },
        None => None,
    };
    let previous = previous.as_ref();
    let allocation = allocate(decl, previous.map_or(previous_allocation, |p| &p.allocation))?;
    let topo = Topology::new(decl, &allocation, keys);
    let (plans, rule_blocks, cache) = plan(decl, &topo, previous);
    let mut diagnostics = path_diagnostics(plans.iter(), &cache);
    diagnostics.extend(left_out_diagnostics(plans.iter(), |b| cache.loc(cache.index[b])));
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
    Ok(Compiled { allocation, nodes, diagnostics, rendered, rule_blocks, cache: Some(Box::new(cache)) })
}

enum Rekeyed {
    Done(Compiled),
    /// The previous output, given back: the change is not one of keys only.
    NotApplicable(Compiled),
}

/// The recompile for a change of keys only: the same declaration (so the same allocation, rules,
/// zones and paths), some nodes with another key or none. Gives `previous` back when it does not
/// apply (another declaration, or a hub's key changed, which can change which hub relays).
fn rekey(decl: &Arc<Declaration>, keys: &HashMap<String, PublicKey>, mut previous: Compiled) -> Rekeyed {
    let Some(cache) = previous.cache.as_ref() else { return Rekeyed::NotApplicable(previous) };
    if !Arc::ptr_eq(decl, &cache.decl) && **decl != *cache.decl {
        return Rekeyed::NotApplicable(previous);
    }
    let new_keys: Vec<Option<PublicKey>> = (0..cache.names.len())
        .map(|a| decl.nodes[cache.order[a] as usize].public_key.or_else(|| keys.get(&*cache.names[a]).copied()))
        .collect();
    let changed: Vec<u32> = (0..new_keys.len() as u32).filter(|&a| new_keys[a as usize] != cache.keys[a as usize]).collect();
    previous.rendered.clear();
    if changed.is_empty() {
        return Rekeyed::Done(previous);
    }
    if cache.reach.hub_keys_differ(&new_keys, &cache.keys) {
        return Rekeyed::NotApplicable(previous);
    }
    let cache = previous.cache.as_mut().expect("checked above");
    cache.keys = new_keys;
    let mut affected: Vec<u32> = changed.clone();
    for &k in &changed {
        affected.extend_from_slice(&cache.partners[k as usize]);
    }
    for &h in &cache.reach.hubs {
        if changed.iter().any(|k| cache.relayed_by[h as usize].binary_search(k).is_ok()) {
            affected.push(h);
        }
    }
    affected.sort_unstable();
    affected.dedup();
    for &a in &affected {
        let name = &cache.names[a as usize];
        let out = previous.nodes.get_mut(&**name).expect("every node has an output");
        let (peers, left_out, no_path) = peers_of(cache, a);
        if (&peers, &left_out, &no_path) == (&out.plan.peers, &out.plan.left_out, &out.plan.no_path) {
            continue;
        }
        out.plan.peers = peers;
        out.plan.left_out = left_out;
        out.plan.no_path = no_path;
        out.files = render::files(&out.plan);
        previous.rendered.push(name.to_string());
    }
    let plans = || previous.nodes.values().map(|o| &o.plan);
    let mut diagnostics = path_diagnostics(plans(), cache);
    diagnostics.extend(left_out_diagnostics(plans(), |b| cache.loc(cache.index[b])));
    diag::sort(&mut diagnostics);
    previous.diagnostics = diagnostics;
    Rekeyed::Done(previous)
}

/// A node's peers, the nodes left out for want of a key, and those with no path, from its paths
/// and the keys.
fn peers_of(c: &Cache, me: u32) -> (Vec<PeerPlan>, Vec<Arc<str>>, Vec<Arc<str>>) {
    let addrs = |i: u32| -> Vec<IpAddr> {
        let i = i as usize;
        c.ipv4[i].map(IpAddr::V4).into_iter().chain(c.ipv6[i].map(IpAddr::V6)).collect()
    };
    let mut peers: BTreeMap<u32, PeerPlan> = BTreeMap::new();
    let entry = |peers: &mut BTreeMap<u32, PeerPlan>, b: u32| {
        let dials = c.reach.dials(me, b);
        let dialled = c.reach.dials(b, me).is_some();
        let key = c.keys[b as usize].expect("peers have keys");
        peers.entry(b).or_insert_with(|| PeerPlan {
            name: c.names[b as usize].clone(),
            key,
            endpoint: dials.map(|e| c.endpoint(b, e)),
            keepalive: dials.is_some() && !dialled,
            allowed: addrs(b),
            relays_for: Vec::new(),
        });
    };
    let mut left_out = Vec::new();
    let mut no_path = Vec::new();
    for &(b, path) in &c.paths[me as usize] {
        if c.keys[b as usize].is_none() {
            left_out.push(c.names[b as usize].clone());
            continue;
        }
        match path {
            Path::Direct { .. } => entry(&mut peers, b),
            Path::Relay { hub } => {
                entry(&mut peers, hub);
                let p = peers.get_mut(&hub).expect("just inserted");
                p.allowed.extend(addrs(b));
                p.relays_for.push(c.names[b as usize].clone());
            }
            Path::None => no_path.push(c.names[b as usize].clone()),
        }
    }
    for &r in &c.relayed_by[me as usize] {
        if c.keys[r as usize].is_some() {
            entry(&mut peers, r);
        }
    }
    (peers.into_values().collect(), left_out, no_path)
}

/// Every node's plan, in name order, and what the next compile keeps. Parts shared by many nodes
/// (the common settings, the rendered rules) are taken from `previous` when unchanged, so that
/// comparing a node's plan with its previous one is a pointer comparison for them.
fn plan(decl: &Arc<Declaration>, topo: &Topology, previous: Option<&Compiled>) -> (Vec<NodePlan>, Vec<Arc<str>>, Cache) {
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
    let position: HashMap<*const crate::decl::Node, u32> =
        topo.decl.nodes.iter().enumerate().map(|(i, node)| (node as *const _, i as u32)).collect();
    let cache = Cache {
        decl: decl.clone(),
        order: topo.nodes.iter().map(|node| position[&(*node as *const _)]).collect(),
        index: names.iter().enumerate().map(|(i, n)| (n.clone(), i as u32)).collect(),
        names,
        ipv4: topo.ipv4.clone(),
        ipv6: topo.ipv6.clone(),
        keys: topo.keys.clone(),
        reach: topo.reach.clone(),
        partners,
        paths,
        relayed_by,
    };
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
    let (names, partners) = (&cache.names, &cache.partners);
    let plans = par::map(n, |a| {
        let me = a as u32;
        let (peers, left_out, no_path) = peers_of(&cache, me);
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
            peers,
            left_out,
            no_path,
            rules,
            zone,
        }
    });
    (plans, rule_blocks, cache)
}

/// Warnings about pairs of nodes with allowed traffic but no path, once per pair (reported by
/// the node whose name sorts first, when the other has a key).
fn path_diagnostics<'p>(plans: impl Iterator<Item = &'p NodePlan>, c: &Cache) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for p in plans {
        for b in &p.no_path {
            if *p.node < **b {
                let (ia, ib) = (c.index[&p.node], c.index[b]);
                let message = no_path_text(&c.reach, &p.node, b, c.reach.path(ia, ib, false), |h| &c.names[h as usize]);
                out.push(Diagnostic::warning(&c.loc(ia), message));
            }
        }
    }
    out
}

/// A warning for every node left out of peer lists for want of a key, with how many lists.
fn left_out_diagnostics<'p>(plans: impl Iterator<Item = &'p NodePlan>, loc: impl Fn(&str) -> crate::Loc) -> Vec<Diagnostic> {
    let mut wanted_by: BTreeMap<&str, usize> = BTreeMap::new();
    for p in plans {
        for b in &p.left_out {
            *wanted_by.entry(b).or_default() += 1;
        }
    }
    wanted_by
        .into_iter()
        .map(|(b, count)| {
            Diagnostic::warning(
                &loc(b),
                format!(
                    "node `{b}` has no public key yet (not enrolled); it is left out of the peer lists of {count} node(s) until it has one"
                ),
            )
        })
        .collect()
}

/// Why two nodes with allowed traffic have no path.
pub fn no_path_message(topo: &Topology, a: &str, b: &str) -> String {
    no_path_text(&topo.reach, a, b, topo.path(topo.index[a], topo.index[b], false), |h| topo.name(h))
}

/// The text of `no_path_message`, given the path the two would have if every hub had a key.
fn no_path_text<'n>(reach: &Reach, a: &str, b: &str, keyless: Path, name: impl Fn(u32) -> &'n str) -> String {
    if let Path::Relay { hub } = keyless {
        return format!(
            "no path between `{a}` and `{b}` yet: hub `{}` could relay for them but has no public key yet (not enrolled)",
            name(hub)
        );
    }
    let hubs =
        if reach.hubs.is_empty() { "the mesh declares no hub".to_string() } else { "no declared hub can be reached by both".to_string() };
    format!("no path between `{a}` and `{b}`: neither can dial an endpoint of the other and {hubs}; declare an endpoint reachable from the other's networks, or a hub both can reach")
}
