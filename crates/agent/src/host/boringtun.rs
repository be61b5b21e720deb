//! The embedded userspace boringtun, through defguard_wireguard_rs (`defguard`): a TUN device
//! served by the agent process itself.

use super::defguard::Defguard;

/// The embedded boringtun's interface.
pub type Boringtun = Defguard<defguard_wireguard_rs::Userspace>;

impl Boringtun {
    pub fn new(ifname: &str) -> Self {
        Defguard::named(ifname, "boringtun")
    }
}
