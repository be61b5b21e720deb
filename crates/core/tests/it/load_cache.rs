//! A load through `LoadCache` (ADR 0034) is exactly a whole load: the same declaration, places
//! and diagnostics, for every lab mesh and for random edits of a mesh; and it does take the
//! unchanged node tables from the cache (it would be a slower whole load otherwise).

use proptest::prelude::*;
use trellis_core::load::{load_cached, LoadCache};
use trellis_core::{load, Loaded, SourceFile};

use crate::support::{lines, source};

#[track_caller]
fn same(cached: &Loaded, whole: &Loaded, what: &str) {
    assert_eq!(lines(&cached.diagnostics), lines(&whole.diagnostics), "{what}: diagnostics");
    assert_eq!(cached.declaration, whole.declaration, "{what}: declaration");
}

fn lab(name: &str) -> (SourceFile, Vec<SourceFile>) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab").join(name);
    let mesh = source("mesh.toml", &std::fs::read_to_string(dir.join("mesh.toml")).unwrap());
    let mut modules: Vec<SourceFile> = std::fs::read_dir(dir.join("modules"))
        .map(|d| d.map(|e| e.unwrap().path()).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .map(|p| source(&format!("modules/{}", p.file_name().unwrap().to_string_lossy()), &std::fs::read_to_string(&p).unwrap()))
        .collect();
    modules.sort_by(|a, b| a.path.cmp(&b.path));
    (mesh, modules)
}

#[test]
fn every_lab_mesh_loads_the_same_through_the_cache_and_the_second_load_parses_no_node() {
    let labs: Vec<String> = std::fs::read_dir(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("mesh.toml").is_file())
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert!(labs.len() >= 10, "{labs:?}");
    for name in labs {
        let (mesh, modules) = lab(&name);
        let whole = load(&mesh, &modules);
        let nodes = whole.declaration.as_ref().unwrap().nodes.len();
        let mut cache = LoadCache::default();
        same(&load_cached(&mesh, &modules, &mut cache), &whole, &name);
        assert_eq!((cache.hits, cache.parsed, cache.whole), (0, nodes, 0), "{name}: the first load parses every node alone");
        same(&load_cached(&mesh, &modules, &mut cache), &whole, &name);
        assert_eq!((cache.hits, cache.parsed, cache.whole), (nodes, nodes, 0), "{name}: the second takes every node from the cache");
    }
}

/// A mesh of `n` nodes as `trellis-dev mesh` writes one: nodes with endpoints and groups.
fn mesh(n: usize) -> String {
    let mut t = String::from("# a mesh\n[mesh]\nname = \"m\"\ndomain = \"m.mesh\"\noverlay_ipv4 = \"10.64.0.0/16\"\n\n[networks]\nlan = {}\nwan = {}\n\n[groups]\n");
    for g in 0..3 {
        let members: Vec<String> = (0..n).filter(|i| i % 3 == g).map(|i| format!("\"n{i}\"")).collect();
        t.push_str(&format!("g{g} = [{}]\n", members.join(", ")));
    }
    for i in 0..n {
        t.push_str(&format!("\n[[node]]\nname = \"n{i}\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n"));
        if i % 2 == 0 {
            t.push_str(&format!("[[node.endpoint]]\naddress = \"192.0.2.{}:51820\"\nreachable_from = [\"lan\"]\n", i % 250 + 1));
        }
    }
    t
}

const WEB: &str = "[module]\nname = \"web\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"443\"]\nfrom = [\"group:g0\"]\n";

/// One edit of a mesh's text, as an operator makes them.
#[derive(Clone, Debug)]
enum Edit {
    /// A line inserted after line `at` (lines below move down).
    Insert(usize, &'static str),
    /// Line `at` removed.
    Remove(usize),
    /// `old` replaced by `new` at its `nth` occurrence.
    Replace(&'static str, &'static str, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (
            0..400usize,
            proptest::sample::select(vec![
                "# a comment",
                "",
                "[[node]]\nname = \"new\"\nnetworks = [\"wan\"]",
                "x = \"\"\"\n[[node]]\n\"\"\"",
                "hub = true",
                "[[node.endpoint]]\naddress = \"198.51.100.1:51820\"\nreachable_from = [\"wan\"]",
                "modules = [\"web\", \"nope\"]",
                "unknown = 1",
                "[[test]]\nfrom = \"node:n1\"\nto = \"node:n0\"\nproto = \"tcp\"\nport = 443\nexpect = \"allow\"",
                "name = \"dup\"",
                "[groups.x]",
                "[[node]",
                "gx = [\"n1\", \"n2\"] # one line",
                "g0 = [\"n1\"]",
                "g7 = [1]",
                "\"g q\" = [\"n1\"]",
                "a.b = [\"n1\"]",
                "g8 = [\"n1\",\n\"n2\"]",
                "[groups]",
            ])
        )
            .prop_map(|(at, l)| Edit::Insert(at, l)),
        (0..400usize).prop_map(Edit::Remove),
        (
            proptest::sample::select(vec![
                ("\"n1\"", "\"n2\""),
                ("lan", "wan"),
                ("\"n3\", ", ""),
                ("g1 = [", "g1 = [\"n4\", "),
                ("51820", "51821"),
                ("[[node]]", "[[node]] # x"),
                ("g2 = ", "g0 = "),
                ("g1 = ", "  g1  =  "),
                ("[groups]", "[groups] # the groups")
            ]),
            0..5usize
        )
            .prop_map(|((a, b), nth)| Edit::Replace(a, b, nth)),
    ]
}

fn apply(text: &str, e: &Edit) -> String {
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    match e {
        Edit::Insert(at, l) => lines.insert((*at).min(lines.len()), l.to_string()),
        Edit::Remove(at) if *at < lines.len() => drop(lines.remove(*at)),
        Edit::Remove(_) => {}
        Edit::Replace(a, b, nth) => {
            if let Some((i, _)) = text.match_indices(a).nth(*nth) {
                return format!("{}{b}{}", &text[..i], &text[i + a.len()..]);
            }
        }
    }
    lines.join("\n") + "\n"
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Each text of a sequence of edits loads through one cache (warm with the text before)
    /// exactly as it loads whole; unchanged node tables are taken from the cache.
    #[test]
    fn edits_load_through_the_cache_as_they_load_whole(n in 4..24usize, edits in proptest::collection::vec(edit(), 1..6)) {
        let modules = vec![source("modules/web.toml", WEB)];
        let mut cache = LoadCache::default();
        let mut text = mesh(n);
        let first = load(&source("mesh.toml", &text), &modules);
        let cached = load_cached(&source("mesh.toml", &text), &modules, &mut cache);
        prop_assert_eq!(lines(&cached.diagnostics), lines(&first.diagnostics));
        prop_assert_eq!(&cached.declaration, &first.declaration);
        prop_assert_eq!(cache.parsed, n, "the generated mesh is cut");
        for e in &edits {
            text = apply(&text, e);
            let (hits, whole_parses) = (cache.hits, cache.whole);
            let whole = load(&source("mesh.toml", &text), &modules);
            let cached = load_cached(&source("mesh.toml", &text), &modules, &mut cache);
            prop_assert_eq!(lines(&cached.diagnostics), lines(&whole.diagnostics), "after {:?}:\n{}", e, text);
            prop_assert_eq!(&cached.declaration, &whole.declaration, "after {:?}:\n{}", e, text);
            // A cut load that had node tables from before took them from the cache.
            if cache.whole == whole_parses && whole.diagnostics.is_empty() {
                prop_assert!(cache.hits > hits || whole.declaration.as_ref().is_none_or(|d| d.nodes.len() <= 1), "after {:?}: nothing from the cache", e);
            }
        }
    }
}

/// A node whose table did not change is not checked again only while what its checks read is
/// the same: a network, a module or the overlay changed under it brings its errors back.
#[test]
fn an_unchanged_node_is_checked_again_when_what_it_names_changes() {
    let web = vec![source("modules/web.toml", WEB)];
    let text = mesh(6);
    let mut cache = LoadCache::default();
    for (text, modules, what) in [
        (text.clone(), web.clone(), "the mesh"),
        (text.replace("lan = {}\n", ""), web.clone(), "network lan gone"),
        (text.clone(), web.clone(), "the mesh again"),
        (text.clone(), Vec::new(), "module web gone"),
        (text.replace("10.64.0.0/16", "192.0.2.0/24"), web.clone(), "endpoints inside the overlay"),
    ] {
        let whole = load(&source("mesh.toml", &text), &modules);
        let parsed = cache.parsed;
        same(&load_cached(&source("mesh.toml", &text), &modules, &mut cache), &whole, what);
        assert_eq!(cache.parsed, parsed + if what == "the mesh" { 6 } else { 0 }, "{what}: node tables parsed");
        assert_eq!(whole.errors().next().is_none(), what.starts_with("the mesh"), "{what}: {:?}", lines(&whole.diagnostics));
    }
}

/// The nodes' names are kept by the cache as tables come and go: a node gone, renamed, given
/// twice or named badly is reported as a whole load reports it.
#[test]
fn the_names_kept_follow_the_tables_that_come_and_go() {
    let modules = vec![source("modules/web.toml", WEB)];
    let text = mesh(6);
    let n1 = "[[node]]\nname = \"n1\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n";
    let n5 = "[[node]]\nname = \"n5\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n";
    assert!(text.contains(n1) && text.ends_with(n5));
    let mut cache = LoadCache::default();
    for (text, what, errors) in [
        (text.clone(), "the mesh", false),
        (text.clone(), "the mesh again", false),
        (text.replace(n5, ""), "n5 gone while g2 lists it", true),
        (text.clone(), "the mesh", false),
        (text.replace("name = \"n5\"", "name = \"n7\""), "n5 renamed", true),
        (text.clone(), "the mesh", false),
        // The copy of the same text as the first (its blank line after it too): both are taken
        // from the cache as the one table held.
        (format!("{text}\n{n1}\n"), "n1 given twice", true),
        (text.clone(), "the mesh", false),
        (text.replace("name = \"n5\"", "name = \"N_5\""), "a name that is no DNS label", true),
        (text.clone(), "the mesh", false),
        (format!("{text}\n[[node]]\nname = \"n9\"\nnetworks = [\"lan\"]\n"), "a node added", false),
        (format!("{text}\n[[node]]\nname = \"n9\"\nnetworks = [\"lan\"]\n[[route]]\nname = \"r\"\nprefixes = [\"10.9.0.0/16\"]\nvia = [\"n9\"]\n"), "a route via the node added", false),
    ] {
        let whole = load(&source("mesh.toml", &text), &modules);
        same(&load_cached(&source("mesh.toml", &text), &modules, &mut cache), &whole, what);
        assert_eq!(whole.errors().next().is_some(), errors, "{what}: {:?}", lines(&whole.diagnostics));
    }
}

/// An index by name made from the one before finds what an index made whole finds, and shares
/// the maps only when every node stands where it stood with the same name and key.
#[test]
fn an_index_made_from_the_one_before_finds_what_a_whole_one_finds() {
    use std::sync::Arc;
    use trellis_core::decl::Indexed;
    let modules = vec![source("modules/web.toml", WEB)];
    let text = mesh(6);
    let mut cache = LoadCache::default();
    let mut load = |text: &str| Arc::new(load_cached(&source("mesh.toml", text), &modules, &mut cache).declaration.expect("loads"));
    let mut before = Indexed::new(load(&text));
    let n1 = "[[node]]\nname = \"n1\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n";
    let n3 = "[[node]]\nname = \"n3\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\n";
    for (text, shared) in [
        (text.replace("g0 = [\"n0\", ", "g0 = [").replace("g1 = [", "g1 = [\"n0\", "), true),
        (
            text.replace(
                "[[node]]\nname = \"n1\"",
                "[[node]]\npublic_key = \"AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\"\nname = \"n1\"",
            ),
            false,
        ),
        (text.clone(), false),
        (text.replace(n1, "@").replace(n3, n1).replace('@', n3), false),
        (text.replace("name = \"n5\"", "name = \"n7\"").replace("\"n5\"", "\"n7\""), false),
    ] {
        let decl = load(&text);
        let whole = Indexed::new(decl.clone());
        let after = Indexed::new_after(decl.clone(), &before);
        assert_eq!(after.shares_maps_with(&before), shared, "{text}");
        for n in &decl.nodes {
            assert_eq!(after.node(&n.name), whole.node(&n.name), "{}", n.name);
            if let Some(k) = &n.public_key {
                assert_eq!(after.declared_holder(k).map(|n| &n.name), whole.declared_holder(k).map(|n| &n.name));
            }
        }
        assert!(after.node("n5").is_some() == whole.node("n5").is_some() && after.node("n7").is_some() == whole.node("n7").is_some());
        before = after;
    }
}
