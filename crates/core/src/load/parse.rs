//! Parsing: each file's tables into the declaration's parts (`mesh.toml`, then each
//! `modules/NAME.toml`), leaving out what fails to parse and reporting why. What refers to other
//! tables is checked afterwards, by `validate`.

use std::net::{IpAddr, SocketAddr};

use ipnet::{Ipv4Net, Ipv6Net};

use super::schema::{map_of, parse_document, root, strings_of, Doc, Table};
use super::validate::is_dns_label;
use super::SourceFile;
use crate::decl::*;
use crate::diag::{Diagnostic, Loc};

/// What the parse produced before cross-references are checked. Parts that failed to parse
/// are left out, and the error that says why is already reported.
#[derive(Default)]
pub(super) struct Parsed {
    mesh: Option<MeshSettings>,
    networks: Vec<Network>,
    groups: Vec<Group>,
    nodes: Vec<std::sync::Arc<Node>>,
    pub(super) modules: Vec<Module>,
    routes: Vec<Route>,
    tests: Vec<PolicyTest>,
    pools: Vec<crate::decl::Pool>,
    acme: Option<Acme>,
    exposures: Vec<Exposure>,
}

impl Parsed {
    pub(super) fn finish(self) -> Option<Declaration> {
        Some(Declaration {
            mesh: self.mesh?,
            networks: self.networks,
            groups: self.groups,
            nodes: self.nodes,
            modules: self.modules,
            routes: self.routes,
            tests: self.tests,
            pools: self.pools,
            acme: self.acme,
            exposures: self.exposures,
        })
    }
}

const MESH_FILE_KEYS: &[&str] = &["mesh", "networks", "groups", "node", "route", "test", "pool", "acme", "expose"];
const ACME_KEYS: &[&str] = &["directory", "email"];
const EXPOSE_KEYS: &[&str] = &["name", "hostnames", "module", "port", "via", "listen", "tls", "sources"];
const MESH_KEYS: &[&str] =
    &["name", "domain", "overlay_ipv4", "overlay_ipv6", "port", "interface", "mtu", "service_cert_lifetime", "min_agent_version"];
const NODE_KEYS: &[&str] =
    &["name", "hub", "networks", "groups", "modules", "address_ipv4", "address_ipv6", "endpoint", "public_key", "exit", "direct"];
const ROUTE_KEYS: &[&str] = &["name", "prefixes", "via", "masquerade", "allow", "host"];
const ROUTE_HOST_KEYS: &[&str] = &["name", "address"];
const ENDPOINT_KEYS: &[&str] = &["address", "reachable_from"];
const POOL_KEYS: &[&str] = &["name", "size", "networks", "groups", "modules", "ephemeral_after"];
const TEST_KEYS: &[&str] = &["from", "to", "proto", "port", "expect"];
const MODULE_FILE_KEYS: &[&str] = &["module", "allow"];
const MODULE_KEYS: &[&str] = &["name", "description", "certificate"];
const CERTIFICATE_KEYS: &[&str] = &["group", "reload"];
const RULE_KEYS: &[&str] = &["proto", "ports", "from"];

/// Every table a declaration may hold and the keys it takes, as the parser reads them (the
/// names are how diagnostics name the tables); the reference of declaration keys is checked
/// against it. `[networks]` and `[groups]` take names the operator chooses, and each network
/// takes no key.
pub const SCHEMA: &[(&str, &[&str])] = &[
    ("mesh.toml", MESH_FILE_KEYS),
    ("[mesh]", MESH_KEYS),
    ("[[node]]", NODE_KEYS),
    ("[[node.endpoint]]", ENDPOINT_KEYS),
    ("[[route]]", ROUTE_KEYS),
    ("[[route.allow]]", RULE_KEYS),
    ("[[route.host]]", ROUTE_HOST_KEYS),
    ("[[pool]]", POOL_KEYS),
    ("[acme]", ACME_KEYS),
    ("[[expose]]", EXPOSE_KEYS),
    ("[[test]]", TEST_KEYS),
    ("modules/NAME.toml", MODULE_FILE_KEYS),
    ("[module]", MODULE_KEYS),
    ("[module.certificate]", CERTIFICATE_KEYS),
    ("[[allow]]", RULE_KEYS),
];

pub(super) fn parse_mesh(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Parsed {
    parse_mesh_parts(file, Vec::new(), diags).0
}

/// `mesh.toml` from its cut (ADR 0034): the rest parsed, and each `[[node]]` table taken from
/// `cache` when its text is one parsed before, else parsed alone. `None` when the cut does not
/// read the file, or any part of it has anything to say (a diagnostic): then the whole file is
/// parsed, so that what it says is said exactly as ever.
pub(super) fn parse_mesh_cut(file: &SourceFile, cache: &mut super::LoadCache) -> Option<Parsed> {
    let cut = super::segments::cut(&file.text)?;
    let mut diags = Vec::new();
    let rest = SourceFile { path: file.path.clone(), text: cut.rest };
    let (mut out, has_nodes) = parse_mesh_parts(&rest, cut.gaps, &mut diags);
    if has_nodes || !diags.is_empty() {
        return None;
    }
    if cache.file.as_deref() != Some(file.path.as_str()) {
        cache.nodes.clear();
        cache.groups.clear();
        cache.file = Some(file.path.clone());
    }
    // Which table of the load before each one is: the one at the same place when its text is
    // the same (a change of groups or of one node moves no table), else the one with its text.
    let held = &cache.nodes;
    let mut by_text: Option<crate::FastMap<&str, usize>> = None;
    let found: Vec<Option<usize>> = cut
        .nodes
        .iter()
        .enumerate()
        .map(|(i, (_, text))| {
            if held.get(i).is_some_and(|(t, ..)| t == text) {
                return Some(i);
            }
            let by_text = by_text.get_or_insert_with(|| held.iter().enumerate().map(|(j, (t, ..))| (t.as_str(), j)).collect());
            by_text.get(text).copied()
        })
        .collect();
    drop(by_text);
    let mut held = std::mem::take(&mut cache.nodes);
    let mut kept = Vec::with_capacity(cut.nodes.len());
    out.nodes.reserve(cut.nodes.len());
    for ((line, text), found) in cut.nodes.into_iter().zip(found) {
        let node = match found {
            // Shared as it was placed, or a copy moved to where it now stands.
            Some(j) => {
                cache.hits += 1;
                let (_, was, node) = &held[j];
                if *was == line {
                    node.clone()
                } else {
                    let mut moved = crate::decl::Node::clone(node);
                    moved.shift_lines(i64::from(line) - i64::from(*was));
                    std::sync::Arc::new(moved)
                }
            }
            None => {
                let parsed = parse_node_alone(&SourceFile { path: file.path.clone(), text: text.to_string() }, &mut diags);
                let Some(mut node) = parsed.filter(|_| diags.is_empty()) else {
                    // The whole parse says what is wrong; the tables held stay for the next load.
                    cache.nodes = held;
                    return None;
                };
                cache.parsed += 1;
                node.shift_lines(i64::from(line));
                std::sync::Arc::new(node)
            }
        };
        // The text kept is the held one when it is this table's (not copied again).
        let key = match found {
            Some(j) if !held[j].0.is_empty() => std::mem::take(&mut held[j].0),
            _ => text.to_string(),
        };
        out.nodes.push(node.clone());
        kept.push((key, line, node));
    }
    cache.nodes = kept;
    if !cut.groups.is_empty() {
        let mut kept = crate::FastMap::with_capacity_and_hasher(cut.groups.len(), Default::default());
        for (line, text) in cut.groups {
            let (key, group) = match cache.groups.remove_entry(text) {
                Some(hit) => hit,
                None => {
                    let group = parse_group_alone(&SourceFile { path: file.path.clone(), text: text.to_string() }, &mut diags)?;
                    if !diags.is_empty() {
                        return None;
                    }
                    (text.to_string(), group)
                }
            };
            let mut placed = group.clone();
            placed.loc.line += line;
            out.groups.push(placed);
            kept.insert(key, group);
        }
        cache.groups = kept;
        // In the order of the table's keys, as the whole parse gives them; a name given twice
        // is the whole parse's to report.
        out.groups.sort_by(|a, b| a.name.cmp(&b.name));
        if out.groups.windows(2).any(|w| w[0].name == w[1].name) {
            return None;
        }
    }
    Some(out)
}

/// One line of `[groups]` (`name = ["a", "b"]`) as a file of its own: the group, its line 1.
fn parse_group_alone(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Group> {
    let doc = Doc::new(file);
    let table = parse_document(&doc, &file.text, diags)?;
    let [(key, value)] = table.get_ref().iter().collect::<Vec<_>>()[..] else { return None };
    let name = key.get_ref().to_string();
    let members = strings_of(&doc, value, &format!("group `{name}` in [groups]"), diags)?;
    Some(Group { name, members: members.into_iter().map(|(m, _)| m).collect(), loc: doc.loc(&key.span()) })
}

/// One `[[node]]` table (with its parts) as a file of its own: the node, its lines counted from
/// the table's; `None` if the file holds anything else.
fn parse_node_alone(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Node> {
    let doc = Doc::new(file);
    let table = parse_document(&doc, &file.text, diags)?;
    if table.get_ref().len() != 1 {
        return None;
    }
    let top = root(&doc, &table, file.path.as_str(), MESH_FILE_KEYS, diags);
    let [v] = top.tables(&doc, "node", diags)[..] else { return None };
    let t = Table::new(&doc, "[[node]]", v, NODE_KEYS, diags)?;
    parse_node(&doc, &t, diags)
}

/// `mesh.toml`'s parts, and whether its top-level table has a `node` key at all; `gaps` says
/// where whole lines of the file were left out of `file` (see `Doc::with_gaps`).
fn parse_mesh_parts(file: &SourceFile, gaps: Vec<(usize, u32)>, diags: &mut Vec<Diagnostic>) -> (Parsed, bool) {
    let doc = Doc::with_gaps(file, gaps);
    let mut out = Parsed::default();
    let Some(table) = parse_document(&doc, &file.text, diags) else {
        return (out, false);
    };
    let top = root(&doc, &table, file.path.as_str(), MESH_FILE_KEYS, diags);
    let has_nodes = top.get("node").is_some();

    match top.get("mesh") {
        None => diags.push(Diagnostic::error(
            &doc.start(),
            "the declaration has no [mesh] table; add one with at least `name`, `domain` and `overlay_ipv4` or `overlay_ipv6`",
        )),
        Some(v) => out.mesh = Table::new(&doc, "[mesh]", v, MESH_KEYS, diags).and_then(|t| parse_mesh_settings(&doc, &t, diags)),
    }
    if let Some(v) = top.get("networks") {
        if let Some(t) = map_of(&doc, "[networks]", v, diags) {
            // Each network is a table of its own: `internet = {}`, or `metered = { direct = false }`.
            for (key, value) in t.iter() {
                let name = key.get_ref().to_string();
                let what = format!("network `{name}`");
                if let Some(n) = Table::new(&doc, what, value, &["direct"], diags) {
                    let direct = n.bool(&doc, "direct", diags).unwrap_or(true);
                    out.networks.push(Network { name, direct, loc: doc.loc(&key.span()) });
                }
            }
        }
    }
    if let Some(v) = top.get("groups") {
        if let Some(t) = map_of(&doc, "[groups]", v, diags) {
            for (key, value) in t.iter() {
                let name = key.get_ref().to_string();
                let what = format!("group `{name}` in [groups]");
                if let Some(members) = strings_of(&doc, value, &what, diags) {
                    out.groups.push(Group { name, members: members.into_iter().map(|(m, _)| m).collect(), loc: doc.loc(&key.span()) });
                }
            }
        }
    }
    for v in top.tables(&doc, "node", diags) {
        if let Some(t) = Table::new(&doc, "[[node]]", v, NODE_KEYS, diags) {
            if let Some(node) = parse_node(&doc, &t, diags) {
                out.nodes.push(std::sync::Arc::new(node));
            }
        }
    }
    for v in top.tables(&doc, "route", diags) {
        if let Some(t) = Table::new(&doc, "[[route]]", v, ROUTE_KEYS, diags) {
            if let Some(route) = parse_route(&doc, &t, diags) {
                out.routes.push(route);
            }
        }
    }
    for v in top.tables(&doc, "pool", diags) {
        if let Some(t) = Table::new(&doc, "[[pool]]", v, POOL_KEYS, diags) {
            out.pools.extend(parse_pool_table(&doc, &t, diags));
        }
    }
    if let Some(v) = top.get("acme") {
        if let Some(t) = Table::new(&doc, "[acme]", v, ACME_KEYS, diags) {
            out.acme = parse_acme(&doc, &t, diags);
        }
    }
    for v in top.tables(&doc, "expose", diags) {
        if let Some(t) = Table::new(&doc, "[[expose]]", v, EXPOSE_KEYS, diags) {
            out.exposures.extend(parse_expose(&doc, &t, diags));
        }
    }
    for v in top.tables(&doc, "test", diags) {
        if let Some(t) = Table::new(&doc, "[[test]]", v, TEST_KEYS, diags) {
            if let Some(test) = parse_test(&doc, &t, diags) {
                out.tests.push(test);
            }
        }
    }
    (out, has_nodes)
}

fn parse_mesh_settings(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<MeshSettings> {
    let name = t.required_str(doc, "name", diags);
    let domain = t.required_str(doc, "domain", diags);
    let v4 = t.str(doc, "overlay_ipv4", diags).and_then(|(s, loc)| parse_pool::<Ipv4Net>(&s, &loc, "overlay_ipv4", 30, diags));
    let v6 = t.str(doc, "overlay_ipv6", diags).and_then(|(s, loc)| parse_pool::<Ipv6Net>(&s, &loc, "overlay_ipv6", 126, diags));
    if t.get("overlay_ipv4").is_none() && t.get("overlay_ipv6").is_none() {
        diags.push(Diagnostic::error(&t.loc, "[mesh] needs `overlay_ipv4`, `overlay_ipv6` or both: the overlay has no address pool"));
    }
    let port = match t.int(doc, "port", diags) {
        None => DEFAULT_PORT,
        Some((p, _)) if (1..=65535).contains(&p) => p as u16,
        Some((p, loc)) => {
            diags.push(Diagnostic::error(&loc, format!("`port` {p} is not a valid UDP port (1-65535)")));
            DEFAULT_PORT
        }
    };
    let mtu = match t.int(doc, "mtu", diags) {
        None => DEFAULT_MTU,
        Some((m, _)) if (1280..=9000).contains(&m) => m as u16,
        Some((m, loc)) => {
            diags.push(Diagnostic::error(&loc, format!("`mtu` {m} is out of range (1280-9000)")));
            DEFAULT_MTU
        }
    };
    let interface = match t.str(doc, "interface", diags) {
        None => DEFAULT_INTERFACE.to_string(),
        Some((i, loc)) => {
            if i.is_empty() || i.len() > 15 || !i.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.') {
                diags.push(Diagnostic::error(
                    &loc,
                    format!("`interface` {i:?} is not a valid interface name (1-15 of letters, digits, '-', '_', '.')"),
                ));
            }
            i
        }
    };
    let (name, name_loc) = name?;
    if name.is_empty() || name.len() > 32 || !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
        diags.push(Diagnostic::error(&name_loc, format!("mesh name {name:?} must be 1-32 of a-z, 0-9 and '-'")));
    }
    let (domain, domain_loc) = domain?;
    let domain = domain.trim_end_matches('.').to_string();
    if domain.is_empty() || domain.len() > 200 || !domain.split('.').all(is_dns_label) {
        diags.push(Diagnostic::error(&domain_loc, format!("`domain` {domain:?} is not a valid DNS name (labels of a-z, 0-9 and '-')")));
    }
    let service_cert_secs = match t.str(doc, "service_cert_lifetime", diags) {
        None => DEFAULT_SERVICE_CERT_SECS,
        Some((s, loc)) => match duration_secs(&s) {
            Some(secs) if (MIN_SERVICE_CERT_SECS..=MAX_SERVICE_CERT_SECS).contains(&secs) => secs,
            _ => {
                diags.push(Diagnostic::error(
                    &loc,
                    format!("`service_cert_lifetime` {s:?} must be a duration from \"1m\" to \"90d\", such as \"24h\""),
                ));
                DEFAULT_SERVICE_CERT_SECS
            }
        },
    };
    let min_agent_version = t.str(doc, "min_agent_version", diags).and_then(|(s, loc)| match s.parse() {
        Ok(r) => Some(r),
        Err(e) => {
            diags.push(Diagnostic::error(&loc, format!("`min_agent_version` {e}")));
            None
        }
    });
    Some(MeshSettings {
        name,
        domain,
        overlay_ipv4: v4,
        overlay_ipv6: v6,
        port,
        interface,
        mtu,
        service_cert_secs,
        min_agent_version,
        loc: t.loc.clone(),
    })
}

trait Pool: Sized + std::str::FromStr + std::fmt::Display + Copy + PartialEq {
    fn prefix(&self) -> u8;
    fn trunc(&self) -> Self;
}
impl Pool for Ipv4Net {
    fn prefix(&self) -> u8 {
        self.prefix_len()
    }
    fn trunc(&self) -> Self {
        Ipv4Net::trunc(self)
    }
}
impl Pool for Ipv6Net {
    fn prefix(&self) -> u8 {
        self.prefix_len()
    }
    fn trunc(&self) -> Self {
        Ipv6Net::trunc(self)
    }
}

fn parse_pool<P: Pool>(s: &str, loc: &Loc, key: &str, max_prefix: u8, diags: &mut Vec<Diagnostic>) -> Option<P> {
    let Ok(net) = s.parse::<P>() else {
        diags.push(Diagnostic::error(loc, format!("`{key}` {s:?} is not a valid CIDR of its address family")));
        return None;
    };
    if net.trunc() != net {
        diags.push(Diagnostic::error(loc, format!("`{key}` {s} has host bits set; did you mean {}?", net.trunc())));
        return None;
    }
    if net.prefix() > max_prefix {
        diags.push(Diagnostic::error(loc, format!("`{key}` {s} is too small for a mesh; use a prefix of /{max_prefix} or shorter")));
        return None;
    }
    Some(net)
}

/// A node's or a pool's `networks`, `groups` and `modules`, with where each name is written.
fn memberships(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> (Vec<String>, Vec<String>, Vec<String>, NodeRefs) {
    let mut names = |key: &str| -> (Vec<String>, Vec<Loc>) { t.strings(doc, key, diags).unwrap_or_default().into_iter().unzip() };
    let (networks, network_locs) = names("networks");
    let (groups, group_locs) = names("groups");
    let (modules, module_locs) = names("modules");
    (networks, groups, modules, NodeRefs { networks: network_locs, groups: group_locs, modules: module_locs })
}

fn parse_node(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Node> {
    let name = t.required_str(doc, "name", diags);
    let (networks, groups, modules, refs) = memberships(doc, t, diags);
    let hub = t.bool(doc, "hub", diags).unwrap_or(false);
    let direct = t.bool(doc, "direct", diags).unwrap_or(true);
    let address_ipv4 = t.str(doc, "address_ipv4", diags).and_then(|(s, loc)| match s.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            diags.push(Diagnostic::error(&loc, format!("`address_ipv4` {s:?} is not an IPv4 address")));
            None
        }
    });
    let address_ipv6 = t.str(doc, "address_ipv6", diags).and_then(|(s, loc)| match s.parse() {
        Ok(a) => Some(a),
        Err(_) => {
            diags.push(Diagnostic::error(&loc, format!("`address_ipv6` {s:?} is not an IPv6 address")));
            None
        }
    });
    let public_key = t.str(doc, "public_key", diags).and_then(|(s, loc)| match PublicKey::parse(&s) {
        Some(k) => Some(k),
        None => {
            diags.push(Diagnostic::error(
                &loc,
                format!("`public_key` {s:?} is not a WireGuard public key (44 characters of base64, 32 bytes)"),
            ));
            None
        }
    });
    let mut endpoints = Vec::new();
    for v in t.tables(doc, "endpoint", diags) {
        let Some(e) = Table::new(doc, "[[node.endpoint]]", v, ENDPOINT_KEYS, diags) else {
            continue;
        };
        let address = e.required_str(doc, "address", diags).and_then(|(s, loc)| match s.parse::<SocketAddr>() {
            Ok(a) if a.port() != 0 => Some(a),
            _ => {
                diags.push(Diagnostic::error(
                    &loc,
                    format!("endpoint `address` {s:?} must be IP:PORT or [IPv6]:PORT, with a port from 1 to 65535"),
                ));
                None
            }
        });
        let reachable_from = match e.strings(doc, "reachable_from", diags) {
            Some(r) => r.into_iter().map(|(s, _)| s).collect(),
            None => {
                if e.get("reachable_from").is_none() {
                    e.missing("reachable_from", diags);
                }
                continue;
            }
        };
        if let Some(address) = address {
            endpoints.push(Endpoint { address, reachable_from, loc: e.loc.clone() });
        }
    }
    let exit = t.str(doc, "exit", diags);
    let (name, _) = name?;
    Some(Node {
        name,
        hub,
        networks,
        groups,
        modules,
        address_ipv4,
        address_ipv6,
        endpoints,
        direct,
        public_key,
        exit,
        loc: t.loc.clone(),
        refs,
        pool: None,
    })
}

/// The most members a pool may hold.
pub const MAX_POOL_SIZE: i64 = 65_535;

fn parse_pool_table(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<crate::decl::Pool> {
    let name = t.required_str(doc, "name", diags);
    let (networks, groups, modules, refs) = memberships(doc, t, diags);
    if t.get("size").is_none() {
        t.missing("size", diags);
    }
    let size = match t.int(doc, "size", diags) {
        Some((n, _)) if (1..=MAX_POOL_SIZE).contains(&n) => Some(n as u32),
        Some((n, loc)) => {
            diags.push(Diagnostic::error(&loc, format!("pool `size` {n} must be from 1 to {MAX_POOL_SIZE}")));
            None
        }
        None => None,
    };
    let ephemeral_after = match t.str(doc, "ephemeral_after", diags) {
        None => None,
        Some((s, loc)) => match duration_secs(&s) {
            Some(secs) => Some(secs),
            None => {
                diags.push(Diagnostic::error(
                    &loc,
                    format!("pool `ephemeral_after` {s:?} is not a duration such as \"30s\", \"10m\", \"1h\" or \"1d\""),
                ));
                return None;
            }
        },
    };
    let (name, _) = name?;
    Some(crate::decl::Pool { name, size: size?, networks, groups, modules, ephemeral_after, loc: t.loc.clone(), refs })
}

fn parse_acme(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Acme> {
    let directory = t.required_str(doc, "directory", diags).and_then(|(s, loc)| {
        if crate::traefik::acme_directory_ok(&s) {
            Some(s)
        } else {
            diags.push(Diagnostic::error(
                &loc,
                format!("[acme] `directory` {s:?} must be an https:// URL of an ACME directory (a host, then only the characters a URL is written with: no quotes, backslashes, braces or spaces)"),
            ));
            None
        }
    });
    let email = t.str(doc, "email", diags).and_then(|(s, loc)| {
        if crate::traefik::acme_email_ok(&s) {
            Some(s)
        } else {
            diags.push(Diagnostic::error(&loc, format!("[acme] `email` {s:?} is not an email address")));
            None
        }
    });
    Some(Acme { directory: directory?, email, loc: t.loc.clone() })
}

/// A public host name an exposure serves: DNS labels, at least two, lower case, no wildcard.
fn is_hostname(s: &str) -> bool {
    s.len() <= 253 && s.split('.').count() >= 2 && s.split('.').all(is_dns_label)
}

fn parse_expose(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Exposure> {
    let name = t.required_str(doc, "name", diags);
    let port_of = |key: &str, diags: &mut Vec<Diagnostic>| match t.int(doc, key, diags) {
        None => None,
        Some((p, _)) if (1..=65535).contains(&p) => Some(p as u16),
        Some((p, loc)) => {
            diags.push(Diagnostic::error(&loc, format!("[[expose]] `{key}` {p} is not a valid TCP port (1-65535)")));
            None
        }
    };
    let mut hostnames = Vec::new();
    let mut hostname_locs = Vec::new();
    match t.strings(doc, "hostnames", diags) {
        None if t.get("hostnames").is_none() => t.missing("hostnames", diags),
        None => {}
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, "[[expose]] has an empty `hostnames`: name the public names it serves"))
        }
        Some(list) => {
            for (h, loc) in list {
                let h = h.trim_end_matches('.').to_string();
                if is_hostname(&h) {
                    hostnames.push(h);
                    hostname_locs.push(loc);
                } else {
                    diags.push(Diagnostic::error(
                        &loc,
                        format!("hostname {h:?} is not a public DNS name (two or more labels of a-z, 0-9 and '-', no wildcard)"),
                    ));
                }
            }
        }
    }
    let module = t.required_str(doc, "module", diags);
    if t.get("port").is_none() {
        t.missing("port", diags);
    }
    let port = port_of("port", diags);
    let (via, via_locs): (Vec<String>, Vec<Loc>) = match t.strings(doc, "via", diags) {
        None if t.get("via").is_none() => {
            t.missing("via", diags);
            (Vec::new(), Vec::new())
        }
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, "[[expose]] has an empty `via`: name the ingress node(s) that serve it"));
            (Vec::new(), Vec::new())
        }
        other => other.unwrap_or_default().into_iter().unzip(),
    };
    let listen = port_of("listen", diags).unwrap_or(DEFAULT_LISTEN);
    let (tls, tls_loc) = match t.str(doc, "tls", diags) {
        None => (Some(ExposeTls::Acme), t.loc.clone()),
        Some((s, loc)) => match ExposeTls::parse(&s) {
            Some(tls) => (Some(tls), loc),
            None => {
                diags.push(Diagnostic::error(&loc, format!("[[expose]] `tls` {s:?} must be \"acme\", \"passthrough\" or \"none\"")));
                (None, loc)
            }
        },
    };
    let sources = match t.strings(doc, "sources", diags) {
        None if t.get("sources").is_none() => vec!["0.0.0.0/0".parse().expect("a prefix"), "::/0".parse().expect("a prefix")],
        None => Vec::new(),
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, "[[expose]] has an empty `sources`: leave it out to admit everyone, or name prefixes"));
            Vec::new()
        }
        Some(list) => {
            let mut out = Vec::new();
            for (p, loc) in list {
                match p.parse::<ipnet::IpNet>() {
                    Ok(net) if net.trunc() != net => {
                        diags.push(Diagnostic::error(&loc, format!("exposure source {p} has host bits set; did you mean {}?", net.trunc())))
                    }
                    Ok(net) => out.push(net),
                    Err(_) => diags
                        .push(Diagnostic::error(&loc, format!("exposure source {p:?} is not a CIDR prefix such as \"203.0.113.0/24\""))),
                }
            }
            out
        }
    };
    let (name, _) = name?;
    let (module, module_loc) = module?;
    Some(Exposure {
        name,
        hostnames,
        hostname_locs,
        module,
        module_loc,
        port: port?,
        via,
        via_locs,
        listen,
        tls: tls?,
        tls_loc,
        sources,
        loc: t.loc.clone(),
    })
}

fn parse_test(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<PolicyTest> {
    let from = t.required_str(doc, "from", diags).and_then(|(s, loc)| match s.strip_prefix("node:") {
        Some(n) => Some(n.to_string()),
        None => {
            diags.push(Diagnostic::error(&loc, format!("test `from` {s:?} must name one node, as \"node:NAME\"")));
            None
        }
    });
    let to = t.required_str(doc, "to", diags).and_then(|(s, loc)| {
        if let Some(n) = s.strip_prefix("node:") {
            Some(Target::Node(n.to_string()))
        } else if let Some(m) = s.strip_prefix("module:") {
            Some(Target::Module(m.to_string()))
        } else if let Some(r) = s.strip_prefix("route:") {
            Some(Target::Route(r.to_string()))
        } else {
            diags.push(Diagnostic::error(&loc, format!("test `to` {s:?} must be \"node:NAME\", \"module:NAME\" or \"route:NAME\"")));
            None
        }
    });
    let proto = parse_proto(doc, t, diags);
    let port = match t.int(doc, "port", diags) {
        None => None,
        Some((p, _)) if (1..=65535).contains(&p) => Some(p as u16),
        Some((p, loc)) => {
            diags.push(Diagnostic::error(&loc, format!("test `port` {p} is not a valid port (1-65535)")));
            return None;
        }
    };
    let expect = t.required_str(doc, "expect", diags).and_then(|(s, loc)| match s.as_str() {
        "allow" => Some(Expect::Allow),
        "deny" => Some(Expect::Deny),
        _ => {
            diags.push(Diagnostic::error(&loc, format!("test `expect` {s:?} must be \"allow\" or \"deny\"")));
            None
        }
    });
    let proto = proto?;
    match (proto, port) {
        (Proto::Icmp, Some(_)) => {
            diags.push(Diagnostic::error(&t.loc, "[[test]] with proto \"icmp\" takes no `port`"));
            return None;
        }
        (Proto::Tcp | Proto::Udp, None) => {
            diags.push(Diagnostic::error(&t.loc, format!("[[test]] with proto \"{proto}\" needs a `port`")));
            return None;
        }
        _ => {}
    }
    Some(PolicyTest { from: from?, to: to?, proto, port, expect: expect?, loc: t.loc.clone() })
}

fn parse_proto(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Proto> {
    t.required_str(doc, "proto", diags).and_then(|(s, loc)| match Proto::parse(&s) {
        Some(p) => Some(p),
        None => {
            diags.push(Diagnostic::error(&loc, format!("`proto` {s:?} must be \"tcp\", \"udp\" or \"icmp\"")));
            None
        }
    })
}

fn parse_route(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Route> {
    let name = t.required_str(doc, "name", diags);
    let mut prefixes = Vec::new();
    match t.strings(doc, "prefixes", diags) {
        None if t.get("prefixes").is_none() => t.missing("prefixes", diags),
        None => {}
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, "[[route]] has an empty `prefixes`: name the prefixes it reaches"))
        }
        Some(list) => {
            for (p, loc) in list {
                match p.parse::<ipnet::IpNet>() {
                    Ok(net) if net.trunc() != net => {
                        diags.push(Diagnostic::error(&loc, format!("route prefix {p} has host bits set; did you mean {}?", net.trunc())))
                    }
                    Ok(net) => prefixes.push(net),
                    Err(_) => {
                        diags.push(Diagnostic::error(&loc, format!("route prefix {p:?} is not a CIDR prefix such as \"192.168.10.0/24\"")))
                    }
                }
            }
        }
    }
    let (via, via_locs): (Vec<String>, Vec<Loc>) = match t.strings(doc, "via", diags) {
        None if t.get("via").is_none() => {
            t.missing("via", diags);
            (Vec::new(), Vec::new())
        }
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, "[[route]] has an empty `via`: name the node(s) that route to it"));
            (Vec::new(), Vec::new())
        }
        other => other.unwrap_or_default().into_iter().unzip(),
    };
    let masquerade = t.bool(doc, "masquerade", diags).unwrap_or(true);
    let mut allow = Vec::new();
    let rules = t.tables(doc, "allow", diags);
    if rules.is_empty() {
        let named = name.as_ref().map_or(String::new(), |(n, _)| format!(" `{n}`"));
        diags.push(Diagnostic::warning(&t.loc, format!("route{named} has no [[route.allow]]: no node may use it")));
    }
    for v in rules {
        let Some(r) = Table::new(doc, "[[route.allow]]", v, RULE_KEYS, diags) else { continue };
        if let Some(rule) = parse_route_rule(doc, &r, diags) {
            allow.push(rule);
        }
    }
    let mut hosts = Vec::new();
    for v in t.tables(doc, "host", diags) {
        let Some(h) = Table::new(doc, "[[route.host]]", v, ROUTE_HOST_KEYS, diags) else { continue };
        let hname = h.required_str(doc, "name", diags);
        let address = h.required_str(doc, "address", diags).and_then(|(s, loc)| match s.parse::<IpAddr>() {
            Ok(a) => Some(a),
            Err(_) => {
                diags.push(Diagnostic::error(&loc, format!("route host `address` {s:?} is not an IP address")));
                None
            }
        });
        if let (Some((hname, _)), Some(address)) = (hname, address) {
            hosts.push(RouteHost { name: hname, address, loc: h.loc.clone() });
        }
    }
    let (name, _) = name?;
    Some(Route { name, prefixes, via, via_locs, masquerade, allow, hosts, loc: t.loc.clone() })
}

/// A route's `[[route.allow]]`: a module rule's shape, where `proto` may also be `"any"`.
fn parse_route_rule(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<RouteRule> {
    if t.str(doc, "proto", &mut Vec::new()).is_some_and(|(p, _)| p == "any") {
        if t.get("ports").is_some() {
            diags.push(Diagnostic::error(&t.loc, "[[route.allow]] with proto \"any\" takes no `ports`: it admits every protocol and port"));
            return None;
        }
        let (from, from_locs) = rule_sources(doc, t, diags)?;
        return Some(RouteRule { proto: None, ports: Vec::new(), from, from_locs, loc: t.loc.clone() });
    }
    let rule = parse_rule(doc, t, diags)?;
    Some(RouteRule { proto: Some(rule.proto), ports: rule.ports, from: rule.from, from_locs: rule.from_locs, loc: rule.loc })
}

pub(super) fn parse_module(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Module> {
    let doc = Doc::new(file);
    let table = parse_document(&doc, &file.text, diags)?;
    let top = root(&doc, &table, file.path.as_str(), MODULE_FILE_KEYS, diags);
    let Some(v) = top.get("module") else {
        diags.push(Diagnostic::error(&doc.start(), "a module manifest needs a [module] table with `name`"));
        return None;
    };
    let header = Table::new(&doc, "[module]", v, MODULE_KEYS, diags)?;
    let name = header.required_str(&doc, "name", diags);
    let _ = header.str(&doc, "description", diags);
    let certificate = header.get("certificate").and_then(|v| {
        let t = Table::new(&doc, "[module.certificate]", v, CERTIFICATE_KEYS, diags)?;
        let mut plain = |key: &str, what: &str, refused: fn(&str) -> Option<&'static str>| {
            t.str(&doc, key, diags).and_then(|(s, loc)| {
                if let (true, Some(why)) = (is_plain_name(&s), refused(&s)) {
                    diags.push(Diagnostic::error(&loc, format!("`{key}` {s:?} in [module.certificate] {why}")));
                    None
                } else if is_plain_name(&s) {
                    Some(s)
                } else {
                    diags.push(Diagnostic::error(
                        &loc,
                        format!("`{key}` {s:?} in [module.certificate] is not a plain {what} name (1-64 of letters, digits, '-', '_', '.', '@', not starting with '-' or '.')"),
                    ));
                    None
                }
            })
        };
        let group = plain("group", "group", crate::certs::refused_group);
        let reload = plain("reload", "systemd unit", crate::certs::refused_unit);
        Some(CertificateSpec { group, reload })
    });
    let mut allow = Vec::new();
    for v in top.tables(&doc, "allow", diags) {
        let Some(t) = Table::new(&doc, "[[allow]]", v, RULE_KEYS, diags) else {
            continue;
        };
        if let Some(rule) = parse_rule(&doc, &t, diags) {
            allow.push(rule);
        }
    }
    let (name, _) = name?;
    Some(Module { name, allow, certificate, loc: header.loc })
}

fn parse_rule(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Rule> {
    let proto = parse_proto(doc, t, diags);
    let ports = t.strings(doc, "ports", diags);
    let mut ok = true;
    let mut ranges = Vec::new();
    for (p, loc) in ports.iter().flatten() {
        match PortRange::parse(p) {
            Some(r) => ranges.push(r),
            None => {
                diags.push(Diagnostic::error(
                    loc,
                    format!("port {p:?} is not a port (1-65535) or a range \"FIRST-LAST\" with FIRST <= LAST"),
                ));
            }
        }
    }
    match (proto, &ports) {
        (Some(Proto::Icmp), Some(_)) => {
            diags.push(Diagnostic::error(&t.loc, format!("{} with proto \"icmp\" takes no `ports`: ICMP has no ports", t.what)));
            ok = false;
        }
        (Some(p @ (Proto::Tcp | Proto::Udp)), None) => {
            diags.push(Diagnostic::error(
                &t.loc,
                format!("{} with proto \"{p}\" needs `ports`; an allow rule without ports would open every port", t.what),
            ));
            ok = false;
        }
        (Some(p @ (Proto::Tcp | Proto::Udp)), Some(list)) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, format!("{} with proto \"{p}\" has an empty `ports` list", t.what)));
            ok = false;
        }
        _ => {}
    }
    let from = rule_sources(doc, t, diags);
    let (from, from_locs) = from?;
    if !ok {
        return None;
    }
    Some(Rule { proto: proto?, ports: ranges, from, from_locs, loc: t.loc.clone() })
}

/// A rule's `from`: required and not empty, every source of a known kind. The sources that
/// parse, with where each is written; `None` when the list is missing or empty.
fn rule_sources(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<(Vec<Source>, Vec<Loc>)> {
    const KINDS: &str = "(\"node:NAME\", \"group:NAME\", \"module:NAME\" or \"mesh\")";
    let from = match t.strings(doc, "from", diags) {
        None if t.get("from").is_none() => {
            diags.push(Diagnostic::error(&t.loc, format!("{} has no `from`: every rule must name its sources {KINDS}", t.what)));
            return None;
        }
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, format!("{} has an empty `from`: every rule must name its sources {KINDS}", t.what)));
            return None;
        }
        other => other?,
    };
    let mut sources = Vec::new();
    for (s, loc) in from {
        match Source::parse(&s) {
            Some(src) => sources.push((src, loc)),
            // Reported; the rule keeps its other sources so they are checked too.
            None => diags.push(Diagnostic::error(
                &loc,
                format!("source {s:?} must be \"node:NAME\", \"group:NAME\", \"module:NAME\", \"pool:NAME\", \"expose:NAME\" or \"mesh\""),
            )),
        }
    }
    Some(sources.into_iter().unzip())
}
