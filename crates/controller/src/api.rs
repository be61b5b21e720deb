//! The HTTP API: `fn app(ctx) -> Router`. Handlers parse, call the core or the store, and map
//! errors; authentication is two extractors, `Admin` (bearer credential) and `NodeIdentity`
//! (a client certificate issued by the mesh CA, for a node that is neither revoked nor replaced).

use std::sync::Arc;
use std::time::Duration;

use axum::extract::{DefaultBodyLimit, FromRequestParts, Path, State};
use axum::http::request::Parts;
use axum::http::StatusCode;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use base64::Engine;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use trellis_core::decl::PublicKey;
use trellis_core::token::EnrolmentToken;
use trellis_core::{Declaration, SourceFile};
use trellis_proto as proto;
use trellis_proto::{EnrolledState, NodeState, TokenState};
use trellis_store::{Audit, NodeRecord, Store, TokenRecord};

use crate::error::ApiError;
use crate::now;
use crate::state::Config;

/// Everything a handler needs.
pub struct Ctx {
    pub store: Store,
    pub ca: trellis_pki::Ca,
    pub config: Config,
    pub signing_key: ed25519_dalek::SigningKey,
    pub signing_public_key: [u8; 32],
    pub publisher: crate::publish::Publisher,
    pub admin_sha256: [u8; 32],
    /// The parsed declaration of the newest revision seen, keyed by its number. A cache only:
    /// the database says which revision is current.
    pub declaration: tokio::sync::Mutex<Option<(i64, Arc<Declaration>)>>,
}

/// The DER of the client certificate of this connection, if one was presented.
#[derive(Clone, Debug, Default)]
pub struct PeerCert(pub Option<Arc<Vec<u8>>>);

type Shared = Arc<Ctx>;

pub fn app(ctx: Shared) -> Router {
    Router::new()
        .route("/v1/health", get(|| async { "ok\n" }))
        .route("/v1/enrol", post(enrol).layer(DefaultBodyLimit::max(SMALL_BODY)))
        .route("/v1/renew", post(renew).layer(DefaultBodyLimit::max(SMALL_BODY)))
        .route("/v1/whoami", get(whoami))
        .route("/v1/bundle", get(bundle))
        .route("/v1/evidence", post(evidence).layer(DefaultBodyLimit::max(EVIDENCE_BODY)))
        .route("/v1/admin/status", get(status))
        .route("/v1/admin/apply", post(apply).layer(DefaultBodyLimit::max(DECLARATION_BODY)))
        .route("/v1/admin/tokens", post(create_token).get(list_tokens))
        .route("/v1/admin/tokens/{id}", delete(revoke_token))
        .route("/v1/admin/nodes", get(list_nodes))
        .route("/v1/admin/nodes/{name}/approve", post(approve))
        .route("/v1/admin/nodes/{name}/revoke", post(revoke))
        .route("/v1/admin/audit", get(audit_log))
        .layer(DefaultBodyLimit::max(SMALL_BODY))
        .with_state(ctx)
}

// --- request bodies --------------------------------------------------------------------------

/// A JSON body whose every rejection (wrong content type, malformed JSON, unknown or missing
/// fields, too large) is one clear sentence in the API's error shape.
/// `MAX` bounds the body: one announced as larger is refused from its headers, before a byte of
/// it is read; one that turns out larger while read (chunked) is cut off by the route's
/// `DefaultBodyLimit`.
pub struct Body<T, const MAX: usize = SMALL_BODY>(pub T);

pub const SMALL_BODY: usize = 64 * 1024;
pub const DECLARATION_BODY: usize = 16 * 1024 * 1024;
pub const EVIDENCE_BODY: usize = 4 * 1024 * 1024;

impl<T: serde::de::DeserializeOwned, S: Send + Sync, const MAX: usize> axum::extract::FromRequest<S> for Body<T, MAX> {
    type Rejection = ApiError;

    async fn from_request(req: axum::extract::Request, state: &S) -> Result<Self, ApiError> {
        use axum::extract::rejection::JsonRejection;
        let announced =
            req.headers().get(axum::http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if announced.is_some_and(|n| n > MAX as u64) {
            return Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", "the request body is larger than this endpoint accepts"));
        }
        match Json::<T>::from_request(req, state).await {
            Ok(Json(v)) => Ok(Body(v)),
            Err(JsonRejection::MissingJsonContentType(_)) => Err(ApiError::new(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "content_type",
                "the request body must be JSON (Content-Type: application/json)",
            )),
            Err(JsonRejection::JsonSyntaxError(e)) => {
                Err(ApiError::bad_request(format!("the request body is not valid JSON: {}", inner(&e))))
            }
            Err(JsonRejection::JsonDataError(e)) => {
                Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "bad_fields", format!("the request body does not fit: {}", inner(&e))))
            }
            Err(JsonRejection::BytesRejection(_)) => {
                Err(ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "too_large", "the request body is larger than this endpoint accepts"))
            }
            Err(other) => Err(ApiError::bad_request(other.body_text())),
        }
    }
}

fn inner(e: &dyn std::error::Error) -> String {
    let mut e = e;
    while let Some(s) = e.source() {
        e = s;
    }
    e.to_string()
}

// --- authentication --------------------------------------------------------------------------

/// An administrator: the request carries the admin credential as a bearer token.
pub struct Admin;

impl FromRequestParts<Shared> for Admin {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ctx: &Shared) -> Result<Self, ApiError> {
        let given = parts
            .headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .ok_or_else(|| ApiError::unauthorized("admin_required", "this needs the admin credential (Authorization: Bearer ...)"))?;
        let digest: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
        if bool::from(digest.ct_eq(&ctx.admin_sha256)) {
            Ok(Admin)
        } else {
            Err(ApiError::unauthorized("admin_denied", "the admin credential is wrong"))
        }
    }
}

/// A node, proven by its certificate: issued by the mesh CA (checked by TLS), with the serial the
/// node currently holds (or just replaced), for a node that is not revoked. Answered from the
/// publisher's table, so a long-poll or a `304` needs no database; a node it does not know yet
/// (just enrolled on another replica) is looked up in the database.
pub struct NodeIdentity {
    pub name: String,
    pub state: EnrolledState,
    pub serial: String,
}

impl FromRequestParts<Shared> for NodeIdentity {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, ctx: &Shared) -> Result<Self, ApiError> {
        let cert = parts
            .extensions
            .get::<PeerCert>()
            .and_then(|p| p.0.clone())
            .ok_or_else(|| ApiError::unauthorized("node_certificate_required", "this needs a node certificate (mutual TLS)"))?;
        let info = trellis_pki::inspect_der(&cert).map_err(|e| ApiError::unauthorized("bad_certificate", e.to_string()))?;
        let node = info.common_name;
        let entry = match ctx.publisher.auth(&node) {
            Some(e) if e.serials.contains(&info.serial) || e.state == EnrolledState::Revoked => e,
            _ => {
                let record = ctx
                    .store
                    .node(&node)
                    .await?
                    .ok_or_else(|| ApiError::forbidden("unknown_node", format!("node `{node}` is not enrolled")))?;
                crate::publish::AuthEntry {
                    state: record.state,
                    serials: [record.cert_serial, record.prev_cert_serial].into_iter().flatten().collect(),
                }
            }
        };
        if entry.state == EnrolledState::Revoked {
            return Err(ApiError::forbidden("node_revoked", format!("node `{node}` has been revoked")));
        }
        if !entry.serials.contains(&info.serial) {
            return Err(ApiError::forbidden(
                "certificate_replaced",
                format!("this certificate of node `{node}` has been replaced; enrol again"),
            ));
        }
        ctx.publisher.contact(&node, now());
        Ok(NodeIdentity { name: node, state: entry.state, serial: info.serial })
    }
}

/// Publishes after a decision. The decision stands even if publishing fails; the background
/// task retries.
async fn republish(ctx: &Ctx) {
    if let Err(e) = ctx.publisher.publish(ctx).await {
        eprintln!("trellis serve: publishing after a decision failed ({}); will retry", e.message);
    }
}

// --- declarations ----------------------------------------------------------------------------

fn diag(d: &trellis_core::Diagnostic) -> proto::Diagnostic {
    proto::Diagnostic {
        severity: d.severity.as_str().to_string(),
        file: d.loc.file.to_string(),
        line: d.loc.line,
        column: d.loc.col,
        message: d.message.clone(),
    }
}

fn valid_path(p: &str) -> bool {
    p == "mesh.toml"
        || p.strip_prefix("modules/")
            .and_then(|n| n.strip_suffix(".toml"))
            .is_some_and(|n| !n.is_empty() && n.len() <= 64 && n.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_'))
}

/// Loads a stored or submitted set of files, mesh.toml first.
pub fn load_files(files: &[(String, String)]) -> trellis_core::Loaded {
    let mesh = files.iter().find(|(p, _)| p == "mesh.toml").map(|(p, t)| SourceFile { path: p.clone(), text: t.clone() });
    let mut modules: Vec<SourceFile> =
        files.iter().filter(|(p, _)| p != "mesh.toml").map(|(p, t)| SourceFile { path: p.clone(), text: t.clone() }).collect();
    modules.sort_by(|a, b| a.path.cmp(&b.path));
    trellis_core::load(&mesh.unwrap_or(SourceFile { path: "mesh.toml".into(), text: String::new() }), &modules)
}

/// The declaration of the current revision, if any: parsed once per revision.
pub async fn current_declaration(ctx: &Ctx) -> Result<Option<(i64, Arc<Declaration>)>, ApiError> {
    let Some((number, _)) = ctx.store.current_revision_head().await? else {
        return Ok(None);
    };
    let mut cache = ctx.declaration.lock().await;
    if let Some((n, d)) = cache.as_ref() {
        if *n == number {
            return Ok(Some((number, d.clone())));
        }
    }
    let Some(rev) = ctx.store.current_revision().await? else {
        return Ok(None);
    };
    let decl =
        load_files(&rev.files).declaration.ok_or_else(|| ApiError::internal("loading the stored revision", "it no longer validates"))?;
    let decl = Arc::new(decl);
    *cache = Some((rev.number, decl.clone()));
    Ok(Some((rev.number, decl)))
}
async fn apply(
    State(ctx): State<Shared>,
    _: Admin,
    Body(req): Body<proto::ApplyRequest, DECLARATION_BODY>,
) -> Result<Json<proto::ApplyResponse>, ApiError> {
    let mut files: Vec<(String, String)> = Vec::new();
    for f in &req.files {
        if !valid_path(&f.path) {
            return Err(ApiError::bad_request(format!("file {:?} is neither mesh.toml nor modules/NAME.toml", f.path)));
        }
        if files.iter().any(|(p, _)| *p == f.path) {
            return Err(ApiError::bad_request(format!("file {:?} is sent twice", f.path)));
        }
        files.push((f.path.clone(), f.text.clone()));
    }
    if !files.iter().any(|(p, _)| p == "mesh.toml") {
        return Err(ApiError::bad_request("the declaration has no mesh.toml"));
    }
    files.sort();
    let loaded = load_files(&files);
    let mut diagnostics = loaded.diagnostics.clone();
    let decl = loaded.declaration;
    if let Some(d) = &decl {
        diagnostics.extend(trellis_core::explain::check(d));
        trellis_core::diag::sort(&mut diagnostics);
    }
    let out: Vec<proto::Diagnostic> = diagnostics.iter().map(diag).collect();
    let errors = diagnostics.iter().filter(|d| d.is_error()).count();
    let Some(decl) = decl.filter(|_| errors == 0) else {
        let mut e = ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_declaration",
            format!("the declaration has {errors} error(s); nothing was changed"),
        );
        e.diagnostics = out;
        return Err(e);
    };
    let digest = {
        let mut h = Sha256::new();
        for (p, t) in &files {
            h.update((p.len() as u64).to_be_bytes());
            h.update(p.as_bytes());
            h.update((t.len() as u64).to_be_bytes());
            h.update(t.as_bytes());
        }
        hex::encode(h.finalize())
    };
    let current = ctx.store.current_revision().await?;
    if let Some(cur) = &current {
        if let Some(expected) = req.expect_revision {
            if expected != cur.number {
                return Err(trellis_store::StoreError::Conflict { current: cur.number, expected }.into());
            }
        }
        if cur.digest == digest {
            return Ok(Json(proto::ApplyResponse { revision: cur.number, diagnostics: out, unchanged: true }));
        }
    }
    let previous = ctx.store.allocation().await?;
    let allocation = trellis_core::allocate(&decl, &previous).map_err(|d| {
        let mut e = ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_declaration", d.message.clone());
        e.diagnostics = vec![diag(&d)];
        e
    })?;
    let audit =
        Audit { at: now(), actor: "admin", action: "declaration applied", subject: &decl.mesh.name, detail: format!("sha256 {digest}") };
    let revision = ctx.store.apply(&files, &digest, &allocation, req.expect_revision, &audit).await?;
    republish(&ctx).await;
    Ok(Json(proto::ApplyResponse { revision, diagnostics: out, unchanged: false }))
}

// --- tokens ----------------------------------------------------------------------------------

const MAX_TTL: u64 = 30 * 86400;

async fn create_token(
    State(ctx): State<Shared>,
    _: Admin,
    Body(req): Body<proto::TokenRequest>,
) -> Result<Json<proto::TokenCreated>, ApiError> {
    if req.ttl_secs == 0 || req.ttl_secs > MAX_TTL {
        return Err(ApiError::bad_request(format!("token lifetime must be between 1 second and 30 days, not {} seconds", req.ttl_secs)));
    }
    let Some((rev, decl)) = current_declaration(&ctx).await? else {
        return Err(ApiError::conflict("no_declaration", "no declaration has been applied yet; run `trellis apply DIR` first"));
    };
    let Some(node) = decl.node(&req.node) else {
        return Err(ApiError::not_found(format!("node `{}` is not declared in revision {rev}; declare it and apply first", req.node)));
    };
    if node.public_key.is_some() {
        return Err(ApiError::conflict(
            "node_managed_outside",
            format!("node `{}` declares a public_key: it is managed outside trellis and does not enrol", req.node),
        ));
    }
    let id: [u8; 8] = rand::random();
    let secret: [u8; 24] = rand::random();
    let created = now();
    let expires = created + req.ttl_secs as i64;
    let token = EnrolmentToken {
        controllers: ctx.config.advertise.clone(),
        ca_fingerprint: ctx.ca.fingerprint(),
        id,
        secret,
        node: req.node.clone(),
        expires: expires as u64,
    };
    let text = token.encode().map_err(|e| ApiError::bad_request(e.to_string()))?;
    let record = TokenRecord {
        id: hex::encode(id),
        node: req.node.clone(),
        secret_sha256: hex::encode(Sha256::digest(secret)),
        created_at: created,
        expires_at: expires,
        used_at: None,
        revoked_at: None,
        require_approval: req.require_approval,
    };
    let audit = Audit {
        at: created,
        actor: "admin",
        action: "token issued",
        subject: &req.node,
        detail: format!("token {} expires {expires}", record.id),
    };
    ctx.store.create_token(&record, &audit).await?;
    Ok(Json(proto::TokenCreated { token: text, id: record.id, node: req.node, expires_at: expires }))
}

fn token_info(t: &TokenRecord, now: i64) -> proto::TokenInfo {
    let state = if t.revoked_at.is_some() {
        TokenState::Revoked
    } else if t.used_at.is_some() {
        TokenState::Used
    } else if now >= t.expires_at {
        TokenState::Expired
    } else {
        TokenState::Valid
    };
    proto::TokenInfo {
        id: t.id.clone(),
        node: t.node.clone(),
        created_at: t.created_at,
        expires_at: t.expires_at,
        used_at: t.used_at,
        revoked_at: t.revoked_at,
        require_approval: t.require_approval,
        state,
    }
}

async fn list_tokens(State(ctx): State<Shared>, _: Admin) -> Result<Json<Vec<proto::TokenInfo>>, ApiError> {
    let n = now();
    Ok(Json(ctx.store.tokens().await?.iter().map(|t| token_info(t, n)).collect()))
}

async fn revoke_token(State(ctx): State<Shared>, _: Admin, Path(id): Path<String>) -> Result<Json<proto::TokenInfo>, ApiError> {
    let Some(t) = ctx.store.token(&id).await? else {
        return Err(ApiError::not_found(format!("no token {id}")));
    };
    let audit = Audit { at: now(), actor: "admin", action: "token revoked", subject: &t.node, detail: format!("token {id}") };
    if !ctx.store.revoke_token(&id, &audit).await? {
        let state = token_info(&t, now()).state;
        return Err(ApiError::conflict("token_not_revocable", format!("token {id} is {state}; only an unused token can be revoked")));
    }
    let t = ctx.store.token(&id).await?.expect("just revoked");
    Ok(Json(token_info(&t, now())))
}

// --- enrolment -------------------------------------------------------------------------------

async fn enrol(State(ctx): State<Shared>, Body(req): Body<proto::EnrolRequest>) -> Result<Json<proto::EnrolResponse>, ApiError> {
    let (token_id, node) = (req.token_id.clone(), req.node.clone());
    match redeem(&ctx, req).await {
        Ok(r) => Ok(r),
        Err(e) => {
            // A refused redemption is a governance event too; its record changes nothing else.
            let audit = Audit {
                at: now(),
                actor: &format!("token {token_id}"),
                action: "token redemption refused",
                subject: &node,
                detail: e.message.clone(),
            };
            if let Err(ae) = ctx.store.record(&audit).await {
                eprintln!("trellis serve: cannot audit a refused redemption: {ae}");
            }
            Err(e)
        }
    }
}

async fn redeem(ctx: &Shared, req: proto::EnrolRequest) -> Result<Json<proto::EnrolResponse>, ApiError> {
    if req.token_id.len() != 16 || req.node.len() > 63 || req.csr_pem.len() > 16 * 1024 {
        return Err(ApiError::bad_request("the enrolment request is malformed (token id, node name or CSR size)"));
    }
    let secret = base64::engine::general_purpose::STANDARD
        .decode(&req.secret)
        .ok()
        .filter(|s| s.len() == 24)
        .ok_or_else(|| ApiError::bad_request("the token secret is malformed"))?;
    let token = ctx
        .store
        .token(&req.token_id)
        .await?
        .ok_or_else(|| ApiError::unauthorized("token_unknown", "token is not known to this controller"))?;
    let stored = hex::decode(&token.secret_sha256).map_err(|e| ApiError::internal("reading a token", e))?;
    let given = Sha256::digest(&secret);
    if !bool::from(given.as_slice().ct_eq(&stored)) {
        return Err(ApiError::unauthorized("token_wrong", "token secret does not match; copy the token again"));
    }
    let t = now();
    if token.revoked_at.is_some() {
        return Err(ApiError::unauthorized("token_revoked", "token has been revoked"));
    }
    if token.used_at.is_some() {
        return Err(ApiError::conflict("token_used", "token already used"));
    }
    if t >= token.expires_at {
        return Err(ApiError::unauthorized("token_expired", "token has expired; ask for a new one"));
    }
    if req.node != token.node {
        return Err(ApiError::forbidden("token_node", format!("token is for node `{}`, not `{}`", token.node, req.node)));
    }
    let Some((rev, decl)) = current_declaration(ctx).await? else {
        return Err(ApiError::conflict("no_declaration", "no declaration has been applied"));
    };
    let Some(node) = decl.node(&req.node) else {
        return Err(ApiError::forbidden("node_undeclared", format!("node `{}` is no longer declared (revision {rev})", req.node)));
    };
    if node.public_key.is_some() {
        return Err(ApiError::forbidden("node_managed_outside", format!("node `{}` declares a public_key and does not enrol", req.node)));
    }
    let key = PublicKey::parse(&req.wireguard_public_key)
        .ok_or_else(|| ApiError::bad_request("wireguard_public_key is not a WireGuard public key (44 characters of base64)"))?;
    if let Some(holder) = decl.nodes.iter().find(|n| n.public_key == Some(key)) {
        return Err(ApiError::conflict("key_taken", format!("WireGuard public key is already held by node `{}`", holder.name)));
    }
    let lifetime = Duration::from_secs(ctx.config.node_cert_secs);
    let issued = ctx
        .ca
        .sign_node(&req.csr_pem, &req.node, &decl.mesh.name, std::time::SystemTime::now(), lifetime)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let state = if token.require_approval { EnrolledState::Pending } else { EnrolledState::Active };
    let record = NodeRecord {
        name: req.node.clone(),
        state,
        wg_public_key: Some(key.to_string()),
        cert_serial: Some(issued.serial.clone()),
        prev_cert_serial: None,
        cert_not_after: Some(issued.not_after),
        enrolled_at: t,
        last_contact: Some(t),
        cert_pem: Some(issued.cert_pem.clone()),
    };
    let audit = Audit {
        at: t,
        actor: &format!("token {}", token.id),
        action: "node enrolled",
        subject: &req.node,
        detail: format!("state {state}, key {key}, certificate {}", issued.serial),
    };
    ctx.store.enrol(&token.id, &record, &audit).await?;
    republish(ctx).await;
    Ok(Json(proto::EnrolResponse {
        node: req.node,
        mesh: decl.mesh.name.clone(),
        state,
        node_cert_pem: issued.cert_pem,
        ca_pem: ctx.ca.cert_pem().to_string(),
        signing_public_key: base64::engine::general_purpose::STANDARD.encode(ctx.signing_public_key),
        controllers: ctx.config.advertise.clone(),
    }))
}

async fn renew(
    State(ctx): State<Shared>,
    who: NodeIdentity,
    Body(req): Body<proto::RenewRequest>,
) -> Result<Json<proto::RenewResponse>, ApiError> {
    let name = who.name.clone();
    let mesh = current_declaration(&ctx).await?.map(|(_, d)| d.mesh.name.clone()).unwrap_or_default();
    let issued = ctx
        .ca
        .sign_node(&req.csr_pem, &name, &mesh, std::time::SystemTime::now(), Duration::from_secs(ctx.config.node_cert_secs))
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let audit = Audit {
        at: now(),
        actor: &format!("node {name}"),
        action: "certificate renewed",
        subject: &name,
        detail: format!("{} replaces {}", issued.serial, who.serial),
    };
    ctx.store.renew(&name, &who.serial, &issued.serial, issued.not_after, &issued.cert_pem, &audit).await?;
    republish(&ctx).await;
    Ok(Json(proto::RenewResponse { node_cert_pem: issued.cert_pem, not_after: issued.not_after }))
}

async fn whoami(who: NodeIdentity) -> Json<proto::WhoAmI> {
    Json(proto::WhoAmI { node: who.name, state: who.state })
}

// --- nodes -----------------------------------------------------------------------------------

fn key_fingerprint(key: &str) -> Option<String> {
    PublicKey::parse(key).map(|k| hex::encode(&Sha256::digest(k.0)[..8]))
}

/// A node the controller knows of, declared or enrolled (or both), with its lifecycle state.
struct RosterEntry {
    name: String,
    state: NodeState,
    declared_key: Option<PublicKey>,
    record: Option<NodeRecord>,
}

/// Every node, in name order. Contacts held in memory are written first, so they show.
async fn roster(ctx: &Ctx) -> Result<Vec<RosterEntry>, ApiError> {
    ctx.publisher.flush_contacts(ctx).await;
    let decl = current_declaration(ctx).await?.map(|(_, d)| d);
    let mut records: std::collections::HashMap<String, NodeRecord> =
        ctx.store.nodes().await?.into_iter().map(|r| (r.name.clone(), r)).collect();
    let mut names: Vec<String> = decl.iter().flat_map(|d| d.nodes.iter().map(|n| n.name.clone())).collect();
    names.extend(records.keys().cloned());
    names.sort();
    names.dedup();
    Ok(names
        .into_iter()
        .map(|name| {
            let declared = decl.as_ref().and_then(|d| d.node(&name));
            let record = records.remove(&name);
            let state = match (declared, &record) {
                (None, _) => NodeState::Removed,
                (Some(n), None) if n.public_key.is_some() => NodeState::External,
                (Some(_), None) => NodeState::Declared,
                (Some(_), Some(r)) => r.state.into(),
            };
            RosterEntry { state, declared_key: declared.and_then(|n| n.public_key), record, name }
        })
        .collect())
}

async fn list_nodes(State(ctx): State<Shared>, _: Admin) -> Result<Json<Vec<proto::NodeInfo>>, ApiError> {
    let alloc = ctx.store.allocation().await?;
    let out = roster(&ctx)
        .await?
        .into_iter()
        .map(|e| {
            let key = e.declared_key.map(|k| k.to_string()).or_else(|| e.record.as_ref().and_then(|r| r.wg_public_key.clone()));
            proto::NodeInfo {
                ipv4: alloc.ipv4.get(&e.name).map(|a| a.to_string()),
                ipv6: alloc.ipv6.get(&e.name).map(|a| a.to_string()),
                key_fingerprint: key.as_deref().and_then(key_fingerprint),
                wireguard_public_key: key,
                cert_not_after: e.record.as_ref().and_then(|r| r.cert_not_after),
                last_contact: e.record.as_ref().and_then(|r| r.last_contact),
                name: e.name,
                state: e.state,
            }
        })
        .collect();
    Ok(Json(out))
}

async fn approve(State(ctx): State<Shared>, _: Admin, Path(name): Path<String>) -> Result<Json<proto::WhoAmI>, ApiError> {
    let audit = Audit { at: now(), actor: "admin", action: "node approved", subject: &name, detail: String::new() };
    ctx.store.set_state(&name, &[EnrolledState::Pending], EnrolledState::Active, &audit).await.map_err(|e| match e {
        trellis_store::StoreError::NotFound(_) => ApiError::conflict("not_pending", format!("node `{name}` is not pending approval")),
        other => other.into(),
    })?;
    republish(&ctx).await;
    Ok(Json(proto::WhoAmI { node: name, state: EnrolledState::Active }))
}

async fn revoke(State(ctx): State<Shared>, _: Admin, Path(name): Path<String>) -> Result<Json<proto::WhoAmI>, ApiError> {
    let audit = Audit { at: now(), actor: "admin", action: "node revoked", subject: &name, detail: String::new() };
    ctx.store.set_state(&name, &[EnrolledState::Pending, EnrolledState::Active], EnrolledState::Revoked, &audit).await.map_err(|e| match e {
        trellis_store::StoreError::NotFound(_) => {
            ApiError::conflict("not_revocable", format!("node `{name}` is not enrolled, or is revoked already"))
        }
        other => other.into(),
    })?;
    republish(&ctx).await;
    Ok(Json(proto::WhoAmI { node: name, state: EnrolledState::Revoked }))
}

async fn audit_log(State(ctx): State<Shared>, _: Admin) -> Result<Json<Vec<proto::AuditRecord>>, ApiError> {
    Ok(Json(ctx.store.audit().await?))
}

// --- delivery --------------------------------------------------------------------------------

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BundleQuery {
    /// Seconds to wait for a newer bundle than the one named in If-None-Match (at most 60).
    #[serde(default)]
    wait: u64,
}

pub const MAX_WAIT: u64 = 60;

fn etag(version: i64) -> String {
    format!("\"{version}\"")
}

/// `GET /v1/bundle`: the node's current signed bundle, `304` when it already holds it. With
/// `wait`, the answer comes as soon as a newer one exists. Every answer carries a signed
/// freshness stamp.
async fn bundle(
    State(ctx): State<Shared>,
    who: NodeIdentity,
    headers: axum::http::HeaderMap,
    axum::extract::Query(q): axum::extract::Query<BundleQuery>,
) -> Result<axum::response::Response, ApiError> {
    use axum::http::header;
    use axum::response::IntoResponse;
    if who.state == EnrolledState::Pending {
        return Err(ApiError::forbidden(
            "pending_approval",
            format!("node `{}` is pending approval; an operator runs `trellis node approve {}`", who.name, who.name),
        ));
    }
    let held = headers.get(header::IF_NONE_MATCH).and_then(|v| v.to_str().ok()).map(str::to_string);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(q.wait.min(MAX_WAIT));
    let mut changes = ctx.publisher.subscribe();
    loop {
        let current = ctx.publisher.current(&who.name);
        let stamp = ctx.publisher.stamp(&ctx);
        if let Some(p) = &current {
            if held.as_deref() != Some(etag(p.version).as_str()) {
                let body = axum::body::Body::new(Chunks(p.signed.head.clone(), p.signed.contents.iter().cloned().collect()));
                return Ok((
                    [
                        (header::CONTENT_TYPE, "application/octet-stream".to_string()),
                        (header::ETAG, etag(p.version)),
                        (header::HeaderName::from_static("x-trellis-freshness"), stamp.to_string()),
                    ],
                    body,
                )
                    .into_response());
            }
        }
        let wait = tokio::time::timeout_at(deadline, changes.changed()).await;
        if !matches!(wait, Ok(Ok(()))) {
            return match current {
                Some(p) => Ok((
                    StatusCode::NOT_MODIFIED,
                    [(header::ETAG, etag(p.version)), (header::HeaderName::from_static("x-trellis-freshness"), stamp.to_string())],
                )
                    .into_response()),
                None => Err(ApiError::new(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "no_bundle_yet",
                    format!("no bundle has been published for node `{}` yet", who.name),
                )),
            };
        }
    }
}

async fn evidence(
    State(ctx): State<Shared>,
    who: NodeIdentity,
    Body(batch): Body<proto::EvidenceBatch, EVIDENCE_BODY>,
) -> Result<Json<proto::EvidenceAck>, ApiError> {
    if batch.records.len() > proto::MAX_EVIDENCE_BATCH {
        return Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "too_large",
            format!("an evidence batch holds at most {} records", proto::MAX_EVIDENCE_BATCH),
        ));
    }
    let mut records = Vec::with_capacity(batch.records.len());
    for r in &batch.records {
        if r.seq < 1 || r.version < 1 {
            return Err(ApiError::bad_request(format!("evidence record {}: sequence numbers and versions start at 1", r.seq)));
        }
        records.push(trellis_store::EvidenceRecord {
            seq: r.seq,
            version: r.version,
            result: r.result,
            error: r.error.clone(),
            files: serde_json::to_string(&r.files).expect("evidence files serialize"),
            at: r.at,
        });
    }
    let (accepted, duplicates) = ctx.store.add_evidence(&who.name, &records, now()).await?;
    Ok(Json(proto::EvidenceAck { accepted, duplicates }))
}

async fn status(State(ctx): State<Shared>, _: Admin) -> Result<Json<Vec<proto::NodeStatus>>, ApiError> {
    let roster = roster(&ctx).await?;
    let bundles = ctx.store.bundles().await?;
    let evidence = ctx.store.evidence_summary().await?;
    let t = now();
    let out = roster
        .into_iter()
        .map(|e| {
            let b = bundles.get(&e.name).filter(|_| e.state == NodeState::Active);
            let ev = evidence.get(&e.name);
            let applied = ev.and_then(|ev| ev.applied_version);
            let stale = b.is_some_and(|b| applied.is_none_or(|a| a < b.version));
            proto::NodeStatus {
                desired_version: b.map(|b| b.version),
                applied_version: applied,
                last_contact: e.record.as_ref().and_then(|r| r.last_contact),
                cert_not_after: e.record.as_ref().and_then(|r| r.cert_not_after),
                stale,
                stale_for: b.filter(|_| stale).map(|b| t - b.issued_at),
                last_result: ev.and_then(|ev| ev.last_result),
                last_error: ev.and_then(|ev| ev.last_error.clone()),
                evidence_records: ev.map_or(0, |ev| ev.records),
                evidence_missing: ev.map_or(0, |ev| ev.missing()),
                state: e.state,
                name: e.name,
            }
        })
        .collect();
    Ok(Json(out))
}

/// A response body made of shared chunks: the bundle's head and its contents, sent without
/// copying them into one buffer.
struct Chunks(bytes::Bytes, std::collections::VecDeque<bytes::Bytes>);

impl http_body::Body for Chunks {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<bytes::Bytes>, Self::Error>>> {
        let next = if self.0.is_empty() { self.1.pop_front() } else { Some(std::mem::take(&mut self.0)) };
        std::task::Poll::Ready(next.map(|b| Ok(http_body::Frame::data(b))))
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact((self.0.len() + self.1.iter().map(bytes::Bytes::len).sum::<usize>()) as u64)
    }
}
