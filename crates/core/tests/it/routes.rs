//! Routes and exits: what `check` refuses (with the place), and what the compiler gives routers
//! and users: the prefixes in the AllowedIPs of the chosen router only for admitted nodes, the
//! router's forward filter with exactly the named sources, masquerading, and failover to the
//! next router when the first has no key.

use std::sync::Arc;

use trellis_core::decl::PublicKey;
use trellis_core::{compile, Declaration, Keys};

use crate::support::{lines, load_text, saddrs, valid};

/// An office LAN behind gw-1 (then gw-2), for group ops on tcp 80 and 443; an exit through exit-1
/// for group travellers; laptop-1 (ops, traveller, opted in), laptop-2 (ops), guest-1 (neither).
const MESH: &str = r#"[mesh]
name = "r"
domain = "r.mesh"
overlay_ipv4 = "10.88.0.0/24"

[networks]
internet = {}

[groups]
ops = ["laptop-1", "laptop-2"]
travellers = ["laptop-1", "guest-1"]

[[node]]
name = "gw-1"
networks = ["internet"]
[[node.endpoint]]
address = "198.51.100.10:51820"
reachable_from = ["internet"]

[[node]]
name = "gw-2"
networks = ["internet"]
[[node.endpoint]]
address = "198.51.100.11:51820"
reachable_from = ["internet"]

[[node]]
name = "exit-1"
networks = ["internet"]
[[node.endpoint]]
address = "198.51.100.12:51820"
reachable_from = ["internet"]

[[node]]
name = "laptop-1"
networks = ["internet"]
exit = "internet"

[[node]]
name = "laptop-2"
networks = ["internet"]

[[node]]
name = "guest-1"
networks = ["internet"]

[[route]]
name = "office-lan"
prefixes = ["192.168.10.0/24"]
via = ["gw-1", "gw-2"]
  [[route.allow]]
  proto = "tcp"
  ports = ["80", "443"]
  from = ["group:ops"]
  [[route.host]]
  name = "printer"
  address = "192.168.10.5"

[[route]]
name = "internet"
prefixes = ["0.0.0.0/0"]
via = ["exit-1"]
  [[route.allow]]
  proto = "any"
  from = ["group:travellers"]
"#;

fn key(b: u8) -> PublicKey {
    PublicKey([b; 32])
}

fn keys(names: &[&str]) -> Keys {
    names.iter().enumerate().map(|(i, n)| (n.to_string(), key(i as u8 + 1))).collect()
}

const ALL: &[&str] = &["gw-1", "gw-2", "exit-1", "laptop-1", "laptop-2", "guest-1"];

fn file(c: &trellis_core::Compiled, node: &str, path: &str) -> String {
    c.nodes[node].files.iter().find(|f| f.path.ends_with(path)).unwrap_or_else(|| panic!("{node} has no {path}")).content.to_string()
}

/// The `[Peer]` section of `peer` in a `wireguard.conf`: from its comment to the next blank line.
fn section(conf: &str, peer: &str) -> String {
    let start = conf.find(&format!("\n# {peer}:")).unwrap_or_else(|| panic!("no section for {peer} in:\n{conf}"));
    let rest = &conf[start + 1..];
    rest[..rest.find("\n\n").map_or(rest.len(), |e| e + 1)].to_string()
}

fn decl() -> Arc<Declaration> {
    Arc::new(valid(MESH, &[]))
}

#[test]
fn only_admitted_nodes_get_the_prefixes_and_only_at_the_first_router_with_a_key() {
    let d = decl();
    let c = compile(&d, &keys(ALL), &Default::default(), None).unwrap();
    let conf = file(&c, "laptop-2", "wireguard.conf");
    assert!(section(&conf, "gw-1").contains("# routes office-lan\nAllowedIPs = 192.168.10.0/24\n"), "{conf}");
    assert!(!section(&conf, "gw-2").contains("192.168.10.0/24"), "gw-2 stands by: {conf}");
    assert!(!conf.contains("0.0.0.0/0"), "laptop-2 uses no exit: {conf}");
    assert!(file(&c, "laptop-2", "node.toml").contains("routes = [\"192.168.10.0/24\"]\n"));

    // guest-1 is admitted by neither rule of office-lan and does not opt into the exit: it does
    // not even peer with the routers.
    let guest = file(&c, "guest-1", "wireguard.conf");
    assert!(!guest.contains("192.168.10.0/24") && !guest.contains("0.0.0.0/0") && !guest.contains("# gw-1:"), "{guest}");
    assert!(!file(&c, "guest-1", "node.toml").contains("routes"));
    assert!(!file(&c, "guest-1", "mesh.zone").contains("printer"), "need to know: the route's host names are for its users");

    // laptop-1 opted in and is a traveller: the exit's default prefix at exit-1, the LAN at gw-1.
    let conf = file(&c, "laptop-1", "wireguard.conf");
    assert!(section(&conf, "exit-1").contains("# routes internet\nAllowedIPs = 0.0.0.0/0\n"), "{conf}");
    let toml = file(&c, "laptop-1", "node.toml");
    assert!(toml.contains("exit = true") && toml.contains("routes = [\"192.168.10.0/24\"]"), "{toml}");
    assert!(file(&c, "laptop-1", "mesh.zone").contains("printer\tIN\tA\t192.168.10.5\n"));

    // gw-1 revoked (no key): gw-2 takes over.
    let mut k = keys(ALL);
    k.set("gw-1", None);
    let again = compile(&d, &k, &c.allocation, Some(c.clone())).unwrap();
    let conf = file(&again, "laptop-2", "wireguard.conf");
    assert!(section(&conf, "gw-2").contains("AllowedIPs = 192.168.10.0/24"), "{conf}");
    assert!(!conf.contains("# gw-1:"), "{conf}");
    // With no router keyed at all, the prefixes are not routed anywhere.
    k.set("gw-2", None);
    let none = compile(&d, &k, &c.allocation, Some(again)).unwrap();
    assert!(!file(&none, "laptop-2", "wireguard.conf").contains("192.168.10.0/24"));
    assert!(!file(&none, "laptop-2", "node.toml").contains("routes"));
}

#[test]
fn a_router_forwards_exactly_the_named_sources_to_the_named_ports_and_masquerades() {
    let d = decl();
    let c = compile(&d, &keys(ALL), &Default::default(), None).unwrap();
    let addr = |n: &str| c.allocation.ipv4[n].to_string();
    let mut ops = [addr("laptop-1"), addr("laptop-2")];
    ops.sort_by_key(|a| a.parse::<std::net::Ipv4Addr>().unwrap());
    let nft = file(&c, "gw-2", "nftables.conf");
    let want = "\t\tiifname \"trellis0\" ip saddr @route_office-lan_1_v4 ip daddr { 192.168.10.0/24 } tcp dport { 80, 443 } accept comment \"route office-lan rule 1: from group:ops\"\n";
    assert!(nft.contains(want), "want\n{want}in\n{nft}");
    assert_eq!(saddrs(&nft, want), ops, "the route's rule admits exactly ops");
    assert!(nft.contains("\t\tiifname \"trellis0\" drop comment \"trellis: no route rule admits this forwarded traffic\"\n"), "{nft}");
    let masquerade =
        "\t\toifname != \"trellis0\" ip saddr @masq_office-lan_v4 ip daddr { 192.168.10.0/24 } masquerade comment \"route office-lan\"\n";
    assert!(nft.contains(masquerade), "want\n{masquerade}in\n{nft}");
    assert_eq!(saddrs(&nft, masquerade), ops);
    assert!(file(&c, "gw-1", "node.toml").contains("router = true"));
    // The forward rules name only ops' addresses: guest-1's is nowhere in the router's filter.
    assert!(!nft.contains(&format!("{} ", addr("guest-1"))) && !nft.contains(&format!("{},", addr("guest-1"))), "{nft}");

    // The exit forwards for the travellers that opted in (laptop-1, not guest-1), to anything but
    // private networks and other routes' prefixes (office-lan lies in 192.168.0.0/16).
    let exit = file(&c, "exit-1", "nftables.conf");
    let want = "\t\tiifname \"trellis0\" ip saddr @route_internet_1_v4 ip daddr != { 0.0.0.0/8, 10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, 192.0.0.0/24, 192.168.0.0/16, 198.18.0.0/15, 240.0.0.0/4 } accept comment \"route internet rule 1: from group:travellers\"\n";
    assert!(exit.contains(want), "want\n{want}in\n{exit}");
    assert_eq!(saddrs(&exit, want), [addr("laptop-1")]);
    assert!(!exit.contains(&format!("{} ", addr("guest-1"))), "guest-1 does not opt in: {exit}");
    let masquerade = "\t\toifname != \"trellis0\" ip saddr @masq_internet_v4 ip daddr != { 0.0.0.0/8, 10.0.0.0/8, 100.64.0.0/10, 127.0.0.0/8, 169.254.0.0/16, 172.16.0.0/12, 192.0.0.0/24, 192.168.0.0/16, 198.18.0.0/15, 240.0.0.0/4 } masquerade comment \"route internet\"\n";
    assert!(exit.contains(masquerade), "want\n{masquerade}in\n{exit}");
    assert_eq!(saddrs(&exit, masquerade), [addr("laptop-1")]);
    // A node that routes for nothing forwards nothing from the overlay but relaying between peers.
    let plain = file(&c, "laptop-1", "nftables.conf");
    let forward = &plain[plain.find("chain forward").expect("every node has a forward chain")..];
    assert!(!forward.contains("daddr"), "{plain}");
    assert!(forward.contains("\t\tiifname \"trellis0\" oifname \"trellis0\" accept\n\t\tct state established,related accept\n\t\tct state invalid drop\n\t\toifname \"trellis0\" drop comment \"trellis: only replies enter the overlay from outside it\"\n\t\tiifname \"trellis0\" drop comment \"trellis: no route rule admits this forwarded traffic\"\n"), "{plain}");
}

/// The prefixes of the set after `daddr != ` in each forward line of `nft` for `family`.
fn refused(nft: &str, family: &str) -> Vec<ipnet::IpNet> {
    let tag = format!(" {family} daddr != {{ ");
    let lines: Vec<&str> = nft.lines().filter(|l| l.contains(&tag) && l.contains(" accept ")).collect();
    assert!(!lines.is_empty(), "no {family} forward line of an exit in\n{nft}");
    let set = |l: &str| -> Vec<ipnet::IpNet> {
        let after = &l[l.find(&tag).unwrap() + tag.len()..];
        after[..after.find(" }").unwrap()]
            .split(", ")
            .map(|p| p.parse().unwrap_or_else(|_| p.parse::<std::net::IpAddr>().unwrap().into()))
            .collect()
    };
    let first = set(lines[0]);
    assert!(lines.iter().all(|l| set(l) == first), "every line of the exit refuses the same ranges\n{nft}");
    first
}

#[test]
fn an_exit_refuses_the_ranges_the_iana_registries_mark_as_not_globally_reachable() {
    let dual = MESH
        .replace("overlay_ipv4 = \"10.88.0.0/24\"", "overlay_ipv4 = \"10.88.0.0/24\"\noverlay_ipv6 = \"fd88::/64\"")
        .replace("prefixes = [\"0.0.0.0/0\"]", "prefixes = [\"0.0.0.0/0\", \"::/0\"]");
    let d = Arc::new(valid(&dual, &[]));
    let c = compile(&d, &keys(ALL), &Default::default(), None).unwrap();
    let nft = file(&c, "exit-1", "nftables.conf");
    let covered = |set: &[ipnet::IpNet], p: &str| {
        let p: ipnet::IpNet = p.parse().unwrap();
        set.iter().any(|s| s.contains(&p))
    };
    let (v4, v6) = (refused(&nft, "ip"), refused(&nft, "ip6"));
    let never4 = ["0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12", "192.0.0.0/24"];
    let never4 = never4.iter().chain(&["192.168.0.0/16", "198.18.0.0/15", "240.0.0.0/4", "255.255.255.255/32"]);
    let never6 = ["::1/128", "::/128", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64", "2001::/32", "2001:2::/48"];
    let never6 = never6.iter().chain(&["2002::/16", "5f00::/16", "fc00::/7", "fe80::/10"]);
    for p in never4 {
        assert!(covered(&v4, p), "the exit forwards to {p}\n{nft}");
    }
    for p in never6 {
        assert!(covered(&v6, p), "the exit forwards to {p}\n{nft}");
    }
    // The internet, and the documentation ranges that stand for it in labs, stay open.
    for p in ["8.8.8.8/32", "198.51.100.80/32", "203.0.113.1/32", "192.0.2.1/32", "1.1.1.1/32"] {
        assert!(!covered(&v4, p), "the exit refuses {p}\n{nft}");
    }
    for p in ["2606:4700::1111/128", "2001:db8::1/128", "2a00::/16"] {
        assert!(!covered(&v6, p), "the exit refuses {p}\n{nft}");
    }
}

/// Loads `mesh` and compares its diagnostics, in order, with `expect`.
#[track_caller]
fn check(mesh: &str, expect: &[&str]) {
    let loaded = load_text(mesh, &[]);
    let got = lines(&loaded.diagnostics);
    let want: String = expect.iter().map(|l| format!("{l}\n")).collect();
    assert_eq!(got, want, "\n--- got ---\n{got}--- want ---\n{want}");
}

#[test]
fn check_refuses_bad_routes_with_their_place() {
    let unknown_via = MESH.replace("via = [\"gw-1\", \"gw-2\"]", "via = [\"gw-9\", \"gw-2\"]");
    check(&unknown_via, &["mesh.toml:50:8: error: route `office-lan` goes via `gw-9`, which is not a declared node (declared: exit-1, guest-1, gw-1, gw-2, laptop-1, laptop-2)"]);

    let overlay = MESH.replace("prefixes = [\"192.168.10.0/24\"]", "prefixes = [\"10.88.0.0/25\"]").replace("192.168.10.5", "10.88.0.5");
    check(&overlay, &["mesh.toml:47:1: error: route `office-lan` prefix 10.88.0.0/25 overlaps the overlay 10.88.0.0/24; a route must reach addresses outside the overlay"]);

    let unadmitted = MESH
        .replace("name = \"laptop-2\"\nnetworks = [\"internet\"]", "name = \"laptop-2\"\nnetworks = [\"internet\"]\nexit = \"internet\"");
    check(&unadmitted, &["mesh.toml:42:8: error: node `laptop-2` uses exit `internet`, but no [[route.allow]] of route `internet` admits it; add a rule naming it, its group or its module"]);

    let not_exit = MESH.replace("exit = \"internet\"", "exit = \"office-lan\"");
    check(&not_exit, &["mesh.toml:37:8: error: node `laptop-1` uses exit `office-lan`, but that route has no default prefix (0.0.0.0/0 or ::/0), so it is no exit"]);

    let unknown_key = MESH.replace("via = [\"exit-1\"]", "via = [\"exit-1\"]\nmetric = 5");
    check(
        &unknown_key,
        &["mesh.toml:63:1: error: unknown key `metric` in [[route]]; allowed keys: name, prefixes, via, masquerade, allow, host"],
    );

    let overlapping = MESH.replace(
        "[[route]]\nname = \"internet\"\nprefixes = [\"0.0.0.0/0\"]",
        "[[route]]\nname = \"internet\"\nprefixes = [\"0.0.0.0/0\", \"192.168.0.0/16\"]",
    );
    check(&overlapping, &["mesh.toml:59:1: error: route `internet` prefix 192.168.0.0/16 overlaps prefix 192.168.10.0/24 of route `office-lan`; a destination must have one route"]);

    let underlay =
        MESH.replace("prefixes = [\"192.168.10.0/24\"]", "prefixes = [\"198.51.100.0/24\"]").replace("192.168.10.5", "198.51.100.5");
    check(&underlay, &["mesh.toml:47:1: error: route `office-lan` prefix 198.51.100.0/24 holds endpoint 198.51.100.10:51820 of node `gw-1`; the underlay must stay outside a route, or the tunnel would carry itself"]);

    let host_off = MESH.replace("192.168.10.5", "192.168.11.5");
    check(
        &host_off,
        &["mesh.toml:55:3: error: host `printer` of route `office-lan` has address 192.168.11.5, which is on none of the route's prefixes"],
    );

    let taken = MESH.replace("name = \"printer\"", "name = \"gw-2\"");
    check(
        &taken,
        &["mesh.toml:55:3: error: host `gw-2` of route `office-lan` takes the name of node `gw-2`; names in the zone must differ"],
    );

    let bad_source = MESH.replace("from = [\"group:ops\"]", "from = [\"group:opz\"]");
    check(&bad_source, &["mesh.toml:54:11: error: rule of route `office-lan` names source `group:opz`, but no group `opz` is declared (declared: ops, travellers)"]);

    let no_from = MESH.replace("  proto = \"any\"\n  from = [\"group:travellers\"]\n", "  proto = \"any\"\n");
    check(
        &no_from,
        &[
            "mesh.toml:37:8: error: node `laptop-1` uses exit `internet`, but no [[route.allow]] of route `internet` admits it; add a rule naming it, its group or its module",
            "mesh.toml:63:3: error: [[route.allow]] has no `from`: every rule must name its sources (\"node:NAME\", \"group:NAME\", \"module:NAME\" or \"mesh\")",
        ],
    );
}

#[test]
fn policy_tests_reach_routes() {
    let tests = "\n[[test]]\nfrom = \"node:laptop-1\"\nto = \"route:office-lan\"\nproto = \"tcp\"\nport = 443\nexpect = \"allow\"\n\
        [[test]]\nfrom = \"node:laptop-2\"\nto = \"route:office-lan\"\nproto = \"tcp\"\nport = 22\nexpect = \"deny\"\n\
        [[test]]\nfrom = \"node:guest-1\"\nto = \"route:office-lan\"\nproto = \"tcp\"\nport = 80\nexpect = \"deny\"\n\
        [[test]]\nfrom = \"node:laptop-1\"\nto = \"route:internet\"\nproto = \"udp\"\nport = 53\nexpect = \"allow\"\n";
    let d = valid(&format!("{MESH}{tests}"), &[]);
    assert_eq!(lines(&trellis_core::explain::check(&d)), "");

    let failing = "\n[[test]]\nfrom = \"node:guest-1\"\nto = \"route:internet\"\nproto = \"tcp\"\nport = 80\nexpect = \"allow\"\n\
        [[test]]\nfrom = \"node:laptop-2\"\nto = \"route:office-lan\"\nproto = \"tcp\"\nport = 80\nexpect = \"deny\"\n\
        [[test]]\nfrom = \"node:laptop-2\"\nto = \"route:office-lan\"\nproto = \"udp\"\nport = 80\nexpect = \"allow\"\n";
    let d = valid(&format!("{MESH}{failing}"), &[]);
    assert_eq!(
        lines(&trellis_core::explain::check(&d)),
        "mesh.toml:67:1: error: test from node:guest-1 to route:internet (tcp 80) expects allow, but guest-1 does not opt into the exit (`exit = \"internet\"` on the node)\n\
         mesh.toml:73:1: error: test from node:laptop-2 to route:office-lan (tcp 80) expects deny, but the route admits it by rule 1 (mesh.toml:51:3)\n\
         mesh.toml:79:1: error: test from node:laptop-2 to route:office-lan (udp 80) expects allow, but no rule of route `office-lan` that admits laptop-2 opens udp 80\n"
    );
}

mod props {
    //! Over generated meshes with a route of random routers and sources: the prefixes reach
    //! exactly the admitted nodes that have a direct path with a router (and only at the first
    //! such router), and every router's forward filter names exactly the sources the rule names,
    //! by a reading of the rule written here without the compiler's index.

    use proptest::prelude::*;
    use trellis_core::decl::{PortRange, Proto, Route, RouteRule, Source};
    use trellis_core::topology::{Path, Topology};

    use crate::props::{declaration, gen};

    proptest! {
        #![proptest_config(ProptestConfig { cases: 120, .. ProptestConfig::default() })]

        #[test]
        fn the_prefixes_and_the_forward_filter_follow_the_rule(
            g in gen(),
            via in proptest::collection::vec(0usize..16, 1..3),
            sources in proptest::collection::vec((0u8..4, 0usize..16), 1..4),
        ) {
            let mut d = declaration(&g);
            let n = d.nodes.len();
            let loc = d.nodes[0].loc.clone();
            let mut via: Vec<String> = via.iter().map(|&i| d.nodes[i % n].name.clone()).collect();
            via.dedup();
            let from: Vec<Source> = sources
                .iter()
                .map(|&(kind, k)| match kind {
                    0 => Source::Node(d.nodes[k % n].name.clone()),
                    1 if !d.groups.is_empty() => Source::Group(d.groups[k % d.groups.len()].name.clone()),
                    2 if !d.modules.is_empty() => Source::Module(d.modules[k % d.modules.len()].name.clone()),
                    _ => Source::Mesh,
                })
                .collect();
            d.routes.push(Route {
                name: "lan".into(),
                prefixes: vec!["192.168.10.0/24".parse().unwrap()],
                via: via.clone(),
                via_locs: via.iter().map(|_| loc.clone()).collect(),
                masquerade: true,
                allow: vec![RouteRule {
                    proto: Some(Proto::Tcp),
                    ports: vec![PortRange::parse("80").unwrap()],
                    from_locs: from.iter().map(|_| loc.clone()).collect(),
                    from: from.clone(),
                    loc: loc.clone(),
                }],
                hosts: Vec::new(),
                loc,
            });
            let c = crate::support::compile_all(&d);
            let alloc = c.allocation.clone();
            let topo = Topology::new(&d, &alloc, &Default::default());
            let admitted: Vec<&str> =
                d.nodes.iter().filter(|x| trellis_core::load::names_node(&from, &d, x)).map(|x| x.name.as_str()).collect();
            for node in &d.nodes {
                let conf = c.nodes[&node.name].files.iter().find(|f| f.path.ends_with("wireguard.conf")).unwrap().content.to_string();
                let i = topo.index[node.name.as_str()];
                let first = via.iter().find(|v| matches!(topo.path(i, topo.index[v.as_str()], false), Path::Direct));
                let gets = admitted.contains(&node.name.as_str()) && !via.contains(&node.name) && first.is_some();
                prop_assert_eq!(conf.matches("# routes lan\n").count(), usize::from(gets), "{}:\n{}", node.name, conf);
                if gets {
                    let at = conf.find(&format!("\n# {}:", first.unwrap())).unwrap();
                    let section = &conf[at..];
                    let end = section[1..].find("\n\n").map_or(section.len(), |e| e + 1);
                    prop_assert!(section[..end].contains("# routes lan\n"), "{} sends the route to {}:\n{}", node.name, first.unwrap(), conf);
                }
                let nft = c.nodes[&node.name].files.iter().find(|f| f.path.ends_with("nftables.conf")).unwrap().content.to_string();
                if via.contains(&node.name) {
                    let mut want: Vec<std::net::Ipv4Addr> = admitted.iter().map(|a| alloc.ipv4[*a]).collect();
                    want.sort_unstable();
                    let want: Vec<String> = want.iter().map(|a| a.to_string()).collect();
                    let line = if want.is_empty() {
                        "# its sources name no node: nothing is forwarded"
                    } else {
                        "ip saddr @route_lan_1_v4 ip daddr { 192.168.10.0/24 } tcp dport { 80 } accept"
                    };
                    prop_assert!(nft.contains(line), "{}: want `{}` in\n{}", node.name, line, nft);
                    if !want.is_empty() {
                        prop_assert_eq!(crate::support::saddrs(&nft, line), want, "{} forwards exactly the admitted", node.name);
                    }
                } else {
                    // Every node's input chain names the overlay's prefix as a destination; only a
                    // router's forward chain names the route's.
                    prop_assert!(!nft.contains("daddr { 192.168.10.0/24 }"), "{} routes for nothing:\n{}", node.name, nft);
                }
            }
        }
    }
}

/// A route's users hold what the route declares, not its router's filter (which names every
/// user): a node joining the route's group leaves the plans of the other users as a full compile
/// makes them, so a later recompile does not take their unchanged files for changed ones.
#[test]
fn a_new_route_user_leaves_the_other_users_plans_as_a_full_compile_makes_them() {
    let mut d = valid(MESH, &[]);
    let first = compile(&Arc::new(d.clone()), &keys(ALL), &Default::default(), None).unwrap();
    let joining = Arc::make_mut(d.nodes.iter_mut().find(|n| n.name == "guest-1").unwrap());
    joining.groups.push("ops".into());
    joining.refs.groups.push(joining.loc.clone());
    let d = Arc::new(d);
    let full = compile(&d, &keys(ALL), &first.allocation, None).unwrap();
    let again = compile(&d, &keys(ALL), &Default::default(), Some(first.clone())).unwrap();
    // The new user is in the named set of the route's sources; the rule's lines stay the same.
    let sets = |c: &trellis_core::Compiled| c.nodes["gw-1"].plan.routes_for[0].sets.clone();
    let forward = |c: &trellis_core::Compiled| c.nodes["gw-1"].plan.routes_for[0].forward.clone();
    assert_ne!(sets(&full), sets(&first), "the router's filter names the new user");
    assert_eq!(forward(&full), forward(&first), "in its set's elements only");
    for (name, out) in &again.nodes {
        assert_eq!(out.files, full.nodes[name].files, "{name}: files");
        assert_eq!(out.plan, full.nodes[name].plan, "{name}: plan");
    }
}
