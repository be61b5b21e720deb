//! The executor: carries a plan's actions out through the host traits (`FileWriter`,
//! `Wireguard`, `Firewall`, `Resolver`, `Forwarding`, `Routing`, `Prompter`), in order, stopping
//! at the first failure (a handshake prompt that cannot be sent is only logged). The backends
//! are chosen at run time: the real host's by the binary, fakes by tests.
//!
//! Prompts are followed up: a peer still without a handshake a moment after its prompt has its
//! handshake restarted and is prompted again, a few times from its prompt (see
//! [`FOLLOW_UP_DELAYS`]), however many bundles come meanwhile.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use trellis_core::wgconf::WgConf;

use crate::dns::Resolver;
use crate::host::{self, FileOutcome, FileWriter, Firewall, Forwarding, Prompter, Wireguard};
use crate::plan::{Action, Prompt};
use crate::state::Identity;
use crate::status::PeerState;

/// Makes the WireGuard backend for an interface, on the first apply that names it.
pub type WireguardFactory = Box<dyn FnMut(&str) -> Option<Box<dyn Wireguard + Send>> + Send>;

/// The host effects the agent uses. `None` leaves that part of the host alone.
pub struct Backends {
    pub files: Box<dyn FileWriter + Send>,
    pub wireguard: Option<WireguardFactory>,
    pub firewall: Option<Box<dyn Firewall + Send>>,
    pub resolver: Option<Box<dyn Resolver>>,
    pub forwarding: Box<dyn Forwarding + Send>,
    pub routing: Option<Box<dyn crate::routes::Routing + Send>>,
    pub prompter: Option<Box<dyn Prompter + Send>>,
    /// Reloads a module's unit after its service certificate is replaced (`crate::certs`).
    pub reloader: Option<Box<dyn crate::certs::Reloader>>,
}

impl Backends {
    /// The real host's: files under `root`, WireGuard by `mode`, `nft`, hickory-dns,
    /// `/proc/sys`, `ip` routes and datagrams bound to the interface; with `files_only`, no
    /// ruleset, DNS, routes or prompts.
    pub fn host(root: &Path, state_dir: &Path, mode: host::WgMode, files_only: bool) -> Backends {
        let state_dir = state_dir.to_path_buf();
        let controllers = move || Identity::load(&state_dir).map(|id| crate::routes::addresses(&id.controllers)).unwrap_or_default();
        let wireguard: Option<WireguardFactory> = match mode {
            host::WgMode::None => None,
            mode => Some(Box::new(move |ifname: &str| host::wireguard(mode, ifname))),
        };
        Backends {
            files: Box::new(host::DiskWriter { root: root.to_path_buf() }),
            wireguard,
            firewall: if files_only { None } else { Some(Box::new(host::Nft::new())) },
            resolver: if files_only { None } else { Some(Box::new(crate::dns::Hickory::default())) },
            forwarding: Box::new(host::ProcSys),
            routing: if files_only { None } else { Some(Box::new(crate::routes::IpRouting::new(Box::new(controllers)))) },
            prompter: if files_only { None } else { Some(Box::new(host::Datagrams)) },
            reloader: if files_only { None } else { Some(Box::new(crate::certs::Systemctl)) },
        }
    }
}

/// What the host shows after the last actions, for the status file.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct HostReport {
    pub interface: Option<String>,
    pub ruleset_loaded: bool,
    pub dns_serving: Vec<String>,
    /// Milliseconds each kind of action took in the last run of actions (`files`, `wireguard`,
    /// `routes`, `ruleset`, `dns`, `forwarding`, `prompts`): where an apply's time goes.
    pub phases_ms: std::collections::BTreeMap<String, f64>,
}

pub struct Executor {
    backends: Backends,
    /// The node's WireGuard private key, read when the interface is configured.
    key_path: PathBuf,
    /// The interface's backend, behind a lock so that the run loop tends direct paths while a
    /// long-poll waits (`tend_paths`).
    wg: Mutex<Option<Box<dyn Wireguard + Send>>>,
    /// What the interface was brought to last (the bundle's `wireguard.conf`, without the direct
    /// paths); `None` before, and after a failed configuration.
    configured: Option<Arc<WgConf>>,
    /// The relayed peers tried or reached directly (ADR 0032), and what the interface holds
    /// with them.
    paths: Mutex<Paths>,
    /// The start of the monotonic milliseconds the paths count in.
    epoch: Instant,
    report: HostReport,
    /// The routes and exit this process installed last: the same again leaves the host alone,
    /// so an exit's rules are not taken down and put back (traffic leaking outside the tunnel
    /// meanwhile) at every change of peers.
    routed: Option<crate::plan::Action>,
    /// The prompted peers still to be checked for a handshake. Behind a lock so that the run loop
    /// follows them up while a long-poll (which borrows the agent) waits.
    follow_up: Mutex<Option<FollowUp>>,
    /// The ruleset's backend, taken from `backends`: behind a lock so that the run loop checks
    /// the kernel's table while a long-poll waits (`reconcile`).
    firewall: Mutex<Option<Box<dyn Firewall + Send>>>,
}

/// When, after a prompt, a peer still without a handshake is prompted again: each delay after
/// the one before. A handshake takes a round trip; one not done by then was dropped by a peer
/// that did not have this node yet (it applies its bundle a moment later, typically within a
/// second). The delays grow so that a slow round trip (a loaded host) is not restarted forever;
/// WireGuard itself would retry only after its 5 s rekey timeout, and after the last follow-up,
/// that retry takes over.
pub const FOLLOW_UP_DELAYS: [Duration; 8] = [
    Duration::from_millis(250),
    Duration::from_millis(250),
    Duration::from_millis(500),
    Duration::from_secs(1),
    Duration::from_secs(1),
    Duration::from_secs(1),
    Duration::from_secs(1),
    Duration::from_secs(1),
];
pub const FOLLOW_UPS: u32 = FOLLOW_UP_DELAYS.len() as u32;
/// The most peers followed up at once: the newest prompted first. A follow-up removes and adds
/// each peer again; a first bundle of ten thousand peers, most of them not answering at once,
/// would have the agent rebuild thousands of peers eight times over, its resolver starved
/// meanwhile (`trellis-dev bench agent`). Beyond these, WireGuard's own retry serves.
pub const FOLLOW_UP_MAX: usize = 256;

/// How often a hub reads the endpoints its peers send from.
pub const HUB_WATCH_MS: u64 = 2_000;

/// The direct paths (ADR 0032): the pairs, whether this node is a hub that observes its peers'
/// endpoints (and what it observed last), and the configuration the interface holds with them.
#[derive(Default)]
struct Paths {
    book: crate::paths::Book,
    observe: bool,
    observed: Vec<trellis_proto::ObservedEndpoint>,
    applied: Option<Arc<WgConf>>,
    interface: String,
    /// Whether the last probes could not be sent: warned once, not every five seconds.
    probes_failing: bool,
    /// When the paths were last tended (milliseconds of the executor's clock).
    tended: Option<u64>,
}

/// Prompted peers awaiting their first handshake.
#[derive(Debug)]
struct FollowUp {
    interface: String,
    /// Each peer waiting, with the follow-ups it had so far: its own count, so that a peer
    /// carried over into a later prompt is not followed up anew (with bundles coming faster than
    /// the follow-ups end, the same silent peers were restarted for as long as they came).
    peers: Vec<(Prompt, u32)>,
    next: Instant,
}

impl Executor {
    /// An executor over `backends` (the files are written where `backends.files` writes them;
    /// the ruleset and the zone are given to theirs as the bundle holds them).
    pub fn new(mut backends: Backends, key_path: PathBuf) -> Executor {
        Executor {
            firewall: Mutex::new(backends.firewall.take()),
            backends,
            key_path,
            wg: Mutex::new(None),
            configured: None,
            paths: Mutex::new(Paths::default()),
            epoch: Instant::now(),
            report: HostReport::default(),
            routed: None,
            follow_up: Mutex::new(None),
        }
    }

    /// When the prompted peers are next checked for a handshake; `None` when none waits.
    pub fn next_follow_up(&self) -> Option<Instant> {
        self.follow_up.lock().expect("follow-up lock").as_ref().map(|f| f.next)
    }

    /// Checks the prompted peers: those with a handshake are done; each other has its handshake
    /// restarted and is prompted again, until its [`FOLLOW_UPS`] follow-ups are spent. Returns the
    /// keys of the peers prompted again. A failure is logged: prompts only hasten a handshake.
    pub fn follow_up(&self) -> Vec<String> {
        let mut slot = self.follow_up.lock().expect("follow-up lock");
        let wg = self.wg.lock().expect("wireguard lock");
        let (Some(f), Some(wg)) = (slot.as_mut(), wg.as_ref()) else {
            *slot = None;
            return Vec::new();
        };
        // The peers still waiting: on the interface (a peer a later bundle removed is followed
        // up no more) and without a handshake.
        match wg.peers() {
            Ok(peers) => {
                let waiting: std::collections::HashSet<&str> =
                    peers.iter().filter(|p| p.last_handshake.is_none_or(|t| t == 0)).map(|p| p.public_key.as_str()).collect();
                f.peers.retain(|(p, _)| waiting.contains(p.public_key.as_str()));
            }
            Err(e) => tracing::warn!("reading the handshakes of {}: {e:#}", f.interface),
        }
        if f.peers.is_empty() {
            *slot = None;
            return Vec::new();
        }
        let keys: Vec<String> = f.peers.iter().map(|(p, _)| p.public_key.clone()).collect();
        let to: Vec<std::net::IpAddr> = f.peers.iter().map(|(p, _)| p.address).collect();
        tracing::debug!(peers = keys.len(), "no handshake yet: restarting it");
        if let Err(e) = wg.restart_handshakes(&keys) {
            tracing::warn!("restarting handshakes on {}: {e:#}", f.interface);
        }
        if let Some(p) = self.backends.prompter.as_ref() {
            if let Err(e) = p.prompt(&f.interface, &to) {
                tracing::warn!("handshake prompts through {}: {e:#}", f.interface);
            }
        }
        // Each peer's count moves on; one whose follow-ups are spent is left to WireGuard's own
        // retry. The next comes after the delay of the peer least followed up.
        for (_, done) in &mut f.peers {
            *done += 1;
        }
        f.peers.retain(|(_, done)| (*done as usize) < FOLLOW_UP_DELAYS.len());
        match f.peers.iter().map(|(_, done)| *done).min() {
            Some(done) => f.next = Instant::now() + FOLLOW_UP_DELAYS[done as usize],
            None => *slot = None,
        }
        keys
    }

    /// Loads the ruleset loaded last again when the kernel's table is not it (flushed, deleted or
    /// changed behind the agent's back); the run loop calls it on its tick, so that the overlay
    /// is not left open until the next bundle. A failure is logged, and the next tick tries
    /// again.
    pub fn reconcile(&self) {
        if let Some(fw) = self.firewall.lock().expect("firewall lock").as_mut() {
            if let Err(e) = fw.reconcile() {
                tracing::error!("loading the ruleset again: {e:#}");
            }
        }
    }

    /// The configuration the interface was last brought to, for the plan's prompts.
    pub fn configured(&self) -> Option<Arc<WgConf>> {
        self.configured.clone()
    }

    /// Whether this agent has routes or an exit installed.
    pub fn routing(&self) -> bool {
        self.backends.routing.as_ref().is_some_and(|r| r.installed())
    }

    /// Whether forwarding is on now.
    pub fn forwarding(&self) -> bool {
        self.backends.forwarding.enabled()
    }

    pub fn report(&self) -> &HostReport {
        &self.report
    }

    /// The interface's peers as it sees them (none before the first configuration).
    pub fn peers(&self) -> Vec<PeerState> {
        self.wg.lock().expect("wireguard lock").as_ref().and_then(|wg| wg.peers().ok()).unwrap_or_default()
    }

    /// Milliseconds since this executor began, and unix seconds.
    fn clocks(&self) -> (u64, i64) {
        (self.epoch.elapsed().as_millis() as u64, crate::unix_now())
    }

    /// When the direct paths are next to be tended: soon while one is tried, every second while
    /// one is direct, every two seconds on a hub (which watches its peers' endpoints), counted
    /// from when they were last tended: the run loop asks again after every other wake-up (a
    /// follow-up, a tick), and counted from then a check would be put off by each of them.
    pub fn next_path_check(&self) -> Option<Instant> {
        let paths = self.paths.lock().expect("paths lock");
        let (now, _) = self.clocks();
        let from = paths.tended.map_or(now, |t| t.min(now));
        let hub = paths.observe.then_some(HUB_WATCH_MS);
        let ms = paths.book.next_check(from).into_iter().chain(hub).min()?;
        Some(Instant::now() + Duration::from_millis((from + ms).saturating_sub(now)))
    }

    /// Reads the interface and moves the direct paths on: a pair whose handshake completed is
    /// promoted, a stale one goes back to its hub (the interface changed in place, one peer at a
    /// time). Returns whether a path moved, and on a hub whether the endpoints its peers send
    /// from moved: either is reported to the controller.
    pub fn tend_paths(&self) -> bool {
        let mut wg_slot = self.wg.lock().expect("wireguard lock");
        let mut paths = self.paths.lock().expect("paths lock");
        let (Some(wg), Some(base)) = (wg_slot.as_mut(), self.configured.as_ref()) else { return false };
        if paths.book.is_empty() && !paths.observe {
            return false;
        }
        let peers = match wg.peers() {
            Ok(p) => p,
            Err(e) => {
                tracing::warn!("reading the peers for direct paths: {e:#}");
                return false;
            }
        };
        let (now, wall) = self.clocks();
        paths.tended = Some(now);
        let mut report = false;
        if paths.observe {
            let seen = crate::paths::observed(&peers, wall);
            if seen != paths.observed {
                paths.observed = seen;
                report = true;
            }
        }
        let moved = paths.book.step(&peers, now, wall);
        report |= moved;
        let mut prompts = Vec::new();
        // Applied when a path moved, and again after an apply that failed.
        let conf = if moved || paths.applied.is_none() { Some(paths.book.overlay(base)) } else { None };
        if let Some(conf) = conf.filter(|c| paths.applied.as_ref() != Some(c)) {
            let applied = std::fs::read_to_string(&self.key_path)
                .context("cannot read wireguard.key")
                .and_then(|key| wg.apply(&conf, key.trim(), None));
            match applied {
                Ok(()) => {
                    // A backend that changes a peer by removing and adding it again (kernel,
                    // boringtun) dropped its session: those this node dials are prompted now.
                    prompts = crate::plan::prompts_for(&conf, &wg.take_sessions_dropped());
                    paths.applied = Some(conf);
                }
                Err(e) => {
                    tracing::error!("changing the direct paths: {e:#}");
                    paths.applied = None;
                }
            }
        }
        // The direct peers' probes, through the configuration just applied (ADR 0032).
        let probes = if paths.applied.is_some() { paths.book.probes(now, &crate::plan::overlay_of(base)) } else { Vec::new() };
        if moved {
            for s in paths.book.status() {
                tracing::info!(peer = %s.peer, hub = %s.hub, endpoint = %s.endpoint, reason = s.reason.as_deref().unwrap_or(""), "path {}", s.state);
            }
        }
        let interface = paths.interface.clone();
        drop(paths);
        drop(wg_slot);
        if let (false, Some(p)) = (probes.is_empty(), self.backends.prompter.as_ref()) {
            let sent = p.prompt(&interface, &probes);
            let mut paths = self.paths.lock().expect("paths lock");
            match &sent {
                Err(e) if !paths.probes_failing => tracing::warn!("probing the direct peers through {interface}: {e:#}"),
                Err(e) => tracing::debug!("probing the direct peers through {interface}: {e:#}"),
                Ok(()) if paths.probes_failing => tracing::info!("probing the direct peers through {interface} again"),
                Ok(()) => {}
            }
            paths.probes_failing = sent.is_err();
        }
        if !prompts.is_empty() {
            self.prompt(&interface, &prompts);
        }
        report
    }

    /// Waits `d` as the run loop does between polls (a controller away: its backoff), the data
    /// path tended as during a long-poll: direct paths (their probes, ADR 0032) and prompted
    /// peers' follow-ups. A controller away takes no direct path down (ADR 0007); what moved is
    /// reported after.
    pub async fn rest(&self, d: Duration) {
        let end = tokio::time::Instant::now() + d;
        loop {
            let (follow_up, paths) = (self.next_follow_up(), self.next_path_check());
            let next = [follow_up, paths].into_iter().flatten().min().map(tokio::time::Instant::from_std);
            let wake = next.map_or(end, |n| n.min(end));
            tokio::time::sleep_until(wake).await;
            if wake >= end {
                return;
            }
            let wake = wake.into_std();
            if paths.is_some_and(|t| t <= wake) {
                self.tend_paths();
            }
            if follow_up.is_some_and(|t| t <= wake) {
                self.follow_up();
            }
        }
    }

    /// The paths as the status file shows them.
    pub fn path_status(&self) -> Vec<crate::status::PathStatus> {
        self.paths.lock().expect("paths lock").book.status()
    }

    /// What the controller is told of the paths, and on a hub of its peers' endpoints.
    pub fn path_report(&self) -> trellis_proto::PathReport {
        let paths = self.paths.lock().expect("paths lock");
        trellis_proto::PathReport { observed: paths.observed.clone(), paths: paths.book.report() }
    }

    /// Carries the actions out in order; stops at the first that fails. Returns what happened
    /// to each file written or removed.
    pub async fn run(&mut self, actions: &[Action]) -> Result<Vec<FileOutcome>> {
        let mut outcomes = Vec::new();
        self.run_into(actions, &mut outcomes).await?;
        Ok(outcomes)
    }

    /// As [`run`](Self::run), adding what happened to each file to `outcomes` as it goes, so
    /// they are known even when a later action fails.
    pub async fn run_into(&mut self, actions: &[Action], outcomes: &mut Vec<FileOutcome>) -> Result<()> {
        self.report.phases_ms.clear();
        for action in actions {
            let started = Instant::now();
            let done = self.one(action).await;
            let ms = started.elapsed().as_secs_f64() * 1000.0;
            *self.report.phases_ms.entry(phase(action).to_string()).or_default() += ms;
            outcomes.extend(done?);
        }
        Ok(())
    }

    async fn one(&mut self, action: &Action) -> Result<Vec<FileOutcome>> {
        match action {
            Action::WriteFiles { files, remove } => return self.backends.files.write_all(files, remove),
            Action::EnableForwarding => self.backends.forwarding.enable()?,
            Action::ConfigureWireguard { interface, read, edit, direct, observe } => {
                let conf = read.conf();
                let slot = self.wg.get_mut().expect("wireguard lock");
                if slot.is_none() {
                    *slot = self.backends.wireguard.as_mut().and_then(|make| make(interface));
                }
                let mut dropped = Vec::new();
                if let Some(wg) = slot.as_mut() {
                    self.configured = None;
                    let private = std::fs::read_to_string(&self.key_path).context("cannot read wireguard.key")?;
                    let (now, wall) = (self.epoch.elapsed().as_millis() as u64, crate::unix_now());
                    let paths = self.paths.get_mut().expect("paths lock");
                    paths.book.set(direct, now, wall);
                    paths.observe = *observe;
                    paths.interface = interface.clone();
                    paths.applied = None;
                    let with_paths = paths.book.overlay(conf);
                    wg.apply(&with_paths, private.trim(), edit.as_deref())?;
                    paths.applied = Some(with_paths);
                    self.configured = Some(conf.clone());
                    self.report.interface = Some(wg.describe());
                    dropped = wg.take_sessions_dropped();
                }
                // Peers changed by removing and adding them again lost their sessions: those this
                // node dials are prompted now. The other end still holds its session and sends on
                // it, which this end can no longer read, until this end speaks.
                let to = crate::plan::prompts_for(conf, &dropped);
                if !to.is_empty() {
                    self.prompt(interface, &to);
                }
            }
            Action::ConfigureRoutes { interface, routes, exit, table } => {
                if self.routed.as_ref() == Some(action) {
                    return Ok(Vec::new());
                }
                if let Some(r) = self.backends.routing.as_mut() {
                    self.routed = None;
                    r.apply(interface, routes, *exit, *table)?;
                    self.routed = Some(action.clone());
                }
            }
            Action::LoadRuleset { files } => {
                if let Some(fw) = self.firewall.get_mut().expect("firewall lock").as_mut() {
                    fw.apply(files)?;
                    self.report.ruleset_loaded = fw.loaded();
                }
            }
            Action::ServeZone { files, origin, listen } => {
                if let Some(dns) = self.backends.resolver.as_mut() {
                    dns.apply(files, origin, listen).await?;
                    self.report.dns_serving = dns.serving().iter().map(|a| a.to_string()).collect();
                }
            }
            Action::PromptHandshakes { interface, to } => self.prompt(interface, to),
        }
        Ok(Vec::new())
    }
}

impl Executor {
    /// Prompts a handshake with each of `to` through `interface` and follows them up.
    fn prompt(&self, interface: &str, to: &[Prompt]) {
        if let Some(p) = self.backends.prompter.as_ref() {
            // A prompt only hastens a handshake WireGuard makes anyway: one not sent is
            // no reason to put the previous bundle back.
            let addresses: Vec<std::net::IpAddr> = to.iter().map(|p| p.address).collect();
            if let Err(e) = p.prompt(interface, &addresses) {
                tracing::warn!("handshake prompts through {interface}: {e:#}");
            }
            // Peers still waiting from an earlier prompt wait on, with the follow-ups they had;
            // the next comes at the new peers' first delay. One the interface no longer has is
            // dropped at the follow-up, which reads the interface anyway: looking each up among
            // the peers configured here cost a change a set of ten thousand keys.
            let mut slot = self.follow_up.lock().expect("follow-up lock");
            let mut peers: Vec<(Prompt, u32)> = to.iter().map(|p| (p.clone(), 0)).collect();
            let mut listed: std::collections::HashSet<String> = peers.iter().map(|(p, _)| p.public_key.clone()).collect();
            for (old, done) in slot.take().map(|f| f.peers).unwrap_or_default() {
                if listed.insert(old.public_key.clone()) {
                    peers.push((old, done));
                }
            }
            peers.truncate(FOLLOW_UP_MAX);
            let next = Instant::now() + FOLLOW_UP_DELAYS[0];
            *slot = Some(FollowUp { interface: interface.to_string(), peers, next });
        }
    }
}

/// The phase an action's time counts under in [`HostReport::phases_ms`].
fn phase(action: &Action) -> &'static str {
    match action {
        Action::WriteFiles { .. } => "files",
        Action::EnableForwarding => "forwarding",
        Action::ConfigureWireguard { .. } => "wireguard",
        Action::ConfigureRoutes { .. } => "routes",
        Action::LoadRuleset { .. } => "ruleset",
        Action::ServeZone { .. } => "dns",
        Action::PromptHandshakes { .. } => "prompts",
    }
}
