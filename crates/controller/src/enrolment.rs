//! Enrolment and identity: redeeming a token for a node certificate, renewing it over the
//! authenticated session, and recognising a node by the certificate it presents.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use trellis_core::decl::PublicKey;
use trellis_proto as proto;
use trellis_proto::{AuditAction, EnrolledState, TokenState};
use trellis_store::{Audit, NodeRecord};

use crate::error::{NodeRefusal, Redemption};
use crate::publish::AuthEntry;
use crate::refusals::{Source, Verdict};
use crate::{Controller, Error, Result};

/// A node, proven by its certificate.
#[derive(Clone, Debug)]
pub struct NodeIdentity {
    pub name: String,
    pub state: EnrolledState,
    /// The serial of the certificate it presented.
    pub serial: String,
}

/// The largest CSR an enrolment may carry.
const MAX_CSR: usize = 16 * 1024;

/// Whether an enrolment request has the shape of one: a 16-hex-digit token id, a node name that
/// is a DNS label, a CSR and key of plausible size. Checked before anything is looked up or
/// written.
fn well_formed(req: &proto::EnrolRequest) -> Result<()> {
    let hex_id = req.token_id.len() == 16 && req.token_id.bytes().all(|b| b.is_ascii_hexdigit());
    if !hex_id
        || !trellis_core::load::is_dns_label(&req.node)
        || req.csr_pem.len() > MAX_CSR
        || req.secret.len() > 64
        || req.wireguard_public_key.len() > 64
    {
        return Err(Redemption::Malformed.into());
    }
    Ok(())
}

impl Controller {
    pub(crate) fn system_time(&self) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(self.now().max(0) as u64)
    }

    /// Redeems a token: the node's CSR and WireGuard key become its certificate and record. A
    /// refused redemption is a governance event too: it is audited, and changes nothing else.
    /// (In process, with no source address; see [`Controller::enrol_from`].)
    pub async fn enrol(&self, req: proto::EnrolRequest) -> Result<proto::EnrolResponse> {
        self.enrol_from(req, None).await
    }

    /// [`Controller::enrol`] for a request from `source`. Its refusals are counted against it:
    /// the first few in a window are audited one by one, the next only counted (and written as
    /// one record when the window closes), and past a limit the source is turned away before
    /// anything is read (`refusals`).
    pub async fn enrol_from(&self, req: proto::EnrolRequest, source: Option<std::net::IpAddr>) -> Result<proto::EnrolResponse> {
        let source = Source::of(source);
        let now = self.now();
        if let Err(wait) = self.refusals.admit(source, now) {
            return Err(Redemption::TooMany { from: source.to_string(), wait }.into());
        }
        // The shape first: a request that is not an enrolment is answered and forgotten (not
        // even counted: it costs no lookup), so an unauthenticated caller cannot write its fields
        // into the audit chain.
        well_formed(&req)?;
        let (token_id, node) = (req.token_id.clone(), req.node.clone());
        match self.redeem(req).await {
            Ok(r) => Ok(r),
            Err(e) => {
                if self.refusals.refused(source, now, &e.to_string()) == Verdict::Audit {
                    let audit = Audit {
                        at: now,
                        actor: &format!("token {token_id}"),
                        action: AuditAction::TokenRedemptionRefused,
                        subject: &node,
                        detail: format!("{e} (from {source})"),
                    };
                    if let Err(ae) = self.store.record(&audit).await {
                        tracing::error!("cannot audit a refused redemption: {ae}");
                    }
                }
                Err(e)
            }
        }
    }

    /// Writes one audit record for each closed window of refusals that were counted, not audited
    /// one by one. Called by the server's timer (every 5 s) and when it stops.
    pub async fn write_refusals(&self) {
        self.write_cert_refusals().await;
        let audited = self.refusals.limits().audited;
        for (source, w) in self.refusals.closed(self.now()) {
            let audit = Audit {
                at: self.now(),
                actor: &format!("source {source}"),
                action: AuditAction::TokenRedemptionsRefused,
                subject: &source.to_string(),
                detail: format!(
                    "{} more refused from {source} in the {} s from {} ({} of them turned away unread); the last: {}",
                    w.refused - audited,
                    self.refusals.limits().window_secs,
                    w.start,
                    w.turned_away,
                    w.last_reason
                ),
            };
            if let Err(e) = self.store.record(&audit).await {
                tracing::error!("cannot audit refused redemptions from {source}: {e}");
            }
        }
    }

    async fn redeem(&self, req: proto::EnrolRequest) -> Result<proto::EnrolResponse> {
        let secret = base64::engine::general_purpose::STANDARD
            .decode(&req.secret)
            .ok()
            .filter(|s| s.len() == 24)
            .ok_or(Redemption::SecretMalformed)?;
        let token = self.store.token(&req.token_id).await?.ok_or(Redemption::Unknown)?;
        let stored = hex::decode(&token.secret_sha256).map_err(|e| Error::internal("reading a token", e))?;
        let given = Sha256::digest(&secret);
        if !bool::from(given.as_slice().ct_eq(&stored)) {
            return Err(Redemption::Wrong.into());
        }
        let t = self.now();
        if token.pool.is_some() {
            return self.redeem_member(&token, req).await;
        }
        match crate::tokens::token_state(&token, t) {
            TokenState::Valid => {}
            TokenState::Revoked => return Err(Redemption::Revoked.into()),
            // A retry of the redemption that used it, whose answer was lost, is answered again.
            TokenState::Used => return self.answer_again(&token, &req).await,
            TokenState::Expired => return Err(Redemption::Expired.into()),
        }
        if req.node != token.node {
            return Err(Redemption::OtherNode { token: token.node.clone(), asked: req.node.clone() }.into());
        }
        let Some((revision, indexed)) = self.current_indexed().await? else {
            return Err(Redemption::NoDeclaration.into());
        };
        let Some(node) = indexed.node(&req.node) else {
            return Err(Redemption::NodeUndeclared { node: req.node.clone(), revision }.into());
        };
        if node.public_key.is_some() {
            return Err(Redemption::NodeManagedOutside(req.node.clone()).into());
        }
        let key = PublicKey::parse(&req.wireguard_public_key).ok_or(Redemption::BadKey)?;
        if let Some(holder) = indexed.declared_holder(&key) {
            return Err(Error::KeyTaken(holder.name.clone()));
        }
        let decl = indexed.decl();
        let lifetime = Duration::from_secs(self.config.node_cert_secs);
        let issued = self
            .ca()
            .sign_node(&req.csr_pem, &req.node, &decl.mesh.name, self.system_time(), lifetime, self.random())
            .map_err(|e| Redemption::BadCsr(e.to_string()))?;
        let state = if token.require_approval { EnrolledState::Pending } else { EnrolledState::Active };
        let record = enrolled_record(&req.node, state, key, &issued, t);
        let audit = Audit {
            at: t,
            actor: &format!("token {}", token.id),
            action: AuditAction::NodeEnrolled,
            subject: &req.node,
            detail: format!("state {state}, key {key}, certificate {}", issued.serial),
        };
        match self.store.enrol(&token.id, &record, &audit).await {
            Ok(()) => {}
            // A retry raced the redemption it repeats (the first was still being decided when
            // the node gave up waiting): once that one is committed, this is answered as it was.
            Err(trellis_store::StoreError::TokenUsed) => {
                let token = self.store.token(&req.token_id).await?.ok_or(Redemption::Unknown)?;
                return self.answer_again(&token, &req).await;
            }
            Err(e) => return Err(e.into()),
        }
        self.ask_publish();
        Ok(self.enrolled(req.node, decl.mesh.name.clone(), state, issued.cert_pem))
    }

    /// The answer to a redemption: the node's certificate and what it needs to trust and reach
    /// the mesh.
    pub(crate) fn enrolled(&self, node: String, mesh: String, state: EnrolledState, node_cert_pem: String) -> proto::EnrolResponse {
        proto::EnrolResponse {
            node,
            mesh,
            state,
            node_cert_pem,
            ca_pem: self.ca().cert_pem().to_string(),
            signing_public_key: base64::engine::general_purpose::STANDARD.encode(self.signing_key().verifying_key().to_bytes()),
            controllers: self.config.advertise.clone(),
        }
    }

    /// The answer to a redemption of a used token: if it is a retry of the redemption that used
    /// it (its answer lost on the way), the node's record still holds exactly what that one
    /// made — the same WireGuard key, a certificate for the CSR's key, nothing renewed or
    /// revoked since — and the answer is given again, unchanged. Anything else is "token already
    /// used". Nothing in the answer is secret: the private keys never left the node.
    async fn answer_again(&self, token: &trellis_store::TokenRecord, req: &proto::EnrolRequest) -> Result<proto::EnrolResponse> {
        let used = || Error::from(Redemption::Used);
        if req.node != token.node {
            return Err(Redemption::OtherNode { token: token.node.clone(), asked: req.node.clone() }.into());
        }
        let Some(record) = self.store.node(&req.node).await? else { return Err(used()) };
        let same_key = PublicKey::parse(&req.wireguard_public_key).map(|k| k.to_string()) == record.wg_public_key;
        let made_by_this_token = token.used_at == Some(record.enrolled_at) && record.prev_cert_serial.is_none();
        let Some(cert_pem) =
            record.cert_pem.as_deref().filter(|_| same_key && made_by_this_token && record.state != EnrolledState::Revoked)
        else {
            return Err(used());
        };
        // The CSR proves possession of its key (its signature), and the key must be the one the
        // certificate certifies.
        let asked = trellis_pki::csr_public_key(&req.csr_pem).map_err(|e| Redemption::BadCsr(e.to_string()))?;
        let certified = trellis_pki::cert_public_key(cert_pem).map_err(|e| Error::internal("reading a node certificate", e))?;
        if !bool::from(asked.as_slice().ct_eq(&certified)) {
            return Err(used());
        }
        let mesh = self.current_declaration().await?.map(|(_, d)| d.mesh.name.clone()).ok_or(Redemption::NoDeclaration)?;
        Ok(self.enrolled(record.name.clone(), mesh, record.state, cert_pem.to_string()))
    }

    /// A new certificate for a node, from a CSR it sent over its authenticated session. The
    /// certificate it replaces stays valid until it expires.
    pub async fn renew(&self, who: &NodeIdentity, req: &proto::RenewRequest) -> Result<proto::RenewResponse> {
        self.require_approved(who)?;
        let name = who.name.clone();
        // Only the current certificate renews: the one it replaced still authenticates until it
        // expires, but renewing with it would replace, and so lock out, the current one.
        let record = self.store.node(&name).await?;
        let current = record.as_ref().and_then(|r| r.cert_serial.clone());
        if current.as_deref() != Some(who.serial.as_str()) {
            // A retry whose answer was lost: the certificate it replaced asks again for the
            // same key, and is answered the certificate it was given. Without this a node that
            // lost the answer kept its old certificate until it expired (or, in a CA rotation,
            // until the old CA stopped being trusted), every retry refused.
            if let Some(again) = record.as_ref().and_then(|r| renewed_already(r, &who.serial, &req.csr_pem)) {
                return Ok(again);
            }
            return Err(NodeRefusal::Superseded(name).into());
        }
        // Each renewal is audited and publishes: a few in a window, not one per request (a node
        // renewing in a loop grew the chain without bound).
        if let Err(wait) = self.renewals.take(&name, self.now(), crate::issue_window(self.config.node_cert_secs)) {
            return Err(Error::TooOften { node: name, what: "its certificate's renewal".into(), wait });
        }
        let mesh = self.current_declaration().await?.map(|(_, d)| d.mesh.name.clone()).unwrap_or_default();
        let issued = self
            .ca()
            .sign_node(&req.csr_pem, &name, &mesh, self.system_time(), Duration::from_secs(self.config.node_cert_secs), self.random())
            .map_err(|e| Error::BadRequest(e.to_string()))?;
        let audit = Audit {
            at: self.now(),
            actor: &format!("node {name}"),
            action: AuditAction::CertificateRenewed,
            subject: &name,
            detail: format!("{} replaces {}", issued.serial, who.serial),
        };
        self.store.renew(&name, &who.serial, &issued.serial, issued.not_after, &issued.cert_pem, &audit).await.map_err(|e| match e {
            // Another renewal with the same certificate won the race.
            trellis_store::StoreError::NotFound(_) => Error::from(NodeRefusal::Superseded(name.clone())),
            other => other.into(),
        })?;
        self.ask_publish();
        Ok(proto::RenewResponse { node_cert_pem: issued.cert_pem, not_after: issued.not_after })
    }

    /// Recognises a node by the DER of the client certificate it presented (TLS has checked that
    /// the mesh CA issued it): the serial must be the node's current (or just replaced) one, and
    /// the node not revoked. Answered from the publisher's table, so a long-poll or a `304` needs
    /// no database; a node it does not know yet (just enrolled on another replica) is looked up.
    pub async fn authenticate_node(&self, cert_der: Option<&[u8]>) -> Result<NodeIdentity> {
        let cert = cert_der.ok_or(NodeRefusal::CertificateRequired)?;
        let info = trellis_pki::inspect_der(cert).map_err(|e| NodeRefusal::BadCertificate(e.to_string()))?;
        // TLS checked only that the chain ends at a mesh CA: a service certificate (under the
        // services CA) does too, and is no node's identity whatever it names.
        if !self.issued_by_mesh_ca(cert) {
            return Err(NodeRefusal::ServiceCertificate(trellis_proto::text::printable(&info.common_name).into_owned()).into());
        }
        let node = info.common_name;
        // The node's state and serials are read from the database on every request, so that a
        // revocation (or renewal) decided by any replica is seen here at once (issue 21, item 5):
        // the table, refreshed by publish runs, lagged up to half a second on other replicas. It
        // answers only while the database cannot: the mesh keeps being served in an outage.
        let entry = match self.store.node_auth(&node).await {
            Ok(Some((state, serials, pool))) => {
                // A member whose name the declaration now gives a declared node is no node of
                // the mesh: the table knows from the last run; a member newer than that is
                // checked against the current declaration here.
                let replaced = match (self.publisher.auth(&node), &pool) {
                    (Some(e), Some(_)) if e.serials == serials => e.replaced,
                    (_, Some(pool)) => match self.current_indexed().await? {
                        Some((_, decl)) if decl.node(&node).is_some() => Some(pool.clone()),
                        _ => None,
                    },
                    (_, None) => None,
                };
                AuthEntry { state, serials, replaced }
            }
            Ok(None) => return Err(NodeRefusal::Unknown(node).into()),
            Err(e) if e.unavailable().is_some() => match self.publisher.auth(&node) {
                Some(entry) => {
                    tracing::warn!(node, "the database is unavailable ({e}): the node authenticated by the last publish run's table");
                    entry
                }
                None => return Err(e.into()),
            },
            Err(e) => return Err(e.into()),
        };
        if let Some(pool) = entry.replaced {
            return Err(NodeRefusal::Replaced { node, pool }.into());
        }
        if entry.state == EnrolledState::Revoked {
            return Err(NodeRefusal::Revoked(node).into());
        }
        if !entry.serials.contains(&info.serial) {
            return Err(NodeRefusal::CertificateReplaced(node).into());
        }
        self.publisher.contact(&node, self.now());
        Ok(NodeIdentity { name: node, state: entry.state, serial: info.serial })
    }

    /// Whether a node may take part (fetch its bundle, report evidence, renew): an enrolled node
    /// pending approval may not.
    pub fn require_approved(&self, who: &NodeIdentity) -> Result<()> {
        if who.state == EnrolledState::Pending {
            return Err(NodeRefusal::PendingApproval(who.name.clone()).into());
        }
        Ok(())
    }
}

/// The answer a renewal from the certificate `serial` was given, when `record` shows that the
/// node renewed from it (it is the previous serial) for the key the CSR names.
fn renewed_already(record: &NodeRecord, serial: &str, csr_pem: &str) -> Option<proto::RenewResponse> {
    if record.prev_cert_serial.as_deref() != Some(serial) {
        return None;
    }
    let cert_pem = record.cert_pem.as_deref()?;
    let asked = trellis_pki::csr_public_key(csr_pem).ok()?;
    let certified = trellis_pki::cert_public_key(cert_pem).ok()?;
    if !bool::from(asked.as_slice().ct_eq(&certified)) {
        return None;
    }
    Some(proto::RenewResponse { node_cert_pem: cert_pem.to_string(), not_after: record.cert_not_after.unwrap_or_default() })
}

/// The record of a node that has just enrolled with `key` and been issued `issued` at `at`
/// (a pool's member adds its pool and addresses).
pub(crate) fn enrolled_record(name: &str, state: EnrolledState, key: PublicKey, issued: &trellis_pki::IssuedCert, at: i64) -> NodeRecord {
    NodeRecord {
        name: name.to_string(),
        state,
        wg_public_key: Some(key.to_string()),
        cert_serial: Some(issued.serial.clone()),
        prev_cert_serial: None,
        cert_not_after: Some(issued.not_after),
        enrolled_at: at,
        last_contact: Some(at),
        cert_pem: Some(issued.cert_pem.clone()),
        pool: None,
        ipv4: None,
        ipv6: None,
    }
}
