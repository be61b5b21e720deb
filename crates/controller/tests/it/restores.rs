//! A database restored from a backup taken before a node got its bundle (issue 21, item 1): the
//! node is the witness. What it holds, by its tag, makes its next bundle go above it, so it is
//! not refused as a rollback; and the same number with other content is never answered `304`.

use std::time::Duration;

use trellis_controller::{BundleAnswer, BundleRequest, Controller, NodeIdentity};
use trellis_core::bundle::Applied;
use trellis_proto::{self as proto, etag::BundleTag};

use super::{enrol_request, on_both};

/// Enrols db-1 and returns who it is.
async fn enrol(c: &Controller) -> NodeIdentity {
    let req = proto::TokenRequest { node: "db-1".into(), ttl_secs: 600, ..Default::default() };
    let (req, _) = enrol_request(&c.create_token(&req).await.unwrap().token);
    let enrolled = c.enrol(req).await.unwrap();
    c.publish().await.unwrap();
    let der = trellis_pki::pem_to_der(&enrolled.node_cert_pem, "CERTIFICATE").unwrap();
    c.authenticate_node(Some(&der)).await.unwrap()
}

/// A change of db-1's files: one more node it may reach.
async fn change(c: &Controller, k: u32) {
    let basic = trellis_testing::controller::lab_files("basic");
    let mut mesh = basic.iter().find(|f| f.path == "mesh.toml").unwrap().text.clone();
    for i in 1..=k {
        mesh.push_str(&format!("\n[[node]]\nname = \"extra-{i}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n"));
    }
    let mut files = vec![proto::DeclFile { path: "mesh.toml".into(), text: mesh }];
    files.extend(basic.into_iter().filter(|f| f.path != "mesh.toml"));
    c.apply(&files, None).await.unwrap();
    c.publish().await.unwrap();
}

/// What db-1 holds after it applied its current bundle: its tag, and what its verifier knows.
fn held(c: &Controller) -> (BundleTag, Applied) {
    let p = c.bundle("db-1").unwrap();
    (BundleTag::new(p.version, &p.digest), Applied { version: p.version as u64, digest: Some(p.digest) })
}

/// db-1's bundle put back as a backup held it, and the declaration with it.
async fn restore(c: &Controller, backup: &trellis_store::BundleVersion) {
    let sql = format!(
        "UPDATE bundles SET version = {}, digest = '{}', issued_at = {} WHERE node = 'db-1'",
        backup.version, backup.digest, backup.issued_at
    );
    assert_eq!(c.store().execute_raw(&sql).await.unwrap(), 1);
    // The declaration as it was then (applied again, as a new revision: the content is the
    // backup's); the replica then serves what the database says, as a controller started on the
    // restored database would.
    change(c, 0).await;
    c.publish_if_moved().await.unwrap();
    assert_eq!(c.bundle("db-1").unwrap().version, backup.version, "the restored version is served");
}

/// The node asks holding `tag`: the bundle it is sent must be one its verifier takes.
async fn ask_and_verify(c: &Controller, who: &NodeIdentity, tag: BundleTag, applied: Applied) -> i64 {
    let ask = BundleRequest { held: Some(tag), takes_delta: false, held_files: Vec::new(), wait: Duration::from_secs(5) };
    let (sent, body) = match c.bundle_answer(who, ask).await.unwrap() {
        BundleAnswer::Whole { tag: sent, body, .. } => (sent, body.collect::<Vec<_>>().concat()),
        BundleAnswer::Current { tag: current, .. } => panic!("holding {tag:?}, told {current:?} is current"),
        BundleAnswer::Delta { .. } => panic!("a delta was not asked for"),
    };
    let key = ed25519_dalek::SigningKey::from_bytes(&[7; 32]).verifying_key();
    let v = trellis_core::bundle::verify(&body, &key, "basic", "db-1", Some(applied))
        .unwrap_or_else(|e| panic!("holding {tag:?}, sent {sent:?}, refused: {e}"));
    assert!(!v.redelivery);
    assert_eq!(v.bundle.version as i64, sent.version);
    sent.version
}

/// db-1 enrolled, backed up, changed three times (it holds the third), then restored from the
/// backup: who it is, the backup, and what it holds.
async fn restored_after_three_changes(c: &Controller) -> (NodeIdentity, trellis_store::BundleVersion, BundleTag, Applied) {
    let who = enrol(c).await;
    let backup = c.store().bundle("db-1").await.unwrap().unwrap();
    for k in 1..=3 {
        change(c, k).await;
    }
    let (tag, applied) = held(c);
    assert_eq!(tag.version, backup.version + 3);
    restore(c, &backup).await;
    (who, backup, tag, applied)
}

/// Restored from before three changes: the next change is numbered below what the node holds.
/// Before, it was sent at that number and refused as a rollback, for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_ahead_of_a_restored_database_gets_its_next_bundle_above_what_it_holds() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (who, backup, tag, applied) = restored_after_three_changes(c).await;
        // The next change after the restore: numbered backup + 1, below what db-1 holds.
        change(c, 4).await;
        assert_eq!(c.bundle("db-1").unwrap().version, backup.version + 1);
        let sent = ask_and_verify(c, &who, tag, applied).await;
        assert_eq!(sent, tag.version + 1, "numbered just above what the node holds");
        assert_eq!(c.store().bundle("db-1").await.unwrap().unwrap().version, sent, "the database numbers it so too");
        assert!(c.scrape().await.contains("trellis_bundles_renumbered_total 1"), "counted");
        // Until it reports applying it, db-1 is shown stale at the new version.
        let status = c.status().await.unwrap();
        let db1 = status.iter().find(|n| n.name == "db-1").unwrap();
        assert_eq!(db1.desired_version, Some(sent));
        assert!(db1.stale, "{db1:?}");
        let evidence = proto::Evidence {
            seq: 1,
            version: sent,
            result: proto::EvidenceResult::Applied,
            error: None,
            files: Vec::new(),
            at: trellis_testing::controller::T0,
            unmanaged: false,
        };
        c.evidence(&who, &proto::EvidenceBatch { records: vec![evidence] }).await.unwrap();
        let status = c.status().await.unwrap();
        assert!(!status.iter().find(|n| n.name == "db-1").unwrap().stale);
        // Once it holds that, it is current again: no more renumbering.
        let (tag, _) = held(c);
        let ask = BundleRequest { held: Some(tag), takes_delta: false, held_files: Vec::new(), wait: Duration::ZERO };
        assert!(matches!(c.bundle_answer(&who, ask).await.unwrap(), BundleAnswer::Current { tag: t, .. } if t == tag));
    })
    .await;
}

/// Restored from before three changes, then three other changes: the node's number comes back
/// with other content. Before, the ETag was the number alone: the node was told `304`, and kept
/// content (peers, keys) the controller had dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_number_with_other_content_is_never_current() {
    on_both(|fx| async move {
        let c = &fx.c;
        let (who, _, tag, applied) = restored_after_three_changes(c).await;
        // Other changes (a different node each time) bring the number back to what db-1 holds.
        for k in [5, 6, 7] {
            change(c, k).await;
        }
        let p = c.bundle("db-1").unwrap();
        assert_eq!(p.version, tag.version, "the number came back");
        assert_ne!(p.digest[..8], tag.digest.unwrap()[..], "with other content");
        let sent = ask_and_verify(c, &who, tag, applied).await;
        assert_eq!(sent, tag.version + 1);
    })
    .await;
}

/// The review of 2026-12-02, finding 3: one request saying it holds the tag's ceiling pushed the
/// node's version (and the high-water mark) past it, where tags are no tags: every long-poll of
/// the node then answered at once with the whole bundle, for ever. A word above anything this
/// controller can have published is not believed, the version stays, and the node, asking with
/// what it was given, waits out its poll; a node's word is believed once in a while, not on
/// every request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_witness_above_what_can_have_been_published_is_not_believed() {
    on_both(|fx| async move {
        let c = &fx.c;
        let who = enrol(c).await;
        let before = c.store().bundle("db-1").await.unwrap().unwrap();
        for forged in
            [proto::etag::MAX_VERSION, proto::etag::MAX_VERSION - 1, before.version + trellis_controller::bundle::WITNESS_MARGIN + 1]
        {
            let ask = BundleRequest {
                held: Some(BundleTag { version: forged, digest: None }),
                takes_delta: false,
                held_files: Vec::new(),
                wait: Duration::ZERO,
            };
            match c.bundle_answer(&who, ask).await.unwrap() {
                BundleAnswer::Whole { tag, .. } => assert_eq!(tag.version, before.version, "holding {forged}"),
                _ => panic!("holding {forged}: not answered with the bundle in force"),
            }
            assert_eq!(c.store().bundle("db-1").await.unwrap().unwrap().version, before.version, "holding {forged}: the version moved");
        }
        assert!(!c.scrape().await.contains("trellis_bundles_renumbered_total 1"), "nothing was renumbered");
        // What it was given is current: the poll waits for a change, as every node's does.
        let (tag, _) = held(c);
        let started = std::time::Instant::now();
        let ask = BundleRequest { held: Some(tag), takes_delta: false, held_files: Vec::new(), wait: Duration::from_millis(600) };
        assert!(matches!(c.bundle_answer(&who, ask).await.unwrap(), BundleAnswer::Current { .. }));
        assert!(started.elapsed() >= Duration::from_millis(500), "the long-poll answered after {:?}", started.elapsed());

        // Within what can be true it is believed, once: asked again at once, not again.
        let ahead = before.version + 10;
        let ask = BundleRequest {
            held: Some(BundleTag { version: ahead, digest: None }),
            takes_delta: false,
            held_files: Vec::new(),
            wait: Duration::ZERO,
        };
        let BundleAnswer::Whole { tag, .. } = c.bundle_answer(&who, ask).await.unwrap() else { panic!("no bundle") };
        assert_eq!(tag.version, ahead + 1, "numbered above what it holds");
        let again = ahead + 1000;
        let ask = BundleRequest {
            held: Some(BundleTag { version: again, digest: None }),
            takes_delta: false,
            held_files: Vec::new(),
            wait: Duration::ZERO,
        };
        let BundleAnswer::Whole { tag, .. } = c.bundle_answer(&who, ask).await.unwrap() else { panic!("no bundle") };
        assert_eq!(tag.version, ahead + 1, "renumbered a second time within the interval");
        assert_eq!(c.store().bundle("db-1").await.unwrap().unwrap().version, ahead + 1);
    })
    .await;
}
