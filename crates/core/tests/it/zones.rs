//! The zones the compiler writes, as BIND reads them: every node's zone of every shipped lab
//! loads in `named-checkzone` with its strictest checks (names, and a name server with an
//! address in the zone), the name server being the node's own resolver.

use std::path::{Path, PathBuf};
use std::process::Command;

use trellis_core::plan::MESH_ZONE;
use trellis_core::{load, SourceFile};

use crate::support::{compile_all, lines};

/// Every declaration the labs use: each directory under `lab/` (and one level further, as
/// `ha/metrics`) that holds a `mesh.toml`.
fn lab_declarations() -> Vec<PathBuf> {
    let lab = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab");
    let mut out = Vec::new();
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&lab).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
    dirs.sort();
    for d in dirs {
        let mut inner: Vec<PathBuf> = std::fs::read_dir(&d).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_dir()).collect();
        inner.sort();
        out.extend(std::iter::once(d).chain(inner).filter(|p| p.join("mesh.toml").exists()));
    }
    out
}

fn load_dir(dir: &Path) -> trellis_core::Declaration {
    let read = |p: &Path, shown: String| SourceFile {
        path: shown,
        text: std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())),
    };
    let mesh = read(&dir.join("mesh.toml"), "mesh.toml".into());
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir.join("modules")).map_or(Vec::new(), |r| r.map(|e| e.unwrap().path()).collect());
    paths.sort();
    let modules: Vec<SourceFile> = paths.iter().map(|p| read(p, format!("modules/{}", p.file_name().unwrap().to_str().unwrap()))).collect();
    let loaded = load(&mesh, &modules);
    loaded.declaration.unwrap_or_else(|| panic!("{} is invalid:\n{}", dir.display(), lines(&loaded.diagnostics)))
}

#[test]
fn every_zone_of_every_lab_loads_in_named_checkzone() {
    if !trellis_testing::can_run(trellis_testing::Need::Program("named-checkzone")) {
        return;
    }
    let dirs = lab_declarations();
    assert!(dirs.len() >= 10, "the labs' declarations: {dirs:?}");
    let tmp = std::env::temp_dir().join(format!("trellis-zones-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let mut failed = Vec::new();
    let mut checked = 0;
    for dir in &dirs {
        let decl = load_dir(dir);
        let compiled = compile_all(&decl);
        for (node, out) in &compiled.nodes {
            let zone = out.files.iter().find(|f| f.path == MESH_ZONE).expect("a zone").content.to_string();
            let file = tmp.join(format!("{}-{node}.zone", dir.file_name().unwrap().to_str().unwrap()));
            std::fs::write(&file, &zone).unwrap();
            let run =
                Command::new("named-checkzone").args(["-k", "fail", "-n", "fail"]).arg(&decl.mesh.domain).arg(&file).output().unwrap();
            checked += 1;
            if !run.status.success() {
                failed.push(format!(
                    "{} node {node}:\n{}{}\n{zone}",
                    dir.display(),
                    String::from_utf8_lossy(&run.stdout),
                    String::from_utf8_lossy(&run.stderr)
                ));
            }
            // The name server the zone names is the node's own resolver, on its overlay addresses.
            let read = trellis_core::zone::parse(&zone).unwrap_or_else(|e| panic!("{node}: {e}\n{zone}"));
            let own: Vec<std::net::IpAddr> = [out.plan.ipv4.map(Into::into), out.plan.ipv6.map(Into::into)].into_iter().flatten().collect();
            assert_eq!(read.nameserver_addresses, own, "{} node {node}: the name server's addresses\n{zone}", dir.display());
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    assert!(failed.is_empty(), "{} of {checked} zones fail named-checkzone -k fail -n fail:\n{}", failed.len(), failed.join("\n"));
}

/// `ns` names every zone's name server: a node, a module or a route host that took it would be
/// answered as the resolver (or hide it), so `check` refuses each, with its place.
#[test]
fn the_name_server_s_name_is_refused_for_a_node_a_module_and_a_route_host() {
    let mesh = "[mesh]\nname = \"z\"\ndomain = \"z.mesh\"\noverlay_ipv4 = \"10.7.0.0/16\"\n\n[networks]\nlan = {}\n\n\
                [[node]]\nname = \"ns\"\nnetworks = [\"lan\"]\nmodules = [\"ns\"]\n\n[[node]]\nname = \"gw\"\nnetworks = [\"lan\"]\n\n\
                [[route]]\nname = \"lan\"\nprefixes = [\"192.168.1.0/24\"]\nvia = [\"gw\"]\n  [[route.allow]]\n  proto = \"any\"\n  from = [\"mesh\"]\n\
                \x20 [[route.host]]\n  name = \"ns\"\n  address = \"192.168.1.2\"\n";
    let module = "[module]\nname = \"ns\"\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"mesh\"]\n";
    let loaded = crate::support::load_text(mesh, &[("ns.toml", module)]);
    assert!(loaded.declaration.is_none());
    let got = lines(&loaded.diagnostics);
    let reserved = "the name `ns` is reserved: every zone names its name server `ns.z.mesh`, the node's own resolver";
    for want in [
        format!("mesh.toml:9:1: error: node `ns`: {reserved}"),
        format!("modules/ns.toml:1:1: error: module `ns`: {reserved}"),
        format!("mesh.toml:25:3: error: host `ns` of route `lan`: {reserved}"),
    ] {
        assert!(got.contains(&want), "want\n{want}\nin\n{got}");
    }
}

/// A revoked node is withdrawn from the mesh for good: its own name and the module names it
/// answered for leave every zone (a pool's clients stop being sent to it by name), while the
/// other runners of its modules still answer, and a node never enrolled keeps its name (the
/// zone follows the declaration, ADR 0015). Before, `postgres.basic.mesh` answered db-1 after
/// db-1 was revoked.
#[test]
fn a_revoked_node_s_names_leave_every_zone() {
    let decl = std::sync::Arc::new(load_dir(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab/basic")));
    let zone = |c: &trellis_core::Compiled, node: &str| {
        let text = c.nodes[node].files.iter().find(|f| f.path == MESH_ZONE).unwrap().content.to_string();
        trellis_core::zone::parse(&text).unwrap().addresses().keys().map(|n| n.to_string()).collect::<Vec<_>>()
    };
    let mut keys = trellis_core::Keys::default();
    for (i, n) in ["api-1", "db-1", "op-1"].iter().enumerate() {
        keys.set(n, Some(trellis_core::decl::PublicKey([i as u8 + 1; 32])));
    }
    let before = trellis_core::compile(&decl, &keys, &Default::default(), None).unwrap();
    let api = zone(&before, "api-1");
    assert!(api.contains(&"db-1".to_string()) && api.contains(&"postgres".to_string()), "{api:?}");
    assert!(zone(&before, "op-1").contains(&"db-1".to_string()));

    keys.set("db-1", None);
    keys.withdraw_only(["db-1"]);
    let after = trellis_core::compile(&decl, &keys, &Default::default(), Some(before.clone())).unwrap();
    for node in ["api-1", "op-1"] {
        let names = zone(&after, node);
        assert!(!names.iter().any(|n| n == "db-1" || n == "postgres" || n == "ssh"), "{node} still resolves db-1's names: {names:?}");
        assert!(names.contains(&node.to_string()), "{node} keeps its own name: {names:?}");
    }
    // ping is run by the others too: the module name stays, answered by them alone.
    assert!(zone(&after, "op-1").contains(&"ping".to_string()));
    // Only withdrawn, not merely without a key: a node that has not enrolled keeps its names.
    let mut unenrolled = trellis_core::Keys::default();
    unenrolled.set("api-1", Some(trellis_core::decl::PublicKey([1; 32])));
    unenrolled.set("op-1", Some(trellis_core::decl::PublicKey([3; 32])));
    let pending = trellis_core::compile(&decl, &unenrolled, &Default::default(), None).unwrap();
    assert!(zone(&pending, "api-1").contains(&"postgres".to_string()));
    // The recompile is the full compile's output, byte for byte.
    let full = trellis_core::compile(&decl, &keys, &Default::default(), None).unwrap();
    for (name, out) in &after.nodes {
        assert_eq!(out.files, full.nodes[name].files, "{name}");
    }
    assert!(after.rendered.contains(&"api-1".to_string()), "api-1's zone changed: {:?}", after.rendered);
}

/// A mesh of `n` nodes in one group, all dual-stack, and a module `ssh` run by `runners` (named
/// `a-0`.. so they sort first, the second pinned at `10.7.9.9` and `fd07::9:9`) that admits the group: each
/// runner's zone names every node, more than 64 KiB of records from about 1,500 nodes. `mtu`
/// and the second runner's name vary.
pub(crate) fn grouped(n: usize, second: &str, mtu: u16) -> std::sync::Arc<trellis_core::Declaration> {
    use std::fmt::Write;
    let mut mesh = format!(
        "[mesh]\nname = \"z\"\ndomain = \"z.mesh\"\noverlay_ipv4 = \"10.7.0.0/16\"\noverlay_ipv6 = \"fd07::/64\"\nmtu = {mtu}\n\n[networks]\nlan = {{}}\n\n[groups]\nall = [{}]\n",
        (0..n).map(|i| format!("\"n-{i:05}\"")).collect::<Vec<_>>().join(", ")
    );
    for (name, pin) in [("a-0", None), (second, Some("10.7.9.9")), ("a-2", None)] {
        let _ = write!(mesh, "\n[[node]]\nname = \"{name}\"\nnetworks = [\"lan\"]\nmodules = [\"ssh\"]\n");
        if let Some(a) = pin {
            let _ = writeln!(mesh, "address_ipv4 = \"{a}\"\naddress_ipv6 = \"fd07::9:9\"");
        }
    }
    for i in 0..n {
        let _ = write!(mesh, "\n[[node]]\nname = \"n-{i:05}\"\nnetworks = [\"lan\"]\n");
    }
    let module = "[module]\nname = \"ssh\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"22\"]\nfrom = [\"group:all\"]\n";
    let loaded = crate::support::load_text(&mesh, &[("ssh.toml", module)]);
    std::sync::Arc::new(loaded.declaration.unwrap_or_else(|| panic!("{}", lines(&loaded.diagnostics))))
}

/// ADR 0043: a zone in parts is `mesh.zone` and its parts one after the other, and that is a
/// zone BIND loads with its strictest checks, holding the same names as the zone made as one
/// file.
#[test]
fn a_zone_in_parts_one_after_the_other_loads_in_named_checkzone() {
    if !trellis_testing::can_run(trellis_testing::Need::Program("named-checkzone")) {
        return;
    }
    let decl = grouped(1600, "a-1", 1420);
    let compiled = compile_all(&decl);
    let out = &compiled.nodes["a-0"];
    let parts: Vec<&trellis_core::plan::FileResource> =
        out.files.iter().filter(|f| trellis_core::plan::zone_part_index(&f.path).is_some()).collect();
    assert!(parts.len() > 32, "a-0's zone is in parts: {}", parts.len());
    let mut joined = out.files.iter().find(|f| f.path == MESH_ZONE).unwrap().content.to_string();
    for p in &parts {
        joined.push_str(&p.content.to_string());
    }
    let file = std::env::temp_dir().join(format!("trellis-zone-parts-{}.zone", std::process::id()));
    std::fs::write(&file, &joined).unwrap();
    let run = Command::new("named-checkzone").args(["-k", "fail", "-n", "fail"]).arg("z.mesh").arg(&file).output().unwrap();
    let _ = std::fs::remove_file(&file);
    assert!(run.status.success(), "{}{}", String::from_utf8_lossy(&run.stdout), String::from_utf8_lossy(&run.stderr));
    let one = trellis_core::zone::parse(&trellis_core::render::zone(&out.plan, None).to_string()).unwrap();
    let whole = trellis_core::zone::parse(&joined).unwrap();
    assert_eq!(by_name(&whole), by_name(&one));
    assert!(whole.addresses().len() > 1600, "every node of the group is named: {}", whole.addresses().len());
}

/// A review found a module's zone block kept from the compile before with the parts of its
/// runners' old names: a runner renamed at the same place in name order, at its pinned address,
/// in a change compiled in full (here with another MTU). The block's lines are the same, its
/// parts are not: a recompile must give what a full compile gives.
#[test]
fn a_module_whose_runner_is_renamed_in_place_has_the_parts_of_its_new_name() {
    let keys = trellis_core::Keys::default();
    let before = trellis_core::compile(&grouped(1600, "a-1", 1420), &keys, &Default::default(), None).unwrap();
    assert_ne!(trellis_core::plan::part_of("a-1"), trellis_core::plan::part_of("a-10"), "the names hash to other parts");
    let after = grouped(1600, "a-10", 1380);
    let full = trellis_core::compile(&after, &keys, &before.allocation, None).unwrap();
    let allocation = before.allocation.clone();
    let inc = trellis_core::compile(&after, &keys, &allocation, Some(before)).unwrap();
    assert_eq!(inc.zone_blocks, full.zone_blocks, "the module's block has the parts of its runners' names");
    for (node, out) in &full.nodes {
        assert_eq!(inc.nodes[node].files, out.files, "{node}'s files");
    }
}

/// Each name of a zone with its addresses, sorted: two zones that answer alike, whatever the order
/// of their records.
pub(crate) fn by_name(z: &trellis_core::zone::Zone) -> std::collections::BTreeMap<String, Vec<std::net::IpAddr>> {
    z.addresses()
        .into_iter()
        .map(|(n, mut a)| {
            a.sort();
            (n.to_string(), a)
        })
        .collect()
}
