//! What nodes trust beyond the CA (issue 21): the controller list nodes are given (ADR 0028),
//! and rotations of the bundle-signing key with the version of each node's bundle that first
//! announced the next key (ADR 0027). Each decision is written with its audit record.

use std::collections::HashMap;

use sqlx::Row;

use crate::{Audit, Result, Store, StoreError};

/// A rotation of the bundle-signing key, as recorded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RotationRecord {
    /// The next key's public half, base64.
    pub next_key: String,
    pub kind: String,
    pub started_at: i64,
    pub overlap_secs: i64,
    pub completed_at: Option<i64>,
    /// `evidence` (every active node confirmed) or `overlap` (the overlap passed first).
    pub completed_by: Option<String>,
}

impl Store {
    /// The controller list nodes are given, in order; empty when none was ever set (nodes are
    /// given the configured advertise addresses).
    pub async fn controllers(&self) -> Result<Vec<String>> {
        let rows = sqlx::query("SELECT address FROM controllers ORDER BY position").fetch_all(&self.pool).await?;
        rows.iter().map(|r| Ok(r.try_get("address")?)).collect()
    }

    /// Sets the controller list to `list` (the one `add` or `remove` made of the list before),
    /// in one transaction with the audit record.
    pub async fn set_controllers(&self, list: &[String], at: i64, audit: &Audit<'_>) -> Result<()> {
        let list = list.to_vec();
        self.decide(audit, |tx| {
            let list = list.clone();
            Box::pin(async move {
                sqlx::query("DELETE FROM controllers").execute(&mut **tx).await?;
                for (i, address) in list.into_iter().enumerate() {
                    sqlx::query("INSERT INTO controllers (address, position, added_at) VALUES ($1, $2, $3)")
                        .bind(address)
                        .bind(i as i64)
                        .bind(at)
                        .execute(&mut **tx)
                        .await?;
                }
                Ok(())
            })
        })
        .await
    }

    /// Every rotation, the newest first.
    pub async fn rotations(&self) -> Result<Vec<RotationRecord>> {
        let rows = sqlx::query(
            "SELECT next_key, kind, started_at, overlap_secs, completed_at, completed_by FROM rotations ORDER BY started_at DESC, next_key",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                Ok(RotationRecord {
                    next_key: r.try_get("next_key")?,
                    kind: r.try_get("kind")?,
                    started_at: r.try_get("started_at")?,
                    overlap_secs: r.try_get("overlap_secs")?,
                    completed_at: r.try_get("completed_at")?,
                    completed_by: r.try_get("completed_by")?,
                })
            })
            .collect()
    }

    /// Starts a rotation to `next_key`, unless one of its kind is in progress
    /// (`RotationInProgress`, decided in the transaction, so racing starts have one winner).
    pub async fn start_rotation(&self, r: &RotationRecord, audit: &Audit<'_>) -> Result<()> {
        let r = r.clone();
        self.decide(audit, |tx| {
            let r = r.clone();
            Box::pin(async move {
                let open = sqlx::query("SELECT next_key FROM rotations WHERE kind = $1 AND completed_at IS NULL")
                    .bind(r.kind.clone())
                    .fetch_optional(&mut **tx)
                    .await?;
                if let Some(row) = open {
                    let key: String = row.try_get("next_key")?;
                    return Err(StoreError::RotationInProgress(key));
                }
                // Two starts racing both find none open; the partial unique index lets one in, and
                // the other, waiting on it, inserts nothing and is told which key won (a plain
                // insert would fail on PostgreSQL with the index's violation instead).
                let n = sqlx::query(
                    "INSERT INTO rotations (next_key, kind, started_at, overlap_secs) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (kind) WHERE completed_at IS NULL DO NOTHING",
                )
                .bind(r.next_key)
                .bind(r.kind.clone())
                .bind(r.started_at)
                .bind(r.overlap_secs)
                .execute(&mut **tx)
                .await?
                .rows_affected();
                if n == 0 {
                    let won = sqlx::query("SELECT next_key FROM rotations WHERE kind = $1 AND completed_at IS NULL")
                        .bind(r.kind)
                        .fetch_optional(&mut **tx)
                        .await?;
                    let key: String = match won {
                        Some(row) => row.try_get("next_key")?,
                        None => String::new(),
                    };
                    return Err(StoreError::RotationInProgress(key));
                }
                Ok(())
            })
        })
        .await
    }

    /// Completes a rotation once: `false` when it was completed already (by another replica).
    pub async fn complete_rotation(&self, next_key: &str, at: i64, by: &str, audit: &Audit<'_>) -> Result<bool> {
        let (key, by) = (next_key.to_string(), by.to_string());
        let done = self
            .decide(audit, |tx| {
                let (key, by) = (key.clone(), by.clone());
                Box::pin(async move {
                    let n = sqlx::query(
                        "UPDATE rotations SET completed_at = $2, completed_by = $3 WHERE next_key = $1 AND completed_at IS NULL",
                    )
                    .bind(key)
                    .bind(at)
                    .bind(by)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                    if n == 0 {
                        // Nothing to audit: roll back by failing.
                        return Err(StoreError::NotFound("an open rotation".into()));
                    }
                    Ok(())
                })
            })
            .await;
        match done {
            Ok(()) => Ok(true),
            Err(StoreError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Records, for each node not recorded yet, the first version of its bundle announcing
    /// `next_key`.
    pub async fn record_announced(&self, next_key: &str, versions: &[(String, i64)]) -> Result<()> {
        if versions.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin().await?;
        for (node, version) in versions {
            sqlx::query("INSERT INTO rotation_nodes (next_key, node, version) VALUES ($1, $2, $3) ON CONFLICT (next_key, node) DO NOTHING")
                .bind(next_key.to_string())
                .bind(node.clone())
                .bind(*version)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Per node, the first version of its bundle that announced `next_key`.
    pub async fn announced(&self, next_key: &str) -> Result<HashMap<String, i64>> {
        let rows = sqlx::query("SELECT node, version FROM rotation_nodes WHERE next_key = $1")
            .bind(next_key.to_string())
            .fetch_all(&self.pool)
            .await?;
        rows.iter().map(|r| Ok((r.try_get("node")?, r.try_get("version")?))).collect()
    }
}
