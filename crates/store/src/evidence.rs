//! Evidence the agents report: what each applied, received once per sequence number.

use std::collections::HashMap;

use sqlx::Row;
use trellis_proto::EvidenceResult;

use crate::{parse, Result, Store};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvidenceRecord {
    pub seq: i64,
    pub version: i64,
    pub result: EvidenceResult,
    pub error: Option<String>,
    /// JSON: per-file path, SHA-256 and result.
    pub files: String,
    pub at: i64,
    /// The agent manages no WireGuard interface (`proto::Evidence::unmanaged`).
    pub unmanaged: bool,
}

/// How many evidence records are kept per node: older ones are pruned (and counted) so that one
/// node cannot grow the database without bound.
pub const EVIDENCE_KEPT: i64 = 10_000;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvidenceSummary {
    pub records: i64,
    /// Records received and later pruned to keep the node's evidence bounded.
    pub pruned: i64,
    pub highest_seq: i64,
    pub applied_version: Option<i64>,
    pub last_result: Option<EvidenceResult>,
    pub last_error: Option<String>,
    pub last_at: Option<i64>,
}

impl EvidenceSummary {
    /// Sequence numbers missing between 1 and the highest received.
    pub fn missing(&self) -> i64 {
        self.highest_seq - self.records - self.pruned
    }
}

impl Store {
    /// Appends evidence records; a record whose (node, seq) is already stored, or was stored and
    /// pruned, is a re-send and is ignored. Keeps the newest [`EVIDENCE_KEPT`] records of the
    /// node, counting what it prunes. Returns (accepted, duplicates).
    pub async fn add_evidence(&self, node: &str, records: &[EvidenceRecord], received_at: i64) -> Result<(usize, usize)> {
        let mut tx = self.begin().await?;
        let floor = sqlx::query("SELECT below FROM evidence_floor WHERE node = $1").bind(node).fetch_optional(&mut *tx).await?;
        let below: i64 = floor.map(|r| r.try_get("below")).transpose()?.unwrap_or(0);
        let mut accepted = 0;
        for r in records.iter().filter(|r| r.seq > below) {
            let n = sqlx::query("INSERT INTO evidence (node, seq, version, result, error, files, at, received_at, unmanaged) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (node, seq) DO NOTHING")
                .bind(node)
                .bind(r.seq)
                .bind(r.version)
                .bind(r.result.as_str())
                .bind(r.error.clone())
                .bind(r.files.clone())
                .bind(r.at)
                .bind(received_at)
                .bind(i64::from(r.unmanaged))
                .execute(&mut *tx)
                .await?
                .rows_affected();
            accepted += n as usize;
        }
        let top: Option<i64> =
            sqlx::query("SELECT MAX(seq) AS top FROM evidence WHERE node = $1").bind(node).fetch_one(&mut *tx).await?.try_get("top")?;
        let new_below = top.unwrap_or(0) - EVIDENCE_KEPT;
        if new_below > below {
            let pruned = sqlx::query("DELETE FROM evidence WHERE node = $1 AND seq <= $2")
                .bind(node)
                .bind(new_below)
                .execute(&mut *tx)
                .await?
                .rows_affected() as i64;
            sqlx::query(
                "INSERT INTO evidence_floor (node, below, pruned) VALUES ($1, $2, $3) \
                 ON CONFLICT (node) DO UPDATE SET below = excluded.below, pruned = evidence_floor.pruned + excluded.pruned",
            )
            .bind(node)
            .bind(new_below)
            .bind(pruned)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok((accepted, records.len() - accepted))
    }

    /// Per node: how many records, the highest sequence number, the newest applied version, and
    /// the result and error of the newest record.
    pub async fn evidence_summary(&self) -> Result<HashMap<String, EvidenceSummary>> {
        let rows = sqlx::query("SELECT node, COUNT(*) AS n, MAX(seq) AS top FROM evidence GROUP BY node").fetch_all(&self.pool).await?;
        let mut out = HashMap::new();
        for r in rows {
            let node: String = r.try_get("node")?;
            out.insert(node, EvidenceSummary { records: r.try_get("n")?, highest_seq: r.try_get("top")?, ..Default::default() });
        }
        for r in sqlx::query("SELECT node, pruned FROM evidence_floor").fetch_all(&self.pool).await? {
            let node: String = r.try_get("node")?;
            if let Some(s) = out.get_mut(&node) {
                s.pruned = r.try_get("pruned")?;
            }
        }
        let applied = sqlx::query("SELECT node, MAX(version) AS v FROM evidence WHERE result = $1 GROUP BY node")
            .bind(EvidenceResult::Applied.as_str())
            .fetch_all(&self.pool)
            .await?;
        for r in applied {
            let node: String = r.try_get("node")?;
            if let Some(s) = out.get_mut(&node) {
                s.applied_version = r.try_get("v")?;
            }
        }
        let last = sqlx::query(
            "SELECT e.node, e.result, e.error, e.at FROM evidence e JOIN (SELECT node, MAX(seq) AS top FROM evidence GROUP BY node) m ON e.node = m.node AND e.seq = m.top",
        )
        .fetch_all(&self.pool)
        .await?;
        for r in last {
            let node: String = r.try_get("node")?;
            if let Some(s) = out.get_mut(&node) {
                s.last_result = Some(parse(r.try_get("result")?)?);
                s.last_error = r.try_get("error")?;
                s.last_at = Some(r.try_get("at")?);
            }
        }
        Ok(out)
    }

    /// Every evidence record of one node, in sequence order.
    pub async fn evidence(&self, node: &str) -> Result<Vec<EvidenceRecord>> {
        let rows = sqlx::query("SELECT seq, version, result, error, files, at, unmanaged FROM evidence WHERE node = $1 ORDER BY seq")
            .bind(node)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(EvidenceRecord {
                    seq: r.try_get("seq")?,
                    version: r.try_get("version")?,
                    result: parse(r.try_get("result")?)?,
                    error: r.try_get("error")?,
                    files: r.try_get("files")?,
                    at: r.try_get("at")?,
                    unmanaged: r.try_get::<i64, _>("unmanaged")? != 0,
                })
            })
            .collect()
    }
}
