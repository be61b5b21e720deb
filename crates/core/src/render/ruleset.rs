//! `nftables.conf` and the parts of its sources (ADR 0044), and the rule and route blocks every
//! node that runs a module, or routes or uses a route, shares.

use std::fmt::Write;
use std::sync::Arc;

use crate::decl::Proto;
use crate::plan::{FileResource, NodePlan, RouteBlock, RouteUse, RuleBlock, NFTABLES_CONF, WIREGUARD_PARTS};
use crate::text::{Text, TextBuilder};
use crate::topology::{ResolvedRoute, ResolvedRule, Topology};

/// A node's `nftables.conf` as one file: the rules' sets with their elements, the chains
/// (`nftables_files` gives it in parts when its sources are many).
pub fn nftables(plan: &NodePlan) -> Text {
    nftables_text(plan, false)
}

/// Whether `plan`'s ruleset is in parts (ADR 0044): its rules' sources' addresses take more than
/// [`crate::plan::RULESET_PARTS_FROM`] bytes.
pub fn ruleset_parted(plan: &NodePlan) -> bool {
    plan.rules.iter().map(|r| r.parted.bytes).sum::<usize>() > crate::plan::RULESET_PARTS_FROM
}

/// A node's ruleset files: `nftables.conf` as [`nftables`] makes it, or, when its rules' sources
/// take more than [`crate::plan::RULESET_PARTS_FROM`] bytes, `nftables.conf` with the rules' sets
/// declared without elements, and the parts (ADR 0044): each source's address added to its set
/// by an `add element` line in the part its node's name hashes to. `nftables.conf` and its parts
/// in order, one after the other, are the ruleset, loaded in one transaction: the same table as
/// the one file makes.
pub fn nftables_files(plan: &NodePlan) -> Vec<FileResource> {
    let file = |path: &str, content: Text| FileResource { path: path.into(), mode: 0o644, content };
    if !ruleset_parted(plan) {
        return vec![file(NFTABLES_CONF, nftables(plan))];
    }
    let mut files = vec![file(NFTABLES_CONF, nftables_text(plan, true))];
    let mut pieces: Vec<Vec<&Arc<str>>> = vec![Vec::new(); WIREGUARD_PARTS];
    for (i, lines) in plan.rules.iter().flat_map(|r| r.parted.parts.iter()) {
        pieces[usize::from(*i)].push(lines);
    }
    for (i, pieces) in pieces.into_iter().enumerate().filter(|(_, p)| !p.is_empty()) {
        let mut t = TextBuilder::with_capacity(pieces.len() + 1, 128);
        let _ = writeln!(
            t,
            "# trellis: sources of the inbound filter of node {} in mesh {}, part {i:02}. Generated; do not edit.",
            plan.node, plan.common.mesh
        );
        for lines in pieces {
            t.push_shared(lines);
        }
        files.push(file(crate::plan::ruleset_part(i), t.finish()));
    }
    files
}

/// `nftables.conf`: with `parted`, the rules' sets declared without their elements, which the
/// parts add (ADR 0044).
fn nftables_text(plan: &NodePlan, parted: bool) -> Text {
    let iface = &plan.common.interface;
    let mut s = TextBuilder::with_capacity(plan.rules.len() * 4 + 2, 512);
    let _ = writeln!(s, "# trellis: inbound filter of node {} in mesh {}. Generated; do not edit.", plan.node, plan.common.mesh);
    s.push_str("# Loaded with `nft -f`: the whole file is one transaction, so the table is replaced atomically.\n");
    s.push_str("# The agent changes only the elements of a named set when nothing else differs (ADR 0031).\n");
    if parted {
        s.push_str("# The rules' sources are added to their sets by nftables.d/sources-NN.nft, loaded after this file in the same transaction (ADR 0044).\n");
    }
    s.push_str("table inet trellis {\n}\ndelete table inet trellis\n\n");
    s.push_str("table inet trellis {\n");
    // Each rule's sources are a named set, so that a node coming or going changes its elements,
    // not the table.
    for r in &plan.rules {
        s.push_shared(if parted { &r.parted.declared } else { &r.sets });
    }
    for r in &plan.routes_for {
        s.push_shared(&r.sets);
    }
    if plan.rules.iter().any(|r| !r.sets.is_empty()) || plan.routes_for.iter().any(|r| !r.sets.is_empty()) {
        s.push_str("\n");
    }
    s.push_str("\tchain input {\n\t\ttype filter hook input priority filter; policy accept;\n");
    // Linux delivers a packet to any of its addresses whatever interface it came in on, so a
    // host beside this node on the underlay that routes to its overlay address would reach every
    // service bound there, past every rule below. Nothing addressed to this node's overlay
    // addresses, or claiming one of the overlay's addresses as its source, comes in any other
    // way than through the overlay (or from this node itself), established or not (a spoofed
    // packet would join a flow's conntrack entry); the rest of the underlay is left be.
    let own = [plan.ipv4.map(|a| ("ip", a.to_string())), plan.ipv6.map(|a| ("ip6", a.to_string()))];
    for (family, addr) in own.iter().flatten() {
        let _ = writeln!(
            s,
            "\t\tiifname != {{ \"{iface}\", \"lo\" }} {family} daddr {addr} drop comment \"trellis: the overlay's addresses are reached through the overlay only\""
        );
    }
    let prefixes = overlay_prefixes(plan);
    for (family, prefix) in &prefixes {
        let _ = writeln!(
            s,
            "\t\tiifname != {{ \"{iface}\", \"lo\" }} {family} saddr {prefix} drop comment \"trellis: the overlay's addresses send through the overlay only\""
        );
    }
    let _ = writeln!(s, "\t\tiifname != \"{iface}\" accept");
    s.push_str("\t\tct state established,related accept\n\t\tct state invalid drop\n");
    for r in &plan.rules {
        s.push_shared(&r.lines);
    }
    let _ = writeln!(s, "\t\tiifname \"{iface}\" drop comment \"trellis: no rule admits this new inbound traffic\"");
    s.push_str("\t}\n");
    // Traffic from the overlay leaves it only as a route's rules say, on every node: a router
    // forwards what its routes admit, a hub relays between overlay peers, and a node that has
    // forwarding on for any other reason (or from before) forwards nothing from the overlay.
    // Traffic from the underlay enters the overlay only as a reply to what a route's rules let
    // out (routes are one-way): a host beside a router or an exit that routes the overlay's
    // prefix through it must not reach the mesh, least of all with another node's overlay
    // address as its source, which the receiving node's filter would take for that node.
    // Forwarding between other interfaces is left be.
    s.push_str("\n\tchain forward {\n\t\ttype filter hook forward priority filter; policy accept;\n");
    // Before the established flows are accepted: a host on the underlay that sends with an
    // overlay address through a hub or router would otherwise join a flow between two peers.
    for (family, prefix) in &prefixes {
        let _ = writeln!(
            s,
            "\t\tiifname != \"{iface}\" oifname \"{iface}\" {family} saddr {prefix} drop comment \"trellis: the overlay's addresses send through the overlay only\""
        );
    }
    let _ = writeln!(s, "\t\tiifname != \"{iface}\" oifname != \"{iface}\" accept");
    let _ = writeln!(s, "\t\tiifname \"{iface}\" oifname \"{iface}\" accept");
    s.push_str("\t\tct state established,related accept\n\t\tct state invalid drop\n");
    let _ = writeln!(s, "\t\toifname \"{iface}\" drop comment \"trellis: only replies enter the overlay from outside it\"");
    for r in &plan.routes_for {
        s.push_shared(&r.forward);
    }
    let _ = writeln!(s, "\t\tiifname \"{iface}\" drop comment \"trellis: no route rule admits this forwarded traffic\"");
    s.push_str("\t}\n");
    if plan.hub || !plan.routes_for.is_empty() {
        // A hub relays between peers of one interface, and the kernel tells the sender of each
        // relayed packet to send straight to its peer instead (an ICMP redirect): there is no
        // such path on the overlay, only noise, and a map of who talks to whom for anyone
        // listening. Forwarding nodes send none out of the overlay.
        s.push_str("\n\tchain output {\n\t\ttype filter hook output priority filter; policy accept;\n");
        let _ =
            writeln!(s, "\t\toifname \"{iface}\" icmp type redirect drop comment \"trellis: a relay sends no redirects into the overlay\"");
        let _ = writeln!(
            s,
            "\t\toifname \"{iface}\" icmpv6 type nd-redirect drop comment \"trellis: a relay sends no redirects into the overlay\""
        );
        s.push_str("\t}\n");
    }
    if plan.routes_for.iter().any(|r| !r.nat.is_empty()) {
        s.push_str("\n\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat; policy accept;\n");
        for r in &plan.routes_for {
            s.push_shared(&r.nat);
        }
        s.push_str("\t}\n");
    }
    s.push_str("}\n");
    s.finish()
}

/// The overlay's prefixes, with the family nftables names each by.
fn overlay_prefixes(plan: &NodePlan) -> Vec<(&'static str, String)> {
    [plan.common.overlay_ipv4.map(|p| ("ip", p.trunc().to_string())), plan.common.overlay_ipv6.map(|p| ("ip6", p.trunc().to_string()))]
        .into_iter()
        .flatten()
        .collect()
}

/// A route as its users' and routers' files hold it (see `RouteBlock`).
pub fn route_block(topo: &Topology, r: &ResolvedRoute) -> RouteBlock {
    let iface = &topo.decl.mesh.interface;
    let route = r.route;
    let prefixes: Vec<String> = route.prefixes.iter().map(|p| p.to_string()).collect();
    let lines = format!("# routes {}\nAllowedIPs = {}\n", route.name, prefixes.join(", "));
    let v4: Vec<String> = route.prefixes.iter().filter(|p| matches!(p, ipnet::IpNet::V4(_))).map(|p| p.to_string()).collect();
    let v6: Vec<String> = route.prefixes.iter().filter(|p| matches!(p, ipnet::IpNet::V6(_))).map(|p| p.to_string()).collect();
    let exit = route.is_exit();
    // An exit forwards for the nodes that use it (admitted and opted in), to the internet: not to
    // private networks the exit host reaches, nor to other routes' prefixes, whose own rules
    // decide who reaches them (a LAN behind the exit is a route of its own).
    let (v4, v6) = if exit {
        let (x4, x6) = exit_destinations(topo);
        // Only the families the exit carries (a default prefix of its own).
        let carries = |v6: bool| route.prefixes.iter().any(|p| p.prefix_len() == 0 && matches!(p, ipnet::IpNet::V6(_)) == v6);
        (if carries(false) { x4 } else { Vec::new() }, if carries(true) { x6 } else { Vec::new() })
    } else {
        (v4, v6)
    };
    // An exit's destinations are those it does not forward to.
    let not = if exit { "!= " } else { "" };
    let addrs = |set: &[u32]| -> (Vec<String>, Vec<String>) {
        let used = |i: &&u32| !exit || r.users.binary_search(i).is_ok();
        let mut a4: Vec<_> = set.iter().filter(used).filter_map(|&i| topo.ipv4[i as usize]).collect();
        let mut a6: Vec<_> = set.iter().filter(used).filter_map(|&i| topo.ipv6[i as usize]).collect();
        a4.sort_unstable();
        a6.sort_unstable();
        (a4.iter().map(|a| a.to_string()).collect(), a6.iter().map(|a| a.to_string()).collect())
    };
    let mut forward = String::new();
    // Each rule's sources, and the sources masqueraded, are named sets (as a module's rules'
    // are), so that a user coming or going changes their elements, not the table.
    let mut sets = String::new();
    let mut set = |name: String, v6: bool, addrs: &[String]| -> String {
        let kind = if v6 { "ipv6_addr" } else { "ipv4_addr" };
        let _ = writeln!(sets, "\tset {name} {{\n\t\ttype {kind}\n\t\telements = {{ {} }}\n\t}}", addrs.join(", "));
        format!("@{name}")
    };
    for (i, (rule, sources)) in route.allow.iter().zip(&r.sources).enumerate() {
        let from: Vec<String> = rule.from.iter().map(|s| s.to_string()).collect();
        let from = from.join(", ");
        let ports: Vec<String> = rule.ports.iter().map(|p| p.to_string()).collect();
        let what = match rule.proto {
            None => "any".to_string(),
            Some(Proto::Icmp) => "icmp".to_string(),
            Some(p) => format!("{p} {}", ports.join(", ")),
        };
        let _ = writeln!(forward, "\t\t# route {}, rule {}: {what} from {from}", route.name, i + 1);
        let comment = truncate(format!("route {} rule {}: from {from}", route.name, i + 1));
        let (s4, s6) = addrs(sources);
        if s4.is_empty() && s6.is_empty() {
            forward.push_str("\t\t# its sources name no node: nothing is forwarded\n");
            continue;
        }
        for (fam, l4, saddrs, daddrs) in [("ip", "icmp", &s4, &v4), ("ip6", "ipv6-icmp", &s6, &v6)] {
            if saddrs.is_empty() || daddrs.is_empty() {
                continue;
            }
            let from = set(format!("route_{}_{}_{}", route.name, i + 1, if fam == "ip" { "v4" } else { "v6" }), fam == "ip6", saddrs);
            let _ = write!(forward, "\t\tiifname \"{iface}\" {fam} saddr {from} {fam} daddr {not}{{ {} }} ", daddrs.join(", "));
            match rule.proto {
                None => {}
                Some(Proto::Icmp) => {
                    let _ = write!(forward, "meta l4proto {l4} ");
                }
                Some(p) => {
                    let _ = write!(forward, "{p} dport {{ {} }} ", ports.join(", "));
                }
            }
            let _ = writeln!(forward, "accept comment \"{comment}\"");
        }
    }
    let mut nat = String::new();
    if route.masquerade {
        let all: Vec<u32> = {
            let mut v: Vec<u32> = r.sources.iter().flatten().copied().collect();
            v.sort_unstable();
            v.dedup();
            v
        };
        let (s4, s6) = addrs(&all);
        for (fam, saddrs, daddrs) in [("ip", &s4, &v4), ("ip6", &s6, &v6)] {
            if saddrs.is_empty() || daddrs.is_empty() {
                continue;
            }
            let from = set(format!("masq_{}_{}", route.name, if fam == "ip" { "v4" } else { "v6" }), fam == "ip6", saddrs);
            let _ = writeln!(
                nat,
                "\t\toifname != \"{iface}\" {fam} saddr {from} {fam} daddr {not}{{ {} }} masquerade comment \"route {}\"",
                daddrs.join(", "),
                route.name
            );
        }
    }
    let route =
        RouteUse { name: Arc::from(route.name.as_str()), prefixes: route.prefixes.clone(), exit: route.is_exit(), lines: lines.into() };
    RouteBlock { route: Arc::new(route), sets: sets.into(), forward: forward.into(), nat: nat.into() }
}

/// The ranges an exit never forwards to, from the IANA IPv4 and IPv6 Special-Purpose Address
/// Registries (iana.org/assignments/iana-ipv4-special-registry and iana-ipv6-special-registry):
/// every entry whose "Globally Reachable" is False, taken whole (the anycast services the IPv6
/// registry lists inside 2001::/23 and the IPv4 one inside 192.0.0.0/24 go with it), because an
/// exit is the internet and these are not; less the documentation ranges (192.0.2.0/24,
/// 198.51.100.0/24, 203.0.113.0/24, 2001:db8::/32, 3fff::/20), which reach nothing on a real
/// network and which labs and tests use as their internet. And the translation prefixes, whatever
/// their "Globally Reachable" (True for 64:ff9b::/96, N/A for 2002::/16): each embeds an IPv4
/// address that a NAT64 or 6to4 relay on the exit's network would reach, private ones included.
/// A global IPv6 LAN behind an exit is in none of these: it is a route of its own, with its rules.
const EXIT_NEVER_V4: [&str; 10] = [
    "0.0.0.0/8",      // "this network"
    "10.0.0.0/8",     // private use
    "100.64.0.0/10",  // shared address space (carrier-grade NAT)
    "127.0.0.0/8",    // loopback
    "169.254.0.0/16", // link local
    "172.16.0.0/12",  // private use
    "192.0.0.0/24",   // IETF protocol assignments
    "192.168.0.0/16", // private use
    "198.18.0.0/15",  // benchmarking
    "240.0.0.0/4",    // reserved, and the limited broadcast address
];
const EXIT_NEVER_V6: [&str; 12] = [
    "::/128",         // unspecified
    "::1/128",        // loopback
    "::ffff:0:0/96",  // IPv4-mapped
    "64:ff9b::/96",   // IPv4-IPv6 translation (NAT64): reaches IPv4, private ranges included
    "64:ff9b:1::/48", // local-use IPv4-IPv6 translation
    "100::/64",       // discard-only
    "2001::/23",      // IETF protocol assignments (Teredo, benchmarking, ORCHID, ...)
    "2002::/16",      // 6to4: reaches IPv4 through a relay
    "5f00::/16",      // segment routing (SRv6) SIDs
    "fc00::/7",       // unique local
    "fe80::/10",      // link-local unicast
    "100:0:0:1::/64", // dummy IPv6 prefix
];

/// What an exit does not forward to, per family (matched with `!=`): `EXIT_NEVER_V4` and
/// `EXIT_NEVER_V6` and every other route's prefixes, merged so that no two overlap.
fn exit_destinations(topo: &Topology) -> (Vec<String>, Vec<String>) {
    let mut v4: Vec<ipnet::Ipv4Net> = EXIT_NEVER_V4.iter().map(|p| p.parse().expect("a prefix")).collect();
    let mut v6: Vec<ipnet::Ipv6Net> = EXIT_NEVER_V6.iter().map(|p| p.parse().expect("a prefix")).collect();
    for other in topo.routes.iter().filter(|o| !o.route.is_exit()) {
        for p in &other.route.prefixes {
            match p {
                ipnet::IpNet::V4(p) => v4.push(*p),
                ipnet::IpNet::V6(p) => v6.push(*p),
            }
        }
    }
    (
        ipnet::Ipv4Net::aggregate(&v4).iter().map(|p| p.to_string()).collect(),
        ipnet::Ipv6Net::aggregate(&v6).iter().map(|p| p.to_string()).collect(),
    )
}

/// An nftables comment of at most 120 bytes.
fn truncate(mut comment: String) -> String {
    if comment.len() > 120 {
        let mut cut = 117;
        while !comment.is_char_boundary(cut) {
            cut -= 1;
        }
        comment.truncate(cut);
        comment.push_str("...");
    }
    comment
}

/// The filter block of one rule: the same on every node that runs the module. Its sources of
/// each family are the named set `src_MODULE_RULE_v4` or `_v6` (a module's name is a DNS label,
/// which nft takes as a set's name; the prefix keeps one that starts with a digit a name).
pub fn rule_block(topo: &Topology, r: &ResolvedRule) -> RuleBlock {
    let iface = &topo.decl.mesh.interface;
    let from: Vec<String> = r.rule.from.iter().map(|s| s.to_string()).collect();
    let from = from.join(", ");
    let ports: Vec<String> = r.rule.ports.iter().map(|p| p.to_string()).collect();
    let what = match r.rule.proto {
        Proto::Icmp => "icmp".to_string(),
        p => format!("{p} {}", ports.join(", ")),
    };
    let mut s = String::new();
    let _ = writeln!(s, "\t\t# module {}, rule {}: {what} from {from}", r.module, r.number);
    let comment = truncate(format!("{} rule {}: from {from}", r.module, r.number));
    // Each source's address with the part of its name (ADR 0044), by address.
    let mut v4: Vec<_> = r.sources.iter().filter_map(|&i| Some((topo.ipv4[i as usize]?, i))).collect();
    let mut v6: Vec<_> = r.sources.iter().filter_map(|&i| Some((topo.ipv6[i as usize]?, i))).collect();
    v4.sort_unstable();
    v6.sort_unstable();
    if v4.is_empty() && v6.is_empty() {
        s.push_str("\t\t# its sources name no node: nothing is accepted\n");
        return RuleBlock { sets: Arc::from(""), lines: s.into(), parted: Default::default() };
    }
    let mut sets = String::new();
    let mut declared = String::new();
    let mut parts: Vec<String> = vec![String::new(); WIREGUARD_PARTS];
    let mut bytes = 0;
    let mut family = |fam: &str, kind: &str, l4: &str, addrs: Vec<(String, u32)>| {
        let set = format!("src_{}_{}_{}", r.module, r.number, if fam == "ip" { "v4" } else { "v6" });
        let list: Vec<&str> = addrs.iter().map(|(a, _)| a.as_str()).collect();
        let list = list.join(", ");
        bytes += list.len();
        let _ = writeln!(sets, "\tset {set} {{\n\t\ttype {kind}\n\t\telements = {{ {list} }}\n\t}}");
        let _ = writeln!(declared, "\tset {set} {{\n\t\ttype {kind}\n\t}}");
        let mut of_part: Vec<Vec<&str>> = vec![Vec::new(); WIREGUARD_PARTS];
        for (a, i) in &addrs {
            of_part[usize::from(topo.kept.parts[*i as usize])].push(a);
        }
        for (i, list) in of_part.into_iter().enumerate().filter(|(_, l)| !l.is_empty()) {
            let _ = writeln!(parts[i], "add element {} {set} {{ {} }}", crate::ruleset::TABLE, list.join(", "));
        }
        let _ = write!(s, "\t\tiifname \"{iface}\" {fam} saddr @{set} ");
        match r.rule.proto {
            Proto::Icmp => {
                let _ = write!(s, "meta l4proto {l4}");
            }
            p => {
                let _ = write!(s, "{p} dport {{ {} }}", ports.join(", "));
            }
        }
        let _ = writeln!(s, " accept comment \"{comment}\"");
    };
    if !v4.is_empty() {
        family("ip", "ipv4_addr", "icmp", v4.iter().map(|(a, i)| (a.to_string(), *i)).collect());
    }
    if !v6.is_empty() {
        family("ip6", "ipv6_addr", "ipv6-icmp", v6.iter().map(|(a, i)| (a.to_string(), *i)).collect());
    }
    let parts = parts.into_iter().enumerate().filter(|(_, p)| !p.is_empty()).map(|(i, p)| (i as u8, Arc::from(p))).collect();
    RuleBlock { sets: sets.into(), lines: s.into(), parted: crate::plan::PartedSets { declared: declared.into(), parts, bytes } }
}
