//! A module manifest (`modules/NAME.toml`) and the rules it and routes allow.

use super::super::schema::{parse_document, root, Doc, Table};
use super::super::SourceFile;
use super::*;
use crate::diag::{Diagnostic, Loc};

pub(in crate::load) fn parse_module(file: &SourceFile, diags: &mut Vec<Diagnostic>) -> Option<Module> {
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

pub(super) fn parse_rule(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<Rule> {
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
pub(super) fn rule_sources(doc: &Doc, t: &Table, diags: &mut Vec<Diagnostic>) -> Option<(Vec<Source>, Vec<Loc>)> {
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
