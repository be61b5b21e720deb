//! Fresh databases for tests: a SQLite file in a directory of its own, removed with it, and a
//! new database on the PostgreSQL server `TRELLIS_TEST_POSTGRES_URL` names, when it names one.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::{can_run, Need, TempDir};

/// A fresh, empty database; it dereferences to (and displays as) its URL. A SQLite database's
/// directory is removed once the last clone is dropped.
#[derive(Clone)]
pub struct Database {
    url: String,
    _dir: Option<Arc<TempDir>>,
}

impl Database {
    /// A new SQLite file.
    pub fn sqlite() -> Database {
        let dir = TempDir::new("sqlite");
        let url = format!("sqlite://{}?mode=rwc", dir.path().join("trellis.db").display());
        Database { url, _dir: Some(Arc::new(dir)) }
    }

    /// A new database on the test PostgreSQL server; `None`, recorded as a skip of the running
    /// test, when `TRELLIS_TEST_POSTGRES_URL` is not set. Panics when the server named cannot
    /// be reached: the PostgreSQL backend is part of what the tests must show.
    pub async fn postgres() -> Option<Database> {
        if !can_run(Need::Postgres) {
            return None;
        }
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let admin = std::env::var("TRELLIS_TEST_POSTGRES_URL").expect("checked by can_run");
        sqlx::any::install_default_drivers();
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let name = format!("trellis_test_{}_{n}_{nanos}", std::process::id());
        let mut conn = <sqlx::AnyConnection as sqlx::Connection>::connect(&admin)
            .await
            .unwrap_or_else(|e| panic!("cannot connect to TRELLIS_TEST_POSTGRES_URL {admin}: {e}"));
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut conn)
            .await
            .unwrap_or_else(|e| panic!("cannot create database {name} on {admin}: {e}"));
        let base = admin.rsplit_once('/').map_or(admin.as_str(), |(b, _)| b);
        Some(Database { url: format!("{base}/{name}"), _dir: None })
    }

    pub fn url(&self) -> &str {
        &self.url
    }
}

/// Both backends, for tests that must hold on each: SQLite, then PostgreSQL when there is a
/// server (otherwise the running test is recorded as having skipped its PostgreSQL part).
pub async fn databases() -> Vec<Database> {
    let mut out = vec![Database::sqlite()];
    out.extend(Database::postgres().await);
    out
}

impl std::ops::Deref for Database {
    type Target = str;

    fn deref(&self) -> &str {
        &self.url
    }
}

impl std::fmt::Display for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

impl std::fmt::Debug for Database {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.url)
    }
}
