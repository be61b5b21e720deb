//! Direct paths through a hub (ADR 0032): which relayed pairs try, at the endpoints the hub
//! observed, and `paths.toml` as written and read back.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use proptest::prelude::*;
use trellis_core::decl::PublicKey;
use trellis_core::paths::{self, Observed, Standing, Why, ATTEMPTS_PER_HUB};
use trellis_core::{Compiled, Declaration, Keys};

use crate::support::valid;

const PING: &str = "[module]\nname = \"ping\"\n[[allow]]\nproto = \"icmp\"\nfrom = [\"mesh\"]\n";

/// A hub on the internet and `n` nodes behind NATs, each on a network of its own, none with an
/// endpoint: every pair of them is relayed by hub-1. `extra` is added to the mesh file.
fn mesh(n: usize, extra: &str) -> Declaration {
    let mut s = String::from(
        "[mesh]\nname = \"m\"\ndomain = \"m.mesh\"\noverlay_ipv4 = \"10.77.0.0/16\"\n[networks]\ninternet = {}\nmetered = { direct = false }\n",
    );
    for i in 0..n {
        s.push_str(&format!("isp-{i} = {{}}\n"));
    }
    s.push_str("[[node]]\nname = \"hub-1\"\nhub = true\nnetworks = [\"internet\"]\nmodules = [\"ping\"]\n  [[node.endpoint]]\n  address = \"198.51.100.10:51820\"\n  reachable_from = [\"internet\"");
    for i in 0..n {
        s.push_str(&format!(", \"isp-{i}\""));
    }
    s.push_str(", \"metered\"]\n");
    for i in 0..n {
        s.push_str(&format!("[[node]]\nname = \"n-{i:03}\"\nnetworks = [\"isp-{i}\"]\nmodules = [\"ping\"]\n"));
    }
    s.push_str(extra);
    valid(&s, &[("ping.toml", PING)])
}

fn keys(decl: &Declaration) -> Keys {
    let mut keys = Keys::default();
    keys.replace(decl.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), PublicKey([i as u8 + 1; 32]))));
    keys
}

fn compile(decl: &Declaration, keys: &Keys) -> Compiled {
    trellis_core::compile(&Arc::new(decl.clone()), keys, &Default::default(), None).expect("compiles")
}

fn at(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// hub-1 observed every node at 203.0.113.N:4000+N.
fn seen_all(decl: &Declaration) -> Observed {
    let nodes =
        decl.nodes.iter().filter(|n| !n.hub).enumerate().map(|(i, n)| (n.name.clone(), at(&format!("203.0.113.{}:{}", i + 1, 4000 + i))));
    Observed { by_hub: HashMap::from([("hub-1".to_string(), nodes.collect())]) }
}

/// Each side of a relayed pair the hub observed gets the other at the endpoint the hub saw, with
/// its key, its hub and its overlay addresses; written and read back, the file is the same.
#[test]
fn each_side_gets_the_endpoint_the_hub_saw_for_the_other() {
    let decl = mesh(2, "");
    let keys = keys(&decl);
    let compiled = compile(&decl, &keys);
    let decided =
        paths::decide(&compiled, &keys, &decl, &seen_all(&decl), &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
    let pairs = decided.relayed.all(compiled.plans());
    assert_eq!(pairs.len(), 1, "{pairs:?}");
    assert_eq!(pairs, decided.relayed.ranked, "the hub saw both: the pair is ranked");
    assert_eq!(pairs[0].decision, Ok((at("203.0.113.1:4000"), at("203.0.113.2:4001"))));
    let a = &decided.candidates["n-000"];
    assert_eq!(a.len(), 1);
    assert_eq!((a[0].peer.as_str(), a[0].endpoint, a[0].hub.as_str()), ("n-001", at("203.0.113.2:4001"), "hub-1"));
    assert_eq!(a[0].public_key, keys.get("n-001").unwrap());
    assert_eq!(a[0].hub_key, keys.get("hub-1").unwrap());
    let ip = compiled.nodes["n-001"].plan.ipv4.unwrap();
    assert_eq!(a[0].allowed_ips, [format!("{ip}/32")]);
    assert_eq!(decided.candidates["n-001"][0].endpoint, at("203.0.113.1:4000"));
    let text = paths::write("n-000", a);
    assert_eq!(paths::parse(&text).unwrap(), *a);
    assert!(!decided.candidates.contains_key("hub-1"), "a hub dials nobody through itself");
}

/// What the hub did not see, `direct = false` on a node or its network, and a NAT two hubs saw
/// with different ports each keep a pair on its hub, with the reason.
#[test]
fn a_pair_stays_on_its_hub_and_says_why() {
    let extra = "[[node]]\nname = \"off-1\"\ndirect = false\nnetworks = [\"isp-0\"]\nmodules = [\"ping\"]\n\
                 [[node]]\nname = \"phone-1\"\nnetworks = [\"metered\"]\nmodules = [\"ping\"]\n";
    let decl = mesh(3, extra);
    let keys = keys(&decl);
    let compiled = compile(&decl, &keys);
    let mut observed = seen_all(&decl);
    observed.by_hub.get_mut("hub-1").unwrap().remove("n-002");
    // A second hub saw n-001 at another port of the same address.
    let seen = observed.by_hub["hub-1"]["n-001"];
    observed.by_hub.insert("hub-2".into(), HashMap::from([("n-001".to_string(), SocketAddr::new(seen.ip(), seen.port() + 517))]));
    let decided = paths::decide(&compiled, &keys, &decl, &observed, &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
    let pairs = decided.relayed.all(compiled.plans());
    let why = |a: &str, b: &str| pairs.iter().find(|p| *p.a == *a && *p.b == *b).map(|p| p.decision.clone()).expect("a relayed pair");
    assert_eq!(why("n-000", "off-1"), Err(Why::Off { node: "off-1".into(), network: None }));
    let plan_of = |n: &str| compiled.nodes.get(n).map(|o| &*o.plan);
    for p in &pairs {
        assert_eq!(decided.relayed.pair(plan_of, &p.b, &p.a, &p.hub).as_ref(), Some(p), "looked up alone");
    }
    assert_eq!(why("n-000", "phone-1"), Err(Why::Off { node: "phone-1".into(), network: Some("metered".into()) }));
    assert_eq!(why("n-000", "n-002"), Err(Why::NotSeen { node: "n-002".into() }));
    let Err(Why::ByDestination { node, ports }) = why("n-000", "n-001") else { panic!("{:?}", why("n-000", "n-001")) };
    assert_eq!((node.as_str(), ports), ("n-001", vec![seen.port(), seen.port() + 517]));
    assert!(decided.candidates.is_empty(), "{:?}", decided.candidates);
    // Two nodes the hub saw behind one address stay on it too.
    let mut observed = seen_all(&decl);
    let hub = observed.by_hub.get_mut("hub-1").unwrap();
    let one = hub["n-000"].ip();
    hub.insert("n-001".into(), SocketAddr::new(one, 60_001));
    let decided = paths::decide(&compiled, &keys, &decl, &observed, &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
    let pairs = decided.relayed.all(compiled.plans());
    let pair = pairs.iter().find(|p| (&*p.a, &*p.b) == ("n-000", "n-001")).unwrap();
    assert_eq!(pair.decision, Err(Why::OneAddress { ip: one }));
    assert!(pairs.iter().any(|p| &*p.a == "n-000" && &*p.b == "n-002" && p.decision.is_ok()));
    assert_eq!(
        Why::ByDestination { node: "b-1".into(), ports: vec![40001, 40517] }.to_string(),
        "b-1's NAT maps by destination (hubs saw ports 40001 and 40517)"
    );
}

/// A burst behind one hub starts at most `ATTEMPTS_PER_HUB` attempts; pairs already direct keep
/// their candidates whatever the count, and pairs that keep failing give their places up first.
#[test]
fn attempts_per_hub_are_capped() {
    let decl = mesh(24, "");
    let keys = keys(&decl);
    let compiled = compile(&decl, &keys);
    let observed = seen_all(&decl);
    let all = paths::decide(&compiled, &keys, &decl, &observed, &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
    assert_eq!(all.relayed.len(), 24 * 23 / 2);
    let trying = |d: &paths::Decided| d.relayed.ranked.iter().filter(|p| p.decision.is_ok()).count();
    assert_eq!(trying(&all), ATTEMPTS_PER_HUB);
    let pairs = all.relayed.all(compiled.plans());
    assert_eq!(pairs.iter().filter(|p| p.decision == Err(Why::Capped)).count(), 276 - ATTEMPTS_PER_HUB);
    // The last pair in name order waited; once it is direct it keeps its place, and a failing
    // pair gives its place to a waiting one.
    let last = pairs.last().unwrap().clone();
    assert_eq!(last.decision, Err(Why::Capped));
    let first = pairs[0].clone();
    let standing = |a: &str, b: &str| match (a, b) {
        _ if (a, b) == (&*last.a, &*last.b) => Standing::Direct,
        _ if (a, b) == (&*first.a, &*first.b) => Standing::Failing,
        _ => Standing::Unknown,
    };
    let again = paths::decide(&compiled, &keys, &decl, &observed, &standing, &HashMap::new(), &mut Default::default());
    let of = |a: &str, b: &str| again.relayed.ranked.iter().find(|p| *p.a == *a && *p.b == *b).unwrap().decision.clone();
    assert!(of(&last.a, &last.b).is_ok());
    assert_eq!(of(&first.a, &first.b), Err(Why::Capped));
    assert_eq!(trying(&again), ATTEMPTS_PER_HUB + 1, "the direct pair does not count against the cap");
}

/// Keys other than those written, values of the wrong kind and keys that are not WireGuard keys
/// are refused with a sentence naming them.
#[test]
fn a_paths_file_with_anything_else_is_refused() {
    let good = "[[peer]]\nname = \"b\"\npublic_key = \"AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=\"\nendpoint = \"203.0.113.2:4001\"\nhub = \"hub-1\"\nhub_key = \"AgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgI=\"\nallowed_ips = [\"10.77.0.3/32\"]\n";
    assert_eq!(paths::parse(good).unwrap().len(), 1);
    assert_eq!(paths::parse("").unwrap(), []);
    for (bad, says) in [
        (good.replace("name = \"b\"", "name = \"b\"\nextra = 1"), "unknown key `extra`"),
        (good.replace("203.0.113.2:4001", "somewhere"), "`endpoint` is not IP:PORT"),
        (good.replace("AQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQEBAQE=", "short"), "`public_key` is not a WireGuard public key"),
        (good.replace("10.77.0.3/32", "ten"), "`allowed_ips` holds something that is not a prefix"),
        (format!("peers = 1\n{good}"), "unknown key `peers`"),
    ] {
        let e = paths::parse(&bad).unwrap_err();
        assert!(e.contains(says), "{e}");
    }
}

/// A pair both sides say is direct keeps its endpoints when the hub stops seeing a side; one
/// that is only trying loses them.
#[test]
fn a_direct_pair_outlives_its_hub_losing_sight_of_a_side() {
    let decl = mesh(2, "");
    let keys = keys(&decl);
    let compiled = compile(&decl, &keys);
    let first =
        paths::decide(&compiled, &keys, &decl, &seen_all(&decl), &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
    let last = first.endpoints();
    let mut observed = seen_all(&decl);
    observed.by_hub.get_mut("hub-1").unwrap().remove("n-001");
    let direct = paths::decide(&compiled, &keys, &decl, &observed, &|_, _| Standing::Direct, &last, &mut Default::default());
    assert_eq!(direct.relayed.all(compiled.plans())[0].decision, first.relayed.all(compiled.plans())[0].decision);
    assert_eq!(direct.candidates, first.candidates);
    let trying = paths::decide(&compiled, &keys, &decl, &observed, &|_, _| Standing::Unknown, &last, &mut Default::default());
    assert_eq!(trying.relayed.all(compiled.plans())[0].decision, Err(Why::NotSeen { node: "n-001".into() }));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// For any mesh behind one hub and any set of nodes the hub observed: a pair has candidates
    /// exactly when the hub saw both (and the cap leaves room), symmetrically, each side at the
    /// endpoint the hub saw for the other; no node is ever a candidate at an endpoint no hub
    /// observed.
    #[test]
    fn candidates_are_what_the_hub_saw_and_nothing_else(n in 2usize..9, seen in proptest::collection::vec(any::<bool>(), 9)) {
        let decl = mesh(n, "");
        let keys = keys(&decl);
        let compiled = compile(&decl, &keys);
        let mut observed = seen_all(&decl);
        observed.by_hub.get_mut("hub-1").unwrap().retain(|node, _| seen[node[2..].parse::<usize>().unwrap()]);
        let decided = paths::decide(&compiled, &keys, &decl, &observed, &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
        let hub = &observed.by_hub["hub-1"];
        let pairs = decided.relayed.all(compiled.plans());
        // Every pair of nodes behind the hub, each once, in (a, b, hub) order: status and the
        // next run read them so. The ranked ones are those the hub saw both sides of, and the
        // count of the others is the rest.
        prop_assert_eq!(pairs.len(), n * (n - 1) / 2);
        prop_assert_eq!(decided.relayed.len(), pairs.len());
        for w in pairs.windows(2) {
            prop_assert!((&w[0].a, &w[0].b, &w[0].hub) < (&w[1].a, &w[1].b, &w[1].hub), "{:?} before {:?}", (&w[0].a, &w[0].b), (&w[1].a, &w[1].b));
        }
        // Each pair looked up alone (the picture's links) is the pair listed, from either side;
        // a pair of a node with itself, or through a node that is no hub, is none.
        let plan_of = |n: &str| compiled.nodes.get(n).map(|o| &*o.plan);
        for p in &pairs {
            prop_assert_eq!(decided.relayed.pair(plan_of, &p.a, &p.b, &p.hub), Some(p.clone()));
            prop_assert_eq!(decided.relayed.pair(plan_of, &p.b, &p.a, &p.hub), Some(p.clone()));
            prop_assert_eq!(decided.relayed.pair(plan_of, &p.a, &p.b, &p.a), None);
        }
        prop_assert_eq!(decided.relayed.pair(plan_of, "n-000", "n-000", "hub-1"), None);
        let ranked: Vec<_> = pairs.iter().filter(|p| hub.contains_key(&*p.a) && hub.contains_key(&*p.b)).cloned().collect();
        prop_assert_eq!(&ranked, &decided.relayed.ranked);
        for p in &pairs {
            let both = hub.contains_key(&*p.a) && hub.contains_key(&*p.b);
            if !both {
                let unseen = if hub.contains_key(&*p.a) { &p.b } else { &p.a };
                prop_assert_eq!(&p.decision, &Err(Why::NotSeen { node: unseen.clone() }));
            }
            prop_assert_eq!(p.decision.is_ok(), both);
            let has = |x: &str, y: &str| decided.candidates.get(x).is_some_and(|l| l.iter().any(|c| c.peer == y && c.endpoint == hub[y]));
            prop_assert_eq!(has(&p.a, &p.b), both);
            prop_assert_eq!(has(&p.b, &p.a), both);
        }
        for list in decided.candidates.values() {
            for c in list {
                prop_assert_eq!(Some(&c.endpoint), hub.get(&c.peer));
            }
        }
    }
}

/// A publish run counts the relayed pairs from the counts of the compile before, counting again
/// only the plans a recompile rendered: through a key that goes, one that comes back, nodes
/// added and one removed, what it decides is what a decision afresh over a full compile says.
#[test]
fn pairs_counted_from_the_compile_before_are_the_pairs_counted_afresh() {
    // Two groups behind one hub, each reaching only its own: a change in one renders its plans
    // and the hub's, not the other group's.
    let groups = |n: usize| {
        let mut s = String::from("[mesh]\nname = \"m\"\ndomain = \"m.mesh\"\noverlay_ipv4 = \"10.77.0.0/16\"\n[groups]\nga = []\ngb = []\n[networks]\ninternet = {}\n");
        for i in 0..n {
            s.push_str(&format!("isp-{i} = {{}}\n"));
        }
        let reach: Vec<String> = (0..n).map(|i| format!("\"isp-{i}\"")).collect();
        s.push_str(&format!("[[node]]\nname = \"hub-1\"\nhub = true\nnetworks = [\"internet\"]\n  [[node.endpoint]]\n  address = \"198.51.100.10:51820\"\n  reachable_from = [{}]\n", reach.join(", ")));
        for i in 0..n {
            let g = if i % 2 == 0 { "a" } else { "b" };
            s.push_str(&format!("[[node]]\nname = \"n-{i:03}\"\nnetworks = [\"isp-{i}\"]\ngroups = [\"g{g}\"]\nmodules = [\"{g}\"]\n"));
        }
        let module = |m: &str| format!("[module]\nname = \"{m}\"\n[[allow]]\nproto = \"icmp\"\nfrom = [\"group:g{m}\"]\n");
        valid(&s, &[("a.toml", &module("a")), ("b.toml", &module("b"))])
    };
    let (small, large) = (groups(6), groups(9));
    let mut keys = keys(&large);
    let mut counts = paths::PairCounts::default();
    let mut previous: Option<Compiled> = None;
    let mut rendered = Vec::new();
    // Each step's declaration, and a key set (or taken away) before it.
    type Step<'d> = (&'d Declaration, Option<(&'static str, Option<PublicKey>)>);
    let steps: Vec<Step> = vec![
        (&small, None),
        (&small, Some(("n-002", None))),
        (&small, Some(("n-002", Some(PublicKey([0x42; 32]))))),
        (&large, None),
        (&small, Some(("n-004", None))),
        (&small, None),
    ];
    for (step, (decl, key)) in steps.into_iter().enumerate() {
        if let Some((name, k)) = key {
            keys.set(name, k);
        }
        let d = Arc::new(decl.clone());
        let allocation = previous.as_ref().map(|p| p.allocation.clone()).unwrap_or_default();
        let compiled = trellis_core::compile(&d, &keys, &allocation, previous.take()).expect("compiles");
        let observed = seen_all(decl);
        let counted = paths::decide(&compiled, &keys, decl, &observed, &|_, _| Standing::Unknown, &HashMap::new(), &mut counts);
        let full = trellis_core::compile(&d, &keys, &allocation, None).expect("compiles");
        let afresh = paths::decide(&full, &keys, decl, &observed, &|_, _| Standing::Unknown, &HashMap::new(), &mut Default::default());
        assert_eq!(counted, afresh, "step {step}");
        assert_eq!(counted.relayed.len(), afresh.relayed.all(full.plans()).len(), "step {step}");
        assert!(!counted.relayed.is_empty(), "step {step}: the hub relays pairs");
        rendered.push(compiled.rendered.len());
        previous = Some(compiled);
    }
    // The key changes render the plans of the node's group and the hub's only (3 of 7).
    assert_eq!(rendered[1..3], [3, 3], "{rendered:?}");
}
