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
    pub name: String,
    #[serde(default)]
    pub role: Role,
    pub addresses: BTreeMap<String, String>,
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
}

/// `proto = "throughput"`: iperf3 from `from` to `to` on `port`, through the overlay and on the
/// underlay; met when the overlay run moved data (a measurement, not a speed limit).
pub const THROUGHPUT: &str = "throughput";

#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    pub from: String,
    pub to: Option<String>,
    pub proto: Option<String>,
    pub port: Option<u16>,
    pub result: Option<String>,
    pub dns: Option<String>,
    pub answer: Option<Vec<String>>,
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

    /// What step `i` does; `lab_dir` is the directory of the lab file.
    pub fn action(&self, i: usize, lab_dir: &Path) -> Action {
        let s = &self.step[i];
        match (&s.kill, &s.apply) {
            (Some(host), _) => Action::Kill(host.clone()),
            (None, Some(dir)) => Action::Apply(lab_dir.join(dir)),
            (None, None) => unreachable!("load checks every step kills or applies"),
        }
    }

    /// The expectations in force after the first `steps` steps: the file's, each replaced or
    /// joined by those of the steps, in order.
    pub fn expectations(&self, steps: usize) -> Vec<Expect> {
        let mut out = self.expect.clone();
        for s in &self.step[..steps] {
            for e in &s.expect {
                match out.iter_mut().find(|o| o.same_check(e)) {
                    Some(o) => *o = e.clone(),
                    None => out.push(e.clone()),
                }
            }
        }
        out
    }

    pub fn net(&self, name: &str) -> Option<&Net> {
        self.net.iter().find(|n| n.name == name)
    }
}

impl Expect {
    /// Whether both test the same thing (and so cannot both be in force).
    pub fn same_check(&self, other: &Expect) -> bool {
        match (&self.dns, &other.dns) {
            (Some(a), Some(b)) => self.from == other.from && a == b,
            (None, None) => {
                (&self.from, &self.to, self.proto.as_deref().unwrap_or("tcp"), self.port)
                    == (&other.from, &other.to, other.proto.as_deref().unwrap_or("tcp"), other.port)
            }
            _ => false,
        }
    }

    /// What is expected: `open` or `closed` for traffic (open when unsaid), the answer or
    /// `nxdomain` for DNS.
    pub fn outcome(&self) -> (Option<&str>, Option<&[String]>) {
        let result = self.result.as_deref().or(if self.dns.is_none() { Some("open") } else { None });
        (result, self.answer.as_deref())
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
    let lab: LabFile = toml::from_str(text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
    let decl = file.parent().unwrap_or(Path::new(".")).join(&lab.lab.declaration);
    let names = |role: Role| lab.host.iter().filter(|h| h.role == role).map(|h| format!("`{}`", h.name)).collect::<Vec<_>>();
    let (controllers, postgres) = (names(Role::Controller), names(Role::Postgres));
    if controllers.is_empty() {
        bail!("{}: no host has role = \"controller\"; the lab needs one", file.display());
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

fn check_expect(file: &Path, what: &str, e: &Expect) -> Result<()> {
    if e.proto.as_deref() == Some(THROUGHPUT) && (e.to.is_none() || e.port.is_none() || e.result.is_some() || e.dns.is_some()) {
        bail!(
            "{}: {what} measures throughput: give `to` and `port` (a TCP port the target's filter admits from `from`), and no `result` or `dns`",
            file.display()
        );
    }
    if e.dns.is_some() {
        // A DNS expectation that names no answer would be met by silence: it must name the
        // nodes whose addresses answer, or say that the name does not exist.
        let nxdomain = e.result.as_deref() == Some("nxdomain");
        let answers = e.answer.as_ref().is_some_and(|a| !a.is_empty());
        if nxdomain == answers {
            bail!(
                "{}: {what} asks for dns {:?}: give `answer = [NODE, ...]` or `result = \"nxdomain\"`, one of them",
                file.display(),
                e.dns.as_deref().unwrap_or_default()
            );
        }
    }
    Ok(())
}

/// Each step kills a controller still running (never the last one) or applies a declaration,
/// and an apply says, with expectations that are not already in force, what it changes.
fn check_steps(file: &Path, lab: &LabFile) -> Result<()> {
    let mut running: Vec<&str> = lab.controllers().map(|h| h.name.as_str()).collect();
    for (i, s) in lab.step.iter().enumerate() {
        let n = i + 1;
        match (&s.kill, &s.apply) {
            (Some(host), None) => {
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
            (None, Some(dir)) => {
                if s.expect.is_empty() {
                    bail!("{}: step {n} applies {dir:?} but names no expectation; give the ones its apply changes", file.display());
                }
                let before = lab.expectations(i);
                for (j, e) in s.expect.iter().enumerate() {
                    let what = format!("step {n} expectation {}", j + 1);
                    check_expect(file, &what, e)?;
                    if before.iter().any(|b| b.same_check(e) && b.outcome() == e.outcome()) {
                        bail!("{}: {what} is already in force; a step lists what its apply changes", file.display());
                    }
                }
            }
            _ => bail!("{}: step {n} needs exactly one of `kill = HOST` and `apply = DIR`", file.display()),
        }
    }
    Ok(())
}

/// Endpoint addresses in the declaration must be lab host addresses of the same node.
pub fn check_endpoints(lab: &LabFile, decl: &trellis_core::Declaration) -> Result<()> {
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
    /// A DNS expectation that names no answer would be met by an empty reply: refused at load.
    #[test]
    fn a_dns_expectation_names_its_answer_or_nxdomain() {
        let dir = std::env::temp_dir().join(format!("trellis-labfile-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let head = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../lab/basic.toml")).unwrap();
        let file = dir.join("lab.toml");
        for (tail, ok) in [
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"db-1.basic.mesh\"\n", false),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"db-1.basic.mesh\"\nanswer = []\n", false),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nanswer = [\"db-1\"]\nresult = \"nxdomain\"\n", false),
            ("[[expect]]\nfrom = \"op-1\"\ndns = \"x.basic.mesh\"\nresult = \"nxdomain\"\n", true),
        ] {
            std::fs::write(&file, format!("{head}\n{tail}")).unwrap();
            let r = super::load(&file);
            assert_eq!(r.is_ok(), ok, "{tail}: {:?}", r.err());
            if let Err(e) = r {
                assert!(e.to_string().contains("give `answer = [NODE, ...]` or `result = \"nxdomain\"`"), "{e}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Loads `text` as a lab file next to the shipped ones; the error's text, if any.
    fn load_text(tag: &str, text: &str) -> Result<super::LabFile, String> {
        let dir = std::env::temp_dir().join(format!("trellis-labfile-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("lab.toml");
        std::fs::write(&file, text).unwrap();
        let r = super::load(&file).map(|(lab, _)| lab).map_err(|e| e.to_string().replace(&file.display().to_string(), "FILE"));
        let _ = std::fs::remove_dir_all(&dir);
        r
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
            ("both", both, "FILE: step 1 needs exactly one of `kill = HOST` and `apply = DIR`"),
            ("neither", neither, "FILE: step 1 needs exactly one of `kill = HOST` and `apply = DIR`"),
            ("silent", silent_apply, "FILE: step 2 applies \"ha/metrics\" but names no expectation; give the ones its apply changes"),
            ("same", same, "FILE: step 2 expectation 1 is already in force; a step lists what its apply changes"),
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
        assert_eq!(load_text("tp", lab).unwrap().expect.iter().filter(|e| e.proto.as_deref() == Some(super::THROUGHPUT)).count(), 3);
        let want = "FILE: expectation 1 measures throughput: give `to` and `port` (a TCP port the target's filter admits from `from`), and no `result` or `dns`";
        for (tag, text) in [
            ("tp-port", lab.replacen("port = 5432\n", "", 1)),
            ("tp-to", lab.replacen("to = \"db-1\"\n", "", 1)),
            ("tp-result", lab.replacen("port = 5432\n", "port = 5432\nresult = \"open\"\n", 1)),
        ] {
            assert_eq!(load_text(tag, &text).unwrap_err(), want, "{tag}");
        }
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
        assert_eq!(port.result.as_deref(), Some("open"));
        let dns = after.iter().find(|e| e.dns.as_deref() == Some("metrics.ha.mesh")).unwrap();
        assert_eq!(dns.answer.as_deref().unwrap(), ["web-1", "api-1", "db-1"]);
        let closed = after.iter().find(|e| e.from == "api-1" && e.port == Some(9100)).unwrap();
        assert_eq!(closed.result.as_deref(), Some("closed"), "an expectation no step names stays");
        let dir = std::path::Path::new("lab");
        assert_eq!(lab.action(0, dir), super::Action::Kill("ctl-1".into()));
        assert_eq!(lab.action(1, dir), super::Action::Apply(dir.join("ha/metrics")));
    }
}
