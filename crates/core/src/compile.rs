//! The compiler: a validated declaration, the known WireGuard keys and the previous address
//! allocation in; every node's plan and file resources out. Pure: no IO, no clock.
//!
//! A recompile given the previous output recomputes every node's plan (cheap: proportional to the
//! allowed-traffic relation) and renders files only for nodes whose plan changed.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::alloc::{allocate, Allocation};
use crate::decl::{Declaration, PublicKey};
use crate::diag::{self, Diagnostic};
use crate::keys::{Keys, KeysSeen};
use crate::par;
use crate::render;
use crate::text::Text;
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
    pub content: Text,
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
    /// The names this node may resolve: itself and every node it has allowed traffic with
    /// (either direction), in name order; then `zone_modules`. Nothing else: other names are
    /// NXDOMAIN.
    pub zone: Vec<Arc<NodeText>>,
    /// The modules this node may reach, in name order, each answering with every node that runs
    /// it; shared by every node that reaches the module.
    pub zone_modules: Vec<Arc<ZoneBlock>>,
    /// The routes this node routes for (it is in their `via`): its forward filter and
    /// masquerading.
    pub routes_for: Vec<Arc<RouteBlock>>,
    /// The routes this node uses that have a router it can reach: their prefixes are sent into
    /// the overlay (an exit's default prefixes by policy routing).
    pub routed: Vec<Arc<RouteUse>>,
    /// The names of hosts on the routes this node uses.
    pub zone_routes: Vec<Arc<ZoneBlock>>,
}

/// A route as the files of its routers hold it, rendered once per compile.
#[derive(Debug, PartialEq, Eq)]
pub struct RouteBlock {
    /// What its users' files hold of it.
    pub route: Arc<RouteUse>,
    /// The router's forward filter lines: each rule's sources to the prefixes.
    pub forward: Arc<str>,
    /// The router's masquerading lines (empty when the route does not masquerade).
    pub nat: Arc<str>,
}

/// A route as the files of its users hold it: what the route declares, not who uses it (so a
/// user's plan stays the same when other users come or go).
#[derive(Debug, PartialEq, Eq)]
pub struct RouteUse {
    pub name: Arc<str>,
    pub prefixes: Vec<ipnet::IpNet>,
    pub exit: bool,
    /// Its lines under the `[Peer]` section of the router a user sends it to: its name in a
    /// comment and its prefixes as one more `AllowedIPs` line.
    pub lines: Arc<str>,
}

/// A module's records in a zone, rendered once and shared by every node that may reach it.
#[derive(Debug, PartialEq, Eq)]
pub struct ZoneBlock {
    pub module: Arc<str>,
    /// The address records, one line each.
    pub records: Arc<str>,
    /// SHA-256 of `records`: a node's zone serial hashes these instead of the records.
    pub digest: [u8; 32],
}

/// A node as the files of other nodes name it, rendered once per compile: its name, its overlay
/// addresses as AllowedIPs entries, its zone records, and its `[Peer]` sections as others hold
/// them. Kept from one compile to the next while the node's name and addresses stay.
#[derive(Debug)]
pub struct NodeText {
    pub name: Arc<str>,
    pub ipv4: Option<std::net::Ipv4Addr>,
    pub ipv6: Option<std::net::Ipv6Addr>,
    /// `10.88.0.1/32, fd88::1/128`: empty when it has no overlay address.
    pub allowed: String,
    /// Its address records in a zone, one line each.
    pub records: Arc<str>,
    /// The start of SHA-256 of `records`: a zone's serial hashes these instead of the records.
    pub records_hash: [u8; 8],
    /// Its lines under the `[Peer]` section of a hub that relays for it: its name in a comment
    /// and its addresses as one more `AllowedIPs` line.
    pub relay_lines: Arc<str>,
    /// Its `[Peer]` sections made so far, by how a peer has it (key, endpoint, keepalive): most
    /// nodes are held the same way by every node that peers with them. The newest few are kept.
    blocks: std::sync::Mutex<Vec<(PeerWay, Arc<str>)>>,
}

/// How a node is held as a peer, what the head of its `[Peer]` section depends on: key,
/// endpoint, keepalive, and whether it relays for the holder.
type PeerWay = (PublicKey, Option<SocketAddr>, bool, bool);

/// How many ways of holding one node as a peer `NodeText` keeps.
const PEER_WAYS_KEPT: usize = 8;

impl PartialEq for NodeText {
    fn eq(&self, other: &NodeText) -> bool {
        (&self.name, self.ipv4, self.ipv6, &self.allowed, &self.records)
            == (&other.name, other.ipv4, other.ipv6, &other.allowed, &other.records)
    }
}

impl Eq for NodeText {}

impl NodeText {
    pub fn new(name: Arc<str>, ipv4: Option<std::net::Ipv4Addr>, ipv6: Option<std::net::Ipv6Addr>) -> NodeText {
        use sha2::Digest;
        use std::fmt::Write as _;
        let mut allowed = String::new();
        if let Some(a) = ipv4 {
            let _ = write!(allowed, "{a}/32");
        }
        if let Some(a) = ipv6 {
            let _ = write!(allowed, "{}{a}/128", if allowed.is_empty() { "" } else { ", " });
        }
        let records: Arc<str> = render::zone_records(std::iter::once((&*name, ipv4, ipv6))).into();
        let records_hash = sha2::Sha256::digest(records.as_bytes())[..8].try_into().expect("8 bytes");
        let relay_lines = render::relay_lines(&name, &allowed).into();
        NodeText { name, ipv4, ipv6, allowed, records, records_hash, relay_lines, blocks: Default::default() }
    }

    /// The head of this node's `[Peer]` section in the file of a node that has it with `key`,
    /// `endpoint` and `keepalive`, relaying through it or not (`render::peer_block`), made once.
    pub fn peer_block(self: &Arc<NodeText>, key: PublicKey, endpoint: Option<SocketAddr>, keepalive: bool, relays: bool) -> Arc<str> {
        let way = (key, endpoint, keepalive, relays);
        let mut blocks = self.blocks.lock().expect("peer blocks");
        if let Some((_, b)) = blocks.iter().find(|(w, _)| *w == way) {
            return b.clone();
        }
        let block: Arc<str> = render::peer_block(self, key, endpoint, keepalive, relays).into();
        if blocks.len() == PEER_WAYS_KEPT {
            blocks.remove(0);
        }
        blocks.push((way, block.clone()));
        block
    }
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
    /// The peer; its addresses are the first AllowedIPs.
    pub node: Arc<NodeText>,
    /// Nodes whose traffic this peer relays (it is a hub): their addresses are routed to it too.
    pub relays_for: Vec<Arc<NodeText>>,
    /// The head of its `[Peer]` section of `wireguard.conf`: its key, the endpoint this node
    /// dials (if it dials it) and whether it keeps the path open (it dials a peer that cannot
    /// dial back), made by `PeerPlan::new` and shared with every node that holds this peer the
    /// same way. The `relay_lines` of the nodes in `relays_for` follow it. Two plans of a peer
    /// with the same head hold it the same way.
    pub block: Arc<str>,
    /// The routes this node sends to this peer (it is their chosen router): their `lines`
    /// follow the relay lines.
    pub routes: Vec<Arc<RouteUse>>,
}

impl PeerPlan {
    pub fn new(
        node: Arc<NodeText>,
        key: PublicKey,
        endpoint: Option<SocketAddr>,
        keepalive: bool,
        relays_for: Vec<Arc<NodeText>>,
    ) -> PeerPlan {
        let block = node.peer_block(key, endpoint, keepalive, !relays_for.is_empty());
        PeerPlan { node, relays_for, block, routes: Vec::new() }
    }

    pub fn name(&self) -> &str {
        &self.node.name
    }

    /// The endpoint this node dials the peer at, as its section says.
    pub fn endpoint(&self) -> Option<SocketAddr> {
        self.block.lines().find_map(|l| l.strip_prefix("Endpoint = ")).and_then(|e| e.parse().ok())
    }

    /// Whether this node keeps the path to the peer open, as its section says.
    pub fn keepalive(&self) -> bool {
        self.block.lines().any(|l| l.starts_with("PersistentKeepalive = "))
    }

    /// The overlay addresses routed to this peer: its own, then those of the nodes it relays for.
    pub fn allowed(&self) -> Vec<std::net::IpAddr> {
        std::iter::once(&self.node)
            .chain(self.relays_for.iter())
            .flat_map(|t| t.ipv4.map(std::net::IpAddr::V4).into_iter().chain(t.ipv6.map(std::net::IpAddr::V6)))
            .collect()
    }
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
    /// The zone records of every module some node runs, shared by the plans of the nodes that
    /// may reach it.
    pub zone_blocks: Vec<Arc<ZoneBlock>>,
    /// What the next compile starts from.
    cache: Option<Box<Cache>>,
}

/// What a compile keeps so that the next one, given only new keys, recomputes only the nodes the
/// change reaches. Positions are node positions in name order.
#[derive(Clone, Debug)]
struct Cache {
    decl: Arc<Declaration>,
    names: Vec<Arc<str>>,
    /// Every node as others' files name it.
    texts: Vec<Arc<NodeText>>,
    /// Position in name order to index in `decl.nodes`.
    order: Vec<u32>,
    index: crate::FastMap<Arc<str>, u32>,
    ipv4: Vec<Option<std::net::Ipv4Addr>>,
    ipv6: Vec<Option<std::net::Ipv6Addr>>,
    keys: Vec<Option<PublicKey>>,
    /// The keys the declaration itself gives (a node managed outside trellis), by position.
    declared_keys: Vec<Option<PublicKey>>,
    reach: Reach,
    partners: Vec<NodeSet>,
    paths: Vec<Vec<(u32, Path)>>,
    relayed_by: Vec<Vec<u32>>,
    /// Per node, the modules it may reach, as positions in `Topology::module_names`.
    reached: Vec<Vec<u32>>,
    /// `Topology::module_names`, and each module's sources (`Topology::module_sources`): what
    /// the partners come from.
    module_names: Vec<(Arc<str>, NodeSet)>,
    module_sources: Vec<NodeSet>,
    /// Per route, its users.
    route_users: Vec<NodeSet>,
    /// Every rule of `Topology::rules` as it was resolved: its module, number, declaration and
    /// sources, what its filter block is made from (with the addresses).
    rules: Vec<(Arc<str>, usize, crate::decl::Rule, NodeSet)>,
    /// Per route, its routers in order of preference.
    route_via: Vec<Vec<u32>>,
    /// Per node, the routes it uses.
    routes_of: Vec<Vec<u32>>,
    route_blocks: Vec<Arc<RouteBlock>>,
    /// Whether each node routes for some route.
    router: Vec<bool>,
    /// Where the compile that made this cache stood in its key set: the next one reads only the
    /// names changed since.
    keys_seen: Option<KeysSeen>,
}

impl Cache {
    fn loc(&self, a: u32) -> crate::Loc {
        self.decl.nodes[self.order[a as usize] as usize].loc.clone()
    }

    fn endpoint(&self, b: u32, e: usize) -> SocketAddr {
        self.decl.nodes[self.order[b as usize] as usize].endpoints[e].address
    }

    /// `b` as a peer: `dials` is its endpoint the node dials, `dialled` whether `b` dials back.
    fn peer(&self, b: u32, dials: Option<usize>, dialled: bool, relays_for: Vec<Arc<NodeText>>) -> PeerPlan {
        PeerPlan::new(
            self.texts[b as usize].clone(),
            self.keys[b as usize].expect("peers have keys"),
            dials.map(|e| self.endpoint(b, e)),
            dials.is_some() && !dialled,
            relays_for,
        )
    }
}

/// Compiles every node. `previous` is the output of the last compile, if any: its allocation keeps
/// addresses stable, its plans let unchanged nodes keep their files without rendering, and when
/// only keys changed (the same declaration: a node enrolled, was re-keyed, approved or revoked)
/// only the changed nodes, the nodes they have traffic with and the hubs that relay for them are
/// recomputed. The result is the same as a compile without `previous`, byte for byte.
pub fn compile(
    decl: &Arc<Declaration>,
    keys: &Keys,
    previous_allocation: &Allocation,
    previous: Option<Compiled>,
) -> Result<Compiled, Diagnostic> {
    let mut done = compile_from(decl, keys, previous_allocation, previous)?;
    if let Some(cache) = done.cache.as_mut() {
        cache.keys_seen = Some(keys.seen());
    }
    Ok(done)
}

fn compile_from(
    decl: &Arc<Declaration>,
    keys: &Keys,
    previous_allocation: &Allocation,
    previous: Option<Compiled>,
) -> Result<Compiled, Diagnostic> {
    let mut previous = match previous {
        Some(p) => match rekey(decl, keys, p) {
            Rekeyed::Done(done) => return Ok(done),
            Rekeyed::NotApplicable(p) => Some(p),
        },
        None => None,
    };
    // The same nodes with the same pins in the same pools hold the addresses they held: the
    // previous allocation is the one `allocate` would give again.
    let allocation = match previous.as_mut() {
        Some(p) if p.cache.as_ref().is_some_and(|c| same_addressing(decl, &c.decl)) => std::mem::take(&mut p.allocation),
        _ => allocate(decl, previous.as_ref().map_or(previous_allocation, |p| &p.allocation))?,
    };
    let topo = Topology::new(decl, &allocation, keys);
    let previous = match previous {
        Some(p) => match redeclare(decl, &topo, p) {
            Rekeyed::Done(mut done) => {
                done.allocation = allocation;
                return Ok(done);
            }
            Rekeyed::NotApplicable(p) => Some(p),
        },
        None => None,
    };
    let previous = previous.as_ref();
    let (plans, shared, cache) = plan(decl, &topo, previous);
    let Shared { rule_blocks, zone_blocks, .. } = shared;
    let mut diagnostics = path_diagnostics(plans.iter(), &cache);
    diagnostics.extend(left_out_diagnostics(plans.iter(), |b| cache.loc(cache.index[b])));
    diag::sort(&mut diagnostics);

    let files = par::map(plans.len(), |i| files_of(&plans[i], previous.and_then(|c| c.nodes.get(&*plans[i].node))));
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
    Ok(Compiled { allocation, nodes, diagnostics, rendered, rule_blocks, zone_blocks, cache: Some(Box::new(cache)) })
}

/// A plan's files given the node's previous output: none when the plan is the same as before (it
/// keeps its files); else the files, keeping those whose inputs are the same.
fn files_of(plan: &NodePlan, prior: Option<&NodeOutput>) -> Option<Vec<FileResource>> {
    match prior {
        Some(o) if o.plan == *plan => None,
        prior => Some(render::files(plan, prior.map(|o| (&o.plan, &o.files[..])))),
    }
}

enum Rekeyed {
    Done(Compiled),
    /// The previous output, given back: the change is not one of keys only.
    NotApplicable(Compiled),
}

/// The recompile for a change of keys only: the same declaration (so the same allocation, rules,
/// zones and paths), some nodes with another key or none. Gives `previous` back when it does not
/// apply (another declaration, or a hub's key changed, which can change which hub relays).
fn rekey(decl: &Arc<Declaration>, keys: &Keys, mut previous: Compiled) -> Rekeyed {
    let Some(cache) = previous.cache.as_ref() else { return Rekeyed::NotApplicable(previous) };
    if !Arc::ptr_eq(decl, &cache.decl) && **decl != *cache.decl {
        return Rekeyed::NotApplicable(previous);
    }
    // The nodes whose key changed, with their new key: from the names the key set changed since
    // the last compile when it continues the set that compile read, else from every name.
    let key_of = |a: usize| cache.declared_keys[a].or_else(|| keys.get(&cache.names[a]));
    let mut changed: Vec<(u32, Option<PublicKey>)> = match cache.keys_seen.as_ref().and_then(|seen| keys.changed_since(seen)) {
        Some(names) => {
            let mut at: Vec<u32> = names.filter_map(|n| cache.index.get(n).copied()).collect();
            at.sort_unstable();
            at.dedup();
            at.into_iter().map(|a| (a, key_of(a as usize))).filter(|&(a, k)| k != cache.keys[a as usize]).collect()
        }
        None => (0..cache.names.len()).map(|a| (a as u32, key_of(a))).filter(|&(a, k)| k != cache.keys[a as usize]).collect(),
    };
    previous.rendered.clear();
    if changed.is_empty() {
        return Rekeyed::Done(previous);
    }
    // A hub's key decides which hub relays, a router's which router a route's users send to: the
    // whole plan is made.
    if changed.iter().any(|&(a, _)| cache.reach.hubs.binary_search(&a).is_ok() || cache.router[a as usize]) {
        return Rekeyed::NotApplicable(previous);
    }
    let cache = previous.cache.as_mut().expect("checked above");
    // Each changed node's key as it was.
    for (a, key) in &mut changed {
        std::mem::swap(key, &mut cache.keys[*a as usize]);
    }
    let (changed, was): (Vec<u32>, Vec<Option<PublicKey>>) = changed.into_iter().unzip();
    // (affected node, changed node it sees): a partner's plan names k's key only where it peers
    // with k directly; a relayed path names k, not its key, unless k gained or lost its key (left
    // out, or not); a hub names the key of every node it relays for.
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    for (&k, was) in changed.iter().zip(&was) {
        let presence = cache.keys[k as usize].is_some() != was.is_some();
        for &p in &cache.partners[k as usize] {
            let list = &cache.paths[p as usize];
            let direct = list.binary_search_by_key(&k, |&(b, _)| b).map_or(true, |i| matches!(list[i].1, Path::Direct { .. }));
            if presence || direct {
                pairs.push((p, k));
            }
        }
    }
    for &h in &cache.reach.hubs {
        for &k in &changed {
            if cache.relayed_by[h as usize].binary_search(&k).is_ok() {
                pairs.push((h, k));
            }
        }
    }
    pairs.sort_unstable();
    pairs.dedup();
    // Each affected plan is edited where the changed keys show (`edit_peers`): a node with ten
    // thousand peers costs what its changed peers cost. A node that sees many changed keys at
    // once (a burst of enrolments covered by one run) has its peer list made again instead, on
    // every core.
    let (many, few): (Vec<_>, Vec<_>) = pairs.chunk_by(|x, y| x.0 == y.0).partition(|seen| remake(cache, seen));
    let remade = par::map(many.len(), |i| peers_of(cache, many[i][0].0));
    let mut lists_changed = false;
    let mut edited: Vec<u32> = Vec::new();
    for (seen, (peers, left_out, no_path)) in many.iter().zip(remade) {
        let a = seen[0].0;
        let plan = &mut previous.nodes.get_mut(&*cache.names[a as usize]).expect("every node has an output").plan;
        let lists = (&left_out, &no_path) != (&plan.left_out, &plan.no_path);
        if !lists && peers == plan.peers {
            continue;
        }
        lists_changed |= lists;
        (plan.peers, plan.left_out, plan.no_path) = (peers, left_out, no_path);
        edited.push(a);
    }
    for seen in few {
        let a = seen[0].0;
        let plan = &mut previous.nodes.get_mut(&*cache.names[a as usize]).expect("every node has an output").plan;
        let (peers, lists) = edit_peers(cache, a, seen, plan);
        lists_changed |= lists;
        if peers || lists {
            edited.push(a);
        }
    }
    // Only the peers changed: the other files stay as they were.
    edited.sort_unstable();
    let outputs = &previous.nodes;
    let files = par::map(edited.len(), |i| {
        let out = &outputs[&*cache.names[edited[i] as usize]];
        render::wireguard(&out.plan, out.files.iter().find(|f| f.path == WIREGUARD_CONF).map(|f| &f.content))
    });
    for (a, content) in edited.into_iter().zip(files) {
        let name = &cache.names[a as usize];
        let out = previous.nodes.get_mut(&**name).expect("every node has an output");
        out.files.iter_mut().find(|f| f.path == WIREGUARD_CONF).expect("every node has a wireguard.conf").content = content;
        previous.rendered.push(name.to_string());
    }
    // The warnings change only where a node's key came or went: a node without a key is in the
    // left-out list of each of its partners, and a pair without a path is reported by the node
    // that sorts first when the other has a key (`path_diagnostics`, `left_out_diagnostics`).
    if lists_changed {
        let diagnostics = &mut previous.diagnostics;
        for (&k, was) in changed.iter().zip(&was) {
            let keyed = cache.keys[k as usize].is_some();
            if keyed == was.is_some() {
                continue;
            }
            let partners = &cache.partners[k as usize];
            if !partners.is_empty() {
                set_diagnostic(diagnostics, left_out_warning(&cache.names[k as usize], partners.len(), &cache.loc(k)), !keyed);
            }
            for &p in partners.iter().take_while(|&&p| p < k) {
                let list = &cache.paths[p as usize];
                if list.binary_search_by_key(&k, |&(b, _)| b).is_ok_and(|i| list[i].1 == Path::None) {
                    let (a, b) = (&cache.names[p as usize], &cache.names[k as usize]);
                    let message = no_path_text(&cache.reach, a, b, cache.reach.path(p, k, false), |h| &cache.names[h as usize]);
                    set_diagnostic(diagnostics, Diagnostic::warning(&cache.loc(p), message), keyed);
                }
            }
        }
    }
    Rekeyed::Done(previous)
}

/// Puts a warning into the sorted warnings (`diag::sort`) or takes it out.
fn set_diagnostic(diagnostics: &mut Vec<Diagnostic>, d: Diagnostic, present: bool) {
    let at = diagnostics.binary_search_by(|x| (&x.loc, x.severity, &x.message).cmp(&(&d.loc, d.severity, &d.message)));
    match (at, present) {
        (Err(i), true) => diagnostics.insert(i, d),
        (Ok(i), false) => drop(diagnostics.remove(i)),
        _ => {}
    }
}

/// Whether a node that sees these changed keys (pairs of it and a changed node) has its peer
/// list made again rather than edited: when they are many, or a quarter of its partners or more
/// (an edit costs a search and a shift per changed key, making the list costs each partner once).
fn remake(cache: &Cache, seen: &[(u32, u32)]) -> bool {
    seen.len() >= 32 || seen.len() * 4 >= cache.paths[seen[0].0 as usize].len()
}

/// Edits the plan of node `a` for the changed nodes it sees (`seen`: pairs of `a` and a changed
/// node) where their keys show: their entries, the entries of the hubs relaying to them, and
/// the lists naming nodes without a key or without a path. The result is the plan `peers_of`
/// would make. Returns whether the peers changed, and whether those lists did.
fn edit_peers(cache: &Cache, a: u32, seen: &[(u32, u32)], plan: &mut NodePlan) -> (bool, bool) {
    let paths = &cache.paths[a as usize];
    let mut touched = Vec::new();
    let mut relayed = Vec::new();
    let mut lists = false;
    for &(_, k) in seen {
        let kname = &cache.names[k as usize];
        if let Ok(i) = paths.binary_search_by_key(&k, |&(b, _)| b) {
            match paths[i].1 {
                Path::Direct { .. } => touched.push(k),
                Path::Relay { hub } => relayed.push((hub, k)),
                Path::None => {}
            }
            let keyed = cache.keys[k as usize].is_some();
            lists |=
                set_member(&mut plan.left_out, kname, !keyed) | set_member(&mut plan.no_path, kname, keyed && paths[i].1 == Path::None);
        }
        if cache.relayed_by[a as usize].binary_search(&k).is_ok() {
            touched.push(k);
        }
    }
    touched.sort_unstable();
    touched.dedup();
    let mut peers = false;
    for t in touched {
        let at = plan.peers.binary_search_by(|p| (*p.node.name).cmp(&cache.names[t as usize]));
        match (at, peer_entry(cache, a, t)) {
            (Ok(i), Some(p)) if plan.peers[i] != p => plan.peers[i] = p,
            (Ok(_), Some(_)) | (Err(_), None) => continue,
            (Ok(i), None) => drop(plan.peers.remove(i)),
            (Err(i), Some(p)) => plan.peers.insert(i, p),
        }
        peers = true;
    }
    // A node reached through a hub joins or leaves that hub's list where its name sorts.
    for (hub, k) in relayed {
        let keyed = cache.keys[k as usize].is_some();
        let at = plan.peers.binary_search_by(|p| (*p.node.name).cmp(&cache.names[hub as usize]));
        let Ok(i) = at else {
            if let Some(p) = keyed.then(|| peer_entry(cache, a, hub)).flatten() {
                plan.peers.insert(at.unwrap_err(), p);
                peers = true;
            }
            continue;
        };
        let list = &mut plan.peers[i].relays_for;
        match (list.binary_search_by(|t| (*t.name).cmp(&cache.names[k as usize])), keyed) {
            (Ok(j), false) => drop(list.remove(j)),
            (Err(j), true) => list.insert(j, cache.texts[k as usize].clone()),
            _ => continue,
        }
        peers = true;
        // The first node relayed, or the last gone: the head of the hub's section says so, and
        // the hub may stop being a peer at all.
        if list.len() == usize::from(keyed) {
            match peer_entry(cache, a, hub) {
                Some(p) => plan.peers[i] = p,
                None => drop(plan.peers.remove(i)),
            }
        }
    }
    (peers, lists)
}

/// Puts `name` into the sorted list `names` or takes it out; whether that changed the list.
fn set_member(names: &mut Vec<Arc<str>>, name: &Arc<str>, member: bool) -> bool {
    match (names.binary_search_by(|n| (**n).cmp(name)), member) {
        (Ok(i), false) => drop(names.remove(i)),
        (Err(i), true) => names.insert(i, name.clone()),
        _ => return false,
    }
    true
}

/// Whether two declarations of a node are the same but for where they are written.
fn same_node(a: &crate::decl::Node, b: &crate::decl::Node) -> bool {
    a.name == b.name
        && a.hub == b.hub
        && a.groups == b.groups
        && a.modules == b.modules
        && a.address_ipv4 == b.address_ipv4
        && a.address_ipv6 == b.address_ipv6
        && a.public_key == b.public_key
        && a.exit.as_ref().map(|e| &e.0) == b.exit.as_ref().map(|e| &e.0)
        && same_reach(a, b)
}

/// Whether two declarations give the same addresses from the same previous allocation: the same
/// mesh name and overlay pools, and the same nodes in the same order with the same pins.
fn same_addressing(a: &Declaration, b: &Declaration) -> bool {
    (&a.mesh.name, a.mesh.overlay_ipv4, a.mesh.overlay_ipv6) == (&b.mesh.name, b.mesh.overlay_ipv4, b.mesh.overlay_ipv6)
        && a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(&b.nodes).all(|(x, y)| (&x.name, x.address_ipv4, x.address_ipv6) == (&y.name, y.address_ipv4, y.address_ipv6))
}

/// Whether a node is reached the same way: the same networks and endpoints (not where written).
fn same_reach(a: &crate::decl::Node, b: &crate::decl::Node) -> bool {
    a.networks == b.networks
        && a.endpoints.len() == b.endpoints.len()
        && a.endpoints.iter().zip(&b.endpoints).all(|(x, y)| x.address == y.address && x.reachable_from == y.reachable_from)
}

/// Whether two declarations of a route are the same but for where they are written.
fn same_route(a: &crate::decl::Route, b: &crate::decl::Route) -> bool {
    let rule = |x: &crate::decl::RouteRule, y: &crate::decl::RouteRule| (x.proto, &x.ports, &x.from) == (y.proto, &y.ports, &y.from);
    let host = |x: &crate::decl::RouteHost, y: &crate::decl::RouteHost| (&x.name, x.address) == (&y.name, y.address);
    (&a.name, &a.prefixes, &a.via, a.masquerade) == (&b.name, &b.prefixes, &b.via, b.masquerade)
        && a.allow.len() == b.allow.len()
        && a.allow.iter().zip(&b.allow).all(|(x, y)| rule(x, y))
        && a.hosts.len() == b.hosts.len()
        && a.hosts.iter().zip(&b.hosts).all(|(x, y)| host(x, y))
}

/// The recompile for a new declaration that keeps the mesh settings, the networks and the hubs
/// as they were: nodes join, leave, change group, modules, endpoints or addresses, and rules
/// change their sources. Recomputes the nodes such a change can reach: the nodes that changed,
/// with their old and new partners when what others see of them changed (address, key,
/// networks, endpoints); the nodes whose partners, filter rules or reachable module blocks
/// changed; and the hubs whose relayed nodes changed. Every other node keeps its plan, its files
/// and its paths. Gives `previous` back when it does not apply.
fn redeclare(decl: &Arc<Declaration>, topo: &Topology, mut previous: Compiled) -> Rekeyed {
    let Some(mut old) = previous.cache.take() else { return Rekeyed::NotApplicable(previous) };
    let od = &old.decl;
    let same_settings = {
        let (a, b) = (&decl.mesh, &od.mesh);
        (&a.name, &a.domain, a.overlay_ipv4, a.overlay_ipv6, a.port, &a.interface, a.mtu)
            == (&b.name, &b.domain, b.overlay_ipv4, b.overlay_ipv6, b.port, &b.interface, b.mtu)
    };
    let same_networks = decl.networks.len() == od.networks.len() && decl.networks.iter().zip(&od.networks).all(|(a, b)| a.name == b.name);
    let old_hubs: Vec<&Arc<str>> = old.reach.hubs.iter().map(|&h| &old.names[h as usize]).collect();
    let same_hubs = old_hubs.len() == topo.hubs.len()
        && topo.hubs.iter().zip(&old_hubs).all(|(&h, name)| {
            let o = old.order[old.index[&***name] as usize] as usize;
            topo.name(h) == &***name
                && same_node(topo.nodes[h as usize], &od.nodes[o])
                && topo.keys[h as usize] == old.keys[old.index[&***name] as usize]
        });
    let same_routes = decl.routes.len() == od.routes.len() && decl.routes.iter().zip(&od.routes).all(|(a, b)| same_route(a, b));
    if !(same_settings && same_networks && same_hubs && same_routes) {
        previous.cache = Some(old);
        return Rekeyed::NotApplicable(previous);
    }
    let n = topo.nodes.len();
    // Positions: new to old and old to new, by name.
    let new_to_old: Vec<Option<u32>> = topo.nodes.iter().map(|node| old.index.get(node.name.as_str()).copied()).collect();
    let mut old_to_new: Vec<Option<u32>> = vec![None; old.names.len()];
    for (a, o) in new_to_old.iter().enumerate() {
        if let Some(o) = o {
            old_to_new[*o as usize] = Some(a as u32);
        }
    }
    let identity = n == old.names.len() && new_to_old.iter().enumerate().all(|(a, o)| *o == Some(a as u32));
    // Partners: with the same nodes in the same places, only the nodes a change of a module's
    // runners or sources reaches have theirs made again; the others keep theirs.
    let sources = topo.module_sources();
    let fresh_partners: Vec<Option<NodeSet>> = match identity.then(|| partners_touched(topo, &sources, &old)).flatten() {
        Some(touched) => par::map(n, |a| touched[a].then(|| topo.partners_of(a as u32, &sources))),
        None => topo.partners().into_iter().map(Some).collect(),
    };
    let partners = |a: usize| fresh_partners[a].as_ref().unwrap_or_else(|| &old.partners[a]);
    let shared = shared(topo, Some(&previous), Some(&old));

    let mut affected = vec![false; n];
    // `changed`: the node's declaration, address or key changed. `moved`: what others' files
    // say of it changed (its address or key), or how it is reached (networks, endpoints), or it
    // is new: its partners are recomputed too. A change of groups or modules alone reaches
    // others through their partners, rules and module blocks, which are compared below.
    let mut changed = vec![false; n];
    let mut moved = vec![false; n];
    let mark_old = |affected: &mut Vec<bool>, o: u32| {
        for &p in &old.partners[o as usize] {
            if let Some(a) = old_to_new[p as usize] {
                affected[a as usize] = true;
            }
        }
    };
    for a in 0..n {
        let Some(o) = new_to_old[a] else {
            changed[a] = true;
            moved[a] = true;
            continue;
        };
        let o = o as usize;
        let (now, was) = (topo.nodes[a], &od.nodes[old.order[o] as usize]);
        moved[a] = !same_reach(now, was) || topo.ipv4[a] != old.ipv4[o] || topo.ipv6[a] != old.ipv6[o] || topo.keys[a] != old.keys[o];
        changed[a] = moved[a] || !same_node(now, was);
    }
    for (o, a) in old_to_new.iter().enumerate() {
        if a.is_none() {
            mark_old(&mut affected, o as u32);
        }
    }
    for a in 0..n {
        if !changed[a] {
            continue;
        }
        affected[a] = true;
        if !moved[a] {
            continue;
        }
        for &p in partners(a) {
            affected[p as usize] = true;
        }
        if let Some(o) = new_to_old[a] {
            mark_old(&mut affected, o);
        }
    }
    let reached = topo.modules_reached(&sources);
    // The previous plans by old position (name order, as the outputs are kept).
    let prior_plans: Vec<&NodePlan> = previous.nodes.values().map(|o| &o.plan).collect();
    for a in 0..n {
        if affected[a] {
            continue;
        }
        let o = new_to_old[a].expect("nodes without an old position are changed") as usize;
        let same_partners = fresh_partners[a].as_ref().is_none_or(|now| {
            now.len() == old.partners[o].len() && now.iter().zip(&old.partners[o]).all(|(&p, &q)| old_to_new[q as usize] == Some(p))
        });
        let prior = prior_plans[o];
        // Module blocks are interned: the same records are the same allocation.
        let same_modules = reached[a].len() == prior.zone_modules.len()
            && reached[a].iter().zip(&prior.zone_modules).all(|(&m, b)| Arc::ptr_eq(&shared.zone_blocks[m as usize], b));
        let same_rules = {
            let mut now = topo.inbound_rules(a as u32).map(|(i, _)| &shared.rule_blocks[i]);
            prior.rules.iter().all(|r| now.next().is_some_and(|x| Arc::ptr_eq(x, r))) && now.next().is_none()
        };
        let same_route_use = topo.routes_of[a] == old.routes_of[o]
            && prior.routes_for.len() == topo.routes.iter().filter(|r| r.via.contains(&(a as u32))).count()
            && prior.routes_for.iter().all(|b| shared.route_blocks.iter().any(|x| x == b));
        affected[a] = !(same_partners && same_modules && same_rules && same_route_use && Arc::ptr_eq(&prior.common, &shared.common));
    }
    // Paths: computed for the affected nodes; every other node's are its old ones (the same
    // partners, and neither side changed).
    let mut old_paths = std::mem::take(&mut old.paths);
    let paths: Vec<Vec<(u32, Path)>> = par::map(n, |a| {
        if affected[a] {
            return partners(a).iter().map(|&b| (b, topo.path(a as u32, b, true))).collect();
        }
        Vec::new()
    });
    let paths: Vec<Vec<(u32, Path)>> = paths
        .into_iter()
        .enumerate()
        .map(|(a, fresh)| {
            if affected[a] {
                return fresh;
            }
            let o = new_to_old[a].expect("unaffected nodes have an old position") as usize;
            let list = std::mem::take(&mut old_paths[o]);
            if identity {
                return list;
            }
            let at = |i: u32| old_to_new[i as usize].expect("partners of unaffected nodes stay");
            list.into_iter()
                .map(|(b, p)| {
                    let p = match p {
                        Path::Relay { hub } => Path::Relay { hub: at(hub) },
                        other => other,
                    };
                    (at(b), p)
                })
                .collect()
        })
        .collect();
    // Which hubs relay for whom: an unaffected node's relayed paths are its old ones.
    let mut relayed_by: Vec<Vec<u32>> = vec![Vec::new(); n];
    for &h in &topo.hubs {
        let o = new_to_old[h as usize].expect("hubs are unchanged") as usize;
        relayed_by[h as usize] =
            old.relayed_by[o].iter().filter_map(|&q| old_to_new[q as usize]).filter(|&a| !affected[a as usize]).collect();
    }
    for (a, list) in paths.iter().enumerate().filter(|&(a, _)| affected[a]) {
        for &(_, p) in list {
            if let Path::Relay { hub } = p {
                relayed_by[hub as usize].push(a as u32);
            }
        }
    }
    for &h in &topo.hubs {
        relayed_by[h as usize].sort_unstable();
        relayed_by[h as usize].dedup();
    }
    // A hub's plan lists the nodes it relays for: recomputed when that list changed or one of
    // them changed.
    for &h in &topo.hubs {
        let h = h as usize;
        let o = new_to_old[h].expect("hubs are unchanged") as usize;
        let same = relayed_by[h].len() == old.relayed_by[o].len()
            && relayed_by[h].iter().zip(&old.relayed_by[o]).all(|(&r, &q)| !moved[r as usize] && old_to_new[q as usize] == Some(r));
        if !same {
            affected[h] = true;
        }
    }
    let mut old_partners = std::mem::take(&mut old.partners);
    let partners: Vec<NodeSet> =
        fresh_partners.into_iter().enumerate().map(|(a, p)| p.unwrap_or_else(|| std::mem::take(&mut old_partners[a]))).collect();
    // The same names in the same places: the index by name is the one before.
    let index = identity.then(|| std::mem::take(&mut old.index));
    let mut cache =
        Cache::new(decl, topo, (partners, paths, relayed_by), sources, index, |a| new_to_old[a].map(|o| old.texts[o as usize].clone()));
    cache.route_blocks = shared.route_blocks.clone();
    let fresh: Vec<Option<NodePlan>> = par::map(n, |a| affected[a].then(|| node_plan(topo, &shared, &cache, a)));
    // The outputs are the previous ones, edited where nodes went, came or were recomputed.
    let mut nodes = std::mem::take(&mut previous.nodes);
    for (o, a) in old_to_new.iter().enumerate() {
        if a.is_none() {
            nodes.remove(&*old.names[o]);
        }
    }
    let fresh: Vec<(u32, NodePlan)> = fresh.into_iter().enumerate().filter_map(|(a, p)| Some((a as u32, p?))).collect();
    let made: Vec<Option<Vec<FileResource>>> =
        par::map(fresh.len(), |i| files_of(&fresh[i].1, nodes.get(&*cache.names[fresh[i].0 as usize])));
    let mut rendered = Vec::new();
    for ((a, plan), files) in fresh.into_iter().zip(made) {
        let name = &cache.names[a as usize];
        let Some(files) = files else {
            nodes.get_mut(&**name).expect("a plan the same as before has an output").plan = plan;
            continue;
        };
        rendered.push(name.to_string());
        nodes.insert(name.to_string(), NodeOutput { plan, files });
    }
    let plans = || nodes.values().map(|o| &o.plan);
    let mut diagnostics = path_diagnostics(plans(), &cache);
    diagnostics.extend(left_out_diagnostics(plans(), |b| cache.loc(cache.index[b])));
    diag::sort(&mut diagnostics);
    Rekeyed::Done(Compiled {
        allocation: previous.allocation,
        nodes,
        diagnostics,
        rendered,
        rule_blocks: shared.rule_blocks,
        zone_blocks: shared.zone_blocks,
        cache: Some(Box::new(cache)),
    })
}

/// Which nodes' partners may differ from those of `old`, for a topology with the same nodes in
/// the same places: the runners and sources of a module whose runners changed; the runners of a
/// module whose sources changed, and the nodes that joined or left its sources. `None` when the
/// modules some node runs or the routes' routers or users changed: every node's are made again.
fn partners_touched(topo: &Topology, sources: &[NodeSet], old: &Cache) -> Option<Vec<bool>> {
    let same_modules =
        topo.module_names.len() == old.module_names.len() && topo.module_names.iter().zip(&old.module_names).all(|(a, b)| a.0 == b.0);
    let same_routes = topo.routes.len() == old.route_via.len()
        && topo.routes.iter().zip(old.route_via.iter().zip(&old.route_users)).all(|(r, (via, users))| r.via == *via && r.users == *users);
    if !(same_modules && same_routes) {
        return None;
    }
    let mut touched = vec![false; topo.nodes.len()];
    for (((_, runners), now), ((_, was_run), was)) in
        topo.module_names.iter().zip(sources).zip(old.module_names.iter().zip(&old.module_sources))
    {
        if runners != was_run {
            for &a in runners.iter().chain(was_run).chain(now).chain(was) {
                touched[a as usize] = true;
            }
        } else if now != was {
            for &a in runners {
                touched[a as usize] = true;
            }
            for a in symmetric_difference(now, was) {
                touched[a as usize] = true;
            }
        }
    }
    Some(touched)
}

/// The members of exactly one of two sorted sets.
fn symmetric_difference<'s>(a: &'s [u32], b: &'s [u32]) -> impl Iterator<Item = u32> + 's {
    let (mut i, mut j) = (0, 0);
    std::iter::from_fn(move || loop {
        match (a.get(i), b.get(j)) {
            (Some(x), Some(y)) if x == y => (i, j) = (i + 1, j + 1),
            (Some(&x), Some(&y)) if x < y => {
                i += 1;
                return Some(x);
            }
            (_, Some(&y)) => {
                j += 1;
                return Some(y);
            }
            (Some(&x), None) => {
                i += 1;
                return Some(x);
            }
            (None, None) => return None,
        }
    })
}

/// A node's peers, the nodes left out for want of a key, and those with no path, from its paths
/// and the keys. Peers come out in position (name) order; a direct path already says who dials
/// whom, so only hubs and the nodes a hub relays for ask `Reach::dials`.
fn peers_of(c: &Cache, me: u32) -> (Vec<PeerPlan>, Vec<Arc<str>>, Vec<Arc<str>>) {
    /// A peer before its section is made: position, endpoint dialled, dialled back, relayed.
    type Draft = (u32, Option<usize>, bool, Vec<Arc<NodeText>>);
    let by_reach = |b: u32| -> Draft { (b, c.reach.dials(me, b), c.reach.dials(b, me).is_some(), Vec::new()) };
    let paths = &c.paths[me as usize];
    let mut peers: Vec<Draft> = Vec::with_capacity(paths.len());
    // Where each hub's entry is in `peers`: few, so searched in order.
    let mut hub_at: Vec<(u32, usize)> = Vec::new();
    let is_hub = |b: u32| c.reach.hubs.binary_search(&b).is_ok();
    let mut left_out = Vec::new();
    let mut no_path = Vec::new();
    for &(b, path) in paths {
        if c.keys[b as usize].is_none() {
            left_out.push(c.names[b as usize].clone());
            continue;
        }
        match path {
            Path::Direct { a_dials, b_dials } => {
                if is_hub(b) {
                    if hub_at.iter().any(|&(h, _)| h == b) {
                        continue;
                    }
                    hub_at.push((b, peers.len()));
                }
                peers.push((b, a_dials, b_dials.is_some(), Vec::new()));
            }
            Path::Relay { hub } => {
                let at = match hub_at.iter().find(|&&(h, _)| h == hub) {
                    Some(&(_, at)) => at,
                    None => {
                        hub_at.push((hub, peers.len()));
                        peers.push(by_reach(hub));
                        peers.len() - 1
                    }
                };
                peers[at].3.push(c.texts[b as usize].clone());
            }
            Path::None => no_path.push(c.names[b as usize].clone()),
        }
    }
    // Partners come in order; hubs joined where first needed.
    if !hub_at.is_empty() {
        peers.sort_unstable_by_key(|d| d.0);
    }
    let relayed = &c.relayed_by[me as usize];
    if !relayed.is_empty() {
        let before = peers.len();
        for &r in relayed {
            if c.keys[r as usize].is_some() && peers[..before].binary_search_by_key(&r, |d| d.0).is_err() {
                peers.push(by_reach(r));
            }
        }
        if peers.len() > before {
            peers.sort_unstable_by_key(|d| d.0);
        }
    }
    let mut peers: Vec<PeerPlan> = peers.into_iter().map(|(b, dials, dialled, relays_for)| c.peer(b, dials, dialled, relays_for)).collect();
    for &r in &c.routes_of[me as usize] {
        if let Some(v) = router_of(c, me, r) {
            if let Ok(i) = peers.binary_search_by(|p| (*p.node.name).cmp(&c.names[v as usize])) {
                peers[i].routes.push(c.route_blocks[r as usize].route.clone());
            }
        }
    }
    (peers, left_out, no_path)
}

/// The router `me` sends route `r` to: the first of its routers with a key that `me` has a
/// direct path with.
fn router_of(c: &Cache, me: u32, r: u32) -> Option<u32> {
    let paths = &c.paths[me as usize];
    c.route_via[r as usize].iter().copied().find(|&v| {
        c.keys[v as usize].is_some() && paths.binary_search_by_key(&v, |&(b, _)| b).is_ok_and(|i| matches!(paths[i].1, Path::Direct { .. }))
    })
}

/// The entry for `b` in the peer list of `me`, if `b` is its peer: the same as `peers_of` makes,
/// for one peer.
fn peer_entry(c: &Cache, me: u32, b: u32) -> Option<PeerPlan> {
    c.keys[b as usize]?;
    let paths = &c.paths[me as usize];
    let path = paths.binary_search_by_key(&b, |&(x, _)| x).ok().map(|i| paths[i].1);
    let relays_for: Vec<Arc<NodeText>> = if c.reach.hubs.binary_search(&b).is_ok() {
        paths
            .iter()
            .filter(|&&(x, p)| p == Path::Relay { hub: b } && c.keys[x as usize].is_some())
            .map(|&(x, _)| c.texts[x as usize].clone())
            .collect()
    } else {
        Vec::new()
    };
    let mut peer = match path {
        Some(Path::Direct { a_dials, b_dials }) => c.peer(b, a_dials, b_dials.is_some(), relays_for),
        _ if !relays_for.is_empty() || c.relayed_by[me as usize].binary_search(&b).is_ok() => {
            c.peer(b, c.reach.dials(me, b), c.reach.dials(b, me).is_some(), relays_for)
        }
        _ => return None,
    };
    for &r in &c.routes_of[me as usize] {
        if router_of(c, me, r) == Some(b) {
            peer.routes.push(c.route_blocks[r as usize].route.clone());
        }
    }
    Some(peer)
}

/// Which hubs relay for whom: for every hub, the nodes with a relayed path through it.
fn relays(paths: &[Vec<(u32, Path)>]) -> Vec<Vec<u32>> {
    let mut relayed_by: Vec<Vec<u32>> = vec![Vec::new(); paths.len()];
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
    relayed_by
}

/// Every node's partners, its paths to them, and for every hub the nodes it relays for.
type Links = (Vec<NodeSet>, Vec<Vec<(u32, Path)>>, Vec<Vec<u32>>);

impl Cache {
    /// `old` gives a node's text from the previous compile, kept when its name and addresses are
    /// the same (so that plans compare it by pointer); `index`, the index by name when it is known.
    fn new(
        decl: &Arc<Declaration>,
        topo: &Topology,
        (partners, paths, relayed_by): Links,
        module_sources: Vec<NodeSet>,
        index: Option<crate::FastMap<Arc<str>, u32>>,
        old: impl Fn(usize) -> Option<Arc<NodeText>> + Sync,
    ) -> Cache {
        let mut router = vec![false; topo.nodes.len()];
        for r in &topo.routes {
            for &v in &r.via {
                router[v as usize] = true;
            }
        }
        let texts: Vec<Arc<NodeText>> = par::map(topo.nodes.len(), |a| match old(a) {
            Some(t) if *t.name == topo.nodes[a].name && t.ipv4 == topo.ipv4[a] && t.ipv6 == topo.ipv6[a] => t,
            _ => Arc::new(NodeText::new(Arc::from(topo.nodes[a].name.as_str()), topo.ipv4[a], topo.ipv6[a])),
        });
        let names: Vec<Arc<str>> = texts.iter().map(|t| t.name.clone()).collect();
        Cache {
            texts,
            decl: decl.clone(),
            order: topo.order.clone(),
            index: index.unwrap_or_else(|| names.iter().enumerate().map(|(i, n)| (n.clone(), i as u32)).collect()),
            names,
            ipv4: topo.ipv4.clone(),
            ipv6: topo.ipv6.clone(),
            keys: topo.keys.clone(),
            declared_keys: topo.nodes.iter().map(|n| n.public_key).collect(),
            reach: topo.reach.clone(),
            partners,
            relayed_by,
            paths,
            reached: topo.modules_reached(&module_sources),
            module_names: topo.module_names.clone(),
            module_sources,
            route_users: topo.routes.iter().map(|r| r.users.clone()).collect(),
            rules: topo.rules.iter().map(|r| (Arc::from(r.module), r.number, r.rule.clone(), r.sources.clone())).collect(),
            route_via: topo.routes.iter().map(|r| r.via.clone()).collect(),
            routes_of: topo.routes_of.clone(),
            // Set by the caller, from what the plans share.
            route_blocks: Vec::new(),
            router,
            // Set by `compile`, which has the key set.
            keys_seen: None,
        }
    }
}

/// What the plans of one compile share: the settings and the rendered rules, interned against
/// the previous output so that comparing a plan with its previous one is a pointer comparison
/// for them.
struct Shared {
    common: Arc<Common>,
    rule_blocks: Vec<Arc<str>>,
    /// The zone records of every module of `Topology::module_names`.
    zone_blocks: Vec<Arc<ZoneBlock>>,
    /// Every route of `Topology::routes`, and the zone records of its hosts (if it names any).
    route_blocks: Vec<Arc<RouteBlock>>,
    route_zones: Vec<Option<Arc<ZoneBlock>>>,
}

fn shared(topo: &Topology, previous: Option<&Compiled>, old: Option<&Cache>) -> Shared {
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
    // With every node at the same position and address, a rule resolved to the same sources,
    // and a module run by the same nodes, has the same text as before: kept without making it.
    let (old, previous) = match (old, previous) {
        (Some(c), Some(p))
            if c.ipv4 == topo.ipv4
                && c.ipv6 == topo.ipv6
                && c.decl.mesh.interface == topo.decl.mesh.interface
                && c.rules.len() == p.rule_blocks.len() =>
        {
            (Some((c, p)), Some(p))
        }
        (_, p) => (None, p),
    };
    let old_rules: HashMap<(&str, usize), usize> =
        old.into_iter().flat_map(|(c, _)| c.rules.iter().enumerate()).map(|(i, r)| ((&*r.0, r.1), i)).collect();
    // The previous blocks by their text, to intern a block made again: built only if one is
    // (hashing every block's text costs more than the blocks kept as they were).
    let old_blocks: std::cell::OnceCell<HashMap<&str, &Arc<str>>> = std::cell::OnceCell::new();
    let rule_blocks: Vec<Arc<str>> = topo
        .rules
        .iter()
        .map(|r| {
            if let Some((c, p)) = old {
                if let Some(&i) = old_rules.get(&(r.module, r.number)) {
                    if c.rules[i].2 == *r.rule && c.rules[i].3 == r.sources {
                        return p.rule_blocks[i].clone();
                    }
                }
            }
            let text = render::rule_block(topo, r);
            let old_blocks =
                old_blocks.get_or_init(|| previous.into_iter().flat_map(|c| c.rule_blocks.iter()).map(|b| (&**b, b)).collect());
            old_blocks.get(text.as_str()).map_or_else(|| Arc::from(text), |b| (*b).clone())
        })
        .collect();
    let old_zones: std::cell::OnceCell<HashMap<(&str, &str), &Arc<ZoneBlock>>> = std::cell::OnceCell::new();
    let zone_blocks = topo
        .module_names
        .iter()
        .enumerate()
        .map(|(i, (module, runners))| {
            if let Some((c, p)) = old {
                if c.module_names.get(i).is_some_and(|(m, r)| m == module && r == runners) && p.zone_blocks.len() == c.module_names.len() {
                    return p.zone_blocks[i].clone();
                }
            }
            let records = render::zone_records(runners.iter().map(|&r| (&**module, topo.ipv4[r as usize], topo.ipv6[r as usize])));
            let old_zones = old_zones
                .get_or_init(|| previous.into_iter().flat_map(|c| c.zone_blocks.iter()).map(|b| ((&*b.module, &*b.records), b)).collect());
            match old_zones.get(&(&**module, records.as_str())) {
                Some(b) => (*b).clone(),
                None => {
                    use sha2::Digest;
                    let digest = sha2::Sha256::digest(records.as_bytes()).into();
                    Arc::new(ZoneBlock { module: module.clone(), records: records.into(), digest })
                }
            }
        })
        .collect();
    let route_blocks = topo.routes.iter().map(|r| Arc::new(render::route_block(topo, r))).collect();
    let route_zones = topo
        .routes
        .iter()
        .map(|r| {
            use sha2::Digest;
            if r.route.hosts.is_empty() {
                return None;
            }
            let records = render::host_records(&r.route.hosts);
            let digest = sha2::Sha256::digest(records.as_bytes()).into();
            Some(Arc::new(ZoneBlock { module: Arc::from(r.route.name.as_str()), records: records.into(), digest }))
        })
        .collect();
    Shared { common, rule_blocks, zone_blocks, route_blocks, route_zones }
}

/// The filter blocks of the rules of the modules a node runs.
fn rules_of(topo: &Topology, shared: &Shared, a: u32) -> Vec<Arc<str>> {
    topo.inbound_rules(a).map(|(i, _)| shared.rule_blocks[i].clone()).collect()
}

/// One node's plan.
fn node_plan(topo: &Topology, shared: &Shared, cache: &Cache, a: usize) -> NodePlan {
    let me = a as u32;
    let names = &cache.names;
    let (peers, left_out, no_path) = peers_of(cache, me);
    let mut zone = Vec::with_capacity(cache.partners[a].len() + 1);
    let mut own = Some(me);
    for &b in &cache.partners[a] {
        if let Some(m) = own.filter(|&m| m < b) {
            zone.push(cache.texts[m as usize].clone());
            own = None;
        }
        zone.push(cache.texts[b as usize].clone());
    }
    if let Some(m) = own {
        zone.push(cache.texts[m as usize].clone());
    }
    let zone_modules = cache.reached[a].iter().map(|&m| shared.zone_blocks[m as usize].clone()).collect();
    let routes_for =
        topo.routes.iter().enumerate().filter(|(_, r)| r.via.contains(&me)).map(|(i, _)| shared.route_blocks[i].clone()).collect();
    let routes_of = &topo.routes_of[a];
    let routed =
        routes_of.iter().filter(|&&r| router_of(cache, me, r).is_some()).map(|&r| shared.route_blocks[r as usize].route.clone()).collect();
    let zone_routes = routes_of.iter().filter_map(|&r| shared.route_zones[r as usize].clone()).collect();
    NodePlan {
        node: names[a].clone(),
        common: shared.common.clone(),
        hub: topo.nodes[a].hub,
        ipv4: cache.ipv4[a],
        ipv6: cache.ipv6[a],
        peers,
        left_out,
        no_path,
        rules: rules_of(topo, shared, me),
        zone,
        zone_modules,
        routes_for,
        routed,
        zone_routes,
    }
}

/// Every node's plan, in name order, what the plans share, and what the next compile keeps.
fn plan(decl: &Arc<Declaration>, topo: &Topology, previous: Option<&Compiled>) -> (Vec<NodePlan>, Shared, Cache) {
    let n = topo.nodes.len();
    let partners = topo.partners();
    let paths: Vec<Vec<(u32, Path)>> = par::map(n, |a| partners[a].iter().map(|&b| (b, topo.path(a as u32, b, true))).collect());
    let relayed_by = relays(&paths);
    let shared = shared(topo, previous, previous.and_then(|p| p.cache.as_deref()));
    let mut cache = Cache::new(decl, topo, (partners, paths, relayed_by), topo.module_sources(), None, |_| None);
    cache.route_blocks = shared.route_blocks.clone();
    let plans = par::map(n, |a| node_plan(topo, &shared, &cache, a));
    (plans, shared, cache)
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
    wanted_by.into_iter().map(|(b, count)| left_out_warning(b, count, &loc(b))).collect()
}

/// The warning for a node left out of `count` peer lists for want of a key.
fn left_out_warning(name: &str, count: usize, loc: &crate::Loc) -> Diagnostic {
    Diagnostic::warning(
        loc,
        format!("node `{name}` has no public key yet (not enrolled); it is left out of the peer lists of {count} node(s) until it has one"),
    )
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
