//! A controller restored from a backup (issue 21, item 1), end to end: the real `trellis serve`
//! on SQLite, stopped, its database (or its whole state directory) put back as a backup taken
//! before three changes, and started again; a real agent that held the newer bundles gets the
//! next change. Before, the next change was numbered below what the agent held, and it refused
//! every later bundle as a rollback, silently.

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use trellis_testing::cmd::Proc;
use trellis_testing::TempDir;

use crate::controller::{agent_bin, copy_dir, enrol, Controller, Db};

/// The declaration `lab/basic` with `extra` more nodes that db-1 may reach.
fn declaration(dir: &Path, extra: u32) {
    copy_dir(&trellis_testing::repo().join("lab/basic"), dir);
    let mut mesh = std::fs::read_to_string(trellis_testing::repo().join("lab/basic/mesh.toml")).unwrap();
    for k in 1..=extra {
        mesh.push_str(&format!("\n[[node]]\nname = \"extra-{k}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n"));
    }
    std::fs::write(dir.join("mesh.toml"), mesh).unwrap();
}

/// Waits (at most 30 s) until db-1's zone, as the agent wrote it, names `name`.
fn until_written(root: &Path, name: &str) -> Result<Duration, String> {
    let started = Instant::now();
    let zone = root.join("etc/trellis/mesh.zone");
    while started.elapsed() < Duration::from_secs(30) {
        if std::fs::read_to_string(&zone).is_ok_and(|z| z.contains(&format!("\n{name}\t"))) {
            return Ok(started.elapsed());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    Err(format!("after 30 s db-1's zone does not name {name}:\n{}", std::fs::read_to_string(&zone).unwrap_or_default()))
}

fn restored_from_before_three_changes(whole_state_directory: bool) {
    let mut c = Controller::start(Db::Sqlite);
    let work = TempDir::new("restore");
    let (state, root, decl) = (work.path().join("db-1"), work.path().join("root"), work.path().join("decl"));
    declaration(&decl, 0);
    c.ok(&["apply", decl.to_str().unwrap()]);
    trellis_testing::cmd::ok(enrol(&c.token("db-1", &[]), &state));
    let _agent = Proc(
        agent_bin()
            .args(["run", "--files-only", "--max-backoff", "1", "--state-dir", state.to_str().unwrap(), "--root", root.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    until_written(&root, "db-1").unwrap();

    // The backup, taken with the controller stopped (as a VM snapshot or a copy of its files).
    c.stop_serving();
    let backup = work.path().join("backup");
    copy_dir(&c.state, &backup);
    c.serve(c.port);
    for k in 1..=3 {
        declaration(&decl, k);
        c.ok(&["apply", decl.to_str().unwrap()]);
        until_written(&root, &format!("extra-{k}")).unwrap();
    }

    // The restore.
    c.stop_serving();
    if whole_state_directory {
        std::fs::remove_dir_all(&c.state).unwrap();
        copy_dir(&backup, &c.state);
    } else {
        for f in std::fs::read_dir(&c.state).unwrap().flatten() {
            if f.file_name().to_string_lossy().starts_with("trellis.db") {
                std::fs::remove_file(f.path()).unwrap();
            }
        }
        for f in std::fs::read_dir(&backup).unwrap().flatten() {
            if f.file_name().to_string_lossy().starts_with("trellis.db") {
                std::fs::copy(f.path(), c.state.join(f.file_name())).unwrap();
            }
        }
    }
    c.serve(c.port);
    // The next change, numbered from the backup's versions: below what the agent holds.
    declaration(&decl, 4);
    c.ok(&["apply", decl.to_str().unwrap()]);
    let took = until_written(&root, "extra-4").unwrap_or_else(|e| panic!("{e}\nthe controller said:\n{}", c.log(c.port)));
    eprintln!(
        "restored ({}): the next change reached the agent in {} ms",
        if whole_state_directory { "state directory" } else { "database" },
        took.as_millis()
    );
    // What the agent holds is what the controller has: it is shown current once it says it
    // applied it (its files are written before its manifest and its evidence).
    let started = Instant::now();
    loop {
        // The controller first, then the agent: an applied version the controller shows is one
        // the agent's manifest holds already.
        let status: serde_json::Value = serde_json::from_str(&c.ok(&["status", "--json"])).unwrap();
        let held: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(state.join("manifest.json")).unwrap()).unwrap();
        let db1 = status.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone();
        if db1["desired_version"] == held["version"] && db1["applied_version"] == held["version"] {
            assert_eq!(db1["stale"], false, "{db1}");
            break;
        }
        // Until then it is never shown current.
        assert_eq!(db1["stale"], true, "{db1}\nholds {held}");
        assert!(started.elapsed() < Duration::from_secs(30), "db-1 never shown current: {db1}\nholds {held}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_restored_database_reaches_an_agent_that_held_newer_bundles() {
    restored_from_before_three_changes(false);
}

#[test]
fn a_restored_state_directory_reaches_an_agent_that_held_newer_bundles() {
    restored_from_before_three_changes(true);
}
