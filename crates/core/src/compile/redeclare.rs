//! The recompile for a declaration that keeps the mesh settings, the networks, the hubs (and
//! their keys) and the routes (ADR 0010): the mesh is indexed again, and only the nodes the change
//! can reach are recomputed, in phases: where each node was before, whose partners are made
//! again, which nodes changed and whom that reaches, whose plan inputs changed, the paths, the
//! relaying hubs, and the outputs edited where nodes came, went or were recomputed.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::cache::{Cache, Old};
use super::full::{node_plan, rules_of, shared, Shared};
use super::warnings::{diagnostics, rewarn};
use super::{files_of, Compiled, NodeOutput, Recompiled};
use crate::decl::Declaration;
use crate::par;
use crate::plan::{FileResource, NodePlan, NFTABLES_CONF};
use crate::topology::{Lists, NodeSet, Path, Topology};

/// The recompile for a new declaration that keeps the mesh settings, the networks, the hubs and
/// the routes as they were: nodes join, leave, change group, modules, endpoints or addresses, and
/// rules change their sources. Recomputes the nodes such a change can reach: the nodes that
/// changed, with their old and new partners when what others see of them changed (address, key,
/// networks, endpoints); the nodes whose partners, filter rules, reachable module blocks or routes
/// changed; and the hubs whose relayed nodes changed. Every other node keeps its plan, its files
/// and its paths. Gives `previous` back when it does not apply.
pub(super) fn redeclare(decl: &Arc<Declaration>, topo: &Topology, mut previous: Compiled) -> Recompiled {
    let Some(mut old) = previous.cache.take() else { return Recompiled::NotApplicable(previous) };
    // Another set of withdrawn (revoked) nodes changes zones everywhere their names were.
    if !keeps_mesh(decl, topo, &old) || old.withdrawn != topo.withdrawn_names {
        previous.cache = Some(old);
        return Recompiled::NotApplicable(previous);
    }
    // The unaffected nodes' paths move into the new cache (`Redeclare::paths`); nothing before
    // that phase reads them.
    let old_paths = std::mem::take(&mut old.paths);
    let sources = topo.module_sources();
    let reached = topo.modules_reached(&sources);
    let step = Redeclare::new(topo, &old, &sources, &reached);
    let shared = shared(topo, Some(&previous), Some(&old), Some(&step.old_to_new));
    let (mut affected, moved) = step.reached_by_changes();
    let mut rules_only = vec![false; topo.nodes.len()];
    step.mark_changed_inputs(&shared, &previous, (&sources, &reached), &mut affected, &mut rules_only);
    let paths = step.paths(old_paths, &affected);
    let relayed_by = step.relayed_by(&paths, &affected);
    step.mark_hubs(&relayed_by, &moved, &mut affected);
    // An ingress node's backends follow its exposed modules' runners and their keys: ingress
    // nodes are few, and always made again.
    for e in &topo.exposures {
        for &v in &e.via {
            affected[v as usize] = true;
        }
    }
    // A node made again for another reason is made whole.
    for (only, &a) in rules_only.iter_mut().zip(&affected) {
        *only &= !a;
    }
    let Redeclare { new_to_old, old_to_new, fresh_partners, .. } = step;
    let mut old_partners = std::mem::take(&mut old.partners);
    let partners: Vec<NodeSet> =
        fresh_partners.into_iter().enumerate().map(|(a, p)| p.unwrap_or_else(|| std::mem::take(&mut old_partners[a]))).collect();
    let mut cache = Cache::new(
        decl,
        topo,
        (partners, paths, relayed_by),
        (sources, reached),
        match topo.same_names {
            true => Old::Texts(std::mem::take(&mut old.texts), std::mem::take(&mut old.names)),
            false => Old::Each(|a: usize| new_to_old[a].map(|o| old.texts[o as usize].clone())),
        },
    );
    cache.route_blocks = shared.route_blocks.clone();
    let gone: Vec<&Arc<str>> = old_to_new.iter().zip(&old.names).filter(|(a, _)| a.is_none()).map(|(_, name)| name).collect();
    let (nodes, rendered) = outputs(topo, &shared, &cache, (&affected, &rules_only), &gone, std::mem::take(&mut previous.nodes));
    // The warnings come from the plans that warn, not from every plan (at 100,000 nodes, 5-8 ms).
    cache.warned = std::mem::take(&mut old.warned);
    rewarn(&mut cache.warned, &nodes, &gone, &rendered);
    let diagnostics = diagnostics(cache.warned.iter().map(|n| &*nodes[&**n].plan), &cache);
    Recompiled::Done(Compiled {
        allocation: previous.allocation,
        nodes,
        diagnostics,
        rendered,
        rule_blocks: shared.rule_blocks,
        zone_blocks: shared.zone_blocks,
        cache: Some(Box::new(cache)),
    })
}

/// Whether the declaration keeps the mesh settings, networks, hubs (and their keys) and routes.
fn keeps_mesh(decl: &Declaration, topo: &Topology, old: &Cache) -> bool {
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
            let o = old.order[old.kept.index[&***name] as usize] as usize;
            topo.name(h) == &***name
                && same_node(topo.nodes[h as usize], &od.nodes[o])
                && topo.keys[h as usize] == old.keys[old.kept.index[&***name] as usize]
        });
    let same_routes = decl.routes.len() == od.routes.len() && decl.routes.iter().zip(&od.routes).all(|(a, b)| same_route(a, b));
    same_settings && same_networks && same_hubs && same_routes && decl.same_exposures(od)
}

/// What the phases of a redeclare share: the new topology, the cache of the compile before, where
/// each node is in the other, and the partners made again.
struct Redeclare<'a, 'd> {
    topo: &'a Topology<'d>,
    old: &'a Cache,
    /// Each node's old position, by name; `None` for a node that is new.
    new_to_old: Vec<Option<u32>>,
    /// Each old position's node now; `None` for a node that left.
    old_to_new: Vec<Option<u32>>,
    /// Every node that stayed is where it was (nodes joined or left only after the last that
    /// stayed: a pool's member joining behind the declared nodes), so the old partners and paths
    /// of a node that stayed name the same positions.
    stable: bool,
    /// Per node, its partners when they were made again; else its old ones stand.
    fresh_partners: Vec<Option<NodeSet>>,
    /// Which nodes' partners may differ from their old ones (`partners_touched`); `None`: any.
    touched: Option<Vec<bool>>,
}

impl<'a, 'd> Redeclare<'a, 'd> {
    /// Where each node was and is, by name, and the partners made again.
    fn new(topo: &'a Topology<'d>, old: &'a Cache, sources: &[NodeSet], reached: &Lists) -> Self {
        let n = topo.nodes.len();
        // The same names in the same places (the topology knows): positions are the same.
        let new_to_old: Vec<Option<u32>> = match topo.same_names {
            true => (0..n as u32).map(Some).collect(),
            // A lookup by name each, on every core (at 100,000 nodes, 24 ms on one).
            false => par::map(n, |a| old.kept.index.get(topo.nodes[a].name.as_str()).copied()),
        };
        let mut old_to_new: Vec<Option<u32>> = vec![None; old.names.len()];
        for (a, o) in new_to_old.iter().enumerate() {
            if let Some(o) = o {
                old_to_new[*o as usize] = Some(a as u32);
            }
        }
        let stable = old_to_new.iter().enumerate().all(|(o, a)| a.is_none_or(|a| a as usize == o));
        // Only the nodes a change of a module's runners or sources reaches, and the new nodes,
        // have their partners made again (`partners_touched`); the others keep theirs, in their
        // new positions when nodes came or went before them (a pool's member whose name sorts
        // among the declared nodes). Positions are in name order both times, so a kept list
        // renumbered is still in order.
        let touched = partners_touched(topo, sources, old, &old_to_new);
        let fresh_partners: Vec<Option<NodeSet>> = match &touched {
            Some(touched) => par::map(n, |a| {
                if touched[a] {
                    return Some(topo.partners_of(a as u32, sources, reached));
                }
                if stable {
                    return None;
                }
                let o = new_to_old[a].expect("new nodes are touched") as usize;
                let at = |q: &u32| old_to_new[*q as usize].expect("the partners of an untouched node stayed");
                Some(old.partners[o].iter().map(at).collect())
            }),
            None => topo.partners().into_iter().map(Some).collect(),
        };
        Redeclare { topo, old, new_to_old, old_to_new, stable, fresh_partners, touched }
    }

    /// Node `a`'s partners now: made again, or kept from before.
    fn partners(&self, a: usize) -> &NodeSet {
        self.fresh_partners[a].as_ref().unwrap_or_else(|| &self.old.partners[a])
    }

    /// Marks the old partners of the node at old position `o`.
    fn mark_old_partners(&self, affected: &mut [bool], o: u32) {
        for &p in &self.old.partners[o as usize] {
            if let Some(a) = self.old_to_new[p as usize] {
                affected[a as usize] = true;
            }
        }
    }

    /// The nodes a change of their own reaches, and which nodes moved (for `mark_hubs`).
    fn reached_by_changes(&self) -> (Vec<bool>, Vec<bool>) {
        let (topo, old) = (self.topo, self.old);
        let n = topo.nodes.len();
        let mut affected = vec![false; n];
        // `changed`: the node's declaration, address or key changed. `moved`: what others' files
        // say of it changed (its address or key), or how it is reached (networks, endpoints), or
        // it is new: its partners, old and new, are reached too, as are the old partners of a
        // node that left. A change of groups or modules alone reaches others through their
        // partners, rules and module blocks (`mark_changed_inputs`).
        let mut changed = vec![false; n];
        let mut moved = vec![false; n];
        for a in 0..n {
            let Some(o) = self.new_to_old[a] else {
                changed[a] = true;
                moved[a] = true;
                continue;
            };
            let o = o as usize;
            let (now, was) = (topo.nodes[a], &old.decl.nodes[old.order[o] as usize]);
            moved[a] = !same_reach(now, was) || topo.ipv4[a] != old.ipv4[o] || topo.ipv6[a] != old.ipv6[o] || topo.keys[a] != old.keys[o];
            changed[a] = moved[a] || !same_node(now, was);
        }
        for (o, a) in self.old_to_new.iter().enumerate() {
            if a.is_none() {
                self.mark_old_partners(&mut affected, o as u32);
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
            for &p in self.partners(a) {
                affected[p as usize] = true;
            }
            if let Some(o) = self.new_to_old[a] {
                self.mark_old_partners(&mut affected, o);
            }
        }
        (affected, moved)
    }

    /// Marks the nodes whose partners, module or filter blocks, routes or settings changed. Reads
    /// what the cache and the blocks say of each node, not its plan (a hundred thousand plans read
    /// were most of a group move's time here), but for the routers: a plan's module blocks are
    /// those of the modules the cache lists for it, its filter blocks those of the modules it runs.
    /// A node whose filter blocks alone changed is marked in `rules_only`, not `affected`: its
    /// paths and the rest of its plan stand (`outputs`).
    ///
    /// When the modules and routes are the same, only the nodes some change can reach are read
    /// (at 100,000 nodes, reading every one was 9 ms of a group move): those whose partners may
    /// differ (`partners_touched`), those that reach a module whose zone block changed (its
    /// sources), those that run a module whose filter blocks changed (its runners), and the
    /// routers. Any other node reaches the modules it reached (it would be touched otherwise),
    /// with the same blocks, runs modules with the same rules, and uses the same routes.
    fn mark_changed_inputs(
        &self,
        shared: &Shared,
        previous: &Compiled,
        (sources, reached): (&[NodeSet], &Lists),
        affected: &mut [bool],
        rules_only: &mut [bool],
    ) {
        let (topo, old) = (self.topo, self.old);
        // Another setting is in every plan.
        if previous.plans().next().is_some_and(|p| !Arc::ptr_eq(&p.common, &shared.common)) {
            affected.fill(true);
            return;
        }
        // Per module now, whether its filter blocks are those it had, the same in number and in
        // order (module blocks are interned: the same text is the same allocation).
        let mut old_rules: crate::FastMap<&str, Vec<&Arc<crate::plan::RuleBlock>>> = crate::FastMap::default();
        for ((module, ..), block) in old.rules.iter().zip(&previous.rule_blocks) {
            old_rules.entry(&**module).or_default().push(block);
        }
        let rules_same: Vec<bool> = topo
            .module_names
            .iter()
            .enumerate()
            .map(|(m, (name, _))| {
                let now = &shared.rule_blocks[topo.module_rules_of(m as u32)];
                // A module without rules had none before either, or it had the ones it has.
                old_rules
                    .get(&**name)
                    .map_or(now.is_empty(), |was| was.len() == now.len() && was.iter().zip(now).all(|(x, y)| Arc::ptr_eq(x, y)))
            })
            .collect();
        // The modules are those before, in the same places, when `touched` is known.
        let read: Option<Vec<bool>> = self.touched.as_ref().map(|touched| {
            let mut read = touched.clone();
            for (m, (_, runners)) in topo.module_names.iter().enumerate() {
                if !Arc::ptr_eq(&shared.zone_blocks[m], &previous.zone_blocks[m]) {
                    sources[m].iter().for_each(|&s| read[s as usize] = true);
                }
                if !rules_same[m] {
                    runners.iter().for_each(|&r| read[r as usize] = true);
                }
            }
            for r in &topo.routes {
                r.via.iter().for_each(|&v| read[v as usize] = true);
            }
            read
        });
        for a in 0..topo.nodes.len() {
            if affected[a] || read.as_ref().is_some_and(|read| !read[a]) {
                continue;
            }
            let o = self.new_to_old[a].expect("nodes without an old position are changed") as usize;
            let same_partners = self.fresh_partners[a].as_ref().is_none_or(|now| {
                now.len() == old.partners[o].len()
                    && now.iter().zip(&old.partners[o]).all(|(&p, &q)| self.old_to_new[q as usize] == Some(p))
            });
            let (now, was) = (&reached[a], &old.reached[o]);
            let same_modules = now.len() == was.len()
                && now.iter().zip(was).all(|(&m, &w)| Arc::ptr_eq(&shared.zone_blocks[m as usize], &previous.zone_blocks[w as usize]));
            // The node is the same (else affected already): it runs the modules it ran.
            let same_rules = topo.modules_run(a as u32).iter().all(|&m| rules_same[m as usize]);
            let routes = topo.routes_of[a] == old.routes_of[o];
            let same_route_use = routes && {
                let routes_for = topo.routes.iter().filter(|r| r.via.contains(&(a as u32))).count();
                match old.router[o] {
                    false => routes_for == 0,
                    true => {
                        let prior = &previous.nodes[&*old.names[o]].plan;
                        prior.routes_for.len() == routes_for && prior.routes_for.iter().all(|b| shared.route_blocks.iter().any(|x| x == b))
                    }
                }
            };
            let rest_same = same_partners && same_modules && same_route_use;
            affected[a] = !rest_same;
            rules_only[a] = rest_same && !same_rules;
        }
    }

    /// Every node's paths: made for the affected nodes, the old ones (renumbered) for the others.
    fn paths(&self, mut old_paths: Vec<Vec<(u32, Path)>>, affected: &[bool]) -> Vec<Vec<(u32, Path)>> {
        let topo = self.topo;
        // The same positions: the old lists, the affected nodes' made again.
        if self.stable && old_paths.len() == topo.nodes.len() {
            let at: Vec<u32> = (0..topo.nodes.len() as u32).filter(|&a| affected[a as usize]).collect();
            let fresh = par::map(at.len(), |i| self.partners(at[i] as usize).iter().map(|&b| (b, topo.path(at[i], b, true))).collect());
            for (a, list) in at.into_iter().zip(fresh) {
                old_paths[a as usize] = list;
            }
            return old_paths;
        }
        // An unaffected node has the same partners, and neither side changed: its old paths hold.
        let paths: Vec<Vec<(u32, Path)>> = par::map(topo.nodes.len(), |a| {
            if affected[a] {
                return self.partners(a).iter().map(|&b| (b, topo.path(a as u32, b, true))).collect();
            }
            Vec::new()
        });
        paths
            .into_iter()
            .enumerate()
            .map(|(a, fresh)| {
                if affected[a] {
                    return fresh;
                }
                let o = self.new_to_old[a].expect("unaffected nodes have an old position") as usize;
                let list = std::mem::take(&mut old_paths[o]);
                if self.stable {
                    return list;
                }
                let at = |i: u32| self.old_to_new[i as usize].expect("partners of unaffected nodes stay");
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
            .collect()
    }

    /// Which hubs relay for whom: the old lists for the unaffected nodes, `paths` for the others.
    fn relayed_by(&self, paths: &[Vec<(u32, Path)>], affected: &[bool]) -> Vec<Vec<u32>> {
        let (topo, old) = (self.topo, self.old);
        let mut relayed_by: Vec<Vec<u32>> = vec![Vec::new(); topo.nodes.len()];
        for &h in &topo.hubs {
            let o = self.new_to_old[h as usize].expect("hubs are unchanged") as usize;
            relayed_by[h as usize] =
                old.relayed_by[o].iter().filter_map(|&q| self.old_to_new[q as usize]).filter(|&a| !affected[a as usize]).collect();
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
        relayed_by
    }

    /// Marks the hubs whose relayed nodes changed, or one of which moved: their plans list them.
    fn mark_hubs(&self, relayed_by: &[Vec<u32>], moved: &[bool], affected: &mut [bool]) {
        for &h in &self.topo.hubs {
            let h = h as usize;
            let o = self.new_to_old[h].expect("hubs are unchanged") as usize;
            let was = &self.old.relayed_by[o];
            let same = relayed_by[h].len() == was.len()
                && relayed_by[h].iter().zip(was).all(|(&r, &q)| !moved[r as usize] && self.old_to_new[q as usize] == Some(r));
            if !same {
                affected[h] = true;
            }
        }
    }
}

/// The previous outputs, edited where nodes went, came or were recomputed; and whose files were
/// made. A node of `rules_only` keeps its plan but for its filter blocks, and its files but for
/// `nftables.conf`: a hub that runs a module whose rule lost a source keeps its hundred thousand
/// peers as they were, rather than making them again and comparing them twice (two thirds of a
/// group move's time at 100,000 nodes).
fn outputs(
    topo: &Topology,
    shared: &Shared,
    cache: &Cache,
    (affected, rules_only): (&[bool], &[bool]),
    gone: &[&Arc<str>],
    mut nodes: BTreeMap<String, NodeOutput>,
) -> (BTreeMap<String, NodeOutput>, Vec<String>) {
    // The affected nodes' plans are made again; of those, the files whose inputs changed, on
    // every core.
    let at: Vec<u32> = (0..topo.nodes.len() as u32).filter(|&a| affected[a as usize]).collect();
    let fresh: Vec<NodePlan> = par::map(at.len(), |i| node_plan(topo, shared, cache, at[i] as usize));
    for name in gone {
        nodes.remove(&***name);
    }
    let fresh: Vec<(u32, NodePlan)> = at.into_iter().zip(fresh).collect();
    let made: Vec<Option<Vec<FileResource>>> =
        par::map(fresh.len(), |i| files_of(&fresh[i].1, nodes.get(&*cache.names[fresh[i].0 as usize])));
    let mut rendered = Vec::new();
    // Edited in place: the compile holds the only reference to each plan (a publish run lets go
    // of those it kept for status before it compiles).
    for a in (0..topo.nodes.len() as u32).filter(|&a| rules_only[a as usize]) {
        let name = &cache.names[a as usize];
        let out = nodes.get_mut(&**name).expect("a node whose rules alone changed has an output");
        let plan = Arc::make_mut(&mut out.plan);
        plan.rules = rules_of(topo, shared, a);
        // The ruleset's files in the place of the ones before: `nftables.conf` and its parts
        // (ADR 0044).
        let at = out.files.iter().position(|f| f.path == NFTABLES_CONF).expect("every node has an nftables.conf");
        out.files.retain(|f| !crate::plan::is_ruleset(&f.path));
        out.files.splice(at..at, crate::render::nftables_files(plan));
        rendered.push(name.to_string());
    }
    for ((a, plan), files) in fresh.into_iter().zip(made) {
        let name = &cache.names[a as usize];
        let Some(files) = files else {
            nodes.get_mut(&**name).expect("a plan the same as before has an output").plan = Arc::new(plan);
            continue;
        };
        rendered.push(name.to_string());
        nodes.insert(name.to_string(), NodeOutput { plan: Arc::new(plan), files });
    }
    (nodes, rendered)
}

/// Whether two declarations of a node are the same but for where they are written.
fn same_node(a: &crate::decl::Node, b: &crate::decl::Node) -> bool {
    std::ptr::eq(a, b)
        || a.name == b.name
            && a.hub == b.hub
            && a.groups == b.groups
            && a.modules == b.modules
            && a.address_ipv4 == b.address_ipv4
            && a.address_ipv6 == b.address_ipv6
            && a.public_key == b.public_key
            && a.exit.as_ref().map(|e| &e.0) == b.exit.as_ref().map(|e| &e.0)
            && same_reach(a, b)
}

pub(super) use crate::alloc::same_addressing;

use crate::topology::same_reach;

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

/// Which nodes' partners may differ from those of `old` (`old_to_new` is each old position's new
/// one; both in name order, so it keeps the order of the nodes that stayed). Every partner of a
/// node not touched stayed: one that left changed a module's runners or sources, which touches
/// the node. A node's partners through a module are its sources if it runs it, its
/// runners if it is a source; so a change of a module's runners touches the runners that came or
/// went and every source, a change of its sources touches every runner and the sources that came
/// or went, a change of both touches all of them. New nodes are touched too. `None` when the
/// modules some node runs or the routes' routers or users changed: every node's are made again.
fn partners_touched(topo: &Topology, sources: &[NodeSet], old: &Cache, old_to_new: &[Option<u32>]) -> Option<Vec<bool>> {
    // An old set in new positions, without the nodes that left; and whether some left.
    let now_of = |was: &[u32]| -> (NodeSet, bool) {
        let kept: NodeSet = was.iter().filter_map(|&o| old_to_new[o as usize]).collect();
        let left = kept.len() != was.len();
        (kept, left)
    };
    let same = |now: &[u32], was: &[u32]| {
        let (kept, left) = now_of(was);
        !left && kept == now
    };
    let same_modules =
        topo.module_names.len() == old.module_names.len() && topo.module_names.iter().zip(&old.module_names).all(|(a, b)| a.0 == b.0);
    let same_routes = topo.routes.len() == old.route_via.len()
        && topo
            .routes
            .iter()
            .zip(old.route_via.iter().zip(&old.route_users))
            .all(|(r, (via, users))| same(&r.via, via) && same(&r.users, users));
    if !(same_modules && same_routes) {
        return None;
    }
    let mut touched = vec![false; topo.nodes.len()];
    let mut known = vec![false; topo.nodes.len()];
    for o in old_to_new.iter().flatten() {
        known[*o as usize] = true;
    }
    for (a, k) in known.iter().enumerate() {
        touched[a] = !k;
    }
    for (((_, runners), now), ((_, was_run), was)) in
        topo.module_names.iter().zip(sources).zip(old.module_names.iter().zip(&old.module_sources))
    {
        let (was_run, run_left) = now_of(was_run);
        let (was, sources_left) = now_of(was);
        let runners_changed = run_left || *runners != was_run;
        let sources_changed = sources_left || *now != was;
        let mut touch = |set: &mut dyn Iterator<Item = u32>| set.for_each(|a| touched[a as usize] = true);
        match (runners_changed, sources_changed) {
            (false, false) => {}
            (true, false) => {
                touch(&mut symmetric_difference(runners, &was_run));
                touch(&mut now.iter().copied());
            }
            (false, true) => {
                touch(&mut runners.iter().copied());
                touch(&mut symmetric_difference(now, &was));
            }
            (true, true) => touch(&mut runners.iter().chain(&was_run).chain(now).chain(&was).copied()),
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
