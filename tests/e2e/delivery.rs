//! Signed delivery as an operator debugs it: `trellis-agent fetch` saves the bundle as received,
//! `trellis-agent verify` checks it with the agent's own code and says exactly why it refuses.

use std::path::Path;

use base64::Engine;
use trellis_core::bundle::{Bundle, BundleFile};

use trellis_testing::cmd::{fails_with, ok};
use trellis_testing::TempDir;

use crate::controller::{agent_bin, enrol, Controller, Db};

fn fetch(node: &Path, out: &Path) -> String {
    let mut c = agent_bin();
    c.args(["fetch", "--state-dir", node.to_str().unwrap(), "--out", out.to_str().unwrap()]);
    ok(c)
}

fn verify(file: &Path, node: &Path, extra: &[&str]) -> std::process::Command {
    let mut c = agent_bin();
    c.args(["verify", file.to_str().unwrap(), "--state-dir", node.to_str().unwrap()]).args(extra);
    c
}

#[test]
fn fetch_and_verify_and_every_refusal_with_its_reason() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let work = TempDir::new("delivery");
    let (db, op) = (work.path().join("db-1"), work.path().join("op-1"));
    ok(enrol(&c.token("db-1", &[]), &db));
    ok(enrol(&c.token("op-1", &[]), &op));
    let v_a = work.path().join("a.bundle");
    let out = fetch(&db, &v_a);
    assert!(out.contains("saved the bundle") && out.contains("signed word is"), "{out}");

    // A change that touches every node (a node more in the zone) gives db-1 a newer version.
    let changed = work.path().join("decl");
    crate::controller::copy_dir(&trellis_testing::repo().join("lab/basic"), &changed);
    let mesh = std::fs::read_to_string(changed.join("mesh.toml")).unwrap();
    std::fs::write(changed.join("mesh.toml"), mesh + "\n[[node]]\nname = \"extra-1\"\n").unwrap();
    c.ok(&["apply", changed.to_str().unwrap()]);
    // The apply is published behind its answer: long-poll for the version after a's.
    let a_version = trellis_core::bundle::verify(&std::fs::read(&v_a).unwrap(), &signing(&c).verifying_key(), "basic", "db-1", None)
        .unwrap()
        .bundle
        .version;
    let v_b = work.path().join("b.bundle");
    let mut newer = agent_bin();
    newer.args([
        "fetch",
        "--state-dir",
        db.to_str().unwrap(),
        "--out",
        v_b.to_str().unwrap(),
        "--held",
        &a_version.to_string(),
        "--wait",
        "20",
    ]);
    ok(newer);

    let ok = ok(verify(&v_b, &db, &["--last-bundle", v_a.to_str().unwrap()]));
    assert!(ok.contains("valid bundle for node db-1 in mesh basic"), "{ok}");
    assert!(ok.contains("etc/trellis/wireguard.conf") && ok.contains("etc/trellis/node.pem"), "{ok}");
    let b =
        trellis_core::bundle::verify(&std::fs::read(&v_b).unwrap(), &signing(&c).verifying_key(), "basic", "db-1", None).unwrap().bundle;
    let a =
        trellis_core::bundle::verify(&std::fs::read(&v_a).unwrap(), &signing(&c).verifying_key(), "basic", "db-1", None).unwrap().bundle;
    assert!(b.version > a.version);

    // Replay of the older bundle.
    fails_with(
        verify(&v_a, &db, &["--last-bundle", v_b.to_str().unwrap()]),
        &format!("bundle version {} is not greater than the last applied version {}", a.version, b.version),
    );

    // One byte changed: in the signed manifest (the node name's first byte), or in a file.
    let original = std::fs::read(&v_b).unwrap();
    let tampered = work.path().join("tampered.bundle");
    let mut bytes = original.clone();
    bytes[72 + "trellis-bundle-v1\n".len() + 4 + 4 + 4] ^= 0x01;
    std::fs::write(&tampered, &bytes).unwrap();
    fails_with(verify(&tampered, &db, &[]), "bundle signature does not verify");
    let mut bytes = original.clone();
    let last = bytes.len() - 10;
    bytes[last] ^= 0x01;
    std::fs::write(&tampered, &bytes).unwrap();
    fails_with(verify(&tampered, &db, &[]), "file etc/trellis/wireguard.conf does not match its SHA-256 in the bundle");

    // Another node's bundle.
    let theirs = work.path().join("op.bundle");
    fetch(&op, &theirs);
    fails_with(verify(&theirs, &db, &[]), "bundle is for node `op-1`, not for this node `db-1`");

    // The same version with other content, validly signed (as a compromised replica could).
    let mut forged = b.clone();
    forged.files.push(BundleFile::new("etc/trellis/extra.conf", 0o644, b"x".to_vec()));
    forged.files.sort_by(|x, y| x.path.cmp(&y.path));
    let forged_path = work.path().join("forged.bundle");
    std::fs::write(&forged_path, Bundle::sign(&forged, &signing(&c)).to_vec()).unwrap();
    fails_with(
        verify(&forged_path, &db, &["--last-bundle", v_b.to_str().unwrap()]),
        &format!("bundle version {} equals the last applied version but its content differs", b.version),
    );

    // Too large, and an unknown format.
    let mut huge = b"TRB1".to_vec();
    huge.resize(trellis_core::bundle::MAX_BUNDLE + 1, 0);
    let huge_path = work.path().join("huge.bundle");
    std::fs::write(&huge_path, &huge).unwrap();
    fails_with(verify(&huge_path, &db, &[]), &format!("over the bound of {}", trellis_core::bundle::MAX_BUNDLE));
    let mut unknown = std::fs::read(&v_b).unwrap();
    unknown[..4].copy_from_slice(b"TRB9");
    let unknown_path = work.path().join("unknown.bundle");
    std::fs::write(&unknown_path, &unknown).unwrap();
    fails_with(verify(&unknown_path, &db, &[]), "unknown format");
}

fn signing(c: &Controller) -> ed25519_dalek::SigningKey {
    let seed = std::fs::read_to_string(c.state.join("signing.key")).unwrap();
    let seed: [u8; 32] = base64::engine::general_purpose::STANDARD.decode(seed.trim()).unwrap().try_into().unwrap();
    ed25519_dalek::SigningKey::from_bytes(&seed)
}

/// Evidence the controller refuses for good (here: for a version it never published, from a
/// bundle signed with its key but never issued) is dropped by the agent, counted, and does not
/// hold back the records after it; before, it stayed at the head of the buffer for ever.
#[test]
fn evidence_refused_for_good_is_dropped_and_counted_not_kept_for_ever() {
    let c = Controller::start(Db::Sqlite);
    c.ok(&["apply", "lab/basic"]);
    let work = TempDir::new("dropped");
    let db = work.path().join("db-1");
    ok(enrol(&c.token("db-1", &[]), &db));
    let saved = work.path().join("a.bundle");
    fetch(&db, &saved);
    let key = signing(&c);
    let mut never =
        trellis_core::bundle::verify(&std::fs::read(&saved).unwrap(), &key.verifying_key(), "basic", "db-1", None).unwrap().bundle;
    never.version += 5;
    let forged = work.path().join("never.bundle");
    std::fs::write(&forged, never.sign(&key).to_vec()).unwrap();
    let root = work.path().join("root");
    let mut apply = agent_bin();
    apply.args(["apply", forged.to_str().unwrap(), "--state-dir", db.to_str().unwrap(), "--root", root.to_str().unwrap(), "--files-only"]);
    let out = ok(apply);
    assert!(out.contains(&format!("applied version {}", never.version)), "{out}");
    let mut status = agent_bin();
    status.args(["status", "--state-dir", db.to_str().unwrap(), "--json"]);
    let s: serde_json::Value = serde_json::from_str(&ok(status)).unwrap();
    assert_eq!((s["buffered_evidence"].as_u64(), s["dropped_evidence"].as_u64()), (Some(0), Some(1)), "{s}");
}
