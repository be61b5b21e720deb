//! Enrolling many nodes for the benches on a real mesh: tokens, keys and CSRs made first (outside
//! any timing), then the enrolments at a fixed number in flight, each answer timed.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use trellis_core::decl::PublicKey;
use trellis_proto as proto;

/// A node ready to enrol: its request (token redeemed, CSR, WireGuard key) and its TLS key.
pub struct Enrolee {
    pub req: proto::EnrolRequest,
    pub key_pem: String,
}

/// A node that enrolled: its certificate and key, and when and how fast the answer came.
pub struct Enrolled {
    pub name: String,
    pub key_pem: String,
    pub cert_pem: String,
    /// Base64 of the controller's bundle-signing key, as the enrolment answered it.
    pub signing_public_key: String,
    pub latency: Duration,
    pub answered: Instant,
}

const TOKEN_TTL: u64 = 6 * 3600;
const IN_FLIGHT_TOKENS: usize = 16;

/// Creates a token for every node and makes its TLS key and CSR; `nodes` are names with the
/// WireGuard key each enrols with.
pub async fn prepare(admin: &Arc<trellis_client::AdminClient>, nodes: Vec<(String, PublicKey)>) -> Result<Vec<Enrolee>> {
    let total = nodes.len();
    let started = Instant::now();
    let mut out = Vec::with_capacity(total);
    let mut chunks = nodes.into_iter().peekable();
    while chunks.peek().is_some() {
        let chunk: Vec<(String, PublicKey)> = chunks.by_ref().take(256).collect();
        let mut tasks = Vec::new();
        for part in chunk.chunks(chunk.len().div_ceil(IN_FLIGHT_TOKENS)) {
            let (admin, part) = (admin.clone(), part.to_vec());
            tasks.push(tokio::spawn(async move {
                let mut made = Vec::with_capacity(part.len());
                for (name, wg) in part {
                    let t = admin
                        .create_token(&proto::TokenRequest {
                            node: name.clone(),
                            ttl_secs: TOKEN_TTL,
                            require_approval: false,
                            ..Default::default()
                        })
                        .await
                        .with_context(|| format!("cannot create a token for {name}"))?;
                    let token = trellis_core::token::EnrolmentToken::decode(&t.token).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
                    let (key_pem, csr) = tokio::task::spawn_blocking(move || trellis_pki::node_key_and_csr(&name)).await??;
                    made.push(Enrolee { req: trellis_client::enrol_request(&token, csr, wg.to_string()), key_pem });
                }
                Ok::<_, anyhow::Error>(made)
            }));
        }
        for t in tasks {
            out.extend(t.await??);
        }
        if out.len() % 2048 < 256 || out.len() == total {
            eprintln!("  {} of {total} tokens and CSRs made ({:.0} s)", out.len(), started.elapsed().as_secs_f64());
        }
    }
    Ok(out)
}

/// Enrols every node over `POST /v1/enrol`, `concurrency` at a time, in the order given. Fails
/// on the first refusal, naming the node.
pub async fn enrol_all(base: &str, ca_pem: &str, enrolees: Vec<Enrolee>, concurrency: usize) -> Result<Vec<Enrolled>> {
    let http = reqwest::Client::builder()
        .use_preconfigured_tls(trellis_pki::tls::client_config(ca_pem, None)?)
        .timeout(Duration::from_secs(120))
        .build()?;
    let queue = Arc::new(std::sync::Mutex::new(enrolees.into_iter().collect::<VecDeque<_>>()));
    let url = format!("{base}/v1/enrol");
    let mut tasks = Vec::new();
    for _ in 0..concurrency.max(1) {
        let (queue, http, url) = (queue.clone(), http.clone(), url.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = Vec::new();
            loop {
                let Some(e) = queue.lock().expect("queue").pop_front() else {
                    return Ok::<_, anyhow::Error>(done);
                };
                let t = Instant::now();
                let resp = http.post(&url).json(&e.req).send().await.with_context(|| format!("enrolment of {}", e.req.node))?;
                if !resp.status().is_success() {
                    bail!("enrolment of {} refused: {}", e.req.node, resp.text().await.unwrap_or_default());
                }
                let r: proto::EnrolResponse = resp.json().await.with_context(|| format!("enrolment of {}", e.req.node))?;
                let answered = Instant::now();
                done.push(Enrolled {
                    name: r.node,
                    key_pem: e.key_pem,
                    cert_pem: r.node_cert_pem,
                    signing_public_key: r.signing_public_key,
                    latency: answered - t,
                    answered,
                });
            }
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.extend(t.await??);
    }
    Ok(out)
}

/// A controller on a fresh state directory under the temporary directory (`trellis-bench-NAME-PID`)
/// served in this process on a free loopback port, as the enrolment and certificate benches time
/// it: its directory, its address and the sender that stops it.
pub async fn serve_in_process(
    name: &str,
    database_url: Option<String>,
) -> anyhow::Result<(std::path::PathBuf, String, tokio::sync::oneshot::Sender<()>)> {
    use trellis_controller::state;
    let dir = std::env::temp_dir().join(format!("trellis-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let opts = state::InitOptions { advertise: vec![addr.clone()], listen: Some(addr.clone()), database_url, node_cert_secs: 86400 };
    let st = state::init(&dir, &opts).await?;
    let server = trellis_server::Server::bind(&st, None, None).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    Ok((dir, addr, stop))
}
