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
            Source::Expose(e) if topo.decl.exposure(e).is_some_and(|e| e.via.contains(&node.name)) => {
                Some(format!("{s} ({} is its ingress)", node.name))
            }
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
        Path::Direct => {
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
            // Relayed pairs try a direct path through their hub unless declared not to (ADR 0032).
            let off = crate::paths::off(topo.decl);
            let why = [a, b].into_iter().find_map(|x| off.get(topo.name(x)).map(|network| (topo.name(x), *network)));
            reasons.push(match why {
                None => format!(
                    "the pair tries a direct path through hub {h}, which tells each side where it sees the other",
                    h = topo.name(hub)
                ),
                Some((x, None)) => format!("the pair stays on hub {}: {x} is declared `direct = false`", topo.name(hub)),
                Some((x, Some(n))) => format!("the pair stays on hub {}: {x} is on network {n}, declared `direct = false`", topo.name(hub)),
            });
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
        Target::Route(r) => return run_route_test(topo, t, from, r),
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

/// Whether the pools' members, once enrolled, may be among a source's nodes.
fn grows_with_pools(decl: &crate::Declaration, s: &Source) -> bool {
    match s {
        Source::Pool(_) => true,
        Source::Group(g) => decl.pools.iter().any(|p| p.groups.contains(g)),
        Source::Module(m) => decl.pools.iter().any(|p| p.modules.contains(m)),
        Source::Node(_) | Source::Expose(_) | Source::Mesh => false,
    }
}

/// Everything `trellis check` reports beyond parsing: an exhausted pool, failing policy tests,
/// pairs with allowed traffic but no path, and rules whose sources name no node.
pub fn check(decl: &crate::Declaration) -> Vec<Diagnostic> {
    match crate::allocate(decl, &crate::Allocation::default()) {
        Ok(alloc) => check_allocated(decl, &alloc),
        Err(d) => vec![d],
    }
}

/// [`check`] with the addresses already allocated (any allocation of every declared node: no
/// diagnostic names an overlay address), as the controller's apply has them.
pub fn check_allocated(decl: &crate::Declaration, alloc: &crate::Allocation) -> Vec<Diagnostic> {
    checked(&Topology::new(decl, alloc, &Default::default()))
}

/// [`check_allocated`] given what the check before held (`held`, with whether `alloc` is the
/// allocation it was made with): its topology is edited where the declaration changed instead
/// of made again (`Topology::new_after`). Returns what this check holds for the next.
pub fn check_after(
    decl: &std::sync::Arc<crate::Declaration>,
    alloc: &crate::Allocation,
    held: Option<(&crate::topology::Held, bool)>,
) -> (Vec<Diagnostic>, crate::topology::Held) {
    let before = held.map(|(h, allocation_kept)| h.before(allocation_kept));
    let topo = Topology::new_after(decl, alloc, &Default::default(), before);
    (checked(&topo), topo.held(decl))
}

/// What a check says of a topology made with every declared node's addresses.
fn checked(topo: &Topology) -> Vec<Diagnostic> {
    let mut out = run_tests(topo);
    for (a, b) in pathless_pairs(topo) {
        let (na, nb) = (topo.name(a), topo.name(b));
        out.push(Diagnostic::warning(&topo.nodes[a as usize].loc, crate::compile::no_path_message(topo, na, nb)));
    }
    for e in &topo.decl.exposures {
        if e.tls == crate::decl::ExposeTls::Acme && e.listen != 443 {
            out.push(Diagnostic::warning(
                &e.loc,
                format!("exposure `{}` takes ACME certificates but listens on {}: TLS-ALPN-01 validation reaches port 443 only, so the edge must also be reached at 443 through a port forward", e.name, e.listen),
            ));
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

/// Every pair of nodes with allowed traffic (a module's runners and the nodes its rules admit, a
/// route's users and its routers) and no path, once, as positions `(a, b)` with `a < b`, in
/// order. The path follows from the two nodes' classes (`Reach::classes`), so each module and
/// route is looked at class against class, and nodes are named only where two classes have no
/// path: a mesh of 100,000 nodes has millions of pairs with allowed traffic and a few thousand
/// classes.
fn pathless_pairs(topo: &Topology) -> Vec<(u32, u32)> {
    let (class, first) = topo.reach.classes();
    let by_class = |set: &[u32]| {
        let mut members: crate::FastMap<u32, Vec<u32>> = crate::FastMap::default();
        for &a in set {
            members.entry(class[a as usize]).or_default().push(a);
        }
        members.into_iter().collect::<Vec<_>>()
    };
    let mut out = Vec::new();
    let mut across = |xs: &[u32], ys: &[u32]| {
        let (xs, ys) = (by_class(xs), by_class(ys));
        for (cx, xs) in &xs {
            for (cy, ys) in &ys {
                if topo.path(first[*cx as usize], first[*cy as usize], false) != Path::None {
                    continue;
                }
                for &a in xs {
                    out.extend(ys.iter().filter(|&&b| b != a).map(|&b| (a.min(b), a.max(b))));
                }
            }
        }
    };
    let sources = topo.module_sources();
    for ((_, runners), sources) in topo.module_names.iter().zip(&sources) {
        across(runners, sources);
    }
    for r in &topo.routes {
        across(&r.users, &r.via);
    }
    out.sort_unstable();
    out.dedup();
    out
}

/// A policy test to a route: the node uses the route (admitted by a rule, opted in for an exit)
/// through a router it has a direct path with, and a rule that admits it opens the protocol and
/// port.
fn run_route_test(topo: &Topology, t: &PolicyTest, from: u32, name: &str) -> Result<(), Diagnostic> {
    let r = topo.routes.iter().find(|r| r.route.name == name).expect("validated: the route is declared");
    let traffic = match t.port {
        Some(p) => format!("{} {p}", t.proto),
        None => t.proto.to_string(),
    };
    let head = format!("test from node:{} to route:{name} ({traffic}) expects {}", t.from, t.expect.as_str());
    let fail = |msg: String| Err(Diagnostic::error(&t.loc, format!("{head}, but {msg}")));
    let admitting: Vec<usize> = (0..r.route.allow.len()).filter(|&i| r.sources[i].binary_search(&from).is_ok()).collect();
    let opening: Vec<usize> = admitting
        .iter()
        .copied()
        .filter(|&i| {
            let rule = &r.route.allow[i];
            rule.proto.is_none_or(|p| p == t.proto && t.port.is_none_or(|port| rule.ports.iter().any(|x| x.contains(port))))
        })
        .collect();
    let uses = r.users.binary_search(&from).is_ok();
    let reached = r.via.iter().any(|&v| matches!(topo.path(from, v, false), Path::Direct));
    match t.expect {
        Expect::Allow if admitting.is_empty() => fail(format!("no rule of route `{name}` admits {}", t.from)),
        Expect::Allow if !uses => fail(format!("{} does not opt into the exit (`exit = \"{name}\"` on the node)", t.from)),
        Expect::Allow if opening.is_empty() => fail(format!("no rule of route `{name}` that admits {} opens {traffic}", t.from)),
        Expect::Allow if !reached => fail(format!("{} has a direct path with none of the route's routers", t.from)),
        Expect::Deny if uses && reached && !opening.is_empty() => {
            let by: Vec<String> = opening.iter().map(|&i| format!("rule {} ({})", i + 1, r.route.allow[i].loc)).collect();
            fail(format!("the route admits it by {}", by.join(", ")))
        }
        _ => Ok(()),
    }
}

/// What a route does for one node: `target` is `route:NAME`, an address (`192.168.10.5`) or an
/// address and port (`192.168.10.5:443`). Says which router the node sends it to (by the
/// declaration: the first router with a direct path; the controller also needs its key), which
/// rules admit the node and what the router's filter does. `None` when `from` is not a node;
/// an error sentence when the target names no route.
pub fn explain_route(topo: &Topology, from: &str, target: &str) -> Option<Result<String, String>> {
    let a = *topo.index.get(from)?;
    let (route, addr, port) = match target.strip_prefix("route:") {
        Some(name) => match topo.routes.iter().find(|r| r.route.name == name) {
            Some(r) => (r, None, None),
            None => return Some(Err(format!("no route `{name}` is declared"))),
        },
        None => {
            let (addr, port) = match target.parse::<std::net::SocketAddr>() {
                Ok(sa) => (sa.ip(), Some(sa.port())),
                Err(_) => match target.parse::<std::net::IpAddr>() {
                    Ok(ip) => (ip, None),
                    Err(_) => return Some(Err(format!("{target:?} is not a node, `route:NAME`, an address or ADDRESS:PORT"))),
                },
            };
            // The most specific prefix holding the address, as the kernel would choose.
            let best = topo
                .routes
                .iter()
                .filter_map(|r| r.route.prefixes.iter().filter(|p| p.contains(&addr)).map(|p| (p.prefix_len(), r)).max_by_key(|x| x.0))
                .max_by_key(|x| x.0);
            match best {
                Some((_, r)) => (r, Some(addr), port),
                None => return Some(Err(format!("{addr} lies on no declared route; only the overlay is reached through trellis"))),
            }
        }
    };
    let r = route.route;
    let mut s = String::new();
    let prefixes: Vec<String> = r.prefixes.iter().map(|p| p.to_string()).collect();
    let kind = if r.is_exit() { "exit route" } else { "route" };
    let _ = writeln!(s, "{kind} {} ({}) for {from}:", r.name, prefixes.join(", "));
    if route.via.contains(&a) {
        let _ = writeln!(s, "  {from} routes for it itself (it is in `via`)");
        return Some(Ok(s));
    }
    if r.is_exit() && topo.nodes[a as usize].exit.as_ref().is_none_or(|(e, _)| *e != r.name) {
        let _ = writeln!(
            s,
            "  {from} does not opt in (`exit = \"{}\"` on the node), so its internet traffic leaves by its own underlay",
            r.name
        );
        return Some(Ok(s));
    }
    let admitting: Vec<usize> = (0..r.allow.len()).filter(|&i| route.sources[i].binary_search(&a).is_ok()).collect();
    if admitting.is_empty() {
        let _ = writeln!(s, "  no [[route.allow]] of route {} names a source containing {from}: it is not sent this route", r.name);
        return Some(Ok(s));
    }
    let mut chosen = None;
    for &v in &route.via {
        let name = topo.name(v);
        let line = match topo.path(a, v, false) {
            Path::Direct if chosen.is_none() => {
                chosen = Some(v);
                format!(
                    "via {name}: used (the first router {from} has a direct path with; the next takes over if it is revoked or removed)"
                )
            }
            Path::Direct => format!("via {name}: stands by (direct path)"),
            Path::Relay { hub } => {
                format!("via {name}: not used (only relayed through hub {}; a route needs a direct path)", topo.name(hub))
            }
            Path::None => format!("via {name}: not used (no path)"),
        };
        let _ = writeln!(s, "  {line}");
    }
    if chosen.is_none() {
        let _ = writeln!(s, "  {from} has a direct path with none of its routers: the route is not installed on it");
    }
    let mut admits_target = None;
    for i in admitting {
        let rule = &r.allow[i];
        let what = match rule.proto {
            None => "any protocol".to_string(),
            Some(Proto::Icmp) => "icmp".to_string(),
            Some(p) => format!("{p} {}", rule.ports.iter().map(|x| x.to_string()).collect::<Vec<_>>().join(", ")),
        };
        let fits = port.is_none_or(|p| rule.proto.is_none() || rule.ports.iter().any(|x| x.contains(p)));
        if fits && admits_target.is_none() {
            admits_target = Some(i + 1);
        }
        let from_list: Vec<String> = rule.from.iter().map(|x| x.to_string()).collect();
        let _ = writeln!(s, "  rule {} ({}): {what} from {}", i + 1, rule.loc, from_list.join(", "));
    }
    let nat = if r.masquerade {
        ", masquerading to the router's own address"
    } else {
        ", keeping the overlay source address (the LAN needs a route back)"
    };
    match (addr, port) {
        (Some(addr), Some(p)) if admits_target.is_some() => {
            let n = admits_target.unwrap_or_default();
            let _ = writeln!(s, "  the router's forward filter accepts {from} -> {addr}:{p} by rule {n}{nat}");
        }
        (Some(addr), Some(p)) => {
            let _ = writeln!(s, "  the router's forward filter drops {from} -> {addr}:{p}: no rule that admits {from} opens that port");
        }
        _ => {
            let _ = writeln!(s, "  the router's forward filter accepts what these rules name and drops the rest{nat}");
        }
    }
    Some(Ok(s))
}

/// What an exposure does (`expose:NAME`): which ingress nodes serve it and how each reaches the
/// backends, which runners are the backends (those with a key, when `keyed` is known), and which
/// rule admits the edge. `None` when no exposure has that name.
pub fn explain_exposure(topo: &Topology, name: &str) -> Option<String> {
    let e = topo.exposures.iter().find(|e| e.exposure.name == name)?;
    let x = e.exposure;
    let mut s = String::new();
    let sources: Vec<String> = x.sources.iter().map(|p| p.to_string()).collect();
    let _ = writeln!(
        s,
        "exposure {} ({}): port {} of module {} on {} for clients from {}, tls {}",
        x.name,
        x.hostnames.join(", "),
        x.port,
        x.module,
        x.listen,
        sources.join(", "),
        x.tls
    );
    let via: Vec<&str> = e.via.iter().map(|&v| topo.name(v)).collect();
    let _ = writeln!(s, "  ingress nodes (each runs Traefik): {}", via.join(", "));
    if e.runners.is_empty() {
        let _ = writeln!(s, "  backends: none: no node runs module {}, so the edge answers 503", x.module);
    } else {
        let runners: Vec<&str> = e.runners.iter().map(|&r| topo.name(r)).collect();
        let _ = writeln!(s, "  backends: the runners of module {} that hold a key: {}", x.module, runners.join(", "));
    }
    let me = Source::Expose(x.name.clone());
    for r in topo.rules.iter().filter(|r| r.module == x.module && r.rule.from.contains(&me)) {
        let ports: Vec<String> = r.rule.ports.iter().map(|p| p.to_string()).collect();
        let _ = writeln!(
            s,
            "  admitted by module {} rule {} ({}): {} {} from {me}",
            r.module,
            r.number,
            r.rule.loc,
            r.rule.proto,
            ports.join(", ")
        );
    }
    for &v in &e.via {
        for &b in &e.runners {
            if v == b {
                continue;
            }
            let how = match topo.path(v, b, false) {
                Path::Direct => "direct".to_string(),
                Path::Relay { hub } => format!("relayed through hub {}", topo.name(hub)),
                Path::None => "no path: this backend is unreachable from this edge (see `trellis explain`)".to_string(),
            };
            let _ = writeln!(s, "  {} -> {}: {how}", topo.name(v), topo.name(b));
        }
    }
    Some(s)
}
