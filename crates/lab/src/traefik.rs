//! The Traefik an ingress node's agent runs, seen from outside (the review of 2026-12-02,
//! finding 6): the system user it runs as, added where the host lacks it, and the running
//! process: that user's, with `CAP_NET_BIND_SERVICE` alone and no new privileges, unable to open
//! the node's keys; and what its agent and the controller report of it (`print_ingress`).

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{procs, LabState};

/// The system user agents run Traefik as (trellis-agent's `ingress::USER`).
const USER: &str = "trellis-ingress";

/// A capability set of `CAP_NET_BIND_SERVICE` alone, as /proc/PID/status writes it.
const NET_BIND_SERVICE_ONLY: &str = "0000000000000400";

/// Adds Traefik's user when the host has none, as trellis-agent's .deb does; true when added.
pub(crate) fn ensure_user() -> Result<bool> {
    let exists = || Command::new("getent").args(["passwd", USER]).stdout(Stdio::null()).status().is_ok_and(|s| s.success());
    if exists() {
        return Ok(false);
    }
    let out = Command::new("useradd")
        .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER])
        .output()
        .context("cannot run useradd")?;
    // A lab or test beside this one may have added it meanwhile.
    if !exists() {
        bail!("useradd {USER}: {}: {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(true)
}

/// A field of `/proc/PID/status`.
fn field(status: &str, name: &str) -> Option<String> {
    let prefix = format!("{name}:");
    status.lines().find_map(|l| l.strip_prefix(&prefix)).map(|v| v.trim().to_string())
}

/// The `traefik` child of the process `agent`, waited for up to 10 s.
fn child(agent: u32) -> Result<(u32, String)> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        for e in std::fs::read_dir("/proc").context("cannot read /proc")?.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
            let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else { continue };
            if field(&status, "Name").as_deref() == Some("traefik") && field(&status, "PPid") == Some(agent.to_string()) {
                return Ok((pid, status));
            }
        }
        if Instant::now() > deadline {
            bail!("the agent (pid {agent}) runs no traefik");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// What opening `path` as `uid`/`gid` (no supplementary group) gives: `opened`, or the error.
fn open_as(uid: u32, gid: u32, path: &Path) -> Result<String> {
    let out = Command::new("cat")
        .arg(path)
        .uid(uid)
        .gid(gid)
        .stdout(Stdio::null())
        .output()
        .with_context(|| format!("cannot run cat {} as uid {uid}", path.display()))?;
    if out.status.success() {
        return Ok("opened".into());
    }
    let said = String::from_utf8_lossy(&out.stderr);
    Ok(said.trim().rsplit(": ").next().unwrap_or_default().to_string())
}

/// The line that says how the Traefik of the agent `agent` (state directory `state_dir`) runs,
/// or an error with it when Traefik is not confined: root, another capability, new privileges
/// allowed, or a key it can open.
pub(crate) fn confinement(agent: u32, state_dir: &Path) -> Result<String> {
    let (pid, status) = child(agent)?;
    let get = |name: &str| field(&status, name).with_context(|| format!("no {name} in /proc/{pid}/status"));
    let first = |name: &str| -> Result<u32> {
        get(name)?.split_whitespace().next().and_then(|v| v.parse().ok()).with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    let (uid, gid) = (first("Uid")?, first("Gid")?);
    let caps = ["CapEff", "CapPrm", "CapAmb"].map(|c| get(c).map(|v| (c, v))).into_iter().collect::<Result<Vec<_>>>()?;
    let no_new_privs = get("NoNewPrivs")?;
    let opened = ["node.key", "wireguard.key"]
        .map(|k| open_as(uid, gid, &state_dir.join(k)).map(|r| (k, r)))
        .into_iter()
        .collect::<Result<Vec<_>>>()?;
    let line = format!(
        "its Traefik (pid {pid}) runs as uid {uid} with {} and NoNewPrivs {no_new_privs}; as uid {uid}, {}",
        caps.iter().map(|(c, v)| format!("{c} {v}")).collect::<Vec<_>>().join(", "),
        opened.iter().map(|(k, r)| format!("opening {k}: {r}")).collect::<Vec<_>>().join(", ")
    );
    let confined = uid != 0
        && caps.iter().all(|(_, v)| v == NET_BIND_SERVICE_ONLY)
        && no_new_privs == "1"
        && opened.iter().all(|(_, r)| r == "Permission denied");
    if !confined {
        bail!("{line}: Traefik must run unprivileged, with CAP_NET_BIND_SERVICE alone, and unable to open the node's keys");
    }
    Ok(line)
}

/// What an ingress node's agent shows of its Traefik (ADR 0026): routers and certificates, from
/// the status file it writes; and how that Traefik runs, an error unless unprivileged.
pub(crate) fn print_ingress(st: &LabState, node: &str) -> Result<()> {
    let path = st.dir.join(format!("agent-{node}/agent-status.json"));
    let read = || -> serde_json::Value { std::fs::read(&path).ok().and_then(|b| serde_json::from_slice(&b).ok()).unwrap_or_default() };
    // The agent refreshes its status every ten seconds while it waits.
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut status = read();
    while status["ingress"]["certificates"].as_array().is_none_or(|c| c.is_empty()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(250));
        status = read();
    }
    let ingress = &status["ingress"];
    let routers: Vec<String> = ingress["routers"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|r| format!("{} {}", r["name"].as_str().unwrap_or("?"), r["status"].as_str().unwrap_or("?")))
        .collect();
    let certs: Vec<String> = ingress["certificates"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| {
            format!("{} until {}", c["hostname"].as_str().unwrap_or("?"), trellis_proto::text::date(c["not_after"].as_i64().unwrap_or(0)))
        })
        .collect();
    println!(
        "ingress {node} (its agent's status): traefik {}; routers: {}; certificates: {}",
        ingress["traefik"].as_str().unwrap_or("not reported"),
        if routers.is_empty() { "none".into() } else { routers.join(", ") },
        if certs.is_empty() { "none yet".into() } else { certs.join(", ") }
    );
    let agent = *st.agent_pids.get(node).with_context(|| format!("the lab runs no agent on `{node}`"))?;
    println!("ingress {node}: {}", confinement(agent, &st.dir.join(format!("agent-{node}")))?);
    // And as the controller has it from the agent's report (`trellis status`).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reported = procs::status(st).ok().and_then(|l| l.into_iter().find(|n| n.name == node)).and_then(|n| n.ingress);
        match reported {
            Some(i) if !i.report.certificates.is_empty() || Instant::now() > deadline => {
                println!("ingress {node} (trellis status): {}", i.summary(trellis_files::unix_now()));
                return Ok(());
            }
            None if Instant::now() > deadline => {
                println!("ingress {node} (trellis status): no report");
                return Ok(());
            }
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    }
}
