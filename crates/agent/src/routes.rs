//! Routes through the overlay: the prefixes of the routes a node uses, sent into the WireGuard
//! interface, and an exit's default route by policy routing, as wg-quick does it. WireGuard's
//! own packets carry a firewall mark (the table number) and keep the main table; so does
//! traffic to the controller, by a rule of its own. Every route and rule trellis adds carries
//! its marks (`proto` 84, preferences 5300-5320), so what a previous bundle added and this one
//! has not is found and removed, and nothing else is touched.

use std::net::IpAddr;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::plan::Exit;

/// The routing protocol number on trellis's routes (`ip route ... proto 84`).
const PROTO: &str = "84";
/// The metric of trellis's routes: above the kernel's own routes of a connected network (0 for
/// IPv4, 256 for IPv6), so that a node on a route's LAN keeps reaching it directly and its own
/// route is never replaced.
const METRIC: &str = "1024";
/// Rule preferences: traffic to the controller keeps the main table; then the main table
/// without its default routes; then everything not WireGuard's own goes to the exit's table.
const PREF_CONTROLLER: &str = "5300";
const PREF_SUPPRESS: &str = "5310";
const PREF_EXIT: &str = "5320";

pub trait Routing {
    /// Brings the host's routes to these: `routes` into `interface`, and with `exit` the default
    /// routes of those families through it (table `table`, mark `table`).
    fn apply(&mut self, interface: &str, routes: &[ipnet::IpNet], exit: Exit, table: u32) -> Result<()>;
    /// Whether this agent has routes or an exit installed.
    fn installed(&self) -> bool;
}

/// The real host's, with `ip`. `controllers` gives the controllers' addresses (asked when an
/// exit is installed: they stay outside the tunnel).
pub struct IpRouting {
    pub controllers: Box<dyn Fn() -> Vec<IpAddr> + Send>,
    /// Known after the first apply; before it, read from the host, so that what an agent
    /// installed before a restart is still removed when a bundle drops it.
    installed: std::cell::Cell<Option<bool>>,
}

impl IpRouting {
    pub fn new(controllers: Box<dyn Fn() -> Vec<IpAddr> + Send>) -> IpRouting {
        IpRouting { controllers, installed: std::cell::Cell::new(None) }
    }
}

/// Whether the host holds any route or rule of trellis's.
fn on_host() -> bool {
    ["-4", "-6"].iter().any(|family| {
        ip(&[family, "route", "show", "table", "all", "proto", PROTO]).is_ok_and(|t| !t.trim().is_empty())
            || [PREF_CONTROLLER, PREF_SUPPRESS, PREF_EXIT]
                .iter()
                .any(|pref| ip(&[family, "rule", "show", "pref", pref]).is_ok_and(|t| !t.trim().is_empty()))
    })
}

fn ip(args: &[&str]) -> Result<String> {
    let out = Command::new("ip").args(args).output().context("cannot run `ip` (iproute2)")?;
    if !out.status.success() {
        bail!("`ip {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The prefixes of trellis's routes on `interface` in the main table, of one family.
fn ours(family: &str, interface: &str) -> Result<Vec<ipnet::IpNet>> {
    let text = ip(&[family, "route", "show", "dev", interface, "proto", PROTO])?;
    Ok(text.lines().filter_map(|l| l.split_whitespace().next()).filter_map(|p| p.parse().ok().or_else(|| host(p))).collect())
}

/// `ip route` prints a host route without its length.
fn host(p: &str) -> Option<ipnet::IpNet> {
    p.parse::<IpAddr>().ok().map(ipnet::IpNet::from)
}

/// Removes every rule at `pref` (there may be several: one per controller address).
fn del_rules(family: &str, pref: &str) {
    for _ in 0..64 {
        if ip(&[family, "rule", "del", "pref", pref]).is_err() {
            break;
        }
    }
}

impl Routing for IpRouting {
    fn apply(&mut self, interface: &str, routes: &[ipnet::IpNet], exit: Exit, table: u32) -> Result<()> {
        let controllers = if routes.is_empty() && !exit.any() { Vec::new() } else { (self.controllers)() };
        // A route over the controller would cut the agent off from what could undo it.
        if !routes.is_empty() {
            if let Some((p, c)) = routes.iter().find_map(|p| controllers.iter().find(|c| p.contains(*c)).map(|c| (p, c))) {
                bail!("route {p} holds the controller's address {c}; it is not routed into the tunnel, which would cut the agent off");
            }
        }
        for (family, v6) in [("-4", false), ("-6", true)] {
            let want: Vec<&ipnet::IpNet> = routes.iter().filter(|p| matches!(p, ipnet::IpNet::V6(_)) == v6).collect();
            let have = ours(family, interface)?;
            for p in &want {
                ip(&[family, "route", "replace", &p.to_string(), "dev", interface, "proto", PROTO, "metric", METRIC])
                    .with_context(|| format!("cannot route {p} into {interface}"))?;
            }
            for p in have.iter().filter(|p| !want.contains(p)) {
                ip(&[family, "route", "del", &p.to_string(), "dev", interface, "proto", PROTO, "metric", METRIC])?;
            }
            let on = if v6 { exit.ipv6 } else { exit.ipv4 };
            let table = table.to_string();
            del_rules(family, PREF_CONTROLLER);
            del_rules(family, PREF_SUPPRESS);
            del_rules(family, PREF_EXIT);
            if on {
                ip(&[family, "route", "replace", "default", "dev", interface, "table", &table, "proto", PROTO])
                    .with_context(|| format!("cannot route the default route into {interface}"))?;
                for c in controllers.iter().filter(|c| c.is_ipv6() == v6) {
                    ip(&[family, "rule", "add", "pref", PREF_CONTROLLER, "to", &c.to_string(), "lookup", "main"])?;
                }
                ip(&[family, "rule", "add", "pref", PREF_SUPPRESS, "lookup", "main", "suppress_prefixlength", "0"])?;
                ip(&[family, "rule", "add", "pref", PREF_EXIT, "not", "fwmark", &table, "lookup", &table])?;
            } else {
                let _ = ip(&[family, "route", "flush", "table", &table, "proto", PROTO]);
            }
        }
        self.installed.set(Some(!routes.is_empty() || exit.any()));
        Ok(())
    }

    fn installed(&self) -> bool {
        let known = self.installed.get().unwrap_or_else(on_host);
        self.installed.set(Some(known));
        known
    }
}

/// The addresses of the controllers (`HOST:PORT`, as an identity names them, or a URL):
/// literal addresses as they are, names as the system resolves them.
pub fn addresses(urls: &[String]) -> Vec<IpAddr> {
    use std::net::ToSocketAddrs;
    let mut out = Vec::new();
    for u in urls {
        let rest = u.split_once("://").map_or(u.as_str(), |(_, r)| r);
        let authority = rest.split('/').next().unwrap_or(rest);
        let with_port = if authority.rsplit_once(':').is_some_and(|(_, p)| p.bytes().all(|b| b.is_ascii_digit())) {
            authority.to_string()
        } else {
            format!("{authority}:443")
        };
        if let Ok(addrs) = with_port.to_socket_addrs() {
            for a in addrs {
                if !out.contains(&a.ip()) {
                    out.push(a.ip());
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_route_over_the_controller_is_refused_before_anything_changes() {
        use super::Routing;
        let mut r = super::IpRouting::new(Box::new(|| vec!["198.51.100.2".parse().unwrap()]));
        let routes = vec!["198.51.100.0/24".parse().unwrap()];
        // Refused before any `ip` command runs: this test changes nothing on the host.
        let e = r.apply("trellis-test0", &routes, crate::plan::Exit::default(), 51820).unwrap_err().to_string();
        assert_eq!(e, "route 198.51.100.0/24 holds the controller's address 198.51.100.2; it is not routed into the tunnel, which would cut the agent off");
    }

    #[test]
    fn controller_urls_give_their_addresses() {
        let urls = vec![
            "198.51.100.2:8443".to_string(),
            "https://198.51.100.3:8443".to_string(),
            "[2001:db8::2]:8443".to_string(),
            "nonsense".to_string(),
        ];
        let got = super::addresses(&urls);
        let want: Vec<std::net::IpAddr> = ["198.51.100.2", "198.51.100.3", "2001:db8::2"].iter().map(|a| a.parse().unwrap()).collect();
        assert_eq!(got, want);
    }
}
