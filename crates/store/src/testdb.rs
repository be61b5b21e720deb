//! Fresh databases for tests, on both backends. PostgreSQL comes from
//! `TRELLIS_TEST_POSTGRES_URL` (`scripts/test` starts a server and sets it).

use std::sync::atomic::{AtomicU32, Ordering};

static COUNTER: AtomicU32 = AtomicU32::new(0);

fn unique(tag: &str) -> String {
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    format!("{tag}_{}_{n}_{t}", std::process::id())
}

/// A URL for a new SQLite file in the system temporary directory.
pub fn sqlite_url() -> String {
    let path = std::env::temp_dir().join(format!("{}.db", unique("trellis_test")));
    format!("sqlite://{}?mode=rwc", path.display())
}

/// A URL for a new, empty PostgreSQL database. Panics with instructions when no server is
/// configured: the PostgreSQL backend is part of what the tests must show.
pub async fn postgres_url() -> String {
    let admin = std::env::var("TRELLIS_TEST_POSTGRES_URL").unwrap_or_else(|_| {
        panic!("TRELLIS_TEST_POSTGRES_URL is not set: run the suite with ./scripts/test, which starts PostgreSQL, or start one with `eval \"$(scripts/postgres start)\"`")
    });
    sqlx::any::install_default_drivers();
    let name = unique("trellis_test");
    let mut conn = <sqlx::AnyConnection as sqlx::Connection>::connect(&admin).await.expect("connect to TRELLIS_TEST_POSTGRES_URL");
    sqlx::query(&format!("CREATE DATABASE {name}")).execute(&mut conn).await.expect("create test database");
    let base = admin.rsplit_once('/').map_or(admin.as_str(), |(b, _)| b);
    format!("{base}/{name}")
}

/// Both backends, for tests that must hold on each.
pub async fn both() -> Vec<String> {
    vec![sqlite_url(), postgres_url().await]
}
