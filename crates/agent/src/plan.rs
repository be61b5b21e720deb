//! The agent's decisions as values: from a verified bundle, what the agent holds now and what it
//! observes of the host, the list of actions that bring the host to the bundle. Pure: no IO, no
//! clock; the executor (`exec`) carries the actions out.

use std::net::{IpAddr, SocketAddr};

use trellis_core::bundle::{Bundle, BundleFile};
use trellis_core::compile::{MESH_ZONE, NFTABLES_CONF, NODE_TOML, WIREGUARD_CONF};
use trellis_core::nodefile::{NodeFile, NodeFileError};
use trellis_core::wgconf::WgConf;

/// One step of bringing the host to a bundle, in the order the plan lists them: files first
/// (staged, then committed), then the network (forwarding, WireGuard, ruleset, DNS).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Stage every file, commit them all, then remove the files the bundle no longer has.
    WriteFiles { files: Vec<BundleFile>, remove: Vec<String> },
    /// Turn on IPv4 and IPv6 forwarding: a hub relays between its overlay peers.
    EnableForwarding,
    /// Bring the interface to this configuration.
    ConfigureWireguard { interface: String, conf: WgConf },
    /// Send these prefixes into the interface, and with `exit` the default route too (by policy
    /// routing in table `table`, as wg-quick does), removing what a previous bundle had that
    /// this one has not.
    ConfigureRoutes { interface: String, routes: Vec<ipnet::IpNet>, exit: Exit, table: u32 },
    /// Load the ruleset written at this path (relative to the root) in one transaction.
    LoadRuleset { path: String },
    /// Serve the zone written at this path (relative to the root) on these addresses.
    ServeZone { path: String, origin: String, listen: Vec<SocketAddr> },
}

/// Which families' default routes go through the overlay.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Exit {
    pub ipv4: bool,
    pub ipv6: bool,
}

impl Exit {
    pub fn any(self) -> bool {
        self.ipv4 || self.ipv6
    }
}

/// What the agent holds now: the bundle whose files are on disk (its version, content digest
/// and file paths).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub version: u64,
    pub digest: [u8; 32],
    pub files: Vec<String>,
}

impl Held {
    pub fn of(bundle: &Bundle) -> Held {
        Held { version: bundle.version, digest: bundle.content_digest(), files: bundle.files.iter().map(|f| f.path.clone()).collect() }
    }
}

/// What the agent observes of the host.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// IPv4 and IPv6 forwarding are both on.
    pub forwarding: bool,
    /// Routes or an exit are installed by this agent.
    pub routing: bool,
    /// The version and content digest whose network configuration this process applied last,
    /// if it applied one and nothing failed since.
    pub network: Option<(u64, [u8; 32])>,
}

/// What this agent manages, from its options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// Files only: no forwarding, interface, ruleset or DNS.
    pub files_only: bool,
    /// Whether the agent manages the WireGuard interface (and so the DNS on its addresses).
    pub wireguard: bool,
    pub dns_port: u16,
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error("the bundle has no etc/trellis/node.toml")]
    NoSettings,
    #[error("node.toml is not UTF-8")]
    SettingsNotUtf8,
    #[error("{0}")]
    Settings(NodeFileError),
    #[error("wireguard.conf is not UTF-8")]
    ConfNotUtf8,
    #[error("{0}")]
    Conf(String),
}

fn file<'a>(bundle: &'a Bundle, path: &str) -> Option<&'a BundleFile> {
    bundle.files.iter().find(|f| f.path == path)
}

fn settings(bundle: &Bundle) -> Result<NodeFile, PlanError> {
    let f = file(bundle, NODE_TOML).ok_or(PlanError::NoSettings)?;
    NodeFile::parse(std::str::from_utf8(&f.content).map_err(|_| PlanError::SettingsNotUtf8)?).map_err(PlanError::Settings)
}

/// The actions that bring the host from what it holds to `bundle`. A re-delivery of what is
/// held, with its network configuration in place, is no action at all; what is held but not
/// yet applied to the network (after a restart, or a failure) gets the network actions only.
pub fn plan(bundle: &Bundle, held: &Held, observed: &Observed, scope: &Scope) -> Result<Vec<Action>, PlanError> {
    let digest = bundle.content_digest();
    let same = held.version == bundle.version && held.digest == digest;
    let mut actions = Vec::new();
    if !same {
        let remove = held.files.iter().filter(|p| file(bundle, p).is_none()).cloned().collect();
        actions.push(Action::WriteFiles { files: bundle.files.clone(), remove });
    }
    let network = network(bundle, observed, scope)?;
    if !(same && observed.network == Some((bundle.version, digest))) {
        actions.extend(network);
    }
    Ok(actions)
}

/// The network half of a plan: forwarding for a hub, the interface, the ruleset, the zone.
fn network(bundle: &Bundle, observed: &Observed, scope: &Scope) -> Result<Vec<Action>, PlanError> {
    let settings = settings(bundle)?;
    let conf = match file(bundle, WIREGUARD_CONF) {
        Some(f) => Some(
            trellis_core::wgconf::parse(std::str::from_utf8(&f.content).map_err(|_| PlanError::ConfNotUtf8)?).map_err(PlanError::Conf)?,
        ),
        None => None,
    };
    if scope.files_only {
        return Ok(Vec::new());
    }
    let mut actions = Vec::new();
    let mut listen = Vec::new();
    if let (Some(conf), true) = (conf, scope.wireguard) {
        // The zone is served on the overlay addresses of the interface the agent manages.
        listen = conf
            .addresses
            .iter()
            .filter_map(|a| a.split('/').next().and_then(|ip| ip.parse::<IpAddr>().ok()))
            .map(|ip| SocketAddr::new(ip, scope.dns_port))
            .collect();
        // The exit's default prefixes in this node's peer list say which families leave by it.
        let exit = Exit {
            ipv4: settings.exit && conf.peers.iter().any(|p| p.allowed_ips.iter().any(|a| a == "0.0.0.0/0")),
            ipv6: settings.exit && conf.peers.iter().any(|p| p.allowed_ips.iter().any(|a| a == "::/0")),
        };
        let table = u32::from(conf.listen_port.unwrap_or(trellis_core::decl::DEFAULT_PORT));
        actions.push(Action::ConfigureWireguard { interface: settings.interface.clone(), conf });
        if !settings.routes.is_empty() || exit.any() || observed.routing {
            actions.push(Action::ConfigureRoutes { interface: settings.interface.clone(), routes: settings.routes.clone(), exit, table });
        }
    }
    if file(bundle, NFTABLES_CONF).is_some() {
        actions.push(Action::LoadRuleset { path: NFTABLES_CONF.to_string() });
    }
    // Forwarding goes on once the filter that says what may be forwarded is loaded.
    if (settings.hub || settings.router) && !observed.forwarding {
        actions.push(Action::EnableForwarding);
    }
    if file(bundle, MESH_ZONE).is_some() && !listen.is_empty() {
        actions.push(Action::ServeZone { path: MESH_ZONE.to_string(), origin: settings.zone, listen });
    }
    Ok(actions)
}
