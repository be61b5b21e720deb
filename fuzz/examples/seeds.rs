//! Writes the seed corpus of every fuzz target (`fuzz/seeds/TARGET/`) from what the code makes:
//! tokens it encodes, the lab's declarations and lab files, and the bundle, `wireguard.conf` and
//! `mesh.zone` of compiling them, so that mutations start from inputs that reach deep.
//!
//! `cargo run --manifest-path fuzz/Cargo.toml --example seeds` (from the repository root).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};
use trellis_core::bundle::{Bundle, BundleFile};
use trellis_core::compile::{CA_PEM, MESH_ZONE, NODE_PEM, WIREGUARD_CONF};
use trellis_core::decl::PublicKey;
use trellis_core::token::EnrolmentToken;
use trellis_fuzz::{join_files, sign_envelope, signing_key, token_text, SIGNED_AT};

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let seeds = root.join("fuzz/seeds");
    let mut out = Seeds { dir: seeds };

    let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
    let ca_pair = trellis_pki::create_ca(trellis_fuzz::MESH, now, [1; 16]).expect("a CA");
    let ca = trellis_pki::Ca::load(&ca_pair.cert_pem, &ca_pair.key_pem).expect("the CA loads");

    // Tokens: as pasted, and as a payload the harness completes with its checksum.
    let tokens = [
        EnrolmentToken {
            controllers: vec!["198.51.100.2:8443".into(), "[2001:db8::2]:8443".into()],
            ca_fingerprint: ca.fingerprint(),
            id: [1, 2, 3, 4, 5, 6, 7, 8],
            secret: [9; 24],
            node: "db-1".into(),
            expires: 1_900_000_000,
        },
        EnrolmentToken {
            controllers: vec!["controller.example:443".into()],
            ca_fingerprint: [0xab; 32],
            id: [0xff; 8],
            secret: [0; 24],
            node: "a".into(),
            expires: u64::MAX,
        },
    ];
    for (i, t) in tokens.iter().enumerate() {
        let text = t.encode().expect("encodes");
        out.put("token", &format!("text-{i}"), &[&[0], format!("  {text}\n").as_bytes()].concat());
        let payload = base64_payload(&text);
        assert_eq!(token_text(&payload), text);
        out.put("token", &format!("payload-{i}"), &[&[1], &payload[..]].concat());
    }
    out.put("token", "not-a-token", b"\0hello");

    // Declarations, lab files, and what compiling the lab's declarations gives.
    let mut labs: Vec<PathBuf> = std::fs::read_dir(root.join("lab")).expect("lab/").map(|e| e.expect("entry").path()).collect();
    labs.sort();
    for lab in &labs {
        let name = lab.file_stem().and_then(|s| s.to_str()).expect("a name").to_string();
        if lab.extension().is_some_and(|e| e == "toml") {
            out.put("labfile", &name, &std::fs::read(lab).expect("a lab file"));
            continue;
        }
        let files = files_of(lab);
        let modules: Vec<&str> = files[1..].iter().map(|(_, t)| t.as_str()).collect();
        out.put("declaration", &name, &join_files(&files[0].1, modules));
        let decl = trellis_core::load_relative(&files, str::to_string).declaration.unwrap_or_else(|| panic!("{name} loads"));
        let keys: trellis_core::Keys =
            decl.nodes.iter().map(|n| (n.name.clone(), PublicKey(Sha256::digest(n.name.as_bytes()).into()))).collect();
        let compiled = trellis_core::compile(&Arc::new(decl), &keys, &Default::default(), None).expect("compiles");
        for (node, output) in compiled.nodes.iter().take(2) {
            for f in &output.files {
                match f.path.as_str() {
                    WIREGUARD_CONF => out.put("wgconf", &format!("{name}-{node}"), &f.content.to_bytes()),
                    MESH_ZONE => out.put("zone", &format!("{name}-{node}"), &f.content.to_bytes()),
                    _ => {}
                }
            }
        }
        if name != trellis_fuzz::MESH {
            continue;
        }
        // A bundle as the controller publishes it for the node the bundle target verifies for.
        let output = &compiled.nodes[trellis_fuzz::NODE];
        let (key_pem, csr) = trellis_pki::node_key_and_csr(trellis_fuzz::NODE).expect("a CSR");
        drop(key_pem);
        let cert = ca.sign_node(&csr, trellis_fuzz::NODE, trellis_fuzz::MESH, now, Duration::from_secs(86400), [2; 16]).expect("signed");
        let mut files: Vec<BundleFile> = output.files.iter().map(|f| BundleFile::new(&f.path, f.mode, f.content.to_bytes())).collect();
        files.push(BundleFile::new(CA_PEM, 0o644, ca.cert_pem().as_bytes().to_vec()));
        files.push(BundleFile::new(NODE_PEM, 0o644, cert.cert_pem.into_bytes()));
        files.sort_by(|a, b| a.path.cmp(&b.path));
        let bundle = Bundle { mesh: name.clone(), node: trellis_fuzz::NODE.into(), version: 3, issued_at: 1_800_000_000, files };
        let signed = bundle.sign(&signing_key()).to_vec();
        assert_eq!(sign_envelope(&signed[SIGNED_AT..]), signed);
        for (mode, what) in [(0u8, "as-received"), (1, "signed"), (3, "signed-after-0"), (5, "signed-after-1"), (7, "signed-held-other")] {
            let body = if mode & 1 == 0 { &signed[..] } else { &signed[SIGNED_AT..] };
            out.put("bundle", what, &[&[mode], body].concat());
        }
        let small = Bundle { files: bundle.files[..1].to_vec(), ..bundle.clone() }.sign(&signing_key()).to_vec();
        out.put("bundle", "signed-one-file", &[&[1], &small[SIGNED_AT..]].concat());
        let stamp = trellis_core::bundle::sign_stamp(&signing_key(), trellis_fuzz::MESH, 1_800_000_000);
        out.put("bundle", "stamp-as-received", &[&[8], &stamp[..]].concat());
        out.put("bundle", "stamp-signed", &[&[9u8][..], &[0u8; 64], &stamp[SIGNED_AT..]].concat());

        // Request bodies, one per endpoint, as the client sends them.
        let enrol = trellis_proto::EnrolRequest {
            token_id: "0102030405060708".into(),
            secret: base64_std(&[9; 24]),
            node: trellis_fuzz::NODE.into(),
            csr_pem: csr.clone(),
            wireguard_public_key: keys.get(trellis_fuzz::NODE).expect("the node has a key").to_string(),
        };
        out.put("bodies", "enrol", &body(0, &enrol));
        out.put("bodies", "renew", &body(1, &trellis_proto::RenewRequest { csr_pem: csr }));
        let evidence = trellis_proto::EvidenceBatch {
            records: vec![trellis_proto::Evidence {
                seq: 1,
                version: 3,
                result: trellis_proto::EvidenceResult::Failed,
                error: Some("nft -f: exit status 1".into()),
                files: vec![trellis_proto::EvidenceFile {
                    path: WIREGUARD_CONF.into(),
                    sha256: "00".repeat(32),
                    result: trellis_proto::FileResult::Unchanged,
                }],
                at: 1_800_000_000,
                unmanaged: false,
            }],
        };
        out.put("bodies", "evidence", &body(2, &evidence));
        let apply = trellis_proto::ApplyRequest {
            files: files_of(lab).into_iter().map(|(path, text)| trellis_proto::DeclFile { path, text }).collect(),
            expect_revision: Some(1),
        };
        out.put("bodies", "apply", &body(3, &apply));
        out.put(
            "bodies",
            "token",
            &body(4, &trellis_proto::TokenRequest { node: "db-1".into(), ttl_secs: 3600, require_approval: true, ..Default::default() }),
        );
    }
}

struct Seeds {
    dir: PathBuf,
}

impl Seeds {
    fn put(&mut self, target: &str, name: &str, data: &[u8]) {
        let dir = self.dir.join(target);
        std::fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("cannot create {}: {e}", dir.display()));
        let path = dir.join(name);
        std::fs::write(&path, data).unwrap_or_else(|e| panic!("cannot write {}: {e}", path.display()));
    }
}

fn body(endpoint: u8, value: &impl serde::Serialize) -> Vec<u8> {
    [vec![endpoint], serde_json::to_vec(value).expect("JSON")].concat()
}

fn base64_std(b: &[u8]) -> String {
    use base64::Engine;
    base64::engine::general_purpose::STANDARD.encode(b)
}

/// A token's bytes before its checksum.
fn base64_payload(text: &str) -> Vec<u8> {
    use base64::Engine;
    let b = base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(&text[trellis_core::token::PREFIX.len()..]).expect("base64");
    b[..b.len() - 4].to_vec()
}

/// `mesh.toml` and `modules/*.toml` of a declaration directory, modules in name order.
fn files_of(dir: &Path) -> Vec<(String, String)> {
    let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_else(|e| panic!("cannot read {}: {e}", p.display()));
    let mut files = vec![("mesh.toml".to_string(), read(&dir.join("mesh.toml")))];
    let mut modules: Vec<PathBuf> = std::fs::read_dir(dir.join("modules")).expect("modules/").map(|e| e.expect("entry").path()).collect();
    modules.sort();
    for m in modules {
        let name = m.file_name().and_then(|n| n.to_str()).expect("a UTF-8 name");
        files.push((format!("modules/{name}"), read(&m)));
    }
    files
}
