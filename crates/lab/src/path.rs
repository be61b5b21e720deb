//! The path expectation (`proto = "path"`): whether `from`'s interface reaches `to` directly or
//! through a hub, read from what the interfaces themselves report in the agents' status files
//! (`agent-status.json`) and, for direct, confirmed by a ping over the overlay. The agent's own
//! view of the path (`paths`) is printed beside the row, never decided by.
//!
//! `decide` is a function of the parsed statuses and the clock; `check` reads the files, pings
//! and waits.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ipnet::IpNet;
use serde::Deserialize;

use crate::checks::{ns, ping, Row};
use crate::file::{Expect, Outcome};
use crate::LabState;

/// The longest a path row waits for its result.
const WAIT: Duration = Duration::from_secs(90);
/// How often it looks again.
const POLL: Duration = Duration::from_millis(200);
/// A handshake older than this is no evidence of a direct path: WireGuard hands shake again every
/// two minutes while a peer is in use.
pub(crate) const FRESH_SECS: u64 = 180;
/// A `relayed` row is met by a look at least this long after the moment it is timed from (both
/// agents running, or the step before it), so that a pair that would go direct has had the time.
const RELAYED_AFTER_MS: u64 = 30_000;

/// The part of an agent's status file a path row reads.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Status {
    /// This node's WireGuard key.
    #[serde(default)]
    pub public_key: Option<String>,
    #[serde(default)]
    pub peers: Vec<Peer>,
    #[serde(default)]
    pub paths: Vec<AgentPath>,
    /// Unix seconds when the agent wrote it.
    #[serde(default)]
    pub updated_at: i64,
}

/// One peer as the interface reports it.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct Peer {
    pub public_key: String,
    #[serde(default)]
    pub endpoint: Option<String>,
    /// Unix seconds.
    #[serde(default)]
    pub last_handshake: Option<u64>,
    #[serde(default)]
    pub allowed_ips: Vec<String>,
}

/// The agent's own view of a relayed peer's path.
#[derive(Debug, Default, Deserialize)]
pub(crate) struct AgentPath {
    pub public_key: String,
    #[serde(default)]
    pub peer: String,
    #[serde(default)]
    pub state: String,
    /// Unix seconds when the path came to its state.
    #[serde(default)]
    pub since: i64,
    #[serde(default)]
    pub reason: Option<String>,
}

/// What `from`'s interface shows of its way to `to`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Seen {
    /// `to`'s own peer entry holds its address, with a fresh handshake at an endpoint that is no
    /// hub's.
    Direct { endpoint: String },
    /// Another peer's entry (a hub's, `by`) holds `to`'s address.
    Relayed { by: String, prefix: String },
    /// Neither, and why.
    Neither(String),
}

impl Seen {
    /// The result it is: `direct`, `relayed`, or neither.
    pub(crate) fn outcome(&self) -> Option<Outcome> {
        match self {
            Seen::Direct { .. } => Some(Outcome::Direct),
            Seen::Relayed { .. } => Some(Outcome::Relayed),
            Seen::Neither(_) => None,
        }
    }

    fn describe(&self) -> String {
        match self {
            Seen::Direct { endpoint } => format!("direct at {endpoint}"),
            Seen::Relayed { by, prefix } => format!("relayed ({by} peer holds {prefix})"),
            Seen::Neither(why) => format!("neither ({why})"),
        }
    }
}

/// Whether `allowed` (`10.88.0.3/32`) is exactly `addr`, as one host's prefix.
fn is_host_prefix(allowed: &str, addr: IpAddr) -> bool {
    allowed.parse::<IpNet>().is_ok_and(|p| p.addr() == addr && p.prefix_len() == p.max_prefix_len())
}

/// The path `from`'s interface takes to the node with key `to_key` and overlay addresses
/// `to_addrs`, at unix second `now`; `hubs` are the hubs' names and keys. Direct: `to`'s peer
/// entry holds one of its addresses as a host prefix, handshook within `FRESH_SECS`, at an
/// endpoint none of `from`'s hub peer entries has. Relayed: another peer's entry holds it.
pub(crate) fn decide(from: &Status, to_key: &str, to_addrs: &[IpAddr], hubs: &[(String, String)], now: u64) -> Seen {
    let holds = |p: &Peer| to_addrs.iter().find_map(|a| p.allowed_ips.iter().find(|x| is_host_prefix(x, *a)).cloned());
    let hub_endpoints: Vec<&str> =
        from.peers.iter().filter(|p| hubs.iter().any(|(_, k)| *k == p.public_key)).filter_map(|p| p.endpoint.as_deref()).collect();
    if let Some(own) = from.peers.iter().find(|p| p.public_key == to_key) {
        if let Some(prefix) = holds(own) {
            let Some(endpoint) = own.endpoint.clone() else {
                return Seen::Neither(format!("its own peer holds {prefix} but has no endpoint"));
            };
            if hub_endpoints.contains(&endpoint.as_str()) {
                return Seen::Neither(format!("its own peer holds {prefix} at {endpoint}, a hub's endpoint"));
            }
            return match own.last_handshake {
                Some(t) if now.saturating_sub(t) <= FRESH_SECS => Seen::Direct { endpoint },
                Some(t) => {
                    Seen::Neither(format!("its own peer holds {prefix} at {endpoint}, last handshake {} s ago", now.saturating_sub(t)))
                }
                None => Seen::Neither(format!("its own peer holds {prefix} at {endpoint}, no handshake yet")),
            };
        }
    }
    for p in from.peers.iter().filter(|p| p.public_key != to_key) {
        if let Some(prefix) = holds(p) {
            let by =
                hubs.iter().find(|(_, k)| *k == p.public_key).map_or_else(|| format!("key {}", short(&p.public_key)), |(n, _)| n.clone());
            return Seen::Relayed { by, prefix };
        }
    }
    let addrs: Vec<String> = to_addrs.iter().map(IpAddr::to_string).collect();
    Seen::Neither(format!("no peer holds {}", addrs.join(" or ")))
}

/// The first eight characters of a key, as a note prints it.
fn short(key: &str) -> &str {
    &key[..key.len().min(8)]
}

/// What the agent says of its path to `to_key`: its state, and why it is not direct.
pub(crate) fn agent_view(from: &Status, to_key: &str) -> String {
    view(from.paths.iter().find(|p| p.public_key == to_key))
}

/// A path as the agent lists it: its state, and why it is not direct.
fn view(path: Option<&AgentPath>) -> String {
    match path {
        Some(AgentPath { state, reason: Some(r), .. }) => format!("{state} ({r})"),
        Some(p) => p.state.clone(),
        None => "lists no path".into(),
    }
}

/// Host `host`'s agent status, as last written; the default while there is none (or it is being
/// replaced).
fn status(st: &LabState, host: &str) -> Status {
    let path = st.dir.join(format!("agent-{host}/agent-status.json"));
    std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default()
}

/// Every path the running agents list as direct, as (agent, peer) with the moment it became
/// direct (a paused agent's status says nothing of now).
pub(crate) fn direct_sessions(st: &LabState) -> std::collections::BTreeMap<(String, String), i64> {
    let mut out = std::collections::BTreeMap::new();
    for host in st.agents.iter().filter(|h| !st.paused.contains(h)) {
        for p in status(st, host).paths.into_iter().filter(|p| p.state == "direct") {
            out.insert((host.clone(), p.peer), p.since);
        }
    }
    out
}

/// When host `host`'s agent last wrote its status (unix seconds; 0 for none).
pub(crate) fn status_written(st: &LabState, host: &str) -> i64 {
    status(st, host).updated_at
}

/// What agent `from` says of its path to the peer named `to` (`agent_view`, by name).
pub(crate) fn agent_view_of(st: &LabState, from: &str, to: &str) -> String {
    view(status(st, from).paths.iter().find(|p| p.peer == to))
}

/// Every path an agent lists that is neither direct nor trying, as `from -> peer: state (reason)`:
/// what the controller's `trellis_pairs` counts among the relayed, printed so that a run that
/// counts fewer direct pairs than it should says which and why.
pub(crate) fn unsettled(st: &LabState) -> Vec<String> {
    let mut out = Vec::new();
    for host in &st.agents {
        for p in status(st, host).paths {
            if p.state != "direct" && p.state != "trying" {
                out.push(format!("{host} -> {}: {} ({})", p.peer, p.state, p.reason.as_deref().unwrap_or("no reason given")));
            }
        }
    }
    out
}

/// The moment (unix milliseconds) a path row between `from` and `to` is timed from: the step
/// before it, or else the later of the two agents' starts.
fn timed_from(st: &LabState, from: &str, to: &str) -> u64 {
    let step = st.step_at_ms.filter(|_| st.steps_done > 0);
    let agents = [from, to].iter().map(|h| st.agent_started_ms.get(*h).copied()).collect::<Option<Vec<u64>>>();
    step.or(agents.and_then(|a| a.into_iter().max())).unwrap_or_else(crate::unix_ms)
}

/// A path row: looks every `POLL` until the pair shows the expected result (`direct` confirmed
/// by a ping to `to`'s overlay address), at most `WAIT`; prints how long it took, or what it saw
/// last.
pub(crate) fn check(e: &Expect, addrs: &HashMap<String, Vec<IpAddr>>, hubs: &[String], st: &LabState) -> Result<Row> {
    let to = e.to.as_deref().context("a path expectation needs `to`")?;
    let want = e.result.context("a path expectation needs `result`")?;
    let to_addrs = addrs.get(to).cloned().with_context(|| format!("path to `{to}`: it has no overlay address"))?;
    let dst = to_addrs.iter().find(|a| a.is_ipv4()).or(to_addrs.first()).context("path: no overlay address")?.to_string();
    let from_ns = ns(st, &e.from);
    let since = timed_from(st, &e.from, to);
    let deadline = Instant::now() + WAIT;
    let mut looks = 0;
    loop {
        looks += 1;
        let from = status(st, &e.from);
        let to_key = status(st, to).public_key.unwrap_or_default();
        let hub_keys: Vec<(String, String)> = hubs.iter().filter_map(|h| status(st, h).public_key.map(|k| (h.clone(), k))).collect();
        let mut seen = if to_key.is_empty() {
            Seen::Neither(format!("the status of `{to}` names no key yet"))
        } else {
            decide(&from, &to_key, &to_addrs, &hub_keys, crate::unix_ms() / 1000)
        };
        // A ping confirms a direct path, and gives a stale one a reason to hand shake again.
        if !matches!(seen, Seen::Relayed { .. }) && !ping(&from_ns, &dst, 1)? {
            if let Seen::Direct { endpoint } = &seen {
                seen = Seen::Neither(format!("direct at {endpoint}, but no ping answered"));
            }
        }
        let after = crate::unix_ms().saturating_sub(since);
        let met = match want {
            Outcome::Relayed => seen.outcome() == Some(Outcome::Relayed) && after >= RELAYED_AFTER_MS,
            _ => seen.outcome() == Some(want),
        };
        // A direct path seen is the answer, also to a row that expects relayed.
        let settled = met || seen.outcome() == Some(Outcome::Direct);
        if settled || Instant::now() >= deadline {
            let first = if looks == 1 { " (first look)" } else { "" };
            let figure = format!("{:.1} s", after as f64 / 1000.0);
            let note = if settled {
                format!("{} after {figure}{first}; agent: {}", seen.describe(), agent_view(&from, &to_key))
            } else {
                format!("still {} after {figure}; agent: {}", seen.describe(), agent_view(&from, &to_key))
            };
            let seen = seen.outcome().map_or("neither", Outcome::as_str).to_string();
            return Ok(Row { from: e.from.clone(), what: format!("path -> {to}"), expected: want.as_str().into(), seen, note });
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::{decide, Seen, Status};

    const NOW: u64 = 1_800_000_000;

    /// home-1's status: hub-1 at 198.51.100.10:51820, home-2 (key K2) with `peer`'s fields.
    fn from(home2: serde_json::Value, hub_allowed: &[&str]) -> Status {
        let v = serde_json::json!({
            "public_key": "K1",
            "peers": [
                {"public_key": "KH", "endpoint": "198.51.100.10:51820", "last_handshake": NOW - 5, "allowed_ips": hub_allowed},
                home2,
            ],
            "paths": [{"peer": "home-2", "public_key": "K2", "hub": "hub-1", "state": "trying", "since": NOW, "endpoint": "x", "reason": "no answer yet"}],
        });
        serde_json::from_value(v).unwrap()
    }

    fn check(tag: &str, status: Status, want: Seen) {
        let hubs = [("hub-1".to_string(), "KH".to_string())];
        let to = ["10.88.0.3".parse().unwrap(), "fd00::3".parse().unwrap()];
        assert_eq!(decide(&status, "K2", &to, &hubs, NOW), want, "{tag}");
    }

    /// Direct, relayed or neither, from the statuses alone: a handshake too old or an endpoint
    /// that is a hub's is not direct, whatever holds the address.
    #[test]
    fn a_path_is_decided_from_the_interfaces_report() {
        let home2 = |endpoint: &str, handshake: Option<u64>, allowed: &[&str]| serde_json::json!({"public_key": "K2", "endpoint": endpoint, "last_handshake": handshake, "allowed_ips": allowed});
        let direct = Seen::Direct { endpoint: "198.51.100.251:51820".into() };
        check("direct", from(home2("198.51.100.251:51820", Some(NOW - 3), &["10.88.0.3/32"]), &["10.88.0.1/32"]), direct.clone());
        check(
            "direct-v6",
            from(home2("198.51.100.251:51820", Some(NOW - 180), &["fd00::3/128"]), &["10.88.0.1/32", "10.88.0.3/32"]),
            direct,
        );
        check(
            "relayed",
            from(home2("198.51.100.251:51820", Some(NOW - 3), &[]), &["10.88.0.1/32", "10.88.0.3/32"]),
            Seen::Relayed { by: "hub-1".into(), prefix: "10.88.0.3/32".into() },
        );
        check(
            "stale",
            from(home2("198.51.100.251:51820", Some(NOW - 181), &["10.88.0.3/32"]), &["10.88.0.1/32"]),
            Seen::Neither("its own peer holds 10.88.0.3/32 at 198.51.100.251:51820, last handshake 181 s ago".into()),
        );
        check(
            "never",
            from(home2("198.51.100.251:51820", None, &["10.88.0.3/32"]), &["10.88.0.1/32"]),
            Seen::Neither("its own peer holds 10.88.0.3/32 at 198.51.100.251:51820, no handshake yet".into()),
        );
        check(
            "hub-endpoint",
            from(home2("198.51.100.10:51820", Some(NOW - 3), &["10.88.0.3/32"]), &["10.88.0.1/32"]),
            Seen::Neither("its own peer holds 10.88.0.3/32 at 198.51.100.10:51820, a hub's endpoint".into()),
        );
        check(
            "wider-prefix",
            from(home2("198.51.100.251:51820", Some(NOW - 3), &["10.88.0.0/24"]), &["10.88.0.1/32"]),
            Seen::Neither("no peer holds 10.88.0.3 or fd00::3".into()),
        );
        check(
            "no-peer",
            from(serde_json::json!({"public_key": "K9", "allowed_ips": ["10.88.0.9/32"]}), &["10.88.0.1/32"]),
            Seen::Neither("no peer holds 10.88.0.3 or fd00::3".into()),
        );
    }

    /// A peer other than a hub that holds the address is named by its key; the agent's view is
    /// printed as it says it.
    #[test]
    fn the_relaying_peer_is_named_and_the_agent_view_printed() {
        let s = from(serde_json::json!({"public_key": "KOTHER123", "allowed_ips": ["10.88.0.3/32"]}), &[]);
        let to = ["10.88.0.3".parse().unwrap()];
        assert_eq!(decide(&s, "K2", &to, &[], NOW), Seen::Relayed { by: "key KOTHER12".into(), prefix: "10.88.0.3/32".into() });
        assert_eq!(super::agent_view(&s, "K2"), "trying (no answer yet)");
        assert_eq!(super::agent_view(&s, "K7"), "lists no path");
    }
}
