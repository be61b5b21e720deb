//! The mesh as an index: nodes by position, network sets as bits, groups and module runners
//! as node sets, rules with their sources resolved, and the path rule between two nodes.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use crate::alloc::Allocation;
use crate::decl::{Declaration, Exposure, Node, PortRange, Proto, PublicKey, Route, Rule, Source};
use crate::FastMap;

mod build;
mod kept;
mod reach;

use build::*;
use kept::Previous;
pub use kept::{Addresses, Before, Held, Kept};
use reach::reach_of;
pub(crate) use reach::same_reach;
pub use reach::Reach;

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
        // The nodes before, in the same places (`n` of them), and those after them.
        let kept_first = |b: &Before, n: usize| {
            b.decl.nodes.len() == n
                && b.order.len() == n
                && b.decl.nodes.iter().zip(&decl.nodes).all(|(a, b)| Arc::ptr_eq(a, b) || a.name == b.name)
        };
        let appended = before.filter(|b| decl.nodes.len() > b.decl.nodes.len() && kept_first(b, b.decl.nodes.len()));
        let before = before.filter(|b| kept_first(b, decl.nodes.len()));
        let order = match (before, appended) {
            (Some(b), _) => b.order.to_vec(),
            (None, Some(b)) => build::order_with_new(decl, b.order),
            (None, None) => order_by_name(decl),
        };
        let nodes: Vec<&Node> = order.iter().map(|&i| &*decl.nodes[i as usize]).collect();
        let was = before.map(|b| Previous::new(b, &order, &nodes));
        let kept = was.as_ref().and_then(|w| w.before.kept.edited(decl, w.before.decl, &nodes, &w.nodes, &w.changed));
        let network_index: FastMap<&str, usize> = decl.networks.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
        let hubs: Vec<u32> = (0..nodes.len() as u32).filter(|&i| nodes[i as usize].hub).collect();
        // Made afresh (a full compile, or names that came or went), the index and the addresses,
        // keys and reach need nothing of each other: made at once, on two cores (at 100,000
        // nodes, 60 and 70 ms one after the other).
        let (kept, fresh) = match (kept, &was) {
            (Some(kept), _) => (kept, None),
            (None, Some(_)) => (Kept::new(decl, &nodes), None),
            (None, None) => {
                let (kept, fresh) = crate::par::join(
                    || Kept::new(decl, &nodes),
                    || {
                        let addresses = addresses(&nodes, alloc, None);
                        let keys = node_keys(&nodes, keys, &FastMap::default(), None);
                        let reach = reach_of(&nodes, &network_index, decl.networks.len(), hubs.clone(), &keys);
                        (addresses, keys, reach)
                    },
                );
                (kept, Some(fresh))
            }
        };
        let index = kept.index.clone();
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
        let withdrawn: Vec<bool> = match keys.withdrawn().is_empty() {
            true => vec![false; nodes.len()],
            false => nodes.iter().map(|n| keys.is_withdrawn(&n.name)).collect(),
        };
        let withdrawn_names = keys.withdrawn().clone();
        let ((ipv4, ipv6), keys, reach) = match fresh {
            Some(fresh) => fresh,
            None => {
                let addresses = addresses(&nodes, alloc, was.as_ref());
                let keys = node_keys(&nodes, keys, &index, was.as_ref());
                let reach = match was.as_ref().filter(|w| w.same_reach(decl, &nodes)) {
                    Some(w) => w.before.reach.rekeyed(&keys),
                    None => reach_of(&nodes, &network_index, decl.networks.len(), hubs.clone(), &keys),
                };
                (addresses, keys, reach)
            }
        };
        let (module_names, modules_of, module_names_rules) = modules_run(&runners, &module_rules, nodes.len());
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
