//! What the compiler makes and the renderer reads: every node's plan (`NodePlan`, its peers,
//! the blocks it shares with other nodes, `NodeText`), the file resources, and the paths of the
//! files a bundle carries. Data only: the compiler (`compile`) makes them, with the texts that
//! `render` makes of them (`NodeText::new`, `PeerPlan::new`).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::decl::PublicKey;
use crate::text::Text;

/// The files the compiler makes for every node, relative to the agent's root.
pub const WIREGUARD_CONF: &str = "etc/trellis/wireguard.conf";
pub const NFTABLES_CONF: &str = "etc/trellis/nftables.conf";
pub const MESH_ZONE: &str = "etc/trellis/mesh.zone";
pub const NODE_TOML: &str = "etc/trellis/node.toml";
/// Where a node with more than [`PARTS_FROM`] peers has them (ADR 0039): `wireguard.conf` keeps
/// the interface, and each peer's section is in the part its name hashes to, one of
/// [`WIREGUARD_PARTS`] files `peers-00.conf` .. `peers-63.conf`, so that a change of one peer
/// rewrites the part that holds it, not every peer's.
pub const WIREGUARD_DIR: &str = "etc/trellis/wireguard.d";
pub const WIREGUARD_PARTS: usize = 64;
pub const PARTS_FROM: usize = 256;
/// Where a node whose zone's records take more than [`ZONE_PARTS_FROM`] bytes has them (ADR
/// 0043): `mesh.zone` keeps the SOA, the NS and the routes' hosts, and each node's records, and a
/// module's records of each node that runs it, are in the part the node's name hashes to (as
/// its peer is, [`part_of`]), one of `names-00.zone` .. `names-63.zone`. The zone served is
/// `mesh.zone` and its parts in order, one after the other.
pub const ZONE_DIR: &str = "etc/trellis/zone.d";
/// Where a node whose filter's sources take more than [`RULESET_PARTS_FROM`] bytes has them
/// (ADR 0044): `nftables.conf` declares the sets (and holds the routes' sets whole), and each
/// source's address is added to its set in the part its node's name hashes to ([`part_of`]), by
/// an `add element` line, one of `sources-00.nft` .. `sources-63.nft`. The ruleset loaded is
/// `nftables.conf` and its parts in order, one after the other, in one transaction.
pub const NFTABLES_DIR: &str = "etc/trellis/nftables.d";
/// From how many bytes of its rules' sources' addresses a node's ruleset is in parts.
pub const RULESET_PARTS_FROM: usize = 64 * 1024;
/// From how many bytes of records a node's zone is in parts: a smaller zone costs less to write
/// whole than its parts cost to hold (at 100,000 nodes, 30,000 nodes name more than 256 nodes,
/// with zones of 16 to 64 KiB; twenty name more than 1,024, each a zone of megabytes).
pub const ZONE_PARTS_FROM: usize = 64 * 1024;
/// The mesh CA and the node's certificate, added to each bundle (`bundle::assemble`) beside the
/// compiled files.
pub const CA_PEM: &str = "etc/trellis/ca.pem";
pub const NODE_PEM: &str = "etc/trellis/node.pem";
/// An ingress node's Traefik dynamic configuration (file provider) and the settings its static
/// configuration is made from (ADR 0026); only ingress nodes receive them.
pub const TRAEFIK_YML: &str = "etc/trellis/traefik/trellis.yml";
pub const INGRESS_TOML: &str = "etc/trellis/ingress.toml";
/// The directory Traefik's file provider watches.
pub const TRAEFIK_DIR: &str = "etc/trellis/traefik";
/// What the node trusts beyond the CA (`trust::TrustFile`: its controllers, the next signing
/// key), added to each bundle by `bundle::assemble`.
pub const TRUST_TOML: &str = "etc/trellis/trust.toml";
/// The relayed peers a node may reach directly, at the endpoints their hub observed
/// (`paths::write`; ADR 0032), added to a bundle by `bundle::assemble` when there are any.
pub const PATHS_TOML: &str = "etc/trellis/paths.toml";
/// Every file a bundle may carry; an agent writes nothing else.
pub const DELIVERED: &[&str] =
    &[WIREGUARD_CONF, NFTABLES_CONF, MESH_ZONE, NODE_TOML, CA_PEM, NODE_PEM, TRAEFIK_YML, INGRESS_TOML, TRUST_TOML, PATHS_TOML];

/// The delivered file `path` names (one of [`DELIVERED`], a part of the peers or of the zone),
/// if it names one.
pub fn delivered(path: &str) -> Option<&'static str> {
    DELIVERED
        .iter()
        .copied()
        .find(|p| *p == path)
        .or_else(|| part_index(path).map(wireguard_part))
        .or_else(|| zone_part_index(path).map(zone_part))
        .or_else(|| ruleset_part_index(path).map(ruleset_part))
}

/// The paths of a kind of part, numbered 00 to 63 (`DIR/STEM-NN.EXT`), made once.
fn numbered(dir: &str, stem: &str, ext: &str) -> Vec<&'static str> {
    (0..WIREGUARD_PARTS).map(|i| &*Box::leak(format!("{dir}/{stem}-{i:02}.{ext}").into_boxed_str())).collect()
}

/// Which of the parts `DIR/STEM-NN.EXT` `path` is, if it is one: two digits, below
/// [`WIREGUARD_PARTS`], nothing else.
fn numbered_index(path: &str, dir: &str, stem: &str, ext: &str) -> Option<usize> {
    let n = path.strip_prefix(dir)?.strip_prefix('/')?.strip_prefix(stem)?.strip_prefix('-')?.strip_suffix(ext)?.strip_suffix('.')?;
    let i: usize = n.parse().ok().filter(|_| n.len() == 2 && n.bytes().all(|b| b.is_ascii_digit()))?;
    (i < WIREGUARD_PARTS).then_some(i)
}

/// The path of the part `i` (below [`WIREGUARD_PARTS`]) of a node's ruleset (ADR 0044).
pub fn ruleset_part(i: usize) -> &'static str {
    static PATHS: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| numbered(NFTABLES_DIR, "sources", "nft"));
    PATHS[i]
}

/// Which part of the ruleset `path` is, if it is one.
pub fn ruleset_part_index(path: &str) -> Option<usize> {
    numbered_index(path, NFTABLES_DIR, "sources", "nft")
}

/// Whether `path` holds part of a node's ruleset: `nftables.conf` or a part of it.
pub fn is_ruleset(path: &str) -> bool {
    path == NFTABLES_CONF || ruleset_part_index(path).is_some()
}

/// The path of the part `i` (below [`WIREGUARD_PARTS`]) of a node's zone (ADR 0043).
pub fn zone_part(i: usize) -> &'static str {
    static PATHS: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| numbered(ZONE_DIR, "names", "zone"));
    PATHS[i]
}

/// Which part of the zone `path` is, if it is one.
pub fn zone_part_index(path: &str) -> Option<usize> {
    numbered_index(path, ZONE_DIR, "names", "zone")
}

/// Whether `path` holds part of a node's zone: `mesh.zone` or a part of it.
pub fn is_zone(path: &str) -> bool {
    path == MESH_ZONE || zone_part_index(path).is_some()
}

/// The path of the part `i` (below [`WIREGUARD_PARTS`]) of a node's peers.
pub fn wireguard_part(i: usize) -> &'static str {
    static PATHS: std::sync::LazyLock<Vec<&'static str>> = std::sync::LazyLock::new(|| numbered(WIREGUARD_DIR, "peers", "conf"));
    PATHS[i]
}

/// Which part of the peers `path` is, if it is one.
pub fn part_index(path: &str) -> Option<usize> {
    numbered_index(path, WIREGUARD_DIR, "peers", "conf")
}

/// Whether `path` is a part of a node's peers.
pub fn is_part(path: &str) -> bool {
    part_index(path).is_some()
}

/// Whether `path` holds part of a node's WireGuard configuration: `wireguard.conf` or a part.
pub fn is_wireguard(path: &str) -> bool {
    path == WIREGUARD_CONF || is_part(path)
}

/// The part of the peers a node of this name is in: FNV-1a of the name, so every node and every
/// compile puts it in the same one, whatever else the mesh holds.
pub fn part_of(name: &str) -> u8 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (h % WIREGUARD_PARTS as u64) as u8
}

/// One file to write on a node, relative to the agent's root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileResource {
    pub path: String,
    pub mode: u32,
    pub content: Text,
}

/// Everything that decides one node's files. Two equal plans render to equal files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodePlan {
    pub node: Arc<str>,
    pub common: Arc<Common>,
    pub hub: bool,
    pub ipv4: Option<std::net::Ipv4Addr>,
    pub ipv6: Option<std::net::Ipv6Addr>,
    pub peers: Vec<PeerPlan>,
    /// Nodes this one has traffic with whose key is not known yet.
    pub left_out: Vec<Arc<str>>,
    /// Nodes this one has traffic with but no path to.
    pub no_path: Vec<Arc<str>>,
    /// Pre-rendered filter blocks of the rules of the modules this node runs.
    pub rules: Vec<Arc<RuleBlock>>,
    /// The names this node may resolve: itself and every node it has allowed traffic with
    /// (either direction), in name order; then `zone_modules`. Nothing else: other names are
    /// NXDOMAIN.
    pub zone: Vec<Arc<NodeText>>,
    /// The modules this node may reach, in name order, each answering with every node that runs
    /// it; shared by every node that reaches the module.
    pub zone_modules: Vec<Arc<ZoneBlock>>,
    /// The routes this node routes for (it is in their `via`): its forward filter and
    /// masquerading.
    pub routes_for: Vec<Arc<RouteBlock>>,
    /// The routes this node uses that have a router it can reach: their prefixes are sent into
    /// the overlay (an exit's default prefixes by policy routing).
    pub routed: Vec<Arc<RouteUse>>,
    /// The names of hosts on the routes this node uses.
    pub zone_routes: Vec<Arc<ZoneBlock>>,
    /// The exposures this node is an ingress of, in declaration order (empty on every other node).
    pub ingress: Vec<ExposurePlan>,
    /// The ACME directory and contact, when one of `ingress` takes certificates from it.
    pub acme: Option<(String, Option<String>)>,
}

/// An exposure as one of its ingress nodes serves it: its routers, entry point, allow-list and
/// backends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExposurePlan {
    pub name: Arc<str>,
    pub hostnames: Vec<String>,
    pub listen: u16,
    pub tls: crate::decl::ExposeTls,
    pub sources: Vec<ipnet::IpNet>,
    /// The port on the runners.
    pub port: u16,
    /// The runners that hold keys, in name order, at their overlay address (IPv4 when they have
    /// one).
    pub backends: Vec<(Arc<str>, std::net::IpAddr)>,
}

/// A rule as the `nftables.conf` of the nodes that run its module holds it, rendered once per
/// compile and shared by those nodes: the named sets of its sources, declared in the table, and
/// its lines in the input chain, which match on those sets. A source that comes or goes changes
/// only its set's elements, which the agent adds or deletes without loading the table again.
#[derive(Debug, PartialEq, Eq, Hash)]
pub struct RuleBlock {
    /// The declarations of its sets (`src_MODULE_RULE_v4`, `_v6`), each with its elements.
    pub sets: Arc<str>,
    /// Its comment and filter lines.
    pub lines: Arc<str>,
    /// For a ruleset in parts (ADR 0044): its sets declared without elements, and the
    /// `add element` lines of each part (the addresses of the sources whose names hash to it).
    pub parted: PartedSets,
}

/// A rule's sets as a ruleset in parts holds them (ADR 0044).
#[derive(Debug, Default, PartialEq, Eq, Hash)]
pub struct PartedSets {
    /// The sets declared, without elements.
    pub declared: Arc<str>,
    /// By part, in part order, only parts with lines: `add element inet trellis SET { .. }`.
    pub parts: ZoneParts,
    /// How many bytes the sets' elements take (what decides whether a ruleset is in parts).
    pub bytes: usize,
}

/// A route as the files of its routers hold it, rendered once per compile.
#[derive(Debug, PartialEq, Eq)]
pub struct RouteBlock {
    /// What its users' files hold of it.
    pub route: Arc<RouteUse>,
    /// The named sets of its rules' sources (`route_ROUTE_RULE_v4`, `_v6`) and of the sources it
    /// masquerades (`masq_ROUTE_v4`, `_v6`), declared in the table.
    pub sets: Arc<str>,
    /// The router's forward filter lines: each rule's sources to the prefixes.
    pub forward: Arc<str>,
    /// The router's masquerading lines (empty when the route does not masquerade).
    pub nat: Arc<str>,
}

/// A route as the files of its users hold it: what the route declares, not who uses it (so a
/// user's plan stays the same when other users come or go).
#[derive(Debug, PartialEq, Eq)]
pub struct RouteUse {
    pub name: Arc<str>,
    pub prefixes: Vec<ipnet::IpNet>,
    pub exit: bool,
    /// Its lines under the `[Peer]` section of the router a user sends it to: its name in a
    /// comment and its prefixes as one more `AllowedIPs` line.
    pub lines: Arc<str>,
}

/// A module's records in a zone, rendered once and shared by every node that may reach it.
#[derive(Debug, PartialEq, Eq)]
pub struct ZoneBlock {
    pub module: Arc<str>,
    /// The address records, one line each.
    pub records: Arc<str>,
    /// SHA-256 of `records`: a node's zone serial hashes these instead of the records.
    pub digest: [u8; 32],
    /// `records` by the part of the node each line is of (ADR 0043), for the zones in parts:
    /// (part, its lines), in part order, only the parts that have lines. Empty for the hosts of
    /// a route, which are no node's and stay in `mesh.zone`.
    pub parts: ZoneParts,
}

/// Lines of a zone by part (ADR 0043): (part, its lines), in part order, only parts with lines.
pub type ZoneParts = Box<[(u8, Arc<str>)]>;

/// A node as the files of other nodes name it, rendered once per compile: its name, its overlay
/// addresses as AllowedIPs entries, its zone records, and its `[Peer]` sections as others hold
/// them. Kept from one compile to the next while the node's name and addresses stay.
#[derive(Debug)]
pub struct NodeText {
    pub name: Arc<str>,
    pub ipv4: Option<std::net::Ipv4Addr>,
    pub ipv6: Option<std::net::Ipv6Addr>,
    /// `10.88.0.1/32, fd88::1/128`: empty when it has no overlay address.
    pub allowed: String,
    /// Its address records in a zone, one line each.
    pub records: Arc<str>,
    /// The start of SHA-256 of `records`: a zone's serial hashes these instead of the records.
    pub records_hash: [u8; 8],
    /// Its lines under the `[Peer]` section of a hub that relays for it: its name in a comment
    /// and its addresses as one more `AllowedIPs` line.
    pub relay_lines: Arc<str>,
    /// The part of the peers its section is in, on a node that has them in parts (`part_of`).
    pub part: u8,
    /// Its `[Peer]` sections made so far (`NodeText::peer_block`), by how a peer has it (key,
    /// endpoint, keepalive): most nodes are held the same way by every node that peers with them.
    /// The newest few are kept.
    pub(crate) blocks: std::sync::Mutex<Vec<(PeerWay, Arc<str>)>>,
}

/// How a node is held as a peer, what the head of its `[Peer]` section depends on: key,
/// endpoint, keepalive, and whether it relays for the holder.
pub(crate) type PeerWay = (PublicKey, Option<SocketAddr>, bool, bool);

impl PartialEq for NodeText {
    fn eq(&self, other: &NodeText) -> bool {
        (&self.name, self.ipv4, self.ipv6, &self.allowed, &self.records)
            == (&other.name, other.ipv4, other.ipv6, &other.allowed, &other.records)
    }
}

impl Eq for NodeText {}

/// What every node of the mesh shares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Common {
    pub mesh: String,
    pub interface: String,
    pub port: u16,
    pub mtu: u16,
    pub ipv4_prefix: u8,
    pub ipv6_prefix: u8,
    /// The overlay's prefixes: every node's filter keeps what is addressed to them, or claims to
    /// come from them, to the overlay interface.
    pub overlay_ipv4: Option<ipnet::Ipv4Net>,
    pub overlay_ipv6: Option<ipnet::Ipv6Net>,
    /// The DNS zone's name (the mesh domain).
    pub domain: String,
}

/// One peer in a node's `wireguard.conf`: who it is, whom it relays for, the head of its section
/// and the routes sent to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerPlan {
    /// The peer; its addresses are the first AllowedIPs.
    pub node: Arc<NodeText>,
    /// Nodes whose traffic this peer relays (it is a hub): their addresses are routed to it too.
    pub relays_for: Vec<Arc<NodeText>>,
    /// The head of its `[Peer]` section of `wireguard.conf`: its key, the endpoint this node
    /// dials (if it dials it) and whether it keeps the path open (it dials a peer that cannot
    /// dial back), made by `PeerPlan::new` and shared with every node that holds this peer the
    /// same way. The `relay_lines` of the nodes in `relays_for` follow it. Two plans of a peer
    /// with the same head hold it the same way.
    pub block: Arc<str>,
    /// The routes this node sends to this peer (it is their chosen router): their `lines`
    /// follow the relay lines.
    pub routes: Vec<Arc<RouteUse>>,
    /// `node.part`, held here too: the peers of one part are found by a walk of the plan alone,
    /// not of every peer's text (at 100,000 peers, each a read elsewhere in memory).
    pub part: u8,
}

impl PeerPlan {
    pub fn name(&self) -> &str {
        &self.node.name
    }

    /// The endpoint this node dials the peer at, as its section says.
    pub fn endpoint(&self) -> Option<SocketAddr> {
        self.block.lines().find_map(|l| l.strip_prefix("Endpoint = ")).and_then(|e| e.parse().ok())
    }

    /// Whether this node keeps the path to the peer open, as its section says.
    pub fn keepalive(&self) -> bool {
        self.block.lines().any(|l| l.starts_with("PersistentKeepalive = "))
    }

    /// The overlay addresses routed to this peer: its own, then those of the nodes it relays for.
    pub fn allowed(&self) -> Vec<std::net::IpAddr> {
        std::iter::once(&self.node)
            .chain(self.relays_for.iter())
            .flat_map(|t| t.ipv4.map(std::net::IpAddr::V4).into_iter().chain(t.ipv6.map(std::net::IpAddr::V6)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    /// The parts of the peers and of the zone are delivered by their exact names, numbered 00 to
    /// 63; anything else under their directories, or another spelling, is not a file trellis
    /// delivers (the verifier refuses a bundle naming it, the writer never writes it).
    #[test]
    fn the_parts_delivered_are_the_numbered_ones_and_no_other_name() {
        use super::*;
        for i in [0, 7, WIREGUARD_PARTS - 1] {
            assert_eq!(delivered(wireguard_part(i)), Some(wireguard_part(i)));
            assert_eq!(delivered(zone_part(i)), Some(zone_part(i)));
            assert_eq!(zone_part_index(zone_part(i)), Some(i));
            assert!(is_zone(zone_part(i)) && !is_wireguard(zone_part(i)) && !is_zone(wireguard_part(i)));
        }
        for bad in [
            "etc/trellis/zone.d/names-64.zone",
            "etc/trellis/zone.d/names-7.zone",
            "etc/trellis/zone.d/names-007.zone",
            "etc/trellis/zone.d/names-+1.zone",
            "etc/trellis/zone.d/names-00.conf",
            "etc/trellis/zone.d/../mesh.zone",
            "etc/trellis/zone.d/x",
            "etc/trellis/wireguard.d/names-00.zone",
            "etc/trellis/zone.d/peers-00.conf",
        ] {
            assert_eq!(delivered(bad), None, "{bad}");
        }
        assert_eq!(zone_part(12), "etc/trellis/zone.d/names-12.zone");
        assert_eq!(ruleset_part(5), "etc/trellis/nftables.d/sources-05.nft");
        assert_eq!(delivered(ruleset_part(63)), Some(ruleset_part(63)));
        assert_eq!(ruleset_part_index(ruleset_part(17)), Some(17));
        assert!(is_ruleset(ruleset_part(0)) && !is_zone(ruleset_part(0)));
        for bad in ["etc/trellis/nftables.d/sources-64.nft", "etc/trellis/nftables.d/sources-1.nft", "etc/trellis/nftables.d/x.nft"] {
            assert_eq!(delivered(bad), None, "{bad}");
        }
    }
}
