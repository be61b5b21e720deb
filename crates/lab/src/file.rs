//! The lab file (`lab/NAME.toml`): nets, hosts and expectations, and its validation against
//! itself and against the declaration it runs.

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
    pub role: Option<String>,
    pub addresses: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
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
    /// The one host with `role = "controller"` (checked by `load`).
    pub fn controller(&self) -> &Host {
        self.host.iter().find(|h| h.role.as_deref() == Some("controller")).expect("load checks there is exactly one controller")
    }

    pub fn net(&self, name: &str) -> Option<&Net> {
        self.net.iter().find(|n| n.name == name)
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
    let controllers = lab.host.iter().filter(|h| h.role.as_deref() == Some("controller")).count();
    if controllers != 1 {
        bail!("{}: exactly one host must have role = \"controller\" (found {controllers})", file.display());
    }
    for h in &lab.host {
        if let Some(r) = &h.role {
            if r != "controller" && r != "node" {
                bail!("{}: host `{}` has role {r:?}; roles are \"controller\" and \"node\"", file.display(), h.name);
            }
        }
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
    }
    for (i, e) in lab.expect.iter().enumerate() {
        if e.dns.is_some() {
            // A DNS expectation that names no answer would be met by silence: it must name the
            // nodes whose addresses answer, or say that the name does not exist.
            let nxdomain = e.result.as_deref() == Some("nxdomain");
            let answers = e.answer.as_ref().is_some_and(|a| !a.is_empty());
            if nxdomain == answers {
                bail!(
                    "{}: expectation {} asks for dns {:?}: give `answer = [NODE, ...]` or `result = \"nxdomain\"`, one of them",
                    file.display(),
                    i + 1,
                    e.dns.as_deref().unwrap_or_default()
                );
            }
        }
    }
    for n in &lab.net {
        for target in [&n.nat, &n.firewall].into_iter().flatten() {
            if lab.net(target).is_none() {
                bail!("{}: net `{}` routes to `{target}`, which is not declared", file.display(), n.name);
            }
        }
    }
    Ok((lab, decl))
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
}
