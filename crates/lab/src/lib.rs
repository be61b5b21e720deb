//! `trellis lab`: mesh topologies in network namespaces, with the real controller and agents.
//! Every address is one of the lab's own namespaces; every wait is bounded.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use ipnet::IpNet;
use serde::{Deserialize, Serialize};

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

/// What `up` made, so that `down` can remove it even after a failure.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct LabState {
    pub prefix: String,
    pub namespaces: Vec<String>,
    pub pids: Vec<u32>,
    pub dir: PathBuf,
    /// Per node: milliseconds from token redemption to the first packet over the overlay.
    pub first_packet_ms: BTreeMap<String, u64>,
    pub controller: String,
}

fn state_path(file: &Path) -> PathBuf {
    let name = file.file_stem().and_then(|s| s.to_str()).unwrap_or("lab");
    std::env::temp_dir().join(format!("trellis-lab-{name}.json"))
}

fn sh(args: &[&str]) -> Result<String> {
    let out = Command::new(args[0]).args(&args[1..]).output().with_context(|| format!("cannot run {}", args[0]))?;
    if !out.status.success() {
        bail!("`{}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).to_string())
}

fn ns_cmd(ns: &str, args: &[&str]) -> Command {
    let mut c = Command::new("ip");
    c.args(["netns", "exec", ns]).args(args);
    c
}

fn in_ns(ns: &str, args: &[&str]) -> Result<String> {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

fn progress(msg: &str) {
    eprintln!("lab: {msg}");
}

pub fn load(file: &Path) -> Result<(LabFile, PathBuf)> {
    let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
    let lab: LabFile = toml::from_str(&text).map_err(|e| anyhow::anyhow!("{}: {e}", file.display()))?;
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
            let n =
                lab.net.iter().find(|n| &n.name == net).with_context(|| {
                    format!("{}: host `{}` has an address on net `{net}`, which is not declared", file.display(), h.name)
                })?;
            let ip: IpAddr =
                addr.parse().with_context(|| format!("{}: host `{}`: {addr:?} is not an IP address", file.display(), h.name))?;
            let inside = [&n.ipv4, &n.ipv6].into_iter().flatten().any(|p| p.parse::<IpNet>().is_ok_and(|p| p.contains(&ip)));
            if !inside {
                bail!("{}: host `{}` address {addr} is not inside net `{net}`", file.display(), h.name);
            }
        }
    }
    for n in &lab.net {
        for target in [&n.nat, &n.firewall].into_iter().flatten() {
            if !lab.net.iter().any(|m| &m.name == target) {
                bail!("{}: net `{}` routes to `{target}`, which is not declared", file.display(), n.name);
            }
        }
    }
    Ok((lab, decl))
}

/// Endpoint addresses in the declaration must be lab host addresses of the same node.
fn check_endpoints(lab: &LabFile, decl: &trellis_core::Declaration) -> Result<()> {
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

/// The address a router takes on a net: counted down from the top of its range.
fn router_addr(net: &str, index: u32, lab: &LabFile, v6: bool) -> Option<String> {
    let n = lab.net.iter().find(|n| n.name == net)?;
    let p: IpNet = if v6 { n.ipv6.as_ref()?.parse().ok()? } else { n.ipv4.as_ref()?.parse().ok()? };
    Some(match p {
        IpNet::V4(p) => std::net::Ipv4Addr::from(u32::from(p.broadcast()) - 1 - index).to_string(),
        IpNet::V6(p) => std::net::Ipv6Addr::from(u128::from(p.broadcast()) - 1 - index as u128).to_string(),
    })
}

fn prefix_len(net: &Net, v6: bool) -> Option<u8> {
    let p: IpNet = if v6 { net.ipv6.as_ref()?.parse().ok()? } else { net.ipv4.as_ref()?.parse().ok()? };
    Some(p.prefix_len())
}

fn exe(name: &str) -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    let p = me.parent().context("no directory for the trellis binary")?.join(name);
    if !p.exists() {
        bail!("{} not found next to {}; build both binaries", p.display(), me.display());
    }
    Ok(p)
}

pub fn up(file: &Path) -> Result<LabState> {
    if !std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
    {
        bail!("the lab needs root: it makes network namespaces");
    }
    let (lab, decl_dir) = load(file)?;
    let loaded = crate::declfs::read(&decl_dir)?;
    let Some(decl) = loaded.declaration else {
        for d in &loaded.diagnostics {
            eprintln!("{d}");
        }
        bail!("{} is not a valid declaration", decl_dir.display());
    };
    check_endpoints(&lab, &decl)?;
    let sp = state_path(file);
    if sp.exists() {
        bail!("a lab from {} is already up; run `trellis lab down {}` first", file.display(), file.display());
    }
    let prefix = format!("tl{:04x}", rand_u16());
    let dir = std::env::temp_dir().join(format!("trellis-lab-{prefix}"));
    std::fs::create_dir_all(&dir)?;
    let mut st = LabState { prefix: prefix.clone(), dir: dir.clone(), ..Default::default() };
    let result = build(&lab, &decl_dir, &decl, &mut st);
    std::fs::write(&sp, serde_json::to_vec_pretty(&st)?)?;
    result.map(|_| st)
}

fn rand_u16() -> u16 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    ((t ^ std::process::id()) & 0xffff) as u16
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

fn build(lab: &LabFile, decl_dir: &Path, decl: &trellis_core::Declaration, st: &mut LabState) -> Result<()> {
    let started = Instant::now();
    progress(&format!("building {} ({} nets, {} hosts) as {}-*", lab.lab.name, lab.net.len(), lab.host.len(), st.prefix));
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
            let n = lab.net.iter().find(|x| &x.name == net).expect("checked");
            let v6 = addr.contains(':');
            let len = prefix_len(n, v6).context("address family not in net")?;
            add_addr(&ns, &format!("{addr}/{len}"), &ifname)?;
        }
        host_ns.insert(h.name.clone(), ns);
    }
    // Routers: a NAT or firewall router between a net and the net it reaches.
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
            let tnet = lab.net.iter().find(|x| &x.name == target).expect("checked");
            let (il, ol) = (prefix_len(n, v6).expect("family"), prefix_len(tnet, v6).expect("family"));
            let fam = if v6 { "-6" } else { "-4" };
            add_addr(&ns, &format!("{inside}/{il}"), "inside")?;
            add_addr(&ns, &format!("{outside}/{ol}"), "outside")?;
            // Hosts inside send everything else to the router.
            for h in lab.host.iter().filter(|h| h.addresses.get(&n.name).is_some_and(|a| a.contains(':') == v6)) {
                in_ns(&host_ns[&h.name], &["ip", fam, "route", "add", "default", "via", &inside])?;
            }
            if !masquerade {
                // Routed: hosts outside know the way in (and are stopped by the firewall).
                let net_prefix = if v6 { n.ipv6.clone() } else { n.ipv4.clone() }.expect("family");
                for h in lab.host.iter().filter(|h| h.addresses.get(target).is_some_and(|a| a.contains(':') == v6)) {
                    in_ns(&host_ns[&h.name], &["ip", fam, "route", "add", &net_prefix, "via", &outside])?;
                }
            }
        }
        in_ns(&ns, &["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])?;
        in_ns(&ns, &["sysctl", "-q", "-w", "net.ipv6.conf.all.forwarding=1"])?;
        let nat = if masquerade {
            "\tchain postrouting {\n\t\ttype nat hook postrouting priority srcnat;\n\t\toifname \"outside\" masquerade\n\t}\n"
        } else {
            ""
        };
        // Routed or masqueraded, only connections started inside pass: new ones from outside drop.
        let rules = format!(
            "table inet lab {{\n{nat}\tchain forward {{\n\t\ttype filter hook forward priority filter; policy drop;\n\t\tct state established,related accept\n\t\tiifname \"inside\" accept\n\t}}\n}}\n"
        );
        let path = st.dir.join(format!("router-{ri}.nft"));
        std::fs::write(&path, rules)?;
        in_ns(&ns, &["nft", "-f", path.to_str().context("path")?])?;
    }
    progress(&format!("network ready ({:.1}s)", started.elapsed().as_secs_f64()));

    // The controller.
    let ctl = lab.host.iter().find(|h| h.role.as_deref() == Some("controller")).expect("checked");
    let ctl_ns = &host_ns[&ctl.name];
    let ctl_addr = ctl.addresses.values().next().context("the controller host has no address")?;
    let advertise = if ctl_addr.contains(':') { format!("[{ctl_addr}]:8443") } else { format!("{ctl_addr}:8443") };
    st.controller = advertise.clone();
    let trellis = exe("trellis")?;
    let agent = exe("trellis-agent")?;
    let state = st.dir.join("controller");
    let t = trellis.to_str().context("path")?;
    in_ns(ctl_ns, &[t, "init", "--state-dir", state.to_str().context("path")?, "--advertise", &advertise])?;
    let log = std::fs::File::create(st.dir.join("serve.log"))?;
    let serve = ns_cmd(ctl_ns, &[t, "serve", "--state-dir", state.to_str().context("path")?]).stdout(Stdio::null()).stderr(log).spawn()?;
    st.pids.push(serve.id());
    let deadline = Instant::now() + Duration::from_secs(30);
    let (host, port) = trellis_controller::state::split_host_port(&advertise)?;
    while !ns_cmd(ctl_ns, &["nc", "-z", "-w", "1", &host, &port.to_string()]).status().is_ok_and(|s| s.success()) {
        if Instant::now() > deadline {
            bail!("the controller did not start; see {}", st.dir.join("serve.log").display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    in_ns(ctl_ns, &[t, "apply", decl_dir.to_str().context("path")?, "--state-dir", state.to_str().context("path")?])?;
    progress(&format!("controller up at {advertise}, declaration applied ({:.1}s)", started.elapsed().as_secs_f64()));

    // The nodes: token, enrolment and agent, each in its own namespace.
    let a = agent.to_str().context("path")?;
    let mut redeemed: HashMap<String, Instant> = HashMap::new();
    for node in &decl.nodes {
        if node.public_key.is_some() {
            continue;
        }
        let ns = &host_ns[&node.name];
        let token = in_ns(ctl_ns, &[t, "token", "create", &node.name, "--state-dir", state.to_str().context("path")?])?.trim().to_string();
        let sdir = st.dir.join(format!("agent-{}", node.name));
        let root = st.dir.join(format!("root-{}", node.name));
        redeemed.insert(node.name.clone(), Instant::now());
        in_ns(ns, &[a, "enrol", &token, "--state-dir", sdir.to_str().context("path")?])?;
        let cmd = format!(
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard && exec {a} run --state-dir {} --root {} --wireguard auto --max-backoff 2",
            sdir.display(),
            root.display()
        );
        let log = std::fs::File::create(st.dir.join(format!("agent-{}.log", node.name)))?;
        let child = ns_cmd(ns, &["unshare", "-m", "sh", "-c", &cmd]).stdout(Stdio::null()).stderr(log).spawn()?;
        st.pids.push(child.id());
        progress(&format!("{} enrolled, agent running", node.name));
    }
    converge(ctl_ns, t, &state, Duration::from_secs(90))?;
    progress(&format!("every node holds its bundle ({:.1}s)", started.elapsed().as_secs_f64()));
    // First packet over the overlay: every node at once pings a peer it dials itself.
    let mut probes = Vec::new();
    for node in decl.nodes.iter().filter(|n| n.public_key.is_none()) {
        let conf = std::fs::read_to_string(st.dir.join(format!("root-{}/etc/trellis/wireguard.conf", node.name))).unwrap_or_default();
        let mut target = None;
        for block in conf.split("[Peer]").skip(1) {
            if block.contains("Endpoint = ") {
                target = block
                    .lines()
                    .filter_map(|l| l.strip_prefix("AllowedIPs = "))
                    .next()
                    .and_then(|l| l.split(", ").next())
                    .map(|a| a.split('/').next().unwrap_or_default().to_string());
                break;
            }
        }
        let Some(target) = target else { continue };
        let (ns, since, name) = (host_ns[&node.name].clone(), redeemed[&node.name], node.name.clone());
        probes.push(std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(30);
            while Instant::now() < deadline {
                if ns_cmd(&ns, &["ping", "-c", "1", "-W", "1", &target])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
                {
                    return Some((name, since.elapsed().as_millis() as u64));
                }
            }
            None
        }));
    }
    for p in probes {
        if let Ok(Some((name, ms))) = p.join() {
            st.first_packet_ms.insert(name, ms);
        }
    }
    progress(&format!("up in {:.1}s", started.elapsed().as_secs_f64()));
    Ok(())
}

fn converge(ctl_ns: &str, t: &str, state: &Path, limit: Duration) -> Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        let text = in_ns(ctl_ns, &[t, "status", "--json", "--state-dir", state.to_str().context("path")?])?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let pending: Vec<String> = v
            .as_array()
            .context("status")?
            .iter()
            .filter(|n| n["state"] == "active" && n["desired_version"] != n["applied_version"])
            .map(|n| n["name"].as_str().unwrap_or_default().to_string())
            .collect();
        let active = v.as_array().context("status")?.iter().filter(|n| n["state"] == "active").count();
        if pending.is_empty() && active > 0 {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("nodes did not converge: {}", pending.join(", "));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Overlay addresses by node, read from a node's zone file.
fn overlay_addresses(dir: &Path, decl: &trellis_core::Declaration) -> HashMap<String, Vec<IpAddr>> {
    let mut out: HashMap<String, Vec<IpAddr>> = HashMap::new();
    let Some(node) = decl.nodes.iter().find(|n| n.public_key.is_none()) else { return out };
    let zone = std::fs::read_to_string(dir.join(format!("root-{}/etc/trellis/mesh.zone", node.name))).unwrap_or_default();
    for line in zone.lines() {
        let parts: Vec<&str> = line.split('\t').collect();
        if parts.len() == 4 && (parts[2] == "A" || parts[2] == "AAAA") {
            if let Ok(ip) = parts[3].parse() {
                out.entry(parts[0].to_string()).or_default().push(ip);
            }
        }
    }
    out
}

pub fn check(file: &Path) -> Result<bool> {
    let (lab, decl_dir) = load(file)?;
    let st: LabState = serde_json::from_slice(
        &std::fs::read(state_path(file))
            .with_context(|| format!("no lab from {} is up; run `trellis lab up {}`", file.display(), file.display()))?,
    )?;
    let decl = crate::declfs::read(&decl_dir)?.declaration.context("declaration")?;
    let addrs = overlay_addresses(&st.dir, &decl);
    let ns = |host: &str| format!("{}-{host}", st.prefix);
    let mut rows = Vec::new();
    let mut failures = 0;
    for (i, e) in lab.expect.iter().enumerate() {
        let (what, expected, seen) = if let Some(name) = &e.dns {
            let server = addrs.get(&e.from).and_then(|a| a.first()).context("from-node has no overlay address")?.to_string();
            let want_v6 = server.contains(':');
            let mut want: Vec<String> = e
                .answer
                .clone()
                .unwrap_or_default()
                .iter()
                .flat_map(|n| addrs.get(n).cloned().unwrap_or_default())
                .filter(|ip| ip.is_ipv6() == want_v6)
                .map(|ip| ip.to_string())
                .collect();
            want.sort();
            let out = ns_cmd(
                &ns(&e.from),
                &["dig", "+short", "+time=2", "+tries=2", &format!("@{server}"), name, if want_v6 { "AAAA" } else { "A" }],
            )
            .output()?;
            let mut got: Vec<String> = String::from_utf8_lossy(&out.stdout).lines().map(str::to_string).collect();
            got.sort();
            (format!("dns {name}"), want.join(" "), got.join(" "))
        } else {
            let to = e.to.as_deref().context("an expectation needs `to` or `dns`")?;
            let proto = e.proto.as_deref().unwrap_or("tcp");
            let dst = addrs
                .get(to)
                .and_then(|a| a.iter().find(|ip| ip.is_ipv4()).or(a.first()))
                .context("to-node has no overlay address")?
                .to_string();
            let expected = e.result.clone().unwrap_or_else(|| "open".into());
            let open = match proto {
                "icmp" => ns_cmd(&ns(&e.from), &["ping", "-c", "1", "-W", "2", &dst]).stdout(Stdio::null()).status()?.success(),
                "tcp" | "udp" => {
                    let port = e.port.context("tcp and udp expectations need a port")?.to_string();
                    let mark = st.dir.join(format!("udp-{i}.out"));
                    let listener = if proto == "tcp" {
                        ns_cmd(&ns(to), &["nc", "-l", "-k", &port])
                            .stdin(Stdio::null())
                            .stdout(Stdio::null())
                            .stderr(Stdio::null())
                            .spawn()?
                    } else {
                        let f = std::fs::File::create(&mark)?;
                        ns_cmd(&ns(to), &["nc", "-u", "-l", "-k", &port]).stdin(Stdio::null()).stdout(f).stderr(Stdio::null()).spawn()?
                    };
                    std::thread::sleep(Duration::from_millis(300));
                    let ok = if proto == "tcp" {
                        ns_cmd(&ns(&e.from), &["nc", "-z", "-n", "-w", "2", &dst, &port]).status()?.success()
                    } else {
                        let mut c = ns_cmd(&ns(&e.from), &["nc", "-u", "-n", "-w", "1", &dst, &port])
                            .stdin(Stdio::piped())
                            .stdout(Stdio::null())
                            .spawn()?;
                        if let Some(mut stdin) = c.stdin.take() {
                            use std::io::Write;
                            let _ = stdin.write_all(b"trellis-lab\n");
                        }
                        let _ = c.wait();
                        std::thread::sleep(Duration::from_millis(300));
                        std::fs::read_to_string(&mark).unwrap_or_default().contains("trellis-lab")
                    };
                    let mut l = listener;
                    let _ = l.kill();
                    let _ = l.wait();
                    ok
                }
                other => bail!("expectation {}: proto {other:?} must be tcp, udp or icmp", i + 1),
            };
            let port = e.port.map(|p| format!(" {p}")).unwrap_or_default();
            (format!("{proto}{port} -> {to}"), expected, if open { "open".into() } else { "closed".into() })
        };
        let ok = expected == seen;
        if !ok {
            failures += 1;
        }
        rows.push((e.from.clone(), what, expected, seen, ok));
    }
    println!("{:<12} {:<34} {:<28} {:<28} OK", "FROM", "CHECK", "EXPECTED", "SEEN");
    for (from, what, expected, seen, ok) in &rows {
        println!("{:<12} {:<34} {:<28} {:<28} {}", from, what, expected, seen, if *ok { "yes" } else { "NO" });
    }
    for (node, ms) in &st.first_packet_ms {
        println!("token redeemed -> first packet over the overlay: {node} {ms} ms");
    }
    // Re-apply convergence: a node more in the declaration changes every node's zone.
    let ctl = lab.host.iter().find(|h| h.role.as_deref() == Some("controller")).expect("checked");
    let t = exe("trellis")?;
    let t = t.to_str().context("path")?;
    let state = st.dir.join("controller");
    let changed = st.dir.join("reapply");
    let _ = std::fs::remove_dir_all(&changed);
    std::fs::create_dir_all(changed.join("modules"))?;
    let mesh = std::fs::read_to_string(decl_dir.join("mesh.toml"))?;
    std::fs::write(changed.join("mesh.toml"), format!("{mesh}\n[[node]]\nname = \"lab-probe\"\n"))?;
    if let Ok(entries) = std::fs::read_dir(decl_dir.join("modules")) {
        for e in entries.flatten() {
            std::fs::copy(e.path(), changed.join("modules").join(e.file_name()))?;
        }
    }
    let t0 = Instant::now();
    in_ns(&ns(&ctl.name), &[t, "apply", changed.to_str().context("path")?, "--state-dir", state.to_str().context("path")?])?;
    converge(&ns(&ctl.name), t, &state, Duration::from_secs(60))?;
    println!("re-apply -> every node converged: {} ms", t0.elapsed().as_millis());
    in_ns(&ns(&ctl.name), &[t, "apply", decl_dir.to_str().context("path")?, "--state-dir", state.to_str().context("path")?])?;
    converge(&ns(&ctl.name), t, &state, Duration::from_secs(60))?;
    println!("{} of {} expectations met", rows.len() - failures, rows.len());
    Ok(failures == 0)
}

pub fn down(file: &Path) -> Result<()> {
    let sp = state_path(file);
    let Ok(bytes) = std::fs::read(&sp) else {
        progress(&format!("nothing to take down for {}", file.display()));
        return Ok(());
    };
    let st: LabState = serde_json::from_slice(&bytes)?;
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
    std::thread::sleep(Duration::from_millis(200));
    for ns in st.namespaces.iter().rev() {
        let _ = Command::new("ip").args(["netns", "del", ns]).output();
    }
    let _ = std::fs::remove_dir_all(&st.dir);
    std::fs::remove_file(&sp)?;
    progress(&format!("removed {} namespaces and their processes", st.namespaces.len()));
    Ok(())
}

pub fn run(file: &Path) -> Result<ExitCode> {
    let started = Instant::now();
    let f = file.to_path_buf();
    let _ = ctrlc::set_handler(move || {
        let _ = down(&f);
        std::process::exit(130);
    });
    let result = up(file).and_then(|_| check(file));
    let cleaned = down(file);
    let ok = result?;
    cleaned?;
    println!("lab run of {} took {:.1}s", file.display(), started.elapsed().as_secs_f64());
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
