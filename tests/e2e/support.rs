//! Helpers of the end-to-end suite: the binaries under test and network namespaces. Commands,
//! temporary directories and skips are trellis-testing's.

use std::path::Path;
use std::process::Command;

use trellis_testing::cmd::{ok, sh};
use trellis_testing::{is_root, repo};

/// Where `trellis-agent` is: its own package builds it next to `trellis` (a test target of one
/// package cannot ask Cargo for another package's binary).
pub const AGENT: &str = concat!(env!("CARGO_BIN_EXE_trellis"), "-agent");

/// The `trellis-agent` binary's path; panics with what to do when it has not been built.
#[track_caller]
pub fn agent() -> &'static str {
    assert!(Path::new(AGENT).exists(), "{AGENT} does not exist: build it first: cargo build -p trellis-agent");
    AGENT
}

/// `trellis`, run in the repository's root.
pub fn trellis() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_trellis"));
    c.current_dir(repo());
    c
}

/// `trellis ARGS`, run in the repository's root.
pub fn trellis_cmd(args: &[&str]) -> Command {
    let mut c = trellis();
    c.args(args);
    c
}

/// A network namespace, deleted (with every process still in it killed) on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
    /// A test that makes one first asks `trellis_testing::can_run(Need::Root)`.
    #[track_caller]
    pub fn new(tag: &str) -> Netns {
        assert!(is_root(), "this test needs root for network namespaces (CI runs as root)");
        // Unique per process and per call: tests run in parallel threads of one process.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("trl{}n{n}-{tag}", std::process::id() % 100_000);
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ok(sh("ip", &["netns", "add", &name]));
        let ns = Netns { name };
        ns.ok(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    pub fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).args(args);
        c
    }

    #[track_caller]
    pub fn ok(&self, args: &[&str]) -> String {
        ok(self.cmd(args))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        if let Ok(out) = Command::new("ip").args(["netns", "pids", &self.name]).output() {
            for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
                let _ = Command::new("kill").args(["-9", pid]).output();
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}
