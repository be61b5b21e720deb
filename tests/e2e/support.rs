//! Helpers for driving binaries and network namespaces; failures print the command and its
//! output.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

/// Where `trellis-agent` is: its own package builds it next to `trellis` (a test target of one
/// package cannot ask Cargo for another package's binary).
pub const AGENT: &str = concat!(env!("CARGO_BIN_EXE_trellis"), "-agent");

/// The `trellis-agent` binary's path; panics with what to do when it has not been built.
#[track_caller]
pub fn agent() -> &'static str {
    assert!(Path::new(AGENT).exists(), "{AGENT} does not exist: build it first: cargo build -p trellis-agent");
    AGENT
}

pub fn trellis() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_trellis"));
    c.current_dir(repo());
    c
}

pub fn describe(cmd: &Command, out: &Output) -> String {
    format!(
        "command: {cmd:?}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command and returns its output, whatever its status.
pub fn run(mut cmd: Command) -> (Output, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let d = describe(&cmd, &out);
    (out, d)
}

/// Runs a command that must succeed; returns its stdout.
#[track_caller]
pub fn ok(cmd: Command) -> String {
    let (out, d) = run(cmd);
    assert!(out.status.success(), "command failed\n{d}");
    String::from_utf8(out.stdout).unwrap()
}

pub fn sh(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

pub fn tempdir(tag: &str) -> TempDir {
    let p = std::env::temp_dir().join(format!("trellis-{tag}-{}-{}", std::process::id(), rand_suffix()));
    std::fs::create_dir_all(&p).unwrap();
    // Private, as a directory that holds keys must be (the agent and `init` refuse an open one).
    std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    TempDir(p)
}

fn rand_suffix() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0);
    h.finish() % 1_000_000
}

/// A child process, killed and reaped when dropped.
pub struct Proc(pub std::process::Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct TempDir(pub PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("Uid:")).map(|l| l.split_whitespace().nth(1) == Some("0")))
        .unwrap_or(false)
}

/// A network namespace, deleted (with every process still in it killed) on drop.
pub struct Netns {
    pub name: String,
}

impl Netns {
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
