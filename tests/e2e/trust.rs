//! What nodes trust beyond the CA, changed without enrolling again (issue 21): the controller
//! list delivered in signed bundles (ADR 0028), and the rotation of the bundle-signing key,
//! announced in bundles signed by the key before it (ADR 0027).

use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use base64::Engine;
use trellis_testing::cmd::{fails_with, ok};
use trellis_testing::{can_run, Need, TempDir};

use crate::controller::{agent_bin, enrol, files_only_agent, free_port, Controller, Db};
use crate::support::{basic_with_extra_nodes, until_zone_names};

/// On SQLite, then on PostgreSQL unless the test skips it (`can_run`).
fn both(f: impl Fn(Db)) {
    f(Db::Sqlite);
    if can_run(Need::Postgres) {
        f(Db::Postgres);
    }
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
        let _agent = files_only_agent(&state, &root);
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

/// The bundle an agent applied last (its signed head and the files under its root, ADR 0033), as
/// an attacker holding `key` would make it again, signed, with a version above every one the
/// agent holds.
fn forged(node_state: &Path, key: &ed25519_dalek::SigningKey, out: &Path) {
    let root = node_state.with_file_name(format!("{}-root", node_state.file_name().unwrap().to_str().unwrap()));
    let head = std::fs::read(node_state.join("bundle.head")).unwrap();
    let bytes = trellis_core::bundle::held_bytes(head, |path, _, _| std::fs::read(root.join(path)).map_err(|e| e.to_string())).unwrap();
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
            agents.push(files_only_agent(&state, &root));
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
        // The state directory keeps the new key as signing.key (0600) and only the public half of
        // the old one (the review of 2026-12-02, finding 15): a later leak of the directory
        // holds no key that nodes away through the overlap would still take.
        assert_eq!(
            signing_key(&c.state, "signing.key").verifying_key().to_bytes(),
            base64::engine::general_purpose::STANDARD.decode(&next_public).unwrap()[..]
        );
        let retired = std::fs::read_to_string(c.state.join("signing.retired.pub")).unwrap();
        assert_eq!(base64::engine::general_purpose::STANDARD.decode(retired.trim()).unwrap(), old.verifying_key().to_bytes());
        assert!(!c.state.join("signing.retired.key").exists(), "the retired private key is kept");
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(c.state.join("signing.key")).unwrap().permissions().mode() & 0o777, 0o600);

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
        let _agent = files_only_agent(&db1, &work.path().join("db-1-root"));
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
            agents.push(files_only_agent(&state, &root));
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
        let _back = files_only_agent(&op1, &work.path().join("op-1-root"));
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

/// SHA-256 (hex) of the first certificate in a PEM file.
fn fingerprint_of(path: &Path) -> String {
    let pem = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    hex::encode(trellis_pki::fingerprint(&trellis_pki::pem_to_der(&pem, "CERTIFICATE").unwrap()))
}

/// Whether the certificate in `cert` was issued by the CA in `ca` (both PEM files).
fn issued_by(cert: &Path, ca: &Path) -> bool {
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    trellis_pki::issued_by_ca(&read(cert), &read(ca)).unwrap()
}

/// `openssl verify -x509_strict` of `cert` against the CA file `ca`.
fn strictly_verified(ca: &Path, cert: &Path) {
    let out = std::process::Command::new("openssl").arg("verify").arg("-x509_strict").arg("-CAfile").arg(ca).arg(cert).output().unwrap();
    assert!(out.status.success(), "openssl verify -x509_strict {}: {}", cert.display(), String::from_utf8_lossy(&out.stderr));
}

/// The rotation of the mesh CA (ADR 0029), as an operator runs it with one node away. After
/// `trellis rotate ca`: the agents online trust both CAs, renew onto the new one and confirm;
/// the rotation waits for the node away. During the overlap a client that trusts only the old CA
/// still reaches the controller (the cross-certificate), a token made before the rotation still
/// enrols, and a new token carries the new fingerprint. Once the node away is back and renewed,
/// the rotation completes by evidence, and from then on: every agent trusts only the new CA, no
/// node enrolled again, a client trusting only the old CA is refused, a node certificate of the
/// old CA is refused by the controller (the attack of a node certificate kept from before,
/// performed: its serial is still the node's previous one), a token of the old CA is refused
/// before its secret is sent, and a change still reaches every agent. Before, the CA made by
/// `init` could not change.
#[test]
fn a_rotated_ca_is_taken_by_every_agent_and_the_old_ca_is_refused() {
    both(|db| {
        let c = Controller::start(db);
        let work = TempDir::new("rotate-ca");
        let decl = work.path().join("decl");
        basic_with_extra_nodes(&decl, 3);
        c.ok(&["apply", decl.to_str().unwrap()]);
        let dir = |n: &str| work.path().join(n);
        let root = |n: &str| work.path().join(format!("{n}-root"));
        let mut agents = Vec::new();
        for n in ["db-1", "api-1", "op-1"] {
            ok(enrol(&c.token(n, &[]), &dir(n)));
            if n != "op-1" {
                agents.push(files_only_agent(&dir(n), &root(n)));
                until_zone_names(&root(n), n).unwrap();
            }
        }
        // Kept from before: the old CA, tokens of it, and db-1's state as it was (its
        // certificate, issued by the old CA).
        let old_ca = work.path().join("old-ca.pem");
        std::fs::copy(c.state.join("ca.pem"), &old_ca).unwrap();
        let (old_token_a, old_token_b) = (c.token("extra-1", &[]), c.token("extra-2", &[]));
        // The files a renewal reads, one by one: the agent is running and replaces others (its
        // status, its evidence) under a copy of the whole directory.
        std::fs::create_dir_all(dir("db-1-before")).unwrap();
        for f in ["identity.toml", "node.key", "node.pem", "ca.pem"] {
            std::fs::copy(dir("db-1").join(f), dir("db-1-before").join(f)).unwrap();
        }
        let admin_trusting = |ca: &Path, args: &[&str]| {
            let mut cmd = crate::support::trellis_cmd(args);
            cmd.args(["--server", &format!("127.0.0.1:{}", c.port), "--admin-token-file"])
                .arg(c.state.join("admin.token"))
                .arg("--ca-file")
                .arg(ca);
            cmd
        };

        let started = Instant::now();
        let out = c.ok(&["rotate", "ca", "--overlap", "1h"]);
        assert!(out.contains("announcing the next mesh CA"), "{out}");
        let next_pem = c.state.join("ca.next.pem");
        let next = fingerprint_of(&next_pem);
        let next_copy = work.path().join("next-ca.pem");
        std::fs::copy(&next_pem, &next_copy).unwrap();
        fails_with(c.admin(&["rotate", "ca"]), "is in progress");
        // The agents online trust both and renew onto the new CA.
        for n in ["db-1", "api-1"] {
            let deadline = Instant::now() + Duration::from_secs(30);
            while !(dir(n).join("ca.next.pem").exists() && issued_by(&dir(n).join("node.pem"), &next_copy)) {
                assert!(Instant::now() < deadline, "{n} did not renew under the next CA");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let online = started.elapsed();
        // They confirm once their evidence of the announcing bundle is in too (it may follow the
        // renewal); the rotation waits for op-1 alone.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let status: serde_json::Value = serde_json::from_str(&c.ok(&["rotate", "status", "--json"])).unwrap();
            let r = status.as_array().unwrap().iter().find(|r| r["kind"] == "ca").unwrap().clone();
            assert_eq!((r["next_key"].as_str(), r["completed_at"].as_i64()), (Some(next.as_str()), None), "{status}");
            if r["waiting"] == serde_json::json!(["op-1"]) {
                break;
            }
            assert!(Instant::now() < deadline, "the rotation does not wait for op-1 alone: {status}");
            std::thread::sleep(Duration::from_millis(50));
        }

        // The overlap: a client trusting only the old CA still reaches the controller; the old
        // token still enrols; a new token names the new CA and enrols too.
        let out = ok(admin_trusting(&old_ca, &["nodes"]));
        assert!(out.contains("db-1"), "{out}");
        ok(enrol(&old_token_a, &dir("extra-1")));
        let new_token = c.token("extra-3", &[]);
        let decoded = trellis_core::token::EnrolmentToken::decode(&new_token).unwrap();
        assert_eq!(hex::encode(decoded.ca_fingerprint), next, "a new token names the new CA");
        ok(enrol(&new_token, &dir("extra-3")));
        for n in ["extra-1", "extra-3"] {
            assert!(issued_by(&dir(n).join("node.pem"), &next_copy), "{n} enrolled during the overlap holds a certificate of the new CA");
            agents.push(files_only_agent(&dir(n), &root(n)));
        }
        // The node away comes back: it renews onto the new CA, and the rotation completes.
        let back = Instant::now();
        agents.push(files_only_agent(&dir("op-1"), &root("op-1")));
        let deadline = Instant::now() + Duration::from_secs(30);
        let status = loop {
            let status: serde_json::Value = serde_json::from_str(&c.ok(&["rotate", "status", "--json"])).unwrap();
            let r = status.as_array().unwrap().iter().find(|r| r["kind"] == "ca").unwrap().clone();
            if r["completed_at"].is_i64() {
                break r;
            }
            assert!(Instant::now() < deadline, "the CA rotation did not complete: {status}");
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(status["completed_by"], "evidence", "{status}");
        let mut confirmed: Vec<&str> = status["confirmed"].as_array().unwrap().iter().map(|n| n.as_str().unwrap()).collect();
        confirmed.sort();
        assert_eq!(confirmed, ["api-1", "db-1", "extra-1", "extra-3", "op-1"], "{status}");
        // Every agent trusts the new CA alone.
        for n in ["db-1", "api-1", "op-1", "extra-1", "extra-3"] {
            let deadline = Instant::now() + Duration::from_secs(30);
            while dir(n).join("ca.next.pem").exists() || fingerprint_of(&dir(n).join("ca.pem")) != next {
                assert!(Instant::now() < deadline, "{n} does not trust the new CA alone");
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(issued_by(&dir(n).join("node.pem"), &next_copy), "{n}");
            strictly_verified(&next_copy, &dir(n).join("node.pem"));
            // The CA file services on the node trust is the new CA alone too, in the bundle
            // the completion publishes (not at some later change).
            let delivered = root(n).join("etc/trellis/ca.pem");
            let deadline = Instant::now() + Duration::from_secs(30);
            loop {
                let pem = std::fs::read_to_string(&delivered).unwrap_or_default();
                if pem.matches("BEGIN CERTIFICATE").count() == 1 && fingerprint_of(&delivered) == next {
                    break;
                }
                assert!(Instant::now() < deadline, "{n}'s etc/trellis/ca.pem is not the new CA alone:\n{pem}");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        eprintln!(
            "{db:?}: CA rotation: the 2 agents online renewed under the new CA {} ms after `trellis rotate ca`; completed {} ms after the node away came back",
            online.as_millis(),
            back.elapsed().as_millis()
        );
        // The state directory: the new CA is ca.pem (its key 0600), the old one retired; the
        // server certificate and the services CA are the new CA's, and pass strict checks.
        assert_eq!(fingerprint_of(&c.state.join("ca.pem")), next);
        assert_eq!(fingerprint_of(&c.state.join("ca.retired.pem")), fingerprint_of(&old_ca));
        assert!(!c.state.join("ca.next.pem").exists() && !c.state.join("ca.next.key").exists());
        use std::os::unix::fs::PermissionsExt;
        for f in ["ca.key", "server.key"] {
            assert_eq!(std::fs::metadata(c.state.join(f)).unwrap().permissions().mode() & 0o777, 0o600, "{f}");
        }
        for f in ["server.pem", "services-ca.pem"] {
            assert!(issued_by(&c.state.join(f), &next_copy), "{f}");
            strictly_verified(&next_copy, &c.state.join(f));
        }

        // After: a client trusting only the old CA is refused by its own TLS check.
        fails_with(admin_trusting(&old_ca, &["nodes"]), "certificate");
        // The attack: db-1's certificate from before (the old CA's, still its previous serial),
        // presented by a client that trusts the new CA, is refused by the controller.
        std::fs::copy(&next_copy, dir("db-1-before").join("ca.pem")).unwrap();
        let mut renew = agent_bin();
        renew.args(["renew", "--force", "--state-dir", dir("db-1-before").to_str().unwrap()]);
        let refused = renew.output().unwrap();
        let said = String::from_utf8_lossy(&refused.stderr);
        assert!(
            !refused.status.success() && said.contains("UnknownCA"),
            "a certificate of the old CA was not refused as such: {refused:?}"
        );
        // A token of the old CA: refused before its secret is sent.
        fails_with(enrol(&old_token_b, &dir("extra-2")), "the controller's CA does not match the token");
        // The controller goes on: a change reaches every agent, and no node enrolled again.
        let mut mesh = std::fs::read_to_string(decl.join("mesh.toml")).unwrap();
        mesh.push_str("\n[[node]]\nname = \"extra-9\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n");
        std::fs::write(decl.join("mesh.toml"), mesh).unwrap();
        c.ok(&["apply", decl.to_str().unwrap()]);
        for n in ["db-1", "api-1", "op-1", "extra-1", "extra-3"] {
            until_zone_names(&root(n), "extra-9").unwrap();
        }
        let records: serde_json::Value = serde_json::from_str(&c.ok(&["audit", "list", "--json"])).unwrap();
        let actions: Vec<&str> = records.as_array().unwrap().iter().map(|r| r["action"].as_str().unwrap()).collect();
        assert_eq!(actions.iter().filter(|a| **a == "node enrolled").count(), 5, "{actions:?}");
        assert!(actions.contains(&"CA rotation started") && actions.contains(&"CA rotation completed"), "{actions:?}");
        let audit = c.ok(&["audit", "verify"]);
        assert!(audit.contains("audit chain verified"), "{audit}");
        drop(agents);
    });
}

/// The server certificate is renewed while serving (ADR 0029): one made to live 30 s is
/// replaced 20 s after it was made, under the mesh CA, without a restart; the controller serves
/// the new one from the next connection on (`openssl s_client` sees its serial), an agent
/// running throughout still gets every change, and the renewal is audited. Before, the server
/// certificate lived five years and nothing renewed it.
#[test]
fn the_server_certificate_is_renewed_while_serving() {
    let mut c = Controller::start(Db::Sqlite);
    let work = TempDir::new("server-renew");
    let decl = work.path().join("decl");
    basic_with_extra_nodes(&decl, 1);
    c.ok(&["apply", decl.to_str().unwrap()]);
    let (state, root) = (work.path().join("db-1"), work.path().join("db-1-root"));
    ok(enrol(&c.token("db-1", &[]), &state));
    // A server certificate made to live 30 s, and a controller configured to make such ones.
    c.stop_serving();
    let ctl_state = c.state.clone();
    let read = |f: &str| std::fs::read_to_string(ctl_state.join(f)).unwrap();
    let ca = trellis_pki::Ca::load(&read("ca.pem"), &read("ca.key")).unwrap();
    let short = ca.server_cert(&["127.0.0.1".into()], std::time::SystemTime::now(), Duration::from_secs(30), [5; 16]).unwrap();
    std::fs::write(c.state.join("server.pem"), &short.cert_pem).unwrap();
    std::fs::write(c.state.join("server.key"), &short.key_pem).unwrap();
    let config: String = read("controller.toml")
        .lines()
        .map(|l| if l.starts_with("server_cert_secs") { "server_cert_secs = 30\n".to_string() } else { format!("{l}\n") })
        .collect();
    assert!(config.contains("server_cert_secs = 30"), "{config}");
    std::fs::write(c.state.join("controller.toml"), config).unwrap();
    let port = c.port;
    c.serve(port);
    let _agent = files_only_agent(&state, &root);
    until_zone_names(&root, "db-1").unwrap();
    let first = trellis_pki::inspect_pem(&short.cert_pem).unwrap().serial;
    let served = || {
        let out = std::process::Command::new("openssl")
            .args(["s_client", "-connect", &format!("127.0.0.1:{port}"), "-servername", "127.0.0.1"])
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let pem = text.split("-----BEGIN CERTIFICATE-----").nth(1).and_then(|r| r.split("-----END CERTIFICATE-----").next());
        pem.map(|b| trellis_pki::inspect_pem(&format!("-----BEGIN CERTIFICATE-----{b}-----END CERTIFICATE-----\n")).unwrap().serial)
    };
    assert_eq!(served().as_deref(), Some(first.as_str()), "the short-lived certificate is served first");
    let made = Instant::now();
    let deadline = made + Duration::from_secs(40);
    let renewed = loop {
        match served() {
            Some(s) if s != first => break s,
            _ => {}
        }
        assert!(Instant::now() < deadline, "the server certificate was not renewed: {}", c.log(port));
        std::thread::sleep(Duration::from_millis(250));
    };
    let took = made.elapsed();
    eprintln!("the server certificate was renewed {} ms after the controller started with it", took.as_millis());
    assert!(took >= Duration::from_secs(12), "renewed at two thirds of 30 s, not at once: {} ms", took.as_millis());
    // The file is the one served, under the mesh CA, strictly valid, its key 0600.
    assert_eq!(trellis_pki::inspect_pem(&read("server.pem")).unwrap().serial, renewed);
    strictly_verified(&c.state.join("ca.pem"), &c.state.join("server.pem"));
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(c.state.join("server.key")).unwrap().permissions().mode() & 0o777, 0o600);
    // The agent, running throughout, still gets a change; the renewal is audited.
    let mut mesh = std::fs::read_to_string(decl.join("mesh.toml")).unwrap();
    mesh.push_str("\n[[node]]\nname = \"extra-9\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n");
    std::fs::write(decl.join("mesh.toml"), mesh).unwrap();
    c.ok(&["apply", decl.to_str().unwrap()]);
    until_zone_names(&root, "extra-9").unwrap();
    let list = c.ok(&["audit", "list", "--json"]);
    assert!(list.contains("server certificate renewed") && list.contains(&first), "{list}");
}

/// A CA rotation with two replicas on one PostgreSQL database (ADR 0017, 0029): the rotation is
/// started through the first; the second takes it up from the database and serves under the new
/// CA as well, so once the first is gone the agents, which trust only the new CA by then, carry on
/// through the second: a change applied there reaches them. A replica left on the old CA would
/// fail every agent's handshake after completion.
#[test]
fn a_ca_rotation_reaches_the_other_replica_which_serves_the_agents_once_the_first_is_gone() {
    if !can_run(Need::Postgres) {
        return;
    }
    let mut c = Controller::start(Db::Postgres);
    let second = free_port();
    c.serve(second);
    let work = TempDir::new("rotate-ca-replicas");
    let decl = work.path().join("decl");
    basic_with_extra_nodes(&decl, 0);
    c.ok(&["apply", decl.to_str().unwrap()]);
    let second_address = format!("127.0.0.1:{second}");
    c.ok(&["controllers", "add", &second_address]);
    let mut agents = Vec::new();
    for n in ["db-1", "api-1"] {
        let (state, root) = (work.path().join(n), work.path().join(format!("{n}-root")));
        ok(enrol(&c.token(n, &[]), &state));
        agents.push(files_only_agent(&state, &root));
        until_zone_names(&root, n).unwrap();
        until_identity(&state, "list the second controller", |t| t.contains(&second_address));
    }
    let old_ca = work.path().join("old-ca.pem");
    std::fs::copy(c.state.join("ca.pem"), &old_ca).unwrap();
    c.ok(&["rotate", "ca", "--overlap", "1h"]);
    let next = fingerprint_of(&c.state.join("ca.next.pem"));
    for n in ["db-1", "api-1"] {
        let dir = work.path().join(n);
        let deadline = Instant::now() + Duration::from_secs(30);
        while dir.join("ca.next.pem").exists() || fingerprint_of(&dir.join("ca.pem")) != next {
            assert!(Instant::now() < deadline, "{n} does not trust the new CA alone");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    // The second replica serves under the new CA: a client of the new CA reaches it, one of the
    // old CA alone does not.
    let ctl_state = c.state.clone();
    let through_second = |ca: &Path, args: &[&str]| {
        let mut cmd = crate::support::trellis_cmd(args);
        cmd.args(["--server", &second_address, "--admin-token-file"]).arg(ctl_state.join("admin.token")).arg("--ca-file").arg(ca);
        cmd
    };
    // It takes the completion up from the database (its next look, within a second).
    let deadline = Instant::now() + Duration::from_secs(10);
    while through_second(&old_ca, &["nodes"]).output().unwrap().status.success() {
        assert!(Instant::now() < deadline, "the second replica still serves the old CA's clients: {}", c.log(second));
        std::thread::sleep(Duration::from_millis(100));
    }
    fails_with(through_second(&old_ca, &["nodes"]), "certificate");
    ok(through_second(&ctl_state.join("ca.pem"), &["nodes"]));
    // The first replica goes; the agents carry on through the second.
    c.stop_replica(0);
    basic_with_extra_nodes(&decl, 1);
    ok(through_second(&ctl_state.join("ca.pem"), &["apply", decl.to_str().unwrap()]));
    for n in ["db-1", "api-1"] {
        let took = until_zone_names(&work.path().join(format!("{n}-root")), "extra-1").unwrap();
        eprintln!("after the CA rotation and the first replica's end, a change through the second reached {n} in {} ms", took.as_millis());
    }
    drop(agents);
}
