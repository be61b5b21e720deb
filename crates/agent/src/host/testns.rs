//! Real interfaces in network namespaces, for the backends' tests: two namespaces joined by a
//! veth pair, and what every backend is checked for against them (what a hub observes of its
//! peers, a peer tried without AllowedIPs that handshakes by its keepalive alone; ADR 0032).
//! A backend made by a thread inside a namespace lives there (its runtime, TUN device and
//! sockets; wireguard-go, its child, too); `ip` runs from the calling thread, which enters the
//! namespace for every call.

use std::os::fd::AsRawFd;
use std::time::Duration;

use anyhow::{bail, Result};
use base64::Engine;
use trellis_core::wgconf::{WgConf, WgPeer};

use crate::status::PeerState;

pub struct Netns {
    pub name: String,
    file: std::fs::File,
}

impl Netns {
    pub fn new(tag: &str) -> Netns {
        let name = format!("tgt-{tag}-{}", std::process::id());
        let _ = sh("ip", &["netns", "del", &name]);
        sh("ip", &["netns", "add", &name]).unwrap();
        let file = std::fs::File::open(format!("/run/netns/{name}")).unwrap();
        Netns { name, file }
    }

    /// Runs `f` on this thread inside the namespace, then returns the thread to where it was.
    pub fn enter<T>(&self, f: impl FnOnce() -> T) -> T {
        let home = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        // SAFETY: setns on descriptors this function holds open; it changes only this thread.
        assert_eq!(unsafe { libc::setns(self.file.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns {}", self.name);
        let out = f();
        assert_eq!(unsafe { libc::setns(home.as_raw_fd(), libc::CLONE_NEWNET) }, 0, "setns back");
        out
    }

    pub fn run(&self, args: &[&str]) -> Result<String> {
        let mut a = vec!["netns", "exec", &self.name];
        a.extend_from_slice(args);
        sh("ip", &a)
    }

    pub fn ping(&self, to: &str, wait_s: u32) -> bool {
        self.run(&["ping", "-c", "1", "-W", &wait_s.to_string(), to]).is_ok()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = sh("ip", &["netns", "del", &self.name]);
    }
}

pub fn sh(program: &str, args: &[&str]) -> Result<String> {
    let out = std::process::Command::new(program).args(args).output()?;
    if !out.status.success() {
        bail!("{program} {}: {}{}", args.join(" "), String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

pub fn keypair() -> (String, String) {
    let secret = x25519_dalek::StaticSecret::random_from_rng(rand::thread_rng());
    let public = x25519_dalek::PublicKey::from(&secret);
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    (b64(secret.as_bytes()), b64(public.as_bytes()))
}

pub fn conf(address: &str, port: u16, peers: Vec<WgPeer>) -> std::sync::Arc<WgConf> {
    let peers = peers.into_iter().map(std::sync::Arc::new).collect();
    std::sync::Arc::new(WgConf { addresses: vec![address.into()], listen_port: Some(port), mtu: None, peers })
}

pub fn wg_peer(key: &str, endpoint: Option<&str>, ips: &[&str]) -> WgPeer {
    WgPeer {
        public_key: key.into(),
        allowed_ips: ips.iter().map(|s| s.to_string()).collect(),
        endpoint: endpoint.map(|e| e.parse().unwrap()),
        keepalive: None,
    }
}

pub fn state<'a>(peers: &'a [PeerState], key: &str) -> Option<&'a PeerState> {
    peers.iter().find(|p| p.public_key == key)
}

/// Two namespaces joined by a veth pair: `a` at 192.0.2.1, `b` at 192.0.2.2, on `eth0`.
pub fn pair(tag: &str) -> (Netns, Netns) {
    let (a_ns, b_ns) = (Netns::new(&format!("{tag}a")), Netns::new(&format!("{tag}b")));
    let veth = format!("tv{}", std::process::id() % 100_000);
    sh("ip", &["link", "add", &veth, "netns", &a_ns.name, "type", "veth", "peer", "name", "eth0", "netns", &b_ns.name]).unwrap();
    a_ns.run(&["ip", "link", "set", &veth, "name", "eth0"]).unwrap();
    for (ns, addr) in [(&a_ns, "192.0.2.1/24"), (&b_ns, "192.0.2.2/24")] {
        ns.run(&["ip", "addr", "add", addr, "dev", "eth0"]).unwrap();
        ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
        ns.run(&["ip", "link", "set", "lo", "up"]).unwrap();
    }
    (a_ns, b_ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::{self, WgMode};
    use trellis_testing::{can_run, Need};

    /// Every backend this host can run, with its name; none without root.
    fn backends() -> Vec<(WgMode, &'static str)> {
        if !can_run(Need::Root) {
            return Vec::new();
        }
        let mut modes = vec![(WgMode::Gotatun, "gotatun"), (WgMode::Boringtun, "boringtun")];
        if can_run(Need::Program("wireguard-go")) {
            modes.push((WgMode::WireguardGo, "wireguard-go"));
        }
        modes
    }

    /// On every backend here: two interfaces that each hold the other as a peer being tried (an
    /// endpoint, a one-second keepalive, no AllowedIPs, as `paths::Book` configures it) complete a
    /// handshake with no packet sent into either, from the keepalive alone; then each reports
    /// the other at the address its packets came from, which is what a hub reports of its peers
    /// (`paths::observed`), with the bytes counted; and the addresses moved onto the peer pass
    /// packets.
    #[test]
    fn every_backend_handshakes_a_tried_peer_and_reports_where_it_sends_from() {
        for (mode, name) in backends() {
            let (a_ns, b_ns) = pair(&name[..3]);
            let ((a_priv, a_pub), (b_priv, b_pub)) = (keypair(), keypair());
            let (mut a, mut b) = (host::wireguard(mode, "wgta0").unwrap(), host::wireguard(mode, "wgtb0").unwrap());
            let tried = |key: &str, endpoint: &str| WgPeer {
                public_key: key.into(),
                allowed_ips: Vec::new(),
                endpoint: Some(endpoint.parse().unwrap()),
                keepalive: Some(crate::paths::TRY_KEEPALIVE),
            };
            b_ns.enter(|| b.apply(&conf("10.77.0.2/24", 51820, vec![tried(&a_pub, "192.0.2.1:51820")]), &b_priv, None)).unwrap();
            a_ns.enter(|| a.apply(&conf("10.77.0.1/24", 51820, vec![tried(&b_pub, "192.0.2.2:51820")]), &a_priv, None)).unwrap();
            let shaken = |peers: &[PeerState], key: &str| state(peers, key).is_some_and(|p| p.last_handshake.is_some_and(|t| t > 0));
            let started = std::time::Instant::now();
            while !(shaken(&a.peers().unwrap(), &b_pub) && shaken(&b.peers().unwrap(), &a_pub)) {
                assert!(started.elapsed() < Duration::from_secs(12), "{name}: no handshake from the keepalive: {:?}", a.peers());
                std::thread::sleep(Duration::from_millis(50));
            }
            let wall = crate::unix_now();
            let seen = crate::paths::observed(&b.peers().unwrap(), wall);
            assert_eq!(seen.len(), 1, "{name}: {seen:?}");
            assert_eq!((seen[0].public_key.as_str(), seen[0].endpoint.as_str()), (a_pub.as_str(), "192.0.2.1:51820"), "{name}");
            // Promoted: the addresses go onto the peer, and packets pass.
            let direct = |key: &str, endpoint: &str, ip: &str| WgPeer { allowed_ips: vec![ip.into()], ..tried(key, endpoint) };
            b_ns.enter(|| b.apply(&conf("10.77.0.2/24", 51820, vec![direct(&a_pub, "192.0.2.1:51820", "10.77.0.1/32")]), &b_priv, None))
                .unwrap();
            a_ns.enter(|| a.apply(&conf("10.77.0.1/24", 51820, vec![direct(&b_pub, "192.0.2.2:51820", "10.77.0.2/32")]), &a_priv, None))
                .unwrap();
            assert!(a_ns.ping("10.77.0.2", 3), "{name}: the promoted peer passes packets");
            let a_peers = a.peers().unwrap();
            let p = state(&a_peers, &b_pub).unwrap();
            assert_eq!(p.allowed_ips, ["10.77.0.2/32"], "{name}");
            assert!(p.rx_bytes > 0 && p.tx_bytes > 0, "{name}: {p:?}");
            a_ns.enter(|| drop(a));
            b_ns.enter(|| drop(b));
        }
    }

    /// On every backend here: a probe (an empty datagram, `host::Datagrams`) from a direct peer
    /// moves the bytes this end received from it, though this end's filter drops it; a keepalive
    /// does not on every backend (gotatun counts only data), nor does it come at all when ours
    /// held it back (wireguard-go, the kernel). Probes are what the agent hears a quiet direct
    /// peer by.
    #[test]
    fn every_backend_counts_a_probe_from_a_direct_peer_as_heard() {
        use crate::host::Prompter;
        for (mode, name) in backends() {
            let (a_ns, b_ns) = pair(&format!("p{}", &name[..2]));
            let ((a_priv, a_pub), (b_priv, b_pub)) = (keypair(), keypair());
            let (mut a, mut b) = (host::wireguard(mode, "wgtpa0").unwrap(), host::wireguard(mode, "wgtpb0").unwrap());
            let peer = |key: &str, endpoint: &str, ip: &str| WgPeer {
                keepalive: Some(crate::paths::DIRECT_KEEPALIVE),
                ..wg_peer(key, Some(endpoint), &[ip])
            };
            b_ns.enter(|| b.apply(&conf("10.77.0.2/24", 51820, vec![peer(&a_pub, "192.0.2.1:51820", "10.77.0.1/32")]), &b_priv, None))
                .unwrap();
            a_ns.enter(|| a.apply(&conf("10.77.0.1/24", 51820, vec![peer(&b_pub, "192.0.2.2:51820", "10.77.0.2/32")]), &a_priv, None))
                .unwrap();
            // a's filter drops the probe: only its WireGuard sees it.
            let table = "add table inet probe; add chain inet probe input { type filter hook input priority 0; }; \
                         add rule inet probe input udp dport 9 drop";
            a_ns.run(&["nft", table]).unwrap();
            assert!(b_ns.ping("10.77.0.1", 3), "{name}: the direct peer passes packets");
            let rx = || state(&a.peers().unwrap(), &b_pub).map(|p| p.rx_bytes).unwrap_or(0);
            std::thread::sleep(Duration::from_millis(300));
            let before = rx();
            b_ns.enter(|| crate::host::Datagrams.prompt("wgtpb0", &["10.77.0.1".parse().unwrap()])).unwrap();
            let started = std::time::Instant::now();
            while rx() == before {
                assert!(started.elapsed() < Duration::from_secs(3), "{name}: the probe was not counted as received");
                std::thread::sleep(Duration::from_millis(20));
            }
            a_ns.enter(|| drop(a));
            b_ns.enter(|| drop(b));
        }
    }

    /// On every backend here: a change the backend refuses part-way (a peer added, then an
    /// allowed IP it cannot read) fails, and the rollback's apply of the configuration before
    /// brings the interface back to exactly it. Before, wireguard-go and the kernel's driver kept
    /// the configuration before as what they held, so the rollback changed nothing and the peer
    /// added by the refused change stayed (a review's finding).
    #[test]
    fn a_change_refused_part_way_is_undone_by_the_next_apply() {
        for (mode, name) in backends() {
            let (a_ns, _b_ns) = pair(&format!("r{}", &name[..2]));
            let (a_priv, _) = keypair();
            let ((_, p1), (_, p2), (_, p3)) = (keypair(), keypair(), keypair());
            let mut a = host::wireguard(mode, "wgtr0").unwrap();
            let before = conf("10.77.0.1/24", 51820, vec![wg_peer(&p1, None, &["10.77.0.11/32"])]);
            a_ns.enter(|| a.apply(&before, &a_priv, None)).unwrap();
            let refused = conf(
                "10.77.0.1/24",
                51820,
                vec![
                    wg_peer(&p1, None, &["10.77.0.11/32"]),
                    wg_peer(&p2, None, &["10.77.0.12/32"]),
                    wg_peer(&p3, None, &["10.77.0.300/32"]),
                ],
            );
            assert!(a_ns.enter(|| a.apply(&refused, &a_priv, None)).is_err(), "{name}: an allowed IP that is no address is refused");
            a_ns.enter(|| a.apply(&before, &a_priv, None)).unwrap();
            let keys: Vec<String> =
                a_ns.enter(|| a.peers()).unwrap_or_else(|e| panic!("{name}: {e:#}")).into_iter().map(|p| p.public_key).collect();
            assert_eq!(keys, [p1.as_str()], "{name}: the interface is the configuration before, and only it");
            a_ns.enter(|| drop(a));
        }
    }
}
