//! Direct paths through a hub (ADR 0032), the controller's half: what agents report (a hub's
//! observed endpoints, every node's paths), kept bounded and cleaned; what a publish run reads
//! of them (`Observed`, how each pair stands); and each pair's path as `trellis status` shows it.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;

use trellis_core::decl::PublicKey;
use trellis_core::paths::{Observed, Pair, Standing};
use trellis_proto as proto;
use trellis_proto::paths::{MAX_PATH_ITEMS, MAX_PATH_TEXT};
use trellis_store::NodeRecord;

use crate::{Controller, Error, NodeIdentity, Result};

/// Whether a hub's observation may be handed to another node: an address a packet can come from
/// across a network, not one that names the receiver itself or many hosts (unspecified, port 0,
/// loopback, multicast, broadcast, link-local, IPv4 in IPv6).
fn dialable(at: &SocketAddr) -> bool {
    let ip = at.ip();
    let v4_bad =
        |v4: std::net::Ipv4Addr| v4.is_broadcast() || v4.is_link_local() || v4.is_unspecified() || v4.is_loopback() || v4.is_multicast();
    at.port() != 0
        && match ip {
            std::net::IpAddr::V4(v4) => !v4_bad(v4),
            std::net::IpAddr::V6(v6) => {
                !(v6.is_unspecified()
                    || v6.is_loopback()
                    || v6.is_multicast()
                    || v6.is_unicast_link_local()
                    || v6.to_ipv4_mapped().is_some())
            }
        }
}

/// The report as kept: observations only from a hub, each a WireGuard key and a dialable
/// `IP:PORT` (others dropped), in key order; path states only for `peers` (the node's current
/// candidates: anything else is nothing it may report on), their texts cut, in peer order.
fn cleaned(r: &proto::PathReport, hub: bool, peers: &HashSet<&str>) -> proto::PathReport {
    let cut = |s: &str| crate::certs::cut(s, MAX_PATH_TEXT);
    let mut observed: Vec<proto::ObservedEndpoint> = if hub {
        r.observed
            .iter()
            .filter(|o| PublicKey::parse(&o.public_key).is_some() && o.endpoint.parse::<SocketAddr>().is_ok_and(|at| dialable(&at)))
            .map(|o| proto::ObservedEndpoint { public_key: o.public_key.clone(), endpoint: o.endpoint.clone() })
            .collect()
    } else {
        Vec::new()
    };
    observed.sort_by(|a, b| a.public_key.cmp(&b.public_key));
    let mut paths: Vec<proto::PathState> = r
        .paths
        .iter()
        .filter(|p| matches!(p.state.as_str(), "trying" | "direct" | "backing-off") && peers.contains(p.peer.as_str()))
        .map(|p| proto::PathState { peer: cut(&p.peer), state: p.state.clone(), since: p.since, reason: p.reason.as_deref().map(cut) })
        .collect();
    paths.sort_by(|a, b| a.peer.cmp(&b.peer));
    proto::PathReport { observed, paths }
}

/// What a run reads of the reports: what the hubs (of the current declaration) observed, by node
/// name, and how each pair stands, as either side said.
pub(crate) struct PathInputs {
    pub observed: Observed,
    pub standing: HashMap<(String, String), Standing>,
}

impl PathInputs {
    pub(crate) fn standing(&self, a: &str, b: &str) -> Standing {
        self.standing.get(&(a.to_string(), b.to_string())).copied().unwrap_or_default()
    }
}

/// How long a pair that reported failed attempts ranks last for a place under the cap, even
/// once it no longer holds one (and so no longer reports): without it, a pair that lost its place
/// would be ranked with the waiting ones again, given one, fail, and lose it, every half minute.
pub const FAILED_HOLD_SECS: i64 = 600;

/// An unordered pair as a key: its names in order.
pub(crate) fn pair_key(a: &str, b: &str) -> (String, String) {
    if a < b {
        (a.to_string(), b.to_string())
    } else {
        (b.to_string(), a.to_string())
    }
}

/// Reads the stored reports as a run takes them: observations of hubs in `hubs` only, keys
/// named by the active records that hold them; pairs in `failed` until a time after `now` stand
/// failing unless a side says they are direct.
pub(crate) fn inputs(
    reports: &[(String, String, i64)],
    records: &[NodeRecord],
    hubs: &HashSet<&str>,
    failed: &HashMap<(String, String), i64>,
    now: i64,
) -> PathInputs {
    // Every active key's node, made when a hub's report is first read: most runs have none (at
    // 100,000 nodes, 100,000 keys hashed for nothing).
    let mut by_key: Option<HashMap<&str, &str>> = None;
    let keys = || {
        records
            .iter()
            .filter(|r| r.state == proto::EnrolledState::Active)
            .filter_map(|r| r.wg_public_key.as_deref().map(|k| (k, r.name.as_str())))
            .collect()
    };
    let mut observed = Observed::default();
    let mut standing: HashMap<(String, String), Standing> =
        failed.iter().filter(|(_, until)| **until > now).map(|(pair, _)| (pair.clone(), Standing::Failing)).collect();
    // Direct only when both sides say so: one side's word must not keep a pair's place (nor
    // lift it over the other's failed attempts).
    let mut direct_sides: HashMap<(String, String), u8> = HashMap::new();
    for (node, text, _) in reports {
        let Ok(report) = serde_json::from_str::<proto::PathReport>(text) else { continue };
        if hubs.contains(node.as_str()) {
            let by_key = by_key.get_or_insert_with(keys);
            let seen = observed.by_hub.entry(node.clone()).or_default();
            for o in &report.observed {
                if let (Some(name), Ok(at)) = (by_key.get(o.public_key.as_str()), o.endpoint.parse()) {
                    seen.insert(name.to_string(), at);
                }
            }
        }
        for p in &report.paths {
            match p.state.as_str() {
                "direct" => *direct_sides.entry(pair_key(node, &p.peer)).or_default() += 1,
                "backing-off" => {
                    standing.insert(pair_key(node, &p.peer), Standing::Failing);
                }
                _ => {}
            }
        }
    }
    for (pair, sides) in direct_sides {
        if sides >= 2 {
            standing.entry(pair).or_insert(Standing::Direct);
        }
    }
    PathInputs { observed, standing }
}

/// A time of day as `trellis status` prints it (UTC).
fn clock(t: i64) -> String {
    let s = t.rem_euclid(86_400);
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// How many relayed pairs go each way of `metrics::PAIR_PATHS` (direct, trying, relayed), each
/// pair counted from the side whose name sorts first, as `pair_paths` says them: what status
/// shows, without a line of text for each of millions of pairs. `ranked` are the pairs a run
/// ranked (`Relayed::ranked`); the `others` it did not rank stay on their hub.
pub(crate) fn path_counts(ranked: &[Pair], others: usize, reports: &HashMap<String, proto::PathReport>) -> [usize; 3] {
    let mut counts = [0, 0, others];
    for p in ranked {
        let state = match &p.decision {
            Err(_) => None,
            Ok(_) => reports.get(&*p.a).and_then(|r| r.paths.iter().find(|s| *s.peer == *p.b)).map(|s| s.state.as_str()),
        };
        let path = match state {
            Some("direct") => 0,
            Some("trying") => 1,
            _ => 2,
        };
        counts[path] += 1;
    }
    counts
}

/// The relayed pairs by each of their nodes.
pub(crate) fn by_node(pairs: &[Pair]) -> HashMap<&str, Vec<&Pair>> {
    let mut out: HashMap<&str, Vec<&Pair>> = HashMap::new();
    for p in pairs {
        out.entry(&*p.a).or_default().push(p);
        out.entry(&*p.b).or_default().push(p);
    }
    out
}

/// Each relayed pair of `node`'s (`pairs`, from `by_node`) as status shows it: what the run
/// decided, and what `node`'s agent last said of the path.
pub(crate) fn pair_paths(node: &str, pairs: &[&Pair], said: Option<&proto::PathReport>) -> Vec<proto::PairPath> {
    let mut out = Vec::new();
    for p in pairs {
        let peer = if *p.a == *node { &p.b } else { &p.a };
        let state = said.and_then(|r| r.paths.iter().find(|s| *s.peer == **peer));
        let (path, since, text) = match (&p.decision, state) {
            (Err(why), _) => ("relayed", None, format!("relayed by {}: {why}", p.hub)),
            (Ok(_), Some(s)) if s.state == "direct" => {
                ("direct", Some(s.since), format!("direct since {} (punched through {})", clock(s.since), p.hub))
            }
            (Ok(_), Some(s)) if s.state == "trying" => {
                ("trying", Some(s.since), format!("relayed by {}, trying a direct path since {}", p.hub, clock(s.since)))
            }
            (Ok(_), Some(s)) => {
                let why = s.reason.clone().unwrap_or_else(|| "direct attempts failed".into());
                ("relayed", Some(s.since), format!("relayed by {}: {why}", p.hub))
            }
            (Ok(_), None) => ("relayed", None, format!("relayed by {}, about to try a direct path", p.hub)),
        };
        out.push(proto::PairPath { peer: peer.to_string(), hub: p.hub.to_string(), path: path.into(), since, text });
    }
    out
}

impl Controller {
    /// Records `who`'s report of its paths; a hub's observations are kept (a non-hub's are
    /// dropped: no node's word about itself or its peers is taken). A report of more than
    /// `MAX_PATH_ITEMS` entries is refused. A change that may move a candidate asks for a run.
    pub async fn report_paths(&self, who: &NodeIdentity, report: &proto::PathReport) -> Result<proto::PathAck> {
        self.require_approved(who)?;
        if report.observed.len() > MAX_PATH_ITEMS || report.paths.len() > MAX_PATH_ITEMS {
            return Err(Error::BadRequest(format!("a path report holds at most {MAX_PATH_ITEMS} observations and {MAX_PATH_ITEMS} paths")));
        }
        let hub = match self.current_declaration().await? {
            Some((_, decl)) => decl.nodes.iter().any(|n| n.name == who.name && n.hub),
            None => false,
        };
        // The peers this node may report on: those the last run gave it as candidates.
        let pairs = self.publisher.pairs.read().expect("pairs").clone();
        let peers: HashSet<&str> = pairs
            .relayed
            .ranked
            .iter()
            .filter(|p| p.decision.is_ok())
            .filter_map(|p| {
                if *p.a == *who.name {
                    Some(&*p.b)
                } else if *p.b == *who.name {
                    Some(&*p.a)
                } else {
                    None
                }
            })
            .collect();
        let kept = cleaned(report, hub, &peers);
        let text = serde_json::to_string(&kept).map_err(|e| Error::internal("writing a path report", e))?;
        // What moves a candidate: the observations, and which pairs are direct or failing.
        let moves = |r: &proto::PathReport| {
            let states: Vec<(&str, &str)> =
                r.paths.iter().filter(|p| p.state != "trying").map(|p| (p.peer.as_str(), p.state.as_str())).collect();
            format!("{:?}{states:?}", r.observed)
        };
        let now = self.now();
        {
            let mut failed = self.publisher.failed_pairs.lock().expect("failed pairs");
            failed.retain(|_, until| *until > now);
            for p in kept.paths.iter().filter(|p| p.state == "backing-off") {
                failed.insert(pair_key(&who.name, &p.peer), now + FAILED_HOLD_SECS);
            }
        }
        let before = self.publisher.path_reports.lock().expect("path reports").get(&who.name).cloned();
        if before.as_ref().is_some_and(|b| *b == kept) {
            return Ok(proto::PathAck { observed: kept.observed.len() });
        }
        self.store.report_paths(&who.name, &text, self.now()).await?;
        let ask = before.as_ref().is_none_or(|b| moves(b) != moves(&kept));
        self.publisher.path_reports.lock().expect("path reports").insert(who.name.clone(), kept.clone());
        if ask {
            self.ask_publish();
        }
        Ok(proto::PathAck { observed: kept.observed.len() })
    }

    /// Each node's last path report, by node.
    pub(crate) async fn path_reports(&self) -> Result<HashMap<String, proto::PathReport>> {
        Ok(self
            .store
            .path_reports()
            .await?
            .into_iter()
            .filter_map(|(node, text, _)| Some((node, serde_json::from_str(&text).ok()?)))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pairs by path as a scrape counts them are what status shows, each pair once from the
    /// side whose name sorts first.
    #[test]
    fn path_counts_are_what_status_shows() {
        let at: SocketAddr = "203.0.113.1:1".parse().unwrap();
        let pair = |a: &str, b: &str, ok: bool| Pair {
            a: a.into(),
            b: b.into(),
            hub: "hub".into(),
            decision: if ok { Ok((at, at)) } else { Err(trellis_core::paths::Why::Capped) },
        };
        let pairs = vec![pair("a", "b", true), pair("a", "c", true), pair("a", "d", true), pair("b", "c", true), pair("c", "d", false)];
        let state = |peer: &str, state: &str| proto::PathState { peer: peer.into(), state: state.into(), since: 1, reason: None };
        let reports: HashMap<String, proto::PathReport> = [
            (
                "a".to_string(),
                proto::PathReport { observed: vec![], paths: vec![state("b", "direct"), state("c", "trying"), state("d", "backing-off")] },
            ),
            // What b says of a is not counted: the pair is a's.
            ("b".to_string(), proto::PathReport { observed: vec![], paths: vec![state("a", "trying")] }),
        ]
        .into();
        assert_eq!(path_counts(&pairs, 0, &reports), [1, 1, 3]);
        assert_eq!(path_counts(&pairs, 2, &reports), [1, 1, 5], "pairs not ranked are relayed");
        let by = by_node(&pairs);
        let mut shown = [0; 3];
        for (node, list) in &by {
            for p in pair_paths(node, list, reports.get(*node)) {
                if **node < *p.peer {
                    shown[crate::metrics::PAIR_PATHS.iter().position(|x| *x == p.path).unwrap()] += 1;
                }
            }
        }
        assert_eq!(shown, [1, 1, 3]);
    }

    fn key(b: u8) -> String {
        PublicKey([b; 32]).to_string()
    }

    /// Only a hub's observations are kept, and only well-formed ones; a node's own are dropped.
    #[test]
    fn only_a_hub_s_observations_are_kept() {
        let report = proto::PathReport {
            observed: vec![
                proto::ObservedEndpoint { public_key: key(2), endpoint: "203.0.113.2:4001".into() },
                proto::ObservedEndpoint { public_key: "nope".into(), endpoint: "203.0.113.3:4001".into() },
                proto::ObservedEndpoint { public_key: key(3), endpoint: "somewhere".into() },
            ],
            paths: vec![proto::PathState { peer: "b".into(), state: "sideways".into(), since: 1, reason: None }],
        };
        let peers = HashSet::from(["b"]);
        let hub = cleaned(&report, true, &peers);
        assert_eq!(hub.observed.len(), 1);
        assert!(hub.paths.is_empty(), "an unknown state is dropped");
        assert!(cleaned(&report, false, &peers).observed.is_empty());
        // Only the node's candidates, and only endpoints one may dial.
        let stray = proto::PathReport {
            observed: ["0.0.0.0:4001", "203.0.113.2:0", "127.0.0.1:51820", "224.0.0.1:1", "169.254.1.1:1", "[::ffff:1.2.3.4]:1", "[::1]:1"]
                .iter()
                .map(|e| proto::ObservedEndpoint { public_key: key(2), endpoint: e.to_string() })
                .collect(),
            paths: ["b", "zz"]
                .iter()
                .map(|p| proto::PathState { peer: p.to_string(), state: "backing-off".into(), since: 1, reason: None })
                .collect(),
        };
        let kept = cleaned(&stray, true, &peers);
        assert!(kept.observed.is_empty(), "{:?}", kept.observed);
        assert_eq!(kept.paths.iter().map(|p| p.peer.as_str()).collect::<Vec<_>>(), ["b"]);
    }

    /// A run reads observations by node name from hubs only, and a pair stands direct when either
    /// side says so.
    #[test]
    fn a_run_reads_hubs_observations_by_name() {
        let record = |name: &str, b: u8| NodeRecord {
            name: name.into(),
            state: proto::EnrolledState::Active,
            wg_public_key: Some(key(b)),
            cert_serial: None,
            prev_cert_serial: None,
            cert_not_after: None,
            enrolled_at: 0,
            last_contact: None,
            cert_pem: None,
            pool: None,
            ipv4: None,
            ipv6: None,
        };
        let records = vec![record("hub-1", 1), record("a", 2), record("b", 3)];
        let report = |observed: Vec<(u8, &str)>, paths: Vec<(&str, &str)>| {
            serde_json::to_string(&proto::PathReport {
                observed: observed.into_iter().map(|(k, e)| proto::ObservedEndpoint { public_key: key(k), endpoint: e.into() }).collect(),
                paths: paths
                    .into_iter()
                    .map(|(p, s)| proto::PathState { peer: p.into(), state: s.into(), since: 0, reason: None })
                    .collect(),
            })
            .unwrap()
        };
        let mut reports = vec![
            ("a".to_string(), report(vec![(3, "198.51.100.66:1")], vec![("b", "direct")]), 0),
            ("hub-1".to_string(), report(vec![(2, "203.0.113.2:4001"), (3, "203.0.113.3:4002")], vec![]), 0),
        ];
        let read = inputs(&reports, &records, &HashSet::from(["hub-1"]), &HashMap::new(), 0);
        assert_eq!(read.observed.by_hub.len(), 1, "a's word about b is not an observation");
        assert_eq!(read.observed.by_hub["hub-1"]["b"], "203.0.113.3:4002".parse().unwrap());
        assert_eq!(read.standing("a", "b"), Standing::Unknown, "one side's word is not enough");
        reports.push(("b".to_string(), report(vec![], vec![("a", "direct")]), 0));
        let read = inputs(&reports, &records, &HashSet::from(["hub-1"]), &HashMap::new(), 0);
        assert_eq!(read.standing("a", "b"), Standing::Direct);
        assert_eq!(read.standing("a", "c"), Standing::Unknown);
        // A pair that failed a moment ago ranks last even when no side reports it any more.
        let failed = HashMap::from([(pair_key("c", "a"), 100)]);
        assert_eq!(inputs(&reports, &records, &HashSet::from(["hub-1"]), &failed, 99).standing("a", "c"), Standing::Failing);
        assert_eq!(inputs(&reports, &records, &HashSet::from(["hub-1"]), &failed, 100).standing("a", "c"), Standing::Unknown);
    }
}
