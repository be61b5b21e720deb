//! The cache a compile keeps for the next one: the index of the mesh as this compile saw it
//! (names, texts, addresses, keys, reach, partners, paths, relaying hubs, module runners and
//! sources, resolved rules, routes) and where it stood in its key set.

use std::net::SocketAddr;
use std::sync::Arc;

use crate::decl::{Declaration, PublicKey};
use crate::keys::KeysSeen;
use crate::par;
use crate::plan::{NodeText, PeerPlan, RouteBlock};
use crate::topology::{Before, Kept, Lists, NodeSet, Path, Reach, Topology};

/// What a compile keeps so that the next one recomputes only the nodes the change reaches
/// (`rekey`, `redeclare`). Positions are node positions in name order.
#[derive(Clone, Debug)]
pub(super) struct Cache {
    pub(super) decl: Arc<Declaration>,
    pub(super) names: Vec<Arc<str>>,
    /// Every node as others' files name it.
    pub(super) texts: Vec<Arc<NodeText>>,
    /// Position in name order to index in `decl.nodes`.
    pub(super) order: Vec<u32>,
    /// What the topology kept for the next (its index by name among it).
    pub(super) kept: Kept,
    pub(super) ipv4: Vec<Option<std::net::Ipv4Addr>>,
    pub(super) ipv6: Vec<Option<std::net::Ipv6Addr>>,
    pub(super) keys: Vec<Option<PublicKey>>,
    pub(super) reach: Reach,
    pub(super) partners: Vec<NodeSet>,
    pub(super) paths: Vec<Vec<(u32, Path)>>,
    pub(super) relayed_by: Vec<Vec<u32>>,
    /// Per node, the modules it may reach, as positions in `Topology::module_names`.
    pub(super) reached: Lists,
    /// `Topology::module_names`, and each module's sources (`Topology::module_sources`): what
    /// the partners come from.
    pub(super) module_names: Vec<(Arc<str>, NodeSet)>,
    pub(super) module_sources: Vec<NodeSet>,
    /// Per route, its users.
    pub(super) route_users: Vec<NodeSet>,
    /// Every rule of `Topology::rules` as it was resolved: its module, number, declaration and
    /// sources, what its filter block is made from (with the addresses).
    pub(super) rules: Vec<(Arc<str>, usize, crate::decl::Rule, NodeSet)>,
    /// Per route, its routers in order of preference.
    pub(super) route_via: Vec<Vec<u32>>,
    /// Per node, the routes it uses.
    pub(super) routes_of: Vec<Vec<u32>>,
    pub(super) route_blocks: Vec<Arc<RouteBlock>>,
    /// Whether each node routes for some route.
    pub(super) router: Vec<bool>,
    /// Whether each node runs an exposed module: its key decides the ingress nodes' backends.
    pub(super) backend: Vec<bool>,
    /// Where the compile that made this cache stood in its key set: the next one reads only the
    /// names changed since.
    pub(super) keys_seen: Option<KeysSeen>,
    /// The names withdrawn from the mesh (revoked) this compile left out of every zone: a
    /// recompile given another set makes every plan again (`full`).
    pub(super) withdrawn: Arc<std::collections::BTreeSet<String>>,
    /// The nodes whose plans name a node left out for want of a key or one without a path: the
    /// only plans the warnings come from (`warnings::Warned`).
    pub(super) warned: std::collections::BTreeSet<Arc<str>>,
}

/// The texts of the nodes before, for `Cache::new`.
pub(super) enum Old<F> {
    /// The texts and names of the cache before, whose nodes are these in the same places.
    Texts(Vec<Arc<NodeText>>, Vec<Arc<str>>),
    /// Each node's text before, if it had one.
    Each(F),
}

/// Every node's partners, its paths to them, and for every hub the nodes it relays for.
pub(super) type Links = (Vec<NodeSet>, Vec<Vec<(u32, Path)>>, Vec<Vec<u32>>);

impl Cache {
    /// `module_sources` and `reached` are `Topology::module_sources` and `modules_reached` of them.
    /// `old` gives the nodes' texts from the previous compile, kept when its name and addresses are
    /// the same (so that plans compare them by pointer).
    pub(super) fn new(
        decl: &Arc<Declaration>,
        topo: &Topology,
        (partners, paths, relayed_by): Links,
        (module_sources, reached): (Vec<NodeSet>, Lists),
        old: Old<impl Fn(usize) -> Option<Arc<NodeText>> + Sync>,
    ) -> Cache {
        let mut router = vec![false; topo.nodes.len()];
        for r in &topo.routes {
            for &v in &r.via {
                router[v as usize] = true;
            }
        }
        let mut backend = vec![false; topo.nodes.len()];
        for e in &topo.exposures {
            for &r in &e.runners {
                backend[r as usize] = true;
            }
        }
        let text = |a: usize| Arc::new(NodeText::new(Arc::from(topo.nodes[a].name.as_str()), topo.ipv4[a], topo.ipv6[a]));
        let (texts, names) = match old {
            // The same names in the same places: the texts before, but where addresses moved.
            Old::Texts(mut texts, names) => {
                for (a, t) in texts.iter_mut().enumerate() {
                    if t.ipv4 != topo.ipv4[a] || t.ipv6 != topo.ipv6[a] {
                        *t = text(a);
                    }
                }
                (texts, names)
            }
            Old::Each(old) => {
                let texts: Vec<Arc<NodeText>> = par::map(topo.nodes.len(), |a| match old(a) {
                    Some(t) if *t.name == topo.nodes[a].name && t.ipv4 == topo.ipv4[a] && t.ipv6 == topo.ipv6[a] => t,
                    _ => text(a),
                });
                let names = texts.iter().map(|t| t.name.clone()).collect();
                (texts, names)
            }
        };
        Cache {
            texts,
            decl: decl.clone(),
            order: topo.order.clone(),
            kept: topo.kept.clone(),
            names,
            ipv4: topo.ipv4.clone(),
            ipv6: topo.ipv6.clone(),
            keys: topo.keys.clone(),
            reach: topo.reach.clone(),
            partners,
            relayed_by,
            paths,
            reached,
            module_names: topo.module_names.clone(),
            module_sources,
            route_users: topo.routes.iter().map(|r| r.users.clone()).collect(),
            rules: topo.rules.iter().map(|r| (Arc::from(r.module), r.number, r.rule.clone(), r.sources.clone())).collect(),
            route_via: topo.routes.iter().map(|r| r.via.clone()).collect(),
            routes_of: topo.routes_of.clone(),
            // Set by the caller, from what the plans share.
            route_blocks: Vec::new(),
            router,
            backend,
            // Set by `compile`, which has the key set.
            keys_seen: None,
            withdrawn: topo.withdrawn_names.clone(),
            // Set by the caller, from the plans.
            warned: Default::default(),
        }
    }

    /// The topology this cache was made with, for the next (`Topology::new_after`); its addresses
    /// when `allocation_kept` (the next compile holds the same allocation).
    pub(super) fn before(&self, allocation_kept: bool) -> Before<'_> {
        Before {
            decl: &self.decl,
            order: &self.order,
            kept: &self.kept,
            addresses: allocation_kept.then_some((&self.ipv4[..], &self.ipv6[..])),
            keys: (&self.keys, self.keys_seen),
            reach: &self.reach,
        }
    }

    /// Where node `a` is declared.
    pub(super) fn loc(&self, a: u32) -> crate::Loc {
        self.decl.nodes[self.order[a as usize] as usize].loc.clone()
    }

    /// Endpoint `e` of node `b`, as declared.
    fn endpoint(&self, b: u32, e: usize) -> SocketAddr {
        self.decl.nodes[self.order[b as usize] as usize].endpoints[e].address
    }

    /// `b` as a peer: `dials` is its endpoint the node dials, `dialled` whether `b` dials back.
    pub(super) fn peer(&self, b: u32, dials: Option<usize>, dialled: bool, relays_for: Vec<Arc<NodeText>>) -> PeerPlan {
        PeerPlan::new(
            self.texts[b as usize].clone(),
            self.keys[b as usize].expect("peers have keys"),
            dials.map(|e| self.endpoint(b, e)),
            dials.is_some() && !dialled,
            relays_for,
        )
    }
}
