//! Who can dial whom, and through which hub: the path rule's index, a row of bits per node.

use std::sync::Arc;

use super::*;

/// Who can dial whom and which hubs can relay, by node position. Owns its data, so that a compile
/// can keep it for the next one; the rows are shared, so that keeping it copies nothing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reach {
    /// Per node, one row: its networks (`words` words of bits), the networks any of its
    /// endpoints is reachable from (`words`), and the hubs it has a direct path with (bits over
    /// `hubs`). Side by side, so that the path between two nodes reads one place for each: a
    /// compile asks it of every pair of partners (19 million at 100,000 nodes).
    pub(super) rows: Arc<[u64]>,
    pub(super) words: usize,
    /// Each endpoint's `reachable_from` (`words` words of bits), node after node: node `a`'s
    /// endpoints are those from `endpoint_start[a]` to `endpoint_start[a + 1]`. One vector, not
    /// one per node and endpoint: at 100,000 nodes those were 300,000 allocations a topology.
    pub(super) endpoint_reach: Arc<[u64]>,
    pub(super) endpoint_start: Arc<[u32]>,
    pub hubs: Vec<u32>,
    /// The hubs whose key is known, as bits over `hubs`.
    pub(super) keyed_hubs: Bits,
}

impl Reach {
    pub(super) fn row(&self, a: usize) -> &[u64] {
        let len = 2 * self.words + self.keyed_hubs.0.len();
        &self.rows[a * len..(a + 1) * len]
    }

    pub(super) fn nets(&self, a: usize) -> &[u64] {
        &self.row(a)[..self.words]
    }

    /// The networks any of the node's endpoints is reachable from.
    pub(super) fn reach(&self, a: usize) -> &[u64] {
        &self.row(a)[self.words..2 * self.words]
    }

    /// The hubs the node has a direct path with, as bits over `hubs`.
    pub(super) fn hub_links(&self, a: usize) -> &[u64] {
        &self.row(a)[2 * self.words..]
    }

    /// The endpoint of `b` that `a` dials: the first whose `reachable_from` meets `a`'s networks.
    pub fn dials(&self, a: u32, b: u32) -> Option<usize> {
        let (a, b) = (a as usize, b as usize);
        let nets = self.nets(a);
        if !meets(nets, self.reach(b)) {
            return None;
        }
        let (from, to) = (self.endpoint_start[b] as usize, self.endpoint_start[b + 1] as usize);
        self.endpoint_reach[from * self.words..to * self.words].chunks_exact(self.words).position(|e| meets(e, nets))
    }

    pub fn direct(&self, a: u32, b: u32) -> bool {
        self.dials(a, b).is_some() || self.dials(b, a).is_some()
    }

    /// The nodes by their rows: each node's class, and one node of each class. Whether two nodes
    /// have a path (and which, without keys) follows from their rows alone (`dials` finds an
    /// endpoint exactly when the networks meet the endpoints' union), so a question about every
    /// pair of two sets can be asked once per pair of their classes.
    pub fn classes(&self) -> (Vec<u32>, Vec<u32>) {
        let n = self.rows.len() / (2 * self.words + self.keyed_hubs.0.len());
        let mut seen: FastMap<&[u64], u32> = FastMap::default();
        let mut first = Vec::new();
        let class = (0..n)
            .map(|a| {
                *seen.entry(self.row(a)).or_insert_with(|| {
                    first.push(a as u32);
                    first.len() as u32 - 1
                })
            })
            .collect();
        (class, first)
    }

    /// The same reach for nodes whose keys are now `keys`: only which hubs may relay follows them.
    pub(super) fn rekeyed(&self, keys: &[Option<PublicKey>]) -> Reach {
        Reach { keyed_hubs: keyed(&self.hubs, keys), ..self.clone() }
    }

    /// The path rule. With `need_keys`, only hubs whose key is known may relay. It reads the two
    /// nodes' rows and nothing else of them: `classes` relies on it (what else decides a path
    /// goes into the rows).
    pub fn path(&self, a: u32, b: u32, need_keys: bool) -> Path {
        if self.dials(a, b).is_some() || self.dials(b, a).is_some() {
            return Path::Direct;
        }
        // A hub never links to itself, so the hubs common to both are neither `a` nor `b`.
        let (la, lb) = (self.hub_links(a as usize), self.hub_links(b as usize));
        for (w, (x, y)) in la.iter().zip(lb.iter()).enumerate() {
            let mut both = x & y;
            if need_keys {
                both &= self.keyed_hubs.0[w];
            }
            if both != 0 {
                return Path::Relay { hub: self.hubs[w * 64 + both.trailing_zeros() as usize] };
            }
        }
        Path::None
    }
}

pub(super) fn hubs_len_words(hubs: &[u32]) -> usize {
    hubs.len().div_ceil(64).max(1)
}

/// The hubs whose key is known, as bits over `hubs`.
pub(super) fn keyed(hubs: &[u32], keys: &[Option<PublicKey>]) -> Bits {
    let mut bits = Bits::new(hubs_len_words(hubs));
    for (j, &h) in hubs.iter().enumerate() {
        if keys[h as usize].is_some() {
            bits.set(j);
        }
    }
    bits
}

/// Whether a node is reached the same way: the same networks and endpoints (not where written).
pub(crate) fn same_reach(a: &Node, b: &Node) -> bool {
    std::ptr::eq(a, b)
        || (a.networks == b.networks
            && a.endpoints.len() == b.endpoints.len()
            && a.endpoints.iter().zip(&b.endpoints).all(|(x, y)| x.address == y.address && x.reachable_from == y.reachable_from))
}

/// The reach of `nodes`: each one's networks and its endpoints' reach as bits over the
/// `networks` declared, and the hubs it has a direct path with (`hubs`, those with a key among
/// them marked).
pub(super) fn reach_of(
    nodes: &[&Node],
    network_index: &FastMap<&str, usize>,
    networks: usize,
    hubs: Vec<u32>,
    keys: &[Option<PublicKey>],
) -> Reach {
    let words = networks.div_ceil(64).max(1);
    // The networks named, as bits set in `into` (`words` words).
    let set_bits = |names: &[String], into: &mut [u64]| {
        for n in names {
            if let Some(&i) = network_index.get(n.as_str()) {
                into[i / 64] |= 1 << (i % 64);
            }
        }
    };
    let endpoints: usize = nodes.iter().map(|n| n.endpoints.len()).sum();
    let mut endpoint_reach = vec![0u64; endpoints * words];
    let mut endpoint_start = Vec::with_capacity(nodes.len() + 1);
    let hub_words = hubs_len_words(&hubs);
    let row = 2 * words + hub_words;
    let mut rows = vec![0u64; nodes.len() * row];
    let mut e = 0;
    for (n, r) in nodes.iter().zip(rows.chunks_exact_mut(row)) {
        endpoint_start.push(e as u32);
        let (nets, rest) = r.split_at_mut(words);
        set_bits(&n.networks, nets);
        for endpoint in &n.endpoints {
            let bits = &mut endpoint_reach[e * words..(e + 1) * words];
            set_bits(&endpoint.reachable_from, bits);
            for (a, b) in rest[..words].iter_mut().zip(bits.iter()) {
                *a |= b;
            }
            e += 1;
        }
    }
    endpoint_start.push(e as u32);
    let keyed_hubs = keyed(&hubs, keys);
    let mut r =
        Reach { rows: rows.into(), words, endpoint_reach: endpoint_reach.into(), endpoint_start: endpoint_start.into(), hubs, keyed_hubs };
    // Whether a node and a hub are direct follows from the node's networks and its
    // endpoints' reach alone (`Reach::dials` finds an endpoint where their union meets the
    // networks): the nodes that share both, most of a fleet, are worked out once (at 100,000
    // nodes and 100 hubs, 10 million pairs were: a tenth of a recompile).
    let link = |a: u32, into: &mut [u64]| {
        for (j, &h) in r.hubs.iter().enumerate() {
            if h != a && r.direct(a, h) {
                into[j / 64] |= 1 << (j % 64);
            }
        }
    };
    // Each node's links, or the first node's alike with it.
    let mut links = vec![0u64; nodes.len() * hub_words];
    let mut alike: FastMap<&[u64], usize> = FastMap::default();
    for a in 0..nodes.len() {
        let start = a * row;
        let first = if nodes[a].hub { a } else { *alike.entry(&r.rows[start..start + 2 * words]).or_insert(a) };
        if first == a {
            link(a as u32, &mut links[a * hub_words..(a + 1) * hub_words]);
        } else {
            links.copy_within(first * hub_words..(first + 1) * hub_words, a * hub_words);
        }
    }
    drop(alike);
    if hub_words > 0 {
        let rows = Arc::get_mut(&mut r.rows).expect("made here");
        for (a, b) in links.chunks_exact(hub_words).enumerate() {
            rows[a * row + 2 * words..(a + 1) * row].copy_from_slice(b);
        }
    }
    r
}
