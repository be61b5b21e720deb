//! Every shipped topology through `trellis lab run`, as the README's main command runs it:
//! namespaces, NAT and firewall routers, the real controller and agents, every expectation met,
//! and nothing left behind.

use crate::support::{is_root, run, trellis};

fn lab_run(file: &str) {
    assert!(is_root(), "the lab needs root (CI runs as root)");
    let (out, d) = run({
        let mut c = trellis();
        c.args(["lab", "run", file]);
        c
    });
    assert!(out.status.success(), "{d}");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let met = stdout.lines().find(|l| l.ends_with("expectations met")).unwrap_or_else(|| panic!("no summary\n{d}"));
    let (got, total) = met.split_once(" of ").map(|(a, b)| (a.to_string(), b.split_whitespace().next().unwrap_or("").to_string())).unwrap();
    assert_eq!(got, total, "{d}");
    assert!(!stdout.contains(" NO\n"), "{d}");
    assert!(stdout.contains("token redeemed -> first packet over the overlay"), "{d}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let prefix = stderr.split(" as ").nth(1).and_then(|s| s.split("-*").next()).unwrap_or_else(|| panic!("no prefix\n{d}")).to_string();
    let left = std::process::Command::new("ip").args(["netns", "list"]).output().unwrap();
    assert!(!String::from_utf8_lossy(&left.stdout).contains(&prefix), "namespaces left behind by {file}\n{d}");
    println!("{file}:\n{stdout}");
}

#[test]
fn lab_basic() {
    lab_run("lab/basic.toml");
}

#[test]
fn lab_cgnat() {
    lab_run("lab/cgnat.toml");
}

#[test]
fn lab_ipv6() {
    lab_run("lab/ipv6.toml");
}

#[test]
fn lab_firewalled() {
    lab_run("lab/firewalled.toml");
}

#[test]
fn lab_dualhomed() {
    lab_run("lab/dualhomed.toml");
}
