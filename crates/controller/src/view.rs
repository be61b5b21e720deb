//! What operators look at: the live picture of the mesh (the current declaration drawn by
//! `core::graph`, each node with its state from `status`) and `explain` between two of its nodes,
//! as the API's shapes. `trellis explain --json` prints the same shape offline.

use std::collections::HashMap;

use trellis_core::graph;
use trellis_core::topology::Topology;
use trellis_proto::{self as proto, EvidenceResult, NodeState, Shown};

use crate::{Controller, Error, Result};

/// The API's shape of an explanation.
pub fn explanation(e: &trellis_core::explain::Explanation) -> proto::Explanation {
    let rules = |list: &[trellis_core::explain::RuleMatch]| -> Vec<proto::RuleMatch> {
        list.iter()
            .map(|m| proto::RuleMatch {
                module: m.module.clone(),
                rule: m.rule,
                at: m.at.to_string(),
                proto: m.proto.as_str().to_string(),
                ports: m.ports.clone(),
                matched: m.matched.clone(),
            })
            .collect()
    };
    proto::Explanation {
        from: e.from.clone(),
        to: e.to.clone(),
        path: e.path.to_string(),
        hub: e.hub.clone(),
        reasons: e.reasons.clone(),
        forward: rules(&e.forward),
        reverse: rules(&e.reverse),
        text: e.to_text(),
    }
}

/// How a node is shown: its roster state, stale or failing when active.
pub fn shown(s: &proto::NodeStatus) -> Shown {
    match s.state {
        NodeState::Active if s.last_result == Some(EvidenceResult::Failed) => Shown::Failing,
        NodeState::Active if s.stale => Shown::Stale,
        NodeState::Active => Shown::Active,
        NodeState::Pending => Shown::Pending,
        NodeState::Revoking => Shown::Revoking,
        NodeState::Revoked => Shown::Revoked,
        NodeState::Declared => Shown::Declared,
        NodeState::External => Shown::External,
        NodeState::Removed | NodeState::Removing => Shown::Removed,
    }
}

/// A shown state as `core::graph` draws it (and colours it: the live page takes its colours from
/// there).
pub fn drawn(s: Shown) -> graph::State {
    match s {
        Shown::Active => graph::State::Active,
        Shown::Pending => graph::State::Pending,
        Shown::Revoking => graph::State::Revoking,
        Shown::Revoked => graph::State::Revoked,
        Shown::Stale => graph::State::Stale,
        Shown::Failing => graph::State::Failing,
        Shown::Declared => graph::State::Declared,
        Shown::External => graph::State::External,
        Shown::Removed => graph::State::Removed,
    }
}

impl Controller {
    /// The live picture: the current declaration's nodes and links, each node with its state.
    pub async fn graph(&self) -> Result<proto::MeshGraph> {
        // Every node's state, without its relayed pairs: the links' are looked up alone below
        // (the picture asks every second, and at 100,000 nodes the pairs are millions).
        let status = self.status_with(false).await?;
        let Some((revision, decl)) = self.current_mesh().await? else {
            return Ok(proto::MeshGraph { revision: None, nodes: Vec::new(), links: Vec::new() });
        };
        let alloc = self.store.allocation().await?;
        let topo = Topology::new(&decl, &alloc, &trellis_core::Keys::default());
        let g = trellis_core::graph::graph(&topo);
        let expiring = self.certificates_expiring().await?;
        let by_name: HashMap<&str, &proto::NodeStatus> = status.iter().map(|s| (s.name.as_str(), s)).collect();
        // Who still holds the key of a node revoking or removing.
        let mut holds: HashMap<&str, Vec<String>> = HashMap::new();
        for r in status.iter().filter_map(|s| s.revocation.as_ref()).filter(|r| !r.complete()) {
            for h in &r.holding {
                holds.entry(h.name.as_str()).or_default().push(r.node.clone());
            }
        }
        let pairs = self.publisher.kept_pairs().await;
        let reports = self.path_reports().await?;
        let plans = pairs.plans.as_deref().unwrap_or_default();
        let plan_of = |n: &str| plans.binary_search_by(|p| (*p.node).cmp(n)).ok().map(|i| &*plans[i]);
        let spots: HashMap<&str, &trellis_core::graph::Spot> = g.nodes.iter().map(|n| (n.name.as_str(), n)).collect();
        let links = g
            .links
            .iter()
            .map(|l| {
                let d = trellis_core::graph::curve(spots[l.a.as_str()], spots[l.b.as_str()], &l.reach);
                let (reach, hub) = match l.reach.clone() {
                    trellis_core::graph::Reach::Direct => ("direct", None),
                    trellis_core::graph::Reach::Relayed(h) => ("relayed", Some(h)),
                    trellis_core::graph::Reach::None => ("none", None),
                };
                // A relayed pair's path now, as status shows it from its first node.
                let path = hub
                    .as_deref()
                    .and_then(|h| pairs.relayed.pair(plan_of, &l.a, &l.b, h))
                    .and_then(|p| crate::paths::pair_paths(&l.a, &[&p], reports.get(&l.a)).pop())
                    .map(|p| p.text);
                proto::GraphLink { a: l.a.clone(), b: l.b.clone(), reach: reach.to_string(), hub, path, d }
            })
            .collect();
        let nodes = g
            .nodes
            .into_iter()
            .map(|n| {
                let s = by_name.get(n.name.as_str());
                proto::GraphNode {
                    hub: n.hub,
                    networks: n.networks,
                    x: n.x,
                    y: n.y,
                    state: s.map_or(NodeState::Declared, |s| s.state),
                    shown: s.map_or(Shown::Declared, |s| shown(s)),
                    desired_version: s.and_then(|s| s.desired_version),
                    applied_version: s.and_then(|s| s.applied_version),
                    stale_for: s.and_then(|s| s.stale_for),
                    last_contact: s.and_then(|s| s.last_contact),
                    last_error: s.and_then(|s| s.last_error.as_deref()).map(|e| proto::text::printable(e).into_owned()),
                    holds: holds.remove(n.name.as_str()).unwrap_or_default(),
                    certificates_expiring: expiring.get(n.name.as_str()).cloned().unwrap_or_default(),
                    name: n.name,
                }
            })
            .collect();
        Ok(proto::MeshGraph { revision: Some(revision), nodes, links })
    }

    /// `explain` between two nodes of the current declaration.
    pub async fn explain(&self, from: &str, to: &str) -> Result<proto::Explanation> {
        let Some((_, decl)) = self.current_mesh().await? else {
            return Err(Error::NoDeclaration("no declaration has been applied yet; run `trellis apply DIR` first"));
        };
        let alloc = self.store.allocation().await?;
        let topo = Topology::new(&decl, &alloc, &trellis_core::Keys::default());
        for n in [from, to] {
            if decl.node(n).is_none() {
                return Err(Error::NotFound(format!("node `{}` in the current declaration", proto::text::printable(n))));
            }
        }
        let e = trellis_core::explain::explain(&topo, from, to).ok_or_else(|| Error::NotFound("such nodes".to_string()))?;
        Ok(explanation(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_active_node_is_shown_failing_before_stale() {
        let mut s = proto::NodeStatus {
            name: "a".into(),
            state: NodeState::Active,
            desired_version: Some(2),
            applied_version: Some(2),
            last_contact: None,
            cert_not_after: None,
            stale: false,
            stale_for: None,
            last_result: Some(EvidenceResult::Applied),
            last_error: None,
            evidence_records: 1,
            evidence_missing: 0,
            revocation: None,
            agent_refused: None,
            clock_skew: None,
            ingress: None,
            paths: Vec::new(),
        };
        assert_eq!(shown(&s), Shown::Active);
        s.stale = true;
        assert_eq!(shown(&s), Shown::Stale);
        s.last_result = Some(EvidenceResult::Failed);
        assert_eq!(shown(&s), Shown::Failing);
        s.state = NodeState::Revoked;
        assert_eq!(shown(&s), Shown::Revoked);
        s.state = NodeState::Revoking;
        assert_eq!(shown(&s), Shown::Revoking);
        s.state = NodeState::Pending;
        assert_eq!(shown(&s), Shown::Pending);
    }

    #[test]
    fn the_picture_labels_each_shown_state_by_its_name() {
        for s in Shown::ALL {
            assert_eq!(drawn(*s).as_str(), s.as_str());
        }
    }
}
