//! What changed between two rulesets trellis wrote, as nft commands: when they differ only in
//! the elements of named sets (a node came, went or was renumbered: the sources of the rules
//! that admit it), the change is those elements, deleted and created in one transaction, instead
//! of the whole table loaded again (ADR 0031). With ten thousand sources a one-source change
//! then costs what the change costs, not what the table does.

use std::collections::HashSet;

/// The table every trellis ruleset holds (`core::render::nftables`).
pub const TABLE: &str = "inet trellis";

/// A ruleset read as the lines that are not set elements, each named set's elements and each
/// chain's rules; `valid` is false for a text trellis does not write (a set's name or an element
/// that is no address or prefix, a rule with a `;`), which is then loaded whole, never pasted
/// into commands.
struct Shape<'a> {
    rest: Vec<&'a str>,
    sets: Vec<(&'a str, Vec<&'a str>)>,
    chains: Vec<Chain<'a>>,
    valid: bool,
}

/// A chain of the table: its base specification (`type ... policy ...;`) and its rules, as
/// written.
struct Chain<'a> {
    name: &'a str,
    spec: Option<&'a str>,
    rules: Vec<&'a str>,
}

/// A name trellis gives a set or a chain: lower-case letters, digits, `_` and the `-` of a
/// module's or route's name (a DNS label).
fn plain(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-')
}

fn shape(text: &str) -> Shape<'_> {
    let mut rest = Vec::new();
    let mut sets: Vec<(&str, Vec<&str>)> = Vec::new();
    let mut chains: Vec<Chain> = Vec::new();
    let mut valid = true;
    // Inside a set's or a chain's braces.
    let (mut in_set, mut in_chain) = (false, false);
    for line in text.lines() {
        if let Some(name) = line.strip_prefix("\tset ").and_then(|l| l.strip_suffix(" {")) {
            valid &= plain(name);
            sets.push((name, Vec::new()));
            in_set = true;
        } else if let Some(name) = line.strip_prefix("\tchain ").and_then(|l| l.strip_suffix(" {")) {
            valid &= plain(name);
            chains.push(Chain { name, spec: None, rules: Vec::new() });
            in_chain = true;
        } else if line == "\t}" {
            (in_set, in_chain) = (false, false);
        } else if in_set {
            if let Some(elements) = line.strip_prefix("\t\telements = { ").and_then(|l| l.strip_suffix(" }")) {
                let (_, list) = sets.last_mut().expect("a set is open");
                // Left out of the shape, so that a set gaining its first element or losing its
                // last (nft declares no empty list) changes its elements, not its shape.
                for e in elements.split(", ") {
                    valid &= e.parse::<std::net::IpAddr>().is_ok() || e.parse::<ipnet::IpNet>().is_ok();
                    list.push(e);
                }
                continue;
            }
        } else if in_chain {
            let chain = chains.last_mut().expect("a chain is open");
            match line.strip_prefix("\t\t") {
                Some(spec) if spec.starts_with("type ") => {
                    valid &= !spec.contains(['{', '}', '"', '#']);
                    chain.spec = Some(spec);
                }
                Some(comment) if comment.starts_with('#') => {}
                Some(rule) if !rule.trim().is_empty() => {
                    valid &= !rule.contains(';');
                    chain.rules.push(rule);
                }
                _ => {}
            }
        }
        rest.push(line);
    }
    Shape { rest, sets, chains, valid }
}

/// The nft commands that take a table loaded from `old` to `new`, if the two differ only in
/// sets' elements: each removed element deleted and each new one created (`create`, not `add`,
/// so that an element already there, like one deleted and not there, fails the transaction: a
/// table that is not what `old` says is loaded whole, never patched), then every chain put back
/// as `new` writes it (declared again, flushed, its rules added), so that rules taken out behind
/// the agent's back (`nft flush chain`, `flush ruleset`) are back after any apply, as after a
/// whole load; a table or set that is gone fails the transaction, and the file is loaded whole.
/// `None` when anything else differs, or when `new` is no text trellis writes.
pub fn delta(old: &str, new: &str) -> Option<String> {
    let (before, after) = (shape(old), shape(new));
    let same_shape = before.rest == after.rest
        && before.sets.len() == after.sets.len()
        && before.sets.iter().zip(&after.sets).all(|((a, _), (b, _))| a == b);
    if !same_shape || !before.valid || !after.valid {
        return None;
    }
    let mut commands = String::new();
    for ((name, was), (_, now)) in before.sets.iter().zip(&after.sets) {
        let was_set: HashSet<&str> = was.iter().copied().collect();
        let now_set: HashSet<&str> = now.iter().copied().collect();
        let gone: Vec<&str> = was.iter().copied().filter(|e| !now_set.contains(e)).collect();
        let came: Vec<&str> = now.iter().copied().filter(|e| !was_set.contains(e)).collect();
        if !gone.is_empty() {
            commands.push_str(&format!("delete element {TABLE} {name} {{ {} }}\n", gone.join(", ")));
        }
        if !came.is_empty() {
            commands.push_str(&format!("create element {TABLE} {name} {{ {} }}\n", came.join(", ")));
        }
    }
    for chain in &after.chains {
        let name = chain.name;
        match chain.spec {
            Some(spec) => commands.push_str(&format!("add chain {TABLE} {name} {{ {spec} }}\n")),
            None => commands.push_str(&format!("add chain {TABLE} {name}\n")),
        }
        commands.push_str(&format!("flush chain {TABLE} {name}\n"));
        for rule in &chain.rules {
            commands.push_str(&format!("add rule {TABLE} {name} {rule}\n"));
        }
    }
    Some(commands)
}

/// A digest of a table as `nft list table` prints it, each set's elements sorted: the kernel
/// lists a hash set in its own order, which may change with no change of elements. Two listings
/// of the same table have the same digest; an element, a rule or a chain added, taken out or
/// changed changes it.
pub fn digest(listing: &str) -> [u8; 32] {
    use sha2::{Digest, Sha256};
    let mut hash = Sha256::new();
    // Inside a set's element list, which nft wraps over lines.
    let mut elements: Option<Vec<&str>> = None;
    for line in listing.lines() {
        let rest = match elements {
            Some(_) => line,
            None => match line.trim_start().strip_prefix("elements = {") {
                Some(rest) => {
                    elements = Some(Vec::new());
                    rest
                }
                None => {
                    hash.update(line.as_bytes());
                    hash.update(b"\n");
                    continue;
                }
            },
        };
        let (part, closed) = rest.split_once('}').map_or((rest, false), |(part, _)| (part, true));
        let list = elements.as_mut().expect("a list is open");
        list.extend(part.split(',').map(str::trim).filter(|e| !e.is_empty()));
        if closed {
            let mut list = elements.take().expect("a list is open");
            list.sort_unstable();
            hash.update(format!("elements = {{ {} }}\n", list.join(", ")).as_bytes());
        }
    }
    hash.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::{delta, digest};

    #[test]
    fn a_listing_digest_changes_with_the_table_not_with_the_order_of_its_elements() {
        let listing = |elements: &str, extra: &str| {
            format!(
                "table inet trellis {{\n\tset src_ssh_1_v4 {{\n\t\ttype ipv4_addr\n\t\telements = {{ {elements} }}\n\t}}\n{extra}\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\t\tip saddr @src_ssh_1_v4 accept\n\t}}\n}}\n"
            )
        };
        let base = digest(&listing("10.0.0.1, 10.0.0.2,\n\t\t\t     10.0.0.3", ""));
        assert_eq!(digest(&listing("10.0.0.3, 10.0.0.1, 10.0.0.2", "")), base, "another order, other wrapping");
        assert_ne!(digest(&listing("10.0.0.1, 10.0.0.2, 10.0.0.3, 10.66.6.6", "")), base, "an element added");
        assert_ne!(digest(&listing("10.0.0.1, 10.0.0.2", "")), base, "an element taken out");
        let chain = "\tchain backdoor {\n\t\ttype filter hook input priority -10; policy accept;\n\t}\n";
        assert_ne!(digest(&listing("10.0.0.1, 10.0.0.2, 10.0.0.3", chain)), base, "a chain added");
        assert_ne!(digest(&listing("10.0.0.1, 10.0.0.2, 10.0.0.3", "").replace(" accept\n\t}", " drop\n\t}")), base, "a rule changed");
    }

    fn ruleset(v4: &[&str], v6: &[&str], port: u16) -> String {
        let set = |name: &str, kind: &str, e: &[&str]| {
            let elements = if e.is_empty() { String::new() } else { format!("\t\telements = {{ {} }}\n", e.join(", ")) };
            format!("\tset {name} {{\n\t\ttype {kind}\n{elements}\t}}\n")
        };
        format!(
            "# trellis\ntable inet trellis {{\n}}\ndelete table inet trellis\n\ntable inet trellis {{\n{}{}\n\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\t\tiifname \"trellis0\" ip saddr @src_ssh_1_v4 tcp dport {{ {port} }} accept\n\t\tiifname \"trellis0\" ip6 saddr @src_ssh_1_v6 tcp dport {{ {port} }} accept\n\t}}\n}}\n",
            set("src_ssh_1_v4", "ipv4_addr", v4),
            set("src_ssh_1_v6", "ipv6_addr", v6)
        )
    }

    /// The element commands of a delta, without the chains it puts back.
    fn elements(commands: &str) -> String {
        commands.lines().filter(|l| l.contains(" element ")).map(|l| format!("{l}\n")).collect()
    }

    /// The chains put back after the elements, as the new text writes them.
    const CHAINS_22: &str = "add chain inet trellis input { type filter hook input priority filter; policy accept; }\n\
        flush chain inet trellis input\n\
        add rule inet trellis input iifname \"trellis0\" ip saddr @src_ssh_1_v4 tcp dport { 22 } accept\n\
        add rule inet trellis input iifname \"trellis0\" ip6 saddr @src_ssh_1_v6 tcp dport { 22 } accept\n";

    #[test]
    fn a_change_of_sources_only_is_the_elements_deleted_and_created() {
        let old = ruleset(&["10.0.0.1", "10.0.0.2", "10.0.0.3"], &["fd00::1"], 22);
        let new = ruleset(&["10.0.0.1", "10.0.0.3", "10.0.0.4"], &["fd00::1"], 22);
        assert_eq!(
            delta(&old, &new).unwrap(),
            format!("delete element inet trellis src_ssh_1_v4 {{ 10.0.0.2 }}\ncreate element inet trellis src_ssh_1_v4 {{ 10.0.0.4 }}\n{CHAINS_22}")
        );
        // Nothing changed: the chains are put back all the same (rules flushed behind the
        // agent's back come back with any apply).
        assert_eq!(delta(&old, &old).unwrap(), CHAINS_22);
    }

    #[test]
    fn a_text_trellis_does_not_write_is_loaded_whole_never_pasted_into_commands() {
        let old = ruleset(&["10.0.0.1"], &["fd00::1"], 22);
        let injected =
            ruleset(&["10.0.0.1 } ; delete table inet other ; create element inet trellis src_ssh_1_v4 { 10.0.0.2"], &["fd00::1"], 22);
        assert_eq!(delta(&old, &injected), None, "an element that is no address");
        let rule = old.replace("tcp dport { 22 } accept\n\t\tiifname", "tcp dport { 22 } accept; delete table inet other\n\t\tiifname");
        assert_eq!(delta(&old, &rule), None, "a rule with a ;");
        let spec = old.replace("policy accept;", "policy accept; } ; delete table inet other ; add chain inet trellis input {");
        assert_eq!(delta(&old, &spec), None, "a chain's specification with braces");
        assert_eq!(delta(&old, &old.replace("src_ssh_1_v4", "src ssh")), None, "a set's name");
        assert!(delta(&old, &ruleset(&["10.0.0.0/24"], &["fd00::/64"], 22)).is_some(), "prefixes are elements");
        let hyphen = old.replace("src_ssh_1", "src_web-app_1");
        assert!(delta(&hyphen, &hyphen.replace("10.0.0.1", "10.0.0.2")).is_some(), "a module named with a hyphen");
    }

    #[test]
    fn a_set_losing_its_last_element_or_gaining_its_first_is_still_a_change_of_elements() {
        let old = ruleset(&["10.0.0.1"], &[], 22);
        let new = ruleset(&[], &["fd00::9"], 22);
        assert_eq!(
            elements(&delta(&old, &new).unwrap()),
            "delete element inet trellis src_ssh_1_v4 { 10.0.0.1 }\ncreate element inet trellis src_ssh_1_v6 { fd00::9 }\n"
        );
    }

    #[test]
    fn any_other_difference_loads_the_whole_table() {
        let old = ruleset(&["10.0.0.1"], &["fd00::1"], 22);
        assert_eq!(delta(&old, &ruleset(&["10.0.0.1"], &["fd00::1"], 2222)), None, "a port");
        assert_eq!(delta(&old, &old.replace("src_ssh_1_v6", "src_ssh_2_v6")), None, "a set's name");
        assert_eq!(delta(&old, &old.replace("ipv4_addr", "ipv6_addr")), None, "a set's type");
        assert_eq!(delta(&old, &format!("{old}table inet other {{\n}}\n")), None, "another line");
    }

    proptest::proptest! {
        /// Whatever the sources before and after, the commands take the old sets to the new
        /// ones: each deletion names an element the old set holds, each creation one it does
        /// not, and applying them gives exactly the new elements.
        #[test]
        fn the_commands_take_the_old_sets_to_the_new(
            old4 in proptest::collection::btree_set(0u16..300, 0..40),
            new4 in proptest::collection::btree_set(0u16..300, 0..40),
            old6 in proptest::collection::btree_set(0u16..300, 0..10),
            new6 in proptest::collection::btree_set(0u16..300, 0..10),
        ) {
            use std::collections::BTreeSet;
            let v4 = |s: &BTreeSet<u16>| s.iter().map(|i| format!("10.0.{}.{}", i / 256, i % 256)).collect::<Vec<_>>();
            let v6 = |s: &BTreeSet<u16>| s.iter().map(|i| format!("fd00::{i:x}")).collect::<Vec<_>>();
            let (o4, n4, o6, n6) = (v4(&old4), v4(&new4), v6(&old6), v6(&new6));
            fn refs(v: &[String]) -> Vec<&str> {
                v.iter().map(String::as_str).collect()
            }
            let old = ruleset(&refs(&o4), &refs(&o6), 22);
            let new = ruleset(&refs(&n4), &refs(&n6), 22);
            let commands = delta(&old, &new).expect("only elements differ");
            let mut sets: std::collections::HashMap<&str, BTreeSet<String>> =
                [("src_ssh_1_v4", o4.iter().cloned().collect()), ("src_ssh_1_v6", o6.iter().cloned().collect())].into();
            for line in elements(&commands).lines() {
                let (verb, rest) = line.split_once(" element inet trellis ").expect("an element command");
                let (name, elements) = rest.split_once(" { ").expect("a set and its elements");
                let set = sets.get_mut(name).expect("a declared set");
                for e in elements.strip_suffix(" }").expect("closed").split(", ") {
                    match verb {
                        "delete" => proptest::prop_assert!(set.remove(e), "{} deletes {} it does not hold", name, e),
                        "create" => proptest::prop_assert!(set.insert(e.to_string()), "{} creates {} it holds", name, e),
                        other => proptest::prop_assert!(false, "unknown command {}", other),
                    }
                }
            }
            proptest::prop_assert_eq!(&sets["src_ssh_1_v4"], &n4.iter().cloned().collect::<BTreeSet<_>>());
            proptest::prop_assert_eq!(&sets["src_ssh_1_v6"], &n6.iter().cloned().collect::<BTreeSet<_>>());
        }
    }

    /// Runs `scenario` on a real table in a network namespace of its own, twice: through `nft`,
    /// and through nftables' library in the agent's own process (as `in_process`).
    fn both_ways(tag: &str, scenario: fn(crate::host::Nft, &str, bool)) {
        use crate::host::Nft;
        use trellis_testing::{can_run, Need};
        if !can_run(Need::Root) || !can_run(Need::Program("nft")) {
            return;
        }
        let ns = format!("trellis-{tag}-{}", std::process::id());
        let netns = |args: &[&str]| std::process::Command::new("ip").args(["netns"]).args(args).output().unwrap();
        assert!(netns(&["add", &ns]).status.success());
        struct Gone(String);
        impl Drop for Gone {
            fn drop(&mut self) {
                let _ = std::process::Command::new("ip").args(["netns", "del", &self.0]).output();
            }
        }
        let _gone = Gone(ns.clone());
        scenario(Nft::in_namespace(&ns), &ns, false);
        // The library runs in the process's namespace: this thread enters the test's.
        let ns2 = ns.clone();
        std::thread::spawn(move || {
            use std::os::fd::AsRawFd;
            let file = std::fs::File::open(format!("/var/run/netns/{ns2}")).unwrap();
            // SAFETY: setns on this thread only, with a namespace file it holds open.
            assert_eq!(unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "{}", std::io::Error::last_os_error());
            // What the first run left is gone.
            let _ = std::process::Command::new("nft").args(["flush", "ruleset"]).output();
            scenario(Nft::new(), &ns2, true);
        })
        .join()
        .unwrap();
    }

    /// `nft ARGS` in the namespace, behind the agent's back; its output.
    fn nft_in(ns: &str, args: &[&str]) -> String {
        let out = std::process::Command::new("ip").args(["netns", "exec", ns, "nft"]).args(args).output().unwrap();
        assert!(out.status.success(), "nft {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8(out.stdout).unwrap()
    }

    /// The elements of one of the table's sets in the kernel, sorted.
    fn elements_in(ns: &str, set: &str) -> Vec<String> {
        let text = nft_in(ns, &["list", "set", "inet", "trellis", set]);
        let mut list: Vec<String> = text
            .split("elements = {")
            .nth(1)
            .map(|e| e.split('}').next().unwrap().split(',').map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect())
            .unwrap_or_default();
        list.sort();
        list
    }

    /// A real table in a network namespace, through `nft` and through nftables' library in the
    /// agent's own process: a change of sources is applied as elements (the table is not loaded
    /// again) and leaves exactly the new sources in the kernel's sets; a table changed behind
    /// the agent's back is loaded whole.
    #[test]
    fn the_kernel_holds_exactly_the_new_sources_whichever_way_they_came() {
        both_ways("rs", scenario);
    }

    fn scenario(mut nft: crate::host::Nft, ns: &str, in_process: bool) {
        use crate::host::Firewall;
        let dir = trellis_testing::TempDir::new("ruleset-delta");
        let file = dir.path().join("nftables.conf");
        let elements = |set: &str| elements_in(ns, set);
        let mut apply = |text: &str| {
            std::fs::write(&file, text).unwrap();
            nft.apply(&file).unwrap();
            nft.whole_loads()
        };
        let many: Vec<String> = (1..=2000).map(|i| format!("10.1.{}.{}", i / 250, i % 250 + 1)).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(apply(&ruleset(&many, &["fd00::1"], 22)), 1, "the first ruleset is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), 2000);
        // One source gone, one come, one renumbered: elements only.
        let mut changed: Vec<&str> = many[1..].to_vec();
        changed.push("10.9.9.9");
        assert_eq!(apply(&ruleset(&changed, &["fd00::2"], 22)), 1, "a change of sources is no whole load");
        let mut want: Vec<String> = changed.iter().map(|a| a.to_string()).collect();
        want.sort();
        assert_eq!(elements("src_ssh_1_v4"), want);
        assert_eq!(elements("src_ssh_1_v6"), vec!["fd00::2".to_string()]);
        // Behind the agent's back, an element taken out: the file is loaded whole, so the
        // kernel holds the file's sources, not a patched guess.
        nft_in(ns, &["delete", "element", "inet", "trellis", "src_ssh_1_v4", "{ 10.9.9.9 }"]);
        let fewer: Vec<&str> = changed[..changed.len() - 1].to_vec();
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)), 2, "a table changed behind the agent's back is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        // Behind the agent's back, the input chain's rules flushed (open to every source): the
        // same file applied again puts them back.
        nft_in(ns, &["flush", "chain", "inet", "trellis", "input"]);
        assert!(!nft_in(ns, &["list", "chain", "inet", "trellis", "input"]).contains("@src_ssh_1_v4"));
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)), 3, "rules flushed: loaded whole");
        let input = nft_in(ns, &["list", "chain", "inet", "trellis", "input"]);
        assert!(input.contains("ip saddr @src_ssh_1_v4 tcp dport 22 accept"), "{input}");
        // The whole ruleset flushed (as Debian's /etc/nftables.conf does on a restart of
        // nftables): the same file applied again is loaded whole, table, sets and rules.
        nft_in(ns, &["flush", "ruleset"]);
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)), 4, "a table gone is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        assert!(nft_in(ns, &["list", "chain", "inet", "trellis", "input"]).contains("@src_ssh_1_v6"));
        // Anything else (a port) is a whole load.
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 2222)), 5);
        // A ruleset nft refuses is refused with its message, and the table stays.
        std::fs::write(&file, "table inet trellis {\n\tchain input {\n\t\tnonsense\n\t}\n}\n").unwrap();
        let e = nft.apply(&file).expect_err("refused").to_string();
        // Its message names the file and the line at fault, though nft read the text in memory.
        assert!(e.starts_with("nft refused") && e.contains("nonsense") && e.contains(&format!("{}:3:", file.display())), "{e}");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        assert_eq!(nft.in_process(), in_process, "nft ran in this process");
    }

    /// Review finding 10: `nft flush ruleset` (a restart of Debian's `nftables`) or the table
    /// deleted left the overlay open until the next bundle, days on a quiet mesh. The check the
    /// run loop makes on its tick loads the ruleset again; a commit to another table, which
    /// moves the kernel's generation too, loads nothing.
    #[test]
    fn a_ruleset_flushed_behind_the_agents_back_is_loaded_again_at_the_next_check() {
        both_ways("flushed", flushed);
    }

    fn flushed(mut nft: crate::host::Nft, ns: &str, _: bool) {
        use crate::host::Firewall;
        let dir = trellis_testing::TempDir::new("ruleset-flushed");
        let file = dir.path().join("nftables.conf");
        std::fs::write(&file, ruleset(&["10.0.0.1", "10.0.0.2"], &["fd00::1"], 22)).unwrap();
        nft.apply(&file).unwrap();
        assert!(!nft.reconcile().unwrap(), "the table is as loaded");
        nft_in(ns, &["add", "table", "inet", "other"]);
        assert!(!nft.reconcile().unwrap(), "a commit to another table loads nothing again");
        assert_eq!(nft.whole_loads(), 1);
        // The file on disk is not read again: what is put back is what was loaded.
        std::fs::write(&file, "not nft\n").unwrap();
        nft_in(ns, &["flush", "ruleset"]);
        assert!(nft.reconcile().unwrap(), "a flushed ruleset is loaded again");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1", "10.0.0.2"]);
        assert!(nft_in(ns, &["list", "chain", "inet", "trellis", "input"]).contains("ip saddr @src_ssh_1_v4 tcp dport 22 accept"));
        nft_in(ns, &["delete", "table", "inet", "trellis"]);
        assert!(nft.reconcile().unwrap(), "a deleted table is loaded again");
        assert_eq!(elements_in(ns, "src_ssh_1_v6"), ["fd00::1"]);
        assert!(!nft.reconcile().unwrap(), "loaded again, the table is as loaded");
        assert_eq!(nft.whole_loads(), 3);
    }

    /// Review finding 10: an element, a chain or a hooked chain added to `inet trellis` behind
    /// the agent's back survived every change of elements, where a whole load removes it. A
    /// table that is not what the agent loaded is loaded whole; one that is (another table
    /// changed) still takes the elements only.
    #[test]
    fn what_is_added_to_the_table_behind_the_agents_back_does_not_survive_a_change_of_elements() {
        both_ways("added", added);
    }

    fn added(mut nft: crate::host::Nft, ns: &str, _: bool) {
        use crate::host::Firewall;
        let dir = trellis_testing::TempDir::new("ruleset-added");
        let file = dir.path().join("nftables.conf");
        let apply = |nft: &mut crate::host::Nft, v4: &[&str]| {
            std::fs::write(&file, ruleset(v4, &["fd00::1"], 22)).unwrap();
            nft.apply(&file).unwrap();
            nft.whole_loads()
        };
        assert_eq!(apply(&mut nft, &["10.0.0.1", "10.0.0.2"]), 1);
        // Right after the agent's commit, a source added to a rule's set.
        nft_in(ns, &["add", "element", "inet", "trellis", "src_ssh_1_v4", "{ 10.66.6.6 }"]);
        assert_eq!(apply(&mut nft, &["10.0.0.1", "10.0.0.3"]), 2, "an added element: loaded whole");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1", "10.0.0.3"]);
        // After the run loop's check settled the table and another table was changed, a chain
        // hooked on input that accepts a source of its own.
        let _ = nft.reconcile();
        nft_in(ns, &["add", "table", "inet", "other"]);
        nft_in(ns, &["add", "chain", "inet", "trellis", "backdoor", "{ type filter hook input priority -10; policy accept; }"]);
        nft_in(ns, &["add", "rule", "inet", "trellis", "backdoor", "ip saddr 10.66.0.0/16 accept"]);
        nft_in(ns, &["add", "chain", "inet", "trellis", "spare"]);
        assert_eq!(apply(&mut nft, &["10.0.0.1", "10.0.0.4"]), 3, "added chains: loaded whole");
        let table = nft_in(ns, &["list", "table", "inet", "trellis"]);
        assert!(!table.contains("backdoor") && !table.contains("spare") && !table.contains("10.66."), "{table}");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1", "10.0.0.4"]);
        // Another table changed, this one not: elements only.
        let _ = nft.reconcile();
        nft_in(ns, &["delete", "table", "inet", "other"]);
        assert_eq!(apply(&mut nft, &["10.0.0.1", "10.0.0.5"]), 3, "a change elsewhere is no reason to load whole");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1", "10.0.0.5"]);
    }

    /// Review finding 10: a whole load had nft read the path the agent had just read, so a file
    /// changed between the two reads was loaded while the agent remembered the other text, and
    /// later changes of elements started from the wrong one. Here the path is a FIFO that gives
    /// another text to a second reader.
    #[test]
    fn a_whole_load_is_the_text_the_agent_read_not_the_path_read_again() {
        both_ways("reread", reread);
    }

    fn reread(mut nft: crate::host::Nft, ns: &str, _: bool) {
        use crate::host::Firewall;
        use std::sync::atomic::{AtomicBool, Ordering};
        let dir = trellis_testing::TempDir::new("ruleset-reread");
        let fifo = dir.path().join("nftables.conf");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "{}", std::io::Error::last_os_error());
        let (read, other) = (ruleset(&["10.0.0.1"], &["fd00::1"], 22), ruleset(&["10.0.0.1", "10.66.6.6"], &["fd00::1"], 22));
        let done = std::sync::Arc::new(AtomicBool::new(false));
        let writer = {
            let (fifo, done) = (fifo.clone(), done.clone());
            std::thread::spawn(move || {
                use std::io::Write;
                use std::os::unix::fs::OpenOptionsExt;
                // The agent's read.
                std::fs::write(&fifo, read).unwrap();
                // Its descriptor closed before a second reader is looked for.
                std::thread::sleep(std::time::Duration::from_millis(200));
                while !done.load(Ordering::SeqCst) {
                    match std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&fifo) {
                        Ok(mut f) => {
                            f.write_all(other.as_bytes()).unwrap();
                            return true;
                        }
                        Err(_) => std::thread::sleep(std::time::Duration::from_millis(1)),
                    }
                }
                false
            })
        };
        nft.apply(&fifo).unwrap();
        done.store(true, Ordering::SeqCst);
        let read_again = writer.join().unwrap();
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1"], "the kernel holds the text the agent read");
        assert!(!read_again, "nothing read the file a second time");
    }
}
