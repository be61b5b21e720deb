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

/// Writes into `dir` the declaration `lab/basic` with `extra` more nodes (`extra-1`, ...) that
/// db-1 may reach: each one more changes db-1's files.
pub fn basic_with_extra_nodes(dir: &Path, extra: u32) {
    crate::controller::copy_dir(&repo().join("lab/basic"), dir);
    let mut mesh = std::fs::read_to_string(repo().join("lab/basic/mesh.toml")).unwrap();
    for k in 1..=extra {
        mesh.push_str(&format!("\n[[node]]\nname = \"extra-{k}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n"));
    }
    std::fs::write(dir.join("mesh.toml"), mesh).unwrap();
}

/// Waits (at most 30 s) until the zone an agent wrote under `root` names `name`; the time it
/// took, or what the zone held instead.
pub fn until_zone_names(root: &Path, name: &str) -> Result<std::time::Duration, String> {
    let started = std::time::Instant::now();
    let zone = root.join("etc/trellis/mesh.zone");
    while started.elapsed() < std::time::Duration::from_secs(30) {
        if std::fs::read_to_string(&zone).is_ok_and(|z| z.contains(&format!("\n{name}\t"))) {
            return Ok(started.elapsed());
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    Err(format!("after 30 s the zone does not name {name}:\n{}", std::fs::read_to_string(&zone).unwrap_or_default()))
}
