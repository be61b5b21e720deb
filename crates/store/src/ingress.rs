//! What ingress nodes report of their Traefik (ADR 0026): one JSON report a node, replaced by
//! each new one. A report, not a decision: not audited.

use sqlx::Row;

use crate::{Result, Store};

impl Store {
    /// Records `node`'s report (JSON) at `at`, replacing the one before.
    pub async fn report_ingress(&self, node: &str, report: &str, at: i64) -> Result<()> {
        self.replace_report("ingress_reports", node, report, at).await
    }

    /// Every node's last report, by node name: (report JSON, when).
    pub async fn ingress_reports(&self) -> Result<Vec<(String, String, i64)>> {
        self.reports("ingress_reports").await
    }

    /// Puts `node`'s report (JSON) at `at` in `table` (one of the report tables: a row a node,
    /// `node`, `report`, `reported_at`), replacing the one before.
    pub(crate) async fn replace_report(&self, table: &'static str, node: &str, report: &str, at: i64) -> Result<()> {
        let mut tx = self.begin().await?;
        sqlx::query(&format!(
            "INSERT INTO {table} (node, report, reported_at) VALUES ($1, $2, $3) \
             ON CONFLICT (node) DO UPDATE SET report = excluded.report, reported_at = excluded.reported_at"
        ))
        .bind(node)
        .bind(report)
        .bind(at)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Every row of report table `table`, in node order: (node, report JSON, when).
    pub(crate) async fn reports(&self, table: &'static str) -> Result<Vec<(String, String, i64)>> {
        let rows = sqlx::query(&format!("SELECT node, report, reported_at FROM {table} ORDER BY node")).fetch_all(&self.pool).await?;
        rows.iter().map(|r| Ok((r.try_get("node")?, r.try_get("report")?, r.try_get("reported_at")?))).collect()
    }
}
