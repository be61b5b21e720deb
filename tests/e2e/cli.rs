//! The offline commands as a user runs them: exit codes, messages, files and JSON.

use std::os::unix::fs::PermissionsExt;

use trellis_testing::cmd::{ok, run};
use trellis_testing::TempDir;

use crate::support::trellis;

fn args(a: &[&str]) -> std::process::Command {
    let mut c = trellis();
    c.args(a);
    c
}

#[test]
fn check_accepts_the_shipped_lab_declarations() {
    let out = ok(args(&["check", "lab/basic"]));
    assert!(out.contains("mesh basic is valid: 3 nodes, 6 modules, 3 policy tests passed"), "{out}");
}

#[test]
fn check_reports_every_error_with_its_place_and_exits_1() {
    let dir = TempDir::new("check");
    std::fs::create_dir_all(dir.path().join("modules")).unwrap();
    std::fs::write(dir.path().join("mesh.toml"), "[mesh]\nname = \"x\"\ndomain = \"x.mesh\"\noverlay_ipv4 = \"10.1.0.0/16\"\n[[node]]\nname = \"a\"\nmodules = [\"web\"]\ncolour = 1\n").unwrap();
    std::fs::write(dir.path().join("modules/web.toml"), "[module]\nname = \"web\"\n[[allow]]\nproto = \"tcp\"\nports = [\"80\"]\n")
        .unwrap();
    let (out, d) = run(args(&["check", dir.path().to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(1), "{d}");
    let err = String::from_utf8_lossy(&out.stderr);
    let mesh = format!("{}/mesh.toml:8:1: error: unknown key `colour` in [[node]]", dir.path().display());
    let web = format!("{}/modules/web.toml:3:1: error: [[allow]] has no `from`", dir.path().display());
    assert!(err.contains(&mesh) && err.contains(&web), "{d}");
    assert!(err.find(&mesh) < err.find(&web), "sorted by file: {d}");

    let (out, d) = run(args(&["check", dir.path().to_str().unwrap(), "--json"]));
    assert_eq!(out.status.code(), Some(1), "{d}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["valid"], false);
    assert_eq!(v["errors"], 2);
    assert_eq!(v["diagnostics"][0]["line"], 8);
}

#[test]
fn usage_errors_exit_2_and_a_missing_directory_exits_1() {
    let (out, d) = run(args(&["check"]));
    assert_eq!(out.status.code(), Some(2), "{d}");
    let dir = TempDir::new("usage");
    let (out, d) = run(args(&["compile", "lab/basic", "--out", dir.join("x").to_str().unwrap()]));
    assert_eq!(out.status.code(), Some(2), "--node or --all is required: {d}");
    let (out, d) = run(args(&["check", "/nonexistent/decl"]));
    assert_eq!(out.status.code(), Some(1), "{d}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/decl is not a directory"), "{d}");
}

#[test]
fn compile_writes_a_node_and_all_nodes_with_their_modes() {
    let out = TempDir::new("compile");
    let one = out.path().join("one");
    ok(args(&["compile", "lab/basic", "--node", "db-1", "--out", one.to_str().unwrap()]));
    for (f, mode) in [("wireguard.conf", 0o600), ("nftables.conf", 0o644), ("mesh.zone", 0o644)] {
        let meta = std::fs::metadata(one.join("etc/trellis").join(f)).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, mode, "{f}");
    }
    let all = out.path().join("all");
    let text = ok(args(&["compile", "lab/basic", "--all", "--out", all.to_str().unwrap(), "--json"]));
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["written"].as_array().unwrap().len(), 12);
    for n in ["api-1", "db-1", "op-1"] {
        assert!(all.join(n).join("etc/trellis/nftables.conf").is_file(), "{n}");
    }
    let (o, d) = run(args(&["compile", "lab/basic", "--node", "ghost", "--out", out.join("x").to_str().unwrap()]));
    assert_eq!(o.status.code(), Some(1), "{d}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("node `ghost` is not declared"), "{d}");
}

#[test]
fn explain_says_why_and_what_passes() {
    let text = ok(args(&["explain", "lab/basic", "op-1", "db-1"]));
    assert!(text.starts_with("path op-1 <-> db-1: direct\n"), "{text}");
    assert!(text.contains("tcp 22: module ssh rule 1"), "{text}");
    let json = ok(args(&["explain", "lab/basic", "api-1", "db-1", "--json"]));
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(v["path"], "direct");
    let modules: Vec<&str> = v["forward"].as_array().unwrap().iter().map(|m| m["module"].as_str().unwrap()).collect();
    assert_eq!(modules, ["ping", "postgres"]);
}

/// `explain DIR expose:NAME` names the ingress nodes, the backends and the admitting rule; an
/// unknown exposure, or a second argument, is one sentence and exit 1.
#[test]
fn explain_an_exposure_names_its_edges_backends_and_rule() {
    let text = ok(args(&["explain", "lab/expose", "expose:shop"]));
    assert!(text.contains("ingress nodes (each runs Traefik): edge-1"), "{text}");
    assert!(text.contains("backends: the runners of module web that hold a key: web-1, web-2"), "{text}");
    assert!(text.contains("admitted by module web rule 1 (lab/expose/modules/web.toml:6:1): tcp 8080 from expose:shop"), "{text}");
    let (o, d) = run(args(&["explain", "lab/expose", "expose:shopp"]));
    assert_eq!(o.status.code(), Some(1), "{d}");
    assert!(String::from_utf8_lossy(&o.stderr).contains("no exposure `shopp` is declared in lab/expose (declared: shop)"), "{d}");
    let (o, d) = run(args(&["explain", "lab/expose", "expose:shop", "edge-1"]));
    assert_eq!(o.status.code(), Some(1), "{d}");
}

#[test]
fn completions_and_man_pages_are_made_from_the_command_line() {
    let dir = TempDir::new("assets");
    ok(args(&["assets", dir.path().to_str().unwrap()]));
    let bash = std::fs::read_to_string(dir.path().join("completions/trellis.bash")).unwrap();
    assert!(bash.contains("--metrics-listen") && bash.contains("graph"), "{bash}");
    for f in ["completions/_trellis", "completions/trellis.fish", "man/trellis.1", "man/trellis-token-create.1"] {
        assert!(dir.path().join(f).is_file(), "{f} was not written");
    }
    let man = std::fs::read_to_string(dir.path().join("man/trellis-serve.1")).unwrap();
    assert!(man.starts_with(".ie") || man.contains(".TH"), "a roff page: {man}");
    assert!(man.contains("metrics"), "{man}");
    assert!(!dir.path().join("man/trellis-assets.1").exists(), "the hidden command has no page");
}

#[test]
fn graph_draws_the_declaration_as_svg_and_dot() {
    let svg = ok(args(&["graph", "lab/cgnat"]));
    assert!(svg.starts_with("<svg") && svg.contains("a-1 and b-1 through hub hub-1"), "{svg}");
    let dot = ok(args(&["graph", "lab/cgnat", "--format", "dot"]));
    assert!(dot.contains("\"a-1\" -- \"b-1\" [style=dashed label=\"via hub-1\"];"), "{dot}");
}
