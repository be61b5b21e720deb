//! Revisions of the declaration, and the address allocation stored with each.

use std::collections::BTreeMap;
use std::sync::Arc;

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

/// The most a packed revision may unpack to: a declaration this size is far beyond what a
/// request may carry (the length before the packed bytes is read from the database, and is not
/// taken on trust).
const UNPACKED_MAX: usize = 1 << 30;

/// A revision's files as stored: the JSON list of (path, text), packed with LZ4, its length
/// first. At 100,000 nodes the list is 12.8 MiB, written at every apply; packed, about 2.7 MiB,
/// made in about 15 ms.
fn pack(files: &[(String, String)]) -> Vec<u8> {
    lz4_flex::compress_prepend_size(&serde_json::to_vec(files).expect("strings serialize"))
}

/// A revision's files packed as they are stored (`Store::apply`), made before the transaction:
/// the controller packs them while its check runs beside.
pub struct Packed(Vec<u8>);

impl Packed {
    pub fn new(files: &[(String, String)]) -> Packed {
        Packed(pack(files))
    }
}

/// The files of a revision from its row: `packed` when it has it, else the JSON `files` of a
/// row written before revisions were packed.
fn unpack(number: i64, packed: Option<Vec<u8>>, files: &str) -> Result<Vec<(String, String)>> {
    let corrupt = |why: String| StoreError::Corrupt(format!("revision {number}: {why}"));
    let Some(packed) = packed else {
        return serde_json::from_str(files).map_err(|e| corrupt(format!("its files are not a list of (path, text): {e}")));
    };
    let claimed = packed.get(..4).map(|n| u32::from_le_bytes(n.try_into().expect("four bytes")) as usize);
    if claimed.is_none_or(|n| n > UNPACKED_MAX) {
        return Err(corrupt(format!("its packed files claim {claimed:?} bytes (at most {UNPACKED_MAX})")));
    }
    let json = lz4_flex::decompress_size_prepended(&packed).map_err(|e| corrupt(format!("its packed files do not unpack: {e}")))?;
    serde_json::from_slice(&json).map_err(|e| corrupt(format!("its files are not a list of (path, text): {e}")))
}

impl Store {
    pub async fn current_revision(&self) -> Result<Option<Revision>> {
        let row = sqlx::query("SELECT number, created_at, digest, files, packed FROM revisions ORDER BY number DESC LIMIT 1")
            .fetch_optional(&self.pool)
            .await?;
        row.map(|r| {
            let number: i64 = r.try_get("number")?;
            let files = unpack(number, r.try_get("packed")?, &r.try_get::<String, _>("files")?)?;
            Ok(Revision { number, created_at: r.try_get("created_at")?, digest: r.try_get("digest")?, files })
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
    /// one of its declared nodes. Only the addresses that changed are written: from
    /// `addresses.held` when it is the allocation of the revision still current (the table is
    /// not read), else from the table as read.
    pub async fn apply(
        &self,
        packed: Packed,
        digest: &str,
        addresses: Addresses,
        expect: Option<i64>,
        replaced: &[String],
        audit: &Audit<'_>,
    ) -> Result<i64> {
        let Packed(packed) = packed;
        let at = audit.at;
        let result = self
            .decide(audit, |tx| {
                let packed = packed.clone();
                let digest = digest.to_string();
                let addresses = addresses.clone();
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
                    sqlx::query("INSERT INTO revisions (number, created_at, digest, files, packed) VALUES ($1, $2, $3, '', $4)")
                        .bind(next)
                        .bind(at)
                        .bind(digest)
                        .bind(packed)
                        .execute(&mut **tx)
                        .await?;
                    for name in &replaced {
                        sqlx::query("DELETE FROM nodes WHERE name = $1 AND pool IS NOT NULL").bind(name).execute(&mut **tx).await?;
                        for table in ["evidence", "evidence_floor"] {
                            sqlx::query(&format!("DELETE FROM {table} WHERE node = $1")).bind(name).execute(&mut **tx).await?;
                        }
                    }
                    let held = match &addresses.held {
                        Some((revision, held)) if *revision == current => held.clone(),
                        _ => Arc::new(read_allocation(&mut **tx).await?),
                    };
                    // The allocation held itself (an apply that kept every address): nothing to write.
                    if !Arc::ptr_eq(&held, &addresses.allocation) {
                        write_changes(tx, &row_changes(&held, &addresses.allocation)).await?;
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

    /// The addresses table: the allocation of the current revision.
    pub async fn allocation(&self) -> Result<Allocation> {
        let mut a = read_allocation(&self.pool).await?;
        // Rows with no readable address are not the allocation's.
        a.ipv4.retain(|_, v| !v.is_unspecified());
        Ok(a)
    }
}

/// The allocation of a new revision, and the one its caller holds as stored with revision N
/// (`held`), if any: the rows are then written by difference from it, unread, when N is still
/// the current revision.
#[derive(Clone, Debug)]
pub struct Addresses {
    pub allocation: Arc<Allocation>,
    pub held: Option<(i64, Arc<Allocation>)>,
}

impl Addresses {
    /// An allocation written by difference from the table as read.
    pub fn read(allocation: Allocation) -> Addresses {
        Addresses { allocation: Arc::new(allocation), held: None }
    }
}

/// Every row of the addresses table, as an allocation; a row whose address does not parse is
/// read as a node without one of that family (it is written again).
async fn read_allocation<'e>(db: impl sqlx::Executor<'e, Database = sqlx::Any>) -> Result<Allocation> {
    let rows = sqlx::query("SELECT node, ipv4, ipv6 FROM addresses").fetch_all(db).await?;
    let mut a = Allocation::default();
    for r in rows {
        let node: String = r.try_get("node")?;
        let v4 = r.try_get::<Option<String>, _>("ipv4")?.and_then(|s| s.parse().ok());
        let v6 = r.try_get::<Option<String>, _>("ipv6")?.and_then(|s| s.parse().ok());
        match (v4, v6) {
            (Some(v4), Some(v6)) => {
                a.ipv4.insert(node.clone(), v4);
                a.ipv6.insert(node, v6);
            }
            (Some(v4), None) => {
                a.ipv4.insert(node, v4);
            }
            (None, Some(v6)) => {
                a.ipv6.insert(node, v6);
            }
            // A row with no readable address is still a row: held as 0.0.0.0 (no allocation
            // gives that), it is updated or deleted, never inserted twice.
            (None, None) => {
                a.ipv4.insert(node, std::net::Ipv4Addr::UNSPECIFIED);
            }
        }
    }
    Ok(a)
}

/// One row of the addresses table to write.
#[derive(Debug, PartialEq, Eq)]
enum RowChange<'a> {
    Delete(&'a str),
    Update(&'a str, Option<String>, Option<String>),
    Insert(&'a str, Option<String>, Option<String>),
}

/// What takes the table from `held` to `to`: rows gone, rows whose addresses changed, new rows,
/// in name order. Both are walked once side by side (not looked up name by name: 100,000 nodes
/// are a few milliseconds), and only the nodes that differ are looked at again.
fn row_changes<'a>(held: &'a Allocation, to: &'a Allocation) -> Vec<RowChange<'a>> {
    let mut differ = std::collections::BTreeSet::new();
    differing(&held.ipv4, &to.ipv4, &mut differ);
    differing(&held.ipv6, &to.ipv6, &mut differ);
    let row = |a: &Allocation, n: &str| (a.ipv4.get(n).copied(), a.ipv6.get(n).copied());
    let text = |(v4, v6): (Option<std::net::Ipv4Addr>, Option<std::net::Ipv6Addr>)| (v4.map(|a| a.to_string()), v6.map(|a| a.to_string()));
    differ
        .into_iter()
        .map(|n| match (row(held, n), row(to, n)) {
            (_, (None, None)) => RowChange::Delete(n),
            ((None, None), new) => {
                let (a, b) = text(new);
                RowChange::Insert(n, a, b)
            }
            (_, new) => {
                let (a, b) = text(new);
                RowChange::Update(n, a, b)
            }
        })
        .collect()
}

/// Adds to `out` the names whose entry is in one map and not the other, or differs: the two
/// sorted maps walked side by side.
fn differing<'a, V: PartialEq>(a: &'a BTreeMap<String, V>, b: &'a BTreeMap<String, V>, out: &mut std::collections::BTreeSet<&'a str>) {
    use std::cmp::Ordering;
    let (mut x, mut y) = (a.iter().peekable(), b.iter().peekable());
    loop {
        match (x.peek().copied(), y.peek().copied()) {
            (None, None) => return,
            (Some((k, _)), None) => {
                out.insert(k);
                x.next();
            }
            (None, Some((k, _))) => {
                out.insert(k);
                y.next();
            }
            (Some((ka, va)), Some((kb, vb))) => match ka.cmp(kb) {
                Ordering::Less => {
                    out.insert(ka);
                    x.next();
                }
                Ordering::Greater => {
                    out.insert(kb);
                    y.next();
                }
                Ordering::Equal => {
                    if va != vb {
                        out.insert(ka);
                    }
                    x.next();
                    y.next();
                }
            },
        }
    }
}

async fn write_changes(tx: &mut sqlx::Transaction<'static, sqlx::Any>, changes: &[RowChange<'_>]) -> Result<()> {
    let mut inserts = Vec::new();
    for c in changes {
        match c {
            RowChange::Delete(n) => {
                sqlx::query("DELETE FROM addresses WHERE node = $1").bind(*n).execute(&mut **tx).await?;
            }
            RowChange::Update(n, v4, v6) => {
                sqlx::query("UPDATE addresses SET ipv4 = $1, ipv6 = $2 WHERE node = $3")
                    .bind(v4.clone())
                    .bind(v6.clone())
                    .bind(*n)
                    .execute(&mut **tx)
                    .await?;
            }
            RowChange::Insert(n, v4, v6) => inserts.push((*n, v4, v6)),
        }
    }
    // New rows go in batches: one statement per 300 rows, not one per row.
    for chunk in inserts.chunks(300) {
        let values: Vec<String> = (0..chunk.len()).map(|i| format!("(${}, ${}, ${})", 3 * i + 1, 3 * i + 2, 3 * i + 3)).collect();
        let sql = format!("INSERT INTO addresses (node, ipv4, ipv6) VALUES {}", values.join(", "));
        let mut q = sqlx::query(&sql);
        for (n, v4, v6) in chunk {
            q = q.bind(*n).bind((*v4).clone()).bind((*v6).clone());
        }
        q.execute(&mut **tx).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(rows: &[(&str, Option<&str>, Option<&str>)]) -> Allocation {
        let mut a = Allocation::default();
        for (n, v4, v6) in rows {
            if let Some(v4) = v4 {
                a.ipv4.insert(n.to_string(), v4.parse().unwrap());
            }
            if let Some(v6) = v6 {
                a.ipv6.insert(n.to_string(), v6.parse().unwrap());
            }
        }
        a
    }

    #[test]
    fn the_changes_are_the_rows_that_differ_each_node_once() {
        let held = alloc(&[
            ("a", Some("10.0.0.1"), None),
            ("b", Some("10.0.0.2"), Some("fd00::2")),
            ("c", None, Some("fd00::3")),
            ("d", Some("10.0.0.4"), None),
        ]);
        let to = alloc(&[
            ("a", Some("10.0.0.1"), None),
            ("b", Some("10.0.0.2"), None),
            ("c", Some("10.0.0.3"), Some("fd00::3")),
            ("e", None, Some("fd00::5")),
        ]);
        let s = |v: &str| Some(v.to_string());
        assert_eq!(
            row_changes(&held, &to),
            vec![
                RowChange::Update("b", s("10.0.0.2"), None),
                RowChange::Update("c", s("10.0.0.3"), s("fd00::3")),
                RowChange::Delete("d"),
                RowChange::Insert("e", None, s("fd00::5")),
            ]
        );
        assert_eq!(row_changes(&to, &to), vec![], "the same allocation writes nothing");
        assert_eq!(row_changes(&Allocation::default(), &held).len(), 4, "every row new");
        assert!(row_changes(&held, &Allocation::default()).iter().all(|c| matches!(c, RowChange::Delete(_))));
    }
}
