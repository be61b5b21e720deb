//! The lab: a declared mesh built in network namespaces with the real controller and agents,
//! its expectations checked through the overlay, and everything removed. Every address is one
//! of the lab's own namespaces; every wait is bounded.
//!
//! `file` is the lab file and its validation; `net` the namespaces, bridges and routers;
//! `procs` the controller and agent processes; `checks` the expectation matrix; `timing` the
//! first-packet and re-apply figures. The declaration directory is read by the caller's reader
//! (`ReadDeclaration`), the one `trellis check` uses.

mod checks;
pub mod file;
mod net;
mod procs;
mod timing;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use trellis_core::{Declaration, Loaded};

pub use file::{load, LabFile};

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
    pub controller: String,
}

fn state_path(file: &Path) -> PathBuf {
    let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or("lab");
    std::env::temp_dir().join(format!("trellis-lab-{name}.json"))
}

fn progress(msg: &str) {
    eprintln!("lab: {msg}");
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
/// convergence. What was made is recorded next to the lab even when a step fails.
pub fn up(file: &Path, read_declaration: ReadDeclaration) -> Result<LabState> {
    if !is_root() {
        bail!("the lab needs root: it makes network namespaces");
    }
    let (lab, decl_dir) = load(file)?;
    let loaded = read_declaration(&decl_dir)?;
    let Some(decl) = loaded.declaration else {
        for d in &loaded.diagnostics {
            eprintln!("{d}");
        }
        bail!("{} is not a valid declaration", decl_dir.display());
    };
    file::check_endpoints(&lab, &decl)?;
    let sp = state_path(file);
    if sp.exists() {
        bail!("a lab from {} is already up; run `trellis lab down {}` first", file.display(), file.display());
    }
    let prefix = format!("tl{:04x}", rand_u16());
    let dir = std::env::temp_dir().join(format!("trellis-lab-{prefix}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut st = LabState { prefix: prefix.clone(), dir: dir.clone(), ..Default::default() };
    let result = build(&lab, &decl_dir, &decl, &mut st);
    std::fs::write(&sp, serde_json::to_vec_pretty(&st)?).with_context(|| format!("cannot write {}", sp.display()))?;
    result.map(|_| st)
}

fn build(lab: &LabFile, decl_dir: &Path, decl: &Declaration, st: &mut LabState) -> Result<()> {
    let started = Instant::now();
    progress(&format!("building {} ({} nets, {} hosts) as {}-*", lab.lab.name, lab.net.len(), lab.host.len(), st.prefix));
    let host_ns = net::build(lab, st)?;
    progress(&format!("network ready ({:.1}s)", started.elapsed().as_secs_f64()));

    let ctl = lab.controller();
    let ctl_ns = &host_ns[&ctl.name];
    let ctl_addr = ctl.addresses.values().next().context("the controller host has no address")?;
    procs::start_controller(ctl_ns, ctl_addr, decl_dir, st)?;
    progress(&format!("controller up at {}, declaration applied ({:.1}s)", st.controller, started.elapsed().as_secs_f64()));

    let redeemed = procs::start_agents(decl, ctl_ns, &host_ns, st, progress)?;
    procs::converge(ctl_ns, st, Duration::from_secs(90))?;
    progress(&format!("every node holds its bundle ({:.1}s)", started.elapsed().as_secs_f64()));
    st.first_packet_ms = timing::first_packets(decl, &host_ns, &redeemed, st)?;
    progress(&format!("up in {:.1}s", started.elapsed().as_secs_f64()));
    Ok(())
}

/// Runs every expectation through the overlay and prints expected versus seen, then the
/// timings; true when every expectation was met.
pub fn check(file: &Path, read_declaration: ReadDeclaration) -> Result<bool> {
    let (lab, decl_dir) = load(file)?;
    let st: LabState = serde_json::from_slice(
        &std::fs::read(state_path(file))
            .with_context(|| format!("no lab from {} is up; run `trellis lab up {}`", file.display(), file.display()))?,
    )?;
    let decl = read_declaration(&decl_dir)?.declaration.context("declaration")?;
    let addrs = checks::overlay_addresses(&st.dir, &decl)?;
    let rows = lab.expect.iter().enumerate().map(|(i, e)| checks::run(i, e, &addrs, &st)).collect::<Result<Vec<_>>>()?;
    let failures = rows.iter().filter(|r| !r.ok()).count();
    checks::print(&rows);
    for (node, ms) in &st.first_packet_ms {
        println!("token redeemed -> first packet over the overlay: {node} {ms} ms");
    }
    let ctl_ns = format!("{}-{}", st.prefix, lab.controller().name);
    let took = timing::reapply(&ctl_ns, &decl_dir, &st)?;
    println!("re-apply -> every node converged: {} ms", took.as_millis());
    procs::apply(&ctl_ns, &decl_dir, &st)?;
    procs::converge(&ctl_ns, &st, Duration::from_secs(60))?;
    println!("{} of {} expectations met", rows.len() - failures, rows.len());
    Ok(failures == 0)
}

/// Removes every namespace and process the lab made from `file`; nothing to do when it is not up.
pub fn down(file: &Path) -> Result<()> {
    let sp = state_path(file);
    let Ok(bytes) = std::fs::read(&sp) else {
        progress(&format!("nothing to take down for {}", file.display()));
        return Ok(());
    };
    let st: LabState = serde_json::from_slice(&bytes).with_context(|| format!("{} is not a lab state", sp.display()))?;
    net::remove(&st);
    let _ = std::fs::remove_dir_all(&st.dir);
    std::fs::remove_file(&sp).with_context(|| format!("cannot remove {}", sp.display()))?;
    progress(&format!("removed {} namespaces and their processes", st.namespaces.len()));
    Ok(())
}

/// `up`, `check` and `down`, taking the lab down on Ctrl-C too; exit status 1 when an
/// expectation was not met.
pub fn run(file: &Path, read_declaration: ReadDeclaration) -> Result<ExitCode> {
    let started = Instant::now();
    let f = file.to_path_buf();
    let _ = ctrlc::set_handler(move || {
        let _ = down(&f);
        std::process::exit(130);
    });
    let result = up(file, read_declaration).and_then(|_| check(file, read_declaration));
    let cleaned = down(file);
    let ok = result?;
    cleaned?;
    println!("lab run of {} took {:.1}s", file.display(), started.elapsed().as_secs_f64());
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
