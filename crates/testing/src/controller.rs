//! The controller in process, as its decisions are tested: built with `Controller::new` on a
//! fresh database, with a clock the test moves and randomness the test knows; enrolment
//! requests as an agent makes them; a shipped lab declaration as the files an apply sends.

use std::path::Path;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use base64::Engine;
use trellis_controller::{state::Config, Clock, Controller, Entropy, Keys};
use trellis_core::token::EnrolmentToken;
use trellis_proto as proto;
use trellis_store::Store;

use crate::Database;

/// The fixture's clock at the start, in Unix seconds (the CA's certificate starts then too).
pub const T0: i64 = 1_900_000_000;
/// The fixture's admin credential.
pub const ADMIN: &str = "trellis-admin-test";

/// A clock that moves only when the test says so (`clock.0.store(T0 + 60, ...)`).
pub struct TestClock(pub AtomicI64);

impl Clock for TestClock {
    fn now(&self) -> i64 {
        self.0.load(Ordering::SeqCst)
    }
}

/// Bytes that count up from one, so token ids are known in advance; each further run of 256
/// bytes is XORed with its number, so that token ids do not repeat after eight tokens.
pub struct Counting(pub AtomicU64);

impl Entropy for Counting {
    fn fill(&self, buf: &mut [u8]) {
        for b in buf {
            let n = self.0.fetch_add(1, Ordering::SeqCst);
            *b = (n as u8).wrapping_add(1) ^ (n >> 8) as u8;
        }
    }
}

/// A controller with nothing applied, its clock, and the database it is on. A SQLite database
/// is removed once the last clone of `db` is dropped: a caller that moves `c` out (an `async
/// move` block naming only `fx.c` drops the rest at once) keeps a clone of the database.
pub struct Fixture {
    pub c: Controller,
    pub clock: Arc<TestClock>,
    pub db: Database,
}

/// A controller on `db`, at [`T0`] by a [`TestClock`], drawing from [`Counting`] from zero,
/// with a fresh CA and services CA, the signing key `[7; 32]` and the admin credential [`ADMIN`].
pub async fn controller(db: Database) -> Fixture {
    use sha2::Digest;
    let store = Store::open(&db).await.unwrap_or_else(|e| panic!("open {db}: {e}"));
    let ca = trellis_pki::create_ca("trellis", UNIX_EPOCH + Duration::from_secs(T0 as u64), [0xca; 16]).unwrap();
    let ca = trellis_pki::Ca::load(&ca.cert_pem, &ca.key_pem).unwrap();
    let services = ca.services_ca("trellis", UNIX_EPOCH + Duration::from_secs(T0 as u64), [0x5e; 16]).unwrap();
    let keys = Keys {
        services: Some(trellis_pki::ServicesCa::load(&services.cert_pem, &services.key_pem).unwrap()),
        ca,
        signing_key: ed25519_dalek::SigningKey::from_bytes(&[7; 32]),
        admin_sha256: sha2::Sha256::digest(ADMIN.as_bytes()).into(),
    };
    let config = Config {
        advertise: vec!["127.0.0.1:8443".into()],
        listen: "127.0.0.1:8443".into(),
        database_url: db.to_string(),
        admin_token_sha256: String::new(),
        node_cert_secs: 3600,
        server_cert_secs: trellis_pki::SERVER_CERT_SECS,
    };
    let clock = Arc::new(TestClock(AtomicI64::new(T0)));
    let c = Controller::new(store, config, keys, clock.clone(), Arc::new(Counting(AtomicU64::new(0))));
    Fixture { c, clock, db }
}

/// The files of the shipped declaration `lab/NAME` (`mesh.toml`, then `modules/*.toml` by
/// name), as an apply sends them.
pub fn lab_files(name: &str) -> Vec<proto::DeclFile> {
    let dir = crate::repo().join("lab").join(name);
    let read = |path: &str| {
        let p = dir.join(path);
        proto::DeclFile { path: path.into(), text: std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())) }
    };
    let mut files = vec![read("mesh.toml")];
    let modules = dir.join("modules");
    let mut names: Vec<String> = std::fs::read_dir(&modules)
        .unwrap_or_else(|e| panic!("{}: {e}", modules.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| Path::new(n).extension().is_some_and(|x| x == "toml"))
        .collect();
    names.sort();
    files.extend(names.iter().map(|n| read(&format!("modules/{n}"))));
    files
}

/// A WireGuard public key made of `byte` (any 32 bytes are one), in base64.
pub fn wireguard_key(byte: u8) -> String {
    base64::engine::general_purpose::STANDARD.encode([byte; 32])
}

/// The request an agent sends to redeem `token` with the WireGuard public key given, and the
/// private key (PEM) of the CSR in it.
pub fn enrol_request(token: &EnrolmentToken, wireguard_public_key: String) -> (proto::EnrolRequest, String) {
    let (key, csr) = trellis_pki::node_key_and_csr(&token.node).unwrap();
    let req = proto::EnrolRequest {
        token_id: trellis_core::token::hex(&token.id),
        secret: base64::engine::general_purpose::STANDARD.encode(token.secret),
        node: token.node.clone(),
        csr_pem: csr,
        wireguard_public_key,
    };
    (req, key)
}
