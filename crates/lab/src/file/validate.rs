//! Validation: what a lab file's tables say of each other (roles, addresses inside their nets,
//! routes, expectations, each step against those before it), and, once its declarations are
//! read, what they must agree on (endpoints, pools, a renewal's certificates).

use std::net::IpAddr;
use std::path::Path;

use anyhow::{bail, Context, Result};
use ipnet::IpNet;

use super::schema::{Expect, LabFile, Outcome, Proto, Role};

/// Every check of the lab file against itself, in order; the first that fails is the error.
pub(super) fn validate(file: &Path, lab: &LabFile) -> Result<()> {
    roles(file, lab)?;
    hosts(file, lab)?;
    for (i, e) in lab.expect.iter().enumerate() {
        check_expect(file, lab, &format!("expectation {}", i + 1), e)?;
    }
    check_steps(file, lab)?;
    for n in &lab.net {
        for target in [&n.nat, &n.firewall].into_iter().flatten() {
            if lab.net(target).is_none() {
                bail!("{}: net `{}` routes to `{target}`, which is not declared", file.display(), n.name);
            }
        }
        if n.mapping.is_some() && n.nat.is_none() {
            bail!("{}: net `{}` gives `mapping` but no `nat`; only a NAT router maps ports", file.display(), n.name);
        }
    }
    Ok(())
}

/// At least one controller; at most one ACME CA and one PostgreSQL, which replicas need.
fn roles(file: &Path, lab: &LabFile) -> Result<()> {
    let names = |role: Role| lab.host.iter().filter(|h| h.role == role).map(|h| format!("`{}`", h.name)).collect::<Vec<_>>();
    let (controllers, postgres) = (names(Role::Controller), names(Role::Postgres));
    if controllers.is_empty() {
        bail!("{}: no host has role = \"controller\"; the lab needs one", file.display());
    }
    let acme = names(Role::Acme);
    if acme.len() > 1 {
        bail!("{}: hosts {} have role = \"acme\"; the lab runs one ACME CA", file.display(), acme.join(", "));
    }
    if postgres.len() > 1 {
        bail!("{}: hosts {} have role = \"postgres\"; the lab runs one PostgreSQL", file.display(), postgres.join(", "));
    }
    if controllers.len() > 1 && postgres.is_empty() {
        bail!(
            "{}: hosts {} have role = \"controller\" but no host has role = \"postgres\"; replicas share one PostgreSQL, so add a host with role = \"postgres\" or keep one controller",
            file.display(),
            controllers.join(", ")
        );
    }
    Ok(())
}

/// Every host's addresses are inside declared nets (a server has one), and its routes go via a
/// host it shares a net with.
fn hosts(file: &Path, lab: &LabFile) -> Result<()> {
    for h in &lab.host {
        for (net, addr) in &h.addresses {
            let n = lab
                .net(net)
                .with_context(|| format!("{}: host `{}` has an address on net `{net}`, which is not declared", file.display(), h.name))?;
            let ip: IpAddr =
                addr.parse().with_context(|| format!("{}: host `{}`: {addr:?} is not an IP address", file.display(), h.name))?;
            let inside = [&n.ipv4, &n.ipv6].into_iter().flatten().any(|p| p.parse::<IpNet>().is_ok_and(|p| p.contains(&ip)));
            if !inside {
                bail!("{}: host `{}` address {addr} is not inside net `{net}`", file.display(), h.name);
            }
        }
        if h.role != Role::Node && h.addresses.is_empty() {
            bail!("{}: host `{}` runs a server but has no address", file.display(), h.name);
        }
    }
    for h in &lab.host {
        for (prefix, via) in &h.routes {
            lab.gateway(h, prefix, via).map_err(|e| anyhow::anyhow!("{}: host `{}`: {e}", file.display(), h.name))?;
        }
    }
    Ok(())
}

fn check_expect(file: &Path, lab: &LabFile, what: &str, e: &Expect) -> Result<()> {
    if e.proto == Some(Proto::Path) {
        return check_path(file, lab, what, e);
    }
    if let Some(r @ (Outcome::Direct | Outcome::Relayed)) = e.result {
        bail!("{}: {what} expects `{}`, which only a `proto = \"path\"` expectation can be", file.display(), r.as_str());
    }
    if e.proto == Some(Proto::Throughput) && (e.to.is_none() || e.port.is_none() || e.result.is_some() || e.dns.is_some()) {
        bail!(
            "{}: {what} measures throughput: give `to` and `port` (a TCP port the target's filter admits from `from`), and no `result` or `dns`",
            file.display()
        );
    }
    let tls = e.proto == Some(Proto::Tls);
    if tls && (e.to.is_none() || e.port.is_none() || e.name.is_none() || e.dns.is_some() || e.via.is_some()) {
        bail!(
            "{}: {what} is a TLS handshake: give `to`, `port` and the `name` it verifies (\"postgres.basic.mesh\"), and no `dns` or `via`",
            file.display()
        );
    }
    let https = e.proto == Some(Proto::Https);
    if https && (e.to.is_none() || e.host.is_none() || e.dns.is_some() || e.via.is_some() || e.name.is_some()) {
        bail!(
            "{}: {what} is an HTTPS request: give `to` (the host whose lab address it goes to) and the `host` it asks for (\"shop.example.com\"), and no `dns`, `via` or `name`",
            file.display()
        );
    }
    if !https && (e.host.is_some() || e.answered_by.is_some()) {
        bail!("{}: {what} gives `host` or `answered_by`, which only a `proto = \"https\"` expectation uses", file.display());
    }
    if https && e.answered_by.as_ref().is_some_and(|a| a.is_empty() || e.result.is_some_and(|r| r != Outcome::Open)) {
        bail!("{}: {what} gives `answered_by`, which needs the runners that may answer, and `result = \"open\"`", file.display());
    }
    if !tls && e.name.is_some() {
        bail!("{}: {what} gives `name`, which only a `proto = \"tls\"` expectation verifies", file.display());
    }
    if e.result == Some(Outcome::Refused) && !tls && !https {
        bail!(
            "{}: {what} expects `refused`, which only a `proto = \"tls\"` handshake or a `proto = \"https\"` request can be",
            file.display()
        );
    }
    if e.dns.is_some() {
        // A DNS expectation that names no answer would be met by silence: it must name the
        // nodes whose addresses answer, or say that the name does not exist.
        let nxdomain = e.result == Some(Outcome::Nxdomain);
        let closed = e.result == Some(Outcome::Closed);
        let answers = e.answer.as_ref().is_some_and(|a| !a.is_empty());
        if [nxdomain, closed, answers].iter().filter(|b| **b).count() != 1 {
            bail!(
                "{}: {what} asks for dns {:?}: give `answer = [NODE, ...]`, `result = \"nxdomain\"` or `result = \"closed\"` (no answer arrives), one of them",
                file.display(),
                e.dns.as_deref().unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// A path expectation names two node hosts, whose agents' status files it reads, and whether
/// the pair is `direct` or `relayed`; nothing else.
fn check_path(file: &Path, lab: &LabFile, what: &str, e: &Expect) -> Result<()> {
    let extra = e.port.is_some() || e.dns.is_some() || e.via.is_some() || e.name.is_some() || e.host.is_some() || e.answered_by.is_some();
    let to = match (&e.to, e.result) {
        (Some(to), Some(Outcome::Direct | Outcome::Relayed)) if !extra => to,
        _ => bail!(
            "{}: {what} checks a path: give `to` and `result = \"direct\"` or `\"relayed\"`, and no `port`, `dns`, `via`, `name`, `host` or `answered_by`",
            file.display()
        ),
    };
    for host in [&e.from, to] {
        if !lab.host.iter().any(|h| h.name == *host && h.role == Role::Node) {
            bail!(
                "{}: {what} checks the path from `{}` to `{to}`, and `{host}` is not a node host (a path is read from both agents)",
                file.display(),
                e.from
            );
        }
    }
    Ok(())
}

/// What every step does one of, as an error names them.
const ONE_ACTION: &str = "`kill = HOST`, `apply = DIR`, `stop = HOST`, `revoke = NODE`, `pause = HOST`, `resume = HOST`, `renew = NODE`, `rotate = \"signing-key\"` or `\"ca\"`, `rebind = NET` and `quiet = SECONDS`";

/// What the steps before the one checked left: the controllers still running, and the hosts
/// stopped or paused.
struct Taken<'a> {
    running: Vec<&'a str>,
    stopped: Vec<&'a str>,
    paused: Vec<&'a str>,
}

/// Each step does exactly one thing, checked by the function of its kind against what the steps
/// before it left.
fn check_steps(file: &Path, lab: &LabFile) -> Result<()> {
    let mut taken = Taken { running: lab.controllers().map(|h| h.name.as_str()).collect(), stopped: Vec::new(), paused: Vec::new() };
    for (i, s) in lab.step.iter().enumerate() {
        let n = i + 1;
        let given = [
            s.kill.is_some(),
            s.apply.is_some(),
            s.stop.is_some(),
            s.revoke.is_some(),
            s.pause.is_some(),
            s.resume.is_some(),
            s.renew.is_some(),
            s.rotate.is_some(),
            s.rebind.is_some(),
            s.quiet.is_some(),
        ]
        .iter()
        .filter(|&&x| x)
        .count();
        if given != 1 {
            bail!("{}: step {n} needs exactly one of {ONE_ACTION}", file.display());
        }
        if let Some(host) = &s.renew {
            check_renew(file, lab, n, host, &taken)?;
        } else if let Some(host) = &s.pause {
            check_pause(file, lab, n, host, &mut taken)?;
        } else if let Some(what) = &s.rotate {
            check_rotate(file, lab, n, what)?;
        } else if let Some(net) = &s.rebind {
            check_rebind(file, lab, n, net)?;
        } else if let Some(secs) = s.quiet {
            if !(1..=600).contains(&secs) {
                bail!("{}: step {n} is quiet for {secs} s; give 1 to 600 seconds", file.display());
            }
            if !s.expect.is_empty() {
                bail!(
                    "{}: step {n} is quiet, which changes no traffic; the expectations in force are checked again after it",
                    file.display()
                );
            }
        } else if let Some(host) = &s.resume {
            check_resume(file, lab, n, host, &mut taken)?;
        } else if let Some(dir) = &s.apply {
            check_change(file, lab, n, &format!("applies {dir:?}"))?;
        } else if let Some(node) = &s.revoke {
            if !lab.host.iter().any(|h| h.name == *node && h.role == Role::Node) {
                bail!("{}: step {n} revokes `{node}`, which is not a node host of the lab", file.display());
            }
            check_change(file, lab, n, &format!("revokes `{node}`"))?;
        } else if let Some(host) = &s.kill {
            check_kill(file, lab, n, host, &mut taken)?;
        } else if let Some(host) = &s.stop {
            check_stop(file, lab, n, host, &taken.stopped)?;
            taken.stopped.push(host);
        }
    }
    Ok(())
}

/// A renewal names a node host whose agent runs, and no expectation.
fn check_renew(file: &Path, lab: &LabFile, n: usize, host: &str, taken: &Taken) -> Result<()> {
    if !lab.host.iter().any(|h| h.name == *host && h.role == Role::Node) {
        bail!("{}: step {n} renews `{host}`'s certificates, and `{host}` is not a node host of the lab", file.display());
    }
    if taken.paused.contains(&host) || taken.stopped.contains(&host) {
        bail!("{}: step {n} renews `{host}`'s certificates, and an earlier step paused or stopped its agent", file.display());
    }
    if !lab.step[n - 1].expect.is_empty() {
        bail!(
            "{}: step {n} renews certificates, which changes no traffic; the expectations in force are checked again after it",
            file.display()
        );
    }
    Ok(())
}

/// A pause names a node host not paused or stopped already, and no expectation: what it changes
/// is that those naming the host go out of force.
fn check_pause<'a>(file: &Path, lab: &LabFile, n: usize, host: &'a str, taken: &mut Taken<'a>) -> Result<()> {
    if !lab.host.iter().any(|h| h.name == *host && h.role == Role::Node) {
        bail!("{}: step {n} pauses `{host}`, which is not a node host of the lab", file.display());
    }
    if taken.paused.contains(&host) || taken.stopped.contains(&host) {
        bail!("{}: step {n} pauses `{host}`, which an earlier step paused or stopped", file.display());
    }
    if !lab.step[n - 1].expect.is_empty() {
        bail!("{}: step {n} pauses `{host}` and names expectations; a pause takes those naming `{host}` out of force", file.display());
    }
    taken.paused.push(host);
    Ok(())
}

/// A rotation rotates the signing key or the mesh CA, in a lab of one controller.
fn check_rotate(file: &Path, lab: &LabFile, n: usize, what: &str) -> Result<()> {
    if what != "signing-key" && what != "ca" {
        bail!("{}: step {n} rotates {what:?}; \"signing-key\" and \"ca\" rotate", file.display());
    }
    if lab.controllers().count() > 1 {
        bail!(
            "{}: step {n} rotates the {} in a lab of several controllers; the lab copies no next key to replicas yet",
            file.display(),
            if what == "ca" { "mesh CA" } else { "signing key" }
        );
    }
    for (j, e) in lab.step[n - 1].expect.iter().enumerate() {
        check_expect(file, lab, &format!("step {n} expectation {}", j + 1), e)?;
    }
    Ok(())
}

/// A rebind names a net with a NAT router; its expectations, if any, replace or join those in
/// force as an apply's do.
fn check_rebind(file: &Path, lab: &LabFile, n: usize, net: &str) -> Result<()> {
    match lab.net(net) {
        None => bail!("{}: step {n} rebinds net `{net}`, which is not declared", file.display()),
        Some(x) if x.nat.is_none() => {
            bail!("{}: step {n} rebinds net `{net}`, which has no `nat` router to forget its mappings", file.display())
        }
        Some(_) => {}
    }
    for (j, e) in lab.step[n - 1].expect.iter().enumerate() {
        check_expect(file, lab, &format!("step {n} expectation {}", j + 1), e)?;
    }
    Ok(())
}

/// A resume names a host an earlier step paused.
fn check_resume(file: &Path, lab: &LabFile, n: usize, host: &str, taken: &mut Taken) -> Result<()> {
    if !taken.paused.contains(&host) {
        bail!("{}: step {n} resumes `{host}`, which no earlier step paused", file.display());
    }
    taken.paused.retain(|p| *p != host);
    for (j, e) in lab.step[n - 1].expect.iter().enumerate() {
        check_expect(file, lab, &format!("step {n} expectation {}", j + 1), e)?;
    }
    Ok(())
}

/// A kill names a controller still running, never the last one, and no expectation.
fn check_kill(file: &Path, lab: &LabFile, n: usize, host: &str, taken: &mut Taken) -> Result<()> {
    if !lab.controllers().any(|h| h.name == *host) {
        bail!("{}: step {n} kills `{host}`, which is not a host with role = \"controller\"", file.display());
    }
    if !taken.running.contains(&host) {
        bail!("{}: step {n} kills `{host}`, which an earlier step killed", file.display());
    }
    if taken.running.len() == 1 {
        bail!("{}: step {n} kills `{host}`, the last controller running; a lab keeps one", file.display());
    }
    taken.running.retain(|r| *r != host);
    if !lab.step[n - 1].expect.is_empty() {
        bail!(
            "{}: step {n} kills a controller, which changes no traffic; its expectations belong to the file or to an apply step",
            file.display()
        );
    }
    Ok(())
}

/// An apply or a revocation (it `does`) says, with expectations not already in force, what it
/// changes.
fn check_change(file: &Path, lab: &LabFile, n: usize, does: &str) -> Result<()> {
    let s = &lab.step[n - 1];
    if s.expect.is_empty() {
        bail!("{}: step {n} {does} but names no expectation; give the ones it changes", file.display());
    }
    let before = lab.expectations(n - 1);
    for (j, e) in s.expect.iter().enumerate() {
        let what = format!("step {n} expectation {}", j + 1);
        check_expect(file, lab, &what, e)?;
        if before.iter().any(|b| b.same_check(e) && b.outcome() == e.outcome() && b.via == e.via && b.answered_by == e.answered_by) {
            bail!("{}: {what} is already in force; a step lists what it changes", file.display());
        }
    }
    Ok(())
}

/// A stop names a pool's host not stopped before, and no expectation: what it changes is that
/// the expectations naming the host go out of force.
fn check_stop(file: &Path, lab: &LabFile, n: usize, host: &str, stopped: &[&str]) -> Result<()> {
    if !lab.host.iter().any(|h| h.name == host && h.pool.is_some()) {
        bail!("{}: step {n} stops `{host}`, which is not a host of a pool (`[[host]] pool = ...`)", file.display());
    }
    if stopped.contains(&host) {
        bail!("{}: step {n} stops `{host}`, which an earlier step stopped", file.display());
    }
    if !lab.step[n - 1].expect.is_empty() {
        bail!("{}: step {n} stops `{host}` and names expectations; a stop takes those naming `{host}` out of force", file.display());
    }
    Ok(())
}

/// The longest `service_cert_lifetime` a `renew` step waits out: its agent renews at two thirds
/// of it.
pub const MAX_RENEW_LIFETIME_SECS: u64 = 300;

/// A `renew` step (step `n`) names a node that `decl`, the declaration in force then, gives a
/// service certificate with a lifetime short enough to wait for its renewal.
pub fn check_renewal(n: usize, node: &str, decl: &trellis_core::Declaration) -> Result<()> {
    let Some(declared) = decl.nodes.iter().find(|d| d.name == node) else {
        bail!("step {n} renews the certificates of `{node}`, which the declaration does not declare");
    };
    let certified = declared.modules.iter().any(|m| decl.modules.iter().any(|d| d.name == *m && d.certificate.is_some()));
    if !certified {
        bail!("step {n} renews the certificates of `{node}`, which runs no module with a [module.certificate] in the declaration");
    }
    let life = decl.mesh.service_cert_secs;
    if life > MAX_RENEW_LIFETIME_SECS {
        bail!(
            "step {n} renews the certificates of `{node}`, which live {life} s (renewed after about two thirds of that); give the lab's declaration `service_cert_lifetime = \"1m\"` (at most {MAX_RENEW_LIFETIME_SECS} s)"
        );
    }
    Ok(())
}

/// A pool's hosts enrol into a pool the declaration has, and no more of them than its size.
pub fn check_pools(lab: &LabFile, decl: &trellis_core::Declaration) -> Result<()> {
    for (pool, hosts) in lab.pools() {
        let Some(p) = decl.pool(pool) else {
            bail!("the lab has hosts of pool `{pool}`, which the declaration does not declare");
        };
        if hosts.len() > p.size as usize {
            bail!("the lab has {} hosts of pool `{pool}`, whose size is {}", hosts.len(), p.size);
        }
    }
    Ok(())
}

/// Endpoint addresses in the declaration must be lab host addresses of the same node.
pub fn check_endpoints(lab: &LabFile, decl: &trellis_core::Declaration) -> Result<()> {
    for h in lab.host.iter().filter(|h| matches!(h.role, Role::Outside | Role::Acme)) {
        if decl.node(&h.name).is_some() {
            bail!(
                "lab host `{}` has role = \"{}\" but the declaration names it as a node; it runs no agent",
                h.name,
                if h.role == Role::Acme { "acme" } else { "outside" }
            );
        }
    }
    if !decl.exposures.is_empty() && decl.acme.is_some() && lab.acme().is_none() {
        bail!("the declaration takes ACME certificates for its exposures, but no lab host has role = \"acme\" to issue them");
    }
    for node in &decl.nodes {
        let Some(host) = lab.host.iter().find(|h| h.name == node.name) else {
            bail!("node `{}` is declared but the lab has no host of that name", node.name);
        };
        for e in &node.endpoints {
            let ip = e.address.ip().to_string();
            if !host.addresses.values().any(|a| *a == ip) {
                bail!(
                    "node `{}` declares endpoint {} but lab host `{}` has addresses {}; they must agree",
                    node.name,
                    e.address,
                    host.name,
                    host.addresses.values().cloned().collect::<Vec<_>>().join(", ")
                );
            }
        }
    }
    Ok(())
}
