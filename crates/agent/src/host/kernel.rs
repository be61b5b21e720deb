//! The kernel's WireGuard module, through defguard_wireguard_rs (`defguard`).

use super::defguard::Defguard;

/// The kernel module's interface.
pub type Kernel = Defguard<defguard_wireguard_rs::Kernel>;

impl Kernel {
    pub fn new(ifname: &str) -> Self {
        Defguard::named(ifname, "kernel")
    }
}

/// Whether the kernel module can make an interface here: one made and removed again.
pub fn available() -> bool {
    let probe = std::process::Command::new("ip").args(["link", "add", "trellis-probe0", "type", "wireguard"]).output();
    if probe.is_ok_and(|o| o.status.success()) {
        let _ = std::process::Command::new("ip").args(["link", "del", "trellis-probe0"]).output();
        return true;
    }
    false
}
