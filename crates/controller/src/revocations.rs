//! Revocations followed to the data plane (ADR 0022). Refusing a revoked node's certificate is
//! immediate; its packets are refused only once every node that held its key has applied a
//! bundle without it. So a revocation is `revoking` until then, and `revoked` after:
//!
//! - the decision opens it (`Store::set_state`, in the revocation's transaction);
//! - the first publish run after it records the holders: the nodes whose plan named the node as
//!   a WireGuard peer in the last compile that held its key (its peers, a hub relaying for it, a
//!   router of its routes); then, in that run and the next ones, each holder's first version
//!   without it (`dropped_in`);
//! - whether each holder applied `dropped_in` or later is read from its evidence, so every
//!   replica computes the same state from the database; a holder revoked too, or no longer
//!   declared, no longer counts;
//! - the completion is written once, with its audit record, by whichever replica sees it first.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use trellis_core::Compiled;
use trellis_proto::{self as proto, AuditAction, EnrolledState, EvidenceResult, NodeState, Withdrawal};
use trellis_store::{Audit, NodeRecord, RevocationRecord};

use crate::nodes::RosterEntry;
use crate::{Controller, Result};

/// What a controller process remembers of revocations between looks; the state is the
/// database's.
#[derive(Default)]
pub(crate) struct Tracking {
    /// Some revocation was open at the last look: evidence may complete it.
    open: AtomicBool,
    /// Evidence arrived since the last look while one was open.
    dirty: AtomicBool,
}

/// Who held the key of each node that left the compiled mesh in a run (it was compiled with a key
/// and is not now), from the compile before: kept for one more run, since the run that records a
/// revocation's holders may be the one after the run that dropped the key.
pub(crate) type Left = HashMap<String, Vec<String>>;

/// The nodes of `compiled` whose plan holds each of `nodes` as a WireGuard peer, each list in
/// name order; a node nobody holds has an empty list.
pub(crate) fn holders_in(compiled: &Compiled, nodes: &HashSet<&str>) -> Left {
    let mut out: Left = nodes.iter().map(|n| (n.to_string(), Vec::new())).collect();
    for (name, o) in &compiled.nodes {
        for p in &o.plan.peers {
            if let Some(list) = out.get_mut(p.name()) {
                list.push(name.clone());
            }
        }
    }
    out
}

/// What each node sends through a peer beyond the peer's own addresses, by (holder, peer): the
/// routes the peer carries for it, and, when the peer is one of `demoted` (a hub no longer one),
/// the nodes it relays for it. Only pairs with something. Relaying is read for demoted hubs only:
/// a hub relays for thousands of nodes at 10,000, and the scan runs on every new revision.
pub(crate) type Carried = HashMap<(String, String), (Vec<String>, Vec<String>)>;

pub(crate) fn carried(compiled: &Compiled, demoted: &HashSet<&str>) -> Carried {
    let mut out = Carried::new();
    for (name, o) in &compiled.nodes {
        for p in &o.plan.peers {
            let relays = !p.relays_for.is_empty() && demoted.contains(p.name());
            if p.routes.is_empty() && !relays {
                continue;
            }
            let relayed = if relays { p.relays_for.iter().map(|t| t.name.to_string()).collect() } else { Vec::new() };
            let routes = p.routes.iter().map(|r| r.name.to_string()).collect();
            out.insert((name.clone(), p.name().to_string()), (relayed, routes));
        }
    }
    out
}

/// The withdrawals from `before` to `after`, by the node they went through: the holders (in
/// name order) that sent a route, or a relayed node's traffic, through a node still in the mesh
/// that no longer carries it for them. What left the mesh is a revocation's or removal's
/// business: a peer gone, a holder gone, a relayed node gone are not withdrawals.
pub(crate) fn withdrawn(before: &Carried, after: &Compiled) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for ((holder, through), (relays, routes)) in before {
        let (Some(h), true) = (after.nodes.get(holder), after.nodes.contains_key(through)) else { continue };
        let now = h.plan.peers.iter().find(|p| p.name() == through);
        let relays_now: Vec<&str> = now.map(|p| p.relays_for.iter().map(|t| &*t.name).collect()).unwrap_or_default();
        let routes_now: Vec<&str> = now.map(|p| p.routes.iter().map(|r| &*r.name).collect()).unwrap_or_default();
        let lost = relays.iter().any(|x| !relays_now.contains(&x.as_str()) && after.nodes.contains_key(x))
            || routes.iter().any(|y| !routes_now.contains(&y.as_str()));
        if lost {
            out.entry(through.clone()).or_default().push(holder.clone());
        }
    }
    for holders in out.values_mut() {
        holders.sort();
    }
    out
}

/// Whether `holder`'s plan in `compiled` holds `node` as a peer.
pub(crate) fn holds(compiled: &Compiled, holder: &str, node: &str) -> bool {
    compiled.nodes.get(holder).is_some_and(|o| o.plan.peers.iter().any(|p| p.name() == node))
}

/// A revocation as its records and the holders' states make it: complete when a run recorded
/// the holders and every holder that still counts (an active node of the mesh) reported applying
/// a version without the key; then at the latest of those reports. The holders' details
/// (`applied_version`, `last_contact`, `last_error`) are left for the caller.
pub(crate) fn judge(r: &RevocationRecord, state_of: &dyn Fn(&str) -> Option<NodeState>, now: i64) -> proto::Revocation {
    if let Some(done) = r.completed_at {
        return proto::Revocation {
            node: r.node.clone(),
            kind: r.kind,
            decided_at: r.decided_at,
            completed_at: Some(done),
            seconds: done - r.decided_at,
            holders_known: true,
            holders: r.holders_counted as usize,
            holding: Vec::new(),
            unverified: r.unverified.clone(),
        };
    }
    let counted: Vec<_> = r.holders.iter().filter(|h| state_of(&h.holder) == Some(NodeState::Active)).collect();
    let holding: Vec<proto::KeyHolder> = counted
        .iter()
        .filter(|h| h.applied_at.is_none())
        .map(|h| proto::KeyHolder {
            name: h.holder.clone(),
            dropped_in: h.dropped_in,
            applied_version: None,
            last_contact: None,
            last_error: None,
        })
        .collect();
    // A holder whose every report came from an agent that manages no interface is counted (it
    // applied what it was given), and named: nothing says its data plane dropped the key.
    let unverified = counted.iter().filter(|h| h.applied_at.is_some() && !h.verified).map(|h| h.holder.clone()).collect();
    let completed_at = (r.holders_known && holding.is_empty())
        .then(|| counted.iter().filter_map(|h| h.applied_at).max().unwrap_or(r.decided_at).max(r.decided_at));
    proto::Revocation {
        node: r.node.clone(),
        kind: r.kind,
        decided_at: r.decided_at,
        completed_at,
        seconds: completed_at.unwrap_or(now) - r.decided_at,
        holders_known: r.holders_known,
        holders: counted.len(),
        holding,
        unverified,
    }
}

/// Whether the node's record says it is no longer what the revocation or removal was about: a
/// node enrolled again since its revocation, a member of the same name enrolled since a removal.
fn superseded(r: &RevocationRecord, record: Option<&NodeRecord>) -> bool {
    match (r.kind, record) {
        (_, None) => false,
        (Withdrawal::Revocation, Some(rec)) => rec.state != EnrolledState::Revoked,
        (Withdrawal::Removal, Some(_)) => true,
        // Routes through a node still in the mesh: a revocation of it would have replaced it.
        (Withdrawal::Routes, Some(_)) => false,
    }
}

impl Controller {
    /// The revocations of the roster's revoked nodes (and of revoked members the sweep removed
    /// since), by node, with the details of each holder that still holds the key.
    pub(crate) async fn revocation_view(&self, roster: &[RosterEntry]) -> Result<BTreeMap<String, proto::Revocation>> {
        let records = self.store.revocations(false).await?;
        if records.is_empty() {
            return Ok(BTreeMap::new());
        }
        let by_name: HashMap<&str, &RosterEntry> = roster.iter().map(|e| (e.name.as_str(), e)).collect();
        let state_of = |n: &str| by_name.get(n).map(|e| e.state);
        let now = self.now();
        let mut views: BTreeMap<String, proto::Revocation> = records
            .iter()
            .filter(|r| !superseded(r, by_name.get(r.node.as_str()).and_then(|e| e.record.as_ref())))
            .map(|r| (r.node.clone(), judge(r, &state_of, now)))
            .collect();
        if views.values().any(|v| !v.holding.is_empty()) {
            let evidence = self.store.evidence_summary().await?;
            for h in views.values_mut().flat_map(|v| v.holding.iter_mut()) {
                let ev = evidence.get(&h.name);
                h.applied_version = ev.and_then(|e| e.applied_version);
                h.last_error = ev.filter(|e| e.last_result == Some(EvidenceResult::Failed)).and_then(|e| e.last_error.clone());
                h.last_contact = by_name.get(h.name.as_str()).and_then(|e| e.record.as_ref()).and_then(|r| r.last_contact);
            }
        }
        Ok(views)
    }

    /// One node's revocation, as `trellis node revoke --wait` follows it.
    pub async fn revocation(&self, name: &str) -> Result<proto::Revocation> {
        let (_, mut views) = self.roster_and_revocations().await?;
        views.remove(name).ok_or_else(|| crate::Error::NotFound(format!("revocation of node `{name}`")))
    }

    /// Records the completion of every open revocation that is complete now, each with its
    /// audit record (once, whichever replica gets there first). Publish runs end with it; the
    /// server calls it on its next tick when evidence arrived here while a revocation was open,
    /// and every 5 s in any case (the evidence may have reached another replica). Returns how
    /// many it recorded.
    pub async fn settle_revocations(&self) -> Result<usize> {
        self.revocations.dirty.store(false, Ordering::SeqCst);
        let open = self.store.revocations(true).await?;
        self.revocations.open.store(!open.is_empty(), Ordering::SeqCst);
        if open.is_empty() {
            return Ok(0);
        }
        let roster = self.roster_entries().await?;
        let by_name: HashMap<&str, &RosterEntry> = roster.iter().map(|e| (e.name.as_str(), e)).collect();
        let state_of = |n: &str| by_name.get(n).map(|e| e.state);
        let now = self.now();
        let mut recorded = 0;
        for r in &open {
            if superseded(r, by_name.get(r.node.as_str()).and_then(|e| e.record.as_ref())) {
                continue;
            }
            let v = judge(r, &state_of, now);
            let Some(at) = v.completed_at else { continue };
            let audit = Audit {
                at: now,
                actor: "controller",
                action: match r.kind {
                    Withdrawal::Revocation => AuditAction::RevocationCompleted,
                    Withdrawal::Removal => AuditAction::RemovalCompleted,
                    Withdrawal::Routes => AuditAction::RoutesWithdrawn,
                },
                subject: &r.node,
                detail: match r.kind {
                    Withdrawal::Routes => format!(
                        "every node that sent routes or relayed traffic through it that it no longer carries applied a bundle that does not: {} holder(s), {} s after the decision",
                        v.holders, v.seconds
                    ),
                    _ => format!(
                        "every node that held its key reported applying a bundle without it: {} holder(s), {} s after the decision{}",
                        v.holders,
                        v.seconds,
                        if v.unverified.is_empty() {
                            String::new()
                        } else {
                            format!(
                                "; {} of them ({}) manage no WireGuard interface, so nothing verifies that their data plane dropped it",
                                v.unverified.len(),
                                v.unverified.join(", ")
                            )
                        }
                    ),
                },
            };
            if self.store.complete_revocation(&r.node, at, v.holders as i64, &v.unverified, &audit).await? {
                tracing::info!(node = %r.node, kind = %r.kind, holders = v.holders, seconds = v.seconds, "every holder dropped the key");
                recorded += 1;
            }
        }
        if recorded > 0 {
            // The next run signs the audit head that now includes the completions.
            self.ask_publish();
        }
        Ok(recorded)
    }

    /// [`Controller::settle_revocations`] if evidence arrived while a revocation was open.
    pub(crate) async fn settle_revocations_if_due(&self) -> Result<usize> {
        if self.revocations.dirty.load(Ordering::SeqCst) {
            self.settle_revocations().await
        } else {
            Ok(0)
        }
    }

    /// Evidence arrived: an open revocation may be complete now.
    pub(crate) fn evidence_arrived(&self) {
        if self.revocations.open.load(Ordering::SeqCst) {
            self.revocations.dirty.store(true, Ordering::SeqCst);
        }
    }

    /// A publish run's part: records the holders of every revocation the plan found unrecorded
    /// (`holders`, each with whether this compile still holds the key), and each holder's first
    /// version without the key that is now in force. `stale` are the nodes whose version in force
    /// here is not this compile's.
    pub(crate) async fn follow_revocations(
        &self,
        holders: &[(String, Vec<(String, bool)>)],
        compiled: &Compiled,
        stale: &HashSet<String>,
    ) -> Result<()> {
        let in_force = |holder: &str| (!stale.contains(holder)).then(|| self.publisher.current(holder).map(|p| p.version)).flatten();
        for (node, holders) in holders {
            let list: Vec<(String, Option<i64>)> =
                holders.iter().map(|(h, still)| (h.clone(), (!still).then(|| in_force(h)).flatten())).collect();
            if self.store.record_holders(node, &list).await? {
                tracing::info!(node = %node, holders = list.len(), "revoking: holders recorded");
            }
        }
        let dropped: Vec<(String, String, i64)> = self
            .store
            .holders_undropped()
            .await?
            .into_iter()
            .filter(|(node, holder)| !holds(compiled, holder, node))
            .filter_map(|(node, holder)| in_force(&holder).map(|v| (node, holder, v)))
            .collect();
        if !dropped.is_empty() {
            self.store.record_dropped(&dropped).await?;
        }
        Ok(())
    }
}

/// Who would hold `node`'s key if it were active: for a process that never compiled the mesh
/// with it (it started after the revocation). A node with no key was held by nobody.
pub(crate) fn holders_as_if_active(
    node: &str,
    compiled: &Compiled,
    (decl, keys, records): (&std::sync::Arc<trellis_core::Declaration>, &trellis_core::Keys, &[NodeRecord]),
) -> Result<Vec<String>> {
    let key =
        records.iter().find(|r| r.name == node).and_then(|r| r.wg_public_key.as_deref()).and_then(trellis_core::decl::PublicKey::parse);
    // A node whose record has no key could be no node's peer: nobody held it (an empty list of
    // holders, which completes the revocation at once; the record keeps its key when revoked).
    let Some(key) = key else { return Ok(Vec::new()) };
    let mut keys = keys.clone();
    keys.set(node, Some(key));
    let as_if = trellis_core::compile(decl, &keys, &compiled.allocation, None).map_err(|d| crate::Error::internal("compiling", d))?;
    Ok(holders_in(&as_if, &HashSet::from([node])).remove(node).unwrap_or_default())
}
