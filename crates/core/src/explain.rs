//! Answers about the policy: why two nodes connect the way they do, what the filter lets
//! through between them, and whether the declared policy tests hold.

use std::fmt::Write;

use crate::decl::{Expect, PolicyTest, Proto, Source, Target};
use crate::diag::{Diagnostic, Loc};
use crate::topology::{Path, ResolvedRule, Topology};

/// Why two nodes connect the way they do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Explanation {
    pub from: String,
    pub to: String,
    /// "direct", "relayed" or "none".
    pub path: &'static str,
    pub hub: Option<String>,
    /// Sentences saying why, one per line.
    pub reasons: Vec<String>,
    pub forward: Vec<RuleMatch>,
    pub reverse: Vec<RuleMatch>,
}

/// A rule that lets traffic through in one direction.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuleMatch {
    pub module: String,
    pub rule: usize,
    pub at: Loc,
    pub proto: Proto,
    pub ports: Vec<String>,
    /// The sources of the rule that contain the sending node, with how.
    pub matched: Vec<String>,
}

impl Explanation {
    pub fn to_text(&self) -> String {
        let mut s = String::new();
        let _ = match (&self.path, &self.hub) {
            (&"relayed", Some(h)) => writeln!(s, "path {} <-> {}: relayed through hub {h}", self.from, self.to),
            (p, _) => writeln!(s, "path {} <-> {}: {p}", self.from, self.to),
        };
        for r in &self.reasons {
            let _ = writeln!(s, "  {r}");
        }
        for (a, b, rules) in [(&self.from, &self.to, &self.forward), (&self.to, &self.from, &self.reverse)] {
            if rules.is_empty() {
                let _ = writeln!(s, "traffic {a} -> {b}: nothing allowed (no rule on {b} names a source containing {a})");
                continue;
            }
            let _ = writeln!(s, "traffic {a} -> {b}:");
            for m in rules {
                let what = if m.proto == Proto::Icmp { "icmp".to_string() } else { format!("{} {}", m.proto, m.ports.join(", ")) };
                let _ = writeln!(s, "  {what}: module {} rule {} ({}) via {}", m.module, m.rule, m.at, m.matched.join(", "));
            }
        }
        s
    }
}

fn names(list: &[String]) -> String {
    if list.is_empty() {
        "no network".to_string()
    } else {
        format!("[{}]", list.join(", "))
    }
}

/// Says why `a` can or cannot dial `b`, in one sentence.
fn dial_reason(topo: &Topology, a: u32, b: u32) -> String {
    let (na, nb) = (topo.nodes[a as usize], topo.nodes[b as usize]);
    match topo.dials(a, b) {
        Some(e) => {
            let ep = &nb.endpoints[e];
            let common: Vec<String> = na.networks.iter().filter(|n| ep.reachable_from.contains(n)).cloned().collect();
            format!(
                "{} dials {} at {} (it sits on {}, which that endpoint is reachable from)",
                na.name,
                nb.name,
                ep.address,
                names(&common)
            )
        }
        None if nb.endpoints.is_empty() => format!("{} cannot dial {}: {} declares no endpoint", na.name, nb.name, nb.name),
        None => {
            let eps: Vec<String> =
                nb.endpoints.iter().map(|e| format!("{} reachable from {}", e.address, names(&e.reachable_from))).collect();
            format!(
                "{} cannot dial {}: it sits on {}, and {}'s endpoints are {}",
                na.name,
                nb.name,
                names(&na.networks),
                nb.name,
                eps.join("; ")
            )
        }
    }
}

fn matches(topo: &Topology, from: u32, r: &ResolvedRule) -> RuleMatch {
    let node = topo.nodes[from as usize];
    let matched = r
        .rule
        .from
        .iter()
        .filter_map(|s| match s {
            Source::Node(n) if *n == node.name => Some(s.to_string()),
            Source::Group(g) if topo.groups.get(g.as_str()).is_some_and(|m| m.binary_search(&from).is_ok()) => {
                Some(format!("{s} ({} is a member)", node.name))
            }
            Source::Module(m) if node.modules.contains(m) => Some(format!("{s} ({} runs it)", node.name)),
            Source::Pool(p) if node.pool.as_ref() == Some(p) => Some(format!("{s} ({} is a member)", node.name)),
            Source::Mesh => Some("mesh".to_string()),
            _ => None,
        })
        .collect();
    RuleMatch {
        module: r.module.to_string(),
        rule: r.number,
        at: r.rule.loc.clone(),
        proto: r.rule.proto,
        ports: r.rule.ports.iter().map(|p| p.to_string()).collect(),
        matched,
    }
}

/// Explains the path and the allowed traffic between two nodes. Keys are not considered: this
/// is the declared topology.
pub fn explain(topo: &Topology, from: &str, to: &str) -> Option<Explanation> {
    let (a, b) = (*topo.index.get(from)?, *topo.index.get(to)?);
    let allowed = |x: u32, y: u32| -> Vec<RuleMatch> {
        topo.inbound_rules(y).map(|(_, r)| r).filter(|r| r.sources.binary_search(&x).is_ok()).map(|r| matches(topo, x, r)).collect()
    };
    let forward = allowed(a, b);
    let reverse = allowed(b, a);
    let mut reasons = Vec::new();
    let (path, hub) = match topo.path(a, b, false) {
        Path::Direct { .. } => {
            reasons.push(dial_reason(topo, a, b));
            reasons.push(dial_reason(topo, b, a));
            ("direct", None)
        }
        Path::Relay { hub } => {
            reasons.push(dial_reason(topo, a, b));
            reasons.push(dial_reason(topo, b, a));
            for x in [a, b] {
                let r = if topo.dials(x, hub).is_some() { dial_reason(topo, x, hub) } else { dial_reason(topo, hub, x) };
                reasons.push(r);
            }
            ("relayed", Some(topo.name(hub).to_string()))
        }
        Path::None => {
            reasons.push(dial_reason(topo, a, b));
            reasons.push(dial_reason(topo, b, a));
            if topo.hubs.is_empty() {
                reasons.push("the mesh declares no hub that could relay".to_string());
            }
            for &h in &topo.hubs {
                if h == a || h == b {
                    continue;
                }
                let lacking: Vec<&str> = [a, b].into_iter().filter(|&x| !topo.direct(x, h)).map(|x| topo.name(x)).collect();
                reasons.push(format!("hub {} cannot relay: no direct path with {}", topo.name(h), lacking.join(" or ")));
            }
            ("none", None)
        }
    };
    if forward.is_empty() && reverse.is_empty() {
        reasons.push("no rule allows traffic either way, so they are not peers".to_string());
    }
    Some(Explanation { from: from.to_string(), to: to.to_string(), path, hub, reasons, forward, reverse })
}

/// Evaluates every `[[test]]`; a failing test becomes an error that names it, its traffic and
/// what the policy actually does.
pub fn run_tests(topo: &Topology) -> Vec<Diagnostic> {
    topo.decl.tests.iter().filter_map(|t| run_test(topo, t).err()).collect()
}

fn run_test(topo: &Topology, t: &PolicyTest) -> Result<(), Diagnostic> {
    let from = topo.index[t.from.as_str()];
    let targets: Vec<u32> = match &t.to {
        Target::Node(n) => vec![topo.index[n.as_str()]],
        Target::Module(m) => topo.runners[m.as_str()].clone(),
    };
    let traffic = match t.port {
        Some(p) => format!("{} {p}", t.proto),
        None => t.proto.to_string(),
    };
    let head = format!("test from node:{} to {} ({traffic}) expects {}", t.from, t.to, t.expect.as_str());
    let fail = |msg: String| Err(Diagnostic::error(&t.loc, format!("{head}, but {msg}")));
    if targets.is_empty() {
        return match t.expect {
            Expect::Allow => fail(format!("{} runs on no node", t.to)),
            Expect::Deny => Ok(()),
        };
    }
    for to in targets.into_iter().filter(|&x| x != from) {
        let rules = topo.admitting(from, to, t.proto, t.port);
        let path = topo.path(from, to, false);
        let to_name = topo.name(to);
        match t.expect {
            Expect::Allow if rules.is_empty() => {
                let mods: Vec<&str> = topo.nodes[to as usize].modules.iter().map(String::as_str).collect();
                return fail(format!(
                    "the policy denies it on {to_name}: no rule of its modules [{}] admits {} on {traffic}",
                    mods.join(", "),
                    t.from
                ));
            }
            Expect::Allow if path == Path::None => {
                return fail(format!("the filter on {to_name} admits it and there is no path between {} and {to_name}", t.from));
            }
            Expect::Deny if !rules.is_empty() => {
                let by: Vec<String> = rules.iter().map(|r| format!("module {} rule {} ({})", r.module, r.number, r.rule.loc)).collect();
                return fail(format!("the policy allows it on {to_name} by {}", by.join(", ")));
            }
            _ => {}
        }
    }
    Ok(())
}

/// Everything `trellis check` reports beyond parsing: an exhausted pool, failing policy tests,
/// pairs with allowed traffic but no path, and rules whose sources name no node.
/// Whether the pools' members, once enrolled, may be among a source's nodes.
fn grows_with_pools(decl: &crate::Declaration, s: &Source) -> bool {
    match s {
        Source::Pool(_) => true,
        Source::Group(g) => decl.pools.iter().any(|p| p.groups.contains(g)),
        Source::Module(m) => decl.pools.iter().any(|p| p.modules.contains(m)),
        Source::Node(_) | Source::Mesh => false,
    }
}

pub fn check(decl: &crate::Declaration) -> Vec<Diagnostic> {
    let alloc = match crate::allocate(decl, &crate::Allocation::default()) {
        Ok(a) => a,
        Err(d) => return vec![d],
    };
    let topo = Topology::new(decl, &alloc, &Default::default());
    let mut out = run_tests(&topo);
    for (a, partners) in topo.partners().iter().enumerate() {
        for &b in partners.iter().filter(|&&b| b > a as u32) {
            if topo.path(a as u32, b, false) == Path::None {
                let (na, nb) = (topo.name(a as u32), topo.name(b));
                out.push(Diagnostic::warning(&topo.nodes[a].loc, crate::compile::no_path_message(&topo, na, nb)));
            }
        }
    }
    for r in &topo.rules {
        // A pool's members join when they enrol, so a rule naming a pool, or a group or module
        // its members join, may admit nobody yet.
        if r.sources.is_empty() && !r.rule.from.iter().any(|s| grows_with_pools(topo.decl, s)) {
            out.push(Diagnostic::warning(
                &r.rule.loc,
                format!("rule {} of module `{}` names sources that contain no node; it admits nothing", r.number, r.module),
            ));
        }
    }
    crate::diag::sort(&mut out);
    out
}
