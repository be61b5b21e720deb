//! The lab file's steps, taken after the first round of `check`: one function per kind (kill,
//! revoke, renew, rotate, pause, resume, stop, apply, rebind, quiet), each doing it and printing
//! its figures.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::file::{self, Action, LabFile};
use crate::{checks, lab_dir, net, procs, save, timing, traefik, LabState};

/// Takes step `i` of the lab file and prints its figures.
pub(crate) fn take_step(file: &Path, lab: &LabFile, st: &mut LabState, i: usize) -> Result<()> {
    st.step_at_ms = Some(crate::unix_ms());
    match lab.action(i, lab_dir(file)) {
        Action::Kill(host) => kill_step(file, st, i, &host),
        Action::Revoke(node) => revoke_step(lab, st, i, &node),
        Action::Renew(node) => renew_step(st, i, &node),
        Action::Rotate(what) if what == "ca" => rotate_ca_step(st, i),
        Action::Rotate(_) => rotate_signing_key_step(st, i),
        Action::Pause(host) => pause_step(file, st, i, &host),
        Action::Resume(host) => resume_step(file, st, i, &host),
        Action::Stop(host) => stop_step(file, st, i, &host),
        Action::Apply(dir) => apply_step(lab, st, i, &dir),
        Action::Rebind(net) => rebind_step(lab, st, i, &net),
        Action::Quiet(secs) => quiet_step(st, i, secs),
    }
}

/// A `quiet` step: the lab sends nothing into the overlay for `secs`; every path an agent listed
/// as direct at the start must be the same direct session at the end.
fn quiet_step(st: &LabState, i: usize, secs: u64) -> Result<()> {
    let before = crate::path::direct_sessions(st);
    if before.is_empty() {
        bail!("step {}: no agent lists a direct path to keep through the quiet", i + 1);
    }
    let began = (crate::unix_ms() / 1000) as i64;
    std::thread::sleep(Duration::from_secs(secs));
    // Each agent's status as written after the quiet ended (it is written every 10 s): one
    // never written again would show the paths as they were.
    let ended = began + secs as i64;
    let deadline = Instant::now() + Duration::from_secs(12);
    for (from, _) in before.keys() {
        while crate::path::status_written(st, from) < ended {
            if Instant::now() > deadline {
                bail!("step {}: {from}'s agent wrote no status in the 12 s after the quiet ended", i + 1);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    let after = crate::path::direct_sessions(st);
    let lost: Vec<String> = before
        .iter()
        .filter(|(pair, since)| after.get(*pair) != Some(since))
        .map(|(pair @ (from, to), _)| match after.get(pair) {
            Some(since) => format!("{from} -> {to}: left direct and came back {} s into the quiet", since - began),
            None => format!("{from} -> {to}: {}", crate::path::agent_view_of(st, from, to)),
        })
        .collect();
    if !lost.is_empty() {
        bail!("step {}: {} direct path(s) did not stay direct through {secs} s of quiet: {}", i + 1, lost.len(), lost.join("; "));
    }
    let pairs: Vec<String> = before.keys().map(|(from, to)| format!("{from} -> {to}")).collect();
    println!(
        "step {}: {secs} s with no traffic in the overlay: every direct path stayed direct, the same session ({})",
        i + 1,
        pairs.join(", ")
    );
    Ok(())
}

/// A `rebind` step: the net's NAT router forgets every mapping and maps to new ports.
fn rebind_step(lab: &LabFile, st: &LabState, i: usize, net: &str) -> Result<()> {
    let k = lab.step[..=i].iter().filter(|s| s.rebind.as_deref() == Some(net)).count();
    let k = u16::try_from(k).context("too many rebinds of one net")?;
    let forgotten = net::rebind(lab, st, net, k)?;
    let ports = match lab.net(net).and_then(|n| n.mapping).unwrap_or_default() {
        file::Mapping::Symmetric => "a new random port for every new destination, as before".to_string(),
        file::Mapping::EndpointIndependent => format!("UDP to port {} for every destination", net::REBOUND_PORT + k),
    };
    println!("step {}: NAT router of {net} rebound: {forgotten} tracked connection(s) forgotten (conntrack -F); it maps {ports}", i + 1);
    Ok(())
}

/// A `kill` step: the time until every agent long-polls a replica still running.
fn kill_step(file: &Path, st: &mut LabState, i: usize, host: &str) -> Result<()> {
    let victim = st.controllers.iter().find(|r| r.host == host).map(|r| r.address.clone()).unwrap_or_default();
    // Who talks to it: an agent on another replica shows nothing of failover.
    let on_victim = st.agents.iter().filter(|a| timing::holds(st, a, &[victim.as_str()])).count();
    let at = Instant::now();
    let result = procs::kill(st, host);
    save(file, st)?;
    result?;
    let took = timing::failover(st, at, Duration::from_secs(30))?;
    let running: Vec<&str> = st.controllers.iter().filter(|r| !r.killed).map(|r| r.host.as_str()).collect();
    println!(
        "step {}: controller {host} killed (SIGKILL; {on_victim} of {} agents were long-polling it) -> every agent long-polling {}: {} ms",
        i + 1,
        st.agents.len(),
        running.join(" or "),
        took.as_millis()
    );
    Ok(())
}

/// A `revoke` step: the revocation followed until complete, the key looked for on every node,
/// and each exposure it was a backend of until it answers from the runners left.
fn revoke_step(lab: &LabFile, st: &LabState, i: usize, node: &str) -> Result<()> {
    let key = procs::nodes(st)?
        .into_iter()
        .find(|n| n.name == node)
        .and_then(|n| n.wireguard_public_key)
        .with_context(|| format!("`trellis nodes` lists no key for `{node}` before it is revoked"))?;
    let at = Instant::now();
    println!("step {}: node {node} revoked -> {}", i + 1, timing::revocation(st, node)?);
    // What the controller says, seen on the nodes: no agent running holds the key.
    let holding = timing::key_holders(st, &key)?;
    let running: Vec<&str> = holding.iter().copied().filter(|h| !st.paused.iter().any(|p| p == h)).collect();
    if !running.is_empty() {
        bail!("step {}: node {node} is revoked, but the wireguard.conf or paths.toml of {} still holds its key", i + 1, running.join(", "));
    }
    let paused = if holding.is_empty() { String::new() } else { format!("; paused, {} still hold(s) it", holding.join(", ")) };
    println!(
        "step {}: node {node}'s key is in the wireguard.conf or paths.toml of no running agent ({} read){paused}",
        i + 1,
        st.agents.len() - st.paused.len()
    );
    // An exposure it was a backend of: how long until the edge no longer sends to it.
    for e in lab.step[i].expect.iter().filter(|e| e.proto == Some(file::Proto::Https) && e.answered_by.is_some()) {
        let (to, host) = (e.to.clone().unwrap_or_default(), e.host.clone().unwrap_or_default());
        let addr = checks::edge_address(lab, &e.from, &to)?;
        let by = e.answered_by.clone().unwrap_or_default();
        let took = timing::only_by(st, &e.from, &host, &addr, e.port().unwrap_or(443), &by, at, Duration::from_secs(60))?;
        println!(
            "step {}: revocation of {node} -> {to} answers {} from {} only ({} requests in a row): {} ms",
            i + 1,
            e.from,
            by.join(", "),
            timing::IN_A_ROW,
            took.as_millis()
        );
    }
    // The checkpoint answers once the publish covering the revocation is done; then
    // every node still active (and not paused) applies what it changed.
    procs::admin(st, &["audit", "verify"])?;
    procs::converge(st, Duration::from_secs(60))?;
    Ok(())
}
/// The first twelve hex digits of a serial, as the step prints it.
fn short(serial: &str) -> &str {
    &serial[..serial.len().min(12)]
}

/// A `renew` step: each service certificate of the node replaced by its agent, and when.
fn renew_step(st: &LabState, i: usize, node: &str) -> Result<()> {
    let renewed = timing::renewal(st, node)?;
    let said: Vec<String> = renewed
        .iter()
        .map(|r| {
            format!(
                "{} {} -> {} after {:.1} s ({}% of its {} s lifetime)",
                r.module,
                short(&r.old_serial),
                short(&r.new_serial),
                r.after.as_secs_f64(),
                r.at_percent,
                r.lifetime
            )
        })
        .collect();
    println!(
        "step {}: service certificates of {node} renewed by its agent, the controller listing each new serial -> {}",
        i + 1,
        said.join("; ")
    );
    Ok(())
}

/// A `rotate = "ca"` step: the time until every agent trusts only the new CA, and a certificate
/// of the retired CA's key refused for every node.
fn rotate_ca_step(st: &LabState, i: usize) -> Result<()> {
    let r = timing::rotate_ca(st, Duration::from_secs(60))?;
    let running = st.agents.len() - st.paused.len();
    println!(
        "step {}: mesh CA rotated -> every agent ({running}) trusts only the new CA and holds a certificate it issued: {} ms after `trellis rotate ca` (completed by {}); nodes enrolled again: {}",
        i + 1,
        r.took.as_millis(),
        r.completed_by,
        r.enrolled_again
    );
    println!(
        "step {}: a node certificate issued with the retired CA's key: refused by the controller for {} of {running} nodes",
        i + 1,
        r.refused
    );
    procs::converge(st, Duration::from_secs(60))
}

/// A `rotate = "signing-key"` step: the time until every agent holds only the new key, and a
/// bundle signed with the retired one refused by every agent.
fn rotate_signing_key_step(st: &LabState, i: usize) -> Result<()> {
    let r = timing::rotate_signing_key(st, Duration::from_secs(60))?;
    println!(
        "step {}: signing key rotated -> every agent ({}) holds only the new key: {} ms after `trellis rotate signing-key` (completed by {})",
        i + 1,
        st.agents.len() - st.paused.len(),
        r.took.as_millis(),
        r.completed_by
    );
    println!(
        "step {}: a bundle signed with the retired key, 100 versions ahead: refused by {} of {} agents",
        i + 1,
        r.refused,
        st.agents.len() - st.paused.len()
    );
    procs::converge(st, Duration::from_secs(60))
}

/// A `pause` step: the agent stopped (SIGSTOP) until a `resume`.
fn pause_step(file: &Path, st: &mut LabState, i: usize, host: &str) -> Result<()> {
    let paused = procs::pause(st, host);
    save(file, st)?;
    paused?;
    println!("step {}: agent of {host} paused (SIGSTOP): it applies and reports nothing until it resumes", i + 1);
    Ok(())
}

/// A `resume` step: the time until every revocation left `revoking` is complete.
fn resume_step(file: &Path, st: &mut LabState, i: usize, host: &str) -> Result<()> {
    let at = Instant::now();
    let revoking = timing::revoking(st)?;
    let resumed = procs::resume(st, host);
    save(file, st)?;
    resumed?;
    let done = timing::revoked(st, &revoking, at, Duration::from_secs(60))?;
    if done.is_empty() {
        println!("step {}: agent of {host} resumed (SIGCONT); no revocation was in progress", i + 1);
    }
    for (node, took, r) in done {
        println!(
            "step {}: agent of {host} resumed (SIGCONT) -> node {node} revoked, every node that held its key ({} peer(s)) applied a bundle without it: {} ms after the resume, {} s after the revocation",
            i + 1,
            r.holders,
            took.as_millis(),
            r.seconds
        );
    }
    procs::converge(st, Duration::from_secs(60))
}

/// A `stop` step: the times until the controller removed the member, every peer dropped it and
/// the removal completed.
fn stop_step(file: &Path, st: &mut LabState, i: usize, host: &str) -> Result<()> {
    let gone = stop_and_wait(st, host, file)?;
    println!(
        "step {}: agent of {host} stopped (SIGKILL) -> removed by the controller (removing in `trellis nodes`): {} ms; dropped from every peer's wireguard.conf: {} ms; removed (every peer applied a bundle without it): {} ms",
        i + 1,
        gone.listed.as_millis(),
        gone.peers.as_millis(),
        gone.complete.as_millis()
    );
    Ok(())
}

/// Stops `host`'s agent and waits (at most a minute past its pool's `ephemeral_after`) until
/// the controller has removed it and every other agent's wireguard.conf has dropped its key.
fn stop_and_wait(st: &mut LabState, host: &str, file: &Path) -> Result<timing::Removed> {
    let key = procs::nodes(st)?
        .into_iter()
        .find(|n| n.name == host)
        .and_then(|n| n.wireguard_public_key)
        .with_context(|| format!("`trellis nodes` lists no key for `{host}` before it is stopped"))?;
    let at = Instant::now();
    let stopped = procs::stop(st, host);
    save(file, st)?;
    stopped?;
    timing::removal(st, host, &key, at, Duration::from_secs(90))
}

/// An `apply` step: the time until every node it changed applied it, the routes it withdrew,
/// and each exposure it opens until a client is served through it.
fn apply_step(lab: &LabFile, st: &LabState, i: usize, dir: &Path) -> Result<()> {
    let through = st.serving()?.host.clone();
    let since = trellis_files::unix_now();
    let at = Instant::now();
    let c = timing::apply_and_wait(dir, st, Duration::from_secs(60))?;
    println!(
        "step {}: apply of {} through {through} -> every node it changed applied it: {} of {} nodes, {} ms",
        i + 1,
        dir.display(),
        c.changed,
        c.nodes,
        c.took.as_millis()
    );
    // Routes the apply took from a router or hub still in the mesh (ADR 0022).
    for (node, r) in timing::withdrawals(st, since, at, Duration::from_secs(60))? {
        println!(
            "step {}: routes through {node} withdrawn, every node that sent them through it ({} peer(s)) applied a bundle that does not: {} ms after the apply",
            i + 1,
            r.holders,
            r.took.as_millis()
        );
    }
    // An exposure the step opens: how long until a client is served through it.
    for e in lab.step[i].expect.iter().filter(|e| e.proto == Some(file::Proto::Https) && e.outcome().0 == Some(file::Outcome::Open)) {
        let (to, host) = (e.to.clone().unwrap_or_default(), e.host.clone().unwrap_or_default());
        let addr = checks::edge_address(lab, &e.from, &to)?;
        let took = timing::served(st, &e.from, &host, &addr, e.port().unwrap_or(443), at, Duration::from_secs(90))?;
        println!(
            "step {}: apply -> https://{host}/ served to {} through {to}, its certificate verified against the lab's ACME root: {} ms",
            i + 1,
            e.from,
            took.as_millis()
        );
        traefik::print_ingress(st, &to)?;
    }
    Ok(())
}
