//! Address allocation: pins honoured, previous addresses kept, the same inputs giving the same
//! addresses.

use trellis_core::{allocate, Allocation};

use crate::support::valid;

fn mesh(nodes: &[&str], extra: &str) -> String {
    let mut s = "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.0/24\"\noverlay_ipv6 = \"fd88::/64\"\n".to_string();
    for n in nodes {
        s.push_str(&format!("[[node]]\nname = \"{n}\"\n"));
    }
    s.push_str(extra);
    s
}

#[test]
fn pins_are_honoured() {
    let d = valid(&mesh(&["a"], "[[node]]\nname = \"p\"\naddress_ipv4 = \"10.88.0.200\"\naddress_ipv6 = \"fd88::200\"\n"), &[]);
    let a = allocate(&d, &Allocation::default()).unwrap();
    assert_eq!(a.ipv4["p"].to_string(), "10.88.0.200");
    assert_eq!(a.ipv6["p"].to_string(), "fd88::200");
}

#[test]
fn same_inputs_same_addresses_and_previous_addresses_are_kept() {
    let d1 = valid(&mesh(&["a", "b", "c"], ""), &[]);
    let a1 = allocate(&d1, &Allocation::default()).unwrap();
    assert_eq!(a1, allocate(&d1, &Allocation::default()).unwrap());
    // Remove b, add many others: a and c keep their addresses.
    let names: Vec<String> = (0..100).map(|i| format!("n{i}")).collect();
    let mut list: Vec<&str> = names.iter().map(String::as_str).collect();
    list.extend(["a", "c"]);
    let d2 = valid(&mesh(&list, ""), &[]);
    let a2 = allocate(&d2, &a1).unwrap();
    for n in ["a", "c"] {
        assert_eq!(a1.ipv4[n], a2.ipv4[n]);
        assert_eq!(a1.ipv6[n], a2.ipv6[n]);
    }
}

#[test]
fn a_new_pin_takes_its_address_and_the_previous_holder_moves() {
    let d1 = valid(&mesh(&["a", "b"], ""), &[]);
    let a1 = allocate(&d1, &Allocation::default()).unwrap();
    let taken = a1.ipv4["a"];
    let d2 = valid(&mesh(&["a"], &format!("[[node]]\nname = \"b\"\naddress_ipv4 = \"{taken}\"\n")), &[]);
    let a2 = allocate(&d2, &a1).unwrap();
    assert_eq!(a2.ipv4["b"], taken);
    assert_ne!(a2.ipv4["a"], taken);
}

#[test]
fn a_full_pool_uses_every_usable_address_and_never_the_network_or_broadcast() {
    let names: Vec<String> = (0..254).map(|i| format!("n{i}")).collect();
    let list: Vec<&str> = names.iter().map(String::as_str).collect();
    let d = valid(&mesh(&list, ""), &[]);
    let a = allocate(&d, &Allocation::default()).unwrap();
    let mut got: Vec<u8> = a.ipv4.values().map(|ip| ip.octets()[3]).collect();
    got.sort_unstable();
    assert_eq!(got, (1..=254).collect::<Vec<u8>>());
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 200, .. Default::default() })]

    /// Allocating by difference (`allocate_after`: nodes joined or left, the others the same)
    /// gives what allocating every node gives, in a small pool (30 addresses) where new nodes probe past taken
    /// slots: nodes added with and without pins (a pin taken by another node too), removed,
    /// declared anew under the same name, or removed and added back.
    #[test]
    fn an_allocation_by_difference_is_the_whole_allocation(
        steps in proptest::collection::vec((0u8..5, 0usize..64, 0u8..70), 1..12),
    ) {
        use std::sync::Arc;
        use trellis_core::allocate_after;
        let names: Vec<String> = (0..16).map(|i| format!("n{i}")).collect();
        let list: Vec<&str> = names.iter().map(String::as_str).collect();
        let small = "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"10.88.0.0/27\"\noverlay_ipv6 = \"fd88::/123\"\n";
        let mut text = small.to_string();
        for n in &list {
            text.push_str(&format!("[[node]]\nname = \"{n}\"\n"));
        }
        let mut d = valid(&text, &[]);
        let mut alloc = allocate(&d, &Allocation::default()).unwrap();
        let mut added = 0;
        for (kind, at, pin) in steps {
            let was = d.clone();
            let n = d.nodes.len();
            match kind {
                // Nodes join, one pinned or up to three not (a pin may be another node's
                // address); their names sort in another order than they are declared.
                0 | 1 => {
                    for i in 0..if kind == 0 { 1 + pin % 3 } else { 1 } {
                        let mut node = trellis_core::decl::Node::clone(&d.nodes[at % n]);
                        node.name = format!("new{}", 99 - added - i);
                        node.address_ipv4 = (kind == 1).then(|| std::net::Ipv4Addr::new(10, 88, 0, 1 + pin % 30));
                        node.address_ipv6 = None;
                        d.nodes.push(Arc::new(node));
                    }
                    added += 3;
                }
                // A node leaves, and another may join in the same change (into a slot it freed).
                2 if n > 1 => {
                    let node = d.nodes.remove(at % n);
                    if pin % 2 == 0 {
                        let mut node = trellis_core::decl::Node::clone(&node);
                        node.name = format!("new{}", 99 - added);
                        added += 3;
                        d.nodes.push(Arc::new(node));
                    }
                }
                // Declared anew under its name (another `Arc`).
                3 => {
                    let node = trellis_core::decl::Node::clone(&d.nodes[at % n]);
                    d.nodes[at % n] = Arc::new(node);
                }
                // Left, and back under the same name.
                _ => {
                    let node = trellis_core::decl::Node::clone(&d.nodes[at % n]);
                    d.nodes.remove(at % n);
                    d.nodes.push(Arc::new(node));
                }
            }
            let whole = allocate(&d, &alloc);
            let by_difference = allocate_after(&d, &was, alloc.clone());
            proptest::prop_assert_eq!(by_difference.as_ref().map_err(|e| e.to_string()), whole.as_ref().map_err(|e| e.to_string()));
            match whole {
                Ok(a) => alloc = a,
                Err(_) => d = was,
            }
        }
    }
}
