//! Rendering plans into the files a node receives, one file per kind: `wireguard.conf` and its
//! parts (`wireguard`), `nftables.conf` and its parts (`ruleset`), `mesh.zone` and its parts
//! (`zone`), and `node.toml` here; and the texts plans share, made once (`NodeText::new`,
//! `NodeText::peer_block`, `PeerPlan::new`, the rule, route and zone blocks). `files` puts a
//! node's files together, keeping those whose inputs did not change.

use std::sync::Arc;

use crate::nodefile::{Comments, NodeFile};
use crate::plan::{FileResource, NodePlan, NodeText, INGRESS_TOML, NODE_TOML, TRAEFIK_YML};
use crate::text::Text;

mod ruleset;
mod wireguard;
mod zone;

pub use ruleset::{nftables, nftables_files, route_block, rule_block, ruleset_parted};
pub use wireguard::{peer_block, relay_lines, wireguard_files, wireguard_files_changed};
pub use zone::{
    host_records, module_records, module_records_from, with_serial, zone, zone_files, zone_parted, zone_parts, zone_records, RunnerBefore,
};

/// The files of `plan`, given the node's previous plan and files if there are any: a file whose
/// inputs are the same as before is kept, the others are made.
pub fn files(plan: &NodePlan, prior: Option<(&NodePlan, &[FileResource])>) -> Vec<FileResource> {
    let prior_file = |path: &str| prior.and_then(|(_, files)| files.iter().find(|f| f.path == path)).map(|f| &f.content);
    // A file is kept when the previous plan gave the same inputs to it.
    let kept = |path: &str, same: fn(&NodePlan, &NodePlan) -> bool| {
        prior.filter(|(q, _)| plan.node == q.node && plan.common == q.common && same(plan, q)).and_then(|_| prior_file(path).cloned())
    };
    let wireguard_same: fn(&NodePlan, &NodePlan) -> bool =
        |p, q| (p.ipv4, p.ipv6, &p.peers, &p.left_out, &p.no_path) == (q.ipv4, q.ipv6, &q.peers, &q.left_out, &q.no_path);
    let nftables_same: fn(&NodePlan, &NodePlan) -> bool = |p, q| (&p.rules, &p.routes_for) == (&q.rules, &q.routes_for);
    let zone_same: fn(&NodePlan, &NodePlan) -> bool =
        |p, q| (&p.zone, &p.zone_modules, &p.zone_routes) == (&q.zone, &q.zone_modules, &q.zone_routes);
    let toml_same: fn(&NodePlan, &NodePlan) -> bool = |p, q| (p.hub, &p.routes_for, &p.routed) == (q.hub, &q.routes_for, &q.routed);
    let file = |path: &str, mode: u32, content: Text| FileResource { path: path.into(), mode, content };
    let ingress_same: fn(&NodePlan, &NodePlan) -> bool = |p, q| (&p.ingress, &p.acme) == (&q.ingress, &q.acme);
    // A file in parts is kept together (ADR 0039, 0043, 0044): the main file and its parts, when
    // the previous plan gave the same inputs to them all, else all made.
    let together = |same: fn(&NodePlan, &NodePlan) -> bool, of: fn(&str) -> bool, make: &dyn Fn() -> Vec<FileResource>| match prior
        .filter(|(q, _)| plan.node == q.node && plan.common == q.common && same(plan, q))
    {
        Some((_, before)) => before.iter().filter(|f| of(&f.path)).cloned().collect(),
        None => make(),
    };
    let mut files = together(wireguard_same, crate::plan::is_wireguard, &|| wireguard_files(plan, prior_file));
    // The parts of the peers go last, where a recompile of the peers alone puts them (`rekey`).
    let parts = files.split_off(1);
    files.extend(together(nftables_same, crate::plan::is_ruleset, &|| nftables_files(plan)));
    files.extend(together(zone_same, crate::plan::is_zone, &|| zone_files(plan, prior_file)));
    files.push(file(NODE_TOML, 0o644, kept(NODE_TOML, toml_same).unwrap_or_else(|| node_toml(plan).into())));
    // Only an ingress node has Traefik's files (ADR 0026).
    if !plan.ingress.is_empty() {
        let ingress = || crate::traefik::IngressFile::of(plan).write().into();
        files.push(file(INGRESS_TOML, 0o644, kept(INGRESS_TOML, ingress_same).unwrap_or_else(ingress)));
        files.push(file(TRAEFIK_YML, 0o644, kept(TRAEFIK_YML, ingress_same).unwrap_or_else(|| crate::traefik::dynamic(plan).into())));
    }
    files.extend(parts);
    files
}

/// What the agent needs to know about its own node beyond the three files: the interface, the
/// zone's name, and whether it relays for others (a hub forwards between overlay peers).
/// A router also says so (it forwards from the overlay to its routes), and a node that uses
/// routes lists the prefixes it sends into the overlay and whether it uses an exit.
pub fn node_toml(plan: &NodePlan) -> String {
    let c = &plan.common;
    let file = NodeFile {
        node: plan.node.to_string(),
        mesh: c.mesh.clone(),
        interface: c.interface.clone(),
        zone: c.domain.clone(),
        hub: plan.hub,
        router: !plan.routes_for.is_empty(),
        routes: plan.routed.iter().filter(|r| !r.exit).flat_map(|r| r.prefixes.iter().copied()).collect(),
        exit: plan.routed.iter().any(|r| r.exit),
    };
    let comments = Comments {
        forwards_to: plan.routes_for.iter().map(|r| &*r.route.name).collect(),
        exit_through: plan.routed.iter().find(|r| r.exit).map(|r| &*r.name),
    };
    file.write(&comments)
}

/// Whether a run of peers' sections, or of a zone's records, ends after this node: for about one
/// node in 64, the same as long as the node's text is held (a hash of its address).
fn ends_run(node: &Arc<NodeText>) -> bool {
    let at = Arc::as_ptr(node) as usize as u64;
    (at >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 58 == 0
}
