//! The HTTP API through the real router and TLS stack, in process, on SQLite and PostgreSQL:
//! concurrent redemptions and every kind of bad input.

mod hardening;
mod openapi;

use std::path::Path;
use std::sync::Arc;

use base64::Engine;
use serde_json::{json, Value};
use trellis_controller::state::{self, InitOptions};
use trellis_core::token::EnrolmentToken;
use trellis_proto::AuditAction;
use trellis_server::Server;
use trellis_testing::{Database, TempDir};

struct Running {
    _dir: TempDir,
    _db: Database,
    ca_path: std::path::PathBuf,
    base: String,
    admin: String,
    http: reqwest::Client,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    /// The controller the server runs, for its metrics.
    controller: Arc<trellis_controller::Controller>,
    /// The server's `run`, which returns once it has stopped.
    done: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn start(database_url: Database) -> Running {
    start_with(database_url, trellis_server::Limits::default()).await
}

async fn start_with(database_url: Database, limits: trellis_server::Limits) -> Running {
    let dir = TempDir::new("api");
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let opts = InitOptions {
        advertise: vec![format!("127.0.0.1:{port}")],
        listen: Some(format!("127.0.0.1:{port}")),
        database_url: Some(database_url.to_string()),
        node_cert_secs: 3600,
    };
    let state = state::init(&dir.path().join("s"), &opts).await.unwrap();
    let server = Server::bind(&state, None, None).await.unwrap().with_limits(limits);
    let controller = server.controller.clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(server.run(async {
        let _ = rx.await;
    }));
    let ca = state.read("ca.pem").unwrap();
    let http = reqwest::Client::builder().use_preconfigured_tls(trellis_pki::tls::client_config(&ca, None).unwrap()).build().unwrap();
    let admin = state.read("admin.token").unwrap().trim().to_string();
    let r = Running {
        ca_path: dir.path().join("s/ca.pem"),
        _dir: dir,
        _db: database_url,
        base: format!("https://127.0.0.1:{port}"),
        admin,
        http,
        stop: Some(tx),
        controller,
        done: Some(done),
    };
    let files = trellis_testing::controller::lab_files("basic");
    let (status, body) = r.admin_post("/v1/admin/apply", json!({"files": files})).await;
    assert_eq!(status, 200, "{body}");
    r
}

impl Running {
    async fn admin_post(&self, path: &str, body: Value) -> (u16, Value) {
        let resp = self.http.post(format!("{}{path}", self.base)).bearer_auth(&self.admin).json(&body).send().await.unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap_or(Value::Null))
    }

    async fn admin_get(&self, path: &str) -> Value {
        self.http.get(format!("{}{path}", self.base)).bearer_auth(&self.admin).send().await.unwrap().json().await.unwrap()
    }

    async fn token(&self, node: &str) -> EnrolmentToken {
        let (status, body) = self.admin_post("/v1/admin/tokens", json!({"node": node, "ttl_secs": 600})).await;
        assert_eq!(status, 200, "{body}");
        EnrolmentToken::decode(body["token"].as_str().unwrap()).unwrap()
    }

    async fn token_state(&self, id: &[u8]) -> String {
        let list = self.admin_get("/v1/admin/tokens").await;
        let id = trellis_core::token::hex(id);
        list.as_array().unwrap().iter().find(|t| t["id"] == id.as_str()).unwrap()["state"].as_str().unwrap().to_string()
    }

    /// Sends raw bytes over TLS and returns whatever the controller answers before it closes.
    async fn raw_request(&self, request: &str) -> String {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let ca = std::fs::read_to_string(&self.ca_path).unwrap();
        let cfg = trellis_pki::tls::client_config(&ca, None).unwrap();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
        let addr = self.base.trim_start_matches("https://").to_string();
        let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let mut tls = connector.connect(name, tcp).await.unwrap();
        tls.write_all(request.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let mut out = Vec::new();
        while let Ok(Ok(n)) = tokio::time::timeout(std::time::Duration::from_secs(5), tls.read(&mut buf)).await {
            if n == 0 {
                break;
            }
            out.extend_from_slice(&buf[..n]);
            if String::from_utf8_lossy(&out).contains("\"code\"") {
                break;
            }
        }
        String::from_utf8_lossy(&out).to_string()
    }

    /// As `post_raw`, with the admin credential.
    async fn admin_post_raw(&self, path: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        let resp = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(&self.admin)
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("answers are JSON, got {status}: {text}")))
    }

    async fn post_raw(&self, path: &str, content_type: &str, body: Vec<u8>) -> (u16, Value) {
        let resp = self.http.post(format!("{}{path}", self.base)).header("content-type", content_type).body(body).send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        (status, serde_json::from_str(&text).unwrap_or_else(|_| panic!("error bodies are JSON, got {status}: {text}")))
    }
}

fn enrol_body(t: &EnrolmentToken, key_byte: u8) -> Value {
    let (req, _key) = trellis_testing::controller::enrol_request(t, trellis_testing::controller::wireguard_key(key_byte));
    serde_json::to_value(req).unwrap()
}

async fn backends() -> Vec<Database> {
    trellis_testing::databases().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_concurrent_redemptions_of_one_token_have_one_winner() {
    for url in backends().await {
        let r = Arc::new(start(url.clone()).await);
        let t = r.token("db-1").await;
        let tasks: Vec<_> = (0..20u8)
            .map(|i| {
                let r = r.clone();
                let body = enrol_body(&t, i + 1);
                tokio::spawn(async move { r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&body).unwrap()).await })
            })
            .collect();
        let mut ok = 0;
        let mut used = 0;
        for task in tasks {
            let (status, body) = task.await.unwrap();
            match status {
                200 => ok += 1,
                409 if body["error"] == "token already used" => used += 1,
                _ => panic!("{url}: unexpected {status} {body}"),
            }
        }
        assert_eq!((ok, used), (1, 19), "{url}");
        // The first five refused redemptions from one address in a minute are audited one by
        // one; the other 14 are counted and written as one record when the minute is over (see
        // the controller's `refused_redemptions_are_audited_counted_then_turned_away_per_source`).
        let audit = r.admin_get("/v1/admin/audit").await;
        let refused = audit.as_array().unwrap().iter().filter(|a| a["action"] == AuditAction::TokenRedemptionRefused.as_str()).count();
        assert_eq!(refused, 5, "{url}: {audit}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_4xx_sentence_and_changes_nothing() {
    for url in backends().await {
        let r = start(url.clone()).await;
        let t = r.token("op-1").await;
        let good = enrol_body(&t, 9);

        // A body announced as larger than the bound is refused from its headers, before it is read.
        let head = r
            .raw_request("POST /v1/enrol HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000\r\n\r\n{")
            .await;
        assert!(head.starts_with("HTTP/1.1 413"), "{head}");
        assert!(head.contains("the request body is larger than this endpoint accepts"), "{head}");

        let (s, b) = r.post_raw("/v1/enrol", "application/json", b"{\"token_id\": ".to_vec()).await;
        assert_eq!(s, 400, "{b}");
        assert!(b["error"].as_str().unwrap().starts_with("the request body is not valid JSON"), "{b}");

        let mut extra = good.clone();
        extra["scope"] = json!("all");
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&extra).unwrap()).await;
        assert_eq!(s, 422, "{b}");
        assert!(b["error"].as_str().unwrap().contains("unknown field `scope`"), "{b}");

        let (s, b) = r.post_raw("/v1/enrol", "text/plain", serde_json::to_vec(&good).unwrap()).await;
        assert_eq!(s, 415, "{b}");

        let mut bad_csr = good.clone();
        bad_csr["csr_pem"] = json!("-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n");
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&bad_csr).unwrap()).await;
        assert_eq!(s, 400, "{b}");
        assert!(b["error"].as_str().unwrap().starts_with("certificate signing request is not valid"), "{b}");

        // A CSR whose signature does not match its key: flip a bit in the signature.
        let csr = good["csr_pem"].as_str().unwrap();
        let mut der = trellis_pki::pem_to_der(csr, "CERTIFICATE REQUEST").unwrap();
        let last = der.len() - 3;
        der[last] ^= 0x01;
        let mut forged = good.clone();
        forged["csr_pem"] = json!(format!(
            "-----BEGIN CERTIFICATE REQUEST-----\n{}\n-----END CERTIFICATE REQUEST-----\n",
            base64::engine::general_purpose::STANDARD.encode(&der)
        ));
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&forged).unwrap()).await;
        assert_eq!(s, 400, "{b}");
        assert!(b["error"].as_str().unwrap().starts_with("certificate signing request is not valid"), "{b}");

        let mut wrong_secret = good.clone();
        wrong_secret["secret"] = json!(base64::engine::general_purpose::STANDARD.encode([0u8; 24]));
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&wrong_secret).unwrap()).await;
        assert_eq!((s, b["error"].as_str()), (401, Some("token secret does not match; copy the token again")), "{b}");

        // Nothing changed: the token is still valid, the node still only declared.
        assert_eq!(r.token_state(&t.id).await, "valid", "{url}");
        let nodes = r.admin_get("/v1/admin/nodes").await;
        let op = nodes.as_array().unwrap().iter().find(|n| n["name"] == "op-1").unwrap();
        assert_eq!(op["state"], "declared", "{url}");

        // And the good request still works afterwards.
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&good).unwrap()).await;
        assert_eq!(s, 200, "{b}");
    }
}

/// A declaration in trellis's own form (`proto::declaration`) applies as its JSON does: the same
/// files are the same revision, a change is the next one with its expectation kept; a body that
/// does not read is refused with a sentence that says where, and changes nothing; JSON is still
/// taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declaration_in_trellis_own_form_applies_as_its_json_does() {
    use trellis_proto::declaration::{encode, MEDIA_TYPE};
    let r = start(Database::sqlite()).await;
    let files: Vec<trellis_proto::DeclFile> = serde_json::from_value(json!(trellis_testing::controller::lab_files("basic"))).unwrap();
    let req =
        |files: Vec<trellis_proto::DeclFile>, expect: Option<i64>| encode(&trellis_proto::ApplyRequest { files, expect_revision: expect });
    let (s, b) = r.admin_post_raw("/v1/admin/apply", MEDIA_TYPE, req(files.clone(), None)).await;
    assert_eq!((s, b["revision"].as_i64(), b["unchanged"].as_bool()), (200, Some(1), Some(true)), "{b}");
    let mut changed = files.clone();
    let mesh = changed.iter_mut().find(|f| f.path == "mesh.toml").unwrap();
    mesh.text.push_str("\n# one line more\n");
    let (s, b) = r.admin_post_raw("/v1/admin/apply", MEDIA_TYPE, req(changed.clone(), Some(5))).await;
    assert_eq!((s, b["code"].as_str()), (409, Some("revision_conflict")), "the expectation is read from the body: {b}");
    let (s, b) = r.admin_post_raw("/v1/admin/apply", MEDIA_TYPE, req(changed.clone(), Some(1))).await;
    assert_eq!((s, b["revision"].as_i64(), b["unchanged"].as_bool()), (200, Some(2), Some(false)), "{b}");
    // Cut short, or not UTF-8: refused, saying where; the revision stays.
    let whole = req(files.clone(), None);
    let (s, b) = r.admin_post_raw("/v1/admin/apply", MEDIA_TYPE, whole[..whole.len() - 3].to_vec()).await;
    assert_eq!(s, 400, "{b}");
    assert!(b["error"].as_str().unwrap().contains("the declaration body does not read: the body ends at byte"), "{b}");
    let (s, b) = r.admin_post_raw("/v1/admin/apply", MEDIA_TYPE, b"TRDECL1\n\x80".to_vec()).await;
    assert_eq!(s, 400, "{b}");
    let (s, b) = r.admin_post_raw("/v1/admin/apply", MEDIA_TYPE, req(changed, Some(2))).await;
    assert_eq!((s, b["revision"].as_i64(), b["unchanged"].as_bool()), (200, Some(2), Some(true)), "revision 2 stands: {b}");
    // JSON as ever.
    let (s, b) = r.admin_post("/v1/admin/apply", json!({"files": files})).await;
    assert_eq!((s, b["revision"].as_i64()), (200, Some(3)), "{b}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_and_node_endpoints_refuse_without_credentials() {
    let r = start(Database::sqlite()).await;
    let resp = r.http.get(format!("{}/v1/admin/nodes", r.base)).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let resp = r.http.get(format!("{}/v1/admin/nodes", r.base)).bearer_auth("trellis-admin-0000").send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let b: Value = resp.json().await.unwrap();
    assert_eq!(b["error"], "the admin credential is wrong");
    let resp = r.http.get(format!("{}/v1/whoami", r.base)).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 401);
    let b: Value = resp.json().await.unwrap();
    assert_eq!(b["code"], "node_certificate_required");
    let (s, b) = r.admin_post("/v1/admin/apply", json!({"files": [{"path": "../etc/passwd", "text": ""}]})).await;
    assert_eq!(s, 400, "{b}");
}

/// An enrolled node as the tests hold it: a client presenting its certificate.
#[derive(Clone)]
struct Node {
    http: reqwest::Client,
    signing: ed25519_dalek::VerifyingKey,
    node: String,
    key: String,
    ca: String,
}

impl Running {
    async fn enrol_node(&self, node: &str, key_byte: u8, approval: bool) -> Node {
        let (status, body) =
            self.admin_post("/v1/admin/tokens", json!({"node": node, "ttl_secs": 600, "require_approval": approval})).await;
        assert_eq!(status, 200, "{body}");
        let t = EnrolmentToken::decode(body["token"].as_str().unwrap()).unwrap();
        let (key, csr) = trellis_pki::node_key_and_csr(node).unwrap();
        let mut req = enrol_body(&t, key_byte);
        req["csr_pem"] = json!(csr);
        let (s, resp) = self.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&req).unwrap()).await;
        assert_eq!(s, 200, "{resp}");
        let ca = std::fs::read_to_string(&self.ca_path).unwrap();
        let cfg = trellis_pki::tls::client_config(&ca, Some((resp["node_cert_pem"].as_str().unwrap(), &key))).unwrap();
        let http = reqwest::Client::builder().use_preconfigured_tls(cfg).build().unwrap();
        let sk: [u8; 32] =
            base64::engine::general_purpose::STANDARD.decode(resp["signing_public_key"].as_str().unwrap()).unwrap().try_into().unwrap();
        Node { http, signing: ed25519_dalek::VerifyingKey::from_bytes(&sk).unwrap(), node: node.to_string(), key, ca }
    }
}

struct Fetched {
    status: u16,
    version: Option<u64>,
    bytes: Vec<u8>,
    stamp: Option<Vec<u8>>,
}

impl Node {
    async fn fetch(&self, base: &str, held: Option<u64>, wait: u64) -> Fetched {
        let mut req = self.http.get(format!("{base}/v1/bundle?wait={wait}"));
        if let Some(v) = held {
            req = req.header("if-none-match", format!("\"{v}\""));
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let version = resp
            .headers()
            .get("etag")
            .and_then(|v| v.to_str().ok())
            .and_then(trellis_proto::etag::BundleTag::parse)
            .map(|t| t.version as u64);
        let stamp = resp
            .headers()
            .get(trellis_proto::FRESHNESS_HEADER)
            .map(|v| base64::engine::general_purpose::STANDARD.decode(v.as_bytes()).unwrap());
        Fetched { status, version, bytes: resp.bytes().await.unwrap().to_vec(), stamp }
    }

    fn open(&self, f: &Fetched, node: &str) -> trellis_core::bundle::Bundle {
        trellis_core::bundle::verify(&f.bytes, &self.signing, "basic", node, None).unwrap_or_else(|e| panic!("{e}")).bundle
    }

    /// The same node presenting another certificate for the same key.
    fn with_cert(&self, cert_pem: &str) -> Node {
        let cfg = trellis_pki::tls::client_config(&self.ca, Some((cert_pem, &self.key))).unwrap();
        let http = reqwest::Client::builder().use_preconfigured_tls(cfg).build().unwrap();
        Node { http, ..self.clone() }
    }

    async fn renew(&self, base: &str) -> (u16, Value) {
        let csr = trellis_pki::csr_from_key(&self.key, &self.node).unwrap();
        let resp = self.http.post(format!("{base}/v1/renew")).json(&json!({"csr_pem": csr})).send().await.unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }

    async fn whoami(&self, base: &str) -> u16 {
        self.http.get(format!("{base}/v1/whoami")).send().await.unwrap().status().as_u16()
    }

    async fn evidence(&self, base: &str, records: Value) -> (u16, Value) {
        let resp = self.http.post(format!("{base}/v1/evidence")).json(&json!({"records": records})).send().await.unwrap();
        (resp.status().as_u16(), resp.json().await.unwrap())
    }
}

fn file<'a>(b: &'a trellis_core::bundle::Bundle, path: &str) -> &'a str {
    std::str::from_utf8(&b.files.iter().find(|f| f.path == path).unwrap_or_else(|| panic!("no {path}")).content).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bundles_are_versioned_signed_long_polled_and_answered_304() {
    for url in backends().await {
        let r = Arc::new(start(url.clone()).await);
        let db = r.enrol_node("db-1", 1, false).await;
        let api = r.enrol_node("api-1", 2, false).await;
        // Enrolments return before publishing: db-1's first bundle may predate api-1's, and the
        // next one, long-polled, follows within moments.
        let api_key = base64::engine::general_purpose::STANDARD.encode([2u8; 32]);
        let mut first = db.fetch(&r.base, None, 0).await;
        assert_eq!(first.status, 200, "{url}");
        if !file(&db.open(&first, "db-1"), "etc/trellis/wireguard.conf").contains(&api_key) {
            first = db.fetch(&r.base, first.version, 10).await;
            assert_eq!(first.status, 200, "{url}: the bundle after api-1's enrolment comes within the long-poll");
        }
        let b1 = db.open(&first, "db-1");
        assert_eq!(Some(b1.version), first.version);
        let paths: Vec<&str> = b1.files.iter().map(|f| f.path.as_str()).collect();
        assert_eq!(
            paths,
            [
                "etc/trellis/ca.pem",
                "etc/trellis/mesh.zone",
                "etc/trellis/nftables.conf",
                "etc/trellis/node.pem",
                "etc/trellis/node.toml",
                "etc/trellis/trust.toml",
                "etc/trellis/wireguard.conf"
            ]
        );
        assert!(file(&b1, "etc/trellis/wireguard.conf").contains(&api_key), "db-1 peers with api-1");

        // Unchanged: 304, with a signed freshness stamp of now.
        let same = db.fetch(&r.base, Some(b1.version), 0).await;
        assert_eq!((same.status, same.version), (304, Some(b1.version)), "{url}");
        let at = trellis_core::bundle::verify_stamp(same.stamp.as_deref().unwrap(), &db.signing, "basic").unwrap();
        assert!((trellis_controller::unix_now() - at).abs() <= 2);

        // Long-poll: the answer comes when op-1 enrols (it gains traffic with db-1), well before the wait ends.
        let waiting = {
            let (r, held) = (r.clone(), b1.version);
            let db = db.clone();
            tokio::spawn(async move {
                let t = std::time::Instant::now();
                (db.fetch(&r.base, Some(held), 30).await, t.elapsed())
            })
        };
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        let op = r.enrol_node("op-1", 3, false).await;
        let (second, took) = waiting.await.unwrap();
        assert_eq!(second.status, 200, "{url}");
        assert!(took < std::time::Duration::from_secs(10), "{url}: long-poll took {took:?}");
        let b2 = db.open(&second, "db-1");
        assert!(b2.version > b1.version, "{url}: versions rise");
        assert!(file(&b2, "etc/trellis/wireguard.conf").contains(&base64::engine::general_purpose::STANDARD.encode([3u8; 32])));

        // Evidence: appended, re-sends ignored, gaps and errors visible; desired state unchanged.
        let rec = |seq: i64, v: u64, result: &str| json!({"seq": seq, "version": v, "result": result, "files": [], "at": 1});
        let (s, ack) = db
            .evidence(&r.base, json!([rec(1, b1.version, "applied"), rec(2, b2.version, "applied"), rec(1, b1.version, "applied")]))
            .await;
        assert_eq!((s, ack["accepted"].as_u64(), ack["duplicates"].as_u64()), (200, Some(2), Some(1)), "{ack}");
        let status = r.admin_get("/v1/admin/status").await;
        let st = status.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone();
        assert_eq!(
            (st["desired_version"].as_u64(), st["applied_version"].as_u64(), st["stale"].as_bool()),
            (Some(b2.version), Some(b2.version), Some(false)),
            "{st}"
        );
        let mut failed = rec(4, b2.version, "failed");
        failed["error"] = json!("nft: syntax error");
        db.evidence(&r.base, json!([failed])).await;
        let status = r.admin_get("/v1/admin/status").await;
        let st = status.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone();
        assert_eq!((st["evidence_missing"].as_i64(), st["last_error"].as_str()), (Some(1), Some("nft: syntax error")), "{st}");
        assert_eq!(st["desired_version"].as_u64(), Some(b2.version), "evidence never changes desired state");

        // Revocation: db-1's next bundle drops op-1; op-1 is refused at once.
        let (s, b) = r.admin_post("/v1/admin/nodes/op-1/revoke", json!(null)).await;
        assert_eq!(s, 200, "{b}");
        let third = db.fetch(&r.base, Some(b2.version), 10).await;
        let b3 = db.open(&third, "db-1");
        assert!(
            b3.version > b2.version
                && !file(&b3, "etc/trellis/wireguard.conf").contains(&base64::engine::general_purpose::STANDARD.encode([3u8; 32]))
        );
        assert_eq!(op.fetch(&r.base, None, 0).await.status, 403, "{url}");
        drop(api);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pending_node_gets_no_bundle_until_approved() {
    let r = start(Database::sqlite()).await;
    let op = r.enrol_node("op-1", 5, true).await;
    let f = op.fetch(&r.base, None, 0).await;
    assert_eq!(f.status, 403);
    assert!(String::from_utf8_lossy(&f.bytes).contains("pending approval"));
    let (s, _) = r.admin_post("/v1/admin/nodes/op-1/approve", json!(null)).await;
    assert_eq!(s, 200);
    let f = op.fetch(&r.base, None, 0).await;
    assert_eq!(f.status, 200);
    op.open(&f, "op-1");
}

/// The attack: a node's superseded certificate (still accepted until it expires) asks for a new
/// one for another key. Before, it got one, which replaced the current certificate and locked it
/// out. For the same key it is a retry whose answer was lost (ADR 0029): it is given the current
/// certificate again, and nothing is replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_superseded_certificate_cannot_renew_and_lock_the_current_one_out() {
    for url in backends().await {
        let r = start(url).await;
        let first = r.enrol_node("db-1", 1, false).await;
        let (s, renewed) = first.renew(&r.base).await;
        assert_eq!(s, 200, "{renewed}");
        let current = first.with_cert(renewed["node_cert_pem"].as_str().unwrap());
        // The node's next bundle carries the new certificate: a run reads the certificates of
        // the nodes whose serial moved only.
        r.controller.settle(std::time::Duration::from_secs(10)).await.unwrap();
        let held = first.fetch(&r.base, None, 0).await;
        assert_eq!(file(&first.open(&held, "db-1"), "etc/trellis/node.pem"), renewed["node_cert_pem"].as_str().unwrap());
        assert_eq!(first.whoami(&r.base).await, 200, "the replaced certificate still authenticates");
        let (_, other_csr) = trellis_pki::node_key_and_csr("db-1").unwrap();
        let resp = first.http.post(format!("{}/v1/renew", r.base)).json(&json!({"csr_pem": other_csr})).send().await.unwrap();
        let (s, body): (u16, Value) = (resp.status().as_u16(), resp.json().await.unwrap());
        assert_eq!((s, body["code"].as_str()), (403, Some("certificate_superseded")), "{body}");
        let (s, again) = first.renew(&r.base).await;
        assert_eq!((s, again["node_cert_pem"].as_str()), (200, renewed["node_cert_pem"].as_str()), "the same key: {again}");
        assert_eq!(current.whoami(&r.base).await, 200, "the current certificate is not locked out");
        let (s, body) = current.renew(&r.base).await;
        assert_eq!(s, 200, "the current certificate renews: {body}");
    }
}

/// The attacks: evidence for a version never published (before, `status` showed it applied
/// for ever), and evidence and renewal from a node still pending approval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evidence_beyond_the_published_version_and_from_a_pending_node_is_refused() {
    for url in backends().await {
        let r = start(url).await;
        let db = r.enrol_node("db-1", 1, false).await;
        let f = db.fetch(&r.base, None, 0).await;
        assert_eq!(f.status, 200);
        let newest = f.version.unwrap();
        let rec = |seq: i64, v: u64| json!({"seq": seq, "version": v, "result": "applied", "files": [], "at": 1});
        let (s, body) = db.evidence(&r.base, json!([rec(1, i64::MAX as u64)])).await;
        assert_eq!(s, 400, "{body}");
        assert_eq!(
            body["error"].as_str().unwrap(),
            format!("evidence record 1: version {} was never published for node `db-1` (its newest is {newest})", i64::MAX)
        );
        let st = r.admin_get("/v1/admin/status").await;
        let row = st.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone();
        assert_eq!((row["applied_version"].clone(), row["evidence_records"].as_i64()), (Value::Null, Some(0)), "nothing was stored: {row}");
        let (s, body) = db.evidence(&r.base, json!([rec(1, newest)])).await;
        assert_eq!(s, 200, "evidence for the published version is taken: {body}");
        // An error of 100 KB is kept as its first 4 KiB, marked as cut.
        let long = json!([{"seq": 2, "version": newest, "result": "failed", "error": "e".repeat(100_000), "files": [], "at": 2}]);
        let (s, body) = db.evidence(&r.base, long).await;
        assert_eq!(s, 200, "{body}");
        let st = r.admin_get("/v1/admin/status").await;
        let err = st.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap()["last_error"].as_str().unwrap().to_string();
        assert!(err.len() < 4200 && err.ends_with("(cut at 4096 bytes)"), "{} bytes", err.len());

        let op = r.enrol_node("op-1", 5, true).await;
        let (s, body) = op.evidence(&r.base, json!([rec(1, 1)])).await;
        assert_eq!((s, body["code"].as_str()), (403, Some("pending_approval")), "{body}");
        let (s, body) = op.renew(&r.base).await;
        assert_eq!((s, body["code"].as_str()), (403, Some("pending_approval")), "{body}");
    }
}

/// The attack: unauthenticated enrolments whose fields are tens of kilobytes. Before, each was
/// refused but written whole into the audit chain (3,000 of them grew the database by 278 MB).
/// Now a request that is not shaped like an enrolment is refused before anything is written;
/// a well-formed one with an unknown token is still audited, with bounded fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_enrolments_are_refused_before_anything_is_written() {
    let r = start(Database::sqlite()).await;
    let before = r.admin_get("/v1/admin/audit").await.as_array().unwrap().len();
    for i in 0..40 {
        let big = "x".repeat(30_000);
        let body = json!({
            "token_id": if i % 2 == 0 { big.clone() } else { "0000000000000000".to_string() },
            "secret": "AAAA",
            "node": big,
            "csr_pem": "-",
            "wireguard_public_key": "-",
        });
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&body).unwrap()).await;
        assert_eq!((s, b["code"].as_str()), (400, Some("bad_request")), "{b}");
    }
    let audit = r.admin_get("/v1/admin/audit").await;
    assert_eq!(audit.as_array().unwrap().len(), before, "nothing was written: {}", audit.to_string().len());

    let unknown = json!({"token_id": "0123456789abcdef", "secret": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "node": "db-1", "csr_pem": "-", "wireguard_public_key": "-"});
    let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&unknown).unwrap()).await;
    assert_eq!((s, b["code"].as_str()), (401, Some("token_unknown")), "{b}");
    let audit = r.admin_get("/v1/admin/audit").await;
    let last = audit.as_array().unwrap().last().unwrap().clone();
    assert_eq!(
        (last["action"].as_str(), last["subject"].as_str()),
        (Some(AuditAction::TokenRedemptionRefused.as_str()), Some("db-1")),
        "{last}"
    );
}

/// The audit flood over HTTP: 300 well-formed enrolments with unknown tokens from one address,
/// one after another. Before, each was read from the database and audited: 300 records. Now the
/// first 5 are audited, the next 25 answered 401 and counted, the rest answered 429 with a
/// sentence before anything is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refused_enrolments_from_one_address_is_counted_and_turned_away() {
    let r = start(Database::sqlite()).await;
    let before = r.admin_get("/v1/admin/audit").await.as_array().unwrap().len();
    let mut statuses = std::collections::BTreeMap::new();
    let mut last = Value::Null;
    for i in 0..300u32 {
        let body = json!({"token_id": format!("{i:016x}"), "secret": "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA", "node": "db-1", "csr_pem": "-", "wireguard_public_key": "-"});
        let (s, b) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&body).unwrap()).await;
        *statuses.entry(s).or_insert(0) += 1;
        last = b;
    }
    assert_eq!(statuses, std::collections::BTreeMap::from([(401, 30), (429, 270)]));
    assert_eq!(last["code"], "too_many_refusals");
    assert!(last["error"].as_str().unwrap().starts_with("too many refused enrolments from 127.0.0.1; try again in "), "{last}");
    let audit = r.admin_get("/v1/admin/audit").await;
    assert_eq!(audit.as_array().unwrap().len() - before, 5, "{audit}");

    // The audit chain is read in pages: `after` and `limit`, held to at most 1,000 a request.
    let seqs = |v: Value| v.as_array().unwrap().iter().map(|x| x["seq"].as_i64().unwrap()).collect::<Vec<_>>();
    assert_eq!(seqs(r.admin_get("/v1/admin/audit?after=2&limit=3").await), vec![3, 4, 5]);
    assert_eq!(seqs(r.admin_get("/v1/admin/audit?limit=0").await), vec![1], "a limit of at least one");
    assert_eq!(seqs(r.admin_get("/v1/admin/audit?after=7").await), Vec::<i64>::new());
    let resp = r.http.get(format!("{}/v1/admin/audit?everything=1", r.base)).bearer_auth(&r.admin).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 400, "unknown query keys are refused");
}

impl Running {
    /// A TLS connection to the controller, as the tests hold it.
    async fn try_connect(&self) -> std::io::Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>> {
        let ca = std::fs::read_to_string(&self.ca_path).unwrap();
        let connector = tokio_rustls::TlsConnector::from(Arc::new(trellis_pki::tls::client_config(&ca, None).unwrap()));
        let tcp = tokio::net::TcpStream::connect(self.base.trim_start_matches("https://")).await?;
        connector.connect(rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap(), tcp).await
    }

    async fn connect(&self) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
        self.try_connect().await.unwrap()
    }
}

/// The attacks: requests whose headers arrive but whose body never does, and more connections
/// from one source than it may hold. Before, such connections stayed open indefinitely (seen
/// after 150 s) and enough of them exhausted the process's descriptors; now the body is refused
/// after the body timeout and the connection closed, and connections over the per-source bound
/// are closed at once while the controller keeps answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_never_arrives_and_too_many_connections_are_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let limits = trellis_server::Limits { max_connections: 64, per_source: 6, body_timeout: std::time::Duration::from_secs(1) };
    let r = start_with(Database::sqlite(), limits).await;

    let mut held = r.connect().await;
    held.write_all(b"POST /v1/enrol HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{\"tok")
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), held.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "the connection was still held after 10 s");
    let answer = String::from_utf8_lossy(&answer).to_string();
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("did not arrive within 1 seconds"), "{answer}");
    assert!(started.elapsed() < std::time::Duration::from_secs(5), "{:?}", started.elapsed());

    // Connections from this address are admitted up to the bound (the test's own client holds
    // one in its pool); the next is closed at once, before its TLS handshake.
    let mut six = Vec::new();
    let mut closed = false;
    for _ in 0..=limits.per_source {
        match tokio::time::timeout(std::time::Duration::from_secs(5), r.try_connect()).await.expect("a connection is never left hanging") {
            Ok(c) => six.push(c),
            Err(e) => {
                assert!(e.kind() == std::io::ErrorKind::UnexpectedEof || e.kind() == std::io::ErrorKind::ConnectionReset, "{e}");
                closed = true;
                break;
            }
        }
    }
    assert!(closed && six.len() < limits.per_source, "admitted {} connections from one source, bound {}", six.len(), limits.per_source);
    drop(six);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let health = r.http.get(format!("{}/v1/health", r.base)).send().await.unwrap();
    assert_eq!(health.status().as_u16(), 200, "the controller answers once the held connections are gone");
}

/// Stopping (`SIGTERM`). Before, `run` returned the moment it was told to stop: a long-poll open
/// then went on waiting its full minute (or was cut with the process), and a decision whose
/// request was in flight was dropped with it. Now the listener closes, long-polls answer at once
/// (304: what the node holds is current), the request in flight is answered and its decision
/// recorded, and only then does `run` return.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stopping_answers_long_polls_at_once_and_finishes_the_decisions_in_flight() {
    use std::time::{Duration, Instant};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let url = Database::sqlite();
    let mut r = start(url.clone()).await;
    let node = r.enrol_node("db-1", 1, false).await;
    let held = node.fetch(&r.base, None, 0).await;
    assert_eq!(held.status, 200);
    let base = r.base.clone();
    let poll = tokio::spawn(async move {
        let t = Instant::now();
        let f = node.fetch(&base, held.version, 60).await;
        (f.status, f.version, t.elapsed())
    });
    // A decision in flight: its headers and half of its body have arrived.
    let body = json!({"node": "op-1", "ttl_secs": 600}).to_string();
    let (first, rest) = body.split_at(body.len() / 2);
    let mut tls = r.connect().await;
    let head = format!(
        "POST /v1/admin/tokens HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{first}",
        r.admin,
        body.len()
    );
    tls.write_all(head.as_bytes()).await.unwrap();
    tls.flush().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;

    r.stop.take().unwrap().send(()).unwrap();
    let (status, version, took) =
        tokio::time::timeout(Duration::from_secs(10), poll).await.expect("the long-poll is answered at once").unwrap();
    assert_eq!((status, version), (304, held.version), "answered with what it holds, after {took:?}");
    assert!(r.try_connect().await.is_err(), "no new connection once stopping");
    assert!(!r.done.as_ref().unwrap().is_finished(), "run waits for the request in flight");

    tls.write_all(rest.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), tls.read_to_end(&mut answer)).await.expect("answered, then closed").ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 200 OK") && answer.contains("\"token\""), "{answer}");
    tokio::time::timeout(Duration::from_secs(10), r.done.take().unwrap()).await.expect("run returns").unwrap().unwrap();
    let store = trellis_store::Store::open(&url).await.unwrap();
    let tokens = store.tokens().await.unwrap();
    assert!(tokens.iter().any(|t| t.node == "op-1"), "the decision in flight was recorded: {tokens:?}");
}

/// A mesh where `op-1` peers with `n` nodes whose keys are declared (they need no enrolment).
/// How many nodes `op-1` peers with in the delta test: enough for a bundle over `DELTA_FROM`.
const WIDE: usize = 600;

fn wide_mesh(n: usize, extra: usize) -> Value {
    let mut mesh = String::from("[mesh]\nname = \"basic\"\ndomain = \"basic.mesh\"\noverlay_ipv4 = \"10.70.0.0/16\"\n\n[networks]\nlan = {}\n\n[[node]]\nname = \"op-1\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\n");
    for i in 0..n + extra {
        let key = base64::engine::general_purpose::STANDARD.encode([(i % 250) as u8 + 1, (i / 250) as u8 + 1].repeat(16));
        mesh.push_str(&format!("\n[[node]]\nname = \"n-{i:04}\"\nnetworks = [\"lan\"]\nmodules = [\"ping\"]\npublic_key = \"{key}\"\n[[node.endpoint]]\naddress = \"192.0.2.{}:{}\"\nreachable_from = [\"lan\"]\n", 1 + i % 200, 20000 + i));
    }
    let ping = "[module]\nname = \"ping\"\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"mesh\"]\n";
    json!({"files": [{"path": "mesh.toml", "text": mesh}, {"path": "modules/ping.toml", "text": ping}]})
}

impl Node {
    /// The bundle as a node that holds `held` and takes deltas asks for it (ADR 0033): its tag
    /// and the digests of its files. Returns the content type and the body.
    async fn fetch_delta(&self, base: &str, held: &trellis_core::bundle::Bundle) -> (String, Option<u64>, Vec<u8>) {
        let tag = trellis_proto::etag::BundleTag::new(held.version as i64, &held.content_digest());
        let files: Vec<[u8; 32]> = held.files.iter().map(|f| f.sha256).collect();
        let resp = self
            .http
            .get(format!("{base}/v1/bundle?wait=0"))
            .header("if-none-match", tag.etag())
            .header("accept", format!("application/octet-stream, {}", trellis_proto::DELTA_TYPE))
            .header(trellis_proto::HELD_FILES_HEADER, trellis_proto::held_files(&files))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let kind = resp.headers()["content-type"].to_str().unwrap().to_string();
        let tag = trellis_proto::etag::BundleTag::parse(resp.headers()["etag"].to_str().unwrap()).expect("an ETag of ours");
        (kind, Some(tag.version as u64), resp.bytes().await.unwrap().to_vec())
    }

    fn open_delta(&self, delta: &[u8], held: &trellis_core::bundle::Bundle) -> trellis_core::bundle::Verified {
        let applied = trellis_core::bundle::Applied { version: held.version, digest: Some(held.content_digest()) };
        trellis_core::bundle::verify_delta(delta, &self.signing, "basic", &held.node, Some(applied), held).unwrap_or_else(|e| panic!("{e}"))
    }
}

/// Issue 35 (ADR 0033): a node that peers with the whole mesh holds a large bundle, and one node
/// more changes a few lines of three of its files. A node one version behind gets the new head
/// and the edits of those files (a few KiB, not the whole bundle); three versions behind, the
/// changed files whole and the rest kept; built, either is exactly the new bundle. A node that
/// holds unknown content, or does not ask for a delta, gets the whole bundle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_catches_up_by_delta_from_any_version_it_holds_and_whole_from_unknown_content() {
    let r = start(Database::sqlite()).await;
    let (s, b) = r.admin_post("/v1/admin/apply", wide_mesh(WIDE, 0)).await;
    assert_eq!(s, 200, "{b}");
    let node = r.enrol_node("op-1", 250, false).await;
    let first = node.fetch(&r.base, None, 20).await;
    assert_eq!(first.status, 200);
    let mut held = vec![node.open(&first, "op-1")];
    assert!(first.bytes.len() >= 128 * 1024, "a large bundle: {} bytes", first.bytes.len());
    let mut whole = 0;
    for extra in 1..=3 {
        let (s, b) = r.admin_post("/v1/admin/apply", wide_mesh(WIDE, extra)).await;
        assert_eq!(s, 200, "{b}");
        let f = node.fetch(&r.base, Some(held.last().unwrap().version), 20).await;
        assert_eq!(f.status, 200);
        whole = f.bytes.len();
        held.push(node.open(&f, "op-1"));
    }
    let current = held.last().unwrap().clone();

    // One version behind: the edits of the large files that changed, and the head.
    let (kind, version, delta) = node.fetch_delta(&r.base, &held[2]).await;
    assert_eq!((kind.as_str(), version), (trellis_proto::DELTA_TYPE, Some(current.version)));
    assert!(delta.len() <= 16 * 1024, "a delta of {} bytes for a bundle of {whole}", delta.len());
    let v = node.open_delta(&delta, &held[2]);
    assert_eq!(v.bundle, current, "the delta builds the new bundle exactly");
    let changed = v.changed.unwrap();
    assert!(
        changed.contains(&"etc/trellis/wireguard.conf".to_string()) && !changed.contains(&"etc/trellis/ca.pem".to_string()),
        "{changed:?}"
    );

    // Three versions behind: the changed files whole, the rest kept.
    let (kind, _, delta) = node.fetch_delta(&r.base, &held[0]).await;
    assert_eq!(kind, trellis_proto::DELTA_TYPE);
    assert!(delta.len() < whole, "{} against {whole}", delta.len());
    assert_eq!(node.open_delta(&delta, &held[0]).bundle, current);

    // Other content under a known version (a file missing): the delta is made from the files
    // the node names, and builds the bundle from them.
    let mut other = held[0].clone();
    other.files.retain(|f| f.path != "etc/trellis/ca.pem");
    let (kind, _, delta) = node.fetch_delta(&r.base, &other).await;
    assert_eq!(kind, trellis_proto::DELTA_TYPE);
    let v = node.open_delta(&delta, &other);
    assert_eq!(v.bundle, current);
    assert!(v.changed.unwrap().contains(&"etc/trellis/ca.pem".to_string()), "the missing file comes whole");

    // Content the controller knows nothing of: whole, as it is held.
    let mut unknown = held[0].clone();
    for f in &mut unknown.files {
        *f = trellis_core::bundle::BundleFile::new(f.path.clone(), f.mode, "changed by hand\n");
    }
    let (kind, _, bytes) = node.fetch_delta(&r.base, &unknown).await;
    assert_eq!(kind, "application/octet-stream");
    assert_eq!(node.open(&Fetched { status: 200, version: None, bytes, stamp: None }, "op-1"), current);

    // Holding another version, the node gets the whole bundle even when it accepts deltas (one
    // above any this database numbered: a restore; its bundle is numbered above it, ADR 0024).
    let resp = node
        .http
        .get(format!("{}/v1/bundle?wait=0", r.base))
        .header("if-none-match", "\"999\"")
        .header("accept", trellis_proto::DELTA_TYPE)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["content-type"], "application/octet-stream");
    let tag = trellis_proto::etag::BundleTag::parse(resp.headers()["etag"].to_str().unwrap()).unwrap();
    assert_eq!(tag.version, 1000, "numbered above what the node holds");
    let b = node.open(&Fetched { status: 200, version: Some(1000), bytes: resp.bytes().await.unwrap().to_vec(), stamp: None }, "op-1");
    assert_eq!(b.version, 1000);
}

/// A pool token over HTTP: redemptions racing past its uses are answered 409 `token_used`, each
/// winner is named by the controller, a pool at its size answers 409 `pool_full`, and a token
/// for an undeclared pool 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pool_redemptions_over_http_name_members_and_refuse_past_uses_and_size() {
    for url in backends().await {
        let r = Arc::new(start(url.clone()).await);
        let files: Vec<Value> = ["mesh.toml", "modules/http.toml", "modules/ping.toml", "modules/postgres.toml"]
            .iter()
            .map(|p| json!({"path": p, "text": std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../lab/pool").join(p)).unwrap()}))
            .collect();
        let (status, body) = r.admin_post("/v1/admin/apply", json!({"files": files})).await;
        assert_eq!(status, 200, "{body}");
        let (status, body) = r.admin_post("/v1/admin/tokens", json!({"pool": "ci", "uses": 3, "ttl_secs": 600})).await;
        assert_eq!((status, body["pool"].as_str(), body["uses"].as_i64()), (200, Some("ci"), Some(3)), "{body}");
        let t = EnrolmentToken::decode(body["token"].as_str().unwrap()).unwrap();
        let tasks: Vec<_> = (0..6u8)
            .map(|i| {
                let (r, body) = (r.clone(), enrol_body(&t, i + 1));
                tokio::spawn(async move { r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&body).unwrap()).await })
            })
            .collect();
        let mut names = Vec::new();
        for task in tasks {
            let (status, body) = task.await.unwrap();
            match status {
                200 => names.push(body["node"].as_str().unwrap().to_string()),
                409 if body["code"] == "token_used" => {}
                _ => panic!("{url}: unexpected {status} {body}"),
            }
        }
        names.sort();
        assert_eq!(names, ["ci-1", "ci-2", "ci-3"], "{url}");
        let (_, body) = r.admin_post("/v1/admin/tokens", json!({"pool": "ci", "uses": 5, "ttl_secs": 600})).await;
        let t = EnrolmentToken::decode(body["token"].as_str().unwrap()).unwrap();
        let (status, body) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&enrol_body(&t, 20)).unwrap()).await;
        assert_eq!((status, body["node"].as_str()), (200, Some("ci-4")), "{body}");
        let (status, body) = r.post_raw("/v1/enrol", "application/json", serde_json::to_vec(&enrol_body(&t, 21)).unwrap()).await;
        assert_eq!((status, body["code"].as_str()), (409, Some("pool_full")), "{body}");
        let (status, body) = r.admin_post("/v1/admin/tokens", json!({"pool": "cd", "ttl_secs": 600})).await;
        assert_eq!((status, body["code"].as_str()), (404, Some("not_found")), "{body}");
        let nodes = r.admin_get("/v1/admin/nodes").await;
        let members = nodes.as_array().unwrap().iter().filter(|n| n["pool"] == "ci").count();
        assert_eq!(members, 4, "{url}: {nodes}");
    }
}

/// A request whose body is past the endpoint's bound, refused from its headers before the body
/// is read: answered 413, or, when the server's close (with the unread body still arriving)
/// resets the connection before the client reads the answer, a broken pipe or a reset. Either
/// way the body was not taken; anything else (a 200, a 422 from reading it) fails.
#[track_caller]
fn refused_unread(sent: reqwest::Result<reqwest::Response>) {
    match sent {
        Ok(resp) => assert_eq!(resp.status().as_u16(), 413),
        Err(e) => {
            let said = format!("{e:?}");
            assert!(said.contains("BrokenPipe") || said.contains("ConnectionReset"), "{said}");
        }
    }
}

/// Service certificates over the real TLS session (ADR 0023): db-1 asks what it is to hold and
/// gets it signed; the certificate, presented with its chain as a client certificate, is no
/// node's identity; a CSR asking to be a CA and a body past the bound are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_gets_its_service_certificate_and_it_opens_no_node_endpoint() {
    for url in backends().await {
        let r = start(url).await;
        let db = r.enrol_node("db-1", 1, false).await;
        let list: Value = db.http.get(format!("{}/v1/node/certificates", r.base)).send().await.unwrap().json().await.unwrap();
        assert_eq!(list["certificates"][0]["module"], "postgres", "{list}");
        assert_eq!(list["certificates"][0]["dns"], json!(["postgres.basic.mesh", "db-1.basic.mesh"]));
        let (key, csr) = trellis_pki::services::service_key_and_csr(&["postgres.basic.mesh".into()]).unwrap();
        let resp = db
            .http
            .post(format!("{}/v1/node/certificates", r.base))
            .json(&json!({"module": "postgres", "csr_pem": csr}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 200);
        let issued: Value = resp.json().await.unwrap();
        let (cert, chain) = (issued["cert_pem"].as_str().unwrap(), issued["chain_pem"].as_str().unwrap());
        assert_eq!(issued["ca_pem"].as_str().unwrap(), db.ca, "clients trust the mesh CA");

        // The service certificate and its chain as a client certificate: TLS accepts the chain
        // (it ends at the mesh CA), the controller does not take it for a node.
        let der = |pem: &str| rustls::pki_types::CertificateDer::from(trellis_pki::pem_to_der(pem, "CERTIFICATE").unwrap());
        let key_der = rustls::pki_types::PrivateKeyDer::Pkcs8(trellis_pki::pem_to_der(&key, "PRIVATE KEY").unwrap().into());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(der(&db.ca)).unwrap();
        let cfg = rustls::ClientConfig::builder_with_provider(trellis_pki::tls::provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(vec![der(cert), der(chain)], key_der)
            .unwrap();
        let service = reqwest::Client::builder().use_preconfigured_tls(cfg).build().unwrap();
        for path in ["/v1/whoami", "/v1/node/certificates"] {
            let resp = service.get(format!("{}{path}", r.base)).send().await.unwrap();
            let status = resp.status().as_u16();
            let body: Value = resp.json().await.unwrap();
            assert_eq!((status, body["code"].as_str()), (403, Some("service_certificate")), "{path}: {body}");
        }

        // CA:true requested, over the wire.
        let mut params = rcgen::CertificateParams::new(vec!["postgres.basic.mesh".to_string()]).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca_csr = params.serialize_request(&rcgen::KeyPair::from_pem(&key).unwrap()).unwrap().pem().unwrap();
        let resp = db
            .http
            .post(format!("{}/v1/node/certificates", r.base))
            .json(&json!({"module": "postgres", "csr_pem": ca_csr}))
            .send()
            .await
            .unwrap();
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap();
        assert_eq!((status, body["code"].as_str()), (403, Some("certificate_ca_requested")), "{body}");
        // A body past the bound is refused before it is read whole.
        let big = "A".repeat(trellis_server::certs::CERTIFICATE_BODY + 1);
        refused_unread(
            db.http.post(format!("{}/v1/node/certificates", r.base)).json(&json!({"module": "postgres", "csr_pem": big})).send().await,
        );
        // An unknown field is refused, as in every request body.
        let resp = db
            .http
            .post(format!("{}/v1/node/certificates", r.base))
            .json(&json!({"module": "postgres", "csr_pem": csr, "ca": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 422);

        // What the node holds, as its agent reports it: recorded for its own module, and shown
        // to operators beside the certificate; a report past the bound is refused unread.
        let report = json!({"certificates": [{"module": "postgres", "serial": "0a", "not_after": 5, "error": "group postgres does not exist on this host"}]});
        let resp = db.http.post(format!("{}/v1/node/certificates/held", r.base)).json(&report).send().await.unwrap();
        let status = resp.status().as_u16();
        let body: Value = resp.json().await.unwrap();
        assert_eq!((status, body["recorded"].as_u64()), (200, Some(1)), "{body}");
        let listed = r.admin_get("/v1/admin/certificates").await;
        let pg = listed.as_array().unwrap().iter().find(|c| c["node"] == "db-1" && c["module"] == "postgres").unwrap();
        assert_eq!(
            (pg["held_serial"].as_str(), pg["node_error"].as_str()),
            (Some("0a"), Some("group postgres does not exist on this host")),
            "{pg}"
        );
        // Past the bound: refused from the headers; nothing is recorded.
        let big = json!({"certificates": [{"module": "postgres", "serial": "0b", "not_after": null, "error": "A".repeat(trellis_server::certs::HELD_BODY)}]});
        refused_unread(db.http.post(format!("{}/v1/node/certificates/held", r.base)).json(&big).send().await);
        let listed = r.admin_get("/v1/admin/certificates").await;
        let pg = listed.as_array().unwrap().iter().find(|c| c["node"] == "db-1" && c["module"] == "postgres").unwrap();
        assert_eq!(pg["held_serial"].as_str(), Some("0a"), "the oversized report was not recorded: {pg}");
        let resp = db
            .http
            .post(format!("{}/v1/node/certificates/held", r.base))
            .json(&json!({"certificates": [], "all": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status().as_u16(), 422);
    }
}

/// Direct paths (ADR 0032), over HTTP: a node that is not a hub claims where it and a peer are,
/// and nothing of it is published; the hub's observations put each side of the relayed pair in
/// the other's `paths.toml`, at the endpoint the hub saw; what the agents report shows in status.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn only_a_hub_s_observations_become_direct_candidates() {
    for url in backends().await {
        let r = start(url.clone()).await;
        let (status, body) = r.admin_post("/v1/admin/apply", json!({"files": trellis_testing::controller::lab_files("cgnat")})).await;
        assert_eq!(status, 200, "{body}");
        let hub = r.enrol_node("hub-1", 1, false).await;
        let a = r.enrol_node("a-1", 2, false).await;
        let _b = r.enrol_node("b-1", 3, false).await;
        let key = trellis_testing::controller::wireguard_key;
        let report = |observed: &[(u8, &str)], paths: Value| json!({"observed": observed.iter().map(|(k, e)| json!({"public_key": key(*k), "endpoint": e})).collect::<Vec<_>>(), "paths": paths});
        let post = |n: &Node, body: Value| {
            let req = n.http.post(format!("{}/v1/node/paths", r.base)).json(&body).send();
            async move {
                let resp = req.await.unwrap();
                (resp.status().as_u16(), resp.json::<Value>().await.unwrap())
            }
        };
        let open = |n: &Node, f: &Fetched| trellis_core::bundle::verify(&f.bytes, &n.signing, "cgnat", &n.node, None).unwrap().bundle;
        let paths_of = |b: &trellis_core::bundle::Bundle| {
            b.files.iter().find(|f| f.path == "etc/trellis/paths.toml").map(|f| String::from_utf8(f.content.to_vec()).unwrap())
        };
        // a-1, no hub, says it and b-1 are somewhere: kept as nothing.
        let (s, ack) = post(&a, report(&[(2, "198.51.100.66:6666"), (3, "198.51.100.66:7777")], json!([]))).await;
        assert_eq!((s, ack["observed"].as_u64()), (200, Some(0)), "{url}: {ack}");
        r.controller.settle(std::time::Duration::from_secs(10)).await.unwrap();
        let held = a.fetch(&r.base, None, 0).await;
        let bundle = open(&a, &held);
        assert!(file(&bundle, "etc/trellis/wireguard.conf").contains(&key(1)), "a-1 peers with its hub");
        assert_eq!(paths_of(&bundle), None, "{url}: a node's own claim is never published");
        // Status says why the pair stays on its hub: the run did not rank it (its hub saw
        // neither side), and its reason is made when status asks.
        let status = || async {
            let nodes = r.admin_get("/v1/admin/status").await;
            let a1 = nodes.as_array().unwrap().iter().find(|n| n["name"] == "a-1").unwrap().clone();
            a1["paths"][0]["text"].as_str().unwrap_or_default().to_string()
        };
        assert_eq!(status().await, "relayed by hub-1: the hub has no session with a-1");

        // hub-1 saw both: each gets the other at the endpoint the hub saw.
        let (s, ack) = post(&hub, report(&[(2, "203.0.113.1:4001"), (3, "203.0.113.2:4002")], json!([]))).await;
        assert_eq!((s, ack["observed"].as_u64()), (200, Some(2)), "{url}: {ack}");
        let next = a.fetch(&r.base, held.version, 10).await;
        assert_eq!(next.status, 200, "{url}: the hub's observation changes a-1's bundle");
        let paths = paths_of(&open(&a, &next)).expect("a paths.toml");
        let candidates = trellis_core::paths::parse(&paths).unwrap();
        assert_eq!(candidates.len(), 1, "{paths}");
        assert_eq!((candidates[0].peer.as_str(), candidates[0].endpoint.to_string()), ("b-1", "203.0.113.2:4002".to_string()));
        assert!(!paths.contains("198.51.100.66"), "{paths}");

        // a-1 again claims b-1 elsewhere: nothing moves.
        let (s, _) = post(&a, report(&[(3, "198.51.100.66:7777")], json!([]))).await;
        assert_eq!(s, 200);
        r.controller.settle(std::time::Duration::from_secs(10)).await.unwrap();
        let same = a.fetch(&r.base, next.version, 0).await;
        assert_eq!(same.status, 304, "{url}: a non-hub's observation moves no candidate");

        // What a-1 says of its path shows in status, from its side.
        assert_eq!(status().await, "relayed by hub-1, about to try a direct path");
        let (s, _) = post(&a, report(&[], json!([{"peer": "b-1", "state": "direct", "since": 43_200 + 3}]))).await;
        assert_eq!(s, 200);
        assert_eq!(status().await, "direct since 12:00:03 (punched through hub-1)");
        // The picture's link between them says what status says from the link's first node,
        // looked up alone (the picture no longer asks status for every pair).
        let graph = r.admin_get("/v1/admin/graph").await;
        let link = graph["links"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| {
                [l["a"].as_str(), l["b"].as_str()] == [Some("a-1"), Some("b-1")]
                    || [l["a"].as_str(), l["b"].as_str()] == [Some("b-1"), Some("a-1")]
            })
            .expect("a link between a-1 and b-1")
            .clone();
        assert_eq!(link["reach"], "relayed", "{link}");
        let nodes = r.admin_get("/v1/admin/status").await;
        let first = nodes.as_array().unwrap().iter().find(|n| n["name"] == link["a"]).unwrap().clone();
        let said = first["paths"].as_array().unwrap().iter().find(|p| p["peer"] == link["b"]).unwrap()["text"].clone();
        assert!(said.as_str().is_some_and(|t| t.contains("hub-1")), "{said}");
        assert_eq!(link["path"], said, "{link}");
        // A report beyond the bound is refused whole.
        let many: Vec<Value> =
            (0..=trellis_proto::paths::MAX_PATH_ITEMS).map(|_| json!({"public_key": key(3), "endpoint": "203.0.113.2:1"})).collect();
        let (s, body) = post(&hub, json!({"observed": many})).await;
        assert_eq!(s, 400, "{url}: {body}");
    }
}
