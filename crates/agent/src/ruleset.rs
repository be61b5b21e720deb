//! A digest of the kernel's table as `nft list table` prints it, which says whether the table is
//! still the one the agent loaded; what changed between two rulesets trellis wrote is
//! `trellis_core::ruleset`, which reads them back.

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
    use super::digest;

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

    /// A ruleset as trellis writes it, with these sources of the `ssh` rule.
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
