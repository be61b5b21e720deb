//! The lab's side of exposures (ADR 0026): Debian's `pebble` as the ACME CA on the host with
//! `role = "acme"`, validating for real (TLS-ALPN-01 on port 443 of the ingress nodes' lab
//! addresses), with a small resolver beside it that answers each exposed host name with its first
//! ingress node's lab address on a net the acme host reaches; and on every runner of an exposed
//! module the lab's HTTP listener, which answers with the runner's host name.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use trellis_core::Declaration;

use crate::file::{Host, LabFile};
use crate::net::{in_ns, ns_cmd};
use crate::LabState;

/// Where Pebble serves ACME and its management API (the roots), and where its resolver answers.
pub(crate) const DIRECTORY_PORT: u16 = 14000;
const MANAGEMENT_PORT: u16 = 15000;
const DNS_PORT: u16 = 8053;

/// The ACME directory URL of a lab's acme host: what the lab's declarations name in `[acme]`.
pub(crate) fn directory(host: &Host) -> Option<String> {
    let ip = first_v4(host)?;
    Some(format!("https://{ip}:{DIRECTORY_PORT}/dir"))
}

fn first_v4(host: &Host) -> Option<IpAddr> {
    host.addresses.values().filter_map(|a| a.parse::<IpAddr>().ok()).find(IpAddr::is_ipv4)
}

/// Each exposed host name of the declarations, with the IPv4 lab address of its first ingress
/// node that the host `acme` reaches it at: Pebble validates there, and an ingress is often on a
/// private net too, which may sort before its public one.
pub(crate) fn names(lab: &LabFile, acme: &Host, decls: &[&Declaration]) -> Result<BTreeMap<String, IpAddr>> {
    let mut out = BTreeMap::new();
    for d in decls {
        for e in &d.exposures {
            let edge = &e.via[0];
            let host = lab.host.iter().find(|h| h.name == *edge).with_context(|| format!("ingress `{edge}` has no lab host"))?;
            // The resolver answers A queries only.
            let ip = crate::net::addresses_seen_from(lab, acme, host)
                .into_iter()
                .find(IpAddr::is_ipv4)
                .with_context(|| format!("ingress `{edge}` has no IPv4 lab address"))?;
            for h in &e.hostnames {
                out.insert(h.clone(), ip);
            }
        }
    }
    Ok(out)
}

/// A resolver on UDP that answers A queries for `names` and nothing else (NXDOMAIN), for Pebble's
/// validation only. Python's standard library is on every machine the lab runs on.
const RESOLVER: &str = r#"
import socket, struct, sys, json
addr, port, names = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((addr, port))
while True:
    q, peer = s.recvfrom(512)
    if len(q) < 17:
        continue
    i, labels = 12, []
    while i < len(q) and q[i] != 0 and len(labels) < 64:
        n = q[i]
        labels.append(q[i + 1:i + 1 + n].decode("ascii", "replace").lower())
        i += 1 + n
    i += 1
    if i + 4 > len(q):
        continue
    qtype = struct.unpack(">H", q[i:i + 2])[0]
    name = ".".join(labels)
    ip = names.get(name)
    flags = 0x8400 | (0x0100 & (q[2] << 8)) | (0 if ip else 3)
    answer = b""
    if ip and qtype == 1:
        answer = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton(ip)
    head = q[:2] + struct.pack(">HHHHH", flags, 1, 1 if answer else 0, 0, 0)
    s.sendto(head + q[12:i + 4] + answer, peer)
"#;

/// Starts Pebble and its resolver on `host` (in namespace `ns`); returns the certificate Pebble's
/// listener presents (agents trust it for the directory: `LEGO_CA_CERTIFICATES`) after fetching the
/// root it issues under into `st.dir/acme-root.pem`, which clients verify the edge against.
pub(crate) fn start(host: &Host, ns: &str, names: &BTreeMap<String, IpAddr>, st: &mut LabState) -> Result<PathBuf> {
    let ip = first_v4(host).with_context(|| format!("acme host `{}` has no IPv4 lab address", host.name))?.to_string();
    let dir = st.dir.join("acme");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let (cert, key) = (dir.join("listener.pem"), dir.join("listener.key"));
    let s = |p: &PathBuf| p.to_string_lossy().into_owned();
    crate::net::sh(&[
        "openssl",
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=trellis lab ACME directory",
        "-addext",
        &format!("subjectAltName=IP:{ip}"),
        "-keyout",
        &s(&key),
        "-out",
        &s(&cert),
    ])?;
    let config = dir.join("pebble.json");
    let json = serde_json::json!({"pebble": {
        "listenAddress": format!("{ip}:{DIRECTORY_PORT}"),
        "managementListenAddress": format!("{ip}:{MANAGEMENT_PORT}"),
        "certificate": s(&cert),
        "privateKey": s(&key),
        // Validation reaches the ingress where the internet would: 80 and 443.
        "httpPort": 80,
        "tlsPort": 443,
        "ocspResponderURL": "",
        "externalAccountBindingRequired": false
    }});
    std::fs::write(&config, serde_json::to_vec_pretty(&json)?).with_context(|| format!("cannot write {}", config.display()))?;
    let names_json = serde_json::to_string(&names.iter().map(|(k, v)| (k.clone(), v.to_string())).collect::<BTreeMap<_, _>>())?;
    let resolver = ns_cmd(ns, &["python3", "-c", RESOLVER, &ip, &DNS_PORT.to_string(), &names_json])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("resolver.log"))?)
        .spawn()
        .context("cannot run python3 for the ACME CA's resolver")?;
    st.pids.push(resolver.id());
    let log = std::fs::File::create(dir.join("pebble.log"))?;
    let pebble = ns_cmd(ns, &["pebble", "-config", &s(&config), "-dnsserver", &format!("{ip}:{DNS_PORT}")])
        // No random waits before validating, and no nonces refused at random: the lab measures.
        .env("PEBBLE_VA_NOSLEEP", "1")
        .env("PEBBLE_WFE_NONCEREJECT", "0")
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .context("cannot run pebble (Debian package pebble)")?;
    st.pids.push(pebble.id());
    let deadline = Instant::now() + Duration::from_secs(20);
    let url = format!("https://{ip}:{DIRECTORY_PORT}/dir");
    while in_ns(ns, &["curl", "-sf", "--max-time", "2", "--cacert", &s(&cert), &url]).is_err() {
        if Instant::now() > deadline {
            bail!("pebble on `{}` did not serve {url} within 20 s; see {}", host.name, dir.join("pebble.log").display());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let root = in_ns(ns, &["curl", "-sf", "--max-time", "5", "--cacert", &s(&cert), &format!("https://{ip}:{MANAGEMENT_PORT}/roots/0")])?;
    if !root.contains("BEGIN CERTIFICATE") {
        bail!("pebble's management API gave no root certificate");
    }
    let root_path = st.dir.join("acme-root.pem");
    std::fs::write(&root_path, root).with_context(|| format!("cannot write {}", root_path.display()))?;
    Ok(cert)
}

/// The lab's HTTP listener on every runner of an exposed module, on the exposure's port: it
/// answers every request with the runner's host name. Runs for the lab's life.
pub(crate) fn listeners(decls: &[&Declaration], host_ns: &std::collections::HashMap<String, String>, st: &mut LabState) -> Result<()> {
    let mut started: Vec<(String, u16)> = Vec::new();
    for d in decls {
        for e in &d.exposures {
            for n in d.nodes.iter().filter(|n| n.modules.contains(&e.module)) {
                if started.contains(&(n.name.clone(), e.port)) {
                    continue;
                }
                let Some(ns) = host_ns.get(&n.name) else { continue };
                let root = st.dir.join(format!("http-{}", n.name));
                std::fs::create_dir_all(&root)?;
                std::fs::write(root.join("index.html"), &n.name)?;
                let child = ns_cmd(ns, &["python3", "-m", "http.server", &e.port.to_string(), "--directory", &root.to_string_lossy()])
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .context("cannot run python3 -m http.server for the lab's HTTP listener")?;
                st.pids.push(child.id());
                started.push((n.name.clone(), e.port));
            }
        }
    }
    Ok(())
}
