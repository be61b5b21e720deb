//! Generated meshes shaped like a fleet, for the benches and `trellis-dev mesh`: their nodes'
//! names, keys and overlay, and the declaration directory written.

use std::fmt::Write as _;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use trellis_core::decl::PublicKey;
use trellis_core::SourceFile;

use crate::args::{MeshArgs, Shape};

/// Writes a generated mesh as a declaration directory.
pub fn write_mesh(a: &MeshArgs) -> Result<ExitCode> {
    if a.out.join("mesh.toml").exists() {
        bail!("{} already holds a mesh.toml; choose an empty directory", a.out.display());
    }
    let (mesh, modules) = generate(&a.shape, a.declared_keys);
    std::fs::create_dir_all(a.out.join("modules")).with_context(|| format!("cannot create {}", a.out.display()))?;
    let mut bytes = 0;
    for f in std::iter::once(&mesh).chain(modules.iter()) {
        std::fs::write(a.out.join(&f.path), &f.text).with_context(|| format!("cannot write {}", f.path))?;
        bytes += f.text.len();
    }
    let s = &a.shape;
    eprintln!(
        "wrote {}: {} nodes, {} groups, {} modules, {} networks, {} hubs ({} files, {:.1} MiB)",
        a.out.display(),
        s.nodes,
        s.groups,
        s.modules,
        s.networks,
        s.hubs,
        modules.len() + 1,
        bytes as f64 / 1048576.0
    );
    Ok(ExitCode::SUCCESS)
}

/// The IPv4 overlay of a generated mesh of `nodes`: the /16 the benches have always used while
/// it holds twice the nodes (figures stay comparable), else one that grows with the mesh
/// (100,000 nodes: a /14).
pub fn overlay_for(nodes: usize) -> String {
    let bits = (2 * nodes as u64 + 2).next_power_of_two().trailing_zeros().max(16);
    if bits <= 16 {
        return "10.88.0.0/16".into();
    }
    format!("10.64.0.0/{}", 32 - bits.min(22))
}

/// The WireGuard key of generated node `i`.
pub fn key(i: usize) -> PublicKey {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    b[31] = 0x5a;
    PublicKey(b)
}

/// The name of generated node `i`: the first `hubs` are hubs.
pub fn node_name(i: usize, hubs: usize) -> String {
    if i < hubs {
        format!("hub-{i}")
    } else {
        format!("node-{i:05}")
    }
}

/// A mesh shaped like a fleet: every node in one group and on one network, a third of them with
/// an endpoint; every node runs one service module and the shared `base` module; services admit
/// two groups over TCP and one over ICMP; `base` admits the `ops` group (SSH from operators).
/// With `declared_keys`, every node's WireGuard key is declared in the mesh (as for nodes managed
/// outside trellis); without, nodes get keys by enrolling.
pub fn generate(a: &Shape, declared_keys: bool) -> (SourceFile, Vec<SourceFile>) {
    let (n, g, m, w, h) = (a.nodes, a.groups.max(2), a.modules.max(2), a.networks.max(1), a.hubs);
    let mut s = String::with_capacity(n * 200);
    let _ = write!(
        s,
        "[mesh]\nname = \"bench\"\ndomain = \"bench.mesh\"\noverlay_ipv4 = \"{}\"\noverlay_ipv6 = \"fd88::/64\"\n\n[networks]\n",
        overlay_for(n)
    );
    for i in 0..w {
        let _ = writeln!(s, "net-{i} = {{}}");
    }
    let mut members: Vec<Vec<String>> = vec![Vec::new(); g];
    let name = |i: usize| node_name(i, h);
    for i in 0..n {
        members[i % g].push(name(i));
    }
    s.push_str("\n[groups]\n");
    for (i, list) in members.iter().enumerate() {
        let quoted: Vec<String> = list.iter().map(|m| format!("\"{m}\"")).collect();
        let label = if i == 0 { "ops".to_string() } else { format!("grp-{i}") };
        let _ = writeln!(s, "{label} = [{}]", quoted.join(", "));
    }
    let all_nets: Vec<String> = (0..w).map(|i| format!("\"net-{i}\"")).collect();
    for i in 0..n {
        let _ = write!(
            s,
            "\n[[node]]\nname = \"{}\"\nnetworks = [\"net-{}\"]\nmodules = [\"svc-{}\", \"base\"]\n",
            name(i),
            i % w,
            i % (m - 1),
        );
        if declared_keys {
            let _ = writeln!(s, "public_key = \"{}\"", key(i));
        }
        if i < h {
            let _ = write!(
                s,
                "hub = true\n[[node.endpoint]]\naddress = \"198.51.100.{}:51820\"\nreachable_from = [{}]\n",
                i + 1,
                all_nets.join(", ")
            );
        } else if i.is_multiple_of(3) {
            let _ = write!(
                s,
                "[[node.endpoint]]\naddress = \"203.0.{}.{}:51820\"\nreachable_from = [\"net-{}\", \"net-{}\"]\n",
                (i / 250) % 250,
                i % 250 + 1,
                i % w,
                (i + 1) % w
            );
        }
    }
    let mut modules = Vec::new();
    for j in 0..m - 1 {
        let (g1, g2, g3) = (1 + (j * 7) % (g - 1), 1 + (j * 7 + 1) % (g - 1), 1 + (j * 7 + 2) % (g - 1));
        let text = format!("[module]\nname = \"svc-{j}\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"{}\", \"8000-8100\"]\nfrom = [\"group:grp-{g1}\", \"group:grp-{g2}\"]\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"group:grp-{g3}\"]\n", 1000 + j);
        modules.push(SourceFile { path: format!("modules/svc-{j}.toml"), text });
    }
    modules.push(SourceFile {
        path: "modules/base.toml".into(),
        text: "[module]\nname = \"base\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"22\"]\nfrom = [\"group:ops\"]\n".into(),
    });
    (SourceFile { path: "mesh.toml".into(), text: s }, modules)
}
