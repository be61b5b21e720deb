//! The expectation matrix: every `[[expect]]` (tcp, udp, icmp open or closed; DNS answers;
//! iperf3 throughput through the overlay next to the underlay; TLS handshakes that verify a
//! service certificate's name) run between the lab's namespaces,
//! expected next to seen.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::file::{Expect, LabFile, Outcome, Proto};
use crate::net::ns_cmd;
use crate::LabState;

/// One line of the matrix.
pub struct Row {
    pub from: String,
    pub what: String,
    pub expected: String,
    pub seen: String,
    /// Printed after the verdict: the figures of a throughput run.
    pub note: String,
}

impl Row {
    pub fn ok(&self) -> bool {
        self.expected == self.seen
    }
}

/// Overlay addresses by name (nodes, and modules with the nodes that run them), read with the
/// core's zone reader from the `mesh.zone` of every node the lab enrolled (`agents`: the pools'
/// members among them). Each zone holds only
/// what its node may reach, but every node's zone holds its own name, so together they name every
/// node; a module's addresses are those of all its runners any node may reach. Empty when no
/// node has a zone file yet.
pub(crate) fn overlay_addresses(dir: &Path, decl: &trellis_core::Declaration, agents: &[String]) -> Result<HashMap<String, Vec<IpAddr>>> {
    let mut out: HashMap<String, Vec<IpAddr>> = HashMap::new();
    // The declared nodes, and the pools' members the lab runs (named as their hosts).
    let declared = decl.nodes.iter().filter(|n| n.public_key.is_none()).map(|n| n.name.as_str());
    let mut names: Vec<&str> = declared.chain(agents.iter().map(String::as_str)).collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        let path = dir.join(format!("root-{name}/{}", trellis_core::compile::MESH_ZONE));
        let Ok(mut text) = std::fs::read_to_string(&path) else { continue };
        // A zone in parts is `mesh.zone` and its parts, one after the other (ADR 0043).
        for i in 0..trellis_core::plan::WIREGUARD_PARTS {
            if let Ok(part) = std::fs::read_to_string(dir.join(format!("root-{name}/{}", trellis_core::plan::zone_part(i)))) {
                text.push_str(&part);
            }
        }
        let zone = trellis_core::zone::parse(&text).with_context(|| format!("cannot read the zone in {}", path.display()))?;
        for (name, addrs) in zone.addresses() {
            let known = out.entry(name.to_string()).or_default();
            for a in addrs {
                if !known.contains(&a) {
                    known.push(a);
                }
            }
        }
    }
    Ok(out)
}

/// How many rows of a round run at once.
const AT_ONCE: usize = 8;

/// Runs every expectation of a round and returns their rows in order. Rows run up to eight at
/// once, since a row expecting `closed` waits out its timeout and a fleet's sample has many: in
/// waves where no two rows listen on the same host, protocol and port; an iperf3 run goes alone,
/// so that nothing else shares the machine while it measures; path rows go first, by themselves. `hubs` are the declaration's hubs,
/// whose peer entries a path row tells apart.
pub(crate) fn run_round(
    expects: &[Expect],
    lab: &LabFile,
    addrs: &HashMap<String, Vec<IpAddr>>,
    underlay: &Underlay,
    hubs: &[String],
    st: &LabState,
) -> Result<Vec<Row>> {
    let one = |i: usize| match expects[i].proto {
        Some(Proto::Throughput) => throughput(&expects[i], lab, addrs, st),
        Some(Proto::Path) => crate::path::check(&expects[i], addrs, hubs, st),
        _ => run(i, &expects[i], lab, addrs, underlay, st),
    };
    let alone = |i: usize| expects[i].proto == Some(Proto::Throughput);
    let path = |i: usize| expects[i].proto == Some(Proto::Path);
    let mut rows: Vec<Option<Row>> = (0..expects.len()).map(|_| None).collect();
    // Path rows wait for the mesh to settle (a pair punching through, or coming back after a
    // rebind): they go first, in waves of their own, so the rows after them see the settled paths.
    let mut left: Vec<usize> = (0..expects.len()).collect();
    left.sort_by_key(|&i| !path(i));
    while !left.is_empty() {
        let mut wave: Vec<usize> = Vec::new();
        let mut listening: Vec<(&str, bool, u16)> = Vec::new();
        left.retain(|&i| {
            let full =
                wave.len() >= AT_ONCE || wave.first().is_some_and(|&w| alone(w) || path(w) != path(i)) || (alone(i) && !wave.is_empty());
            let key = listener(&expects[i]);
            if full || key.is_some_and(|k| listening.contains(&k)) {
                return true;
            }
            listening.extend(key);
            wave.push(i);
            false
        });
        let done: Vec<(usize, Result<Row>)> = std::thread::scope(|s| {
            let running: Vec<_> = wave.iter().map(|&i| (i, s.spawn(move || one(i)))).collect();
            running
                .into_iter()
                .map(|(i, h)| (i, h.join().unwrap_or_else(|_| Err(anyhow::anyhow!("expectation {}: its check panicked", i + 1)))))
                .collect()
        });
        for (i, row) in done {
            rows[i] = Some(row?);
        }
    }
    Ok(rows.into_iter().map(|r| r.expect("every row ran in a wave")).collect())
}

/// What a row listens on while it runs: its target, whether on UDP, and its port. Tcp, tls
/// and throughput rows start a TCP listener there, udp rows a UDP one; ping, DNS and HTTPS rows
/// start none.
fn listener(e: &Expect) -> Option<(&str, bool, u16)> {
    if e.dns.is_some() {
        return None;
    }
    let udp = match e.proto.unwrap_or_default() {
        Proto::Tcp | Proto::Tls | Proto::Throughput => false,
        Proto::Udp => true,
        Proto::Icmp | Proto::Https | Proto::Path => return None,
    };
    Some((e.to.as_deref()?, udp, e.port?))
}

/// Runs expectation `i` and returns its row.
/// `underlay` holds every lab host's lab addresses: an outside host is reached at them, and a
/// `via` node's are where a connection must come from.
fn run(i: usize, e: &Expect, lab: &LabFile, addrs: &HashMap<String, Vec<IpAddr>>, underlay: &Underlay, st: &LabState) -> Result<Row> {
    let Some(name) = &e.dns else { return traffic(i, e, lab, addrs, underlay, st) };
    let (what, expected, seen) = dns(e, name, addrs, st)?;
    Ok(Row { from: e.from.clone(), what, expected, seen, note: String::new() })
}

pub(crate) fn ns(st: &LabState, host: &str) -> String {
    format!("{}-{host}", st.prefix)
}

/// Asks the from-node's own resolver (on its first overlay address) for `name`, in the family of
/// that address; expects the addresses of the nodes in `answer`.
fn dns(e: &Expect, name: &str, addrs: &HashMap<String, Vec<IpAddr>>, st: &LabState) -> Result<(String, String, String)> {
    // The from-node's own resolver, or the one of the node `to` names (asked from outside it).
    let asked = e.to.as_deref().unwrap_or(&e.from);
    let server = addrs.get(asked).and_then(|a| a.first()).with_context(|| format!("`{asked}` has no overlay address to ask"))?.to_string();
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
    let nxdomain = e.result == Some(Outcome::Nxdomain);
    let closed = e.result == Some(Outcome::Closed);
    if want.is_empty() && !nxdomain && !closed {
        // Expected and seen would both be empty, and the check could not fail.
        bail!("expectation dns {name}: none of {:?} has an address in the family the resolver of `{}` is asked in", e.answer, e.from);
    }
    let out = ns_cmd(
        &ns(st, &e.from),
        &["dig", "+noall", "+answer", "+comments", "+time=2", "+tries=2", &format!("@{server}"), name, if want_v6 { "AAAA" } else { "A" }],
    )
    .output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let at = if asked == e.from { String::new() } else { format!(" at {asked}") };
    if closed {
        // No answer of any kind: the resolver cannot be reached from `from` (dig's status 9, no
        // reply). Any other failure of dig is no answer about the resolver.
        if !matches!(out.status.code(), Some(0) | Some(9)) {
            bail!("expectation dns {name}{at}: dig failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
        }
        let status = text.lines().find_map(|l| l.split("status: ").nth(1)).map(|s| s.split(',').next().unwrap_or("").to_string());
        return Ok((format!("dns {name}{at}"), "closed".into(), status.map_or_else(|| "closed".into(), |s| format!("answered {s}"))));
    }
    if nxdomain {
        let status = text.lines().find_map(|l| l.split("status: ").nth(1)).map(|s| s.split(',').next().unwrap_or("").to_string());
        return Ok((format!("dns {name}{at}"), "NXDOMAIN".into(), status.unwrap_or_else(|| "no answer".into())));
    }
    let mut got: Vec<String> = text
        .lines()
        .filter(|l| !l.starts_with(';') && !l.trim().is_empty())
        .filter_map(|l| l.split_whitespace().last().map(str::to_string))
        .collect();
    got.sort();
    Ok((format!("dns {name}{at}"), want.join(" "), got.join(" ")))
}

/// The lab hosts' own addresses, and which hosts are outside the mesh.
#[derive(Default)]
pub(crate) struct Underlay {
    pub addresses: HashMap<String, Vec<IpAddr>>,
    pub outside: Vec<String>,
}

/// Sends tcp, udp or icmp from the from-node to the to-node's overlay address (IPv4 first), or to
/// an outside host's lab address, and reports whether it arrived; with `via`, also whether it
/// arrived from that node's lab address.
fn traffic(i: usize, e: &Expect, lab: &LabFile, addrs: &HashMap<String, Vec<IpAddr>>, underlay: &Underlay, st: &LabState) -> Result<Row> {
    let to = e.to.as_deref().context("an expectation needs `to` or `dns`")?;
    let proto = e.proto.unwrap_or_default();
    if proto == Proto::Https {
        let (what, expected, seen) = https(e, to, lab, st)?;
        return Ok(Row { from: e.from.clone(), what, expected, seen, note: String::new() });
    }
    let first = |a: &Vec<IpAddr>| a.iter().find(|ip| ip.is_ipv4()).or(a.first()).map(|ip| ip.to_string());
    let dst = if underlay.outside.iter().any(|o| o == to) {
        underlay.addresses.get(to).and_then(first).context("outside host has no lab address")?
    } else {
        addrs.get(to).and_then(first).context("to-node has no overlay address")?
    };
    let mut expected = e.result.unwrap_or(Outcome::Open).as_str().to_string();
    let via = match &e.via {
        Some(v) => {
            if proto != Proto::Tcp {
                bail!("expectation {}: `via` is checked on tcp only", i + 1);
            }
            expected = format!("{expected} via {v}");
            Some(underlay.addresses.get(v).with_context(|| format!("expectation {}: `via` names `{v}`, which is no lab host", i + 1))?)
        }
        None => None,
    };
    let log = st.dir.join(format!("tcp-{i}.log"));
    let (from_ns, to_ns) = (ns(st, &e.from), ns(st, to));
    if proto == Proto::Tls {
        return tls(e, to, &dst, st);
    }
    let open = match proto {
        Proto::Icmp => ping(&from_ns, &dst, 2)?,
        Proto::Tcp | Proto::Udp => {
            let port = e.port.context("tcp and udp expectations need a port")?.to_string();
            let mark = st.dir.join(format!("udp-{i}.out"));
            let listener = if proto == Proto::Tcp {
                // Verbose: the listener says where each connection came from.
                let f = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
                ns_cmd(&to_ns, &["nc", "-v", "-n", "-l", "-k", &port]).stdin(Stdio::null()).stdout(Stdio::null()).stderr(f).spawn()?
            } else {
                let f = std::fs::File::create(&mark).with_context(|| format!("cannot create {}", mark.display()))?;
                ns_cmd(&to_ns, &["nc", "-u", "-l", "-k", &port]).stdin(Stdio::null()).stdout(f).stderr(Stdio::null()).spawn()?
            };
            std::thread::sleep(Duration::from_millis(300));
            let ok = if proto == Proto::Tcp {
                ns_cmd(&from_ns, &["nc", "-z", "-n", "-w", "2", &dst, &port]).status()?.success()
            } else {
                let mut c =
                    ns_cmd(&from_ns, &["nc", "-u", "-n", "-w", "1", &dst, &port]).stdin(Stdio::piped()).stdout(Stdio::null()).spawn()?;
                if let Some(mut stdin) = c.stdin.take() {
                    use std::io::Write;
                    let _ = stdin.write_all(b"trellis-lab\n");
                }
                let _ = c.wait();
                std::thread::sleep(Duration::from_millis(300));
                std::fs::read_to_string(&mark).unwrap_or_default().contains("trellis-lab")
            };
            if ok && via.is_some() {
                // The listener says where the connection came from once it has accepted it.
                let deadline = std::time::Instant::now() + Duration::from_secs(2);
                while !std::fs::read_to_string(&log).unwrap_or_default().contains("received on ") && std::time::Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
            let mut l = listener;
            let _ = l.kill();
            let _ = l.wait();
            ok
        }
        Proto::Throughput | Proto::Path => bail!("expectation {}: proto \"{proto}\" is checked by its own function, not sent", i + 1),
        Proto::Tls | Proto::Https => unreachable!("handled above"),
    };
    let port = e.port.map(|p| format!(" {p}")).unwrap_or_default();
    let mut seen = if open { "open".to_string() } else { "closed".to_string() };
    if let (Some(addrs), true) = (via, open) {
        // `Connection received on ADDRESS PORT`: the source the target saw.
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let source = text.lines().find_map(|l| l.split("received on ").nth(1)).and_then(|r| r.split_whitespace().next()).unwrap_or("?");
        let v = e.via.as_deref().unwrap_or_default();
        seen = if addrs.iter().any(|a| a.to_string() == source) { format!("open via {v}") } else { format!("open from {source}") };
    }
    Ok(Row { from: e.from.clone(), what: format!("{proto}{port} -> {to}"), expected, seen, note: String::new() })
}

/// One ping from namespace `from_ns` to `dst`, waiting at most `secs` seconds: whether it was
/// answered.
pub(crate) fn ping(from_ns: &str, dst: &str, secs: u32) -> Result<bool> {
    let status = ns_cmd(from_ns, &["ping", "-c", "1", "-W", &secs.to_string(), dst]).stdout(Stdio::null()).stderr(Stdio::null()).status();
    Ok(status.context("cannot run ping")?.success())
}

/// A TLS handshake from the from-node to `dst` (the to-node's overlay address) on the
/// expectation's port, verifying `name` against the mesh CA the from-node holds, as a client
/// with `sslmode=verify-full` does (`openssl s_client -verify_hostname NAME
/// -verify_return_error`). The to-node serves with the files its agent wrote for the module
/// `name` names (else the first it holds). `closed` when no connection is admitted, `refused`
/// when the handshake does not verify, `open` when it does, the note naming the serial served
/// (a renewal step shows the new one).
fn tls(e: &Expect, to: &str, dst: &str, st: &LabState) -> Result<Row> {
    let name = e.name.as_deref().context("a tls expectation needs `name`")?;
    let port = e.port.context("a tls expectation needs a port")?.to_string();
    let certs = st.dir.join(format!("root-{to}/{}", trellis_core::certs::CERTS_DIR));
    let module = name.split('.').next().unwrap_or_default();
    // The agent writes its certificates right after the bundle that brought the module.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let dir = loop {
        let wanted = certs.join(module);
        let found = if wanted.join("cert.pem").exists() {
            Some(wanted)
        } else {
            let mut dirs: Vec<_> = std::fs::read_dir(&certs)
                .into_iter()
                .flatten()
                .flatten()
                .map(|d| d.path())
                .filter(|d| d.join("cert.pem").exists())
                .collect();
            dirs.sort();
            dirs.into_iter().next()
        };
        match found {
            Some(d) => break d,
            None if std::time::Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            None => bail!(
                "tls {name} -> {to}: `{to}` holds no service certificate in {} (does a module it runs have [module.certificate]?)",
                certs.display()
            ),
        }
    };
    let file = |f: &str| dir.join(f).to_string_lossy().into_owned();
    // Read before the server starts: what it serves, unless the agent renews in between.
    let serial = std::fs::read_to_string(dir.join("cert.pem"))
        .ok()
        .and_then(|pem| trellis_pki::services::inspect_service(&pem).ok())
        .map(|c| c.serial)
        .unwrap_or_default();
    let mut server = ns_cmd(
        &ns(st, to),
        &[
            "openssl",
            "s_server",
            "-quiet",
            "-accept",
            &port,
            "-cert",
            &file("cert.pem"),
            "-key",
            &file("key.pem"),
            "-cert_chain",
            &file("chain.pem"),
        ],
    )
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .context("cannot run openssl s_server")?;
    std::thread::sleep(Duration::from_millis(400));
    let from_ns = ns(st, &e.from);
    let reached = ns_cmd(&from_ns, &["nc", "-z", "-n", "-w", "2", dst, &port]).status()?.success();
    let seen = if !reached {
        "closed"
    } else {
        let ca = st.dir.join(format!("root-{}/etc/trellis/ca.pem", e.from));
        let connect = if dst.contains(':') { format!("[{dst}]:{port}") } else { format!("{dst}:{port}") };
        let out = ns_cmd(
            &from_ns,
            &[
                "timeout",
                "10",
                "openssl",
                "s_client",
                "-connect",
                &connect,
                "-servername",
                name,
                "-verify_hostname",
                name,
                "-verify_return_error",
                "-CAfile",
                &ca.to_string_lossy(),
            ],
        )
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()
        .context("cannot run openssl s_client")?;
        let verified = out.status.success() && String::from_utf8_lossy(&out.stdout).contains("Verify return code: 0 (ok)");
        if verified {
            "open"
        } else {
            "refused"
        }
    };
    let _ = server.kill();
    let _ = server.wait();
    let expected = e.result.unwrap_or(Outcome::Open).as_str().to_string();
    let note = if seen == "open" { format!("serial {}", &serial[..serial.len().min(12)]) } else { String::new() };
    Ok(Row { from: e.from.clone(), what: format!("tls {port} {name} -> {to}"), expected, seen: seen.to_string(), note })
}

/// How many requests an HTTPS expectation sends: every answer must come from `answered_by`.
const HTTPS_REQUESTS: usize = 4;

/// What one HTTPS request to an edge came to.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Served {
    /// Answered 2xx, with the body (the runner's host name).
    Answered(String),
    /// Answered 403: the edge's allow-list.
    Refused,
    /// No connection, a certificate that does not verify for the name, or no router for it (404).
    Closed(String),
    /// Another answer (502/503: no backend).
    Other(String),
}

/// One HTTPS request from namespace `from_ns` for `host` to `addr:port`, verifying the
/// certificate against the lab's ACME root (never skipped), with curl, bounded in time.
pub(crate) fn https_once(st: &LabState, from_ns: &str, host: &str, addr: &str, port: u16) -> Result<Served> {
    https_within(st, from_ns, host, addr, port, 5)
}

/// As `https_once`, each request given at most `secs` seconds.
pub(crate) fn https_within(st: &LabState, from_ns: &str, host: &str, addr: &str, port: u16, secs: u32) -> Result<Served> {
    let root = st.dir.join("acme-root.pem");
    if !root.exists() {
        bail!("https to {host}: the lab has no ACME root ({} is missing): is there a host with role = \"acme\"?", root.display());
    }
    let url = format!("https://{host}:{port}/");
    let resolve = format!("{host}:{port}:{addr}");
    let out = ns_cmd(
        from_ns,
        &[
            "curl",
            "-s",
            "--max-time",
            &secs.to_string(),
            "--cacert",
            &root.to_string_lossy(),
            "--resolve",
            &resolve,
            "-w",
            "\n%{http_code}",
            &url,
        ],
    )
    .stdin(Stdio::null())
    .output()
    .context("cannot run curl")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", text.as_str()));
    Ok(match (out.status.code(), code) {
        (Some(0), c) if c.starts_with('2') => Served::Answered(body.trim().to_string()),
        (Some(0), "403") => Served::Refused,
        (Some(0), "404") => Served::Closed("404".into()),
        (Some(0), c) => Served::Other(c.to_string()),
        // 7: no connection; 28: timed out; 35 and 60: a handshake or certificate that fails.
        (c, _) => Served::Closed(format!("curl exit {}", c.unwrap_or(-1))),
    })
}

/// The lab address of edge `to` that HTTPS requests from `from` go to: one on a net `from` is
/// on or reaches (`net::addresses_seen_from`), as a client on the internet reaches the public
/// side of an ingress that also sits on a private net.
pub(crate) fn edge_address(lab: &LabFile, from: &str, to: &str) -> Result<String> {
    let host = |name: &str| lab.host.iter().find(|h| h.name == name).with_context(|| format!("https to `{to}`: `{name}` is no lab host"));
    let seen = crate::net::addresses_seen_from(lab, host(from)?, host(to)?);
    Ok(seen.first().with_context(|| format!("https to `{to}`: `{to}` has no lab address"))?.to_string())
}

/// An HTTPS expectation: requests for `host` from `from` to `to`'s lab address (`edge_address`),
/// as the internet reaches an edge. `open` when every request was answered (by one of
/// `answered_by`, when given), `refused` when the edge refused, `closed` when nothing served the
/// name.
fn https(e: &Expect, to: &str, lab: &LabFile, st: &LabState) -> Result<(String, String, String)> {
    let host = e.host.as_deref().context("an https expectation needs `host`")?;
    let port = e.port().unwrap_or(443);
    let addr = edge_address(lab, &e.from, to)?;
    let from_ns = ns(st, &e.from);
    let mut expected = e.result.unwrap_or(Outcome::Open).as_str().to_string();
    if let Some(by) = &e.answered_by {
        expected = format!("open by {}", by.join("|"));
    }
    let mut by: Vec<String> = Vec::new();
    let mut seen = String::new();
    for _ in 0..HTTPS_REQUESTS {
        match https_once(st, &from_ns, host, &addr, port)? {
            Served::Answered(b) => by.push(b),
            Served::Refused => seen = "refused".into(),
            Served::Closed(why) => seen = format!("closed ({why})"),
            Served::Other(code) => seen = format!("answered {code}"),
        }
        if !seen.is_empty() {
            break;
        }
    }
    if seen.starts_with("closed") && e.result == Some(Outcome::Closed) {
        seen = "closed".into();
    }
    if seen.is_empty() {
        by.sort();
        by.dedup();
        seen = match &e.answered_by {
            Some(allowed) if by.iter().all(|b| allowed.contains(b)) => expected.clone(),
            Some(_) => format!("open by {}", by.join("|")),
            None => "open".into(),
        };
    }
    Ok((format!("https {port} {host} -> {to}"), expected, seen))
}

/// Prints the matrix as the lab always has: one row per expectation, `NO` where they differ.
pub(crate) fn print(rows: &[Row]) {
    println!("{:<12} {:<34} {:<28} {:<28} OK", "FROM", "CHECK", "EXPECTED", "SEEN");
    for r in rows {
        let ok = if r.ok() { "yes" } else { "NO" };
        println!("{}", format!("{:<12} {:<34} {:<28} {:<28} {ok:<3} {}", r.from, r.what, r.expected, r.seen, r.note).trim_end());
    }
}

/// The seconds each iperf3 run sends for, and the longest a run may take with its start.
const IPERF_SECONDS: u32 = 3;
const IPERF_LIMIT: &str = "15";

/// Measures TCP throughput with iperf3 from the from-node to the to-node on the expectation's
/// port, once to its overlay address and once to its lab address (same family, IPv4 first); met
/// when the overlay run moved data. The note gives both figures and their ratio.
fn throughput(e: &Expect, lab: &LabFile, addrs: &HashMap<String, Vec<IpAddr>>, st: &LabState) -> Result<Row> {
    let to = e.to.as_deref().context("a throughput expectation needs `to`")?;
    let port = e.port.context("a throughput expectation needs `port`")?;
    let overlay = addrs.get(to).and_then(|a| a.iter().find(|ip| ip.is_ipv4()).or(a.first())).context("to-node has no overlay address")?;
    let host = lab.host.iter().find(|h| h.name == to).with_context(|| format!("throughput to `{to}`: no lab host of that name"))?;
    let lab_addrs: Vec<IpAddr> = host.addresses.values().filter_map(|a| a.parse().ok()).collect();
    let underlay = lab_addrs.iter().find(|ip| ip.is_ipv4() == overlay.is_ipv4()).or(lab_addrs.first());
    let over = iperf(st, &e.from, to, *overlay, port);
    let under = underlay.map(|u| iperf(st, &e.from, to, *u, port));
    let mbit = |r: &Result<(u64, f64)>| match r {
        Ok((_, bps)) => format!("{:.0} Mbit/s", bps / 1e6),
        Err(err) => format!("failed ({err:#})"),
    };
    let ratio = match (&over, &under) {
        (Ok((_, o)), Some(Ok((_, u)))) if *u > 0.0 => format!(", ratio {:.3}", o / u),
        _ => String::new(),
    };
    let note = format!("overlay {}, underlay {}{ratio}", mbit(&over), under.as_ref().map_or("- (no lab address)".into(), mbit));
    let moved = over.as_ref().is_ok_and(|(bytes, _)| *bytes > 0);
    Ok(Row {
        from: e.from.clone(),
        what: format!("throughput {port} -> {to}"),
        expected: "data moves".into(),
        seen: if moved { "data moves".into() } else { "no data".into() },
        note,
    })
}

/// One bounded iperf3 run (`-t 3`, at most 15 s with its start) from `from`'s namespace to `dst`
/// in `to`'s, where a one-off server listens on `port`: bytes received and bits a second.
fn iperf(st: &LabState, from: &str, to: &str, dst: IpAddr, port: u16) -> Result<(u64, f64)> {
    let port = port.to_string();
    let mut server = ns_cmd(&ns(st, to), &["timeout", IPERF_LIMIT, "iperf3", "-s", "-1", "-p", &port])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("cannot run iperf3 (is it installed?)")?;
    std::thread::sleep(Duration::from_millis(300));
    let secs = IPERF_SECONDS.to_string();
    let client =
        ns_cmd(&ns(st, from), &["timeout", IPERF_LIMIT, "iperf3", "-c", &dst.to_string(), "-p", &port, "-t", &secs, "-J"]).output();
    let _ = server.kill();
    let _ = server.wait();
    let out = client.context("cannot run iperf3 (is it installed?)")?;
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).with_context(|| format!("iperf3 to {dst} printed no JSON"))?;
    if let Some(err) = v["error"].as_str() {
        bail!("{}", err.trim());
    }
    let sum = &v["end"]["sum_received"];
    Ok((sum["bytes"].as_u64().unwrap_or(0), sum["bits_per_second"].as_f64().unwrap_or(0.0)))
}
