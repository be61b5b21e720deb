//! Direct paths through a hub, the agent's half (ADR 0032), as values: each relayed peer that
//! `paths.toml` names is tried at the endpoint its hub observed, promoted when a handshake
//! there completed, put back on the hub when the direct session goes stale, and tried again
//! after a pause that grows while attempts keep failing. Pure: the executor reads the interface
//! (`step`) and applies the configuration this gives (`overlay`).
//!
//! While a peer is tried it is a peer of the interface without AllowedIPs (its addresses stay on
//! the hub's peer, so traffic keeps flowing through the hub) and with a short keepalive, which
//! makes WireGuard send handshakes to the observed endpoint: each one opens this node's NAT to
//! the other, and the other's, crossing it, gets through. Once direct, the peer's addresses move
//! from the hub's peer to it in one change of the interface.

use std::collections::BTreeMap;
use std::sync::Arc;

use trellis_core::paths::Candidate;
use trellis_core::wgconf::{WgConf, WgPeer};

use crate::status::{PathStatus, PeerState};

/// How long a pair is tried before the attempt counts as failed: WireGuard retries an
/// initiation every 5 s, so four tries.
pub const TRY_FOR_MS: u64 = 20_000;
/// The keepalive of a peer being tried (each one without a session sends a handshake, at most one
/// per WireGuard's 5 s rekey timeout) and of a direct peer (so that each side hears from the
/// other at least this often, and a NAT keeps the mapping).
pub const TRY_KEEPALIVE: u16 = 1;
pub const DIRECT_KEEPALIVE: u16 = 5;
/// How often each end sends every direct peer a probe: an empty UDP datagram through the tunnel
/// to its overlay address (the executor's `Prompter`, the one that prompts handshakes), so that
/// each end hears from the other at least this often on every backend.
///
/// A persistent keepalive does not do it. WireGuard (the kernel's and wireguard-go) starts that
/// timer again on every packet received as well as sent: when one end's keepalive arrives just
/// before the other's would have left, the other sends nothing, and it can go on that way for
/// many intervals (16 s seen on a loaded machine, in CI). And gotatun counts only the data a
/// packet carries in the bytes received, so a keepalive (no data) is never seen there at all.
/// A probe is data (its IP and UDP headers): it moves the bytes received on every backend,
/// whatever the peer's filter then does with it.
pub const PROBE_EVERY_MS: u64 = DIRECT_KEEPALIVE as u64 * 1000;
/// A direct session from which nothing was received for this long is stale: four probes' worth
/// and a second (a probe leaves at the first check after it is due, and the other end sees it
/// at its next check).
pub const STALE_MS: u64 = 4 * PROBE_EVERY_MS + 1000;
/// The pause after a direct session went stale before it is tried again (the hub sees the new
/// endpoint meanwhile, if the node roamed or its NAT rebound).
pub const AFTER_STALE_MS: u64 = 5_000;
/// The pause after the n-th failed attempt: 30 s doubling, at most an hour.
pub fn backoff_ms(failures: u32) -> u64 {
    (30_000u64 << failures.saturating_sub(1).min(7)).min(3_600_000)
}

/// How long from `wall` (unix seconds) to the next attempt after the n-th failed one: to the
/// next multiple of `backoff_ms(failures)` in unix time, not that long from now.
///
/// Through two NATs that filter, an attempt succeeds only while both ends send: each end's
/// handshakes open its own NAT to the other. Pauses counted from each end's own failure let the
/// two ends' attempts alternate and never meet (seen in `lab/nat.toml` after a rebind: one end
/// tried while the other waited, by turns, each 20 s attempt followed by 30 s, then 60 s). On
/// the clock's multiples they meet: every pause is 30 s times a power of two, so each multiple
/// of the longer pause is one of the shorter; clocks a few seconds apart still overlap in a
/// 20 s attempt.
pub fn backoff_until_ms(failures: u32, wall: i64) -> u64 {
    let period = backoff_ms(failures);
    period - (wall.max(0) as u64 * 1000) % period
}
/// How often the interface is read in the first seconds of an attempt (the switch to direct
/// happens within this of the handshake, on both ends: a ping every 20 ms loses at most one),
/// for the rest of it (a whole interface read a hundred times a second costs a node with
/// thousands of peers), and otherwise.
pub const TRYING_POLL_MS: u64 = 10;
pub const TRYING_FAST_FOR_MS: u64 = 5_000;
pub const TRYING_SLOW_POLL_MS: u64 = 100;
pub const WATCH_POLL_MS: u64 = 1_000;

/// Where one pair stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum State {
    /// Handshakes go to the observed endpoint; traffic goes through the hub.
    Trying { since: u64 },
    /// The peer's addresses are on its direct peer. `rx` is the bytes received from it when last
    /// seen to move, at `heard`; `probed`, when it was last probed (`probes`).
    Direct { since: u64, rx: u64, heard: u64, probed: Option<u64> },
    /// Back on the hub until `until`, and why.
    BackingOff { since: u64, until: u64, reason: String },
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct Entry {
    candidate: Candidate,
    state: State,
    /// Attempts failed in a row since the last direct session or new endpoint.
    failures: u32,
    /// Unix seconds when the state began, for the status.
    wall_since: i64,
}

/// Every relayed peer this node may reach directly, by key.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Book {
    entries: BTreeMap<String, Entry>,
}

impl Book {
    /// Takes a bundle's candidates at `now` (milliseconds, monotonic; `wall` unix seconds): new
    /// peers are tried; a peer whose endpoint moved is tried anew unless it is direct (WireGuard
    /// follows a direct peer that roams); peers no longer named are dropped (back on the hub).
    pub fn set(&mut self, candidates: &[Candidate], now: u64, wall: i64) {
        let mut next = BTreeMap::new();
        for c in candidates {
            let key = c.public_key.to_string();
            let entry = match self.entries.remove(&key) {
                Some(mut e) if e.candidate.endpoint == c.endpoint || matches!(e.state, State::Direct { .. }) => {
                    e.candidate = c.clone();
                    e
                }
                _ => Entry { candidate: c.clone(), state: State::Trying { since: now }, failures: 0, wall_since: wall },
            };
            next.insert(key, entry);
        }
        self.entries = next;
    }

    /// Moves each pair on from what the interface shows at `now`; whether any moved.
    pub fn step(&mut self, peers: &[PeerState], now: u64, wall: i64) -> bool {
        let by_key: std::collections::HashMap<&str, &PeerState> = peers.iter().map(|p| (p.public_key.as_str(), p)).collect();
        let mut moved = false;
        for (key, e) in self.entries.iter_mut() {
            let seen = by_key.get(key.as_str());
            let next = match &e.state {
                State::Trying { since } => {
                    // The peer was added for this attempt; a handshake from before it (a peer a
                    // failed apply left behind) does not count.
                    let fresh = |t: u64| t > 0 && t as i64 >= e.wall_since - 1;
                    if let Some(p) = seen.filter(|p| p.last_handshake.is_some_and(fresh)) {
                        e.failures = 0;
                        Some(State::Direct { since: now, rx: p.rx_bytes, heard: now, probed: None })
                    } else if now.saturating_sub(*since) >= TRY_FOR_MS {
                        e.failures += 1;
                        let reason = format!(
                            "no handshake at {} within {} s (attempt {}); trying again later",
                            e.candidate.endpoint,
                            TRY_FOR_MS / 1000,
                            e.failures
                        );
                        Some(State::BackingOff { since: now, until: now + backoff_until_ms(e.failures, wall), reason })
                    } else {
                        None
                    }
                }
                State::Direct { since, rx, heard, probed } => match seen {
                    Some(p) if p.rx_bytes != *rx => {
                        e.state = State::Direct { since: *since, rx: p.rx_bytes, heard: now, probed: *probed };
                        None
                    }
                    _ if now.saturating_sub(*heard) >= STALE_MS => Some(State::BackingOff {
                        since: now,
                        until: now + AFTER_STALE_MS,
                        reason: format!("the direct session went stale (nothing heard for {} s)", STALE_MS / 1000),
                    }),
                    _ => None,
                },
                State::BackingOff { until, .. } => (now >= *until).then_some(State::Trying { since: now }),
            };
            if let Some(state) = next {
                e.state = state;
                e.wall_since = wall;
                moved = true;
            }
        }
        moved
    }

    /// The overlay addresses of the direct peers to probe at `now`, each marked probed: every
    /// direct peer, once per `PROBE_EVERY_MS` (the first at once), at its overlay address as a
    /// handshake prompt finds it (`plan::overlay_address`, in `overlay`: this node's networks on
    /// the interface), else it is not probed.
    pub fn probes(&mut self, now: u64, overlay: &[ipnet::IpNet]) -> Vec<std::net::IpAddr> {
        let mut out = Vec::new();
        for e in self.entries.values_mut() {
            let State::Direct { probed, .. } = &mut e.state else { continue };
            let due = probed.is_none_or(|p| now.saturating_sub(p) >= PROBE_EVERY_MS);
            if let (true, Some(address)) = (due, crate::plan::overlay_address(&e.candidate.allowed_ips, overlay)) {
                // On the interval's beat, not the check's: checks a second apart do not stretch
                // it (a probe very late, after a pause, starts the beat again).
                *probed = Some(match *probed {
                    Some(p) if now.saturating_sub(p) < 2 * PROBE_EVERY_MS => p + PROBE_EVERY_MS,
                    _ => now,
                });
                out.push(address);
            }
        }
        out
    }

    /// When the interface is to be read next, in milliseconds from `now`: soon while a pair is
    /// tried, each second while one is direct, at the end of the shortest pause otherwise.
    pub fn next_check(&self, now: u64) -> Option<u64> {
        self.entries
            .values()
            .map(|e| match &e.state {
                State::Trying { since } if now.saturating_sub(*since) < TRYING_FAST_FOR_MS => TRYING_POLL_MS,
                State::Trying { .. } => TRYING_SLOW_POLL_MS,
                State::Direct { .. } => WATCH_POLL_MS,
                State::BackingOff { until, .. } => until.saturating_sub(now).max(1),
            })
            .min()
    }

    /// The interface's configuration: `base` (the bundle's `wireguard.conf`) with each pair as it
    /// stands. A candidate that `base` does not relay through its hub (the files disagree), or
    /// whose key `base` already holds as a peer, is left out.
    ///
    /// With no pair to show, `base` itself (the same value: a plan's edit of it still applies).
    pub fn overlay(&self, base: &Arc<WgConf>) -> Arc<WgConf> {
        if self.entries.is_empty() {
            return base.clone();
        }
        let mut conf = WgConf::clone(base);
        let index: std::collections::HashMap<String, usize> =
            conf.peers.iter().enumerate().map(|(i, p)| (p.public_key.clone(), i)).collect();
        let mut shown = false;
        for (key, e) in &self.entries {
            let Some(&hub) = index.get(&e.candidate.hub_key.to_string()) else { continue };
            if index.contains_key(key) || !e.candidate.allowed_ips.iter().all(|a| conf.peers[hub].allowed_ips.contains(a)) {
                continue;
            }
            let (keepalive, allowed_ips) = match e.state {
                State::Trying { .. } => (TRY_KEEPALIVE, Vec::new()),
                State::Direct { .. } => (DIRECT_KEEPALIVE, e.candidate.allowed_ips.clone()),
                State::BackingOff { .. } => continue,
            };
            if !allowed_ips.is_empty() {
                Arc::make_mut(&mut conf.peers[hub]).allowed_ips.retain(|a| !allowed_ips.contains(a));
            }
            conf.peers.push(Arc::new(WgPeer {
                public_key: key.clone(),
                allowed_ips,
                endpoint: Some(e.candidate.endpoint),
                keepalive: Some(keepalive),
            }));
            shown = true;
        }
        if shown {
            Arc::new(conf)
        } else {
            base.clone()
        }
    }

    /// Each pair as the status file shows it.
    pub fn status(&self) -> Vec<PathStatus> {
        let mut out: Vec<PathStatus> = self
            .entries
            .iter()
            .map(|(key, e)| {
                let (state, reason) = match &e.state {
                    State::Trying { .. } => ("trying", None),
                    State::Direct { .. } => ("direct", None),
                    State::BackingOff { reason, .. } => ("backing-off", Some(reason.clone())),
                };
                PathStatus {
                    peer: e.candidate.peer.clone(),
                    public_key: key.clone(),
                    hub: e.candidate.hub.clone(),
                    state: state.into(),
                    since: e.wall_since,
                    endpoint: e.candidate.endpoint.to_string(),
                    reason,
                }
            })
            .collect();
        out.sort_by(|a, b| a.peer.cmp(&b.peer));
        out
    }

    /// What the controller is told of the pairs.
    pub fn report(&self) -> Vec<trellis_proto::PathState> {
        self.status()
            .into_iter()
            .map(|s| trellis_proto::PathState { peer: s.peer, state: s.state, since: s.since, reason: s.reason })
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// What a hub reports it observes: each peer it had a handshake with in the last three minutes
/// (WireGuard's session lifetime), at the endpoint its packets come from.
pub fn observed(peers: &[PeerState], wall: i64) -> Vec<trellis_proto::ObservedEndpoint> {
    let mut out: Vec<trellis_proto::ObservedEndpoint> = peers
        .iter()
        .filter(|p| p.last_handshake.is_some_and(|t| wall - (t as i64) < 180))
        .filter_map(|p| Some(trellis_proto::ObservedEndpoint { public_key: p.public_key.clone(), endpoint: p.endpoint.clone()? }))
        .collect();
    out.sort_by(|a, b| a.public_key.cmp(&b.public_key));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use trellis_core::decl::PublicKey;

    fn key(b: u8) -> PublicKey {
        PublicKey([b; 32])
    }

    fn candidate(b: u8, port: u16) -> Candidate {
        Candidate {
            peer: format!("n-{b}"),
            public_key: key(b),
            endpoint: format!("203.0.113.{b}:{port}").parse().unwrap(),
            hub: "hub-1".into(),
            hub_key: key(1),
            allowed_ips: vec![format!("10.77.0.{b}/32")],
        }
    }

    /// This node's wireguard.conf: hub-1 relays for n-2 and n-3.
    fn base() -> Arc<WgConf> {
        Arc::new(WgConf {
            addresses: vec!["10.77.0.9/16".into()],
            peers: vec![Arc::new(WgPeer {
                public_key: key(1).to_string(),
                allowed_ips: vec!["10.77.0.1/32".into(), "10.77.0.2/32".into(), "10.77.0.3/32".into()],
                endpoint: Some("198.51.100.10:51820".parse().unwrap()),
                keepalive: Some(25),
            })],
            ..Default::default()
        })
    }

    fn peer(b: u8, handshake: Option<u64>, rx: u64) -> PeerState {
        let mut p = PeerState::new(key(b).to_string(), None, handshake);
        p.rx_bytes = rx;
        p
    }

    /// Tried with no AllowedIPs (traffic stays on the hub), then direct once a handshake shows:
    /// the addresses move from the hub's peer to the direct one in one configuration.
    #[test]
    fn a_pair_is_tried_then_promoted_on_a_handshake() {
        let mut book = Book::default();
        book.set(&[candidate(2, 4002)], 0, 100);
        let trying = book.overlay(&base());
        assert_eq!(trying.peers.len(), 2);
        assert_eq!(trying.peers[0].allowed_ips.len(), 3, "the hub keeps the addresses while a pair is tried");
        assert_eq!(trying.peers[1].allowed_ips, Vec::<String>::new());
        assert_eq!(trying.peers[1].keepalive, Some(TRY_KEEPALIVE));
        assert_eq!(trying.peers[1].endpoint, Some("203.0.113.2:4002".parse().unwrap()));
        assert!(!book.step(&[peer(2, None, 0)], 10, 100), "no handshake yet");
        assert!(book.step(&[peer(2, Some(100), 92)], 20, 100));
        let direct = book.overlay(&base());
        assert_eq!(direct.peers[0].allowed_ips, ["10.77.0.1/32", "10.77.0.3/32"]);
        assert_eq!(direct.peers[1].allowed_ips, ["10.77.0.2/32"]);
        assert_eq!(direct.peers[1].keepalive, Some(DIRECT_KEEPALIVE));
        assert_eq!(book.status()[0].state, "direct");
    }

    /// Every direct peer is probed at its overlay address once it is direct, then once per
    /// interval, whether or not it was heard from (what the other end hears is not known here);
    /// 16 s of quiet (what CI saw of keepalives held back) is not stale, `STALE_MS` is, and a
    /// peer back on its hub is not probed.
    #[test]
    fn every_direct_peer_is_probed_each_interval_and_called_stale_only_after_four() {
        let mut book = Book::default();
        book.set(&[candidate(2, 4002)], 0, 100);
        let none: [std::net::IpAddr; 0] = [];
        let overlay: Vec<ipnet::IpNet> = vec!["10.77.0.0/16".parse().unwrap()];
        assert_eq!(book.probes(5, &overlay), none, "a pair being tried is not probed");
        assert!(book.step(&[peer(2, Some(100), 100)], 10, 100), "n-2 promoted");
        let address: std::net::IpAddr = "10.77.0.2".parse().unwrap();
        assert_eq!(book.probes(10, &overlay), [address], "probed at once, at its overlay address");
        assert_eq!(book.probes(10 + PROBE_EVERY_MS - 1, &overlay), none, "once per interval");
        assert!(!book.step(&[peer(2, Some(100), 132)], 10 + PROBE_EVERY_MS - 1, 101), "heard");
        // A check 900 ms late: the beat is kept, the next is due 5 s after the last was due.
        assert_eq!(book.probes(10 + PROBE_EVERY_MS + 900, &overlay), [address], "probed though heard from");
        assert_eq!(book.probes(10 + 2 * PROBE_EVERY_MS, &overlay), [address], "on the interval's beat");
        let heard = 10 + PROBE_EVERY_MS - 1;
        assert!(!book.step(&[peer(2, Some(100), 132)], heard + 16_000, 102), "16 s of quiet is not stale: {:?}", book.status());
        assert!(!book.step(&[peer(2, Some(100), 132)], heard + STALE_MS - 1, 102));
        assert!(book.step(&[peer(2, Some(100), 132)], heard + STALE_MS, 103), "stale");
        assert_eq!(book.status()[0].state, "backing-off");
        assert_eq!(book.probes(heard + STALE_MS + PROBE_EVERY_MS, &overlay), none, "a peer on its hub is not probed");
    }

    /// Two ends that failed at different moments, and different numbers of times, try again
    /// at the same moment: the next multiple of their pause in unix time (the longer pause's
    /// multiples are the shorter's). Before, each waited its pause from its own failure, and
    /// after a NAT rebind the two ends' attempts alternated without meeting.
    #[test]
    fn two_ends_backing_off_try_again_together() {
        let (mut a, mut b) = (Book::default(), Book::default());
        // a's first attempt ran from unix time 980 to 1000, and failed.
        a.set(&[candidate(2, 4002)], 0, 980);
        assert!(a.step(&[], TRY_FOR_MS, 1000));
        // b's first ran from 945 to 965 and waited to 990 (a multiple of 30 s); its second ran
        // from 990 to 1010, and failed.
        b.set(&[candidate(3, 4003)], 0, 945);
        assert!(b.step(&[], TRY_FOR_MS, 965));
        assert_eq!(b.next_check(TRY_FOR_MS), Some(25_000));
        assert!(b.step(&[], 45_000, 990));
        assert!(b.step(&[], 65_000, 1010));
        // a waits to 1020 (a multiple of 30 s), b to 1020 (of 60 s): both try at 1020.
        assert_eq!(a.next_check(TRY_FOR_MS), Some(20_000));
        assert_eq!(b.next_check(65_000), Some(10_000));
        assert_eq!(backoff_until_ms(1, 1020), 30_000, "on the multiple itself: the next one");
    }

    /// A probe goes to one overlay address: not to a candidate's AllowedIPs that are a network
    /// or outside this node's overlay (it would leave the interface for an address that is no
    /// peer's); an IPv6 overlay address is probed like an IPv4 one.
    #[test]
    fn a_probe_goes_to_one_overlay_address_only() {
        let mut book = Book::default();
        let with = |b: u8, ips: &[&str]| Candidate { allowed_ips: ips.iter().map(|s| s.to_string()).collect(), ..candidate(b, 4000) };
        book.set(
            &[with(2, &["10.77.0.0/24"]), with(3, &["192.0.2.3/32"]), with(4, &["fd77::4/128", "10.77.0.4/32"]), with(5, &["0.0.0.0/0"])],
            0,
            100,
        );
        let shaken: Vec<PeerState> = (2..=5).map(|b| peer(b, Some(100), 100)).collect();
        assert!(book.step(&shaken, 10, 100));
        let overlay: Vec<ipnet::IpNet> = vec!["10.77.0.0/16".parse().unwrap(), "fd77::/64".parse().unwrap()];
        assert_eq!(book.probes(10, &overlay), ["fd77::4".parse::<std::net::IpAddr>().unwrap()]);
    }

    /// A direct session that hears nothing for `STALE_MS` goes back to the hub, and is tried again
    /// after `AFTER_STALE_MS`; one that keeps hearing stays.
    #[test]
    fn a_stale_direct_session_falls_back_and_is_tried_again() {
        let mut book = Book::default();
        book.set(&[candidate(2, 4002)], 0, 100);
        book.step(&[peer(2, Some(100), 92)], 10, 100);
        assert!(!book.step(&[peer(2, Some(100), 200)], STALE_MS, 101), "bytes came: not stale");
        assert!(!book.step(&[peer(2, Some(100), 200)], 2 * STALE_MS - 1, 102));
        assert!(book.step(&[peer(2, Some(100), 200)], 2 * STALE_MS, 103));
        let s = &book.status()[0];
        assert_eq!(s.state, "backing-off");
        assert!(s.reason.as_deref().unwrap().contains("went stale"), "{s:?}");
        assert_eq!(book.overlay(&base()), base(), "back on the hub: the direct peer is gone");
        assert!(book.step(&[], 2 * STALE_MS + AFTER_STALE_MS, 104));
        assert_eq!(book.status()[0].state, "trying");
    }

    /// Attempts that fail back off longer each time, up to an hour; a new endpoint from the hub
    /// is tried at once.
    #[test]
    fn failing_attempts_back_off_and_a_new_endpoint_is_tried_at_once() {
        // At unix time 0 every pause ends on a multiple of itself: the pauses are whole.
        let mut book = Book::default();
        book.set(&[candidate(2, 4002)], 0, 100);
        let mut now = 0;
        for n in 1..=3 {
            now += TRY_FOR_MS;
            assert!(book.step(&[], now, 0));
            assert_eq!(book.next_check(now), Some(backoff_ms(n)));
            now += backoff_ms(n);
            assert!(book.step(&[], now, 0));
        }
        assert_eq!((backoff_ms(1), backoff_ms(2), backoff_ms(3), backoff_ms(20)), (30_000, 60_000, 120_000, 3_600_000));
        now += TRY_FOR_MS;
        book.step(&[], now, 0);
        assert_eq!(book.status()[0].state, "backing-off");
        book.set(&[candidate(2, 5555)], now + 1, 0);
        assert_eq!(book.status()[0].state, "trying");
        assert_eq!(book.next_check(now + 1), Some(TRYING_POLL_MS));
    }

    /// A candidate the bundle's wireguard.conf does not relay through its hub is left out.
    #[test]
    fn a_candidate_the_conf_does_not_relay_is_left_out() {
        let mut book = Book::default();
        let mut stray = candidate(7, 4007);
        stray.allowed_ips = vec!["10.77.0.7/32".into()];
        let mut other_hub = candidate(2, 4002);
        other_hub.hub_key = key(99);
        book.set(&[stray, other_hub], 0, 0);
        assert_eq!(book.overlay(&base()), base());
    }

    /// A hub reports the peers it had a handshake with in the last three minutes, where they send
    /// from; never one without an endpoint.
    #[test]
    fn a_hub_observes_recent_sessions_only() {
        let mut fresh = PeerState::new(key(2).to_string(), Some("203.0.113.2:4002".into()), Some(1_000));
        fresh.rx_bytes = 1;
        let old = PeerState::new(key(3).to_string(), Some("203.0.113.3:4003".into()), Some(800));
        let none = PeerState::new(key(4).to_string(), None, Some(1_000));
        let seen = observed(&[fresh, old, none], 1_010);
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].endpoint, "203.0.113.2:4002");
    }

    #[derive(Clone, Debug)]
    enum Event {
        Tick(u64),
        Handshake,
        Bytes,
        NewEndpoint,
    }

    fn event() -> impl Strategy<Value = Event> {
        prop_oneof![(1u64..40_000).prop_map(Event::Tick), Just(Event::Handshake), Just(Event::Bytes), Just(Event::NewEndpoint)]
    }

    proptest! {
        /// Whatever the interface shows and whenever: the hub keeps every address the direct peer
        /// does not hold, no address is on two peers, a direct peer holds exactly the candidate's
        /// addresses, and a pair is direct only after a handshake was seen while it was tried.
        #[test]
        fn the_overlay_never_loses_or_doubles_an_address(events in proptest::collection::vec(event(), 1..60)) {
            let mut book = Book::default();
            let (mut now, mut port, mut rx, mut shaken) = (0u64, 4002u16, 0u64, false);
            book.set(&[candidate(2, port)], now, 0);
            for e in events {
                match e {
                    Event::Tick(ms) => now += ms,
                    Event::Handshake => shaken = true,
                    Event::Bytes => rx += 100,
                    Event::NewEndpoint => {
                        port += 1;
                        book.set(&[candidate(2, port)], now, 0);
                    }
                }
                let before = book.status()[0].state.clone();
                let in_conf = book.overlay(&base()).peers.len() == 2;
                let p = peer(2, shaken.then_some(100), rx);
                book.step(if in_conf { std::slice::from_ref(&p) } else { &[] }, now, 0);
                let after = book.status()[0].state.clone();
                if after == "direct" && before != "direct" {
                    prop_assert!(shaken && before == "trying");
                }
                let conf = book.overlay(&base());
                if conf.peers.len() == 1 {
                    // The peer left the interface: a new one starts without a handshake.
                    shaken = false;
                }
                let mut all: Vec<&String> = conf.peers.iter().flat_map(|p| &p.allowed_ips).collect();
                prop_assert_eq!(all.len(), 3);
                all.sort();
                all.dedup();
                prop_assert_eq!(all.len(), 3);
                if after == "direct" {
                    prop_assert_eq!(&conf.peers[1].allowed_ips, &vec!["10.77.0.2/32".to_string()]);
                }
            }
        }
    }
}
