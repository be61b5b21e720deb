//! The lab file (`lab/NAME.toml`): nets, hosts, expectations and the steps taken after them,
//! and its validation against itself and against the declarations it runs.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use ipnet::IpNet;
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabFile {
    pub lab: LabHead,
    #[serde(default)]
    pub net: Vec<Net>,
    #[serde(default)]
    pub host: Vec<Host>,
    #[serde(default)]
    pub expect: Vec<Expect>,
    /// Taken in order after the expectations are checked; every expectation in force is
    /// checked again after each.
    #[serde(default)]
    pub step: Vec<Step>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LabHead {
    pub name: String,
    pub declaration: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Net {
    pub name: String,
    pub ipv4: Option<String>,
    pub ipv6: Option<String>,
    /// Hosts here reach this net only through a masquerading router.
    pub nat: Option<String>,
    /// Routed to this net, but new connections from it are dropped.
    pub firewall: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Host {
    /// Left out for a pool's hosts: `load` names them as the controller names the pool's members.
    #[serde(default)]
    pub name: String,
    #[serde(default)]
    pub role: Role,
    pub addresses: BTreeMap<String, String>,
    /// With `count`: that many hosts that enrol as members of this pool with one pool token,
    /// named `POOL-1` ... `POOL-N` (the names the controller gives them, in enrolment order, which
    /// the lab checks), at consecutive addresses from those given.
    pub pool: Option<String>,
    pub count: Option<u32>,
    /// Prefixes this host routes through another host's address on a net they share, as
    /// `{ "10.88.0.0/16" = "db-1" }`: a neighbour on a node's LAN that sends the overlay's
    /// prefix to the node, as an attacker there would.
    #[serde(default)]
    pub routes: BTreeMap<String, String>,
}

/// What a lab host runs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// An agent, when the declaration names the host as a node.
    #[default]
    Node,
    /// `trellis serve`; several controllers are replicas on the lab's PostgreSQL.
    Controller,
    /// A PostgreSQL server on the host's lab addresses, the database of every controller.
    Postgres,
    /// A host that is no mesh node and runs no agent (a printer on a LAN, a web server on the
    /// internet): expectations reach it at its lab address, and the lab listens there as on a
    /// node.
    Outside,
    /// The lab's ACME CA: Debian's `pebble` on the host's first lab address, validating for real
    /// against the ingress nodes' lab addresses, with a resolver there that answers every
    /// `[[expose]]` host name with its first ingress node's lab address (ADR 0026).
    Acme,
}

/// One step after the first check: a controller killed, or a declaration applied through a
/// controller still running, with the expectations that change with it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Step {
    /// A controller host whose `trellis serve` is killed (SIGKILL).
    pub kill: Option<String>,
    /// A declaration directory (relative to the lab file) applied through a running controller.
    pub apply: Option<String>,
    /// A host whose agent is stopped (SIGKILL): a pool member, removed by the controller once
    /// its pool's `ephemeral_after` has passed. Expectations naming it are out of force after.
    pub stop: Option<String>,
    /// A node revoked through a running controller (`trellis node revoke --wait`): the step
    /// prints the time until it is `revoked`, every node that held its key having applied a
    /// bundle without it, or, while an agent is paused, that it is still `revoking`, held by the
    /// paused agents only (ADR 0022).
    pub revoke: Option<String>,
    /// A node host whose agent is paused (SIGSTOP): it applies and reports nothing until a
    /// `resume` step. Expectations naming it are out of force meanwhile.
    pub pause: Option<String>,
    /// A host paused by an earlier step whose agent continues (SIGCONT); the step prints the time
    /// until every revocation left `revoking` is complete.
    pub resume: Option<String>,
    /// A node host whose service certificates are renewed by its agent: the step waits until
    /// every certificate it holds has been replaced (a new serial, issued by the controller) and
    /// prints when, within the certificates' lifetime; the expectations in force are checked
    /// again after, with the new files (ADR 0023). The declaration needs a short
    /// `service_cert_lifetime`.
    pub renew: Option<String>,
    /// `signing-key`: `trellis rotate signing-key` through the controller (ADR 0027); the step
    /// prints the time until every agent holds only the new key, then forges a bundle with the
    /// retired key for every agent and fails unless each refuses it. `ca`: `trellis rotate ca`
    /// (ADR 0029); the step prints the time until every agent trusts only the new CA and holds a
    /// certificate it issued, then presents, from every node, a certificate issued with the
    /// retired CA's key, and fails unless the controller refuses each.
    pub rotate: Option<String>,
    /// From this step on: each replaces the expectation with the same check (from, to, proto
    /// and port; or from and dns), or adds one.
    #[serde(default)]
    pub expect: Vec<Expect>,
}

/// What a step does, once validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Kill(String),
    Apply(PathBuf),
    Stop(String),
    Revoke(String),
    Pause(String),
    Resume(String),
    Renew(String),
    Rotate(String),
}

/// What an expectation sends (`proto`); tcp when unsaid.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Proto {
    #[default]
    Tcp,
    Udp,
    Icmp,
    /// iperf3 from `from` to `to` on `port`, through the overlay and on the underlay; met when
    /// the overlay run moved data (a measurement, not a speed limit).
    Throughput,
    /// A TLS handshake from `from` to `to` on `port` that verifies `name` against the mesh CA,
    /// served on `to` with the service certificate its agent wrote (ADR 0023).
    Tls,
    /// An HTTPS request for `host` (SNI and Host header) from `from` to `to`'s lab address on
    /// `port` (443 unless said), verifying the certificate against the lab's ACME root; met
    /// `open` when an answer comes back (from one of `answered_by`, when given), `refused` when the
    /// edge answers 403 (its allow-list), `closed` when nothing serves that name (ADR 0026).
    Https,
}

impl Proto {
    pub fn as_str(self) -> &'static str {
        match self {
            Proto::Tcp => "tcp",
            Proto::Udp => "udp",
            Proto::Icmp => "icmp",
            Proto::Throughput => "throughput",
            Proto::Tls => "tls",
            Proto::Https => "https",
        }
    }
}

impl std::fmt::Display for Proto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an expectation expects (`result`): traffic `open` or `closed`, a DNS name `nxdomain`, a
/// TLS handshake whose certificate does not verify `refused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Open,
    Closed,
    Nxdomain,
    Refused,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Open => "open",
            Outcome::Closed => "closed",
            Outcome::Nxdomain => "nxdomain",
            Outcome::Refused => "refused",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub from: String,
    pub to: Option<String>,
    pub proto: Option<Proto>,
    pub port: Option<u16>,
    pub result: Option<Outcome>,
    pub dns: Option<String>,
    pub answer: Option<Vec<String>>,
    /// The node whose underlay address the connection must arrive from (what an exit or a
    /// masquerading router does); without it the check is reachability alone.
    pub via: Option<String>,
    /// For `proto = "tls"`: the name the handshake verifies (`postgres.basic.mesh`).
    pub name: Option<String>,
    /// For `proto = "https"`: the host name asked for (SNI and Host header).
    pub host: Option<String>,
    /// For `proto = "https"`: the runners one of which must have answered (the lab's listener on
    /// a runner answers with its host name).
    pub answered_by: Option<Vec<String>>,
}

impl LabFile {
    /// The hosts with `role = "controller"`, in file order (at least one, checked by `load`).
    pub fn controllers(&self) -> impl Iterator<Item = &Host> {
        self.host.iter().filter(|h| h.role == Role::Controller)
    }

    /// The host with `role = "postgres"`, if any (at most one, checked by `load`).
    pub fn postgres(&self) -> Option<&Host> {
        self.host.iter().find(|h| h.role == Role::Postgres)
    }

    /// The host with `role = "acme"`, if any (at most one, checked by `load`).
    pub fn acme(&self) -> Option<&Host> {
        self.host.iter().find(|h| h.role == Role::Acme)
    }

    /// What step `i` does; `lab_dir` is the directory of the lab file.
    pub fn action(&self, i: usize, lab_dir: &Path) -> Action {
        let s = &self.step[i];
        if let Some(host) = &s.pause {
            return Action::Pause(host.clone());
        }
        if let Some(host) = &s.resume {
            return Action::Resume(host.clone());
        }
        if let Some(host) = &s.renew {
            return Action::Renew(host.clone());
        }
        if let Some(what) = &s.rotate {
            return Action::Rotate(what.clone());
        }
        match (&s.kill, &s.apply, &s.stop, &s.revoke) {
            (Some(host), ..) => Action::Kill(host.clone()),
            (None, Some(dir), ..) => Action::Apply(lab_dir.join(dir)),
            (None, None, Some(host), _) => Action::Stop(host.clone()),
            (None, None, None, Some(node)) => Action::Revoke(node.clone()),
            (None, None, None, None) => unreachable!("load checks every step kills, applies, stops, revokes, pauses or resumes"),
        }
    }

    /// The expectations in force after the first `steps` steps: the file's, each replaced or
    /// joined by those of the steps, in order.
    pub fn expectations(&self, steps: usize) -> Vec<Expect> {
        let mut out = self.expect.clone();
        let mut paused: Vec<&str> = Vec::new();
        for s in &self.step[..steps] {
            paused.extend(s.pause.as_deref());
            paused.retain(|h| s.resume.as_deref() != Some(*h));
            for e in &s.expect {
                match out.iter_mut().find(|o| o.same_check(e)) {
                    Some(o) => *o = e.clone(),
                    None => out.push(e.clone()),
                }
            }
            // A stopped host sends and answers nothing more.
            if let Some(host) = &s.stop {
                out.retain(|e| !e.names(host));
            }
        }
        // A paused host sends and answers nothing it is expected to until it resumes.
        out.retain(|e| !paused.iter().any(|h| e.names(h)));
        out
    }

    /// The hosts of each pool, in member order (`POOL-1` first).
    pub fn pools(&self) -> BTreeMap<&str, Vec<&Host>> {
        let mut out: BTreeMap<&str, Vec<&Host>> = BTreeMap::new();
        for h in &self.host {
            if let Some(p) = &h.pool {
                out.entry(p.as_str()).or_default().push(h);
            }
        }
        out
    }

    pub fn net(&self, name: &str) -> Option<&Net> {
        self.net.iter().find(|n| n.name == name)
    }
}

impl Expect {
    /// Whether it sends from, goes to or expects an answer of `host`.
    pub fn names(&self, host: &str) -> bool {
        self.from == host
            || self.to.as_deref() == Some(host)
            || self.answer.iter().flatten().any(|a| a == host)
            || self.answered_by.iter().flatten().any(|a| a == host)
    }

    /// The port an expectation goes to: given, or 443 for `https`.
    pub fn port(&self) -> Option<u16> {
        self.port.or((self.proto == Some(Proto::Https)).then_some(443))
    }

    /// Whether both test the same thing (and so cannot both be in force).
    pub fn same_check(&self, other: &Expect) -> bool {
        match (&self.dns, &other.dns) {
            (Some(a), Some(b)) => self.from == other.from && self.to == other.to && a == b,
            (None, None) => {
                (&self.from, &self.to, self.proto.unwrap_or_default(), self.port(), &self.name, &self.host)
                    == (&other.from, &other.to, other.proto.unwrap_or_default(), other.port(), &other.name, &other.host)
            }
            _ => false,
        }
    }

    /// What is expected: `open` or `closed` for traffic (open when unsaid), the answer or
    /// `nxdomain` for DNS.
    pub fn outcome(&self) -> (Option<Outcome>, Option<&[String]>) {
        let result = self.result.or(if self.dns.is_none() { Some(Outcome::Open) } else { None });
        (result, self.answer.as_deref())
    }
}

impl LabFile {
    /// The address of host `via` that `host` routes `prefix` through: `via`'s address, of the
    /// prefix's family, on a net the two share.
    pub fn gateway(&self, host: &Host, prefix: &str, via: &str) -> Result<IpAddr> {
        let p: IpNet = prefix.parse().with_context(|| format!("route {prefix:?} is not a prefix (\"10.88.0.0/16\")"))?;
        let gw =
            self.host.iter().find(|g| g.name == via).with_context(|| format!("route {prefix} goes via `{via}`, which is no lab host"))?;
        let v6 = matches!(p, IpNet::V6(_));
        host.addresses
            .iter()
            .filter(|(_, a)| a.contains(':') == v6)
            .find_map(|(net, _)| gw.addresses.get(net).filter(|a| a.contains(':') == v6))
            .and_then(|a| a.parse().ok())
            .with_context(|| format!("route {prefix} goes via `{via}`, which has no address of its family on a net this host is on"))
    }
}

impl Net {
    /// The net's prefix of one family, if it has one.
    pub fn prefix(&self, v6: bool) -> Option<IpNet> {
        if v6 { self.ipv6.as_ref()? } else { self.ipv4.as_ref()? }.parse().ok()
    }
}

/// Reads and validates a lab file; returns it with the declaration directory it names (relative
/// to the lab file).
pub fn load(file: &Path) -> Result<(LabFile, PathBuf)> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    parse(&text, file)
}

/// Validates a lab file's text; `file` names it in errors and is where the declaration
/// directory it names is found from. No IO.
pub fn parse(text: &str, file: &Path) -> Result<(LabFile, PathBuf)> {
    let mut lab: LabFile = toml::from_str(text).map_err(|e| parse_error(text, file, &e))?;
    expand_pools(file, &mut lab)?;
    let decl = file.parent().unwrap_or(Path::new(".")).join(&lab.lab.declaration);
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
    for (i, e) in lab.expect.iter().enumerate() {
        check_expect(file, &format!("expectation {}", i + 1), e)?;
    }
    check_steps(file, &lab)?;
    for n in &lab.net {
        for target in [&n.nat, &n.firewall].into_iter().flatten() {
            if lab.net(target).is_none() {
                bail!("{}: net `{}` routes to `{target}`, which is not declared", file.display(), n.name);
            }
        }
    }
    Ok((lab, decl))
}

/// A TOML or schema error (a typo in `proto`, `result` or `role` included) at FILE:LINE:COL,
/// found before anything is built.
fn parse_error(text: &str, file: &Path, e: &toml::de::Error) -> anyhow::Error {
    let Some(span) = e.span() else {
        return anyhow::anyhow!("{}: {}", file.display(), e.message());
    };
    let before = &text[..span.start.min(text.len())];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    anyhow::anyhow!("{}:{line}:{col}: {}", file.display(), e.message())
}

fn check_expect(file: &Path, what: &str, e: &Expect) -> Result<()> {
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

/// What every step does one of, as an error names them.
const ONE_ACTION: &str =
    "`kill = HOST`, `apply = DIR`, `stop = HOST`, `revoke = NODE`, `pause = HOST`, `resume = HOST`, `renew = NODE` and `rotate = \"signing-key\"` or `\"ca\"`";

/// Each step kills a controller still running (never the last one), applies a declaration or
/// stops a pool's host, and an apply says, with expectations that are not already in force, what
/// it changes.
fn check_steps(file: &Path, lab: &LabFile) -> Result<()> {
    let mut running: Vec<&str> = lab.controllers().map(|h| h.name.as_str()).collect();
    let mut stopped: Vec<&str> = Vec::new();
    let mut paused: Vec<&str> = Vec::new();
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
        ]
        .iter()
        .filter(|&&x| x)
        .count();
        if given != 1 {
            bail!("{}: step {n} needs exactly one of {ONE_ACTION}", file.display());
        }
        if let Some(host) = &s.renew {
            if !lab.host.iter().any(|h| h.name == *host && h.role == Role::Node) {
                bail!("{}: step {n} renews `{host}`'s certificates, and `{host}` is not a node host of the lab", file.display());
            }
            if paused.contains(&host.as_str()) || stopped.contains(&host.as_str()) {
                bail!("{}: step {n} renews `{host}`'s certificates, and an earlier step paused or stopped its agent", file.display());
            }
            if !s.expect.is_empty() {
                bail!(
                    "{}: step {n} renews certificates, which changes no traffic; the expectations in force are checked again after it",
                    file.display()
                );
            }
            continue;
        }
        if let Some(host) = &s.pause {
            if !lab.host.iter().any(|h| h.name == *host && h.role == Role::Node) {
                bail!("{}: step {n} pauses `{host}`, which is not a node host of the lab", file.display());
            }
            if paused.contains(&host.as_str()) || stopped.contains(&host.as_str()) {
                bail!("{}: step {n} pauses `{host}`, which an earlier step paused or stopped", file.display());
            }
            if !s.expect.is_empty() {
                bail!(
                    "{}: step {n} pauses `{host}` and names expectations; a pause takes those naming `{host}` out of force",
                    file.display()
                );
            }
            paused.push(host);
            continue;
        }
        if let Some(what) = &s.rotate {
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
            for (j, e) in s.expect.iter().enumerate() {
                check_expect(file, &format!("step {n} expectation {}", j + 1), e)?;
            }
            continue;
        }
        if let Some(host) = &s.resume {
            if !paused.contains(&host.as_str()) {
                bail!("{}: step {n} resumes `{host}`, which no earlier step paused", file.display());
            }
            paused.retain(|p| p != host);
            for (j, e) in s.expect.iter().enumerate() {
                check_expect(file, &format!("step {n} expectation {}", j + 1), e)?;
            }
            continue;
        }
        let changes = match (&s.apply, &s.revoke) {
            (Some(dir), _) => Some(format!("applies {dir:?}")),
            (None, Some(node)) => {
                if !lab.host.iter().any(|h| h.name == *node && h.role == Role::Node) {
                    bail!("{}: step {n} revokes `{node}`, which is not a node host of the lab", file.display());
                }
                Some(format!("revokes `{node}`"))
            }
            (None, None) => None,
        };
        match (&s.kill, changes, &s.stop) {
            (None, None, Some(host)) => check_stop(file, lab, n, host, &stopped)?,
            (Some(host), None, None) => {
                if !lab.controllers().any(|h| h.name == *host) {
                    bail!("{}: step {n} kills `{host}`, which is not a host with role = \"controller\"", file.display());
                }
                if !running.contains(&host.as_str()) {
                    bail!("{}: step {n} kills `{host}`, which an earlier step killed", file.display());
                }
                if running.len() == 1 {
                    bail!("{}: step {n} kills `{host}`, the last controller running; a lab keeps one", file.display());
                }
                running.retain(|r| r != host);
                if !s.expect.is_empty() {
                    bail!(
                        "{}: step {n} kills a controller, which changes no traffic; its expectations belong to the file or to an apply step",
                        file.display()
                    );
                }
            }
            (None, Some(does), None) => {
                if s.expect.is_empty() {
                    bail!("{}: step {n} {does} but names no expectation; give the ones it changes", file.display());
                }
                let before = lab.expectations(i);
                for (j, e) in s.expect.iter().enumerate() {
                    let what = format!("step {n} expectation {}", j + 1);
                    check_expect(file, &what, e)?;
                    if before
                        .iter()
                        .any(|b| b.same_check(e) && b.outcome() == e.outcome() && b.via == e.via && b.answered_by == e.answered_by)
                    {
                        bail!("{}: {what} is already in force; a step lists what it changes", file.display());
                    }
                }
            }
            _ => unreachable!("one action per step, checked above"),
        }
        stopped.extend(s.stop.as_deref());
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

/// The most hosts one pool may have in a lab: each is a network namespace with an agent.
pub const MAX_POOL_HOSTS: u32 = 250;

/// Replaces each `[[host]]` with `pool` and `count` by its `count` hosts, named `POOL-1` ...,
/// the first at the addresses given and each next one at the next addresses.
fn expand_pools(file: &Path, lab: &mut LabFile) -> Result<()> {
    let mut hosts = Vec::with_capacity(lab.host.len());
    for h in std::mem::take(&mut lab.host) {
        let (pool, count) = match (&h.pool, h.count) {
            (None, None) => {
                if h.name.is_empty() {
                    bail!("{}: a [[host]] has no `name`", file.display());
                }
                hosts.push(h);
                continue;
            }
            (Some(p), Some(c)) if (1..=MAX_POOL_HOSTS).contains(&c) && h.name.is_empty() && h.role == Role::Node => (p.clone(), c),
            _ => bail!(
                "{}: a [[host]] of a pool has `pool` and `count` (1 to {MAX_POOL_HOSTS}), no `name` (the controller names members) and no `role`",
                file.display()
            ),
        };
        if hosts.iter().any(|x: &Host| x.pool.as_deref() == Some(pool.as_str())) {
            bail!("{}: pool `{pool}` has two [[host]] tables; give it one with `count`", file.display());
        }
        for i in 0..count {
            let mut addresses = BTreeMap::new();
            for (net, a) in &h.addresses {
                let ip: IpAddr = a.parse().with_context(|| format!("{}: pool `{pool}`: {a:?} is not an IP address", file.display()))?;
                let next = match ip {
                    IpAddr::V4(v4) => u32::from(v4).checked_add(i).map(|n| IpAddr::from(std::net::Ipv4Addr::from(n))),
                    IpAddr::V6(v6) => u128::from(v6).checked_add(i as u128).map(|n| IpAddr::from(std::net::Ipv6Addr::from(n))),
                };
                let next = next.with_context(|| format!("{}: pool `{pool}`: no address {i} after {a}", file.display()))?;
                addresses.insert(net.clone(), next.to_string());
            }
            hosts.push(Host {
                name: format!("{pool}-{}", i + 1),
                role: Role::Node,
                addresses,
                pool: Some(pool.clone()),
                count: None,
                routes: BTreeMap::new(),
            });
        }
    }
    lab.host = hosts;
    Ok(())
}

/// A pool's hosts enrol into a pool the declaration has, and no more of them than its size.
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

#[cfg(test)]
mod tests {
    /// A TLS expectation names where it goes and the name it verifies; `name` and `refused` belong
    /// to TLS alone.
    #[test]
    fn a_tls_expectation_names_its_target_port_and_name() {
        let dir = trellis_testing::TempDir::new("labfile-tls");
        let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
        let file = dir.join("lab.toml");
        let tls = "[[expect]]\nfrom = \"api-1\"\nproto = \"tls\"\n";
        for (tail, wrong) in [
            (format!("{tls}to = \"db-1\"\nport = 5432\nname = \"postgres.basic.mesh\"\nresult = \"refused\"\n"), None),
            (format!("{tls}to = \"db-1\"\nport = 5432\n"), Some("is a TLS handshake: give `to`, `port` and the `name` it verifies")),
            (format!("{tls}to = \"db-1\"\nname = \"postgres.basic.mesh\"\n"), Some("is a TLS handshake")),
            (format!("{tls}to = \"db-1\"\nport = 5432\nname = \"p\"\nvia = \"db-1\"\n"), Some("and no `dns` or `via`")),
            (
                "[[expect]]\nfrom = \"api-1\"\nto = \"db-1\"\nport = 5432\nname = \"p\"\n".to_string(),
                Some("gives `name`, which only a `proto = \"tls\"`"),
            ),
            (
                "[[expect]]\nfrom = \"api-1\"\nto = \"db-1\"\nport = 5432\nresult = \"refused\"\n".to_string(),
                Some("expects `refused`, which only"),
            ),
        ] {
            std::fs::write(&file, format!("{head}\n{tail}")).unwrap();
            let r = super::load(&file);
            match (wrong, r) {
                (None, r) => assert!(r.is_ok(), "{tail}: {:?}", r.err()),
                (Some(w), Ok(_)) => panic!("{tail}: loaded; wanted {w:?}"),
                (Some(w), Err(e)) => assert!(e.to_string().contains(w), "{tail}: {e}"),
            }
        }
    }

    /// A route through a host that shares no net with the router is refused where it is named.
    #[test]
    fn a_hosts_route_goes_via_a_host_it_shares_a_net_with() {
        let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
        for (from, to, said) in [
            (
                "routes = { \"10.88.0.0/16\" = \"db-1\" }",
                "routes = { \"10.88.0.0/16\" = \"db-9\" }",
                "route 10.88.0.0/16 goes via `db-9`, which is no lab host",
            ),
            ("routes = { \"10.88.0.0/16\" = \"db-1\" }", "routes = { \"10.88.0.0\" = \"db-1\" }", "route \"10.88.0.0\" is not a prefix"),
            (
                "routes = { \"10.88.0.0/16\" = \"db-1\" }",
                "routes = { \"fd88::/64\" = \"db-1\" }",
                "has no address of its family on a net this host is on",
            ),
        ] {
            assert!(head.contains(from), "lab/basic.toml has {from}");
            let e = load_text("routes", &head.replace(from, to)).unwrap_err();
            assert!(e.contains("host `neighbour`: ") && e.contains(said), "{e}");
        }
    }

    /// A DNS expectation that names no answer would be met by an empty reply: refused at load.
    #[test]
    fn a_dns_expectation_names_its_answer_or_nxdomain() {
        let dir = trellis_testing::TempDir::new("labfile");
        let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
        let file = dir.join("lab.toml");
        for (tail, ok) in [
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"db-1.basic.mesh\"\n", false),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"db-1.basic.mesh\"\nanswer = []\n", false),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nanswer = [\"db-1\"]\nresult = \"nxdomain\"\n", false),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nresult = \"nxdomain\"\n", true),
            // No answer at all: a resolver the from-host may not reach.
            ("[[expect]]\nfrom = \"op-1\"\nto = \"db-1\"\ndns = \"x.basic.mesh\"\nresult = \"closed\"\n", true),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nanswer = [\"db-1\"]\nresult = \"closed\"\n", false),
        ] {
            std::fs::write(&file, format!("{head}\n{tail}")).unwrap();
            let r = super::load(&file);
            assert_eq!(r.is_ok(), ok, "{tail}: {:?}", r.err());
            if let Err(e) = r {
                assert!(e.to_string().contains("give `answer = [NODE, ...]`, `result = \"nxdomain\"` or `result = \"closed\"`"), "{e}");
            }
        }
    }

    /// Loads `text` as a lab file next to the shipped ones; the error's text, if any.
    fn load_text(tag: &str, text: &str) -> Result<super::LabFile, String> {
        let dir = trellis_testing::TempDir::new(&format!("labfile-{tag}"));
        let file = dir.join("lab.toml");
        std::fs::write(&file, text).unwrap();
        super::load(&file).map(|(lab, _)| lab).map_err(|e| e.to_string().replace(&file.display().to_string(), "FILE"))
    }

    const HA: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/ha.toml"));

    /// Replicas need the lab's PostgreSQL; a step kills a running controller (never the last)
    /// or applies a declaration and says what that changes. Each refusal is one sentence naming
    /// the file and the host or step at fault.
    #[test]
    fn controllers_postgres_and_steps_are_checked() {
        let no_pg = HA.replace("role = \"postgres\"", "role = \"node\"");
        let two_pg = HA.replace("name = \"op-1\"\naddresses", "name = \"op-1\"\nrole = \"postgres\"\naddresses");
        let one_ctl =
            no_pg.replace("name = \"ctl-2\"\nrole = \"controller\"", "name = \"ctl-2\"").split("# A crash").next().unwrap().to_string();
        let kill_node = HA.replace("kill = \"ctl-1\"", "kill = \"web-1\"");
        let kill_twice = HA.replace("[[step]]\nkill = \"ctl-1\"", "[[step]]\nkill = \"ctl-1\"\n\n[[step]]\nkill = \"ctl-1\"");
        let kill_both = HA.replace("[[step]]\nkill = \"ctl-1\"", "[[step]]\nkill = \"ctl-1\"\n\n[[step]]\nkill = \"ctl-2\"");
        let both = HA.replace("kill = \"ctl-1\"", "kill = \"ctl-1\"\napply = \"ha/metrics\"");
        let neither = HA.replace("kill = \"ctl-1\"", "");
        let silent_apply = HA.split("  [[step.expect]]").next().unwrap().to_string();
        let same = HA.replace("  port = 9100\n  result = \"open\"", "  port = 9100\n  result = \"closed\"");
        let unknown_role = HA.replace("role = \"postgres\"", "role = \"database\"");
        for (tag, text, want) in [
            ("ha", HA.to_string(), ""),
            ("one-controller-sqlite", one_ctl, ""),
            (
                "no-pg",
                no_pg,
                "FILE: hosts `ctl-1`, `ctl-2` have role = \"controller\" but no host has role = \"postgres\"; replicas share one PostgreSQL, so add a host with role = \"postgres\" or keep one controller",
            ),
            ("two-pg", two_pg, "FILE: hosts `pg`, `op-1` have role = \"postgres\"; the lab runs one PostgreSQL"),
            ("kill-node", kill_node, "FILE: step 1 kills `web-1`, which is not a host with role = \"controller\""),
            ("kill-twice", kill_twice, "FILE: step 2 kills `ctl-1`, which an earlier step killed"),
            ("kill-both", kill_both, "FILE: step 2 kills `ctl-2`, the last controller running; a lab keeps one"),
            ("both", both, "FILE: step 1 needs exactly one of `kill = HOST`, `apply = DIR`, `stop = HOST`, `revoke = NODE`, `pause = HOST`, `resume = HOST`, `renew = NODE` and `rotate = \"signing-key\"` or `\"ca\"`"),
            ("neither", neither, "FILE: step 1 needs exactly one of `kill = HOST`, `apply = DIR`, `stop = HOST`, `revoke = NODE`, `pause = HOST`, `resume = HOST`, `renew = NODE` and `rotate = \"signing-key\"` or `\"ca\"`"),
            ("silent", silent_apply, "FILE: step 2 applies \"ha/metrics\" but names no expectation; give the ones it changes"),
            ("same", same, "FILE: step 2 expectation 1 is already in force; a step lists what it changes"),
            ("role", unknown_role, "unknown variant `database`, expected one of `node`, `controller`, `postgres`"),
        ] {
            match load_text(tag, &text) {
                Ok(_) => assert!(want.is_empty(), "{tag}: loaded, but should fail with {want:?}"),
                Err(e) => assert!(!want.is_empty() && e.contains(want), "{tag}: {e}"),
            }
        }
    }

    /// A throughput expectation names its target and a port the filter admits, and expects
    /// nothing but data moving.
    #[test]
    fn a_throughput_expectation_names_to_and_port_only() {
        let lab = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/throughput.toml"));
        assert_eq!(load_text("tp", lab).unwrap().expect.iter().filter(|e| e.proto == Some(super::Proto::Throughput)).count(), 3);
        let want = "FILE: expectation 1 measures throughput: give `to` and `port` (a TCP port the target's filter admits from `from`), and no `result` or `dns`";
        for (tag, text) in [
            ("tp-port", lab.replacen("port = 5432\n", "", 1)),
            ("tp-to", lab.replacen("to = \"db-1\"\n", "", 1)),
            ("tp-result", lab.replacen("port = 5432\n", "port = 5432\nresult = \"open\"\n", 1)),
        ] {
            assert_eq!(load_text(tag, &text).unwrap_err(), want, "{tag}");
        }
    }

    /// A typo in `proto` or `result` is refused at load, at its line and column, before any
    /// namespace is made.
    #[test]
    fn a_typo_in_proto_or_result_is_refused_at_load_with_its_place() {
        let lab = |expect: &str| {
            format!("[lab]\nname = \"typo\"\ndeclaration = \"basic\"\n\n[[expect]]\nfrom = \"op-1\"\nto = \"db-1\"\n{expect}")
        };
        assert_eq!(
            load_text("proto-typo", &lab("proto = \"icmpp\"\n")).unwrap_err(),
            "FILE:8:9: unknown variant `icmpp`, expected one of `tcp`, `udp`, `icmp`, `throughput`, `tls`, `https`"
        );
        assert_eq!(
            load_text("result-typo", &lab("port = 5432\nresult = \"close\"\n")).unwrap_err(),
            "FILE:9:10: unknown variant `close`, expected one of `open`, `closed`, `nxdomain`, `refused`"
        );
    }

    /// An HTTPS expectation names where it goes and the host it asks for; `host` and
    /// `answered_by` belong to it alone, and `answered_by` means open.
    #[test]
    fn an_https_expectation_names_its_target_and_host() {
        let lab = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/expose.toml"));
        let loaded = load_text("https", lab).unwrap();
        let https: Vec<_> = loaded.expect.iter().filter(|e| e.proto == Some(super::Proto::Https)).collect();
        assert_eq!(https.len(), 2);
        assert_eq!((https[0].port(), https[1].port()), (Some(443), Some(8080)));
        let head = "[lab]\nname = \"h\"\ndeclaration = \"expose-off\"\n[[net]]\nname = \"n\"\nipv4 = \"192.0.2.0/24\"\n[[host]]\nname = \"c\"\nrole = \"controller\"\naddresses = { n = \"192.0.2.1\" }\n[[expect]]\nfrom = \"c\"\n";
        for (tag, tail, want) in [
            ("https-host", "to = \"c\"\nproto = \"https\"\n", "is an HTTPS request: give `to`"),
            ("https-name", "to = \"c\"\nproto = \"https\"\nhost = \"a.example\"\nname = \"x\"\n", "and no `dns`, `via` or `name`"),
            ("tcp-host", "to = \"c\"\nport = 1\nhost = \"a.example\"\n", "which only a `proto = \"https\"` expectation uses"),
            (
                "https-by",
                "to = \"c\"\nproto = \"https\"\nhost = \"a.example\"\nanswered_by = [\"c\"]\nresult = \"refused\"\n",
                "needs the runners that may answer, and `result = \"open\"`",
            ),
        ] {
            let err = load_text(tag, &format!("{head}{tail}")).unwrap_err();
            assert!(err.contains(want), "{tag}: {err}");
        }
        assert!(
            load_text("https-ok", &format!("{head}to = \"c\"\nproto = \"https\"\nhost = \"a.example\"\nresult = \"refused\"\n")).is_ok()
        );
    }

    /// A step's expectations replace those with the same check and keep the others.
    #[test]
    fn steps_replace_the_expectations_they_name() {
        let lab = load_text("steps", HA).unwrap();
        assert_eq!(lab.expectations(0), lab.expect);
        assert_eq!(lab.expectations(1), lab.expect, "a kill changes no expectation");
        let after = lab.expectations(2);
        assert_eq!(after.len(), lab.expect.len());
        let port = after.iter().find(|e| e.from == "op-1" && e.port == Some(9100)).unwrap();
        assert_eq!(port.result, Some(super::Outcome::Open));
        let dns = after.iter().find(|e| e.dns.as_deref() == Some("metrics.ha.mesh")).unwrap();
        assert_eq!(dns.answer.as_deref().unwrap(), ["web-1", "api-1", "db-1"]);
        let closed = after.iter().find(|e| e.from == "api-1" && e.port == Some(9100)).unwrap();
        assert_eq!(closed.result, Some(super::Outcome::Closed), "an expectation no step names stays");
        let dir = std::path::Path::new("lab");
        assert_eq!(lab.action(0, dir), super::Action::Kill("ctl-1".into()));
        assert_eq!(lab.action(1, dir), super::Action::Apply(dir.join("ha/metrics")));
    }

    const POOL: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/pool.toml"));

    /// A pool's host table becomes its `count` hosts, named as the controller names members, at
    /// consecutive addresses; a stop takes the expectations naming its host out of force.
    #[test]
    fn pool_hosts_are_expanded_and_a_stop_ends_their_expectations() {
        let lab = load_text("pool", POOL).unwrap();
        let members: Vec<(&str, &str)> =
            lab.host.iter().filter(|h| h.pool.is_some()).map(|h| (h.name.as_str(), h.addresses["lan"].as_str())).collect();
        assert_eq!(members, [("ci-1", "192.0.2.21"), ("ci-2", "192.0.2.22")]);
        assert_eq!(lab.pools()["ci"].len(), 2);
        assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Stop("ci-2".into()));
        let after = lab.expectations(1);
        assert_eq!(after.len(), lab.expect.len() - 2, "the two naming ci-2 go");
        assert!(after.iter().all(|e| !e.names("ci-2")) && after.iter().any(|e| e.names("ci-1")));
    }

    #[test]
    fn pool_hosts_and_stops_are_checked() {
        let named = POOL.replace("pool = \"ci\"\ncount = 2", "name = \"r\"\npool = \"ci\"\ncount = 2");
        let zero = POOL.replace("count = 2", "count = 0");
        let outside = POOL.replace("count = 2", "count = 240");
        let many = POOL.replace("count = 2", "count = 4000000000");
        let stop_node = POOL.replace("stop = \"ci-2\"", "stop = \"web-1\"");
        let stop_twice = format!("{POOL}\n[[step]]\nstop = \"ci-2\"\n");
        let stop_expect = format!("{POOL}  [[step.expect]]\n  from = \"ci-1\"\n  to = \"web-1\"\n  proto = \"icmp\"\n");
        for (tag, text, want) in [
            ("named", named, "a [[host]] of a pool has `pool` and `count` (1 to 250), no `name`"),
            ("zero", zero, "a [[host]] of a pool has `pool` and `count` (1 to 250)"),
            ("many", many, "a [[host]] of a pool has `pool` and `count` (1 to 250)"),
            ("outside", outside, "host `ci-236` address 192.0.3.0 is not inside net `lan`"),
            ("stop-node", stop_node, "step 1 stops `web-1`, which is not a host of a pool"),
            ("stop-twice", stop_twice, "step 2 stops `ci-2`, which an earlier step stopped"),
            ("stop-expect", stop_expect, "step 1 stops `ci-2` and names expectations"),
        ] {
            match load_text(tag, &text) {
                Ok(_) => panic!("{tag}: loaded, but should fail with {want:?}"),
                Err(e) => assert!(e.contains(want), "{tag}: {e}"),
            }
        }
    }

    const REVOKE: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/revoke.toml"));
    const ROTATE: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/rotate.toml"));

    /// A rotation step rotates the signing key or the mesh CA, and nothing else, in a lab of
    /// one controller.
    #[test]
    fn a_rotation_step_rotates_the_signing_key_or_the_ca_only() {
        let lab = load_text("rotate", ROTATE).unwrap();
        assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Rotate("signing-key".into()));
        assert_eq!(lab.action(1, std::path::Path::new("lab")), super::Action::Rotate("ca".into()));
        let other = ROTATE.replace("rotate = \"signing-key\"", "rotate = \"admin-token\"");
        assert_eq!(load_text("rotate", &other).unwrap_err(), "FILE: step 1 rotates \"admin-token\"; \"signing-key\" and \"ca\" rotate");
    }

    /// A pause names a node host not paused already and no expectation; a resume names a host
    /// paused before; the paused host's expectations are out of force in between.
    #[test]
    fn pauses_and_resumes_are_checked_and_take_expectations_out_of_force_in_between() {
        let lab = load_text("revoke", REVOKE).unwrap();
        let names = |steps: usize| lab.expectations(steps).iter().filter(|e| e.names("op-1")).count();
        let before = names(0);
        assert!(before > 0, "lab/revoke.toml expects something of op-1");
        assert_eq!((names(1), names(2)), (0, 0), "paused, then still paused while db-1 is revoked");
        assert!(names(3) > 0, "resumed, op-1 is expected again");
        assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Pause("op-1".into()));
        assert_eq!(lab.action(2, std::path::Path::new("lab")), super::Action::Resume("op-1".into()));
        let twice = REVOKE.replace("[[step]]\npause = \"op-1\"", "[[step]]\npause = \"op-1\"\n\n[[step]]\npause = \"op-1\"");
        let unpaused = REVOKE.replace("[[step]]\npause = \"op-1\"", "[[step]]\npause = \"api-1\"");
        let controller = REVOKE.replace("pause = \"op-1\"", "pause = \"controller\"");
        for (tag, text, want) in [
            ("twice", twice, "FILE: step 2 pauses `op-1`, which an earlier step paused or stopped"),
            ("unpaused", unpaused, "FILE: step 3 resumes `op-1`, which no earlier step paused"),
            ("controller", controller, "FILE: step 1 pauses `controller`, which is not a node host of the lab"),
        ] {
            assert_eq!(load_text(tag, &text).err().as_deref(), Some(want), "{tag}");
        }
    }
}

#[cfg(test)]
mod renew_tests {
    const RENEW: &str = include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/renew.toml"));

    fn declaration(name: &str) -> trellis_core::Declaration {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab").join(name);
        let mut files = vec![("mesh.toml".to_string(), std::fs::read_to_string(root.join("mesh.toml")).unwrap())];
        for m in std::fs::read_dir(root.join("modules")).unwrap().flatten() {
            files.push((format!("modules/{}", m.file_name().to_string_lossy()), std::fs::read_to_string(m.path()).unwrap()));
        }
        trellis_core::load::load_relative(&files, |p| p.to_string()).declaration.expect("a valid declaration")
    }

    /// A renew step names a node host whose agent runs, and no expectation; the declaration in
    /// force gives the node a certificate short-lived enough to wait for.
    #[test]
    fn a_renew_step_names_a_running_node_with_a_short_lived_certificate() {
        let dir = trellis_testing::TempDir::new("labfile-renew");
        let load = |text: &str| {
            let file = dir.join("lab.toml");
            std::fs::write(&file, text).unwrap();
            super::load(&file).map(|(lab, _)| lab).map_err(|e| e.to_string().replace(&file.display().to_string(), "FILE"))
        };
        let lab = load(RENEW).unwrap();
        assert_eq!(lab.action(0, std::path::Path::new("lab")), super::Action::Renew("db-1".into()));
        let expects =
            RENEW.replace("renew = \"db-1\"", "renew = \"db-1\"\n  [[step.expect]]\n  from = \"db-1\"\n  to = \"app-1\"\n  port = 22\n");
        for (tag, text, want) in [
            (
                "controller",
                RENEW.replace("renew = \"db-1\"", "renew = \"controller\""),
                "FILE: step 1 renews `controller`'s certificates, and `controller` is not a node host of the lab",
            ),
            ("expects", expects, "FILE: step 1 renews certificates, which changes no traffic"),
            (
                "paused",
                RENEW.replace("[[step]]\nrenew", "[[step]]\npause = \"db-1\"\n\n[[step]]\nrenew"),
                "FILE: step 2 renews `db-1`'s certificates, and an earlier step paused or stopped its agent",
            ),
        ] {
            match load(&text) {
                Ok(_) => panic!("{tag}: loaded, but should fail with {want:?}"),
                Err(e) => assert!(e.contains(want), "{tag}: {e}"),
            }
        }
        let renew = declaration("renew");
        super::check_renewal(1, "db-1", &renew).unwrap();
        let e = super::check_renewal(1, "app-1", &renew).unwrap_err().to_string();
        assert_eq!(e, "step 1 renews the certificates of `app-1`, which runs no module with a [module.certificate] in the declaration");
        let e = super::check_renewal(1, "db-1", &declaration("basic")).unwrap_err().to_string();
        assert!(e.contains("which live 86400 s") && e.contains("service_cert_lifetime = \"1m\""), "{e}");
    }
}
