//! The rulesets the compiler writes, as the agent reads them back (`ruleset`): every node's
//! `nftables.conf` of a generated mesh reads, through any sequence of changes, and the commands
//! between a node's ruleset before and after a change take exactly the old sets to the new ones.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use proptest::prelude::*;
use trellis_core::plan::NFTABLES_CONF;
use trellis_core::ruleset::{delta, read, Ruleset, TABLE};
use trellis_core::{compile, Compiled, Keys};

use crate::incremental::{add_routes, apply, change};
use crate::props::{declaration, gen};

/// Each node's ruleset: `nftables.conf` and its parts one after the other (ADR 0044).
fn rulesets(c: &Compiled) -> BTreeMap<String, String> {
    c.nodes.iter().map(|(node, out)| (node.to_string(), joined(out))).collect()
}

/// A node's ruleset files one after the other.
fn joined(out: &trellis_core::compile::NodeOutput) -> String {
    let main = out.files.iter().find(|f| f.path == NFTABLES_CONF).expect("a ruleset");
    let mut parts: Vec<_> = out.files.iter().filter_map(|f| Some((trellis_core::plan::ruleset_part_index(&f.path)?, f))).collect();
    parts.sort_by_key(|(i, _)| *i);
    std::iter::once(main).chain(parts.into_iter().map(|(_, f)| f)).map(|f| f.content.to_string()).collect()
}

/// ADR 0044: a runner of a module open to a group of 3,500 dual-stack nodes has more than 64 KiB
/// of sources: its ruleset is `nftables.conf`, declaring the sets, and parts that add each
/// source's addresses in the part of its name. One after the other they are the ruleset of the
/// one file, set by set; each part holds only lines that add elements; and after a node leaves
/// the group, a recompile gives what a full compile gives, and the change between the two is
/// elements only.
#[test]
fn a_ruleset_in_parts_one_after_the_other_is_the_ruleset_of_one_file() {
    let keys = Keys::default();
    let before = compile(&crate::zones::grouped(3500, "a-1", 1420), &keys, &Default::default(), None).unwrap();
    let out = &before.nodes["a-0"];
    let parts: Vec<_> = out.files.iter().filter(|f| trellis_core::plan::ruleset_part_index(&f.path).is_some()).collect();
    assert!(parts.len() > 32, "a-0's ruleset is in parts: {}", parts.len());
    let text = joined(out);
    let one = trellis_core::render::nftables(&out.plan).to_string();
    assert_eq!(sets(&read(&text).expect("the parts read")), sets(&read(&one).unwrap()), "the sets' elements");
    assert_eq!(read(&text).unwrap().chains, read(&one).unwrap().chains, "the chains");
    // Each source's addresses are in the part of its name.
    let name_of: BTreeMap<String, &str> = out
        .plan
        .zone
        .iter()
        .flat_map(|z| [z.ipv4.map(|a| (a.to_string(), &*z.name)), z.ipv6.map(|a| (a.to_string(), &*z.name))])
        .flatten()
        .collect();
    for f in &parts {
        let i = trellis_core::plan::ruleset_part_index(&f.path).unwrap();
        let content = f.content.to_string();
        assert_eq!(trellis_core::ruleset::check_part(&content, &f.path), Ok(()));
        for line in content.lines().filter(|l| l.starts_with("add element")) {
            let list = line.split_once(" { ").unwrap().1.strip_suffix(" }").unwrap();
            for a in list.split(", ") {
                assert_eq!(usize::from(trellis_core::plan::part_of(name_of[a])), i, "{a} of {} in {}", name_of[a], f.path);
            }
        }
    }
    // A node that runs nothing has a ruleset of one file.
    assert!(before.nodes["n-00007"].files.iter().all(|f| trellis_core::plan::ruleset_part_index(&f.path).is_none()));

    let after = crate::zones::grouped(3499, "a-1", 1420);
    let full = compile(&after, &keys, &before.allocation, None).unwrap();
    let old = joined(&before.nodes["a-0"]);
    let allocation = before.allocation.clone();
    let inc = compile(&after, &keys, &allocation, Some(before)).unwrap();
    for (node, out) in &full.nodes {
        assert_eq!(inc.nodes[node].files, out.files, "{node}'s files");
    }
    let commands = delta(&old, &joined(&inc.nodes["a-0"])).expect("elements only");
    let elements: Vec<&str> = commands.lines().filter(|l| l.contains(" element ")).collect();
    assert_eq!(elements.len(), 2, "the node's v4 and v6 address deleted: {elements:?}");
    assert!(elements.iter().all(|l| l.starts_with(&format!("delete element {TABLE} src_ssh_1_"))), "{elements:?}");
}

/// Each set's elements, as a set.
fn sets(r: &Ruleset) -> BTreeMap<String, BTreeSet<String>> {
    r.sets.iter().map(|(name, elements)| (name.to_string(), elements.iter().map(|e| e.to_string()).collect())).collect()
}

/// What reading a rendered ruleset must give: the table's chains, every set a rule names
/// declared and every set declared named by a rule, and the same text again as no change of
/// elements, only its chains put back.
fn reads_back(node: &str, text: &str) -> Result<(), TestCaseError> {
    let Some(r) = read(text) else { return Err(TestCaseError::fail(format!("{node}'s ruleset does not read back:\n{text}"))) };
    let chains: Vec<&str> = r.chains.iter().map(|c| c.name).collect();
    prop_assert!(chains.starts_with(&["input", "forward"]), "{}: chains {:?}", node, chains);
    let declared: BTreeSet<&str> = r.sets.iter().map(|(name, _)| *name).collect();
    let named: BTreeSet<&str> =
        r.chains.iter().flat_map(|c| &c.rules).flat_map(|rule| rule.split('@').skip(1)).map(|s| s.split(' ').next().unwrap_or(s)).collect();
    prop_assert_eq!(&declared, &named, "{}: the sets declared and the sets the rules name\n{}", node, text);
    let same = delta(text, text).expect("a ruleset against itself");
    prop_assert!(!same.contains(" element "), "{}: the same text changes elements:\n{}", node, same);
    prop_assert_eq!(same.matches(&format!("flush chain {TABLE} ")).count(), r.chains.len(), "{}: every chain put back", node);
    Ok(())
}

/// The element commands of `commands`, applied to `sets`.
fn apply_elements(
    mut sets: BTreeMap<String, BTreeSet<String>>,
    commands: &str,
) -> Result<BTreeMap<String, BTreeSet<String>>, TestCaseError> {
    for line in commands.lines().filter(|l| l.contains(" element ")) {
        let (verb, rest) = line.split_once(&format!(" element {TABLE} ")).expect("an element command");
        let (name, elements) = rest.split_once(" { ").expect("a set and its elements");
        let set = sets.get_mut(name).expect("a declared set");
        for e in elements.strip_suffix(" }").expect("closed").split(", ") {
            match verb {
                "delete" => prop_assert!(set.remove(e), "{} deletes {} it does not hold", name, e),
                "create" => prop_assert!(set.insert(e.to_string()), "{} creates {} it holds", name, e),
                other => prop_assert!(false, "unknown command {}", other),
            }
        }
    }
    Ok(sets)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, .. ProptestConfig::default() })]

    /// Render, then read: each ruleset reads back, and between two compiles the agent either
    /// loads the new one whole (something besides elements differs) or changes exactly the
    /// elements that take each old set to the new one.
    #[test]
    fn every_rendered_ruleset_reads_back_and_its_changes_are_exactly_the_new_elements(g in gen(), routed in any::<bool>(), changes in proptest::collection::vec(change(), 1..6)) {
        let mut d = declaration(&g);
        if routed {
            add_routes(&mut d);
        }
        let mut keys = Keys::default();
        let mut prev = compile(&Arc::new(d.clone()), &keys, &Default::default(), None).unwrap();
        for (node, text) in rulesets(&prev) {
            reads_back(&node, &text)?;
        }
        let mut added = 0;
        for c in &changes {
            apply(&mut d, &mut keys, c, &mut added);
            let next = compile(&Arc::new(d.clone()), &keys, &prev.allocation, None).unwrap();
            let (before, after) = (rulesets(&prev), rulesets(&next));
            for (node, new) in &after {
                reads_back(node, new)?;
                let Some(old) = before.get(node) else { continue };
                let (o, n) = (read(old).expect("read above"), read(new).expect("read above"));
                let names = |r: &Ruleset| r.sets.iter().map(|(name, _)| name.to_string()).collect::<Vec<_>>();
                let only_elements = o.rest == n.rest && names(&o) == names(&n);
                let whole = delta(old, new);
                match &whole {
                    None => prop_assert!(!only_elements, "{}: {:?} differs only in elements, yet is loaded whole", node, c),
                    Some(commands) => {
                        prop_assert!(only_elements, "{}: {:?} changes more than elements, yet is patched:\n{}", node, c, commands);
                        prop_assert_eq!(apply_elements(sets(&o), commands)?, sets(&n), "{}: after {:?}", node, c);
                    }
                }
                // Read from the regions of the edits a delta carries (ADR 0035): the whole
                // read's commands, whenever it gives any.
                let edits = trellis_core::delta::edits(old.as_bytes(), new.as_bytes());
                let (built, hunks) = trellis_core::delta::rebuild_with_hunks(old.as_bytes(), &edits, new.len(), "nftables.conf").unwrap();
                prop_assert_eq!(&built[..], new.as_bytes());
                let chains = trellis_core::ruleset::chains(old).expect("a rendered ruleset lists each element once");
                if let Some(by_regions) = trellis_core::ruleset::delta_in(old, new, &hunks.expect("the controller's edits copy forward"), &chains) {
                    prop_assert_eq!(Some(by_regions), whole, "{}: after {:?}", node, c);
                }
            }
            prev = next;
        }
    }
}

/// A source renamed in place (pinned, so it keeps its address; between the same names, so it
/// keeps its position) in a change that makes every plan again (the MTU): its address is in the
/// part of its new name in the rule's sets (ADR 0044), as a full compile puts it, not kept in its
/// old name's part with the block before.
#[test]
fn a_source_renamed_in_place_has_its_address_in_its_new_name_s_part() {
    use std::fmt::Write;
    let (old, new) = ("s-1", "s-10");
    assert_ne!(trellis_core::plan::part_of(old), trellis_core::plan::part_of(new), "the names hash to other parts");
    let mesh = |source: &str, mtu: u16| {
        let mut mesh = format!(
            "[mesh]\nname = \"r\"\ndomain = \"r.mesh\"\noverlay_ipv4 = \"10.7.0.0/16\"\noverlay_ipv6 = \"fd07::/64\"\nmtu = {mtu}\n\n[networks]\nlan = {{}}\n\n[groups]\nall = [\"{source}\", {}]\n",
            (0..30).map(|i| format!("\"n-{i:02}\"")).collect::<Vec<_>>().join(", ")
        );
        let _ = write!(mesh, "\n[[node]]\nname = \"a-0\"\nnetworks = [\"lan\"]\nmodules = [\"ssh\"]\n");
        let _ = write!(
            mesh,
            "\n[[node]]\nname = \"{source}\"\nnetworks = [\"lan\"]\naddress_ipv4 = \"10.7.9.9\"\naddress_ipv6 = \"fd07::9:9\"\n"
        );
        for i in 0..30 {
            let _ = write!(mesh, "\n[[node]]\nname = \"n-{i:02}\"\nnetworks = [\"lan\"]\n");
        }
        let module = "[module]\nname = \"ssh\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"22\"]\nfrom = [\"group:all\"]\n";
        let loaded = crate::support::load_text(&mesh, &[("ssh.toml", module)]);
        Arc::new(loaded.declaration.expect("the mesh loads"))
    };
    let keys = Keys::default();
    let before = compile(&mesh(old, 1420), &keys, &Default::default(), None).unwrap();
    let after = mesh(new, 1380);
    let full = compile(&after, &keys, &before.allocation, None).unwrap();
    let allocation = before.allocation.clone();
    let inc = compile(&after, &keys, &allocation, Some(before)).unwrap();
    assert_eq!(inc.rule_blocks, full.rule_blocks, "the rule's sets have the parts of its sources' names");
    for (node, out) in &full.nodes {
        assert_eq!(inc.nodes[node].files, out.files, "{node}'s files");
    }
}
