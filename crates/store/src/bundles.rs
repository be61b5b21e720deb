//! The version and digest of every node's current bundle, and publishing new content.

use std::collections::HashMap;

/// Up to how many nodes `bundles_of` (and so `publish`, which reads back what it stored) reads
/// by name; more are read as `bundles` reads every row (at 100,000 nodes, about 300 ms).
pub const BUNDLES_BY_NAME: usize = 2_000;

use sqlx::Row;

use crate::{is_unique_violation, Result, Store, StoreError};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleVersion {
    pub version: i64,
    pub digest: String,
    pub issued_at: i64,
}

fn is_serialization(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("40001") || d.code().as_deref() == Some("40P01"))
}

impl Store {
    /// Version, content digest and issue time of every node's current bundle.
    pub async fn bundles(&self) -> Result<HashMap<String, BundleVersion>> {
        let rows = sqlx::query("SELECT node, version, digest, issued_at FROM bundles").fetch_all(&self.pool).await?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("node")?,
                    BundleVersion { version: r.try_get("version")?, digest: r.try_get("digest")?, issued_at: r.try_get("issued_at")? },
                ))
            })
            .collect()
    }

    /// How many bundles there are and the sum of their versions: it moves whenever any replica
    /// publishes (versions only rise), so a replica can see, with one small query, that the
    /// versions it holds may be behind.
    pub async fn bundle_versions(&self) -> Result<(i64, i64)> {
        let r = sqlx::query("SELECT COUNT(*) AS n, CAST(COALESCE(SUM(version), 0) AS BIGINT) AS total FROM bundles")
            .fetch_one(&self.pool)
            .await?;
        Ok((r.try_get("n")?, r.try_get("total")?))
    }

    /// The version, digest and issue time of one node's current bundle, if it has one.
    pub async fn bundle(&self, node: &str) -> Result<Option<BundleVersion>> {
        let row =
            sqlx::query("SELECT version, digest, issued_at FROM bundles WHERE node = $1").bind(node).fetch_optional(&self.pool).await?;
        row.map(|r| Ok(BundleVersion { version: r.try_get("version")?, digest: r.try_get("digest")?, issued_at: r.try_get("issued_at")? }))
            .transpose()
    }

    /// Moves every bundle's version up by `past`, with the audit record that says so: after a
    /// restore, every version is then above any this mesh numbered before (`past` is the highest).
    pub async fn renumber_past(&self, past: i64, audit: &crate::Audit<'_>) -> Result<()> {
        self.decide(audit, |tx| {
            Box::pin(async move {
                sqlx::query("UPDATE bundles SET version = version + $1").bind(past).execute(&mut **tx).await?;
                Ok(())
            })
        })
        .await
    }

    /// Numbers a node's current bundle above `held`, the version the node says it holds, when
    /// the stored one is not above it already (the database was restored from a backup taken
    /// before the node got it): its content stays, and the next publish run signs it at the new
    /// version. Returns whether the version moved.
    /// A version the next would take above the tag's ceiling is never written.
    pub async fn raise_version(&self, node: &str, held: i64) -> Result<bool> {
        if held >= trellis_proto::etag::MAX_VERSION {
            return Ok(false);
        }
        let moved = sqlx::query("UPDATE bundles SET version = $2 + 1 WHERE node = $1 AND version <= $2")
            .bind(node)
            .bind(held)
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(moved > 0)
    }

    /// Records new content for these nodes: each whose digest differs from its stored one gets
    /// the next version, in one transaction. A node whose stored digest already matches (another
    /// replica published it first) keeps its version. Returns the versions now in force.
    pub async fn publish(&self, changes: &[(String, String)], now: i64) -> Result<Vec<(String, BundleVersion)>> {
        let mut attempt = 0;
        loop {
            let mut tx = self.begin().await?;
            let r: Result<()> = async {
                // Multi-row upserts: a node's version moves only when its digest changes.
                for chunk in changes.chunks(250) {
                    let mut sql = String::from("INSERT INTO bundles (node, version, digest, issued_at) VALUES ");
                    for k in 0..chunk.len() {
                        if k > 0 {
                            sql.push_str(", ");
                        }
                        sql.push_str(&format!("(${}, 1, ${}, ${})", 3 * k + 1, 3 * k + 2, 3 * k + 3));
                    }
                    sql.push_str(
                        " ON CONFLICT (node) DO UPDATE SET version = bundles.version + 1, digest = excluded.digest, \
                         issued_at = excluded.issued_at WHERE bundles.digest <> excluded.digest",
                    );
                    let mut q = sqlx::query(&sql);
                    for (node, digest) in chunk {
                        q = q.bind(node.clone()).bind(digest.clone()).bind(now);
                    }
                    q.execute(&mut *tx).await?;
                }
                Ok(())
            }
            .await;
            let r = match r {
                Ok(()) => tx.commit().await.map_err(StoreError::from),
                Err(e) => {
                    let _ = tx.rollback().await;
                    Err(e)
                }
            };
            match r {
                Ok(()) => break,
                Err(StoreError::Db(e)) if (is_unique_violation(&e) || is_serialization(&e)) && attempt < 20 => attempt += 1,
                Err(e) => return Err(e),
            }
        }
        let names: Vec<&str> = changes.iter().map(|(node, _)| node.as_str()).collect();
        let now_in_force = self.bundles_of(&names).await?;
        Ok(changes.iter().filter_map(|(node, _)| now_in_force.get(node).map(|v| (node.clone(), v.clone()))).collect())
    }

    /// The current bundles of these nodes (those that have one), read by name up to
    /// `BUNDLES_BY_NAME` of them. A few are read by name: a
    /// publish run of the 40 nodes a change reaches read all 100,000 rows back, up to a second
    /// of its time. Many are read as `bundles` reads them.
    pub async fn bundles_of(&self, nodes: &[&str]) -> Result<HashMap<String, BundleVersion>> {
        if nodes.len() > BUNDLES_BY_NAME {
            return self.bundles().await;
        }
        let mut out = HashMap::with_capacity(nodes.len());
        for r in self.rows_named("SELECT node, version, digest, issued_at FROM bundles", "node", nodes).await? {
            out.insert(
                r.try_get("node")?,
                BundleVersion { version: r.try_get("version")?, digest: r.try_get("digest")?, issued_at: r.try_get("issued_at")? },
            );
        }
        Ok(out)
    }
}
