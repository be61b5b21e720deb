//! The narrow traits every host side effect sits behind (files, WireGuard, nftables, IP
//! forwarding, handshake prompts), and what the WireGuard backends share (`peer_changes`). The
//! executor and the tests talk only to these; each backend has a file of its own beside this one.

use std::net::IpAddr;
use std::sync::Arc;

use anyhow::Result;
use trellis_core::bundle::BundleFile;
use trellis_core::wgconf::WgConf;

use crate::status::PeerState;

/// What happened to one file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FileOutcome {
    pub path: String,
    pub sha256: String,
    pub result: trellis_proto::FileResult,
}

/// Writes a bundle's files under a root: every file staged (temporary file in the same
/// directory, final mode from creation, written, fsynced) before any is committed (renamed into
/// place, directory fsynced). A crash leaves each file old or new, never a mix.
pub trait FileWriter {
    fn write_all(&mut self, files: &[BundleFile], dropped: &[String]) -> Result<Vec<FileOutcome>>;
}

/// A WireGuard interface brought to a node's `wireguard.conf`, by one of the backends.
pub trait Wireguard {
    /// Brings the interface to this configuration: created on first use, peers changed in place,
    /// by `edit`'s changes when it takes the configuration held to this one.
    fn apply(&mut self, conf: &Arc<WgConf>, private_key: &str, edit: Option<&crate::plan::Edit>) -> Result<()>;
    fn peers(&self) -> Result<Vec<PeerState>>;
    fn describe(&self) -> String;
    /// Removes these peers and adds them again as configured, so that the next packet to each
    /// starts a handshake now. Every backend sends at most one initiation per peer in WireGuard's
    /// 5 s rekey timeout: one the other end dropped (it did not have this node yet) is otherwise
    /// retried only then. A peer that has a session must not be named (it loses the session).
    fn restart_handshakes(&self, public_keys: &[String]) -> Result<()>;
    /// The peers the last `apply` removed and added again to change them (their sessions gone),
    /// taken: the executor prompts those this node dials, so that traffic resumes now, not when
    /// the peer's session would have been renewed (minutes; 25 s with a keepalive).
    fn take_sessions_dropped(&mut self) -> Vec<String> {
        Vec::new()
    }
}

pub use trellis_core::wgconf::{changes as peer_changes, PeerChanges};

/// The changes that take the interface from `current` to `conf`: the plan's edit when it takes
/// exactly these two (ADR 0037: read from a delta's regions, no peer compared), found by key
/// otherwise (after a failure, or with pairs tried directly, the interface holds another value).
pub fn changes_from<'a>(
    current: &Arc<WgConf>,
    conf: &Arc<WgConf>,
    edit: Option<&'a crate::plan::Edit>,
) -> std::borrow::Cow<'a, PeerChanges> {
    match edit.and_then(|e| e.between(current, conf)) {
        Some(c) => std::borrow::Cow::Borrowed(c),
        None => std::borrow::Cow::Owned(peer_changes(&current.peers, &conf.peers)),
    }
}

/// The peers of `peers` whose keys `public_keys` names, in order: by a set, since up to 256 keys
/// are followed up against ten thousand peers (a scan of the list for each took milliseconds of
/// every follow-up).
pub fn named<'a>(peers: &'a [Arc<trellis_core::wgconf::WgPeer>], public_keys: &[String]) -> Vec<&'a Arc<trellis_core::wgconf::WgPeer>> {
    if public_keys.is_empty() {
        return Vec::new();
    }
    let keys: std::collections::HashSet<&str> = public_keys.iter().map(String::as_str).collect();
    peers.iter().filter(|p| keys.contains(p.public_key.as_str())).collect()
}

/// The node's inbound filter, loaded from its `nftables.conf` (and its parts, ADR 0044).
pub trait Firewall {
    /// Loads the ruleset, its files one after the other, in one transaction; on refusal nothing
    /// changes. Only the files that differ from those loaded are read, each by the regions of its
    /// edits when it came as edits of the file loaded (ADR 0035).
    fn apply(&mut self, ruleset: &[crate::plan::TextFile]) -> Result<()>;
    fn loaded(&self) -> bool;
    /// Loads the ruleset loaded last again, whole, when the kernel's table is no longer it
    /// (flushed, deleted or changed behind the agent's back); whether it did. The run loop
    /// calls it on its tick, so that a flushed table is back within seconds, not at the next
    /// bundle.
    fn reconcile(&mut self) -> Result<bool> {
        Ok(false)
    }
}

/// IP forwarding, which a hub needs to relay between its overlay peers.
pub trait Forwarding {
    /// Whether IPv4 and IPv6 forwarding are both on.
    fn enabled(&self) -> bool;
    /// Turns IPv4 and IPv6 forwarding on.
    fn enable(&mut self) -> Result<()>;
}

/// Makes WireGuard start handshakes now, whatever the backend: a packet for a peer without a
/// session is what starts one.
pub trait Prompter {
    /// Sends one empty datagram to each overlay address in `to`, through `interface` only.
    fn prompt(&self, interface: &str, to: &[IpAddr]) -> Result<()>;
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use trellis_core::wgconf::WgPeer;

    fn peer(key: &str, ip: &str) -> Arc<WgPeer> {
        Arc::new(WgPeer { public_key: key.into(), allowed_ips: vec![ip.into()], endpoint: None, keepalive: None })
    }

    /// Gone, new and changed peers by key; a peer the same as before is no change.
    #[test]
    fn peer_changes_are_found_by_key() {
        let old = vec![peer("a", "10.0.0.1/32"), peer("b", "10.0.0.2/32"), peer("c", "10.0.0.3/32")];
        let new = vec![peer("a", "10.0.0.1/32"), peer("c", "10.0.0.9/32"), peer("d", "10.0.0.4/32")];
        let c = super::peer_changes(&old, &new);
        assert_eq!(c.gone.iter().map(|p| p.public_key.as_str()).collect::<Vec<_>>(), ["b"]);
        let changed: Vec<(&str, Option<&str>)> =
            c.changed.iter().map(|(n, o)| (n.public_key.as_str(), o.as_ref().map(|o| o.allowed_ips[0].as_str()))).collect();
        assert_eq!(changed, [("c", Some("10.0.0.3/32")), ("d", None)]);
        let same = super::peer_changes(&old, &old);
        assert!(same.gone.is_empty() && same.changed.is_empty());
    }
}
