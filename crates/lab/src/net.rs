//! The lab's network: a switch namespace with a bridge per net, a namespace per host linked to
//! its nets, and NAT or firewall routers between nets; and the commands that run inside them.

use std::collections::HashMap;
use std::net::IpAddr;
use std::process::Command;

use anyhow::{bail, Context, Result};
use ipnet::IpNet;

use crate::file::{Host, LabFile, Mapping};
use crate::LabState;

/// Runs a command to completion; its stdout, or an error with its stderr.
pub(crate) fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("cannot run {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

/// A command that runs inside namespace `ns`, to be spawned or waited for by the caller.
pub(crate) fn ns_cmd(ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c
}

/// Runs a command inside namespace `ns` to completion, like `sh`.
pub(crate) fn in_ns(ns: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

/// The address a router takes on a net: counted down from the top of its range.
fn router_addr(net: &str, index: u32, lab: &LabFile, v6: bool) -> Option<String> {
    let p = lab.net(net)?.prefix(v6)?;
    Some(match p {
        IpNet::V4(p) => std::net::Ipv4Addr::from(u32::from(p.broadcast()) - 1 - index).to_string(),
        IpNet::V6(p) => std::net::Ipv6Addr::from(u128::from(p.broadcast()) - 1 - index as u128).to_string(),
    })
}

fn add_ns(st: &mut LabState, name: &str) -> Result<String> {
    let ns = format!("{}-{name}", st.prefix);
    sh(&["ip", "netns", "add", &ns])?;
    st.namespaces.push(ns.clone());
    in_ns(&ns, &["ip", "link", "set", "lo", "up"])?;
    Ok(ns)
}

/// Adds an address; IPv6 ones skip duplicate address detection, so they are usable at once.
fn add_addr(ns: &str, cidr: &str, dev: &str) -> Result<()> {
    let mut args = vec!["ip", "addr", "add", cidr, "dev", dev];
    if cidr.contains(':') {
        args.push("nodad");
    }
    in_ns(ns, &args).map(|_| ())
}

fn link(sw: &str, net: &str, ns: &str, ifname: &str, counter: &mut u32) -> Result<()> {
    *counter += 1;
    let veth = format!("v{counter}");
    sh(&["ip", "link", "add", &veth, "netns", sw, "type", "veth", "peer", "name", ifname, "netns", ns])?;
    in_ns(sw, &["ip", "link", "set", &veth, "master", &format!("br-{net}")])?;
    in_ns(sw, &["ip", "link", "set", &veth, "up"])?;
    in_ns(ns, &["ip", "link", "set", ifname, "up"])?;
    Ok(())
}

/// Builds every namespace, bridge, link and router the lab file describes, recording each
/// namespace in `st` as it is made; returns the namespace of every host by host name.
pub(crate) fn build(lab: &LabFile, st: &mut LabState) -> Result<HashMap<String, String>> {
    let sw = add_ns(st, "sw")?;
    for n in &lab.net {
        let br = format!("br-{}", n.name);
        in_ns(&sw, &["ip", "link", "add", &br, "type", "bridge"])?;
        in_ns(&sw, &["ip", "link", "set", &br, "up"])?;
    }
    let mut counter = 0;
    let mut host_ns: HashMap<String, String> = HashMap::new();
    for h in &lab.host {
        let ns = add_ns(st, &h.name)?;
        for (i, (net, addr)) in h.addresses.iter().enumerate() {
            let ifname = format!("eth{i}");
            link(&sw, net, &ns, &ifname, &mut counter)?;
            let n = lab.net(net).expect("checked");
            let len = n.prefix(addr.contains(':')).context("address family not in net")?.prefix_len();
            add_addr(&ns, &format!("{addr}/{len}"), &ifname)?;
        }
        host_ns.insert(h.name.clone(), ns);
    }
    for h in &lab.host {
        for (prefix, via) in &h.routes {
            let gw = lab.gateway(h, prefix, via)?.to_string();
            let fam = if gw.contains(':') { "-6" } else { "-4" };
            in_ns(&host_ns[&h.name], &["ip", fam, "route", "add", prefix, "via", &gw])?;
        }
    }
    // Routers: a NAT or firewall router between a net and the net it reaches. A host on both
    // nets reaches each directly (its kernel already has the route), and gets one default route
    // at most.
    let mut defaults = std::collections::HashSet::new();
    for (ri, n) in lab.net.iter().enumerate() {
        let (target, masquerade) = match (&n.nat, &n.firewall) {
            (Some(t), _) => (t, true),
            (None, Some(t)) => (t, false),
            _ => continue,
        };
        let ns = add_ns(st, &format!("r{ri}"))?;
        link(&sw, &n.name, &ns, "inside", &mut counter)?;
        link(&sw, target, &ns, "outside", &mut counter)?;
        for v6 in [false, true] {
            let (Some(inside), Some(outside)) = (router_addr(&n.name, ri as u32, lab, v6), router_addr(target, ri as u32, lab, v6)) else {
                continue;
            };
            let tnet = lab.net(target).expect("checked");
            let (il, ol) = (n.prefix(v6).expect("family").prefix_len(), tnet.prefix(v6).expect("family").prefix_len());
            let fam = if v6 { "-6" } else { "-4" };
            add_addr(&ns, &format!("{inside}/{il}"), "inside")?;
            add_addr(&ns, &format!("{outside}/{ol}"), "outside")?;
            // Hosts inside send everything else to the router.
            for h in lab.host.iter().filter(|h| h.addresses.get(&n.name).is_some_and(|a| a.contains(':') == v6)) {
                if h.addresses.contains_key(target) || !defaults.insert((h.name.clone(), v6)) {
                    continue;
                }
                in_ns(&host_ns[&h.name], &["ip", fam, "route", "add", "default", "via", &inside])?;
            }
            if !masquerade {
                // Routed: hosts outside know the way in (and are stopped by the firewall).
                let net_prefix = if v6 { n.ipv6.clone() } else { n.ipv4.clone() }.expect("family");
                let outside_only = |h: &&crate::file::Host| !h.addresses.contains_key(&n.name);
                for h in lab.host.iter().filter(|h| h.addresses.get(target).is_some_and(|a| a.contains(':') == v6)).filter(outside_only) {
                    in_ns(&host_ns[&h.name], &["ip", fam, "route", "add", &net_prefix, "via", &outside])?;
                }
            }
        }
        in_ns(&ns, &["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
        in_ns(&ns, &["sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"])?;
        let nat = masquerade.then(|| n.mapping.unwrap_or_default());
        load_router_rules(st, ri, nat, 0)?;
    }
    // The other routers on a routed net's outside know the way in too, as the internet's do: a
    // host behind a NAT reaches a firewalled data centre's addresses (and is stopped by its
    // firewall unless the data centre spoke first), so a pair of them can punch through.
    fn outside_of(n: &crate::file::Net) -> Option<&str> {
        n.nat.as_deref().or(n.firewall.as_deref())
    }
    for (fi, f) in lab.net.iter().enumerate().filter(|(_, n)| n.nat.is_none()) {
        let Some(target) = f.firewall.as_deref() else { continue };
        for (ri, _) in lab.net.iter().enumerate().filter(|(ri, n)| *ri != fi && outside_of(n) == Some(target)) {
            for v6 in [false, true] {
                let (Some(prefix), Some(via)) = (f.prefix(v6), router_addr(target, fi as u32, lab, v6)) else { continue };
                let fam = if v6 { "-6" } else { "-4" };
                in_ns(&format!("{}-r{ri}", st.prefix), &["ip", fam, "route", "add", &prefix.to_string(), "via", &via])?;
            }
        }
    }
    Ok(host_ns)
}

/// The first UDP port a router maps to after a rebind: the k-th rebind maps to `REBOUND_PORT + k`.
pub(crate) const REBOUND_PORT: u16 = 40000;

/// The ruleset of router `r{index}`: masquerading with `nat`'s mapping (or routing, with `None`),
/// and after `rebinds` rebinds of an endpoint-independent one, UDP mapped to the one port
/// `REBOUND_PORT + rebinds`, since Linux masquerade would give a flushed mapping its old port
/// back. One port keeps the mapping endpoint-independent: every destination sees it.
pub(crate) fn router_rules(nat: Option<Mapping>, rebinds: u16) -> String {
    let nat = match nat {
        None => String::new(),
        Some(Mapping::Symmetric) => "\t\toifname \"outside\" masquerade fully-random\n".to_string(),
        Some(Mapping::EndpointIndependent) if rebinds == 0 => "\t\toifname \"outside\" masquerade\n".to_string(),
        Some(Mapping::EndpointIndependent) => format!(
            "\t\toifname \"outside\" meta l4proto udp masquerade to :{}\n\t\toifname \"outside\" masquerade\n",
            REBOUND_PORT + rebinds
        ),
    };
    let nat =
        if nat.is_empty() { nat } else { format!("\tchain postrouting {{\n\t\ttype nat hook postrouting priority srcnat;\n{nat}\t}}\n") };
    // Routed or masqueraded, only connections started inside pass: new ones from outside drop.
    // So do new ones from outside to the router itself, as a home router's do: accepted, a
    // datagram to the router's own port would be tracked as a connection of its own, and the
    // mapping an inside host then asks for toward the same address and port would clash with it
    // and be given another port (a hole punched from both sides would miss). The ruleset
    // replaces the router's whole ruleset, as a rebind reloads it.
    format!(
        "flush ruleset\ntable inet lab {{\n{nat}\tchain input {{\n\t\ttype filter hook input priority filter; policy accept;\n\t\tiifname \"outside\" ct state new drop\n\t}}\n\tchain forward {{\n\t\ttype filter hook forward priority filter; policy drop;\n\t\tct state established,related accept\n\t\tiifname \"inside\" accept\n\t}}\n}}\n"
    )
}

/// Writes router `r{index}`'s ruleset (`router_rules`) to `router-{index}.nft` and loads it.
fn load_router_rules(st: &LabState, index: usize, nat: Option<Mapping>, rebinds: u16) -> Result<()> {
    let path = st.dir.join(format!("router-{index}.nft"));
    std::fs::write(&path, router_rules(nat, rebinds)).with_context(|| format!("cannot write {}", path.display()))?;
    in_ns(&format!("{}-r{index}", st.prefix), &["nft", "-f", path.to_str().context("path")?]).map(|_| ())
}

/// Rebinds net `net`'s NAT router for the `rebinds`-th time: its new ruleset loaded first, then
/// every mapping forgotten (`conntrack -F`), so that nothing maps with the old rules in between.
/// Returns how many connections the router tracked just before.
pub(crate) fn rebind(lab: &LabFile, st: &LabState, net: &str, rebinds: u16) -> Result<u64> {
    let index = lab.net.iter().position(|n| n.name == net).with_context(|| format!("the lab has no net `{net}`"))?;
    let n = &lab.net[index];
    if n.nat.is_none() {
        bail!("net `{net}` has no NAT router to rebind");
    }
    load_router_rules(st, index, Some(n.mapping.unwrap_or_default()), rebinds)?;
    let ns = format!("{}-r{index}", st.prefix);
    let tracked = in_ns(&ns, &["conntrack", "-C"]).context("cannot count the router's connections (is conntrack installed?)")?;
    in_ns(&ns, &["conntrack", "-F"]).with_context(|| format!("cannot flush the connections of net `{net}`'s router"))?;
    tracked.trim().parse().with_context(|| format!("`conntrack -C` printed {tracked:?}, not a count"))
}

/// The lab addresses of host `to`, best first for reaching it from host `from`: those on a net
/// `from` is on; then those on a net `from`'s nets reach through a NAT or firewall router; then
/// those on a net routed to `from`'s nets through a firewall that drops new connections from
/// them (a check that expects `closed` is then sent where the firewall stops it); then the rest.
/// IPv4 before IPv6 at each rank, and a rank's addresses in net-name order. An ingress with a
/// private net that sorts before its public one is thus reached at its public address, where a
/// client or a CA on the internet finds it, not at its first.
pub(crate) fn addresses_seen_from(lab: &LabFile, from: &Host, to: &Host) -> Vec<IpAddr> {
    let rank = |net: &str, v6: bool| {
        let on = |n: &str| from.addresses.get(n).is_some_and(|a| a.contains(':') == v6);
        let nets_of_from = || from.addresses.keys().filter(|n| on(n)).filter_map(|n| lab.net(n));
        if on(net) {
            0
        } else if nets_of_from().any(|n| n.nat.as_deref() == Some(net) || n.firewall.as_deref() == Some(net)) {
            1
        } else if lab.net(net).and_then(|n| n.firewall.as_deref()).is_some_and(on) {
            2
        } else {
            3
        }
    };
    let mut ranked: Vec<(u8, bool, IpAddr)> =
        to.addresses.iter().filter_map(|(net, a)| a.parse::<IpAddr>().ok().map(|ip| (rank(net, ip.is_ipv6()), ip.is_ipv6(), ip))).collect();
    // Stable: equal ranks keep the addresses' net-name order.
    ranked.sort_by_key(|&(rank, v6, _)| (rank, v6));
    ranked.into_iter().map(|(_, _, ip)| ip).collect()
}

/// Kills every process in the lab's namespaces and those it started, then deletes the
/// namespaces, last made first.
pub(crate) fn remove(st: &LabState) {
    for ns in st.namespaces.iter().rev() {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", ns]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).output();
            }
        }
    }
    for pid in &st.pids {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).output();
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    for ns in st.namespaces.iter().rev() {
        let _ = Command::new("ip").args(["netns", "del", ns]).output();
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    /// A dual-homed edge is reached where each host can reach it: at its public address from the
    /// internet, though its private net sorts first; at its private one from that net; and a
    /// host behind a firewall or NAT at the address on the net its router leads to.
    #[test]
    fn a_dual_homed_host_is_reached_on_a_net_the_other_host_reaches() {
        let text = r#"
[lab]
name = "reach"
declaration = "reach"

[[net]]
name = "backend"
ipv4 = "10.30.0.0/24"

[[net]]
name = "dc"
ipv4 = "203.0.113.0/24"
firewall = "internet"

[[net]]
name = "internet"
ipv4 = "198.51.100.0/24"
ipv6 = "2001:db8::/64"

[[net]]
name = "lan"
ipv4 = "192.168.1.0/24"
nat = "internet"

[[host]]
name = "controller"
role = "controller"
addresses = { internet = "198.51.100.2" }

[[host]]
name = "edge-1"
addresses = { backend = "10.30.0.10", internet = "198.51.100.10" }

[[host]]
name = "edge-6"
addresses = { backend = "10.30.0.16", internet = "2001:db8::16" }

[[host]]
name = "client"
role = "outside"
addresses = { internet = "198.51.100.20" }

[[host]]
name = "private"
role = "outside"
addresses = { backend = "10.30.0.20" }

[[host]]
name = "client6"
role = "outside"
addresses = { internet = "2001:db8::20" }

[[host]]
name = "runner"
addresses = { dc = "203.0.113.11" }

[[host]]
name = "app"
addresses = { backend = "10.30.0.12", dc = "203.0.113.12" }

[[host]]
name = "desk"
role = "outside"
addresses = { lan = "192.168.1.5" }
"#;
        let (lab, _) = crate::file::parse(text, std::path::Path::new("reach.toml")).unwrap();
        let host = |n: &str| lab.host.iter().find(|h| h.name == n).unwrap();
        let seen = |from: &str, to: &str| -> Vec<String> {
            super::addresses_seen_from(&lab, host(from), host(to)).iter().map(IpAddr::to_string).collect()
        };
        for (from, to, want) in [
            ("client", "edge-1", ["198.51.100.10", "10.30.0.10"]),
            ("private", "edge-1", ["10.30.0.10", "198.51.100.10"]),
            // Outward through the data centre's firewall, or the LAN's NAT, to the internet.
            ("runner", "edge-1", ["198.51.100.10", "10.30.0.10"]),
            ("desk", "edge-1", ["198.51.100.10", "10.30.0.10"]),
            // An address on a shared net, of the family the host has there, before IPv4 elsewhere.
            ("client6", "edge-6", ["2001:db8::16", "10.30.0.16"]),
            ("client", "edge-6", ["10.30.0.16", "2001:db8::16"]),
        ] {
            assert_eq!(seen(from, to), want, "{from} -> {to}");
        }
        // Routed in through the firewall (which drops it): still before a net with no route.
        assert_eq!(seen("client", "app"), ["203.0.113.12", "10.30.0.12"]);
    }

    /// A router as the lab builds it, for real (root): an ordinary NAT keeps a sender's port for
    /// every destination, a `symmetric` one gives each destination its own, and a rebind moves
    /// the ordinary one to `REBOUND_PORT + 1` for every destination. Each port is the one the
    /// destination saw (`nc -l -v`).
    #[test]
    fn routers_map_ports_as_their_mapping_says_and_a_rebind_moves_them() {
        use trellis_testing::{can_run, Need};
        if !can_run(Need::Root) || !can_run(Need::Program("conntrack")) || !can_run(Need::Program("nc")) {
            return;
        }
        let text = r#"
[lab]
name = "map"
declaration = "map"

[[net]]
name = "internet"
ipv4 = "198.51.100.0/24"

[[net]]
name = "home"
ipv4 = "192.168.1.0/24"
nat = "internet"

[[net]]
name = "carrier"
ipv4 = "100.64.1.0/24"
nat = "internet"
mapping = "symmetric"

[[host]]
name = "controller"
role = "controller"
addresses = { internet = "198.51.100.2" }

[[host]]
name = "a"
role = "outside"
addresses = { internet = "198.51.100.10" }

[[host]]
name = "b"
role = "outside"
addresses = { internet = "198.51.100.11" }

[[host]]
name = "home-1"
role = "outside"
addresses = { home = "192.168.1.10" }

[[host]]
name = "phone-1"
role = "outside"
addresses = { carrier = "100.64.1.10" }
"#;
        let (lab, _) = crate::file::parse(text, std::path::Path::new("map.toml")).unwrap();
        let dir = trellis_testing::TempDir::new("lab-nat-mapping");
        /// The namespaces go, also when an assertion fails.
        struct Built(crate::LabState);
        impl Drop for Built {
            fn drop(&mut self) {
                super::remove(&self.0);
            }
        }
        let mut st = crate::LabState { prefix: format!("tm{:04x}", crate::rand_u16()), dir: dir.to_path_buf(), ..Default::default() };
        let built = super::build(&lab, &mut st);
        let lab_up = Built(st);
        built.unwrap();
        let st = &lab_up.0;
        // The source port `to` sees a datagram from `from`'s port 51820 arrive from.
        let seen = |from: &str, to: &str, addr: &str| -> String {
            let log = st.dir.join(format!("nc-{to}.log"));
            let f = std::fs::File::create(&log).unwrap();
            let mut listener = super::ns_cmd(&format!("{}-{to}", st.prefix), &["nc", "-u", "-l", "-v", "-n", "7000"])
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(f)
                .spawn()
                .unwrap();
            std::thread::sleep(std::time::Duration::from_millis(300));
            let mut send = super::ns_cmd(&format!("{}-{from}", st.prefix), &["nc", "-u", "-n", "-w", "1", "-p", "51820", addr, "7000"])
                .stdin(std::process::Stdio::piped())
                .spawn()
                .unwrap();
            std::io::Write::write_all(&mut send.stdin.take().unwrap(), b"trellis-lab\n").unwrap();
            send.wait().unwrap();
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
            let mut text = String::new();
            while !text.contains("received on ") && std::time::Instant::now() < deadline {
                std::thread::sleep(std::time::Duration::from_millis(20));
                text = std::fs::read_to_string(&log).unwrap();
            }
            let _ = listener.kill();
            let _ = listener.wait();
            // `Connection received on ADDRESS PORT`
            let source =
                text.lines().find_map(|l| l.split("received on ").nth(1)).unwrap_or_else(|| panic!("{to} saw nothing from {from}: {text}"));
            source.split_whitespace().nth(1).unwrap().to_string()
        };
        let (a, b) = ("198.51.100.10", "198.51.100.11");
        assert_eq!([seen("home-1", "a", a), seen("home-1", "b", b)], ["51820", "51820"], "an ordinary NAT keeps the port");
        let (to_a, to_b) = (seen("phone-1", "a", a), seen("phone-1", "b", b));
        assert_ne!(to_a, to_b, "a symmetric NAT gives each destination its own port");
        // home-1's two mappings, at least (the kernel may track more).
        assert!(super::rebind(&lab, st, "home", 1).unwrap() >= 2);
        let flushed = super::in_ns(&format!("{}-r1", st.prefix), &["conntrack", "-L", "-p", "udp"]).unwrap();
        assert!(!flushed.contains("dport=7000"), "the rebind forgot every mapping: {flushed}");
        let rebound = (super::REBOUND_PORT + 1).to_string();
        assert_eq!([seen("home-1", "a", a), seen("home-1", "b", b)], [rebound.clone(), rebound], "a rebound NAT maps to its new port");
        let err = super::rebind(&lab, st, "internet", 1).unwrap_err().to_string();
        assert_eq!(err, "net `internet` has no NAT router to rebind");
    }
}
