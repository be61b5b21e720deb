//! Property tests over generated meshes, checked against a naive reading of the rules written
//! here independently of the compiler.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;

use proptest::prelude::*;
use trellis_core::decl::{Declaration, Source};
use trellis_core::{allocate, Allocation, Compiled};

use crate::support::{compile_all, valid};

#[derive(Debug, Clone)]
pub(crate) struct Gen {
    networks: usize,
    nodes: Vec<GenNode>,
    groups: usize,
    modules: Vec<Vec<GenRule>>,
    /// Members of the pool `pl` the controller has added.
    members: usize,
}

#[derive(Debug, Clone)]
struct GenNode {
    networks: Vec<usize>,
    endpoints: Vec<Vec<usize>>,
    hub: bool,
    groups: Vec<usize>,
    modules: Vec<usize>,
}

#[derive(Debug, Clone)]
struct GenRule {
    proto: u8,
    sources: Vec<(u8, usize)>,
}

/// A mesh where the runners of `m0` (the first `runners` of `nodes`) peer with every node: each
/// node in `g0` on `net0` with an endpoint, `m0` open to `g0`. Its runners have more peers than
/// `PARTS_FROM` when `nodes` is larger, and get them in parts (ADR 0039).
pub(crate) fn wide(nodes: usize, runners: usize) -> Gen {
    let node = |i: usize| GenNode {
        networks: vec![0],
        endpoints: vec![vec![0]],
        hub: false,
        groups: vec![0],
        modules: if i < runners { vec![0] } else { Vec::new() },
    };
    let rule = GenRule { proto: 0, sources: vec![(1, 0)] };
    Gen { networks: 1, nodes: (0..nodes).map(node).collect(), groups: 1, modules: vec![vec![rule]], members: 0 }
}

/// `wide`, but no node has an endpoint but the last, a hub: every other pair is relayed by it,
/// so the runners' section of the hub names every other node (more than `PARTS_FROM` when
/// `nodes` is larger).
pub(crate) fn wide_relayed(nodes: usize, runners: usize) -> Gen {
    let mut g = wide(nodes, runners);
    for n in &mut g.nodes {
        n.endpoints.clear();
    }
    let hub = g.nodes.last_mut().expect("a node");
    (hub.endpoints, hub.hub) = (vec![vec![0]], true);
    g
}

/// `wide_relayed`, but every other node but the runners and the hub has an endpoint: the
/// runners dial those directly (more than `PARTS_FROM` of them when `nodes` is larger, so in
/// parts) and reach the others through the hub.
pub(crate) fn wide_relayed_half(nodes: usize, runners: usize) -> Gen {
    let mut g = wide_relayed(nodes, runners);
    let last = g.nodes.len() - 1;
    for (i, n) in g.nodes.iter_mut().enumerate() {
        if i % 2 == 1 && i != last && i >= runners {
            n.endpoints = vec![vec![0]];
        }
    }
    g
}

/// Two hubs, the second to last dialled on `net0`, the last on `net1`; the runners and the hubs
/// are on both networks, every other node on one, without an endpoint: the runners' files have
/// two hub sections, each relaying for half the nodes.
pub(crate) fn wide_two_hubs(nodes: usize, runners: usize) -> Gen {
    let mut g = wide(nodes, runners);
    g.networks = 2;
    let n = g.nodes.len();
    for (i, node) in g.nodes.iter_mut().enumerate() {
        node.endpoints.clear();
        node.networks = if i < runners || i >= n - 2 { vec![0, 1] } else { vec![i % 2] };
    }
    (g.nodes[n - 2].endpoints, g.nodes[n - 2].hub) = (vec![vec![0]], true);
    (g.nodes[n - 1].endpoints, g.nodes[n - 1].hub) = (vec![vec![1]], true);
    g
}

pub(crate) fn gen() -> impl Strategy<Value = Gen> {
    (1usize..4, 2usize..14, 1usize..4, 1usize..4).prop_flat_map(|(nets, n, groups, mods)| {
        let subset = move |k: usize| proptest::collection::vec(0..k, 0..=k.min(3));
        let node = (subset(nets), proptest::collection::vec(subset(nets), 0..3), any::<bool>(), subset(groups), subset(mods)).prop_map(
            |(networks, endpoints, hub, groups, modules)| {
                let hub = hub && !endpoints.is_empty();
                GenNode { networks, endpoints, hub, groups, modules }
            },
        );
        let rule = (0u8..3, proptest::collection::vec((0u8..5, 0usize..16), 1..4)).prop_map(|(proto, sources)| GenRule { proto, sources });
        (proptest::collection::vec(node, n), proptest::collection::vec(proptest::collection::vec(rule, 1..3), mods), 0usize..4)
            .prop_map(move |(nodes, modules, members)| Gen { networks: nets, nodes, groups, modules, members })
    })
}

fn key(i: usize) -> String {
    use base64::Engine as _;
    let mut b = [7u8; 32];
    b[0] = i as u8;
    b[1] = 7 + (i >> 8) as u8;
    base64::engine::general_purpose::STANDARD.encode(b)
}

fn render(g: &Gen) -> (String, Vec<(String, String)>) {
    let list = |prefix: &str, items: &[usize]| -> String {
        let mut v: Vec<usize> = items.to_vec();
        v.sort_unstable();
        v.dedup();
        v.iter().map(|i| format!("\"{prefix}{i}\"")).collect::<Vec<_>>().join(", ")
    };
    // A mesh of more than 200 nodes (`wide`) needs a wider overlay.
    let prefix = if g.nodes.len() > 200 { 16 } else { 24 };
    let mut s = format!(
        "[mesh]\nname = \"p\"\ndomain = \"p.mesh\"\noverlay_ipv4 = \"10.88.0.0/{prefix}\"\noverlay_ipv6 = \"fd88::/64\"\n[networks]\n"
    );
    for i in 0..g.networks {
        s.push_str(&format!("net{i} = {{}}\n"));
    }
    s.push_str("[groups]\n");
    for gi in 0..g.groups {
        // Groups list some members in [groups]; nodes name others themselves.
        let members: Vec<usize> = (0..g.nodes.len()).filter(|i| (i + gi).is_multiple_of(3)).collect();
        s.push_str(&format!("g{gi} = [{}]\n", list("n", &members)));
    }
    for (i, n) in g.nodes.iter().enumerate() {
        s.push_str(&format!(
            "[[node]]\nname = \"n{i}\"\nhub = {}\nnetworks = [{}]\ngroups = [{}]\nmodules = [{}]\npublic_key = \"{}\"\n",
            n.hub,
            list("net", &n.networks),
            list("g", &n.groups),
            list("m", &n.modules),
            key(i)
        ));
        for (e, reach) in n.endpoints.iter().enumerate() {
            s.push_str(&format!(
                "[[node.endpoint]]\naddress = \"192.0.{}.{}:{}\"\nreachable_from = [{}]\n",
                2 + i / 250,
                i % 250 + 1,
                51820 + e,
                list("net", reach)
            ));
        }
    }
    // A pool whose members the controller would add: they join a group and run a module.
    s.push_str("[[pool]]\nname = \"pl\"\nsize = 3\nnetworks = [\"net0\"]\ngroups = [\"g0\"]\nmodules = [\"m0\"]\n");
    let modules = g
        .modules
        .iter()
        .enumerate()
        .map(|(mi, rules)| {
            let mut t = format!("[module]\nname = \"m{mi}\"\n");
            for r in rules {
                let sources: BTreeSet<String> = r
                    .sources
                    .iter()
                    .map(|&(kind, k)| match kind {
                        0 => format!("node:n{}", k % g.nodes.len()),
                        1 => format!("group:g{}", k % g.groups),
                        2 => format!("module:m{}", k % g.modules.len()),
                        3 => "pool:pl".to_string(),
                        _ => "mesh".to_string(),
                    })
                    .collect();
                let from: Vec<String> = sources.iter().map(|s| format!("\"{s}\"")).collect();
                let (proto, ports) = match r.proto {
                    0 => ("tcp", "ports = [\"22\", \"8000-8100\"]\n"),
                    1 => ("udp", "ports = [\"53\"]\n"),
                    _ => ("icmp", ""),
                };
                t.push_str(&format!("[[allow]]\nproto = \"{proto}\"\n{ports}from = [{}]\n", from.join(", ")));
            }
            (format!("m{mi}.toml"), t)
        })
        .collect();
    (s, modules)
}

/// The generated mesh with `g.members` members of its pool added (each with a key, as an
/// enrolled member has), as the controller compiles it.
pub(crate) fn declaration(g: &Gen) -> Declaration {
    let (mesh, modules) = render(g);
    let refs: Vec<(&str, &str)> = modules.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
    let members: Vec<trellis_core::decl::Member> = (1..=g.members)
        .map(|i| trellis_core::decl::Member { name: format!("pl-{i}"), pool: "pl".into(), address_ipv4: None, address_ipv6: None })
        .collect();
    let mut d = valid(&mesh, &refs).with_members(&members).into_owned();
    for (i, n) in d.nodes.iter_mut().filter(|n| n.pool.is_some()).map(Arc::make_mut).enumerate() {
        n.public_key = trellis_core::decl::PublicKey::parse(&key(200 + i));
    }
    d
}

/// The naive reading of the declaration, written without the compiler's index.
struct Oracle<'d> {
    d: &'d Declaration,
}

impl<'d> Oracle<'d> {
    fn in_group(&self, node: &str, g: &str) -> bool {
        self.d.groups.iter().any(|gr| gr.name == g && gr.members.iter().any(|m| m == node))
            || self.d.node(node).unwrap().groups.iter().any(|x| x == g)
    }

    fn source_has(&self, s: &Source, node: &str) -> bool {
        match s {
            Source::Node(n) => n == node,
            Source::Group(g) => self.in_group(node, g),
            Source::Module(m) => self.d.node(node).unwrap().modules.contains(m),
            Source::Pool(p) => self.d.node(node).unwrap().pool.as_ref() == Some(p),
            Source::Expose(e) => self.d.exposures.iter().any(|x| x.name == *e && x.via.iter().any(|v| v == node)),
            Source::Mesh => true,
        }
    }

    fn allowed(&self, from: &str, to: &str) -> bool {
        self.d
            .node(to)
            .unwrap()
            .modules
            .iter()
            .any(|m| self.d.module(m).unwrap().allow.iter().any(|r| r.from.iter().any(|s| self.source_has(s, from))))
    }

    fn dials(&self, a: &str, b: &str) -> bool {
        let a = self.d.node(a).unwrap();
        self.d.node(b).unwrap().endpoints.iter().any(|e| e.reachable_from.iter().any(|n| a.networks.contains(n)))
    }

    fn direct(&self, a: &str, b: &str) -> bool {
        self.dials(a, b) || self.dials(b, a)
    }

    fn relay(&self, a: &str, b: &str) -> Option<&'d str> {
        let mut hubs: Vec<&str> = self.d.nodes.iter().filter(|n| n.hub).map(|n| n.name.as_str()).collect();
        hubs.sort_unstable();
        hubs.into_iter().find(|&h| h != a && h != b && self.direct(a, h) && self.direct(b, h))
    }

    /// The expected peers of every node, with the nodes each peer entry carries.
    fn peers(&self) -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
        let mut out: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
        for n in &self.d.nodes {
            out.entry(n.name.clone()).or_default();
        }
        let names: Vec<&str> = self.d.nodes.iter().map(|n| n.name.as_str()).collect();
        for &a in &names {
            for &b in &names {
                if a == b || !(self.allowed(a, b) || self.allowed(b, a)) {
                    continue;
                }
                if self.direct(a, b) {
                    out.get_mut(a).unwrap().entry(b.to_string()).or_default().insert(b.to_string());
                } else if let Some(h) = self.relay(a, b) {
                    let e = out.get_mut(a).unwrap().entry(h.to_string()).or_default();
                    e.insert(h.to_string());
                    e.insert(b.to_string());
                    out.get_mut(h).unwrap().entry(a.to_string()).or_default().insert(a.to_string());
                }
            }
        }
        out
    }
}

fn addresses_of(c: &Compiled, node: &str) -> BTreeSet<IpAddr> {
    let mut s = BTreeSet::new();
    s.extend(c.allocation.ipv4.get(node).map(|a| IpAddr::V4(*a)));
    s.extend(c.allocation.ipv6.get(node).map(|a| IpAddr::V6(*a)));
    s
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, .. ProptestConfig::default() })]

    #[test]
    fn addresses_are_unique_in_the_pool_and_stable(g in gen(), drop in 0usize..14, extra in 1usize..6) {
        let d = declaration(&g);
        let a = allocate(&d, &Allocation::default()).unwrap();
        let v4: BTreeSet<_> = a.ipv4.values().collect();
        let v6: BTreeSet<_> = a.ipv6.values().collect();
        prop_assert_eq!(v4.len(), d.nodes.len());
        prop_assert_eq!(v6.len(), d.nodes.len());
        let pool4 = d.mesh.overlay_ipv4.unwrap();
        prop_assert!(a.ipv4.values().all(|ip| pool4.contains(ip) && *ip != pool4.network() && *ip != pool4.broadcast()));

        // Remove one node and add others: every remaining node keeps both addresses.
        let mut d2 = d.clone();
        let gone = drop % d2.nodes.len();
        d2.nodes.remove(gone);
        for i in 0..extra {
            let mut n = trellis_core::decl::Node::clone(&d.nodes[0]);
            n.name = format!("new{i}");
            n.public_key = None;
            d2.nodes.push(Arc::new(n));
        }
        let a2 = allocate(&d2, &a).unwrap();
        for n in &d2.nodes {
            if let Some(old) = a.ipv4.get(&n.name) {
                prop_assert_eq!(a2.ipv4[&n.name], *old, "{} was renumbered", n.name);
                prop_assert_eq!(a2.ipv6[&n.name], a.ipv6[&n.name]);
            }
        }
        let v4: BTreeSet<_> = a2.ipv4.values().collect();
        prop_assert_eq!(v4.len(), d2.nodes.len());
    }

    /// What lets an apply keep the allocation held (ADR 0034): allocating is idempotent, and
    /// reads of a declaration only what `same_addressing` compares.
    #[test]
    fn a_declaration_with_the_same_addressing_gets_the_allocation_made_for_it_again(g in gen(), drop in 0usize..14) {
        let d = declaration(&g);
        // Made from the allocation of a declaration without one of its nodes, as an apply's is
        // made from the one before.
        let mut before = d.clone();
        before.nodes.remove(drop % before.nodes.len());
        let a = allocate(&d, &allocate(&before, &Allocation::default()).unwrap()).unwrap();
        prop_assert_eq!(&allocate(&d, &a).unwrap(), &a);
        // Its groups, modules and endpoints changed (copies of every node, none shared).
        let mut other = d.clone();
        for n in other.nodes.iter_mut() {
            let mut copy = trellis_core::decl::Node::clone(n);
            copy.groups.clear();
            copy.refs.groups.clear();
            copy.modules.reverse();
            copy.endpoints.clear();
            *n = Arc::new(copy);
        }
        prop_assert!(trellis_core::alloc::same_addressing(&d, &other));
        prop_assert_eq!(&allocate(&other, &a).unwrap(), &a);
        // A node renamed, or one of two swapped, is another addressing.
        let mut renamed = d.clone();
        Arc::make_mut(&mut renamed.nodes[drop % d.nodes.len()]).name.push('x');
        prop_assert!(!trellis_core::alloc::same_addressing(&d, &renamed));
        if d.nodes.len() > 1 {
            let mut swapped = d.clone();
            swapped.nodes.swap(0, 1);
            prop_assert!(!trellis_core::alloc::same_addressing(&d, &swapped));
        }
    }

    #[test]
    fn peers_follow_the_path_rule_and_are_symmetric(g in gen()) {
        let d = declaration(&g);
        let c = compile_all(&d);
        let oracle = Oracle { d: &d };
        let want = oracle.peers();
        for (node, out) in &c.nodes {
            let got: BTreeMap<String, BTreeSet<IpAddr>> = out.plan.peers.iter()
                .map(|p| (p.name().to_string(), p.allowed().into_iter().collect()))
                .collect();
            let expected: BTreeMap<String, BTreeSet<IpAddr>> = want[node].iter()
                .map(|(peer, carried)| (peer.clone(), carried.iter().flat_map(|n| addresses_of(&c, n)).collect()))
                .collect();
            prop_assert_eq!(&got, &expected, "peers of {}", node);
            // Symmetric: if a has b, b has a.
            for p in &out.plan.peers {
                prop_assert!(c.nodes[p.name()].plan.peers.iter().any(|q| q.name() == &**node), "{} has {} but not the reverse", node, p.name());
            }
        }
    }

    #[test]
    fn the_check_warns_of_exactly_the_pairs_with_allowed_traffic_and_no_path(g in gen()) {
        let d = declaration(&g);
        let oracle = Oracle { d: &d };
        let mut want = BTreeSet::new();
        for a in &d.nodes {
            for b in &d.nodes {
                let (a, b) = (a.name.as_str(), b.name.as_str());
                if a < b && (oracle.allowed(a, b) || oracle.allowed(b, a)) && !oracle.direct(a, b) && oracle.relay(a, b).is_none() {
                    want.insert((a.to_string(), b.to_string()));
                }
            }
        }
        let got: BTreeSet<(String, String)> = trellis_core::explain::check(&d)
            .iter()
            .filter_map(|w| {
                let (a, rest) = w.message.strip_prefix("no path between `")?.split_once("` and `")?;
                Some((a.to_string(), rest.split_once('`')?.0.to_string()))
            })
            .collect();
        prop_assert_eq!(got, want);
    }

    #[test]
    fn no_endpoint_is_given_to_a_node_that_cannot_dial_it(g in gen()) {
        let d = declaration(&g);
        let c = compile_all(&d);
        for (node, out) in &c.nodes {
            let me = d.node(node).unwrap();
            for p in &out.plan.peers {
                let peer = d.node(p.name()).unwrap();
                let dialable: Vec<_> = peer.endpoints.iter()
                    .filter(|e| e.reachable_from.iter().any(|n| me.networks.contains(n)))
                    .map(|e| e.address)
                    .collect();
                match p.endpoint() {
                    Some(e) => prop_assert!(dialable.contains(&e), "{} got endpoint {} of {} it cannot dial", node, e, p.name()),
                    None => prop_assert!(dialable.is_empty(), "{} can dial {} but got no endpoint", node, p.name()),
                }
                let back = me.endpoints.iter().any(|e| e.reachable_from.iter().any(|n| peer.networks.contains(n)));
                prop_assert_eq!(p.keepalive(), p.endpoint().is_some() && !back, "keepalive of {} towards {}", node, p.name());
            }
        }
    }

    #[test]
    fn every_rule_admits_exactly_its_sources(g in gen()) {
        let d = declaration(&g);
        let c = compile_all(&d);
        let oracle = Oracle { d: &d };
        for (node, out) in &c.nodes {
            let nft = &out.files.iter().find(|f| f.path.ends_with("nftables.conf")).unwrap().content.to_string();
            // Addresses accepted per rule comment, read back from the rendered ruleset.
            let mut seen: HashMap<String, BTreeSet<IpAddr>> = HashMap::new();
            for line in nft.lines().filter(|l| l.contains(" accept comment ")) {
                let tag = line.split("comment \"").nth(1).unwrap().split(':').next().unwrap().to_string();
                let set = crate::support::saddrs(nft, line);
                prop_assert!(!set.is_empty(), "no sources in {:?}", line);
                seen.entry(tag).or_default().extend(set.iter().map(|a| a.parse::<IpAddr>().unwrap()));
            }
            let me = d.node(node).unwrap();
            let mut expected: HashMap<String, BTreeSet<IpAddr>> = HashMap::new();
            for m in &me.modules {
                for (i, r) in d.module(m).unwrap().allow.iter().enumerate() {
                    let addrs: BTreeSet<IpAddr> = d.nodes.iter()
                        .filter(|n| r.from.iter().any(|s| oracle.source_has(s, &n.name)))
                        .flat_map(|n| addresses_of(&c, &n.name))
                        .collect();
                    if !addrs.is_empty() {
                        expected.insert(format!("{m} rule {}", i + 1), addrs);
                    }
                }
            }
            prop_assert_eq!(&seen, &expected, "filter of {}", node);
        }
    }
}
