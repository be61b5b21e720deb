//! Service certificates (ADR 0023): which certificates each node may hold and the names each
//! may carry, read from the declaration and the allocation. A node holds one certificate for
//! every module it runs whose manifest has `[module.certificate]`, naming `MODULE.DOMAIN`,
//! `NODE.DOMAIN`, the node's overlay addresses, and `spiffe://DOMAIN/module/MODULE`; nothing
//! else. The controller signs only what this says, and the agent asks only for it. Pure.

use std::net::IpAddr;

use crate::decl::{Declaration, Node};
use crate::Allocation;

/// Where a node's agent writes its service certificates under its root, one directory per
/// module (`MODULE/{key.pem,cert.pem,chain.pem,ca.pem}`).
pub const CERTS_DIR: &str = "etc/trellis/certs";

/// One certificate a node may hold: for `module` on `node`, with exactly these names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCert {
    pub node: String,
    pub module: String,
    /// `MODULE.DOMAIN`, then `NODE.DOMAIN`.
    pub dns: Vec<String>,
    /// The node's overlay addresses, IPv4 first.
    pub ips: Vec<IpAddr>,
    /// `spiffe://DOMAIN/module/MODULE`: the module's identity, which a rule may one day require
    /// of a client.
    pub uri: String,
    /// The group that may read the key.
    pub group: Option<String>,
    /// The systemd unit reloaded after a renewal.
    pub reload: Option<String>,
    /// How long the certificate is valid, in seconds.
    pub lifetime_secs: u64,
}

/// The URI SAN naming a module of the mesh whose zone is `domain`.
pub fn module_uri(domain: &str, module: &str) -> String {
    format!("spiffe://{domain}/module/{module}")
}

/// The certificates `node` may hold in `decl` (its pool's members included, at their pinned
/// addresses), in the order of its `modules`; none for a node not declared.
pub fn for_node(decl: &Declaration, alloc: &Allocation, node: &str) -> Vec<ServiceCert> {
    decl.node(node).map(|n| of(decl, alloc, n)).unwrap_or_default()
}

/// Every certificate every node of `decl` may hold, by node in declaration order.
pub fn all(decl: &Declaration, alloc: &Allocation) -> Vec<ServiceCert> {
    decl.nodes.iter().flat_map(|n| of(decl, alloc, n)).collect()
}

fn of(decl: &Declaration, alloc: &Allocation, n: &Node) -> Vec<ServiceCert> {
    let domain = &decl.mesh.domain;
    let mut ips = Vec::new();
    if decl.mesh.overlay_ipv4.is_some() {
        ips.extend(n.address_ipv4.or_else(|| alloc.ipv4.get(&n.name).copied()).map(IpAddr::V4));
    }
    if decl.mesh.overlay_ipv6.is_some() {
        ips.extend(n.address_ipv6.or_else(|| alloc.ipv6.get(&n.name).copied()).map(IpAddr::V6));
    }
    let mut out: Vec<ServiceCert> = Vec::new();
    for m in &n.modules {
        let Some(spec) = decl.module(m).and_then(|m| m.certificate.as_ref()) else { continue };
        if out.iter().any(|c| &c.module == m) {
            continue;
        }
        out.push(ServiceCert {
            node: n.name.clone(),
            module: m.clone(),
            dns: vec![format!("{m}.{domain}"), format!("{}.{domain}", n.name)],
            ips: ips.clone(),
            uri: module_uri(domain, m),
            group: spec.group.clone(),
            reload: spec.reload.clone(),
            lifetime_secs: decl.mesh.service_cert_secs,
        });
    }
    out
}

/// Units a certificate's renewal never restarts, whatever a declaration says: those whose
/// restart cuts the operator off or stops the node (the agent itself, the SSH server, the
/// network, systemd's own). `reload` names a service unit; a target (`reboot.target`) is refused
/// by its kind.
const CRITICAL_UNITS: &[&str] = &[
    "trellis-agent.service",
    "trellis.service",
    "ssh.service",
    "sshd.service",
    "dbus.service",
    "dbus-broker.service",
    "networking.service",
    "NetworkManager.service",
    "wpa_supplicant.service",
    "nftables.service",
    "getty@.service",
    "serial-getty@.service",
    "emergency.service",
    "rescue.service",
    "debug-shell.service",
    "rc-local.service",
];

/// Why `unit` may not be a certificate's `reload`, if it may not: only a service unit
/// (`NAME.service`), and none whose restart would take the node or the operator's way in down.
pub fn refused_unit(unit: &str) -> Option<&'static str> {
    let Some(name) = unit.strip_suffix(".service").filter(|n| !n.is_empty()) else {
        return Some("is not a service unit (`NAME.service`); a renewal reloads the service that uses the certificate, nothing else");
    };
    if CRITICAL_UNITS.contains(&unit) || name.starts_with("systemd-") || unit.starts_with("getty@") || unit.starts_with("serial-getty@") {
        return Some("is a unit whose restart takes the node, its network or the way in down; a renewal never restarts it");
    }
    None
}

/// Groups a service key is never given to: those whose members are every user, or who hold
/// the host already or can take it (the key would be everyone's, or root's in all but name).
const BROAD_GROUPS: &[&str] = &[
    "root",
    "users",
    "staff",
    "sudo",
    "wheel",
    "adm",
    "admin",
    "disk",
    "shadow",
    "nogroup",
    "nobody",
    "everyone",
    "docker",
    "lxd",
    "libvirt",
    "kvm",
    "systemd-journal",
];

/// Why `group` may not read a service's key, if it may not.
pub fn refused_group(group: &str) -> Option<&'static str> {
    BROAD_GROUPS
        .contains(&group)
        .then_some("is a group of every user or of the host's administrators; name the group of the service that uses the key (`postgres`)")
}
