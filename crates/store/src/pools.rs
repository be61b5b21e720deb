//! Members of pools: a redemption of a pool token that records a new member, atomically (the
//! token's uses, the member's name and addresses, and the pool's size are all enforced in one
//! transaction), and the removal of a member that has been out of contact.

use sqlx::Row;
use trellis_proto::EnrolledState;

use crate::nodes::{bind_enrolled, node_record, DECLARED_NODE_COLUMNS, NODE_COLUMNS};
use crate::{is_unique_violation, parse, Audit, NodeRecord, Result, Store, StoreError};

/// Why a member could not be recorded.
#[derive(Debug, PartialEq, Eq)]
pub enum MemberRefusal {
    /// The token has no use left, is revoked or has expired, or is not this pool's.
    TokenUsedUp,
    /// The pool holds `size` members already.
    PoolFull,
    /// The name or an address was taken since they were chosen: choose again.
    Taken,
}

/// Where the members are read from (`Store::members`).
const MEMBERS: &str = "FROM nodes WHERE pool >= ''";

impl Store {
    /// The live members of every pool, by name.
    pub async fn members(&self) -> Result<Vec<NodeRecord>> {
        // `pool >= ''` is `pool IS NOT NULL` for text, said so that SQLite searches the pool's
        // index; and sorted here, not by `ORDER BY name`, which had it walk every node in name
        // order instead (70-200 ms at 100,000 nodes, in every apply and pool redemption).
        let rows = sqlx::query(&format!("SELECT {NODE_COLUMNS} {MEMBERS}")).fetch_all(&self.pool).await?;
        let mut members: Vec<NodeRecord> = rows.iter().map(node_record).collect::<Result<_>>()?;
        members.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(members)
    }

    /// Redeems one use of pool token `token_id` (valid at `node.enrolled_at`) and records `node`,
    /// a member of `node.pool`, in one transaction: the use is counted by one conditional update
    /// (so under any concurrency exactly `uses` redemptions succeed); redemptions for one pool
    /// take turns, so the pool holds fewer than `size` members however many tokens it has; and no
    /// other node holds the name, the WireGuard key or the addresses.
    /// `Ok(Err(Taken))` asks the caller to choose the name and addresses again.
    pub async fn enrol_member(
        &self,
        token_id: &str,
        size: u32,
        node: &NodeRecord,
        audit: &Audit<'_>,
    ) -> Result<std::result::Result<(), MemberRefusal>> {
        let (token_id, node) = (token_id.to_string(), node.clone());
        let pool = node.pool.clone().ok_or_else(|| StoreError::NotFound("the member's pool".into()))?;
        let r = self
            .decide(audit, |tx| {
                let (token_id, node, pool) = (token_id.clone(), node.clone(), pool.clone());
                Box::pin(async move {
                    // Redemptions for one pool take turns from here (a row lock on PostgreSQL;
                    // SQLite's transactions take turns already).
                    sqlx::query("INSERT INTO pool_locks (pool) VALUES ($1) ON CONFLICT (pool) DO UPDATE SET pool = excluded.pool")
                        .bind(pool.clone())
                        .execute(&mut **tx)
                        .await?;
                    let used = sqlx::query(
                        "UPDATE tokens SET used = used + 1, used_at = $1 \
                         WHERE id = $2 AND pool = $3 AND used < uses AND revoked_at IS NULL AND expires_at > $1",
                    )
                    .bind(node.enrolled_at)
                    .bind(token_id)
                    .bind(pool.clone())
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                    if used != 1 {
                        return Err(StoreError::Refused(MemberRefusal::TokenUsedUp));
                    }
                    let live: i64 = sqlx::query("SELECT COUNT(*) AS n FROM nodes WHERE pool = $1")
                        .bind(pool)
                        .fetch_one(&mut **tx)
                        .await?
                        .try_get("n")?;
                    if live >= size as i64 {
                        return Err(StoreError::Refused(MemberRefusal::PoolFull));
                    }
                    if let Some(key) = &node.wg_public_key {
                        let holder = sqlx::query("SELECT name FROM nodes WHERE wg_public_key = $1")
                            .bind(key.clone())
                            .fetch_optional(&mut **tx)
                            .await?;
                        if let Some(h) = holder {
                            return Err(StoreError::KeyTaken(h.try_get("name")?));
                        }
                    }
                    let taken = sqlx::query("SELECT name FROM nodes WHERE name = $1 OR ipv4 = $2 OR ipv6 = $3")
                        .bind(node.name.clone())
                        .bind(node.ipv4.clone())
                        .bind(node.ipv6.clone())
                        .fetch_optional(&mut **tx)
                        .await?;
                    if taken.is_some() {
                        return Err(StoreError::Refused(MemberRefusal::Taken));
                    }
                    // A member's row is a declared node's, with its pool and addresses.
                    let insert = format!(
                        "INSERT INTO nodes ({DECLARED_NODE_COLUMNS}, pool, ipv4, ipv6) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)"
                    );
                    bind_enrolled(sqlx::query(&insert), &node)
                        .bind(node.pool.clone())
                        .bind(node.ipv4.clone())
                        .bind(node.ipv6.clone())
                        .execute(&mut **tx)
                        .await?;
                    Ok(())
                })
            })
            .await;
        match r {
            Ok(()) => Ok(Ok(())),
            Err(StoreError::Refused(why)) => Ok(Err(why)),
            // Another member took the name or an address between the check and the insert.
            Err(StoreError::Db(e)) if is_unique_violation(&e) => Ok(Err(MemberRefusal::Taken)),
            Err(e) => Err(e),
        }
    }

    /// Removes member `name` if its last contact (or, without one, its enrolment) is before
    /// `before`, with its evidence (a later member of the same name starts its records at 1
    /// again, which would read as re-sends). Its bundle version stays, so a later member of the
    /// same name is published at a higher one. Returns false when it is not there or has made
    /// contact since (another replica removed it first, or it came back).
    pub async fn remove_member(&self, name: &str, before: i64, audit: &Audit<'_>) -> Result<bool> {
        let name = name.to_string();
        let audit_at = audit.at;
        let r = self
            .decide(audit, |tx| {
                let name = name.clone();
                Box::pin(async move {
                    let state = sqlx::query("SELECT state FROM nodes WHERE name = $1").bind(name.clone()).fetch_optional(&mut **tx).await?;
                    let state: Option<EnrolledState> = state.map(|r| parse(r.try_get::<String, _>("state")?)).transpose()?;
                    let n =
                        sqlx::query("DELETE FROM nodes WHERE name = $1 AND pool IS NOT NULL AND COALESCE(last_contact, enrolled_at) < $2")
                            .bind(name.clone())
                            .bind(before)
                            .execute(&mut **tx)
                            .await?
                            .rows_affected();
                    if n != 1 {
                        return Err(StoreError::NotFound(format!("member `{name}` out of contact")));
                    }
                    for table in ["evidence", "evidence_floor"] {
                        sqlx::query(&format!("DELETE FROM {table} WHERE node = $1")).bind(name.clone()).execute(&mut **tx).await?;
                    }
                    // An active member's peers held its key: followed until they drop it (ADR
                    // 0022). A revoked one's revocation goes on as it was.
                    if state == Some(EnrolledState::Active) {
                        crate::revocations::open(tx, &name, trellis_proto::Withdrawal::Removal, audit_at, true).await?;
                    }
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

#[cfg(test)]
mod tests {
    use sqlx::Row;

    /// SQLite reads the members through the pool's index, not by walking every node: with
    /// `pool IS NOT NULL ORDER BY name` it walked the names' index (70-200 ms at 100,000 nodes,
    /// in every apply).
    #[tokio::test]
    async fn sqlite_reads_the_members_through_the_pool_s_index() {
        let path = std::env::temp_dir().join(format!("trellis-members-plan-{}.db", std::process::id()));
        let store = crate::Store::open(&format!("sqlite://{}?mode=rwc", path.display())).await.unwrap();
        let rows = sqlx::query(&format!("EXPLAIN QUERY PLAN SELECT {} {}", super::NODE_COLUMNS, super::MEMBERS))
            .fetch_all(&store.pool)
            .await
            .unwrap();
        let plan: Vec<String> = rows.iter().map(|r| r.try_get::<String, _>("detail").unwrap()).collect();
        drop(store);
        for end in ["", "-wal", "-shm"] {
            let _ = std::fs::remove_file(format!("{}{end}", path.display()));
        }
        assert!(plan.iter().any(|d| d.contains("USING INDEX nodes_pool")), "{plan:?}");
    }
}
