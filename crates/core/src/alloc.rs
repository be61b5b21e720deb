//! Overlay address allocation: deterministic, honouring pins, and stable given the previous
//! allocation (see adr/0009-overlay-address-allocation.md).
//!
//! Order of precedence for each node and family: its pin; else the address it held in the
//! previous allocation, if still in the pool and not pinned by another node; else a slot derived
//! from SHA-256 of the mesh and node names, probing upward to the next free address. New nodes are
//! placed in name order, so the same inputs always give the same addresses.

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, Ipv6Addr};

use ipnet::{Ipv4Net, Ipv6Net};
use sha2::{Digest, Sha256};

use crate::decl::Declaration;
use crate::diag::Diagnostic;

/// Overlay addresses per node name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocation {
    pub ipv4: BTreeMap<String, Ipv4Addr>,
    pub ipv6: BTreeMap<String, Ipv6Addr>,
}

/// Whether two declarations give the same addresses from the same previous allocation: the same
/// mesh name and overlay pools, and the same nodes in the same order with the same pins (all
/// that [`allocate`] reads of a declaration). Allocating is idempotent, so a declaration with
/// the same addressing as the one an allocation was made for gets that allocation again. A node
/// two declarations share (the same `Arc`) is not read.
pub fn same_addressing(a: &Declaration, b: &Declaration) -> bool {
    (&a.mesh.name, a.mesh.overlay_ipv4, a.mesh.overlay_ipv6) == (&b.mesh.name, b.mesh.overlay_ipv4, b.mesh.overlay_ipv6)
        && a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(&b.nodes).all(|(x, y)| {
            std::sync::Arc::ptr_eq(x, y) || (&x.name, x.address_ipv4, x.address_ipv6) == (&y.name, y.address_ipv4, y.address_ipv6)
        })
}

/// Allocates addresses for every node of `decl`. Fails only when a pool is exhausted.
pub fn allocate(decl: &Declaration, previous: &Allocation) -> Result<Allocation, Diagnostic> {
    let mut out = Allocation::default();
    if let Some(pool) = decl.mesh.overlay_ipv4 {
        let space = Space::v4(pool);
        out.ipv4 = assign(
            decl,
            &space,
            |n| n.address_ipv4.map(|a| space.offset_v4(a)),
            |name| previous.ipv4.get(name).and_then(|a| space.usable_v4(*a)),
        )
        .map_err(|e| unassigned(decl, e, "overlay_ipv4", &pool.to_string(), space.usable))?
        .into_iter()
        .map(|(n, off)| (n, space.v4_at(off)))
        .collect();
    }
    if let Some(pool) = decl.mesh.overlay_ipv6 {
        let space = Space::v6(pool);
        out.ipv6 = assign(
            decl,
            &space,
            |n| n.address_ipv6.map(|a| space.offset_v6(a)),
            |name| previous.ipv6.get(name).and_then(|a| space.usable_v6(*a)),
        )
        .map_err(|e| unassigned(decl, e, "overlay_ipv6", &pool.to_string(), space.usable))?
        .into_iter()
        .map(|(n, off)| (n, space.v6_at(off)))
        .collect();
    }
    Ok(out)
}

/// [`allocate`] for `decl` given `previous`, the allocation of `was`: the same result, made by
/// difference when `decl` declares the nodes of `was` that stay as they were (the same `Arc`)
/// and adds nodes under new names (a pool's member joining): the nodes that left free their
/// addresses and the new ones are placed as `allocate` places them, without the others being
/// placed again (at 100,000 nodes, 100 ms of a member's arrival). Anything else is allocated
/// whole.
pub fn allocate_after(decl: &Declaration, was: &Declaration, mut previous: Allocation) -> Result<Allocation, Diagnostic> {
    match added_only(decl, was, &previous) {
        Some(change) => {
            change.apply(&mut previous);
            Ok(previous)
        }
        None => allocate(decl, &previous),
    }
}

/// What `allocate_after` changes: the names that left, and the new nodes' offsets per family.
struct Added {
    gone: Vec<String>,
    ipv4: Option<(Space, Vec<(String, u128)>)>,
    ipv6: Option<(Space, Vec<(String, u128)>)>,
}

impl Added {
    fn apply(self, to: &mut Allocation) {
        for name in &self.gone {
            to.ipv4.remove(name);
            to.ipv6.remove(name);
        }
        if let Some((space, placed)) = self.ipv4 {
            to.ipv4.extend(placed.into_iter().map(|(n, off)| (n, space.v4_at(off))));
        }
        if let Some((space, placed)) = self.ipv6 {
            to.ipv6.extend(placed.into_iter().map(|(n, off)| (n, space.v6_at(off))));
        }
    }
}

/// The change from `previous` (the allocation of `was`) to the allocation of `decl`, when `decl`
/// keeps the nodes of `was` it declares as they were and its other nodes are new names; `None`
/// otherwise, or when a new node's pin is taken (then `allocate` decides, or says what is wrong).
fn added_only(decl: &Declaration, was: &Declaration, previous: &Allocation) -> Option<Added> {
    if (&decl.mesh.name, decl.mesh.overlay_ipv4, decl.mesh.overlay_ipv6) != (&was.mesh.name, was.mesh.overlay_ipv4, was.mesh.overlay_ipv6) {
        return None;
    }
    let before: crate::FastSet<*const crate::decl::Node> = was.nodes.iter().map(std::sync::Arc::as_ptr).collect();
    let added: Vec<&crate::decl::Node> = decl.nodes.iter().filter(|n| !before.contains(&std::sync::Arc::as_ptr(n))).map(|n| &**n).collect();
    let gone: Vec<String> = match decl.nodes.len() - added.len() == was.nodes.len() {
        true => Vec::new(),
        false => {
            let now: crate::FastSet<*const crate::decl::Node> = decl.nodes.iter().map(std::sync::Arc::as_ptr).collect();
            was.nodes.iter().filter(|n| !now.contains(&std::sync::Arc::as_ptr(n))).map(|n| n.name.clone()).collect()
        }
    };
    // A name that was there (declared anew, or left and came back) may keep its address: all of
    // it is for `allocate` to decide.
    let gone_names: crate::FastSet<&str> = gone.iter().map(String::as_str).collect();
    let known = |name: &str| previous.ipv4.contains_key(name) || previous.ipv6.contains_key(name) || gone_names.contains(name);
    if added.iter().any(|n| known(&n.name)) {
        return None;
    }
    let mesh = &decl.mesh.name;
    let ipv4 = match decl.mesh.overlay_ipv4 {
        Some(pool) => {
            let space = Space::v4(pool);
            let placed = place_added(
                decl,
                &space,
                &previous.ipv4,
                was.nodes.len(),
                |a| space.offset_v4(*a),
                &gone,
                &added,
                |n| n.address_ipv4.map(|a| space.offset_v4(a)),
                mesh,
            )?;
            Some((space, placed))
        }
        None => None,
    };
    let ipv6 = match decl.mesh.overlay_ipv6 {
        Some(pool) => {
            let space = Space::v6(pool);
            let placed = place_added(
                decl,
                &space,
                &previous.ipv6,
                was.nodes.len(),
                |a| space.offset_v6(*a),
                &gone,
                &added,
                |n| n.address_ipv6.map(|a| space.offset_v6(a)),
                mesh,
            )?;
            Some((space, placed))
        }
        None => None,
    };
    Some(Added { gone, ipv4, ipv6 })
}

/// The offsets `assign` gives the nodes `added` in one family, given the addresses of the `was`
/// nodes before (`map`) less those `gone`: their pins, then the others in name order, each from
/// its preferred slot upwards. `None` when the map is not of `was` nodes, a pin is taken, or the
/// pool is too small.
#[allow(clippy::too_many_arguments)]
fn place_added<A>(
    decl: &Declaration,
    space: &Space,
    map: &BTreeMap<String, A>,
    was: usize,
    offset: impl Fn(&A) -> u128,
    gone: &[String],
    added: &[&crate::decl::Node],
    pin: impl Fn(&crate::decl::Node) -> Option<u128>,
    mesh: &str,
) -> Option<Vec<(String, u128)>> {
    if map.len() != was || decl.nodes.len() as u128 > space.usable {
        return None;
    }
    let mut used: crate::FastSet<u128> = map.values().map(&offset).collect();
    for name in gone {
        used.remove(&offset(map.get(name)?));
    }
    let mut placed = Vec::with_capacity(added.len());
    let mut rest = Vec::new();
    for n in added {
        match pin(n) {
            Some(off) if used.insert(off) => placed.push((n.name.clone(), off)),
            Some(_) => return None,
            None => rest.push(n.name.as_str()),
        }
    }
    rest.sort_unstable();
    for name in rest {
        let mut off = space.preferred(mesh, name);
        while !used.insert(off) {
            off = if off == space.usable { 1 } else { off + 1 };
        }
        placed.push((name.to_string(), off));
    }
    Some(placed)
}

fn unassigned(decl: &Declaration, e: Unassigned, key: &str, pool: &str, usable: u128) -> Diagnostic {
    if let Unassigned::SamePin(a, b) = e {
        let at = decl.node(&a).map_or(&decl.mesh.loc, |n| &n.loc);
        return Diagnostic::error(
            at,
            format!("nodes `{a}` and `{b}` hold the same address of `{key}`; a pinned address must be free (a pool's member may hold it)"),
        );
    }
    Diagnostic::error(
        &decl.mesh.loc,
        format!(
            "`{key}` {pool} is exhausted: {} nodes are declared but it holds {usable} usable addresses; use a larger pool",
            decl.nodes.len()
        ),
    )
}

/// A pool as a range of offsets from its network address. Offset 0 (the network address) is never
/// used, nor, in IPv4, the broadcast address.
struct Space {
    base: u128,
    usable: u128,
    salt: String,
}

impl Space {
    fn v4(pool: Ipv4Net) -> Space {
        let size = 1u128 << (32 - pool.prefix_len());
        Space { base: u32::from(pool.network()) as u128, usable: size - 2, salt: pool.to_string() }
    }

    fn v6(pool: Ipv6Net) -> Space {
        let bits = 128 - pool.prefix_len() as u32;
        // Offsets are u128, so a pool wider than 2^127 is treated as 2^127 addresses.
        let size = if bits >= 127 { 1u128 << 127 } else { 1u128 << bits };
        Space { base: u128::from(pool.network()), usable: size - 1, salt: pool.to_string() }
    }

    fn offset_v4(&self, a: Ipv4Addr) -> u128 {
        (u32::from(a) as u128).wrapping_sub(self.base)
    }

    fn offset_v6(&self, a: Ipv6Addr) -> u128 {
        u128::from(a).wrapping_sub(self.base)
    }

    fn usable_v4(&self, a: Ipv4Addr) -> Option<u128> {
        Some(self.offset_v4(a)).filter(|o| (1..=self.usable).contains(o))
    }

    fn usable_v6(&self, a: Ipv6Addr) -> Option<u128> {
        Some(self.offset_v6(a)).filter(|o| (1..=self.usable).contains(o))
    }

    fn v4_at(&self, off: u128) -> Ipv4Addr {
        Ipv4Addr::from((self.base + off) as u32)
    }

    fn v6_at(&self, off: u128) -> Ipv6Addr {
        Ipv6Addr::from(self.base + off)
    }

    /// The first slot tried for a new node: stable for a name, spread over the pool.
    fn preferred(&self, mesh: &str, node: &str) -> u128 {
        let mut h = Sha256::new();
        h.update(b"trellis address v1\0");
        h.update(self.salt.as_bytes());
        h.update(b"\0");
        h.update(mesh.as_bytes());
        h.update(b"\0");
        h.update(node.as_bytes());
        let d = h.finalize();
        let n = u128::from_be_bytes(d[..16].try_into().expect("16 bytes"));
        1 + n % self.usable
    }
}

enum Unassigned {
    Exhausted,
    /// Two nodes pin the same address (a declared node and a pool member that holds it).
    SamePin(String, String),
}

fn assign(
    decl: &Declaration,
    space: &Space,
    pin: impl Fn(&crate::decl::Node) -> Option<u128>,
    previous: impl Fn(&str) -> Option<u128>,
) -> Result<Vec<(String, u128)>, Unassigned> {
    if decl.nodes.len() as u128 > space.usable {
        return Err(Unassigned::Exhausted);
    }
    // Hashed with foldhash, not SipHash: two of these sets of 100,000 offsets are an apply's.
    let mut used: crate::FastSet<u128> = crate::FastSet::with_capacity_and_hasher(decl.nodes.len(), Default::default());
    let mut out: Vec<(String, u128)> = Vec::with_capacity(decl.nodes.len());
    let mut rest = Vec::new();
    for n in &decl.nodes {
        if let Some(off) = pin(n) {
            if !used.insert(off) {
                let other = out.iter().find(|(_, o)| *o == off).map(|(name, _)| name.clone()).unwrap_or_default();
                return Err(Unassigned::SamePin(other, n.name.clone()));
            }
            out.push((n.name.clone(), off));
        }
    }
    for n in &decl.nodes {
        if pin(n).is_some() {
            continue;
        }
        match previous(&n.name) {
            Some(off) if used.insert(off) => out.push((n.name.clone(), off)),
            _ => rest.push(n.name.as_str()),
        }
    }
    rest.sort_unstable();
    for name in rest {
        let mut off = space.preferred(&decl.mesh.name, name);
        // Terminates: fewer nodes than usable addresses were checked above.
        while !used.insert(off) {
            off = if off == space.usable { 1 } else { off + 1 };
        }
        out.push((name.to_string(), off));
    }
    Ok(out)
}
