//! Running commands in tests: every failure prints the command, its status, its standard output
//! and its standard error (ripgrep's `tests/util.rs`).

use std::process::{Child, Command, Output};

/// The command, its status and both outputs, for a failure message.
pub fn describe(cmd: &Command, out: &Output) -> String {
    format!(
        "command: {cmd:?}\nstatus: {}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Runs a command and returns its output, whatever its status, with its description.
#[track_caller]
pub fn run(mut cmd: Command) -> (Output, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let d = describe(&cmd, &out);
    (out, d)
}

/// Runs a command that must succeed; returns its standard output.
#[track_caller]
pub fn ok(cmd: Command) -> String {
    let (out, d) = run(cmd);
    assert!(out.status.success(), "command failed\n{d}");
    String::from_utf8(out.stdout).unwrap_or_else(|e| panic!("stdout is not UTF-8 ({e})\n{d}"))
}

/// Runs a command that must exit 1 with `text` in its standard error; returns the standard
/// error.
#[track_caller]
pub fn fails_with(cmd: Command, text: &str) -> String {
    let (out, d) = run(cmd);
    assert_eq!(out.status.code(), Some(1), "expected exit 1\n{d}");
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    assert!(err.contains(text), "expected {text:?} in stderr\n{d}");
    err
}

/// `program args...`, not yet run.
pub fn sh(program: &str, args: &[&str]) -> Command {
    let mut c = Command::new(program);
    c.args(args);
    c
}

/// A child process, killed and reaped when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
