//! Enrolment tokens: created, read, revoked while unused (redemption is part of enrolment).

use sqlx::any::AnyRow;
use sqlx::Row;

use crate::{Audit, Result, Store, StoreError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRecord {
    pub id: String,
    pub node: String,
    pub secret_sha256: String,
    pub created_at: i64,
    pub expires_at: i64,
    pub used_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub require_approval: bool,
    /// The pool whose members this token enrols (then `node` holds the pool's name too); none
    /// for a token for one declared node.
    pub pool: Option<String>,
    /// How many redemptions the token allows (1 for a node's token), and how many it had.
    pub uses: i64,
    pub used: i64,
}

const TOKEN_COLUMNS: &str = "id, node, secret_sha256, created_at, expires_at, used_at, revoked_at, require_approval, pool, uses, used";

fn token_record(r: &AnyRow) -> Result<TokenRecord> {
    Ok(TokenRecord {
        id: r.try_get("id")?,
        node: r.try_get("node")?,
        secret_sha256: r.try_get("secret_sha256")?,
        created_at: r.try_get("created_at")?,
        expires_at: r.try_get("expires_at")?,
        used_at: r.try_get("used_at")?,
        revoked_at: r.try_get("revoked_at")?,
        require_approval: r.try_get::<i64, _>("require_approval")? != 0,
        pool: r.try_get("pool")?,
        uses: r.try_get("uses")?,
        used: r.try_get("used")?,
    })
}

impl Store {
    pub async fn create_token(&self, t: &TokenRecord, audit: &Audit<'_>) -> Result<()> {
        let t = t.clone();
        self.decide(audit, |tx| {
            let t = t.clone();
            Box::pin(async move {
                sqlx::query(&format!("INSERT INTO tokens ({TOKEN_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)"))
                    .bind(t.id)
                    .bind(t.node)
                    .bind(t.secret_sha256)
                    .bind(t.created_at)
                    .bind(t.expires_at)
                    .bind(t.used_at)
                    .bind(t.revoked_at)
                    .bind(t.require_approval as i64)
                    .bind(t.pool)
                    .bind(t.uses)
                    .bind(t.used)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .await
    }

    pub async fn token(&self, id: &str) -> Result<Option<TokenRecord>> {
        let row = sqlx::query(&format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE id = $1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(token_record).transpose()
    }

    pub async fn tokens(&self) -> Result<Vec<TokenRecord>> {
        let rows = sqlx::query(&format!("SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at, id")).fetch_all(&self.pool).await?;
        rows.iter().map(token_record).collect()
    }

    /// Revokes a token that has uses left. Returns false when there is no such token or it has
    /// none (a node's token once used, a pool token used up).
    pub async fn revoke_token(&self, id: &str, audit: &Audit<'_>) -> Result<bool> {
        let id = id.to_string();
        let at = audit.at;
        let r = self
            .decide(audit, |tx| {
                let id = id.clone();
                Box::pin(async move {
                    let n = sqlx::query("UPDATE tokens SET revoked_at = $1 WHERE id = $2 AND used < uses AND revoked_at IS NULL")
                        .bind(at)
                        .bind(id.clone())
                        .execute(&mut **tx)
                        .await?
                        .rows_affected();
                    if n == 1 {
                        Ok(())
                    } else {
                        Err(StoreError::NotFound(format!("unused token {id}")))
                    }
                })
            })
            .await;
        match r {
            Ok(()) => Ok(true),
            Err(StoreError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }
}
