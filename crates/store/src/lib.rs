//! The controller's records, in SQLite (the embedded default) or PostgreSQL, through sqlx. The
//! same queries serve both backends; each backend has its own migrations. Nothing of record lives
//! in process memory: several controllers may share one PostgreSQL.
//!
//! Every governance decision is written in the same transaction as its audit record, and the
//! audit records are chained by SHA-256 (ADR 0008).

use std::collections::BTreeMap;

use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{Any, AnyPool, Row, Transaction};
use trellis_core::Allocation;
pub use trellis_proto::audit::verify as verify_audit;
pub use trellis_proto::AuditRecord;
use trellis_proto::{EnrolledState, EvidenceResult};

pub mod testdb;

static SQLITE: sqlx::migrate::Migrator = sqlx::migrate!("migrations/sqlite");
static POSTGRES: sqlx::migrate::Migrator = sqlx::migrate!("migrations/postgres");

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the current revision is {current}, not {expected}: someone applied in between; re-check and apply again")]
    Conflict { current: i64, expected: i64 },
    #[error("token already used")]
    TokenUsed,
    #[error("WireGuard public key is already held by node `{0}`")]
    KeyTaken(String),
    #[error("{0} not found")]
    NotFound(String),
    #[error("database URL {0:?} is neither sqlite:// nor postgres://")]
    BadUrl(String),
    #[error("the database holds what this trellis does not understand: {0}")]
    Corrupt(String),
    #[error("database: {0}")]
    Db(#[from] sqlx::Error),
    #[error("database migration: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
}

pub type Result<T> = std::result::Result<T, StoreError>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

#[derive(Clone)]
pub struct Store {
    pool: AnyPool,
    pub backend: Backend,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Revision {
    pub number: i64,
    pub created_at: i64,
    pub digest: String,
    /// (path, text) of every declaration file.
    pub files: Vec<(String, String)>,
}

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
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenRecord {
    pub id: String,
    pub node: String,
    pub secret_sha256: String,
    pub created_at: i64,
    pub expires_at: i64,
    pub used_at: Option<i64>,
    pub revoked_at: Option<i64>,
    pub require_approval: bool,
}

/// A state read back from the database; a name no enum knows means the database was written by
/// something else.
fn parse<T: std::str::FromStr<Err = trellis_proto::state::UnknownState>>(s: String) -> Result<T> {
    s.parse().map_err(|e: trellis_proto::state::UnknownState| StoreError::Corrupt(e.to_string()))
}

fn node_record(r: &AnyRow) -> Result<NodeRecord> {
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
    })
}

fn token_record(r: &AnyRow) -> Result<TokenRecord> {
    Ok(TokenRecord {
        id: r.try_get("id")?,
        node: r.try_get("node")?,
        secret_sha256: r.try_get("secret_sha256")?,
        created_at: r.try_get("created_at")?,
        expires_at: r.try_get("expires_at")?,
        used_at: r.try_get("used_at")?,
        revoked_at: r.try_get("revoked_at")?,
        require_approval: r.try_get::<i64, _>("require_approval")? != 0,
    })
}

const NODE_COLUMNS: &str = "name, state, wg_public_key, cert_serial, prev_cert_serial, cert_not_after, enrolled_at, last_contact, cert_pem";
const TOKEN_COLUMNS: &str = "id, node, secret_sha256, created_at, expires_at, used_at, revoked_at, require_approval";

fn is_unique_violation(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.is_unique_violation() || d.message().contains("UNIQUE constraint failed") || d.code().as_deref() == Some("23505")
        }
        _ => false,
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BundleVersion {
    pub version: i64,
    pub digest: String,
    pub issued_at: i64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EvidenceRecord {
    pub seq: i64,
    pub version: i64,
    pub result: EvidenceResult,
    pub error: Option<String>,
    /// JSON: per-file path, SHA-256 and result.
    pub files: String,
    pub at: i64,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EvidenceSummary {
    pub records: i64,
    pub highest_seq: i64,
    pub applied_version: Option<i64>,
    pub last_result: Option<EvidenceResult>,
    pub last_error: Option<String>,
    pub last_at: Option<i64>,
}

impl EvidenceSummary {
    /// Sequence numbers missing between 1 and the highest received.
    pub fn missing(&self) -> i64 {
        self.highest_seq - self.records
    }
}

fn is_serialization(e: &sqlx::Error) -> bool {
    matches!(e, sqlx::Error::Database(d) if d.code().as_deref() == Some("40001") || d.code().as_deref() == Some("40P01"))
}

/// What a decision writes to the audit chain.
pub struct Audit<'a> {
    pub at: i64,
    pub actor: &'a str,
    pub action: &'a str,
    pub subject: &'a str,
    pub detail: String,
}

impl Store {
    /// Opens (creating a SQLite file if needed) and migrates the database.
    pub async fn open(url: &str) -> Result<Store> {
        sqlx::any::install_default_drivers();
        let backend = if url.starts_with("sqlite:") {
            Backend::Sqlite
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            Backend::Postgres
        } else {
            return Err(StoreError::BadUrl(url.to_string()));
        };
        let mut opts = AnyPoolOptions::new().max_connections(if backend == Backend::Sqlite { 4 } else { 8 });
        if backend == Backend::Sqlite {
            opts = opts.after_connect(|conn, _| {
                Box::pin(async move {
                    sqlx::query("PRAGMA busy_timeout = 10000").execute(&mut *conn).await?;
                    sqlx::query("PRAGMA journal_mode = WAL").execute(&mut *conn).await?;
                    sqlx::query("PRAGMA synchronous = NORMAL").execute(&mut *conn).await?;
                    Ok(())
                })
            });
        }
        let pool = opts.connect(url).await?;
        match backend {
            Backend::Sqlite => SQLITE.run(&pool).await?,
            Backend::Postgres => POSTGRES.run(&pool).await?,
        }
        Ok(Store { pool, backend })
    }

    /// A transaction that takes SQLite's write lock at once, so that two writers never both
    /// read and then collide on upgrade; PostgreSQL relies on its constraints.
    async fn begin(&self) -> Result<Transaction<'static, Any>> {
        let tx = match self.backend {
            Backend::Sqlite => self.pool.begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => self.pool.begin().await?,
        };
        Ok(tx)
    }

    async fn append_audit(tx: &mut Transaction<'static, Any>, a: &Audit<'_>) -> Result<()> {
        let last = sqlx::query("SELECT seq, hash FROM audit ORDER BY seq DESC LIMIT 1").fetch_optional(&mut **tx).await?;
        let (seq, prev) = match last {
            Some(r) => (r.try_get::<i64, _>("seq")? + 1, r.try_get::<String, _>("hash")?),
            None => (1, String::new()),
        };
        let hash = trellis_proto::audit::hash(seq, a.at, a.actor, a.action, a.subject, &a.detail, &prev);
        sqlx::query("INSERT INTO audit (seq, at, actor, action, subject, detail, prev_hash, hash) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)")
            .bind(seq)
            .bind(a.at)
            .bind(a.actor)
            .bind(a.action)
            .bind(a.subject)
            .bind(a.detail.clone())
            .bind(prev)
            .bind(hash)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// Runs `f` in a transaction with an audit record, retrying when a concurrent writer took the
    /// same audit sequence number first.
    async fn decide<T, F>(&self, audit: &Audit<'_>, mut f: F) -> Result<T>
    where
        F: for<'t> FnMut(&'t mut Transaction<'static, Any>) -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<T>> + Send + 't>>,
    {
        let mut attempt = 0;
        loop {
            let mut tx = self.begin().await?;
            let out = match f(&mut tx).await {
                Ok(v) => v,
                Err(e) => {
                    let _ = tx.rollback().await;
                    return Err(e);
                }
            };
            match Self::append_audit(&mut tx, audit).await {
                Ok(()) => {}
                Err(StoreError::Db(e)) if is_unique_violation(&e) && attempt < 20 => {
                    let _ = tx.rollback().await;
                    attempt += 1;
                    continue;
                }
                Err(e) => return Err(e),
            }
            match tx.commit().await {
                Ok(()) => return Ok(out),
                Err(e) if is_unique_violation(&e) && attempt < 20 => attempt += 1,
                Err(e) => return Err(e.into()),
            }
        }
    }

    // --- revisions -------------------------------------------------------------------------

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
    /// `expect`, fails with `Conflict` unless the current revision is that one (0 for none).
    pub async fn apply(
        &self,
        files: &[(String, String)],
        digest: &str,
        allocation: &Allocation,
        expect: Option<i64>,
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
                    sqlx::query("DELETE FROM addresses").execute(&mut **tx).await?;
                    let mut names: BTreeMap<&str, (Option<String>, Option<String>)> = BTreeMap::new();
                    for (n, a) in &allocation.ipv4 {
                        names.entry(n.as_str()).or_default().0 = Some(a.to_string());
                    }
                    for (n, a) in &allocation.ipv6 {
                        names.entry(n.as_str()).or_default().1 = Some(a.to_string());
                    }
                    for (n, (v4, v6)) in names {
                        sqlx::query("INSERT INTO addresses (node, ipv4, ipv6) VALUES ($1, $2, $3)")
                            .bind(n)
                            .bind(v4)
                            .bind(v6)
                            .execute(&mut **tx)
                            .await?;
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

    // --- tokens ----------------------------------------------------------------------------

    pub async fn create_token(&self, t: &TokenRecord, audit: &Audit<'_>) -> Result<()> {
        let t = t.clone();
        self.decide(audit, |tx| {
            let t = t.clone();
            Box::pin(async move {
                sqlx::query(&format!("INSERT INTO tokens ({TOKEN_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"))
                    .bind(t.id)
                    .bind(t.node)
                    .bind(t.secret_sha256)
                    .bind(t.created_at)
                    .bind(t.expires_at)
                    .bind(t.used_at)
                    .bind(t.revoked_at)
                    .bind(t.require_approval as i64)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            })
        })
        .await
    }

    pub async fn token(&self, id: &str) -> Result<Option<TokenRecord>> {
        let row = sqlx::query(&format!("SELECT {TOKEN_COLUMNS} FROM tokens WHERE id = $1")).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(token_record).transpose()
    }

    pub async fn tokens(&self) -> Result<Vec<TokenRecord>> {
        let rows = sqlx::query(&format!("SELECT {TOKEN_COLUMNS} FROM tokens ORDER BY created_at, id")).fetch_all(&self.pool).await?;
        rows.iter().map(token_record).collect()
    }

    /// Revokes an unused token. Returns false when there is no such token or it was used.
    pub async fn revoke_token(&self, id: &str, audit: &Audit<'_>) -> Result<bool> {
        let id = id.to_string();
        let at = audit.at;
        let r = self
            .decide(audit, |tx| {
                let id = id.clone();
                Box::pin(async move {
                    let n = sqlx::query("UPDATE tokens SET revoked_at = $1 WHERE id = $2 AND used_at IS NULL AND revoked_at IS NULL")
                        .bind(at)
                        .bind(id.clone())
                        .execute(&mut **tx)
                        .await?
                        .rows_affected();
                    if n == 1 {
                        Ok(())
                    } else {
                        Err(StoreError::NotFound(format!("unused token {id}")))
                    }
                })
            })
            .await;
        match r {
            Ok(()) => Ok(true),
            Err(StoreError::NotFound(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    // --- nodes -----------------------------------------------------------------------------

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
                    let used = sqlx::query("UPDATE tokens SET used_at = $1 WHERE id = $2 AND used_at IS NULL AND revoked_at IS NULL")
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
                    sqlx::query(&format!(
                        "INSERT INTO nodes ({NODE_COLUMNS}) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) \
                         ON CONFLICT (name) DO UPDATE SET state = excluded.state, wg_public_key = excluded.wg_public_key, \
                         cert_serial = excluded.cert_serial, prev_cert_serial = excluded.prev_cert_serial, \
                         cert_not_after = excluded.cert_not_after, enrolled_at = excluded.enrolled_at, last_contact = excluded.last_contact, cert_pem = excluded.cert_pem"
                    ))
                    .bind(node.name)
                    .bind(node.state.as_str())
                    .bind(node.wg_public_key)
                    .bind(node.cert_serial)
                    .bind(node.prev_cert_serial)
                    .bind(node.cert_not_after)
                    .bind(node.enrolled_at)
                    .bind(node.last_contact)
                    .bind(node.cert_pem)
                    .execute(&mut **tx)
                    .await?;
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

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>> {
        let rows = sqlx::query(&format!("SELECT {NODE_COLUMNS} FROM nodes ORDER BY name")).fetch_all(&self.pool).await?;
        rows.iter().map(node_record).collect()
    }

    /// Moves a node from one of `from` states to `to`. Revocation also forgets its certificates,
    /// so they are refused at once. Returns the state it was in, or `NotFound`.
    pub async fn set_state(&self, name: &str, from: &[EnrolledState], to: EnrolledState, audit: &Audit<'_>) -> Result<EnrolledState> {
        let name = name.to_string();
        let from = from.to_vec();
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
                sqlx::query(sql).bind(to.as_str()).bind(name).execute(&mut **tx).await?;
                Ok(state)
            })
        })
        .await
    }

    /// Records a renewed certificate; the one it replaces stays valid until it expires.
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
            Box::pin(async move {
                let n = sqlx::query("UPDATE nodes SET prev_cert_serial = $1, cert_serial = $2, cert_not_after = $3, cert_pem = $4 WHERE name = $5 AND state <> $6")
                    .bind(old)
                    .bind(new)
                    .bind(not_after)
                    .bind(pem)
                    .bind(name.clone())
                    .bind(EnrolledState::Revoked.as_str())
                    .execute(&mut **tx)
                    .await?
                    .rows_affected();
                if n == 1 { Ok(()) } else { Err(StoreError::NotFound(format!("node `{name}`"))) }
            })
        })
        .await
    }

    pub async fn touch(&self, name: &str, now: i64) -> Result<()> {
        sqlx::query("UPDATE nodes SET last_contact = $1 WHERE name = $2").bind(now).bind(name).execute(&self.pool).await?;
        Ok(())
    }

    // --- bundles ---------------------------------------------------------------------------

    /// Version, content digest and issue time of every node's current bundle.
    pub async fn bundles(&self) -> Result<std::collections::HashMap<String, BundleVersion>> {
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
        let all = self.bundles().await?;
        Ok(changes.iter().filter_map(|(node, _)| all.get(node).map(|v| (node.clone(), v.clone()))).collect())
    }

    // --- evidence --------------------------------------------------------------------------

    /// Appends evidence records; a record whose (node, seq) is already stored is a re-send and is
    /// ignored. Returns (accepted, duplicates).
    pub async fn add_evidence(&self, node: &str, records: &[EvidenceRecord], received_at: i64) -> Result<(usize, usize)> {
        let mut tx = self.begin().await?;
        let mut accepted = 0;
        for r in records {
            let n = sqlx::query("INSERT INTO evidence (node, seq, version, result, error, files, at, received_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (node, seq) DO NOTHING")
                .bind(node)
                .bind(r.seq)
                .bind(r.version)
                .bind(r.result.as_str())
                .bind(r.error.clone())
                .bind(r.files.clone())
                .bind(r.at)
                .bind(received_at)
                .execute(&mut *tx)
                .await?
                .rows_affected();
            accepted += n as usize;
        }
        tx.commit().await?;
        Ok((accepted, records.len() - accepted))
    }

    /// Per node: how many records, the highest sequence number, the newest applied version, and
    /// the result and error of the newest record.
    pub async fn evidence_summary(&self) -> Result<std::collections::HashMap<String, EvidenceSummary>> {
        let rows = sqlx::query("SELECT node, COUNT(*) AS n, MAX(seq) AS top FROM evidence GROUP BY node").fetch_all(&self.pool).await?;
        let mut out = std::collections::HashMap::new();
        for r in rows {
            let node: String = r.try_get("node")?;
            out.insert(node, EvidenceSummary { records: r.try_get("n")?, highest_seq: r.try_get("top")?, ..Default::default() });
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
        let rows = sqlx::query("SELECT seq, version, result, error, files, at FROM evidence WHERE node = $1 ORDER BY seq")
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
                })
            })
            .collect()
    }

    /// The newest audit sequence number: every governance decision moves it, so replicas watch
    /// it to learn that something changed.
    pub async fn audit_head(&self) -> Result<i64> {
        let r = sqlx::query("SELECT MAX(seq) AS top FROM audit").fetch_one(&self.pool).await?;
        Ok(r.try_get::<Option<i64>, _>("top")?.unwrap_or(0))
    }

    // --- audit -----------------------------------------------------------------------------

    /// Records an event that changes nothing else, such as a refused token redemption.
    pub async fn record(&self, audit: &Audit<'_>) -> Result<()> {
        self.decide(audit, |_| Box::pin(async { Ok(()) })).await
    }

    pub async fn audit(&self) -> Result<Vec<AuditRecord>> {
        let rows = sqlx::query("SELECT seq, at, actor, action, subject, detail, prev_hash, hash FROM audit ORDER BY seq")
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                Ok(AuditRecord {
                    seq: r.try_get("seq")?,
                    at: r.try_get("at")?,
                    actor: r.try_get("actor")?,
                    action: r.try_get("action")?,
                    subject: r.try_get("subject")?,
                    detail: r.try_get("detail")?,
                    prev_hash: r.try_get("prev_hash")?,
                    hash: r.try_get("hash")?,
                })
            })
            .collect()
    }

    /// For tests: run raw SQL (used to tamper with the audit chain on purpose).
    pub async fn execute_raw(&self, sql: &str) -> Result<u64> {
        Ok(sqlx::query(sql).execute(&self.pool).await?.rows_affected())
    }
}
