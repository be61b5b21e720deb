//! What nodes report of their direct paths (ADR 0032): one JSON report a node, replaced by each
//! new one. A report, not a decision: not audited.

use crate::{Result, Store};

impl Store {
    /// Records `node`'s report (JSON) at `at`, replacing the one before.
    pub async fn report_paths(&self, node: &str, report: &str, at: i64) -> Result<()> {
        self.replace_report("path_reports", node, report, at).await
    }

    /// Every node's last report, by node name: (node, report JSON, when).
    pub async fn path_reports(&self) -> Result<Vec<(String, String, i64)>> {
        self.reports("path_reports").await
    }
}
