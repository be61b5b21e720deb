//! Reading back the `wireguard.conf` that `render` writes (wg-quick format without
//! `PrivateKey`), for the agent that applies it; and reading a change of it by the regions where
//! the two texts differ (ADR 0037), so that a change of three peers among ten thousand costs
//! three peers. Pure.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::Arc;

use crate::delta::Hunk;

/// The interface and peers a `wireguard.conf` describes. Each peer is shared: a configuration
/// read from a change of another holds the other's peers that did not change, not copies.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WgConf {
    /// Addresses with their prefix length, as written (`10.88.0.5/16`).
    pub addresses: Vec<String>,
    pub listen_port: Option<u16>,
    pub mtu: Option<u32>,
    pub peers: Vec<Arc<WgPeer>>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WgPeer {
    pub public_key: String,
    pub allowed_ips: Vec<String>,
    pub endpoint: Option<SocketAddr>,
    pub keepalive: Option<u16>,
}

/// Parses the file; an unknown key or a malformed value is an error naming the line.
pub fn parse(text: &str) -> Result<WgConf, String> {
    read(text).map(|r| Arc::unwrap_or_clone(r.conf))
}

/// A `wireguard.conf` as read: its configuration, where each peer's section starts in the text,
/// and whether it is plain: every peer has a key of its own, and no `[Interface]` comes after a
/// peer. What a change of the text is read against ([`Read::edit`]).
#[derive(Clone, Debug)]
pub struct Read {
    pub conf: Arc<WgConf>,
    starts: Vec<usize>,
    plain: bool,
}

impl Read {
    /// Whether every peer has a key of its own and no `[Interface]` comes after a peer.
    pub fn plain(&self) -> bool {
        self.plain
    }
}

/// What changes from one peer list to another: the peers gone, and each peer new or changed with
/// the peer of its key before, if there was one; in the order of the lists.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerChanges {
    pub gone: Vec<Arc<WgPeer>>,
    pub changed: Vec<(Arc<WgPeer>, Option<Arc<WgPeer>>)>,
}

impl PeerChanges {
    pub fn is_empty(&self) -> bool {
        self.gone.is_empty() && self.changed.is_empty()
    }
}

/// The changes from the peers `old` to `new`, found by key through maps (an operator's node has
/// ten thousand peers, and comparing every peer with every other took 300 ms of a one-peer
/// change). Of two peers of one key in `old`, the later counts.
pub fn changes(old: &[Arc<WgPeer>], new: &[Arc<WgPeer>]) -> PeerChanges {
    let before: HashMap<&str, &Arc<WgPeer>> = old.iter().map(|p| (p.public_key.as_str(), p)).collect();
    let after: HashSet<&str> = new.iter().map(|p| p.public_key.as_str()).collect();
    PeerChanges {
        gone: old.iter().filter(|o| !after.contains(o.public_key.as_str())).cloned().collect(),
        changed: new
            .iter()
            .filter_map(|n| match before.get(n.public_key.as_str()) {
                Some(o) if *o == n => None,
                o => Some((n.clone(), o.map(|o| (*o).clone()))),
            })
            .collect(),
    }
}

/// A line as the reader sees it: without its comment and the white space around.
fn content(raw: &str) -> &str {
    raw.split('#').next().unwrap_or("").trim()
}

/// One `KEY = VALUE` line of a `[Peer]` section, added to its peer; the error names no line.
fn peer_key(peer: &mut WgPeer, key: &str, value: &str) -> Result<(), String> {
    match key {
        "PublicKey" => peer.public_key = value.to_string(),
        // WireGuard adds up a peer's AllowedIPs lines (a hub has one per node it relays for).
        "AllowedIPs" => peer.allowed_ips.extend(list(value)),
        "Endpoint" => peer.endpoint = Some(value.parse().map_err(|_| "Endpoint is not IP:PORT")?),
        "PersistentKeepalive" => peer.keepalive = Some(value.parse().map_err(|_| "PersistentKeepalive is not a number")?),
        k => return Err(format!("unknown key `{k}` in [Peer]")),
    }
    Ok(())
}

fn list(value: &str) -> impl Iterator<Item = String> + '_ {
    value.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// The file read whole.
pub fn read(text: &str) -> Result<Read, String> {
    read_as(text, "wireguard.conf", true)
}

/// Reads a part of a node's peers (`wireguard.d/peers-NN.conf`, ADR 0039): `[Peer]` sections
/// only; an error names the part by `name`.
pub fn read_part(text: &str, name: &str) -> Result<Read, String> {
    read_as(text, name, false)
}

fn read_as(text: &str, name: &str, interface_here: bool) -> Result<Read, String> {
    let mut conf = WgConf::default();
    let mut starts = Vec::new();
    let mut open: Option<WgPeer> = None;
    let (mut interface, mut late_interface) = (false, false);
    // Where the lines after the last that says something start: a section's own blank and
    // comment lines go with it (`render` writes each peer's name above its `[Peer]`).
    let (mut at, mut said) = (0, 0);
    for (n, raw) in text.split_inclusive('\n').enumerate() {
        at += raw.len();
        let line = content(raw);
        if line.is_empty() {
            continue;
        }
        let start = std::mem::replace(&mut said, at);
        let here = |msg: &str| format!("{name} line {}: {msg}", n + 1);
        if line == "[Interface]" && !interface_here {
            return Err(here("[Interface] belongs in wireguard.conf, not in a part of the peers"));
        }
        if line == "[Interface]" || line == "[Peer]" {
            conf.peers.extend(open.take().map(Arc::new));
            interface = line == "[Interface]";
            // An `[Interface]` after a peer lies in that peer's section (its lines go up to the
            // next `[Peer]`): a change of it is not one of peers.
            late_interface |= interface && !starts.is_empty();
            if !interface {
                open = Some(WgPeer::default());
                starts.push(start);
            }
            continue;
        }
        let (key, value) = line.split_once('=').ok_or_else(|| here("expected KEY = VALUE"))?;
        let (key, value) = (key.trim(), value.trim());
        match (open.as_mut(), interface, key) {
            (Some(peer), _, k) => peer_key(peer, k, value).map_err(|e| here(&e))?,
            (None, true, "Address") => conf.addresses = list(value).collect(),
            (None, true, "ListenPort") => conf.listen_port = Some(value.parse().map_err(|_| here("ListenPort is not a port"))?),
            (None, true, "MTU") => conf.mtu = Some(value.parse().map_err(|_| here("MTU is not a number"))?),
            _ => return Err(here(&format!("unknown key `{key}` here"))),
        }
    }
    conf.peers.extend(open.map(Arc::new));
    if conf.peers.iter().any(|p| p.public_key.is_empty()) {
        return Err(format!("{name}: a [Peer] has no PublicKey"));
    }
    let mut seen = HashSet::with_capacity(conf.peers.len());
    let plain = !late_interface && conf.peers.iter().all(|p| seen.insert(p.public_key.as_str()));
    Ok(Read { conf: Arc::new(conf), starts, plain })
}

/// The peers of a run of whole `[Peer]` sections of the file (a region of it), with where each
/// starts, from `offset`. `None` for anything else in it (an `[Interface]`, a key before the
/// first section, a line `read` refuses, a peer without a key): the file is read whole then, and
/// the error names its line.
fn peers_in(text: &str, offset: usize) -> Option<(Vec<WgPeer>, Vec<usize>)> {
    let (mut peers, mut starts) = (Vec::new(), Vec::new());
    let (mut at, mut said) = (offset, offset);
    for raw in text.split_inclusive('\n') {
        at += raw.len();
        let line = content(raw);
        if line.is_empty() {
            continue;
        }
        let start = std::mem::replace(&mut said, at);
        match line {
            "[Peer]" => {
                peers.push(WgPeer::default());
                starts.push(start);
            }
            line => {
                let (key, value) = line.split_once('=')?;
                peer_key(peers.last_mut()?, key.trim(), value.trim()).ok()?;
            }
        }
    }
    peers.iter().all(|p| !p.public_key.is_empty()).then_some((peers, starts))
}

/// Whether a peer's section starts at the line start `at` of `text` (where a region of the file
/// may start): the line before says something, and the first line from here that does is
/// `[Peer]`. A section's blank and comment lines above its `[Peer]` are its own, as `read`
/// counts them.
fn section_at(text: &[u8], at: usize) -> bool {
    let said = |line: &[u8]| std::str::from_utf8(line).map(|l| !content(l).is_empty());
    let before = &text[..at - 1];
    if !said(&before[before.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1)..]).unwrap_or(false) {
        return false;
    }
    for line in text[at..].split(|&b| b == b'\n') {
        match std::str::from_utf8(line).map(content) {
            Ok("") => continue,
            Ok(l) => return l == "[Peer]",
            Err(_) => return false,
        }
    }
    false
}

/// More keys new to a change than this are looked for in a set of the held keys, not one by one.
const FRESH_SCANNED: usize = 16;

impl Read {
    /// The file `new`, a change of `old` (the text this was read from) in `hunks` (as a delta's
    /// edits give them), read by the regions where the two differ, widened to whole `[Peer]`
    /// sections: the peers outside them are this one's, shared. With the changes from this
    /// configuration's peers to the new one's, as [`changes`] would find them.
    ///
    /// `None` when the regions do not say it all, and the file is to be read whole: a region
    /// reaches the `[Interface]` section or anything before the first peer, holds a line the
    /// reader refuses, or lists a key twice or a key a peer outside the regions has; the held
    /// file is not plain (a key twice, an `[Interface]` after a peer); or the hunks span more
    /// than a quarter of either text (reading them would cost more than reading it whole).
    ///
    /// Only the regions of `new` are read (and checked as UTF-8): outside them it is `old`'s
    /// bytes, and they start and end at lines. Reading them costs the regions; the new
    /// configuration is then made of the held peers' handles and the regions' peers (a copy of
    /// ten thousand pointers, no peer copied).
    pub fn edit(&self, old: &[u8], new: &[u8], hunks: &[Hunk]) -> Option<(Read, PeerChanges)> {
        let first_start = *self.starts.first()?;
        let spanned = |side: fn(&Hunk) -> &std::ops::Range<usize>| hunks.iter().map(|h| side(h).len()).sum::<usize>();
        if !self.plain || spanned(|h| &h.old) > old.len() / 4 || spanned(|h| &h.new) > new.len() / 4 {
            return None;
        }
        // The interface and anything before the first peer as they were: else no region may
        // start after it (cheaper to see here than after widening every hunk).
        if old.get(..first_start) != new.get(..first_start) {
            return None;
        }
        let regions = crate::delta::widen(old, new, hunks, b"\n", section_at)?;
        let held = &self.conf.peers;
        // The held peers in the regions (by index), and the peers the regions hold now.
        let mut inside: Vec<std::ops::Range<usize>> = Vec::with_capacity(regions.len());
        let mut now: Vec<(Vec<WgPeer>, Vec<usize>)> = Vec::with_capacity(regions.len());
        for r in &regions {
            if r.old.start < first_start {
                return None;
            }
            let first = self.starts.partition_point(|&s| s < r.old.start);
            let end = self.starts.partition_point(|&s| s < r.old.end);
            // The region starts at a section, or at the end of the text.
            if self.starts.get(first).map_or(r.old.start != old.len(), |&s| s != r.old.start) {
                return None;
            }
            inside.push(first..end);
            now.push(peers_in(std::str::from_utf8(new.get(r.new.clone())?).ok()?, r.new.start)?);
        }
        // By key across every region: a peer may move from one region to another.
        let before: HashMap<&str, &Arc<WgPeer>> =
            inside.iter().flat_map(|i| &held[i.clone()]).map(|p| (p.public_key.as_str(), p)).collect();
        let listed: HashSet<&str> = now.iter().flat_map(|(n, _)| n).map(|p| p.public_key.as_str()).collect();
        if listed.len() != now.iter().map(|(n, _)| n.len()).sum::<usize>() {
            return None;
        }
        let mut out = PeerChanges::default();
        let mut peers: Vec<Arc<WgPeer>> = Vec::with_capacity(held.len() + listed.len());
        let mut starts: Vec<usize> = Vec::with_capacity(held.len() + listed.len());
        // The held peers of `range`, outside every region, where they now start.
        let keep = |peers: &mut Vec<Arc<WgPeer>>, starts: &mut Vec<usize>, range: std::ops::Range<usize>, shift: isize| -> Option<()> {
            peers.extend_from_slice(&held[range.clone()]);
            for s in &self.starts[range] {
                starts.push(s.checked_add_signed(shift)?);
            }
            Some(())
        };
        let (mut next, mut shift) = (0usize, 0isize);
        for ((r, i), (list, at)) in regions.iter().zip(&inside).zip(&now) {
            keep(&mut peers, &mut starts, next..i.start, shift)?;
            for (p, &start) in list.iter().zip(at) {
                peers.push(match before.get(p.public_key.as_str()) {
                    Some(&o) if **o == *p => o.clone(),
                    o => {
                        let p = Arc::new(p.clone());
                        out.changed.push((p.clone(), o.map(|&o| o.clone())));
                        p
                    }
                });
                starts.push(start);
            }
            out.gone.extend(held[i.clone()].iter().filter(|o| !listed.contains(o.public_key.as_str())).cloned());
            next = i.end;
            shift = r.new.end as isize - r.old.end as isize;
        }
        keep(&mut peers, &mut starts, next..held.len(), shift)?;
        // A key new to the regions that a held peer has is a peer outside them (the held keys
        // are unique, and those inside are in `before`): `read` would list the key twice.
        let fresh: Vec<&str> = out.changed.iter().filter(|(_, o)| o.is_none()).map(|(p, _)| p.public_key.as_str()).collect();
        let twice = if fresh.len() <= FRESH_SCANNED {
            fresh.iter().any(|&k| held.iter().any(|p| p.public_key == k))
        } else {
            let keys: HashSet<&str> = held.iter().map(|p| p.public_key.as_str()).collect();
            fresh.iter().any(|k| keys.contains(k))
        };
        if twice {
            return None;
        }
        let conf = WgConf { addresses: self.conf.addresses.clone(), listen_port: self.conf.listen_port, mtu: self.conf.mtu, peers };
        Some((Read { conf: Arc::new(conf), starts, plain: true }, out))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_back_what_render_writes() {
        let text = "# c\n[Interface]\nAddress = 10.88.0.1/16, fd88::1/64\nListenPort = 51820\nMTU = 1420\n\n# p\n[Peer]\nPublicKey = AQEB\nAllowedIPs = 10.88.0.2/32, fd88::2/128\nEndpoint = 192.0.2.1:51820\nPersistentKeepalive = 25\n";
        let c = super::parse(text).unwrap();
        assert_eq!(c.addresses, ["10.88.0.1/16", "fd88::1/64"]);
        assert_eq!((c.listen_port, c.mtu), (Some(51820), Some(1420)));
        assert_eq!(c.peers.len(), 1);
        assert_eq!(c.peers[0].allowed_ips, ["10.88.0.2/32", "fd88::2/128"]);
        assert_eq!(c.peers[0].keepalive, Some(25));
        let hub =
            super::parse("[Peer]\nPublicKey = AQEB\nAllowedIPs = 10.88.0.2/32\n# relays for a\nAllowedIPs = 10.88.0.3/32, fd88::3/128\n")
                .unwrap();
        assert_eq!(hub.peers[0].allowed_ips, ["10.88.0.2/32", "10.88.0.3/32", "fd88::3/128"]);
        assert!(super::parse("[Interface]\nPrivateKey = x\n").is_err());
    }

    /// A file as `render` writes it: the interface, then each peer `(key number, endpoint port,
    /// relayed node numbers)` with its comment, and a comment at the end.
    pub(super) fn file(peers: &[(u16, Option<u16>, Vec<u16>)], mtu: u32) -> String {
        let mut s = format!("# trellis: WireGuard overlay of n\n[Interface]\nAddress = 10.88.0.1/16\nListenPort = 51820\nMTU = {mtu}\n");
        for (k, port, relays) in peers {
            s.push_str(&format!(
                "\n# node-{k}: either side dials\n[Peer]\nPublicKey = key{k:05}=\nAllowedIPs = 10.88.{}.{}/32\n",
                k / 256,
                k % 256
            ));
            if let Some(p) = port {
                s.push_str(&format!("Endpoint = 192.0.2.1:{p}\n"));
            }
            for r in relays {
                s.push_str(&format!("# relays for r{r}\nAllowedIPs = 10.89.{}.{}/32\n", r / 256, r % 256));
            }
        }
        s.push_str("\n# No path (see `trellis explain`): x, y\n");
        s
    }

    /// The change from `old` to `new` as the agent has it: the controller's edits, rebuilt.
    pub(super) fn hunks(old: &str, new: &str) -> Vec<crate::delta::Hunk> {
        let edits = crate::delta::edits(old.as_bytes(), new.as_bytes());
        let (built, hunks) = crate::delta::rebuild_with_hunks(old.as_bytes(), &edits, new.len(), "wireguard.conf").unwrap();
        assert_eq!(built, new.as_bytes());
        hunks.expect("the controller's edits copy in order")
    }

    /// The edit read by regions against the whole read of the new text: the same configuration,
    /// the same starts, and the changes `changes` finds.
    fn same_as_whole(old: &str, new: &str, hunks: &[crate::delta::Hunk]) -> Option<super::PeerChanges> {
        let held = super::read(old).unwrap();
        let (edited, changes) = held.edit(old.as_bytes(), new.as_bytes(), hunks)?;
        let whole = super::read(new).unwrap();
        assert_eq!(edited.conf, whole.conf);
        assert_eq!(edited.starts, whole.starts);
        assert!(whole.plain, "the edit is plain, as the whole read");
        assert_eq!(changes, super::changes(&held.conf.peers, &whole.conf.peers));
        Some(changes)
    }

    #[test]
    fn a_change_of_three_peers_is_read_from_its_regions() {
        let peers: Vec<_> = (0..300u16).map(|k| (k, (k % 3 == 0).then_some(51820), Vec::new())).collect();
        let old = file(&peers, 1420);
        let mut after = peers.clone();
        after[100].0 = 9000; // re-keyed
        after.remove(200);
        after.insert(250, (9001, Some(4000), vec![7])); // added
        let new = file(&after, 1420);
        let changes = same_as_whole(&old, &new, &hunks(&old, &new)).expect("read by regions");
        let keys = |v: Vec<&str>| v.into_iter().map(String::from).collect::<Vec<_>>();
        assert_eq!(changes.gone.iter().map(|p| p.public_key.clone()).collect::<Vec<_>>(), keys(vec!["key00100=", "key00200="]));
        assert_eq!(changes.changed.iter().map(|(p, _)| p.public_key.clone()).collect::<Vec<_>>(), keys(vec!["key09000=", "key09001="]));
        // The peers outside the regions are the held ones, not copies.
        let held = super::read(&old).unwrap();
        let (edited, _) = held.edit(old.as_bytes(), new.as_bytes(), &hunks(&old, &new)).unwrap();
        assert!(std::sync::Arc::ptr_eq(&held.conf.peers[0], &edited.conf.peers[0]));
        assert!(std::sync::Arc::ptr_eq(&held.conf.peers[299], &edited.conf.peers[299]));
    }

    #[test]
    fn what_the_regions_cannot_say_is_read_whole() {
        let peers: Vec<_> = (0..50u16).map(|k| (k, None, Vec::new())).collect();
        let old = file(&peers, 1420);
        // The interface changed.
        let new = file(&peers, 1380);
        assert!(same_as_whole(&old, &new, &hunks(&old, &new)).is_none());
        // A key added that a peer outside the regions has.
        let mut twice = peers.clone();
        twice.insert(40, (3, None, Vec::new()));
        let new = file(&twice, 1420);
        assert!(super::read(&old).unwrap().edit(old.as_bytes(), new.as_bytes(), &hunks(&old, &new)).is_none());
        // A line the reader refuses, inside a region: the whole read names it.
        let bad = old.replacen("AllowedIPs = 10.88.0.20/32", "AllowedIPs = 10.88.0.20/32\nColour = blue", 1);
        assert!(super::read(&old).unwrap().edit(old.as_bytes(), bad.as_bytes(), &hunks(&old, &bad)).is_none());
        assert!(super::read(&bad).unwrap_err().contains("unknown key `Colour`"));
        // An `[Interface]` after a peer lies in that peer's section: taking it away changes the
        // interface, which the regions do not read (a review's finding: the port stayed).
        // (Each with forty more peers after, so the change spans little of the file.)
        let more: String = (0..40).map(|i| format!("[Peer]\nPublicKey = more{i}\nAllowedIPs = 10.9.0.{i}/32\n")).collect();
        for (old, new) in [
            (
                "[Peer]\nPublicKey = A\n[Interface]\nListenPort = 1\n[Peer]\nPublicKey = B\n",
                "[Peer]\nPublicKey = A\n[Peer]\nPublicKey = B\n",
            ),
            ("[Peer]\nPublicKey = A\n[Interface]\nMTU = 1\n", "[Peer]\nPublicKey = A\n"),
            (
                "[Interface]\nMTU = 1\n[Peer]\nPublicKey = A\n[Interface]\nAddress = 10.0.0.1/24\n",
                "[Interface]\nMTU = 1\n[Peer]\nPublicKey = A\n[Peer]\nPublicKey = C\n",
            ),
        ] {
            let (old, new) = (format!("{old}{more}"), format!("{new}{more}"));
            let held = super::read(&old).unwrap();
            let edited = held.edit(old.as_bytes(), new.as_bytes(), &hunks(&old, &new));
            if let Some((edited, _)) = &edited {
                assert_eq!(edited.conf, super::read(&new).unwrap().conf, "the edit is wrong");
            }
            assert!(edited.is_none(), "an [Interface] after a peer: not plain");
        }
        // A held file with a key twice is never read by regions.
        let dup = file(&twice, 1420);
        let changed = file(&twice[1..], 1420);
        assert!(super::read(&dup).unwrap().edit(dup.as_bytes(), changed.as_bytes(), &hunks(&dup, &changed)).is_none());
    }

    proptest::proptest! {
        /// Any change of a large peer list (peers gone, added, re-keyed, endpoints and relays
        /// changed, a key moved): the regions give the whole read, and its changes, whenever
        /// they give anything; and they do give it for every change that leaves the keys unique.
        #[test]
        fn the_regions_never_say_other_than_the_whole_read(
            keys in proptest::collection::vec(0u16..2000, 20..300),
            ops in proptest::collection::vec((0usize..300, 0u8..5, 0u16..3000), 0..8),
        ) {
            let mut seen = std::collections::HashSet::new();
            let peers: Vec<_> = keys.into_iter().filter(|k| seen.insert(*k)).map(|k| (k, (k % 2 == 0).then_some(51820), Vec::new())).collect();
            let mut after = peers.clone();
            for (at, op, value) in ops {
                let at = at % (after.len() + 1);
                match (op, at < after.len()) {
                    (0, true) => { after.remove(at); }
                    (1, _) => after.insert(at, (value, Some(value), vec![value])),
                    (2, true) => after[at].0 = value,
                    (3, true) => after[at].1 = Some(value),
                    (4, true) => after[at].2.push(value),
                    _ => {}
                }
            }
            let (old, new) = (file(&peers, 1420), file(&after, 1420));
            let unique = { let mut s = std::collections::HashSet::new(); after.iter().all(|p| s.insert(p.0)) };
            let h = hunks(&old, &new);
            // A change spanning more than a quarter of either text is read whole, by design.
            let small = h.iter().map(|h| h.old.len()).sum::<usize>() <= old.len() / 4 && h.iter().map(|h| h.new.len()).sum::<usize>() <= new.len() / 4;
            let got = same_as_whole(&old, &new, &h);
            proptest::prop_assert!(got.is_some() || !unique || !small || old == new || peers.is_empty(), "a change of unique keys was not read by regions");
        }
    }
}
