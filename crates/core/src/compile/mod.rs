//! The compiler: a validated declaration, the known WireGuard keys and the previous address
//! allocation in; every node's plan and file resources out (the types are in `plan`). Pure: no
//! IO, no clock.
//!
//! Given the previous output, a compile takes the first of three paths that applies; all three
//! give the same output, byte for byte (ADR 0010; a property test holds both recompiles equal to
//! a full compile):
//! - `rekey`, a change of keys only (the same declaration: a node enrolled, was re-keyed,
//!   approved or revoked): reads only the names the key set changed since the compile before,
//!   and edits the plans of the changed nodes' partners and of the hubs relaying for them where
//!   the changed keys show; only their `wireguard.conf` is made again. Not when a hub's or a
//!   router's key changed.
//! - `redeclare`, a declaration that keeps the mesh settings, the networks, the hubs (and their
//!   keys) and the routes: indexes it again, then recomputes only the nodes the change can reach
//!   (the changed nodes with their old and new partners, the nodes whose partners, filter blocks,
//!   module blocks or routes changed, the hubs whose relayed nodes changed); every other node
//!   keeps its plan, its files and its paths.
//! - `full`, anything else or no previous output: every plan is made. A plan equal to the one
//!   before keeps its files, and a changed plan makes again only the files whose inputs changed.
//!
//! Every compile keeps a private `Cache` for the next one (`cache`), and the warnings about the
//! compiled mesh are made in `warnings`.

mod cache;
mod full;
mod redeclare;
mod rekey;
mod warnings;

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::alloc::{allocate, allocate_after, Allocation};
use crate::decl::Declaration;
use crate::diag::Diagnostic;
use crate::keys::Keys;
use crate::plan::{FileResource, NodePlan, ZoneBlock};
use crate::render;
use crate::topology::Topology;
use cache::Cache;

/// The paths of the files a node receives, where the agent, the controller and the lab use them.
pub use crate::plan::{
    CA_PEM, DELIVERED, INGRESS_TOML, MESH_ZONE, NFTABLES_CONF, NODE_PEM, NODE_TOML, TRAEFIK_DIR, TRAEFIK_YML, TRUST_TOML, WIREGUARD_CONF,
};
pub use warnings::no_path_message;

/// One node's plan and the files rendered from it.
#[derive(Clone, Debug)]
pub struct NodeOutput {
    /// Shared, so a status can hold every node's plan while the next compile runs: a plan the
    /// compile changes in place is copied first if held (`Arc::make_mut`).
    pub plan: Arc<NodePlan>,
    pub files: Vec<FileResource>,
}

/// The output of a compile: the allocation, every node's output by name, and what the next
/// compile starts from.
#[derive(Clone, Debug)]
pub struct Compiled {
    pub allocation: Allocation,
    pub nodes: BTreeMap<String, NodeOutput>,
    /// Warnings about the compiled mesh: pairs with no path, nodes left out for want of a key.
    pub diagnostics: Vec<Diagnostic>,
    /// Names of the nodes whose files were rendered by this compile (all of them on a first
    /// compile; on a recompile, those whose plan changed). A node not named here has a plan equal
    /// to the one the compile before gave it (a plan made again equal is not named): what
    /// `paths::PairCounts` counts again follows from it.
    pub rendered: Vec<String>,
    /// The filter block of every rule, shared by the plans of the nodes that run its module.
    pub rule_blocks: Vec<Arc<crate::plan::RuleBlock>>,
    /// The zone records of every module some node runs, shared by the plans of the nodes that
    /// may reach it.
    pub zone_blocks: Vec<Arc<ZoneBlock>>,
    /// What the next compile starts from.
    cache: Option<Box<Cache>>,
}

impl Compiled {
    /// Every node's plan, in name order.
    pub fn plans(&self) -> impl Iterator<Item = &NodePlan> {
        self.nodes.values().map(|o| &*o.plan)
    }
}

/// Compiles every node. `previous` is the output of the last compile, if any: its allocation keeps
/// addresses stable, its plans let unchanged nodes keep their files without rendering, and when
/// only keys changed, or the declaration kept the mesh settings, networks, hubs and routes, only
/// the nodes the change reaches are recomputed (`rekey`, `redeclare`). The result is the same as
/// a compile without `previous`, byte for byte.
pub fn compile(
    decl: &Arc<Declaration>,
    keys: &Keys,
    previous_allocation: &Allocation,
    previous: Option<Compiled>,
) -> Result<Compiled, Diagnostic> {
    let mut done = compile_from(decl, keys, previous_allocation, previous)?;
    if let Some(cache) = done.cache.as_mut() {
        cache.keys_seen = Some(keys.seen());
    }
    Ok(done)
}

/// The first of the three paths that applies: a change of keys only, a declaration that keeps
/// the mesh, or a full compile.
fn compile_from(
    decl: &Arc<Declaration>,
    keys: &Keys,
    previous_allocation: &Allocation,
    previous: Option<Compiled>,
) -> Result<Compiled, Diagnostic> {
    let mut previous = match previous {
        Some(p) => match rekey::rekey(decl, keys, p) {
            Recompiled::Done(done) => return Ok(done),
            Recompiled::NotApplicable(p) => Some(p),
        },
        None => None,
    };
    // The same nodes with the same pins in the same pools hold the addresses they held: the
    // previous allocation is the one `allocate` would give again.
    let kept = previous.as_ref().and_then(|p| p.cache.as_ref()).is_some_and(|c| redeclare::same_addressing(decl, &c.decl));
    let allocation = match previous.as_mut() {
        Some(p) if kept => std::mem::take(&mut p.allocation),
        // The allocation before is that of the declaration before: nodes that joined are placed
        // by difference (`allocate_after`).
        Some(p) => match p.cache.as_ref() {
            Some(c) => allocate_after(decl, &c.decl, std::mem::take(&mut p.allocation))?,
            None => allocate(decl, &p.allocation)?,
        },
        None => allocate(decl, previous_allocation)?,
    };
    let before = previous.as_ref().and_then(|p| p.cache.as_ref()).map(|c| c.before(kept));
    let topo = Topology::new_after(decl, &allocation, keys, before);
    let previous = match previous {
        Some(p) => match redeclare::redeclare(decl, &topo, p) {
            Recompiled::Done(mut done) => {
                done.allocation = allocation;
                return Ok(done);
            }
            Recompiled::NotApplicable(p) => Some(p),
        },
        None => None,
    };
    Ok(full::compile(decl, &topo, allocation, previous.as_ref()))
}

/// A plan's files given the node's previous output: none when the plan is the same as before (it
/// keeps its files); else the files, keeping those whose inputs are the same.
fn files_of(plan: &NodePlan, prior: Option<&NodeOutput>) -> Option<Vec<FileResource>> {
    match prior {
        Some(o) if *o.plan == *plan => None,
        prior => Some(render::files(plan, prior.map(|o| (&*o.plan, &o.files[..])))),
    }
}

/// What a recompile from the previous output came to, `rekey`'s or `redeclare`'s.
enum Recompiled {
    Done(Compiled),
    /// The previous output, given back: the change is not one this recompile handles.
    NotApplicable(Compiled),
}
