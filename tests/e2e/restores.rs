//! A controller restored from a backup (issue 21, item 1), end to end: the real `trellis serve`
//! on SQLite, stopped, its database (or its whole state directory) put back as a backup taken
//! before three changes, and started again; a real agent that held the newer bundles gets the
//! next change. Before, the next change was numbered below what the agent held, and it refused
//! every later bundle as a rollback, silently.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use trellis_testing::TempDir;

use crate::controller::{copy_dir, enrol, files_only_agent, Controller, Db};
use crate::support::{basic_with_extra_nodes, until_zone_names};

/// On PostgreSQL, the database copied as a template (the controller stopped: no connection to it
/// may be open), or put back from that copy.
fn postgres(sql: &str) {
    let admin = std::env::var("TRELLIS_TEST_POSTGRES_URL").expect("checked by can_run");
    trellis_testing::cmd::ok(trellis_testing::cmd::sh("psql", &[&admin, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql]));
}

/// The backup: the state directory, and on PostgreSQL the database too.
fn back_up(c: &Controller, to: &Path) {
    copy_dir(&c.state, to);
    if let Some(url) = &c.database_url {
        let name = url.rsplit('/').next().unwrap();
        postgres(&format!("CREATE DATABASE {name}_backup TEMPLATE {name}"));
    }
}

/// The restore: the database (on SQLite its files in the state directory), or the whole state
/// directory with it.
fn restore(c: &Controller, from: &Path, whole_state_directory: bool) {
    let database = |name: &std::ffi::OsStr| name.to_string_lossy().starts_with("trellis.db");
    if whole_state_directory {
        std::fs::remove_dir_all(&c.state).unwrap();
        copy_dir(from, &c.state);
    } else if c.database_url.is_none() {
        for f in std::fs::read_dir(&c.state).unwrap().flatten().filter(|f| database(&f.file_name())) {
            std::fs::remove_file(f.path()).unwrap();
        }
        for f in std::fs::read_dir(from).unwrap().flatten().filter(|f| database(&f.file_name())) {
            std::fs::copy(f.path(), c.state.join(f.file_name())).unwrap();
        }
    }
    if let Some(url) = &c.database_url {
        let name = url.rsplit('/').next().unwrap();
        postgres(&format!("DROP DATABASE {name}"));
        postgres(&format!("CREATE DATABASE {name} TEMPLATE {name}_backup"));
    }
}

/// Waits up to 30 s for `done`, failing with `what`.
fn until(what: &str, done: &dyn Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "{what} within 30 s");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// lab/basic written to `work`'s `decl` and applied, db-1 and op-1 enrolled: db-1's state
/// directory and root, the declaration's directory and op-1's WireGuard key.
fn db_and_op_enrolled(c: &Controller, work: &Path) -> (PathBuf, PathBuf, PathBuf, String) {
    let (state, root, decl) = (work.join("db-1"), work.join("root"), work.join("decl"));
    basic_with_extra_nodes(&decl, 0);
    c.ok(&["apply", decl.to_str().unwrap()]);
    trellis_testing::cmd::ok(enrol(&c.token("db-1", &[]), &state));
    trellis_testing::cmd::ok(enrol(&c.token("op-1", &[]), &work.join("op-1")));
    let nodes = c.nodes();
    let op = nodes.as_array().unwrap().iter().find(|n| n["name"] == "op-1").unwrap();
    (state, root, decl, op["wireguard_public_key"].as_str().unwrap().to_string())
}

fn restored_from_before_three_changes(db: Db, whole_state_directory: bool) {
    if matches!(db, Db::Postgres) && !trellis_testing::can_run(trellis_testing::Need::Postgres) {
        return;
    }
    let mut c = Controller::start(db);
    let work = TempDir::new("restore");
    let (state, root, decl) = (work.path().join("db-1"), work.path().join("root"), work.path().join("decl"));
    basic_with_extra_nodes(&decl, 0);
    c.ok(&["apply", decl.to_str().unwrap()]);
    trellis_testing::cmd::ok(enrol(&c.token("db-1", &[]), &state));
    let _agent = files_only_agent(&state, &root);
    until_zone_names(&root, "db-1").unwrap();

    // The backup, taken with the controller stopped (as a VM snapshot or a copy of its files).
    c.stop_serving();
    let backup = work.path().join("backup");
    back_up(&c, &backup);
    c.serve(c.port);
    for k in 1..=3 {
        basic_with_extra_nodes(&decl, k);
        c.ok(&["apply", decl.to_str().unwrap()]);
        until_zone_names(&root, &format!("extra-{k}")).unwrap();
    }

    // The restore.
    c.stop_serving();
    restore(&c, &backup, whole_state_directory);
    if whole_state_directory {
        // The state directory agrees with itself: it starts as it is, and the agent, holding
        // versions it never numbered, catches it up (ADR 0024).
        c.serve(c.port);
    } else {
        // The database alone is behind the controller's signed checkpoint: refused, saying what
        // to do; then started once with --restored.
        let refused = trellis_testing::cmd::fails_with(c.serve_cmd(c.port, &[]), "the database's audit chain ends at record");
        assert!(refused.contains("restored from an older backup") && refused.contains("trellis serve --restored"), "{refused}");
        c.serve_with(c.port, &["--restored"]);
        let audit = c.ok(&["audit", "list", "--json"]);
        assert!(audit.contains("restored from backup") && audit.contains("every bundle version moved past 1024"), "{audit}");
        // The chain is anchored again: it verifies against the new checkpoint.
        c.ok(&["audit", "verify"]);
        // Started again, it is no longer behind.
        c.stop_serving();
        c.serve(c.port);
    }
    // The next change, numbered from the backup's versions: below what the agent holds.
    basic_with_extra_nodes(&decl, 4);
    c.ok(&["apply", decl.to_str().unwrap()]);
    let took = until_zone_names(&root, "extra-4").unwrap_or_else(|e| panic!("{e}\nthe controller said:\n{}", c.log(c.port)));
    eprintln!(
        "restored ({}, {db:?}): the next change reached the agent in {} ms",
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
    // The agent said which release it is and the protocol it speaks (issue 21, item 3).
    let nodes = c.nodes();
    let db1 = nodes.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone();
    assert_eq!((db1["agent_release"].as_str(), db1["agent_protocol"].as_str()), (Some(env!("CARGO_PKG_VERSION")), Some("1.0")), "{db1}");
    let listed = c.ok(&["nodes"]);
    let line = listed.lines().find(|l| l.starts_with("db-1 ")).unwrap_or_default();
    assert!(line.ends_with(&format!("{} (1.0)", env!("CARGO_PKG_VERSION"))), "{listed}");
}

#[test]
fn a_restored_database_is_refused_until_told_then_reaches_an_agent_that_held_newer_bundles() {
    restored_from_before_three_changes(Db::Sqlite, false);
    restored_from_before_three_changes(Db::Postgres, false);
}

#[test]
fn a_restored_state_directory_reaches_an_agent_that_held_newer_bundles() {
    restored_from_before_three_changes(Db::Sqlite, true);
    restored_from_before_three_changes(Db::Postgres, true);
}

/// The review of 2026-12-02, finding 2: a database restored from a backup taken before a node
/// was revoked held it `active` again, and its key went back into its peers' bundles (a token
/// revoked after the backup could be redeemed again). The state directory's ledger makes both
/// revocations again when the controller starts on the restored database: op-1 stays revoked,
/// its key stays out of db-1's files through the next change, and the token stays revoked.
#[test]
fn a_revocation_made_after_the_backup_survives_its_restore() {
    for db in [Db::Sqlite, Db::Postgres] {
        if matches!(db, Db::Postgres) && !trellis_testing::can_run(trellis_testing::Need::Postgres) {
            continue;
        }
        let mut c = Controller::start(db);
        let work = TempDir::new("restore-revoked");
        let (state, root, decl, op_key) = db_and_op_enrolled(&c, work.path());
        let spare = c.token("api-1", &[]);
        let tokens: serde_json::Value = serde_json::from_str(&c.ok(&["token", "list", "--json"])).unwrap();
        let spare_id = tokens.as_array().unwrap().iter().find(|t| t["node"] == "api-1").unwrap()["id"].as_str().unwrap().to_string();
        let _agent = files_only_agent(&state, &root);
        let conf = root.join("etc/trellis/wireguard.conf");
        let holds_op = || std::fs::read_to_string(&conf).unwrap_or_default().contains(&op_key);
        let until = |what: &str, done: &dyn Fn() -> bool| until(&format!("{what} ({db:?})"), done);
        until("db-1 holds op-1's key", &holds_op);

        c.stop_serving();
        let backup = work.path().join("backup");
        back_up(&c, &backup);
        c.serve(c.port);
        c.ok(&["node", "revoke", "op-1"]);
        c.ok(&["token", "revoke", &spare_id]);
        until("db-1 drops op-1's key", &|| !holds_op());

        c.stop_serving();
        restore(&c, &backup, false);
        c.serve_with(c.port, &["--restored"]);
        let log = c.log(c.port);
        assert!(log.contains("audit record(s) decided after the backup are lost") && log.contains("revocations.ledger"), "{log}");
        let state_now = c.node_state("op-1");
        assert!(state_now == "revoked" || state_now == "revoking", "op-1 is {state_now} after the restore ({db:?})");
        let audit = c.ok(&["audit", "list", "--json"]);
        assert!(audit.contains("re-applied from") && audit.contains("revoked on "), "{audit}");
        let tokens: serde_json::Value = serde_json::from_str(&c.ok(&["token", "list", "--json"])).unwrap();
        let t = tokens.as_array().unwrap().iter().find(|t| t["id"] == spare_id.as_str()).unwrap().clone();
        assert_eq!(t["state"], "revoked", "{t}");
        let redeem = enrol(&spare, &work.path().join("api-1")).output().unwrap();
        assert!(!redeem.status.success(), "the revoked token was redeemed after the restore");
        // The next change reaches db-1 without op-1's key.
        basic_with_extra_nodes(&decl, 1);
        c.ok(&["apply", decl.to_str().unwrap()]);
        until_zone_names(&root, "extra-1").unwrap_or_else(|e| panic!("{e}\n{}", c.log(c.port)));
        assert!(!holds_op(), "op-1's key is back in db-1's wireguard.conf after the restore ({db:?})");
    }
}

/// The review of 2026-12-02, finding 2, for a whole state directory restored from a snapshot:
/// the ledger rolls back with the database, so the controller forgets that op-1 was revoked
/// and puts its key back into db-1's bundle. db-1's agent refuses that bundle: it counts fewer
/// node revocations than the one db-1 applied. op-1's key stays out of db-1's files until the
/// operator revokes op-1 again, and then db-1 takes the controller's bundles again.
#[test]
fn a_node_refuses_a_snapshot_s_bundle_that_forgot_a_revocation() {
    let mut c = Controller::start(Db::Sqlite);
    let work = TempDir::new("restore-snapshot-revoked");
    let (state, root, decl, op_key) = db_and_op_enrolled(&c, work.path());
    let _agent = files_only_agent(&state, &root);
    let conf = root.join("etc/trellis/wireguard.conf");
    let holds_op = || std::fs::read_to_string(&conf).unwrap_or_default().contains(&op_key);
    until("db-1 holds op-1's key", &holds_op);

    c.stop_serving();
    let snapshot = work.path().join("snapshot");
    back_up(&c, &snapshot);
    c.serve(c.port);
    c.ok(&["node", "revoke", "op-1"]);
    until("db-1 drops op-1's key", &|| !holds_op());
    let trust = root.join("etc/trellis/trust.toml");
    until("db-1 counts one revocation", &|| std::fs::read_to_string(&trust).unwrap_or_default().contains("revocations = 1"));

    // The whole state directory put back: it agrees with itself, so it starts, with op-1 active.
    c.stop_serving();
    restore(&c, &snapshot, true);
    c.serve(c.port);
    assert_eq!(c.node_state("op-1"), "active", "the snapshot is from before the revocation");
    // A change, so that db-1 is sent a new bundle: it names op-1 again, and counts none.
    basic_with_extra_nodes(&decl, 1);
    c.ok(&["apply", decl.to_str().unwrap()]);
    let status = || -> serde_json::Value {
        let mut a = crate::controller::agent_bin();
        a.args(["status", "--state-dir", state.to_str().unwrap(), "--json"]);
        serde_json::from_str(&trellis_testing::cmd::ok(a)).unwrap()
    };
    until("db-1 refuses the snapshot's bundle", &|| {
        status()["last_error"].as_str().is_some_and(|e| e.contains("counts 0 node revocation(s), fewer than the 1"))
    });
    std::thread::sleep(Duration::from_secs(1));
    assert!(!holds_op(), "op-1's key is back in db-1's wireguard.conf after the snapshot was restored");
    let zone = std::fs::read_to_string(root.join("etc/trellis/mesh.zone")).unwrap();
    assert!(!zone.contains("extra-1"), "db-1 applied the snapshot's bundle:\n{zone}");

    // The operator makes the revocation again: the count is whole, and db-1 takes the bundle
    // once it has waited out the poll it refused (55 s at most: a refusal never makes it spin).
    c.ok(&["node", "revoke", "op-1"]);
    let taken = until_zone_names(&root, "extra-1").or_else(|_| until_zone_names(&root, "extra-1"));
    taken.unwrap_or_else(|e| panic!("{e}\n{}", c.log(c.port)));
    assert!(!holds_op(), "op-1's key in db-1's wireguard.conf");
}

/// Found from outside (issue 33): after a controller lost what it had acknowledged of a node's
/// evidence (a whole state directory restored from a snapshot), the node showed `stale` with its
/// old applied version until its next bundle change, for as long as watched. Its agent tells the
/// controller again what it applied last after every outage: here the evidence is taken out of
/// the database while the controller is stopped, and once it is back the node is current again
/// without any change.
#[test]
fn a_controller_that_lost_a_nodes_evidence_hears_it_again_after_an_outage() {
    for db in [Db::Sqlite, Db::Postgres] {
        if matches!(db, Db::Postgres) && !trellis_testing::can_run(trellis_testing::Need::Postgres) {
            continue;
        }
        if matches!(db, Db::Sqlite) && !trellis_testing::can_run(trellis_testing::Need::Program("sqlite3")) {
            continue;
        }
        let mut c = Controller::start(db);
        let work = TempDir::new("restore-evidence");
        let (state, root, decl) = (work.path().join("db-1"), work.path().join("root"), work.path().join("decl"));
        basic_with_extra_nodes(&decl, 0);
        c.ok(&["apply", decl.to_str().unwrap()]);
        trellis_testing::cmd::ok(enrol(&c.token("db-1", &[]), &state));
        let _agent = files_only_agent(&state, &root);
        let db1 = |c: &Controller| {
            let status: serde_json::Value = serde_json::from_str(&c.ok(&["status", "--json"])).unwrap();
            status.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone()
        };
        let until_current = |c: &Controller, what: &str| {
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let n = db1(c);
                if n["stale"] == false && n["applied_version"].is_i64() && n["applied_version"] == n["desired_version"] {
                    return;
                }
                assert!(Instant::now() < deadline, "{what} ({db:?}): {n}");
                std::thread::sleep(Duration::from_millis(200));
            }
        };
        until_current(&c, "db-1 current before");
        c.stop_serving();
        let sql = "DELETE FROM evidence WHERE node = 'db-1'";
        match &c.database_url {
            Some(url) => trellis_testing::cmd::ok(trellis_testing::cmd::sh("psql", &[url, "-v", "ON_ERROR_STOP=1", "-q", "-c", sql])),
            None => trellis_testing::cmd::ok(trellis_testing::cmd::sh("sqlite3", &[c.state.join("trellis.db").to_str().unwrap(), sql])),
        };
        c.serve(c.port);
        let lost = db1(&c);
        assert!(lost["applied_version"].is_null(), "the evidence was taken out ({db:?}): {lost}");
        until_current(&c, "db-1 current again after the controller lost its evidence");
    }
}
