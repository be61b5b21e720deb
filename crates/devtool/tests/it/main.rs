//! `trellis-dev` as a developer runs it: the figures it prints.

use std::path::PathBuf;
use std::process::{Command, Output};

use trellis_testing::cmd::describe as shown;
use trellis_testing::TempDir;

/// Runs `trellis-dev ARGS`; a failure shows the command, its status and both outputs.
fn trellis_dev(args: &[&str]) -> (Command, Output) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellis-dev"));
    cmd.args(args);
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    (cmd, out)
}

/// Runs `trellis-dev ARGS`, which must succeed and print JSON.
fn figures(args: &[&str]) -> serde_json::Value {
    let (cmd, out) = trellis_dev(args);
    assert!(out.status.success(), "{}", shown(&cmd, &out));
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e})\n{}", shown(&cmd, &out)))
}

/// A generated mesh of 60 nodes written by `trellis-dev mesh`, removed when dropped.
struct Mesh {
    dir: PathBuf,
    _tmp: TempDir,
}

impl Mesh {
    fn new(name: &str, extra: &[&str]) -> Mesh {
        let tmp = TempDir::new(&format!("dev-it-{name}"));
        let dir = tmp.path().join("mesh");
        let mut args = vec!["mesh", "--nodes", "60", "--groups", "6", "--hubs", "2", "--out", dir.to_str().unwrap()];
        args.extend_from_slice(extra);
        let (cmd, out) = trellis_dev(&args);
        assert!(out.status.success(), "{}", shown(&cmd, &out));
        Mesh { dir, _tmp: tmp }
    }

    fn path(&self) -> &str {
        self.dir.to_str().unwrap()
    }
}

fn number(v: &serde_json::Value, what: &str) -> f64 {
    v.pointer(what).and_then(|x| x.as_f64()).unwrap_or_else(|| panic!("no number at {what}: {v:#}"))
}

#[test]
fn bench_compile_prints_its_figures() {
    let v = figures(&["bench", "compile", "--nodes", "300", "--groups", "20", "--modules", "6", "--hubs", "3", "--runs", "1", "--json"]);
    let text = v.to_string();
    assert_eq!(v["nodes"], 300);
    let changes = &v["changes"];
    assert_eq!(changes["no_change"]["rendered"], 0, "an unchanged mesh renders nothing: {text}");
    for change in ["rekey_one_node", "enrol_one_node", "regroup_one_node"] {
        let rendered = changes[change]["rendered"].as_u64().unwrap();
        assert!((1..300).contains(&rendered), "{change} re-renders some nodes, not all: {text}");
        assert_eq!(changes[change]["equals_full_compile"], true, "{text}");
    }
}

#[test]
fn bench_enrol_on_a_mesh_enrols_every_node_and_every_node_holds_a_bundle() {
    let mesh = Mesh::new("enrol", &[]);
    let v = figures(&["bench", "enrol", "--mesh", mesh.path(), "--concurrency", "8", "--sample", "4", "--json"]);
    assert_eq!(v["nodes"], 60, "{v:#}");
    assert_eq!(v["enrolled"], 60, "every node enrols: {v:#}");
    assert_eq!(v["held"], 60, "every node holds its first bundle: {v:#}");
    assert!(number(&v, "/enrolments_per_second") > 0.0, "{v:#}");
    // Each enrolment's latency lies within the run, from the first request to the last answer.
    assert!(number(&v, "/latency_ms/p50") > 0.0 && number(&v, "/latency_ms/p99") <= number(&v, "/wall_ms"), "{v:#}");
    assert!(number(&v, "/publish_runs") >= 1.0, "the storm is published: {v:#}");
    assert_eq!(v["sample_fetched"], 4, "{v:#}");
    assert!(number(&v, "/sample_bytes") > 0.0, "{v:#}");
}

#[test]
fn bench_enrol_refuses_a_mesh_with_declared_keys() {
    let mesh = Mesh::new("keys", &["--declared-keys"]);
    let (cmd, out) = trellis_dev(&["bench", "enrol", "--mesh", mesh.path()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("keys stripped, every node enrols"), "{}", shown(&cmd, &out));
}

#[test]
fn bench_delivery_on_a_mesh_delivers_every_change_to_the_agents_it_affects() {
    let mesh = Mesh::new("delivery", &[]);
    let v = figures(&["bench", "delivery", "--mesh", mesh.path(), "--agents", "20", "--json"]);
    assert_eq!(v["agents"], 20, "{v:#}");
    assert_eq!(v["enrolled"], 60, "every node of the mesh enrols: {v:#}");
    assert!(number(&v, "/first_bundles/bytes") > 0.0, "{v:#}");
    assert_eq!(v["agent_failures"], serde_json::json!([]), "{v:#}");
    let change = &v["change"];
    assert!(number(change, "/agents_expected") > 0.0, "the change reaches some agents: {v:#}");
    assert_eq!(change["agents_changed"], change["agents_expected"], "exactly the affected agents get a new bundle: {v:#}");
    assert_eq!(change["agents_unexpected"], 0, "{v:#}");
    assert_eq!(change["agents_missing"], 0, "{v:#}");
    assert!(number(change, "/to_bundle_ms/p50") > 0.0, "{v:#}");
    assert!(number(change, "/bytes") > 0.0, "{v:#}");
    for phase in ["declare", "enrol"] {
        let p = &v["add_node"][phase];
        assert_eq!(p["agents_changed"], p["agents_expected"], "{phase}: {v:#}");
        assert_eq!(p["agents_missing"], 0, "{phase}: {v:#}");
    }
    assert!(number(&v, "/add_node/refetched_bytes") > 0.0, "{v:#}");
    assert!(number(&v, "/serve_peak_rss_kib") > 0.0, "{v:#}");
}

#[test]
fn bench_certs_prints_signing_issuance_and_fleet_figures() {
    let v = figures(&["bench", "certs", "--nodes", "20", "--concurrency", "4", "--signatures", "50", "--fleet", "10000", "--json"]);
    assert!(number(&v, "/signing/per_second") > 0.0, "{v:#}");
    assert!(number(&v, "/issuance/per_second") > 0.0, "{v:#}");
    assert!(number(&v, "/issuance/latency_ms/p50") <= number(&v, "/issuance/latency_ms/p99"), "{v:#}");
    // One certificate a node, renewed every 16 h.
    let needed = number(&v, "/fleet/signatures_per_second");
    assert!((needed - 10_000.0 / 57_600.0).abs() < 1e-9, "{v:#}");
}

/// `bench agent` on a small mesh, as root: a real agent in a namespace applies the first bundle
/// and the three-peer change on each backend (wireguard-go, gotatun and boringtun by default), and every figure is there (the phases the agent
/// timed include WireGuard and the ruleset; its resolver answered).
#[test]
fn bench_agent_reports_each_backends_applies_memory_and_dns() {
    if !trellis_testing::can_run(trellis_testing::Need::Root) {
        return;
    }
    let f = figures(&["bench", "agent", "--peers", "20", "--queries", "3", "--changes", "3", "--json"]);
    let backends = f["backends"].as_array().unwrap();
    let names: Vec<&str> = backends.iter().map(|b| b["backend"].as_str().unwrap()).collect();
    assert_eq!(names, ["wireguard-go", "gotatun", "boringtun"], "{f}");
    for b in backends {
        for run in ["first", "change"] {
            assert!(b[run]["apply_ms"].as_u64().is_some(), "{run}: {b}");
            for phase in ["files", "wireguard", "ruleset", "dns"] {
                assert!(b[run]["phases_ms"][phase].as_f64().is_some(), "{run} {phase}: {b}");
            }
        }
        // Three changes timed, each undoing the one before; the median is one of them.
        let runs: Vec<u64> = b["change"]["runs_ms"].as_array().unwrap().iter().map(|r| r.as_u64().unwrap()).collect();
        assert_eq!(runs.len(), 3, "{b}");
        assert!(runs.contains(&b["change"]["apply_ms"].as_u64().unwrap()), "{b}");
        // p-00001 removed and p-00020 added: still 20 peers on the interface.
        assert_eq!((b["first"]["peers_on_interface"].as_u64(), b["change"]["peers_on_interface"].as_u64()), (Some(20), Some(20)), "{b}");
        assert!(b["agent_rss_mib"].as_f64().unwrap() > 1.0, "{b}");
        assert_eq!((b["dns_queries"].as_u64(), b["dns_unanswered"].as_u64()), (Some(3), Some(0)), "{b}");
    }
    assert!(backends[0]["wireguard_go_rss_mib"].as_f64().is_some_and(|m| m > 1.0), "{f}");
}
