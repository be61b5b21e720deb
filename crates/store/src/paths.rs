//! What nodes report of their direct paths (ADR 0032): one JSON report a node, replaced by each
//! new one. A report, not a decision: not audited.

use sqlx::Row;

use crate::{Result, Store};

impl Store {
    /// Records `node`'s report (JSON) at `at`, replacing the one before.
    pub async fn report_paths(&self, node: &str, report: &str, at: i64) -> Result<()> {
        let mut tx = self.begin().await?;
        sqlx::query(
            "INSERT INTO path_reports (node, report, reported_at) VALUES ($1, $2, $3) \
             ON CONFLICT (node) DO UPDATE SET report = excluded.report, reported_at = excluded.reported_at",
        )
        .bind(node)
        .bind(report)
        .bind(at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Every node's last report, by node name: (node, report JSON, when).
    pub async fn path_reports(&self) -> Result<Vec<(String, String, i64)>> {
        let rows = sqlx::query("SELECT node, report, reported_at FROM path_reports ORDER BY node").fetch_all(&self.pool).await?;
        rows.iter().map(|r| Ok((r.try_get("node")?, r.try_get("report")?, r.try_get("reported_at")?))).collect()
    }
}
