//! Service certificates (ADR 0023): per node and module, the one last issued and the last
//! refusal, each written in the same transaction as its audit record.

use sqlx::Row;

use crate::{Audit, Result, Store};

/// A node's certificate for one module, as last issued, and its last refusal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServiceCertRecord {
    pub node: String,
    pub module: String,
    /// None until one is issued.
    pub serial: Option<String>,
    /// The names the certificate carries (DNS names, addresses, the URI).
    pub names: Vec<String>,
    pub issued_at: Option<i64>,
    pub not_after: Option<i64>,
    /// The last refusal, when it is newer than the last issuance.
    pub refused_at: Option<i64>,
    pub refusal: Option<String>,
    /// What the node last reported holding: the serial on its disk, and why its last attempt
    /// failed there.
    pub held_serial: Option<String>,
    pub held_not_after: Option<i64>,
    pub node_error: Option<String>,
    pub reported_at: Option<i64>,
}

/// One module's certificate as a node reports holding it.
#[derive(Clone, Debug)]
pub struct HeldServiceCert<'a> {
    pub module: &'a str,
    pub serial: Option<&'a str>,
    pub not_after: Option<i64>,
    pub error: Option<&'a str>,
}

/// A certificate just issued for a node's module.
#[derive(Clone, Debug)]
pub struct IssuedServiceCert<'a> {
    pub node: &'a str,
    pub module: &'a str,
    pub serial: &'a str,
    pub names: &'a [String],
    pub issued_at: i64,
    pub not_after: i64,
}

impl Store {
    /// Records a certificate issued for a node's module, clearing any refusal before it.
    pub async fn issue_service_cert(&self, c: &IssuedServiceCert<'_>, audit: &Audit<'_>) -> Result<()> {
        let (node, module, serial, names) = (c.node.to_string(), c.module.to_string(), c.serial.to_string(), c.names.join("\n"));
        let (issued_at, not_after) = (c.issued_at, c.not_after);
        self.decide(audit, |tx| {
            let (node, module, serial, names) = (node.clone(), module.clone(), serial.clone(), names.clone());
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO service_certs (node, module, serial, names, issued_at, not_after, refused_at, refusal) \
                     VALUES ($1, $2, $3, $4, $5, $6, NULL, NULL) \
                     ON CONFLICT (node, module) DO UPDATE SET serial = excluded.serial, names = excluded.names, \
                     issued_at = excluded.issued_at, not_after = excluded.not_after, refused_at = NULL, refusal = NULL",
                )
                .bind(node)
                .bind(module)
                .bind(serial)
                .bind(names)
                .bind(issued_at)
                .bind(not_after)
                .execute(&mut **tx)
                .await?;
                Ok(())
            })
        })
        .await
    }

    /// Records a refused request for `node`'s `module`; the certificate issued before, if any,
    /// stays recorded.
    pub async fn refuse_service_cert(&self, node: &str, module: &str, at: i64, reason: &str, audit: &Audit<'_>) -> Result<()> {
        let (node, module, reason) = (node.to_string(), module.to_string(), reason.to_string());
        self.decide(audit, |tx| {
            let (node, module, reason) = (node.clone(), module.clone(), reason.clone());
            Box::pin(async move {
                sqlx::query(
                    "INSERT INTO service_certs (node, module, refused_at, refusal) VALUES ($1, $2, $3, $4) \
                     ON CONFLICT (node, module) DO UPDATE SET refused_at = excluded.refused_at, refusal = excluded.refusal",
                )
                .bind(node)
                .bind(module)
                .bind(at)
                .bind(reason)
                .execute(&mut **tx)
                .await?;
                Ok(())
            })
        })
        .await
    }

    /// Every node's certificates, by node and module.
    /// Records what `node` reports holding, per module, at `at`: one transaction, a report is
    /// not a decision (no audit record; the controller's issuances and refusals are audited).
    pub async fn report_service_certs(&self, node: &str, held: &[HeldServiceCert<'_>], at: i64) -> Result<()> {
        let mut tx = self.begin().await?;
        for h in held {
            sqlx::query(
                "INSERT INTO service_certs (node, module, held_serial, held_not_after, node_error, reported_at) VALUES ($1, $2, $3, $4, $5, $6) \
                 ON CONFLICT (node, module) DO UPDATE SET held_serial = excluded.held_serial, held_not_after = excluded.held_not_after, \
                 node_error = excluded.node_error, reported_at = excluded.reported_at",
            )
            .bind(node)
            .bind(h.module)
            .bind(h.serial)
            .bind(h.not_after)
            .bind(h.error)
            .bind(at)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    pub async fn service_certs(&self) -> Result<Vec<ServiceCertRecord>> {
        let rows = sqlx::query(
            "SELECT node, module, serial, names, issued_at, not_after, refused_at, refusal, held_serial, held_not_after, node_error, reported_at \
             FROM service_certs ORDER BY node, module",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter()
            .map(|r| {
                let names: String = r.try_get("names")?;
                Ok(ServiceCertRecord {
                    node: r.try_get("node")?,
                    module: r.try_get("module")?,
                    serial: r.try_get("serial")?,
                    names: names.lines().map(str::to_string).filter(|n| !n.is_empty()).collect(),
                    issued_at: r.try_get("issued_at")?,
                    not_after: r.try_get("not_after")?,
                    refused_at: r.try_get("refused_at")?,
                    refusal: r.try_get("refusal")?,
                    held_serial: r.try_get("held_serial")?,
                    held_not_after: r.try_get("held_not_after")?,
                    node_error: r.try_get("node_error")?,
                    reported_at: r.try_get("reported_at")?,
                })
            })
            .collect()
    }
}
