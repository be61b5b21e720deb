//! Enrolled nodes: enrolment (which redeems a token), state changes, certificate renewal and
//! last contact.

use std::collections::{HashMap, HashSet};

use sqlx::any::AnyRow;
use sqlx::Row;
use trellis_proto::EnrolledState;

use crate::{is_unique_violation, parse, Audit, Result, Store, StoreError};

/// Where a read of the records stood: the change number, and the audit chain's head, which a
/// database restored or failed over to another history no longer holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordsRead {
    pub seq: i64,
    pub head: Option<(i64, String)>,
}

/// What `Store::node_changes` read: where it stood, the records written since the read asked
/// for (every record when `whole`), and the names deleted since.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeChanges {
    pub read: RecordsRead,
    pub records: Vec<NodeRecord>,
    pub gone: Vec<String>,
    pub whole: bool,
}

impl NodeChanges {
    /// `kept`, every record as of the read before (in name order), brought to this read: in name
    /// order, each record written since in its place, each deleted since taken out.
    pub fn onto(self, kept: Vec<NodeRecord>) -> Vec<NodeRecord> {
        let mut fresh = self.records;
        fresh.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        if self.whole {
            return fresh;
        }
        // A name deleted and written again since is the record read (read after the deletions).
        let gone: HashSet<String> = self.gone.into_iter().filter(|n| fresh.binary_search_by(|r| r.name.cmp(n)).is_err()).collect();
        let mut out = Vec::with_capacity(kept.len() + fresh.len());
        let mut fresh = fresh.into_iter().peekable();
        for r in kept {
            while fresh.peek().is_some_and(|f| f.name < r.name) {
                out.extend(fresh.next());
            }
            if fresh.peek().is_some_and(|f| f.name == r.name) {
                out.extend(fresh.next());
            } else if !gone.contains(&r.name) {
                out.push(r);
            }
        }
        out.extend(fresh);
        out
    }
}

/// A node's certificate serial, and its certificate when one is on record.
pub type SerialAndCert = (String, Option<String>);

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeRecord {
    pub name: String,
    pub state: EnrolledState,
    pub wg_public_key: Option<String>,
    pub cert_serial: Option<String>,
    pub prev_cert_serial: Option<String>,
    pub cert_not_after: Option<i64>,
    pub enrolled_at: i64,
    pub last_contact: Option<i64>,
    pub cert_pem: Option<String>,
    /// For a member of a pool: the pool, and the overlay addresses it was given when it enrolled.
    pub pool: Option<String>,
    pub ipv4: Option<String>,
    pub ipv6: Option<String>,
}

pub(crate) const NODE_COLUMNS: &str =
    "name, state, wg_public_key, cert_serial, prev_cert_serial, cert_not_after, enrolled_at, last_contact, cert_pem, pool, ipv4, ipv6";

/// The columns a declared node's enrolment writes (a member's also has its pool and addresses).
pub(crate) const DECLARED_NODE_COLUMNS: &str =
    "name, state, wg_public_key, cert_serial, prev_cert_serial, cert_not_after, enrolled_at, last_contact, cert_pem";

/// Binds the values of `DECLARED_NODE_COLUMNS`, in that order, to a query's next placeholders.
pub(crate) fn bind_enrolled<'q>(
    q: sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>,
    node: &NodeRecord,
) -> sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>> {
    q.bind(node.name.clone())
        .bind(node.state.as_str())
        .bind(node.wg_public_key.clone())
        .bind(node.cert_serial.clone())
        .bind(node.prev_cert_serial.clone())
        .bind(node.cert_not_after)
        .bind(node.enrolled_at)
        .bind(node.last_contact)
        .bind(node.cert_pem.clone())
}

/// `NODE_COLUMNS` with the certificate read as NULL: what a publish run reads of every record.
fn columns_without_certificate() -> String {
    NODE_COLUMNS.replace("cert_pem", "CAST(NULL AS TEXT) AS cert_pem")
}

pub(crate) fn node_record(r: &AnyRow) -> Result<NodeRecord> {
    Ok(NodeRecord {
        name: r.try_get("name")?,
        state: parse(r.try_get::<String, _>("state")?)?,
        wg_public_key: r.try_get("wg_public_key")?,
        cert_serial: r.try_get("cert_serial")?,
        prev_cert_serial: r.try_get("prev_cert_serial")?,
        cert_not_after: r.try_get("cert_not_after")?,
        enrolled_at: r.try_get("enrolled_at")?,
        last_contact: r.try_get("last_contact")?,
        cert_pem: r.try_get("cert_pem")?,
        pool: r.try_get("pool")?,
        ipv4: r.try_get("ipv4")?,
        ipv6: r.try_get("ipv6")?,
    })
}

impl Store {
    /// Redeems a token and records the node's keys and certificate, atomically: the token is
    /// used once, and a WireGuard key held by another node is refused.
    pub async fn enrol(&self, token_id: &str, node: &NodeRecord, audit: &Audit<'_>) -> Result<()> {
        let token_id = token_id.to_string();
        let node = node.clone();
        let r = self
            .decide(audit, |tx| {
                let token_id = token_id.clone();
                let node = node.clone();
                Box::pin(async move {
                    let used = sqlx::query("UPDATE tokens SET used_at = $1, used = used + 1 WHERE id = $2 AND pool IS NULL AND used_at IS NULL AND revoked_at IS NULL")
                        .bind(node.enrolled_at)
                        .bind(token_id)
                        .execute(&mut **tx)
                        .await?
                        .rows_affected();
                    if used != 1 {
                        return Err(StoreError::TokenUsed);
                    }
                    if let Some(key) = &node.wg_public_key {
                        let holder = sqlx::query("SELECT name FROM nodes WHERE wg_public_key = $1 AND name <> $2")
                            .bind(key.clone())
                            .bind(node.name.clone())
                            .fetch_optional(&mut **tx)
                            .await?;
                        if let Some(h) = holder {
                            return Err(StoreError::KeyTaken(h.try_get("name")?));
                        }
                    }
                    let insert = format!(
                        "INSERT INTO nodes ({DECLARED_NODE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                         ON CONFLICT (name) DO UPDATE SET state = excluded.state, wg_public_key = excluded.wg_public_key, \
                         cert_serial = excluded.cert_serial, prev_cert_serial = excluded.prev_cert_serial, \
                         cert_not_after = excluded.cert_not_after, enrolled_at = excluded.enrolled_at, last_contact = excluded.last_contact, cert_pem = excluded.cert_pem, \
                         pool = NULL, ipv4 = NULL, ipv6 = NULL"
                    );
                    bind_enrolled(sqlx::query(&insert), &node).execute(&mut **tx).await?;
                    Ok(())
                })
            })
            .await;
        match r {
            Err(StoreError::Db(e)) if is_unique_violation(&e) => Err(StoreError::KeyTaken("another node".into())),
            other => other,
        }
    }

    pub async fn node(&self, name: &str) -> Result<Option<NodeRecord>> {
        let row = sqlx::query(&format!("SELECT {NODE_COLUMNS} FROM nodes WHERE name = $1")).bind(name).fetch_optional(&self.pool).await?;
        row.as_ref().map(node_record).transpose()
    }

    /// What authenticating a node's certificate needs, read fresh: its state, the serials of the
    /// certificates it may present (the current one and the one before a renewal), and its pool.
    /// One row by its key, on every node request: a revocation decided by any replica is seen
    /// by every replica at once.
    pub async fn node_auth(&self, name: &str) -> Result<Option<(EnrolledState, Vec<String>, Option<String>)>> {
        let row = sqlx::query("SELECT state, cert_serial, prev_cert_serial, pool FROM nodes WHERE name = $1")
            .bind(name)
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            let serials = [r.try_get::<Option<String>, _>("cert_serial")?, r.try_get::<Option<String>, _>("prev_cert_serial")?];
            Ok((parse(r.try_get("state")?)?, serials.into_iter().flatten().collect(), r.try_get("pool")?))
        })
        .transpose()
    }

    /// Records the protocol and release a node's agent says it speaks.
    pub async fn set_agent(&self, name: &str, protocol: &str, release: &str) -> Result<()> {
        sqlx::query("UPDATE nodes SET agent_protocol = $2, agent_release = $3 WHERE name = $1")
            .bind(name)
            .bind(protocol)
            .bind(release)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// The protocol and release each node's agent last said it speaks, for the nodes whose
    /// agent said so.
    pub async fn agents(&self) -> Result<std::collections::HashMap<String, (String, String)>> {
        let rows = sqlx::query(
            "SELECT name, agent_protocol, agent_release FROM nodes WHERE agent_protocol IS NOT NULL AND agent_release IS NOT NULL",
        )
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(|r| Ok((r.try_get("name")?, (r.try_get("agent_protocol")?, r.try_get("agent_release")?)))).collect()
    }

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>> {
        let rows = sqlx::query(&format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY name")).fetch_all(&self.pool).await?;
        rows.iter().map(node_record).collect()
    }

    /// Every node's record as `nodes` reads it, but without its certificate (`cert_pem` is
    /// `None`), as `node_changes` reads records for a publish run (at 100,000 nodes the
    /// certificates are 69 MB of a whole read; a run takes those it has not seen from
    /// `cert_pems`).
    pub async fn nodes_without_certificates(&self) -> Result<Vec<NodeRecord>> {
        let rows = sqlx::query(&format!("SELECT {} FROM nodes ORDER BY name", columns_without_certificate())).fetch_all(&self.pool).await?;
        rows.iter().map(node_record).collect()
    }

    /// The records written since the read `since` (every record for `None`), without their
    /// certificates, and the names deleted since (ADR 0036); all read in one snapshot. Every
    /// record is read again when the database is not the one `since` was read from: the audit
    /// chain no longer holds the head it had then (a restore, or a failover to a standby that
    /// lost transactions; every write of a record is a decision with its audit record).
    pub async fn node_changes(&self, since: Option<&RecordsRead>) -> Result<NodeChanges> {
        let mut tx = self.pool.begin().await?;
        if self.backend == crate::Backend::Postgres {
            sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY").execute(&mut *tx).await?;
        }
        let seq: i64 = sqlx::query("SELECT seq FROM node_changes WHERE id = 1").fetch_one(&mut *tx).await?.try_get("seq")?;
        let head = sqlx::query("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetch_optional(&mut *tx).await?;
        let head: Option<(i64, String)> = head.map(|r| Ok::<_, StoreError>((r.try_get("seq")?, r.try_get("hash")?))).transpose()?;
        let read = RecordsRead { seq, head };
        let same_history = match since {
            Some(RecordsRead { seq: before, head: Some((at, hash)) }) if *before <= seq => {
                let now = sqlx::query("SELECT hash FROM audit WHERE seq = $1").bind(*at).fetch_optional(&mut *tx).await?;
                now.map(|r| r.try_get::<String, _>("hash")).transpose()?.as_ref() == Some(hash)
            }
            _ => false,
        };
        let columns = columns_without_certificate();
        let changes = if let (true, Some(since)) = (same_history, since) {
            let gone = sqlx::query("SELECT name FROM nodes_gone WHERE changed > $1")
                .bind(since.seq)
                .fetch_all(&mut *tx)
                .await?
                .iter()
                .map(|r| r.try_get("name"))
                .collect::<std::result::Result<Vec<String>, _>>()?;
            let rows = sqlx::query(&format!("SELECT {columns} FROM nodes WHERE changed > $1")).bind(since.seq).fetch_all(&mut *tx).await?;
            NodeChanges { read, records: rows.iter().map(node_record).collect::<Result<Vec<_>>>()?, gone, whole: false }
        } else {
            let rows = sqlx::query(&format!("SELECT {columns} FROM nodes")).fetch_all(&mut *tx).await?;
            NodeChanges { read, records: rows.iter().map(node_record).collect::<Result<Vec<_>>>()?, gone: Vec::new(), whole: true }
        };
        tx.commit().await?;
        Ok(changes)
    }

    /// The serial and certificate of each of these nodes that has a serial, by name (a record
    /// written before certificates were kept has none). A few are read by name; many, every
    /// node's.
    pub async fn cert_pems(&self, nodes: &[&str]) -> Result<HashMap<String, SerialAndCert>> {
        const BY_NAME: usize = 2_000;
        let row = |r: &AnyRow| -> Result<Option<(String, SerialAndCert)>> {
            let serial: Option<String> = r.try_get("cert_serial")?;
            Ok(match serial {
                Some(serial) => Some((r.try_get("name")?, (serial, r.try_get("cert_pem")?))),
                None => None,
            })
        };
        let mut out = HashMap::with_capacity(nodes.len());
        if nodes.len() > BY_NAME {
            for r in sqlx::query("SELECT name, cert_serial, cert_pem FROM nodes").fetch_all(&self.pool).await? {
                out.extend(row(&r)?);
            }
            let wanted: std::collections::HashSet<&str> = nodes.iter().copied().collect();
            out.retain(|name, _| wanted.contains(name.as_str()));
            return Ok(out);
        }
        for r in self.rows_named("SELECT name, cert_serial, cert_pem FROM nodes", "name", nodes).await? {
            out.extend(row(&r)?);
        }
        Ok(out)
    }

    /// The rows of `select` whose `column` is one of `names`, asked 250 names a statement (a
    /// bound well under either database's limit on parameters).
    pub(crate) async fn rows_named(&self, select: &str, column: &str, names: &[&str]) -> Result<Vec<AnyRow>> {
        let mut rows = Vec::new();
        for chunk in names.chunks(250) {
            let marks: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            let sql = format!("{select} WHERE {column} IN ({})", marks.join(", "));
            let mut q = sqlx::query(&sql);
            for name in chunk {
                q = q.bind(*name);
            }
            rows.extend(q.fetch_all(&self.pool).await?);
        }
        Ok(rows)
    }

    /// Moves a node from one of `from` states to `to`. Revocation also forgets its certificates,
    /// so they are refused at once. Returns the state it was in, or `NotFound`.
    /// A revocation is opened in the same transaction (ADR 0022), at the audit record's time.
    pub async fn set_state(&self, name: &str, from: &[EnrolledState], to: EnrolledState, audit: &Audit<'_>) -> Result<EnrolledState> {
        let name = name.to_string();
        let from = from.to_vec();
        let at = audit.at;
        self.decide(audit, |tx| {
            let (name, from) = (name.clone(), from.clone());
            Box::pin(async move {
                let row = sqlx::query("SELECT state FROM nodes WHERE name = $1").bind(name.clone()).fetch_optional(&mut **tx).await?;
                let Some(row) = row else { return Err(StoreError::NotFound(format!("enrolled node `{name}`"))) };
                let state: EnrolledState = parse(row.try_get("state")?)?;
                if !from.contains(&state) {
                    let names: Vec<&str> = from.iter().map(|s| s.as_str()).collect();
                    return Err(StoreError::NotFound(format!("node `{name}` in state {}", names.join(" or "))));
                }
                let sql = if to == EnrolledState::Revoked {
                    "UPDATE nodes SET state = $1, cert_serial = NULL, prev_cert_serial = NULL WHERE name = $2"
                } else {
                    "UPDATE nodes SET state = $1 WHERE name = $2"
                };
                sqlx::query(sql).bind(to.as_str()).bind(name.clone()).execute(&mut **tx).await?;
                if to == EnrolledState::Revoked {
                    crate::revocations::open(tx, &name, trellis_proto::Withdrawal::Revocation, at, state == EnrolledState::Active).await?;
                }
                Ok(state)
            })
        })
        .await
    }

    /// Records a renewed certificate, only if `old_serial` is the node's current one (a
    /// superseded certificate cannot renew, so it cannot lock the current one out); the one it
    /// replaces stays valid until it expires. `NotFound` when the node is revoked, unknown, or
    /// holds another certificate now.
    pub async fn renew(
        &self,
        name: &str,
        old_serial: &str,
        new_serial: &str,
        not_after: i64,
        cert_pem: &str,
        audit: &Audit<'_>,
    ) -> Result<()> {
        let (name, old, new, pem) = (name.to_string(), old_serial.to_string(), new_serial.to_string(), cert_pem.to_string());
        self.decide(audit, |tx| {
            let (name, old, new, pem) = (name.clone(), old.clone(), new.clone(), pem.clone());
            let current = old.clone();
            Box::pin(async move {
                let n = sqlx::query("UPDATE nodes SET prev_cert_serial = $1, cert_serial = $2, cert_not_after = $3, cert_pem = $4 WHERE name = $5 AND state <> $6 AND cert_serial = $7")
                    .bind(old)
                    .bind(new)
                    .bind(not_after)
                    .bind(pem)
                    .bind(name.clone())
                    .bind(EnrolledState::Revoked.as_str())
                    .bind(current)
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                if n == 1 { Ok(()) } else { Err(StoreError::NotFound(format!("node `{name}`"))) }
            })
        })
        .await
    }

    /// Records the last contact of many nodes in one transaction (one commit, not one each).
    pub async fn touch_all(&self, contacts: &[(String, i64)]) -> Result<()> {
        let mut tx = self.begin().await?;
        for (name, at) in contacts {
            sqlx::query("UPDATE nodes SET last_contact = $1 WHERE name = $2").bind(*at).bind(name).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }
}
