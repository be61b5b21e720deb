//! The tables of `mesh.toml` a declaration lists (`[[node]]`, `[[pool]]`, `[acme]`, `[[expose]]`,
//! `[[test]]`, `[[route]]`), each read into its part of the declaration.

use std::net::{IpAddr, SocketAddr};

use super::super::schema::{Doc, Table};
use super::super::validate::is_dns_label;
use super::*;
use crate::diag::{Diagnostic, Loc};

/// A node's or a pool's `networks`, `groups` and `modules`, with where each name is written.
pub(super) fn memberships(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> (Vec<String>, Vec<String>, Vec<String>, NodeRefs) {
    let mut names = |key: &str| -> (Vec<String>, Vec<Loc>) { t.strings(doc, key, diags).unwrap_or_default().into_iter().unzip() };
    let (networks, network_locs) = names("networks");
    let (groups, group_locs) = names("groups");
    let (modules, module_locs) = names("modules");
    (networks, groups, modules, NodeRefs { networks: network_locs, groups: group_locs, modules: module_locs })
}

pub(super) fn parse_node(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Node> {
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

pub(super) fn parse_pool_table(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<crate::decl::Pool> {
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

pub(super) fn parse_acme(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Acme> {
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
pub(super) fn is_hostname(s: &str) -> bool {
    s.len() <= 253 && s.split('.').count() >= 2 && s.split('.').all(is_dns_label)
}

/// A table's `via`, the nodes it goes through, with where each is named: required, and not
/// empty (`empty` says so for the table).
fn via_of(doc: &Doc, t: &Table, empty: &str, diags: &mut Vec<Diagnostic>) -> (Vec<String>, Vec<Loc>) {
    match t.strings(doc, "via", diags) {
        None if t.get("via").is_none() => {
            t.missing("via", diags);
            (Vec::new(), Vec::new())
        }
        Some(list) if list.is_empty() => {
            diags.push(Diagnostic::error(&t.loc, empty));
            (Vec::new(), Vec::new())
        }
        other => other.unwrap_or_default().into_iter().unzip(),
    }
}

pub(super) fn parse_expose(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Exposure> {
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
    let (via, via_locs) = via_of(doc, t, "[[expose]] has an empty `via`: name the ingress node(s) that serve it", diags);
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

pub(super) fn parse_test(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<PolicyTest> {
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

pub(super) fn parse_proto(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Proto> {
    t.required_str(doc, "proto", diags).and_then(|(s, loc)| match Proto::parse(&s) {
        Some(p) => Some(p),
        None => {
            diags.push(Diagnostic::error(&loc, format!("`proto` {s:?} must be \"tcp\", \"udp\" or \"icmp\"")));
            None
        }
    })
}

pub(super) fn parse_route(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Route> {
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
    let (via, via_locs) = via_of(doc, t, "[[route]] has an empty `via`: name the node(s) that route to it", diags);
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
pub(super) fn parse_route_rule(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<RouteRule> {
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
