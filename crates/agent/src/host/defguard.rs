//! WireGuard through defguard_wireguard_rs, which the `kernel` and `boringtun` backends share:
//! the interface made and configured through its API, peers changed in place (removed and added
//! again when their settings change).

use std::str::FromStr;

use anyhow::Result;
use defguard_wireguard_rs::{WGApi, WireguardInterfaceApi};
use trellis_core::wgconf::{WgConf, WgPeer};

use super::traits::{changes_from, Wireguard};
use crate::status::PeerState;

/// One interface driven through defguard_wireguard_rs's API of kind `T` (the kernel module or its
/// embedded userspace boringtun).
pub struct Defguard<T> {
    ifname: String,
    api: Option<WGApi<T>>,
    current: Option<std::sync::Arc<WgConf>>,
    backend: &'static str,
    /// The peers the last apply removed and added again (see `take_sessions_dropped`).
    dropped: Vec<String>,
}

impl<T> Defguard<T> {
    /// The interface `ifname`, made at the first apply; `backend` names the kind in messages.
    pub(super) fn named(ifname: &str, backend: &'static str) -> Self {
        Defguard { ifname: ifname.to_string(), api: None, current: None, backend, dropped: Vec::new() }
    }
}

fn dg_peer(p: &WgPeer) -> Result<defguard_wireguard_rs::peer::Peer> {
    use defguard_wireguard_rs::{key::Key, net::IpAddrMask, peer::Peer};
    let key = Key::from_str(&p.public_key).map_err(|e| anyhow::anyhow!("peer key {}: {e}", p.public_key))?;
    let mut peer = Peer::new(key);
    peer.endpoint = p.endpoint;
    peer.persistent_keepalive_interval = p.keepalive;
    for a in &p.allowed_ips {
        peer.allowed_ips.push(IpAddrMask::from_str(a).map_err(|e| anyhow::anyhow!("allowed IP {a}: {e}"))?);
    }
    Ok(peer)
}

impl<T> Wireguard for Defguard<T>
where
    WGApi<T>: WireguardInterfaceApi,
{
    fn apply(&mut self, conf: &std::sync::Arc<WgConf>, private_key: &str, edit: Option<&crate::plan::Edit>) -> Result<()> {
        use defguard_wireguard_rs::{net::IpAddrMask, InterfaceConfiguration};
        let same_interface =
            self.current.as_ref().is_some_and(|c| c.addresses == conf.addresses && c.listen_port == conf.listen_port && c.mtu == conf.mtu);
        if same_interface {
            // Peers change in place: the interface and its sessions stay up.
            let api = self.api.as_ref().expect("interface exists");
            // Whatever part of a failed change took, the interface is no longer what `current`
            // says: forgotten, so that the next apply (the rollback's) makes it anew.
            let old = self.current.take().expect("configured");
            self.dropped.clear();
            let changes = changes_from(&old, conf, edit);
            for gone in &changes.gone {
                let key = defguard_wireguard_rs::key::Key::from_str(&gone.public_key).map_err(|e| anyhow::anyhow!("{e}"))?;
                api.remove_peer(&key).map_err(|e| anyhow::anyhow!("removing peer {}: {e}", gone.public_key))?;
            }
            for (p, before) in &changes.changed {
                // A peer whose settings changed is removed and added again: the embedded
                // boringtun refuses (panics) to modify an existing peer in place.
                if before.is_some() {
                    let key = defguard_wireguard_rs::key::Key::from_str(&p.public_key).map_err(|e| anyhow::anyhow!("{e}"))?;
                    api.remove_peer(&key).map_err(|e| anyhow::anyhow!("removing peer {} to change it: {e}", p.public_key))?;
                    self.dropped.push(p.public_key.clone());
                }
                api.configure_peer(&dg_peer(p)?).map_err(|e| anyhow::anyhow!("configuring peer {}: {e}", p.public_key))?;
            }
        } else {
            // The interface before goes first, its handle with it: the embedded boringtun's
            // handle, dropped after the new one is made, took the new interface's socket away
            // (it has the same path), and the new one answered nothing.
            if let Some(api) = self.api.take() {
                let _ = api.remove_interface();
            }
            let mut api = WGApi::<T>::new(self.ifname.clone()).map_err(|e| anyhow::anyhow!("{}: {e}", self.ifname))?;
            api.create_interface()
                .map_err(|e| anyhow::anyhow!("cannot create WireGuard interface {} ({}): {e}", self.ifname, self.backend))?;
            let addresses = conf
                .addresses
                .iter()
                .map(|a| IpAddrMask::from_str(a).map_err(|e| anyhow::anyhow!("address {a}: {e}")))
                .collect::<Result<Vec<_>>>()?;
            let peers = conf.peers.iter().map(|p| dg_peer(p)).collect::<Result<Vec<_>>>()?;
            let cfg = InterfaceConfiguration {
                name: self.ifname.clone(),
                prvkey: private_key.to_string(),
                addresses,
                port: conf.listen_port.unwrap_or(51820),
                peers,
                mtu: conf.mtu,
                // WireGuard's own packets carry the mark, so that an exit's policy
                // routing (`routes`) keeps them out of the tunnel, as wg-quick does.
                fwmark: Some(u32::from(conf.listen_port.unwrap_or(51820))),
            };
            api.configure_interface(&cfg).map_err(|e| anyhow::anyhow!("cannot configure {}: {e}", self.ifname))?;
            self.api = Some(api);
        }
        self.current = Some(conf.clone());
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerState>> {
        let Some(api) = &self.api else { return Ok(Vec::new()) };
        let host = api.read_interface_data().map_err(|e| anyhow::anyhow!("{e}"))?;
        Ok(host
            .peers
            .values()
            .map(|p| PeerState {
                public_key: p.public_key.to_string(),
                endpoint: p.endpoint.map(|e| e.to_string()),
                last_handshake: p.last_handshake.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs()),
                allowed_ips: p.allowed_ips.iter().map(|m| m.to_string()).collect(),
                rx_bytes: p.rx_bytes,
                tx_bytes: p.tx_bytes,
            })
            .collect())
    }

    fn describe(&self) -> String {
        format!("{} ({})", self.ifname, self.backend)
    }

    fn take_sessions_dropped(&mut self) -> Vec<String> {
        std::mem::take(&mut self.dropped)
    }

    fn restart_handshakes(&self, public_keys: &[String]) -> Result<()> {
        let (Some(api), Some(current)) = (&self.api, &self.current) else { return Ok(()) };
        for p in super::traits::named(&current.peers, public_keys) {
            let key = defguard_wireguard_rs::key::Key::from_str(&p.public_key).map_err(|e| anyhow::anyhow!("{e}"))?;
            api.remove_peer(&key).map_err(|e| anyhow::anyhow!("removing peer {} to restart its handshake: {e}", p.public_key))?;
            api.configure_peer(&dg_peer(p)?).map_err(|e| anyhow::anyhow!("adding peer {} again: {e}", p.public_key))?;
        }
        Ok(())
    }
}
