//! Skips: a test asks [`can_run`] for what it needs and returns when the answer is no. The
//! test binary says once, as it exits, which tests skipped what and why (ripgrep's
//! `cmd_exists`, told instead of silent); with `TRELLIS_TEST_REQUIRE_ALL=1` a skip is a failure.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::panic::Location;
use std::sync::{Mutex, Once};

/// The environment variable that turns every skip into a failure (`scripts/test` sets it).
pub const REQUIRE_ALL: &str = "TRELLIS_TEST_REQUIRE_ALL";

/// What a test needs that a laptop may not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Need {
    /// Root: network namespaces, nftables, mounts, servers run as another user.
    Root,
    /// A PostgreSQL server, named by `TRELLIS_TEST_POSTGRES_URL`.
    Postgres,
    /// A program on `PATH`.
    Program(&'static str),
}

impl Need {
    fn met(self) -> bool {
        match self {
            Need::Root => is_root(),
            Need::Postgres => std::env::var("TRELLIS_TEST_POSTGRES_URL").is_ok_and(|u| !u.is_empty()),
            Need::Program(p) => on_path(p),
        }
    }

    /// What is missing.
    fn what(self) -> String {
        match self {
            Need::Root => "root".into(),
            Need::Postgres => "PostgreSQL".into(),
            Need::Program(p) => format!("`{p}`"),
        }
    }

    /// Why it is missing, and how to have it.
    fn how(self) -> String {
        match self {
            Need::Root => "network namespaces, nftables and mounts need it; run as root, as CI does".into(),
            Need::Postgres => {
                "TRELLIS_TEST_POSTGRES_URL is not set; `eval \"$(scripts/postgres start)\"` starts a server and sets it".into()
            }
            Need::Program(p) => format!("`{p}` is not on PATH; scripts/install-deps installs it"),
        }
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|d| d.join(program).is_file())
}

/// Whether the running test has what it needs. When it has not, the test is recorded as having
/// skipped what needs it (told once, as the test binary exits) and the caller skips that part:
/// `if !can_run(Need::Root) { return; }`. With `TRELLIS_TEST_REQUIRE_ALL=1` it panics instead,
/// naming what is missing.
#[track_caller]
pub fn can_run(need: Need) -> bool {
    if need.met() {
        return true;
    }
    let test = test_name(Location::caller());
    if std::env::var(REQUIRE_ALL).is_ok_and(|v| !v.is_empty() && v != "0") {
        panic!("{test} needs {} ({}); {REQUIRE_ALL} is set, so no test may skip", need.what(), need.how());
    }
    SKIPPED.lock().unwrap_or_else(|e| e.into_inner()).entry(need).or_default().insert(test);
    static TELL: Once = Once::new();
    TELL.call_once(|| {
        // SAFETY: `atexit` is the C library's; `tell` is a function that never unwinds.
        unsafe { atexit(tell) };
    });
    false
}

/// The test running on this thread: libtest names each test's thread after the test. Outside a
/// test's thread (a runtime's worker), where the caller is.
fn test_name(at: &Location) -> String {
    match std::thread::current().name() {
        Some(name) if name != "main" && !name.starts_with("tokio-runtime") => name.to_string(),
        _ => format!("{}:{}", at.file(), at.line()),
    }
}

static SKIPPED: Mutex<BTreeMap<Need, BTreeSet<String>>> = Mutex::new(BTreeMap::new());

extern "C" {
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// One line per missing need, after libtest's summary.
extern "C" fn tell() {
    let _ = std::panic::catch_unwind(|| {
        let skipped = SKIPPED.lock().unwrap_or_else(|e| e.into_inner());
        let mut text = String::new();
        for (need, tests) in skipped.iter() {
            let names: Vec<&str> = tests.iter().map(String::as_str).collect();
            let n = names.len();
            text.push_str(&format!(
                "{n} test{} skipped what needs {} ({}; {REQUIRE_ALL}=1 makes this a failure): {}\n",
                if n == 1 { "" } else { "s" },
                need.what(),
                need.how(),
                names.join(", ")
            ));
        }
        let _ = std::io::stderr().write_all(text.as_bytes());
    });
}
