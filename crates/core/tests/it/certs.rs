//! The names of service certificates, held against the declaration as generated: a node holds
//! one certificate per module it runs that asks for one, naming exactly that module, the node,
//! its overlay addresses and the module's URI, and nothing for any other module.

use std::collections::BTreeSet;
use std::net::IpAddr;

use proptest::prelude::*;
use trellis_core::certs;

use crate::support::valid;

#[derive(Debug, Clone)]
struct Gen {
    /// Per node: the modules it runs.
    nodes: Vec<BTreeSet<usize>>,
    /// Per module: whether it asks for a certificate, and with a group.
    modules: Vec<(bool, bool)>,
    v4: bool,
    v6: bool,
}

fn gen() -> impl Strategy<Value = Gen> {
    (1usize..6, 1usize..10, any::<bool>(), any::<bool>()).prop_flat_map(|(mods, n, v4, v6)| {
        let v4 = v4 || !v6;
        (
            proptest::collection::vec(proptest::collection::btree_set(0..mods, 0..=mods), n),
            proptest::collection::vec((any::<bool>(), any::<bool>()), mods),
        )
            .prop_map(move |(nodes, modules)| Gen { nodes, modules, v4, v6 })
    })
}

fn render(g: &Gen) -> (String, Vec<(String, String)>) {
    let mut s = "[mesh]\nname = \"p\"\ndomain = \"p.mesh\"\n".to_string();
    if g.v4 {
        s.push_str("overlay_ipv4 = \"10.88.0.0/24\"\n");
    }
    if g.v6 {
        s.push_str("overlay_ipv6 = \"fd88::/64\"\n");
    }
    for (i, mods) in g.nodes.iter().enumerate() {
        let list: Vec<String> = mods.iter().map(|m| format!("\"m{m}\"")).collect();
        s.push_str(&format!("[[node]]\nname = \"n{i}\"\nmodules = [{}]\n", list.join(", ")));
    }
    let modules = g
        .modules
        .iter()
        .enumerate()
        .map(|(i, &(cert, group))| {
            let mut t = format!("[module]\nname = \"m{i}\"\n");
            if cert {
                t.push_str("[module.certificate]\n");
                if group {
                    t.push_str(&format!("group = \"grp{i}\"\n"));
                }
            }
            (format!("m{i}.toml"), t)
        })
        .collect();
    (s, modules)
}

proptest! {
    #[test]
    fn a_node_may_hold_exactly_the_names_of_itself_and_its_modules_that_ask(g in gen()) {
        let (mesh, modules) = render(&g);
        let refs: Vec<(&str, &str)> = modules.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        let decl = valid(&mesh, &refs);
        let alloc = trellis_core::allocate(&decl, &Default::default()).unwrap();
        for (i, mods) in g.nodes.iter().enumerate() {
            let node = format!("n{i}");
            let got = certs::for_node(&decl, &alloc, &node);
            let asking: Vec<usize> = mods.iter().copied().filter(|&m| g.modules[m].0).collect();
            prop_assert_eq!(got.len(), asking.len(), "{}: {:?}", node, got);
            let mut want_ips: Vec<IpAddr> = Vec::new();
            if g.v4 {
                want_ips.push(IpAddr::V4(alloc.ipv4[&node]));
            }
            if g.v6 {
                want_ips.push(IpAddr::V6(alloc.ipv6[&node]));
            }
            for (c, &m) in got.iter().zip(&asking) {
                prop_assert_eq!(&c.node, &node);
                prop_assert_eq!(&c.module, &format!("m{m}"));
                prop_assert_eq!(&c.dns, &vec![format!("m{m}.p.mesh"), format!("{node}.p.mesh")]);
                prop_assert_eq!(&c.ips, &want_ips);
                prop_assert_eq!(&c.uri, &format!("spiffe://p.mesh/module/m{m}"));
                prop_assert_eq!(c.group.clone(), g.modules[m].1.then(|| format!("grp{m}")));
                prop_assert_eq!(c.lifetime_secs, 86_400);
            }
        }
        // `all` is every node's list, and nothing for a node not declared.
        let every: usize = g.nodes.iter().map(|mods| mods.iter().filter(|&&m| g.modules[m].0).count()).sum();
        prop_assert_eq!(certs::all(&decl, &alloc).len(), every);
        prop_assert!(certs::for_node(&decl, &alloc, "ghost").is_empty());
    }
}
