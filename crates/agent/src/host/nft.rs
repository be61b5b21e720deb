//! The nftables backend: a ruleset that differs from the one loaded only in its named sets'
//! elements is changed by those elements (`trellis_core::ruleset::changes`): nf_tables' own
//! element messages (`crate::nftgen::ElementBatch`, ADR 0040), or `delete element`/`create
//! element` where those cannot be made; else it is loaded whole, through nftables' library in
//! the agent's helper process (`crate::nfthelper`) or the `nft` program. The kernel's ruleset
//! generation (`crate::nftgen`) and a digest of the table's listing say whether the table is
//! still the one loaded (ADR 0031).

use anyhow::{bail, Context, Result};
use trellis_core::ruleset::TABLE;

use super::traits::Firewall;
use crate::plan::TextFile;

/// nftables on a real host: one `table inet trellis`, loaded from the bundle's ruleset.
pub struct Nft {
    loaded: bool,
    /// The ruleset this process loaded last, as it read it: the next is compared with it (one
    /// that differs only in sets' elements is applied as those elements, `ruleset::changes`), and
    /// it is loaded again, whole, when the kernel's table is found not to be it.
    last: Option<Loaded>,
    /// What the kernel's table was known to be after this process's last commit.
    mark: Mark,
    /// How nft is run: its library in the agent's helper process, or its program.
    via: Via,
    /// How the helper ended during this apply or check, if it did: nothing more is sent to nft
    /// until the next one, which starts another helper.
    ended: Option<String>,
    /// The network namespace nft runs in (`ip netns exec`, for a test); `None`: this process's.
    namespace: Option<String>,
    /// Where the kernel's generation is read.
    generation: Gen,
    /// How many times a whole file was loaded (the rest were changes of elements).
    whole_loads: u32,
    /// How many changes were read from the regions of a delta's edits (ADR 0035), whether then
    /// committed as elements or, the table not the one loaded, loaded whole.
    pub by_regions: u32,
}

/// A ruleset as this process was given and loaded it: its files (`nftables.conf` and its parts,
/// ADR 0044), each with its SHA-256.
#[derive(Clone)]
struct Loaded {
    files: Vec<(String, [u8; 32], bytes::Bytes)>,
    /// The commands that put its chains back, when a change may be read from its regions
    /// (`ruleset::chains`); read at the first change by regions, and kept.
    chains: Option<Option<String>>,
}

impl Loaded {
    fn new(files: &[TextFile]) -> Loaded {
        Loaded { files: files.iter().map(|f| (f.path.clone(), f.sha256, f.content.clone())).collect(), chains: None }
    }

    /// The ruleset: its files one after the other.
    fn text(&self) -> String {
        self.files.iter().map(|(_, _, c)| String::from_utf8_lossy(c)).collect()
    }

    /// The file named in messages: `nftables.conf`.
    fn path(&self) -> &str {
        self.files.first().map_or("the ruleset", |(p, ..)| p.as_str())
    }
}

/// The changes of the sets' elements from the files `loaded` to `files`, read from the regions
/// of each file that differs (ADR 0035, 0044): by its edits when it came as edits of the file
/// loaded, else compared with it as one hunk. A file loaded as it is (its SHA-256) is not read.
/// `None` when a file came or went, or a region is anything but elements: the ruleset is loaded
/// whole.
fn file_changes(loaded: &[(String, [u8; 32], bytes::Bytes)], files: &[TextFile]) -> Option<Vec<trellis_core::ruleset::SetChange>> {
    if loaded.len() != files.len() || loaded.iter().zip(files).any(|((path, ..), f)| *path != f.path) {
        return None;
    }
    let mut sets: Vec<trellis_core::ruleset::SetChange> = Vec::new();
    for ((_, sha, old), f) in loaded.iter().zip(files).filter(|((_, sha, _), f)| *sha != f.sha256) {
        let hunks = f.hunks_from(sha, old.len());
        let changed = trellis_core::ruleset::changes_in(std::str::from_utf8(old).ok()?, std::str::from_utf8(&f.content).ok()?, &hunks)?;
        for c in changed {
            match sets.iter_mut().find(|s| s.set == c.set) {
                Some(s) => {
                    s.gone.extend(c.gone);
                    s.came.extend(c.came);
                }
                None => sets.push(c),
            }
        }
    }
    // An address gone from one part and come in another (a node renamed at its address) is no
    // change of the set. An address gone, or come, twice is not known to be one change: the
    // ruleset would list it twice (a review found it deleted while another part still listed it).
    for s in &mut sets {
        let mut came = std::collections::HashSet::new();
        let mut gone = std::collections::HashSet::new();
        if !s.came.iter().all(|e| came.insert(e.clone())) || !s.gone.iter().all(|e| gone.insert(e.clone())) {
            return None;
        }
        s.gone.retain(|e| !came.contains(e));
        s.came.retain(|e| !gone.contains(e));
    }
    sets.retain(|s| !s.gone.is_empty() || !s.came.is_empty());
    Some(sets)
}

/// nft's message about the text it was given (`/dev/stdin:LINE:`), with each place named by its
/// file and line there.
fn located(message: &str, files: &[(String, [u8; 32], bytes::Bytes)]) -> String {
    let mut out = String::with_capacity(message.len());
    let mut rest = message;
    while let Some(at) = rest.find("/dev/stdin:") {
        out.push_str(&rest[..at]);
        rest = &rest[at + "/dev/stdin:".len()..];
        let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
        let Ok(line) = rest[..digits].parse::<usize>() else {
            out.push_str("/dev/stdin:");
            continue;
        };
        match crate::plan::place_of(files.iter().map(|(path, _, content)| (path.as_str(), &content[..])), line) {
            Some((path, line)) => out.push_str(&format!("{path}:{line}")),
            None => out.push_str(&format!("/dev/stdin:{line}")),
        }
        rest = &rest[digits..];
    }
    out.push_str(rest);
    out
}

/// The kernel's table as this process's last commit left it: the generation right after the
/// commit, when no other commit came between (the generation moved by exactly one), and a
/// digest of the table's listing at that generation, taken at the first check after the commit
/// rather than on an apply's path (listing ten thousand sources takes milliseconds). A moved
/// generation with a table that still lists as the digest says is another table's change.
#[derive(Default)]
struct Mark {
    generation: Option<u32>,
    digest: Option<[u8; 32]>,
}

/// Whether the kernel's table is the one this process loaded last.
#[derive(Debug, PartialEq)]
enum Table {
    Same,
    /// Flushed, deleted or changed by another commit, or not known to be the one loaded.
    Changed,
    /// The generation cannot be read.
    Unknown,
}

enum Via {
    /// The helper, started at the first ruleset; the program where the library does not load.
    Untried,
    Helper(crate::nfthelper::Helper),
    /// This command run as `nft` (a test runs it inside a network namespace).
    Program(Vec<String>),
}

enum Gen {
    /// Opened at the first commit, in the namespace nft runs in.
    Untried,
    Open(crate::nftgen::Generation),
    /// It did not open (said once, in the log): every change is loaded whole.
    Missing,
}

impl Nft {
    pub fn new() -> Self {
        Nft {
            loaded: false,
            last: None,
            mark: Mark::default(),
            via: Via::Untried,
            ended: None,
            namespace: None,
            generation: Gen::Untried,
            whole_loads: 0,
            by_regions: 0,
        }
    }

    /// `nft` run through `ip netns exec NAMESPACE`.
    pub fn in_namespace(namespace: &str) -> Self {
        Nft {
            via: Via::Program(["ip", "netns", "exec", namespace, "nft"].map(String::from).to_vec()),
            namespace: Some(namespace.to_string()),
            ..Nft::new()
        }
    }

    /// nft run as this program (a test's: one that is not nft at all).
    #[cfg(test)]
    fn with_program(mut self, program: &[&str]) -> Self {
        self.via = Via::Program(program.iter().map(|w| w.to_string()).collect());
        self
    }

    /// nft run through this helper (a test's).
    #[cfg(test)]
    pub(crate) fn with_helper(helper: crate::nfthelper::Helper) -> Self {
        Nft { via: Via::Helper(helper), ..Nft::new() }
    }

    /// How many times a whole ruleset was loaded, rather than changed in its sets' elements.
    pub fn whole_loads(&self) -> u32 {
        self.whole_loads
    }

    /// Whether nft runs through its library (in the agent's helper process), not its program.
    pub fn in_process(&self) -> bool {
        matches!(self.via, Via::Helper(_))
    }

    /// The running helper's process id.
    pub fn helper_pid(&self) -> Option<u32> {
        match &self.via {
            Via::Helper(helper) => helper.pid(),
            _ => None,
        }
    }

    /// Runs these commands (changes of elements, a listing) as one transaction, or, with the
    /// ruleset's files as `whole`, a whole ruleset's text (its files one after the other) as nft
    /// loads a file. Always the text: a ruleset is loaded as the agent was given it, never from
    /// its path. What nft printed; the error is nft's message, which names the file and line
    /// at fault. A helper that ended fails this batch,
    /// and every later one of the same apply or check: nothing more is sent until the next,
    /// which starts another helper.
    fn run(&mut self, commands: &str, whole: Option<&[(String, [u8; 32], bytes::Bytes)]>) -> Result<String> {
        use crate::nfthelper::{HelperError, Request};
        if let Some(ended) = &self.ended {
            return Err(HelperError::Ended(ended.clone()).into());
        }
        if matches!(self.via, Via::Untried) {
            self.via = Via::Helper(crate::nfthelper::Helper::default());
        }
        if let Via::Helper(helper) = &mut self.via {
            let request = match whole {
                Some(_) => Request::Load { text: commands, name: STDIN },
                None => Request::Run(commands),
            };
            match helper.run(request) {
                Ok(out) => return Ok(out),
                Err(HelperError::Refused(message)) => bail!("{}", whole.map_or(message.clone(), |files| located(&message, files))),
                Err(HelperError::NoLibrary(why)) => {
                    tracing::info!(error = %why, "nftables' library does not load: the agent runs `nft`");
                    self.via = Via::Program(vec!["nft".into()]);
                }
                Err(e @ HelperError::Ended(_)) => {
                    // The apply fails here, as for a refusal; a helper that keeps ending gives way
                    // to the program.
                    if helper.exhausted() {
                        tracing::warn!(error = %e, "nftables' helper process keeps ending: the agent runs `nft` from now on");
                        self.via = Via::Program(vec!["nft".into()]);
                    }
                    self.ended = Some(e.to_string());
                    return Err(e.into());
                }
            }
        }
        let Via::Program(program) = &self.via else { unreachable!("the helper answered above") };
        program_run(program, commands).map_err(|e| match whole {
            Some(files) => anyhow::anyhow!("{}", located(&format!("{e:#}"), files)),
            None => e,
        })
    }

    /// The kernel's ruleset generation in nft's namespace; `None` when it cannot be read.
    fn generation(&mut self) -> Option<u32> {
        if matches!(self.generation, Gen::Untried) {
            let opened = match &self.namespace {
                Some(ns) => crate::nftgen::Generation::in_namespace(ns),
                None => crate::nftgen::Generation::open(),
            };
            self.generation = match opened {
                Ok(g) => Gen::Open(g),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "cannot read the kernel's nftables generation: every ruleset is loaded whole, and a table changed behind the agent's back is put back only by the next one"
                    );
                    Gen::Missing
                }
            };
        }
        match &mut self.generation {
            Gen::Open(g) => g.read().map_err(|e| tracing::warn!(error = %e, "cannot read the kernel's nftables generation")).ok(),
            _ => None,
        }
    }

    /// A digest of the kernel's table as nft lists it; `None` when there is no table.
    fn listed(&mut self) -> Option<[u8; 32]> {
        let listing = self.run(&format!("list table {}\n", TABLE), None).ok()?;
        Some(digest(&listing))
    }

    /// Runs commands that change the table, and marks what the kernel holds after them as this
    /// process's. A refused transaction changes nothing in the kernel, nor the mark.
    fn commit(&mut self, commands: &str, whole: Option<&[(String, [u8; 32], bytes::Bytes)]>) -> Result<()> {
        let before = self.generation();
        self.run(commands, whole)?;
        let after = self.generation();
        // Another commit between the two reads leaves the table not known to be this one: the
        // next check loads it whole.
        let generation = after.filter(|a| before.is_some_and(|b| *a == crate::nftgen::following(b)));
        self.mark = Mark { generation, digest: None };
        Ok(())
    }

    /// Whether the kernel's table is the one this process loaded last. An unmoved generation
    /// says so in one netlink round trip; a moved one (a commit to any table) has the table
    /// listed and compared with the digest. `settle` takes the digest, when there is none yet
    /// and the generation has not moved since the commit.
    fn table(&mut self, settle: bool) -> Table {
        let Some(now) = self.generation() else { return Table::Unknown };
        if self.mark.generation == Some(now) {
            if settle && self.mark.digest.is_none() {
                let digest = self.listed();
                // Kept only if nothing was committed while the table was listed.
                if self.generation() == Some(now) {
                    self.mark.digest = digest;
                }
            }
            return Table::Same;
        }
        let Some(known) = self.mark.digest else { return Table::Changed };
        if self.listed() == Some(known) {
            self.mark.generation = Some(now);
            Table::Same
        } else {
            Table::Changed
        }
    }

    /// Changes the sets' elements of the table this process loaded, which `table` just found
    /// the same, by the kernel's own element messages on the generation's socket
    /// (`nftgen::ElementBatch`): nft is not run, so it does not read the sets first, and the
    /// chains are not put back, since no commit came since the check. The generation says so: it
    /// must be the one checked right before the batch and move by exactly one with it, else the
    /// change is taken as refused (and the file loaded whole), whatever else was committed.
    /// `None` when the batch cannot be made (no socket, an element that is no address, a
    /// change of thousands): nft makes it.
    fn elements(&mut self, sets: &[trellis_core::ruleset::SetChange]) -> Option<Result<()>> {
        let Gen::Open(g) = &mut self.generation else { return None };
        let batch = g.batch(TABLE, sets)?;
        let checked = self.mark.generation;
        let before = g.read().ok();
        if before.is_none() || before != checked {
            self.mark = Mark::default();
            return Some(Err(anyhow::anyhow!("the kernel's ruleset changed since the table was checked")));
        }
        let sent = g.commit(&batch);
        let after = g.read().ok();
        let ours = before.is_some_and(|b| after == Some(crate::nftgen::following(b)));
        match sent {
            Ok(()) if ours => {
                self.mark = Mark { generation: after, digest: None };
                Some(Ok(()))
            }
            Ok(()) => {
                self.mark = Mark::default();
                Some(Err(anyhow::anyhow!("another commit came with the change of elements")))
            }
            Err(e) => Some(Err(anyhow::anyhow!("the kernel refused the change of elements: {e}"))),
        }
    }

    /// Changes the sets' elements of the table this process loaded: by the kernel's own element
    /// messages (`elements`), or, where those cannot be made, by nft's commands with every chain
    /// put back (`chains`) in the same transaction.
    fn change_elements(&mut self, sets: &[trellis_core::ruleset::SetChange], chains: &str) -> Result<()> {
        match self.elements(sets) {
            Some(done) => done,
            None => self.commit(&(trellis_core::ruleset::commands(sets) + chains), None),
        }
    }

    /// Loads a ruleset's text whole, in one transaction that replaces the table.
    fn load_whole(&mut self, ruleset: Loaded) -> Result<()> {
        if let Err(e) = self.commit(&ruleset.text(), Some(&ruleset.files)) {
            if helper_ended(&e) {
                bail!("cannot load {}: {e:#}", ruleset.path());
            }
            bail!("nft refused {}: {e:#}", ruleset.path());
        }
        self.last = Some(ruleset);
        self.loaded = true;
        self.whole_loads += 1;
        Ok(())
    }
}

impl Default for Nft {
    fn default() -> Self {
        Self::new()
    }
}

/// Whether this error is nftables' helper process ending, not nft refusing the batch.
fn helper_ended(e: &anyhow::Error) -> bool {
    matches!(e.downcast_ref(), Some(crate::nfthelper::HelperError::Ended(_)))
}

/// What nft calls the text it was given, in its messages.
const STDIN: &str = "/dev/stdin";

/// Runs `nft -f -` (after the command's other words) with these commands on its standard input.
fn program_run(program: &[String], commands: &str) -> Result<String> {
    use std::io::Write;
    let mut cmd = std::process::Command::new(&program[0]);
    cmd.args(&program[1..]).args(["-f", "-"]);
    cmd.stdin(std::process::Stdio::piped()).stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().context("cannot run nft (is nftables installed?)")?;
    let mut input = child.stdin.take().expect("piped");
    let written = input.write_all(commands.as_bytes());
    drop(input);
    // Waited for even when it stopped reading early: no child is left unreaped, and its own
    // message says why.
    let out = child.wait_with_output().context("cannot run nft")?;
    if !out.status.success() {
        bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
    }
    written.context("cannot give nft its commands")?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Firewall for Nft {
    fn apply(&mut self, ruleset: &[TextFile]) -> Result<()> {
        self.ended = None;
        if let Some(f) = ruleset.iter().find(|f| std::str::from_utf8(&f.content).is_err()) {
            bail!("cannot load {}: it is not UTF-8", f.path);
        }
        // By the regions of the files that differ from those loaded (ADR 0035, 0044): the
        // elements there, and the chains of the text loaded.
        let by_regions = match self.last.as_mut() {
            Some(last) => {
                let chains = match &last.chains {
                    Some(c) => c.clone(),
                    None => last.chains.insert(trellis_core::ruleset::chains(&last.text())).clone(),
                };
                file_changes(&last.files, ruleset).and_then(|sets| Some((sets, chains?)))
            }
            None => None,
        };
        let (new, change) = match by_regions {
            Some((sets, chains)) => {
                self.by_regions += 1;
                (Loaded { chains: Some(Some(chains.clone())), ..Loaded::new(ruleset) }, Some((sets, chains)))
            }
            None => {
                let new = Loaded::new(ruleset);
                let change = self.last.as_ref().and_then(|old| trellis_core::ruleset::changes(&old.text(), &new.text()));
                (new, change)
            }
        };
        // Only the elements that changed, when nothing else did, and only on the table this
        // process loaded: one changed behind its back (an element or a chain added, rules
        // flushed) is loaded whole, as a whole load would leave it, never patched.
        if let Some((sets, chains)) = change {
            match self.table(false) {
                Table::Same if sets.is_empty() => {
                    self.last = Some(new);
                    return Ok(());
                }
                Table::Same => match self.change_elements(&sets, &chains) {
                    Ok(()) => {
                        tracing::info!(sets = sets.len(), "ruleset changed in its sets' elements");
                        self.last = Some(new);
                        return Ok(());
                    }
                    // The helper gone, the apply fails (a refusal of the elements loads the file
                    // whole instead).
                    Err(e) if helper_ended(&e) => bail!("cannot change the sets' elements of {}: {e:#}", new.path()),
                    Err(e) => tracing::warn!(
                        error = %format!("{e:#}"),
                        "the loaded table refused a change of its sets' elements; loading {} whole",
                        new.path()
                    ),
                },
                Table::Changed => tracing::warn!(
                    "table {} is not the one the agent loaded (changed behind its back); loading {} whole",
                    TABLE,
                    new.path()
                ),
                Table::Unknown => {}
            }
        }
        // Loaded whole, the text is read again for the next change by regions: a cache taken
        // over from the text before (whose elements were listed once each) may not hold for it.
        self.load_whole(Loaded { chains: None, ..new })
    }

    fn loaded(&self) -> bool {
        self.loaded
    }

    fn reconcile(&mut self) -> Result<bool> {
        self.ended = None;
        // Nothing loaded, nothing to put back; a generation that cannot be read tells nothing.
        if self.last.is_none() || self.table(true) != Table::Changed {
            return Ok(false);
        }
        let last = self.last.clone().expect("checked");
        tracing::warn!(
            "table {} is not the one the agent loaded (flushed, deleted or changed behind its back); loading {} again, as given at its last apply",
            TABLE,
            last.path()
        );
        self.load_whole(last)?;
        Ok(true)
    }
}

/// A digest of a table as `nft list table` prints it, each set's elements sorted: the kernel
/// lists a hash set in its own order, which may change with no change of elements. Two listings
/// of the same table have the same digest; an element, a rule or a chain added, taken out or
/// changed changes it.
fn digest(listing: &str) -> [u8; 32] {
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
    use super::*;

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

    /// The ruleset as one `nftables.conf` of this text, named by `file` in messages, with the
    /// change that brought it if it came as edits.
    fn given(file: &std::path::Path, text: &str, change: Option<crate::plan::TextChange>) -> Vec<crate::plan::TextFile> {
        let f = trellis_core::bundle::BundleFile::new(trellis_core::plan::NFTABLES_CONF, 0o644, text.as_bytes().to_vec());
        vec![crate::plan::TextFile { path: file.display().to_string(), sha256: f.sha256, content: f.content, change }]
    }

    /// The ruleset as the `nftables.conf` written at `file`.
    fn on_disk(file: &std::path::Path) -> Vec<crate::plan::TextFile> {
        given(file, &std::fs::read_to_string(file).unwrap(), None)
    }

    /// Runs `scenario` on a real table in a network namespace of its own, twice: through `nft`,
    /// and through nftables' library in the agent's own process (as `in_process`).
    fn both_ways(tag: &str, scenario: fn(Nft, &str, bool)) {
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

    fn scenario(mut nft: Nft, ns: &str, in_process: bool) {
        let dir = trellis_testing::TempDir::new("ruleset-delta");
        let file = dir.path().join("nftables.conf");
        let elements = |set: &str| elements_in(ns, set);
        // Each text but the first comes as edits of the one before (ADR 0035), as a delta
        // brings it.
        let mut before: Option<String> = None;
        let mut apply = |text: &str| {
            let change = before.as_deref().map(|b| crate::plan::TextChange::between(b, text));
            nft.apply(&given(&file, text, change)).unwrap();
            before = Some(text.to_string());
            (nft.whole_loads(), nft.by_regions)
        };
        let many: Vec<String> = (1..=2000).map(|i| format!("10.1.{}.{}", i / 250, i % 250 + 1)).collect();
        let many: Vec<&str> = many.iter().map(String::as_str).collect();
        assert_eq!(apply(&ruleset(&many, &["fd00::1"], 22)), (1, 0), "the first ruleset is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), 2000);
        // One source gone, one come, one renumbered: elements only.
        let mut changed: Vec<&str> = many[1..].to_vec();
        changed.push("10.9.9.9");
        assert_eq!(apply(&ruleset(&changed, &["fd00::2"], 22)), (1, 1), "a change of sources is no whole load, read by its regions");
        let mut want: Vec<String> = changed.iter().map(|a| a.to_string()).collect();
        want.sort();
        assert_eq!(elements("src_ssh_1_v4"), want);
        assert_eq!(elements("src_ssh_1_v6"), vec!["fd00::2".to_string()]);
        // Behind the agent's back, an element taken out: the file is loaded whole, so the
        // kernel holds the file's sources, not a patched guess.
        nft_in(ns, &["delete", "element", "inet", "trellis", "src_ssh_1_v4", "{ 10.9.9.9 }"]);
        let fewer: Vec<&str> = changed[..changed.len() - 1].to_vec();
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)).0, 2, "a table changed behind the agent's back is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        // Behind the agent's back, the input chain's rules flushed (open to every source): the
        // same file applied again puts them back.
        nft_in(ns, &["flush", "chain", "inet", "trellis", "input"]);
        assert!(!nft_in(ns, &["list", "chain", "inet", "trellis", "input"]).contains("@src_ssh_1_v4"));
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)).0, 3, "rules flushed: loaded whole");
        let input = nft_in(ns, &["list", "chain", "inet", "trellis", "input"]);
        assert!(input.contains("ip saddr @src_ssh_1_v4 tcp dport 22 accept"), "{input}");
        // The whole ruleset flushed (as Debian's /etc/nftables.conf does on a restart of
        // nftables): the same file applied again is loaded whole, table, sets and rules.
        nft_in(ns, &["flush", "ruleset"]);
        assert_eq!(apply(&ruleset(&fewer, &["fd00::2"], 22)).0, 4, "a table gone is loaded whole");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len());
        assert!(nft_in(ns, &["list", "chain", "inet", "trellis", "input"]).contains("@src_ssh_1_v6"));
        // Anything else (a port) is a whole load.
        let (whole, by_regions) = apply(&ruleset(&fewer, &["fd00::2"], 2222));
        assert_eq!(whole, 5);
        // A source gone again, by the regions, from the table as the whole load left it.
        assert_eq!(apply(&ruleset(&fewer[1..], &["fd00::2"], 2222)), (5, by_regions + 1));
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len() - 1);
        assert!(!elements("src_ssh_1_v4").contains(&fewer[0].to_string()));
        // A source listed twice (nft takes it once): the element created again is refused, and
        // the file loaded whole. Back to the list without the repeat, the source stays: the
        // text with the repeat is read whole, never by its regions (a review found that the
        // regions deleted it, the kernel then lacking a source the file names).
        let mut twice: Vec<&str> = fewer[1..].to_vec();
        twice.push(fewer[1]);
        assert_eq!(apply(&ruleset(&twice, &["fd00::2"], 2222)).0, 6, "an element created twice is refused: loaded whole");
        apply(&ruleset(&fewer[1..], &["fd00::2"], 2222));
        assert!(elements("src_ssh_1_v4").contains(&fewer[1].to_string()), "the source listed twice before is still held");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len() - 1);
        // A ruleset nft refuses is refused with its message, and the table stays.
        let e = nft
            .apply(&given(&file, "table inet trellis {\n\tchain input {\n\t\tnonsense\n\t}\n}\n", None))
            .expect_err("refused")
            .to_string();
        // Its message names the file and the line at fault, though nft read the text in memory.
        assert!(e.starts_with("nft refused") && e.contains("nonsense") && e.contains(&format!("{}:3:", file.display())), "{e}");
        assert_eq!(elements("src_ssh_1_v4").len(), fewer.len() - 1);
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

    fn flushed(mut nft: Nft, ns: &str, _: bool) {
        let dir = trellis_testing::TempDir::new("ruleset-flushed");
        let file = dir.path().join("nftables.conf");
        nft.apply(&given(&file, &ruleset(&["10.0.0.1", "10.0.0.2"], &["fd00::1"], 22), None)).unwrap();
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
    fn a_change_of_elements_runs_no_nft_and_a_moved_generation_loads_whole() {
        both_ways("nonft", no_nft);
    }

    /// Loaded whole by nft, then given a program that is not nft (`false`): a change of elements
    /// still goes into the kernel (the kernel's own element messages, no nft run, no chain put
    /// back), and only a whole load needs nft. A commit of another table between two applies
    /// moves the generation, and no listing was taken since the change: the table is not known
    /// to be the one loaded, and the next change is a whole load.
    fn no_nft(nft: Nft, ns: &str, _: bool) {
        let dir = trellis_testing::TempDir::new("ruleset-no-nft");
        let file = dir.path().join("nftables.conf");
        let write = |v4: &[&str], port: u16| std::fs::write(&file, ruleset(v4, &["fd00::1"], port)).unwrap();
        let mut nft = nft;
        write(&["10.0.0.1", "10.0.0.2"], 22);
        nft.apply(&on_disk(&file)).unwrap();
        let mut nft = nft.with_program(&["false"]);
        write(&["10.0.0.2", "10.0.0.3"], 22);
        nft.apply(&on_disk(&file)).expect("elements without nft");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.2", "10.0.0.3"]);
        assert_eq!(nft.whole_loads(), 1);
        // Another table's commit: loaded whole, which `false` refuses; the kernel keeps what it
        // had.
        nft_in(ns, &["add", "table", "inet", "other"]);
        write(&["10.0.0.3"], 22);
        assert!(nft.apply(&on_disk(&file)).is_err(), "a whole load needs nft");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.2", "10.0.0.3"], "a refused load changes nothing");
        // A port: only nft can load it.
        write(&["10.0.0.3"], 2222);
        assert!(nft.apply(&on_disk(&file)).is_err());
        assert!(nft_in(ns, &["list", "chain", "inet", "trellis", "input"]).contains("dport 22 accept"));
    }

    /// The review of ADR 0040: one set's change of more than 2,340 IPv6 elements overflowed the
    /// 16-bit length of its element list; the kernel took the part it read and acknowledged it,
    /// so the table held 660 of 3,001 sources added, or kept 2,342 removed. Now such a change
    /// goes through nft, and the kernel holds exactly the file's sources both ways.
    #[test]
    fn a_change_of_thousands_of_ipv6_sources_leaves_exactly_the_files() {
        both_ways("many-v6", many_v6);
    }

    fn many_v6(mut nft: Nft, ns: &str, _: bool) {
        let dir = trellis_testing::TempDir::new("ruleset-many-v6");
        let file = dir.path().join("nftables.conf");
        let many: Vec<String> = (1..=3000).map(|i| format!("fd00::1:{i:x}")).collect();
        let mut all: Vec<&str> = vec!["fd00::1"];
        all.extend(many.iter().map(String::as_str));
        for (v6, want) in [(&["fd00::1"][..], 1), (&all[..], 3001), (&["fd00::1"][..], 1)] {
            std::fs::write(&file, ruleset(&["10.0.0.1"], v6, 22)).unwrap();
            nft.apply(&on_disk(&file)).unwrap();
            assert_eq!(elements_in(ns, "src_ssh_1_v6").len(), want, "the kernel holds exactly the file's sources");
        }
        assert_eq!(nft.whole_loads(), 1, "changes of elements, through nft");
    }

    #[test]
    fn what_is_added_to_the_table_behind_the_agents_back_does_not_survive_a_change_of_elements() {
        both_ways("added", added);
    }

    fn added(mut nft: Nft, ns: &str, _: bool) {
        let dir = trellis_testing::TempDir::new("ruleset-added");
        let file = dir.path().join("nftables.conf");
        let apply = |nft: &mut Nft, v4: &[&str]| {
            std::fs::write(&file, ruleset(v4, &["fd00::1"], 22)).unwrap();
            nft.apply(&on_disk(&file)).unwrap();
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

    /// ADR 0044: a ruleset in parts, `nftables.conf` declaring the sets and each part adding
    /// the addresses of its sources, is loaded as one text; a change of one part's sources (a
    /// node's v4 and v6 addresses, on lines one after the other) is made by its elements, read
    /// from that part's regions; a part gone is a whole load; a part nft refuses is named with
    /// its line.
    #[test]
    fn a_ruleset_in_parts_is_loaded_as_one_and_changed_by_the_parts_that_changed() {
        both_ways("parts", parts);
    }

    fn parts(mut nft: Nft, ns: &str, _: bool) {
        use trellis_core::plan::{ruleset_part, NFTABLES_CONF};
        let main = ruleset(&[], &[], 22).replace("# trellis\n", "# trellis, in parts\n");
        // Part i adds the v4 and v6 addresses of the sources n with n % 4 == i.
        let part = |i: usize, skip: usize| {
            let mut t = format!("# part {i:02}\n");
            let n: Vec<usize> = (0..400).filter(|n| n % 4 == i && *n != skip).collect();
            let v4: Vec<String> = n.iter().map(|n| format!("10.1.{}.{}", n / 200, n % 200 + 1)).collect();
            let v6: Vec<String> = n.iter().map(|n| format!("fd00::1:{n:x}")).collect();
            t.push_str(&format!(
                "add element inet trellis src_ssh_1_v4 {{ {} }}\nadd element inet trellis src_ssh_1_v6 {{ {} }}\n",
                v4.join(", "),
                v6.join(", ")
            ));
            t
        };
        let file = |path: &str, text: &str, before: Option<&str>| {
            let f = trellis_core::bundle::BundleFile::new(path, 0o644, text.as_bytes().to_vec());
            let change = before.map(|b| crate::plan::TextChange::between(b, text));
            crate::plan::TextFile { path: path.to_string(), sha256: f.sha256, content: f.content, change }
        };
        let one: Vec<crate::plan::TextFile> =
            std::iter::once(file(NFTABLES_CONF, &main, None)).chain((0..3).map(|i| file(ruleset_part(i), &part(i, 999), None))).collect();
        nft.apply(&one).unwrap();
        assert_eq!((nft.whole_loads(), nft.by_regions), (1, 0));
        assert_eq!(elements_in(ns, "src_ssh_1_v4").len(), 300);
        assert_eq!(elements_in(ns, "src_ssh_1_v6").len(), 300);

        // Source 5 (part 1) gone, v4 and v6: part 1 came as edits; the others as they were.
        let two: Vec<crate::plan::TextFile> =
            vec![one[0].clone(), one[1].clone(), file(ruleset_part(1), &part(1, 5), Some(&part(1, 999))), one[3].clone()];
        nft.apply(&two).unwrap();
        assert_eq!((nft.whole_loads(), nft.by_regions), (1, 1), "changed by its elements, read from part 1's regions");
        let v4 = elements_in(ns, "src_ssh_1_v4");
        assert!(v4.len() == 299 && !v4.contains(&"10.1.0.6".to_string()), "{}", v4.len());
        assert!(!elements_in(ns, "src_ssh_1_v6").contains(&"fd00::1:5".to_string()));

        // Part 2 gone: loaded whole, and the kernel holds what the files say.
        let three: Vec<crate::plan::TextFile> = vec![two[0].clone(), two[1].clone(), two[2].clone()];
        nft.apply(&three).unwrap();
        assert_eq!(nft.whole_loads(), 2);
        assert_eq!(elements_in(ns, "src_ssh_1_v4").len(), 199);

        // A part nft refuses (an element of no set): named with its line, and the table stays.
        let mut bad = three.clone();
        bad.push(file(ruleset_part(7), "# part 07\nadd element inet trellis src_nothing_v4 { 10.9.9.9 }\n", None));
        let e = nft.apply(&bad).expect_err("refused").to_string();
        assert!(e.contains(&format!("{}:2:", ruleset_part(7))), "{e}");
        assert_eq!(elements_in(ns, "src_ssh_1_v4").len(), 199);
    }

    /// A file of a ruleset in parts, as the bundle gives it, with the change that brought it.
    fn part_file(path: &str, text: &str, before: Option<&str>) -> crate::plan::TextFile {
        let f = trellis_core::bundle::BundleFile::new(path, 0o644, text.as_bytes().to_vec());
        let change = before.map(|b| crate::plan::TextChange::between(b, text));
        crate::plan::TextFile { path: path.to_string(), sha256: f.sha256, content: f.content, change }
    }

    /// `nftables.conf` in parts, declaring `src_ssh_1_*` and `src_ssh_2_v4` without elements.
    fn parted_main() -> String {
        ruleset(&[], &[], 22).replace(
            "table inet trellis {\n\tset src_ssh_1_v4",
            "table inet trellis {\n\tset src_ssh_2_v4 {\n\t\ttype ipv4_addr\n\t}\n\tset src_ssh_1_v4",
        )
    }

    fn adds(set: &str, e: &[&str]) -> String {
        format!("add element inet trellis {set} {{ {} }}\n", e.join(", "))
    }

    /// An attacker's review of ADR 0044 found four ways a change read from a part's regions left
    /// the kernel's table other than a whole load of the same files would, the apply reporting
    /// success: each is performed here, on a real table, and the kernel must hold what the files
    /// say (or, for a part nft refuses, what it held).
    #[test]
    fn a_change_of_a_ruleset_in_parts_leaves_the_kernel_as_a_whole_load_would() {
        both_ways("pt-rename", renamed_on_its_line);
        both_ways("pt-twice", listed_twice_across_parts);
        both_ways("pt-spelled", spelled_two_ways);
        both_ways("pt-crlf", crlf);
    }

    /// A part's line that names another set: its elements all move, not only the first.
    fn renamed_on_its_line(mut nft: Nft, ns: &str, _: bool) {
        use trellis_core::plan::{ruleset_part, NFTABLES_CONF};
        let p0 = format!("# p0\n{}", adds("src_ssh_1_v4", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]));
        let p1 = format!("# p1\n{}{}", adds("src_ssh_2_v4", &["10.0.1.1"]), adds("src_ssh_1_v4", &["10.0.1.2"]));
        let one = vec![
            part_file(NFTABLES_CONF, &parted_main(), None),
            part_file(ruleset_part(0), &p0, None),
            part_file(ruleset_part(1), &p1, None),
        ];
        nft.apply(&one).unwrap();
        let p0b = format!("# p0\n{}", adds("src_ssh_2_v4", &["10.0.0.1", "10.0.0.2", "10.0.0.3"]));
        nft.apply(&[one[0].clone(), part_file(ruleset_part(0), &p0b, Some(&p0)), one[2].clone()]).unwrap();
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.1.2"]);
        assert_eq!(elements_in(ns, "src_ssh_2_v4"), ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.1.1"]);
    }

    /// An address gone from one part and come in two others, then gone from one of them: it is
    /// still listed, and still held.
    fn listed_twice_across_parts(mut nft: Nft, ns: &str, _: bool) {
        use trellis_core::plan::{ruleset_part, NFTABLES_CONF};
        let p = |i: usize, e: &[&str]| format!("# p{i}\n{}", adds("src_ssh_1_v4", e));
        let (a1, b1, c1) = (p(0, &["10.0.0.1", "10.0.0.9"]), p(1, &["10.0.0.2"]), p(2, &["10.0.0.3"]));
        let main = part_file(NFTABLES_CONF, &parted_main(), None);
        nft.apply(&[
            main.clone(),
            part_file(ruleset_part(0), &a1, None),
            part_file(ruleset_part(1), &b1, None),
            part_file(ruleset_part(2), &c1, None),
        ])
        .unwrap();
        let (a2, b2, c2) = (p(0, &["10.0.0.1"]), p(1, &["10.0.0.2", "10.0.0.9"]), p(2, &["10.0.0.3", "10.0.0.9"]));
        let two = [
            main.clone(),
            part_file(ruleset_part(0), &a2, Some(&a1)),
            part_file(ruleset_part(1), &b2, Some(&b1)),
            part_file(ruleset_part(2), &c2, Some(&c1)),
        ];
        nft.apply(&two).unwrap();
        let c3 = p(2, &["10.0.0.3"]);
        nft.apply(&[main, two[1].clone(), two[2].clone(), part_file(ruleset_part(2), &c3, Some(&c2))]).unwrap();
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.9"]);
    }

    /// One address spelled two ways (one element to nft): one spelling gone, the address stays.
    fn spelled_two_ways(mut nft: Nft, ns: &str, _: bool) {
        use trellis_core::plan::{ruleset_part, NFTABLES_CONF};
        let a = format!("# p0\n{}", adds("src_ssh_1_v6", &["fd00::1"]));
        let b1 = format!("# p1\n{}", adds("src_ssh_1_v6", &["FD00::1", "fd00::2"]));
        let one = vec![
            part_file(NFTABLES_CONF, &parted_main(), None),
            part_file(ruleset_part(0), &a, None),
            part_file(ruleset_part(1), &b1, None),
        ];
        nft.apply(&one).unwrap();
        let b2 = format!("# p1\n{}", adds("src_ssh_1_v6", &["fd00::2"]));
        nft.apply(&[one[0].clone(), one[1].clone(), part_file(ruleset_part(1), &b2, Some(&b1))]).unwrap();
        assert_eq!(elements_in(ns, "src_ssh_1_v6"), ["fd00::1", "fd00::2"]);
    }

    /// A part with carriage returns, which nft refuses: refused by the check, refused by nft when
    /// given anyway (never applied as elements), and the table a flush took is put back.
    fn crlf(mut nft: Nft, ns: &str, _: bool) {
        use trellis_core::plan::{ruleset_part, NFTABLES_CONF};
        let a = format!("# p0\n{}", adds("src_ssh_1_v4", &["10.0.0.1"]));
        let one = vec![part_file(NFTABLES_CONF, &parted_main(), None), part_file(ruleset_part(0), &a, None)];
        nft.apply(&one).unwrap();
        let a2 = format!("# p0\r\n{}", adds("src_ssh_1_v4", &["10.0.0.1", "10.0.0.2"]).replace('\n', "\r\n"));
        assert!(trellis_core::ruleset::check_part(&a2, "p0").is_err());
        assert!(nft.apply(&[one[0].clone(), part_file(ruleset_part(0), &a2, Some(&a))]).is_err());
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1"]);
        nft_in(ns, &["flush", "ruleset"]);
        assert!(nft.reconcile().unwrap(), "the last ruleset loaded is loaded again");
        assert_eq!(elements_in(ns, "src_ssh_1_v4"), ["10.0.0.1"]);
    }
}
