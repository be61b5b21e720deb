//! The warnings about a compiled mesh: pairs of nodes with allowed traffic but no path, and
//! nodes left out of peer lists for want of a key; made whole by a compile, or edited one by one
//! by `rekey`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use super::cache::Cache;
use super::NodeOutput;
use crate::diag::Diagnostic;
use crate::plan::NodePlan;
use crate::topology::{Path, Reach, Topology};

/// Whether a plan names a node left out for want of a key, or one without a path: the warnings
/// come from such plans only.
fn warns(plan: &NodePlan) -> bool {
    !plan.left_out.is_empty() || !plan.no_path.is_empty()
}

/// The nodes whose plans warn (`Cache::warned`), of every plan.
pub(super) fn warned<'p>(plans: impl Iterator<Item = &'p NodePlan>) -> BTreeSet<Arc<str>> {
    plans.filter(|p| warns(p)).map(|p| p.node.clone()).collect()
}

/// `warned` kept up to date after a recompile: the nodes that left (`gone`), and those whose
/// plans were made again (`rendered`), are looked at; every other plan is the one before.
pub(super) fn rewarn(warned: &mut BTreeSet<Arc<str>>, nodes: &BTreeMap<String, NodeOutput>, gone: &[&Arc<str>], rendered: &[String]) {
    for name in gone {
        warned.remove(&***name);
    }
    for name in rendered {
        let plan = &nodes[name].plan;
        match warns(plan) {
            true => warned.insert(plan.node.clone()),
            false => warned.remove(&*plan.node),
        };
    }
}

/// The warnings of a compiled mesh, sorted, from its plans: every plan, or those of the nodes
/// that warn (`warned`).
pub(super) fn diagnostics<'p>(plans: impl Iterator<Item = &'p NodePlan> + Clone, c: &Cache) -> Vec<Diagnostic> {
    let mut diagnostics = path_diagnostics(plans.clone(), c);
    diagnostics.extend(left_out_diagnostics(plans, |b| c.loc(c.kept.index[b])));
    crate::diag::sort(&mut diagnostics);
    diagnostics
}

/// Puts a warning into the sorted warnings (`diag::sort`) or takes it out.
pub(super) fn set_diagnostic(diagnostics: &mut Vec<Diagnostic>, d: Diagnostic, present: bool) {
    let at = diagnostics.binary_search_by(|x| (&x.loc, x.severity, &x.message).cmp(&(&d.loc, d.severity, &d.message)));
    match (at, present) {
        (Err(i), true) => diagnostics.insert(i, d),
        (Ok(i), false) => drop(diagnostics.remove(i)),
        _ => {}
    }
}

/// Warnings about pairs of nodes with allowed traffic but no path, once per pair (reported by
/// the node whose name sorts first, when the other has a key).
pub(super) fn path_diagnostics<'p>(plans: impl Iterator<Item = &'p NodePlan>, c: &Cache) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    for p in plans {
        for b in &p.no_path {
            if *p.node < **b {
                let (ia, ib) = (c.kept.index[&p.node], c.kept.index[b]);
                let message = no_path_text(&c.reach, &p.node, b, c.reach.path(ia, ib, false), |h| &c.names[h as usize]);
                out.push(Diagnostic::warning(&c.loc(ia), message));
            }
        }
    }
    out
}

/// A warning for every node left out of peer lists for want of a key, with how many lists.
pub(super) fn left_out_diagnostics<'p>(plans: impl Iterator<Item = &'p NodePlan>, loc: impl Fn(&str) -> crate::Loc) -> Vec<Diagnostic> {
    // Counted by hash and sorted once: before a mesh enrols, every node is left out of every
    // partner's list, millions of names at 100,000 nodes.
    let mut wanted_by: crate::FastMap<&str, usize> = crate::FastMap::default();
    for p in plans {
        for b in &p.left_out {
            *wanted_by.entry(b).or_default() += 1;
        }
    }
    let mut wanted_by: Vec<(&str, usize)> = wanted_by.into_iter().collect();
    wanted_by.sort_unstable();
    wanted_by.into_iter().map(|(b, count)| left_out_warning(b, count, &loc(b))).collect()
}

/// The warning for a node left out of `count` peer lists for want of a key.
pub(super) fn left_out_warning(name: &str, count: usize, loc: &crate::Loc) -> Diagnostic {
    Diagnostic::warning(
        loc,
        format!("node `{name}` has no public key yet (not enrolled); it is left out of the peer lists of {count} node(s) until it has one"),
    )
}

/// Why two nodes with allowed traffic have no path.
pub fn no_path_message(topo: &Topology, a: &str, b: &str) -> String {
    no_path_text(&topo.reach, a, b, topo.path(topo.index[a], topo.index[b], false), |h| topo.name(h))
}

/// The text of `no_path_message`, given the path the two would have if every hub had a key.
pub(super) fn no_path_text<'n>(reach: &Reach, a: &str, b: &str, keyless: Path, name: impl Fn(u32) -> &'n str) -> String {
    if let Path::Relay { hub } = keyless {
        return format!(
            "no path between `{a}` and `{b}` yet: hub `{}` could relay for them but has no public key yet (not enrolled)",
            name(hub)
        );
    }
    let hubs =
        if reach.hubs.is_empty() { "the mesh declares no hub".to_string() } else { "no declared hub can be reached by both".to_string() };
    format!("no path between `{a}` and `{b}`: neither can dial an endpoint of the other and {hubs}; declare an endpoint reachable from the other's networks, or a hub both can reach")
}
