//! Enrolment tokens: issued for a declared node (the secret is kept only as its SHA-256),
//! listed with their state, and revoked while unused.

use sha2::{Digest, Sha256};
use trellis_core::token::EnrolmentToken;
use trellis_proto as proto;
use trellis_proto::{AuditAction, TokenState};
use trellis_store::{Audit, TokenRecord};

use crate::{Controller, Error, Result};

/// The longest lifetime a token may have.
pub const MAX_TTL: u64 = 30 * 86400;

/// The most redemptions one pool token may allow.
pub const MAX_USES: u32 = 100_000;

/// A token's state at `now`: a pool token is used once it has had all its uses.
pub fn token_state(t: &TokenRecord, now: i64) -> TokenState {
    if t.revoked_at.is_some() {
        TokenState::Revoked
    } else if t.used >= t.uses || (t.pool.is_none() && t.used_at.is_some()) {
        TokenState::Used
    } else if now >= t.expires_at {
        TokenState::Expired
    } else {
        TokenState::Valid
    }
}

fn token_info(t: &TokenRecord, now: i64) -> proto::TokenInfo {
    proto::TokenInfo {
        id: t.id.clone(),
        node: t.node.clone(),
        created_at: t.created_at,
        expires_at: t.expires_at,
        used_at: t.used_at,
        revoked_at: t.revoked_at,
        require_approval: t.require_approval,
        state: token_state(t, now),
        pool: t.pool.clone(),
        uses: t.uses,
        used: t.used,
    }
}

impl Controller {
    /// Issues a token for a node of the current declaration, or a reusable one for a pool; the
    /// answer holds the only copy of its secret.
    pub async fn create_token(&self, req: &proto::TokenRequest) -> Result<proto::TokenCreated> {
        if req.ttl_secs == 0 || req.ttl_secs > MAX_TTL {
            return Err(Error::BadRequest(format!("token lifetime must be between 1 second and 30 days, not {} seconds", req.ttl_secs)));
        }
        let Some((revision, indexed)) = self.current_indexed().await? else {
            return Err(Error::NoDeclaration("no declaration has been applied yet; run `trellis apply DIR` first"));
        };
        let decl = indexed.decl();
        let uses = match (&req.pool, req.uses) {
            (Some(_), _) if !req.node.is_empty() => {
                return Err(Error::BadRequest("a token is for a node or for a pool, not both".into()));
            }
            (None, Some(_)) => return Err(Error::BadRequest("only a pool token takes `uses`; a node's token is used once".into())),
            (Some(_), Some(u)) if u == 0 || u > MAX_USES => {
                return Err(Error::BadRequest(format!("a pool token's uses must be from 1 to {MAX_USES}, not {u}")));
            }
            (Some(_), u) => u.unwrap_or(1),
            (None, None) => 1,
        };
        // A pool token names the pool where a node's token names the node.
        let subject = req.pool.as_ref().unwrap_or(&req.node);
        match &req.pool {
            Some(pool) if decl.pool(pool).is_none() => return Err(Error::PoolNotDeclared { pool: pool.clone(), revision }),
            Some(_) => {}
            None => {
                let Some(node) = indexed.node(&req.node) else {
                    return Err(Error::NodeNotDeclared { node: req.node.clone(), revision });
                };
                if node.public_key.is_some() {
                    return Err(Error::NodeManagedOutside(req.node.clone()));
                }
            }
        }
        let id: [u8; 8] = self.random();
        let secret: [u8; 24] = self.random();
        let created = self.now();
        let expires = created + req.ttl_secs as i64;
        let token = EnrolmentToken {
            controllers: self.config.advertise.clone(),
            ca_fingerprint: self.ca().fingerprint(),
            id,
            secret,
            node: subject.clone(),
            expires: expires as u64,
        };
        let text = token.encode().map_err(|e| Error::BadRequest(e.to_string()))?;
        let record = TokenRecord {
            id: hex::encode(id),
            node: subject.clone(),
            secret_sha256: hex::encode(Sha256::digest(secret)),
            created_at: created,
            expires_at: expires,
            used_at: None,
            revoked_at: None,
            require_approval: req.require_approval,
            pool: req.pool.clone(),
            uses: uses as i64,
            used: 0,
        };
        let detail = match &req.pool {
            Some(pool) => format!("token {} for pool {pool}, {uses} use(s), expires {expires}", record.id),
            None => format!("token {} expires {expires}", record.id),
        };
        let audit = Audit { at: created, actor: "admin", action: AuditAction::TokenIssued, subject, detail };
        self.store.create_token(&record, &audit).await?;
        Ok(proto::TokenCreated {
            token: text,
            id: record.id,
            node: subject.clone(),
            expires_at: expires,
            pool: req.pool.clone(),
            uses: uses as i64,
        })
    }

    pub async fn tokens(&self) -> Result<Vec<proto::TokenInfo>> {
        let now = self.now();
        Ok(self.store.tokens().await?.iter().map(|t| token_info(t, now)).collect())
    }

    /// Revokes a token with uses left (a pool token's members stay).
    pub async fn revoke_token(&self, id: &str) -> Result<proto::TokenInfo> {
        let Some(t) = self.store.token(id).await? else {
            return Err(Error::TokenNotFound(id.to_string()));
        };
        let audit =
            Audit { at: self.now(), actor: "admin", action: AuditAction::TokenRevoked, subject: &t.node, detail: format!("token {id}") };
        if !self.store.revoke_token(id, &audit).await? {
            return Err(Error::TokenNotRevocable { id: id.to_string(), state: token_state(&t, self.now()) });
        }
        self.remember(crate::ledger::Entry::Token { id: id.to_string(), at: audit.at });
        let t = self.store.token(id).await?.ok_or_else(|| Error::internal("revoking a token", "it vanished"))?;
        Ok(token_info(&t, self.now()))
    }
}
