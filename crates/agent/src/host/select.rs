//! Which WireGuard backend runs (`--wireguard`): the one named, or the one `auto` picks on this
//! host. Above the backends, which never import it.

use anyhow::{bail, Result};

use super::boringtun::Boringtun;
use super::gotatun::Gotatun;
use super::kernel::{self, Kernel};
use super::traits::Wireguard;
use super::wggo::{self, WireguardGo};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum WgMode {
    /// The kernel module where it exists, else a `wireguard-go` found on PATH, else the embedded gotatun
    Auto,
    /// The kernel module (fails where it is missing)
    Kernel,
    /// A `wireguard-go` found on PATH, run as the agent's child and driven through its UAPI socket
    WireguardGo,
    /// The embedded userspace boringtun: a TUN device served by the agent process itself
    #[value(alias = "userspace")]
    Boringtun,
    /// The embedded userspace GotaTun (Mullvad's boringtun fork): a TUN device served by the agent process itself
    Gotatun,
    /// Leave the WireGuard interface alone (managed elsewhere)
    None,
}

impl WgMode {
    /// Refuses, in one sentence, a backend this host cannot run, before anything is applied.
    pub fn check(self) -> Result<()> {
        if self == WgMode::WireguardGo && wggo::find().is_none() {
            bail!(wggo::MISSING);
        }
        Ok(())
    }
}

/// Picks the backend: with `auto`, the kernel module if an interface can be made with it, else
/// a `wireguard-go` on PATH (installed, so chosen), else the embedded gotatun (ADR 0030).
pub fn wireguard(mode: WgMode, ifname: &str) -> Option<Box<dyn Wireguard + Send>> {
    Some(match mode {
        WgMode::None => return None,
        WgMode::Kernel => Box::new(Kernel::new(ifname)),
        WgMode::WireguardGo => Box::new(WireguardGo::new(ifname)),
        WgMode::Boringtun => Box::new(Boringtun::new(ifname)),
        WgMode::Gotatun => Box::new(Gotatun::new(ifname)),
        WgMode::Auto => {
            if kernel::available() {
                Box::new(Kernel::new(ifname))
            } else if wggo::find().is_some() {
                Box::new(WireguardGo::new(ifname))
            } else {
                Box::new(Gotatun::new(ifname))
            }
        }
    })
}
