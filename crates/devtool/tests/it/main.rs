//! `trellis-dev` as a developer runs it: the figures it prints.

use std::process::Command;

#[test]
fn bench_compile_prints_its_figures() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_trellis-dev"));
    cmd.args(["bench", "compile", "--nodes", "300", "--groups", "20", "--modules", "6", "--hubs", "3", "--runs", "1", "--json"]);
    let out = cmd.output().unwrap_or_else(|e| panic!("cannot run {cmd:?}: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "command: {cmd:?}\nstatus: {}\n--- stdout ---\n{text}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["nodes"], 300);
    let changes = &v["changes"];
    assert_eq!(changes["no_change"]["rendered"], 0, "an unchanged mesh renders nothing: {text}");
    for change in ["rekey_one_node", "enrol_one_node", "regroup_one_node"] {
        let rendered = changes[change]["rendered"].as_u64().unwrap();
        assert!((1..300).contains(&rendered), "{change} re-renders some nodes, not all: {text}");
        assert_eq!(changes[change]["equals_full_compile"], true, "{text}");
    }
}
