//! What changed between two rulesets trellis wrote, as nft commands: when they differ only in
//! the elements of named sets (a node came, went or was renumbered: the sources of the rules
//! that admit it), the change is those elements, deleted and created in one transaction, instead
//! of the whole table loaded again (ADR 0031). With ten thousand sources a one-source change
//! then costs what the change costs, not what the table does.

use std::collections::HashSet;

/// The table every trellis ruleset holds (`core::render::nftables`).
const TABLE: &str = "inet trellis";

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

#[cfg(test)]
mod tests {
    use super::delta;

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

    /// A real table in a network namespace, through `nft` and through nftables' library in the
    /// agent's own process: a change of sources is applied as elements (the table is not loaded
    /// again) and leaves exactly the new sources in the kernel's sets; a table changed behind
    /// the agent's back refuses the change, and the file is loaded whole.
    #[test]
    fn the_kernel_holds_exactly_the_new_sources_whichever_way_they_came() {
        use crate::host::Nft;
        use trellis_testing::{can_run, Need};
        if !can_run(Need::Root) || !can_run(Need::Program("nft")) {
            return;
        }
        let ns = format!("trellis-rs-{}", std::process::id());
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
            // Gone from the first scenario.
            let _ = std::process::Command::new("nft").args(["delete", "table", "inet", "trellis"]).output();
            let nft = Nft::new();
            scenario(nft, &ns2, true);
        })
        .join()
        .unwrap();
    }

    fn scenario(mut nft: crate::host::Nft, ns: &str, in_process: bool) {
        use crate::host::Firewall;
        let dir = trellis_testing::TempDir::new("ruleset-delta");
        let file = dir.path().join("nftables.conf");
        let elements = |set: &str| {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", ns, "nft", "list", "set", "inet", "trellis", set])
                .output()
                .unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            let text = String::from_utf8(out.stdout).unwrap();
            let mut list: Vec<String> = text
                .split("elements = {")
                .nth(1)
                .map(|e| e.split('}').next().unwrap().split(',').map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect())
                .unwrap_or_default();
            list.sort();
            list
        };
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
        // Behind the agent's back, an element taken out: deleting it again is refused, and the
        // file is loaded whole, so the kernel holds the file's sources, not a patched guess.
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", ns, "nft", "delete", "element", "inet", "trellis", "src_ssh_1_v4", "{ 10.9.9.9 }"])
            .output()
            .unwrap();
        assert!(out.status.success());
        let fewer: Vec<&str> = changed[..changed.len() - 1].to_vec();
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)), 2, "a refused change is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        let nft_in_ns = |args: &[&str]| {
            let out = std::process::Command::new("ip").args(["netns", "exec", ns, "nft"]).args(args).output().unwrap();
            assert!(out.status.success(), "nft {args:?}: {}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8(out.stdout).unwrap()
        };
        // Behind the agent's back, the input chain's rules flushed (open to every source): the
        // same file applied again puts them back, without loading the table whole.
        nft_in_ns(&["flush", "chain", "inet", "trellis", "input"]);
        assert!(!nft_in_ns(&["list", "chain", "inet", "trellis", "input"]).contains("@src_ssh_1_v4"));
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)), 2, "rules put back with the elements' commands");
        let input = nft_in_ns(&["list", "chain", "inet", "trellis", "input"]);
        assert!(input.contains("ip saddr @src_ssh_1_v4 tcp dport 22 accept"), "{input}");
        // The whole ruleset flushed (as Debian's /etc/nftables.conf does on a restart of
        // nftables): the same file applied again is loaded whole, table, sets and rules.
        nft_in_ns(&["flush", "ruleset"]);
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)), 3, "a table gone is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        assert!(nft_in_ns(&["list", "chain", "inet", "trellis", "input"]).contains("@src_ssh_1_v6"));
        // Anything else (a port) is a whole load.
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 2222)), 4);
        // A ruleset nft refuses is refused with its message, and the table stays.
        std::fs::write(&file, "table inet trellis {\n\tchain input {\n\t\tnonsense\n\t}\n}\n").unwrap();
        let e = nft.apply(&file).expect_err("refused").to_string();
        assert!(e.starts_with("nft refused") && e.contains("nonsense"), "{e}");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        assert_eq!(nft.in_process(), in_process, "nft ran in this process");
    }
}
