//! The JSON bodies of every endpoint that takes one, read as the server's `Body<T, MAX>` reads
//! them (serde_json, unknown fields refused), then handed to the library functions the controller
//! hands them to. The first byte chooses the endpoint: `/v1/enrol`, `/v1/renew`, `/v1/evidence`,
//! `/v1/admin/apply`, `/v1/admin/tokens`, and `/v1/admin/apply` in trellis's own form
//! (`proto::declaration`: what decodes encodes back to the same bytes).
//!
//! Every body that reads writes back as JSON that reads as the same value. Every string the
//! controller stores from a body and shows to an operator shows through `printable` without a
//! control character. A declaration is loaded as the controller loads it and compiles
//! deterministically; a token for the requested node encodes and reads back.
//!
//! The controller's own shape checks (`enrolment::well_formed`, `declarations::valid_path`,
//! the evidence bounds) are not called: they live in `trellis-controller`, whose dependencies
//! (sqlx with a bundled SQLite, the PostgreSQL driver) would make a clean build of this crate
//! several times longer than CI's bounded pass allows. Nor is a CSR signed (`trellis-pki`, with
//! rustls and ring, would double the build): the controller parses one only after a valid
//! token or from an authenticated node, and the parser is rcgen's.
#![no_main]

use base64::Engine;
use libfuzzer_sys::fuzz_target;
use serde::de::DeserializeOwned;
use serde::Serialize;
use trellis_core::decl::PublicKey;
use trellis_core::token::EnrolmentToken;
use trellis_fuzz::assert_terminal_safe;
use trellis_proto as proto;
use trellis_proto::text::printable;

fuzz_target!(|data: &[u8]| {
    let Some((&which, body)) = data.split_first() else { return };
    match which % 6 {
        0 => enrol(body),
        1 => renew(body),
        2 => evidence(body),
        3 => apply(body),
        4 => token(body),
        _ => apply_binary(body),
    }
});

/// A body read as the server reads it; what reads writes back as JSON that reads the same.
fn read<T: DeserializeOwned + Serialize>(body: &[u8]) -> Option<T> {
    let value: T = serde_json::from_slice(body).ok()?;
    let json = serde_json::to_vec(&value).expect("a body that was read can be written");
    let back: T = serde_json::from_slice(&json).unwrap_or_else(|e| panic!("{} does not read back: {e}", String::from_utf8_lossy(&json)));
    assert_eq!(serde_json::to_value(&back).expect("written"), serde_json::to_value(&value).expect("written"));
    Some(value)
}

fn enrol(body: &[u8]) {
    let Some(req) = read::<proto::EnrolRequest>(body) else { return };
    // The token id and node name are audited, refused or not, and listed by `trellis audit`.
    for field in [&req.token_id, &req.node] {
        shown(field);
    }
    let secret = base64::engine::general_purpose::STANDARD.decode(&req.secret).ok().filter(|s| s.len() == 24);
    let key = PublicKey::parse(&req.wireguard_public_key);
    if let Some(k) = key {
        assert_eq!(PublicKey::parse(&k.to_string()), Some(k), "a key reads back from how it is shown");
    }
    if let Some(s) = secret {
        assert_eq!(base64::engine::general_purpose::STANDARD.encode(s), req.secret, "a secret is read in one spelling only");
    }
}

/// A stored string as an operator sees it: nothing in it moves the cursor or ends the line, and
/// a string with nothing to escape shows as it is.
fn shown(s: &str) {
    let p = printable(s);
    assert_terminal_safe(&p);
    if !s.chars().any(trellis_fuzz::moves_the_terminal) {
        assert_eq!(p, s, "a string with nothing to escape is shown as it is");
    }
}

fn renew(body: &[u8]) {
    drop(read::<proto::RenewRequest>(body));
}

fn evidence(body: &[u8]) {
    let Some(batch) = read::<proto::EvidenceBatch>(body) else { return };
    if batch.records.len() > proto::MAX_EVIDENCE_BATCH {
        return;
    }
    for r in &batch.records {
        // `trellis status` shows the last error; the files are stored as JSON and read back.
        if let Some(e) = &r.error {
            shown(e);
        }
        for f in &r.files {
            shown(&f.path);
            shown(&f.sha256);
        }
        let files = serde_json::to_string(&r.files).expect("files are written");
        assert_eq!(serde_json::from_str::<Vec<proto::EvidenceFile>>(&files).expect("files read back"), r.files);
    }
}

/// The declaration in trellis's own form, as the server's `Declaration` reads it: one encoding
/// of each request, so what decodes encodes back to the very bytes; then loaded as JSON's is.
fn apply_binary(body: &[u8]) {
    let Ok(req) = proto::declaration::decode(body) else { return };
    assert_eq!(proto::declaration::encode(&req), body, "decoded and encoded again");
    loaded(req);
}

fn apply(body: &[u8]) {
    let Some(req) = read::<proto::ApplyRequest>(body) else { return };
    loaded(req);
}

/// A declaration loaded as the controller loads it, compiled twice alike.
fn loaded(req: proto::ApplyRequest) {
    let files: Vec<(String, String)> = req.files.iter().map(|f| (f.path.clone(), f.text.clone())).collect();
    // As `declarations::load_files` loads a submitted or stored revision.
    let loaded = trellis_core::load_relative(&files, str::to_string);
    for d in &loaded.diagnostics {
        shown(&d.loc.file);
    }
    let Some(decl) = loaded.declaration else { return };
    drop(trellis_core::explain::check(&decl));
    let decl = std::sync::Arc::new(decl);
    if let Ok(c) = trellis_core::compile(&decl, &Default::default(), &Default::default(), None) {
        let again = trellis_core::compile(&decl, &Default::default(), &Default::default(), None).expect("compiles again");
        assert_eq!(c.allocation, again.allocation);
        assert_eq!(c.nodes.keys().collect::<Vec<_>>(), again.nodes.keys().collect::<Vec<_>>());
    }
}

fn token(body: &[u8]) {
    let Some(req) = read::<proto::TokenRequest>(body) else { return };
    shown(&req.node);
    let token = EnrolmentToken {
        controllers: vec!["198.51.100.2:8443".into(), "[2001:db8::2]:8443".into()],
        ca_fingerprint: [7; 32],
        id: [1; 8],
        secret: [2; 24],
        node: req.node,
        expires: 1_800_000_000u64.saturating_add(req.ttl_secs),
    };
    if let Ok(text) = token.encode() {
        assert_eq!(EnrolmentToken::decode(&text), Ok(token));
    }
}
