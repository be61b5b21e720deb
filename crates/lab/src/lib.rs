//! The lab: a declared mesh built in network namespaces with the real controller and agents,
//! its expectations checked through the overlay, and everything removed. Every address is one
//! of the lab's own namespaces; every wait is bounded.
//!
//! `file` is the lab file and its validation; `net` the namespaces, bridges and routers; `pg`
//! the PostgreSQL server of a lab with controller replicas; `procs` the controller and agent
//! processes; `checks` the expectation matrix, `path` its path rows; `steps` the lab file's
//! steps, one function per kind; `timing` the first-packet, apply and failover figures.
//! Declaration directories are read by the caller's reader (`ReadDeclaration`), the one
//! `trellis check` uses.

mod acme;
mod checks;
pub mod file;
mod metrics;
mod net;
mod path;
mod pg;
mod procs;
mod steps;
mod timing;
mod traefik;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use trellis_core::{Declaration, Loaded};

use file::Action;
pub use file::{load, LabFile};
use procs::Replica;

/// Reads and loads a declaration directory, as `trellis check` does.
pub type ReadDeclaration = fn(&Path) -> Result<Loaded>;

/// What `up` made, so that `down` can remove it even after a failure.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct LabState {
    pub prefix: String,
    pub namespaces: Vec<String>,
    pub pids: Vec<u32>,
    pub dir: PathBuf,
    /// Per node: milliseconds from token redemption to the first packet over the overlay.
    pub first_packet_ms: BTreeMap<String, u64>,
    /// The nodes that run an agent.
    pub agents: Vec<String>,
    pub controllers: Vec<Replica>,
    pub postgres: Option<pg::Postgres>,
    /// How many of the lab file's steps `check` has taken.
    pub steps_done: usize,
    /// The process of each agent, by host, for a step that stops one.
    #[serde(default)]
    pub agent_pids: BTreeMap<String, u32>,
    /// Every agent's `--wireguard` backend.
    #[serde(default)]
    pub wireguard: String,
    /// The hosts whose agent a step paused and no step resumed yet.
    #[serde(default)]
    pub paused: Vec<String>,
    /// The certificate of the lab's ACME directory, which agents trust (`LEGO_CA_CERTIFICATES`),
    /// when the lab has an acme host.
    #[serde(default)]
    pub acme_ca: Option<PathBuf>,
    /// When each agent started, in unix milliseconds: a path row before any step is timed from
    /// the later of its pair's.
    #[serde(default)]
    pub agent_started_ms: BTreeMap<String, u64>,
    /// When the last step taken began, in unix milliseconds: a path row after it is timed from
    /// then.
    #[serde(default)]
    pub step_at_ms: Option<u64>,
}

impl LabState {
    /// The first controller still running: admin commands go through it.
    pub(crate) fn serving(&self) -> Result<&Replica> {
        self.controllers.iter().find(|r| !r.killed).context("no controller of the lab is running")
    }
}

/// Where the state of a lab that is up is kept: named by the lab file and a digest of its full
/// path, so the same topology from two checkouts can be up at once.
fn state_path(file: &Path) -> PathBuf {
    let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or("lab");
    let full = std::fs::canonicalize(file).unwrap_or_else(|_| file.to_path_buf());
    let mut h = std::hash::DefaultHasher::new();
    std::hash::Hash::hash(&full, &mut h);
    std::env::temp_dir().join(format!("trellis-lab-{name}-{:08x}.json", std::hash::Hasher::finish(&h) as u32))
}

fn progress(msg: &str) {
    eprintln!("lab: {msg}");
}

/// Now, in unix milliseconds.
fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

fn rand_u16() -> u16 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    ((t ^ std::process::id()) & 0xffff) as u16
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
}

/// Builds the namespaces, starts the controller and an agent per node, and waits for
/// convergence; every agent runs `--wireguard WIREGUARD`. What was made is recorded next to the
/// lab even when a step fails.
pub fn up(file: &Path, read_declaration: ReadDeclaration, wireguard: &str) -> Result<LabState> {
    let planned = plan(file, read_declaration)?;
    let st = claim(file, wireguard)?;
    up_claimed(file, planned, st)
}

/// A lab file and its declarations, read and checked before anything is built.
struct Planned {
    lab: LabFile,
    decl_dir: PathBuf,
    decl: Declaration,
    /// The declarations the file's steps apply, in order.
    later: Vec<Declaration>,
}

/// Reads the lab file and every declaration it applies, and checks them against each other.
fn plan(file: &Path, read_declaration: ReadDeclaration) -> Result<Planned> {
    if !is_root() {
        bail!("the lab needs root: it makes network namespaces");
    }
    let (lab, decl_dir) = load(file)?;
    let decl = read_valid(&decl_dir, read_declaration)?;
    file::check_endpoints(&lab, &decl)?;
    file::check_pools(&lab, &decl)?;
    // A step's declaration is checked now, before anything is built for it.
    let mut later: Vec<Declaration> = Vec::new();
    for i in 0..lab.step.len() {
        match lab.action(i, lab_dir(file)) {
            Action::Apply(dir) => {
                let d = read_valid(&dir, read_declaration)?;
                file::check_endpoints(&lab, &d)?;
                later.push(d);
            }
            Action::Renew(node) => {
                file::check_renewal(i + 1, &node, later.last().unwrap_or(&decl)).with_context(|| file.display().to_string())?
            }
            _ => {}
        }
    }
    Ok(Planned { lab, decl_dir, decl, later })
}

/// Makes the state of a lab from `file`, refusing when one is up already: the state file is
/// created with O_CREAT|O_EXCL, so the check that no lab of the file is up and the write that
/// says this one is are one step, and of two runs started at once exactly one goes on. The
/// state names a prefix and a directory not made yet; `down` removes it, also after a failure.
fn claim(file: &Path, wireguard: &str) -> Result<LabState> {
    let sp = state_path(file);
    let mut out = match std::fs::OpenOptions::new().write(true).create_new(true).open(&sp) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
            bail!("a lab from {} is already up; run `trellis lab down {}` first", file.display(), file.display())
        }
        Err(e) => return Err(e).with_context(|| format!("cannot create {}", sp.display())),
    };
    let prefix = format!("tl{:04x}", rand_u16());
    let dir = std::env::temp_dir().join(format!("trellis-lab-{prefix}"));
    let st = LabState { prefix, dir, wireguard: wireguard.to_string(), ..Default::default() };
    // Written through the handle that made the file: a `down` that reads it meanwhile finds it
    // empty for a moment at most, never another run's.
    std::io::Write::write_all(&mut out, &serde_json::to_vec_pretty(&st)?).with_context(|| format!("cannot write {}", sp.display()))?;
    Ok(st)
}

/// `up` once this run holds the lab's state (`claim`).
fn up_claimed(file: &Path, planned: Planned, mut st: LabState) -> Result<LabState> {
    let Planned { lab, decl_dir, decl, later } = planned;
    std::fs::create_dir_all(&st.dir).with_context(|| format!("cannot create {}", st.dir.display()))?;
    // An ingress's Traefik runs unprivileged and must reach its agent's root and the ACME CA's
    // certificate here; the state directories of the agents and controllers in it are 0700.
    std::fs::set_permissions(&st.dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .with_context(|| format!("cannot open {} to Traefik's user", st.dir.display()))?;
    let result = build(file, &lab, &decl_dir, &decl, &later, &mut st);
    save(file, &st)?;
    result.map(|_| st)
}

fn lab_dir(file: &Path) -> &Path {
    file.parent().unwrap_or(Path::new("."))
}

/// A declaration directory read and loaded, or its diagnostics printed and an error.
fn read_valid(dir: &Path, read_declaration: ReadDeclaration) -> Result<Declaration> {
    let loaded = read_declaration(dir)?;
    let Some(decl) = loaded.declaration else {
        for d in &loaded.diagnostics {
            eprintln!("{d}");
        }
        bail!("{} is not a valid declaration", dir.display());
    };
    Ok(decl)
}

fn save(file: &Path, st: &LabState) -> Result<()> {
    let sp = state_path(file);
    std::fs::write(&sp, serde_json::to_vec_pretty(st)?).with_context(|| format!("cannot write {}", sp.display()))
}

/// Builds the lab, recording in the state file what it made at each stage, so that `down` (also
/// from Ctrl-C) finds the namespaces and the PostgreSQL server of a build cut short.
fn build(file: &Path, lab: &LabFile, decl_dir: &Path, decl: &Declaration, later: &[Declaration], st: &mut LabState) -> Result<()> {
    let started = Instant::now();
    progress(&format!("building {} ({} nets, {} hosts) as {}-*", lab.lab.name, lab.net.len(), lab.host.len(), st.prefix));
    let host_ns = net::build(lab, st);
    save(file, st)?;
    let host_ns = host_ns?;
    progress(&format!("network ready ({:.1}s)", started.elapsed().as_secs_f64()));

    let decls: Vec<&Declaration> = std::iter::once(decl).chain(later).collect();
    if let Some(h) = lab.acme() {
        let want = acme::directory(h);
        if let Some(d) = decls.iter().find_map(|d| d.acme.as_ref().filter(|a| Some(&a.directory) != want.as_ref())) {
            bail!("the declaration's [acme] directory is {}, but the lab's ACME CA serves {}", d.directory, want.unwrap_or_default());
        }
        let names = acme::names(lab, h, &decls)?;
        let ca = acme::start(h, &host_ns[&h.name], &names, st);
        save(file, st)?;
        st.acme_ca = Some(ca?);
        save(file, st)?;
        progress(&format!("ACME CA (pebble) up on {} for {} name(s) ({:.1}s)", h.name, names.len(), started.elapsed().as_secs_f64()));
    }
    let database_url = match lab.postgres() {
        Some(h) => {
            let url = pg::start(lab, h, &host_ns[&h.name], st);
            save(file, st)?;
            let url = url?;
            progress(&format!("PostgreSQL up on {} ({:.1}s)", h.name, started.elapsed().as_secs_f64()));
            Some(url)
        }
        None => None,
    };
    let started_controllers = procs::start_controllers(lab, &host_ns, database_url.as_deref(), decl_dir, st);
    save(file, st)?;
    started_controllers?;
    let at: Vec<String> = st.controllers.iter().map(|r| format!("{} {}", r.host, r.address)).collect();
    let db = if database_url.is_some() { "PostgreSQL" } else { "SQLite" };
    progress(&format!("controllers up ({}; {db}), declaration applied ({:.1}s)", at.join(", "), started.elapsed().as_secs_f64()));

    let listened = acme::listeners(&decls, &host_ns, st);
    save(file, st)?;
    listened?;
    if decls.iter().any(|d| !d.exposures.is_empty()) && traefik::ensure_user()? {
        progress("added the system user trellis-ingress, whom agents run Traefik as");
    }
    let mut first = timing::FirstPackets::default();
    st.agents = procs::start_agents(lab, decl, &host_ns, st, progress, |node, since, st| first.start(node, &host_ns[node], since, st))?;
    st.agents.sort();
    procs::converge(st, Duration::from_secs(90))?;
    progress(&format!("every node holds its bundle ({:.1}s)", started.elapsed().as_secs_f64()));
    progress(&format!("WireGuard (--wireguard {}): {}", st.wireguard, procs::interfaces(st)?.join(", ")));
    st.first_packet_ms = first.finish()?;
    progress(&format!("up in {:.1}s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// Runs every expectation through the overlay and prints expected versus seen, then the
/// timings; then takes the lab file's steps not taken yet, each followed by its figure and every
/// expectation then in force. True when every expectation was met.
pub fn check(file: &Path, read_declaration: ReadDeclaration) -> Result<bool> {
    let (lab, decl_dir) = load(file)?;
    let mut st: LabState = serde_json::from_slice(
        &std::fs::read(state_path(file))
            .with_context(|| format!("no lab from {} is up; run `trellis lab up {}`", file.display(), file.display()))?,
    )?;
    // The declaration in force after `steps` steps: that of the last apply among them.
    let in_force = |steps: usize| {
        (0..steps)
            .filter_map(|i| match lab.action(i, lab_dir(file)) {
                Action::Apply(dir) => Some(dir),
                Action::Kill(_)
                | Action::Stop(_)
                | Action::Revoke(_)
                | Action::Pause(_)
                | Action::Resume(_)
                | Action::Renew(_)
                | Action::Rotate(_)
                | Action::Rebind(_)
                | Action::Quiet(_) => None,
            })
            .next_back()
            .unwrap_or_else(|| decl_dir.clone())
    };
    let mut tally = Tally::default();
    wait_for_certificates(&lab, &st)?;
    tally.round(&lab, &st, &in_force(st.steps_done), read_declaration)?;
    for (node, ms) in &st.first_packet_ms {
        println!("token redeemed -> first packet over the overlay: {node} {ms} ms");
    }
    let retried = timing::waited_for_retry(&st.first_packet_ms);
    if !retried.is_empty() {
        // A failure: the agents follow their prompts up (a peer still without a handshake has it
        // restarted), so no first packet waits for WireGuard's own retry.
        println!("slow: a first packet waited past WireGuard's 5 s rekey timeout, for a handshake's retry: {}", retried.join(", "));
    }
    let dir = in_force(st.steps_done);
    let c = timing::reapply(&dir, &st)?;
    println!("re-apply -> every node converged: {} ms ({} of {} nodes changed)", c.took.as_millis(), c.changed, c.nodes);
    timing::apply_and_wait(&dir, &st, Duration::from_secs(60))?;
    // Every node converged: the metrics must say so.
    let desired = procs::status(&st)?.into_iter().filter_map(|n| Some((n.name, n.desired_version?))).collect();
    let metrics_wrong = metrics::report(&st, &desired)?;
    // Agents talk to the controller over the underlay, never through the overlay (an exit's
    // policy routing keeps the controller outside the tunnel).
    let through_overlay = control_through_overlay(&st, &read_valid(&in_force(st.steps_done), read_declaration)?)?;
    for i in st.steps_done..lab.step.len() {
        println!();
        steps::take_step(file, &lab, &mut st, i)?;
        st.steps_done = i + 1;
        save(file, &st)?;
        tally.round(&lab, &st, &in_force(st.steps_done), read_declaration)?;
    }
    println!("{} of {} expectations met", tally.rows - tally.failures, tally.rows);
    Ok(tally.failures == 0 && metrics_wrong.is_empty() && through_overlay.is_empty() && retried.is_empty())
}

/// Before the first round: until each https expectation in force that expects an answer is
/// served (at most 90 s each), as a step that applies an exposure waits, since an exposure
/// declared from the start has its ACME certificate issued only once its ingress runs, and a
/// round before that sees no certificate that verifies (curl exit 60). One never served is
/// printed, and its row then shows what it gets.
fn wait_for_certificates(lab: &LabFile, st: &LabState) -> Result<()> {
    let open = |e: &&file::Expect| e.proto == Some(file::Proto::Https) && e.outcome().0 == Some(file::Outcome::Open);
    let mut waited: Vec<String> = Vec::new();
    for e in lab.expectations(st.steps_done).iter().filter(open) {
        let (to, host) = (e.to.clone().unwrap_or_default(), e.host.clone().unwrap_or_default());
        let addr = checks::edge_address(lab, &e.from, &to)?;
        match timing::served(st, &e.from, &host, &addr, e.port().unwrap_or(443), Instant::now(), Duration::from_secs(90)) {
            Ok(took) => println!(
                "exposure in force -> https://{host}/ served to {} through {to}, its certificate verified against the lab's ACME root: waited {} ms before the first round",
                e.from,
                took.as_millis()
            ),
            Err(err) => println!("exposure in force -> {err:#}"),
        }
        if !waited.contains(&to) {
            traefik::print_ingress(st, &to)?;
            waited.push(to);
        }
    }
    Ok(())
}

/// The agents whose connection to a controller leaves from an overlay address, after printing
/// how every agent reaches its controller.
fn control_through_overlay(st: &LabState, decl: &Declaration) -> Result<Vec<String>> {
    let running: Vec<&str> = st.controllers.iter().filter(|r| !r.killed).map(|r| r.address.as_str()).collect();
    let overlay = |ip: &std::net::IpAddr| match ip {
        std::net::IpAddr::V4(a) => decl.mesh.overlay_ipv4.is_some_and(|p| p.contains(a)),
        std::net::IpAddr::V6(a) => decl.mesh.overlay_ipv6.is_some_and(|p| p.contains(a)),
    };
    let mut inside = Vec::new();
    let mut held = 0;
    for node in &st.agents {
        let sources = timing::control_sources(st, node, &running);
        held += usize::from(!sources.is_empty());
        if sources.iter().any(overlay) {
            inside.push(node.clone());
        }
    }
    if inside.is_empty() {
        println!(
            "agents reach the controller outside the overlay: {held} of {} hold a connection, none through the overlay",
            st.agents.len()
        );
    } else {
        println!("NO: agents reach the controller through the overlay: {}", inside.join(", "));
    }
    Ok(inside)
}

/// Rows checked and rows not met, over every round of `check`.
#[derive(Default)]
struct Tally {
    rows: usize,
    failures: usize,
}

impl Tally {
    /// Checks and prints every expectation in force after `st.steps_done` steps, with the
    /// overlay addresses of `decl_dir`, the declaration in force.
    fn round(&mut self, lab: &LabFile, st: &LabState, decl_dir: &Path, read_declaration: ReadDeclaration) -> Result<()> {
        let decl = read_valid(decl_dir, read_declaration)?;
        let addrs = checks::overlay_addresses(&st.dir, &decl, &st.agents)?;
        let underlay = checks::Underlay {
            addresses: lab.host.iter().map(|h| (h.name.clone(), h.addresses.values().filter_map(|a| a.parse().ok()).collect())).collect(),
            // Reached at their lab addresses: every host that is no node of the declaration nor a
            // pool's member (a member is a node the declaration does not name).
            outside: lab.host.iter().filter(|h| decl.node(&h.name).is_none() && h.pool.is_none()).map(|h| h.name.clone()).collect(),
        };
        let hubs: Vec<String> = decl.nodes.iter().filter(|n| n.hub).map(|n| n.name.clone()).collect();
        let rows = checks::run_round(&lab.expectations(st.steps_done), lab, &addrs, &underlay, &hubs, st)?;
        checks::print(&rows);
        self.rows += rows.len();
        self.failures += rows.iter().filter(|r| !r.ok()).count();
        Ok(())
    }
}

/// Removes every namespace and process the lab made from `file`; nothing to do when it is not up.
pub fn down(file: &Path) -> Result<()> {
    let sp = state_path(file);
    let Ok(bytes) = std::fs::read(&sp) else {
        progress(&format!("nothing to take down for {}", file.display()));
        return Ok(());
    };
    let st: LabState = serde_json::from_slice(&bytes).with_context(|| format!("{} is not a lab state", sp.display()))?;
    // PostgreSQL first, by its own hand: killed with the rest, it would leave its shared memory.
    if let Some(pg) = &st.postgres {
        pg::stop(pg);
    }
    net::remove(&st);
    // The processes' logs outlive the lab for whoever asks (`TRELLIS_LAB_KEEP_LOGS=DIR`): a test
    // that reads a figure the lab printed can show what the controller logged of it.
    if let Some(keep) = std::env::var_os("TRELLIS_LAB_KEEP_LOGS") {
        keep_logs(&st.dir, Path::new(&keep));
    }
    let _ = std::fs::remove_dir_all(&st.dir);
    std::fs::remove_file(&sp).with_context(|| format!("cannot remove {}", sp.display()))?;
    progress(&format!("removed {} namespaces and their processes", st.namespaces.len()));
    Ok(())
}

/// Copies the `.log` files of `dir` into `to` (made if missing); says so, or why not.
fn keep_logs(dir: &Path, to: &Path) {
    let copied = std::fs::create_dir_all(to).and_then(|_| {
        let mut n = 0;
        for e in std::fs::read_dir(dir)?.flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                std::fs::copy(e.path(), to.join(e.file_name()))?;
                n += 1;
            }
        }
        Ok(n)
    });
    match copied {
        Ok(n) => progress(&format!("{n} log(s) kept in {}", to.display())),
        Err(e) => progress(&format!("cannot keep the logs in {}: {e}", to.display())),
    }
}

/// `up` (agents on `--wireguard WIREGUARD`), `check` and `down`, taking the lab down on Ctrl-C
/// too; exit status 1 when an expectation was not met.
pub fn run(file: &Path, read_declaration: ReadDeclaration, wireguard: &str) -> Result<ExitCode> {
    let started = Instant::now();
    // A lab of this file that is up already is another run's: refused before anything is done,
    // so that neither Ctrl-C nor the `down` below, which follows a failed `up`, takes it down.
    let st = claim(file, wireguard)?;
    let f = file.to_path_buf();
    let _ = ctrlc::set_handler(move || {
        let _ = down(&f);
        std::process::exit(130);
    });
    let result = plan(file, read_declaration).and_then(|p| up_claimed(file, p, st)).and_then(|_| check(file, read_declaration));
    let cleaned = down(file);
    let ok = result?;
    cleaned?;
    println!("lab run of {} took {:.1}s", file.display(), started.elapsed().as_secs_f64());
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

#[cfg(test)]
mod run_tests {
    /// A second run of a lab file that is up refuses and leaves the first one's state (and so its
    /// namespaces and processes) as it was: it used to take the first one down on its way out.
    #[test]
    fn a_second_run_of_a_lab_that_is_up_leaves_it_up() {
        let dir = std::env::temp_dir().join(format!("trellis-lab-second-run-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("up.toml");
        std::fs::write(&file, "").unwrap();
        let state = super::state_path(&file);
        let held = br#"{"prefix":"tlffff","dir":"/nonexistent","namespaces":["tlffff-a"]}"#;
        std::fs::write(&state, held).unwrap();
        let err = super::run(&file, |_| unreachable!("nothing is read"), "auto").unwrap_err().to_string();
        let kept = std::fs::read(&state);
        let _ = std::fs::remove_file(&state);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(err.contains("is already up; run `trellis lab down"), "{err}");
        assert_eq!(kept.unwrap(), held.to_vec(), "the first run's state was removed");
    }

    /// Of runs of one lab file started at once, exactly one claims the lab; every other is
    /// refused at once with the sentence and leaves the state the first wrote as it was. A check
    /// that no state exists followed by a write of it let two through.
    #[test]
    fn of_runs_started_at_once_exactly_one_claims_the_lab() {
        const RUNS: usize = 8;
        let dir = trellis_testing::TempDir::new("lab-claim");
        let file = dir.join("race.toml");
        std::fs::write(&file, "").unwrap();
        let state = super::state_path(&file);
        // The state lives next to every other lab's, not in `dir`: removed also when an assertion fails.
        struct Remove(std::path::PathBuf);
        impl Drop for Remove {
            fn drop(&mut self) {
                let _ = std::fs::remove_file(&self.0);
            }
        }
        let _removed = Remove(state.clone());
        for round in 0..500 {
            let _ = std::fs::remove_file(&state);
            let start = std::sync::Barrier::new(RUNS);
            let claims: Vec<anyhow::Result<super::LabState>> = std::thread::scope(|s| {
                let runs: Vec<_> = (0..RUNS)
                    .map(|_| {
                        s.spawn(|| {
                            start.wait();
                            super::claim(&file, "auto")
                        })
                    })
                    .collect();
                runs.into_iter().map(|r| r.join().unwrap()).collect()
            });
            let won: Vec<&super::LabState> = claims.iter().filter_map(|c| c.as_ref().ok()).collect();
            assert_eq!(won.len(), 1, "round {round}: {} of {RUNS} runs started at once claimed the lab", won.len());
            for err in claims.iter().filter_map(|c| c.as_ref().err()) {
                let err = err.to_string();
                assert!(err.contains(&format!("a lab from {} is already up; run `trellis lab down", file.display())), "{err}");
            }
            let held: super::LabState = serde_json::from_slice(&std::fs::read(&state).unwrap()).unwrap();
            assert_eq!((&held.prefix, &held.dir), (&won[0].prefix, &won[0].dir), "round {round}: the state is not the winner's");
        }
    }
}
