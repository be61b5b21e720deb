//! Handshake prompts on a real host: an empty datagram to each peer's overlay address, sent
//! through the WireGuard interface only.

use std::net::IpAddr;

use anyhow::{bail, Result};

use super::traits::Prompter;

/// UDP datagrams to the discard port (9), each from a socket bound to the interface
/// (`SO_BINDTODEVICE`): it leaves through WireGuard, which hands it only to the peer whose
/// AllowedIPs hold the address, or not at all; never by the underlay, whatever the routes say.
/// The peer's filter drops it; the handshake it started stays.
pub struct Datagrams;

const DISCARD_PORT: u16 = 9;

impl Prompter for Datagrams {
    fn prompt(&self, interface: &str, to: &[IpAddr]) -> Result<()> {
        use socket2::{Domain, Protocol, SockAddr, Socket, Type};
        let send = |addr: IpAddr| -> std::io::Result<()> {
            let to = std::net::SocketAddr::new(addr, DISCARD_PORT);
            let socket = Socket::new(Domain::for_address(to), Type::DGRAM, Some(Protocol::UDP))?;
            socket.bind_device(Some(interface.as_bytes()))?;
            socket.send_to(&[], &SockAddr::from(to)).map(drop)
        };
        let failed: Vec<String> = to.iter().filter_map(|a| send(*a).err().map(|e| format!("{a}: {e}"))).collect();
        if !failed.is_empty() {
            bail!("cannot send a datagram through {interface} to {}", failed.join(", "));
        }
        Ok(())
    }
}
