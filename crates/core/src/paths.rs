//! Direct paths through a hub (ADR 0032): which relayed pairs try to reach each other directly,
//! at which endpoints, and `etc/trellis/paths.toml`, the file that tells a node. Pure.
//!
//! A hub both nodes of a relayed pair dial sees each one's NAT-mapped WireGuard endpoint, as a
//! STUN server would. The controller hands each side the endpoint that hub observed for the
//! other; both agents add the other as a peer at that endpoint and send handshakes, and move the
//! pair's addresses off the hub only once one completed. Candidates are only ever what hubs
//! observed: a node's word about itself is never taken.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use toml::de::DeTable;

use crate::decl::{Declaration, PublicKey};
use crate::nodefile::quoted;
use crate::plan::NodePlan;
use crate::{Compiled, Keys};

/// The most pairs one hub has trying at once (not yet direct): a burst of new nodes behind it
/// starts at most these, and the rest start as those end (ADR 0032).
pub const ATTEMPTS_PER_HUB: usize = 256;

/// The most candidates one `paths.toml` may hold: a bound on what an agent reads.
pub const MAX_CANDIDATES: usize = 65_536;

/// One relayed peer a node may try to reach directly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// The peer's node name and WireGuard key.
    pub peer: String,
    pub public_key: PublicKey,
    /// Where the hub saw the peer's packets come from.
    pub endpoint: SocketAddr,
    /// The hub that relays the pair and observed the endpoint, and its key.
    pub hub: String,
    pub hub_key: PublicKey,
    /// The peer's overlay addresses as AllowedIPs entries (`10.88.0.3/32`): they move from the
    /// hub's peer to the direct one once a handshake completed.
    pub allowed_ips: Vec<String>,
}

/// What hubs observed: per hub, the endpoint each node it has a session with sends from.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    pub by_hub: HashMap<String, HashMap<String, SocketAddr>>,
}

impl Observed {
    /// The nodes whose NAT maps by destination: two hubs saw one address with different ports.
    /// Each with the ports seen, in order.
    pub fn by_destination(&self) -> HashMap<&str, Vec<u16>> {
        let mut seen: HashMap<&str, BTreeMap<std::net::IpAddr, std::collections::BTreeSet<u16>>> = HashMap::new();
        for nodes in self.by_hub.values() {
            for (node, at) in nodes {
                seen.entry(node.as_str()).or_default().entry(at.ip()).or_default().insert(at.port());
            }
        }
        seen.into_iter()
            .filter_map(|(node, ips)| ips.into_values().find(|ports| ports.len() > 1).map(|ports| (node, ports.into_iter().collect())))
            .collect()
    }
}

/// How a pair stands as its agents last said: the controller keeps direct pairs' candidates and
/// gives waiting pairs the places of those that keep failing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Standing {
    /// Either side reports the path direct.
    Direct,
    #[default]
    Unknown,
    /// Either side is backing off after failed attempts.
    Failing,
}

/// Why a relayed pair does not try a direct path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Why {
    /// `direct = false` on this node, or on this network of it.
    Off { node: String, network: Option<String> },
    /// The hub has no session with this node (it is down, or has not dialled the hub yet).
    NotSeen { node: Arc<str> },
    /// Two hubs saw this node's address with different ports: its NAT maps by destination, so
    /// the port a hub saw is not the one its peer would reach.
    ByDestination { node: String, ports: Vec<u16> },
    /// The hub saw both nodes send from one address: they sit behind one NAT, which does not
    /// send a packet from inside back inside (hairpinning), so the endpoint the hub saw is no
    /// way from one to the other. Their LAN endpoints, declared, connect them directly.
    OneAddress { ip: std::net::IpAddr },
    /// The hub has `ATTEMPTS_PER_HUB` pairs trying already.
    Capped,
}

impl std::fmt::Display for Why {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Why::Off { node, network: None } => write!(f, "{node} is declared `direct = false`"),
            Why::Off { node, network: Some(n) } => write!(f, "{node} is on network {n}, declared `direct = false`"),
            Why::NotSeen { node } => write!(f, "the hub has no session with {node}"),
            Why::ByDestination { node, ports } => {
                let ports: Vec<String> = ports.iter().map(u16::to_string).collect();
                write!(f, "{node}'s NAT maps by destination (hubs saw ports {})", ports.join(" and "))
            }
            Why::OneAddress { ip } => {
                write!(f, "both reach the hub from {ip}, behind one NAT (declare their LAN endpoints to connect them directly)")
            }
            Why::Capped => write!(f, "the hub has {ATTEMPTS_PER_HUB} pairs trying already; this one waits its turn"),
        }
    }
}

/// One relayed pair (names in order), its hub, and whether it tries a direct path.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pair {
    /// The names, shared with the compiled output: a run at 100,000 nodes decides millions of
    /// pairs, and a copy of three names each was most of its time and gigabytes held.
    pub a: Arc<str>,
    pub b: Arc<str>,
    pub hub: Arc<str>,
    /// The endpoints the hub observed for `a` and `b`, or why the pair stays on its hub.
    pub decision: Result<(SocketAddr, SocketAddr), Why>,
}

impl Decided {
    /// The endpoints of each pair that tries or is direct, for the next run's `last`.
    pub fn endpoints(&self) -> HashMap<(String, String), (SocketAddr, SocketAddr)> {
        self.relayed.ranked.iter().filter_map(|p| Some(((p.a.to_string(), p.b.to_string()), p.decision.clone().ok()?))).collect()
    }
}

/// What `decide` gives: each node's candidates (in peer name order) and the relayed pairs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Decided {
    pub candidates: HashMap<String, Vec<Candidate>>,
    pub relayed: Relayed,
}

/// Every relayed pair as a run decided it, without a value for each. At 100,000 nodes the
/// relayed pairs are tens of millions, nearly all on their hub because it sees neither side (no
/// agent reported from there yet): a run that made one value each spent seconds and gigabytes
/// on them, for `trellis status` alone. The pairs a hub saw both sides of are ranked and kept,
/// each with its decision; every other pair's reason follows from the declaration and what the
/// hubs saw, kept here, and is made only when asked for (`all`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Relayed {
    /// The pairs ranked for a place (their hub saw both sides, or they were kept direct from the
    /// run before), each with its decision, in (a, b, hub) order.
    pub ranked: Vec<Pair>,
    /// How many relayed pairs are not ranked: each stays on its hub, for a reason `all` gives.
    pub others: usize,
    /// The nodes declared `direct = false`, on themselves or a network (`off`).
    off: HashMap<String, Option<String>>,
    /// The nodes each hub saw, by hub.
    seen: HashMap<String, HashSet<String>>,
}

impl Relayed {
    /// How many relayed pairs there are.
    pub fn len(&self) -> usize {
        self.ranked.len() + self.others
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every relayed pair of `plans` (every node's, in name order, of the output these pairs
    /// were decided on: `Compiled::plans`), in (a, b, hub) order, with its decision: the ranked
    /// ones as decided, every other with why it stays on its hub.
    pub fn all<'p>(&self, plans: impl IntoIterator<Item = &'p NodePlan>) -> Vec<Pair> {
        let empty = HashSet::new();
        let mut all = Vec::with_capacity(self.len());
        let mut ranked = self.ranked.iter().peekable();
        for plan in plans {
            let a = &plan.node;
            let from = all.len();
            for hub in plan.peers.iter().filter(|p| !p.relays_for.is_empty()) {
                let seen = self.seen.get(hub.name()).unwrap_or(&empty);
                let seen_a = seen.contains(&**a);
                for b in after(&hub.relays_for, a) {
                    let why = self.why(a, &b.name, seen_a);
                    all.push(Pair { a: a.clone(), b: b.name.clone(), hub: hub.node.name.clone(), decision: Err(why) });
                }
            }
            all[from..].sort_unstable_by(|x, y| (&x.b, &x.hub).cmp(&(&y.b, &y.hub)));
            // The ranked pairs of this node take the place of theirs.
            let mut mine = Vec::new();
            while ranked.peek().is_some_and(|r| r.a == *a) {
                mine.extend(ranked.next());
            }
            if !mine.is_empty() {
                let theirs = all.split_off(from);
                let mut mine = mine.into_iter().peekable();
                for p in theirs {
                    while mine.peek().is_some_and(|r| (&r.b, &r.hub) < (&p.b, &p.hub)) {
                        all.extend(mine.next().cloned());
                    }
                    if mine.peek().is_some_and(|r| (&r.b, &r.hub) == (&p.b, &p.hub)) {
                        all.extend(mine.next().cloned());
                    } else {
                        all.push(p);
                    }
                }
                all.extend(mine.cloned());
            }
        }
        all
    }

    /// The relayed pair of nodes `a` and `b` through `hub`, as `all` gives it, if the plans relay
    /// it; `plan_of` finds a node's plan among them. A few lookups, where `all` walks every pair:
    /// for the picture's links.
    pub fn pair<'p>(&self, plan_of: impl Fn(&str) -> Option<&'p NodePlan>, a: &str, b: &str, hub: &str) -> Option<Pair> {
        let (a, b) = if a < b { (a, b) } else { (b, a) };
        let plan = plan_of(a)?;
        if let Ok(i) = self.ranked.binary_search_by(|p| (&*p.a, &*p.b, &*p.hub).cmp(&(a, b, hub))) {
            return Some(self.ranked[i].clone());
        }
        let through = plan.peers.iter().find(|p| p.name() == hub && !p.relays_for.is_empty())?;
        let b = &through.relays_for[through.relays_for.binary_search_by(|t| (*t.name).cmp(b)).ok()?].name;
        let seen_a = self.seen.get(hub).is_some_and(|s| s.contains(a));
        Some(Pair { a: plan.node.clone(), b: b.clone(), hub: through.node.name.clone(), decision: Err(self.why(&plan.node, b, seen_a)) })
    }

    /// Why the pair of `a` and `b`, not ranked, stays on its hub: a side declared off, or else
    /// the side the hub does not see.
    fn why(&self, a: &Arc<str>, b: &Arc<str>, seen_a: bool) -> Why {
        match self.off.get(&**a).map(|w| (a, w)).or_else(|| self.off.get(&**b).map(|w| (b, w))) {
            Some((n, network)) => Why::Off { node: n.to_string(), network: network.clone() },
            None => Why::NotSeen { node: if seen_a { b } else { a }.clone() },
        }
    }
}

/// The nodes of a hub's `relays_for` (in name order) whose names sort after `a`: the pairs `a`
/// counts as its own.
fn after<'l>(relays_for: &'l [Arc<crate::plan::NodeText>], a: &str) -> &'l [Arc<crate::plan::NodeText>] {
    debug_assert!(relays_for.windows(2).all(|w| w[0].name < w[1].name), "relays_for is in name order");
    &relays_for[relays_for.partition_point(|b| *b.name <= *a)..]
}

/// How many relayed pairs each node's plan names (the nodes after it by name that a hub relays
/// for it), kept from one decision to the next: a recompile counts again only the plans it
/// rendered. Counting every plan looked each node up in every relaying hub's list: 105 ms a
/// publish run at 100,000 nodes (7.8 million pairs), for a count that a one-node change barely
/// moves.
#[derive(Clone, Debug, Default)]
pub struct PairCounts {
    by_node: crate::FastMap<Arc<str>, usize>,
    total: usize,
}

impl PairCounts {
    /// The relayed pairs `plan` names.
    fn of(plan: &NodePlan) -> usize {
        plan.peers.iter().filter(|p| !p.relays_for.is_empty()).map(|hub| after(&hub.relays_for, &plan.node).len()).sum()
    }

    /// Brought up to `compiled` and its total: when these counts are of the compile `compiled`
    /// was made from, only the plans it rendered are counted again (a plan it did not render is
    /// the one counted); else (another compile, a first one) every plan is.
    pub fn update(&mut self, compiled: &Compiled) -> usize {
        for name in &compiled.rendered {
            let now = compiled.nodes.get(name).map(|o| Self::of(&o.plan));
            let was = match now {
                Some(n) => self.by_node.insert(Arc::from(name.as_str()), n),
                None => self.by_node.remove(name.as_str()),
            };
            self.total = self.total + now.unwrap_or(0) - was.unwrap_or(0);
        }
        // Every node compiled is counted now (one it did not render was in the compile before,
        // so counted); as many as compiled means no node left.
        if self.by_node.len() != compiled.nodes.len() {
            self.by_node = compiled.nodes.iter().map(|(n, o)| (Arc::from(n.as_str()), Self::of(&o.plan))).collect();
            self.total = self.by_node.values().sum();
        }
        debug_assert_eq!(self.total, compiled.plans().map(Self::of).sum::<usize>(), "the counts follow the compiles");
        self.total
    }
}

/// Why a node takes no direct paths: `direct = false` on it or on one of its networks.
pub fn off(decl: &Declaration) -> HashMap<&str, Option<&str>> {
    let off_networks: HashSet<&str> = decl.networks.iter().filter(|n| !n.direct).map(|n| n.name.as_str()).collect();
    decl.nodes
        .iter()
        .filter_map(|n| {
            if !n.direct {
                return Some((n.name.as_str(), None));
            }
            n.networks.iter().find(|w| off_networks.contains(w.as_str())).map(|w| (n.name.as_str(), Some(w.as_str())))
        })
        .collect()
}

/// Decides, for every pair the compiled mesh relays, whether it tries a direct path and at which
/// endpoints: both nodes take direct paths, the hub observed both, from two addresses, neither NAT
/// maps by destination, and the hub has a place among its `ATTEMPTS_PER_HUB` (pairs already direct first,
/// then in name order, pairs that keep failing last).
///
/// A pair both of whose sides say it is direct keeps the endpoints `last` gives it (the run
/// before's) when its hub no longer sees a side (the hub restarted, a node went quiet towards
/// it): it does not need the hub, and withdrawing it would reach its two sides at different
/// moments, each dropping what the other still sends directly.
///
/// Only pairs whose hub saw both sides, or kept from the run before, are looked at one by one;
/// the others are counted (`Relayed`): from `counts`, the counts of the compile before for a
/// recompile (only the plans it rendered are counted again; `PairCounts::default()` counts every
/// plan), brought up to `compiled`.
pub fn decide(
    compiled: &Compiled,
    keys: &Keys,
    decl: &Declaration,
    observed: &Observed,
    standing: &dyn Fn(&str, &str) -> Standing,
    last: &HashMap<(String, String), (SocketAddr, SocketAddr)>,
    counts: &mut PairCounts,
) -> Decided {
    let pairs = counts.update(compiled);
    let off = off(decl);
    let by_destination = observed.by_destination();
    let empty = HashMap::new();
    // The nodes of a pair kept direct from the run before: only those pairs are looked up there.
    let kept_nodes: HashSet<&str> = last.keys().map(|(a, _)| a.as_str()).collect();
    // Every relayed pair once (a < b), with its hub. Only a pair its hub saw both sides of, or
    // kept from the run before, can be a candidate: those are ranked by how they stand (their
    // order decides who gets a place under the cap). Every other pair stays on its hub, for a
    // reason that needs no rank, and is only counted.
    // How a pair stands, and its two nodes and hub.
    type Ranked<'n> = (Standing, &'n Arc<str>, &'n Arc<str>, &'n Arc<str>);
    let mut ranked: Vec<Ranked> = Vec::new();
    // Only a node some hub saw, or of a pair kept, can be the first of a ranked pair: only their
    // plans are read (every pair is counted in `counts`).
    let mut looked: std::collections::BTreeSet<&str> = kept_nodes.iter().copied().collect();
    looked.extend(observed.by_hub.values().flat_map(|nodes| nodes.keys().map(String::as_str)));
    for out in looked.into_iter().filter_map(|a| compiled.nodes.get(a)) {
        let a = &out.plan.node;
        let a_kept = kept_nodes.contains(&**a);
        for hub in out.plan.peers.iter().filter(|p| !p.relays_for.is_empty()) {
            let seen = observed.by_hub.get(hub.name()).unwrap_or(&empty);
            let seen_a = seen.contains_key(&**a);
            if !seen_a && !a_kept {
                continue;
            }
            for b in after(&hub.relays_for, a) {
                let b = &b.name;
                if (seen_a && seen.contains_key(&**b)) || (a_kept && last.contains_key(&(a.to_string(), b.to_string()))) {
                    ranked.push((standing(a, b), a, b, &hub.node.name));
                }
            }
        }
    }
    ranked.sort();
    let allowed_of = |n: &str| compiled.nodes.get(n).map(|o| allowed_ips(o.plan.ipv4, o.plan.ipv6)).unwrap_or_default();
    let mut decided = Decided::default();
    let mut trying: HashMap<&str, usize> = HashMap::new();
    for (stand, a_name, b_name, hub_name) in ranked {
        let (a, b, hub): (&str, &str, &str) = (a_name, b_name, hub_name);
        let seen = observed.by_hub.get(hub).unwrap_or(&empty);
        let decision = (|| {
            for n in [a, b] {
                if let Some(network) = off.get(n) {
                    return Err(Why::Off { node: n.to_string(), network: network.map(str::to_string) });
                }
            }
            let kept = || last.get(&(a.to_string(), b.to_string())).filter(|_| stand == Standing::Direct);
            let (Some(at_a), Some(at_b)) = (seen.get(a), seen.get(b)) else {
                if let Some(&(at_a, at_b)) = kept() {
                    return Ok((at_a, at_b));
                }
                let node = if seen.contains_key(a) { b_name } else { a_name };
                return Err(Why::NotSeen { node: node.clone() });
            };
            for n in [a, b] {
                if let Some(ports) = by_destination.get(n) {
                    return Err(Why::ByDestination { node: n.to_string(), ports: ports.clone() });
                }
            }
            if at_a.ip() == at_b.ip() {
                return Err(Why::OneAddress { ip: at_a.ip() });
            }
            let count = trying.entry(hub).or_default();
            if stand != Standing::Direct {
                if *count >= ATTEMPTS_PER_HUB {
                    return Err(Why::Capped);
                }
                *count += 1;
            }
            Ok((*at_a, *at_b))
        })();
        if let (Ok((at_a, at_b)), Some(ka), Some(kb), Some(kh)) = (&decision, keys.get(a), keys.get(b), keys.get(hub)) {
            let candidate = |peer: &str, key: PublicKey, endpoint: SocketAddr| Candidate {
                peer: peer.to_string(),
                public_key: key,
                endpoint,
                hub: hub.to_string(),
                hub_key: kh,
                allowed_ips: allowed_of(peer),
            };
            decided.candidates.entry(a.to_string()).or_default().push(candidate(b, kb, *at_b));
            decided.candidates.entry(b.to_string()).or_default().push(candidate(a, ka, *at_a));
        }
        decided.relayed.ranked.push(Pair { a: a_name.clone(), b: b_name.clone(), hub: hub_name.clone(), decision });
    }
    for list in decided.candidates.values_mut() {
        list.sort_by(|x, y| x.peer.cmp(&y.peer));
    }
    decided.relayed.ranked.sort_unstable_by(|x, y| (&x.a, &x.b, &x.hub).cmp(&(&y.a, &y.b, &y.hub)));
    decided.relayed.others = pairs - decided.relayed.ranked.len();
    decided.relayed.off = off.into_iter().map(|(n, w)| (n.to_string(), w.map(str::to_string))).collect();
    decided.relayed.seen = observed.by_hub.iter().map(|(hub, nodes)| (hub.clone(), nodes.keys().cloned().collect())).collect();
    decided
}

/// A node's overlay addresses as AllowedIPs entries.
fn allowed_ips(v4: Option<std::net::Ipv4Addr>, v6: Option<std::net::Ipv6Addr>) -> Vec<String> {
    v4.map(|a| format!("{a}/32")).into_iter().chain(v6.map(|a| format!("{a}/128"))).collect()
}

/// The text of `paths.toml` for `node`: one `[[peer]]` per candidate, in the order given.
pub fn write(node: &str, candidates: &[Candidate]) -> String {
    let mut s = format!(
        "# trellis: the relayed peers node {node} may reach directly, each at the endpoint its hub saw.\n\
         # Generated; do not edit. The agent moves a peer's addresses off the hub once a handshake\n\
         # at that endpoint completed, and back when the direct session goes stale (ADR 0032).\n"
    );
    for c in candidates {
        let ips: Vec<String> = c.allowed_ips.iter().map(|a| quoted(a)).collect();
        let _ = write!(
            s,
            "\n[[peer]]\nname = {}\npublic_key = \"{}\"\nendpoint = \"{}\"\nhub = {}\nhub_key = \"{}\"\nallowed_ips = [{}]\n",
            quoted(&c.peer),
            c.public_key,
            c.endpoint,
            quoted(&c.hub),
            c.hub_key,
            ips.join(", ")
        );
    }
    s
}

/// Reads `paths.toml`; anything but `[[peer]]` tables with exactly the keys `write` writes is an
/// error naming what is wrong.
pub fn parse(text: &str) -> Result<Vec<Candidate>, String> {
    let table = DeTable::parse(text).map_err(|e| format!("paths.toml: invalid TOML: {}", e.message().trim_end_matches('\n')))?;
    let mut out = Vec::new();
    for (key, value) in table.get_ref().iter() {
        if key.get_ref() != "peer" {
            return Err(format!("paths.toml: unknown key `{}`", key.get_ref()));
        }
        let peers = value.get_ref().as_array().ok_or("paths.toml: `peer` must be an array of tables")?;
        if peers.len() > MAX_CANDIDATES {
            return Err(format!("paths.toml: more than {MAX_CANDIDATES} peers"));
        }
        for (i, p) in peers.iter().enumerate() {
            let t = p.get_ref().as_table().ok_or("paths.toml: `peer` must be an array of tables")?;
            let at = |problem: &str| format!("paths.toml: peer {}: {problem}", i + 1);
            let string = |k: &str| -> Result<String, String> {
                t.get(k).and_then(|v| v.get_ref().as_str()).map(str::to_string).ok_or_else(|| at(&format!("`{k}` must be a string")))
            };
            let key = |k: &str| -> Result<PublicKey, String> {
                PublicKey::parse(&string(k)?).ok_or_else(|| at(&format!("`{k}` is not a WireGuard public key")))
            };
            if let Some((k, _)) =
                t.iter().find(|(k, _)| !["name", "public_key", "endpoint", "hub", "hub_key", "allowed_ips"].contains(&k.get_ref().as_ref()))
            {
                return Err(at(&format!("unknown key `{}`", k.get_ref())));
            }
            let endpoint = string("endpoint")?.parse().map_err(|_| at("`endpoint` is not IP:PORT"))?;
            let ips = t.get("allowed_ips").and_then(|v| v.get_ref().as_array()).ok_or_else(|| at("`allowed_ips` must be an array"))?;
            let mut allowed_ips = Vec::new();
            for ip in ips.iter() {
                let ip = ip
                    .get_ref()
                    .as_str()
                    .filter(|s| s.parse::<ipnet::IpNet>().is_ok())
                    .ok_or_else(|| at("`allowed_ips` holds something that is not a prefix"))?;
                allowed_ips.push(ip.to_string());
            }
            out.push(Candidate {
                peer: string("name")?,
                public_key: key("public_key")?,
                endpoint,
                hub: string("hub")?,
                hub_key: key("hub_key")?,
                allowed_ips,
            });
        }
    }
    Ok(out)
}
