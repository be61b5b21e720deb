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
