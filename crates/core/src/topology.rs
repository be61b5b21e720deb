//! The mesh as an index: nodes by position, network sets as bits, groups and module runners
//! as node sets, rules with their sources resolved, and the path rule between two nodes.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use crate::alloc::Allocation;
use crate::decl::{Declaration, Exposure, Node, PortRange, Proto, PublicKey, Route, Rule, Source};
use crate::FastMap;

/// A set of networks, one bit each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bits(Box<[u64]>);

impl Bits {
    fn new(words: usize) -> Bits {
        Bits(vec![0; words].into_boxed_slice())
    }

    fn set(&mut self, i: usize) {
        self.0[i / 64] |= 1 << (i % 64);
    }
}

/// Whether two sets of bits share one.
fn meets(a: &[u64], b: &[u64]) -> bool {
    a.iter().zip(b).any(|(x, y)| x & y != 0)
}

/// A node set: sorted, without repeats, of node positions.
pub type NodeSet = Vec<u32>;

/// A list of numbers for each node, all in one vector: at 100,000 nodes, a vector per node was
/// 100,000 allocations made and freed every compile.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Lists {
    /// Node `a`'s list is `items[start[a]..start[a + 1]]`.
    start: Vec<u32>,
    items: Vec<u32>,
}

impl Lists {
    /// `n` lists, from `(node, item)` pairs given twice by `pairs` (once counted, once placed);
    /// each list keeps the order its items come in.
    fn gather<I: Iterator<Item = (u32, u32)>>(n: usize, pairs: impl Fn() -> I) -> Lists {
        let mut start = vec![0u32; n + 1];
        for (a, _) in pairs() {
            start[a as usize + 1] += 1;
        }
        for a in 0..n {
            start[a + 1] += start[a];
        }
        let mut at: Vec<u32> = start[..n].to_vec();
        let mut items = vec![0u32; start[n] as usize];
        for (a, x) in pairs() {
            items[at[a as usize] as usize] = x;
            at[a as usize] += 1;
        }
        Lists { start, items }
    }

    pub fn len(&self) -> usize {
        self.start.len().saturating_sub(1)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl std::ops::Index<usize> for Lists {
    type Output = [u32];

    fn index(&self, a: usize) -> &[u32] {
        &self.items[self.start[a] as usize..self.start[a + 1] as usize]
    }
}

/// A rule of a module with its sources resolved to nodes.
#[derive(Debug, PartialEq)]
pub struct ResolvedRule<'d> {
    pub module: &'d str,
    /// 1-based position of the rule in its manifest.
    pub number: usize,
    pub rule: &'d Rule,
    pub sources: NodeSet,
}

impl ResolvedRule<'_> {
    pub fn admits(&self, proto: Proto, port: Option<u16>) -> bool {
        self.rule.proto == proto
            && match port {
                None => true,
                Some(p) => self.rule.ports.iter().any(|r: &PortRange| r.contains(p)),
            }
    }
}

/// A route with its routers and its rules' sources resolved to nodes.
#[derive(Debug, PartialEq)]
pub struct ResolvedRoute<'d> {
    pub route: &'d Route,
    /// The routers in order of preference, as positions.
    pub via: Vec<u32>,
    /// The sources of each of its rules.
    pub sources: Vec<NodeSet>,
    /// The nodes that use it: those its rules admit (for an exit, those of them that opt in),
    /// but its routers.
    pub users: NodeSet,
}

/// How two nodes reach each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// At least one side dials the other; `Reach::dials` says which endpoint. Not held here, so
    /// that the paths a compile keeps (one per pair of partners) take eight bytes each.
    Direct,
    /// Neither can dial the other; both dial, or are dialled by, this hub.
    Relay {
        hub: u32,
    },
    None,
}

/// Who can dial whom and which hubs can relay, by node position. Owns its data, so that a compile
/// can keep it for the next one; the rows are shared, so that keeping it copies nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reach {
    /// Per node, one row: its networks (`words` words of bits), the networks any of its
    /// endpoints is reachable from (`words`), and the hubs it has a direct path with (bits over
    /// `hubs`). Side by side, so that the path between two nodes reads one place for each: a
    /// compile asks it of every pair of partners (19 million at 100,000 nodes).
    rows: Arc<[u64]>,
    words: usize,
    /// Each endpoint's `reachable_from` (`words` words of bits), node after node: node `a`'s
    /// endpoints are those from `endpoint_start[a]` to `endpoint_start[a + 1]`. One vector, not
    /// one per node and endpoint: at 100,000 nodes those were 300,000 allocations a topology.
    endpoint_reach: Arc<[u64]>,
    endpoint_start: Arc<[u32]>,
    pub hubs: Vec<u32>,
    /// The hubs whose key is known, as bits over `hubs`.
    keyed_hubs: Bits,
}

impl Reach {
    fn row(&self, a: usize) -> &[u64] {
        let len = 2 * self.words + self.keyed_hubs.0.len();
        &self.rows[a * len..(a + 1) * len]
    }

    fn nets(&self, a: usize) -> &[u64] {
        &self.row(a)[..self.words]
    }

    /// The networks any of the node's endpoints is reachable from.
    fn reach(&self, a: usize) -> &[u64] {
        &self.row(a)[self.words..2 * self.words]
    }

    /// The hubs the node has a direct path with, as bits over `hubs`.
    fn hub_links(&self, a: usize) -> &[u64] {
        &self.row(a)[2 * self.words..]
    }

    /// The endpoint of `b` that `a` dials: the first whose `reachable_from` meets `a`'s networks.
    pub fn dials(&self, a: u32, b: u32) -> Option<usize> {
        let (a, b) = (a as usize, b as usize);
        let nets = self.nets(a);
        if !meets(nets, self.reach(b)) {
            return None;
        }
        let (from, to) = (self.endpoint_start[b] as usize, self.endpoint_start[b + 1] as usize);
        self.endpoint_reach[from * self.words..to * self.words].chunks_exact(self.words).position(|e| meets(e, nets))
    }

    pub fn direct(&self, a: u32, b: u32) -> bool {
        self.dials(a, b).is_some() || self.dials(b, a).is_some()
    }

    /// The nodes by their rows: each node's class, and one node of each class. Whether two nodes
    /// have a path (and which, without keys) follows from their rows alone (`dials` finds an
    /// endpoint exactly when the networks meet the endpoints' union), so a question about every
    /// pair of two sets can be asked once per pair of their classes.
    pub fn classes(&self) -> (Vec<u32>, Vec<u32>) {
        let n = self.rows.len() / (2 * self.words + self.keyed_hubs.0.len());
        let mut seen: FastMap<&[u64], u32> = FastMap::default();
        let mut first = Vec::new();
        let class = (0..n)
            .map(|a| {
                *seen.entry(self.row(a)).or_insert_with(|| {
                    first.push(a as u32);
                    first.len() as u32 - 1
                })
            })
            .collect();
        (class, first)
    }

    /// The same reach for nodes whose keys are now `keys`: only which hubs may relay follows them.
    fn rekeyed(&self, keys: &[Option<PublicKey>]) -> Reach {
        Reach { keyed_hubs: keyed(&self.hubs, keys), ..self.clone() }
    }

    /// The path rule. With `need_keys`, only hubs whose key is known may relay. It reads the two
    /// nodes' rows and nothing else of them: `classes` relies on it (what else decides a path
    /// goes into the rows).
    pub fn path(&self, a: u32, b: u32, need_keys: bool) -> Path {
        if self.dials(a, b).is_some() || self.dials(b, a).is_some() {
            return Path::Direct;
        }
        // A hub never links to itself, so the hubs common to both are neither `a` nor `b`.
        let (la, lb) = (self.hub_links(a as usize), self.hub_links(b as usize));
        for (w, (x, y)) in la.iter().zip(lb.iter()).enumerate() {
            let mut both = x & y;
            if need_keys {
                both &= self.keyed_hubs.0[w];
            }
            if both != 0 {
                return Path::Relay { hub: self.hubs[w * 64 + both.trailing_zeros() as usize] };
            }
        }
        Path::None
    }
}

pub struct Topology<'d> {
    pub decl: &'d Declaration,
    /// Nodes in name order; a node's position here is its index everywhere else.
    pub nodes: Vec<&'d Node>,
    /// Each position's index in `decl.nodes`.
    pub order: Vec<u32>,
    /// Each node's position by name (shared with `kept`).
    pub index: Arc<FastMap<Arc<str>, u32>>,
    /// The topology given to `new_after` named the same nodes in the same places: positions are
    /// the same in both.
    pub same_names: bool,
    /// What the next topology over the same names starts from.
    pub kept: Kept,
    pub ipv4: Vec<Option<Ipv4Addr>>,
    pub ipv6: Vec<Option<Ipv6Addr>>,
    pub keys: Vec<Option<PublicKey>>,
    /// Per node, whether it was withdrawn from the mesh for good (revoked): its names are in no
    /// zone (ADR 0015).
    pub withdrawn: Vec<bool>,
    /// The withdrawn names as the key set gave them.
    pub withdrawn_names: std::sync::Arc<std::collections::BTreeSet<String>>,
    pub network_index: FastMap<&'d str, usize>,
    pub reach: Reach,
    pub hubs: Vec<u32>,
    pub groups: FastMap<Arc<str>, NodeSet>,
    /// Every declared module's runners (and any other module a node runs).
    pub runners: Arc<FastMap<Arc<str>, NodeSet>>,
    pub rules: Vec<ResolvedRule<'d>>,
    /// The rules of each module, as a range of `rules`.
    pub module_rules: FastMap<&'d str, std::ops::Range<usize>>,
    /// Every module that some node runs, in name order, with its runners: the module names of
    /// the zone.
    pub module_names: Vec<(std::sync::Arc<str>, NodeSet)>,
    /// The routes in declaration order.
    pub routes: Vec<ResolvedRoute<'d>>,
    /// Per node, the routes it uses, as positions in `routes`.
    pub routes_of: Vec<Vec<u32>>,
    /// The exposures in declaration order.
    pub exposures: Vec<ResolvedExposure<'d>>,
    /// Per module of `module_names`, its rules (positions in `rules`).
    module_names_rules: Vec<std::ops::Range<usize>>,
    /// Per node, the modules it runs, as positions in `module_names`.
    modules_of: Lists,
}

/// An exposure with its ingress nodes and its module's runners as node sets.
#[derive(Debug, PartialEq)]
pub struct ResolvedExposure<'d> {
    pub exposure: &'d Exposure,
    /// The ingress nodes.
    pub via: NodeSet,
    /// Every node running the module; the backends are those of them with a key.
    pub runners: NodeSet,
}

fn hubs_len_words(hubs: &[u32]) -> usize {
    hubs.len().div_ceil(64).max(1)
}

/// The hubs whose key is known, as bits over `hubs`.
fn keyed(hubs: &[u32], keys: &[Option<PublicKey>]) -> Bits {
    let mut bits = Bits::new(hubs_len_words(hubs));
    for (j, &h) in hubs.iter().enumerate() {
        if keys[h as usize].is_some() {
            bits.set(j);
        }
    }
    bits
}

/// What a topology keeps for the next one over the same names (`Topology::new_after`): the index
/// by name, the groups as the nodes name them and as they are declared, and the modules' runners.
/// Shared, so that a compile whose change touches none of them copies nothing, and one that does
/// edits them where the changed nodes are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    pub index: Arc<FastMap<Arc<str>, u32>>,
    /// Per group name, the nodes that name it in their `groups`.
    grouped: Arc<FastMap<Arc<str>, NodeSet>>,
    /// Per declared group, in declaration order, its `members` that are nodes.
    members: Arc<Vec<NodeSet>>,
    /// Per module, declared or run, its runners.
    running: Arc<FastMap<Arc<str>, NodeSet>>,
}

impl Kept {
    /// Made from every node.
    fn new(decl: &Declaration, nodes: &[&Node]) -> Kept {
        let index: FastMap<Arc<str>, u32> = nodes.iter().enumerate().map(|(i, n)| (Arc::from(n.name.as_str()), i as u32)).collect();
        let members =
            decl.groups.iter().map(|g| set_of(g.members.iter().filter_map(|m| index.get(m.as_str()).copied()).collect())).collect();
        // Gathered by the names at hand, then keyed by shared names (a few thousand groups).
        let mut grouped: FastMap<&str, Vec<u32>> = FastMap::default();
        let mut running: FastMap<&str, Vec<u32>> = decl.modules.iter().map(|m| (m.name.as_str(), Vec::new())).collect();
        for (i, n) in nodes.iter().enumerate() {
            for g in &n.groups {
                grouped.entry(g.as_str()).or_default().push(i as u32);
            }
            for m in &n.modules {
                running.entry(m.as_str()).or_default().push(i as u32);
            }
        }
        let shared =
            |m: FastMap<&str, Vec<u32>>| -> FastMap<Arc<str>, NodeSet> { m.into_iter().map(|(k, v)| (Arc::from(k), set_of(v))).collect() };
        Kept { index: Arc::new(index), grouped: Arc::new(shared(grouped)), members: Arc::new(members), running: Arc::new(shared(running)) }
    }

    /// This one (made for `was`, whose nodes are in the same places) edited for `decl`: the nodes
    /// at `changed` (positions, declared anew) leave the groups and modules they named and join
    /// those they name now, and the declared groups whose members changed are resolved again.
    /// `None` when the declared groups or modules are others (by name, in order).
    fn edited(&self, decl: &Declaration, was: &Declaration, nodes: &[&Node], before: &[&Node], changed: &[u32]) -> Option<Kept> {
        let names_same = |a: &mut dyn ExactSizeIterator<Item = &String>, b: &mut dyn ExactSizeIterator<Item = &String>| {
            a.len() == b.len() && a.zip(b).all(|(x, y)| x == y)
        };
        if !names_same(&mut decl.groups.iter().map(|g| &g.name), &mut was.groups.iter().map(|g| &g.name))
            || !names_same(&mut decl.modules.iter().map(|m| &m.name), &mut was.modules.iter().map(|m| &m.name))
        {
            return None;
        }
        // Each change moves the rest of a sorted set: past a few thousand changed nodes, making
        // the sets again costs less than editing them.
        if changed.len() > 4096.max(nodes.len() / 16) {
            return None;
        }
        let mut kept = self.clone();
        // Leaves `a` in every set `from` names, joins it to every set `to` names; a set left empty
        // goes unless `keep` holds for its name.
        let edit = |map: &mut Arc<FastMap<Arc<str>, NodeSet>>, a: u32, from: &[String], to: &[String], keep: &dyn Fn(&str) -> bool| {
            if from == to {
                return;
            }
            let map = Arc::make_mut(map);
            for name in from {
                if let Some(set) = map.get_mut(name.as_str()) {
                    if let Ok(i) = set.binary_search(&a) {
                        set.remove(i);
                    }
                    if set.is_empty() && !keep(name) {
                        map.remove(name.as_str());
                    }
                }
            }
            for name in to {
                let set = match map.get_mut(name.as_str()) {
                    Some(set) => set,
                    None => map.entry(Arc::from(name.as_str())).or_default(),
                };
                if let Err(i) = set.binary_search(&a) {
                    set.insert(i, a);
                }
            }
        };
        let declared: crate::FastSet<&str> = decl.modules.iter().map(|m| m.name.as_str()).collect();
        for &a in changed {
            let (now, was) = (nodes[a as usize], before[a as usize]);
            edit(&mut kept.grouped, a, &was.groups, &now.groups, &|_| false);
            edit(&mut kept.running, a, &was.modules, &now.modules, &|m| declared.contains(m));
        }
        for (i, (g, w)) in decl.groups.iter().zip(&was.groups).enumerate() {
            if g.members != w.members {
                Arc::make_mut(&mut kept.members)[i] =
                    set_of(g.members.iter().filter_map(|m| kept.index.get(m.as_str()).copied()).collect());
            }
        }
        Some(kept)
    }

    /// Every group's nodes: its declared members and the nodes that name it.
    fn groups(&self, decl: &Declaration) -> FastMap<Arc<str>, NodeSet> {
        let mut groups: FastMap<Arc<str>, NodeSet> =
            decl.groups.iter().zip(self.members.iter()).map(|(g, m)| (Arc::from(g.name.as_str()), m.clone())).collect();
        for (g, set) in self.grouped.iter() {
            match groups.get_mut(g) {
                Some(members) if !members.is_empty() => {
                    members.extend_from_slice(set);
                    members.sort_unstable();
                    members.dedup();
                }
                Some(members) => members.clone_from(set),
                None => {
                    groups.insert(g.clone(), set.clone());
                }
            }
        }
        groups
    }
}

/// Each position's addresses, IPv4 and IPv6.
pub type Addresses<'c> = (&'c [Option<Ipv4Addr>], &'c [Option<Ipv6Addr>]);

/// The topology of the compile before, for `Topology::new_after` (`Topology::before`, or what a
/// compile kept of it).
#[derive(Clone, Copy)]
pub struct Before<'c> {
    pub decl: &'c Declaration,
    pub order: &'c [u32],
    pub kept: &'c Kept,
    /// Each position's addresses, when the allocation is the one that topology had.
    pub addresses: Option<Addresses<'c>>,
    /// Each position's key, and where that topology stood in its key set: the names changed
    /// since are read again, the others kept. Without the second, every key is read again.
    pub keys: (&'c [Option<PublicKey>], Option<crate::keys::KeysSeen>),
    pub reach: &'c Reach,
}

/// A topology's parts that the next one over the same names starts from (`Topology::held`),
/// owned: for a process that checks one declaration after another (the controller's apply) and
/// holds no compile of them.
pub struct Held {
    decl: Arc<Declaration>,
    order: Vec<u32>,
    kept: Kept,
    ipv4: Vec<Option<Ipv4Addr>>,
    ipv6: Vec<Option<Ipv6Addr>>,
    keys: Vec<Option<PublicKey>>,
    reach: Reach,
}

impl Held {
    /// The declaration it was made from.
    pub fn decl(&self) -> &Arc<Declaration> {
        &self.decl
    }

    /// As the topology before; its addresses when `allocation_kept` (the next topology is made
    /// with the allocation this one was). Every key is read again.
    pub fn before(&self, allocation_kept: bool) -> Before<'_> {
        Before {
            decl: &self.decl,
            order: &self.order,
            kept: &self.kept,
            addresses: allocation_kept.then_some((&self.ipv4[..], &self.ipv6[..])),
            keys: (&self.keys, None),
            reach: &self.reach,
        }
    }
}

/// Whether a node is reached the same way: the same networks and endpoints (not where written).
pub(crate) fn same_reach(a: &Node, b: &Node) -> bool {
    std::ptr::eq(a, b)
        || (a.networks == b.networks
            && a.endpoints.len() == b.endpoints.len()
            && a.endpoints.iter().zip(&b.endpoints).all(|(x, y)| x.address == y.address && x.reachable_from == y.reachable_from))
}

/// The reach of `nodes`: each one's networks and its endpoints' reach as bits over the
/// `networks` declared, and the hubs it has a direct path with (`hubs`, those with a key among
/// them marked).
fn reach_of(nodes: &[&Node], network_index: &FastMap<&str, usize>, networks: usize, hubs: Vec<u32>, keys: &[Option<PublicKey>]) -> Reach {
    let words = networks.div_ceil(64).max(1);
    // The networks named, as bits set in `into` (`words` words).
    let set_bits = |names: &[String], into: &mut [u64]| {
        for n in names {
            if let Some(&i) = network_index.get(n.as_str()) {
                into[i / 64] |= 1 << (i % 64);
            }
        }
    };
    let endpoints: usize = nodes.iter().map(|n| n.endpoints.len()).sum();
    let mut endpoint_reach = vec![0u64; endpoints * words];
    let mut endpoint_start = Vec::with_capacity(nodes.len() + 1);
    let hub_words = hubs_len_words(&hubs);
    let row = 2 * words + hub_words;
    let mut rows = vec![0u64; nodes.len() * row];
    let mut e = 0;
    for (n, r) in nodes.iter().zip(rows.chunks_exact_mut(row)) {
        endpoint_start.push(e as u32);
        let (nets, rest) = r.split_at_mut(words);
        set_bits(&n.networks, nets);
        for endpoint in &n.endpoints {
            let bits = &mut endpoint_reach[e * words..(e + 1) * words];
            set_bits(&endpoint.reachable_from, bits);
            for (a, b) in rest[..words].iter_mut().zip(bits.iter()) {
                *a |= b;
            }
            e += 1;
        }
    }
    endpoint_start.push(e as u32);
    let keyed_hubs = keyed(&hubs, keys);
    let mut r =
        Reach { rows: rows.into(), words, endpoint_reach: endpoint_reach.into(), endpoint_start: endpoint_start.into(), hubs, keyed_hubs };
    // Whether a node and a hub are direct follows from the node's networks and its
    // endpoints' reach alone (`Reach::dials` finds an endpoint where their union meets the
    // networks): the nodes that share both, most of a fleet, are worked out once (at 100,000
    // nodes and 100 hubs, 10 million pairs were: a tenth of a recompile).
    let link = |a: u32, into: &mut [u64]| {
        for (j, &h) in r.hubs.iter().enumerate() {
            if h != a && r.direct(a, h) {
                into[j / 64] |= 1 << (j % 64);
            }
        }
    };
    // Each node's links, or the first node's alike with it.
    let mut links = vec![0u64; nodes.len() * hub_words];
    let mut alike: FastMap<&[u64], usize> = FastMap::default();
    for a in 0..nodes.len() {
        let start = a * row;
        let first = if nodes[a].hub { a } else { *alike.entry(&r.rows[start..start + 2 * words]).or_insert(a) };
        if first == a {
            link(a as u32, &mut links[a * hub_words..(a + 1) * hub_words]);
        } else {
            links.copy_within(first * hub_words..(first + 1) * hub_words, a * hub_words);
        }
    }
    drop(alike);
    if hub_words > 0 {
        let rows = Arc::get_mut(&mut r.rows).expect("made here");
        for (a, b) in links.chunks_exact(hub_words).enumerate() {
            rows[a * row + 2 * words..(a + 1) * row].copy_from_slice(b);
        }
    }
    r
}

/// The positions of a pool's members (the nodes the controller added for it).
fn pool_members<'a>(nodes: &'a [&Node], pool: &'a str) -> impl Iterator<Item = u32> + 'a {
    (0..nodes.len() as u32).filter(move |&i| nodes[i as usize].pool.as_deref() == Some(pool))
}

/// Each node's entry in a map by name: both in name order, so read side by side rather than
/// looked up.
fn by_name<T: Copy>(nodes: &[&Node], map: &std::collections::BTreeMap<String, T>) -> Vec<Option<T>> {
    let mut entries = map.iter().peekable();
    nodes
        .iter()
        .map(|n| {
            while entries.next_if(|(k, _)| k.as_str() < n.name.as_str()).is_some() {}
            entries.next_if(|(k, _)| **k == n.name).map(|(_, v)| *v)
        })
        .collect()
}

fn set_of(mut v: Vec<u32>) -> NodeSet {
    v.sort_unstable();
    v.dedup();
    v
}

/// The topology before over the same names in the same places: each node as it was declared
/// there, and the positions of the nodes declared anew (another `Arc<Node>`).
struct Previous<'b> {
    before: Before<'b>,
    nodes: Vec<&'b Node>,
    changed: Vec<u32>,
}

impl<'b> Previous<'b> {
    fn new(before: Before<'b>, order: &[u32], nodes: &[&Node]) -> Previous<'b> {
        let was: Vec<&Node> = order.iter().map(|&i| &*before.decl.nodes[i as usize]).collect();
        let changed = (0..nodes.len() as u32).filter(|&a| !std::ptr::eq(nodes[a as usize], was[a as usize])).collect();
        Previous { before, nodes: was, changed }
    }

    /// Whether the reach before holds for `decl`: the same networks, and every node declared anew
    /// (`nodes`, in the same places) reached as it was and a hub as it was (only the hubs' keys are
    /// read again).
    fn same_reach(&self, decl: &Declaration, nodes: &[&Node]) -> bool {
        let nets = &self.before.decl.networks;
        decl.networks.len() == nets.len()
            && decl.networks.iter().zip(nets).all(|(x, y)| x.name == y.name)
            && self.changed.iter().all(|&a| {
                let (now, was) = (nodes[a as usize], self.nodes[a as usize]);
                now.hub == was.hub && same_reach(now, was)
            })
    }
}

/// Each position's index in `decl.nodes`, in name order. Sorted with the names at hand: a
/// comparison reads no node (and a list in name order already is one pass).
fn order_by_name(decl: &Declaration) -> Vec<u32> {
    let mut named: Vec<(&str, u32)> = decl.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i as u32)).collect();
    named.sort_unstable();
    named.iter().map(|&(_, i)| i).collect()
}

/// Every module's rules with their sources resolved, and each module's range of them.
fn resolved_rules<'d>(
    decl: &'d Declaration,
    resolve: &dyn Fn(&[Source]) -> NodeSet,
) -> (Vec<ResolvedRule<'d>>, FastMap<&'d str, std::ops::Range<usize>>) {
    let mut rules = Vec::new();
    let mut module_rules = FastMap::default();
    for m in &decl.modules {
        let start = rules.len();
        for (i, rule) in m.allow.iter().enumerate() {
            rules.push(ResolvedRule { module: &m.name, number: i + 1, rule, sources: resolve(&rule.from) });
        }
        module_rules.insert(m.name.as_str(), start..rules.len());
    }
    (rules, module_rules)
}

/// The routes with their routers, rules' sources and users resolved, and the routes each node
/// uses.
fn resolved_routes<'d>(
    decl: &'d Declaration,
    nodes: &[&Node],
    index: &FastMap<Arc<str>, u32>,
    resolve: &dyn Fn(&[Source]) -> NodeSet,
) -> (Vec<ResolvedRoute<'d>>, Vec<Vec<u32>>) {
    let mut routes_of: Vec<Vec<u32>> = vec![Vec::new(); nodes.len()];
    let routes = decl
        .routes
        .iter()
        .enumerate()
        .map(|(r, route)| {
            let via: Vec<u32> = route.via.iter().filter_map(|v| index.get(v.as_str()).copied()).collect();
            let sources: Vec<NodeSet> = route.allow.iter().map(|rule| resolve(&rule.from)).collect();
            let mut users: NodeSet = set_of(sources.iter().flatten().copied().collect());
            users.retain(|u| {
                !via.contains(u) && (!route.is_exit() || nodes[*u as usize].exit.as_ref().is_some_and(|(e, _)| *e == route.name))
            });
            for &u in &users {
                routes_of[u as usize].push(r as u32);
            }
            ResolvedRoute { route, via, sources, users }
        })
        .collect();
    (routes, routes_of)
}

/// Each node's addresses: those of the topology before when it was given them (the same
/// allocation), else read from the allocation.
fn addresses(nodes: &[&Node], alloc: &Allocation, was: Option<&Previous>) -> (Vec<Option<Ipv4Addr>>, Vec<Option<Ipv6Addr>>) {
    match was.and_then(|w| w.before.addresses) {
        Some((v4, v6)) => {
            debug_assert!(v4 == by_name(nodes, &alloc.ipv4) && v6 == by_name(nodes, &alloc.ipv6), "addresses given are the allocation's");
            (v4.to_vec(), v6.to_vec())
        }
        None => (by_name(nodes, &alloc.ipv4), by_name(nodes, &alloc.ipv6)),
    }
}

/// Each node's key (declared, else from `keys`): those of the topology before but for the names
/// changed since and the nodes declared anew, when it says where it stood in this key set.
fn node_keys(nodes: &[&Node], keys: &crate::keys::Keys, index: &FastMap<Arc<str>, u32>, was: Option<&Previous>) -> Vec<Option<PublicKey>> {
    let key_of = |n: &Node| n.public_key.or_else(|| keys.get(&n.name));
    let kept = was.and_then(|w| {
        let names = keys.changed_since(w.before.keys.1.as_ref()?)?;
        let mut kept = w.before.keys.0.to_vec();
        for a in names.filter_map(|n| index.get(n)).chain(&w.changed) {
            kept[*a as usize] = key_of(nodes[*a as usize]);
        }
        Some(kept)
    });
    kept.unwrap_or_else(|| nodes.iter().map(|n| key_of(n)).collect())
}

/// The modules some node runs, in name order with their runners; each node's of them; and each
/// one's rules (from `module_rules`).
#[allow(clippy::type_complexity)]
fn modules_run(
    runners: &FastMap<Arc<str>, NodeSet>,
    module_rules: &FastMap<&str, std::ops::Range<usize>>,
    n: usize,
) -> (Vec<(Arc<str>, NodeSet)>, Lists, Vec<std::ops::Range<usize>>) {
    let mut names: Vec<(Arc<str>, NodeSet)> = runners.iter().filter(|(_, r)| !r.is_empty()).map(|(m, r)| (m.clone(), r.clone())).collect();
    names.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let modules_of =
        Lists::gather(n, || names.iter().enumerate().flat_map(|(m, (_, runners))| runners.iter().map(move |&r| (r, m as u32))));
    let rules = names.iter().map(|(m, _)| module_rules[&**m].clone()).collect();
    (names, modules_of, rules)
}

impl<'d> Topology<'d> {
    /// Indexes a validated declaration. `keys` are the WireGuard keys known for nodes (enrolled
    /// or declared); a key declared in the mesh wins over one given here.
    pub fn new(decl: &'d Declaration, alloc: &Allocation, keys: &crate::keys::Keys) -> Self {
        Self::new_after(decl, alloc, keys, None)
    }

    /// `new`, given the topology of the compile before (`before`). When this declaration names
    /// the same nodes in the same places, that one's order by name is this one's (the names are
    /// not sorted again) and what it kept is edited where nodes changed: the index by name, the
    /// groups and runners, the addresses when the allocation is the same, the keys but those
    /// changed since, and the reach when no node is reached another way. A change that adds,
    /// removes and renames no node (a group move, a rule) costs what it changes there; at 100,000
    /// nodes these were 190 ms of a group move.
    pub fn new_after(decl: &'d Declaration, alloc: &Allocation, keys: &crate::keys::Keys, before: Option<Before<'_>>) -> Self {
        let before = before.filter(|b| {
            b.decl.nodes.len() == decl.nodes.len()
                && b.order.len() == decl.nodes.len()
                && b.decl.nodes.iter().zip(&decl.nodes).all(|(a, b)| Arc::ptr_eq(a, b) || a.name == b.name)
        });
        let order = before.map_or_else(|| order_by_name(decl), |b| b.order.to_vec());
        let nodes: Vec<&Node> = order.iter().map(|&i| &*decl.nodes[i as usize]).collect();
        let was = before.map(|b| Previous::new(b, &order, &nodes));
        let kept = was.as_ref().and_then(|w| w.before.kept.edited(decl, w.before.decl, &nodes, &w.nodes, &w.changed));
        let kept = kept.unwrap_or_else(|| Kept::new(decl, &nodes));
        let index = kept.index.clone();
        let network_index: FastMap<&str, usize> = decl.networks.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
        let hubs: Vec<u32> = (0..nodes.len() as u32).filter(|&i| nodes[i as usize].hub).collect();
        let groups = kept.groups(decl);
        let runners = kept.running.clone();
        let all: NodeSet = (0..nodes.len() as u32).collect();
        let resolve = |from: &[Source]| {
            let mut sources = Vec::new();
            for s in from {
                match s {
                    Source::Node(n) => sources.extend(index.get(n.as_str())),
                    Source::Group(g) => sources.extend(groups.get(g.as_str()).into_iter().flatten()),
                    Source::Module(m) => sources.extend(runners.get(m.as_str()).into_iter().flatten()),
                    Source::Pool(p) => sources.extend(pool_members(&nodes, p)),
                    Source::Expose(e) => sources
                        .extend(decl.exposure(e).into_iter().flat_map(|e| e.via.iter().filter_map(|v| index.get(v.as_str()).copied()))),
                    Source::Mesh => sources.extend(&all),
                }
            }
            set_of(sources)
        };
        let (rules, module_rules) = resolved_rules(decl, &resolve);
        let (routes, routes_of) = resolved_routes(decl, &nodes, &index, &resolve);
        let exposures: Vec<ResolvedExposure> = decl
            .exposures
            .iter()
            .map(|e| ResolvedExposure {
                exposure: e,
                via: set_of(e.via.iter().filter_map(|v| index.get(v.as_str()).copied()).collect()),
                runners: runners.get(e.module.as_str()).cloned().unwrap_or_default(),
            })
            .collect();
        let (ipv4, ipv6) = addresses(&nodes, alloc, was.as_ref());
        let withdrawn: Vec<bool> = match keys.withdrawn().is_empty() {
            true => vec![false; nodes.len()],
            false => nodes.iter().map(|n| keys.is_withdrawn(&n.name)).collect(),
        };
        let withdrawn_names = keys.withdrawn().clone();
        let keys = node_keys(&nodes, keys, &index, was.as_ref());
        let (module_names, modules_of, module_names_rules) = modules_run(&runners, &module_rules, nodes.len());
        let reach = match was.as_ref().filter(|w| w.same_reach(decl, &nodes)) {
            Some(w) => w.before.reach.rekeyed(&keys),
            None => reach_of(&nodes, &network_index, decl.networks.len(), hubs.clone(), &keys),
        };
        Topology {
            decl,
            nodes,
            order,
            index,
            same_names: was.is_some(),
            kept,
            ipv4,
            ipv6,
            keys,
            withdrawn,
            withdrawn_names,
            network_index,
            reach,
            hubs,
            groups,
            runners,
            rules,
            module_rules,
            module_names,
            routes,
            routes_of,
            exposures,
            module_names_rules,
            modules_of,
        }
    }

    /// This topology as the one before the next (`new_after`), with where it stood in its key set
    /// when that is known.
    pub fn before(&self, keys_seen: Option<crate::keys::KeysSeen>) -> Before<'_> {
        Before { decl: self.decl, order: &self.order, kept: &self.kept, addresses: None, keys: (&self.keys, keys_seen), reach: &self.reach }
    }

    /// What the next topology over the same names starts from, owned; `decl` is this one's.
    pub fn held(&self, decl: &Arc<Declaration>) -> Held {
        debug_assert!(std::ptr::eq(&**decl, self.decl), "a topology is held with its own declaration");
        Held {
            decl: decl.clone(),
            order: self.order.clone(),
            kept: self.kept.clone(),
            ipv4: self.ipv4.clone(),
            ipv6: self.ipv6.clone(),
            keys: self.keys.clone(),
            reach: self.reach.clone(),
        }
    }

    pub fn name(&self, i: u32) -> &'d str {
        &self.nodes[i as usize].name
    }

    /// The first part in which this topology differs from `other` (another index of the mesh, or
    /// the same mesh indexed another way), by name; `None` when they are the same. For tests that
    /// hold a topology made from the one before to one made afresh.
    pub fn differs_from(&self, other: &Topology) -> Option<&'static str> {
        let names = |t: &Topology| t.nodes.iter().map(|n| n.name.clone()).collect::<Vec<_>>();
        let parts: [(&'static str, bool); 20] = [
            ("nodes", names(self) == names(other)),
            ("order", self.order == other.order),
            ("kept", self.kept == other.kept),
            ("index", self.index == other.index),
            ("ipv4", self.ipv4 == other.ipv4),
            ("ipv6", self.ipv6 == other.ipv6),
            ("keys", self.keys == other.keys),
            ("withdrawn", self.withdrawn == other.withdrawn && self.withdrawn_names == other.withdrawn_names),
            ("network_index", self.network_index == other.network_index),
            ("reach", self.reach == other.reach),
            ("hubs", self.hubs == other.hubs),
            ("groups", self.groups == other.groups),
            ("runners", self.runners == other.runners),
            ("rules", self.rules == other.rules),
            ("module_rules", self.module_rules == other.module_rules),
            ("module_names", self.module_names == other.module_names),
            ("routes", self.routes == other.routes && self.routes_of == other.routes_of),
            ("exposures", self.exposures == other.exposures),
            ("module_names_rules", self.module_names_rules == other.module_names_rules),
            ("modules_of", self.modules_of == other.modules_of),
        ];
        parts.iter().find(|(_, same)| !same).map(|(name, _)| *name)
    }

    /// The endpoint of `b` that `a` dials (see `Reach::dials`).
    pub fn dials(&self, a: u32, b: u32) -> Option<usize> {
        self.reach.dials(a, b)
    }

    pub fn direct(&self, a: u32, b: u32) -> bool {
        self.reach.direct(a, b)
    }

    /// The path rule (see `Reach::path`).
    pub fn path(&self, a: u32, b: u32, need_keys: bool) -> Path {
        self.reach.path(a, b, need_keys)
    }

    /// The rules of the modules `node` runs, in manifest order of module names.
    pub fn inbound_rules(&self, node: u32) -> impl Iterator<Item = (usize, &ResolvedRule<'d>)> {
        let rules = self.modules_of[node as usize].iter().flat_map(|&m| self.module_names_rules[m as usize].clone());
        rules.map(move |i| (i, &self.rules[i]))
    }

    /// The modules `node` runs, as positions in `module_names`.
    pub fn modules_run(&self, node: u32) -> &[u32] {
        &self.modules_of[node as usize]
    }

    /// The rules of module `m` of `module_names`, as positions in `rules`.
    pub fn module_rules_of(&self, m: u32) -> std::ops::Range<usize> {
        self.module_names_rules[m as usize].clone()
    }

    /// For every node, the nodes it has any allowed traffic with, in either direction.
    pub fn partners(&self) -> Vec<NodeSet> {
        let sources = self.module_sources();
        let reached = self.modules_reached(&sources);
        crate::par::map(self.nodes.len(), |a| self.partners_of(a as u32, &sources, &reached))
    }

    /// For every module of `module_names`, the nodes its rules admit: the union of their sources.
    pub fn module_sources(&self) -> Vec<NodeSet> {
        self.module_names
            .iter()
            .map(|(name, _)| {
                set_of(self.rules[self.module_rules[&**name].clone()].iter().flat_map(|r| r.sources.iter().copied()).collect())
            })
            .collect()
    }

    /// The partners of one node (what `partners` gives it), from `module_sources` and
    /// `modules_reached` of them: the sources of the modules it runs, the runners of the modules
    /// that admit it, and a route's routers for its users and users for its routers.
    pub fn partners_of(&self, a: u32, sources: &[NodeSet], reached: &Lists) -> NodeSet {
        let mut v = Vec::new();
        for &m in &self.modules_of[a as usize] {
            v.extend_from_slice(&sources[m as usize]);
        }
        for &m in &reached[a as usize] {
            v.extend_from_slice(&self.module_names[m as usize].1);
        }
        for r in &self.routes {
            if r.users.binary_search(&a).is_ok() {
                v.extend_from_slice(&r.via);
            }
            if r.via.contains(&a) {
                v.extend_from_slice(&r.users);
            }
        }
        let mut v = set_of(v);
        v.retain(|&p| p != a);
        v
    }

    /// For every node, the modules it may reach (a rule of the module names it as a source), in
    /// name order, as positions in `module_names`; `sources` is `module_sources`.
    pub fn modules_reached(&self, sources: &[NodeSet]) -> Lists {
        Lists::gather(self.nodes.len(), || sources.iter().enumerate().flat_map(|(m, sources)| sources.iter().map(move |&s| (s, m as u32))))
    }

    /// The rules on `to` that admit traffic from `from` with this protocol and port.
    pub fn admitting(&self, from: u32, to: u32, proto: Proto, port: Option<u16>) -> Vec<&ResolvedRule<'d>> {
        self.inbound_rules(to).map(|(_, r)| r).filter(|r| r.sources.binary_search(&from).is_ok() && r.admits(proto, port)).collect()
    }
}
