//! The wireguard-go backend: a `wireguard-go` found on PATH, started by the agent for the
//! interface and owned as its child (stopped when the agent stops or the interface is replaced),
//! configured through its UAPI socket with the text protocol of
//! <https://www.wireguard.com/xplatform/>; addresses, MTU and link state with `ip`.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine;
use trellis_core::wgconf::{WgConf, WgPeer};

use super::traits::{changes_from, PeerChanges, Wireguard};
use crate::status::PeerState;

/// Where wireguard-go (like boringtun and `wg`) keeps its control sockets.
const SOCKET_DIR: &str = "/var/run/wireguard";
/// The most one UAPI answer may hold: a `get` of ten thousand peers is well under it.
const MAX_ANSWER: usize = 8 << 20;
const SOCKET_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a new wireguard-go has to open its control socket.
const START_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a stopped wireguard-go has to end after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// The `wireguard-go` program on PATH, if there is one.
pub fn find() -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join("wireguard-go"))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
}

/// The sentence for a host without wireguard-go.
pub const MISSING: &str =
    "--wireguard wireguard-go: no `wireguard-go` on PATH; install it (Debian package wireguard-go) or choose another backend";

pub struct WireguardGo {
    ifname: String,
    socket: PathBuf,
    child: Option<Child>,
    current: Option<std::sync::Arc<WgConf>>,
}

impl WireguardGo {
    pub fn new(ifname: &str) -> Self {
        WireguardGo { ifname: ifname.to_string(), socket: Path::new(SOCKET_DIR).join(format!("{ifname}.sock")), child: None, current: None }
    }

    /// Starts wireguard-go for the interface and brings it to `conf`; on any failure the process
    /// is stopped again, so nothing half made stays.
    fn start(&mut self, conf: &WgConf, private_key: &str) -> Result<()> {
        let program = find().context(MISSING)?;
        if UnixStream::connect(&self.socket).is_ok() {
            bail!(
                "{} already answers: another WireGuard process serves {}; stop it before the agent starts wireguard-go",
                self.socket.display(),
                self.ifname
            );
        }
        let mut cmd = Command::new(&program);
        // In the foreground wireguard-go stays the agent's child. It logs (errors only, unless
        // LOG_LEVEL says more) on its standard output, which goes to the agent's log.
        cmd.arg(&self.ifname).env("WG_PROCESS_FOREGROUND", "1").stdin(Stdio::null()).stdout(std::io::stderr());
        let agent = nix::unistd::getpid();
        // SAFETY: between fork and exec the closure calls only prctl and getppid, which are
        // async-signal-safe, and allocates nothing (the capabilities lowered are a fixed array).
        unsafe {
            cmd.pre_exec(move || {
                // An agent that dies, even by SIGKILL, takes its wireguard-go with it (the
                // agent runs its applies on its main thread, so the thread that forked lives
                // as long as the process).
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
                if nix::unistd::getppid() != agent {
                    return Err(std::io::Error::other("the agent ended before wireguard-go started"));
                }
                // wireguard-go needs CAP_NET_ADMIN for its TUN device and nothing else of what
                // the agent's unit gives the agent (CAP_CHOWN for service keys, CAP_NET_RAW,
                // CAP_NET_BIND_SERVICE): only that one is left in its ambient set.
                // linux/capability.h: CAP_CHOWN 0, CAP_NET_BIND_SERVICE 10, CAP_NET_RAW 13.
                for cap in [0u32, 10, 13] {
                    // A capability the set does not hold is no failure; prctl with integer
                    // arguments only.
                    let _ = libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_LOWER as libc::c_ulong, cap as libc::c_ulong, 0, 0);
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("cannot start {}", program.display()))?;
        self.child = Some(child);
        let configured = self.await_socket(&program).and_then(|()| self.configure(conf, private_key));
        if configured.is_err() {
            self.stop();
        }
        configured
    }

    /// Waits until the new process answers on its control socket.
    fn await_socket(&mut self, program: &Path) -> Result<()> {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            if UnixStream::connect(&self.socket).is_ok() {
                return Ok(());
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                bail!(
                    "{} for {} exited ({status}) before its control socket {} appeared; its message is in the agent's log",
                    program.display(),
                    self.ifname,
                    self.socket.display()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "{} for {} opened no control socket at {} within {START_TIMEOUT:?}",
                    program.display(),
                    self.ifname,
                    self.socket.display()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// MTU and addresses with `ip`, key, port and peers over UAPI, then the link up.
    fn configure(&self, conf: &WgConf, private_key: &str) -> Result<()> {
        if let Some(mtu) = conf.mtu {
            ip(&["link", "set", "dev", &self.ifname, "mtu", &mtu.to_string()])?;
        }
        for a in &conf.addresses {
            ip(&["address", "add", a, "dev", &self.ifname])?;
        }
        self.set(&set_device(conf, private_key)?)?;
        ip(&["link", "set", "dev", &self.ifname, "up"])
    }

    /// Stops the process (SIGTERM, then SIGKILL after a while) and waits until it and its
    /// interface are gone.
    fn stop(&mut self) {
        self.current = None;
        let Some(mut child) = self.child.take() else { return };
        if let Ok(pid) = i32::try_from(child.id()) {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::Signal::SIGTERM);
        }
        let deadline = Instant::now() + STOP_TIMEOUT;
        while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
        // The socket of a process that is gone answers nothing; a new one would remove it too.
        let _ = std::fs::remove_file(&self.socket);
        // The TUN device goes with the process's last descriptor; a new process for the same
        // name needs it gone.
        let link = Path::new("/sys/class/net").join(&self.ifname);
        let deadline = Instant::now() + STOP_TIMEOUT;
        while link.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One `set=1` transaction.
    fn set(&self, body: &str) -> Result<()> {
        exchange(&self.socket, format!("set=1\n{body}\n").as_bytes())
            .with_context(|| format!("wireguard-go refused the configuration of {}", self.ifname))
            .map(drop)
    }
}

impl Drop for WireguardGo {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Wireguard for WireguardGo {
    fn apply(&mut self, conf: &std::sync::Arc<WgConf>, private_key: &str, edit: Option<&crate::plan::Edit>) -> Result<()> {
        let running = self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)));
        let same_interface = running
            && self
                .current
                .as_ref()
                .is_some_and(|c| c.addresses == conf.addresses && c.listen_port == conf.listen_port && c.mtu == conf.mtu);
        if same_interface {
            // Peers change in place: the interface and the other peers' sessions stay up.
            let old = self.current.as_ref().expect("configured");
            let body = set_peers(&changes_from(old, conf, edit))?;
            if !body.is_empty() {
                // wireguard-go takes a `set` line by line: whatever part of a refused one took,
                // the device is no longer what `current` says. Forgotten, so that the next
                // apply (the rollback's) makes the interface anew.
                self.current = None;
                self.set(&body)?;
            }
        } else {
            self.stop();
            self.start(conf, private_key)?;
        }
        self.current = Some(conf.clone());
        Ok(())
    }

    fn peers(&self) -> Result<Vec<PeerState>> {
        if self.child.is_none() {
            return Ok(Vec::new());
        }
        parse_peers(&exchange(&self.socket, b"get=1\n\n")?)
    }

    fn describe(&self) -> String {
        format!("{} (wireguard-go)", self.ifname)
    }

    fn restart_handshakes(&self, public_keys: &[String]) -> Result<()> {
        let Some(current) = self.current.as_ref().filter(|_| self.child.is_some()) else { return Ok(()) };
        let body = restart_peers(&current.peers, public_keys)?;
        if !body.is_empty() {
            self.set(&body)?;
        }
        Ok(())
    }
}

/// The `set=1` body that removes the named peers of `peers` and adds them again as they are.
fn restart_peers(peers: &[std::sync::Arc<WgPeer>], public_keys: &[String]) -> Result<String> {
    let mut out = String::new();
    for p in super::traits::named(peers, public_keys) {
        out.push_str(&format!("public_key={}\nremove=true\n", hex_key(&p.public_key)?));
        peer_lines(p, &mut out)?;
    }
    Ok(out)
}

/// Runs `ip ARGS`; its complaint is the error.
fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("cannot run ip (is iproute2 installed?)")?;
    if !out.status.success() {
        bail!("ip {} failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// One UAPI exchange: sends `request` (which ends in a blank line) and reads the answer up to the
/// blank line that ends it, at most `MAX_ANSWER` bytes and `SOCKET_TIMEOUT` a read. Returns the
/// lines before `errno=0`; another errno is an error.
fn exchange(socket: &Path, request: &[u8]) -> Result<String> {
    let at = socket.display();
    let mut s = UnixStream::connect(socket).with_context(|| format!("cannot connect to {at}"))?;
    s.set_read_timeout(Some(SOCKET_TIMEOUT)).and_then(|()| s.set_write_timeout(Some(SOCKET_TIMEOUT))).with_context(|| format!("{at}"))?;
    s.write_all(request).with_context(|| format!("cannot write to {at}"))?;
    let mut answer = Vec::new();
    let mut chunk = [0u8; 16 * 1024];
    // Every line of an answer holds a key, so the first blank line ends it.
    while !answer.ends_with(b"\n\n") {
        let n = s.read(&mut chunk).with_context(|| format!("no complete answer from {at}"))?;
        if n == 0 {
            bail!("{at} closed the connection before its answer ended");
        }
        answer.extend_from_slice(&chunk[..n]);
        if answer.len() > MAX_ANSWER {
            bail!("the answer from {at} exceeds {MAX_ANSWER} bytes");
        }
    }
    let text = String::from_utf8(answer).with_context(|| format!("the answer from {at} is not UTF-8"))?;
    let (body, last) = text.trim_end().rsplit_once('\n').unwrap_or(("", text.trim_end()));
    match last.strip_prefix("errno=") {
        Some("0") => Ok(body.to_string()),
        Some(n) => bail!("errno={n}"),
        None => bail!("the answer from {at} does not end with errno"),
    }
}

/// A key as the UAPI wants it: 64 hex digits, from the base64 of the files.
fn hex_key(b64: &str) -> Result<String> {
    let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).ok().filter(|k| k.len() == 32);
    raw.map(hex::encode).with_context(|| format!("{b64:?} is not a WireGuard key (base64 of 32 bytes)"))
}

/// The `set=1` body that makes the whole device: its key, its port and exactly these peers.
fn set_device(conf: &WgConf, private_key: &str) -> Result<String> {
    let key = hex_key(private_key).map_err(|_| anyhow::anyhow!("the private key is not a WireGuard key (base64 of 32 bytes)"))?;
    // WireGuard's own packets carry the mark (the listen port), so that an exit's policy routing
    // (`routes`) keeps them out of the tunnel, as wg-quick does.
    let port = conf.listen_port.unwrap_or(51820);
    let mut out = format!("private_key={key}\nlisten_port={port}\nfwmark={port}\nreplace_peers=true\n");
    for p in &conf.peers {
        peer_lines(p, &mut out)?;
    }
    Ok(out)
}

/// The `set=1` body that makes `changes` in place; empty when there are none. A peer that loses
/// its endpoint is removed and added again (UAPI cannot clear one).
fn set_peers(changes: &PeerChanges) -> Result<String> {
    let mut out = String::new();
    for gone in &changes.gone {
        out.push_str(&format!("public_key={}\nremove=true\n", hex_key(&gone.public_key)?));
    }
    for (p, before) in &changes.changed {
        if before.as_ref().is_some_and(|o| o.endpoint.is_some() && p.endpoint.is_none()) {
            out.push_str(&format!("public_key={}\nremove=true\n", hex_key(&p.public_key)?));
        }
        peer_lines(p, &mut out)?;
    }
    Ok(out)
}

/// One peer, every setting said (keepalive 0 when none, allowed IPs replaced), so the same
/// lines create it or bring an existing one to it.
fn peer_lines(p: &WgPeer, out: &mut String) -> Result<()> {
    out.push_str(&format!("public_key={}\n", hex_key(&p.public_key)?));
    if let Some(e) = p.endpoint {
        out.push_str(&format!("endpoint={e}\n"));
    }
    out.push_str(&format!("persistent_keepalive_interval={}\nreplace_allowed_ips=true\n", p.keepalive.unwrap_or(0)));
    for a in &p.allowed_ips {
        out.push_str(&format!("allowed_ip={a}\n"));
    }
    Ok(())
}

/// The peers of a `get=1` answer: each starts at its `public_key` line.
fn parse_peers(body: &str) -> Result<Vec<PeerState>> {
    let mut peers: Vec<PeerState> = Vec::new();
    for line in body.lines() {
        let (key, value) = line.split_once('=').with_context(|| format!("unexpected line in a UAPI answer: {line:?}"))?;
        match (key, peers.last_mut()) {
            ("public_key", _) => {
                let raw = hex::decode(value)
                    .ok()
                    .filter(|k| k.len() == 32)
                    .with_context(|| format!("peer key {value:?} is not 64 hex digits"))?;
                let public_key = base64::engine::general_purpose::STANDARD.encode(raw);
                peers.push(PeerState::new(public_key, None, None));
            }
            ("endpoint", Some(p)) => p.endpoint = Some(value.to_string()),
            ("last_handshake_time_sec", Some(p)) => p.last_handshake = value.parse().ok().filter(|s| *s != 0),
            ("allowed_ip", Some(p)) => p.allowed_ips.push(value.to_string()),
            ("rx_bytes", Some(p)) => p.rx_bytes = value.parse().unwrap_or(0),
            ("tx_bytes", Some(p)) => p.tx_bytes = value.parse().unwrap_or(0),
            _ => {}
        }
    }
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "YWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWFhYWE=";
    const B: &str = "YmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmJiYmI=";
    const C: &str = "Y2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2NjY2M=";

    fn peer(key: &str, endpoint: Option<&str>, keepalive: Option<u16>, ips: &[&str]) -> std::sync::Arc<WgPeer> {
        std::sync::Arc::new(WgPeer {
            public_key: key.into(),
            allowed_ips: ips.iter().map(|s| s.to_string()).collect(),
            endpoint: endpoint.map(|e| e.parse().unwrap()),
            keepalive,
        })
    }

    /// The body that takes the peers `old` to `new`.
    fn set_between(old: &[std::sync::Arc<WgPeer>], new: &[std::sync::Arc<WgPeer>]) -> Result<String> {
        set_peers(&trellis_core::wgconf::changes(old, new))
    }

    #[test]
    fn the_device_is_set_whole_with_hex_keys() {
        let conf = WgConf {
            addresses: vec!["10.88.0.5/16".into()],
            listen_port: Some(51821),
            mtu: Some(1420),
            peers: vec![peer(A, Some("192.0.2.11:51820"), Some(25), &["10.88.0.6/32", "fd88::6/128"])],
        };
        let a = hex::encode([b'a'; 32]);
        let b = hex::encode([b'b'; 32]);
        assert_eq!(
            set_device(&conf, B).unwrap(),
            format!(
                "private_key={b}\nlisten_port=51821\nfwmark=51821\nreplace_peers=true\npublic_key={a}\nendpoint=192.0.2.11:51820\npersistent_keepalive_interval=25\nreplace_allowed_ips=true\nallowed_ip=10.88.0.6/32\nallowed_ip=fd88::6/128\n"
            )
        );
        let e = set_device(&conf, "not a key").unwrap_err().to_string();
        assert!(!e.contains("not a key"), "the private key never shows in an error: {e}");
    }

    #[test]
    fn peers_change_in_place() {
        let (a, b) = (hex::encode([b'a'; 32]), hex::encode([b'b'; 32]));
        let old = vec![peer(A, Some("192.0.2.11:51820"), None, &["10.88.0.6/32"]), peer(B, None, None, &["10.88.0.7/32"])];
        assert_eq!(set_between(&old, &old).unwrap(), "", "nothing changed, nothing sent");
        // B goes, A's allowed IPs change: A is updated, not removed.
        let new = vec![peer(A, Some("192.0.2.11:51820"), None, &["10.88.0.6/32", "10.88.0.9/32"])];
        assert_eq!(
            set_between(&old, &new).unwrap(),
            format!("public_key={b}\nremove=true\npublic_key={a}\nendpoint=192.0.2.11:51820\npersistent_keepalive_interval=0\nreplace_allowed_ips=true\nallowed_ip=10.88.0.6/32\nallowed_ip=10.88.0.9/32\n")
        );
        // A loses its endpoint: removed and added again, since UAPI cannot clear an endpoint.
        let new = vec![peer(A, None, Some(25), &["10.88.0.6/32"]), old[1].clone()];
        assert_eq!(
            set_between(&old, &new).unwrap(),
            format!("public_key={a}\nremove=true\npublic_key={a}\npersistent_keepalive_interval=25\nreplace_allowed_ips=true\nallowed_ip=10.88.0.6/32\n")
        );
        assert!(set_between(&[], &[peer("short", None, None, &[])]).unwrap_err().to_string().contains("is not a WireGuard key"));
    }

    #[test]
    fn a_restarted_handshake_removes_the_peer_and_adds_it_back_as_it_was() {
        let a = hex::encode([b'a'; 32]);
        let peers = vec![peer(A, Some("192.0.2.11:51820"), Some(25), &["10.88.0.6/32"]), peer(B, None, None, &["10.88.0.7/32"])];
        assert_eq!(
            restart_peers(&peers, &[A.to_string(), C.to_string()]).unwrap(),
            format!("public_key={a}\nremove=true\npublic_key={a}\nendpoint=192.0.2.11:51820\npersistent_keepalive_interval=25\nreplace_allowed_ips=true\nallowed_ip=10.88.0.6/32\n"),
            "only A: C is not a peer, B is not named"
        );
        assert_eq!(restart_peers(&peers, &[]).unwrap(), "");
    }

    #[test]
    fn a_get_answer_gives_the_peers() {
        let a = hex::encode([b'a'; 32]);
        let b = hex::encode([b'b'; 32]);
        let body = format!(
            "private_key={b}\nlisten_port=51820\npublic_key={a}\npreshared_key=0000\nprotocol_version=1\nendpoint=192.0.2.11:51820\nlast_handshake_time_sec=1700000000\nlast_handshake_time_nsec=5\ntx_bytes=1\nrx_bytes=2\npersistent_keepalive_interval=0\nallowed_ip=10.88.0.6/32\npublic_key={b}\nlast_handshake_time_sec=0\n"
        );
        let peers = parse_peers(&body).unwrap();
        assert_eq!(peers.len(), 2);
        assert_eq!(
            (peers[0].public_key.as_str(), peers[0].endpoint.as_deref(), peers[0].last_handshake),
            (A, Some("192.0.2.11:51820"), Some(1_700_000_000))
        );
        assert_eq!((peers[1].public_key.as_str(), peers[1].endpoint.as_deref(), peers[1].last_handshake), (B, None, None));
        assert!(parse_peers("garbage").is_err());
    }

    /// The exchange against a socket that answers as wireguard-go does, and one that never ends
    /// its answer: the read stops at the bound.
    #[test]
    fn an_exchange_reads_one_answer_and_no_more_than_the_bound() {
        let dir = std::env::temp_dir().join(format!("trellis-uapi-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.sock");
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let server = std::thread::spawn(move || {
            let answers: [&[u8]; 3] = [b"listen_port=1\nerrno=0\n\n", b"errno=22\n\n", &[b'x'; MAX_ANSWER + 20_000]];
            for answer in answers {
                let (mut c, _) = listener.accept().unwrap();
                let mut buf = [0u8; 64];
                let _ = c.read(&mut buf);
                let _ = c.write_all(answer);
            }
        });
        assert_eq!(exchange(&path, b"get=1\n\n").unwrap(), "listen_port=1");
        assert_eq!(exchange(&path, b"set=1\n\n").unwrap_err().to_string(), "errno=22");
        assert!(exchange(&path, b"get=1\n\n").unwrap_err().to_string().contains("exceeds"));
        server.join().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}
