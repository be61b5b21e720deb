//! The deciding half of a publish run, pure: no store, no tokio, no clock. Given the records,
//! the declaration with its pools' members, what the previous run kept and the trust in force, a
//! `RunPlan`: the compiled mesh, which nodes are due (their plan was rendered again, their
//! certificate or the trust moved, another replica's version is in force, or no bundle is held
//! for them, or the run before put them off), and who held what a revocation, a removal or a
//! withdrawal of routes takes away. `run` reads its inputs and carries it out, assembling the due
//! bundles' files and digests (`assembled`) in stages (ADR 0042).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use trellis_core::bundle::{assemble, entries, Listed, Shared};
use trellis_core::decl::PublicKey;
use trellis_core::{Allocation, Compiled, Declaration, Text};
use trellis_store::NodeRecord;

use crate::revocations::{carried, holders_as_if_active, holders_in, holds, withdrawn, Carried, Left};
use crate::{Error, Result};

/// Compiled file contents, each hashed once: an entry lives as long as the compiled output holds
/// its content (it keeps the content alive, so its address names it), so a file a recompile left
/// unchanged is not hashed again when its bundle is signed again.
#[derive(Default)]
pub(crate) struct Contents(HashMap<usize, (Text, [u8; 32])>);

impl Contents {
    /// Hashes, on every core, the contents of `compiled`'s files for these nodes that are not
    /// held yet.
    pub(crate) fn add(&mut self, compiled: &Compiled, nodes: &[&str]) {
        let mut new: Vec<Text> = Vec::new();
        let mut ids = HashSet::new();
        for n in nodes {
            for f in &compiled.nodes[*n].files {
                if !self.0.contains_key(&f.content.id()) && ids.insert(f.content.id()) {
                    new.push(f.content.clone());
                }
            }
        }
        let digests = trellis_core::par::map(new.len(), |i| new[i].sha256());
        for (content, digest) in new.into_iter().zip(digests) {
            self.0.insert(content.id(), (content, digest));
        }
    }

    /// The SHA-256 of a content `add` holds.
    pub(crate) fn digest(&self, content: &Text) -> [u8; 32] {
        self.0[&content.id()].1
    }

    /// Forgets the contents the compiled output no longer holds.
    pub(crate) fn keep_only(&mut self, compiled: &Compiled) {
        let live: HashSet<usize> = compiled.nodes.values().flat_map(|o| o.files.iter()).map(|f| f.content.id()).collect();
        self.0.retain(|k, _| live.contains(k));
    }
}

/// What a run keeps for the next: its compiled output and keys, what it published, where it
/// stood in the audit chain, and what the next plan compares with.
#[derive(Default)]
pub(crate) struct Run {
    pub(crate) compiled: Option<Compiled>,
    /// The active nodes' keys, kept across runs and changed in place: the compiler reads only the
    /// names changed since the last run.
    pub(crate) keys: trellis_core::Keys,
    /// Per node: the digest last published and the serial of the certificate it carried.
    pub(crate) published: trellis_core::FastMap<String, (String, Option<String>)>,
    /// Each node's certificate as last read, with its serial (`Store::cert_pems`): a run reads
    /// the records without them, and only those whose serial moved (a new one is a new serial).
    pub(crate) certs: HashMap<String, trellis_store::SerialAndCert>,
    /// Every node's record (without its certificate) as of a change number, kept from the last
    /// read (ADR 0036): the next run reads only the records written since.
    pub(crate) records: Option<(trellis_store::RecordsRead, Vec<NodeRecord>)>,
    pub(crate) audit_head: i64,
    /// Hashed file contents, kept across runs.
    pub(crate) contents: Contents,
    /// Nodes whose stored version is not the one held here: the next run publishes them again.
    pub(crate) lagging: HashSet<String>,
    /// Nodes due whose bundles the run before put off while enrolments waited (ADR 0042), oldest
    /// first: the next run publishes them, before the rest.
    pub(crate) deferred: Vec<String>,
    /// The stored versions (`Store::bundle_versions`) last seen to match the ones held here.
    pub(crate) versions_seen: Option<(i64, i64)>,
    /// The declaration the auth table was last made with (`Publisher::set_auth`), from the
    /// records as they were read then.
    pub(crate) auth_for: Option<std::sync::Arc<trellis_core::Declaration>>,
    /// Who held the key of each node that left the compiled mesh in the last run.
    pub(crate) left: Left,
    /// The declaration revision the last run compiled, and its hubs: routes and hubs change
    /// with it.
    pub(crate) revision: Option<i64>,
    pub(crate) hubs: HashSet<String>,
    /// The `trust.toml` every bundle of the last run carried: when it changes, every node is
    /// published again.
    pub(crate) trust: String,
    /// The `paths.toml` each node's bundle carried (ADR 0032): a node whose candidates moved is
    /// published again.
    pub(crate) paths: HashMap<String, String>,
    /// The peers each node's `paths.toml` named: a node that may reach a revoked one directly
    /// holds its key as much as one whose `wireguard.conf` names it (ADR 0022).
    pub(crate) candidates: HashMap<String, Vec<String>>,
    /// The endpoints each pair that tried or was direct had: a direct pair keeps them when its
    /// hub loses sight of a side.
    pub(crate) endpoints: HashMap<(String, String), (std::net::SocketAddr, std::net::SocketAddr)>,
    /// The relayed pairs each plan names, counted again only for the plans a compile rendered.
    pub(crate) pair_counts: trellis_core::paths::PairCounts,
    /// The declaration the last plan was made with, and where its active nodes were among the
    /// records it was given: the same records under a declaration of the same nodes (a group
    /// moved, a rule changed) have the same active nodes, with the keys the set holds.
    pub(crate) planned_for: Option<Arc<Declaration>>,
    pub(crate) active_at: Vec<u32>,
    /// Whether the last run found another replica's content in force for a node it found due
    /// (stale): that node was not swapped in, so what `published` holds of it (its certificate's
    /// serial) is behind, and the next plan looks at every active node.
    pub(crate) stale: bool,
}

/// Whether two declarations name the same nodes, each of the same pool, in the same places.
fn same_nodes(a: &Declaration, b: &Declaration) -> bool {
    a.nodes.len() == b.nodes.len() && a.nodes.iter().zip(&b.nodes).all(|(x, y)| Arc::ptr_eq(x, y) || (x.name == y.name && x.pool == y.pool))
}

impl Run {
    /// Keeps what the next run compares with: the compiled output, who left, the hubs, the
    /// contents still compiled, the direct candidates and their endpoints; nothing lags behind
    /// another replica any more. Returns the plan's relayed pairs, for status.
    pub(crate) fn keep(&mut self, plan: RunPlan) -> trellis_core::paths::Relayed {
        self.paths = plan.paths;
        self.candidates = plan.candidates;
        self.endpoints = plan.endpoints;
        self.hubs = plan.hubs;
        self.left = plan.left;
        self.contents.keep_only(&plan.compiled);
        self.lagging.clear();
        self.compiled = Some(plan.compiled);
        plan.pairs
    }
}

/// What a plan is given besides the previous run: the records it answers with (`'r`), and the
/// rest, read only while it plans.
pub(crate) struct Inputs<'r, 'a> {
    /// Every node's record, as the run read them.
    pub records: &'r [NodeRecord],
    /// Whether they are the records the last plan was given, in the same order (none written
    /// since, read by difference). The records kept are those of the last run that finished,
    /// which planned with them; a run without a declaration keeps its records without a plan
    /// and forgets `Run::planned_for`, so the next plan reads them again.
    pub records_unchanged: bool,
    /// The current declaration with its pools' members, and its revision.
    pub decl: &'a Arc<Declaration>,
    pub revision: i64,
    /// The mesh's nodes by name, with the pool of each member: a record is taken for the node of
    /// its name only if it is of the same kind.
    pub declared: &'a HashMap<&'a str, Option<&'a str>>,
    /// The revocations and removals whose holders no run recorded yet.
    pub unrecorded: &'a [String],
    /// The stored addresses, for a first compile (a recompile keeps its previous output's).
    pub allocation: Allocation,
    /// The `trust.toml` this run delivers.
    pub trust: &'a str,
    /// Whether a bundle of this node is held (in the table the long-polls read), and how many
    /// are (the table holds active nodes' only).
    pub held: &'a dyn Fn(&str) -> bool,
    pub held_count: usize,
    /// What hubs observed and how pairs stand, for direct paths (ADR 0032).
    pub paths: &'a crate::paths::PathInputs,
}

/// A node's certificate by its name (the records are read without it).
type Cert<'a> = &'a dyn Fn(&str) -> Option<&'a str>;

/// A node due this run: its record, its bundle's files in the manifest's order, and the digest
/// of their entries (of the zone as compiled: `bundle::number` gives it the version's serial).
pub(crate) struct Due<'r> {
    pub record: &'r NodeRecord,
    pub files: Vec<Listed>,
    pub digest: String,
}

/// What a run is to do, decided.
pub(crate) struct RunPlan<'r> {
    pub compiled: Compiled,
    /// The records of the nodes of the compiled mesh: active, of the kind declared.
    pub active: Vec<&'r NodeRecord>,
    /// The records of the nodes due, in name order, their bundles not assembled yet
    /// (`assembled`: the run assembles the nodes that hold none first).
    pub due: Vec<&'r NodeRecord>,
    /// Who held the key of each node that left the compiled mesh in this run.
    pub left: Left,
    /// Per revocation or removal not recorded yet: who held the key, each with whether this
    /// compile still holds it.
    pub revocations: Vec<(String, Vec<(String, bool)>)>,
    /// Per node still in the mesh that no longer carries a route or relays for some nodes: the
    /// nodes (in name order) that sent it through it.
    pub withdrawals: BTreeMap<String, Vec<String>>,
    /// The declaration's hubs, which the next run compares with.
    pub hubs: HashSet<String>,
    /// Each node's `paths.toml`, for the nodes with direct candidates, the peers each names, and
    /// every relayed pair.
    pub paths: HashMap<String, String>,
    pub candidates: HashMap<String, Vec<String>>,
    pub endpoints: HashMap<(String, String), (std::net::SocketAddr, std::net::SocketAddr)>,
    pub pairs: trellis_core::paths::Relayed,
    /// The same active nodes as the plan before, which the run before carried out (its records
    /// were kept, none written since): no node left the table since.
    pub active_unchanged: bool,
}

/// Plans a run. Takes from `run` what the compile consumes (the previous output, and the keys,
/// changed in place); the rest of `run` is the caller's to update once the plan is carried out
/// (`assembled` hashes the due contents it does not hold yet into `run.contents`). In phases:
/// the active nodes, their keys (and who held those leaving), what routers and hubs carried
/// before, the compile, the direct paths, the nodes due, and who must drop what.
pub(crate) fn plan<'r>(input: Inputs<'r, '_>, run: &mut Run) -> Result<RunPlan<'r>> {
    let Inputs { records, records_unchanged, decl, revision, declared, unrecorded, allocation, trust, held, held_count, paths } = input;
    let at = std::time::Instant::now();
    let (active, same) = active_nodes(run, records, records_unchanged, decl, declared);
    let active_ms = at.elapsed().as_millis() as u64;
    let at = std::time::Instant::now();
    let left = rekey(run, &active, same, records, declared);
    let keys_ms = at.elapsed().as_millis() as u64;
    let at = std::time::Instant::now();
    let previous = run.compiled.take();
    // The relayed pairs are counted from the compile before: without one (a first run, or the
    // run before failed once it had taken it), from nothing.
    if previous.is_none() {
        run.pair_counts = Default::default();
    }
    let hubs: HashSet<String> = decl.nodes.iter().filter(|n| n.hub).map(|n| n.name.clone()).collect();
    let carried_before = carried_before(run, previous.as_ref(), &hubs, revision);
    let carried_ms = at.elapsed().as_millis() as u64;
    let at = std::time::Instant::now();
    let compiled = trellis_core::compile(decl, &run.keys, &allocation, previous).map_err(|d| Error::internal("compiling", d))?;
    let compile_ms = at.elapsed().as_millis() as u64;
    // Direct paths: each relayed pair's candidates, from what its hub observed (ADR 0032).
    let at = std::time::Instant::now();
    let decided = trellis_core::paths::decide(
        &compiled,
        &run.keys,
        decl,
        &paths.observed,
        &|a, b| paths.standing(a, b),
        &run.endpoints,
        &mut run.pair_counts,
    );
    let decide_ms = at.elapsed().as_millis() as u64;
    let at = std::time::Instant::now();
    let texts: HashMap<String, String> =
        decided.candidates.iter().map(|(node, list)| (node.clone(), trellis_core::paths::write(node, list))).collect();
    // The active nodes of the run before, each holding a bundle this process published (the
    // table and `published` hold active nodes only) as `published` says, none stale: only the
    // nodes something named can be due.
    let kept = same && !run.stale && held_count == active.len() && run.published.len() == active.len();
    let due = due(run, (&active, kept), &compiled, run.trust != trust, held, &texts);
    let due_ms = at.elapsed().as_millis() as u64;
    let at = std::time::Instant::now();
    let withdrawals = carried_before.map(|before| withdrawn(&before, &compiled)).unwrap_or_default();
    let revocations = revocation_holders(unrecorded, (&left, &run.left), &compiled, (decl, &run.keys, records))?;
    let candidates = decided.candidates.iter().map(|(n, l)| (n.clone(), l.iter().map(|c| c.peer.clone()).collect())).collect();
    let endpoints = decided.endpoints();
    tracing::debug!(
        active_ms,
        keys_ms,
        carried_ms,
        compile_ms,
        decide_ms,
        due_ms,
        rest_ms = at.elapsed().as_millis() as u64,
        "publish plan"
    );
    Ok(RunPlan {
        compiled,
        active,
        due,
        left,
        revocations,
        withdrawals,
        hubs,
        paths: texts,
        candidates,
        endpoints,
        pairs: decided.relayed,
        active_unchanged: same,
    })
}

/// The active nodes' records (of the kind declared), and whether they are those of the last plan:
/// the same records under a declaration of the same nodes have the same active nodes, with the
/// keys the set holds, and neither is read again (at 100,000 nodes, 30 and 60 ms of every run
/// that follows an apply).
fn active_nodes<'r>(
    run: &mut Run,
    records: &'r [NodeRecord],
    records_unchanged: bool,
    decl: &Arc<Declaration>,
    declared: &HashMap<&str, Option<&str>>,
) -> (Vec<&'r NodeRecord>, bool) {
    let same = records_unchanged
        && run.planned_for.as_ref().is_some_and(|d| same_nodes(d, decl))
        && run.active_at.last().is_none_or(|&i| (i as usize) < records.len());
    run.planned_for = Some(decl.clone());
    if !same {
        run.active_at = (0..records.len() as u32)
            .filter(|&i| {
                let r = &records[i as usize];
                r.state == trellis_proto::EnrolledState::Active && declared.get(r.name.as_str()) == Some(&r.pool.as_deref())
            })
            .collect();
    }
    (run.active_at.iter().map(|&i| &records[i as usize]).collect(), same)
}

/// Brings the key set to the active nodes' keys (unless they are the last plan's: `same`) and
/// withdraws the revoked nodes of the mesh for good (their names leave every zone). Returns who
/// held the keys leaving the compiled mesh (had a key, not active now), while the previous
/// compile still says; most runs none leaves, and nothing is walked then.
fn rekey(run: &mut Run, active: &[&NodeRecord], same: bool, records: &[NodeRecord], declared: &HashMap<&str, Option<&str>>) -> Left {
    if same {
        return Left::default();
    }
    let gone =
        run.keys.replace(active.iter().filter_map(|r| r.wg_public_key.as_deref().and_then(PublicKey::parse).map(|k| (r.name.as_str(), k))));
    let mut left = Left::default();
    if let Some(previous) = run.compiled.as_ref().filter(|_| !gone.is_empty()) {
        let now_active: HashSet<&str> = active.iter().map(|r| r.name.as_str()).collect();
        let leaving: HashSet<&str> = gone.iter().map(String::as_str).filter(|n| !now_active.contains(n)).collect();
        left = holders_in(previous, &leaving);
        // So did the nodes that may reach one directly (its key in their interface).
        for (holder, peers) in &run.candidates {
            for p in peers {
                if let Some(list) = left.get_mut(p.as_str()) {
                    if !list.contains(holder) {
                        list.push(holder.clone());
                        list.sort();
                    }
                }
            }
        }
    }
    run.keys.withdraw_only(
        records
            .iter()
            .filter(|r| r.state == trellis_proto::EnrolledState::Revoked && declared.get(r.name.as_str()) == Some(&r.pool.as_deref()))
            .map(|r| r.name.as_str()),
    );
    left
}

/// What each node sent through routers and hubs, when a new declaration (another revision than
/// the run before's) may have taken some of it away (ADR 0022): read before the compile consumes
/// the previous output.
fn carried_before(run: &Run, previous: Option<&Compiled>, hubs: &HashSet<String>, revision: i64) -> Option<Carried> {
    let before = previous.filter(|_| run.revision.is_some_and(|r| r != revision))?;
    let demoted: HashSet<&str> = run.hubs.iter().filter(|h| !hubs.contains(*h)).map(String::as_str).collect();
    Some(carried(before, &demoted))
}

/// The due nodes' bundles assembled: their files (the contents hashed once, into
/// `run.contents`), `ca.pem`, `trust.toml`, the certificate and `paths.toml`, with the digest of
/// their entries.
pub(crate) fn assembled<'r, 'a>(
    run: &mut Run,
    due: Vec<&'r NodeRecord>,
    compiled: &Compiled,
    (shared, cert, texts): (&Shared, Cert<'a>, &HashMap<String, String>),
) -> Vec<Due<'r>> {
    run.contents.add(compiled, &due.iter().map(|r| r.name.as_str()).collect::<Vec<_>>());
    due.into_iter()
        .map(|record| {
            let node_paths = texts.get(&record.name).map(String::as_str);
            let files = assemble(&compiled.nodes[&record.name].files, |c| run.contents.digest(c), shared, cert(&record.name), node_paths);
            let digest = hex::encode(trellis_core::bundle::entries_digest(&entries(&files)));
            Due { record, files, digest }
        })
        .collect()
}

/// The nodes due this run: their plan was rendered again, their certificate, the trust or their
/// direct candidates moved, their stored version is not the one held, the run before put them
/// off, or no bundle of theirs is held. `kept`: the active nodes and their records are those of the run before, and each holds
/// a bundle; then no certificate moved, and only the nodes rendered, whose candidates moved or
/// that lag are looked at (at 100,000 nodes, the walk of every active node was 60 ms of the run
/// after a group move).
fn due<'r>(
    run: &Run,
    (active, kept): (&[&'r NodeRecord], bool),
    compiled: &Compiled,
    trust_moved: bool,
    held: &dyn Fn(&str) -> bool,
    paths: &HashMap<String, String>,
) -> Vec<&'r NodeRecord> {
    // Each active node is looked up in these (at 100,000 nodes, a run after one change walks
    // them all): hashed by foldhash, and the lookups of sets that are empty, or of the direct
    // candidates when none moved, are not made.
    let rendered: trellis_core::FastSet<&str> = compiled.rendered.iter().map(String::as_str).collect();
    let paths_moved: trellis_core::FastSet<&str> = run
        .paths
        .iter()
        .filter(|(n, t)| paths.get(*n) != Some(*t))
        .map(|(n, _)| n.as_str())
        .chain(paths.iter().filter(|(n, t)| run.paths.get(*n) != Some(*t)).map(|(n, _)| n.as_str()))
        .collect();
    // Whether each active node is compiled: the records come in name order (the store reads them
    // so), as the compiled nodes are kept, so one walk beside them answers it, not a search of
    // the compiled nodes for each (at 100,000 nodes, a search of a tree of names each); records
    // in another order are searched for.
    let in_order = active.windows(2).all(|w| w[0].name < w[1].name);
    if kept && in_order && !trust_moved {
        let mut named: Vec<&str> = rendered
            .iter()
            .chain(&paths_moved)
            .copied()
            .chain(run.lagging.iter().map(String::as_str))
            .chain(run.deferred.iter().map(String::as_str))
            .collect();
        named.sort_unstable();
        named.dedup();
        return named
            .into_iter()
            .filter_map(|name| active.binary_search_by(|r| r.name.as_str().cmp(name)).ok().map(|i| active[i]))
            .filter(|r| compiled.nodes.contains_key(&r.name))
            .collect();
    }
    let mut names = compiled.nodes.keys().peekable();
    let mut compiled_node = |name: &str| {
        if !in_order {
            return compiled.nodes.contains_key(name);
        }
        while names.next_if(|n| n.as_str() < name).is_some() {}
        names.peek().is_some_and(|n| n.as_str() == name)
    };
    let deferred: trellis_core::FastSet<&str> = run.deferred.iter().map(String::as_str).collect();
    let mut due = Vec::new();
    for r in active {
        if !compiled_node(&r.name) {
            continue;
        }
        let previous = run.published.get(&r.name);
        let unchanged = !trust_moved
            && previous.is_some_and(|(_, serial)| *serial == r.cert_serial)
            && (rendered.is_empty() || !rendered.contains(r.name.as_str()))
            && (run.lagging.is_empty() || !run.lagging.contains(&r.name))
            && (paths_moved.is_empty() || !paths_moved.contains(r.name.as_str()))
            && (deferred.is_empty() || !deferred.contains(r.name.as_str()))
            && held(&r.name);
        if !unchanged {
            due.push(*r);
        }
    }
    due
}

/// Who held each of `unrecorded` (from who held it when it left the compiled mesh, this run or
/// the one before, or else from a compile as if it had not been revoked: for a process that never
/// compiled the mesh with it), each with whether `compiled` still holds it.
#[allow(clippy::type_complexity)]
fn revocation_holders(
    unrecorded: &[String],
    (left, left_before): (&Left, &Left),
    compiled: &Compiled,
    ctx: (&Arc<Declaration>, &trellis_core::Keys, &[NodeRecord]),
) -> Result<Vec<(String, Vec<(String, bool)>)>> {
    let mut out = Vec::with_capacity(unrecorded.len());
    for node in unrecorded {
        let holders = match left.get(node).or_else(|| left_before.get(node)) {
            Some(h) => h.clone(),
            None => holders_as_if_active(node, compiled, ctx)?,
        };
        let holders = holders.into_iter().map(|h| {
            let still = holds(compiled, &h, node);
            (h, still)
        });
        out.push((node.clone(), holders.collect()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use trellis_proto::EnrolledState;

    /// A shipped lab declaration, loaded as an apply stores it.
    fn declaration(name: &str) -> Arc<Declaration> {
        let files: Vec<(String, String)> = trellis_testing::controller::lab_files(name).into_iter().map(|f| (f.path, f.text)).collect();
        let loaded = trellis_core::load_relative(&files, |p| p.to_string());
        Arc::new(loaded.declaration.unwrap_or_else(|| panic!("lab/{name}: {:?}", loaded.diagnostics)))
    }

    fn record(name: &str, key: u8, state: EnrolledState) -> NodeRecord {
        NodeRecord {
            name: name.into(),
            state,
            wg_public_key: Some(trellis_testing::controller::wireguard_key(key)),
            cert_serial: Some(format!("{key:02x}")),
            prev_cert_serial: None,
            cert_not_after: None,
            enrolled_at: 0,
            last_contact: None,
            cert_pem: Some(format!("certificate of {name}, key {key}\n")),
            pool: None,
            ipv4: None,
            ipv6: None,
        }
    }

    /// What a run reads, as values.
    struct World {
        decl: Arc<Declaration>,
        revision: i64,
        records: Vec<NodeRecord>,
        unrecorded: Vec<String>,
        /// Whether the records are those the plan before was given.
        records_unchanged: bool,
        trust: String,
        paths: crate::paths::PathInputs,
    }

    impl World {
        fn new(lab: &str, revision: i64) -> World {
            let decl = declaration(lab);
            let mut records: Vec<NodeRecord> =
                decl.nodes.iter().enumerate().map(|(i, n)| record(&n.name, i as u8 + 1, EnrolledState::Active)).collect();
            // In name order, as the store reads them.
            records.sort_by(|a, b| a.name.cmp(&b.name));
            let paths = crate::paths::PathInputs { observed: Default::default(), standing: Default::default() };
            World { decl, revision, records, unrecorded: Vec::new(), records_unchanged: false, trust: "controllers = []\n".into(), paths }
        }

        /// The plan of this world after `run`, with the bundles `held` in the table.
        fn plan(&self, run: &mut Run, allocation: Allocation, held: &HashSet<String>) -> Planned<'_> {
            let declared: HashMap<&str, Option<&str>> = self.decl.nodes.iter().map(|n| (n.name.as_str(), n.pool.as_deref())).collect();
            let shared = Shared::new("the mesh CA\n", &self.trust);
            let held = |n: &str| held.contains(n);
            let cert = |n: &str| self.records.iter().find(|r| r.name == n).and_then(|r| r.cert_pem.as_deref());
            let paths = &self.paths;
            let inputs = Inputs {
                records: &self.records,
                records_unchanged: self.records_unchanged,
                decl: &self.decl,
                revision: self.revision,
                declared: &declared,
                unrecorded: &self.unrecorded,
                allocation,
                trust: &self.trust,
                held: &held,
                held_count: self.records.iter().filter(|r| held(&r.name)).count(),
                paths,
            };
            let mut plan = plan(inputs, run).expect("a plan");
            let due = assembled(run, std::mem::take(&mut plan.due), &plan.compiled, (&shared, &cert, &plan.paths));
            Planned { plan, due }
        }
    }

    /// A plan with its due bundles assembled, as a run carries it out.
    struct Planned<'r> {
        plan: RunPlan<'r>,
        due: Vec<Due<'r>>,
    }

    impl<'r> std::ops::Deref for Planned<'r> {
        type Target = RunPlan<'r>;
        fn deref(&self) -> &RunPlan<'r> {
            &self.plan
        }
    }

    /// What the shell does with a plan, but for the store and the signatures: each due bundle
    /// is held, its digest kept, and the run keeps what the next plan compares with.
    fn carry_out(world: &World, run: &mut Run, plan: Planned, held: &mut HashSet<String>) -> HashMap<String, String> {
        for d in &plan.due {
            run.published.insert(d.record.name.clone(), (d.digest.clone(), d.record.cert_serial.clone()));
            held.insert(d.record.name.clone());
        }
        let live: HashSet<&str> = plan.active.iter().map(|r| r.name.as_str()).collect();
        run.published.retain(|n, _| live.contains(n.as_str()));
        held.retain(|n| live.contains(n.as_str()));
        run.revision = Some(world.revision);
        run.trust = world.trust.clone();
        run.keep(plan.plan);
        run.published.iter().map(|(n, (d, _))| (n.clone(), d.clone())).collect()
    }

    /// A run that follows another plans, for every node of the mesh, the bundle a first run
    /// would (a full compile, every node due): through a new declaration that takes a route from
    /// a router, a node's new key and certificate, and a revocation; and with nothing changed,
    /// nothing is due.
    #[test]
    fn the_plan_of_a_recompile_equals_the_plan_of_a_full_compile() {
        let (mut run, mut held) = (Run::default(), HashSet::new());
        let before = World::new("routes", 1);
        let first = before.plan(&mut run, Allocation::default(), &held);
        assert_eq!(first.due.len(), before.records.len(), "a first run publishes every node");
        let desk_held_by = holders_in(&first.compiled, &HashSet::from(["desk-1"])).remove("desk-1").unwrap();
        assert!(!desk_held_by.is_empty());
        let allocation = first.compiled.allocation.clone();
        carry_out(&before, &mut run, first, &mut held);

        let again = before.plan(&mut run, Allocation::default(), &held);
        assert!(again.due.is_empty(), "nothing changed, nothing due: {:?}", again.due.iter().map(|d| &d.record.name).collect::<Vec<_>>());
        carry_out(&before, &mut run, again, &mut held);

        // gw-1 no longer carries the office route; laptop-2 has a new key and certificate; desk-1
        // is revoked.
        let mut after = World::new("routes-gw-2", 2);
        for r in &mut after.records {
            match r.name.as_str() {
                "laptop-2" => *r = record("laptop-2", 42, EnrolledState::Active),
                "desk-1" => r.state = EnrolledState::Revoked,
                _ => {}
            }
        }
        after.unrecorded = vec!["desk-1".into()];
        let recompiled = after.plan(&mut run, Allocation::default(), &held);
        assert!(recompiled.withdrawals.get("gw-1").is_some_and(|h| !h.is_empty()), "{:?}", recompiled.withdrawals);
        assert_eq!(recompiled.revocations.len(), 1);
        let (node, holders) = &recompiled.revocations[0];
        assert_eq!(node, "desk-1");
        assert_eq!(holders.iter().map(|(h, _)| h.as_str()).collect::<Vec<_>>(), desk_held_by);
        assert!(holders.iter().all(|(_, still)| !still), "{holders:?}");
        let incremental = carry_out(&after, &mut run, recompiled, &mut held);

        let (mut fresh, none) = (Run::default(), HashSet::new());
        let full = after.plan(&mut fresh, allocation, &none);
        assert_eq!(full.due.len(), full.active.len());
        let full: HashMap<String, String> = full.due.iter().map(|d| (d.record.name.clone(), d.digest.clone())).collect();
        assert_eq!(incremental, full, "every node's bundle, incrementally and in full");
        assert!(!full.contains_key("desk-1"));
    }

    /// The same records under a declaration of the same nodes (the route moved to another
    /// router) take the active nodes and keys the run before found: the plan is the one a first
    /// run makes. Records said unchanged under a declaration of other nodes are read again.
    #[test]
    fn the_same_records_under_the_same_nodes_plan_as_a_first_run() {
        let (mut run, mut held) = (Run::default(), HashSet::new());
        let before = World::new("routes", 1);
        let first = before.plan(&mut run, Allocation::default(), &held);
        let allocation = first.compiled.allocation.clone();
        carry_out(&before, &mut run, first, &mut held);
        let names = |p: &Planned| p.active.iter().map(|r| r.name.clone()).collect::<Vec<_>>();

        let mut after = World::new("routes-gw-2", 2);
        after.records = before.records.clone();
        after.records_unchanged = true;
        let published_before = run.published.clone();
        let planned = after.plan(&mut run, Allocation::default(), &held);
        let (mut fresh, none) = (Run::default(), HashSet::new());
        let full = after.plan(&mut fresh, allocation, &none);
        assert_eq!(names(&planned), names(&full));
        // Due are exactly the nodes whose bundle changed: found among those the compile named,
        // without a walk of every active node.
        let changed: Vec<&str> = full
            .due
            .iter()
            .filter(|d| published_before.get(&d.record.name).map(|(digest, _)| digest) != Some(&d.digest))
            .map(|d| d.record.name.as_str())
            .collect();
        assert!(!changed.is_empty());
        assert_eq!(planned.due.iter().map(|d| d.record.name.as_str()).collect::<Vec<_>>(), changed);
        assert!(planned.withdrawals.get("gw-1").is_some_and(|h| !h.is_empty()), "{:?}", planned.withdrawals);
        assert!(!planned.due.is_empty(), "the route moved: bundles change");
        let digests = |p: &Planned| p.due.iter().map(|d| (d.record.name.clone(), d.digest.clone())).collect::<HashMap<_, _>>();
        let full_digests = digests(&full);
        for (name, digest) in digests(&planned) {
            assert_eq!(Some(&digest), full_digests.get(&name), "{name}");
        }
        assert_eq!(run.keys, fresh.keys);
        carry_out(&after, &mut run, planned, &mut held);

        // Records said unchanged under another mesh: its nodes are found among them (given in
        // another order than the store's, so searched for).
        let mut other = World::new("nat", 3);
        other.records_unchanged = true;
        other.records.reverse();
        let planned = other.plan(&mut run, Allocation::default(), &held);
        assert_eq!(names(&planned), other.records.iter().map(|r| r.name.clone()).collect::<Vec<_>>());
        let (mut fresh, none) = (Run::default(), HashSet::new());
        let full = other.plan(&mut fresh, Allocation::default(), &none);
        assert_eq!(run.keys, fresh.keys);
        assert_eq!(names(&planned), names(&full));
    }

    /// A node that may reach another directly holds its key: when that one is revoked, it is
    /// among the holders that must apply a bundle without it (ADR 0022, 0032), beside the hub
    /// whose `wireguard.conf` named it; and the paths.toml that named it is published again.
    #[test]
    fn a_direct_candidate_holds_the_key_of_a_revoked_peer() {
        let (mut run, mut held) = (Run::default(), HashSet::new());
        let mut world = World::new("cgnat", 1);
        world.paths.observed.by_hub.insert(
            "hub-1".into(),
            HashMap::from([
                ("a-1".to_string(), "203.0.113.1:4001".parse().unwrap()),
                ("b-1".to_string(), "203.0.113.2:4002".parse().unwrap()),
            ]),
        );
        let first = world.plan(&mut run, Allocation::default(), &held);
        let a_paths =
            first.due.iter().find(|d| d.record.name == "a-1").and_then(|d| d.files.iter().find(|f| f.path == "etc/trellis/paths.toml"));
        assert!(a_paths.is_some_and(|f| f.content.to_string().contains("203.0.113.2:4002")), "a-1 may reach b-1 directly");
        carry_out(&world, &mut run, first, &mut held);
        for r in &mut world.records {
            if r.name == "b-1" {
                r.state = EnrolledState::Revoked;
            }
        }
        world.unrecorded = vec!["b-1".into()];
        let plan = world.plan(&mut run, Allocation::default(), &held);
        let (node, holders) = &plan.revocations[0];
        assert_eq!(node, "b-1");
        assert_eq!(holders.iter().map(|(h, _)| h.as_str()).collect::<Vec<_>>(), ["a-1", "hub-1"]);
        let a = plan.due.iter().find(|d| d.record.name == "a-1").expect("a-1's bundle changes");
        assert!(a.files.iter().all(|f| f.path != "etc/trellis/paths.toml"), "no candidate left");
    }

    /// A node another replica published other content for (stale) is not swapped in, so what the
    /// run keeps of it is behind: the next plan, though the records did not move, looks at every
    /// active node and finds it due (its certificate's serial moved since it was published).
    #[test]
    fn a_stale_node_is_due_again_though_the_records_did_not_move() {
        let (mut run, mut held) = (Run::default(), HashSet::new());
        let mut world = World::new("basic", 1);
        let first = world.plan(&mut run, Allocation::default(), &held);
        carry_out(&world, &mut run, first, &mut held);
        let x = world.records[0].name.clone();
        let kept_before = run.published[&x].clone();
        world.records[0].cert_serial = Some("ff".into());
        let renewed = world.plan(&mut run, Allocation::default(), &held);
        assert!(renewed.due.iter().any(|d| d.record.name == x), "{x} renewed: due");
        carry_out(&world, &mut run, renewed, &mut held);
        // Another replica's content was in force for x: it was not swapped in.
        run.published.insert(x.clone(), kept_before);
        run.stale = true;
        world.records_unchanged = true;
        let again = world.plan(&mut run, Allocation::default(), &held);
        assert_eq!(again.due.iter().map(|d| d.record.name.as_str()).collect::<Vec<_>>(), [x.as_str()]);
    }

    /// A new `trust.toml` puts every node's bundle due, and it carries the new file.
    #[test]
    fn a_change_of_trust_puts_every_node_due() {
        let (mut run, mut held) = (Run::default(), HashSet::new());
        let mut world = World::new("basic", 1);
        let first = world.plan(&mut run, Allocation::default(), &held);
        carry_out(&world, &mut run, first, &mut held);
        world.trust = "controllers = [\"c.example:8443\"]\n".into();
        let plan = world.plan(&mut run, Allocation::default(), &held);
        assert_eq!(plan.due.len(), world.records.len());
        for d in &plan.due {
            let trust = d.files.iter().find(|f| f.path == trellis_core::compile::TRUST_TOML).expect("trust.toml");
            assert_eq!(trust.content.to_string(), world.trust);
        }
    }
}
