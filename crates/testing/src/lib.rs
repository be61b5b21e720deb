//! What the tests of every trellis crate share: a temporary directory that removes itself
//! ([`TempDir`]), the command runner whose failures print the command, its status and both
//! outputs ([`cmd`]), fresh databases on SQLite and PostgreSQL ([`Database`]), the in-process
//! controller fixture and enrolment requests ([`controller`]), and skips ([`can_run`]).
//!
//! A plain `cargo test` runs on any laptop: a test that needs root, PostgreSQL or a program that
//! is not installed skips what it cannot do, and each test binary says once, as it exits, which
//! tests skipped what and why. `TRELLIS_TEST_REQUIRE_ALL=1` (set by `scripts/test`) turns every
//! skip into a failure, so CI runs everything.
//!
//! A dev-dependency only: no product crate depends on it. Without features it needs only std;
//! `db` adds [`Database`] (sqlx), `controller` the controller fixture.

pub mod cmd;
#[cfg(feature = "controller")]
pub mod controller;
#[cfg(feature = "db")]
mod db;
mod dir;
mod skip;

#[cfg(feature = "db")]
pub use db::{databases, Database};
pub use dir::TempDir;
pub use skip::{can_run, is_root, Need, REQUIRE_ALL};

/// The repository's root directory.
pub fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().expect("the repository root")
}
