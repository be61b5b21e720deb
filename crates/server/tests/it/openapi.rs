//! The API description: served at `/v1/openapi.json` as OpenAPI 3.1; every route the router
//! answers is in it and every path in it is a route; every path the client crate calls is in it;
//! every schema describes exactly what serde writes for its type, and what it writes reads back.

use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::{json, Value};
use trellis_proto as proto;
use trellis_testing::Database;

use super::start;

/// Checks that `value` is what `schema` describes, resolving `$ref`s in `doc`; an object may hold
/// no key its schema does not list, so a field serde writes and the schema lacks is caught.
fn conforms(doc: &Value, schema: &Value, value: &Value, at: &str) -> Result<(), String> {
    if let Some(r) = schema.get("$ref").and_then(Value::as_str) {
        let name = r.strip_prefix("#/components/schemas/").ok_or_else(|| format!("{at}: unexpected $ref {r}"))?;
        let target = &doc["components"]["schemas"][name];
        if target.is_null() {
            return Err(format!("{at}: $ref to a missing schema {name}"));
        }
        return conforms(doc, target, value, at);
    }
    if let Some(any) = schema.get("oneOf").or_else(|| schema.get("anyOf")).and_then(Value::as_array) {
        let errors: Vec<String> = any.iter().filter_map(|s| conforms(doc, s, value, at).err()).collect();
        return if errors.len() < any.len() { Ok(()) } else { Err(errors.join("; ")) };
    }
    if let Some(all) = schema.get("allOf").and_then(Value::as_array) {
        for s in all {
            conforms(doc, s, value, at)?;
        }
    }
    if let Some(options) = schema.get("enum").and_then(Value::as_array) {
        if !options.contains(value) {
            return Err(format!("{at}: {value} is not one of {options:?}"));
        }
    }
    let types: Vec<&str> = match schema.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => return Ok(()),
    };
    let kind = match value {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    };
    let described = types.contains(&kind) || (kind == "integer" && types.contains(&"number"));
    if !described {
        return Err(format!("{at}: a {kind} where the schema says {types:?}"));
    }
    match value {
        Value::Array(items) => {
            for (i, v) in items.iter().enumerate() {
                conforms(doc, &schema["items"], v, &format!("{at}[{i}]"))?;
            }
        }
        Value::Object(fields) => {
            let properties = schema["properties"].as_object().cloned().unwrap_or_default();
            for required in schema["required"].as_array().into_iter().flatten().filter_map(Value::as_str) {
                if !fields.contains_key(required) {
                    return Err(format!("{at}: required field {required} missing"));
                }
            }
            for (k, v) in fields {
                let s = properties.get(k).ok_or_else(|| format!("{at}: field {k} is not in the schema"))?;
                conforms(doc, s, v, &format!("{at}.{k}"))?;
            }
        }
        _ => {}
    }
    Ok(())
}

/// One sample of a type: it conforms to the schema of that name, and reads back as itself.
fn sample<T: Serialize + DeserializeOwned>(doc: &Value, name: &str, value: T, checked: &mut Vec<String>) {
    let json = serde_json::to_value(&value).unwrap();
    let schema = &doc["components"]["schemas"][name];
    assert!(!schema.is_null(), "no schema {name} in the document");
    if let Err(e) = conforms(doc, schema, &json, name) {
        panic!("{name}: {e}\nvalue: {json:#}\nschema: {schema:#}");
    }
    let back: T = serde_json::from_value(json.clone()).unwrap_or_else(|e| panic!("{name} does not read back: {e}"));
    assert_eq!(serde_json::to_value(&back).unwrap(), json, "{name} round trip");
    checked.push(name.to_string());
}

#[test]
fn every_schema_describes_what_serde_writes_and_reads_back() {
    let doc = serde_json::to_value(trellis_server::openapi::document()).unwrap();
    assert_eq!(doc["openapi"], "3.1.0");
    let diag = proto::Diagnostic { severity: "error".into(), file: "mesh.toml".into(), line: 3, column: 1, message: "m".into() };
    let file = proto::EvidenceFile { path: "etc/trellis/wireguard.conf".into(), sha256: "ab".into(), result: proto::FileResult::Written };
    let evidence = proto::Evidence {
        seq: 1,
        version: 2,
        result: proto::EvidenceResult::Failed,
        error: Some("e".into()),
        files: vec![file.clone()],
        at: 3,
        unmanaged: true,
    };
    let mut c = Vec::new();
    let d = &doc;
    sample(d, "ErrorBody", proto::ErrorBody { error: "e".into(), code: "c".into(), diagnostics: vec![diag.clone()] }, &mut c);
    sample(d, "ErrorBody", proto::ErrorBody { error: "e".into(), code: "c".into(), diagnostics: vec![] }, &mut c);
    sample(d, "Diagnostic", diag, &mut c);
    sample(d, "DeclFile", proto::DeclFile { path: "mesh.toml".into(), text: "t".into() }, &mut c);
    sample(d, "ApplyRequest", proto::ApplyRequest { files: vec![], expect_revision: Some(1) }, &mut c);
    sample(d, "ApplyRequest", proto::ApplyRequest { files: vec![], expect_revision: None }, &mut c);
    sample(d, "ApplyResponse", proto::ApplyResponse { revision: 1, diagnostics: vec![], unchanged: false }, &mut c);
    sample(d, "TokenRequest", proto::TokenRequest { node: "n".into(), ttl_secs: 60, require_approval: true, ..Default::default() }, &mut c);
    sample(
        d,
        "TokenCreated",
        proto::TokenCreated { token: "t".into(), id: "i".into(), node: "n".into(), expires_at: 9, pool: None, uses: 1 },
        &mut c,
    );
    let pool_token =
        proto::TokenCreated { token: "t".into(), id: "i".into(), node: "ci".into(), expires_at: 9, pool: Some("ci".into()), uses: 20 };
    sample(d, "TokenCreated", pool_token, &mut c);
    let pool_request = proto::TokenRequest { ttl_secs: 60, pool: Some("ci".into()), uses: Some(20), ..Default::default() };
    sample(d, "TokenRequest", pool_request, &mut c);
    let info = proto::TokenInfo {
        id: "i".into(),
        node: "n".into(),
        created_at: 1,
        expires_at: 2,
        used_at: Some(3),
        revoked_at: None,
        require_approval: false,
        state: proto::TokenState::Used,
        pool: None,
        uses: 1,
        used: 1,
    };
    sample(d, "TokenInfo", info.clone(), &mut c);
    sample(d, "TokenInfo", proto::TokenInfo { pool: Some("n".into()), uses: 20, used: 3, state: proto::TokenState::Valid, ..info }, &mut c);
    let enrol = proto::EnrolRequest {
        token_id: "i".into(),
        secret: "s".into(),
        node: "n".into(),
        csr_pem: "p".into(),
        wireguard_public_key: "k".into(),
    };
    sample(d, "EnrolRequest", enrol, &mut c);
    let enrolled = proto::EnrolResponse {
        node: "n".into(),
        mesh: "m".into(),
        state: proto::EnrolledState::Pending,
        node_cert_pem: "c".into(),
        ca_pem: "a".into(),
        signing_public_key: "k".into(),
        controllers: vec!["127.0.0.1:8443".into()],
    };
    sample(d, "EnrolResponse", enrolled, &mut c);
    sample(d, "RenewRequest", proto::RenewRequest { csr_pem: "p".into() }, &mut c);
    sample(d, "RenewResponse", proto::RenewResponse { node_cert_pem: "c".into(), not_after: 5 }, &mut c);
    let node = proto::NodeInfo {
        name: "n".into(),
        state: proto::NodeState::External,
        ipv4: Some("10.0.0.1".into()),
        ipv6: None,
        key_fingerprint: None,
        wireguard_public_key: Some("k".into()),
        cert_not_after: None,
        last_contact: Some(4),
        pool: None,
        revocation: None,
        agent_protocol: Some("1.0".into()),
        agent_release: Some("0.1.0".into()),
    };
    sample(d, "NodeInfo", node.clone(), &mut c);
    sample(
        d,
        "NodeInfo",
        proto::NodeInfo { name: "ci-1".into(), state: proto::NodeState::Active, pool: Some("ci".into()), ..node },
        &mut c,
    );
    sample(d, "WhoAmI", proto::WhoAmI { node: "n".into(), state: proto::EnrolledState::Revoked }, &mut c);
    sample(d, "EvidenceBatch", proto::EvidenceBatch { records: vec![evidence.clone()] }, &mut c);
    sample(d, "Evidence", evidence, &mut c);
    sample(d, "EvidenceFile", file, &mut c);
    sample(d, "EvidenceAck", proto::EvidenceAck { accepted: 1, duplicates: 0 }, &mut c);
    let status = proto::NodeStatus {
        name: "n".into(),
        state: proto::NodeState::Active,
        desired_version: Some(3),
        applied_version: None,
        last_contact: None,
        cert_not_after: Some(1),
        stale: true,
        stale_for: Some(20),
        last_result: Some(proto::EvidenceResult::Applied),
        last_error: None,
        evidence_records: 1,
        evidence_missing: 0,
        revocation: None,
        agent_refused: None,
        clock_skew: None,
        ingress: None,
        paths: Vec::new(),
    };
    sample(d, "NodeStatus", status.clone(), &mut c);
    let refused = proto::NodeStatus {
        agent_refused: Some(
            "node `n` runs agent 0.1.0, older than this mesh's min_agent_version 0.2.0: upgrade trellis-agent on it".into(),
        ),
        ..status.clone()
    };
    sample(d, "NodeStatus", refused, &mut c);
    let pair = proto::PairPath {
        peer: "b-1".into(),
        hub: "hub-1".into(),
        path: "direct".into(),
        since: Some(43_203),
        text: "direct since 12:00:03 (punched through hub-1)".into(),
    };
    sample(d, "NodeStatus", proto::NodeStatus { paths: vec![pair.clone()], ..status.clone() }, &mut c);
    let holder = proto::KeyHolder {
        name: "db-1".into(),
        dropped_in: Some(13),
        applied_version: Some(12),
        last_contact: Some(7),
        last_error: Some("nft: syntax error".into()),
    };
    let revocation = proto::Revocation {
        node: "n".into(),
        kind: proto::Withdrawal::Revocation,
        decided_at: 5,
        completed_at: None,
        seconds: 9,
        holders_known: true,
        holders: 3,
        holding: vec![holder.clone()],
        unverified: vec!["op-1".into()],
    };
    let revoking = proto::NodeStatus { state: proto::NodeState::Revoking, revocation: Some(revocation.clone()), ..status };
    sample(d, "NodeStatus", revoking, &mut c);
    sample(d, "Revocation", revocation.clone(), &mut c);
    sample(d, "Revocation", proto::Revocation { kind: proto::Withdrawal::Removal, ..revocation.clone() }, &mut c);
    sample(d, "Revocation", proto::Revocation { completed_at: Some(14), holding: vec![], ..revocation }, &mut c);
    sample(d, "KeyHolder", holder.clone(), &mut c);
    sample(
        d,
        "KeyHolder",
        proto::KeyHolder { dropped_in: None, applied_version: None, last_contact: None, last_error: None, ..holder },
        &mut c,
    );
    let record = proto::AuditRecord {
        seq: 1,
        at: 2,
        actor: "admin".into(),
        action: proto::AuditAction::NodeRevoked.to_string(),
        subject: "n".into(),
        detail: String::new(),
        prev_hash: "0".into(),
        hash: "1".into(),
    };
    sample(d, "AuditRecord", record, &mut c);
    sample(d, "Checkpoint", proto::audit::Checkpoint { seq: 1, hash: "h".into(), signature: "s".into() }, &mut c);
    let rule = proto::RuleMatch {
        module: "app".into(),
        rule: 1,
        at: "modules/app.toml:4:1".into(),
        proto: "tcp".into(),
        ports: vec!["80".into()],
        matched: vec!["node:a-1".into()],
    };
    let explained = proto::Explanation {
        from: "a-1".into(),
        to: "b-1".into(),
        path: "relayed".into(),
        hub: Some("hub-1".into()),
        reasons: vec!["r".into()],
        forward: vec![rule.clone()],
        reverse: vec![],
        text: "path a-1 <-> b-1: relayed through hub hub-1\n".into(),
    };
    sample(d, "Explanation", explained, &mut c);
    sample(d, "RuleMatch", rule, &mut c);
    let gnode = proto::GraphNode {
        name: "a-1".into(),
        hub: false,
        networks: vec!["isp-a".into()],
        x: 500.0,
        y: 100.5,
        state: proto::NodeState::Active,
        shown: proto::Shown::Stale,
        desired_version: Some(2),
        applied_version: Some(1),
        stale_for: Some(30),
        last_contact: None,
        last_error: Some("e".into()),
        holds: vec![],
        certificates_expiring: vec!["postgres".into()],
    };
    let link = proto::GraphLink {
        a: "a-1".into(),
        b: "b-1".into(),
        reach: "relayed".into(),
        hub: Some("hub-1".into()),
        path: Some("direct since 12:00:03 (punched through hub-1)".into()),
        d: "M1 2 Q3 4 5 6".into(),
    };
    sample(d, "MeshGraph", proto::MeshGraph { revision: Some(1), nodes: vec![gnode.clone()], links: vec![link.clone()] }, &mut c);
    sample(d, "GraphNode", proto::GraphNode { holds: vec!["db-1".into()], ..gnode.clone() }, &mut c);
    sample(d, "GraphNode", gnode, &mut c);
    sample(d, "GraphLink", link, &mut c);
    let spec = proto::ServiceCertSpec {
        module: "postgres".into(),
        dns: vec!["postgres.m".into(), "db-1.m".into()],
        ips: vec!["10.0.0.1".into()],
        uri: "spiffe://m/module/postgres".into(),
        group: Some("postgres".into()),
        reload: None,
        lifetime_secs: 86_400,
    };
    sample(d, "ServiceCertList", proto::ServiceCertList { certificates: vec![spec.clone()] }, &mut c);
    sample(d, "ServiceCertSpec", spec, &mut c);
    sample(d, "ServiceCertRequest", proto::ServiceCertRequest { module: "postgres".into(), csr_pem: "CSR".into() }, &mut c);
    let issued = proto::ServiceCertResponse {
        module: "postgres".into(),
        cert_pem: "C".into(),
        chain_pem: "I".into(),
        ca_pem: "R".into(),
        serial: "01".into(),
        not_after: 2,
    };
    sample(d, "ServiceCertResponse", issued, &mut c);
    let info = proto::ServiceCertInfo {
        node: "db-1".into(),
        module: "postgres".into(),
        declared: true,
        names: vec!["postgres.m".into()],
        serial: None,
        issued_at: None,
        not_after: Some(3),
        lifetime_secs: Some(60),
        refused_at: Some(1),
        refusal: Some("r".into()),
        held_serial: Some("00".into()),
        held_not_after: Some(2),
        node_error: Some("e".into()),
        reported_at: Some(1),
    };
    sample(d, "ServiceCertInfo", info, &mut c);
    let held = proto::HeldServiceCert { module: "postgres".into(), serial: Some("01".into()), not_after: Some(2), error: None };
    sample(d, "HeldServiceCerts", proto::HeldServiceCerts { certificates: vec![held.clone()] }, &mut c);
    sample(d, "HeldServiceCert", held, &mut c);
    sample(d, "HeldServiceCertsAck", proto::HeldServiceCertsAck { recorded: 1 }, &mut c);
    let report = proto::IngressReport {
        traefik: "running".into(),
        error: None,
        routers: vec![proto::IngressRouter { name: "shop-0".into(), status: "enabled".into(), errors: vec![] }],
        certificates: vec![proto::IngressCertificate { hostname: "shop.example.com".into(), not_after: 9 }],
    };
    sample(d, "IngressRouter", report.routers[0].clone(), &mut c);
    sample(d, "IngressCertificate", report.certificates[0].clone(), &mut c);
    sample(d, "IngressState", proto::IngressState { node: "edge-1".into(), reported_at: 1, report: report.clone() }, &mut c);
    sample(d, "IngressReport", report, &mut c);
    sample(d, "IngressAck", proto::IngressAck { recorded: true }, &mut c);
    let observed =
        proto::ObservedEndpoint { public_key: trellis_testing::controller::wireguard_key(2), endpoint: "203.0.113.2:4002".into() };
    let state = proto::PathState { peer: "b-1".into(), state: "backing-off".into(), since: 1, reason: Some("no handshake".into()) };
    sample(d, "ObservedEndpoint", observed.clone(), &mut c);
    sample(d, "PathState", state.clone(), &mut c);
    sample(d, "PathReport", proto::PathReport { observed: vec![observed], paths: vec![state] }, &mut c);
    sample(d, "PathAck", proto::PathAck { observed: 1 }, &mut c);
    sample(d, "PairPath", pair, &mut c);

    for s in proto::Shown::ALL {
        sample(d, "Shown", *s, &mut c);
    }
    for s in proto::EnrolledState::ALL {
        sample(d, "EnrolledState", *s, &mut c);
    }
    let list = proto::ControllerList {
        controllers: vec!["127.0.0.1:8443".into(), "c2.acme.example:8443".into()],
        server_names: vec!["127.0.0.1".into()],
    };
    sample(d, "ControllerList", list, &mut c);
    sample(d, "ControllerChange", proto::ControllerChange { address: "c2.acme.example:8443".into() }, &mut c);
    sample(d, "SigningKeyRotation", proto::SigningKeyRotation { next_public_key: "AAAA".into(), overlap_secs: 86_400 }, &mut c);
    sample(d, "CaRotation", proto::CaRotation { next_ca_fingerprint: "ab".repeat(32), overlap_secs: 86_400 }, &mut c);
    let rotation = proto::Rotation {
        kind: "signing-key".into(),
        next_key: "AAAA".into(),
        started_at: 1,
        overlap_secs: 86_400,
        completes_by: 86_401,
        completed_at: None,
        completed_by: None,
        confirmed: vec!["db-1".into()],
        waiting: vec!["api-1".into()],
    };
    sample(d, "Rotation", rotation.clone(), &mut c);
    sample(d, "Rotation", proto::Rotation { completed_at: Some(9), completed_by: Some("evidence".into()), ..rotation }, &mut c);
    for s in proto::NodeState::ALL {
        sample(d, "NodeState", *s, &mut c);
    }
    for s in proto::TokenState::ALL {
        sample(d, "TokenState", *s, &mut c);
    }
    for s in proto::Withdrawal::ALL {
        sample(d, "Withdrawal", *s, &mut c);
    }
    for s in proto::EvidenceResult::ALL {
        sample(d, "EvidenceResult", *s, &mut c);
    }
    for s in proto::FileResult::ALL {
        sample(d, "FileResult", *s, &mut c);
    }
    let mut unchecked: Vec<&String> = doc["components"]["schemas"].as_object().unwrap().keys().filter(|k| !c.contains(k)).collect();
    unchecked.sort();
    assert!(unchecked.is_empty(), "schemas without a sample here: {unchecked:?}");
}

/// Checks a live answer against the operation's description: its status is described (itself
/// or its class), a JSON body conforms to the schema described for it, and a 401's challenge
/// header is there.
fn answers_as_described(doc: &Value, op: &Value, status: u16, challenge: bool, text: &str) -> Result<(), String> {
    let responses = &op["responses"];
    let class = format!("{}XX", status / 100);
    let described =
        [status.to_string(), class].into_iter().find_map(|k| responses.get(&k)).ok_or_else(|| format!("{status} is not described"))?;
    if status == 401 && !challenge {
        return Err("a 401 without WWW-Authenticate".into());
    }
    if let Some(schema) = described["content"].get("application/json").and_then(|c| c.get("schema")) {
        let value: Value = serde_json::from_str(text).map_err(|e| format!("{status}: not JSON ({e}): {text}"))?;
        conforms(doc, schema, &value, "answer")?;
    }
    Ok(())
}

/// `{name}` and `{id}` filled in, so that the request reaches the handler.
fn concrete(path: &str) -> String {
    path.replace("{name}", "nobody").replace("{id}", "00")
}

#[tokio::test]
async fn every_route_is_described_and_every_described_path_is_a_route() {
    let r = start(Database::sqlite()).await;
    let served: Value = r.http.get(format!("{}/v1/openapi.json", r.base)).send().await.unwrap().json().await.unwrap();
    assert_eq!(served, serde_json::to_value(trellis_server::openapi::document()).unwrap(), "the served document is the one made");
    let paths = served["paths"].as_object().unwrap();
    let mut operations = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().unwrap().iter().filter(|(m, _)| ["get", "post", "delete", "put"].contains(&m.as_str())) {
            operations += 1;
            let url = format!("{}{}", r.base, concrete(path));
            let req = r.http.request(method.to_uppercase().parse().unwrap(), &url).bearer_auth(&r.admin).json(&json!({}));
            let resp = req.send().await.unwrap();
            let status = resp.status().as_u16();
            let challenge = resp.headers().contains_key("www-authenticate");
            let text = resp.text().await.unwrap_or_default();
            answers_as_described(&served, op, status, challenge, &text).unwrap_or_else(|e| panic!("{method} {path}: {e}"));
            // The router's own refusals (no route, no such method) have their own codes; every
            // handler's refusal is an ErrorBody with another.
            let code = serde_json::from_str::<Value>(&text).ok().and_then(|b| b["code"].as_str().map(str::to_string));
            let routed = status != 405 && status != 404 || code.is_some_and(|c| c != "no_route" && c != "method_not_allowed");
            assert!(routed, "{method} {path}: the router has no such route ({status} {text})");
        }
    }
    // Every route the router serves comes from the same list as the document (`routes::api`);
    // and a path that is not described is not served.
    let unknown = r.http.get(format!("{}/v1/admin/undescribed", r.base)).bearer_auth(&r.admin).send().await.unwrap();
    assert_eq!(unknown.status().as_u16(), 404);
    assert_eq!(unknown.json::<Value>().await.unwrap()["code"], "no_route");
    assert_eq!(operations, 33, "operations described: {:?}", paths.keys().collect::<Vec<_>>());

    // Every path the client crate calls is described.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../client/src");
    for entry in std::fs::read_dir(&dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for called in text.split('"').filter_map(|s| s.find("/v1/").map(|i| &s[i..])) {
            let called = called.split('?').next().unwrap();
            let pattern = called.replace("{node}", "{name}");
            assert!(paths.contains_key(&pattern), "the client calls {called}, which the document does not describe");
        }
    }
}

/// What the document says of the answers the handlers' types do not show: the bundle's two
/// content types and its headers, `wait`'s bound, and the `WWW-Authenticate` of every 401. And
/// the document is valid OpenAPI, as `openapi-spec-validator` (PyPI; `scripts/install-deps`
/// installs it) reads it.
#[test]
fn the_document_describes_headers_content_types_and_bounds_and_is_valid() {
    let doc = serde_json::to_value(trellis_server::openapi::document()).unwrap();
    let bundle = &doc["paths"]["/v1/bundle"]["get"];
    let whole = &bundle["responses"]["200"];
    let types: Vec<&String> = whole["content"].as_object().unwrap().keys().collect();
    assert_eq!(types, ["application/octet-stream", proto::DELTA_TYPE], "{whole:#}");
    for status in ["200", "304"] {
        for header in ["ETag", "X-Trellis-Freshness"] {
            assert!(bundle["responses"][status]["headers"][header].is_object(), "{status} {header}: {bundle:#}");
        }
    }
    // The declaration is taken as JSON or in trellis's own form.
    let apply = &doc["paths"]["/v1/admin/apply"]["post"]["requestBody"]["content"];
    let types: Vec<&String> = apply.as_object().unwrap().keys().collect();
    assert_eq!(types, ["application/json", proto::declaration::MEDIA_TYPE], "{apply:#}");
    let wait = bundle["parameters"].as_array().unwrap().iter().find(|p| p["name"] == "wait").unwrap();
    assert_eq!(wait["schema"]["maximum"], json!(trellis_controller::bundle::MAX_WAIT.as_secs()), "{wait:#}");
    let mut challenged = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            let secured = op.get("security").is_some() || path == "/v1/enrol";
            let unauthorized = &op["responses"]["401"];
            assert_eq!(secured, unauthorized.is_object(), "{method} {path}: a 401 is described where a credential is asked for");
            if secured {
                assert!(unauthorized["headers"]["WWW-Authenticate"].is_object(), "{method} {path}: {unauthorized:#}");
                challenged += 1;
            }
        }
    }
    assert!(challenged >= 15, "{challenged}");

    // Through the one skip mechanism: a laptop without the validator says so once, CI
    // (TRELLIS_TEST_REQUIRE_ALL) fails.
    if !trellis_testing::can_run(trellis_testing::Need::Program("openapi-spec-validator")) {
        return;
    }
    let dir = trellis_testing::TempDir::new("openapi");
    let file = dir.path().join("openapi.json");
    std::fs::write(&file, serde_json::to_vec_pretty(&doc).unwrap()).unwrap();
    let out = std::process::Command::new("openapi-spec-validator").arg(&file).output().expect("openapi-spec-validator runs");
    assert!(
        out.status.success(),
        "openapi-spec-validator refuses the document:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
