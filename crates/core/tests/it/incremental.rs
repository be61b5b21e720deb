//! The incremental compiler against the full one: random sequences of changes (keys that appear,
//! change and go; nodes that move group, take or drop a module, lose their endpoints, join or
//! leave; rules whose sources change), each compiled from the previous output and from nothing,
//! must give every node the same files, byte for byte, and name every node whose files changed.

use std::sync::Arc;

use proptest::prelude::*;
use trellis_core::decl::{Node, PublicKey, Source};
use trellis_core::{compile, Compiled, Declaration, Keys};

use crate::props::{declaration, gen};

#[derive(Debug, Clone)]
pub(crate) enum Change {
    /// A node enrols or re-keys (Some) or is revoked (None).
    Key(usize, Option<u8>),
    /// The same declaration applied again, as a copy.
    Reapply,
    MoveGroup(usize, usize),
    ToggleModule(usize, usize),
    DropEndpoints(usize),
    AddNode(usize),
    RemoveNode(usize),
    RuleSource(usize, usize, u8, usize),
    /// A node opts into the exit, or out of it.
    ToggleExit(usize),
    /// A node is revoked: its key goes and its names leave every zone.
    Withdraw(usize),
}

pub(crate) fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        4 => (0usize..32, proptest::option::of(any::<u8>())).prop_map(|(i, k)| Change::Key(i, k)),
        1 => Just(Change::Reapply),
        1 => (0usize..32, 0usize..4).prop_map(|(i, g)| Change::MoveGroup(i, g)),
        1 => (0usize..32, 0usize..4).prop_map(|(i, m)| Change::ToggleModule(i, m)),
        1 => (0usize..32).prop_map(Change::DropEndpoints),
        1 => (0usize..32).prop_map(Change::AddNode),
        1 => (0usize..32).prop_map(Change::RemoveNode),
        1 => (0usize..4, 0usize..4, 0u8..4, 0usize..32).prop_map(|(m, r, kind, k)| Change::RuleSource(m, r, kind, k)),
        1 => (0usize..32).prop_map(Change::ToggleExit),
        1 => (0usize..32).prop_map(Change::Withdraw),
    ]
}

/// The changes that move a module's runners: nodes come and go, leave or join it, are revoked,
/// change group.
fn runner_change() -> impl Strategy<Value = Change> {
    prop_oneof![
        (0usize..32).prop_map(Change::AddNode),
        (0usize..32).prop_map(Change::RemoveNode),
        (0usize..32).prop_map(|i| Change::ToggleModule(i, 0)),
        (0usize..32).prop_map(Change::Withdraw),
        (0usize..32, 0usize..4).prop_map(|(i, g)| Change::MoveGroup(i, g)),
    ]
}

/// Applies a change; returns whether the declaration changed.
pub(crate) fn apply(d: &mut Declaration, keys: &mut Keys, c: &Change, added: &mut usize) -> bool {
    let n = d.nodes.len();
    match *c {
        Change::Key(i, k) => {
            let name = d.nodes[i % n].name.clone();
            keys.set(&name, k.map(|b| PublicKey([b; 32])));
            false
        }
        Change::Reapply => true,
        Change::Withdraw(i) => {
            let name = d.nodes[i % n].name.clone();
            keys.set(&name, None);
            let mut withdrawn: Vec<String> = keys.withdrawn().iter().cloned().collect();
            withdrawn.push(name);
            keys.withdraw_only(withdrawn.iter().map(String::as_str));
            false
        }
        Change::MoveGroup(i, g) => {
            let groups: Vec<String> = d.groups.iter().map(|g| g.name.clone()).collect();
            if groups.is_empty() {
                return false;
            }
            let node = Arc::make_mut(&mut d.nodes[i % n]);
            node.groups = vec![groups[g % groups.len()].clone()];
            node.refs.groups = vec![node.loc.clone()];
            for grp in &mut d.groups {
                grp.members = grp.members.iter().filter(|m| **m != node.name).cloned().collect();
            }
            true
        }
        Change::ToggleModule(i, m) => {
            let modules: Vec<String> = d.modules.iter().map(|m| m.name.clone()).collect();
            let m = modules[m % modules.len()].clone();
            let node = Arc::make_mut(&mut d.nodes[i % n]);
            if let Some(at) = node.modules.iter().position(|x| *x == m) {
                node.modules.remove(at);
                node.refs.modules.remove(at);
            } else {
                node.modules.push(m);
                node.refs.modules.push(node.loc.clone());
            }
            true
        }
        Change::DropEndpoints(i) => {
            let node = Arc::make_mut(&mut d.nodes[i % n]);
            if node.hub {
                return false;
            }
            node.endpoints.clear();
            true
        }
        Change::AddNode(template) => {
            let mut node = Node::clone(&d.nodes[template % n]);
            // Half the new nodes sort before every other (every position moves by one), half
            // after (none does).
            node.name = if template % 2 == 0 { format!("a{added}") } else { format!("x{added}") };
            *added += 1;
            node.public_key = None;
            d.nodes.push(Arc::new(node));
            true
        }
        Change::RemoveNode(i) => {
            let name = d.nodes[i % n].name.clone();
            let named = d.modules.iter().flat_map(|m| &m.allow).flat_map(|r| &r.from).any(|s| *s == Source::Node(name.clone()))
                || d.exposures.iter().any(|e| e.via.contains(&name));
            if n <= 2 || named {
                return false;
            }
            d.nodes.remove(i % n);
            for grp in &mut d.groups {
                grp.members = grp.members.iter().filter(|m| **m != name).cloned().collect();
            }
            keys.set(&name, None);
            true
        }
        Change::ToggleExit(i) => {
            if d.route("internet").is_none() {
                return false;
            }
            let node = Arc::make_mut(&mut d.nodes[i % n]);
            node.exit = match node.exit {
                Some(_) => None,
                None => Some(("internet".to_string(), node.loc.clone())),
            };
            true
        }
        Change::RuleSource(m, r, kind, k) => {
            let source = match kind {
                0 => Source::Node(d.nodes[k % n].name.clone()),
                1 if !d.groups.is_empty() => Source::Group(d.groups[k % d.groups.len()].name.clone()),
                2 => Source::Module(d.modules[k % d.modules.len()].name.clone()),
                _ => Source::Mesh,
            };
            let module = m % d.modules.len();
            let rules = &mut d.modules[module].allow;
            let count = rules.len();
            let rule = &mut rules[r % count];
            if rule.from.contains(&source) {
                return false;
            }
            rule.from[0] = source;
            true
        }
    }
}

/// A generated declaration, with routes and an exposure when asked.
fn mesh(g: &crate::props::Gen, routed: bool, exposed: bool) -> Declaration {
    let mut d = declaration(g);
    if routed {
        add_routes(&mut d);
    }
    if exposed {
        add_exposure(&mut d);
    }
    d
}

fn same(inc: &Compiled, full: &Compiled, before: &Compiled, step: usize) -> Result<(), TestCaseError> {
    prop_assert_eq!(inc.nodes.keys().collect::<Vec<_>>(), full.nodes.keys().collect::<Vec<_>>(), "step {}: the nodes", step);
    for (name, out) in &inc.nodes {
        let want = &full.nodes[name];
        for (a, b) in out.files.iter().zip(want.files.iter()) {
            prop_assert_eq!(a, b, "step {}: node {} file {} differs from a full compile", step, name, b.path);
        }
        prop_assert_eq!(out.files.len(), want.files.len());
        // The plans too: a plan that differs from a full compile's makes a later recompile
        // render files that did not change.
        prop_assert_eq!(&out.plan, &want.plan, "step {}: node {}'s plan differs from a full compile", step, name);
        let changed = before.nodes.get(name).is_none_or(|o| o.files != out.files);
        prop_assert!(!changed || inc.rendered.contains(name), "step {}: {}'s files changed but it is not named as rendered", step, name);
    }
    prop_assert_eq!(&inc.diagnostics, &full.diagnostics, "step {}: diagnostics", step);
    prop_assert_eq!(&inc.allocation, &full.allocation);
    prop_assert_eq!(&inc.rule_blocks, &full.rule_blocks, "step {}: rule blocks", step);
    prop_assert_eq!(&inc.zone_blocks, &full.zone_blocks, "step {}: zone blocks", step);
    Ok(())
}

proptest! {
    // PROPTEST_CASES=N runs more.
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(150), .. ProptestConfig::default() })]

    #[test]
    fn an_incremental_recompile_equals_a_full_compile(g in gen(), enrolled in proptest::collection::vec(any::<bool>(), 32), routed in any::<bool>(), exposed in any::<bool>(), changes in proptest::collection::vec((change(), any::<bool>(), proptest::option::of((0usize..32, proptest::option::of(any::<u8>())))), 1..10)) {
        let mut d = mesh(&g, routed, exposed);
        // Most nodes get their key by enrolling; a few keep a declared one.
        let mut keys = Keys::default();
        for (i, node) in d.nodes.iter_mut().map(Arc::make_mut).enumerate() {
            if i % 5 != 0 {
                let key = node.public_key.take().expect("generated with a key");
                if enrolled[i % 32] {
                    keys.set(&node.name, Some(key));
                }
            }
        }
        let mut decl = Arc::new(d.clone());
        let mut prev = compile(&decl, &keys, &Default::default(), None).unwrap();
        let mut added = 0;
        for (step, (c, afresh, key_too)) in changes.iter().enumerate() {
            // Sometimes a key changes in the same compile as the declaration.
            if let Some((i, k)) = key_too {
                apply(&mut d, &mut keys, &Change::Key(*i, *k), &mut added);
            }
            if apply(&mut d, &mut keys, c, &mut added) {
                decl = Arc::new(d.clone());
            }
            // The key set is mostly the one changed in place (the recompile reads the names it
            // changed); sometimes a new set with the same keys (it reads every key).
            if *afresh {
                let mut fresh: Keys = keys.iter().map(|(n, k)| (n.to_string(), *k)).collect();
                fresh.withdraw_only(keys.withdrawn().iter().map(String::as_str));
                keys = fresh;
            }
            let before = prev.clone();
            let inc = compile(&decl, &keys, &Default::default(), Some(prev)).unwrap();
            let full = compile(&decl, &keys, &before.allocation, None).unwrap();
            same(&inc, &full, &before, step)?;
            prev = inc;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(12), .. ProptestConfig::default() })]

    /// ADR 0039: the runners of a module open to every node have their peers in parts. A
    /// recompile after each change gives the same files as a full compile, parts included, and
    /// every node's parts hold exactly its peers, each in the part its name hashes to.
    #[test]
    fn peers_in_parts_recompile_as_a_full_compile_makes_them(changes in proptest::collection::vec(change(), 1..8)) {
        let first = compiles_in_parts(&crate::props::wide(trellis_core::plan::PARTS_FROM + 40, 3), &changes, |c| {
            zone_parts_hold_the_names(c)?;
            parts_hold_the_peers(c)
        })?;
        prop_assert!(first > 0, "no node had its peers in parts");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4), .. ProptestConfig::default() })]

    /// ADR 0043: the runners of a module open to every node have zones of more than 64 KiB (each
    /// node's A and AAAA records). A recompile after each change gives the same files as a full
    /// compile, the zone's parts included, and every zone in parts is the zone the one file is.
    #[test]
    fn zones_in_parts_recompile_as_a_full_compile_makes_them(changes in proptest::collection::vec(change(), 1..6)) {
        let first = compiles_in_parts(&crate::props::wide(1540, 3), &changes, zone_parts_hold_the_names)?;
        prop_assert!(first > 0, "no node had its zone in parts");
    }

    /// A module of more runners than a recompile writes again whole (`EDIT_RECORDS_FROM`, 256):
    /// runners that come (before every other name, or after), leave it, go, are revoked or change
    /// group change its records by their own lines, and its block, records and parts, is the one a
    /// full compile makes (`same`). The changes name the first 32 nodes, all runners.
    #[test]
    fn a_module_of_many_runners_recompiles_as_a_full_compile_makes_it(changes in proptest::collection::vec(runner_change(), 1..6)) {
        compiles_in_parts(&crate::props::wide(330, 300), &changes, |_| Ok(0))?;
    }
}

/// Compiles `g` with every node's key enrolled but every fifth's (so that a change of one is a
/// re-key, `rekey`), then recompiles it after each of `changes`: each recompile must give the
/// files a full compile gives, and `check` must hold of every compile. Gives what `check` gave
/// of the first (how many nodes have parts).
fn compiles_in_parts(
    g: &crate::props::Gen,
    changes: &[Change],
    check: impl Fn(&Compiled) -> Result<usize, TestCaseError>,
) -> Result<usize, TestCaseError> {
    let mut d = declaration(g);
    let mut keys = Keys::default();
    for (i, node) in d.nodes.iter_mut().map(Arc::make_mut).enumerate() {
        if i % 5 != 0 {
            keys.set(&node.name, node.public_key.take());
        }
    }
    let mut decl = Arc::new(d.clone());
    let mut prev = compile(&decl, &keys, &Default::default(), None).unwrap();
    let first = check(&prev)?;
    let mut added = 0;
    for (step, c) in changes.iter().enumerate() {
        if apply(&mut d, &mut keys, c, &mut added) {
            decl = Arc::new(d.clone());
        }
        let before = prev.clone();
        let inc = compile(&decl, &keys, &Default::default(), Some(prev)).unwrap();
        let full = compile(&decl, &keys, &before.allocation, None).unwrap();
        same(&inc, &full, &before, step)?;
        check(&inc)?;
        prev = inc;
    }
    Ok(first)
}

/// Keys changed near each other in name order: a step names a node and changes to the keys of
/// the nodes after it.
type KeySteps = Vec<(usize, Vec<(usize, Option<u8>)>)>;

fn key_steps(nodes: usize, most: usize) -> impl Strategy<Value = KeySteps> {
    proptest::collection::vec(
        (0..nodes, proptest::collection::vec((0usize..most, proptest::option::of(any::<u8>())), 1..most.min(90))),
        1..6,
    )
}

/// Compiles `g` with every third node's key missing, then re-keys it step by step (the last
/// `hubs` nodes, its hubs, keep theirs: a hub's key makes every plan again); each recompile must
/// give the files a full compile gives. A runner's file must have a hub section of more than 256
/// relayed nodes, so that its runs are taken from the file before by their ends.
fn rekeys_as_a_full_compile(g: &crate::props::Gen, hubs: usize, steps: &KeySteps) -> Result<(), TestCaseError> {
    let mut d = declaration(g);
    let mut keys = Keys::default();
    for (i, node) in d.nodes.iter().enumerate() {
        keys.set(&node.name, node.public_key.filter(|_| i % 3 != 1));
    }
    for node in d.nodes.iter_mut().map(Arc::make_mut) {
        node.public_key = None;
    }
    let decl = Arc::new(d);
    let mut prev = compile(&decl, &keys, &Default::default(), None).unwrap();
    let runner = &prev.nodes[&decl.nodes[0].name].plan;
    prop_assert!(runner.peers.iter().any(|p| p.relays_for.len() > 256), "a runner's hub section relays for more than 256 nodes");
    let keyed = decl.nodes.len() - hubs;
    for (step, (at, changes)) in steps.iter().enumerate() {
        // Nodes near each other (n120, n121, ...: near in name order too), so that changes fall
        // in the same run of the section.
        for &(i, k) in changes {
            keys.set(&decl.nodes[(at + i) % keyed].name, k.map(|b| PublicKey([b; 32])));
        }
        let before = prev.clone();
        let inc = compile(&decl, &keys, &Default::default(), Some(prev)).unwrap();
        let full = compile(&decl, &keys, &before.allocation, None).unwrap();
        same(&inc, &full, &before, step)?;
        prev = inc;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(24), .. ProptestConfig::default() })]

    /// A hub's section in a runner's file names every node the hub relays for it, here more than
    /// 256; a re-key takes the section's runs without a changed node from the file before
    /// (`render::peer_sections`). Keys come and go, several in one compile (a node joining the
    /// section and another leaving it in the same run of lines).
    #[test]
    fn a_hub_section_of_many_relayed_nodes_recompiles_as_a_full_compile_makes_it(steps in key_steps(450, 8)) {
        rekeys_as_a_full_compile(&crate::props::wide_relayed(450, 2), 1, &steps)?;
    }

    /// The same with the runner's peers in parts (half the nodes dialled directly), and with two
    /// hubs each relaying for more than 256; and with up to 89 keys changed in one compile, past
    /// the 64 names `rekey` hands the sections and past the 32 that make a plan's peers again.
    #[test]
    fn long_hub_sections_in_parts_and_under_two_hubs_recompile_as_a_full_compile_makes_them(
        two_hubs in any::<bool>(),
        steps in prop_oneof![3 => key_steps(1000, 12), 1 => key_steps(1000, 90)],
    ) {
        match two_hubs {
            true => rekeys_as_a_full_compile(&crate::props::wide_two_hubs(1000, 2), 2, &steps)?,
            false => rekeys_as_a_full_compile(&crate::props::wide_relayed_half(1000, 2), 1, &steps)?,
        }
    }
}

/// Each node's `wireguard.conf` and parts: a node of more than `PARTS_FROM` peers has none in
/// `wireguard.conf`, and its parts, read as the agent reads them, hold its peers in its plan's
/// order part by part, each in the part of its name; any other node has no parts. Gives how many
/// nodes have parts.
fn parts_hold_the_peers(c: &Compiled) -> Result<usize, TestCaseError> {
    use trellis_core::plan::{part_index, part_of, PARTS_FROM, WIREGUARD_CONF};
    let mut parted = 0;
    for (name, out) in &c.nodes {
        let conf = out.files.iter().find(|f| f.path == WIREGUARD_CONF).expect("a wireguard.conf");
        let main = trellis_core::wgconf::read(&conf.content.to_string()).unwrap();
        let parts: Vec<_> = out.files.iter().filter_map(|f| Some((part_index(&f.path)?, f))).collect();
        if out.plan.peers.len() <= PARTS_FROM {
            prop_assert!(parts.is_empty(), "{} has {} peers and parts", name, out.plan.peers.len());
            prop_assert_eq!(main.conf.peers.len(), out.plan.peers.len());
            continue;
        }
        parted += 1;
        prop_assert!(main.conf.peers.is_empty(), "{} has peers in wireguard.conf beside its parts", name);
        prop_assert!(parts.windows(2).all(|w| w[0].0 < w[1].0), "{}'s parts are in order", name);
        let mut held = Vec::new();
        for (i, f) in &parts {
            prop_assert_eq!(f.mode, 0o600);
            let read = trellis_core::wgconf::read_part(&f.content.to_string(), &f.path).unwrap();
            prop_assert!(!read.conf.peers.is_empty(), "{} has an empty part {}", name, f.path);
            held.extend(read.conf.peers.iter().map(|p| (*i, p.public_key.clone())));
        }
        let mut want: Vec<(usize, String)> = out
            .plan
            .peers
            .iter()
            .map(|p| (usize::from(part_of(p.name())), p.block.lines().find_map(|l| l.strip_prefix("PublicKey = ")).unwrap().to_string()))
            .collect();
        want.sort_by_key(|(i, _)| *i);
        prop_assert_eq!(held, want, "{}'s parts hold its peers, each in its name's part", name);
    }
    Ok(parted)
}

/// Each node's zone files (ADR 0043): a node whose zone's records take more than
/// `ZONE_PARTS_FROM` bytes has them in parts, in order, each holding address records only, each
/// node's records in the part of its name; `mesh.zone` and the parts one after the other are
/// the zone the one file (`render::zone`) is: the same origin, serial, name server and names
/// with the same addresses. Any other node has no parts. Gives how many nodes have parts.
fn zone_parts_hold_the_names(c: &Compiled) -> Result<usize, TestCaseError> {
    use trellis_core::plan::{part_of, zone_part_index, MESH_ZONE};
    let mut parted = 0;
    for (name, out) in &c.nodes {
        let main = out.files.iter().find(|f| f.path == MESH_ZONE).expect("a mesh.zone");
        let parts: Vec<_> = out.files.iter().filter_map(|f| Some((zone_part_index(&f.path)?, f))).collect();
        let one = trellis_core::zone::parse(&trellis_core::render::zone(&out.plan, None).to_string()).unwrap();
        if !trellis_core::render::zone_parted(&out.plan) {
            prop_assert!(parts.is_empty(), "{} names {} nodes and has zone parts", name, out.plan.zone.len());
            continue;
        }
        parted += 1;
        prop_assert!(parts.windows(2).all(|w| w[0].0 < w[1].0), "{}'s zone parts are in order", name);
        let mut joined = main.content.to_string();
        let names: std::collections::HashSet<&str> = out.plan.zone.iter().map(|z| &*z.name).collect();
        for (i, f) in &parts {
            prop_assert_eq!(f.mode, 0o644);
            let text = f.content.to_string();
            prop_assert!(
                trellis_core::zone::check_part(&text, &f.path).is_ok(),
                "{}: {:?}",
                name,
                trellis_core::zone::check_part(&text, &f.path)
            );
            for record in text.lines().filter(|l| !l.starts_with(';')) {
                let n = record.split('\t').next().unwrap();
                prop_assert!(!names.contains(n) || usize::from(part_of(n)) == *i, "{}: {} is in part {}", name, n, i);
            }
            joined.push_str(&text);
        }
        let in_main = trellis_core::zone::parse(&main.content.to_string()).unwrap();
        prop_assert!(
            in_main.records.iter().all(|r| !names.contains(r.name.as_str())),
            "{} has node records in mesh.zone beside its parts",
            name
        );
        let whole = trellis_core::zone::parse(&joined).unwrap();
        prop_assert_eq!(
            (&whole.origin, whole.serial, &whole.nameserver, &whole.nameserver_addresses),
            (&one.origin, one.serial, &one.nameserver, &one.nameserver_addresses)
        );
        prop_assert_eq!(crate::zones::by_name(&whole), crate::zones::by_name(&one), "{}'s zone in parts is the zone", name);
    }
    Ok(parted)
}

/// A LAN route through two routers (the first two nodes), for a group and a node, and an exit
/// through the second that every fourth node opts into.
pub(crate) fn add_routes(d: &mut Declaration) {
    use trellis_core::decl::{Proto, Route, RouteRule};
    let loc = d.nodes[0].loc.clone();
    let names: Vec<String> = d.nodes.iter().map(|n| n.name.clone()).collect();
    let mut from = vec![Source::Node(names[names.len() - 1].clone())];
    if let Some(g) = d.groups.first() {
        from.push(Source::Group(g.name.clone()));
    }
    let rule = |proto, ports: Vec<trellis_core::decl::PortRange>, from: Vec<Source>| RouteRule {
        proto,
        ports,
        from_locs: from.iter().map(|_| loc.clone()).collect(),
        from,
        loc: loc.clone(),
    };
    d.routes.push(Route {
        name: "lan".into(),
        prefixes: vec!["192.168.10.0/24".parse().unwrap(), "fd10::/64".parse().unwrap()],
        via: vec![names[0].clone(), names[1].clone()],
        via_locs: vec![loc.clone(), loc.clone()],
        masquerade: true,
        allow: vec![rule(Some(Proto::Tcp), vec![trellis_core::decl::PortRange::parse("80").unwrap()], from)],
        hosts: vec![trellis_core::decl::RouteHost { name: "printer".into(), address: "192.168.10.5".parse().unwrap(), loc: loc.clone() }],
        loc: loc.clone(),
    });
    d.routes.push(Route {
        name: "internet".into(),
        prefixes: vec!["0.0.0.0/0".parse().unwrap()],
        via: vec![names[1].clone()],
        via_locs: vec![loc.clone()],
        masquerade: true,
        allow: vec![rule(None, Vec::new(), vec![Source::Mesh])],
        hosts: Vec::new(),
        loc: loc.clone(),
    });
    for (i, node) in d.nodes.iter_mut().map(Arc::make_mut).enumerate() {
        if i % 4 == 3 {
            node.exit = Some(("internet".into(), loc.clone()));
        }
    }
}

/// An exposure of the first module through the two last nodes, admitted by its first rule, so
/// that the ingress nodes' backends follow runners and keys as they change.
fn add_exposure(d: &mut Declaration) {
    use trellis_core::decl::{Acme, ExposeTls, Exposure};
    let loc = d.nodes[0].loc.clone();
    let n = d.nodes.len();
    let via = vec![d.nodes[n - 1].name.clone(), d.nodes[n - 2].name.clone()];
    let module = &mut d.modules[0];
    let port = module.allow[0].ports.first().map_or(80, |p| p.first);
    module.allow[0].from.push(Source::Expose("shop".into()));
    module.allow[0].from_locs.push(loc.clone());
    d.acme = Some(Acme { directory: "https://acme.example.net/dir".into(), email: None, loc: loc.clone() });
    d.exposures.push(Exposure {
        name: "shop".into(),
        hostnames: vec!["shop.example.com".into()],
        hostname_locs: vec![loc.clone()],
        module: module.name.clone(),
        module_loc: loc.clone(),
        port,
        via_locs: vec![loc.clone(), loc.clone()],
        via,
        listen: 443,
        tls: ExposeTls::Acme,
        tls_loc: loc.clone(),
        sources: vec!["0.0.0.0/0".parse().unwrap()],
        loc,
    });
}

/// The order by name of the compile before is taken only for the same names in the same places:
/// the same nodes declared in another order are sorted again (taking the old order would put
/// every node in another's place), and the order taken is the one a sort gives.
#[test]
fn the_order_before_is_taken_for_the_same_names_in_the_same_places_only() {
    use trellis_core::topology::Topology;
    let decl = crate::support::fixture("relay");
    let alloc = trellis_core::allocate(&decl, &Default::default()).unwrap();
    let keys = Keys::default();
    let before = Topology::new(&decl, &alloc, &keys);
    let names = |t: &Topology| (0..t.nodes.len() as u32).map(|i| t.name(i).to_string()).collect::<Vec<_>>();
    let mut sorted = names(&before);
    sorted.sort();
    assert_eq!(names(&before), sorted);

    let copy = decl.clone();
    let kept = Topology::new_after(&copy, &alloc, &keys, Some(before.before(None)));
    assert_eq!((kept.order.clone(), names(&kept)), (before.order.clone(), sorted.clone()));

    let mut reversed = decl.clone();
    reversed.nodes.reverse();
    assert!(reversed.nodes.len() > 2);
    let again = Topology::new_after(&reversed, &alloc, &keys, Some(before.before(None)));
    assert_eq!(again.order, Topology::new(&reversed, &alloc, &keys).order);
    assert_eq!(names(&again), sorted, "every node in its own place");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(100), .. ProptestConfig::default() })]

    /// A topology made from the one before (`new_after`: the index, groups and runners edited
    /// where nodes changed, the addresses, keys and reach kept where they hold) is the topology
    /// made afresh, after any sequence of changes, whether the key set is the one changed in
    /// place or a new one, and whether the allocation is the one before or not.
    #[test]
    fn a_topology_made_from_the_one_before_is_the_one_made_afresh(g in gen(), routed in any::<bool>(), exposed in any::<bool>(), changes in proptest::collection::vec((change(), any::<bool>(), any::<bool>(), proptest::option::of((0usize..32, proptest::option::of(any::<u8>())))), 1..12)) {
        use trellis_core::topology::{Before, Topology};
        let mut d = mesh(&g, routed, exposed);
        let mut keys = Keys::default();
        for node in d.nodes.iter_mut().map(Arc::make_mut).skip(1).step_by(2) {
            let key = node.public_key.take().expect("generated with a key");
            keys.set(&node.name, Some(key));
        }
        // Every step's declaration lives to the end of the case: each topology is made from
        // the one before, which borrows its declaration.
        let hold = |d: &Declaration| -> &'static Declaration { Box::leak(Box::new(d.clone())) };
        let mut alloc = trellis_core::allocate(&d, &Default::default()).unwrap();
        let mut decl = hold(&d);
        let mut prev = Topology::new(decl, &alloc, &keys);
        let mut seen = keys.seen();
        let mut added = 0;
        for (step, (c, afresh, group_members, key_too)) in changes.iter().enumerate() {
            // Sometimes a key changes in the same step as the declaration (one publish run
            // covers both).
            if let Some((i, k)) = key_too {
                apply(&mut d, &mut keys, &Change::Key(*i, *k), &mut added);
            }
            if apply(&mut d, &mut keys, c, &mut added) {
                // Sometimes a group's declared members change as well.
                if *group_members && !d.groups.is_empty() {
                    let name = d.nodes[step % d.nodes.len()].name.clone();
                    let at = step % d.groups.len();
                    let mut members = d.groups[at].members.to_vec();
                    match members.iter().position(|m| *m == name) {
                        Some(i) => {
                            members.remove(i);
                        }
                        None => members.push(name),
                    }
                    d.groups[at].members = members.into();
                }
                decl = hold(&d);
            }
            if *afresh {
                let mut fresh: Keys = keys.iter().map(|(n, k)| (n.to_string(), *k)).collect();
                fresh.withdraw_only(keys.withdrawn().iter().map(String::as_str));
                keys = fresh;
            }
            let now = trellis_core::allocate(decl, &alloc).unwrap();
            let addresses = (now == alloc).then_some((&prev.ipv4[..], &prev.ipv6[..]));
            let after = Topology::new_after(decl, &now, &keys, Some(Before { addresses, ..prev.before(Some(seen)) }));
            prop_assert_eq!(after.differs_from(&Topology::new(decl, &now, &keys)), None, "step {}: {:?}", step, c);
            (prev, alloc, seen) = (after, now, keys.seen());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(100), .. ProptestConfig::default() })]

    /// The controller's apply checks each declaration from what the check before held
    /// (`check_after`): after any sequence of changes it says what a whole check says, and its
    /// topology is the one made afresh, whether the allocation is the one before or not.
    #[test]
    fn a_check_from_the_one_before_says_what_a_whole_check_says(g in gen(), routed in any::<bool>(), exposed in any::<bool>(), changes in proptest::collection::vec((change(), any::<bool>()), 1..12)) {
        use trellis_core::explain::{check_after, check_allocated};
        use trellis_core::topology::Topology;
        let mut d = mesh(&g, routed, exposed);
        // A check knows the declared keys only: the key set of the changes is not its own.
        let mut keys = Keys::default();
        let mut alloc = Arc::new(trellis_core::allocate(&d, &Default::default()).unwrap());
        let mut decl = Arc::new(d.clone());
        let (first, mut held) = check_after(&decl, &alloc, None);
        prop_assert_eq!(crate::support::lines(&first), crate::support::lines(&check_allocated(&decl, &alloc)));
        let mut added = 0;
        for (step, (c, reshuffled)) in changes.iter().enumerate() {
            if apply(&mut d, &mut keys, c, &mut added) {
                decl = Arc::new(d.clone());
            }
            let mut now = trellis_core::allocate(&decl, &alloc).unwrap();
            // Sometimes the nodes hold one another's addresses (an allocation of the same names
            // that is not the one before).
            if *reshuffled {
                now.ipv4 = now.ipv4.keys().cloned().zip(now.ipv4.values().rev().copied()).collect();
            }
            let kept = now == *alloc;
            if !kept {
                alloc = Arc::new(now);
            }
            let before = held.before(kept);
            let topo = Topology::new_after(&decl, &alloc, &Keys::default(), Some(before));
            prop_assert_eq!(topo.differs_from(&Topology::new(&decl, &alloc, &Keys::default())), None, "step {}: {:?}", step, c);
            drop(topo);
            let (said, next) = check_after(&decl, &alloc, Some((&held, kept)));
            prop_assert_eq!(crate::support::lines(&said), crate::support::lines(&check_allocated(&decl, &alloc)), "step {}: {:?}", step, c);
            held = next;
        }
    }
}

/// A declared module whose last runner drops it keeps its (empty) runners in a topology made
/// from the one before, as in one made afresh; a group no node names any more is gone from both.
#[test]
fn a_module_left_without_runners_is_still_declared_after_the_edit() {
    use trellis_core::topology::Topology;
    let decl = crate::support::fixture("relay");
    let alloc = trellis_core::allocate(&decl, &Default::default()).unwrap();
    let keys = Keys::default();
    let before = Topology::new(&decl, &alloc, &keys);
    let module = decl.modules[0].name.clone();
    let mut d = decl.clone();
    let mut dropped = 0;
    for node in &mut d.nodes {
        if node.modules.contains(&module) || !node.groups.is_empty() {
            let node = Arc::make_mut(node);
            if let Some(at) = node.modules.iter().position(|m| *m == module) {
                node.modules.remove(at);
                node.refs.modules.remove(at);
                dropped += 1;
            }
            node.groups.clear();
            node.refs.groups.clear();
        }
    }
    assert!(dropped > 0, "the fixture runs {module}");
    let after = Topology::new_after(&d, &alloc, &keys, Some(before.before(None)));
    let afresh = Topology::new(&d, &alloc, &keys);
    assert_eq!(after.runners.get(module.as_str()), Some(&Vec::new()));
    assert_eq!(after.differs_from(&afresh), None);
}

/// A module without rules (one that only asks for a certificate, say) run by every node keeps
/// its (no) filter blocks across a recompile: a change that reaches no plan makes none again,
/// not every runner of that module.
#[test]
fn a_module_without_rules_does_not_make_its_runners_again() {
    let mut d = crate::support::fixture("relay");
    d.modules.push(trellis_core::decl::Module { name: "bare".into(), allow: Vec::new(), certificate: None, loc: d.mesh.loc.clone() });
    for node in &mut d.nodes {
        let node = Arc::make_mut(node);
        node.modules.push("bare".into());
        node.refs.modules.push(node.loc.clone());
    }
    let keys: Keys = d.nodes.iter().filter_map(|n| Some((n.name.clone(), n.public_key?))).collect();
    let decl = Arc::new(d.clone());
    let first = compile(&decl, &keys, &Default::default(), None).unwrap();
    // One node is written elsewhere: no plan changes, and none is made again.
    let loc = d.mesh.loc.clone();
    assert_ne!(d.nodes[0].loc, loc);
    Arc::make_mut(&mut d.nodes[0]).loc = loc;
    let moved = Arc::new(d);
    let again = compile(&moved, &keys, &first.allocation, Some(first.clone())).unwrap();
    let full = compile(&moved, &keys, &first.allocation, None).unwrap();
    same(&again, &full, &first, 0).unwrap();
    // A plan made again is another allocation, even when equal to the one before.
    let remade = again.nodes.iter().filter(|(n, o)| !Arc::ptr_eq(&o.plan, &first.nodes[*n].plan)).count();
    assert_eq!(remade, 0, "{remade} of {} plans made again", moved.nodes.len());
}

/// A node whose filter rules alone change (a rule of a module it runs gains a source that was
/// its partner already) keeps its plan's peers in place and its other files: only its
/// `nftables.conf` is made again. At 100,000 nodes a hub of a hundred thousand peers that runs
/// such a module was made again whole on a group move, two thirds of its time.
#[test]
fn a_node_whose_filter_rules_alone_change_keeps_its_peers_and_other_files() {
    use trellis_core::plan::{MESH_ZONE, NFTABLES_CONF, NODE_TOML, WIREGUARD_CONF};
    let mut d = crate::support::fixture("relay");
    // hub-1 runs the resolver, open to the whole mesh; a second rule opens it to the admins.
    let resolver = d.modules.iter_mut().find(|m| m.name == "resolver").expect("the fixture has a resolver");
    let mut rule = resolver.allow[0].clone();
    rule.proto = trellis_core::decl::Proto::Tcp;
    rule.from = vec![Source::Group("admins".into())];
    rule.from_locs = vec![rule.loc.clone()];
    resolver.allow.push(rule);
    let keys: Keys = d.nodes.iter().filter_map(|n| Some((n.name.clone(), n.public_key?))).collect();
    let first = compile(&Arc::new(d.clone()), &keys, &Default::default(), None).unwrap();
    // db-1 joins the admins: it was hub-1's partner already (through the mesh-wide rule).
    let db = d.nodes.iter_mut().find(|n| n.name == "db-1").expect("the fixture has db-1");
    let db = Arc::make_mut(db);
    db.groups = vec!["admins".into()];
    db.refs.groups = vec![db.loc.clone()];
    let moved = Arc::new(d);
    // The plans the compile before holds are its own, as a publish run's are.
    let mut before = first.clone();
    for o in before.nodes.values_mut() {
        o.plan = Arc::new((*o.plan).clone());
    }
    let peers_at = before.nodes["hub-1"].plan.peers.as_ptr();
    let again = compile(&moved, &keys, &first.allocation, Some(before)).unwrap();
    let full = compile(&moved, &keys, &first.allocation, None).unwrap();
    same(&again, &full, &first, 0).unwrap();
    let (hub, was) = (&again.nodes["hub-1"], &first.nodes["hub-1"]);
    let content = |o: &trellis_core::compile::NodeOutput, path: &str| o.files.iter().find(|f| f.path == path).expect(path).content.clone();
    assert!(again.rendered.iter().any(|n| n == "hub-1"), "hub-1's files changed: {:?}", again.rendered);
    assert_ne!(content(hub, NFTABLES_CONF).to_string(), content(was, NFTABLES_CONF).to_string(), "db-1 joined a set of hub-1's filter");
    for path in [WIREGUARD_CONF, MESH_ZONE, NODE_TOML] {
        assert_eq!(content(hub, path).id(), content(was, path).id(), "hub-1's {path} is kept as it was");
    }
    assert_eq!(hub.plan.peers.as_ptr(), peers_at, "hub-1's peers are kept in place, not made again");
}
