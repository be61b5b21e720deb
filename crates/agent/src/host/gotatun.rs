//! The embedded GotaTun backend (ADR 0030): Mullvad's boringtun fork, in the agent process, a
//! TUN device served by a tokio runtime of its own and configured through the crate's API
//! (peers changed in place, none removed to be changed); addresses, MTU and link state with
//! `ip`.
//!
//! The agent's loop runs on a current-thread runtime and calls the `Wireguard` trait
//! synchronously, so the device cannot live there (it would stop whenever the loop waits on
//! something else, and blocking on it from inside that runtime is refused): every call is
//! handed to the backend's own runtime and waited for on a channel.

use std::future::Future;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use base64::Engine;
use gotatun::device::{DefaultDeviceTransports, Device, DeviceBuilder, Peer};
use gotatun::tun::tun_async_device::TunDevice;
use gotatun::x25519::{PublicKey, StaticSecret};
use trellis_core::wgconf::{WgConf, WgPeer};

use super::traits::{changes_from, Wireguard};
use crate::status::PeerState;

/// WireGuard's MTU where the configuration names none, as wireguard-go and wg-quick use.
const DEFAULT_MTU: u16 = 1420;
/// How long a stopped device's interface has to go before a new one of the same name is made.
const STOP_TIMEOUT: Duration = Duration::from_secs(3);

type Dev = Device<DefaultDeviceTransports>;

pub struct Gotatun {
    ifname: String,
    /// The runtime the device's tasks run on; made with the first interface.
    rt: Option<tokio::runtime::Runtime>,
    device: Option<Arc<Dev>>,
    current: Option<std::sync::Arc<WgConf>>,
}

impl Gotatun {
    pub fn new(ifname: &str) -> Self {
        Gotatun { ifname: ifname.to_string(), rt: None, device: None, current: None }
    }

    /// Runs `fut` on the backend's runtime and waits for its result.
    fn block<T: Send + 'static>(&self, fut: impl Future<Output = T> + Send + 'static) -> Result<T> {
        let rt = self.rt.as_ref().context("the gotatun runtime is not running")?;
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().with_context(|| format!("the gotatun task for {} ended without an answer", self.ifname))
    }

    /// The runtime, made on first use: one worker per core, so that reading the TUN device,
    /// encrypting and sending run beside decrypting and writing back.
    fn runtime(&mut self) -> Result<()> {
        if self.rt.is_none() {
            let workers = std::thread::available_parallelism().map_or(2, |n| n.get()).max(2);
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(workers)
                .thread_name("gotatun")
                .enable_all()
                .build()
                .context("cannot start the gotatun runtime")?;
            self.rt = Some(rt);
        }
        Ok(())
    }

    /// Makes the interface and its device for `conf`, then addresses, MTU and link with `ip`; on
    /// any failure the device is stopped again, so nothing half made stays.
    fn start(&mut self, conf: &WgConf, private_key: &str) -> Result<()> {
        self.runtime()?;
        let key = StaticSecret::from(
            key_bytes(private_key).map_err(|_| anyhow::anyhow!("the private key is not a WireGuard key (base64 of 32 bytes)"))?,
        );
        let peers = conf.peers.iter().map(|p| peer(p)).collect::<Result<Vec<_>>>()?;
        let port = conf.listen_port.unwrap_or(51820);
        let mtu = match conf.mtu {
            None => DEFAULT_MTU,
            Some(m) => u16::try_from(m).ok().with_context(|| format!("MTU {m} of {}: at most 65535", self.ifname))?,
        };
        let ifname = self.ifname.clone();
        let device = self
            .block(async move {
                let mut config = gotatun::tun::tun::Configuration::default();
                config.tun_name(&ifname).mtu(mtu);
                let tun = gotatun::tun::tun::create_as_async(&config)
                    .map_err(|e| anyhow::anyhow!("cannot create the TUN device {ifname}: {e}"))?;
                let tun = TunDevice::from_tun_device(tun).map_err(|e| anyhow::anyhow!("TUN device {ifname}: {e}"))?;
                DeviceBuilder::new()
                    .with_default_udp()
                    .with_ip(tun)
                    .with_private_key(key)
                    .with_listen_port(port)
                    // WireGuard's own packets carry the mark, so that an exit's policy routing
                    // (`routes`) keeps them out of the tunnel, as wg-quick does.
                    .with_fwmark(u32::from(port))
                    .with_peers(peers)
                    .build()
                    .await
                    .map_err(|e| anyhow::anyhow!("cannot start the WireGuard device {ifname} (gotatun): {e}"))
            })?
            .with_context(|| format!("cannot create WireGuard interface {} (gotatun)", self.ifname))?;
        self.device = Some(Arc::new(device));
        let configured = self.configure(conf);
        if configured.is_err() {
            self.stop();
        }
        configured
    }

    /// Addresses with `ip`, then the link up (the MTU came with the TUN device).
    fn configure(&self, conf: &WgConf) -> Result<()> {
        for a in &conf.addresses {
            ip(&["address", "add", a, "dev", &self.ifname])?;
        }
        ip(&["link", "set", "dev", &self.ifname, "up"])
    }

    /// Stops the device and waits until its interface is gone (the TUN device goes with its
    /// last descriptor, which the device holds).
    fn stop(&mut self) {
        self.current = None;
        let Some(device) = self.device.take() else { return };
        let stopped = self.block(async move {
            if let Some(device) = Arc::into_inner(device) {
                device.stop().await;
            }
        });
        if let Err(e) = stopped {
            tracing::warn!("stopping the gotatun device of {}: {e:#}", self.ifname);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while link_exists(&self.ifname) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn device(&self) -> Option<Arc<Dev>> {
        self.device.clone()
    }
}

impl Drop for Gotatun {
    fn drop(&mut self) {
        self.stop();
        // Dropped where blocking is not allowed (inside the agent's runtime), a runtime may only
        // be let go in the background; its tasks are done by now.
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

impl Wireguard for Gotatun {
    fn apply(&mut self, conf: &std::sync::Arc<WgConf>, private_key: &str, edit: Option<&crate::plan::Edit>) -> Result<()> {
        let same_interface = self.device.is_some()
            && self
                .current
                .as_ref()
                .is_some_and(|c| c.addresses == conf.addresses && c.listen_port == conf.listen_port && c.mtu == conf.mtu);
        if same_interface {
            // Peers change in place: the interface and every session stay up, a changed peer's
            // too (gotatun updates a peer's endpoint, keepalive and allowed IPs where it is).
            let old = self.current.as_ref().expect("configured");
            let changes = changes_from(old, conf, edit);
            // A device made without peers has no connection (no socket, no tasks) until one is
            // forced; clearing its (no) peers is what forces it.
            let first_peers = old.peers.is_empty() && !conf.peers.is_empty();
            let gone = changes.gone.iter().map(|p| public_key(&p.public_key)).collect::<Result<Vec<_>>>()?;
            let changed = changes.changed.iter().map(|(p, before)| Ok((peer(p)?, before.is_some()))).collect::<Result<Vec<_>>>()?;
            let device = self.device().expect("interface exists");
            let ifname = self.ifname.clone();
            // Whatever part of a failed change took, the device is no longer what `current`
            // says: forgotten, so that the next apply (the rollback's) makes the interface anew.
            self.current = None;
            self.block(async move {
                device
                    .write(async |d| {
                        if first_peers {
                            d.clear_peers();
                        }
                        for key in &gone {
                            d.remove_peer(key).await;
                        }
                        for (p, existed) in changed {
                            if existed {
                                let Peer { public_key, endpoint, allowed_ips, keepalive, .. } = p;
                                d.modify_peer(&public_key, |m| {
                                    // A peer without a configured endpoint keeps the one it was
                                    // last heard from (as `wg set` does): a spoke behind NAT
                                    // changed in its allowed IPs stays reachable from here.
                                    if endpoint.is_some() {
                                        m.set_endpoint(endpoint);
                                    }
                                    m.set_keepalive(keepalive);
                                    m.clear_allowed_ips();
                                    m.add_allowed_ips(allowed_ips);
                                })
                                .await;
                            } else {
                                d.add_peer(p);
                            }
                        }
                    })
                    .await
                    .map_err(|e| anyhow::anyhow!("gotatun refused the peers of {ifname}: {e}"))
            })??;
        } else {
            self.stop();
            self.start(conf, private_key)?;
        }
        self.current = Some(conf.clone());
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerState>> {
        let Some(device) = self.device() else { return Ok(Vec::new()) };
        let stats = self.block(async move { device.peers().await })?;
        let now = SystemTime::now();
        Ok(stats
            .into_iter()
            .map(|s| PeerState {
                public_key: base64::engine::general_purpose::STANDARD.encode(s.peer.public_key.as_bytes()),
                endpoint: s.peer.endpoint.map(|e| e.to_string()),
                // gotatun gives the time since the handshake; the state holds when it was.
                last_handshake: s
                    .stats
                    .last_handshake
                    .and_then(|ago| now.checked_sub(ago))
                    .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                    .map(|d| d.as_secs()),
                allowed_ips: s.peer.allowed_ips.iter().map(|n| n.to_string()).collect(),
                rx_bytes: s.stats.rx_bytes as u64,
                tx_bytes: s.stats.tx_bytes as u64,
            })
            .collect())
    }

    fn describe(&self) -> String {
        format!("{} (gotatun)", self.ifname)
    }

    fn restart_handshakes(&self, public_keys: &[String]) -> Result<()> {
        let (Some(device), Some(current)) = (self.device(), &self.current) else { return Ok(()) };
        let named = super::traits::named(&current.peers, public_keys).into_iter().map(|p| peer(p)).collect::<Result<Vec<_>>>()?;
        if named.is_empty() {
            return Ok(());
        }
        let ifname = self.ifname.clone();
        self.block(async move {
            device
                .write(async |d| {
                    // A peer made anew has no initiation outstanding, so its next packet starts
                    // one now, not when the one the other end dropped would be retried.
                    for p in named {
                        d.remove_peer(&p.public_key).await;
                        d.add_peer(p);
                    }
                })
                .await
                .map_err(|e| anyhow::anyhow!("gotatun refused to restart handshakes on {ifname}: {e}"))
        })?
    }
}

/// The 32 bytes of a base64 WireGuard key.
fn key_bytes(b64: &str) -> Result<[u8; 32]> {
    let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok();
    raw.and_then(|k| <[u8; 32]>::try_from(k).ok()).with_context(|| format!("{b64:?} is not a WireGuard key (base64 of 32 bytes)"))
}

fn public_key(b64: &str) -> Result<PublicKey> {
    key_bytes(b64).map(PublicKey::from).with_context(|| "peer key")
}

/// A peer as gotatun takes it.
fn peer(p: &WgPeer) -> Result<Peer> {
    let mut out = Peer::new(public_key(&p.public_key)?);
    out.endpoint = p.endpoint;
    out.keepalive = p.keepalive.filter(|k| *k != 0);
    for a in &p.allowed_ips {
        out.allowed_ips
            .push(ipnetwork::IpNetwork::from_str(a).map_err(|e| anyhow::anyhow!("allowed IP {a} of peer {}: {e}", p.public_key))?);
    }
    Ok(out)
}

/// Whether this thread's network namespace has an interface of this name (asked of the kernel:
/// `/sys/class/net` shows the namespace sysfs was mounted in, which may be another).
fn link_exists(ifname: &str) -> bool {
    let Ok(name) = std::ffi::CString::new(ifname) else { return false };
    // SAFETY: a NUL-terminated name that lives across the call.
    unsafe { libc::if_nametoindex(name.as_ptr()) != 0 }
}

/// Runs `ip ARGS`; its complaint is the error.
fn ip(args: &[&str]) -> Result<()> {
    let out = std::process::Command::new("ip").args(args).output().context("cannot run ip (is iproute2 installed?)")?;
    if !out.status.success() {
        bail!("ip {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// The backend for real: two network namespaces joined by a veth pair, a gotatun interface in
/// each, ping between them. The backend's runtime is made on the thread that first applies, so
/// each backend is first applied from inside its namespace (its worker threads, its TUN device
/// and its sockets are there); `ip` runs from the calling thread, which enters the namespace
/// for every call.
#[cfg(test)]
mod tests {
    use super::super::testns::{conf, keypair, sh, state, wg_peer, Netns};
    use super::*;
    use trellis_testing::{can_run, Need};

    /// Peers applied to an interface made without any, a handshake that the other end dropped
    /// restarted at once, a peer changed in place (its session kept, its new allowed IPs
    /// routed), a peer removed, and both interfaces gone with their backends.
    #[test]
    fn two_gotatun_interfaces_pass_packets_and_change_peers_in_place() {
        if !can_run(Need::Root) {
            return;
        }
        let (a_ns, b_ns) = (Netns::new("a"), Netns::new("b"));
        sh("ip", &["link", "add", "tgt-veth", "netns", &a_ns.name, "type", "veth", "peer", "name", "eth0", "netns", &b_ns.name]).unwrap();
        a_ns.run(&["ip", "link", "set", "tgt-veth", "name", "eth0"]).unwrap();
        for (ns, addr) in [(&a_ns, "192.0.2.1/24"), (&b_ns, "192.0.2.2/24")] {
            ns.run(&["ip", "addr", "add", addr, "dev", "eth0"]).unwrap();
            ns.run(&["ip", "link", "set", "eth0", "up"]).unwrap();
            ns.run(&["ip", "link", "set", "lo", "up"]).unwrap();
        }
        let ((a_priv, a_pub), (b_priv, b_pub)) = (keypair(), keypair());
        let (mut a, mut b) = (Gotatun::new("wgt0"), Gotatun::new("wgt0"));

        // b starts without peers; a has b (and its endpoint), whose first initiation b drops.
        b_ns.enter(|| b.apply(&conf("10.77.0.2/24", 51820, vec![]), &b_priv, None)).unwrap();
        let a_conf = conf("10.77.0.1/24", 51820, vec![wg_peer(&b_pub, Some("192.0.2.2:51820"), &["10.77.0.2/32"])]);
        a_ns.enter(|| a.apply(&a_conf, &a_priv, None)).unwrap();
        assert_eq!(a.describe(), "wgt0 (gotatun)");
        assert!(a_ns.run(&["ip", "-o", "link", "show", "wgt0"]).unwrap().contains("mtu 1420"), "the default MTU");
        assert!(!a_ns.ping("10.77.0.2", 1), "b does not know a yet");

        // b gets a as its first peer; a's next initiation would wait for WireGuard's 5 s retry.
        b_ns.enter(|| b.apply(&conf("10.77.0.2/24", 51820, vec![wg_peer(&a_pub, None, &["10.77.0.1/32"])]), &b_priv, None)).unwrap();
        assert!(!a_ns.ping("10.77.0.2", 1), "no initiation before the retry: the case restart_handshakes is for");
        a.restart_handshakes(std::slice::from_ref(&b_pub)).unwrap();
        assert!(a_ns.ping("10.77.0.2", 2), "a restarted handshake completes at once");
        let a_peers = a.peers().unwrap();
        assert!(state(&a_peers, &b_pub).and_then(|p| p.last_handshake).is_some(), "{a_peers:?}");
        assert_eq!(state(&a_peers, &b_pub).and_then(|p| p.endpoint.clone()).as_deref(), Some("192.0.2.2:51820"));
        let b_peers = b.peers().unwrap();
        let first = state(&b_peers, &a_pub).and_then(|p| p.last_handshake).expect("b has a handshake with a");
        assert_eq!(
            state(&b_peers, &a_pub).and_then(|p| p.endpoint.clone()).as_deref(),
            Some("192.0.2.1:51820"),
            "learned from the handshake"
        );

        // b's peer on a changes: more allowed IPs and a keepalive. In place: the session stays
        // (a peer made anew would handshake again, a second or more after the first).
        std::thread::sleep(Duration::from_millis(1100));
        let mut changed = wg_peer(&b_pub, Some("192.0.2.2:51820"), &["10.77.0.2/32", "10.77.9.0/24"]);
        changed.keepalive = Some(25);
        a_ns.enter(|| a.apply(&conf("10.77.0.1/24", 51820, vec![changed]), &a_priv, None)).unwrap();
        assert!(a.take_sessions_dropped().is_empty());
        b_ns.run(&["ip", "addr", "add", "10.77.9.1/32", "dev", "wgt0"]).unwrap();
        a_ns.run(&["ip", "route", "add", "10.77.9.0/24", "dev", "wgt0"]).unwrap();
        assert!(a_ns.ping("10.77.9.1", 2), "the new allowed IPs go to b and are accepted from it");
        let b_peers = b.peers().unwrap();
        assert_eq!(state(&b_peers, &a_pub).and_then(|p| p.last_handshake), Some(first), "the session survived the change: {b_peers:?}");

        // b's peer on a goes.
        a_ns.enter(|| a.apply(&conf("10.77.0.1/24", 51820, vec![]), &a_priv, None)).unwrap();
        assert!(a.peers().unwrap().is_empty());
        assert!(!a_ns.ping("10.77.0.2", 1), "no peer, no packet");

        // Another address makes another interface; the backend gone, so is its interface.
        a_ns.enter(|| a.apply(&conf("10.77.0.11/24", 51820, vec![wg_peer(&b_pub, None, &["10.77.0.2/32"])]), &a_priv, None)).unwrap();
        let shown = a_ns.run(&["ip", "-o", "addr", "show", "wgt0"]).unwrap();
        assert!(shown.contains("10.77.0.11/24") && !shown.contains("10.77.0.1/24"), "{shown}");
        assert_eq!(a.peers().unwrap().len(), 1);
        a_ns.enter(|| drop(a));
        b_ns.enter(|| drop(b));
        for ns in [&a_ns, &b_ns] {
            assert!(ns.run(&["ip", "link", "show", "wgt0"]).is_err(), "wgt0 outlived its backend in {}", ns.name);
        }
    }

    #[test]
    fn peers_are_converted_and_bad_keys_named() {
        let p = peer(&wg_peer(&keypair().1, Some("192.0.2.2:51820"), &["10.77.0.2/32", "fd77::2/128"])).unwrap();
        assert_eq!(p.allowed_ips.iter().map(|n| n.to_string()).collect::<Vec<_>>(), ["10.77.0.2/32", "fd77::2/128"]);
        assert_eq!(p.endpoint, Some("192.0.2.2:51820".parse().unwrap()));
        assert_eq!(p.keepalive, None);
        let e = peer(&wg_peer("short", None, &[])).unwrap_err();
        assert!(format!("{e:#}").contains("\"short\" is not a WireGuard key"), "{e:#}");
        let e = peer(&wg_peer(&keypair().1, None, &["10.77.0.300/32"])).unwrap_err();
        assert!(format!("{e:#}").contains("allowed IP 10.77.0.300/32"), "{e:#}");
    }
}
