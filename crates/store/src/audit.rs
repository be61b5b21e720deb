//! The audit chain: what a decision writes, appended in the decision's transaction and chained
//! by SHA-256 (ADR 0008), and reading it back.

use sqlx::{Any, Row, Transaction};
use trellis_proto::{AuditAction, AuditRecord};

use crate::{Result, Store};

/// What a decision writes to the audit chain.
pub struct Audit<'a> {
    pub at: i64,
    pub actor: &'a str,
    pub action: AuditAction,
    pub subject: &'a str,
    pub detail: String,
}

impl Store {
    /// The newest audit sequence number: every governance decision moves it, so replicas watch
    /// it to learn that something changed.
    pub async fn audit_head(&self) -> Result<i64> {
        let r = sqlx::query("SELECT MAX(seq) AS top FROM audit").fetch_one(&self.pool).await?;
        Ok(r.try_get::<Option<i64>, _>("top")?.unwrap_or(0))
    }

    /// The newest audit record's sequence number and hash, if there is one.
    pub async fn audit_head_hash(&self) -> Result<Option<(i64, String)>> {
        let row = sqlx::query("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetch_optional(&self.pool).await?;
        row.map(|r| Ok((r.try_get("seq")?, r.try_get("hash")?))).transpose()
    }

    /// The hash of the record at `seq`, if the chain holds it.
    pub async fn audit_hash_at(&self, seq: i64) -> Result<Option<String>> {
        let row = sqlx::query("SELECT hash FROM audit WHERE seq = $1").bind(seq).fetch_optional(&self.pool).await?;
        row.map(|r| Ok(r.try_get("hash")?)).transpose()
    }

    /// How many node revocations were ever decided (or made again from the ledger): it only
    /// rises, and a restore from before a revocation lowers it (ADR 0024).
    pub async fn revocations_decided(&self) -> Result<u64> {
        let r = sqlx::query("SELECT COUNT(*) AS n FROM audit WHERE action = $1")
            .bind(AuditAction::NodeRevoked.as_str())
            .fetch_one(&self.pool)
            .await?;
        Ok(r.try_get::<i64, _>("n")?.max(0) as u64)
    }

    /// Records an event that changes nothing else, such as a refused token redemption.
    pub async fn record(&self, audit: &Audit<'_>) -> Result<()> {
        self.decide(audit, |_| Box::pin(async { Ok(()) })).await
    }

    /// The whole chain. For tests and small chains: listing goes by [`Store::audit_page`].
    pub async fn audit(&self) -> Result<Vec<AuditRecord>> {
        self.audit_page(0, i64::MAX).await
    }

    /// At most `limit` records after sequence number `after`, oldest first.
    pub async fn audit_page(&self, after: i64, limit: i64) -> Result<Vec<AuditRecord>> {
        let rows =
            sqlx::query("SELECT seq, at, actor, action, subject, detail, prev_hash, hash FROM audit WHERE seq > $1 ORDER BY seq LIMIT $2")
                .bind(after)
                .bind(limit)
                .fetch_all(&self.pool)
                .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditRecord {
                    seq: r.try_get("seq")?,
                    at: r.try_get("at")?,
                    actor: r.try_get("actor")?,
                    action: r.try_get("action")?,
                    subject: r.try_get("subject")?,
                    detail: r.try_get("detail")?,
                    prev_hash: r.try_get("prev_hash")?,
                    hash: r.try_get("hash")?,
                })
            })
            .collect()
    }
}

/// Appends `a` to the chain inside `tx`. Two writers may both read the same last record; the
/// second then fails on the unique sequence number, and `decide` retries.
pub(crate) async fn append(tx: &mut Transaction<'static, Any>, a: &Audit<'_>) -> Result<()> {
    let last = sqlx::query("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetch_optional(&mut **tx).await?;
    let (seq, prev) = match last {
        Some(r) => (r.try_get::<i64, _>("seq")? + 1, r.try_get::<String, _>("hash")?),
        None => (1, String::new()),
    };
    let hash = trellis_proto::audit::hash(seq, a.at, a.actor, a.action.as_str(), a.subject, &a.detail, &prev);
    sqlx::query("INSERT INTO audit (seq, at, actor, action, subject, detail, prev_hash, hash) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")
        .bind(seq)
        .bind(a.at)
        .bind(a.actor)
        .bind(a.action.as_str())
        .bind(a.subject)
        .bind(a.detail.clone())
        .bind(prev)
        .bind(hash)
        .execute(&mut **tx)
        .await?;
    Ok(())
}
