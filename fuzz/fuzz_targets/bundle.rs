//! Bundle verification, as the agent runs it on what a controller sends. The first byte chooses:
//! bit 0 clear, the rest is the bundle as received (what anyone who could alter it sends: it
//! must be refused at the envelope or the signature); set, the rest is what follows the
//! signature and the harness signs the manifest with the controller's key, so the manifest and
//! contents behind the signature are the fuzzer's. Bits 1-2 choose what the node last applied;
//! bit 3 verifies a freshness stamp instead.
//!
//! A bundle that verifies is canonical (signing what was read gives back the bytes that were
//! read), carries only delivered files with their digests, is recognised as a re-delivery, and
//! is refused as a rollback by a node that holds a newer version.
#![no_main]

use ed25519_dalek::Signer;
use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use trellis_core::bundle::{self, Applied, BundleError};
use trellis_core::compile::{DELIVERED, MESH_ZONE, WIREGUARD_CONF};
use trellis_fuzz::{signing_key, MESH, NODE};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    let key = signing_key();
    let verifying = key.verifying_key();
    let signed = mode & 1 == 1;
    if mode & 8 != 0 {
        let bytes = if signed && rest.len() >= 64 {
            let mut out = b"TRF1".to_vec();
            out.extend_from_slice(&key.sign(&rest[64..]).to_bytes());
            out.extend_from_slice(&rest[64..]);
            out
        } else {
            rest.to_vec()
        };
        if let Ok(at) = bundle::verify_stamp(&bytes, &verifying, MESH) {
            assert_eq!(bundle::sign_stamp(&key, MESH, at), bytes, "a stamp that verifies is the one signed for its time");
        }
        return;
    }
    let bytes = if signed { trellis_fuzz::sign_envelope(rest) } else { rest.to_vec() };
    let last = match (mode >> 1) & 3 {
        0 => None,
        1 => Some(Applied { version: 0, digest: None }),
        2 => Some(Applied { version: 1, digest: None }),
        _ => Some(Applied { version: 1, digest: Some([0; 32]) }),
    };
    let Ok(v) = bundle::verify(&bytes, &verifying, MESH, NODE, last) else { return };
    let b = &v.bundle;
    assert_eq!(b.sign(&key).to_vec(), bytes, "a bundle that verifies is the one signed for what it says");
    assert_eq!((b.mesh.as_str(), b.node.as_str()), (MESH, NODE));
    let mut paths: Vec<&str> = b.files.iter().map(|f| f.path.as_str()).collect();
    paths.sort_unstable();
    paths.dedup();
    assert_eq!(paths.len(), b.files.len(), "a path appears twice");
    for f in &b.files {
        assert!(DELIVERED.contains(&f.path.as_str()) && f.mode <= 0o777, "{:?} mode {:o}", f.path, f.mode);
        assert_eq!(<[u8; 32]>::from(Sha256::digest(&f.content)), f.sha256, "{}", f.path);
        // What the agent and the lab read of what they were given.
        if let Ok(text) = std::str::from_utf8(&f.content) {
            match f.path.as_str() {
                WIREGUARD_CONF => drop(trellis_core::wgconf::parse(text)),
                MESH_ZONE => drop(trellis_core::zone::parse(text)),
                _ => {}
            }
        }
    }
    let held = Applied { version: b.version, digest: Some(b.content_digest()) };
    let again = bundle::verify(&bytes, &verifying, MESH, NODE, Some(held)).expect("the same bundle again verifies");
    assert!(again.redelivery, "the version held, with the same content, is a re-delivery");
    if let Some(newer) = b.version.checked_add(1) {
        assert_eq!(
            bundle::verify(&bytes, &verifying, MESH, NODE, Some(Applied { version: newer, digest: None })).unwrap_err(),
            BundleError::NotNewer { version: b.version, last: newer }
        );
    }
});
