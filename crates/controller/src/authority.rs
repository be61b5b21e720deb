//! The mesh CA, the services CA and the controller's server certificate, as they change while
//! the controller serves (ADR 0029): `trellis rotate ca` announces a next CA in signed bundles;
//! from then on node and server certificates are issued under it, and clients that trust only
//! the current CA reach it through a cross-certificate; once every active node applied a bundle
//! announcing it and holds a certificate it issued (or the overlap passed), it is the only CA.
//! The server certificate is renewed at two thirds of its lifetime, while serving.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use trellis_pki::{Ca, Pair, ServicesCa};
use trellis_proto::{self as proto, AuditAction};
use trellis_store::{Audit, RotationRecord};

use crate::layout::{
    CA_CERT, CA_KEY, NEXT_CA_CERT, NEXT_CA_KEY, RETIRED_CA_CERT, SERVER_CERT, SERVER_KEY, SERVICES_CA_CERT, SERVICES_CA_KEY,
};
use crate::rotation::{check_overlap, Started, CA_ROTATION};
use crate::{Controller, Error, Result};

/// A next CA, held while its rotation is open.
pub(crate) struct NextCa {
    ca: Arc<Ca>,
    subject: Vec<u8>,
    /// SHA-256 of its certificate, hex: the rotation's key.
    fingerprint: String,
    /// The next CA certified by the current one.
    cross: String,
}

/// What the controller issues and trusts certificates with now.
pub(crate) struct Authority {
    current: Arc<Ca>,
    current_subject: Vec<u8>,
    next: Option<NextCa>,
    services: Option<Arc<ServicesCa>>,
    /// The server certificate and key (none for a controller made in process).
    server: Option<Pair>,
}

impl Authority {
    pub(crate) fn new(ca: Ca, services: Option<ServicesCa>) -> Authority {
        Authority { current_subject: ca.subject_der(), current: Arc::new(ca), next: None, services: services.map(Arc::new), server: None }
    }
}

/// What the server presents and accepts: its certificate and key, the chain after it, and the
/// CAs whose client certificates it takes (PEM each).
#[derive(Clone, Debug)]
pub struct TlsMaterial {
    pub server_pem: String,
    pub server_key_pem: String,
    pub chain_pem: String,
    pub client_roots_pem: String,
}

fn hex_fingerprint(ca: &Ca) -> String {
    hex::encode(ca.fingerprint())
}

impl Controller {
    fn authority(&self) -> std::sync::RwLockReadGuard<'_, Authority> {
        self.authority.read().expect("authority")
    }

    /// The CA node certificates are issued under now: the next one while a rotation is open.
    pub(crate) fn ca(&self) -> Arc<Ca> {
        let a = self.authority();
        a.next.as_ref().map_or_else(|| a.current.clone(), |n| n.ca.clone())
    }

    /// The CAs a node, or a service's client, trusts now (PEM, the current one first): what
    /// bundles deliver as `ca.pem` and service certificates come with.
    pub(crate) fn trusted_ca_pem(&self) -> String {
        let a = self.authority();
        let mut pem = a.current.cert_pem().to_string();
        if let Some(n) = &a.next {
            pem = pem_join(&[&pem, n.ca.cert_pem()]);
        }
        pem
    }

    /// The services intermediate CA, if this controller has one.
    pub(crate) fn services_ca(&self) -> Option<Arc<ServicesCa>> {
        self.authority().services.clone()
    }

    /// Whether a certificate was issued by a mesh CA trusted now (not by the services CA).
    pub(crate) fn issued_by_mesh_ca(&self, cert_der: &[u8]) -> bool {
        let a = self.authority();
        trellis_pki::services::issued_by(cert_der, &a.current_subject)
            || a.next.as_ref().is_some_and(|n| trellis_pki::services::issued_by(cert_der, &n.subject))
    }

    /// Changes each time what the server presents or accepts changes; the server builds its TLS
    /// configuration again when it does.
    pub fn tls_generation(&self) -> u64 {
        self.tls_generation.load(Ordering::SeqCst)
    }

    /// What the server presents and accepts now; none for a controller made in process.
    pub fn tls_material(&self) -> Option<TlsMaterial> {
        let a = self.authority();
        let server = a.server.as_ref()?;
        // While a rotation is open the server's certificate is the next CA's: a client that
        // trusts only the current CA follows the cross-certificate; a first contact pinned to
        // either fingerprint finds its CA among those presented.
        let (chain_pem, client_roots_pem) = match &a.next {
            Some(n) => {
                (format!("{}{}{}", n.cross, n.ca.cert_pem(), a.current.cert_pem()), format!("{}{}", a.current.cert_pem(), n.ca.cert_pem()))
            }
            None => (a.current.cert_pem().to_string(), a.current.cert_pem().to_string()),
        };
        Some(TlsMaterial { server_pem: server.cert_pem.clone(), server_key_pem: server.key_pem.clone(), chain_pem, client_roots_pem })
    }

    /// The fingerprint of the next CA, while this controller holds one.
    pub(crate) fn next_ca_fingerprint(&self) -> Option<String> {
        self.authority().next.as_ref().map(|n| n.fingerprint.clone())
    }

    /// Keeps the server certificate this controller serves with.
    pub(crate) fn set_server(&self, server: Pair) {
        self.authority.write().expect("authority").server = Some(server);
        self.tls_generation.fetch_add(1, Ordering::SeqCst);
    }

    /// Writes a file of the state directory, if there is one.
    fn keep(&self, name: &str, bytes: &[u8], mode: u32) -> Result<()> {
        match &self.state_dir {
            Some(dir) => trellis_files::replace(&dir.join(name), bytes, mode)
                .map_err(|e| Error::internal("writing the state directory", format!("{name}: {e}"))),
            None => Ok(()),
        }
    }

    /// Starts a rotation of the mesh CA to the CA in this controller's `ca.next.pem` (the one
    /// `trellis rotate ca` wrote), whose fingerprint the request names; audited. From now on
    /// node and server certificates are issued under it. Refused while another is in progress.
    pub async fn rotate_ca(&self, req: &proto::CaRotation) -> Result<proto::Rotation> {
        check_overlap(req.overlap_secs)?;
        let fingerprint = req.next_ca_fingerprint.to_ascii_lowercase();
        let next = self.load_next_ca(&fingerprint)?;
        if !next.allows_intermediate() {
            return Err(Error::BadRequest("the next CA allows no intermediate CA below it, so it cannot certify the services CA".into()));
        }
        let detail = format!("overlap {} s; {}", req.overlap_secs, next.inspect().map(|i| i.common_name).unwrap_or_default());
        let started = Started { kind: CA_ROTATION, what: "mesh CA", action: AuditAction::CaRotationStarted };
        self.start_rotation(started, &fingerprint, req.overlap_secs, detail).await?;
        self.adopt_next_ca(next)?;
        self.rotation_started(&fingerprint).await
    }

    /// The next CA from this state directory, which must be the one named.
    fn load_next_ca(&self, named: &str) -> Result<Ca> {
        let Some(dir) = &self.state_dir else {
            return Err(Error::BadRequest("this controller has no state directory to hold a next CA".into()));
        };
        let read = |name: &str| {
            trellis_files::read(&dir.join(name)).map_err(|e| {
                Error::BadRequest(format!(
                    "cannot read {}: {e}; run `trellis rotate ca --state-dir` on this controller's state directory (and copy {NEXT_CA_CERT} and {NEXT_CA_KEY} to every replica's)",
                    dir.join(name).display()
                ))
            })
        };
        let ca = Ca::load(&read(NEXT_CA_CERT)?, &read(NEXT_CA_KEY)?)
            .map_err(|e| Error::BadRequest(format!("{} does not hold a CA with its key: {e}", dir.join(NEXT_CA_CERT).display())))?;
        if hex_fingerprint(&ca) != named {
            return Err(Error::BadRequest(format!("{} holds another CA than the one named", dir.join(NEXT_CA_CERT).display())));
        }
        if ca.fingerprint() == self.authority().current.fingerprint() {
            return Err(Error::BadRequest("the next CA is the current one".into()));
        }
        Ok(ca)
    }

    /// Issues under `next` from now on: the cross-certificate made, the server certificate
    /// issued under it (unless it already is, as after a restart) and the services CA certified
    /// by it; kept in the state directory.
    fn adopt_next_ca(&self, next: Ca) -> Result<()> {
        let _changing = self.cert_changes.lock().expect("certificate changes");
        let fingerprint = hex_fingerprint(&next);
        if self.authority().next.as_ref().is_some_and(|n| n.fingerprint == fingerprint) {
            return Ok(());
        }
        let subject = next.subject_der();
        let (cross, server, services) = {
            let a = self.authority();
            let cross = a.current.cross_certify(&next, self.random()).map_err(|e| Error::internal("cross-certifying the next CA", e))?;
            let server = match &a.server {
                Some(s) if !issued_under(&s.cert_pem, &subject) => Some(self.server_cert_under(&next)?),
                _ => None,
            };
            // A new services CA, its own new key, under the next CA: a rotation made because the
            // state directory leaked leaves the leaked services key nothing to sign. A replica
            // sharing this directory that made it already is followed.
            let services = match &a.services {
                Some(s) if !issued_under(s.cert_pem(), &subject) => Some(match self.services_here_under(&subject) {
                    Some(found) => (None, Arc::new(found)),
                    None => {
                        let pair = next
                            .services_ca("trellis", self.system_time(), self.random())
                            .map_err(|e| Error::internal("making the next services CA", e))?;
                        let ca = ServicesCa::load(&pair.cert_pem, &pair.key_pem)
                            .map_err(|e| Error::internal("making the next services CA", e))?;
                        (Some(pair), Arc::new(ca))
                    }
                }),
                _ => None,
            };
            (cross, server, services)
        };
        if let Some(s) = &server {
            self.keep(SERVER_KEY, s.key_pem.as_bytes(), 0o600)?;
            self.keep(SERVER_CERT, s.cert_pem.as_bytes(), 0o644)?;
        }
        if let Some((Some(pair), _)) = &services {
            // The key first: a stop between the two leaves a key its certificate does not name,
            // which the next start replaces (`repair_services`), never a certificate without its key.
            self.keep(SERVICES_CA_KEY, pair.key_pem.as_bytes(), 0o600)?;
            self.keep(SERVICES_CA_CERT, pair.cert_pem.as_bytes(), 0o644)?;
        }
        let mut a = self.authority.write().expect("authority");
        if let Some(s) = server {
            a.server = Some(s);
        }
        if let Some((_, s)) = services {
            a.services = Some(s);
        }
        a.next = Some(NextCa { ca: Arc::new(next), subject, fingerprint: fingerprint.clone(), cross });
        drop(a);
        self.tls_generation.fetch_add(1, Ordering::SeqCst);
        tracing::info!("node and server certificates are issued under the next CA {fingerprint} from now on");
        Ok(())
    }

    /// The services CA this state directory holds, if a CA of `subject` issued it.
    fn services_here_under(&self, subject: &[u8]) -> Option<ServicesCa> {
        let dir = self.state_dir.as_ref()?;
        let pem = trellis_files::read(&dir.join(SERVICES_CA_CERT)).ok()?;
        if !issued_under(&pem, subject) {
            return None;
        }
        ServicesCa::load(&pem, &trellis_files::read(&dir.join(SERVICES_CA_KEY)).ok()?).ok()
    }

    /// The CA `fingerprint` as this state directory's `ca.pem` and `ca.key` hold it, if they do.
    fn promoted_here(&self, fingerprint: &str) -> Option<Ca> {
        let dir = self.state_dir.as_ref()?;
        let ca = Ca::load(&trellis_files::read(&dir.join(CA_CERT)).ok()?, &trellis_files::read(&dir.join(CA_KEY)).ok()?).ok()?;
        (hex_fingerprint(&ca) == fingerprint).then_some(ca)
    }

    /// A server certificate under `ca` for the names the current one carries.
    fn server_cert_under(&self, ca: &Ca) -> Result<Pair> {
        let lifetime = Duration::from_secs(self.config.server_cert_secs);
        ca.server_cert(&self.server_names, self.system_time(), lifetime, self.random())
            .map_err(|e| Error::internal("issuing the server certificate", e))
    }

    /// The rotation to the CA `fingerprint` completed: it is the only CA from now on; the state
    /// directory's `ca.pem` and `ca.key` are its, and the old certificate is kept as
    /// `ca.retired.pem`.
    fn promote_ca(&self, fingerprint: &str) -> Result<()> {
        let held = self.authority().next.as_ref().map(|n| n.fingerprint.clone());
        if held.as_deref() != Some(fingerprint) {
            // A replica that never adopted it (it was stopped through the whole overlap, or the
            // rotation completed before it looked): from its own copy of the next CA, or, when
            // a replica sharing this state directory promoted it already, from `ca.pem`.
            let next = match self.load_next_ca(fingerprint) {
                Ok(ca) => ca,
                Err(e) => self.promoted_here(fingerprint).ok_or(e)?,
            };
            self.adopt_next_ca(next)?;
        }
        let _changing = self.cert_changes.lock().expect("certificate changes");
        if let Some(dir) = &self.state_dir {
            // In this order, so that a stop at any point leaves what `finish_promotion` (at the
            // next start) or the next publish run completes: never a CA certificate beside
            // another CA's key without the next pair still there.
            let old = self.authority().current.cert_pem().to_string();
            let new = self.authority().next.as_ref().map(|n| n.ca.cert_pem().to_string()).unwrap_or_default();
            self.keep(RETIRED_CA_CERT, old.as_bytes(), 0o644)?;
            self.keep(CA_CERT, new.as_bytes(), 0o644)?;
            finish_promotion(dir).map_err(|e| Error::internal("keeping the new CA", format!("{e:#}")))?;
        }
        let mut a = self.authority.write().expect("authority");
        if let Some(n) = a.next.take() {
            a.current = n.ca;
            a.current_subject = n.subject;
        }
        drop(a);
        self.tls_generation.fetch_add(1, Ordering::SeqCst);
        tracing::info!("the mesh CA is {fingerprint} from now on; certificates of the old one are refused");
        Ok(())
    }

    /// What this publish run says of the mesh CA in `trust.toml` (`ca`, `next_ca`) and the CA it
    /// announces: a rotation completed (here or by another replica) makes its CA the current one
    /// first; one open that this replica does not hold yet is adopted from its own copy.
    pub(crate) async fn run_ca(&self, rotation: Option<&RotationRecord>) -> Result<(Option<[u8; 32]>, Option<String>, Option<String>)> {
        let Some(r) = rotation else { return Ok((None, None, None)) };
        let current = hex_fingerprint(&self.authority().current);
        if r.completed_at.is_some() && current != r.next_key {
            self.promote_ca(&r.next_key)?;
        } else if r.completed_at.is_none() {
            let held = self.authority().next.as_ref().map(|n| n.fingerprint.clone());
            if held.as_deref() != Some(&r.next_key) {
                // A replica that cannot take part publishes nothing: its bundles would tell every
                // agent that no CA comes next, and its renewals would be under the old CA.
                if let Err(e) = self.load_next_ca(&r.next_key).and_then(|ca| self.adopt_next_ca(ca)) {
                    return Err(Error::internal("a rotation of the mesh CA is in progress, and this replica cannot take part", e));
                }
            }
        }
        let a = self.authority();
        let next = a.next.as_ref().filter(|n| n.fingerprint == r.next_key);
        Ok((Some(a.current.fingerprint()), next.map(|n| n.ca.cert_pem().to_string()), next.map(|n| n.fingerprint.clone())))
    }

    /// Per active node, whether it holds a certificate issued by the CA `fingerprint` (the next
    /// one while its rotation is open).
    pub(crate) async fn holding_certificates_of(&self, fingerprint: &str) -> Result<std::collections::HashSet<String>> {
        let subject = {
            let a = self.authority();
            match (&a.next, hex_fingerprint(&a.current) == fingerprint) {
                (Some(n), _) if n.fingerprint == fingerprint => n.subject.clone(),
                (_, true) => a.current_subject.clone(),
                _ => return Ok(Default::default()),
            }
        };
        Ok(self
            .store
            .nodes()
            .await?
            .into_iter()
            .filter(|r| r.cert_pem.as_deref().is_some_and(|pem| issued_under(pem, &subject)))
            .map(|r| r.name)
            .collect())
    }

    /// At start: an open CA rotation is taken up at once (its CA adopted, or a completed one
    /// promoted), so the first connection is served as the rotation says, not after the first
    /// publish run.
    pub(crate) async fn resume_ca_rotation(&self) -> Result<()> {
        let rotations = self.store.rotations().await?;
        self.run_ca(rotations.iter().find(|r| r.kind == CA_ROTATION)).await.map(|_| ())
    }

    /// Certifies the services CA again, for the declaration's domain and overlay prefixes alone,
    /// when the certificate in force does not say exactly that (it was made by `trellis init`
    /// before any domain was declared, or the domain or the overlay changed): name constraints,
    /// so that its key, leaked, mints nothing a client trusting the mesh CA takes outside the
    /// mesh (the review of 2026-12-02, finding 12). Audited. Every publish run asks; when
    /// nothing changed it costs a comparison.
    pub(crate) async fn scope_services_ca(&self, mesh: &trellis_core::decl::MeshSettings) -> Result<()> {
        use trellis_pki::services::{name_constraints_of, ServiceScope};
        let prefixes = [
            mesh.overlay_ipv4.map(|p| (std::net::IpAddr::V4(p.network()), p.prefix_len())),
            mesh.overlay_ipv6.map(|p| (std::net::IpAddr::V6(p.network()), p.prefix_len())),
        ];
        let scope = ServiceScope { domain: mesh.domain.clone(), prefixes: prefixes.into_iter().flatten().collect() };
        let want = scope.name_constraints();
        let _scoping = self.scoping.lock().await;
        let (services, issuer) = {
            let a = self.authority();
            let Some(services) = a.services.clone() else { return Ok(()) };
            // The certificate last looked at, and what it carries: a rotation's new services CA
            // is another certificate, looked at again.
            let seen = (services.cert_pem().to_string(), want.clone());
            if self.services_scope.lock().expect("services scope").as_ref() == Some(&seen) {
                return Ok(());
            }
            if name_constraints_of(services.cert_pem()).as_deref() == Some(&want[..]) {
                *self.services_scope.lock().expect("services scope") = Some(seen);
                return Ok(());
            }
            // Certified by the CA that certified it before: the next one during a rotation.
            let issuer = match &a.next {
                Some(n) if issued_under(services.cert_pem(), &n.subject) => n.ca.clone(),
                _ => a.current.clone(),
            };
            (services, issuer)
        };
        {
            // Under the lock a CA rotation adopts its new services CA with: one adopted since
            // the services CA was read above is not put back by this one scoped (the review of
            // 2026-12-06: the retired key signing again, beside a certificate not its own). The
            // next run scopes the new one.
            let _changing = self.cert_changes.lock().expect("certificate changes");
            if !self.authority().services.as_ref().is_some_and(|s| Arc::ptr_eq(s, &services)) {
                return Ok(());
            }
            let (pem, scoped) = services
                .scoped(&issuer, "trellis", &scope, self.system_time(), self.random())
                .map_err(|e| Error::internal("scoping the services CA", e))?;
            self.keep(SERVICES_CA_CERT, pem.as_bytes(), 0o644)?;
            *self.services_scope.lock().expect("services scope") = Some((scoped.cert_pem().to_string(), want));
            self.authority.write().expect("authority").services = Some(Arc::new(scoped));
        }
        let subject = format!("{} {}", mesh.domain, scope.prefixes.iter().map(|(a, l)| format!("{a}/{l}")).collect::<Vec<_>>().join(" "));
        let audit = Audit {
            at: self.now(),
            actor: "controller",
            action: AuditAction::ServicesCaScoped,
            subject: &subject,
            detail: "the services CA certifies DNS names and SPIFFE IDs of this domain and addresses of these prefixes, nothing else"
                .into(),
        };
        self.store.record(&audit).await?;
        tracing::info!("the services CA is certified for {subject} alone from now on");
        Ok(())
    }

    /// Renews the server certificate once two thirds of its lifetime have passed (counted from
    /// when it was made), under the CA that issues now, and serves with it from the next
    /// connection on; audited. The server calls it every few seconds.
    pub(crate) async fn renew_server_cert_if_due(&self) -> Result<bool> {
        let due = {
            let a = self.authority();
            let Some(server) = &a.server else { return Ok(false) };
            let info = trellis_pki::inspect_pem(&server.cert_pem).map_err(|e| Error::internal("reading the server certificate", e))?;
            trellis_pki::server_renewal_due(info.not_before, info.not_after, self.now()).then_some(info.serial)
        };
        let Some(old) = due else { return Ok(false) };
        let info = {
            let _changing = self.cert_changes.lock().expect("certificate changes");
            let ca = self.ca();
            let server = self.server_cert_under(&ca)?;
            let info = trellis_pki::inspect_pem(&server.cert_pem).map_err(|e| Error::internal("reading the server certificate", e))?;
            self.keep(SERVER_KEY, server.key_pem.as_bytes(), 0o600)?;
            self.keep(SERVER_CERT, server.cert_pem.as_bytes(), 0o644)?;
            self.set_server(server);
            info
        };
        let audit = Audit {
            at: self.now(),
            actor: "controller",
            action: AuditAction::ServerCertificateRenewed,
            subject: &info.serial,
            detail: format!("replaces {old}, valid until {}", trellis_proto::text::date(info.not_after)),
        };
        self.store.record(&audit).await?;
        tracing::info!(serial = info.serial, "the server certificate was renewed");
        Ok(true)
    }
}

/// Completes, in the state directory `dir`, a promotion of the next CA that stopped after
/// `ca.pem` became the next CA's certificate: `ca.key` becomes its key, and the next pair goes.
/// Nothing to do otherwise. Run when a controller opens its state directory, before loading the CA.
pub fn finish_promotion(dir: &std::path::Path) -> anyhow::Result<()> {
    let (cert, key) = (dir.join(NEXT_CA_CERT), dir.join(NEXT_CA_KEY));
    if !cert.exists() || !key.exists() {
        return Ok(());
    }
    let fingerprint =
        |path: &std::path::Path| -> anyhow::Result<[u8; 32]> { Ok(trellis_pki::inspect_pem(&trellis_files::read(path)?)?.fingerprint) };
    if fingerprint(&cert)? != fingerprint(&dir.join(CA_CERT))? {
        return Ok(());
    }
    trellis_files::replace(&dir.join(CA_KEY), trellis_files::read(&key)?.as_bytes(), 0o600)?;
    std::fs::remove_file(&key)?;
    std::fs::remove_file(&cert)?;
    Ok(())
}

/// At start, in the state directory `dir` whose mesh CA is `ca`: a services CA key that is not
/// its certificate's (a stop between writing a new pair's two files) is replaced by a new services
/// CA under `ca`. It had signed nothing: its certificate was never written.
pub fn repair_services(dir: &std::path::Path, ca: &Ca) -> anyhow::Result<()> {
    let (cert, key) = (dir.join(SERVICES_CA_CERT), dir.join(SERVICES_CA_KEY));
    if !cert.exists() || !key.exists() || trellis_pki::key_matches_cert(&trellis_files::read(&key)?, &trellis_files::read(&cert)?) {
        return Ok(());
    }
    tracing::warn!("{} is not the key of {}; a new services CA is made", key.display(), cert.display());
    let mut random = [0u8; 16];
    crate::Entropy::fill(&crate::OsEntropy, &mut random);
    let pair = ca.services_ca("trellis", std::time::SystemTime::now(), random)?;
    trellis_files::replace(&key, pair.key_pem.as_bytes(), 0o600)?;
    trellis_files::replace(&cert, pair.cert_pem.as_bytes(), 0o644)?;
    Ok(())
}

/// Makes the next mesh CA in the state directory `dir` (`trellis rotate ca`): `ca.next.key`
/// (0600 before its first byte) and `ca.next.pem`; a pair made before and not yet announced
/// (the request failed) is kept. Returns its fingerprint (hex), which the request names.
pub fn prepare_next_ca(dir: &std::path::Path) -> anyhow::Result<String> {
    use anyhow::Context;
    let (cert, key) = (dir.join(NEXT_CA_CERT), dir.join(NEXT_CA_KEY));
    let pem = if cert.exists() && key.exists() {
        let pem = trellis_files::read(&cert)?;
        Ca::load(&pem, &trellis_files::read(&key)?)
            .with_context(|| format!("{} does not hold a CA with its key; remove both files and run again", cert.display()))?;
        pem
    } else {
        let mut random = [0u8; 16];
        crate::Entropy::fill(&crate::OsEntropy, &mut random);
        let pair = trellis_pki::create_next_ca("trellis", std::time::SystemTime::now(), random)?;
        let _ = std::fs::remove_file(&cert);
        let _ = std::fs::remove_file(&key);
        trellis_files::create_new(&key, pair.key_pem.as_bytes(), 0o600)?;
        trellis_files::create_new(&cert, pair.cert_pem.as_bytes(), 0o644)?;
        pair.cert_pem
    };
    Ok(hex::encode(trellis_pki::inspect_pem(&pem)?.fingerprint))
}

/// PEM texts one after the other, each ending its line.
fn pem_join(parts: &[&str]) -> String {
    let mut out = String::new();
    for p in parts {
        out.push_str(p);
        if !out.ends_with('\n') {
            out.push('\n');
        }
    }
    out
}

/// Whether the certificate in `pem` names `subject` as its issuer.
fn issued_under(pem: &str, subject: &[u8]) -> bool {
    trellis_pki::pem_to_der(pem, "CERTIFICATE").is_ok_and(|der| trellis_pki::services::issued_by(&der, subject))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A promotion stopped after `ca.pem` became the next CA's is completed at the next start:
    /// `ca.key` becomes its key and the next pair goes; one stopped before changes nothing (the
    /// next publish run promotes again). A CA pair whose key is not the certificate's is refused.
    #[test]
    fn a_promotion_stopped_half_way_is_completed_at_the_next_start() {
        let dir = trellis_testing::TempDir::new("promotion");
        let now = std::time::SystemTime::now();
        let old = trellis_pki::create_ca("trellis", now, [1; 16]).unwrap();
        let next = trellis_pki::create_next_ca("trellis", now, [2; 16]).unwrap();
        let write = |f: &str, t: &str| std::fs::write(dir.join(f), t).unwrap();
        write(CA_CERT, &old.cert_pem);
        write(CA_KEY, &old.key_pem);
        write(NEXT_CA_CERT, &next.cert_pem);
        write(NEXT_CA_KEY, &next.key_pem);
        // Stopped before ca.pem was replaced: nothing to do here.
        finish_promotion(&dir).unwrap();
        assert!(dir.join(NEXT_CA_KEY).exists() && std::fs::read_to_string(dir.join(CA_KEY)).unwrap() == old.key_pem);
        // Stopped after: the certificate of one CA beside the key of the other, refused as such.
        write(CA_CERT, &next.cert_pem);
        let err = Ca::load(&next.cert_pem, &old.key_pem).err().unwrap().to_string();
        assert!(err.contains("the key is not the one the CA certificate certifies"), "{err}");
        finish_promotion(&dir).unwrap();
        let key = std::fs::read_to_string(dir.join(CA_KEY)).unwrap();
        assert_eq!(key, next.key_pem);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.join(CA_KEY)).unwrap().permissions().mode() & 0o777, 0o600);
        assert!(!dir.join(NEXT_CA_KEY).exists() && !dir.join(NEXT_CA_CERT).exists());
        Ca::load(&std::fs::read_to_string(dir.join(CA_CERT)).unwrap(), &key).unwrap();
    }

    /// A services CA whose key is not its certificate's (a stop between writing a new pair's
    /// files) is replaced at the next start by one under the mesh CA; a sound one is left be.
    #[test]
    fn a_half_written_services_ca_is_made_again_at_the_next_start() {
        let dir = trellis_testing::TempDir::new("services-repair");
        let now = std::time::SystemTime::now();
        let pair = trellis_pki::create_ca("trellis", now, [1; 16]).unwrap();
        let ca = Ca::load(&pair.cert_pem, &pair.key_pem).unwrap();
        let sound = ca.services_ca("trellis", now, [2; 16]).unwrap();
        std::fs::write(dir.join(SERVICES_CA_CERT), &sound.cert_pem).unwrap();
        std::fs::write(dir.join(SERVICES_CA_KEY), &sound.key_pem).unwrap();
        repair_services(&dir, &ca).unwrap();
        assert_eq!(std::fs::read_to_string(dir.join(SERVICES_CA_CERT)).unwrap(), sound.cert_pem, "left be");
        let other = ca.services_ca("trellis", now, [3; 16]).unwrap();
        std::fs::write(dir.join(SERVICES_CA_KEY), &other.key_pem).unwrap();
        assert!(ServicesCa::load(&sound.cert_pem, &other.key_pem).is_err());
        repair_services(&dir, &ca).unwrap();
        let (cert, key) =
            (std::fs::read_to_string(dir.join(SERVICES_CA_CERT)).unwrap(), std::fs::read_to_string(dir.join(SERVICES_CA_KEY)).unwrap());
        ServicesCa::load(&cert, &key).unwrap();
        assert!(trellis_pki::issued_by_ca(&cert, &pair.cert_pem).unwrap());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(dir.join(SERVICES_CA_KEY)).unwrap().permissions().mode() & 0o777, 0o600);
    }
}
