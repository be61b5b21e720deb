//! Reading back the `wireguard.conf` that `render` writes (wg-quick format without
//! `PrivateKey`), for the agent that applies it. Pure.

use std::net::SocketAddr;

/// The interface and peers a `wireguard.conf` describes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WgConf {
    /// Addresses with their prefix length, as written (`10.88.0.5/16`).
    pub addresses: Vec<String>,
    pub listen_port: Option<u16>,
    pub mtu: Option<u32>,
    pub peers: Vec<WgPeer>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WgPeer {
    pub public_key: String,
    pub allowed_ips: Vec<String>,
    pub endpoint: Option<SocketAddr>,
    pub keepalive: Option<u16>,
}

/// Parses the file; an unknown key or a malformed value is an error naming the line.
pub fn parse(text: &str) -> Result<WgConf, String> {
    let mut conf = WgConf::default();
    let mut section = "";
    for (n, raw) in text.lines().enumerate() {
        let line = raw.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |msg: &str| format!("wireguard.conf line {}: {msg}", n + 1);
        if line == "[Interface]" || line == "[Peer]" {
            section = if line == "[Peer]" { "peer" } else { "interface" };
            if section == "peer" {
                conf.peers.push(WgPeer::default());
            }
            continue;
        }
        let (key, value) = line.split_once('=').ok_or_else(|| at("expected KEY = VALUE"))?;
        let (key, value) = (key.trim(), value.trim());
        let list = || value.split(',').map(|s| s.trim().to_string()).filter(|s| !s.is_empty()).collect::<Vec<_>>();
        match (section, key) {
            ("interface", "Address") => conf.addresses = list(),
            ("interface", "ListenPort") => conf.listen_port = Some(value.parse().map_err(|_| at("ListenPort is not a port"))?),
            ("interface", "MTU") => conf.mtu = Some(value.parse().map_err(|_| at("MTU is not a number"))?),
            ("peer", k) => {
                let peer = conf.peers.last_mut().expect("a [Peer] section is open");
                match k {
                    "PublicKey" => peer.public_key = value.to_string(),
                    // WireGuard adds up a peer's AllowedIPs lines (a hub has one per node it relays for).
                    "AllowedIPs" => peer.allowed_ips.extend(list()),
                    "Endpoint" => peer.endpoint = Some(value.parse().map_err(|_| at("Endpoint is not IP:PORT"))?),
                    "PersistentKeepalive" => peer.keepalive = Some(value.parse().map_err(|_| at("PersistentKeepalive is not a number"))?),
                    _ => return Err(at(&format!("unknown key `{k}` in [Peer]"))),
                }
            }
            _ => return Err(at(&format!("unknown key `{key}` here"))),
        }
    }
    if conf.peers.iter().any(|p| p.public_key.is_empty()) {
        return Err("wireguard.conf: a [Peer] has no PublicKey".into());
    }
    Ok(conf)
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_back_what_render_writes() {
        let text = "# c\n[Interface]\nAddress = 10.88.0.1/16, fd88::1/64\nListenPort = 51820\nMTU = 1420\n\n# p\n[Peer]\nPublicKey = AQEB\nAllowedIPs = 10.88.0.2/32, fd88::2/128\nEndpoint = 192.0.2.1:51820\nPersistentKeepalive = 25\n";
        let c = super::parse(text).unwrap();
        assert_eq!(c.addresses, ["10.88.0.1/16", "fd88::1/64"]);
        assert_eq!((c.listen_port, c.mtu), (Some(51820), Some(1420)));
        assert_eq!(c.peers.len(), 1);
        assert_eq!(c.peers[0].allowed_ips, ["10.88.0.2/32", "fd88::2/128"]);
        assert_eq!(c.peers[0].keepalive, Some(25));
        let hub =
            super::parse("[Peer]\nPublicKey = AQEB\nAllowedIPs = 10.88.0.2/32\n# relays for a\nAllowedIPs = 10.88.0.3/32, fd88::3/128\n")
                .unwrap();
        assert_eq!(hub.peers[0].allowed_ips, ["10.88.0.2/32", "10.88.0.3/32", "fd88::3/128"]);
        assert!(super::parse("[Interface]\nPrivateKey = x\n").is_err());
    }
}
