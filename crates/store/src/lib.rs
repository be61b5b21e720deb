//! The controller's records, in SQLite (the embedded default) or PostgreSQL, through sqlx. The
//! same queries serve both backends; each backend has its own migrations. Nothing of record lives
//! in process memory: several controllers may share one PostgreSQL.
//!
//! Every governance decision is written in the same transaction as its audit record, and the
//! audit records are chained by SHA-256 (ADR 0008).

use sqlx::any::AnyPoolOptions;
use sqlx::{Any, AnyPool, Transaction};
pub use trellis_proto::audit::verify as verify_audit;
pub use trellis_proto::AuditRecord;

mod audit;
mod bundles;
mod certs;
mod evidence;
mod ingress;
mod nodes;
mod paths;
mod pools;
mod revisions;
mod revocations;
mod tokens;
mod trust;

pub use audit::Audit;
pub use bundles::{BundleVersion, BUNDLES_BY_NAME};
pub use certs::{HeldServiceCert, IssuedServiceCert, ServiceCertRecord};
pub use evidence::{EvidenceRecord, EvidenceSummary, EVIDENCE_KEPT};
pub use nodes::{NodeChanges, NodeRecord, RecordsRead, SerialAndCert};
pub use pools::MemberRefusal;
pub use revisions::{Addresses, Packed, Revision};
pub use revocations::{HolderRecord, RevocationRecord};
pub use tokens::TokenRecord;
pub use trust::RotationRecord;

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
    #[error("member refused: {0:?}")]
    Refused(MemberRefusal),
    #[error("{0} not found")]
    NotFound(String),
    /// A rotation of this kind is in progress already, to the key named.
    #[error("a rotation to key {0} is in progress already")]
    RotationInProgress(String),
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

/// The PostgreSQL advisory lock that audited decisions take before appending to the chain.
const AUDIT_LOCK: i64 = 0x0074_7265_6c6c_6973; // "trellis"

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

/// A state read back from the database; a name no enum knows means the database was written by
/// something else.
fn parse<T: std::str::FromStr<Err = trellis_proto::state::UnknownState>>(s: String) -> Result<T> {
    s.parse().map_err(|e: trellis_proto::state::UnknownState| StoreError::Corrupt(e.to_string()))
}

impl StoreError {
    /// When the database could not be reached or is restarting (as opposed to refusing or
    /// failing a statement), a short reason, never the URL or a statement: the request may
    /// succeed once it is back.
    pub fn unavailable(&self) -> Option<String> {
        let StoreError::Db(e) = self else { return None };
        match e {
            sqlx::Error::PoolTimedOut => Some("no connection within 10 s".into()),
            sqlx::Error::Io(io) => Some(format!("connection: {}", io.kind())),
            sqlx::Error::Tls(_) | sqlx::Error::PoolClosed | sqlx::Error::WorkerCrashed | sqlx::Error::Protocol(_) => {
                Some("connection lost".into())
            }
            // Class 08, connection exception; 57P01-57P03, the server shutting down or starting.
            sqlx::Error::Database(d) => {
                let code = d.code().unwrap_or_default();
                (code.starts_with("08") || code.starts_with("57P")).then(|| format!("it is shutting down or starting (SQLSTATE {code})"))
            }
            _ => None,
        }
    }
}

fn is_unique_violation(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Database(d) => {
            d.is_unique_violation() || d.message().contains("UNIQUE constraint failed") || d.code().as_deref() == Some("23505")
        }
        _ => false,
    }
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
        // A request waits at most a few seconds for a connection: when the database is down
        // (restarting), it is told so promptly instead of hanging for sqlx's default 30 s.
        let mut opts = AnyPoolOptions::new()
            .max_connections(if backend == Backend::Sqlite { 4 } else { 8 })
            .acquire_timeout(std::time::Duration::from_secs(10))
            // A connection that comes back inside a transaction is closed, not reused (closing
            // rolls it back). sqlx returns one so when a request is cancelled (its client went
            // away) after `BEGIN` ran but before the `Transaction` that would roll it back on drop
            // existed: on SQLite it would hold the write lock, and every later write would fail
            // with "database is locked" or "cannot start a transaction within a transaction".
            .after_release(|conn, _| Box::pin(async move { Ok(!sqlx::Connection::is_in_transaction(conn)) }));
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

    /// Runs `f` in a transaction with an audit record, retrying when a concurrent writer took the
    /// same audit sequence number first (or another unique value `f` writes).
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
            // On PostgreSQL, audited decisions take turns at the head of the chain (a lock held
            // from here to the commit): with only the retry below, one of 100,000 token creations
            // 16 at a time lost twenty times running and failed. SQLite's writers take turns
            // already (`begin`).
            if self.backend == Backend::Postgres {
                if let Err(e) = sqlx::query("SELECT 1 FROM pg_advisory_xact_lock($1)").bind(AUDIT_LOCK).execute(&mut *tx).await {
                    let _ = tx.rollback().await;
                    return Err(e.into());
                }
            }
            match audit::append(&mut tx, audit).await {
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

    /// For tests: a connection goes back to the pool inside a transaction that nothing will roll
    /// back, as one does when a request is cancelled after `BEGIN` ran but before the
    /// `Transaction` existed.
    #[cfg(feature = "testing")]
    pub async fn leave_a_transaction_open(&self) -> Result<()> {
        let mut conn = self.pool.acquire().await?;
        let statement = if self.backend == Backend::Sqlite { "BEGIN IMMEDIATE" } else { "BEGIN" };
        std::mem::forget(sqlx::Connection::begin_with(&mut *conn, statement).await?);
        Ok(())
    }

    /// For tests: run raw SQL (used to tamper with the audit chain on purpose).
    #[cfg(feature = "testing")]
    pub async fn execute_raw(&self, sql: &str) -> Result<u64> {
        Ok(sqlx::query(sql).execute(&self.pool).await?.rows_affected())
    }
}
