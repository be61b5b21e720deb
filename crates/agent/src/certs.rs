//! Service certificates on the node (ADR 0023): for every module the controller says this node
//! is to hold a certificate for, a key made here, a CSR sent over the node's mutual-TLS session,
//! and the answer written atomically to `etc/trellis/certs/MODULE/{key.pem,cert.pem,chain.pem,
//! ca.pem}` under the root, then the module's unit reloaded. Renewed at two thirds of the
//! lifetime, earlier by a jitter of up to a twelfth of it (so that nodes certified together do
//! not renew together); a renewal that fails keeps the files in place and says so in the
//! status. The directory of a module no longer listed is removed.
//!
//! What to do is decided by [`plan`], a function of what is on disk, the list and the time;
//! [`Certs::tend`] carries it out through the client, the file writer and the [`Reloader`].

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;

use anyhow::{bail, Context, Result};
use sha2::{Digest, Sha256};
use trellis_client::NodeClient;
use trellis_files::beneath::Beneath;
use trellis_pki::services::SERVICE_BACKDATE_SECS;
use trellis_proto as proto;

use crate::status::CertStatus;

pub use trellis_core::certs::CERTS_DIR;
pub const KEY: &str = "key.pem";
pub const CERT: &str = "cert.pem";
pub const CHAIN: &str = "chain.pem";
pub const CA: &str = "ca.pem";
/// The files of one module's directory, in the order they are committed: the key first.
const FILES: [&str; 4] = [KEY, CERT, CHAIN, CA];

/// How often the list is asked for when no certificate is due sooner: a module assigned to the
/// node is noticed at the latest by then (at once when it comes with a new bundle).
pub const LIST_EVERY_SECS: i64 = 300;
/// The wait after a failed request before asking again.
pub const RETRY_SECS: i64 = 30;

/// The controller's side: signs a CSR for one module, or says why not. The node's client over
/// its mutual-TLS session on a real host; tests sign in process.
pub trait Signer: Sync {
    fn sign<'a>(
        &'a self,
        req: &'a proto::ServiceCertRequest,
    ) -> Pin<Box<dyn Future<Output = Result<proto::ServiceCertResponse>> + Send + 'a>>;
}

impl Signer for NodeClient {
    fn sign<'a>(
        &'a self,
        req: &'a proto::ServiceCertRequest,
    ) -> Pin<Box<dyn Future<Output = Result<proto::ServiceCertResponse>> + Send + 'a>> {
        Box::pin(async move { self.sign_service_certificate(req).await.map_err(crate::identity::controller_error) })
    }
}

/// Tells a service its certificate was replaced: `systemctl reload-or-restart UNIT` on a real
/// host; tests record the calls.
pub trait Reloader: Send {
    fn reload(&mut self, unit: &str) -> Result<()>;
}

/// The host's: `systemctl try-reload-or-restart UNIT`, which reloads (or restarts) a service that
/// runs and starts none that does not: a renewal never brings up a unit (a debug shell, say) the
/// operator has not started. The unit is first resolved to its own name, so that an alias is
/// checked as what it is.
pub struct Systemctl;

impl Reloader for Systemctl {
    fn reload(&mut self, unit: &str) -> Result<()> {
        let id = std::process::Command::new("systemctl")
            .args(["show", "--property=Id", "--value", "--", unit])
            .output()
            .with_context(|| format!("cannot run systemctl to look up {unit}"))?;
        let id = String::from_utf8_lossy(&id.stdout).trim().to_string();
        if let Some(why) = (!id.is_empty() && id != unit).then(|| trellis_core::certs::refused_unit(&id)).flatten() {
            bail!("{unit} is another name of {id}, which {why}; not reloaded");
        }
        let out = std::process::Command::new("systemctl")
            .args(["try-reload-or-restart", "--", unit])
            .output()
            .with_context(|| format!("cannot run systemctl to reload {unit}"))?;
        if !out.status.success() {
            bail!("systemctl try-reload-or-restart {unit} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }
}

/// `text` cut to at most `max` bytes, at a character boundary.
fn cut(text: &str, max: usize) -> String {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// When a certificate valid from `not_before` to `not_after` is renewed: at two thirds of its
/// lifetime, counted from its issuance (`not_before` is backdated for slow clocks by
/// [`SERVICE_BACKDATE_SECS`]), earlier by up to a twelfth of it, by an amount drawn from its
/// serial (the same for the same certificate every time it is asked, spread over certificates).
pub fn renew_at(not_before: i64, not_after: i64, serial: &str) -> i64 {
    let issued = (not_before + SERVICE_BACKDATE_SECS).min(not_after);
    let life = (not_after - issued).max(0);
    let spread = life / 12;
    let draw = u64::from_be_bytes(Sha256::digest(serial.as_bytes())[..8].try_into().expect("8 bytes"));
    let jitter = if spread > 0 { (draw % spread as u64) as i64 } else { 0 };
    issued + life * 2 / 3 - jitter
}

/// What is on disk for one module: the certificate's serial, validity and names, when it reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub serial: String,
    pub not_before: i64,
    pub not_after: i64,
    pub names: (Vec<String>, Vec<String>, Vec<String>),
}

/// What to do for one module.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Ask for a certificate: there is none, its names are no longer the declared ones, or it is
    /// due.
    Issue(proto::ServiceCertSpec),
    /// Nothing until then.
    Keep { module: String, renew_at: i64 },
    /// The module is no longer listed: its files go.
    Remove(String),
}

/// The steps that bring the node's certificates to `list`, given what is `held` (by module) at
/// `now`.
pub fn plan(list: &proto::ServiceCertList, held: &[(String, Option<Held>)], now: i64) -> Vec<Step> {
    let mut steps = Vec::new();
    for spec in &list.certificates {
        let on_disk = held.iter().find(|(m, _)| *m == spec.module).and_then(|(_, h)| h.as_ref());
        let want = (spec.dns.clone(), spec.ips.clone(), vec![spec.uri.clone()]);
        match on_disk {
            Some(h) if h.names == want && now < renew_at(h.not_before, h.not_after, &h.serial) => {
                steps.push(Step::Keep { module: spec.module.clone(), renew_at: renew_at(h.not_before, h.not_after, &h.serial) })
            }
            _ => steps.push(Step::Issue(spec.clone())),
        }
    }
    for (module, _) in held {
        if !list.certificates.iter().any(|s| &s.module == module) {
            steps.push(Step::Remove(module.clone()));
        }
    }
    steps
}

/// The node's service certificates: what is on disk under `root`, the controller's list, and
/// when to look again.
pub struct Certs {
    root: PathBuf,
    reloader: Option<Box<dyn Reloader>>,
    /// Unix seconds at which `tend` next asks the controller.
    next: i64,
    status: Vec<CertStatus>,
    /// The status as the controller last acknowledged it: reported again only when it changes.
    reported: Option<Vec<CertStatus>>,
    /// Every certificate is issued again at the next look, whatever its age (a CA rotation:
    /// its chain must lead to the next CA).
    reissue: bool,
}

impl Certs {
    pub fn new(root: &Path, reloader: Option<Box<dyn Reloader>>) -> Certs {
        Certs { root: root.to_path_buf(), reloader, next: 0, status: Vec::new(), reported: None, reissue: false }
    }

    pub fn status(&self) -> &[CertStatus] {
        &self.status
    }

    /// Unix seconds at which [`Certs::tend`] next has something to do: a renewal due, a retry,
    /// or the list to be asked for again. The run loop wakes for it even in a long-poll.
    pub fn next_due(&self) -> i64 {
        self.next
    }

    /// Issues every certificate again at the next look (now), whatever its age.
    pub fn reissue_all(&mut self) {
        self.reissue = true;
        self.next = 0;
    }

    /// Asks for the certificate list and acts on it, when it is time (`force`: now, as after a
    /// new bundle). Failures are kept per module in the status; the files in place stay.
    pub async fn tend(&mut self, client: &NodeClient, now: i64, force: bool) {
        if !force && now < self.next {
            return;
        }
        let list = match client.service_certificates().await {
            Ok(l) => l,
            Err(e) => {
                // Nothing on disk is touched. None reachable: asked again soon. An answer that
                // refuses (a controller without service certificates answers 404): asked again
                // at the list's pace, so an old controller is not asked every few seconds.
                tracing::debug!("service certificate list: {e}");
                self.next = now + if e.refused().is_some() { LIST_EVERY_SECS } else { RETRY_SECS };
                return;
            }
        };
        self.next = self.apply(&list, now, client).await;
    }

    /// Tells the controller what the node holds, per module (the serial on disk and why the last
    /// attempt failed here), when that changed since it last acknowledged: a renewal failing on
    /// the node shows in `trellis certs` and `trellis status`. A controller that does not take
    /// reports (an older one) is not asked again; one not reached is, next time.
    pub async fn report(&mut self, client: &NodeClient) {
        if self.reported.as_ref() == Some(&self.status) {
            return;
        }
        let certificates = self
            .status
            .iter()
            .map(|s| proto::HeldServiceCert {
                module: s.module.clone(),
                serial: s.serial.clone(),
                not_after: s.not_after,
                error: s.error.as_deref().map(|e| cut(e, proto::certs::MAX_HELD_ERROR)),
            })
            .take(proto::certs::MAX_HELD_REPORTED)
            .collect();
        match client.report_held_certificates(&proto::HeldServiceCerts { certificates }).await {
            Ok(_) => self.reported = Some(self.status.clone()),
            Err(e) if e.refused().is_some_and(|r| r.status < 500) => {
                tracing::debug!("the controller takes no report of held certificates: {e}");
                self.reported = Some(self.status.clone());
            }
            Err(e) => tracing::debug!("reporting the service certificates held: {e}"),
        }
    }

    /// Carries out [`plan`] for `list` with `signer` as the controller; returns when to look
    /// again.
    pub async fn apply(&mut self, list: &proto::ServiceCertList, now: i64, signer: &dyn Signer) -> i64 {
        let mut next = now + LIST_EVERY_SECS;
        let held = match self.held() {
            Ok(h) => h,
            Err(e) => {
                tracing::error!("reading the service certificates: {e:#}");
                return now + RETRY_SECS;
            }
        };
        let mut status = Vec::new();
        let mut steps = plan(list, &held, now);
        if std::mem::take(&mut self.reissue) {
            for step in &mut steps {
                if let Step::Keep { module, .. } = step {
                    if let Some(spec) = list.certificates.iter().find(|s| s.module == *module) {
                        *step = Step::Issue(spec.clone());
                    }
                }
            }
        }
        for step in steps {
            match step {
                Step::Keep { module, renew_at } => {
                    next = next.min(renew_at);
                    let h = held.iter().find(|(m, _)| *m == module).and_then(|(_, h)| h.clone());
                    let error = self.status.iter().find(|s| s.module == module).and_then(|s| s.error.clone());
                    status.push(CertStatus {
                        serial: h.as_ref().map(|h| h.serial.clone()),
                        not_after: h.map(|h| h.not_after),
                        renew_at: Some(renew_at),
                        error,
                        module,
                    });
                }
                Step::Issue(spec) => {
                    let old = held.iter().find(|(m, _)| *m == spec.module).and_then(|(_, h)| h.clone());
                    match self.issue(&spec, signer).await {
                        Ok(issued) => {
                            let at = renew_at(issued.not_before, issued.not_after, &issued.serial);
                            next = next.min(at);
                            tracing::info!(module = %spec.module, serial = %issued.serial, "service certificate written");
                            let mut error = None;
                            if let Some(unit) = &spec.reload {
                                if let Some(r) = self.reloader.as_mut() {
                                    if let Err(e) = r.reload(unit) {
                                        tracing::error!(module = %spec.module, "{e:#}");
                                        error = Some(format!("written, but {unit} was not reloaded: {e:#}"));
                                    }
                                }
                            }
                            status.push(CertStatus {
                                module: spec.module.clone(),
                                serial: Some(issued.serial),
                                not_after: Some(issued.not_after),
                                renew_at: Some(at),
                                error,
                            });
                        }
                        Err(e) => {
                            let kept = match &old {
                                Some(h) if h.not_after > now => {
                                    format!("; the certificate in place ({}) stays until it expires in {} s", h.serial, h.not_after - now)
                                }
                                Some(_) => "; the certificate in place has expired".to_string(),
                                None => String::new(),
                            };
                            let error = format!("certificate for {}: {e:#}{kept}", spec.module);
                            tracing::error!("{error}");
                            next = next.min(now + RETRY_SECS);
                            status.push(CertStatus {
                                module: spec.module.clone(),
                                serial: old.as_ref().map(|h| h.serial.clone()),
                                not_after: old.map(|h| h.not_after),
                                renew_at: None,
                                error: Some(error),
                            });
                        }
                    }
                }
                Step::Remove(module) => match self.remove(&module) {
                    Ok(()) => tracing::info!(module = %module, "service certificate removed: the node no longer runs the module"),
                    Err(e) => {
                        tracing::error!(module = %module, "removing the service certificate: {e:#}");
                        next = next.min(now + RETRY_SECS);
                    }
                },
            }
        }
        self.status = status;
        next
    }

    /// Every module directory under `CERTS_DIR`, with its certificate when it reads.
    fn held(&self) -> Result<Vec<(String, Option<Held>)>> {
        let dir = match Beneath::open(&self.root, CERTS_DIR, false) {
            Ok(d) => d,
            Err(e) if e.source.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(e.into()),
        };
        let mut out = Vec::new();
        for name in dir.names()? {
            if !trellis_core::load::is_dns_label(&name) {
                continue;
            }
            let held =
                Beneath::open(&self.root, &format!("{CERTS_DIR}/{name}"), false).ok().and_then(|d| d.read(CERT)).and_then(|(pem, _)| {
                    let info = trellis_pki::services::inspect_service(std::str::from_utf8(&pem).ok()?).ok()?;
                    let ips = info.ips.iter().map(|ip| ip.to_string()).collect();
                    Some(Held {
                        serial: info.serial,
                        not_before: info.not_before,
                        not_after: info.not_after,
                        names: (info.dns, ips, info.uris),
                    })
                });
            out.push((name, held));
        }
        Ok(out)
    }

    async fn issue(&self, spec: &proto::ServiceCertSpec, signer: &dyn Signer) -> Result<Issued> {
        if !trellis_core::load::is_dns_label(&spec.module) {
            bail!("the controller named a module {:?} that is not a DNS label; nothing written", proto::text::printable(&spec.module));
        }
        // Checked here as the declaration's are: what comes from the controller is not taken on
        // its word alone.
        if let Some(why) = spec.group.as_deref().and_then(trellis_core::certs::refused_group) {
            bail!(
                "the controller named group {:?} for the key of {}, which {why}; nothing written",
                proto::text::printable(spec.group.as_deref().unwrap_or_default()),
                spec.module
            );
        }
        if let Some(why) = spec.reload.as_deref().and_then(trellis_core::certs::refused_unit) {
            bail!(
                "the controller named {:?} to reload for {}, which {why}; nothing written",
                proto::text::printable(spec.reload.as_deref().unwrap_or_default()),
                spec.module
            );
        }
        let gid = match &spec.group {
            None => None,
            Some(g) => Some(
                nix::unistd::Group::from_name(g)
                    .with_context(|| format!("cannot look up group {g}"))?
                    .with_context(|| format!("group {g} does not exist on this host; the key of {} is not written", spec.module))?
                    .gid
                    .as_raw(),
            ),
        };
        // A new key for every certificate: it is made here and never leaves the node.
        let (key, csr) = trellis_pki::services::service_key_and_csr(&spec.dns)?;
        let req = proto::ServiceCertRequest { module: spec.module.clone(), csr_pem: csr };
        let answer = signer.sign(&req).await.map_err(|e| anyhow::anyhow!("renewal refused: {e:#}"))?;
        let info = trellis_pki::services::inspect_service(&answer.cert_pem)?;
        if trellis_pki::cert_public_key(&answer.cert_pem)? != trellis_pki::services::public_key_of(&key)? {
            bail!("the controller's certificate for {} does not certify the key made for it; nothing written", spec.module);
        }
        // The server presents its certificate followed by the services CA.
        let cert = format!("{}{}", answer.cert_pem, answer.chain_pem);
        self.write(&spec.module, &key, gid, &cert, &answer.chain_pem, &answer.ca_pem)?;
        Ok(Issued { serial: info.serial, not_before: info.not_before, not_after: info.not_after })
    }

    /// Writes the four files of `module`, each staged before any is committed: the key 0600
    /// from its first byte (then its group's and 0640 when one is named), the others 0644.
    fn write(&self, module: &str, key: &str, gid: Option<u32>, cert: &str, chain: &str, ca: &str) -> Result<()> {
        let dir = Beneath::open(&self.root, &format!("{CERTS_DIR}/{module}"), true)?;
        let mut staged = Vec::new();
        let stage_all = |staged: &mut Vec<(String, &str)>| -> Result<()> {
            let key_mode = if gid.is_some() { 0o640 } else { 0o600 };
            staged.push((dir.stage_for_group(KEY, key.as_bytes(), gid, key_mode)?, KEY));
            for (name, content) in [(CERT, cert), (CHAIN, chain), (CA, ca)] {
                if dir.is_link(name) {
                    bail!("refusing to write {}: it is a symbolic link, which is never followed", dir.path().join(name).display());
                }
                staged.push((dir.stage(name, content.as_bytes(), 0o644)?, name));
            }
            Ok(())
        };
        let done = stage_all(&mut staged).and_then(|()| staged.iter().try_for_each(|(tmp, name)| Ok(dir.commit(tmp, name)?)));
        if let Err(e) = done {
            for (tmp, _) in &staged {
                dir.discard(tmp);
            }
            return Err(e);
        }
        dir.sync();
        Ok(())
    }

    /// Removes a module's files and its directory.
    fn remove(&self, module: &str) -> Result<()> {
        let dir = Beneath::open(&self.root, &format!("{CERTS_DIR}/{module}"), false)?;
        for name in dir.names()? {
            dir.remove(&name)?;
        }
        dir.sync();
        Beneath::open(&self.root, CERTS_DIR, false)?.remove_dir(module)?;
        Ok(())
    }
}

struct Issued {
    serial: String,
    not_before: i64,
    not_after: i64,
}

/// The files of one module's certificate, relative to the root.
pub fn files_of(module: &str) -> Vec<String> {
    FILES.iter().map(|f| format!("{CERTS_DIR}/{module}/{f}")).collect()
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    /// The controller's side in process: the real services CA, signing for the spec's names.
    struct InProcess {
        ca_pem: String,
        services: trellis_pki::ServicesCa,
        names: trellis_pki::ServiceNames,
        now: i64,
        asked: AtomicUsize,
        refuse: AtomicBool,
    }

    impl Signer for InProcess {
        fn sign<'a>(
            &'a self,
            req: &'a proto::ServiceCertRequest,
        ) -> Pin<Box<dyn Future<Output = Result<proto::ServiceCertResponse>> + Send + 'a>> {
            Box::pin(async move {
                self.asked.fetch_add(1, Ordering::SeqCst);
                if self.refuse.load(Ordering::SeqCst) {
                    bail!("node `db-1` does not run module `pg` with a [module.certificate] in the current declaration");
                }
                let now = UNIX_EPOCH + Duration::from_secs(self.now as u64);
                let issued = self
                    .services
                    .sign(&req.csr_pem, &self.names, now, Duration::from_secs(1200), rand::random())?
                    .map_err(|e| anyhow::anyhow!("{e}"))?;
                Ok(proto::ServiceCertResponse {
                    module: req.module.clone(),
                    cert_pem: issued.cert_pem,
                    chain_pem: self.services.cert_pem().to_string(),
                    ca_pem: self.ca_pem.clone(),
                    serial: issued.serial,
                    not_after: issued.not_after,
                })
            })
        }
    }

    #[derive(Clone, Default)]
    struct Reloads(Arc<Mutex<Vec<String>>>);

    impl Reloader for Reloads {
        fn reload(&mut self, unit: &str) -> Result<()> {
            self.0.lock().unwrap().push(unit.to_string());
            Ok(())
        }
    }

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o777
    }

    #[tokio::test]
    async fn certificates_are_written_kept_renewed_refused_and_removed_under_the_root() {
        let t0 = crate::unix_now();
        let ca = trellis_pki::create_ca("t", UNIX_EPOCH + Duration::from_secs(t0 as u64), [1; 16]).unwrap();
        let mesh = trellis_pki::Ca::load(&ca.cert_pem, &ca.key_pem).unwrap();
        let pair = mesh.services_ca("t", UNIX_EPOCH + Duration::from_secs(t0 as u64), [2; 16]).unwrap();
        let mut pg = spec("pg");
        // A group every Debian-like host has, other than root's.
        let group = ["daemon", "www-data"].into_iter().find(|g| nix::unistd::Group::from_name(g).ok().flatten().is_some());
        pg.group = group.map(str::to_string);
        pg.reload = Some("postgresql.service".into());
        let names = trellis_pki::ServiceNames { dns: pg.dns.clone(), ips: vec!["10.0.0.1".parse().unwrap()], uri: pg.uri.clone() };
        let mut signer = InProcess {
            ca_pem: ca.cert_pem.clone(),
            services: trellis_pki::ServicesCa::load(&pair.cert_pem, &pair.key_pem).unwrap(),
            names,
            now: t0,
            asked: AtomicUsize::new(0),
            refuse: AtomicBool::new(false),
        };
        let root = trellis_testing::TempDir::new("agent-certs");
        let reloads = Reloads::default();
        let mut certs = Certs::new(root.path(), Some(Box::new(reloads.clone())));
        let list = proto::ServiceCertList { certificates: vec![pg.clone()] };

        // Written: the key 0640 and the group's (0600 without one), the rest 0644; reloaded.
        let next = certs.apply(&list, t0, &signer).await;
        let dir = root.path().join(CERTS_DIR).join("pg");
        let key = dir.join(KEY);
        assert_eq!(mode(&key), if group.is_some() { 0o640 } else { 0o600 });
        if let Some(g) = group {
            assert_eq!(std::fs::metadata(&key).unwrap().gid(), nix::unistd::Group::from_name(g).unwrap().unwrap().gid.as_raw());
        }
        for f in [CERT, CHAIN, CA] {
            assert_eq!(mode(&dir.join(f)), 0o644, "{f}");
        }
        assert_eq!(*reloads.0.lock().unwrap(), ["postgresql.service"]);
        let first = certs.status()[0].clone();
        assert_eq!(first.error, None);
        let serial = first.serial.clone().unwrap();
        assert!(next > t0 && next <= t0 + 800, "looked at again by its renewal: {next}");
        let names: Vec<String> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names.len(), 4, "no staging file is left: {names:?}");
        if trellis_testing::can_run(trellis_testing::Need::Program("openssl")) {
            let p = |f: &str| dir.join(f).to_str().unwrap().to_string();
            let out = trellis_testing::cmd::ok(trellis_testing::cmd::sh(
                "openssl",
                &["verify", "-x509_strict", "-verify_hostname", "pg.t.mesh", "-CAfile", &p(CA), "-untrusted", &p(CHAIN), &p(CERT)],
            ));
            assert!(out.contains(": OK"), "{out}");
        }

        // Not due: nothing asked, nothing reloaded.
        certs.apply(&list, t0 + 10, &signer).await;
        assert_eq!(signer.asked.load(Ordering::SeqCst), 1);
        assert_eq!(reloads.0.lock().unwrap().len(), 1);

        // Due (two thirds of 1200 s, less the jitter): a new key and certificate, reloaded.
        signer.now = t0 + 800;
        certs.apply(&list, t0 + 800, &signer).await;
        assert_eq!(signer.asked.load(Ordering::SeqCst), 2);
        let second = certs.status()[0].serial.clone().unwrap();
        assert_ne!(second, serial);
        assert_eq!(reloads.0.lock().unwrap().len(), 2);

        // Refused at the next renewal: the files stay, and the status says why.
        let before = std::fs::read(dir.join(CERT)).unwrap();
        signer.refuse.store(true, Ordering::SeqCst);
        let next = certs.apply(&list, t0 + 1700, &signer).await;
        assert_eq!(std::fs::read(dir.join(CERT)).unwrap(), before, "the certificate in place stays");
        let e = certs.status()[0].error.clone().unwrap();
        assert!(e.starts_with("certificate for pg: renewal refused: node `db-1` does not run module `pg`"), "{e}");
        assert!(e.contains(&format!("the certificate in place ({second}) stays until it expires in")), "{e}");
        assert_eq!(next, t0 + 1700 + RETRY_SECS);
        assert_eq!(reloads.0.lock().unwrap().len(), 2, "nothing replaced, nothing reloaded");

        // No longer listed: removed.
        certs.apply(&proto::ServiceCertList { certificates: vec![] }, t0 + 1800, &signer).await;
        assert!(!dir.exists());
        assert!(root.path().join(CERTS_DIR).exists());

        // A module directory that is a symbolic link is never followed.
        let outside = trellis_testing::TempDir::new("agent-certs-outside");
        std::os::unix::fs::symlink(outside.path(), root.path().join(CERTS_DIR).join("pg")).unwrap();
        signer.refuse.store(false, Ordering::SeqCst);
        certs.apply(&list, t0 + 1900, &signer).await;
        assert!(std::fs::read_dir(outside.path()).unwrap().next().is_none(), "nothing written through the link");
        assert!(certs.status()[0].error.as_deref().unwrap().contains("symbolic link"), "{:?}", certs.status());
        std::fs::remove_file(root.path().join(CERTS_DIR).join("pg")).unwrap();

        // A unit or a group the declaration could not name is not taken from the controller
        // either (the review of 2026-12-02, finding 7): nothing written, nothing reloaded.
        let reloaded = reloads.0.lock().unwrap().len();
        for (group, reload, said) in
            [(None, "poweroff.target", "poweroff.target"), (Some("users"), "postgresql.service", "group \"users\"")]
        {
            let mut bad = pg.clone();
            bad.group = group.map(str::to_string);
            bad.reload = Some(reload.to_string());
            certs.apply(&proto::ServiceCertList { certificates: vec![bad] }, t0 + 2000, &signer).await;
            let e = certs.status()[0].error.clone().unwrap_or_default();
            assert!(e.contains(said) && e.contains("nothing written"), "{e}");
            assert!(!dir.join(KEY).exists(), "{reload}: a key was written");
        }
        assert_eq!(reloads.0.lock().unwrap().len(), reloaded, "nothing reloaded");
    }

    fn spec(module: &str) -> proto::ServiceCertSpec {
        proto::ServiceCertSpec {
            module: module.into(),
            dns: vec![format!("{module}.t.mesh"), "db-1.t.mesh".into()],
            ips: vec!["10.0.0.1".into()],
            uri: format!("spiffe://t.mesh/module/{module}"),
            group: None,
            reload: None,
            lifetime_secs: 1200,
        }
    }

    fn held(module: &str, serial: &str, nb: i64, na: i64) -> Held {
        let s = spec(module);
        Held { serial: serial.into(), not_before: nb, not_after: na, names: (s.dns, s.ips, vec![s.uri]) }
    }

    #[test]
    fn renewal_comes_at_two_thirds_of_the_lifetime_less_up_to_a_twelfth_of_it() {
        let mut seen = std::collections::BTreeSet::new();
        // Issued at 1000 for 1200 s: it begins SERVICE_BACKDATE_SECS earlier.
        let nb = 1000 - super::SERVICE_BACKDATE_SECS;
        for i in 0..500 {
            let at = renew_at(nb, 2200, &format!("{i:032x}"));
            assert!((1000 + 800 - 100..=1000 + 800).contains(&at), "{at}");
            seen.insert(at);
            assert_eq!(at, renew_at(nb, 2200, &format!("{i:032x}")), "the same every time for one certificate");
        }
        assert!(seen.len() > 50, "spread over certificates: {}", seen.len());
        // The shortest lifetime, a minute: renewed 35 to 40 s after issuance, not 20 s (two
        // thirds of the backdated span would be).
        for i in 0..100 {
            let at = renew_at(1000 - super::SERVICE_BACKDATE_SECS, 1060, &format!("{i:032x}"));
            assert!((1035..=1040).contains(&at), "{at}");
        }
    }

    #[test]
    fn the_plan_issues_what_is_missing_renamed_or_due_keeps_the_rest_and_removes_the_unlisted() {
        let list = proto::ServiceCertList { certificates: vec![spec("pg"), spec("ssh"), spec("web"), spec("api")] };
        let mut renamed = held("web", "03", 1000, 2200);
        renamed.names.1 = vec!["10.0.0.9".into()];
        let disk = vec![
            ("pg".to_string(), Some(held("pg", "01", 1000, 2200))),
            ("ssh".to_string(), Some(held("ssh", "02", 0, 1200))),
            ("web".to_string(), Some(renamed)),
            ("api".to_string(), None),
            ("old".to_string(), Some(held("old", "05", 1000, 2200))),
        ];
        let steps = plan(&list, &disk, 1100);
        assert_eq!(
            steps,
            [
                Step::Keep { module: "pg".into(), renew_at: renew_at(1000, 2200, "01") },
                Step::Issue(spec("ssh")),
                Step::Issue(spec("web")),
                Step::Issue(spec("api")),
                Step::Remove("old".into()),
            ]
        );
    }
}
