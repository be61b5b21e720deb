//! Parsing: a lab file's text into its tables (a typo of an enum's value refused at its line and
//! column), and each pool's `[[host]]` expanded into its hosts. What the tables say of each other
//! is checked afterwards, by `validate`.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use anyhow::{bail, Context, Result};

use super::schema::{Host, LabFile, Role};

/// The tables of a lab file, each pool's hosts expanded; `file` names it in errors.
pub(super) fn read(text: &str, file: &Path) -> Result<LabFile> {
    let mut lab: LabFile = toml::from_str(text).map_err(|e| parse_error(text, file, &e))?;
    expand_pools(file, &mut lab)?;
    Ok(lab)
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
