//! Reading declarations: TOML text to a validated [`Declaration`], reporting every problem at
//! once with its file, line and column. Unknown keys are refused in every table.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::sync::Arc;

use ipnet::{Ipv4Net, Ipv6Net};
use toml::de::{DeTable, DeValue};
use toml::Spanned;

use crate::decl::*;
use crate::diag::{self, Diagnostic, LineIndex, Loc};

/// One declaration file as text. `path` is how diagnostics name it.
#[derive(Clone, Debug)]
pub struct SourceFile {
    pub path: String,
    pub text: String,
}

/// The result of loading: the declaration when there was no error, and every diagnostic
/// (errors and warnings) sorted by file and line.
#[derive(Debug)]
pub struct Loaded {
    pub declaration: Option<Declaration>,
    pub diagnostics: Vec<Diagnostic>,
}

impl Loaded {
    pub fn errors(&self) -> impl Iterator<Item = &Diagnostic> {
        self.diagnostics.iter().filter(|d| d.is_error())
    }
}

/// Loads a mesh from `mesh.toml` and the module manifests.
pub fn load(mesh: &SourceFile, modules: &[SourceFile]) -> Loaded {
    let mut diags = Vec::new();
    let mut parsed = parse_mesh(mesh, &mut diags);
    for file in modules {
        if let Some(m) = parse_module(file, &mut diags) {
            parsed.modules.push(m);
        }
    }
    if let Some(decl) = parsed.finish() {
        validate(&decl, &mut diags);
        let has_errors = diags.iter().any(Diagnostic::is_error);
        diag::sort(&mut diags);
        return Loaded { declaration: (!has_errors).then_some(decl), diagnostics: diags };
    }
    diag::sort(&mut diags);
    Loaded { declaration: None, diagnostics: diags }
}

/// The file of a declaration directory that holds the mesh; the others are `modules/NAME.toml`.
pub const MESH_FILE: &str = "mesh.toml";

/// Loads a declaration given as its files, each named relative to the declaration directory
/// (`mesh.toml`, `modules/NAME.toml`), in any order: the modules are read in name order, and a
/// missing `mesh.toml` loads as an empty one (which reports what it lacks). `display` names a
/// file in diagnostics (the directory it was read from, or nothing).
pub fn load_relative(files: &[(String, String)], display: impl Fn(&str) -> String) -> Loaded {
    let file = |(p, t): &(String, String)| SourceFile { path: display(p), text: t.clone() };
    let mesh = files.iter().find(|(p, _)| p == MESH_FILE).map(file).unwrap_or(SourceFile { path: display(MESH_FILE), text: String::new() });
    let mut modules: Vec<&(String, String)> = files.iter().filter(|(p, _)| p != MESH_FILE).collect();
    modules.sort_by(|a, b| a.0.cmp(&b.0));
    let modules: Vec<SourceFile> = modules.into_iter().map(file).collect();
    load(&mesh, &modules)
}

// ---------------------------------------------------------------------------------------------
// The schema walker

struct Doc<'a> {
    file: Arc<str>,
    text: &'a str,
    lines: LineIndex,
}

impl<'a> Doc<'a> {
    fn new(file: &'a SourceFile) -> Self {
        let name: Arc<str> = Arc::from(file.path.as_str());
        Doc { lines: LineIndex::new(name.clone(), &file.text), file: name, text: &file.text }
    }

    fn loc(&self, span: &Range<usize>) -> Loc {
        self.lines.loc(self.text, span.start)
    }

    /// The whole file, for problems that belong to no one line.
    fn start(&self) -> Loc {
        Loc { file: self.file.clone(), line: 1, col: 1 }
    }
}

type Value<'i> = Spanned<DeValue<'i>>;

/// Reads one table: hands out the keys the schema knows and, in `finish`, refuses the rest.
struct Table<'t, 'i> {
    what: String,
    table: &'t DeTable<'i>,
    loc: Loc,
    allowed: &'static [&'static str],
}

impl<'t, 'i> Table<'t, 'i> {
    fn new(
        doc: &Doc,
        what: impl Into<String>,
        value: &'t Value<'i>,
        allowed: &'static [&'static str],
        diags: &mut Vec<Diagnostic>,
    ) -> Option<Self> {
        let what = what.into();
        match value.get_ref() {
            DeValue::Table(table) => {
                let t = Table { what, table, loc: doc.loc(&value.span()), allowed };
                t.refuse_unknown(doc, diags);
                Some(t)
            }
            other => {
                diags.push(Diagnostic::error(&doc.loc(&value.span()), format!("{what} must be a table, found {}", other.type_str())));
                None
            }
        }
    }

    fn refuse_unknown(&self, doc: &Doc, diags: &mut Vec<Diagnostic>) {
        for key in self.table.keys() {
            if !self.allowed.contains(&key.get_ref().as_ref()) {
                let allowed = if self.allowed.is_empty() {
                    "no keys are allowed there".to_string()
                } else {
                    format!("allowed keys: {}", self.allowed.join(", "))
                };
                diags
                    .push(Diagnostic::error(&doc.loc(&key.span()), format!("unknown key `{}` in {}; {allowed}", key.get_ref(), self.what)));
            }
        }
    }

    fn get(&self, key: &str) -> Option<&'t Value<'i>> {
        debug_assert!(self.allowed.contains(&key), "schema does not list {key}");
        self.table.get(key)
    }

    fn missing(&self, key: &str, diags: &mut Vec<Diagnostic>) {
        diags.push(Diagnostic::error(&self.loc, format!("{} is missing the required key `{key}`", self.what)));
    }

    fn str(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<(String, Loc)> {
        let v = self.get(key)?;
        match v.get_ref() {
            DeValue::String(s) => Some((s.to_string(), doc.loc(&v.span()))),
            other => {
                diags.push(type_error(doc, v, key, &self.what, "a string", other));
                None
            }
        }
    }

    fn required_str(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<(String, Loc)> {
        if self.get(key).is_none() {
            self.missing(key, diags);
            return None;
        }
        self.str(doc, key, diags)
    }

    fn bool(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<bool> {
        let v = self.get(key)?;
        match v.get_ref() {
            DeValue::Boolean(b) => Some(*b),
            other => {
                diags.push(type_error(doc, v, key, &self.what, "true or false", other));
                None
            }
        }
    }

    fn int(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<(i64, Loc)> {
        let v = self.get(key)?;
        let loc = doc.loc(&v.span());
        match v.get_ref() {
            DeValue::Integer(i) => match i64::from_str_radix(&i.as_str().replace('_', ""), i.radix()) {
                Ok(n) => Some((n, loc)),
                Err(_) => {
                    diags.push(Diagnostic::error(&loc, format!("`{key}` in {} is out of range", self.what)));
                    None
                }
            },
            other => {
                diags.push(type_error(doc, v, key, &self.what, "an integer", other));
                None
            }
        }
    }

    /// An array of strings, each with its location. Absent means empty.
    fn strings(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Option<Vec<(String, Loc)>> {
        let v = self.get(key)?;
        strings_of(doc, v, &format!("`{key}` in {}", self.what), diags)
    }

    /// An array of tables (`[[key]]`), or nothing.
    fn tables(&self, doc: &Doc, key: &str, diags: &mut Vec<Diagnostic>) -> Vec<&'t Value<'i>> {
        let Some(v) = self.get(key) else {
            return Vec::new();
        };
        match v.get_ref() {
            DeValue::Array(items) => items.iter().collect(),
            other => {
                diags.push(type_error(doc, v, key, &self.what, "an array of tables", other));
                Vec::new()
            }
        }
    }
}

fn strings_of(doc: &Doc, v: &Value, what: &str, diags: &mut Vec<Diagnostic>) -> Option<Vec<(String, Loc)>> {
    match v.get_ref() {
        DeValue::Array(items) => {
            let mut out = Vec::new();
            for item in items.iter() {
                match item.get_ref() {
                    DeValue::String(s) => out.push((s.to_string(), doc.loc(&item.span()))),
                    other => diags.push(Diagnostic::error(
                        &doc.loc(&item.span()),
                        format!("{what} must hold only strings, found {}", other.type_str()),
                    )),
                }
            }
            Some(out)
        }
        other => {
            diags.push(Diagnostic::error(&doc.loc(&v.span()), format!("{what} must be an array of strings, found {}", other.type_str())));
            None
        }
    }
}

/// A table whose keys are names the operator chooses, such as `[networks]`.
fn map_of<'t, 'i>(doc: &Doc, what: &str, v: &'t Value<'i>, diags: &mut Vec<Diagnostic>) -> Option<&'t DeTable<'i>> {
    match v.get_ref() {
        DeValue::Table(t) => Some(t),
        other => {
            diags.push(Diagnostic::error(&doc.loc(&v.span()), format!("{what} must be a table, found {}", other.type_str())));
            None
        }
    }
}

fn type_error(doc: &Doc, v: &Value, key: &str, what: &str, want: &str, found: &DeValue) -> Diagnostic {
    Diagnostic::error(&doc.loc(&v.span()), format!("`{key}` in {what} must be {want}, found {}", found.type_str()))
}

fn parse_document<'i>(doc: &Doc, text: &'i str, diags: &mut Vec<Diagnostic>) -> Option<Spanned<DeTable<'i>>> {
    match DeTable::parse(text) {
        Ok(t) => Some(t),
        Err(e) => {
            let loc = e.span().map_or_else(|| doc.start(), |s| doc.loc(&s));
            diags.push(Diagnostic::error(&loc, format!("invalid TOML: {}", e.message().trim_end_matches('\n'))));
            None
        }
    }
}

fn root<'t, 'i>(
    doc: &Doc,
    table: &'t Spanned<DeTable<'i>>,
    what: &str,
    allowed: &'static [&'static str],
    diags: &mut Vec<Diagnostic>,
) -> Table<'t, 'i> {
    let t = Table { what: what.to_string(), table: table.get_ref(), loc: doc.start(), allowed };
    t.refuse_unknown(doc, diags);
    t
}

// ---------------------------------------------------------------------------------------------
// mesh.toml

/// What the parse produced before cross-references are checked. Parts that failed to parse
/// are left out, and the error that says why is already reported.
#[derive(Default)]
struct Parsed {
    mesh: Option<MeshSettings>,
    networks: Vec<Network>,
    groups: Vec<Group>,
    nodes: Vec<Node>,
    modules: Vec<Module>,
    routes: Vec<Route>,
    tests: Vec<PolicyTest>,
    pools: Vec<crate::decl::Pool>,
}

impl Parsed {
    fn finish(self) -> Option<Declaration> {
        Some(Declaration {
            mesh: self.mesh?,
            networks: self.networks,
            groups: self.groups,
            nodes: self.nodes,
            modules: self.modules,
            routes: self.routes,
            tests: self.tests,
            pools: self.pools,
        })
    }
}

const MESH_FILE_KEYS: &[&str] = &["mesh", "networks", "groups", "node", "route", "test", "pool"];
const MESH_KEYS: &[&str] = &["name", "domain", "overlay_ipv4", "overlay_ipv6", "port", "interface", "mtu"];
const NODE_KEYS: &[&str] =
    &["name", "hub", "networks", "groups", "modules", "address_ipv4", "address_ipv6", "endpoint", "public_key", "exit"];
const ROUTE_KEYS: &[&str] = &["name", "prefixes", "via", "masquerade", "allow", "host"];
const ROUTE_HOST_KEYS: &[&str] = &["name", "address"];
const ENDPOINT_KEYS: &[&str] = &["address", "reachable_from"];
const POOL_KEYS: &[&str] = &["name", "size", "networks", "groups", "modules", "ephemeral_after"];
const TEST_KEYS: &[&str] = &["from", "to", "proto", "port", "expect"];
const MODULE_FILE_KEYS: &[&str] = &["module", "allow"];
const MODULE_KEYS: &[&str] = &["name", "description"];
const RULE_KEYS: &[&str] = &["proto", "ports", "from"];

fn parse_mesh(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Parsed {
    let doc = Doc::new(file);
    let mut out = Parsed::default();
    let Some(table) = parse_document(&doc, &file.text, diags) else {
        return out;
    };
    let top = root(&doc, &table, file.path.as_str(), MESH_FILE_KEYS, diags);

    match top.get("mesh") {
        None => diags.push(Diagnostic::error(
            &doc.start(),
            "the declaration has no [mesh] table; add one with at least `name`, `domain` and `overlay_ipv4` or `overlay_ipv6`",
        )),
        Some(v) => out.mesh = Table::new(&doc, "[mesh]", v, MESH_KEYS, diags).and_then(|t| parse_mesh_settings(&doc, &t, diags)),
    }
    if let Some(v) = top.get("networks") {
        if let Some(t) = map_of(&doc, "[networks]", v, diags) {
            // Each network is a table of its own; none takes keys yet, so `internet = {}`.
            for (key, value) in t.iter() {
                let name = key.get_ref().to_string();
                let what = format!("network `{name}`");
                if Table::new(&doc, what, value, &[], diags).is_some() {
                    out.networks.push(Network { name, loc: doc.loc(&key.span()) });
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
                out.nodes.push(node);
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
    for v in top.tables(&doc, "test", diags) {
        if let Some(t) = Table::new(&doc, "[[test]]", v, TEST_KEYS, diags) {
            if let Some(test) = parse_test(&doc, &t, diags) {
                out.tests.push(test);
            }
        }
    }
    out
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
    Some(MeshSettings { name, domain, overlay_ipv4: v4, overlay_ipv6: v6, port, interface, mtu, loc: t.loc.clone() })
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

// ---------------------------------------------------------------------------------------------
// modules/*.toml

fn parse_module(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Module> {
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
    Some(Module { name, allow, loc: header.loc })
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
                format!("source {s:?} must be \"node:NAME\", \"group:NAME\", \"module:NAME\", \"pool:NAME\" or \"mesh\""),
            )),
        }
    }
    Some(sources.into_iter().unzip())
}

// ---------------------------------------------------------------------------------------------
// Cross-references and rules that span the whole mesh

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

/// The checks that span the whole mesh, each adding its diagnostics; `load` sorts them.
fn validate(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    names(decl, diags);
    zone_names(decl, diags);
    let declared = Declared::of(decl);
    groups(decl, &declared, diags);
    for n in &decl.nodes {
        node_references(n, &declared, diags);
        endpoints(n, &decl.mesh, &declared, diags);
    }
    pinned_addresses(decl, diags);
    public_keys(decl, diags);
    module_sources(decl, &declared, diags);
    routes(decl, &declared, diags);
    exits(decl, diags);
    tests(decl, &declared, diags);
    pools(decl, &declared, diags);
}

/// The names declared of each kind, for checking what refers to them.
struct Declared<'d> {
    networks: HashSet<&'d str>,
    groups: HashSet<&'d str>,
    nodes: HashSet<&'d str>,
    modules: HashSet<&'d str>,
    pools: HashSet<&'d str>,
}

impl<'d> Declared<'d> {
    fn of(decl: &'d Declaration) -> Self {
        Declared {
            networks: decl.networks.iter().map(|n| n.name.as_str()).collect(),
            groups: decl.groups.iter().map(|g| g.name.as_str()).collect(),
            nodes: decl.nodes.iter().map(|n| n.name.as_str()).collect(),
            modules: decl.modules.iter().map(|m| m.name.as_str()).collect(),
            pools: decl.pools.iter().map(|p| p.name.as_str()).collect(),
        }
    }
}

/// The names of a set, for a diagnostic that says what could have been meant.
fn listing(set: &HashSet<&str>) -> String {
    let mut v: Vec<&str> = set.iter().copied().collect();
    v.sort_unstable();
    if v.is_empty() {
        "none are declared".to_string()
    } else {
        format!("declared: {}", v.join(", "))
    }
}

/// Every name is a DNS label and unique within its kind.
fn names(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    names_of("network", decl.networks.iter().map(|n| (&n.name, &n.loc)), diags);
    names_of("group", decl.groups.iter().map(|g| (&g.name, &g.loc)), diags);
    names_of("node", decl.nodes.iter().map(|n| (&n.name, &n.loc)), diags);
    names_of("module", decl.modules.iter().map(|m| (&m.name, &m.loc)), diags);
}

fn names_of<'d>(kind: &str, items: impl Iterator<Item = (&'d String, &'d Loc)>, diags: &mut Vec<Diagnostic>) {
    let mut first: HashMap<&str, &Loc> = HashMap::new();
    for (name, loc) in items {
        if !is_dns_label(name) {
            diags.push(Diagnostic::error(
                loc,
                format!("{kind} name {name:?} must be a DNS label: 1-63 of a-z, 0-9 and '-', not starting or ending with '-'"),
            ));
        }
        if let Some(first) = first.get(name.as_str()) {
            diags.push(Diagnostic::error(loc, format!("duplicate {kind} `{name}`: already declared at {first}")));
        } else {
            first.insert(name, loc);
        }
    }
}

/// A module may not take a node's name. Both become names in the mesh's DNS zone
/// (`NAME.DOMAIN`), so one of them would shadow the other; the names of each kind are unique
/// among themselves (`names`), and this is the one rule that spans two kinds.
fn zone_names(decl: &Declaration, diags: &mut Vec<Diagnostic>) {
    let mut nodes: HashMap<&str, &Loc> = HashMap::new();
    for n in &decl.nodes {
        nodes.entry(n.name.as_str()).or_insert(&n.loc);
    }
    for m in &decl.modules {
        if let Some(node) = nodes.get(m.name.as_str()) {
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
        for m in &g.members {
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
    let mut pinned: HashMap<IpAddr, &str> = HashMap::new();
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
    let mut keys: HashMap<PublicKey, &str> = HashMap::new();
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
    let mut zone: HashMap<&str, String> = HashMap::new();
    for n in &decl.nodes {
        zone.entry(n.name.as_str()).or_insert_with(|| format!("node `{}`", n.name));
    }
    for m in &decl.modules {
        zone.entry(m.name.as_str()).or_insert_with(|| format!("module `{}`", m.name));
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
                zone.insert(&h.name, format!("host `{}` of route `{}`", h.name, r.name));
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
    let mut seen = HashSet::new();
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
