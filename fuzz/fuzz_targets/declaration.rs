//! The declaration loader on arbitrary files, as `trellis check` and `trellis apply` run it: the
//! input is `mesh.toml` and module files split at NUL; a declaration that loads is checked
//! (`explain::check`) and compiled, as `trellis compile` and the controller do.
//!
//! Loading is deterministic, the same through the load cache (cold and warm), and names only
//! the files given, at lines and columns that exist; a declaration exists exactly when there is
//! no error. Compiling is deterministic, a recompile
//! that only learns keys equals a compile from scratch, and every node's rendered
//! `wireguard.conf` and `mesh.zone` read back (with the core's own readers) as exactly the plan
//! they were rendered from.
#![no_main]

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use trellis_core::compile::{NodeOutput, MESH_ZONE, WIREGUARD_CONF};
use trellis_core::decl::{PublicKey, KEEPALIVE_SECS};
use trellis_core::wgconf::{WgConf, WgPeer};
use trellis_core::{compile, explain, load_relative, Allocation, Compiled, NodePlan};

fuzz_target!(|data: &[u8]| {
    let files = trellis_fuzz::declaration_files(data);
    let display = |p: &str| format!("decl/{p}");
    let loaded = load_relative(&files, display);
    let again = load_relative(&files, display);
    assert_eq!(loaded.diagnostics, again.diagnostics, "loading is deterministic");
    assert_eq!(loaded.declaration, again.declaration, "loading is deterministic");
    assert_eq!(loaded.declaration.is_some(), loaded.errors().next().is_none(), "a declaration exists exactly when there is no error");
    // Through the load cache (ADR 0034), cold and then warm, exactly the same.
    let mut cache = trellis_core::load::LoadCache::default();
    for pass in ["cold", "warm"] {
        let cached = trellis_core::load::load_relative_cached(&files, display, &mut cache);
        assert_eq!(loaded.diagnostics, cached.diagnostics, "the {pass} cached load says what the whole load says");
        assert_eq!(loaded.declaration, cached.declaration, "the {pass} cached load gives the whole load's declaration");
    }
    for d in &loaded.diagnostics {
        let text = files.iter().find(|(p, _)| display(p) == *d.loc.file).map(|(_, t)| t.as_str());
        // A missing mesh.toml is reported at its (empty) start.
        let text = text.unwrap_or_else(|| {
            assert_eq!(*d.loc.file, display(trellis_core::load::MESH_FILE), "{d} names a file that was not given");
            ""
        });
        let lines = text.split('\n').count() as u32;
        assert!(d.loc.line >= 1 && d.loc.line <= lines && d.loc.col >= 1, "{d} is outside its file of {lines} lines");
    }
    let Some(decl) = loaded.declaration else { return };
    let checked = explain::check(&decl);

    let decl = Arc::new(decl);
    let bare = match compile(&decl, &Default::default(), &Allocation::default(), None) {
        Ok(c) => c,
        Err(d) => {
            assert!(checked.contains(&d), "compiling fails with {d}, which `check` does not report");
            return;
        }
    };
    // Keys for every node not declared with one, as enrolments would bring them.
    let keys: trellis_core::Keys = decl
        .nodes
        .iter()
        .filter(|n| n.public_key.is_none())
        .map(|n| (n.name.clone(), PublicKey(Sha256::digest(n.name.as_bytes()).into())))
        .collect();
    let full = compile(&decl, &keys, &Allocation::default(), None).expect("compiles with keys as without");
    same(&full, &compile(&decl, &keys, &Allocation::default(), None).expect("compiles again"), "a second compile");
    same(&full, &compile(&decl, &keys, &Allocation::default(), Some(bare)).expect("recompiles"), "a recompile that learns keys");
    // A peer's key is the one it enrolled with or the one declared for it.
    let key_of = |n: &str| keys.get(n).or_else(|| decl.node(n).and_then(|d| d.public_key)).expect("peers have keys");
    for (name, out) in &full.nodes {
        reads_back(name, out, &key_of);
    }
});

fn same(a: &Compiled, b: &Compiled, what: &str) {
    assert_eq!(a.allocation, b.allocation, "{what}: allocation");
    assert_eq!(a.diagnostics, b.diagnostics, "{what}: diagnostics");
    assert_eq!(a.nodes.keys().collect::<Vec<_>>(), b.nodes.keys().collect::<Vec<_>>(), "{what}: nodes");
    for (name, x) in &a.nodes {
        let y = &b.nodes[name];
        assert_eq!(x.plan, y.plan, "{what}: the plan of {name}");
        assert_eq!(x.files, y.files, "{what}: the files of {name}");
    }
}

fn file(out: &NodeOutput, path: &str) -> String {
    out.files.iter().find(|f| f.path == path).unwrap_or_else(|| panic!("{path} is missing")).content.to_string()
}

/// The rendered files, read back, say what the plan says.
fn reads_back(name: &str, out: &NodeOutput, key_of: &dyn Fn(&str) -> PublicKey) {
    let plan = &out.plan;
    let wg = trellis_core::wgconf::parse(&file(out, WIREGUARD_CONF)).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(wg, expected_wgconf(plan, key_of), "{name}: wireguard.conf");

    let zone = trellis_core::zone::parse(&file(out, MESH_ZONE)).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(zone.origin, plan.common.domain, "{name}: zone origin");
    let seen = zone.addresses();
    let mut names: Vec<&str> = plan.zone.iter().map(|t| &*t.name).collect();
    for t in &plan.zone {
        let want: Vec<IpAddr> = t.ipv4.map(IpAddr::V4).into_iter().chain(t.ipv6.map(IpAddr::V6)).collect();
        assert_eq!(seen.get(&*t.name).cloned().unwrap_or_default(), want, "{name}: the zone's addresses of {}", t.name);
    }
    names.extend(plan.zone_modules.iter().filter(|m| !m.records.is_empty()).map(|m| &*m.module));
    // A route's block names the hosts on it, each on its own record lines.
    names.extend(plan.zone_routes.iter().flat_map(|r| r.records.lines().filter_map(|l| l.split_whitespace().next())));
    names.sort_unstable();
    let listed: Vec<&str> = seen.keys().copied().collect();
    let want: Vec<&str> = BTreeMap::from_iter(names.into_iter().map(|n| (n, ()))).into_keys().collect();
    assert_eq!(listed, want, "{name}: the zone names exactly the nodes and modules of the plan");
}

fn expected_wgconf(plan: &NodePlan, key_of: &dyn Fn(&str) -> PublicKey) -> WgConf {
    let c = &plan.common;
    let addresses = plan
        .ipv4
        .map(|a| format!("{a}/{}", c.ipv4_prefix))
        .into_iter()
        .chain(plan.ipv6.map(|a| format!("{a}/{}", c.ipv6_prefix)))
        .collect();
    let peers = plan
        .peers
        .iter()
        .map(|p| WgPeer {
            public_key: key_of(p.name()).to_string(),
            allowed_ips: std::iter::once(&p.node)
                .chain(p.relays_for.iter())
                .flat_map(|t| t.allowed.split(", ").filter(|s| !s.is_empty()).map(str::to_string))
                // Then the prefixes of the routes this node sends to the peer, its router.
                .chain(p.routes.iter().flat_map(|r| r.prefixes.iter().map(|n| n.to_string())))
                .collect(),
            endpoint: p.endpoint(),
            keepalive: p.keepalive().then_some(KEEPALIVE_SECS),
        })
        .map(std::sync::Arc::new)
        .collect();
    WgConf { addresses, listen_port: Some(c.port), mtu: Some(u32::from(c.mtu)), peers }
}
