//! The agent's decisions as values: from a verified bundle, what the agent holds now and what it
//! observes of the host, the list of actions that bring the host to the bundle. Pure: no IO, no
//! clock; the executor (`exec`) carries the actions out.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use trellis_core::bundle::{Bundle, BundleFile};
use trellis_core::compile::{MESH_ZONE, NFTABLES_CONF, NODE_TOML, WIREGUARD_CONF};
use trellis_core::nodefile::{NodeFile, NodeFileError};
use trellis_core::wgconf::{PeerChanges, WgConf, WgPeer};

/// One step of bringing the host to a bundle, in the order the plan lists them: files first
/// (staged, then committed), then the network (WireGuard, routes, ruleset, forwarding, DNS,
/// handshake prompts).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Stage every file, commit them all, then remove the files the bundle no longer has.
    WriteFiles { files: Vec<BundleFile>, remove: Vec<String> },
    /// Turn on IPv4 and IPv6 forwarding: a hub relays between its overlay peers.
    EnableForwarding,
    /// Bring the interface to this configuration, with the relayed peers of `direct` tried at
    /// the endpoints their hubs observed (ADR 0032); with `observe` (a hub), report the
    /// endpoints its peers send from.
    /// `edit` is the changes of peers from the configuration the plan was made against, read from
    /// the regions of a delta's edits (ADR 0037): a backend that holds that configuration makes
    /// them without comparing ten thousand peers.
    ConfigureWireguard {
        interface: String,
        read: ConfRead,
        edit: Option<Arc<Edit>>,
        direct: Vec<trellis_core::paths::Candidate>,
        observe: bool,
    },
    /// Send these prefixes into the interface, and with `exit` the default route too (by policy
    /// routing in table `table`, as wg-quick does), removing what a previous bundle had that
    /// this one has not.
    ConfigureRoutes { interface: String, routes: Vec<ipnet::IpNet>, exit: Exit, table: u32 },
    /// Load the ruleset, `nftables.conf` and its parts one after the other (ADR 0044), in one
    /// transaction; a file that came as edits of the one held may be read by its regions.
    LoadRuleset { files: Vec<TextFile> },
    /// Serve the zone, `mesh.zone` and its parts one after the other (ADR 0043), on these
    /// addresses.
    ServeZone { files: Vec<TextFile>, origin: String, listen: Vec<SocketAddr> },
    /// Send one empty datagram through the interface to each of these overlay addresses, one
    /// per peer the interface just got or now dials at another endpoint: WireGuard starts the
    /// handshake at once, so whichever end comes up second completes it, and a first packet
    /// does not wait for the 5 s retry of an initiation that was lost (or that crossed the
    /// other end's) while the tunnel was not up on both ends.
    PromptHandshakes { interface: String, to: Vec<Prompt> },
}

/// One peer to prompt: its key (for the executor's follow-up, which restarts the handshake of a
/// peer still without one) and its own overlay address (where the datagram goes).
/// A file of the bundle that a delta built as edits of the file held (ADR 0035): the held content,
/// the new one, and the hunks where they differ. A reader that holds the old content (the ruleset
/// loaded, the zone served) reads only the regions around the hunks; one that does not reads the
/// new content whole.
#[derive(Clone, PartialEq, Eq)]
pub struct TextChange {
    /// The SHA-256 of `old`, as the held bundle names it.
    pub base: [u8; 32],
    pub old: bytes::Bytes,
    pub new: bytes::Bytes,
    pub hunks: Arc<[trellis_core::delta::Hunk]>,
}

impl TextChange {
    /// Whether this change brought `content` from the file whose SHA-256 is `base` (the same
    /// bytes in memory, then no comparison): only then are its hunks where the two differ.
    pub fn takes(&self, base: &[u8; 32], content: &bytes::Bytes) -> bool {
        self.base == *base && ((self.new.as_ptr() == content.as_ptr() && self.new.len() == content.len()) || self.new == *content)
    }
}

impl TextFile {
    /// Where this file differs from the one held (its SHA-256 `sha`, `held` bytes long): its
    /// change's hunks when it came as edits of that file, else the two whole, as one hunk.
    pub fn hunks_from(&self, sha: &[u8; 32], held: usize) -> std::borrow::Cow<'_, [trellis_core::delta::Hunk]> {
        match self.change.as_ref().filter(|c| c.takes(sha, &self.content)) {
            Some(c) => std::borrow::Cow::Borrowed(&c.hunks[..]),
            None => std::borrow::Cow::Owned(vec![trellis_core::delta::Hunk { old: 0..held, new: 0..self.content.len() }]),
        }
    }
}

/// Where line `line` (1-based) of a text made of `files` one after the other is: the file's path
/// and its line there (a line past the end is the last file's). `None` without files.
pub fn place_of<'f>(files: impl IntoIterator<Item = (&'f str, &'f [u8])>, line: usize) -> Option<(&'f str, usize)> {
    let mut first = 1;
    let mut last = None;
    for (path, content) in files {
        let lines = content.iter().filter(|&&b| b == b'\n').count();
        if line < first + lines {
            return Some((path, line + 1 - first));
        }
        last = Some((path, first));
        first += lines;
    }
    last.map(|(path, first)| (path, (line + 1).saturating_sub(first).max(1)))
}

impl std::fmt::Debug for TextChange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextChange {{ {} bytes to {} in {} hunks }}", self.old.len(), self.new.len(), self.hunks.len())
    }
}

#[cfg(test)]
impl TextChange {
    /// The change from `old` to `new` as a delta carries it: the edits the controller makes,
    /// rebuilt as the agent rebuilds them, with their hunks.
    pub fn between(old: &str, new: &str) -> TextChange {
        let edits = trellis_core::delta::edits(old.as_bytes(), new.as_bytes());
        let (built, hunks) = trellis_core::delta::rebuild_with_hunks(old.as_bytes(), &edits, new.len(), "f").expect("edits rebuild");
        assert_eq!(built, new.as_bytes());
        TextChange {
            base: BundleFile::new("f", 0o644, old.as_bytes().to_vec()).sha256,
            old: bytes::Bytes::copy_from_slice(old.as_bytes()),
            new: bytes::Bytes::copy_from_slice(new.as_bytes()),
            hunks: hunks.expect("the controller's edits copy in order").into(),
        }
    }
}

/// The files of a bundle known to have changed from the held ones in hunks only, by path.
pub type Changes = std::collections::HashMap<String, TextChange>;

/// One file of a text delivered in parts (the zone, ADR 0043; the ruleset, ADR 0044) as the
/// bundle has it, and, when it came as edits of the file held at its path, the change (ADR
/// 0035): the resolver serves the zone's files one after the other, the firewall loads the
/// ruleset's so, and each reads a change by the regions of the files that differ from those it
/// holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TextFile {
    pub path: String,
    pub sha256: [u8; 32],
    pub content: bytes::Bytes,
    pub change: Option<TextChange>,
}

/// A bundle's zone files as the resolver is given them: `mesh.zone`, then its parts by number
/// (ADR 0043), each with its change when it came as edits.
pub(crate) fn zone_of(bundle: &Bundle, changes: &Changes) -> Vec<TextFile> {
    in_parts(bundle, MESH_ZONE, trellis_core::plan::zone_part_index, changes)
}

/// A bundle's ruleset files as the firewall is given them: `nftables.conf`, then its parts by
/// number (ADR 0044), each with its change when it came as edits.
pub(crate) fn ruleset_of(bundle: &Bundle, changes: &Changes) -> Vec<TextFile> {
    in_parts(bundle, NFTABLES_CONF, trellis_core::plan::ruleset_part_index, changes)
}

/// The file `main` of a bundle and its parts by number (`part`), each with its change.
fn in_parts(bundle: &Bundle, main: &str, part: fn(&str) -> Option<usize>, changes: &Changes) -> Vec<TextFile> {
    let mut parts: Vec<(usize, &BundleFile)> = bundle.files.iter().filter_map(|f| Some((part(&f.path)?, f))).collect();
    parts.sort_by_key(|(i, _)| *i);
    file(bundle, main)
        .into_iter()
        .chain(parts.into_iter().map(|(_, f)| f))
        .map(|f| TextFile { path: f.path.clone(), sha256: f.sha256, content: f.content.clone(), change: changes.get(&f.path).cloned() })
        .collect()
}

/// The changes a delta's edits make to the files `previous` holds: each file edited from the one
/// held at its path (by its SHA-256), with the held content and the new one.
pub fn text_changes(previous: Option<&Bundle>, bundle: &Bundle, edited: &[trellis_core::bundle::Edited]) -> Changes {
    let Some(previous) = previous else { return Changes::new() };
    edited
        .iter()
        .filter_map(|e| {
            let old = file(previous, &e.path).filter(|f| f.sha256 == e.base)?;
            let new = file(bundle, &e.path)?;
            Some((e.path.clone(), TextChange { base: e.base, old: old.content.clone(), new: new.content.clone(), hunks: e.hunks.clone() }))
        })
        .collect()
}

/// A node's WireGuard configuration as read: `wireguard.conf`, and its parts of the peers when
/// it has them (ADR 0039), each by the SHA-256 of its text, and the configuration they make
/// together. A bundle holding the same file uses its read as it is, one holding edits of it reads
/// only their regions (ADR 0037), and a file not changed is not read at all.
#[derive(Clone, Debug)]
pub struct ConfRead {
    /// `wireguard.conf` first, then the parts in the order of their paths.
    pub files: Vec<FileRead>,
    conf: Arc<WgConf>,
}

/// One file of a node's WireGuard configuration, as read.
#[derive(Clone, Debug)]
pub struct FileRead {
    pub path: String,
    pub sha256: [u8; 32],
    pub file: Arc<trellis_core::wgconf::Read>,
    /// Its peers' keys (but for a `wireguard.conf` of more than `PARTS_FROM` peers, which has no
    /// parts beside it): whether a key a change touches is in another file too is a lookup in
    /// each (ADR 0039).
    keys: Option<Arc<std::collections::HashSet<String>>>,
}

impl FileRead {
    fn new(path: &str, sha256: [u8; 32], file: Arc<trellis_core::wgconf::Read>) -> FileRead {
        // A part holds a few hundred peers; `wireguard.conf` with more than `PARTS_FROM` is a node
        // without parts, whose changes are its own (no set needed).
        let peers = &file.conf.peers;
        let keys = (peers.len() <= trellis_core::plan::PARTS_FROM || path != WIREGUARD_CONF)
            .then(|| Arc::new(peers.iter().map(|p| p.public_key.clone()).collect()));
        FileRead { path: path.to_string(), sha256, file, keys }
    }

    /// Whether this file lists `key`.
    fn lists(&self, key: &str) -> bool {
        match &self.keys {
            Some(keys) => keys.contains(key),
            None => self.file.conf.peers.iter().any(|p| p.public_key == key),
        }
    }
}

impl ConfRead {
    pub fn conf(&self) -> &Arc<WgConf> {
        &self.conf
    }

    fn file(&self, path: &str) -> Option<&FileRead> {
        self.files.iter().find(|f| f.path == path)
    }
}

/// Two reads of the same texts are the same.
impl PartialEq for ConfRead {
    fn eq(&self, other: &Self) -> bool {
        self.files.len() == other.files.len() && self.files.iter().zip(&other.files).all(|(a, b)| a.path == b.path && a.sha256 == b.sha256)
    }
}
impl Eq for ConfRead {}

/// The changes of peers from one configuration to another, both as read: a backend holding
/// exactly `from` (the same value in memory) that is brought to exactly `to` makes `changes`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edit {
    pub from: Arc<WgConf>,
    pub to: Arc<WgConf>,
    pub changes: PeerChanges,
}

impl Edit {
    /// The changes, when this edit takes `current` to `conf`.
    pub fn between(&self, current: &Arc<WgConf>, conf: &Arc<WgConf>) -> Option<&PeerChanges> {
        (Arc::ptr_eq(&self.from, current) && Arc::ptr_eq(&self.to, conf)).then_some(&self.changes)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prompt {
    pub public_key: String,
    pub address: IpAddr,
}

/// Which families' default routes go through the overlay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exit {
    pub ipv4: bool,
    pub ipv6: bool,
}

impl Exit {
    pub fn any(self) -> bool {
        self.ipv4 || self.ipv6
    }
}

/// What the agent holds now: the bundle whose files are on disk (its version, content digest
/// and each file's path, SHA-256 and mode).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub version: u64,
    pub digest: [u8; 32],
    pub files: Vec<(String, [u8; 32], u32)>,
}

impl Held {
    pub fn of(bundle: &Bundle) -> Held {
        Held {
            version: bundle.version,
            digest: bundle.content_digest(),
            files: bundle.files.iter().map(|f| (f.path.clone(), f.sha256, f.mode)).collect(),
        }
    }

    /// Whether this file is held as it is: same path, content and mode.
    fn holds(&self, f: &BundleFile) -> bool {
        self.files.iter().any(|(path, sha256, mode)| *path == f.path && *sha256 == f.sha256 && *mode == f.mode)
    }
}

/// What the agent observes of the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// IPv4 and IPv6 forwarding are both on.
    pub forwarding: bool,
    /// Routes or an exit are installed by this agent.
    pub routing: bool,
    /// The version and content digest whose network configuration this process applied last,
    /// if it applied one and nothing failed since.
    pub network: Option<(u64, [u8; 32])>,
    /// The configuration this process last brought the interface to, if it did and nothing
    /// failed since: peers it already has at the same endpoint need no prompt.
    pub interface: Option<Arc<WgConf>>,
    /// The last `wireguard.conf` read (whatever became of its bundle): the same file, or edits of
    /// it, are read from it.
    pub read: Option<ConfRead>,
}

/// What this agent manages, from its options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// Files only: no forwarding, interface, ruleset or DNS.
    pub files_only: bool,
    /// Whether the agent manages the WireGuard interface (and so the DNS on its addresses).
    pub wireguard: bool,
    pub dns_port: u16,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("the bundle has no etc/trellis/node.toml")]
    NoSettings,
    #[error("node.toml is not UTF-8")]
    SettingsNotUtf8,
    #[error("{0}")]
    Settings(NodeFileError),
    #[error("{0} is not UTF-8")]
    ConfNotUtf8(String),
    #[error("{0}")]
    Conf(String),
}

fn file<'a>(bundle: &'a Bundle, path: &str) -> Option<&'a BundleFile> {
    bundle.files.iter().find(|f| f.path == path)
}

fn settings(bundle: &Bundle) -> Result<NodeFile, PlanError> {
    let f = file(bundle, NODE_TOML).ok_or(PlanError::NoSettings)?;
    NodeFile::parse(std::str::from_utf8(&f.content).map_err(|_| PlanError::SettingsNotUtf8)?).map_err(PlanError::Settings)
}

/// The actions that bring the host from what it holds to `bundle`. Only the files that differ
/// from what is held are written (ADR 0033: a one-peer change does not rewrite the CA). A
/// re-delivery of what is held, with its network configuration in place, is no action at all;
/// what is held but not yet applied to the network (after a restart, or a failure) gets the
/// network actions only.
pub fn plan(bundle: &Bundle, held: &Held, observed: &Observed, scope: &Scope, changes: &Changes) -> Result<Vec<Action>, PlanError> {
    let digest = bundle.content_digest();
    let same = held.version == bundle.version && held.digest == digest;
    let mut actions = Vec::new();
    if !same {
        let remove = held.files.iter().filter(|(p, ..)| file(bundle, p).is_none()).map(|(p, ..)| p.clone()).collect();
        let files = bundle.files.iter().filter(|f| !held.holds(f)).cloned().collect();
        actions.push(Action::WriteFiles { files, remove });
    }
    check_parts(bundle, held)?;
    let network = network(bundle, observed, scope, changes)?;
    if !(same && observed.network == Some((bundle.version, digest))) {
        actions.extend(network);
    }
    Ok(actions)
}

/// The network half of a plan: forwarding for a hub, the interface, the ruleset, the zone.
fn network(bundle: &Bundle, observed: &Observed, scope: &Scope, changes: &Changes) -> Result<Vec<Action>, PlanError> {
    let settings = settings(bundle)?;
    let conf = read_conf(bundle, observed.read.as_ref(), changes)?;
    if scope.files_only {
        return Ok(Vec::new());
    }
    let mut actions = Vec::new();
    let mut listen = Vec::new();
    let mut prompt = None;
    if let (Some((read, edit)), true) = (conf, scope.wireguard) {
        let conf = read.conf();
        // The zone is served on the overlay addresses of the interface the agent manages.
        listen = conf
            .addresses
            .iter()
            .filter_map(|a| a.split('/').next().and_then(|ip| ip.parse::<IpAddr>().ok()))
            .map(|ip| SocketAddr::new(ip, scope.dns_port))
            .collect();
        // The exit's default prefixes in this node's peer list say which families leave by it.
        let exit = Exit {
            ipv4: settings.exit && conf.peers.iter().any(|p| p.allowed_ips.iter().any(|a| a == "0.0.0.0/0")),
            ipv6: settings.exit && conf.peers.iter().any(|p| p.allowed_ips.iter().any(|a| a == "::/0")),
        };
        let table = u32::from(conf.listen_port.unwrap_or(trellis_core::decl::DEFAULT_PORT));
        let to = match (&edit, observed.interface.as_ref()) {
            (Some(e), Some(before)) if Arc::ptr_eq(&e.from, before) => prompts_of(conf, &e.changes),
            _ => prompts(conf, observed.interface.as_deref()),
        };
        if !to.is_empty() {
            prompt = Some(Action::PromptHandshakes { interface: settings.interface.clone(), to });
        }
        // Direct paths are an optimisation: a paths.toml this agent cannot read (a newer
        // controller's, say) leaves every pair on its hub, and the rest of the bundle applies.
        let direct = match file(bundle, trellis_core::plan::PATHS_TOML) {
            Some(f) => match std::str::from_utf8(&f.content)
                .map_err(|_| "paths.toml is not UTF-8".to_string())
                .and_then(trellis_core::paths::parse)
            {
                Ok(list) => list,
                Err(e) => {
                    tracing::warn!("{e}; every relayed peer stays on its hub");
                    Vec::new()
                }
            },
            None => Vec::new(),
        };
        actions.push(Action::ConfigureWireguard {
            interface: settings.interface.clone(),
            read,
            edit: edit.map(Arc::new),
            direct,
            observe: settings.hub,
        });
        if !settings.routes.is_empty() || exit.any() || observed.routing {
            actions.push(Action::ConfigureRoutes { interface: settings.interface.clone(), routes: settings.routes.clone(), exit, table });
        }
    }
    if file(bundle, NFTABLES_CONF).is_some() {
        actions.push(Action::LoadRuleset { files: ruleset_of(bundle, changes) });
    }
    // Forwarding goes on once the filter that says what may be forwarded is loaded.
    if (settings.hub || settings.router) && !observed.forwarding {
        actions.push(Action::EnableForwarding);
    }
    if file(bundle, MESH_ZONE).is_some() && !listen.is_empty() {
        actions.push(Action::ServeZone { files: zone_of(bundle, changes), origin: settings.zone, listen });
    }
    // Last, once the filter that guards the tunnel is loaded and everything else is in place.
    actions.extend(prompt);
    Ok(actions)
}

/// Refuses a bundle whose zone or ruleset has parts (ADR 0043, 0044) without its `mesh.zone` or
/// `nftables.conf`, or after one whose last line is not ended, or a part not held as it is that
/// holds anything but ended lines of address records (the zone) or of elements added to the
/// table's sets (the ruleset), naming the part and its line.
fn check_parts(bundle: &Bundle, held: &Held) -> Result<(), PlanError> {
    type Check = fn(&str, &str) -> Result<(), String>;
    type PartOf = fn(&str) -> Option<usize>;
    let kinds: [(&str, PartOf, Check); 2] = [
        (MESH_ZONE, trellis_core::plan::zone_part_index, trellis_core::zone::check_part),
        (NFTABLES_CONF, trellis_core::plan::ruleset_part_index, trellis_core::ruleset::check_part),
    ];
    for (main, part, check) in kinds {
        let mut parts = bundle.files.iter().filter(|f| part(&f.path).is_some()).peekable();
        if let Some(f) = parts.peek() {
            // The parts follow the main file's last line: it must be ended.
            match file(bundle, main) {
                None => return Err(PlanError::Conf(format!("the bundle has {} but no {main}", f.path))),
                Some(m) if !m.content.ends_with(b"\n") => {
                    return Err(PlanError::Conf(format!("{main} has parts and its last line is not ended (a newline)")))
                }
                Some(_) => {}
            }
        }
        for f in parts.filter(|f| !held.holds(f)) {
            let text = std::str::from_utf8(&f.content).map_err(|_| PlanError::ConfNotUtf8(f.path.clone()))?;
            check(text, &f.path).map_err(PlanError::Conf)?;
        }
    }
    Ok(())
}

/// A node's WireGuard configuration read from the bundle's `wireguard.conf` and parts: the read
/// held when every file is that very file (with an edit that changes nothing); else each file
/// the held read has as it is, a file that came as edits of the held one by the regions of its
/// edits (ADR 0037), any other whole; with the changes of peers from the held configuration when
/// each file changed gave them. `None` when the bundle has no `wireguard.conf`.
fn read_conf(bundle: &Bundle, held: Option<&ConfRead>, changes: &Changes) -> Result<Option<(ConfRead, Option<Edit>)>, PlanError> {
    let mut parts: Vec<(usize, &BundleFile)> =
        bundle.files.iter().filter_map(|f| Some((trellis_core::plan::part_index(&f.path)?, f))).collect();
    let Some(main) = file(bundle, WIREGUARD_CONF) else {
        return match parts.first() {
            Some((_, f)) => Err(PlanError::Conf(format!("the bundle has {} but no {WIREGUARD_CONF}", f.path))),
            None => Ok(None),
        };
    };
    parts.sort_by_key(|(i, _)| *i);
    let files: Vec<&BundleFile> = std::iter::once(main).chain(parts.into_iter().map(|(_, f)| f)).collect();
    if let Some(h) =
        held.filter(|h| h.files.len() == files.len() && h.files.iter().zip(&files).all(|(r, f)| r.path == f.path && r.sha256 == f.sha256))
    {
        let edit = Edit { from: h.conf().clone(), to: h.conf().clone(), changes: PeerChanges::default() };
        return Ok(Some((h.clone(), Some(edit))));
    }
    let mut read = Vec::with_capacity(files.len());
    // The changes of peers file by file, while every file changed gives them.
    let mut found: Option<Vec<PeerChanges>> = held.map(|_| Vec::new());
    for f in files {
        let before = held.and_then(|h| h.file(&f.path));
        if let Some(b) = before.filter(|b| b.sha256 == f.sha256) {
            read.push(b.clone());
            continue;
        }
        let (file, changed) = read_file(f, before, changes.get(&f.path))?;
        // A part read whole is compared with the part held by key (a few hundred peers at most);
        // `wireguard.conf` read whole, with peers, is left to the interface's own comparison.
        let held_peers = before.map_or(&[][..], |b| &b.file.conf.peers[..]);
        let by_key = f.path != WIREGUARD_CONF || (held_peers.is_empty() && file.conf.peers.is_empty());
        found = found.and_then(|mut v| {
            v.push(changed.or_else(|| by_key.then(|| trellis_core::wgconf::changes(held_peers, &file.conf.peers)))?);
            Some(v)
        });
        read.push(FileRead::new(&f.path, f.sha256, file));
    }
    let conf = match &read[..] {
        [one] => one.file.conf.clone(),
        [main, ..] => Arc::new(WgConf {
            addresses: main.file.conf.addresses.clone(),
            listen_port: main.file.conf.listen_port,
            mtu: main.file.conf.mtu,
            peers: read.iter().flat_map(|r| r.file.conf.peers.iter().cloned()).collect(),
        }),
        [] => unreachable!("wireguard.conf is first"),
    };
    let edit = match (held, found) {
        (Some(h), Some(mut per_file)) => {
            // The peers of a part the bundle no longer has are gone.
            for gone in h.files.iter().filter(|g| !read.iter().any(|r| r.path == g.path)) {
                per_file.push(PeerChanges { gone: gone.file.conf.peers.clone(), changed: Vec::new() });
            }
            let single = read.len() == 1 && h.files.len() == 1;
            (single || once_each(&per_file, &h.files, &read)).then(|| merge(per_file)).map(|changes| Edit {
                from: h.conf().clone(),
                to: conf.clone(),
                changes,
            })
        }
        _ => None,
    };
    Ok(Some((ConfRead { files: read, conf }, edit)))
}

/// One file of the WireGuard configuration read: by the regions of its edits when it came as
/// edits of the file held at its path (with the changes of peers they make), whole otherwise.
fn read_file(
    f: &BundleFile,
    before: Option<&FileRead>,
    change: Option<&TextChange>,
) -> Result<(Arc<trellis_core::wgconf::Read>, Option<PeerChanges>), PlanError> {
    if let Some(b) = before {
        if let Some(c) = change.filter(|c| c.takes(&b.sha256, &f.content)) {
            if let Some((read, changes)) = b.file.edit(&c.old, &c.new, &c.hunks) {
                return Ok((Arc::new(read), Some(changes)));
            }
        }
    }
    let text = std::str::from_utf8(&f.content).map_err(|_| PlanError::ConfNotUtf8(f.path.clone()))?;
    let read = match f.path == WIREGUARD_CONF {
        true => trellis_core::wgconf::read(text),
        false => trellis_core::wgconf::read_part(text, &f.path),
    };
    Ok((Arc::new(read.map_err(PlanError::Conf)?), None))
}

/// Whether every key the files' changes touch is listed once in all of `before` and once in all
/// of `after`, and each file read anew lists each of its keys once: only then are the changes of
/// the files the changes of the configuration. A key in two files (a bundle the compiler never
/// makes, but one a signed bundle may hold) leaves the comparison to the interface. A lookup per
/// touched key in each file, not a pass over every peer.
fn once_each(per_file: &[PeerChanges], before: &[FileRead], after: &[FileRead]) -> bool {
    if !after.iter().all(|f| f.file.plain()) {
        return false;
    }
    let touched: std::collections::HashSet<&str> =
        per_file.iter().flat_map(|c| c.gone.iter().chain(c.changed.iter().map(|(p, _)| p))).map(|p| p.public_key.as_str()).collect();
    touched.iter().all(|k| before.iter().filter(|f| f.lists(k)).count() <= 1 && after.iter().filter(|f| f.lists(k)).count() <= 1)
}

/// The changes of peers of several files as one, each key in one file before and one after
/// (`once_each`): a key gone from one file and new in another (a part the peer's name moved to)
/// is changed, or nothing when it is the same peer.
fn merge(per_file: Vec<PeerChanges>) -> PeerChanges {
    let mut gone: std::collections::HashMap<&str, &Arc<WgPeer>> =
        per_file.iter().flat_map(|c| &c.gone).map(|p| (p.public_key.as_str(), p)).collect();
    let mut changed = Vec::new();
    for (p, before) in per_file.iter().flat_map(|c| &c.changed) {
        match (before, gone.remove(p.public_key.as_str())) {
            (None, Some(moved)) if moved == p => {}
            (None, Some(moved)) => changed.push((p.clone(), Some(moved.clone()))),
            (before, _) => changed.push((p.clone(), before.clone())),
        }
    }
    let gone = per_file.iter().flat_map(|c| &c.gone).filter(|p| gone.contains_key(p.public_key.as_str())).cloned().collect();
    PeerChanges { gone, changed }
}

/// The prompts of [`prompts`] from the changes of an edit of the interface's configuration: each
/// peer new or changed that this node dials, unless it was dialled at the same endpoint before.
fn prompts_of(conf: &WgConf, changes: &PeerChanges) -> Vec<Prompt> {
    let overlay = overlay_of(conf);
    changes
        .changed
        .iter()
        .filter(|(p, before)| p.endpoint.is_some() && before.as_ref().is_none_or(|b| b.endpoint != p.endpoint))
        .filter_map(|(p, _)| Some(Prompt { public_key: p.public_key.clone(), address: overlay_address(&p.allowed_ips, &overlay)? }))
        .collect()
}

/// The overlay address of every peer to prompt: each peer this node dials (it has an
/// `Endpoint`) that the interface `before` did not have, or had at another endpoint; every
/// peer it dials when the interface is new or made again (other addresses, port or MTU: the
/// backends make it anew, without sessions). A peer that dials this node is left to do so.
fn prompts(conf: &WgConf, before: Option<&WgConf>) -> Vec<Prompt> {
    let before = before.filter(|b| b.addresses == conf.addresses && b.listen_port == conf.listen_port && b.mtu == conf.mtu);
    // By key, through a map: ten thousand peers compared with ten thousand cost a change 100 ms.
    let endpoints: std::collections::HashMap<&str, Option<std::net::SocketAddr>> =
        before.iter().flat_map(|b| b.peers.iter().map(|o| (o.public_key.as_str(), o.endpoint))).collect();
    let held = |p: &WgPeer| endpoints.get(p.public_key.as_str()).is_some_and(|e| *e == p.endpoint);
    let overlay = overlay_of(conf);
    conf.peers
        .iter()
        .filter(|p| p.endpoint.is_some() && !held(p))
        .filter_map(|p| Some(Prompt { public_key: p.public_key.clone(), address: overlay_address(&p.allowed_ips, &overlay)? }))
        .collect()
}

/// The prompt of each peer named in `keys` that this node dials (it has an `Endpoint`), at its
/// own overlay address.
pub(crate) fn prompts_for(conf: &WgConf, keys: &[String]) -> Vec<Prompt> {
    if keys.is_empty() {
        return Vec::new();
    }
    let keys: std::collections::HashSet<&str> = keys.iter().map(String::as_str).collect();
    let overlay = overlay_of(conf);
    conf.peers
        .iter()
        .filter(|p| p.endpoint.is_some() && keys.contains(p.public_key.as_str()))
        .filter_map(|p| Some(Prompt { public_key: p.public_key.clone(), address: overlay_address(&p.allowed_ips, &overlay)? }))
        .collect()
}

/// The overlay the interface's addresses span (`overlay_address`).
pub(crate) fn overlay_of(conf: &WgConf) -> Vec<ipnet::IpNet> {
    conf.addresses.iter().filter_map(|a| a.parse().ok()).collect()
}

/// A peer's own overlay address, from its AllowedIPs: the first of them (`render` writes the
/// peer's own addresses first, then the nodes a hub relays for and routes), if it is a single
/// address inside `overlay`. Never a route's prefix or an exit's default, so a prompt or a probe
/// goes to the peer itself and nowhere else.
pub(crate) fn overlay_address(allowed_ips: &[String], overlay: &[ipnet::IpNet]) -> Option<IpAddr> {
    let first: ipnet::IpNet = allowed_ips.first()?.parse().ok()?;
    let single = first.prefix_len() == first.max_prefix_len();
    (single && overlay.iter().any(|net| net.contains(&first.addr()))).then(|| first.addr())
}

#[cfg(test)]
mod tests {
    /// A line of files one after the other is named by its file and its line there; a line past
    /// the end by the last file.
    #[test]
    fn a_line_of_files_one_after_the_other_is_named_by_its_file() {
        let files = [("a", &b"1\n2\n"[..]), ("b", &b""[..]), ("c", &b"3\n4\n5\n"[..])];
        let at = |line| super::place_of(files.iter().copied(), line);
        assert_eq!([at(1), at(2), at(3), at(5), at(9)], [Some(("a", 1)), Some(("a", 2)), Some(("c", 1)), Some(("c", 3)), Some(("c", 7))]);
        assert_eq!(super::place_of(std::iter::empty(), 1), None);
    }

    use super::*;

    const A: &str = "YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE=";
    const B: &str = "YmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmI=";
    const C: &str = "Y2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2M=";

    fn peer(key: &str, endpoint: Option<&str>, allowed: &[&str]) -> WgPeer {
        WgPeer {
            public_key: key.into(),
            allowed_ips: allowed.iter().map(|a| a.to_string()).collect(),
            endpoint: endpoint.map(|e| e.parse().unwrap()),
            keepalive: None,
        }
    }

    fn conf(peers: Vec<WgPeer>) -> WgConf {
        WgConf {
            addresses: vec!["10.88.0.5/16".into(), "fd88::5/64".into()],
            listen_port: Some(51820),
            mtu: None,
            peers: peers.into_iter().map(Arc::new).collect(),
        }
    }

    /// A bundle of `wireguard.conf` (the interface) and these parts, each a list of (key, the
    /// last byte of its address).
    fn parted(parts: &[(usize, &[(&str, u8)])]) -> Bundle {
        let mut files = vec![BundleFile::new(WIREGUARD_CONF, 0o600, b"[Interface]\nAddress = 10.88.0.5/16\n".to_vec())];
        for (i, peers) in parts {
            let text: String = peers.iter().map(|(k, ip)| format!("[Peer]\nPublicKey = {k}\nAllowedIPs = 10.88.0.{ip}/32\n")).collect();
            files.push(BundleFile::new(trellis_core::plan::wireguard_part(*i), 0o600, text.into_bytes()));
        }
        Bundle { mesh: "m".into(), node: "n".into(), version: 1, issued_at: 1, files }
    }

    /// The review of ADR 0039's change: a key in two files made the edit wrong (a peer removed
    /// that the new files still list, a peer already held taken for a new one, a move matched
    /// against the wrong copy). Such a bundle has no edit: the interface compares by key. A key
    /// in one file has one, and a part without `wireguard.conf` is refused.
    #[test]
    fn a_key_in_two_parts_leaves_the_changes_to_the_interface() {
        let edit = |before: &Bundle, after: &Bundle| {
            let (held, _) = read_conf(before, None, &Changes::new()).unwrap().unwrap();
            let (read, edit) = read_conf(after, Some(&held), &Changes::new()).unwrap().unwrap();
            let whole: Vec<String> = after
                .files
                .iter()
                .flat_map(|f| {
                    let text = std::str::from_utf8(&f.content).unwrap();
                    let r = if f.path == WIREGUARD_CONF {
                        trellis_core::wgconf::read(text)
                    } else {
                        trellis_core::wgconf::read_part(text, &f.path)
                    };
                    r.unwrap().conf.peers.iter().map(|p| p.public_key.clone()).collect::<Vec<_>>()
                })
                .collect();
            let merged: Vec<String> = read.conf().peers.iter().map(|p| p.public_key.clone()).collect();
            assert_eq!(merged, whole, "the parts read together are the whole read");
            edit.map(|e| {
                let letter = |k: &str| [(A, "A"), (B, "B"), (C, "C")].iter().find(|(key, _)| *key == k).map_or("?", |(_, l)| *l);
                let keys = |v: Vec<&Arc<WgPeer>>| v.iter().map(|p| letter(&p.public_key)).collect::<Vec<_>>().join(",");
                format!(
                    "gone {} changed {}",
                    keys(e.changes.gone.iter().collect()),
                    keys(e.changes.changed.iter().map(|(p, _)| p).collect())
                )
            })
        };
        // K in parts 3 and 40; J goes from 7, K from 40: K is still in 3.
        let before = parted(&[(3, &[(A, 1)]), (7, &[(B, 2)]), (40, &[(A, 1)])]);
        assert_eq!(edit(&before, &parted(&[(3, &[(A, 1)])])), None);
        // K held in 3, and 12 gains it with other addresses.
        let before = parted(&[(3, &[(A, 1)])]);
        assert_eq!(edit(&before, &parted(&[(3, &[(A, 1)]), (12, &[(A, 9)])])), None);
        // K in 7 and 40; 7 goes and 3 gains it: which copy moved is not known.
        let before = parted(&[(7, &[(A, 1)]), (40, &[(A, 3)])]);
        assert_eq!(edit(&before, &parted(&[(3, &[(A, 2)]), (40, &[(A, 3)])])), None);
        // Each key in one file: a move as it was is no change, a new peer and a gone one are.
        let before = parted(&[(7, &[(A, 1), (B, 2)])]);
        assert_eq!(edit(&before, &parted(&[(3, &[(A, 1)]), (7, &[(C, 3)])])).as_deref(), Some("gone B changed C"));
        // Parts without wireguard.conf.
        let mut odd = parted(&[(3, &[(A, 1)])]);
        odd.files.remove(0);
        let e = read_conf(&odd, None, &Changes::new()).unwrap_err().to_string();
        assert_eq!(e, "the bundle has etc/trellis/wireguard.d/peers-03.conf but no etc/trellis/wireguard.conf");
    }

    /// The prompts the plan makes for `after` when the interface holds `before`.
    fn check(before: Option<&WgConf>, after: &WgConf, expect: &[&str]) {
        let expect: Vec<IpAddr> = expect.iter().map(|a| a.parse().unwrap()).collect();
        let to: Vec<IpAddr> = prompts(after, before).iter().map(|p| p.address).collect();
        assert_eq!(to, expect, "before {before:?}\nafter {after:?}");
        for p in prompts(after, before) {
            let peer = after.peers.iter().find(|peer| peer.public_key == p.public_key).expect("the prompt names a peer");
            assert!(peer.allowed_ips[0].starts_with(&p.address.to_string()), "{p:?} is {peer:?}'s own address");
        }
    }

    #[test]
    fn a_new_peer_or_a_changed_endpoint_is_prompted_and_an_unchanged_peer_is_not() {
        let a = peer(A, Some("192.0.2.11:51820"), &["10.88.0.6/32", "fd88::6/128"]);
        let b = peer(B, Some("192.0.2.12:51820"), &["10.88.0.7/32"]);
        let held = conf(vec![a.clone()]);
        // A fresh interface: every peer it dials.
        check(None, &held, &["10.88.0.6"]);
        check(Some(&held), &held, &[]);
        // B is new; A is as it was (its allowed IPs may change: its session stays).
        let mut a_more = a.clone();
        a_more.allowed_ips.push("10.88.0.9/32".into());
        check(Some(&held), &conf(vec![a_more, b.clone()]), &["10.88.0.7"]);
        // A is dialled at another endpoint.
        let moved = peer(A, Some("198.51.100.11:51820"), &["10.88.0.6/32", "fd88::6/128"]);
        check(Some(&held), &conf(vec![moved.clone(), b.clone()]), &["10.88.0.6", "10.88.0.7"]);
        // A re-keyed peer is a new peer.
        check(Some(&held), &conf(vec![peer(C, a.endpoint.map(|e| e.to_string()).as_deref(), &["10.88.0.6/32"])]), &["10.88.0.6"]);
        // The interface made again (another port): it has no sessions left.
        let mut other_port = conf(vec![a.clone(), b.clone()]);
        other_port.listen_port = Some(51821);
        check(Some(&conf(vec![a, b])), &other_port, &["10.88.0.6", "10.88.0.7"]);
    }

    #[test]
    fn only_a_dialled_peers_own_overlay_address_is_prompted() {
        // A peer that dials this node (no endpoint) is left to do so.
        check(None, &conf(vec![peer(A, None, &["10.88.0.6/32"])]), &[]);
        // A route's prefix, an exit's default, a relayed node's address outside the overlay:
        // never a target. An IPv6-only peer is prompted at its IPv6 address.
        check(
            None,
            &conf(vec![
                peer(A, Some("192.0.2.11:51820"), &["192.168.10.0/24", "10.88.0.6/32"]),
                peer(B, Some("192.0.2.12:51820"), &["0.0.0.0/0", "::/0"]),
                peer(C, Some("192.0.2.13:51820"), &["10.89.0.7/32"]),
            ]),
            &[],
        );
        check(None, &conf(vec![peer(A, Some("[2001:db8::11]:51820"), &["fd88::6/128", "10.88.0.6/32"])]), &["fd88::6"]);
    }
}
