//! What nodes trust beyond the CA, changed without enrolling again (issue 21): the controller
//! list delivered in signed bundles (ADR 0028), and the rotation of the bundle-signing key,
//! announced in bundles signed by the key before it (ADR 0027).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine;
use trellis_testing::cmd::{fails_with, ok, Proc};
use trellis_testing::{can_run, Need, TempDir};

use crate::controller::{agent_bin, enrol, free_port, Controller, Db};
use crate::support::{basic_with_extra_nodes, until_zone_names};

/// On SQLite, then on PostgreSQL unless the test skips it (`can_run`).
fn both(f: impl Fn(Db)) {
    f(Db::Sqlite);
    if can_run(Need::Postgres) {
        f(Db::Postgres);
    }
}

fn run_agent(state: &Path, root: &Path) -> Proc {
    Proc(
        agent_bin()
            .args(["run", "--files-only", "--max-backoff", "1", "--state-dir", state.to_str().unwrap(), "--root", root.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    )
}

/// The agent's identity file, read until `done` holds (at most 30 s).
fn until_identity(state: &Path, what: &str, done: impl Fn(&str) -> bool) -> (String, Duration) {
    let started = Instant::now();
    loop {
        let text = std::fs::read_to_string(state.join("identity.toml")).unwrap_or_default();
        if done(&text) {
            return (text, started.elapsed());
        }
        assert!(started.elapsed() < Duration::from_secs(30), "after 30 s the identity does not {what}:\n{text}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A controller added with `trellis controllers add` reaches every node in its next bundle: the
/// agent, enrolled with a token that named only the first controller, keeps working through the
/// second once the first is gone, and no node enrols again; a removed one is dropped from the
/// list. Before, the list was fixed in the token at enrolment.
#[test]
fn a_controller_added_is_used_once_the_first_is_gone_and_no_node_enrols_again() {
    both(|db| {
        let mut c = Controller::start(db);
        let work = TempDir::new("controllers");
        let (state, root, decl) = (work.path().join("db-1"), work.path().join("root"), work.path().join("decl"));
        basic_with_extra_nodes(&decl, 0);
        c.ok(&["apply", decl.to_str().unwrap()]);
        ok(enrol(&c.token("db-1", &[]), &state));
        let _agent = run_agent(&state, &root);
        until_zone_names(&root, "db-1").unwrap();
        let (first, second) = (format!("127.0.0.1:{}", c.port), format!("127.0.0.1:{}", free_port()));

        // Refusals, each one sentence, nothing changed.
        fails_with(c.admin(&["controllers", "add", "no-port"]), "`no-port` is not HOST:PORT");
        fails_with(c.admin(&["controllers", "add", "c2.example.com:8443"]), "the server certificate names 127.0.0.1, not c2.example.com");
        fails_with(c.admin(&["controllers", "add", &first]), "is listed already");
        fails_with(c.admin(&["controllers", "remove", &first]), "is the only controller listed");

        let out = c.ok(&["controllers", "add", &second]);
        assert!(out.contains(&format!("added {second}")) && out.contains(&format!(" 2. {second}")), "{out}");
        let list: serde_json::Value = serde_json::from_str(&c.ok(&["controllers", "list", "--json"])).unwrap();
        assert_eq!(list["controllers"], serde_json::json!([first, second]), "{list}");
        let (_, took) = until_identity(&state, "list the second controller", |t| t.contains(&second));
        eprintln!("{db:?}: the added controller reached the agent's identity in {} ms", took.as_millis());
        let trust = std::fs::read_to_string(root.join("etc/trellis/trust.toml")).unwrap();
        assert!(trust.contains(&format!("controllers = [\"{first}\", \"{second}\"]")), "{trust}");

        // The first controller goes; the second serves the same state and database.
        c.stop_serving();
        let port: u16 = second.rsplit_once(':').unwrap().1.parse().unwrap();
        c.serve(port);
        let second_admin = |args: &[&str]| {
            let mut cmd = crate::support::trellis_cmd(args);
            cmd.args(["--server", &second, "--admin-token-file"])
                .arg(c.state.join("admin.token"))
                .arg("--ca-file")
                .arg(c.state.join("ca.pem"));
            cmd
        };
        basic_with_extra_nodes(&decl, 1);
        ok(second_admin(&["apply", decl.to_str().unwrap()]));
        let took = until_zone_names(&root, "extra-1").unwrap();
        eprintln!("{db:?}: a change through the second controller reached the agent in {} ms", took.as_millis());
        // Removing the first leaves the second alone in every node's list.
        ok(second_admin(&["controllers", "remove", &first]));
        let (text, _) = until_identity(&state, "drop the first controller", |t| !t.contains(&first));
        assert!(text.contains(&format!("controllers = [\"{second}\"]")), "{text}");
        // One enrolment, ever: the audit chain holds one, and both list changes.
        let audit = ok(second_admin(&["audit", "list", "--json"]));
        let records: serde_json::Value = serde_json::from_str(&audit).unwrap();
        let actions: Vec<&str> = records.as_array().unwrap().iter().map(|r| r["action"].as_str().unwrap()).collect();
        assert_eq!(actions.iter().filter(|a| **a == "node enrolled").count(), 1, "{actions:?}");
        assert!(actions.contains(&"controller added") && actions.contains(&"controller removed"), "{actions:?}");
    });
}

/// The signing key in the state directory (`signing.key`, `signing.retired.key`).
fn signing_key(state: &Path, file: &str) -> ed25519_dalek::SigningKey {
    let text = std::fs::read_to_string(state.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
    let seed: [u8; 32] = base64::engine::general_purpose::STANDARD.decode(text.trim()).unwrap().try_into().unwrap();
    ed25519_dalek::SigningKey::from_bytes(&seed)
}

/// The bundle an agent applied last, as an attacker holding `key` would make it again, signed,
/// with a version above every one the agent holds.
fn forged(node_state: &Path, key: &ed25519_dalek::SigningKey, out: &Path) {
    let bytes = std::fs::read(node_state.join("bundle.last")).unwrap();
    let id = std::fs::read_to_string(node_state.join("identity.toml")).unwrap();
    let current = id.lines().find_map(|l| l.strip_prefix("signing_public_key = \"")).unwrap().trim_end_matches('"');
    let current: [u8; 32] = base64::engine::general_purpose::STANDARD.decode(current).unwrap().try_into().unwrap();
    let current = ed25519_dalek::VerifyingKey::from_bytes(&current).unwrap();
    let mut bundle = trellis_core::bundle::verify(&bytes, &current, "basic", "db-1", None).unwrap().bundle;
    bundle.version += 100;
    std::fs::write(out, bundle.sign(key).to_vec()).unwrap();
}

/// `trellis rotate signing-key` (ADR 0027): the next key is announced in bundles signed by the
/// current one; once every active node applied one (evidence), bundles are signed with the new
/// key only, every agent takes it without enrolling again, and a bundle signed with the retired
/// key is refused by the agent, however new its version: the attack of a leaked old key,
/// performed. Before, the key made by `init` could not change.
#[test]
fn a_rotated_signing_key_is_taken_by_every_agent_and_the_retired_key_is_refused() {
    both(|db| {
        let c = Controller::start(db);
        let work = TempDir::new("rotate");
        let decl = work.path().join("decl");
        basic_with_extra_nodes(&decl, 0);
        c.ok(&["apply", decl.to_str().unwrap()]);
        let nodes = ["db-1", "api-1", "op-1"];
        let mut agents = Vec::new();
        for n in nodes {
            let (state, root) = (work.path().join(n), work.path().join(format!("{n}-root")));
            ok(enrol(&c.token(n, &[]), &state));
            agents.push(run_agent(&state, &root));
            until_zone_names(&root, n).unwrap();
        }
        let db1 = work.path().join("db-1");
        let old = signing_key(&c.state, "signing.key");
        // The attack, before: a bundle signed with the current key is taken (the forgery is a
        // valid bundle, so its refusal after the rotation is the key's, nothing else).
        let forgery = work.path().join("forged.bundle");
        forged(&db1, &old, &forgery);
        let verify = |file: &Path| {
            let mut a = agent_bin();
            a.args(["verify", file.to_str().unwrap(), "--state-dir", db1.to_str().unwrap()]);
            a
        };
        ok(verify(&forgery));

        let started = Instant::now();
        let out = c.ok(&["rotate", "signing-key", "--overlap", "1h"]);
        assert!(out.contains("announcing the next signing key"), "{out}");
        let next_public =
            base64::engine::general_purpose::STANDARD.encode(signing_key(&c.state, "signing.next.key").verifying_key().to_bytes());
        fails_with(c.admin(&["rotate", "signing-key"]), "is in progress");
        // Every agent takes the new key (announced, then signing), in its identity.
        let mut took = Vec::new();
        for n in nodes {
            let (_, t) = until_identity(&work.path().join(n), "hold the new key alone", |t| {
                t.contains(&format!("signing_public_key = \"{next_public}\"")) && !t.contains("next_signing_public_key")
            });
            took.push(t);
        }
        let whole = started.elapsed();
        let status: serde_json::Value = serde_json::from_str(&c.ok(&["rotate", "status", "--json"])).unwrap();
        let r = &status[0];
        assert_eq!(
            (r["kind"].as_str(), r["next_key"].as_str(), r["completed_by"].as_str()),
            (Some("signing-key"), Some(next_public.as_str()), Some("evidence")),
            "{status}"
        );
        let mut confirmed: Vec<&str> = r["confirmed"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
        confirmed.sort();
        assert_eq!(confirmed, ["api-1", "db-1", "op-1"], "{status}");
        eprintln!(
            "{db:?}: rotation with 3 agents online: every agent held only the new key {} ms after `trellis rotate signing-key`",
            whole.as_millis()
        );
        let text = c.ok(&["rotate", "status"]);
        assert!(text.contains("every active node confirmed") && text.contains("confirmed (3): "), "{text}");
        // The state directory keeps the new key as signing.key, the old one retired, 0600.
        assert_eq!(
            signing_key(&c.state, "signing.key").verifying_key().to_bytes(),
            base64::engine::general_purpose::STANDARD.decode(&next_public).unwrap()[..]
        );
        assert_eq!(signing_key(&c.state, "signing.retired.key").to_bytes(), old.to_bytes());
        use std::os::unix::fs::PermissionsExt;
        for f in ["signing.key", "signing.retired.key"] {
            assert_eq!(std::fs::metadata(c.state.join(f)).unwrap().permissions().mode() & 0o777, 0o600, "{f}");
        }

        // The attack, after: the retired key's bundle is refused, by `verify` and by `apply`,
        // before anything is written.
        forged(&db1, &old, &forgery);
        fails_with(verify(&forgery), "bundle signature does not verify with the controller's key");
        drop(agents);
        let mut apply = agent_bin();
        apply
            .args(["apply", forgery.to_str().unwrap(), "--files-only", "--state-dir", db1.to_str().unwrap(), "--root"])
            .arg(work.path().join("db-1-root"));
        fails_with(apply, "bundle signature does not verify with the controller's key");
        // The controller goes on, signing with the new key: a change still reaches the agent.
        let _agent = run_agent(&db1, &work.path().join("db-1-root"));
        basic_with_extra_nodes(&decl, 1);
        c.ok(&["apply", decl.to_str().unwrap()]);
        until_zone_names(&work.path().join("db-1-root"), "extra-1").unwrap();
        let audit = c.ok(&["audit", "verify"]);
        assert!(audit.contains("audit chain verified"), "{audit}");
        let list = c.ok(&["audit", "list", "--json"]);
        assert!(list.contains("signing key rotation started") && list.contains("signing key rotation completed"), "{list}");
        eprintln!("{db:?}: per agent {:?}", took.iter().map(|t| t.as_millis()).collect::<Vec<_>>());
    });
}

/// A node that is away is waited for until the overlap passes, no longer: the rotation then
/// completes by the overlap, `trellis rotate status` names the node it did not hear from, and the
/// agents online take the new key. The node that was away, back, refuses the new key's bundles
/// (it was never told of it), as the ADR says: it enrols again.
#[test]
fn a_node_away_is_waited_for_until_the_overlap_passes() {
    both(|db| {
        let c = Controller::start(db);
        let work = TempDir::new("overlap");
        let decl = work.path().join("decl");
        basic_with_extra_nodes(&decl, 0);
        c.ok(&["apply", decl.to_str().unwrap()]);
        let mut agents = Vec::new();
        for n in ["db-1", "op-1"] {
            let (state, root) = (work.path().join(n), work.path().join(format!("{n}-root")));
            ok(enrol(&c.token(n, &[]), &state));
            agents.push(run_agent(&state, &root));
            until_zone_names(&root, n).unwrap();
        }
        // op-1 goes away before the rotation.
        agents.pop();
        let started = Instant::now();
        c.ok(&["rotate", "signing-key", "--overlap", "3s"]);
        // Right after the start db-1 may not have confirmed yet; op-1 cannot have.
        let text = c.ok(&["rotate", "status"]);
        let waiting = text.lines().find(|l| l.trim_start().starts_with("waiting for")).unwrap_or_default();
        assert!(text.contains("in progress") && waiting.contains("op-1"), "{text}");
        let next_public =
            base64::engine::general_purpose::STANDARD.encode(signing_key(&c.state, "signing.next.key").verifying_key().to_bytes());
        // db-1 holds the next key as announced, and waits with it.
        until_identity(&work.path().join("db-1"), "hold the announced key", |t| {
            t.contains(&format!("next_signing_public_key = \"{next_public}\""))
        });
        let (_, took) = until_identity(&work.path().join("db-1"), "hold the new key alone", |t| {
            t.contains(&format!("signing_public_key = \"{next_public}\"")) && !t.contains("next_signing_public_key")
        });
        assert!(started.elapsed() >= Duration::from_secs(3), "completed after {:?}, before the overlap passed", took);
        let status: serde_json::Value = serde_json::from_str(&c.ok(&["rotate", "status", "--json"])).unwrap();
        assert_eq!(status[0]["completed_by"], "overlap", "{status}");
        assert_eq!(status[0]["waiting"], serde_json::json!(["op-1"]), "{status}");
        let audit = c.ok(&["audit", "list", "--json"]);
        assert!(audit.contains("the overlap passed with 1 node(s) not confirmed: op-1"), "{audit}");
        // op-1 back: the new key's bundles are refused, before anything is written.
        let op1 = work.path().join("op-1");
        let _back = run_agent(&op1, &work.path().join("op-1-root"));
        let started = Instant::now();
        loop {
            let status = std::fs::read_to_string(op1.join("agent-status.json")).unwrap_or_default();
            if status.contains("refused a bundle: bundle signature does not verify with the controller's key") {
                break;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "op-1 did not refuse the new key's bundle:\n{status}");
            std::thread::sleep(Duration::from_millis(50));
        }
    });
}
