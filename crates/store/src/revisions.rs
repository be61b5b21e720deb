//! Revisions of the declaration, and the address allocation stored with each.

use std::collections::BTreeMap;

use sqlx::Row;
use trellis_core::Allocation;

use crate::{is_unique_violation, Audit, Result, Store, StoreError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision {
    pub number: i64,
    pub created_at: i64,
    pub digest: String,
    /// (path, text) of every declaration file.
    pub files: Vec<(String, String)>,
}

impl Store {
    pub async fn current_revision(&self) -> Result<Option<Revision>> {
        let row = sqlx::query("SELECT number, created_at, digest, files FROM revisions ORDER BY number DESC LIMIT 1")
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            let files: String = r.try_get("files")?;
            let files: Vec<(String, String)> = serde_json::from_str(&files).unwrap_or_default();
            Ok(Revision { number: r.try_get("number")?, created_at: r.try_get("created_at")?, digest: r.try_get("digest")?, files })
        })
        .transpose()
    }

    /// The number and digest of the current revision, without its files.
    pub async fn current_revision_head(&self) -> Result<Option<(i64, String)>> {
        let row = sqlx::query("SELECT number, digest FROM revisions ORDER BY number DESC LIMIT 1").fetch_optional(&self.pool).await?;
        row.map(|r| Ok((r.try_get("number")?, r.try_get("digest")?))).transpose()
    }

    /// Stores a declaration as the next revision with its address allocation, atomically. With
    /// `expect`, fails with `Conflict` unless the current revision is that one (0 for none). The
    /// pool members named in `replaced` (the revision declares nodes of their names) are removed
    /// in the same transaction, so no revision is ever current while a member holds the name of
    /// one of its declared nodes.
    pub async fn apply(
        &self,
        files: &[(String, String)],
        digest: &str,
        allocation: &Allocation,
        expect: Option<i64>,
        replaced: &[String],
        audit: &Audit<'_>,
    ) -> Result<i64> {
        let files_json = serde_json::to_string(files).expect("strings serialize");
        let at = audit.at;
        let allocation = allocation.clone();
        let result = self
            .decide(audit, |tx| {
                let files_json = files_json.clone();
                let digest = digest.to_string();
                let allocation = allocation.clone();
                let replaced = replaced.to_vec();
                Box::pin(async move {
                    let current: Option<i64> =
                        sqlx::query("SELECT MAX(number) AS n FROM revisions").fetch_one(&mut **tx).await?.try_get("n")?;
                    let current = current.unwrap_or(0);
                    if let Some(expected) = expect {
                        if expected != current {
                            return Err(StoreError::Conflict { current, expected });
                        }
                    }
                    let next = current + 1;
                    sqlx::query("INSERT INTO revisions (number, created_at, digest, files) VALUES ($1, $2, $3, $4)")
                        .bind(next)
                        .bind(at)
                        .bind(digest)
                        .bind(files_json)
                        .execute(&mut **tx)
                        .await?;
                    for name in &replaced {
                        sqlx::query("DELETE FROM nodes WHERE name = $1 AND pool IS NOT NULL").bind(name).execute(&mut **tx).await?;
                        for table in ["evidence", "evidence_floor"] {
                            sqlx::query(&format!("DELETE FROM {table} WHERE node = $1")).bind(name).execute(&mut **tx).await?;
                        }
                    }
                    // Only what changed is written: an apply that moves no address writes none.
                    let mut wanted: BTreeMap<&str, (Option<String>, Option<String>)> = BTreeMap::new();
                    for (n, a) in &allocation.ipv4 {
                        wanted.entry(n.as_str()).or_default().0 = Some(a.to_string());
                    }
                    for (n, a) in &allocation.ipv6 {
                        wanted.entry(n.as_str()).or_default().1 = Some(a.to_string());
                    }
                    let rows = sqlx::query("SELECT node, ipv4, ipv6 FROM addresses").fetch_all(&mut **tx).await?;
                    let mut held: BTreeMap<String, (Option<String>, Option<String>)> = BTreeMap::new();
                    for r in rows {
                        held.insert(r.try_get("node")?, (r.try_get("ipv4")?, r.try_get("ipv6")?));
                    }
                    for name in held.keys().filter(|n| !wanted.contains_key(n.as_str())) {
                        sqlx::query("DELETE FROM addresses WHERE node = $1").bind(name).execute(&mut **tx).await?;
                    }
                    let mut inserts = Vec::new();
                    for (n, v) in &wanted {
                        match held.get(*n) {
                            Some(h) if h == v => {}
                            Some(_) => {
                                sqlx::query("UPDATE addresses SET ipv4 = $1, ipv6 = $2 WHERE node = $3")
                                    .bind(v.0.clone())
                                    .bind(v.1.clone())
                                    .bind(*n)
                                    .execute(&mut **tx)
                                    .await?;
                            }
                            None => inserts.push((*n, v)),
                        }
                    }
                    // New rows go in batches: one statement per 300 rows, not one per row.
                    for chunk in inserts.chunks(300) {
                        let values: Vec<String> =
                            (0..chunk.len()).map(|i| format!("(${}, ${}, ${})", 3 * i + 1, 3 * i + 2, 3 * i + 3)).collect();
                        let sql = format!("INSERT INTO addresses (node, ipv4, ipv6) VALUES {}", values.join(", "));
                        let mut q = sqlx::query(&sql);
                        for (n, (v4, v6)) in chunk {
                            q = q.bind(*n).bind(v4.clone()).bind(v6.clone());
                        }
                        q.execute(&mut **tx).await?;
                    }
                    Ok(next)
                })
            })
            .await;
        match result {
            // Two applies raced for the same number: the loser sees who won.
            Err(StoreError::Db(e)) if is_unique_violation(&e) => {
                let current = self.current_revision().await?.map_or(0, |r| r.number);
                Err(StoreError::Conflict { current, expected: expect.unwrap_or(current - 1) })
            }
            other => other,
        }
    }

    /// The allocation of one node only (what a node's own request needs, at any mesh size).
    pub async fn allocation_of(&self, node: &str) -> Result<Allocation> {
        let rows = sqlx::query("SELECT node, ipv4, ipv6 FROM addresses WHERE node = $1").bind(node).fetch_all(&self.pool).await?;
        let mut a = Allocation::default();
        for r in rows {
            let node: String = r.try_get("node")?;
            if let Some(v4) = r.try_get::<Option<String>, _>("ipv4")?.and_then(|s| s.parse().ok()) {
                a.ipv4.insert(node.clone(), v4);
            }
            if let Some(v6) = r.try_get::<Option<String>, _>("ipv6")?.and_then(|s| s.parse().ok()) {
                a.ipv6.insert(node, v6);
            }
        }
        Ok(a)
    }

    pub async fn allocation(&self) -> Result<Allocation> {
        let rows = sqlx::query("SELECT node, ipv4, ipv6 FROM addresses").fetch_all(&self.pool).await?;
        let mut a = Allocation::default();
        for r in rows {
            let node: String = r.try_get("node")?;
            if let Some(v4) = r.try_get::<Option<String>, _>("ipv4")?.and_then(|s| s.parse().ok()) {
                a.ipv4.insert(node.clone(), v4);
            }
            if let Some(v6) = r.try_get::<Option<String>, _>("ipv6")?.and_then(|s| s.parse().ok()) {
                a.ipv6.insert(node, v6);
            }
        }
        Ok(a)
    }
}
