//! Service certificates (ADR 0023): what each node is to hold (one per module it runs that asks
//! for one, from `trellis_core::certs`), signing a node's CSR under the services intermediate CA
//! for exactly the names the current declaration gives it, and every refusal audited. The key
//! never leaves the node; the controller sees only the CSR.

use std::time::Duration;

use trellis_core::certs::ServiceCert;
use trellis_pki::{CsrRefusal, ServiceNames};
use trellis_proto::{self as proto, AuditAction, EnrolledState};
use trellis_store::Audit;

use crate::{Controller, Error, NodeIdentity, Result};

/// The largest service CSR a node may send (a P-256 CSR with every name is under 2 KiB).
pub const MAX_SERVICE_CSR: usize = 8 * 1024;

/// Why a service certificate was refused.
#[derive(Debug, thiserror::Error)]
pub enum ServiceCertRefusal {
    #[error("node `{node}` does not run module `{module}` with a [module.certificate] in the current declaration; it may hold no certificate for it")]
    NotServed { node: String, module: String },
    #[error("node `{0}` is pending approval; an operator runs `trellis node approve {0}`")]
    Pending(String),
    #[error("node `{0}` has been revoked")]
    Revoked(String),
    #[error("{0}")]
    Csr(CsrRefusal),
    #[error("the service certificate request is malformed (module name or CSR size)")]
    Malformed,
    #[error("this controller has no services CA (its state directory was made before service certificates); run `trellis init` for a new state directory")]
    NoServicesCa,
}

impl ServiceCertRefusal {
    pub fn code(&self) -> &'static str {
        match self {
            ServiceCertRefusal::NotServed { .. } => "certificate_not_served",
            ServiceCertRefusal::Pending(_) => "pending_approval",
            ServiceCertRefusal::Revoked(_) => "node_revoked",
            ServiceCertRefusal::Csr(CsrRefusal::Invalid(_)) | ServiceCertRefusal::Malformed => "bad_request",
            ServiceCertRefusal::Csr(CsrRefusal::CaRequested) => "certificate_ca_requested",
            ServiceCertRefusal::Csr(CsrRefusal::NameNotServed(_)) => "certificate_name_not_served",
            ServiceCertRefusal::NoServicesCa => "no_services_ca",
        }
    }

    /// The reason label of `trellis_service_certificate_refusals_total`: a fixed set.
    pub fn reason(&self) -> &'static str {
        match self {
            ServiceCertRefusal::NotServed { .. } => "not_served",
            ServiceCertRefusal::Pending(_) => "pending",
            ServiceCertRefusal::Revoked(_) => "revoked",
            ServiceCertRefusal::Csr(CsrRefusal::Invalid(_)) | ServiceCertRefusal::Malformed => "malformed",
            ServiceCertRefusal::Csr(CsrRefusal::CaRequested) => "ca_requested",
            ServiceCertRefusal::Csr(CsrRefusal::NameNotServed(_)) => "name_not_served",
            ServiceCertRefusal::NoServicesCa => "no_services_ca",
        }
    }
}

/// Every reason a refusal is counted under (`too_often`: a node turned away for asking too often,
/// before anything was decided).
pub const REFUSAL_REASONS: [&str; 8] =
    ["not_served", "pending", "revoked", "malformed", "ca_requested", "name_not_served", "no_services_ca", "too_often"];

fn spec(c: &ServiceCert) -> proto::ServiceCertSpec {
    proto::ServiceCertSpec {
        module: c.module.clone(),
        dns: c.dns.clone(),
        ips: c.ips.iter().map(|ip| ip.to_string()).collect(),
        uri: c.uri.clone(),
        group: c.group.clone(),
        reload: c.reload.clone(),
        lifetime_secs: c.lifetime_secs,
    }
}

/// The names a certificate carries, as `trellis certs` lists them.
fn listed(c: &ServiceCert) -> Vec<String> {
    c.dns.iter().cloned().chain(c.ips.iter().map(|ip| ip.to_string())).chain([c.uri.clone()]).collect()
}

impl Controller {
    /// The certificates of the current declaration (with its pools' members), every node's.
    async fn declared_certs(&self) -> Result<Vec<ServiceCert>> {
        let Some((_, decl)) = self.current_mesh().await? else { return Ok(Vec::new()) };
        let alloc = self.store.allocation().await?;
        Ok(trellis_core::certs::all(&decl, &alloc))
    }

    /// The certificates of one node of the current declaration: its own addresses only are
    /// read, so a node's request costs the same at any mesh size.
    async fn certs_of(&self, node: &str) -> Result<Vec<ServiceCert>> {
        let Some((_, decl)) = self.current_mesh().await? else { return Ok(Vec::new()) };
        let alloc = self.store.allocation_of(node).await?;
        Ok(trellis_core::certs::for_node(&decl, &alloc, node))
    }

    /// The certificates `who` is to hold now; it removes any other.
    pub async fn service_cert_specs(&self, who: &NodeIdentity) -> Result<proto::ServiceCertList> {
        self.require_approved(who)?;
        let certificates = self.certs_of(&who.name).await?.iter().map(spec).collect();
        Ok(proto::ServiceCertList { certificates })
    }

    /// Signs `who`'s CSR for one module, for exactly the names the current declaration gives the
    /// node for it, under the services CA. Every issuance and every refusal is audited, and the
    /// refusal recorded beside the certificate it leaves in place.
    pub async fn sign_service_cert(&self, who: &NodeIdentity, req: &proto::ServiceCertRequest) -> Result<proto::ServiceCertResponse> {
        if !trellis_core::load::is_dns_label(&req.module) || req.csr_pem.len() > MAX_SERVICE_CSR {
            // Not a module name: nothing of it reaches the audit chain.
            self.metrics.service_cert_refused(ServiceCertRefusal::Malformed.reason());
            return Err(ServiceCertRefusal::Malformed.into());
        }
        // A node cannot grow the audit chain as fast as it can send (the review of 2026-12-02,
        // finding 8): its refusals are audited one by one only up to a few in a window, then
        // counted and written as one record, and past a limit it is turned away unread.
        let now = self.now();
        if let Err(wait) = self.cert_refusals.admit(who.name.clone(), now) {
            self.metrics.service_cert_refused("too_often");
            return Err(Error::TooOften { node: who.name.clone(), what: "service certificates that were refused".into(), wait });
        }
        match self.decide_service_cert(who, req).await {
            Ok(answer) => Ok(answer),
            Err(Error::ServiceCert(refusal)) => {
                let at = self.now();
                if self.cert_refusals.refused(who.name.clone(), at, &refusal.to_string()) == crate::refusals::Verdict::Audit {
                    let audit = Audit {
                        at,
                        actor: &format!("node {}", who.name),
                        action: AuditAction::ServiceCertificateRefused,
                        subject: &format!("{}/{}", who.name, req.module),
                        detail: refusal.to_string(),
                    };
                    self.store.refuse_service_cert(&who.name, &req.module, at, &refusal.to_string(), &audit).await?;
                }
                self.metrics.service_cert_refused(refusal.reason());
                tracing::warn!(node = %who.name, module = %req.module, "service certificate refused: {refusal}");
                Err(refusal.into())
            }
            Err(e) => Err(e),
        }
    }

    /// Writes one audit record for each closed window of a node's refused service certificates
    /// that were counted, not audited one by one (with [`Controller::write_refusals`]).
    pub(crate) async fn write_cert_refusals(&self) {
        let audited = self.cert_refusals.limits().audited;
        for (node, w) in self.cert_refusals.closed(self.now()) {
            let who = if node.is_empty() { "other nodes".to_string() } else { format!("node {node}") };
            let audit = Audit {
                at: self.now(),
                actor: &who,
                action: AuditAction::ServiceCertificateRefused,
                subject: if node.is_empty() { "nodes" } else { &node },
                detail: format!(
                    "{} more refused for {who} in the {} s from {} ({} of them turned away unread); the last: {}",
                    w.refused - audited,
                    self.cert_refusals.limits().window_secs,
                    w.start,
                    w.turned_away,
                    w.last_reason
                ),
            };
            if let Err(e) = self.store.record(&audit).await {
                tracing::error!("cannot audit refused service certificates of {who}: {e}");
            }
        }
    }

    async fn decide_service_cert(&self, who: &NodeIdentity, req: &proto::ServiceCertRequest) -> Result<proto::ServiceCertResponse> {
        // The state as stored now, not as the request was authenticated: a revocation or a
        // node put back to pending between the two is not signed for.
        let state = self.store.node(&who.name).await?.map_or(EnrolledState::Revoked, |r| r.state);
        match state {
            EnrolledState::Pending => return Err(ServiceCertRefusal::Pending(who.name.clone()).into()),
            EnrolledState::Revoked => return Err(ServiceCertRefusal::Revoked(who.name.clone()).into()),
            EnrolledState::Active => {}
        }
        let certs = self.certs_of(&who.name).await?;
        let Some(cert) = certs.iter().find(|c| c.module == req.module) else {
            return Err(ServiceCertRefusal::NotServed { node: who.name.clone(), module: req.module.clone() }.into());
        };
        let services = self.services_ca().ok_or(ServiceCertRefusal::NoServicesCa)?;
        // Each issuance is audited: a few in a window per node and module (a renewal, a CA
        // announced, files lost on the node), not one per request.
        if let Err(wait) =
            self.cert_issues.take(&format!("{}/{}", who.name, cert.module), self.now(), crate::issue_window(cert.lifetime_secs))
        {
            return Err(Error::TooOften { node: who.name.clone(), what: format!("certificates for {}", cert.module), wait });
        }
        let names = ServiceNames { dns: cert.dns.clone(), ips: cert.ips.clone(), uri: cert.uri.clone() };
        let issued = services
            .sign(&req.csr_pem, &names, self.system_time(), Duration::from_secs(cert.lifetime_secs), self.random())
            .map_err(|e| Error::internal("signing a service certificate", e))?
            .map_err(ServiceCertRefusal::Csr)?;
        let at = self.now();
        let names = listed(cert);
        let audit = Audit {
            at,
            actor: &format!("node {}", who.name),
            action: AuditAction::ServiceCertificateIssued,
            subject: &format!("{}/{}", who.name, cert.module),
            detail: format!("certificate {} for {} until {}", issued.serial, names.join(", "), issued.not_after),
        };
        let record = trellis_store::IssuedServiceCert {
            node: &who.name,
            module: &cert.module,
            serial: &issued.serial,
            names: &names,
            issued_at: at,
            not_after: issued.not_after,
        };
        self.store.issue_service_cert(&record, &audit).await?;
        self.metrics.service_cert_issued();
        Ok(proto::ServiceCertResponse {
            module: cert.module.clone(),
            cert_pem: issued.cert_pem,
            chain_pem: services.cert_pem().to_string(),
            ca_pem: self.trusted_ca_pem(),
            serial: issued.serial,
            not_after: issued.not_after,
        })
    }

    /// Records what `who` reports holding: per module the declaration gives it a certificate
    /// for, the serial on its disk and why its last attempt failed there. Modules it is given no
    /// certificate for are left out (a node writes nothing about another's or an undeclared
    /// one); a report of more than [`proto::certs::MAX_HELD_REPORTED`] modules, or naming one
    /// twice, is refused; errors are cut to [`proto::certs::MAX_HELD_ERROR`] bytes. Returns how
    /// many modules were recorded.
    pub async fn report_held_certs(&self, who: &NodeIdentity, report: &proto::HeldServiceCerts) -> Result<usize> {
        self.require_approved(who)?;
        let list = &report.certificates;
        let twice = list.iter().enumerate().any(|(i, h)| list[..i].iter().any(|o| o.module == h.module));
        let bad_serial = |s: &Option<String>| s.as_ref().is_some_and(|s| s.len() > 64 || !s.bytes().all(|b| b.is_ascii_hexdigit()));
        if list.len() > proto::certs::MAX_HELD_REPORTED || twice || list.iter().any(|h| bad_serial(&h.serial)) {
            return Err(ServiceCertRefusal::Malformed.into());
        }
        let served = self.certs_of(&who.name).await?;
        let errors: Vec<Option<String>> = list.iter().map(|h| h.error.as_deref().map(|e| cut(e, proto::certs::MAX_HELD_ERROR))).collect();
        let held: Vec<trellis_store::HeldServiceCert> = list
            .iter()
            .zip(&errors)
            .filter(|(h, _)| served.iter().any(|c| c.module == h.module))
            .map(|(h, e)| trellis_store::HeldServiceCert {
                module: &h.module,
                serial: h.serial.as_deref(),
                not_after: h.not_after,
                error: e.as_deref(),
            })
            .collect();
        for h in held.iter().filter(|h| h.error.is_some()) {
            tracing::warn!(node = %who.name, module = %h.module, "the node reports its service certificate failing: {}", h.error.unwrap_or_default());
        }
        self.store.report_service_certs(&who.name, &held, self.now()).await?;
        Ok(held.len())
    }

    /// Every service certificate issued or refused, and every one declared but not issued yet,
    /// by node and module; each says whether the declaration still gives it.
    pub async fn service_certs(&self) -> Result<Vec<proto::ServiceCertInfo>> {
        let declared = self.declared_certs().await?;
        let mut out: Vec<proto::ServiceCertInfo> = self
            .store
            .service_certs()
            .await?
            .into_iter()
            .map(|r| {
                let d = declared.iter().find(|c| c.node == r.node && c.module == r.module);
                proto::ServiceCertInfo {
                    declared: d.is_some(),
                    lifetime_secs: d.map(|c| c.lifetime_secs),
                    names: r.names,
                    serial: r.serial,
                    issued_at: r.issued_at,
                    not_after: r.not_after,
                    refused_at: r.refused_at,
                    refusal: r.refusal,
                    held_serial: r.held_serial,
                    held_not_after: r.held_not_after,
                    node_error: r.node_error,
                    reported_at: r.reported_at,
                    node: r.node,
                    module: r.module,
                }
            })
            .collect();
        for c in &declared {
            if !out.iter().any(|i| i.node == c.node && i.module == c.module) {
                out.push(proto::ServiceCertInfo {
                    node: c.node.clone(),
                    module: c.module.clone(),
                    declared: true,
                    names: listed(c),
                    serial: None,
                    issued_at: None,
                    not_after: None,
                    lifetime_secs: Some(c.lifetime_secs),
                    refused_at: None,
                    refusal: None,
                    held_serial: None,
                    held_not_after: None,
                    node_error: None,
                    reported_at: None,
                });
            }
        }
        out.sort_by(|a, b| (&a.node, &a.module).cmp(&(&b.node, &b.module)));
        Ok(out)
    }
}

impl Controller {
    /// Per node, the modules whose declared service certificate expires within a quarter of its
    /// lifetime of now, or has expired: what the live page marks.
    pub async fn certificates_expiring(&self) -> Result<std::collections::HashMap<String, Vec<String>>> {
        let now = self.now();
        let mut out: std::collections::HashMap<String, Vec<String>> = Default::default();
        for c in self.service_certs().await? {
            if let (true, Some(t), Some(life)) = (c.declared, c.not_after, c.lifetime_secs) {
                if expiring(t, life, now) {
                    out.entry(c.node).or_default().push(c.module);
                }
            }
        }
        Ok(out)
    }
}

/// Whether a certificate valid until `not_after` for `lifetime` seconds expires within a quarter
/// of its lifetime of `now`: what the live page marks.
pub fn expiring(not_after: i64, lifetime: u64, now: i64) -> bool {
    not_after - now <= (lifetime / 4) as i64
}

/// `text` cut to at most `max` bytes at a character boundary, its control characters shown
/// escaped (it is the node's word, printed to operators).
pub(crate) fn cut(text: &str, max: usize) -> String {
    let shown = proto::text::printable(text).to_string();
    let mut end = shown.len().min(max);
    while !shown.is_char_boundary(end) {
        end -= 1;
    }
    shown[..end].to_string()
}
