//! Revocations followed to the data plane (ADR 0022): the decision (written with the node's
//! revocation, `Store::set_state`), the nodes that held the key and the first version of each
//! one's bundle without it (written by publish runs), each holder's first report of applying such
//! a version (read from the evidence), and the completion, written once with its audit record.

use std::collections::HashMap;

use sqlx::Row;
use trellis_proto::{EvidenceResult, Withdrawal};

use crate::{parse, Audit, Result, Store, StoreError};

/// One revocation as stored, with its holders while it is open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RevocationRecord {
    pub node: String,
    pub kind: Withdrawal,
    pub decided_at: i64,
    /// Whether a publish run has recorded the holders.
    pub holders_known: bool,
    /// When it completed, once recorded, and the holders it counted then.
    pub completed_at: Option<i64>,
    pub holders_counted: i64,
    /// Of the holders it counted when it completed, those whose agents manage no WireGuard
    /// interface (their reports prove nothing of the data plane).
    pub unverified: Vec<String>,
    /// The holders (only for an open revocation).
    pub holders: Vec<HolderRecord>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderRecord {
    pub holder: String,
    /// The first version of its bundle without the key, once published.
    pub dropped_in: Option<i64>,
    /// When the controller received its first report of applying `dropped_in` or later.
    pub applied_at: Option<i64>,
    /// Whether one of those reports came from an agent that manages its WireGuard interface.
    pub verified: bool,
}

impl Store {
    /// Every revocation (or only the open ones), oldest decision first; the open ones with their
    /// holders, each with the time its first report of applying a version without the key
    /// arrived.
    pub async fn revocations(&self, open_only: bool) -> Result<Vec<RevocationRecord>> {
        let filter = if open_only { " WHERE completed_at IS NULL" } else { "" };
        let rows = sqlx::query(&format!(
            "SELECT node, kind, decided_at, holders_known, completed_at, holders, unverified FROM revocations{filter} ORDER BY decided_at, node"
        ))
        .fetch_all(&self.pool)
        .await?;
        let mut out: Vec<RevocationRecord> = rows
            .iter()
            .map(|r| {
                Ok(RevocationRecord {
                    node: r.try_get("node")?,
                    kind: parse(r.try_get::<String, _>("kind")?)?,
                    decided_at: r.try_get("decided_at")?,
                    holders_known: r.try_get::<i64, _>("holders_known")? != 0,
                    completed_at: r.try_get("completed_at")?,
                    holders_counted: r.try_get("holders")?,
                    unverified: r.try_get::<String, _>("unverified")?.split(',').filter(|n| !n.is_empty()).map(str::to_string).collect(),
                    holders: Vec::new(),
                })
            })
            .collect::<Result<_>>()?;
        if out.iter().all(|r| r.completed_at.is_some()) {
            return Ok(out);
        }
        // Evidence is keyed by (node, seq): the join reads each holder's records only.
        let rows = sqlx::query(
            "SELECT h.node, h.holder, h.dropped_in, MIN(e.received_at) AS applied_at, \
             CAST(MAX(CASE WHEN e.unmanaged = 0 THEN 1 ELSE 0 END) AS BIGINT) AS verified FROM revocation_holders h \
             JOIN revocations r ON r.node = h.node \
             LEFT JOIN evidence e ON e.node = h.holder AND e.result = $1 AND e.version >= h.dropped_in \
             WHERE r.completed_at IS NULL GROUP BY h.node, h.holder, h.dropped_in ORDER BY h.node, h.holder",
        )
        .bind(EvidenceResult::Applied.as_str())
        .fetch_all(&self.pool)
        .await?;
        let mut holders: HashMap<String, Vec<HolderRecord>> = HashMap::new();
        for r in rows {
            holders.entry(r.try_get("node")?).or_default().push(HolderRecord {
                holder: r.try_get("holder")?,
                dropped_in: r.try_get("dropped_in")?,
                applied_at: r.try_get("applied_at")?,
                verified: r.try_get::<Option<i64>, _>("verified")?.unwrap_or(0) != 0,
            });
        }
        for r in &mut out {
            if r.completed_at.is_none() {
                r.holders = holders.remove(&r.node).unwrap_or_default();
            }
        }
        Ok(out)
    }

    /// The open revocations whose holders no publish run has recorded yet.
    pub async fn revocations_unrecorded(&self) -> Result<Vec<String>> {
        let rows = sqlx::query("SELECT node FROM revocations WHERE holders_known = 0 AND completed_at IS NULL ORDER BY node")
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(|r| Ok(r.try_get("node")?)).collect()
    }

    /// Records who held `node`'s key, each with the first version of its bundle without it if
    /// that is published already, unless a run (of any replica) recorded them first. Returns
    /// whether these were recorded.
    pub async fn record_holders(&self, node: &str, holders: &[(String, Option<i64>)]) -> Result<bool> {
        let mut tx = self.begin().await?;
        let n = sqlx::query("UPDATE revocations SET holders_known = 1 WHERE node = $1 AND holders_known = 0")
            .bind(node)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n != 1 {
            tx.rollback().await?;
            return Ok(false);
        }
        insert_holders(&mut tx, node, holders).await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Opens a withdrawal of routes through `node` (a router removed from a route, a hub no
    /// longer a hub: `Withdrawal::Routes`) decided at `at`, with its holders (each node that sent
    /// them through it, and the first version of its bundle that does not) known at once: the
    /// publish run that compiled the change knows both. A withdrawal opened before for the node
    /// starts over.
    pub async fn open_withdrawal(&self, node: &str, at: i64, holders: &[(String, Option<i64>)]) -> Result<()> {
        let mut tx = self.begin().await?;
        open(&mut tx, node, Withdrawal::Routes, at, true).await?;
        sqlx::query("UPDATE revocations SET holders_known = 1 WHERE node = $1").bind(node.to_string()).execute(&mut *tx).await?;
        insert_holders(&mut tx, node, holders).await?;
        tx.commit().await?;
        Ok(())
    }

    /// The holders of open revocations whose bundle without the key is not published yet, as
    /// (revoked node, holder).
    pub async fn holders_undropped(&self) -> Result<Vec<(String, String)>> {
        let rows = sqlx::query(
            "SELECT h.node, h.holder FROM revocation_holders h JOIN revocations r ON r.node = h.node \
             WHERE r.completed_at IS NULL AND h.dropped_in IS NULL ORDER BY h.node, h.holder",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| Ok((r.try_get("node")?, r.try_get("holder")?))).collect()
    }

    /// Records, for (revoked node, holder, version), the first version of the holder's bundle
    /// without the key; a version recorded already is kept.
    pub async fn record_dropped(&self, dropped: &[(String, String, i64)]) -> Result<()> {
        let mut tx = self.begin().await?;
        for (node, holder, version) in dropped {
            sqlx::query("UPDATE revocation_holders SET dropped_in = $1 WHERE node = $2 AND holder = $3 AND dropped_in IS NULL")
                .bind(*version)
                .bind(node)
                .bind(holder)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records that a revocation completed at `at`, counting `holders`, with its audit record;
    /// only once, whichever replica sees it first. Returns whether this call recorded it.
    pub async fn complete_revocation(&self, node: &str, at: i64, holders: i64, unverified: &[String], audit: &Audit<'_>) -> Result<bool> {
        let node = node.to_string();
        let unverified = unverified.join(",");
        let r = self
            .decide(audit, |tx| {
                let (node, unverified) = (node.clone(), unverified.clone());
                Box::pin(async move {
                    let n = sqlx::query(
                        "UPDATE revocations SET completed_at = $1, holders = $2, unverified = $4 WHERE node = $3 AND completed_at IS NULL AND holders_known = 1",
                    )
                    .bind(at)
                    .bind(holders)
                    .bind(node.clone())
                    .bind(unverified)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                    if n != 1 {
                        return Err(StoreError::NotFound(format!("open revocation of `{node}`")));
                    }
                    sqlx::query("DELETE FROM revocation_holders WHERE node = $1").bind(node).execute(&mut **tx).await?;
                    Ok(())
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

/// Writes the holders of `node`'s revocation or withdrawal, in multi-row inserts: an operator's
/// node may have ten thousand holders.
async fn insert_holders(tx: &mut sqlx::Transaction<'static, sqlx::Any>, node: &str, holders: &[(String, Option<i64>)]) -> Result<()> {
    for chunk in holders.chunks(250) {
        let mut sql = String::from("INSERT INTO revocation_holders (node, holder, dropped_in) VALUES ");
        for k in 0..chunk.len() {
            if k > 0 {
                sql.push_str(", ");
            }
            sql.push_str(&format!("(${}, ${}, ${})", 3 * k + 1, 3 * k + 2, 3 * k + 3));
        }
        let mut q = sqlx::query(&sql);
        for (holder, dropped_in) in chunk {
            q = q.bind(node.to_string()).bind(holder.clone()).bind(*dropped_in);
        }
        q.execute(&mut **tx).await?;
    }
    Ok(())
}

/// Opens a revocation in a decision's transaction: a node revoked again starts over. A node that
/// was not active was given to no peer: nobody holds its key, and the revocation is complete as
/// soon as it is looked at.
pub(crate) async fn open(
    tx: &mut sqlx::Transaction<'static, sqlx::Any>,
    node: &str,
    kind: Withdrawal,
    at: i64,
    was_active: bool,
) -> Result<()> {
    sqlx::query(
        "INSERT INTO revocations (node, kind, decided_at, holders_known, completed_at, holders) VALUES ($1, $2, $3, $4, NULL, 0) \
         ON CONFLICT (node) DO UPDATE SET kind = excluded.kind, decided_at = excluded.decided_at, \
         holders_known = excluded.holders_known, completed_at = NULL, holders = 0",
    )
    .bind(node.to_string())
    .bind(kind.as_str())
    .bind(at)
    .bind(i64::from(!was_active))
    .execute(&mut **tx)
    .await?;
    sqlx::query("DELETE FROM revocation_holders WHERE node = $1").bind(node.to_string()).execute(&mut **tx).await?;
    Ok(())
}
