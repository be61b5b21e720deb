//! `wireguard.conf` and the parts of its peers (ADR 0039), and the texts a peer is written with,
//! made once and shared by every file that holds it.

use std::fmt::Write;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::{ends_run, zone_records};
use crate::decl::{PublicKey, KEEPALIVE_SECS};
use crate::plan::{wireguard_part, FileResource, NodePlan, NodeText, PeerPlan, PARTS_FROM, WIREGUARD_CONF, WIREGUARD_DIR, WIREGUARD_PARTS};
use crate::text::{Runs, Text, TextBuilder};

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
