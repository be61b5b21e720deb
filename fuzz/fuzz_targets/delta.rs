//! Bundle deltas, as the agent reads them from the network (`trellis_core::delta`, ADR 0033).
//! A delta made between two inputs (the held file and the next one, each the content of a
//! bundle's `wireguard.conf`) builds exactly the next bundle; the same delta with its ops
//! replaced by any bytes is refused or builds exactly that bundle (the signed head binds every
//! file); and edits of any bytes never build more than the length they are given.
#![no_main]

use ed25519_dalek::SigningKey;
use libfuzzer_sys::fuzz_target;
use trellis_core::bundle::{verify_delta, Applied, Bundle, BundleFile};
use trellis_core::delta;

fn bundle(version: u64, conf: &[u8]) -> Bundle {
    let files = vec![
        BundleFile::new("etc/trellis/node.toml", 0o644, &b"node = 1\n"[..]),
        BundleFile::new("etc/trellis/wireguard.conf", 0o600, conf.to_vec()),
    ];
    Bundle { mesh: "m".into(), node: "n".into(), version, issued_at: 1, files }
}

/// The hunks widened to lines and to list items put into `base` give `new`, the bytes between
/// them the same in both.
fn regions_rebuild(base: &[u8], new: &[u8], hunks: &[delta::Hunk]) {
    for seps in [&b"\n"[..], b",\n"] {
        let regions = delta::widen(base, new, hunks, seps, |_, _| true).expect("the hunks fit the texts they were made of");
        let (mut old_at, mut new_at, mut patched) = (0, 0, Vec::new());
        for r in &regions {
            assert_eq!(base[old_at..r.old.start], new[new_at..r.new.start], "the texts differ outside the regions");
            patched.extend_from_slice(&base[old_at..r.old.start]);
            patched.extend_from_slice(&new[r.new.clone()]);
            (old_at, new_at) = (r.old.end, r.new.end);
        }
        assert_eq!(base[old_at..], new[new_at..], "the texts differ after the last region");
        patched.extend_from_slice(&base[old_at..]);
        assert_eq!(patched, new);
    }
}

fuzz_target!(|data: &[u8]| {
    // The first byte says where the held file ends and the next one (or the ops) starts.
    let Some((&cut, rest)) = data.split_first() else { return };
    let at = (cut as usize * rest.len()) / 255;
    let (base, other) = rest.split_at(at);
    if let Ok((built, hunks)) = delta::rebuild_with_hunks(base, other, 4096, "f") {
        assert_eq!(built.len(), 4096, "edits built another length than asked");
        // The hunks of any edits, widened to lines (ADR 0035): outside them the base and the
        // result agree, and the base with them put in gives the result.
        if let Some(hunks) = hunks {
            regions_rebuild(base, &built, &hunks);
        }
    }
    let key = SigningKey::from_bytes(&[9; 32]);
    let (held, next) = (bundle(1, base), bundle(2, other));
    let edits = delta::Edits { base: held.files[1].sha256, edits: delta::edits(base, other).into() };
    let is_held = |d: &[u8; 32]| held.files.iter().any(|f| f.sha256 == *d);
    let ops: Vec<_> = next.files.iter().map(|f| delta::op(&f.sha256, &f.content, Some(&edits), &is_held)).collect();
    let head = next.sign(&key).head;
    let made = delta::encode(&head, delta::Base::of(1, &held.content_digest()), &ops);
    let applied = Some(Applied { version: 1, digest: Some(held.content_digest()) });
    let v =
        verify_delta(&made, &key.verifying_key(), "m", "n", applied, &held).expect("a delta made between two bundles builds the second");
    assert_eq!(v.bundle, next);
    for e in &v.edited {
        regions_rebuild(base, other, &e.hunks);
    }
    // The same head and base with any ops: refused, or exactly the next bundle.
    let mut forged = made[..4 + 4 + head.len() + 16].to_vec();
    forged.extend_from_slice(base);
    if let Ok(v) = verify_delta(&forged, &key.verifying_key(), "m", "n", applied, &held) {
        assert_eq!(v.bundle, next, "a delta built other files than the signed head names");
    }
});
