//! The recompile for a change of keys only (ADR 0010): the same declaration, so the same
//! allocation, rules, zones and paths, and some nodes with another key or none. The plans that
//! show a changed key are edited where it shows, and only their `wireguard.conf` is made again.

use std::sync::{Arc, Mutex};

use super::cache::Cache;
use super::full::{peers_of, router_of};
use super::warnings::{left_out_warning, no_path_text, set_diagnostic};
use super::{Compiled, NodeOutput, Recompiled};
use crate::decl::{Declaration, PublicKey};
use crate::diag::Diagnostic;
use crate::keys::Keys;
use crate::par;
use crate::plan::{is_part, Common, NodePlan, NodeText, PeerPlan, PARTS_FROM, WIREGUARD_CONF};
use crate::render;
use crate::topology::Path;

/// The recompile for a change of keys only: the same declaration (so the same allocation, rules,
/// zones and paths), some nodes with another key or none. Gives `previous` back when it does not
/// apply (another declaration, or a hub's or a router's key changed, which can change which hub
/// relays or which router a route goes to).
pub(super) fn rekey(decl: &Arc<Declaration>, keys: &Keys, mut previous: Compiled) -> Recompiled {
    let Some(cache) = previous.cache.as_ref() else { return Recompiled::NotApplicable(previous) };
    if !Arc::ptr_eq(decl, &cache.decl) && **decl != *cache.decl {
        return Recompiled::NotApplicable(previous);
    }
    // A node withdrawn (revoked) leaves zones everywhere its names were: every plan is made.
    if cache.withdrawn != *keys.withdrawn() {
        return Recompiled::NotApplicable(previous);
    }
    let mut changed = changed_keys(cache, keys);
    previous.rendered.clear();
    if changed.is_empty() {
        return Recompiled::Done(previous);
    }
    // A hub's key decides which hub relays, a router's which router a route's users send to: the
    // whole plan is made. So it is for a backend of an exposure (`redeclare` remakes the ingress).
    // An exposed module's runner's key decides the ingress nodes' backends (their Traefik files).
    if changed.iter().any(|&(a, _)| cache.reach.hubs.binary_search(&a).is_ok() || cache.router[a as usize] || cache.backend[a as usize]) {
        return Recompiled::NotApplicable(previous);
    }
    let cache = previous.cache.as_mut().expect("checked above");
    // Each changed node's key as it was.
    for (a, key) in &mut changed {
        std::mem::swap(key, &mut cache.keys[*a as usize]);
    }
    let (changed, was): (Vec<u32>, Vec<Option<PublicKey>>) = changed.into_iter().unzip();
    let pairs = affected_pairs(cache, &changed, &was);
    // A hub's section lists the nodes it relays for; only those whose key came or went joined or
    // left one (the paths are the same), so the rest of each section is taken from the file
    // before by its runs. Past a few such nodes, each section is read whole instead.
    let relays_changed: Option<Vec<Arc<str>>> =
        (changed.len() <= 64).then(|| changed.iter().map(|&k| cache.names[k as usize].clone()).collect());
    // Each affected node's output taken out of the map once (a stand-in holds its place), its
    // plan edited and its peers' files made again on every core, then put back: at 100,000
    // nodes an enrolment reaches some 280 nodes, and three searches of the map for each (edit,
    // render, place) and their edits one after another were half its time.
    let seen: Vec<&[(u32, u32)]> = pairs.chunk_by(|x, y| x.0 == y.0).collect();
    let stand_in = seen.first().map(|s| stand_in(&previous.nodes[&*cache.names[s[0].0 as usize]].plan.common));
    let taken: Vec<Mutex<NodeOutput>> = seen
        .iter()
        .map(|s| {
            let out = previous.nodes.get_mut(&*cache.names[s[0].0 as usize]).expect("every node has an output");
            let plan = stand_in.clone().expect("a node is affected");
            Mutex::new(std::mem::replace(out, NodeOutput { plan, files: Vec::new() }))
        })
        .collect();
    let done = par::map_each(seen.len(), |i| {
        let mut out = taken[i].lock().expect("an output of its own");
        let (edited, lists) = edit_plan(cache, seen[i], &mut out.plan);
        if let Some(parts) = edited {
            let out = &mut *out;
            let files = &out.files;
            let before = |path: &str| files.iter().find(|f| f.path == path).map(|f| &f.content);
            let wireguard = render::wireguard_files_changed(&out.plan, before, parts, relays_changed.as_deref());
            // `wireguard.conf` keeps its place; the parts are the node's last files.
            let mut wireguard = wireguard.into_iter();
            let conf = wireguard.next().expect("every node has a wireguard.conf");
            out.files.retain(|f| !is_part(&f.path));
            *out.files.iter_mut().find(|f| f.path == WIREGUARD_CONF).expect("every node has a wireguard.conf") = conf;
            out.files.extend(wireguard);
        }
        (edited.is_some(), lists)
    });
    let mut lists_changed = false;
    for ((s, out), (edited, lists)) in seen.iter().zip(taken).zip(done) {
        let name = &cache.names[s[0].0 as usize];
        *previous.nodes.get_mut(&**name).expect("every node has an output") = out.into_inner().expect("an output of its own");
        if edited {
            previous.rendered.push(name.to_string());
        }
        lists_changed |= lists;
    }
    if lists_changed {
        edit_warnings(cache, &changed, &was, &mut previous.diagnostics);
    }
    let cache = previous.cache.as_mut().expect("checked above");
    super::warnings::rewarn(&mut cache.warned, &previous.nodes, &[], &previous.rendered);
    Recompiled::Done(previous)
}

/// The nodes whose key changed, with their new key.
fn changed_keys(cache: &Cache, keys: &Keys) -> Vec<(u32, Option<PublicKey>)> {
    // From the names the key set changed since the last compile when it continues the set that
    // compile read, else from every name.
    let key_of = |a: usize| cache.decl.nodes[cache.order[a] as usize].public_key.or_else(|| keys.get(&cache.names[a]));
    match cache.keys_seen.as_ref().and_then(|seen| keys.changed_since(seen)) {
        Some(names) => {
            let mut at: Vec<u32> = names.filter_map(|n| cache.kept.index.get(n).copied()).collect();
            at.sort_unstable();
            at.dedup();
            at.into_iter().map(|a| (a, key_of(a as usize))).filter(|&(a, k)| k != cache.keys[a as usize]).collect()
        }
        None => (0..cache.names.len()).map(|a| (a as u32, key_of(a))).filter(|&(a, k)| k != cache.keys[a as usize]).collect(),
    }
}

/// The pairs (affected node, changed node it sees), sorted; `was` is each changed node's old key.
fn affected_pairs(cache: &Cache, changed: &[u32], was: &[Option<PublicKey>]) -> Vec<(u32, u32)> {
    // A partner's plan names k's key only where it peers with k directly; a relayed path names
    // k, not its key, unless k gained or lost its key (left out, or not); a hub names the key of
    // every node it relays for.
    let mut pairs: Vec<(u32, u32)> = Vec::new();
    // The path rule and the partners are symmetric (`Reach::path`, `Topology::partners_of`):
    // k's own paths say how each partner reaches it, read in one list rather than a search of
    // each partner's.
    for (&k, was) in changed.iter().zip(was) {
        let presence = cache.keys[k as usize].is_some() != was.is_some();
        for &(p, path) in &cache.paths[k as usize] {
            if presence || path == Path::Direct {
                pairs.push((p, k));
            }
        }
    }
    for &h in &cache.reach.hubs {
        for &k in changed {
            if cache.relayed_by[h as usize].binary_search(&k).is_ok() {
                pairs.push((h, k));
            }
        }
    }
    pairs.sort_unstable();
    pairs.dedup();
    pairs
}

/// Edits the plan of node `seen[0].0` for the changed nodes it sees (pairs of it and a changed
/// node). Returns whether its peers changed, with the parts of its peers that did
/// (`render::wireguard_files_changed`; `None`: every part), and whether its left-out or no-path
/// list did.
fn edit_plan(cache: &Cache, seen: &[(u32, u32)], plan: &mut Arc<NodePlan>) -> (Option<Option<u64>>, bool) {
    let a = seen[0].0;
    // A plan is edited where the changed keys show (`edit_peers`): a node with ten thousand
    // peers costs what its changed peers cost. A node that sees many changed keys at once (a
    // burst of enrolments covered by one run) has its peer list made again instead.
    if remake(cache, seen) {
        let (peers, left_out, no_path) = peers_of(cache, a);
        let lists = (&left_out, &no_path) != (&plan.left_out, &plan.no_path);
        if !lists && peers == plan.peers {
            return (None, false);
        }
        // A plan another holder still shares (a status being made) is copied first.
        let plan = Arc::make_mut(plan);
        (plan.peers, plan.left_out, plan.no_path) = (peers, left_out, no_path);
        return (Some(None), lists);
    }
    let plan = Arc::make_mut(plan);
    let had = plan.peers.len();
    let (parts, lists) = edit_peers(cache, a, seen, plan);
    if parts == 0 && !lists {
        return (None, false);
    }
    // The peers in parts before and after: only the parts a changed peer is in.
    let parted = had > PARTS_FROM && plan.peers.len() > PARTS_FROM;
    (Some(parted.then_some(parts)), lists)
}

/// A plan that holds an output's place while its own is edited off the map (`rekey`).
fn stand_in(common: &Arc<Common>) -> Arc<NodePlan> {
    Arc::new(NodePlan {
        node: Arc::from(""),
        common: common.clone(),
        hub: false,
        ipv4: None,
        ipv6: None,
        peers: Vec::new(),
        left_out: Vec::new(),
        no_path: Vec::new(),
        rules: Vec::new(),
        zone: Vec::new(),
        zone_modules: Vec::new(),
        routes_for: Vec::new(),
        routed: Vec::new(),
        zone_routes: Vec::new(),
        ingress: Vec::new(),
        acme: None,
    })
}

/// Edits the warnings where a node's key came or went.
fn edit_warnings(cache: &Cache, changed: &[u32], was: &[Option<PublicKey>], diagnostics: &mut Vec<Diagnostic>) {
    // A node without a key is in the left-out list of each of its partners, and a pair without a
    // path is reported by the node that sorts first when the other has a key (`path_diagnostics`,
    // `left_out_diagnostics`).
    for (&k, was) in changed.iter().zip(was) {
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

/// Whether a node that sees these changed keys (pairs of it and a changed node) has its peer
/// list made again rather than edited: when they are many, or a quarter of its partners or more
/// (an edit costs a search and a shift per changed key, making the list costs each partner once).
fn remake(cache: &Cache, seen: &[(u32, u32)]) -> bool {
    seen.len() >= 32 || seen.len() * 4 >= cache.paths[seen[0].0 as usize].len()
}

/// Edits the plan of node `a` for the changed nodes it sees (`seen`: pairs of `a` and a changed
/// node) where their keys show: their entries, the entries of the hubs relaying to them, and
/// the lists naming nodes without a key or without a path. The result is the plan `peers_of`
/// would make. Returns the parts (`plan::part_of`, a bit each) whose peers changed, none when
/// no peer did, and whether those lists did.
fn edit_peers(cache: &Cache, a: u32, seen: &[(u32, u32)], plan: &mut NodePlan) -> (u64, bool) {
    let paths = &cache.paths[a as usize];
    let mut touched = Vec::new();
    let mut relayed = Vec::new();
    let mut lists = false;
    for &(_, k) in seen {
        let kname = &cache.names[k as usize];
        if let Ok(i) = paths.binary_search_by_key(&k, |&(b, _)| b) {
            match paths[i].1 {
                Path::Direct => touched.push(k),
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
    let mut parts = 0u64;
    let part = |b: u32| 1u64 << cache.texts[b as usize].part;
    for t in touched {
        let at = plan.peers.binary_search_by(|p| (*p.node.name).cmp(&cache.names[t as usize]));
        match (at, peer_entry(cache, a, t)) {
            (Ok(i), Some(p)) if plan.peers[i] != p => plan.peers[i] = p,
            (Ok(_), Some(_)) | (Err(_), None) => continue,
            (Ok(i), None) => drop(plan.peers.remove(i)),
            (Err(i), Some(p)) => plan.peers.insert(i, p),
        }
        parts |= part(t);
    }
    // A node reached through a hub joins or leaves that hub's list where its name sorts.
    for (hub, k) in relayed {
        let keyed = cache.keys[k as usize].is_some();
        let at = plan.peers.binary_search_by(|p| (*p.node.name).cmp(&cache.names[hub as usize]));
        let Ok(i) = at else {
            if let Some(p) = keyed.then(|| peer_entry(cache, a, hub)).flatten() {
                plan.peers.insert(at.unwrap_err(), p);
                parts |= part(hub);
            }
            continue;
        };
        let list = &mut plan.peers[i].relays_for;
        match (list.binary_search_by(|t| (*t.name).cmp(&cache.names[k as usize])), keyed) {
            (Ok(j), false) => drop(list.remove(j)),
            (Err(j), true) => list.insert(j, cache.texts[k as usize].clone()),
            _ => continue,
        }
        parts |= part(hub);
        // The first node relayed, or the last gone: the head of the hub's section says so, and
        // the hub may stop being a peer at all.
        if list.len() == usize::from(keyed) {
            match peer_entry(cache, a, hub) {
                Some(p) => plan.peers[i] = p,
                None => drop(plan.peers.remove(i)),
            }
        }
    }
    (parts, lists)
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
    let peer = path == Some(Path::Direct) || !relays_for.is_empty() || c.relayed_by[me as usize].binary_search(&b).is_ok();
    if !peer {
        return None;
    }
    let mut peer = c.peer(b, c.reach.dials(me, b), c.reach.dials(b, me).is_some(), relays_for);
    for &r in &c.routes_of[me as usize] {
        if router_of(c, me, r) == Some(b) {
            peer.routes.push(c.route_blocks[r as usize].route.clone());
        }
    }
    Some(peer)
}
