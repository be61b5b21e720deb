//! The lab file's shape: the tables serde reads (`[lab]`, `[[net]]`, `[[host]]`, `[[expect]]`,
//! `[[step]]`), their enums (`Role`, `Mapping`, `Proto`, `Outcome`), what a step does once validated
//! (`Action`), and what the rest of the lab asks of them.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
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
    /// How the NAT router (`nat`) picks a connection's outside port.
    pub mapping: Option<Mapping>,
}

/// How a NAT router maps an inside source to an outside port (`mapping`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Mapping {
    /// As Linux masquerade does: the source port kept where it is free, one mapping for every
    /// destination (a home router), so a peer told the port the hub saw can answer on it.
    #[default]
    EndpointIndependent,
    /// A new random port for every new destination (`masquerade fully-random`), as carrier and
    /// cloud NATs do: the port the hub saw is no use to anyone else.
    Symmetric,
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
    /// A net with `nat` whose router forgets every mapping (`conntrack -F`) and maps to new
    /// outside ports from then on, as a home router does when it restarts or its lease changes;
    /// the expectations in force are checked again after, a path row timed from the step.
    pub rebind: Option<String>,
    /// Seconds in which the lab sends nothing into the overlay: every path an agent lists as
    /// direct when the step begins must still be direct, the same session (the same `since`),
    /// when it ends, though only keepalives and the agents' probes crossed it (ADR 0032); the
    /// expectations in force are checked again after.
    pub quiet: Option<u64>,
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
    Rebind(String),
    Quiet(u64),
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
    /// How `from`'s interface reaches `to`: `direct` (a fresh handshake with `to`'s own peer entry,
    /// which holds `to`'s address, at an endpoint that is no hub's, and a ping answered) or
    /// `relayed` (a hub's peer entry holds `to`'s address), read from the agents' status files.
    Path,
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
            Proto::Path => "path",
        }
    }
}

impl std::fmt::Display for Proto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an expectation expects (`result`): traffic `open` or `closed`, a DNS name `nxdomain`, a
/// TLS handshake whose certificate does not verify `refused`, a path `direct` or `relayed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Open,
    Closed,
    Nxdomain,
    Refused,
    Direct,
    Relayed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Open => "open",
            Outcome::Closed => "closed",
            Outcome::Nxdomain => "nxdomain",
            Outcome::Refused => "refused",
            Outcome::Direct => "direct",
            Outcome::Relayed => "relayed",
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
        if let Some(net) = &s.rebind {
            return Action::Rebind(net.clone());
        }
        if let Some(secs) = s.quiet {
            return Action::Quiet(secs);
        }
        match (&s.kill, &s.apply, &s.stop, &s.revoke) {
            (Some(host), ..) => Action::Kill(host.clone()),
            (None, Some(dir), ..) => Action::Apply(lab_dir.join(dir)),
            (None, None, Some(host), _) => Action::Stop(host.clone()),
            (None, None, None, Some(node)) => Action::Revoke(node.clone()),
            (None, None, None, None) => unreachable!("load checks every step does exactly one thing"),
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
            // A revoked node has no path to anyone: its reachability rows stay (closed), its
            // path rows go.
            if let Some(node) = &s.revoke {
                out.retain(|e| !(e.proto == Some(Proto::Path) && e.names(node)));
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
