//! Cross-reference validation: the rules that span the whole mesh (names unique and declared,
//! endpoints, pinned addresses, keys, sources, routes, exits, tests, pools), checked on the parsed
//! declaration, each adding its diagnostics.

// Maps and sets of names, hashed fast: validation reads every node's names a few times, and
// SipHash was a third of it at 100,000 nodes (nothing here is keyed by what an attacker sends
// to a running service).
type HashMap<K, V> = crate::FastMap<K, V>;
type HashSet<K> = crate::FastSet<K>;
use std::net::IpAddr;

use crate::decl::*;
use crate::diag::{Diagnostic, Loc};

/// A name the zone can hold: 1 to 63 of a-z, 0-9 and `-`, not starting or ending with `-`. Node
/// and module names are such labels.
pub fn is_dns_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// What the checks of each node alone (`node_references`, `endpoints`) read besides the node:
/// the names of the networks, groups and modules declared, and the overlay's pools.
#[derive(PartialEq)]
pub(super) struct NodeContext {
    networks: Vec<String>,
    groups: Vec<String>,
    modules: Vec<String>,
    overlay: (Option<ipnet::Ipv4Net>, Option<ipnet::Ipv6Net>),
}

impl NodeContext {
    fn of(decl: &Declaration) -> Self {
        NodeContext {
            networks: decl.networks.iter().map(|n| n.name.clone()).collect(),
            groups: decl.groups.iter().map(|g| g.name.clone()).collect(),
            modules: decl.modules.iter().map(|m| m.name.clone()).collect(),
            overlay: (decl.mesh.overlay_ipv4, decl.mesh.overlay_ipv6),
        }
    }
}

/// What validation found that the next load through the cache can start from (ADR 0034).
pub(super) struct Checked {
    /// What the checks of each node alone read besides it.
    pub(super) context: NodeContext,
    /// For each node, whether its checks alone said nothing.
    pub(super) quiet: Vec<bool>,
    /// Whether the nodes' names said nothing (each a DNS label, none given twice).
    pub(super) names_quiet: bool,
}

/// The checks that span the whole mesh, each adding its diagnostics; `load` sorts them.
/// `before` names, under the context it was found in, each node whose checks
/// alone said nothing when a node of the same table was checked last (ADR 0034): under the same
/// context they say nothing again, and are not run. `held_names`, when given, are the nodes' names,
/// known to be DNS labels given once.
pub(super) fn validate(
    decl: &Declaration,
    diags: &mut Vec<Diagnostic>,
    before: Option<(&NodeContext, &[bool])>,
    held_names: Option<&crate::FastSet<String>>,
) -> Checked {
    // The sets of names are made once, as the names are checked, and every rule after reads
    // them (at 100,000 nodes each set of node names costs milliseconds to make).
    let (declared, names_quiet) = names(decl, held_names, diags);
    zone_names(decl, &declared.nodes, diags);
    groups(decl, &declared, diags);
    let context = NodeContext::of(decl);
    let known = before.filter(|(c, q)| **c == context && q.len() == decl.nodes.len()).map(|(_, q)| q);
    let mut quiet = Vec::with_capacity(decl.nodes.len());
    for (i, n) in decl.nodes.iter().enumerate() {
        if known.is_some_and(|q| q[i]) {
            quiet.push(true);
            continue;
        }
        let said = diags.len();
        node_references(n, &declared, diags);
        endpoints(n, &decl.mesh, &declared, diags);
        quiet.push(diags.len() == said);
    }
    pinned_addresses(decl, diags);
    public_keys(decl, diags);
    module_sources(decl, &declared, diags);
    routes(decl, &declared, diags);
    exits(decl, diags);
    tests(decl, &declared, diags);
    pools(decl, &declared, diags);
    exposures(decl, &declared, diags);
    Checked { context, quiet, names_quiet }
}

/// What holds a name of the zone, as a diagnostic names it.
enum Named<'d> {
    Node(&'d str),
    Module(&'d str),
    Host(&'d str, &'d str),
}

impl std::fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Named::Node(n) => write!(f, "node `{n}`"),
            Named::Module(m) => write!(f, "module `{m}`"),
            Named::Host(h, r) => write!(f, "host `{h}` of route `{r}`"),
        }
    }
}

/// The names declared of each kind, for checking what refers to them.
struct Declared<'d> {
    networks: Names<'d>,
    groups: Names<'d>,
    nodes: Names<'d>,
    modules: Names<'d>,
    pools: Names<'d>,
    exposures: Names<'d>,
}

/// The names declared of one kind: made from the declaration, or (the nodes') held by the load
/// cache, which knows them to be this declaration's, each a DNS label given once (ADR 0034).
enum Names<'d> {
    Made(HashSet<&'d str>),
    Held(&'d crate::FastSet<String>),
}

impl Names<'_> {
    fn contains(&self, name: &str) -> bool {
        match self {
            Names::Made(set) => set.contains(name),
            Names::Held(set) => set.contains(name),
        }
    }

    fn iter(&self) -> Box<dyn Iterator<Item = &str> + '_> {
        match self {
            Names::Made(set) => Box::new(set.iter().copied()),
            Names::Held(set) => Box::new(set.iter().map(String::as_str)),
        }
    }
}

/// The names of a set, for a diagnostic that says what could have been meant.
fn listing(set: &Names) -> String {
    let mut v: Vec<&str> = set.iter().collect();
    v.sort_unstable();
    if v.is_empty() {
        "none are declared".to_string()
    } else {
        format!("declared: {}", v.join(", "))
    }
}

/// Every name is a DNS label and unique within its kind; the names declared of each kind.
/// The nodes' names are `held`'s when given. Also whether the nodes' names said nothing.
fn names<'d>(decl: &'d Declaration, held: Option<&'d crate::FastSet<String>>, diags: &mut Vec<Diagnostic>) -> (Declared<'d>, bool) {
    let networks = Names::Made(names_of("network", decl.networks.iter().map(|n| (&n.name, &n.loc)), diags));
    let groups = Names::Made(names_of("group", decl.groups.iter().map(|g| (&g.name, &g.loc)), diags));
    let said = diags.len();
    let nodes = match held {
        Some(held) => Names::Held(held),
        None => Names::Made(names_of("node", decl.nodes.iter().map(|n| (&n.name, &n.loc)), diags)),
    };
    let quiet = diags.len() == said;
    let declared = Declared {
        networks,
        groups,
        nodes,
        modules: Names::Made(names_of("module", decl.modules.iter().map(|m| (&m.name, &m.loc)), diags)),
        pools: Names::Made(decl.pools.iter().map(|p| p.name.as_str()).collect()),
        exposures: Names::Made(decl.exposures.iter().map(|e| e.name.as_str()).collect()),
    };
    (declared, quiet)
}

/// The names of `items`, each reported when it is no DNS label or was declared before (where
/// it was first is looked for only then).
fn names_of<'d>(kind: &str, items: impl Iterator<Item = (&'d String, &'d Loc)> + Clone, diags: &mut Vec<Diagnostic>) -> HashSet<&'d str> {
    let mut seen: HashSet<&str> = HashSet::default();
    seen.reserve(items.size_hint().0);
    for (name, loc) in items.clone() {
        if !is_dns_label(name) {
            diags.push(Diagnostic::error(
                loc,
                format!("{kind} name {name:?} must be a DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'"),
            ));
        }
        if !seen.insert(name.as_str()) {
            let first = items.clone().find(|(n, _)| *n == name).map(|(_, l)| l).expect("a name seen is listed");
            diags.push(Diagnostic::error(loc, format!("duplicate {kind} `{name}`: already declared at {first}")));
        }
    }
    seen
}

/// No name in the zone is `NAMESERVER`, and a module may not take a node's name. Both become names in the mesh's DNS zone
/// (`NAME.DOMAIN`), so one of them would shadow the other; the names of each kind are unique
/// among themselves (`names`), and this is the one rule that spans two kinds.
fn zone_names(decl: &Declaration, nodes: &Names, diags: &mut Vec<Diagnostic>) {
    use crate::decl::NAMESERVER;
    // What is named, made into words only for the one that takes the name (a string for each
    // of 100,000 nodes was made before).
    let hosts = decl.routes.iter().flat_map(|r| r.hosts.iter().map(move |h| (Some(&r.name), "host", &h.name, &h.loc)));
    let named = decl
        .nodes
        .iter()
        .map(|n| (None, "node", &n.name, &n.loc))
        .chain(decl.modules.iter().map(|m| (None, "module", &m.name, &m.loc)))
        .chain(hosts);
    for (route, kind, name, loc) in named {
        if name == NAMESERVER {
            let what = match route {
                Some(r) => format!("{kind} `{NAMESERVER}` of route `{r}`"),
                None => format!("{kind} `{NAMESERVER}`"),
            };
            diags.push(Diagnostic::error(
                loc,
                format!(
                    "{what}: the name `{NAMESERVER}` is reserved: every zone names its name server `{NAMESERVER}.{}`, the node's own resolver",
                    decl.mesh.domain
                ),
            ));
        }
    }
    for m in decl.modules.iter().filter(|m| nodes.contains(m.name.as_str())) {
        // Where the node is written, looked for only when a module takes its name.
        if let Some(node) = decl.nodes.iter().find(|n| n.name == m.name).map(|n| &n.loc) {
            diags.push(Diagnostic::error(
                &m.loc,
                format!(
                    "module `{}` has the name of node declared at {node}; nodes and modules share the DNS zone, so their names must differ",
                    m.name
                ),
            ));
        }
    }
}

/// Every member of a group is a declared node.
fn groups(decl: &Declaration, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    for g in &decl.groups {
        for m in g.members.iter() {
            if !declared.nodes.contains(m.as_str()) {
                diags.push(Diagnostic::error(&g.loc, format!("group `{}` lists `{m}`, which is not a declared node", g.name)));
            }
        }
    }
}

/// A node's networks, groups and modules are declared, and a hub has an endpoint.
fn node_references(n: &Node, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    // Each points at the name it is about, or at the node when that place is unknown.
    let at = |locs: &[Loc], i: usize| locs.get(i).unwrap_or(&n.loc).clone();
    for (i, net) in n.networks.iter().enumerate() {
        if !declared.networks.contains(net.as_str()) {
            let loc = at(&n.refs.networks, i);
            diags.push(Diagnostic::error(
                &loc,
                format!("node `{}` sits on network `{net}`, which is not declared in [networks] ({})", n.name, listing(&declared.networks)),
            ));
        }
    }
    for (i, g) in n.groups.iter().enumerate() {
        if !declared.groups.contains(g.as_str()) {
            let msg = format!("node `{}` names group `{g}`, which is not declared in [groups] ({})", n.name, listing(&declared.groups));
            diags.push(Diagnostic::error(&at(&n.refs.groups, i), msg));
        }
    }
    for (i, m) in n.modules.iter().enumerate() {
        if !declared.modules.contains(m.as_str()) {
            let msg = format!("node `{}` runs module `{m}`, which has no manifest in modules/ ({})", n.name, listing(&declared.modules));
            diags.push(Diagnostic::error(&at(&n.refs.modules, i), msg));
        }
    }
    if n.hub && n.endpoints.is_empty() {
        diags.push(Diagnostic::error(
            &n.loc,
            format!(
                "hub `{}` has no [[node.endpoint]]: a hub relays for nodes that dial it, so it needs an endpoint they can reach",
                n.name
            ),
        ));
    }
}

/// A node's endpoints: reachable from declared networks (from none is a warning), and outside
/// the overlay.
fn endpoints(n: &Node, mesh: &MeshSettings, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    for e in &n.endpoints {
        for net in &e.reachable_from {
            if !declared.networks.contains(net.as_str()) {
                diags.push(Diagnostic::error(
                    &e.loc,
                    format!(
                        "endpoint {} of node `{}` is reachable from `{net}`, which is not declared in [networks] ({})",
                        e.address,
                        n.name,
                        listing(&declared.networks)
                    ),
                ));
            }
        }
        if e.reachable_from.is_empty() {
            diags.push(Diagnostic::warning(
                &e.loc,
                format!("endpoint {} of node `{}` is reachable from no network: nobody will dial it", e.address, n.name),
            ));
        }
        let inside = match e.address.ip() {
            IpAddr::V4(a) => mesh.overlay_ipv4.is_some_and(|p| p.contains(&a)),
            IpAddr::V6(a) => mesh.overlay_ipv6.is_some_and(|p| p.contains(&a)),
        };
        if inside {
            diags.push(Diagnostic::error(
                &e.loc,
                format!(
                    "endpoint {} of node `{}` lies inside the overlay pool; an underlay address must not overlap the overlay",
                    e.address, n.name
                ),
            ));
        }
    }
}

/// A pinned overlay address is a usable address of its pool, and no two nodes pin the same.
fn pinned_addresses(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    let v4 = decl.mesh.overlay_ipv4;
    let v6 = decl.mesh.overlay_ipv6;
    let mut pinned: HashMap<IpAddr, &str> = HashMap::default();
    for n in &decl.nodes {
        let mut err = |msg: String| diags.push(Diagnostic::error(&n.loc, msg));
        if let Some(a) = n.address_ipv4 {
            match v4 {
                None => err(format!("node `{}` pins `address_ipv4` {a}, but the mesh has no `overlay_ipv4`", n.name)),
                Some(p) if !p.contains(&a) || a == p.network() || a == p.broadcast() => {
                    err(format!("node `{}` pins `address_ipv4` {a}, which is not a usable address of the pool {p}", n.name))
                }
                _ => {}
            }
            if let Some(other) = pinned.insert(IpAddr::V4(a), &n.name) {
                err(format!("node `{}` pins {a}, which node `{other}` pins already", n.name));
            }
        }
        if let Some(a) = n.address_ipv6 {
            match v6 {
                None => err(format!("node `{}` pins `address_ipv6` {a}, but the mesh has no `overlay_ipv6`", n.name)),
                Some(p) if !p.contains(&a) || a == p.network() => {
                    err(format!("node `{}` pins `address_ipv6` {a}, which is not a usable address of the pool {p}", n.name))
                }
                _ => {}
            }
            if let Some(other) = pinned.insert(IpAddr::V6(a), &n.name) {
                err(format!("node `{}` pins {a}, which node `{other}` pins already", n.name));
            }
        }
    }
}

/// No two nodes declare the same WireGuard public key.
fn public_keys(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    let mut keys: HashMap<PublicKey, &str> = HashMap::default();
    for n in &decl.nodes {
        if let Some(k) = n.public_key {
            if let Some(other) = keys.insert(k, &n.name) {
                diags.push(Diagnostic::error(
                    &n.loc,
                    format!("node `{}` declares the same `public_key` as node `{other}`; every node needs its own key", n.name),
                ));
            }
        }
    }
}

/// Every source a module's rules admit is a declared node, group, module or pool.
fn module_sources(decl: &Declaration, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    for m in &decl.modules {
        for rule in &m.allow {
            undeclared_sources(&format!("module `{}`", m.name), &rule.from, &rule.from_locs, declared, diags);
        }
    }
}

/// Routes: unique names, declared routers, known sources, prefixes clear of the overlay and of
/// each other, host names that are free in the zone and addresses on the route.
fn routes(decl: &Declaration, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    names_of("route", decl.routes.iter().map(|r| (&r.name, &r.loc)), diags);
    // What holds each name of the zone, said only when a host's name is taken.
    let mut zone: HashMap<&str, Named> = HashMap::default();
    if decl.routes.iter().any(|r| !r.hosts.is_empty()) {
        for n in &decl.nodes {
            zone.entry(n.name.as_str()).or_insert(Named::Node(&n.name));
        }
        for m in &decl.modules {
            zone.entry(m.name.as_str()).or_insert(Named::Module(&m.name));
        }
    }
    // Prefixes of routes that are not exits, to find overlaps between routes.
    let mut seen: Vec<(ipnet::IpNet, &str)> = Vec::new();
    for r in &decl.routes {
        for (v, loc) in r.via.iter().zip(&r.via_locs) {
            if !declared.nodes.contains(v.as_str()) {
                diags.push(Diagnostic::error(
                    loc,
                    format!("route `{}` goes via `{v}`, which is not a declared node ({})", r.name, listing(&declared.nodes)),
                ));
            }
        }
        for (i, v) in r.via.iter().enumerate() {
            if r.via[..i].contains(v) {
                diags.push(Diagnostic::error(&r.via_locs[i], format!("route `{}` names `{v}` in `via` twice", r.name)));
            }
        }
        for p in &r.prefixes {
            let overlay = match p {
                ipnet::IpNet::V4(p4) => {
                    decl.mesh.overlay_ipv4.filter(|o| o.contains(&p4.network()) || p4.contains(&o.network())).map(|o| o.to_string())
                }
                ipnet::IpNet::V6(p6) => {
                    decl.mesh.overlay_ipv6.filter(|o| o.contains(&p6.network()) || p6.contains(&o.network())).map(|o| o.to_string())
                }
            };
            // A default route holds the overlay by definition; the overlay's own routes are
            // more specific and win.
            if let Some(o) = overlay.filter(|_| p.prefix_len() > 0) {
                diags.push(Diagnostic::error(
                    &r.loc,
                    format!("route `{}` prefix {p} overlaps the overlay {o}; a route must reach addresses outside the overlay", r.name),
                ));
            }
            if p.prefix_len() == 0 {
                continue;
            }
            // Users send the prefix into the tunnel: an endpoint on it would be dialled through the
            // tunnel it carries.
            if let Some((n, e)) =
                decl.nodes.iter().flat_map(|n| n.endpoints.iter().map(move |e| (n, e))).find(|(_, e)| p.contains(&e.address.ip()))
            {
                diags.push(Diagnostic::error(
                    &r.loc,
                    format!(
                        "route `{}` prefix {p} holds endpoint {} of node `{}`; the underlay must stay outside a route, or the tunnel would carry itself",
                        r.name, e.address, n.name
                    ),
                ));
            }
            if let Some((q, other)) = seen.iter().find(|(q, _)| q.contains(&p.network()) || p.contains(&q.network())) {
                diags.push(Diagnostic::error(
                    &r.loc,
                    format!("route `{}` prefix {p} overlaps prefix {q} of route `{other}`; a destination must have one route", r.name),
                ));
            }
        }
        for p in &r.prefixes {
            if p.prefix_len() > 0 {
                seen.push((*p, &r.name));
            }
        }
        for rule in &r.allow {
            undeclared_sources(&format!("route `{}`", r.name), &rule.from, &rule.from_locs, declared, diags);
        }
        for h in &r.hosts {
            if !is_dns_label(&h.name) {
                diags.push(Diagnostic::error(
                    &h.loc,
                    format!("route host name {:?} must be a DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'", h.name),
                ));
            }
            if let Some(other) = zone.get(h.name.as_str()) {
                diags.push(Diagnostic::error(
                    &h.loc,
                    format!("host `{}` of route `{}` takes the name of {other}; names in the zone must differ", h.name, r.name),
                ));
            } else {
                zone.insert(&h.name, Named::Host(&h.name, &r.name));
            }
            if !r.prefixes.iter().any(|p| p.contains(&h.address)) {
                diags.push(Diagnostic::error(
                    &h.loc,
                    format!("host `{}` of route `{}` has address {}, which is on none of the route's prefixes", h.name, r.name, h.address),
                ));
            }
        }
    }
}

/// Whether a rule's sources name this node (by name, group, module, or the whole mesh).
pub fn names_node(from: &[Source], decl: &Declaration, n: &Node) -> bool {
    from.iter().any(|s| match s {
        Source::Node(x) => *x == n.name,
        Source::Group(g) => n.groups.contains(g) || decl.groups.iter().any(|x| x.name == *g && x.members.contains(&n.name)),
        Source::Module(m) => n.modules.contains(m),
        Source::Pool(p) => n.pool.as_ref() == Some(p),
        Source::Expose(e) => decl.exposure(e).is_some_and(|e| e.via.contains(&n.name)),
        Source::Mesh => true,
    })
}

/// A node's `exit` names a declared exit route that one of its rules admits the node to, and
/// that the node does not itself route for.
fn exits(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    for n in &decl.nodes {
        let Some((exit, loc)) = &n.exit else { continue };
        let Some(r) = decl.route(exit) else {
            let exits: Vec<&str> = decl.routes.iter().filter(|r| r.is_exit()).map(|r| r.name.as_str()).collect();
            let declared = if exits.is_empty() { "none are declared".to_string() } else { format!("declared: {}", exits.join(", ")) };
            diags.push(Diagnostic::error(loc, format!("node `{}` uses exit `{exit}`, which is not a declared route ({declared})", n.name)));
            continue;
        };
        if !r.is_exit() {
            diags.push(Diagnostic::error(
                loc,
                format!("node `{}` uses exit `{exit}`, but that route has no default prefix (0.0.0.0/0 or ::/0), so it is no exit", n.name),
            ));
        } else if r.via.contains(&n.name) {
            diags.push(Diagnostic::error(loc, format!("node `{}` uses exit `{exit}`, which it routes for itself", n.name)));
        } else if !r.allow.iter().any(|rule| names_node(&rule.from, decl, n)) {
            diags.push(Diagnostic::error(
                loc,
                format!("node `{}` uses exit `{exit}`, but no [[route.allow]] of route `{exit}` admits it; add a rule naming it, its group or its module", n.name),
            ));
        }
    }
}

/// Reports each source of a rule of `owner` (`module `pg``, `route `lan``) that names nothing
/// declared, where it is written.
fn undeclared_sources(owner: &str, from: &[Source], locs: &[Loc], declared: &Declared, diags: &mut Vec<Diagnostic>) {
    for (src, loc) in from.iter().zip(locs) {
        let (kind, name, set) = match src {
            Source::Node(n) => ("node", n, &declared.nodes),
            Source::Group(g) => ("group", g, &declared.groups),
            Source::Module(m) => ("module", m, &declared.modules),
            Source::Pool(p) => ("pool", p, &declared.pools),
            Source::Expose(e) => ("exposure", e, &declared.exposures),
            Source::Mesh => continue,
        };
        if !set.contains(name.as_str()) {
            diags.push(Diagnostic::error(
                loc,
                format!("rule of {owner} names source `{src}`, but no {kind} `{name}` is declared ({})", listing(set)),
            ));
        }
    }
}

/// A policy test goes from a declared node to a declared node or module.
fn tests(decl: &Declaration, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    for t in &decl.tests {
        let mut err = |msg: String| diags.push(Diagnostic::error(&t.loc, msg));
        if !declared.nodes.contains(t.from.as_str()) {
            err(format!("test `from` names node `{}`, which is not declared", t.from));
        }
        match &t.to {
            Target::Node(n) if !declared.nodes.contains(n.as_str()) => err(format!("test `to` names node `{n}`, which is not declared")),
            Target::Route(r) if decl.route(r).is_none() => err(format!("test `to` names route `{r}`, which is not declared")),
            Target::Module(m) if !declared.modules.contains(m.as_str()) => {
                err(format!("test `to` names module `{m}`, which has no manifest"))
            }
            _ => {}
        }
    }
}

/// A pool: its name a DNS label, unique among pools, with room in a label for its members'
/// names; its networks, groups and modules declared; no declared node or module named like one
/// of its members (`NAME-DIGITS`), since the controller names members so and both share the
/// zone.
fn pools(decl: &Declaration, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    names_of("pool", decl.pools.iter().map(|p| (&p.name, &p.loc)), diags);
    pool_room(decl, diags);
    let mut seen = HashSet::default();
    // A pool declared twice is reported as a duplicate, and checked once.
    for p in decl.pools.iter().filter(|p| seen.insert(p.name.as_str())) {
        let longest = p.member_name(p.size);
        if is_dns_label(&p.name) && longest.len() > 63 {
            diags.push(Diagnostic::error(
                &p.loc,
                format!("pool `{}` would name a member `{longest}`, longer than a DNS label (63); use a shorter name", p.name),
            ));
        }
        let at = |locs: &[Loc], i: usize| locs.get(i).unwrap_or(&p.loc).clone();
        for (i, net) in p.networks.iter().enumerate() {
            if !declared.networks.contains(net.as_str()) {
                let msg = format!(
                    "pool `{}` sits on network `{net}`, which is not declared in [networks] ({})",
                    p.name,
                    listing(&declared.networks)
                );
                diags.push(Diagnostic::error(&at(&p.refs.networks, i), msg));
            }
        }
        for (i, g) in p.groups.iter().enumerate() {
            if !declared.groups.contains(g.as_str()) {
                let msg = format!("pool `{}` names group `{g}`, which is not declared in [groups] ({})", p.name, listing(&declared.groups));
                diags.push(Diagnostic::error(&at(&p.refs.groups, i), msg));
            }
        }
        for (i, m) in p.modules.iter().enumerate() {
            if !declared.modules.contains(m.as_str()) {
                let msg =
                    format!("pool `{}` runs module `{m}`, which has no manifest in modules/ ({})", p.name, listing(&declared.modules));
                diags.push(Diagnostic::error(&at(&p.refs.modules, i), msg));
            }
        }
        let taken = decl.nodes.iter().map(|n| ("node", &n.name, &n.loc)).chain(decl.modules.iter().map(|m| ("module", &m.name, &m.loc)));
        for (kind, name, loc) in taken {
            if p.number_of(name).is_some() {
                diags.push(Diagnostic::error(
                    loc,
                    format!(
                        "{kind} `{name}` is named like a member of pool `{}` (declared at {}), which the controller names `{}-1`, `{}-2`, ...; rename one of them",
                        p.name, p.loc, p.name, p.name
                    ),
                ));
            }
        }
    }
}

/// The overlay has an address of each family for every node and every member the pools may hold.
fn pool_room(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    if decl.pools.is_empty() {
        return;
    }
    let members: u128 = decl.pools.iter().map(|p| p.size as u128).sum();
    let need = decl.nodes.len() as u128 + members;
    let v4 = decl.mesh.overlay_ipv4.map(|p| ("overlay_ipv4", p.to_string(), (1u128 << (32 - p.prefix_len())) - 2));
    let v6 = decl
        .mesh
        .overlay_ipv6
        .map(|p| ("overlay_ipv6", p.to_string(), 1u128.checked_shl(128 - p.prefix_len() as u32).unwrap_or(u128::MAX) - 1));
    for (key, pool, usable) in [v4, v6].into_iter().flatten() {
        if need > usable {
            diags.push(Diagnostic::error(
                &decl.mesh.loc,
                format!(
                    "`{key}` {pool} holds {usable} usable addresses, but {} nodes and pools of up to {members} members may need {need}; use a larger pool or smaller sizes",
                    decl.nodes.len()
                ),
            ));
        }
    }
}

/// Exposures (ADR 0026): unique names, a declared module and declared ingress nodes, each host
/// name served once, `[acme]` for `tls = "acme"`, one TLS mode per port of an ingress node, a
/// source `expose:NAME` only in the rules of the module it exposes, and a rule of that module
/// that admits the exposure on its port, so that nothing looks exposed while nothing is.
fn exposures(decl: &Declaration, declared: &Declared, diags: &mut Vec<Diagnostic>) {
    names_of("exposure", decl.exposures.iter().map(|e| (&e.name, &e.loc)), diags);
    let mut hostnames: HashMap<&str, (&str, &Loc)> = HashMap::default();
    // (ingress node, listen port) -> (TLS mode, exposure, where)
    let mut listens: HashMap<(&str, u16), (ExposeTls, &str)> = HashMap::default();
    for e in &decl.exposures {
        if !declared.modules.contains(e.module.as_str()) {
            diags.push(Diagnostic::error(
                &e.module_loc,
                format!(
                    "exposure `{}` exposes module `{}`, which has no manifest in modules/ ({})",
                    e.name,
                    e.module,
                    listing(&declared.modules)
                ),
            ));
        }
        for (i, (v, loc)) in e.via.iter().zip(&e.via_locs).enumerate() {
            if !declared.nodes.contains(v.as_str()) {
                diags.push(Diagnostic::error(
                    loc,
                    format!("exposure `{}` goes via `{v}`, which is not a declared node ({})", e.name, listing(&declared.nodes)),
                ));
            }
            if e.via[..i].contains(v) {
                diags.push(Diagnostic::error(loc, format!("exposure `{}` names `{v}` in `via` twice", e.name)));
            }
        }
        for (h, loc) in e.hostnames.iter().zip(&e.hostname_locs) {
            match hostnames.get(h.as_str()) {
                Some((other, first)) => diags.push(Diagnostic::error(
                    loc,
                    format!(
                        "hostname `{h}` of exposure `{}` is already served by exposure `{other}` at {first}; a name has one exposure",
                        e.name
                    ),
                )),
                None => {
                    hostnames.insert(h, (&e.name, loc));
                }
            }
        }
        if e.tls == ExposeTls::Acme && decl.acme.is_none() {
            diags.push(Diagnostic::error(
                &e.tls_loc,
                format!("exposure `{}` takes its certificates from ACME (`tls = \"acme\"`, the default), but the declaration has no [acme] table with its `directory`", e.name),
            ));
        }
        for v in &e.via {
            match listens.get(&(v.as_str(), e.listen)) {
                Some((tls, other)) if *tls != e.tls => diags.push(Diagnostic::error(
                    &e.tls_loc,
                    format!(
                        "exposure `{}` listens on port {} of `{v}` with tls \"{}\", but exposure `{other}` listens there with tls \"{tls}\"; one port of an ingress node has one TLS mode",
                        e.name, e.listen, e.tls
                    ),
                )),
                Some(_) => {}
                None => {
                    listens.insert((v.as_str(), e.listen), (e.tls, &e.name));
                }
            }
        }
        let Some(m) = decl.module(&e.module) else { continue };
        let admitted = m.allow.iter().any(|r| {
            r.proto == Proto::Tcp
                && r.ports.iter().any(|p| p.contains(e.port))
                && r.from.iter().any(|s| *s == Source::Expose(e.name.clone()))
        });
        if !admitted {
            diags.push(Diagnostic::error(
                &e.loc,
                format!(
                    "exposure `{}` sends to port {} of module `{}`, but no rule of module `{}` admits it there; add [[allow]] proto = \"tcp\", ports = [\"{}\"], from = [\"expose:{}\"] to modules/{}.toml",
                    e.name, e.port, e.module, e.module, e.port, e.name, e.module
                ),
            ));
        }
    }
    // `expose:NAME` admits the ingress nodes to what they serve, and to nothing else.
    for m in &decl.modules {
        for rule in &m.allow {
            for (src, loc) in rule.from.iter().zip(&rule.from_locs) {
                let Source::Expose(name) = src else { continue };
                let Some(e) = decl.exposure(name) else { continue };
                if e.module != m.name {
                    diags.push(Diagnostic::error(
                        loc,
                        format!("rule of module `{}` names source `{src}`, but exposure `{name}` exposes module `{}`; its ingress nodes are admitted only to the module they serve", m.name, e.module),
                    ));
                    continue;
                }
                // Only the exposure's own port, over TCP: the edge faces the internet, and a
                // wider rule would let it reach more of the runner than it serves.
                let beyond: Vec<String> =
                    rule.ports.iter().filter(|p| (p.first, p.last) != (e.port, e.port)).map(|p| p.to_string()).collect();
                if rule.proto != Proto::Tcp || !beyond.is_empty() {
                    let what =
                        if rule.proto != Proto::Tcp { format!("proto \"{}\"", rule.proto) } else { format!("ports {}", beyond.join(", ")) };
                    diags.push(Diagnostic::error(
                        loc,
                        format!("rule of module `{}` admits `{src}` on {what}, but exposure `{name}` sends only to tcp port {}; admit it in a rule with proto = \"tcp\", ports = [\"{}\"] and nothing else", m.name, e.port, e.port),
                    ));
                }
            }
        }
    }
    for r in &decl.routes {
        for rule in &r.allow {
            for (src, loc) in rule.from.iter().zip(&rule.from_locs) {
                if matches!(src, Source::Expose(_)) {
                    diags.push(Diagnostic::error(
                        loc,
                        format!("rule of route `{}` names source `{src}`; an exposure's ingress nodes are admitted only to the module they serve", r.name),
                    ));
                }
            }
        }
    }
}
