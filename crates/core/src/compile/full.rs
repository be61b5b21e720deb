//! The full compile: every node's plan made from the topology, the blocks plans share
//! (settings, rule filter blocks, module and route zone blocks, route blocks) interned against the
//! previous output, and each node's peers from its paths. The recompiles use the same pieces.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use super::cache::{Cache, Old};
use super::{files_of, Compiled, NodeOutput};
use crate::alloc::Allocation;
use crate::decl::Declaration;
use crate::decl::ExposeTls;
use crate::par;
use crate::plan::{Common, ExposurePlan, NodePlan, NodeText, PeerPlan, RouteBlock, RuleBlock, ZoneBlock};
use crate::render;
use crate::topology::{Path, Topology};
use std::net::IpAddr;

/// Every node's plan and output; a node whose plan is the same as in `previous` keeps its files.
pub(super) fn compile(decl: &Arc<Declaration>, topo: &Topology, allocation: Allocation, previous: Option<&Compiled>) -> Compiled {
    let (plans, shared, mut cache) = plan(decl, topo, previous);
    cache.warned = super::warnings::warned(plans.iter());
    let Shared { rule_blocks, zone_blocks, .. } = shared;
    let diagnostics = super::warnings::diagnostics(plans.iter(), &cache);

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
        nodes.insert(name, NodeOutput { plan: Arc::new(plan), files });
    }
    Compiled { allocation, nodes, diagnostics, rendered, rule_blocks, zone_blocks, cache: Some(Box::new(cache)) }
}

/// What the plans of one compile share: the settings and the rendered blocks, interned against
/// the previous output so that comparing a plan with its previous one is a pointer comparison
/// for them.
pub(super) struct Shared {
    pub(super) common: Arc<Common>,
    pub(super) rule_blocks: Vec<Arc<RuleBlock>>,
    /// The zone records of every module of `Topology::module_names`.
    pub(super) zone_blocks: Vec<Arc<ZoneBlock>>,
    /// Every route of `Topology::routes`, and the zone records of its hosts (if it names any).
    pub(super) route_blocks: Vec<Arc<RouteBlock>>,
    pub(super) route_zones: Vec<Option<Arc<ZoneBlock>>>,
}

/// What the plans share, interned against `previous` and its cache `old`: a block whose inputs are
/// the same is kept, one made again takes the previous block of the same text if there is one.
/// `renumber` gives, for a recompile that knows it, each old position's new one: then a block is
/// kept when its nodes are the same nodes at the same addresses, wherever they now stand (a node
/// joining moves every later node by one); without it, only when every position holds the same
/// addresses as before.
pub(super) fn shared(topo: &Topology, previous: Option<&Compiled>, old: Option<&Cache>, renumber: Option<&[Option<u32>]>) -> Shared {
    let common = Common {
        mesh: topo.decl.mesh.name.clone(),
        interface: topo.decl.mesh.interface.clone(),
        port: topo.decl.mesh.port,
        mtu: topo.decl.mesh.mtu,
        ipv4_prefix: topo.decl.mesh.overlay_ipv4.map_or(32, |p| p.prefix_len()),
        ipv6_prefix: topo.decl.mesh.overlay_ipv6.map_or(128, |p| p.prefix_len()),
        overlay_ipv4: topo.decl.mesh.overlay_ipv4,
        overlay_ipv6: topo.decl.mesh.overlay_ipv6,
        domain: topo.decl.mesh.domain.clone(),
    };
    let old_common = previous.and_then(|c| c.nodes.values().next()).map(|o| &o.plan.common);
    let common = match old_common {
        Some(old) if **old == common => old.clone(),
        _ => Arc::new(common),
    };
    // A rule resolved to the same nodes at the same addresses, and a module run by the same
    // nodes at the same addresses, have the same text as before: kept without making them.
    let (old, previous) = match (old, previous) {
        (Some(c), Some(p))
            if (renumber.is_some() || (c.ipv4 == topo.ipv4 && c.ipv6 == topo.ipv6))
                && c.decl.mesh.interface == topo.decl.mesh.interface
                && c.rules.len() == p.rule_blocks.len()
                && c.withdrawn == topo.withdrawn_names =>
        {
            (Some((c, p)), Some(p))
        }
        (_, p) => (None, p),
    };
    // Where each old position's node is now: known by a renumbering (by name), or the same place
    // when the names are the same in the same places; else not known (the same positions may be
    // other names, and blocks split by part follow their nodes' names, ADR 0043, 0044).
    let now_of = |o: usize| match renumber {
        Some(map) => map[o],
        None => topo.same_names.then_some(o as u32),
    };
    // Whether a set of old positions is the same nodes at the same addresses as one of new ones
    // (without a renumbering, `old` holds only when every position's addresses are the same).
    let same_nodes = |c: &Cache, was: &[u32], now: &[u32]| match renumber {
        Some(_) => {
            was.len() == now.len()
                && was.iter().zip(now).all(|(&o, &a)| {
                    let (o, a2) = (o as usize, a as usize);
                    now_of(o) == Some(a) && c.ipv4[o] == topo.ipv4[a2] && c.ipv6[o] == topo.ipv6[a2]
                })
        }
        None => topo.same_names && was == now,
    };
    let old_rules: HashMap<(&str, usize), usize> =
        old.into_iter().flat_map(|(c, _)| c.rules.iter().enumerate()).map(|(i, r)| ((&*r.0, r.1), i)).collect();
    // The previous blocks by their text, to intern a block made again when the rules cannot be
    // matched by name: built only if one is (hashing every block's text costs more than the
    // blocks kept as they were; 9 ms of a group move's 13 at 100,000 nodes).
    let old_blocks: std::cell::OnceCell<HashMap<&RuleBlock, &Arc<RuleBlock>>> = std::cell::OnceCell::new();
    let rule_blocks: Vec<Arc<RuleBlock>> = topo
        .rules
        .iter()
        .map(|r| {
            let was = old.and_then(|(c, p)| old_rules.get(&(r.module, r.number)).map(|&i| (c, &p.rule_blocks[i], i)));
            if let Some((c, block, i)) = was {
                if c.rules[i].2 == *r.rule && same_nodes(c, &c.rules[i].3, &r.sources) {
                    return block.clone();
                }
            }
            let block = render::rule_block(topo, r);
            // A block names its sets by its module and rule (`src_MODULE_RULE_v4`): made again the
            // same, it is the same rule's block before and no other.
            if let Some((_, before, _)) = was {
                return if **before == block { before.clone() } else { Arc::new(block) };
            }
            let old_blocks =
                old_blocks.get_or_init(|| previous.into_iter().flat_map(|c| c.rule_blocks.iter()).map(|b| (&**b, b)).collect());
            old_blocks.get(&block).map_or_else(|| Arc::new(block), |b| (*b).clone())
        })
        .collect();
    // The previous blocks by module, to keep one made again the same (by name: hashing every
    // block's records would cost more than making the one).
    let old_zones: std::cell::OnceCell<HashMap<&str, &Arc<ZoneBlock>>> = std::cell::OnceCell::new();
    let zone_blocks = topo
        .module_names
        .iter()
        .enumerate()
        .map(|(i, (module, runners))| {
            if let Some((c, p)) = old {
                if c.module_names.get(i).is_some_and(|(m, r)| m == module && same_nodes(c, r, runners))
                    && p.zone_blocks.len() == c.module_names.len()
                {
                    return p.zone_blocks[i].clone();
                }
            }
            // A withdrawn (revoked) runner answers for its module no more.
            let live = runners.iter().filter(|&&r| !topo.withdrawn[r as usize]);
            let edited = old.and_then(|(c, p)| edited_block(topo, (c, p), &now_of, module, runners));
            let (records, parts) = edited.unwrap_or_else(|| {
                render::module_records(module, live.map(|&r| (topo.kept.parts[r as usize], topo.ipv4[r as usize], topo.ipv6[r as usize])))
            });
            let old_zones =
                old_zones.get_or_init(|| previous.into_iter().flat_map(|c| c.zone_blocks.iter()).map(|b| (&*b.module, b)).collect());
            match old_zones.get(&**module).filter(|b| *b.records == *records && b.parts == parts) {
                Some(b) => (*b).clone(),
                None => {
                    use sha2::Digest;
                    let digest = sha2::Sha256::digest(records.as_bytes()).into();
                    Arc::new(ZoneBlock { module: module.clone(), records: records.into(), digest, parts })
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
            Some(Arc::new(ZoneBlock { module: Arc::from(r.route.name.as_str()), records: records.into(), digest, parts: Box::new([]) }))
        })
        .collect();
    Shared { common, rule_blocks, zone_blocks, route_blocks, route_zones }
}

/// Below this many runners a module's records are written whole: editing them saves nothing.
const EDIT_RECORDS_FROM: usize = 256;

/// The records and parts of `module`, run now by `runners`, made from its block before
/// (`render::module_records_from`) when it had one and many runners: the parts whose lines are
/// the same are the parts before. `now_of` gives where each old position's node is now, if known.
fn edited_block(
    topo: &Topology,
    (c, p): (&Cache, &Compiled),
    now_of: &dyn Fn(usize) -> Option<u32>,
    module: &str,
    runners: &[u32],
) -> Option<(String, crate::plan::ZoneParts)> {
    if runners.len() < EDIT_RECORDS_FROM || p.zone_blocks.len() != c.module_names.len() {
        return None;
    }
    let j = c.module_names.iter().position(|(m, _)| &**m == module)?;
    let before = &p.zone_blocks[j];
    let withdrawn = |o: u32| !c.withdrawn.is_empty() && c.withdrawn.contains(&*c.names[o as usize]);
    let (v4, v6) = (&c.ipv4, &c.ipv6);
    let was = c.module_names[j].1.iter().filter(|&&o| !withdrawn(o)).map(|&o| {
        let o = o as usize;
        render::RunnerBefore {
            now: now_of(o).filter(|&a| (topo.ipv4[a as usize], topo.ipv6[a as usize]) == (v4[o], v6[o]) && !topo.withdrawn[a as usize]),
            lines: u8::from(v4[o].is_some()) + u8::from(v6[o].is_some()),
            part: c.kept.parts[o],
        }
    });
    let now = runners.iter().filter(|&&a| !topo.withdrawn[a as usize]).map(|&a| (a, topo.ipv4[a as usize], topo.ipv6[a as usize]));
    let (records, parts) = render::module_records_from(module, &before.records, was, now, |a| topo.kept.parts[a as usize])?;
    Some((records, render::zone_parts(parts, &before.parts)))
}

/// The filter blocks of the rules of the modules a node runs.
pub(super) fn rules_of(topo: &Topology, shared: &Shared, a: u32) -> Vec<Arc<RuleBlock>> {
    topo.inbound_rules(a).map(|(i, _)| shared.rule_blocks[i].clone()).collect()
}

/// One node's plan.
pub(super) fn node_plan(topo: &Topology, shared: &Shared, cache: &Cache, a: usize) -> NodePlan {
    let me = a as u32;
    let names = &cache.names;
    let (peers, left_out, no_path) = peers_of(cache, me);
    let mut zone = Vec::with_capacity(cache.partners[a].len() + 1);
    let mut own = Some(me);
    // A withdrawn (revoked) partner's name is in no zone.
    for &b in cache.partners[a].iter().filter(|&&b| !topo.withdrawn[b as usize]) {
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
    let ingress = ingress_of(topo, cache, me);
    let acme = topo
        .decl
        .acme
        .as_ref()
        .filter(|_| ingress.iter().any(|e| e.tls == ExposeTls::Acme))
        .map(|a| (a.directory.clone(), a.email.clone()));
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
        ingress,
        acme,
    }
}

/// The exposures node `me` is an ingress of, each with its backends: the runners of its module
/// that hold a key, at their overlay address.
fn ingress_of(topo: &Topology, cache: &Cache, me: u32) -> Vec<ExposurePlan> {
    topo.exposures
        .iter()
        .filter(|e| e.via.binary_search(&me).is_ok())
        .map(|e| {
            let x = e.exposure;
            let backends = e
                .runners
                .iter()
                .filter(|&&r| cache.keys[r as usize].is_some())
                .filter_map(|&r| {
                    let ip = cache.ipv4[r as usize].map(IpAddr::V4).or(cache.ipv6[r as usize].map(IpAddr::V6))?;
                    Some((cache.names[r as usize].clone(), ip))
                })
                .collect();
            ExposurePlan {
                name: Arc::from(x.name.as_str()),
                hostnames: x.hostnames.clone(),
                listen: x.listen,
                tls: x.tls,
                sources: x.sources.clone(),
                port: x.port,
                backends,
            }
        })
        .collect()
}

/// Every node's plan, in name order, what the plans share, and what the next compile keeps.
fn plan(decl: &Arc<Declaration>, topo: &Topology, previous: Option<&Compiled>) -> (Vec<NodePlan>, Shared, Cache) {
    let n = topo.nodes.len();
    let partners = topo.partners();
    let paths: Vec<Vec<(u32, Path)>> = par::map(n, |a| partners[a].iter().map(|&b| (b, topo.path(a as u32, b, true))).collect());
    let relayed_by = relays(&paths);
    let shared = shared(topo, previous, previous.and_then(|p| p.cache.as_deref()), None);
    let sources = topo.module_sources();
    let reached = topo.modules_reached(&sources);
    let mut cache = Cache::new(decl, topo, (partners, paths, relayed_by), (sources, reached), Old::Each(|_| None));
    cache.route_blocks = shared.route_blocks.clone();
    let plans = par::map(n, |a| node_plan(topo, &shared, &cache, a));
    (plans, shared, cache)
}

/// A node's peers, the nodes left out for want of a key, and those with no path, from its paths
/// and the keys. Peers come out in position (name) order; who dials whom is `Reach::dials`.
pub(super) fn peers_of(c: &Cache, me: u32) -> (Vec<PeerPlan>, Vec<Arc<str>>, Vec<Arc<str>>) {
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
            Path::Direct => {
                if is_hub(b) {
                    if hub_at.iter().any(|&(h, _)| h == b) {
                        continue;
                    }
                    hub_at.push((b, peers.len()));
                }
                peers.push(by_reach(b));
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
    // Room for a few more: a recompile edits this list in place (`rekey`), and a list of
    // 100,000 peers made again to add one is 8 MB copied to fresh pages.
    let drafts = peers;
    let mut peers: Vec<PeerPlan> = Vec::with_capacity(drafts.len() + drafts.len() / 64);
    peers.extend(drafts.into_iter().map(|(b, dials, dialled, relays_for)| c.peer(b, dials, dialled, relays_for)));
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
pub(super) fn router_of(c: &Cache, me: u32, r: u32) -> Option<u32> {
    let paths = &c.paths[me as usize];
    c.route_via[r as usize].iter().copied().find(|&v| {
        c.keys[v as usize].is_some() && paths.binary_search_by_key(&v, |&(b, _)| b).is_ok_and(|i| matches!(paths[i].1, Path::Direct))
    })
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
