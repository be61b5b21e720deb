//! The real binaries in the lab: `trellis init` once and `trellis serve` in every controller's
//! namespace, the admin commands through a controller still running, `trellis-agent enrol` and
//! `run` in each node's, killing a controller, and waiting for convergence.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use trellis_proto::{NodeState, NodeStatus};

use crate::file::LabFile;
use crate::net::{in_ns, ns_cmd, sh};
use crate::LabState;

/// The port the lab's controllers listen on.
pub(crate) const PORT: u16 = 8443;

/// A controller replica the lab runs: `trellis serve` in its host's namespace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Replica {
    pub host: String,
    pub ns: String,
    /// The lab address it is reached at.
    pub ip: String,
    /// HOST:PORT, as tokens carry it.
    pub address: String,
    pub state_dir: PathBuf,
    pub pid: u32,
    pub killed: bool,
}

/// A binary next to the running one (the lab runs inside `trellis`, so `trellis-agent` must
/// have been built beside it).
pub(crate) fn exe(name: &str) -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let p = me.parent().context("no directory for the trellis binary")?.join(name);
    if !p.exists() {
        bail!("{} not found next to {}; build both binaries", p.display(), me.display());
    }
    Ok(p)
}

pub(crate) fn path_str(p: &Path) -> Result<&str> {
    p.to_str().with_context(|| format!("{} is not UTF-8", p.display()))
}

/// HOST:PORT for an address, with brackets for IPv6.
fn host_port(address: &str, port: u16) -> String {
    if address.contains(':') {
        format!("[{address}]:{port}")
    } else {
        format!("{address}:{port}")
    }
}

/// Copies a controller's state directory (files only, modes kept) into a new private one: a
/// replica needs the same CA, server certificate, signing key and admin credential.
fn copy_state(from: &Path, to: &Path) -> Result<()> {
    trellis_files::private_dir(to).with_context(|| format!("cannot create {}", to.display()))?;
    for e in std::fs::read_dir(from).with_context(|| format!("cannot read {}", from.display()))? {
        let e = e.with_context(|| format!("cannot read {}", from.display()))?;
        if e.file_type()?.is_file() {
            std::fs::copy(e.path(), to.join(e.file_name()))
                .with_context(|| format!("cannot copy {} to {}", e.path().display(), to.display()))?;
        }
    }
    Ok(())
}

/// Initialises the controller once, with every controller's address advertised (and so carried
/// by every token and named in the server certificate) and the lab's PostgreSQL when there is
/// one; copies its state directory to every other controller; starts `trellis serve` in every
/// controller's namespace and waits until each accepts connections; then applies the
/// declaration through the first.
pub(crate) fn start_controllers(
    lab: &LabFile,
    host_ns: &HashMap<String, String>,
    database_url: Option<&str>,
    decl_dir: &Path,
    st: &mut LabState,
) -> Result<()> {
    let trellis = exe("trellis")?;
    let t = path_str(&trellis)?;
    for h in lab.controllers() {
        let address = h.addresses.values().next().context("a controller host has no address")?;
        st.controllers.push(Replica {
            host: h.name.clone(),
            ns: host_ns[&h.name].clone(),
            ip: address.clone(),
            address: host_port(address, PORT),
            state_dir: st.dir.join(format!("controller-{}", h.name)),
            pid: 0,
            killed: false,
        });
    }
    let first = st.controllers[0].clone();
    let mut init = vec![t, "init", "--state-dir", path_str(&first.state_dir)?];
    for r in &st.controllers {
        init.extend(["--advertise", r.address.as_str()]);
    }
    if let Some(url) = database_url {
        init.extend(["--database-url", url]);
    }
    in_ns(&first.ns, &init)?;
    for r in &st.controllers[1..] {
        copy_state(&first.state_dir, &r.state_dir)?;
    }
    for i in 0..st.controllers.len() {
        let r = &st.controllers[i];
        let log_path = st.dir.join(format!("serve-{}.log", r.host));
        let log = std::fs::File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
        let serve = ns_cmd(&r.ns, &[t, "serve", "--state-dir", path_str(&r.state_dir)?, "--metrics-listen", crate::metrics::CONTROLLER])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()?;
        st.pids.push(serve.id());
        st.controllers[i].pid = serve.id();
    }
    for r in &st.controllers {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !ns_cmd(&r.ns, &["nc", "-z", "-w", "1", &r.ip, &PORT.to_string()]).status().is_ok_and(|s| s.success()) {
            if Instant::now() > deadline {
                bail!("the controller on `{}` did not start; see {}", r.host, st.dir.join(format!("serve-{}.log", r.host)).display());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    apply(st, decl_dir)
}

/// Runs an admin command (`trellis ARGS`) through the first controller still running, from its
/// namespace, naming it with `--server`: a replica's own address, not the first one advertised.
pub(crate) fn admin(st: &LabState, args: &[&str]) -> Result<String> {
    let r = st.serving()?;
    let trellis = exe("trellis")?;
    let mut full = vec![path_str(&trellis)?];
    full.extend_from_slice(args);
    let (token, ca) = (r.state_dir.join("admin.token"), r.state_dir.join("ca.pem"));
    full.extend(["--server", r.address.as_str(), "--admin-token-file", path_str(&token)?, "--ca-file", path_str(&ca)?]);
    in_ns(&r.ns, &full)
}

/// An admin command through a running controller that may exit 1 and still print its answer
/// (`trellis node revoke --wait`): whether it succeeded, and its standard output.
pub(crate) fn admin_answer(st: &LabState, args: &[&str]) -> Result<(bool, String)> {
    let r = st.serving()?;
    let trellis = exe("trellis")?;
    let (token, ca) = (r.state_dir.join("admin.token"), r.state_dir.join("ca.pem"));
    let mut c = ns_cmd(&r.ns, &[path_str(&trellis)?]);
    c.args(args).args(["--server", r.address.as_str(), "--admin-token-file", path_str(&token)?, "--ca-file", path_str(&ca)?]);
    let out = c.output().with_context(|| format!("cannot run trellis {}", args.join(" ")))?;
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() && stdout.trim().is_empty() {
        bail!("`trellis {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok((out.status.success(), stdout))
}

/// `trellis apply DIR` through a running controller.
pub(crate) fn apply(st: &LabState, decl_dir: &Path) -> Result<()> {
    admin(st, &["apply", path_str(decl_dir)?]).map(|_| ())
}

/// `trellis status --json` through a running controller.
pub(crate) fn status(st: &LabState) -> Result<Vec<NodeStatus>> {
    let text = admin(st, &["status", "--json"])?;
    serde_json::from_str(&text).context("`trellis status --json` printed something else than a status list")
}

/// How long an enrolment may take to settle: every active node applied what it changed.
const SETTLE: Duration = Duration::from_secs(30);

/// For every node the lab enrols (one without a declared key): a token from a running
/// controller, `trellis-agent enrol` and then `trellis-agent run` in the node's namespace, each
/// agent in its own mount namespace so the userspace WireGuard control sockets do not collide.
/// The next token is redeemed once every node applied what the last enrolment changed: each node
/// is timed on a settled mesh, not behind the applies of the nodes enrolled just before it (in a
/// fleet, one enrolment changes the bundles of every node that peers with the new one).
/// Then each pool's hosts, in order, with one pool token of as many uses: each must be given the
/// member name its host has. `started` is told of each agent as soon as it runs, with the
/// moment its token was redeemed. Returns the nodes enrolled.
pub(crate) fn start_agents(
    lab: &LabFile,
    decl: &trellis_core::Declaration,
    host_ns: &HashMap<String, String>,
    st: &mut LabState,
    progress: impl Fn(&str),
    mut started: impl FnMut(&str, Instant, &LabState),
) -> Result<Vec<String>> {
    let mut enrolled = Vec::new();
    for node in &decl.nodes {
        if node.public_key.is_some() {
            continue;
        }
        let token = admin(st, &["token", "create", &node.name])?.trim().to_string();
        let redeemed = Instant::now();
        enrol_and_run(&node.name, &host_ns[&node.name], &token, st)?;
        started(&node.name, redeemed, st);
        enrolled.push(node.name.clone());
        progress(&format!("{} enrolled, agent running", node.name));
        settle(st)?;
    }
    for (pool, hosts) in lab.pools() {
        let uses = hosts.len().to_string();
        let token = admin(st, &["token", "create", "--pool", pool, "--uses", &uses])?.trim().to_string();
        for h in hosts {
            let redeemed = Instant::now();
            let node = enrol_and_run(&h.name, &host_ns[&h.name], &token, st)?;
            if node != h.name {
                bail!("host `{}` enrolled with the token of pool `{pool}` and was named `{node}`; the lab names it `{}`", h.name, h.name);
            }
            started(&h.name, redeemed, st);
            enrolled.push(h.name.clone());
            progress(&format!("{} enrolled as a member of pool {pool}, agent running", h.name));
            settle(st)?;
        }
    }
    Ok(enrolled)
}

/// Enrols host `host` (in namespace `ns`) with `token` and runs its agent; returns the node name
/// the controller gave it, as the agent's identity says.
fn enrol_and_run(host: &str, ns: &str, token: &str, st: &mut LabState) -> Result<String> {
    let agent = exe("trellis-agent")?;
    let a = path_str(&agent)?;
    let sdir = st.dir.join(format!("agent-{host}"));
    let root = st.dir.join(format!("root-{host}"));
    // The token goes through a file, as an operator should paste it: not on a command line.
    let token_file = st.dir.join(format!("token-{host}"));
    trellis_files::create_new(&token_file, token.as_bytes(), 0o600)?;
    in_ns(ns, &[a, "enrol", "--token-file", path_str(&token_file)?, "--state-dir", path_str(&sdir)?])?;
    let identity: serde_json::Value = serde_json::from_str(&in_ns(ns, &[a, "status", "--json", "--state-dir", path_str(&sdir)?])?)
        .context("`trellis-agent status --json` printed something else than JSON")?;
    let node = identity["node"].as_str().context("`trellis-agent status --json` names no node")?.to_string();
    // An ingress's Traefik trusts the lab's ACME directory by its certificate (lego's variable).
    let acme = st.acme_ca.as_ref().map_or(String::new(), |ca| format!("env LEGO_CA_CERTIFICATES={} ", ca.display()));
    let cmd = format!(
        "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard && exec {acme}{a} run --state-dir {} --root {} --wireguard {} --max-backoff 2 --metrics-listen {}",
        sdir.display(),
        root.display(),
        if st.wireguard.is_empty() { "auto" } else { &st.wireguard },
        crate::metrics::AGENT
    );
    let log_path = st.dir.join(format!("agent-{host}.log"));
    let log = std::fs::File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let child = ns_cmd(ns, &["unshare", "-m", "sh", "-c", &cmd]).stdout(Stdio::null()).stderr(log).spawn()?;
    st.pids.push(child.id());
    st.agent_pids.insert(host.to_string(), child.id());
    st.agent_started_ms.insert(host.to_string(), crate::unix_ms());
    Ok(node)
}

/// Waits until every node applied what the last enrolment changed. The controller answers for
/// the audit checkpoint once the publish run covering the enrolment is done (as an apply's wait
/// does); until then no node's desired version shows the change.
fn settle(st: &LabState) -> Result<()> {
    admin(st, &["audit", "verify"])?;
    converge(st, SETTLE)
}

/// Stops host `host`'s agent with SIGKILL, as a runner that is switched off, and waits until it
/// has ended. Recorded in `st`.
pub(crate) fn stop(st: &mut LabState, host: &str) -> Result<()> {
    let pid = *st.agent_pids.get(host).with_context(|| format!("the lab runs no agent on `{host}`"))?;
    // The pid is the one `ip netns exec` became (then unshare, sh and the agent, each by exec).
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    if exe.file_name().and_then(|n| n.to_str()) != Some("trellis-agent") || ended(pid) {
        bail!("the agent on `{host}` (pid {pid}) is not running; see {}", st.dir.join(format!("agent-{host}.log")).display());
    }
    sh(&["kill", "-KILL", &pid.to_string()])?;
    st.pids.retain(|p| *p != pid);
    st.agent_pids.remove(host);
    st.agents.retain(|a| a != host);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ended(pid) {
        if Instant::now() > deadline {
            bail!("the agent on `{host}` (pid {pid}) did not end after SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// The pid of host `host`'s agent, checked to be a running `trellis-agent`.
fn agent_pid(st: &LabState, host: &str) -> Result<u32> {
    let pid = *st.agent_pids.get(host).with_context(|| format!("the lab runs no agent on `{host}`"))?;
    let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
    if exe.file_name().and_then(|n| n.to_str()) != Some("trellis-agent") || ended(pid) {
        bail!("the agent on `{host}` (pid {pid}) is not running; see {}", st.dir.join(format!("agent-{host}.log")).display());
    }
    Ok(pid)
}

/// Pauses host `host`'s agent (SIGSTOP), as a node that hangs or is suspended: it applies and
/// reports nothing until [`resume`]. Waits until it is stopped; recorded in `st`.
pub(crate) fn pause(st: &mut LabState, host: &str) -> Result<()> {
    let pid = agent_pid(st, host)?;
    sh(&["kill", "-STOP", &pid.to_string()])?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while process_state(pid) != Some('T') {
        if Instant::now() > deadline {
            bail!("the agent on `{host}` (pid {pid}) did not stop after SIGSTOP");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    st.paused.push(host.to_string());
    Ok(())
}

/// Lets host `host`'s agent, paused by [`pause`], continue (SIGCONT).
pub(crate) fn resume(st: &mut LabState, host: &str) -> Result<()> {
    if !st.paused.iter().any(|p| p == host) {
        bail!("the agent on `{host}` is not paused");
    }
    let pid = *st.agent_pids.get(host).with_context(|| format!("the lab runs no agent on `{host}`"))?;
    sh(&["kill", "-CONT", &pid.to_string()])?;
    st.paused.retain(|p| p != host);
    Ok(())
}

/// `trellis nodes --json` through a running controller.
pub(crate) fn nodes(st: &LabState) -> Result<Vec<trellis_proto::NodeInfo>> {
    let text = admin(st, &["nodes", "--json"])?;
    serde_json::from_str(&text).context("`trellis nodes --json` printed something else than a node list")
}

/// Each agent's WireGuard interface and backend (`api-1 trellis0 (wireguard-go)`), as its
/// `trellis-agent status` reports it.
pub(crate) fn interfaces(st: &LabState) -> Result<Vec<String>> {
    let agent = exe("trellis-agent")?;
    let mut out = Vec::new();
    for node in &st.agents {
        let sdir = st.dir.join(format!("agent-{node}"));
        let text = in_ns(&format!("{}-{node}", st.prefix), &[path_str(&agent)?, "status", "--state-dir", path_str(&sdir)?, "--json"])?;
        let status: serde_json::Value =
            serde_json::from_str(&text).with_context(|| format!("`trellis-agent status` of {node} is not JSON"))?;
        out.push(format!("{node} {}", status["interface"].as_str().unwrap_or("none")));
    }
    Ok(out)
}

/// Waits until at least one node is active and every active node (but those whose agent is
/// paused) has applied its desired version, as `trellis status` reports it.
pub(crate) fn converge(st: &LabState, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let list = status(st)?;
        let active: Vec<&NodeStatus> = list.iter().filter(|n| n.state == NodeState::Active && !st.paused.contains(&n.name)).collect();
        let pending: Vec<&str> = active.iter().filter(|n| n.desired_version != n.applied_version).map(|n| n.name.as_str()).collect();
        if pending.is_empty() && !active.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("nodes did not converge: {}", pending.join(", "));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Whether process `pid` has ended (gone, or a zombie its parent has not reaped).
fn ended(pid: u32) -> bool {
    process_state(pid).is_none_or(|s| s == 'Z' || s == 'X')
}

/// The state letter of process `pid` (`R`, `S`, `T`, `Z`...), if it exists.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(") ").and_then(|(_, rest)| rest.chars().next())
}

/// Kills controller `host`'s `trellis serve` with SIGKILL, as a crash would end it, and waits
/// until it has ended. Recorded in `st`.
pub(crate) fn kill(st: &mut LabState, host: &str) -> Result<()> {
    let r = st.controllers.iter_mut().find(|r| r.host == host).with_context(|| format!("the lab runs no controller on `{host}`"))?;
    if r.killed {
        bail!("the controller on `{host}` was killed already");
    }
    // The pid is the one `ip netns exec` became: make sure it is still trellis before the kill.
    let exe = std::fs::read_link(format!("/proc/{}/exe", r.pid)).unwrap_or_default();
    if exe.file_name().and_then(|n| n.to_str()) != Some("trellis") || ended(r.pid) {
        bail!("the controller on `{host}` (pid {}) is not running; see {}", r.pid, st.dir.join(format!("serve-{host}.log")).display());
    }
    sh(&["kill", "-KILL", &r.pid.to_string()])?;
    r.killed = true;
    let pid = r.pid;
    // Its number may be another process's by the time `down` runs.
    st.pids.retain(|p| *p != pid);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ended(pid) {
        if Instant::now() > deadline {
            bail!("the controller on `{host}` (pid {pid}) did not end after SIGKILL");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}
