//! The host side effects, each behind a narrow trait with one implementation per backend:
//! files (atomic, staged), WireGuard (the kernel module or the embedded boringtun through
//! defguard_wireguard_rs, the embedded gotatun: `crate::gotatun`, or a `wireguard-go` process:
//! `crate::wggo`), nftables (its library in the agent's helper process, `crate::nfthelper`, or
//! `nft -f`), IP
//! forwarding (`/proc/sys`) and handshake prompts (datagrams bound to the interface); the zone's
//! server is `crate::dns`, routes `crate::routes`. The executor talks only to the traits.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};
use trellis_core::bundle::BundleFile;
use trellis_core::wgconf::WgConf;
use trellis_files::beneath::Beneath;

use crate::status::PeerState;

// --- files -----------------------------------------------------------------------------------

/// What happened to one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOutcome {
    pub path: String,
    pub sha256: String,
    pub result: trellis_proto::FileResult,
}

/// Writes a bundle's files under a root: every file staged (temporary file in the same
/// directory, final mode from creation, written, fsynced) before any is committed (renamed into
/// place, directory fsynced). A crash leaves each file old or new, never a mix.
pub trait FileWriter {
    fn write_all(&mut self, files: &[BundleFile], dropped: &[String]) -> Result<Vec<FileOutcome>>;
}

pub struct DiskWriter {
    pub root: PathBuf,
}

impl DiskWriter {
    /// Where a bundle's file goes: only a file trellis delivers (the verifier has refused any
    /// other already; this holds even for a caller that did not verify), as (its directory, its
    /// name).
    fn split(rel: &str) -> Result<(&str, &str)> {
        if !trellis_core::bundle::safe_path(rel) {
            bail!("refusing to write {rel:?}: it is not one of the files trellis delivers");
        }
        Ok(rel.rsplit_once('/').unwrap_or(("", rel)))
    }

    /// The directory a file goes in, opened under the root without following a symbolic link in
    /// any component (a linked `etc/trellis` would have the agent write wherever the link
    /// points), once per directory.
    fn dir(&self, dirs: &mut Vec<(String, Beneath)>, rel: &str, dir: &str) -> Result<usize> {
        if let Some(i) = dirs.iter().position(|(d, _)| d == dir) {
            return Ok(i);
        }
        let opened = Beneath::open(&self.root, dir, true).map_err(|e| anyhow::anyhow!("refusing to write {rel}: {e}"))?;
        dirs.push((dir.to_string(), opened));
        Ok(dirs.len() - 1)
    }
}

impl DiskWriter {
    /// Stages every file that differs from what is on disk (a file already as the bundle has it
    /// is `Unchanged`), noting what it staged in `staged` as it goes.
    fn stage_all(
        &self,
        files: &[BundleFile],
        dirs: &mut Vec<(String, Beneath)>,
        staged: &mut Vec<(usize, String, String)>,
        outcomes: &mut Vec<FileOutcome>,
    ) -> Result<()> {
        let mut unsynced: Vec<(PathBuf, std::fs::File)> = Vec::new();
        for f in files {
            let (dir_rel, name) = Self::split(&f.path)?;
            let d = self.dir(dirs, &f.path, dir_rel)?;
            let dir = &dirs[d].1;
            if dir.is_link(name) {
                bail!("refusing to write {}: {} is a symbolic link, which is never followed", f.path, dir.path().join(name).display());
            }
            let sha = hex::encode(f.sha256);
            if dir.holds(name, &f.content, f.mode) {
                outcomes.push(FileOutcome { path: f.path.clone(), sha256: sha, result: trellis_proto::FileResult::Unchanged });
                continue;
            }
            let (tmp, file) = dir.stage_unsynced(name, &f.content, f.mode)?;
            staged.push((d, tmp, name.to_string()));
            unsynced.push((dir.path().join(&staged.last().expect("staged").1), file));
            outcomes.push(FileOutcome { path: f.path.clone(), sha256: sha, result: trellis_proto::FileResult::Written });
        }
        // Synced at once, before any is committed: a crash leaves the old files or the new ones.
        std::thread::scope(|s| {
            let syncs: Vec<_> = unsynced.iter().map(|(path, file)| s.spawn(move || file.sync_all().map_err(|e| (path, e)))).collect();
            syncs.into_iter().try_for_each(|t| t.join().expect("a sync thread panicked"))
        })
        .map_err(|(path, e)| anyhow::anyhow!("cannot sync {}: {e}", path.display()))?;
        Ok(())
    }
}

impl FileWriter for DiskWriter {
    fn write_all(&mut self, files: &[BundleFile], dropped: &[String]) -> Result<Vec<FileOutcome>> {
        let mut outcomes = Vec::new();
        let mut dirs: Vec<(String, Beneath)> = Vec::new();
        // (directory index, staged name, final name)
        let mut staged: Vec<(usize, String, String)> = Vec::new();
        // Everything is staged before anything is committed. On any failure (a full disk) the
        // staged files go and the old ones stay; discarding one already committed does nothing.
        let written = self
            .stage_all(files, &mut dirs, &mut staged, &mut outcomes)
            .and_then(|()| staged.iter().try_for_each(|(d, tmp, name)| Ok(dirs[*d].1.commit(tmp, name)?)));
        if let Err(e) = written {
            for (d, tmp, _) in &staged {
                dirs[*d].1.discard(tmp);
            }
            return Err(e);
        }
        for (_, dir) in &dirs {
            dir.sync();
        }
        for path in dropped {
            let (dir_rel, name) = Self::split(path)?;
            let dir = match Beneath::open(&self.root, dir_rel, false) {
                Ok(d) => d,
                // No directory, no file to remove.
                Err(e) if e.source.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("cannot remove {path}")),
            };
            if dir.remove(name)? {
                outcomes.push(FileOutcome { path: path.clone(), sha256: String::new(), result: trellis_proto::FileResult::Removed });
            }
        }
        Ok(outcomes)
    }
}

// --- WireGuard -------------------------------------------------------------------------------

pub trait Wireguard {
    /// Brings the interface to this configuration: created on first use, peers changed in place.
    fn apply(&mut self, conf: &WgConf, private_key: &str) -> Result<()>;
    fn peers(&self) -> Result<Vec<PeerState>>;
    fn describe(&self) -> String;
    /// Removes these peers and adds them again as configured, so that the next packet to each
    /// starts a handshake now. Every backend sends at most one initiation per peer in WireGuard's
    /// 5 s rekey timeout: one the other end dropped (it did not have this node yet) is otherwise
    /// retried only then. A peer that has a session must not be named (it loses the session).
    fn restart_handshakes(&self, public_keys: &[String]) -> Result<()>;
    /// The peers the last `apply` removed and added again to change them (their sessions gone),
    /// taken: the executor prompts those this node dials, so that traffic resumes now, not when
    /// the peer's session would have been renewed (minutes; 25 s with a keepalive).
    fn take_sessions_dropped(&mut self) -> Vec<String> {
        Vec::new()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WgMode {
    /// The kernel module where it exists, else a `wireguard-go` found on PATH, else the embedded gotatun
    Auto,
    /// The kernel module (fails where it is missing)
    Kernel,
    /// A `wireguard-go` found on PATH, run as the agent's child and driven through its UAPI socket
    WireguardGo,
    /// The embedded userspace boringtun: a TUN device served by the agent process itself
    #[value(alias = "userspace")]
    Boringtun,
    /// The embedded userspace GotaTun (Mullvad's boringtun fork): a TUN device served by the agent process itself
    Gotatun,
    /// Leave the WireGuard interface alone (managed elsewhere)
    None,
}

impl WgMode {
    /// Refuses, in one sentence, a backend this host cannot run, before anything is applied.
    pub fn check(self) -> Result<()> {
        if self == WgMode::WireguardGo && crate::wggo::find().is_none() {
            bail!(crate::wggo::MISSING);
        }
        Ok(())
    }
}

pub struct Defguard<T> {
    ifname: String,
    api: Option<defguard_wireguard_rs::WGApi<T>>,
    current: Option<WgConf>,
    backend: &'static str,
    /// The peers the last apply removed and added again (see `take_sessions_dropped`).
    dropped: Vec<String>,
}

/// What changes from the peers `old` to `new`: the peers gone, and each peer new or changed with
/// the peer of its key before, if there was one. By key, through maps: an operator's node has
/// ten thousand peers, and comparing every peer with every other took 300 ms of a one-peer
/// change (`trellis-dev bench agent`).
pub struct PeerChanges<'a> {
    pub gone: Vec<&'a trellis_core::wgconf::WgPeer>,
    pub changed: Vec<(&'a trellis_core::wgconf::WgPeer, Option<&'a trellis_core::wgconf::WgPeer>)>,
}

pub fn peer_changes<'a>(old: &'a [trellis_core::wgconf::WgPeer], new: &'a [trellis_core::wgconf::WgPeer]) -> PeerChanges<'a> {
    use std::collections::HashMap;
    let before: HashMap<&str, &trellis_core::wgconf::WgPeer> = old.iter().map(|p| (p.public_key.as_str(), p)).collect();
    let after: std::collections::HashSet<&str> = new.iter().map(|p| p.public_key.as_str()).collect();
    PeerChanges {
        gone: old.iter().filter(|o| !after.contains(o.public_key.as_str())).collect(),
        changed: new
            .iter()
            .filter_map(|n| match before.get(n.public_key.as_str()) {
                Some(o) if *o == n => None,
                o => Some((n, o.copied())),
            })
            .collect(),
    }
}

fn dg_peer(p: &trellis_core::wgconf::WgPeer) -> Result<defguard_wireguard_rs::peer::Peer> {
    use defguard_wireguard_rs::{key::Key, net::IpAddrMask, peer::Peer};
    let key = Key::from_str(&p.public_key).map_err(|e| anyhow::anyhow!("peer key {}: {e}", p.public_key))?;
    let mut peer = Peer::new(key);
    peer.endpoint = p.endpoint;
    peer.persistent_keepalive_interval = p.keepalive;
    for a in &p.allowed_ips {
        peer.allowed_ips.push(IpAddrMask::from_str(a).map_err(|e| anyhow::anyhow!("allowed IP {a}: {e}"))?);
    }
    Ok(peer)
}

macro_rules! defguard_backend {
    ($t:ty, $name:expr) => {
        impl Defguard<$t> {
            pub fn new(ifname: &str) -> Self {
                Defguard { ifname: ifname.to_string(), api: None, current: None, backend: $name, dropped: Vec::new() }
            }
        }

        impl Wireguard for Defguard<$t> {
            fn apply(&mut self, conf: &WgConf, private_key: &str) -> Result<()> {
                use defguard_wireguard_rs::{net::IpAddrMask, InterfaceConfiguration, WGApi, WireguardInterfaceApi};
                let same_interface = self
                    .current
                    .as_ref()
                    .is_some_and(|c| c.addresses == conf.addresses && c.listen_port == conf.listen_port && c.mtu == conf.mtu);
                if same_interface {
                    // Peers change in place: the interface and its sessions stay up.
                    let api = self.api.as_ref().expect("interface exists");
                    let old = self.current.as_ref().expect("configured");
                    self.dropped.clear();
                    let changes = peer_changes(&old.peers, &conf.peers);
                    for gone in changes.gone {
                        let key = defguard_wireguard_rs::key::Key::from_str(&gone.public_key).map_err(|e| anyhow::anyhow!("{e}"))?;
                        api.remove_peer(&key).map_err(|e| anyhow::anyhow!("removing peer {}: {e}", gone.public_key))?;
                    }
                    for (p, before) in changes.changed {
                        // A peer whose settings changed is removed and added again: the embedded
                        // boringtun refuses (panics) to modify an existing peer in place.
                        if before.is_some() {
                            let key = defguard_wireguard_rs::key::Key::from_str(&p.public_key).map_err(|e| anyhow::anyhow!("{e}"))?;
                            api.remove_peer(&key).map_err(|e| anyhow::anyhow!("removing peer {} to change it: {e}", p.public_key))?;
                            self.dropped.push(p.public_key.clone());
                        }
                        api.configure_peer(&dg_peer(p)?).map_err(|e| anyhow::anyhow!("configuring peer {}: {e}", p.public_key))?;
                    }
                } else {
                    if let Some(api) = self.api.as_mut() {
                        let _ = api.remove_interface();
                    }
                    let mut api = WGApi::<$t>::new(self.ifname.clone()).map_err(|e| anyhow::anyhow!("{}: {e}", self.ifname))?;
                    api.create_interface()
                        .map_err(|e| anyhow::anyhow!("cannot create WireGuard interface {} ({}): {e}", self.ifname, $name))?;
                    let addresses = conf
                        .addresses
                        .iter()
                        .map(|a| IpAddrMask::from_str(a).map_err(|e| anyhow::anyhow!("address {a}: {e}")))
                        .collect::<Result<Vec<_>>>()?;
                    let peers = conf.peers.iter().map(dg_peer).collect::<Result<Vec<_>>>()?;
                    let cfg = InterfaceConfiguration {
                        name: self.ifname.clone(),
                        prvkey: private_key.to_string(),
                        addresses,
                        port: conf.listen_port.unwrap_or(51820),
                        peers,
                        mtu: conf.mtu,
                        // WireGuard's own packets carry the mark, so that an exit's policy
                        // routing (`routes`) keeps them out of the tunnel, as wg-quick does.
                        fwmark: Some(u32::from(conf.listen_port.unwrap_or(51820))),
                    };
                    api.configure_interface(&cfg).map_err(|e| anyhow::anyhow!("cannot configure {}: {e}", self.ifname))?;
                    self.api = Some(api);
                }
                self.current = Some(conf.clone());
                Ok(())
            }

            fn peers(&self) -> Result<Vec<PeerState>> {
                use defguard_wireguard_rs::WireguardInterfaceApi;
                let Some(api) = &self.api else { return Ok(Vec::new()) };
                let host = api.read_interface_data().map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok(host
                    .peers
                    .values()
                    .map(|p| PeerState {
                        public_key: p.public_key.to_string(),
                        endpoint: p.endpoint.map(|e| e.to_string()),
                        last_handshake: p.last_handshake.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs()),
                    })
                    .collect())
            }

            fn describe(&self) -> String {
                format!("{} ({})", self.ifname, self.backend)
            }

            fn take_sessions_dropped(&mut self) -> Vec<String> {
                std::mem::take(&mut self.dropped)
            }

            fn restart_handshakes(&self, public_keys: &[String]) -> Result<()> {
                use defguard_wireguard_rs::WireguardInterfaceApi;
                let (Some(api), Some(current)) = (&self.api, &self.current) else { return Ok(()) };
                for p in current.peers.iter().filter(|p| public_keys.contains(&p.public_key)) {
                    let key = defguard_wireguard_rs::key::Key::from_str(&p.public_key).map_err(|e| anyhow::anyhow!("{e}"))?;
                    api.remove_peer(&key).map_err(|e| anyhow::anyhow!("removing peer {} to restart its handshake: {e}", p.public_key))?;
                    api.configure_peer(&dg_peer(p)?).map_err(|e| anyhow::anyhow!("adding peer {} again: {e}", p.public_key))?;
                }
                Ok(())
            }
        }
    };
}

defguard_backend!(defguard_wireguard_rs::Kernel, "kernel");
defguard_backend!(defguard_wireguard_rs::Userspace, "boringtun");

/// Picks the backend: with `auto`, the kernel module if an interface can be made with it, else
/// a `wireguard-go` on PATH (installed, so chosen), else the embedded gotatun (ADR 0030).
pub fn wireguard(mode: WgMode, ifname: &str) -> Option<Box<dyn Wireguard + Send>> {
    Some(match mode {
        WgMode::None => return None,
        WgMode::Kernel => Box::new(Defguard::<defguard_wireguard_rs::Kernel>::new(ifname)),
        WgMode::WireguardGo => Box::new(crate::wggo::WireguardGo::new(ifname)),
        WgMode::Boringtun => Box::new(Defguard::<defguard_wireguard_rs::Userspace>::new(ifname)),
        WgMode::Gotatun => Box::new(crate::gotatun::Gotatun::new(ifname)),
        WgMode::Auto => {
            let probe = std::process::Command::new("ip").args(["link", "add", "trellis-probe0", "type", "wireguard"]).output();
            if probe.is_ok_and(|o| o.status.success()) {
                let _ = std::process::Command::new("ip").args(["link", "del", "trellis-probe0"]).output();
                Box::new(Defguard::<defguard_wireguard_rs::Kernel>::new(ifname))
            } else if crate::wggo::find().is_some() {
                Box::new(crate::wggo::WireguardGo::new(ifname))
            } else {
                Box::new(crate::gotatun::Gotatun::new(ifname))
            }
        }
    })
}

// --- nftables --------------------------------------------------------------------------------

pub trait Firewall {
    /// Loads the ruleset file in one transaction; on refusal nothing changes.
    fn apply(&mut self, ruleset: &Path) -> Result<()>;
    fn loaded(&self) -> bool;
    /// Loads the ruleset loaded last again, whole, when the kernel's table is no longer it
    /// (flushed, deleted or changed behind the agent's back); whether it did. The run loop
    /// calls it on its tick, so that a flushed table is back within seconds, not at the next
    /// bundle.
    fn reconcile(&mut self) -> Result<bool> {
        Ok(false)
    }
}

pub struct Nft {
    loaded: bool,
    /// The ruleset this process loaded last, as it read it: the next is compared with it (one
    /// that differs only in sets' elements is applied as those elements, `ruleset::delta`), and
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
}

/// A ruleset as this process read and loaded it.
#[derive(Clone)]
struct Loaded {
    path: PathBuf,
    text: String,
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
    /// ruleset's path as `whole`, a whole ruleset's text as nft loads a file. Always the text:
    /// a ruleset is loaded as the agent read it, never from its path read a second time (the
    /// file may have changed between the two reads). What nft printed; the error is nft's
    /// message, which names the ruleset's path and line. A helper that ended fails this batch,
    /// and every later one of the same apply or check: nothing more is sent until the next,
    /// which starts another helper.
    fn run(&mut self, commands: &str, whole: Option<&Path>) -> Result<String> {
        use crate::nfthelper::{HelperError, Request};
        if let Some(ended) = &self.ended {
            return Err(HelperError::Ended(ended.clone()).into());
        }
        if matches!(self.via, Via::Untried) {
            self.via = Via::Helper(crate::nfthelper::Helper::default());
        }
        if let Via::Helper(helper) = &mut self.via {
            let name = whole.map(|p| p.display().to_string());
            let request = match &name {
                Some(name) => Request::Load { text: commands, name },
                None => Request::Run(commands),
            };
            match helper.run(request) {
                Ok(out) => return Ok(out),
                Err(HelperError::Refused(message)) => bail!("{message}"),
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
        program_run(program, commands, whole)
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
        let listing = self.run(&format!("list table {}\n", trellis_core::ruleset::TABLE), None).ok()?;
        Some(crate::ruleset::digest(&listing))
    }

    /// Runs commands that change the table, and marks what the kernel holds after them as this
    /// process's. A refused transaction changes nothing in the kernel, nor the mark.
    fn commit(&mut self, commands: &str, whole: Option<&Path>) -> Result<()> {
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

    /// Loads a ruleset's text whole, in one transaction that replaces the table.
    fn load_whole(&mut self, ruleset: Loaded) -> Result<()> {
        if let Err(e) = self.commit(&ruleset.text, Some(&ruleset.path)) {
            if helper_ended(&e) {
                bail!("cannot load {}: {e:#}", ruleset.path.display());
            }
            bail!("nft refused {}: {e:#}", ruleset.path.display());
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

/// Runs `nft -f -` (after the command's other words) with these commands on its standard input.
fn program_run(program: &[String], commands: &str, whole: Option<&Path>) -> Result<String> {
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
        let message = String::from_utf8_lossy(&out.stderr);
        let message = match whole {
            Some(path) => message.replace("/dev/stdin:", &format!("{}:", path.display())),
            None => message.into_owned(),
        };
        bail!("{}", message.trim());
    }
    written.context("cannot give nft its commands")?;
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Firewall for Nft {
    fn apply(&mut self, ruleset: &Path) -> Result<()> {
        let text = std::fs::read_to_string(ruleset).with_context(|| format!("cannot read {}", ruleset.display()))?;
        let new = Loaded { path: ruleset.to_path_buf(), text };
        self.ended = None;
        // Only the elements that changed, when nothing else did, and only on the table this
        // process loaded: one changed behind its back (an element or a chain added, rules
        // flushed) is loaded whole, as a whole load would leave it, never patched.
        if let Some(commands) = self.last.as_ref().and_then(|old| trellis_core::ruleset::delta(&old.text, &new.text)) {
            match self.table(false) {
                Table::Same if commands.is_empty() => {
                    self.last = Some(new);
                    return Ok(());
                }
                Table::Same => match self.commit(&commands, None) {
                    Ok(()) => {
                        tracing::info!(commands = commands.lines().count(), "ruleset changed in its sets' elements");
                        self.last = Some(new);
                        return Ok(());
                    }
                    // The helper gone, the apply fails (a refusal of the elements loads the file
                    // whole instead).
                    Err(e) if helper_ended(&e) => bail!("cannot change the sets' elements of {}: {e:#}", ruleset.display()),
                    Err(e) => tracing::warn!(
                        error = %format!("{e:#}"),
                        "the loaded table refused a change of its sets' elements; loading {} whole",
                        ruleset.display()
                    ),
                },
                Table::Changed => tracing::warn!(
                    "table {} is not the one the agent loaded (changed behind its back); loading {} whole",
                    trellis_core::ruleset::TABLE,
                    ruleset.display()
                ),
                Table::Unknown => {}
            }
        }
        self.load_whole(new)
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
            "table {} is not the one the agent loaded (flushed, deleted or changed behind its back); loading {} again, as read at its last apply",
            trellis_core::ruleset::TABLE,
            last.path.display()
        );
        self.load_whole(last)?;
        Ok(true)
    }
}

// --- forwarding ------------------------------------------------------------------------------

/// IP forwarding, which a hub needs to relay between its overlay peers.
pub trait Forwarding {
    /// Whether IPv4 and IPv6 forwarding are both on.
    fn enabled(&self) -> bool;
    /// Turns IPv4 and IPv6 forwarding on.
    fn enable(&mut self) -> Result<()>;
}

/// Forwarding through the kernel's `/proc/sys` knobs.
pub struct ProcSys;

const FORWARDING_KNOBS: [&str; 2] = ["/proc/sys/net/ipv4/ip_forward", "/proc/sys/net/ipv6/conf/all/forwarding"];

impl Forwarding for ProcSys {
    fn enabled(&self) -> bool {
        FORWARDING_KNOBS.iter().all(|k| std::fs::read_to_string(k).is_ok_and(|v| v.trim() == "1"))
    }

    fn enable(&mut self) -> Result<()> {
        for knob in FORWARDING_KNOBS {
            std::fs::write(knob, "1").with_context(|| format!("cannot enable forwarding ({knob})"))?;
        }
        Ok(())
    }
}

// --- handshake prompts -----------------------------------------------------------------------

/// Makes WireGuard start handshakes now, whatever the backend: a packet for a peer without a
/// session is what starts one.
pub trait Prompter {
    /// Sends one empty datagram to each overlay address in `to`, through `interface` only.
    fn prompt(&self, interface: &str, to: &[IpAddr]) -> Result<()>;
}

/// UDP datagrams to the discard port (9), each from a socket bound to the interface
/// (`SO_BINDTODEVICE`): it leaves through WireGuard, which hands it only to the peer whose
/// AllowedIPs hold the address, or not at all; never by the underlay, whatever the routes say.
/// The peer's filter drops it; the handshake it started stays.
pub struct Datagrams;

const DISCARD_PORT: u16 = 9;

impl Prompter for Datagrams {
    fn prompt(&self, interface: &str, to: &[IpAddr]) -> Result<()> {
        use socket2::{Domain, Protocol, SockAddr, Socket, Type};
        let send = |addr: IpAddr| -> std::io::Result<()> {
            let to = std::net::SocketAddr::new(addr, DISCARD_PORT);
            let socket = Socket::new(Domain::for_address(to), Type::DGRAM, Some(Protocol::UDP))?;
            socket.bind_device(Some(interface.as_bytes()))?;
            socket.send_to(&[], &SockAddr::from(to)).map(drop)
        };
        let failed: Vec<String> = to.iter().filter_map(|a| send(*a).err().map(|e| format!("{a}: {e}"))).collect();
        if !failed.is_empty() {
            bail!("cannot send a datagram through {interface} to {}", failed.join(", "));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("trellis-diskwriter-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The attack: the agent's root holds `etc/trellis` as a link to a directory outside it.
    /// Before, the writer followed it and wrote the bundle's files there.
    #[test]
    fn a_symlinked_directory_is_never_written_through() {
        let base = scratch("link");
        let (root, outside) = (base.join("root"), base.join("outside"));
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("etc/trellis")).unwrap();
        let mut w = DiskWriter { root: root.clone() };
        let file = BundleFile::new(trellis_core::compile::NFTABLES_CONF, 0o644, b"table inet trellis {}\n".to_vec());
        let e = w.write_all(std::slice::from_ref(&file), &[]).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing was written outside the root");

        // A linked file is refused as well, and a plain tree is written.
        std::fs::remove_file(root.join("etc/trellis")).unwrap();
        std::fs::create_dir_all(root.join("etc/trellis")).unwrap();
        std::os::unix::fs::symlink(outside.join("x"), root.join(trellis_core::compile::NFTABLES_CONF)).unwrap();
        assert!(w.write_all(std::slice::from_ref(&file), &[]).is_err());
        std::fs::remove_file(root.join(trellis_core::compile::NFTABLES_CONF)).unwrap();
        let out = w.write_all(&[file], &[]).unwrap();
        assert_eq!(out[0].result, trellis_proto::FileResult::Written);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn only_the_files_trellis_delivers_are_written() {
        let root = scratch("names");
        let mut w = DiskWriter { root: root.clone() };
        for bad in ["etc/cron.d/x", "root/.ssh/authorized_keys", "etc/trellis/../../x"] {
            let e = w.write_all(&[BundleFile::new(bad, 0o644, b"x".to_vec())], &[]).unwrap_err().to_string();
            assert!(e.contains("not one of the files trellis delivers"), "{bad}: {e}");
        }
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&root);
    }
}

#[cfg(test)]
mod peer_change_tests {
    use trellis_core::wgconf::WgPeer;

    fn peer(key: &str, ip: &str) -> WgPeer {
        WgPeer { public_key: key.into(), allowed_ips: vec![ip.into()], endpoint: None, keepalive: None }
    }

    /// Gone, new and changed peers by key; a peer the same as before is no change.
    #[test]
    fn peer_changes_are_found_by_key() {
        let old = vec![peer("a", "10.0.0.1/32"), peer("b", "10.0.0.2/32"), peer("c", "10.0.0.3/32")];
        let new = vec![peer("a", "10.0.0.1/32"), peer("c", "10.0.0.9/32"), peer("d", "10.0.0.4/32")];
        let c = super::peer_changes(&old, &new);
        assert_eq!(c.gone.iter().map(|p| p.public_key.as_str()).collect::<Vec<_>>(), ["b"]);
        let changed: Vec<(&str, Option<&str>)> =
            c.changed.iter().map(|(n, o)| (n.public_key.as_str(), o.map(|o| o.allowed_ips[0].as_str()))).collect();
        assert_eq!(changed, [("c", Some("10.0.0.3/32")), ("d", None)]);
        let same = super::peer_changes(&old, &old);
        assert!(same.gone.is_empty() && same.changed.is_empty());
    }
}
