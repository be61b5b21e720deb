//! The declaration model: a validated mesh as the operator wrote it, with where each part was
//! written. Built only by [`crate::load`], so every name in it refers to something declared.

use std::fmt;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};

use ipnet::{Ipv4Net, Ipv6Net};

use crate::diag::Loc;

/// A whole mesh: `mesh.toml` plus the module manifests.
#[derive(Clone, Debug, PartialEq)]
pub struct Declaration {
    pub mesh: MeshSettings,
    pub networks: Vec<Network>,
    pub groups: Vec<Group>,
    /// Shared, so that a load taking nodes unchanged from the load before (ADR 0034), or a
    /// declaration with its pool members added, copies no node.
    pub nodes: Vec<std::sync::Arc<Node>>,
    pub modules: Vec<Module>,
    /// Prefixes beyond the overlay (a LAN, or the internet for an exit) reached through router
    /// nodes.
    pub routes: Vec<Route>,
    pub tests: Vec<PolicyTest>,
    pub pools: Vec<Pool>,
    /// `[acme]`: where ingress nodes get public certificates (ADR 0026).
    pub acme: Option<Acme>,
    /// `[[expose]]`: modules offered beyond the mesh through ingress nodes (ADR 0026).
    pub exposures: Vec<Exposure>,
}

/// `[acme]`: the ACME directory ingress nodes take public certificates from, and the account's
/// contact.
#[derive(Clone, Debug, PartialEq)]
pub struct Acme {
    pub directory: String,
    pub email: Option<String>,
    pub loc: Loc,
}

/// How an exposure's edge handles TLS.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ExposeTls {
    /// The edge terminates TLS with a certificate from `[acme]`.
    Acme,
    /// The edge routes TCP by SNI and the runner terminates TLS.
    Passthrough,
    /// Plain HTTP at the edge.
    None,
}

impl ExposeTls {
    pub fn parse(s: &str) -> Option<ExposeTls> {
        match s {
            "acme" => Some(ExposeTls::Acme),
            "passthrough" => Some(ExposeTls::Passthrough),
            "none" => Some(ExposeTls::None),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ExposeTls::Acme => "acme",
            ExposeTls::Passthrough => "passthrough",
            ExposeTls::None => "none",
        }
    }
}

impl fmt::Display for ExposeTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The port an exposure listens on when it names none.
pub const DEFAULT_LISTEN: u16 = 443;

/// An `[[expose]]`: a module's port offered to clients beyond the mesh under public host names,
/// through ingress nodes (`via`) that each run Traefik. The exposure is a rule source
/// (`expose:NAME`) that resolves to the ingress nodes: a rule of the module must admit it on the
/// port.
#[derive(Clone, Debug, PartialEq)]
pub struct Exposure {
    pub name: String,
    pub hostnames: Vec<String>,
    pub hostname_locs: Vec<Loc>,
    pub module: String,
    pub module_loc: Loc,
    /// The port on the runners.
    pub port: u16,
    pub via: Vec<String>,
    pub via_locs: Vec<Loc>,
    /// The port the ingress nodes listen on.
    pub listen: u16,
    pub tls: ExposeTls,
    pub tls_loc: Loc,
    /// The client addresses the edge admits.
    pub sources: Vec<ipnet::IpNet>,
    pub loc: Loc,
}

impl Exposure {
    /// Whether two exposures are the same but for where they are written.
    pub fn same(&self, other: &Exposure) -> bool {
        (&self.name, &self.hostnames, &self.module, self.port, &self.via, self.listen, self.tls, &self.sources)
            == (&other.name, &other.hostnames, &other.module, other.port, &other.via, other.listen, other.tls, &other.sources)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct MeshSettings {
    pub name: String,
    pub domain: String,
    pub overlay_ipv4: Option<Ipv4Net>,
    pub overlay_ipv6: Option<Ipv6Net>,
    pub port: u16,
    pub interface: String,
    pub mtu: u16,
    /// How long a service certificate is valid, in seconds (`service_cert_lifetime`).
    pub service_cert_secs: u64,
    /// The oldest agent release the controller serves (`min_agent_version`); older agents are
    /// refused by name.
    pub min_agent_version: Option<crate::release::Release>,
    pub loc: Loc,
}

/// A service certificate's lifetime when `[mesh]` names none: a day, as step-ca's leaves.
pub const DEFAULT_SERVICE_CERT_SECS: u64 = 86_400;
/// The shortest `service_cert_lifetime`: renewal at two thirds of it, with jitter, must leave
/// the agent room to ask again.
pub const MIN_SERVICE_CERT_SECS: u64 = 60;
/// The longest `service_cert_lifetime`: a short-lived identity, never a year-long one.
pub const MAX_SERVICE_CERT_SECS: u64 = 90 * 86_400;

pub const DEFAULT_PORT: u16 = 51820;
pub const DEFAULT_INTERFACE: &str = "trellis0";
pub const DEFAULT_MTU: u16 = 1420;
/// The name of every zone's name server (`ns.DOMAIN`), with the addresses of the node's own
/// resolver (the agent serves the zone on the node's overlay addresses). No node, module or
/// route host may take it.
pub const NAMESERVER: &str = "ns";

/// Seconds between keepalives sent by the side that dials.
pub const KEEPALIVE_SECS: u16 = 25;

#[derive(Clone, Debug, PartialEq)]
pub struct Network {
    pub name: String,
    /// `direct = false`: nodes on this network stay on their hub, never punched through it
    /// (a metered link, a policy; ADR 0032).
    pub direct: bool,
    pub loc: Loc,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub name: String,
    pub members: std::sync::Arc<[String]>,
    pub loc: Loc,
}

/// `Eq`, so that two declarations sharing a node (`Arc`) compare it by pointer first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub name: String,
    pub hub: bool,
    pub networks: Vec<String>,
    pub groups: Vec<String>,
    pub modules: Vec<String>,
    pub address_ipv4: Option<Ipv4Addr>,
    pub address_ipv6: Option<Ipv6Addr>,
    pub endpoints: Vec<Endpoint>,
    /// `direct = false`: its relayed pairs stay on their hub (ADR 0032). True by default.
    pub direct: bool,
    /// A WireGuard public key declared for a node managed outside trellis.
    pub public_key: Option<PublicKey>,
    /// The exit route (a route to a default prefix) this node sends its internet traffic
    /// through, with where it is written.
    pub exit: Option<(String, Loc)>,
    pub loc: Loc,
    /// Where each of `networks`, `groups` and `modules` is written, in the same order, so a
    /// diagnostic about one points at it.
    pub refs: NodeRefs,
    /// The pool this node is a member of: set only on the members the controller adds
    /// ([`Pool::member`]), never by a declaration file.
    pub pool: Option<String>,
}

impl Node {
    /// Every place in the node moved down by `lines` (a node table parsed as a file of its own,
    /// placed where it stands in `mesh.toml`), or up for a negative count.
    pub(crate) fn shift_lines(&mut self, lines: i64) {
        let all = std::iter::once(&mut self.loc)
            .chain(self.exit.iter_mut().map(|(_, l)| l))
            .chain(self.endpoints.iter_mut().map(|e| &mut e.loc))
            .chain(self.refs.networks.iter_mut())
            .chain(self.refs.groups.iter_mut())
            .chain(self.refs.modules.iter_mut());
        for loc in all {
            loc.line = u32::try_from(i64::from(loc.line) + lines).expect("a node's places stay in its file");
        }
    }
}

/// The places of a node's references.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeRefs {
    pub networks: Vec<Loc>,
    pub groups: Vec<Loc>,
    pub modules: Vec<Loc>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Endpoint {
    pub address: SocketAddr,
    pub reachable_from: Vec<String>,
    pub loc: Loc,
}

/// A WireGuard (X25519) public key.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublicKey(pub [u8; 32]);

impl PublicKey {
    /// Parses the base64 form WireGuard tools print: 44 characters, 32 bytes.
    pub fn parse(s: &str) -> Option<PublicKey> {
        use base64::Engine;
        let bytes = base64::engine::general_purpose::STANDARD.decode(s).ok()?;
        Some(PublicKey(bytes.try_into().ok()?))
    }
}

impl fmt::Display for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        use base64::Engine;
        f.write_str(&base64::engine::general_purpose::STANDARD.encode(self.0))
    }
}

impl fmt::Debug for PublicKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PublicKey({self})")
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Module {
    pub name: String,
    pub allow: Vec<Rule>,
    /// `[module.certificate]`: every node running the module holds a service certificate for it.
    pub certificate: Option<CertificateSpec>,
    pub loc: Loc,
}

/// What a module's `[module.certificate]` asks for: the group that may read the key (the files
/// are `root:GROUP`, the key 0640) and the systemd unit reloaded after a renewal.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CertificateSpec {
    pub group: Option<String>,
    pub reload: Option<String>,
}

/// Whether `s` is a plain name for a group or a systemd unit: 1-64 of letters, digits, `-`, `_`,
/// `.` and `@`, not starting with `-` or `.`, so that it is never read as an option or a path.
pub fn is_plain_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 64
        && !s.starts_with(['-', '.'])
        && s.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@'))
}

/// One allow rule of a module: traffic of `proto` to `ports` on every node running the
/// module, from the named sources.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub proto: Proto,
    pub ports: Vec<PortRange>,
    pub from: Vec<Source>,
    /// Where each source of `from` was written, for diagnostics.
    pub from_locs: Vec<Loc>,
    pub loc: Loc,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    Tcp,
    Udp,
    Icmp,
}

impl Proto {
    pub fn parse(s: &str) -> Option<Proto> {
        match s {
            "tcp" => Some(Proto::Tcp),
            "udp" => Some(Proto::Udp),
            "icmp" => Some(Proto::Icmp),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Icmp => "icmp",
        }
    }
}

impl fmt::Display for Proto {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An inclusive port range; a single port has `first == last`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PortRange {
    pub first: u16,
    pub last: u16,
}

impl PortRange {
    /// Parses `"5432"` or `"8000-8100"`. Port 0 is refused.
    pub fn parse(s: &str) -> Option<PortRange> {
        let port = |p: &str| -> Option<u16> {
            if p.is_empty() || !p.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            p.parse::<u16>().ok().filter(|&n| n > 0)
        };
        let (first, last) = match s.split_once('-') {
            Some((a, b)) => (port(a)?, port(b)?),
            None => (port(s)?, port(s)?),
        };
        (first <= last).then_some(PortRange { first, last })
    }

    pub fn contains(self, port: u16) -> bool {
        self.first <= port && port <= self.last
    }
}

impl fmt::Display for PortRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.first == self.last {
            write!(f, "{}", self.first)
        } else {
            write!(f, "{}-{}", self.first, self.last)
        }
    }
}

/// A route: prefixes beyond the overlay reached through router nodes (`via`, in order of
/// preference). A route whose prefixes include a default route is an exit, used only by nodes
/// that opt in with `exit = NAME`.
#[derive(Clone, Debug, PartialEq)]
pub struct Route {
    pub name: String,
    pub prefixes: Vec<ipnet::IpNet>,
    pub via: Vec<String>,
    /// Where each of `via` is written.
    pub via_locs: Vec<Loc>,
    /// Whether the router rewrites the source of forwarded traffic to its own address, so that
    /// hosts on the route need no route back to the overlay.
    pub masquerade: bool,
    pub allow: Vec<RouteRule>,
    pub hosts: Vec<RouteHost>,
    pub loc: Loc,
}

impl Route {
    /// Whether this route carries a default prefix (`0.0.0.0/0` or `::/0`): an exit.
    pub fn is_exit(&self) -> bool {
        self.prefixes.iter().any(|p| p.prefix_len() == 0)
    }
}

/// One allow rule of a route: traffic of `proto` (any protocol when `None`) to `ports` on the
/// route's prefixes, from the named sources.
#[derive(Clone, Debug, PartialEq)]
pub struct RouteRule {
    pub proto: Option<Proto>,
    pub ports: Vec<PortRange>,
    pub from: Vec<Source>,
    pub from_locs: Vec<Loc>,
    pub loc: Loc,
}

/// A name in the mesh zone for a host on a route that runs no agent (a printer, a NAS).
#[derive(Clone, Debug, PartialEq)]
pub struct RouteHost {
    pub name: String,
    pub address: std::net::IpAddr,
    pub loc: Loc,
}

/// A named source of traffic in a rule's `from`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Source {
    Node(String),
    Group(String),
    Module(String),
    /// Every live member of a pool.
    Pool(String),
    /// The ingress nodes of an exposure (`expose:NAME`).
    Expose(String),
    Mesh,
}

impl Source {
    pub fn parse(s: &str) -> Option<Source> {
        if s == "mesh" {
            return Some(Source::Mesh);
        }
        let (kind, name) = s.split_once(':')?;
        let name = name.to_string();
        match kind {
            "node" => Some(Source::Node(name)),
            "group" => Some(Source::Group(name)),
            "module" => Some(Source::Module(name)),
            "pool" => Some(Source::Pool(name)),
            "expose" => Some(Source::Expose(name)),
            _ => None,
        }
    }
}

impl fmt::Display for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Source::Node(n) => write!(f, "node:{n}"),
            Source::Group(n) => write!(f, "group:{n}"),
            Source::Module(n) => write!(f, "module:{n}"),
            Source::Pool(n) => write!(f, "pool:{n}"),
            Source::Expose(n) => write!(f, "expose:{n}"),
            Source::Mesh => f.write_str("mesh"),
        }
    }
}

/// What a policy test expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Expect {
    Allow,
    Deny,
}

impl Expect {
    pub fn as_str(self) -> &'static str {
        match self {
            Expect::Allow => "allow",
            Expect::Deny => "deny",
        }
    }
}

/// The target of a policy test: one node, or every node running a module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    Node(String),
    Module(String),
    /// A route: the node uses it for this protocol and port.
    Route(String),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Node(n) => write!(f, "node:{n}"),
            Target::Module(n) => write!(f, "module:{n}"),
            Target::Route(n) => write!(f, "route:{n}"),
        }
    }
}

/// A `[[test]]`: traffic from one node to a target that the policy must allow or deny.
#[derive(Clone, Debug, PartialEq)]
pub struct PolicyTest {
    pub from: String,
    pub to: Target,
    pub proto: Proto,
    pub port: Option<u16>,
    pub expect: Expect,
    pub loc: Loc,
}

impl Declaration {
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.nodes.iter().find(|n| n.name == name).map(|n| &**n)
    }

    pub fn module(&self, name: &str) -> Option<&Module> {
        self.modules.iter().find(|m| m.name == name)
    }

    pub fn route(&self, name: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.name == name)
    }

    pub fn pool(&self, name: &str) -> Option<&Pool> {
        self.pools.iter().find(|p| p.name == name)
    }

    pub fn exposure(&self, name: &str) -> Option<&Exposure> {
        self.exposures.iter().find(|e| e.name == name)
    }

    /// Whether the exposures and `[acme]` are the same as `other`'s but for where they are written.
    pub fn same_exposures(&self, other: &Declaration) -> bool {
        let acme = |a: &Option<Acme>| a.as_ref().map(|a| (a.directory.clone(), a.email.clone()));
        acme(&self.acme) == acme(&other.acme)
            && self.exposures.len() == other.exposures.len()
            && self.exposures.iter().zip(&other.exposures).all(|(a, b)| a.same(b))
    }

    /// The declaration with the live members of its pools added as nodes (`members` are names
    /// with their pool and pinned overlay addresses): what the controller compiles. A member whose
    /// pool is no longer declared, or whose name a declared node holds, is left out. Borrowed,
    /// not copied, when no member is added (at 100,000 nodes a copy is tens of milliseconds).
    pub fn with_members(&self, members: &[Member]) -> std::borrow::Cow<'_, Declaration> {
        let added: Vec<std::sync::Arc<Node>> = members
            .iter()
            .filter_map(|m| self.pool(&m.pool).filter(|_| self.node(&m.name).is_none()).map(|pool| std::sync::Arc::new(pool.member(m))))
            .collect();
        if added.is_empty() {
            return std::borrow::Cow::Borrowed(self);
        }
        let mut out = self.clone();
        out.nodes.extend(added);
        std::borrow::Cow::Owned(out)
    }
}

/// A shared declaration with its nodes by name and by declared WireGuard key. `Declaration::node`
/// reads the nodes in order, which a caller answering many requests against one declaration
/// cannot afford at a fleet's size (an enrolment read every node twice: at 100,000 nodes, a third
/// of an enrolment storm's time). The declaration is held behind an `Arc`, so it cannot change
/// under its index.
#[derive(Debug)]
pub struct Indexed {
    decl: std::sync::Arc<Declaration>,
    by_name: std::sync::Arc<crate::FastMap<Box<str>, u32>>,
    by_key: std::sync::Arc<crate::FastMap<PublicKey, u32>>,
}

impl Indexed {
    pub fn new(decl: std::sync::Arc<Declaration>) -> Indexed {
        let mut by_name = crate::FastMap::default();
        let mut by_key = crate::FastMap::default();
        // The first of a name or key wins, as `Declaration::node` and a search in order find it.
        for (i, n) in decl.nodes.iter().enumerate() {
            by_name.entry(n.name.as_str().into()).or_insert(i as u32);
            if let Some(k) = n.public_key {
                by_key.entry(k).or_insert(i as u32);
            }
        }
        Indexed { decl, by_name: by_name.into(), by_key: by_key.into() }
    }

    /// The index of `decl`, from `before`'s when every node stands where it stood there with the
    /// same name and declared key (a change of groups, modules or rules moves none; the load
    /// cache hands an unchanged node out as the same `Arc`): the maps are then the same, and
    /// shared rather than made again (at 100,000 nodes, 100,000 names). Else made whole.
    pub fn new_after(decl: std::sync::Arc<Declaration>, before: &Indexed) -> Indexed {
        let was = &before.decl.nodes;
        let same = decl.nodes.len() == was.len()
            && decl.nodes.iter().zip(was).all(|(a, b)| std::sync::Arc::ptr_eq(a, b) || (a.name == b.name && a.public_key == b.public_key));
        if !same {
            return Indexed::new(decl);
        }
        Indexed { decl, by_name: before.by_name.clone(), by_key: before.by_key.clone() }
    }

    /// Whether the two indexes share their maps (one was made from the other, not again).
    pub fn shares_maps_with(&self, other: &Indexed) -> bool {
        std::sync::Arc::ptr_eq(&self.by_name, &other.by_name) && std::sync::Arc::ptr_eq(&self.by_key, &other.by_key)
    }

    pub fn decl(&self) -> &std::sync::Arc<Declaration> {
        &self.decl
    }

    /// The node of this name (what `Declaration::node` finds).
    pub fn node(&self, name: &str) -> Option<&Node> {
        self.by_name.get(name).map(|&i| &*self.decl.nodes[i as usize])
    }

    /// The first node that declares `key` as its own (a node managed outside trellis).
    pub fn declared_holder(&self, key: &PublicKey) -> Option<&Node> {
        self.by_key.get(key).map(|&i| &*self.decl.nodes[i as usize])
    }
}

/// A `[[pool]]`: a template for short-lived nodes that enrol with a reusable token and are named
/// by the controller `NAME-1`, `NAME-2`, ... (the lowest free number, at most `size`).
#[derive(Clone, Debug, PartialEq)]
pub struct Pool {
    pub name: String,
    /// At most this many live members at once; members are numbered 1 to `size`.
    pub size: u32,
    pub networks: Vec<String>,
    pub groups: Vec<String>,
    pub modules: Vec<String>,
    /// Seconds without contact after which the controller removes a member.
    pub ephemeral_after: Option<u64>,
    pub loc: Loc,
    pub refs: NodeRefs,
}

/// A live member of a pool, as the controller records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub name: String,
    pub pool: String,
    pub address_ipv4: Option<Ipv4Addr>,
    pub address_ipv6: Option<Ipv6Addr>,
}

impl Pool {
    /// The name of member `n`.
    pub fn member_name(&self, n: u32) -> String {
        format!("{}-{n}", self.name)
    }

    /// The member number `name` would have in this pool (`ci-7` is 7 in `ci`), if it has the
    /// shape of a member's name: the pool's name, `-`, and digits without a leading zero.
    pub fn number_of(&self, name: &str) -> Option<u32> {
        let digits = name.strip_prefix(self.name.as_str())?.strip_prefix('-')?;
        if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        digits.parse().ok()
    }

    /// The lowest member number in 1..=size that `taken` does not hold; none when the pool is
    /// full.
    pub fn lowest_free(&self, taken: impl IntoIterator<Item = u32>) -> Option<u32> {
        let mut used = vec![false; self.size as usize + 1];
        for n in taken {
            if let Some(u) = used.get_mut(n as usize) {
                *u = true;
            }
        }
        (1..=self.size).find(|&n| !used[n as usize])
    }

    /// A member as a node: the pool's networks, groups and modules, no endpoint (it dials out),
    /// the addresses it was given at enrolment pinned, and the pool's place in the declaration.
    pub fn member(&self, m: &Member) -> Node {
        Node {
            name: m.name.clone(),
            hub: false,
            networks: self.networks.clone(),
            groups: self.groups.clone(),
            modules: self.modules.clone(),
            address_ipv4: m.address_ipv4,
            address_ipv6: m.address_ipv6,
            endpoints: Vec::new(),
            direct: true,
            public_key: None,
            exit: None,
            loc: self.loc.clone(),
            refs: self.refs.clone(),
            pool: Some(self.name.clone()),
        }
    }
}

/// A duration as declarations and the command line write it: digits and a unit, `s`, `m`, `h`
/// or `d` (`30s`, `10m`, `1h`, `7d`), in seconds; zero is refused.
pub fn duration_secs(s: &str) -> Option<u64> {
    let (num, unit) = s.split_at(s.find(|c: char| !c.is_ascii_digit())?);
    let n: u64 = num.parse().ok().filter(|&n| n > 0)?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86400,
        _ => return None,
    };
    n.checked_mul(mult)
}
