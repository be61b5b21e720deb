//! Attacks on what the API keeps per request (issue 24): each test sends the requests an
//! attacker would and shows what they can no longer grow.

use trellis_testing::Database;

use super::start;

/// The series of the request latency histogram in a scrape.
fn request_series(scrape: &str) -> Vec<&str> {
    scrape.lines().filter(|l| l.starts_with("trellis_http_request_duration_seconds_count{")).collect()
}

/// The attack: unauthenticated requests with made-up methods and paths. Before, the method was a
/// label as sent, so each made-up method made a series (5,000 of 4,000 bytes made one scrape
/// 410 MB). Now methods outside a fixed set are `other` and paths no route matches `unmatched`:
/// however many are sent, the series are the same few.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn made_up_methods_and_paths_make_no_new_metric_series() {
    let r = start(Database::sqlite()).await;
    let send = |method: String, path: String| {
        let req = r.http.request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), format!("{}{path}", r.base));
        async move { req.send().await.unwrap().status().as_u16() }
    };
    // Warm up the series a well-behaved client makes, then count.
    assert_eq!(send("GET".into(), "/v1/health".into()).await, 200);
    let before = request_series(&r.controller.scrape().await).len();
    for i in 0..100 {
        let method = format!("M{i:03}{}", "X".repeat(1000));
        send(method.clone(), "/v1/health".into()).await;
        send(method, format!("/v1/nothing-{i}")).await;
        send("GET".into(), format!("/v1/nothing/{i}/{}", "y".repeat(500))).await;
    }
    let scrape = r.controller.scrape().await;
    let series = request_series(&scrape);
    assert!(!scrape.contains("XXXX") && !scrape.contains("nothing"), "a label carries what the client sent:\n{}", series.join("\n"));
    // At most: other on a matched route (405), other and GET where no route matched (404).
    assert!(series.len() <= before + 3, "{} series after 300 made-up requests, {before} before:\n{}", series.len(), series.join("\n"));
    assert!(series.iter().any(|l| l.contains("method=\"other\"")), "{}", series.join("\n"));
    assert!(scrape.len() < 64 * 1024, "a scrape of {} bytes", scrape.len());
}

/// Reads a refusal: its status, its `WWW-Authenticate`, `Allow`, and its body, which must be an
/// ErrorBody (JSON with `error` and `code`, and nothing else but `diagnostics`).
async fn refusal(resp: reqwest::Response) -> (u16, Option<String>, Option<String>, String) {
    let status = resp.status().as_u16();
    let header = |name: &str| resp.headers().get(name).map(|v| v.to_str().unwrap().to_string());
    let (challenge, allow) = (header("www-authenticate"), header("allow"));
    let content_type = header("content-type");
    let text = resp.text().await.unwrap();
    assert_eq!(content_type.as_deref(), Some("application/json"), "{status}: {text}");
    let body: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{status}: not JSON ({e}): {text}"));
    let fields: Vec<&String> = body.as_object().unwrap_or_else(|| panic!("{text}")).keys().collect();
    assert!(fields.iter().all(|k| ["error", "code", "diagnostics"].contains(&k.as_str())), "{status}: {text}");
    let error: trellis_proto::ErrorBody =
        serde_json::from_value(body).unwrap_or_else(|e| panic!("{status}: not an ErrorBody ({e}): {text}"));
    assert!(!error.error.is_empty(), "{text}");
    (status, challenge, allow, error.code)
}

/// The refusals the HTTP layer makes itself. Before, a query string that did not fit answered
/// axum's `text/plain` sentence, an unknown path or method an empty body, and a 401 no
/// `WWW-Authenticate`; now each is an ErrorBody with a stable code, and every 401 names what it
/// asks for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_an_error_body_with_a_stable_code() {
    let r = start(Database::sqlite()).await;
    let get = |path: &str, admin: Option<&str>| {
        let mut req = r.http.get(format!("{}{path}", r.base));
        if let Some(a) = admin {
            req = req.bearer_auth(a);
        }
        async move { refusal(req.send().await.unwrap()).await }
    };
    let admin = Some(r.admin.as_str());
    for query in ["/v1/admin/audit?after=first", "/v1/admin/audit?everything=1", "/v1/admin/explain?from=a", "/v1/bundle?wait=-1"] {
        let (status, _, _, code) = get(query, if query.starts_with("/v1/admin") { admin } else { None }).await;
        // The bundle is for nodes: without a certificate, that refusal comes first.
        let expected = if query.starts_with("/v1/bundle") { (401, "node_certificate_required") } else { (400, "bad_query") };
        assert_eq!((status, code.as_str()), expected, "{query}");
    }
    let resp = r.http.post(format!("{}/v1/admin/nodes/%FF/approve", r.base)).bearer_auth(&r.admin).send().await.unwrap();
    let (status, _, _, code) = refusal(resp).await;
    assert_eq!((status, code.as_str()), (400, "bad_path"));
    for path in ["/", "/v1/nothing", "/v1/admin/nodes/a/b/c", "/ui"] {
        let (status, _, _, code) = get(path, admin).await;
        assert_eq!((status, code.as_str()), (404, "no_route"), "{path}");
    }
    for method in ["DELETE", "PUT", "MADEUP"] {
        let req = r.http.request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), format!("{}/v1/health", r.base));
        let (status, _, allow, code) = refusal(req.send().await.unwrap()).await;
        assert_eq!((status, code.as_str()), (405, "method_not_allowed"), "{method}");
        assert!(allow.as_deref().is_some_and(|a| a.contains("GET")), "{method}: Allow {allow:?}");
    }

    let (status, challenge, _, code) = get("/v1/admin/nodes", None).await;
    assert_eq!((status, code.as_str(), challenge.as_deref()), (401, "admin_required", Some("Bearer realm=\"trellis-admin\"")));
    let (status, challenge, _, code) = get("/v1/admin/nodes", Some("trellis-admin-0000")).await;
    assert_eq!(
        (status, code.as_str(), challenge.as_deref()),
        (401, "admin_denied", Some("Bearer realm=\"trellis-admin\", error=\"invalid_token\""))
    );
    let (status, challenge, _, code) = get("/v1/whoami", None).await;
    assert_eq!(
        (status, code.as_str(), challenge.as_deref()),
        (401, "node_certificate_required", Some("ClientCertificate realm=\"trellis-node\""))
    );
    let t = r.token("db-1").await;
    let mut wrong = super::enrol_body(&t, 1);
    wrong["secret"] = serde_json::json!(base64::Engine::encode(&base64::engine::general_purpose::STANDARD, [0u8; 24]));
    let resp = r.http.post(format!("{}/v1/enrol", r.base)).json(&wrong).send().await.unwrap();
    let (status, challenge, _, code) = refusal(resp).await;
    assert_eq!((status, code.as_str(), challenge.as_deref()), (401, "token_wrong", Some("EnrolmentToken realm=\"trellis-enrolment\"")));
}

/// The attack: another site frames the live page and has the operator click through it unseen.
/// Before, the page said nothing of framing; now its policy allows no frame ancestor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_live_page_may_not_be_framed() {
    let r = start(Database::sqlite()).await;
    let resp = r.http.get(format!("{}/ui/", r.base)).send().await.unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let csp = resp.headers()["content-security-policy"].to_str().unwrap().to_string();
    assert!(csp.split(';').any(|d| d.trim() == "frame-ancestors 'none'"), "{csp}");
}

/// Protocol versions (issue 21, item 3): a node request naming a protocol major this controller
/// does not speak is refused with `protocol_unsupported`, naming the node and both versions.
/// Before, agents and controllers of different releases were not told apart at all. A version
/// that is no version, or a release that is not plain, is refused too; without the header (an
/// older agent) it is 1.0; a higher minor is spoken. What the agent said is listed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_major_not_spoken_is_refused_naming_the_node_and_both_versions() {
    let r = start(Database::sqlite()).await;
    let n = r.enrol_node("db-1", 1, false).await;
    let whoami = |protocol: Option<&str>, release: Option<&str>| {
        let mut req = n.http.get(format!("{}/v1/whoami", r.base));
        if let Some(p) = protocol {
            req = req.header("trellis-protocol", p);
        }
        if let Some(a) = release {
            req = req.header("trellis-agent", a);
        }
        req.send()
    };
    let resp = whoami(Some("2.0"), Some("9.0.0")).await.unwrap();
    let text = resp.text().await.unwrap();
    let body: trellis_proto::ErrorBody = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(body.code, "protocol_unsupported", "{text}");
    assert!(body.error.starts_with("node `db-1` speaks trellis protocol 2.0 (agent 9.0.0); this controller speaks 1.0"), "{text}");
    for (protocol, release, code) in [(Some("1.x"), Some("0.1.0"), "bad_request"), (Some("1.0"), Some("0.1 0"), "bad_request")] {
        let (status, _, _, got) = refusal(whoami(protocol, release).await.unwrap()).await;
        assert_eq!((status, got.as_str()), (400, code), "{protocol:?} {release:?}");
    }
    assert_eq!(whoami(None, None).await.unwrap().status().as_u16(), 200, "an agent older than the header speaks 1.0");
    assert_eq!(whoami(Some("1.7"), Some("0.9.0")).await.unwrap().status().as_u16(), 200, "a higher minor is spoken");
    let nodes = r.admin_get("/v1/admin/nodes").await;
    let db1 = nodes.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap();
    assert_eq!((db1["agent_protocol"].as_str(), db1["agent_release"].as_str()), (Some("1.7"), Some("0.9.0")), "{db1}");
}

/// The node's clock as it says it (`Trellis-Time`), `offset` seconds from this machine's, which
/// the controller under test reads.
fn clock(offset: i64) -> String {
    (trellis_controller::unix_now() + offset).to_string()
}

/// Clock skew (issue 21, item 3; the review of 2026-12-02, finding 5): a node whose clock is
/// within five minutes of the controller's enrols; one further off, ahead or behind, is refused
/// enrolment with one sentence naming the node and the skew, and its token is not spent (it would
/// be given a certificate its clock holds as not yet valid). An enrolled node is served whatever
/// its clock says, renewals included, and `status` names the skew: refused, a controller's clock
/// fault would have let every node's certificate expire, and every node would have had to enrol
/// again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clock_more_than_five_minutes_off_is_refused_naming_the_skew() {
    let r = start(Database::sqlite()).await;
    let enrol = |t: &trellis_core::token::EnrolmentToken, key_byte: u8, offset: i64| {
        let body = super::enrol_body(t, key_byte);
        let req = r.http.post(format!("{}/v1/enrol", r.base)).header("trellis-time", clock(offset)).json(&body);
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.json::<serde_json::Value>().await.unwrap())
        }
    };
    let ahead = r.token("api-1").await;
    let (status, body) = enrol(&ahead, 3, 330).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("clock_skew")), "{body}");
    let error = body["error"].as_str().unwrap();
    // 5 min 30 s, give or take the second that turned between the two clocks' reads.
    assert!(error.starts_with("the clock of node `api-1` is 5 min "), "{error}");
    assert!(error.ends_with(" s ahead of the controller's, more than the 300 s tolerated: set its clock (NTP) and try again"), "{error}");
    assert_eq!(r.token_state(&ahead.id).await, "valid", "a refused clock spends no token");
    let behind = r.token("op-1").await;
    let (status, body) = enrol(&behind, 4, -3600).await;
    assert_eq!((status, body["code"].as_str()), (400, Some("clock_skew")), "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(error.starts_with("the clock of node `op-1` is ") && error.contains(" behind the controller's"), "{error}");
    // Within the bound: both enrol, one behind and one ahead.
    assert_eq!(enrol(&ahead, 3, 290).await.0, 200);
    assert_eq!(enrol(&behind, 4, -290).await.0, 200);

    let n = r.enrol_node("db-1", 1, false).await;
    let whoami = |offset: Option<i64>| {
        let mut req = n.http.get(format!("{}/v1/whoami", r.base));
        if let Some(o) = offset {
            req = req.header("trellis-time", clock(o));
        }
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    let skew_shown = || async {
        let status = r.admin_get("/v1/admin/status").await;
        let db1 = status.as_array().unwrap().iter().find(|n| n["name"] == "db-1").unwrap().clone();
        db1.get("clock_skew").and_then(|s| s.as_str()).map(str::to_string)
    };
    for ok in [None, Some(0), Some(290), Some(-290)] {
        assert_eq!(whoami(ok).await.0, 200, "{ok:?}");
    }
    assert_eq!(skew_shown().await, None, "a clock within the bound is not shown");
    for (far, words) in [(330, " ahead of "), (-330, " behind "), (86_400, " ahead of ")] {
        let (status, text) = whoami(Some(far)).await;
        assert_eq!(status, 200, "{far}: a clock far off is served: {text}");
        let shown = skew_shown().await.unwrap_or_else(|| panic!("{far}: status does not show db-1's clock"));
        assert!(shown.starts_with("the clock of node `db-1` is ") && shown.contains(words), "{far}: {shown}");
        assert!(shown.ends_with("more than the 300 s tolerated: set the clocks (NTP); its requests are still served"), "{shown}");
    }
    assert_eq!(whoami(Some(10)).await.0, 200);
    assert_eq!(skew_shown().await, None, "a clock set right again is no longer shown");
    let (status, text) = {
        let resp = n.http.get(format!("{}/v1/whoami", r.base)).header("trellis-time", "soon").send().await.unwrap();
        (resp.status().as_u16(), resp.text().await.unwrap())
    };
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("the Trellis-Time header is not a time (Unix seconds)"), "{text}");

    // Renewal: a clock 400 s behind is renewed all the same.
    let renew = |offset: i64| {
        let (_, csr) = trellis_pki::node_key_and_csr("db-1").unwrap();
        let req =
            n.http.post(format!("{}/v1/renew", r.base)).header("trellis-time", clock(offset)).json(&serde_json::json!({"csr_pem": csr}));
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.json::<serde_json::Value>().await.unwrap())
        }
    };
    let (status, body) = renew(-400).await;
    assert_eq!(status, 200, "a renewal is never refused for the clock: {body}");
    assert!(body["node_cert_pem"].as_str().is_some_and(|p| p.contains("BEGIN CERTIFICATE")), "{body}");
}

/// `[mesh] min_agent_version` (issue 21, item 3): an agent older than the minimum is refused on
/// every request with one sentence naming the node, its release and the minimum, and
/// `trellis status` says which nodes it refuses; an agent that names no release (older than the
/// header) is older than any minimum. Before, there was no way to require one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_older_than_the_minimum_is_refused_by_name_and_shown_in_status() {
    let r = start(Database::sqlite()).await;
    let n = r.enrol_node("db-1", 1, false).await;
    let whoami = |release: Option<&str>| {
        let mut req = n.http.get(format!("{}/v1/whoami", r.base)).header("trellis-protocol", "1.0");
        if let Some(a) = release {
            req = req.header("trellis-agent", a);
        }
        async move {
            let resp = req.send().await.unwrap();
            (resp.status().as_u16(), resp.text().await.unwrap())
        }
    };
    assert_eq!(whoami(Some("0.1.9")).await.0, 200, "no minimum declared");
    let mut files = trellis_testing::controller::lab_files("basic");
    files[0].text = files[0].text.replacen("[mesh]\n", "[mesh]\nmin_agent_version = \"0.2.0\"\n", 1);
    assert!(files[0].text.contains("min_agent_version"));
    let (status, body) = r.admin_post("/v1/admin/apply", serde_json::json!({"files": files})).await;
    assert_eq!(status, 200, "{body}");
    let refused = |text: &str, release: &str| {
        let body: trellis_proto::ErrorBody = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"));
        assert_eq!(body.code, "agent_too_old", "{text}");
        assert_eq!(
            body.error,
            format!("node `db-1` runs agent {release}, older than this mesh's min_agent_version 0.2.0: upgrade trellis-agent on it")
        );
    };
    // The apply is published by the background task: wait for the minimum to be taken.
    let mut last = (0, String::new());
    for _ in 0..100 {
        last = whoami(Some("0.1.9")).await;
        if last.0 == 403 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(last.0, 403, "{}", last.1);
    refused(&last.1, "0.1.9");
    let (status, text) = whoami(Some("0.2.0-rc.1")).await;
    assert_eq!(status, 403, "a pre-release comes before its release: {text}");
    refused(&text, "0.2.0-rc.1");
    let (status, text) = whoami(None).await;
    assert_eq!(status, 403, "{text}");
    refused(&text, "unknown");
    let status_of = |list: &serde_json::Value| list.as_array().unwrap().iter().find(|s| s["name"] == "db-1").unwrap().clone();
    let db1 = status_of(&r.admin_get("/v1/admin/status").await);
    assert_eq!(
        db1["agent_refused"].as_str(),
        Some("node `db-1` runs agent unknown, older than this mesh's min_agent_version 0.2.0: upgrade trellis-agent on it"),
        "{db1}"
    );
    let (status, text) = whoami(Some("0.2.0")).await;
    assert_eq!(status, 200, "{text}");
    assert_eq!(whoami(Some("1.0.0+build.7")).await.0, 200);
    let db1 = status_of(&r.admin_get("/v1/admin/status").await);
    assert!(db1.get("agent_refused").is_none(), "{db1}");
}

/// The fault: a fleet's agents reconnecting together after a controller restart, faster than
/// the controller accepts them (its runtime busy with TLS handshakes). What the kernel queues
/// for a listener that has not accepted yet is its backlog: with tokio's default of 1,024, the
/// 1,026th connection of a burst had its SYN dropped and its agent waited out a retry of a second
/// or more (thousands of them). The burst here is 2,000 connections to a controller that accepts
/// nothing until they are all in: each must be established at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_connections_waits_in_the_kernel_s_queue_not_in_syn_retries() {
    let dir = trellis_testing::TempDir::new("burst");
    let db = Database::sqlite();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let opts = trellis_controller::state::InitOptions {
        advertise: vec![format!("127.0.0.1:{port}")],
        listen: Some(format!("127.0.0.1:{port}")),
        database_url: Some(db.to_string()),
        node_cert_secs: 3600,
    };
    let state = trellis_controller::state::init(&dir.path().join("s"), &opts).await.unwrap();
    // Bound and listening, not yet accepting: every connection of the burst stays queued.
    let server = trellis_server::Server::bind(&state, None, None).await.unwrap();
    let addr = server.local_addr();
    const BURST: usize = 2000;
    let mut tasks = Vec::with_capacity(BURST);
    for _ in 0..BURST {
        tasks.push(tokio::spawn(async move {
            // Loopback answers a queued SYN in microseconds; a dropped one is retried after 1 s.
            tokio::time::timeout(std::time::Duration::from_millis(700), tokio::net::TcpStream::connect(addr)).await
        }));
    }
    let mut held = Vec::with_capacity(BURST);
    let mut late = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(Ok(s)) => held.push(s),
            _ => late += 1,
        }
    }
    assert_eq!(late, 0, "{late} of {BURST} connections were not established within 700 ms by a listener that had not accepted yet");
    // And the controller then serves them: the first queued connection gets its TLS handshake.
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    drop(held);
    let ca = state.read("ca.pem").unwrap();
    let http = reqwest::Client::builder().use_preconfigured_tls(trellis_pki::tls::client_config(&ca, None).unwrap()).build().unwrap();
    let health = http.get(format!("https://{addr}/v1/health")).send().await.unwrap();
    assert_eq!(health.status(), 200);
    let _ = stop.send(());
    done.await.unwrap().unwrap();
}
