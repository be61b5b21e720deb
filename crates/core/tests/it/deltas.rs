//! Deltas (ADR 0033): for any bundle a node holds and any it is given next, the delta applied to
//! the first is exactly the second (files, modes, digests, and the head a whole bundle carries);
//! a delta for another base, node, mesh or an older version is refused as a bad bundle is.

use bytes::Bytes;
use ed25519_dalek::SigningKey;
use proptest::prelude::*;
use trellis_core::bundle::{verify, verify_delta, Applied, Bundle, BundleError, BundleFile};
use trellis_core::delta::{self, Base, DeltaError, Edits};
use trellis_core::plan::DELIVERED;

fn key() -> SigningKey {
    SigningKey::from_bytes(&[7; 32])
}

fn bundle(node: &str, version: u64, files: &[(usize, u32, Vec<u8>)]) -> Bundle {
    let mut files: Vec<BundleFile> = files.iter().map(|(i, mode, c)| BundleFile::new(DELIVERED[*i], *mode, c.clone())).collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    files.dedup_by(|a, b| a.path == b.path);
    Bundle { mesh: "m".into(), node: node.into(), version, issued_at: 1_700_000_000, files }
}

/// The delta the controller sends a node holding `held`: each file kept, edited from the held
/// file of the same path (a large file's edits are made from the version before), or whole.
fn make(held: &Bundle, new: &Bundle) -> Vec<u8> {
    let signed = new.sign(&key());
    let edits: Vec<Option<Edits>> = new
        .files
        .iter()
        .map(|f| {
            held.files
                .iter()
                .find(|h| h.path == f.path && h.sha256 != f.sha256)
                .map(|h| Edits { base: h.sha256, edits: Bytes::from(delta::edits(&h.content, &f.content)) })
        })
        .collect();
    let is_held = |d: &[u8; 32]| held.files.iter().any(|h| h.sha256 == *d);
    let ops: Vec<_> = new.files.iter().zip(&edits).map(|(f, e)| delta::op(&f.sha256, &f.content, e.as_ref(), &is_held)).collect();
    delta::encode(&signed.head, Base::of(held.version, &held.content_digest()), &ops)
}

fn applied(b: &Bundle) -> Option<Applied> {
    Some(Applied { version: b.version, digest: Some(b.content_digest()) })
}

/// Contents a recompile makes: lines of a few kinds, some changed between versions.
fn content() -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(
        proptest::sample::select(vec!["[Peer]\n", "PublicKey = a\n", "PublicKey = b\n", "x,", "10.0.0.1,", "\n"]),
        0..60,
    )
    .prop_map(|l| l.concat().into_bytes())
}

fn files() -> impl Strategy<Value = Vec<(usize, u32, Vec<u8>)>> {
    proptest::collection::vec((0..DELIVERED.len(), proptest::sample::select(vec![0o600u32, 0o644]), content()), 1..8)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn a_delta_applied_to_the_held_bundle_is_exactly_the_next(held in files(), next in files(), step in 1u64..5) {
        let (held, next) = (bundle("n", 3, &held), bundle("n", 3 + step, &next));
        let d = make(&held, &next);
        let whole = next.sign(&key()).to_vec();
        let v = verify_delta(&d, &key().verifying_key(), "m", "n", applied(&held), &held).unwrap();
        prop_assert_eq!(&v.bundle, &next);
        prop_assert_eq!(v.bundle.content_digest(), next.content_digest());
        let w = verify(&whole, &key().verifying_key(), "m", "n", applied(&held)).unwrap();
        prop_assert_eq!(&v.head, &w.head, "the head kept is the whole bundle's");
        prop_assert_eq!(v.bundle.files.clone(), w.bundle.files);
        // What the delta built is what changed (or moved): the rest came from what is held.
        let built = v.changed.unwrap();
        for f in &next.files {
            let same = held.files.iter().any(|h| h.sha256 == f.sha256);
            prop_assert_eq!(built.contains(&f.path), !same, "{}", f.path);
        }
        // Never more than the whole bundle and a byte a file.
        prop_assert!(d.len() <= whole.len() + 24 + next.files.len(), "{} against {}", d.len(), whole.len());
    }

    #[test]
    fn a_delta_for_another_base_node_or_version_is_refused(held in files(), other in files(), next in files()) {
        let (held, other, next) = (bundle("n", 3, &held), bundle("n", 3, &other), bundle("n", 4, &next));
        let key = key().verifying_key();
        let d = make(&held, &next);
        if other.content_digest() != held.content_digest() {
            let r = verify_delta(&d, &key, "m", "n", applied(&other), &other);
            prop_assert_eq!(r.unwrap_err(), BundleError::Delta(DeltaError::OtherBase { version: 3 }));
        }
        let r = verify_delta(&d, &key, "m", "o", applied(&held), &held);
        prop_assert!(matches!(r, Err(BundleError::WrongNode { .. })), "{r:?}");
        let r = verify_delta(&d, &key, "x", "n", applied(&held), &held);
        prop_assert!(matches!(r, Err(BundleError::WrongMesh { .. })), "{r:?}");
        let ahead = Some(Applied { version: 5, digest: None });
        prop_assert_eq!(verify_delta(&d, &key, "m", "n", ahead, &held).unwrap_err(), BundleError::NotNewer { version: 4, last: 5 });
        let other_key = SigningKey::from_bytes(&[8; 32]).verifying_key();
        prop_assert_eq!(verify_delta(&d, &other_key, "m", "n", applied(&held), &held).unwrap_err(), BundleError::BadSignature);
    }
}

/// Any byte of a delta changed: refused, or (where a copy takes the same bytes from elsewhere)
/// the very same bundle. Never other files.
#[test]
fn a_tampered_delta_is_refused_or_changes_nothing() {
    let peers = |n: usize, extra: bool| {
        let mut s = String::new();
        for i in 0..n {
            s.push_str(&format!("[Peer]\nPublicKey = key{i}\nAllowedIPs = 10.0.0.{i}/32\n\n"));
            if extra && i == n / 2 {
                s.push_str("[Peer]\nPublicKey = late\nAllowedIPs = 10.9.9.9/32\n\n");
            }
        }
        s.into_bytes()
    };
    let held = bundle("n", 3, &[(0, 0o600, peers(40, false)), (3, 0o644, b"node = 1\n".to_vec())]);
    let next = bundle("n", 4, &[(0, 0o600, peers(40, true)), (3, 0o644, b"node = 1\n".to_vec()), (9, 0o644, b"paths\n".to_vec())]);
    let d = make(&held, &next);
    let key = key().verifying_key();
    let mut refused = 0;
    for i in 0..d.len() {
        let mut bad = d.clone();
        bad[i] ^= 0x40;
        match verify_delta(&bad, &key, "m", "n", applied(&held), &held) {
            Ok(v) => assert_eq!(v.bundle, next, "byte {i} changed gave other files"),
            Err(_) => refused += 1,
        }
    }
    assert!(refused > d.len() * 3 / 4, "{refused} of {}", d.len());
    // A keep of a file the node does not hold: refused, naming it.
    let mut other = held.clone();
    other.files[1] = BundleFile::new(DELIVERED[3], 0o644, "node = 2\n");
    let d = make(&held, &next);
    let e = verify_delta(&d, &key, "m", "n", applied(&held), &Bundle { files: other.files.clone(), ..held.clone() });
    assert!(matches!(e, Err(BundleError::Delta(DeltaError::OtherBase { .. }))), "{e:?}");
}

/// A one-peer change to a file of 10,000 peers is edits of a few hundred bytes: the delta is the
/// head and those, whatever the size of the file.
#[test]
fn a_one_peer_change_sends_about_that_peer() {
    let peers = |extra: bool| {
        let mut s = String::new();
        for i in 0..10_000 {
            s.push_str(&format!("# node-{i}\n[Peer]\nPublicKey = {i:0>43}=\nAllowedIPs = 10.{}.{}.1/32\n\n", i / 256, i % 256));
            if extra && i == 5000 {
                s.push_str("# late\n[Peer]\nPublicKey = late\nAllowedIPs = 10.99.9.9/32\n\n");
            }
        }
        s.into_bytes()
    };
    let held = bundle("n", 3, &[(0, 0o600, peers(false)), (3, 0o644, b"node = 1\n".to_vec())]);
    let next = bundle("n", 4, &[(0, 0o600, peers(true)), (3, 0o644, b"node = 1\n".to_vec())]);
    let d = make(&held, &next);
    assert!(next.sign(&key()).len() > 900_000);
    assert!(d.len() < 1024, "{} bytes", d.len());
    let v = verify_delta(&d, &key().verifying_key(), "m", "n", applied(&held), &held).unwrap();
    assert_eq!(v.bundle, next);
}

/// The review of ADR 0033: a delta's head is bounded as a whole bundle is (head and contents
/// together), or a delta could build a bundle that, read back at the next start, is over the
/// bound and refused with nothing held.
#[test]
fn a_head_naming_more_than_a_bundle_may_hold_is_refused() {
    let near = trellis_core::bundle::MAX_BUNDLE - 10;
    let sha = [1u8; 32];
    let head = trellis_core::bundle::sign_entries(&key(), "m", "n", 4, 1, &[(DELIVERED[0], 0o600, &sha, near)]);
    let held = bundle("n", 3, &[(0, 0o600, b"x".to_vec())]);
    let d = delta::encode::<Bytes>(&head, Base::of(3, &held.content_digest()), &[delta::Op::Keep]);
    let e = verify_delta(&d, &key().verifying_key(), "m", "n", applied(&held), &held).unwrap_err();
    assert!(matches!(e, BundleError::TooLarge { .. }), "{e:?}");
}
