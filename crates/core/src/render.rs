//! Rendering plans into the files a node receives: `wireguard.conf` (wg-quick format without
//! `PrivateKey`), `nftables.conf` (one `table inet trellis`, replaced atomically by `nft -f`) and
//! `mesh.zone` (a master file for the mesh domain holding only the names the node may reach);
//! and the texts plans share, made once (`NodeText::new`, `NodeText::peer_block`, `PeerPlan::new`).

use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::decl::{Proto, PublicKey, KEEPALIVE_SECS, NAMESERVER};
use crate::nodefile::{Comments, NodeFile};
use crate::plan::{
    wireguard_part, zone_part, FileResource, NodePlan, NodeText, PeerPlan, RouteBlock, RouteUse, RuleBlock, INGRESS_TOML, MESH_ZONE,
    NFTABLES_CONF, NODE_TOML, PARTS_FROM, TRAEFIK_YML, WIREGUARD_CONF, WIREGUARD_DIR, WIREGUARD_PARTS, ZONE_DIR,
};
use crate::text::{Runs, Text, TextBuilder};
use crate::topology::{ResolvedRoute, ResolvedRule, Topology};

/// The files of `plan`, given the node's previous plan and files if there are any: a file whose
/// inputs are the same as before is kept, the others are made.
pub fn files(plan: &NodePlan, prior: Option<(&NodePlan, &[FileResource])>) -> Vec<FileResource> {
    let prior_file = |path: &str| prior.and_then(|(_, files)| files.iter().find(|f| f.path == path)).map(|f| &f.content);
    // A file is kept when the previous plan gave the same inputs to it.
    let kept = |path: &str, same: fn(&NodePlan, &NodePlan) -> bool| {
        prior.filter(|(q, _)| plan.node == q.node && plan.common == q.common && same(plan, q)).and_then(|_| prior_file(path).cloned())
    };
    let wireguard_same: fn(&NodePlan, &NodePlan) -> bool =
        |p, q| (p.ipv4, p.ipv6, &p.peers, &p.left_out, &p.no_path) == (q.ipv4, q.ipv6, &q.peers, &q.left_out, &q.no_path);
    let nftables_same: fn(&NodePlan, &NodePlan) -> bool = |p, q| (&p.rules, &p.routes_for) == (&q.rules, &q.routes_for);
    let zone_same: fn(&NodePlan, &NodePlan) -> bool =
        |p, q| (&p.zone, &p.zone_modules, &p.zone_routes) == (&q.zone, &q.zone_modules, &q.zone_routes);
    let toml_same: fn(&NodePlan, &NodePlan) -> bool = |p, q| (p.hub, &p.routes_for, &p.routed) == (q.hub, &q.routes_for, &q.routed);
    let file = |path: &str, mode: u32, content: Text| FileResource { path: path.into(), mode, content };
    let ingress_same: fn(&NodePlan, &NodePlan) -> bool = |p, q| (&p.ingress, &p.acme) == (&q.ingress, &q.acme);
    // The WireGuard files are kept together: `wireguard.conf` and its parts, if it has them.
    let kept_wireguard = prior.filter(|(q, _)| plan.node == q.node && plan.common == q.common && wireguard_same(plan, q));
    let mut files: Vec<FileResource> = match kept_wireguard {
        Some((_, before)) => before.iter().filter(|f| crate::plan::is_wireguard(&f.path)).cloned().collect(),
        None => wireguard_files(plan, prior_file),
    };
    // The parts of the peers go last, where a recompile of the peers alone puts them (`rekey`).
    let parts = files.split_off(1);
    // The ruleset's files are kept together: `nftables.conf` and its parts, if it has them.
    match prior.filter(|(q, _)| plan.node == q.node && plan.common == q.common && nftables_same(plan, q)) {
        Some((_, before)) => files.extend(before.iter().filter(|f| crate::plan::is_ruleset(&f.path)).cloned()),
        None => files.extend(nftables_files(plan)),
    }
    // The zone's files are kept together too: `mesh.zone` and its parts, if it has them.
    match prior.filter(|(q, _)| plan.node == q.node && plan.common == q.common && zone_same(plan, q)) {
        Some((_, before)) => files.extend(before.iter().filter(|f| crate::plan::is_zone(&f.path)).cloned()),
        None => files.extend(zone_files(plan, prior_file)),
    }
    files.push(file(NODE_TOML, 0o644, kept(NODE_TOML, toml_same).unwrap_or_else(|| node_toml(plan).into())));
    // Only an ingress node has Traefik's files (ADR 0026).
    if !plan.ingress.is_empty() {
        let ingress = || crate::traefik::IngressFile::of(plan).write().into();
        files.push(file(INGRESS_TOML, 0o644, kept(INGRESS_TOML, ingress_same).unwrap_or_else(ingress)));
        files.push(file(TRAEFIK_YML, 0o644, kept(TRAEFIK_YML, ingress_same).unwrap_or_else(|| crate::traefik::dynamic(plan).into())));
    }
    files.extend(parts);
    files
}

/// What the agent needs to know about its own node beyond the three files: the interface, the
/// zone's name, and whether it relays for others (a hub forwards between overlay peers).
/// A router also says so (it forwards from the overlay to its routes), and a node that uses
/// routes lists the prefixes it sends into the overlay and whether it uses an exit.
pub fn node_toml(plan: &NodePlan) -> String {
    let c = &plan.common;
    let file = NodeFile {
        node: plan.node.to_string(),
        mesh: c.mesh.clone(),
        interface: c.interface.clone(),
        zone: c.domain.clone(),
        hub: plan.hub,
        router: !plan.routes_for.is_empty(),
        routes: plan.routed.iter().filter(|r| !r.exit).flat_map(|r| r.prefixes.iter().copied()).collect(),
        exit: plan.routed.iter().any(|r| r.exit),
    };
    let comments = Comments {
        forwards_to: plan.routes_for.iter().map(|r| &*r.route.name).collect(),
        exit_through: plan.routed.iter().find(|r| r.exit).map(|r| &*r.name),
    };
    file.write(&comments)
}

/// A node's WireGuard configuration: `wireguard.conf`, and when it has more than `PARTS_FROM`
/// peers the parts that hold them (ADR 0039), each made again from the same file of `before`
/// (the node's files before, by path). A peer that relays for no one is written the same way in
/// every file that has it the same way (key, endpoint, keepalive), so that text is made once and
/// shared (`NodeText::peer_block`).
///
/// The peers' sections are held in runs (`text::Chunk`) that end at peers, and at nodes a hub
/// relays for, picked by their address in memory, about one in 64: a file made again with its
/// text before takes from it every run whose peers and sections are the same, so that one peer
/// more or less in a list of ten thousand costs a run, not ten thousand references.
pub fn wireguard_files<'b>(plan: &NodePlan, before: impl Fn(&str) -> Option<&'b Text>) -> Vec<FileResource> {
    wireguard_files_changed(plan, before, None, None)
}

/// [`wireguard_files`] for a plan that has its peers in parts and had them in `before`, where
/// only the parts of `changed` (bit `i` for part `i`) may hold other peers than before: every
/// other part is the file of `before` (or, without one, still empty), not made again. A node of
/// a hundred thousand peers with one changed writes one part, not all of them. `None` makes
/// every part.
///
/// `relays_changed`, when given, promises that every hub relays for the same nodes as in
/// `before`, in the same order, but for the nodes it names, which may have joined or
/// left a hub's section (a re-key: the paths are the same, only keys came or went): the runs of
/// a long section without them are then taken from `before` by their first and last lines.
pub fn wireguard_files_changed<'b>(
    plan: &NodePlan,
    before: impl Fn(&str) -> Option<&'b Text>,
    changed: Option<u64>,
    relays_changed: Option<&[Arc<str>]>,
) -> Vec<FileResource> {
    const { assert!(WIREGUARD_PARTS <= 64, "a part is a bit of `changed`") };
    let made = |i: usize| changed.is_none_or(|m| m >> i & 1 == 1);
    let c = &plan.common;
    // With parts, `wireguard.conf` holds the interface and a few comments only.
    let parted = plan.peers.len() > PARTS_FROM;
    let mut s = TextBuilder::with_capacity(if parted { 4 } else { plan.peers.len() + 2 }, 256);
    let _ = writeln!(s, "# trellis: WireGuard overlay of node {} in mesh {}. Generated; do not edit.", plan.node, c.mesh);
    s.push_str("# The agent adds the PrivateKey it holds; the controller never sees it.\n");
    s.push_str("[Interface]\n");
    let mut addrs = Vec::new();
    if let Some(a) = plan.ipv4 {
        addrs.push(format!("{a}/{}", c.ipv4_prefix));
    }
    if let Some(a) = plan.ipv6 {
        addrs.push(format!("{a}/{}", c.ipv6_prefix));
    }
    let _ = writeln!(s, "Address = {}", addrs.join(", "));
    let _ = writeln!(s, "ListenPort = {}", c.port);
    let _ = writeln!(s, "MTU = {}", c.mtu);
    let mut parts = Vec::new();
    if parted {
        let _ = writeln!(s, "\n# {} peers, in {WIREGUARD_DIR}/peers-NN.conf: each in the part its name hashes to.", plan.peers.len());
        let mut of_part: Vec<Vec<&PeerPlan>> = vec![Vec::new(); WIREGUARD_PARTS];
        for p in plan.peers.iter().filter(|p| made(usize::from(p.part))) {
            of_part[usize::from(p.part)].push(p);
        }
        for (i, peers) in of_part.into_iter().enumerate() {
            let path = wireguard_part(i);
            if !made(i) {
                parts.extend(before(path).map(|t| FileResource { path: path.into(), mode: 0o600, content: t.clone() }));
                continue;
            }
            if peers.is_empty() {
                continue;
            }
            let mut t = TextBuilder::with_capacity(peers.len() + 1, 128);
            let _ = writeln!(t, "# trellis: peers of node {} in mesh {}, part {i:02}. Generated; do not edit.", plan.node, c.mesh);
            peer_sections(&mut t, peers.into_iter(), before(path), relays_changed);
            parts.push(FileResource { path: path.into(), mode: 0o600, content: t.finish() });
        }
    } else {
        peer_sections(&mut s, plan.peers.iter(), before(WIREGUARD_CONF), relays_changed);
    }
    if !plan.left_out.is_empty() {
        let names: Vec<&str> = plan.left_out.iter().map(|n| &**n).collect();
        let _ = writeln!(s, "\n# Left out until they enrol (no public key yet): {}", names.join(", "));
    }
    if !plan.no_path.is_empty() {
        let names: Vec<&str> = plan.no_path.iter().map(|n| &**n).collect();
        let _ = writeln!(s, "\n# No path (see `trellis explain`): {}", names.join(", "));
    }
    let mut files = vec![FileResource { path: WIREGUARD_CONF.into(), mode: 0o600, content: s.finish() }];
    files.extend(parts);
    files
}

/// The `[Peer]` sections of `peers`, in runs, taking from `before` every run that is the same.
/// With `relays_changed` (`wireguard_files_changed`), a run of `before` is taken for the next
/// lines of a hub's section when it starts and ends with the same lines as they, and holds no
/// more lines than come before the next changed node's, without reading the lines between: an
/// operator's hub section of 100,000 relayed nodes with one more costs its runs, not its lines.
/// That is the same text because each relay line is in one section of a file (one path, one
/// hub), the section is in name order, and only the changed nodes joined or left it: the run
/// before holds the same nodes between its ends, less those that left, and if any had left it
/// would be longer than the lines now between the same ends.
fn peer_sections<'p>(
    s: &mut TextBuilder,
    peers: impl Iterator<Item = &'p PeerPlan>,
    before: Option<&Text>,
    relays_changed: Option<&[Arc<str>]>,
) {
    let mut before = Runs::of(before);
    let mut run: Vec<&Arc<str>> = Vec::with_capacity(256);
    let mut marks: Vec<usize> = Vec::new();
    for p in peers {
        // A block is never empty (it starts with the blank line before the section).
        run.push(&p.block);
        let relays = &p.relays_for;
        // Where the changed nodes' lines are in this section (a line that left is not found: the
        // run that held it is shorter, or ends elsewhere, so no run before matches it).
        let changed = relays_changed.filter(|_| relays.len() > SKIP_FROM);
        let skipping = changed.is_some();
        marks.clear();
        marks.extend(changed.into_iter().flatten().filter_map(|n| relays.binary_search_by(|t| (*t.name).cmp(n)).ok()));
        marks.sort_unstable();
        let mut i = 0;
        while i < relays.len() {
            if skipping && run.is_empty() {
                let clean = marks.iter().find(|&&m| m >= i).map_or(relays.len(), |&m| m) - i;
                if let Some(n) = s.push_same_run(&mut before, clean, |k| &relays[i + k].relay_lines) {
                    i += n;
                    continue;
                }
            }
            let r = &relays[i];
            run.push(&r.relay_lines);
            // A hub's section names every node it relays for (nearly every node, in an
            // operator's file at 100,000 nodes): cut like the peers, so that one node more behind
            // the hub costs a run, not the section.
            if ends_run(r) {
                s.push_run(&run, &mut before);
                run.clear();
            }
            i += 1;
        }
        for r in &p.routes {
            run.push(&r.lines);
        }
        if ends_run(&p.node) {
            s.push_run(&run, &mut before);
            run.clear();
        }
    }
    s.push_run(&run, &mut before);
}

/// From how many relay lines a hub's section is read by its runs (`peer_sections`).
const SKIP_FROM: usize = 256;

/// Whether a run of peers' sections, or of a zone's records, ends after this node: for about one
/// node in 64, the same as long as the node's text is held (a hash of its address).
fn ends_run(node: &Arc<NodeText>) -> bool {
    let at = Arc::as_ptr(node) as usize as u64;
    (at >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58 == 0
}

/// The head of one `[Peer]` section, with the blank line before it: `node` with `key`, dialled
/// at `endpoint` (kept open with `keepalive`). A hub that relays for the holder is followed by
/// the `relay_lines` of each node it relays for (one more `AllowedIPs` line each: WireGuard
/// adds up the lines of a peer), so a node joining behind a hub adds its lines and leaves the
/// rest of the section as it was.
pub fn peer_block(node: &NodeText, key: PublicKey, endpoint: Option<SocketAddr>, keepalive: bool, relays: bool) -> String {
    let mut s = String::with_capacity(256);
    s.push('\n');
    let how = match (endpoint, keepalive) {
        (Some(_), true) => "this node dials it and keeps the path open",
        (Some(_), false) => "either side dials",
        (None, _) => "it dials this node",
    };
    let _ = write!(s, "# {}: {how}", node.name);
    if relays {
        s.push_str("; relays for the nodes named below");
    }
    s.push('\n');
    s.push_str("[Peer]\n");
    let _ = writeln!(s, "PublicKey = {key}");
    if !node.allowed.is_empty() {
        let _ = writeln!(s, "AllowedIPs = {}", node.allowed);
    }
    if let Some(e) = endpoint {
        let _ = writeln!(s, "Endpoint = {e}");
    }
    if keepalive {
        let _ = writeln!(s, "PersistentKeepalive = {KEEPALIVE_SECS}");
    }
    s
}

/// A relayed node's lines in the `[Peer]` section of the hub that relays for it.
pub fn relay_lines(name: &str, allowed: &str) -> String {
    if allowed.is_empty() {
        return format!("# relays for {name}\n");
    }
    format!("# relays for {name}\nAllowedIPs = {allowed}\n")
}

/// How many ways of holding one node as a peer `NodeText` keeps.
const PEER_WAYS_KEPT: usize = 8;

impl NodeText {
    /// A node's text: its addresses as AllowedIPs entries, its zone records and its relay lines.
    pub fn new(name: Arc<str>, ipv4: Option<Ipv4Addr>, ipv6: Option<Ipv6Addr>) -> NodeText {
        let mut allowed = String::new();
        if let Some(a) = ipv4 {
            let _ = write!(allowed, "{a}/32");
        }
        if let Some(a) = ipv6 {
            let _ = write!(allowed, "{}{a}/128", if allowed.is_empty() { "" } else { ", " });
        }
        let records: Arc<str> = zone_records(std::iter::once((&*name, ipv4, ipv6))).into();
        let records_hash = Sha256::digest(records.as_bytes())[..8].try_into().expect("8 bytes");
        let relay_lines = relay_lines(&name, &allowed).into();
        NodeText {
            part: crate::plan::part_of(&name),
            name,
            ipv4,
            ipv6,
            allowed,
            records,
            records_hash,
            relay_lines,
            blocks: Default::default(),
        }
    }

    /// The head of this node's `[Peer]` section in the file of a node that has it with `key`,
    /// `endpoint` and `keepalive`, relaying through it or not (`peer_block`), made once.
    pub fn peer_block(self: &Arc<NodeText>, key: PublicKey, endpoint: Option<SocketAddr>, keepalive: bool, relays: bool) -> Arc<str> {
        let way = (key, endpoint, keepalive, relays);
        let mut blocks = self.blocks.lock().expect("peer blocks");
        if let Some((_, b)) = blocks.iter().find(|(w, _)| *w == way) {
            return b.clone();
        }
        let block: Arc<str> = peer_block(self, key, endpoint, keepalive, relays).into();
        if blocks.len() == PEER_WAYS_KEPT {
            blocks.remove(0);
        }
        blocks.push((way, block.clone()));
        block
    }
}

impl PeerPlan {
    /// `node` as a peer held with `key`, `endpoint` and `keepalive`, relaying for `relays_for`:
    /// its section's head is the one `NodeText::peer_block` made for that way.
    pub fn new(
        node: Arc<NodeText>,
        key: PublicKey,
        endpoint: Option<SocketAddr>,
        keepalive: bool,
        relays_for: Vec<Arc<NodeText>>,
    ) -> PeerPlan {
        let block = node.peer_block(key, endpoint, keepalive, !relays_for.is_empty());
        let part = node.part;
        PeerPlan { node, relays_for, block, routes: Vec::new(), part }
    }
}

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

/// Address records of a route's named hosts.
pub fn host_records(hosts: &[crate::decl::RouteHost]) -> String {
    let mut records = String::new();
    for h in hosts {
        let kind = if h.address.is_ipv4() { "A" } else { "AAAA" };
        let _ = writeln!(records, "{}\tIN\t{kind}\t{}", h.name, h.address);
    }
    records
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
            of_part[usize::from(crate::plan::part_of(&topo.nodes[*i as usize].name))].push(a);
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

/// Address records, one line each, for names with their addresses.
pub fn zone_records<'n>(names: impl Iterator<Item = (&'n str, Option<Ipv4Addr>, Option<Ipv6Addr>)>) -> String {
    let mut records = String::new();
    for (name, v4, v6) in names {
        if let Some(a) = v4 {
            let _ = writeln!(records, "{name}\tIN\tA\t{a}");
        }
        if let Some(a) = v6 {
            let _ = writeln!(records, "{name}\tIN\tAAAA\t{a}");
        }
    }
    records
}

/// A node's zone: the names it may resolve (see `NodePlan::zone`) and nothing else, with its name
/// server `ns` at the node's own addresses. The serial written here is derived from the records
/// (the module blocks by their digests), so it changes when they do but does not rise: the
/// controller gives each bundle's zone the bundle's version as its serial (`with_serial`), which
/// rises whenever the bundle's content changes (ADR 0010); an offline compile keeps this one.
///
/// The names' records are the nodes' own (`NodeText::records`), held by reference in runs as
/// `wireguard` holds peers' sections: a zone made again with `before`, the node's zone before,
/// takes from it every run of the same names, and the zones of a mesh share the records instead
/// of copying them (at 100,000 nodes they name about 19 million nodes in all).
pub fn zone(plan: &NodePlan, before: Option<&Text>) -> Text {
    let mut s = zone_head(plan);
    let mut before = Runs::of(before);
    let mut run: Vec<&Arc<str>> = Vec::with_capacity(128);
    for z in &plan.zone {
        run.push(&z.records);
        if ends_run(z) {
            s.push_run(&run, &mut before);
            run.clear();
        }
    }
    s.push_run(&run, &mut before);
    for m in plan.zone_modules.iter().chain(&plan.zone_routes) {
        s.push_shared(&m.records);
    }
    s.finish()
}

/// Whether `plan`'s zone is in parts (ADR 0043): its records take more than
/// [`crate::plan::ZONE_PARTS_FROM`] bytes.
pub fn zone_parted(plan: &NodePlan) -> bool {
    let names: usize = plan.zone.iter().map(|z| z.records.len()).sum();
    let modules: usize = plan.zone_modules.iter().map(|m| m.records.len()).sum();
    names + modules > crate::plan::ZONE_PARTS_FROM
}

/// A node's zone files: `mesh.zone` as [`zone`] makes it, or, when its records take more than
/// [`crate::plan::ZONE_PARTS_FROM`] bytes, `mesh.zone` with the SOA, the NS and the routes' hosts, and the parts
/// (ADR 0043): each node's records, and a module's records of each node that runs it, in the
/// part the node's name hashes to (its peer's part), each part made again from the same path's
/// text in `before` (its runs taken over). `mesh.zone` and its parts in order, one after the
/// other, are the zone: the same records as the one file would hold, in another order.
pub fn zone_files<'b>(plan: &NodePlan, before: impl Fn(&str) -> Option<&'b Text>) -> Vec<FileResource> {
    let file = |path: &str, content: Text| FileResource { path: path.into(), mode: 0o644, content };
    if !zone_parted(plan) {
        return vec![file(MESH_ZONE, zone(plan, before(MESH_ZONE)))];
    }
    let mut s = zone_head(plan);
    let _ = writeln!(
        s,
        "; {} names, in {ZONE_DIR}/names-NN.zone by the part each hashes to: this file and its parts, one after the other, are the zone.",
        plan.zone.len()
    );
    for m in &plan.zone_routes {
        s.push_shared(&m.records);
    }
    let mut files = vec![file(MESH_ZONE, s.finish())];
    let mut names: Vec<Vec<&Arc<NodeText>>> = vec![Vec::new(); WIREGUARD_PARTS];
    for z in &plan.zone {
        names[usize::from(z.part)].push(z);
    }
    let mut modules: Vec<Vec<&Arc<str>>> = vec![Vec::new(); WIREGUARD_PARTS];
    for (i, records) in plan.zone_modules.iter().flat_map(|m| m.parts.iter()) {
        modules[usize::from(*i)].push(records);
    }
    for (i, (names, modules)) in names.into_iter().zip(modules).enumerate() {
        if names.is_empty() && modules.is_empty() {
            continue;
        }
        let path = zone_part(i);
        let mut t = TextBuilder::with_capacity(names.len() / 32 + modules.len() + 2, 128);
        let _ = writeln!(
            t,
            "; trellis: names of zone {} of mesh {} as node {} sees them, part {i:02}. Generated; do not edit.",
            plan.common.domain, plan.common.mesh, plan.node
        );
        let mut before = Runs::of(before(path));
        let mut run: Vec<&Arc<str>> = Vec::with_capacity(128);
        for z in names {
            run.push(&z.records);
            if ends_run(z) {
                t.push_run(&run, &mut before);
                run.clear();
            }
        }
        t.push_run(&run, &mut before);
        for records in modules {
            t.push_shared(records);
        }
        files.push(file(path, t.finish()));
    }
    files
}

/// The head of a node's zone: its comment, origin and TTL, the SOA with the serial derived from
/// the records, the NS and the name server's own addresses.
fn zone_head(plan: &NodePlan) -> TextBuilder {
    let domain = &plan.common.domain;
    let mut hash = Sha256::new();
    for z in &plan.zone {
        hash.update(z.records_hash);
    }
    for m in plan.zone_modules.iter().chain(&plan.zone_routes) {
        hash.update(m.digest);
    }
    let digest = hash.finalize();
    let serial = u32::from_be_bytes(digest[..4].try_into().expect("4 bytes")) & 0x7fff_ffff;
    let mut s = TextBuilder::with_capacity(plan.zone_modules.len() + 2, 512);
    let _ = writeln!(s, "; trellis: zone {domain} of mesh {} as node {} sees it. Generated; do not edit.", plan.common.mesh, plan.node);
    let _ = writeln!(s, "$ORIGIN {domain}.");
    s.push_str("$TTL 60\n");
    // A piece of its own, so that `with_serial` replaces it and shares the rest.
    s.push_shared(&Arc::from(soa(domain, serial)));
    let _ = writeln!(s, "@\tIN\tNS\t{NAMESERVER}.{domain}.");
    // The name server is the node's own resolver, which the agent serves on its overlay addresses.
    s.push_str(&zone_records(std::iter::once((NAMESERVER, plan.ipv4, plan.ipv6))));
    s
}

/// A module's address records, one line for each address of each node that runs it (`runners`:
/// name and addresses), and the same lines by the part of the runner's name (ADR 0043), in part
/// order, only the parts that have lines.
pub fn module_records<'n>(
    module: &str,
    runners: impl Iterator<Item = (&'n str, Option<Ipv4Addr>, Option<Ipv6Addr>)>,
) -> (String, crate::plan::ZoneParts) {
    let mut records = String::new();
    let mut parts: Vec<String> = vec![String::new(); WIREGUARD_PARTS];
    for (name, v4, v6) in runners {
        let lines = zone_records(std::iter::once((module, v4, v6)));
        parts[usize::from(crate::plan::part_of(name))].push_str(&lines);
        records.push_str(&lines);
    }
    let parts = parts.into_iter().enumerate().filter(|(_, p)| !p.is_empty()).map(|(i, p)| (i as u8, Arc::from(p))).collect();
    (records, parts)
}

/// The SOA record of a zone of `domain` with `serial`.
fn soa(domain: &str, serial: u32) -> String {
    format!("@\tIN\tSOA\t{NAMESERVER}.{domain}. hostmaster.{domain}. {serial} 3600 600 86400 60\n")
}

/// `zone` (as `zone` makes it) with the serial `serial` in its SOA record, sharing the rest.
pub fn with_serial(zone: &Text, serial: u32) -> Text {
    let soa_of = |p: &str| -> Option<String> {
        let rest = p.strip_prefix("@\tIN\tSOA\t")?.strip_suffix('\n')?;
        let f: Vec<&str> = rest.split(' ').collect();
        let domain = f.first()?.strip_prefix(&format!("{NAMESERVER}."))?.strip_suffix('.')?;
        (f.len() == 7 && !rest.contains('\n')).then(|| soa(domain, serial))
    };
    if let Some(text) = zone.replace_first(soa_of) {
        return text;
    }
    // A zone cut another way: line by line.
    let text = zone.to_string();
    let lines: Vec<String> = text.lines().map(|l| soa_of(&format!("{l}\n")).unwrap_or_else(|| format!("{l}\n"))).collect();
    Text::from(lines.concat())
}
