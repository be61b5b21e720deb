//! Pools of short-lived nodes (ADR 0019): redeeming a pool token for a new member, named by the
//! controller (`POOL-N`, the lowest free N up to the pool's size) and given its overlay
//! addresses when it enrols; the declaration the controller compiles (the declared nodes plus
//! the live members); and the sweep that removes members out of contact for their pool's
//! `ephemeral_after`.

use std::sync::Arc;
use std::time::Duration;

use trellis_core::decl::{Member, PublicKey};
use trellis_core::Declaration;
use trellis_proto as proto;
use trellis_proto::{AuditAction, EnrolledState, TokenState};
use trellis_store::{Audit, MemberRefusal, NodeRecord, StoreError, TokenRecord};

use crate::error::Redemption;
use crate::{Controller, Error, Result};

/// How much longer than `ephemeral_after` the sweep waits before removing a member. Contacts are
/// written to the database in batches every 5 s by each replica (a long-poll in progress counts
/// as contact at each batch), so the last contact the database holds may be that much behind.
pub const SWEEP_SLACK: i64 = 15;

/// How often a redemption chooses a name and addresses again when another took them first.
const ATTEMPTS: usize = 50;

/// The pool member a node record is, if it is one.
pub fn member_of(r: &NodeRecord) -> Option<Member> {
    Some(Member {
        name: r.name.clone(),
        pool: r.pool.clone()?,
        address_ipv4: r.ipv4.as_deref().and_then(|a| a.parse().ok()),
        address_ipv6: r.ipv6.as_deref().and_then(|a| a.parse().ok()),
    })
}

/// The declaration with members, kept for as long as the revision and the members stay the
/// same, so that a publish run that changes only keys compiles the same `Arc` again.
pub(crate) type MembersCache = std::sync::Mutex<Option<(i64, Vec<Member>, Arc<Declaration>)>>;

impl Controller {
    /// The current declaration as compiled: the declared nodes plus every live member of its
    /// pools, each a node with its pool's networks, groups and modules.
    pub async fn current_mesh(&self) -> Result<Option<(i64, Arc<Declaration>)>> {
        let Some((revision, decl)) = self.current_declaration().await? else { return Ok(None) };
        if decl.pools.is_empty() {
            return Ok(Some((revision, decl)));
        }
        let members = self.store.members().await?;
        Ok(Some((revision, self.with_members(revision, decl, &members))))
    }

    /// `decl` (of `revision`) with the members among `records` added.
    pub(crate) fn with_members(&self, revision: i64, decl: Arc<Declaration>, records: &[NodeRecord]) -> Arc<Declaration> {
        let members: Vec<Member> = records.iter().filter_map(member_of).collect();
        if members.is_empty() || decl.pools.is_empty() {
            return decl;
        }
        let mut cache = self.members_cache.lock().expect("members cache");
        if let Some((r, m, d)) = cache.as_ref() {
            if *r == revision && *m == members {
                return d.clone();
            }
        }
        let d = Arc::new(decl.with_members(&members).into_owned());
        *cache = Some((revision, members, d.clone()));
        d
    }

    /// Redeems a pool token: a new member of its pool, named and addressed here. Exactly the
    /// token's uses succeed and the pool never holds more than its size (the store enforces both
    /// in the redemption's transaction); a retry with the keys of a member this pool made (its
    /// answer lost) is answered again.
    pub(crate) async fn redeem_member(&self, token: &TokenRecord, req: proto::EnrolRequest) -> Result<proto::EnrolResponse> {
        let pool_name = token.pool.clone().ok_or_else(|| Error::internal("redeeming a pool token", "it has no pool"))?;
        if req.node != token.node {
            return Err(Redemption::OtherNode { token: token.node.clone(), asked: req.node.clone() }.into());
        }
        let key = PublicKey::parse(&req.wireguard_public_key).ok_or(Redemption::BadKey)?;
        if let Some(again) = self.member_answered_again(&pool_name, key, &req).await? {
            return Ok(again);
        }
        let now = self.now();
        match crate::tokens::token_state(token, now) {
            TokenState::Valid => {}
            TokenState::Revoked => return Err(Redemption::Revoked.into()),
            TokenState::Used => return Err(Redemption::Used.into()),
            TokenState::Expired => return Err(Redemption::Expired.into()),
        }
        let Some((revision, indexed)) = self.current_indexed().await? else {
            return Err(Redemption::NoDeclaration.into());
        };
        let decl = indexed.decl();
        let Some(pool) = decl.pool(&pool_name) else {
            return Err(Redemption::PoolUndeclared { pool: pool_name, revision }.into());
        };
        if let Some(holder) = indexed.declared_holder(&key) {
            return Err(Error::KeyTaken(holder.name.clone()));
        }
        let state = if token.require_approval { EnrolledState::Pending } else { EnrolledState::Active };
        let (_, previous) = self.current_allocation().await?;
        // Numbers whose name turned out to be held by another row (a node of another kind that
        // keeps its record): the next attempt takes the next number instead of the same one.
        let mut held: Vec<u32> = Vec::new();
        for _ in 0..ATTEMPTS {
            let records = self.store.members().await?;
            let taken = records
                .iter()
                .filter(|r| r.pool.as_deref() == Some(pool_name.as_str()))
                .filter_map(|r| pool.number_of(&r.name))
                .chain(held.iter().copied());
            let Some(number) = pool.lowest_free(taken) else {
                return Err(Redemption::PoolFull { pool: pool_name, size: pool.size }.into());
            };
            let name = pool.member_name(number);
            // Addresses as an apply would give them: the members held are pinned where they are
            // (those of a pool no longer declared too, as if of this one: they hold their
            // addresses until the next sweep removes them).
            let mut members: Vec<Member> = records
                .iter()
                .filter_map(member_of)
                .map(|m| if decl.pool(&m.pool).is_some() { m } else { Member { pool: pool_name.clone(), ..m } })
                .collect();
            members.push(Member { name: name.clone(), pool: pool_name.clone(), address_ipv4: None, address_ipv6: None });
            let allocation = trellis_core::allocate(&decl.with_members(&members), &previous)
                .map_err(|d| Error::internal("giving a pool member its addresses", d.message))?;
            let issued = self
                .ca()
                .sign_node(
                    &req.csr_pem,
                    &name,
                    &decl.mesh.name,
                    self.system_time(),
                    Duration::from_secs(self.config.node_cert_secs),
                    self.random(),
                )
                .map_err(|e| Redemption::BadCsr(e.to_string()))?;
            let record = NodeRecord {
                pool: Some(pool_name.clone()),
                ipv4: allocation.ipv4.get(&name).map(|a| a.to_string()),
                ipv6: allocation.ipv6.get(&name).map(|a| a.to_string()),
                ..crate::enrolment::enrolled_record(&name, state, key, &issued, now)
            };
            let audit = Audit {
                at: now,
                actor: &format!("token {}", token.id),
                action: AuditAction::NodeEnrolled,
                subject: &name,
                detail: format!("member {number} of pool {pool_name}, state {state}, key {key}, certificate {}", issued.serial),
            };
            match self.store.enrol_member(&token.id, pool.size, &record, &audit).await {
                Ok(Ok(())) => {
                    self.ask_publish();
                    return Ok(self.enrolled(name, decl.mesh.name.clone(), state, issued.cert_pem));
                }
                Ok(Err(MemberRefusal::Taken)) => {
                    held.push(number);
                    continue;
                }
                Ok(Err(MemberRefusal::PoolFull)) => return Err(Redemption::PoolFull { pool: pool_name, size: pool.size }.into()),
                Ok(Err(MemberRefusal::TokenUsedUp)) => {
                    // Used up (or revoked, or expired) since it was read: say which.
                    let t = self.store.token(&token.id).await?.ok_or(Redemption::Unknown)?;
                    return Err(match crate::tokens::token_state(&t, self.now()) {
                        TokenState::Revoked => Redemption::Revoked,
                        TokenState::Expired => Redemption::Expired,
                        _ => Redemption::Used,
                    }
                    .into());
                }
                // A retry raced the redemption it repeats: once that one is committed, this is
                // answered as it was.
                Err(StoreError::KeyTaken(holder)) => {
                    return match self.member_answered_again(&pool_name, key, &req).await? {
                        Some(again) => Ok(again),
                        None => Err(Error::KeyTaken(holder)),
                    };
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(Error::internal("enrolling a pool member", format!("the names of pool {pool_name} kept being taken by others")))
    }

    /// The answer again to a redemption by a member of `pool` that holds `key`, made by an
    /// earlier redemption whose answer was lost: its record holds exactly what that one made (no
    /// renewal or revocation since) and the CSR's key is the one its certificate certifies.
    async fn member_answered_again(&self, pool: &str, key: PublicKey, req: &proto::EnrolRequest) -> Result<Option<proto::EnrolResponse>> {
        let key = key.to_string();
        let records = self.store.members().await?;
        let Some(record) = records.iter().find(|r| r.pool.as_deref() == Some(pool) && r.wg_public_key.as_deref() == Some(key.as_str()))
        else {
            return Ok(None);
        };
        let Some(cert_pem) =
            record.cert_pem.as_deref().filter(|_| record.prev_cert_serial.is_none() && record.state != EnrolledState::Revoked)
        else {
            return Err(Redemption::Used.into());
        };
        let asked = trellis_pki::csr_public_key(&req.csr_pem).map_err(|e| Redemption::BadCsr(e.to_string()))?;
        let certified = trellis_pki::cert_public_key(cert_pem).map_err(|e| Error::internal("reading a node certificate", e))?;
        use subtle::ConstantTimeEq;
        if !bool::from(asked.as_slice().ct_eq(&certified)) {
            return Err(Redemption::Used.into());
        }
        let mesh = self.current_declaration().await?.map(|(_, d)| d.mesh.name.clone()).ok_or(Redemption::NoDeclaration)?;
        Ok(Some(self.enrolled(record.name.clone(), mesh, record.state, cert_pem.to_string())))
    }

    /// Removes the members out of contact for longer than their pool's `ephemeral_after` (plus
    /// [`SWEEP_SLACK`]), revoked members, and those whose pool is no longer declared, each
    /// audited; their peers'
    /// bundles drop them in the publish run that follows. Safe with several replicas: a member
    /// is removed by one statement that checks its last contact again, so only one replica
    /// removes (and audits) it. Returns the members removed.
    pub async fn sweep_members(&self) -> Result<Vec<String>> {
        let Some((revision, decl)) = self.current_declaration().await? else { return Ok(Vec::new()) };
        let now = self.now();
        let mut removed = Vec::new();
        for m in self.store.members().await? {
            let pool = m.pool.as_deref().unwrap_or_default();
            let (before, detail) = match decl.pool(pool) {
                None => (i64::MAX, format!("member of pool {pool}, which revision {revision} no longer declares")),
                // Revoked: it takes no part any more, and its number is freed.
                Some(_) if m.state == EnrolledState::Revoked => (i64::MAX, format!("member of pool {pool}, revoked")),
                Some(p) => match p.ephemeral_after {
                    None => continue,
                    Some(secs) => (
                        now - secs as i64 - SWEEP_SLACK,
                        format!("member of pool {pool}, out of contact for longer than its ephemeral_after ({secs} s)"),
                    ),
                },
            };
            if m.last_contact.unwrap_or(m.enrolled_at) >= before {
                continue;
            }
            let last = m.last_contact.map_or("never".to_string(), |t| t.to_string());
            let audit = Audit {
                at: now,
                actor: "controller",
                action: AuditAction::NodeRemoved,
                subject: &m.name,
                detail: format!("{detail}; last contact {last}"),
            };
            if self.store.remove_member(&m.name, before, &audit).await? {
                tracing::info!(node = %m.name, pool, "removed pool member");
                removed.push(m.name);
            }
        }
        if !removed.is_empty() {
            self.ask_publish();
        }
        Ok(removed)
    }
}
