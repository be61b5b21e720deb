//! The host side effects, each behind a narrow trait (`traits`) with one file per backend: files
//! (`disk`: atomic, staged), WireGuard (`kernel` and `boringtun` through defguard_wireguard_rs,
//! `defguard`; the embedded gotatun, `gotatun`; a `wireguard-go` process, `wggo`), nftables
//! (`nft`: its library in the agent's helper process, `crate::nfthelper`, or `nft -f`), IP
//! forwarding (`forwarding`: `/proc/sys`) and handshake prompts (`prompts`: datagrams bound to
//! the interface); `select` picks the WireGuard backend. The zone's server is `crate::dns`, routes
//! `crate::routes`. The executor talks only to the traits; the backends use `traits` alone, and
//! only `select` names them.

pub mod boringtun;
pub mod defguard;
pub mod disk;
pub mod forwarding;
pub mod gotatun;
pub mod kernel;
pub mod nft;
pub mod prompts;
pub mod select;
#[cfg(test)]
pub(crate) mod testns;
pub mod traits;
pub mod wggo;

pub use disk::DiskWriter;
pub use forwarding::ProcSys;
pub use nft::Nft;
pub use prompts::Datagrams;
pub use select::{wireguard, WgMode};
pub use traits::{peer_changes, FileOutcome, FileWriter, Firewall, Forwarding, PeerChanges, Prompter, Wireguard};
