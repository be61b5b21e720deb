//! The real binaries in the lab: `trellis init`, `serve` and `apply` in the controller's
//! namespace, `trellis-agent enrol` and `run` in each node's, and waiting for convergence.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use trellis_proto::{NodeState, NodeStatus};

use crate::net::{in_ns, ns_cmd};
use crate::LabState;

/// The port the lab's controller listens on.
const PORT: u16 = 8443;

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

fn path_str(p: &Path) -> Result<&str> {
    p.to_str().with_context(|| format!("{} is not UTF-8", p.display()))
}

/// The controller's state directory in the lab.
pub(crate) fn controller_state(st: &LabState) -> PathBuf {
    st.dir.join("controller")
}

/// `trellis init` and `trellis serve` in the controller's namespace, waits until it accepts
/// connections, then applies the declaration. Records the process and the advertised address.
pub(crate) fn start_controller(ns: &str, address: &str, decl_dir: &Path, st: &mut LabState) -> Result<()> {
    let advertise = if address.contains(':') { format!("[{address}]:{PORT}") } else { format!("{address}:{PORT}") };
    st.controller = advertise.clone();
    let trellis = exe("trellis")?;
    let t = path_str(&trellis)?;
    let state = controller_state(st);
    let s = path_str(&state)?;
    in_ns(ns, &[t, "init", "--state-dir", s, "--advertise", &advertise])?;
    let log_path = st.dir.join("serve.log");
    let log = std::fs::File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
    let serve = ns_cmd(ns, &[t, "serve", "--state-dir", s]).stdout(Stdio::null()).stderr(log).spawn()?;
    st.pids.push(serve.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ns_cmd(ns, &["nc", "-z", "-w", "1", address, &PORT.to_string()]).status().is_ok_and(|s| s.success()) {
        if Instant::now() > deadline {
            bail!("the controller did not start; see {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    apply(ns, decl_dir, st)
}

/// `trellis apply DIR` against the lab's controller.
pub(crate) fn apply(ctl_ns: &str, decl_dir: &Path, st: &LabState) -> Result<()> {
    let trellis = exe("trellis")?;
    in_ns(ctl_ns, &[path_str(&trellis)?, "apply", path_str(decl_dir)?, "--state-dir", path_str(&controller_state(st))?]).map(|_| ())
}

/// For every node the lab enrols (one without a declared key): a token from the controller,
/// `trellis-agent enrol` and then `trellis-agent run` in the node's namespace, each agent in its
/// own mount namespace so the userspace WireGuard control sockets do not collide. Returns when
/// each token was redeemed.
pub(crate) fn start_agents(
    decl: &trellis_core::Declaration,
    ctl_ns: &str,
    host_ns: &HashMap<String, String>,
    st: &mut LabState,
    progress: impl Fn(&str),
) -> Result<HashMap<String, Instant>> {
    let trellis = exe("trellis")?;
    let t = path_str(&trellis)?;
    let agent = exe("trellis-agent")?;
    let a = path_str(&agent)?;
    let state = controller_state(st);
    let mut redeemed: HashMap<String, Instant> = HashMap::new();
    for node in &decl.nodes {
        if node.public_key.is_some() {
            continue;
        }
        let ns = &host_ns[&node.name];
        let token = in_ns(ctl_ns, &[t, "token", "create", &node.name, "--state-dir", path_str(&state)?])?.trim().to_string();
        let sdir = st.dir.join(format!("agent-{}", node.name));
        let root = st.dir.join(format!("root-{}", node.name));
        redeemed.insert(node.name.clone(), Instant::now());
        // The token goes through a file, as an operator should paste it: not on a command line.
        let token_file = st.dir.join(format!("token-{}", node.name));
        trellis_files::create_new(&token_file, token.as_bytes(), 0o600)?;
        in_ns(ns, &[a, "enrol", "--token-file", path_str(&token_file)?, "--state-dir", path_str(&sdir)?])?;
        let cmd = format!(
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard && exec {a} run --state-dir {} --root {} --wireguard auto --max-backoff 2",
            sdir.display(),
            root.display()
        );
        let log_path = st.dir.join(format!("agent-{}.log", node.name));
        let log = std::fs::File::create(&log_path).with_context(|| format!("cannot create {}", log_path.display()))?;
        let child = ns_cmd(ns, &["unshare", "-m", "sh", "-c", &cmd]).stdout(Stdio::null()).stderr(log).spawn()?;
        st.pids.push(child.id());
        progress(&format!("{} enrolled, agent running", node.name));
    }
    Ok(redeemed)
}

/// Waits until at least one node is active and every active node has applied its desired
/// version, as `trellis status` reports it.
pub(crate) fn converge(ctl_ns: &str, st: &LabState, limit: Duration) -> Result<()> {
    let trellis = exe("trellis")?;
    let state = controller_state(st);
    let deadline = Instant::now() + limit;
    loop {
        let text = in_ns(ctl_ns, &[path_str(&trellis)?, "status", "--json", "--state-dir", path_str(&state)?])?;
        let list: Vec<NodeStatus> =
            serde_json::from_str(&text).context("`trellis status --json` printed something else than a status list")?;
        let active: Vec<&NodeStatus> = list.iter().filter(|n| n.state == NodeState::Active).collect();
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
