//! Golden files for everything the compiler renders. Refresh with `UPDATE_GOLDEN=1 cargo test`.

use std::path::Path;

use crate::support::{compile_all, fixture};

#[track_caller]
fn golden(path: &Path, actual: &str) {
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, actual).unwrap();
        return;
    }
    let expected =
        std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}; run with UPDATE_GOLDEN=1 to create it", path.display()));
    assert!(
        expected == actual,
        "{} differs from the rendering; if the change is intended, rerun with UPDATE_GOLDEN=1\n--- expected ---\n{expected}\n--- actual ---\n{actual}",
        path.display()
    );
}

#[test]
fn relay_mesh_renders_as_recorded() {
    let compiled = compile_all(&fixture("relay"));
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/relay");
    assert_eq!(compiled.nodes.len(), 5);
    for (node, out) in &compiled.nodes {
        for f in &out.files {
            golden(&dir.join(node).join(&f.path), &f.content.to_string());
        }
    }
    let diags: Vec<String> = compiled.diagnostics.iter().map(|d| d.to_string()).collect();
    golden(&dir.join("diagnostics.txt"), &(diags.join("\n") + "\n"));
}

#[test]
fn explain_renders_as_recorded() {
    let decl = fixture("relay");
    let alloc = trellis_core::allocate(&decl, &Default::default()).unwrap();
    let topo = trellis_core::topology::Topology::new(&decl, &alloc, &Default::default());
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/relay/explain");
    for (a, b) in [("laptop-1", "db-1"), ("laptop-1", "web-1"), ("web-1", "db-1"), ("api-1", "web-1")] {
        let e = trellis_core::explain::explain(&topo, a, b).unwrap();
        golden(&dir.join(format!("{a}--{b}.txt")), &e.to_text());
    }
}

#[test]
fn relayed_pairs_route_through_the_hub() {
    let compiled = compile_all(&fixture("relay"));
    let laptop = &compiled.nodes["laptop-1"].plan;
    let hub = laptop.peers.iter().find(|p| p.name() == "hub-1").expect("laptop-1 peers with hub-1");
    assert_eq!(hub.relays_for.iter().map(|n| &*n.name).collect::<Vec<_>>(), ["db-1"]);
    assert!(hub.keepalive() && hub.endpoint().is_some(), "the node behind NAT dials the hub and keeps the path open");
    let db_addr = compiled.allocation.ipv4["db-1"];
    assert!(hub.allowed().contains(&db_addr.into()), "db-1's address sits in laptop-1's entry for the hub");
    assert!(!laptop.peers.iter().any(|p| p.name() == "db-1"), "no direct entry for a relayed node");
    let hub_plan = &compiled.nodes["hub-1"].plan;
    for n in ["laptop-1", "db-1"] {
        let p = hub_plan.peers.iter().find(|p| p.name() == n).unwrap_or_else(|| panic!("hub keeps {n}"));
        assert!(p.endpoint().is_none() || n == "db-1", "the hub cannot dial laptop-1");
    }
    // api-1 has no key: left out everywhere, and said so.
    assert!(compiled.nodes.values().all(|o| o.plan.peers.iter().all(|p| p.name() != "api-1")));
    assert!(compiled.nodes["web-1"].files[0].content.to_string().contains("Left out until they enrol (no public key yet): api-1"));
}
