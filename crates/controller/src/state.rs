//! The controller's state directory: mesh CA, TLS certificate, bundle-signing key, admin
//! credential and configuration, made once by `trellis init`. Made before any controller
//! exists, on the system clock and the operating system's randomness (the two a controller
//! opened from it is given).

use std::path::{Path, PathBuf};
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use base64::Engine;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use trellis_files as files;

use crate::layout::{
    ADMIN_TOKEN, CA_CERT, CA_KEY, CONFIG, DATABASE, NEXT_CA_CERT, SERVER_CERT, SERVER_KEY, SERVICES_CA_CERT, SERVICES_CA_KEY, SIGNING_KEY,
};
use crate::{Clock, Entropy, OsEntropy, SystemClock};

#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where agents and admins reach the controller, HOST:PORT; carried in every token.
    pub advertise: Vec<String>,
    /// The socket address `serve` listens on.
    pub listen: String,
    pub database_url: String,
    /// SHA-256 (hex) of the admin credential; the credential itself is in `admin.token`.
    pub admin_token_sha256: String,
    /// Lifetime of node certificates, in seconds.
    pub node_cert_secs: u64,
    /// Lifetime of the controller's server certificate, in seconds (five years unless set); it
    /// is renewed while serving at two thirds of it.
    #[serde(default = "server_cert_secs")]
    pub server_cert_secs: u64,
}

/// The shortest lifetime a server certificate may be given: it is looked at every 5 s.
pub const MIN_SERVER_CERT_SECS: u64 = 30;
/// The longest: twenty years.
pub const MAX_SERVER_CERT_SECS: u64 = 20 * 365 * 86400;

fn server_cert_secs() -> u64 {
    trellis_pki::SERVER_CERT_SECS
}

pub struct StateDir {
    pub dir: PathBuf,
    pub config: Config,
}

impl StateDir {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    pub fn load(dir: &Path) -> Result<StateDir> {
        let path = dir.join(CONFIG);
        let text = files::read(&path)
            .with_context(|| format!("{} holds no controller; run `trellis init --state-dir {}` first", dir.display(), dir.display()))?;
        let config: Config =
            toml::from_str(&text).with_context(|| format!("{} is not a valid controller configuration", path.display()))?;
        if !(MIN_SERVER_CERT_SECS..=MAX_SERVER_CERT_SECS).contains(&config.server_cert_secs) {
            bail!(
                "{}: server_cert_secs is {}; it must be from {MIN_SERVER_CERT_SECS} to {MAX_SERVER_CERT_SECS} (20 years)",
                path.display(),
                config.server_cert_secs
            );
        }
        Ok(StateDir { dir: dir.to_path_buf(), config })
    }

    pub fn read(&self, name: &str) -> Result<String> {
        Ok(files::read(&self.path(name))?)
    }

    /// How an admin on this machine reaches the controller: its first advertised HOST:PORT, the
    /// mesh CA certificate (with the next one during a CA rotation, so that a command begun just
    /// before the rotation completes is not refused the new server certificate) and the admin
    /// credential.
    pub fn admin_access(&self) -> Result<(String, String, String)> {
        let host = self.config.advertise.first().context("controller.toml advertises no address")?;
        let mut cas = self.read(CA_CERT)?;
        if let Ok(next) = self.read(NEXT_CA_CERT) {
            if !cas.ends_with('\n') {
                cas.push('\n');
            }
            cas.push_str(&next);
        }
        Ok((host.clone(), cas, self.read(ADMIN_TOKEN)?))
    }

    /// The services intermediate CA (ADR 0023), if this state directory has one: one made before
    /// service certificates has none, and its controller refuses to sign them.
    pub fn services_ca(&self) -> Result<Option<trellis_pki::ServicesCa>> {
        if !self.path(SERVICES_CA_KEY).exists() {
            return Ok(None);
        }
        let ca = trellis_pki::ServicesCa::load(&self.read(SERVICES_CA_CERT)?, &self.read(SERVICES_CA_KEY)?)
            .with_context(|| format!("{} does not hold a services CA", self.path(SERVICES_CA_CERT).display()))?;
        Ok(Some(ca))
    }

    pub fn signing_key(&self) -> Result<ed25519_dalek::SigningKey> {
        let text = self.read(SIGNING_KEY)?;
        let bytes =
            base64::engine::general_purpose::STANDARD.decode(text.trim()).with_context(|| format!("{SIGNING_KEY} is not base64"))?;
        let seed: [u8; 32] = bytes.try_into().map_err(|_| anyhow::anyhow!("{SIGNING_KEY} does not hold 32 bytes"))?;
        Ok(ed25519_dalek::SigningKey::from_bytes(&seed))
    }
}

pub struct InitOptions {
    pub advertise: Vec<String>,
    pub listen: Option<String>,
    pub database_url: Option<String>,
    pub node_cert_secs: u64,
}

/// Splits HOST:PORT (with `[v6]:PORT`) into host and port.
pub fn split_host_port(s: &str) -> Result<(String, u16)> {
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let (h, p) = rest.split_once("]:").with_context(|| format!("{s:?} is not [IPv6]:PORT"))?;
        (h.to_string(), p)
    } else {
        let (h, p) = s.rsplit_once(':').with_context(|| format!("advertise address {s:?} needs a port, as HOST:PORT"))?;
        if h.contains(':') {
            bail!("advertise address {s:?}: write an IPv6 address as [ADDRESS]:PORT");
        }
        (h.to_string(), p)
    };
    let port: u16 = port.parse().ok().filter(|p| *p > 0).with_context(|| format!("advertise address {s:?} has no valid port"))?;
    if host.is_empty() {
        bail!("advertise address {s:?} has no host");
    }
    Ok((host, port))
}

/// Bytes from the operating system's randomness.
fn random<const N: usize>() -> [u8; N] {
    let mut b = [0u8; N];
    OsEntropy.fill(&mut b);
    b
}

/// Creates a controller in `dir`. Refuses a directory that already holds one.
pub async fn init(dir: &Path, opts: &InitOptions) -> Result<StateDir> {
    if opts.advertise.is_empty() {
        bail!("give at least one --advertise HOST:PORT: it is where nodes will reach the controller");
    }
    let mut hosts = Vec::new();
    for a in &opts.advertise {
        hosts.push(split_host_port(a)?.0);
    }
    if dir.join(CONFIG).exists() || dir.join(CA_KEY).exists() {
        bail!("{} already holds a controller ({}); refusing to overwrite it", dir.display(), CONFIG);
    }
    // Made private, or refused if it exists open to others; never chmod'ed.
    files::private_dir(dir)?;
    let now = UNIX_EPOCH + Duration::from_secs(SystemClock.now().max(0) as u64);
    let ca = trellis_pki::create_ca("trellis", now, random())?;
    let ca_loaded = trellis_pki::Ca::load(&ca.cert_pem, &ca.key_pem)?;
    let server = ca_loaded.server_cert(&hosts, now, Duration::from_secs(trellis_pki::SERVER_CERT_SECS), random())?;
    let services = ca_loaded.services_ca("trellis", now, random())?;
    let signing = ed25519_dalek::SigningKey::from_bytes(&random());
    let admin: [u8; 32] = random();
    let admin_token = format!("trellis-admin-{}", hex::encode(admin));
    let (_, port) = split_host_port(&opts.advertise[0])?;
    let (first_host, _) = split_host_port(&opts.advertise[0])?;
    let any = if first_host.contains(':') { "[::]" } else { "0.0.0.0" };
    let listen = opts.listen.clone().unwrap_or_else(|| format!("{any}:{port}"));
    listen.parse::<std::net::SocketAddr>().with_context(|| format!("--listen {listen:?} is not a socket address such as 0.0.0.0:8443"))?;
    let database_url = opts.database_url.clone().unwrap_or_else(|| format!("sqlite://{}?mode=rwc", dir.join(DATABASE).display()));
    let config = Config {
        advertise: opts.advertise.clone(),
        listen,
        database_url: database_url.clone(),
        admin_token_sha256: hex::encode(Sha256::digest(admin_token.as_bytes())),
        node_cert_secs: opts.node_cert_secs,
        server_cert_secs: trellis_pki::SERVER_CERT_SECS,
    };
    files::create_new(&dir.join(CA_KEY), ca.key_pem.as_bytes(), 0o600)?;
    files::create_new(&dir.join(CA_CERT), ca.cert_pem.as_bytes(), 0o644)?;
    files::create_new(&dir.join(SERVER_KEY), server.key_pem.as_bytes(), 0o600)?;
    files::create_new(&dir.join(SERVER_CERT), server.cert_pem.as_bytes(), 0o644)?;
    files::create_new(&dir.join(SERVICES_CA_KEY), services.key_pem.as_bytes(), 0o600)?;
    files::create_new(&dir.join(SERVICES_CA_CERT), services.cert_pem.as_bytes(), 0o644)?;
    files::create_new(&dir.join(SIGNING_KEY), base64::engine::general_purpose::STANDARD.encode(signing.to_bytes()).as_bytes(), 0o600)?;
    files::create_new(&dir.join(ADMIN_TOKEN), format!("{admin_token}\n").as_bytes(), 0o600)?;
    trellis_store::Store::open(&database_url).await.with_context(|| format!("cannot create the database {database_url}"))?;
    // The configuration is written last: its presence means the controller is complete.
    files::create_new(&dir.join(CONFIG), toml::to_string(&config)?.as_bytes(), 0o600)?;
    Ok(StateDir { dir: dir.to_path_buf(), config })
}

/// A database URL without its password, for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s => {
            let creds = &url[s + 3..at];
            let user = creds.split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..s + 3], &url[at..])
        }
        _ => url.to_string(),
    }
}

/// SHA-256 fingerprint of the mesh CA, hex, for display.
pub fn ca_fingerprint_hex(state: &StateDir) -> Result<String> {
    let der = trellis_pki::pem_to_der(&state.read(CA_CERT)?, "CERTIFICATE")?;
    Ok(hex::encode(Sha256::digest(der)))
}
