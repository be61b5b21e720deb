//! Parsing: each file's tables into the declaration's parts (`mesh.toml`, then each
//! `modules/NAME.toml`), leaving out what fails to parse and reporting why. What refers to other
//! tables is checked afterwards, by `validate`. Here `mesh.toml` and its settings; the tables it
//! lists in `tables`, module manifests and rules in `module`, the cached load in `cached`.

use ipnet::{Ipv4Net, Ipv6Net};

use super::schema::{map_of, parse_document, root, strings_of, Doc, Table};
use super::validate::is_dns_label;
use super::SourceFile;
use crate::decl::*;
use crate::diag::{Diagnostic, Loc};

mod cached;
mod module;
mod tables;

pub(super) use cached::parse_mesh_cut;
pub(super) use module::parse_module;
use module::*;
pub use tables::MAX_POOL_SIZE;
use tables::*;

/// What the parse produced before cross-references are checked. Parts that failed to parse
/// are left out, and the error that says why is already reported.
#[derive(Clone, Default)]
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

/// where whole lines of the file were left out of `file` (see `Doc::with_gaps`).
/// `mesh.toml`'s parts, and whether its top-level table has a `node` key at all; `gaps` says
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
