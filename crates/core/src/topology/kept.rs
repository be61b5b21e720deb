//! What a topology keeps for the next over the same names, and the topology before as the next
//! one reads it.

use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

use super::*;

/// What a topology keeps for the next one over the same names (`Topology::new_after`): the index
/// by name, the groups as the nodes name them and as they are declared, and the modules' runners.
/// Shared, so that a compile whose change touches none of them copies nothing, and one that does
/// edits them where the changed nodes are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Kept {
    pub index: Arc<FastMap<Arc<str>, u32>>,
    /// Per group name, the nodes that name it in their `groups`.
    pub(super) grouped: Arc<FastMap<Arc<str>, NodeSet>>,
    /// Per declared group, in declaration order, its `members` that are nodes.
    pub(super) members: Arc<Vec<NodeSet>>,
    /// Per module, declared or run, its runners.
    pub(super) running: Arc<FastMap<Arc<str>, NodeSet>>,
    /// Per position, the part of its name (`plan::part_of`, ADR 0039): read in order where a
    /// module's or rule's nodes are split by part, without going to each name.
    pub parts: Arc<Vec<u8>>,
}

impl Kept {
    /// Made from every node.
    pub(super) fn new(decl: &Declaration, nodes: &[&Node]) -> Kept {
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
        let parts = nodes.iter().map(|n| crate::plan::part_of(&n.name)).collect();
        Kept {
            index: Arc::new(index),
            grouped: Arc::new(shared(grouped)),
            members: Arc::new(members),
            running: Arc::new(shared(running)),
            parts: Arc::new(parts),
        }
    }

    /// This one (made for `was`, whose nodes are in the same places) edited for `decl`: the nodes
    /// at `changed` (positions, declared anew) leave the groups and modules they named and join
    /// those they name now, and the declared groups whose members changed are resolved again.
    /// `None` when the declared groups or modules are others (by name, in order).
    pub(super) fn edited(&self, decl: &Declaration, was: &Declaration, nodes: &[&Node], before: &[&Node], changed: &[u32]) -> Option<Kept> {
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
    pub(super) fn groups(&self, decl: &Declaration) -> FastMap<Arc<str>, NodeSet> {
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
    pub(super) decl: Arc<Declaration>,
    pub(super) order: Vec<u32>,
    pub(super) kept: Kept,
    pub(super) ipv4: Vec<Option<Ipv4Addr>>,
    pub(super) ipv6: Vec<Option<Ipv6Addr>>,
    pub(super) keys: Vec<Option<PublicKey>>,
    pub(super) reach: Reach,
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

/// The topology before over the same names in the same places: each node as it was declared
/// there, and the positions of the nodes declared anew (another `Arc<Node>`).
pub(super) struct Previous<'b> {
    pub(super) before: Before<'b>,
    pub(super) nodes: Vec<&'b Node>,
    pub(super) changed: Vec<u32>,
}

impl<'b> Previous<'b> {
    pub(super) fn new(before: Before<'b>, order: &[u32], nodes: &[&Node]) -> Previous<'b> {
        let was: Vec<&Node> = order.iter().map(|&i| &*before.decl.nodes[i as usize]).collect();
        let changed = (0..nodes.len() as u32).filter(|&a| !std::ptr::eq(nodes[a as usize], was[a as usize])).collect();
        Previous { before, nodes: was, changed }
    }

    /// Whether the reach before holds for `decl`: the same networks, and every node declared anew
    /// (`nodes`, in the same places) reached as it was and a hub as it was (only the hubs' keys are
    /// read again).
    pub(super) fn same_reach(&self, decl: &Declaration, nodes: &[&Node]) -> bool {
        let nets = &self.before.decl.networks;
        decl.networks.len() == nets.len()
            && decl.networks.iter().zip(nets).all(|(x, y)| x.name == y.name)
            && self.changed.iter().all(|&a| {
                let (now, was) = (nodes[a as usize], self.nodes[a as usize]);
                now.hub == was.hub && same_reach(now, was)
            })
    }
}
