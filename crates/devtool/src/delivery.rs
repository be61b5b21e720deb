//! `trellis-dev bench delivery`: simulated agents against a real `trellis serve` process on loopback.
//! Every loop is bounded in count and time; every address is 127.0.0.1.

use std::path::PathBuf;
use std::process::{Child, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine;
use serde_json::json;
use trellis_proto as proto;

use crate::args::DeliveryArgs;
use crate::figures::{database_name, memory_kib, ms, pct};

/// A `trellis serve` child process, killed when dropped.
pub struct Serve(pub Child);

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The `trellis` binary this tool measures: the one built next to `trellis-dev`, in the same
/// target directory, so that the figures are for the code of this checkout.
pub fn trellis_exe() -> Result<PathBuf> {
    let me = std::env::current_exe().context("cannot find the path of trellis-dev")?;
    let dir = me.parent().with_context(|| format!("{} has no directory", me.display()))?;
    let trellis = dir.join("trellis");
    if !trellis.is_file() {
        bail!(
            "{} is missing; build it next to trellis-dev with `cargo build -p trellis` (add --release for a release trellis-dev)",
            trellis.display()
        );
    }
    Ok(trellis)
}

/// Raises this process's limit of open files to its hard limit, and refuses `agents` that need
/// more: every agent holds one connection, in this process and in `trellis serve` (which inherits
/// the limit), beside the files and database connections each holds.
pub fn raise_fd_limit(agents: usize) -> Result<()> {
    // SAFETY: `getrlimit` and `setrlimit` only read and write the `rlimit` value owned here.
    let limit = unsafe {
        let mut l = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) != 0 {
            return Ok(());
        }
        if l.rlim_cur < l.rlim_max {
            l.rlim_cur = l.rlim_max.min(1 << 20);
            libc::setrlimit(libc::RLIMIT_NOFILE, &l);
        }
        l.rlim_cur as usize
    };
    const OWN_FILES: usize = 512;
    if agents + OWN_FILES > limit {
        bail!(
            "{agents} agents need {} open files in this process and in trellis serve, over the limit of {limit} here (raise the hard limit, `ulimit -Hn`, or run at most {} agents)",
            agents + OWN_FILES,
            limit.saturating_sub(OWN_FILES)
        );
    }
    Ok(())
}

/// The loopback address the `k`th simulated agent connects from: a fleet's agents come from many
/// addresses, and the server admits at most 15,000 connections from one (`Limits::per_source`;
/// the 15,001st agent of 20,000 found its handshake closed). 4,000 agents an address.
pub fn agent_source(k: usize) -> std::net::IpAddr {
    std::net::IpAddr::V4(std::net::Ipv4Addr::new(127, 1, (k / 4000) as u8, 1))
}

/// A `trellis serve` child on a fresh state directory, listening on loopback.
pub struct Running {
    pub serve: Serve,
    pub dir: PathBuf,
    pub addr: String,
}

impl Running {
    /// `https://ADDR`
    pub fn base(&self) -> String {
        format!("https://{}", self.addr)
    }
}

/// Initialises a state directory in the temporary directory (named after `what`) and starts
/// `trellis serve` on it; returns once it accepts connections.
pub async fn start(trellis: &std::path::Path, database_url: Option<String>, what: &str) -> Result<Running> {
    let dir = std::env::temp_dir().join(format!("trellis-bench-{what}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let opts = trellis_controller::state::InitOptions {
        advertise: vec![addr.clone()],
        listen: Some(addr.clone()),
        database_url,
        node_cert_secs: 86400,
    };
    trellis_controller::state::init(&dir, &opts).await?;
    let log = std::fs::File::create(dir.join("serve.log"))?;
    let serve = Serve(
        std::process::Command::new(trellis)
            .args(["serve", "--state-dir", dir.to_str().context("temp dir is not UTF-8")?])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {} serve", trellis.display()))?,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&addr).is_err() {
        if Instant::now() > deadline {
            bail!("trellis serve did not start; see {}", dir.join("serve.log").display());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(Running { serve, dir, addr })
}

fn mesh(n: usize, extra: bool) -> String {
    let mut s = String::from("[mesh]\nname = \"load\"\ndomain = \"load.mesh\"\noverlay_ipv4 = \"10.80.0.0/12\"\n\n[networks]\nlan = {}\n\n[groups]\nops = [\"a00000\", \"a00001\"]\n");
    for i in 0..n {
        s.push_str(&format!("\n[[node]]\nname = \"a{i:05}\"\nnetworks = [\"lan\"]\nmodules = [\"svc\"]\n[[node.endpoint]]\naddress = \"192.0.2.1:{}\"\nreachable_from = [\"lan\"]\n", 10000 + i));
    }
    if extra {
        s.push_str("\n[[node]]\nname = \"late-1\"\n");
    }
    s
}

const SVC: &str = "[module]\nname = \"svc\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"22\"]\nfrom = [\"group:ops\"]\n";

pub struct Agent {
    pub name: String,
    pub http: reqwest::Client,
    pub version: u64,
    /// The bundle held, verified, to build a delta from (fleet only).
    pub last: std::sync::Mutex<Option<trellis_core::bundle::Bundle>>,
    /// The controller's bundle-signing key (fleet only).
    pub signing: Option<ed25519_dalek::VerifyingKey>,
}

impl Agent {
    pub fn new(name: String, http: reqwest::Client) -> Agent {
        Agent { name, http, version: 0, last: Default::default(), signing: None }
    }
}

/// One bundle request of `agent` (with `delta`, naming the bundle it holds and its files, as the
/// agent does, ADR 0033): the status, the version named by the ETag, the body, and whether it is
/// a delta.
pub async fn fetch(agent: &Agent, base: &str, held: Option<u64>, wait: u64, delta: bool) -> Result<(u16, Option<u64>, bytes::Bytes, bool)> {
    let mut req = agent.http.get(format!("{base}/v1/bundle?wait={wait}")).timeout(Duration::from_secs(wait + 30));
    let last = if delta { agent.last.lock().expect("last").clone() } else { None };
    match (held, last) {
        (Some(_), Some(b)) => {
            let files: Vec<[u8; 32]> = b.files.iter().map(|f| f.sha256).collect();
            req = req
                .header("if-none-match", trellis_proto::etag::BundleTag::new(b.version as i64, &b.content_digest()).etag())
                .header("accept", format!("application/octet-stream, {}", trellis_proto::DELTA_TYPE))
                .header(trellis_proto::HELD_FILES_HEADER, trellis_proto::held_files(&files));
        }
        (Some(v), None) => req = req.header("if-none-match", format!("\"{v}\"")),
        (None, _) => {}
    }
    let resp = req.send().await?;
    let status = resp.status().as_u16();
    let version =
        resp.headers().get("etag").and_then(|v| v.to_str().ok()).and_then(trellis_proto::etag::BundleTag::parse).map(|t| t.version as u64);
    let is_delta = resp.headers().get("content-type").is_some_and(|v| v.as_bytes() == trellis_proto::DELTA_TYPE.as_bytes());
    let body = resp.bytes().await?;
    if status != 200 && status != 304 {
        bail!("{} got {status}: {}", agent.name, String::from_utf8_lossy(&body));
    }
    Ok((status, version, body, is_delta))
}

/// One bundle request of `agent`, whole: the status, the version named by the ETag and the
/// body's length.
pub async fn get(agent: &Agent, base: &str, held: Option<u64>, wait: u64) -> Result<(u16, Option<u64>, usize)> {
    let (status, version, body, _) = fetch(agent, base, held, wait, false).await?;
    Ok((status, version, body.len()))
}

pub async fn run(a: &DeliveryArgs) -> Result<std::process::ExitCode> {
    if a.agents == 0 || a.agents > 20_000 {
        bail!("--agents must be between 1 and 20000");
    }
    let trellis = trellis_exe()?;
    raise_fd_limit(a.agents)?;
    let Running { serve, dir, addr } = start(&trellis, a.database_url.clone(), "delivery").await?;
    let base = format!("https://{addr}");
    let admin = crate::admin_client(&dir)?;
    let files = |extra: bool| {
        vec![
            proto::DeclFile { path: "mesh.toml".into(), text: mesh(a.agents, extra) },
            proto::DeclFile { path: "modules/svc.toml".into(), text: SVC.into() },
        ]
    };
    admin.apply(&proto::ApplyRequest { files: files(false), expect_revision: None }).await?;

    // Enrol every agent: tokens, keys and CSRs made here, 16 enrolments in flight.
    eprintln!("enrolling {} agents...", a.agents);
    let ca = std::fs::read_to_string(dir.join(trellis_controller::layout::CA_CERT))?;
    let plain = reqwest::Client::builder().use_preconfigured_tls(trellis_pki::tls::client_config(&ca, None)?).build()?;
    let mut agents = Vec::with_capacity(a.agents);
    let started = Instant::now();
    for chunk in (0..a.agents).collect::<Vec<_>>().chunks(16) {
        let mut tasks = Vec::new();
        for &i in chunk {
            let name = format!("a{i:05}");
            let t = admin
                .create_token(&proto::TokenRequest { node: name.clone(), ttl_secs: 3600, require_approval: false, ..Default::default() })
                .await?;
            let token = trellis_core::token::EnrolmentToken::decode(&t.token).map_err(|e| anyhow::anyhow!("{e}"))?;
            let (plain, base, ca) = (plain.clone(), base.clone(), ca.clone());
            tasks.push(tokio::spawn(async move {
                let (key, csr) = trellis_pki::node_key_and_csr(&name)?;
                let mut wg = [0u8; 32];
                wg[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
                let req = trellis_client::enrol_request(&token, csr, base64::engine::general_purpose::STANDARD.encode(wg));
                let resp = plain.post(format!("{base}/v1/enrol")).json(&req).send().await?;
                if !resp.status().is_success() {
                    bail!("enrolment of {name} failed: {}", resp.text().await.unwrap_or_default());
                }
                let r: proto::EnrolResponse = resp.json().await?;
                let cfg = trellis_pki::tls::client_config(&ca, Some((&r.node_cert_pem, &key)))?;
                let http = reqwest::Client::builder()
                    .use_preconfigured_tls(cfg)
                    .pool_max_idle_per_host(1)
                    .local_address(agent_source(i))
                    .build()?;
                Ok::<_, anyhow::Error>(Agent::new(name, http))
            }));
        }
        for t in tasks {
            agents.push(t.await??);
        }
        if agents.len().is_multiple_of(500) {
            eprintln!("  {} enrolled ({:.0}s)", agents.len(), started.elapsed().as_secs_f64());
        }
    }
    // Every agent takes its first bundle.
    for agent in agents.iter_mut() {
        let (status, v, _) = get(agent, &base, None, 0).await?;
        if status != 200 {
            bail!("{} got {status} for its first bundle", agent.name);
        }
        agent.version = v.context("no ETag")?;
    }
    let agents: Arc<Vec<Agent>> = Arc::new(agents);

    // 304s per second: bounded count, 64 in flight.
    eprintln!("timing {} unchanged-bundle requests...", a.requests);
    let per_task = a.requests.div_ceil(64);
    let t = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..64usize {
        let (agents, base) = (agents.clone(), base.clone());
        tasks.push(tokio::spawn(async move {
            let mut n304 = 0usize;
            for j in 0..per_task {
                let agent = &agents[(k * per_task + j) % agents.len()];
                if get(agent, &base, Some(agent.version), 0).await?.0 == 304 {
                    n304 += 1;
                }
            }
            Ok::<_, anyhow::Error>(n304)
        }));
    }
    let mut n304 = 0;
    for task in tasks {
        n304 += task.await??;
    }
    let not_modified_rate = n304 as f64 / t.elapsed().as_secs_f64();

    // Long-poll: every agent waits; one apply changes every bundle (a node joins the zone).
    eprintln!("{} agents long-polling; applying a change...", agents.len());
    let mut waits = Vec::new();
    for i in 0..agents.len() {
        let (agents, base) = (agents.clone(), base.clone());
        waits.push(tokio::spawn(async move {
            let agent = &agents[i];
            let (status, v, _) = get(agent, &base, Some(agent.version), 60).await?;
            Ok::<_, anyhow::Error>((status, v, Instant::now()))
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = Instant::now();
    admin.apply(&proto::ApplyRequest { files: files(true), expect_revision: None }).await?;
    let apply_time = t0.elapsed();
    let mut lat = Vec::new();
    let mut missed = 0;
    let mut held: Vec<u64> = agents.iter().map(|a| a.version).collect();
    for (i, w) in waits.into_iter().enumerate() {
        let (status, v, at) = w.await??;
        if status == 200 && v > Some(agents[i].version) {
            lat.push(at.saturating_duration_since(t0));
            held[i] = v.expect("a newer version");
        } else {
            missed += 1;
        }
    }
    lat.sort();
    let revoked = revocation(&agents, &held, &base, &admin).await?;
    let peak = memory_kib(serve.0.id(), "VmHWM");
    drop(serve);
    let _ = std::fs::remove_dir_all(&dir);
    if lat.is_empty() {
        bail!("no agent received the new bundle");
    }
    let db = database_name(a.database_url.as_deref());
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "agents": agents.len(), "database": db,
                "not_modified_per_second": not_modified_rate,
                "apply_ms": ms(apply_time),
                "apply_to_bundle_ms": {"p50": ms(pct(&lat, 0.5)), "p99": ms(pct(&lat, 0.99)), "max": ms(*lat.last().expect("non-empty"))},
                "agents_missed": missed,
                "revoke_to_revoked_ms": ms(revoked.took), "revocation_holders": revoked.holders,
                "serve_peak_rss_kib": peak,
            }))?
        );
    } else {
        println!("{} agents against trellis serve ({db}) on loopback", agents.len());
        println!("304 answers:                  {not_modified_rate:8.0} per second ({n304} timed, 64 in flight)");
        println!("apply request took:           {:8.1} ms", ms(apply_time));
        println!(
            "apply -> agent holds bundle:  p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms ({} of {} agents{})",
            ms(pct(&lat, 0.5)),
            ms(pct(&lat, 0.99)),
            ms(*lat.last().expect("non-empty")),
            lat.len(),
            agents.len(),
            if missed > 0 { format!(", {missed} missed") } else { String::new() }
        );
        println!(
            "revoke -> revoked:            {:8.1} ms (a00000, held by {} peers, each reporting the bundle without it; the request took {:.1} ms)",
            ms(revoked.took),
            revoked.holders,
            ms(revoked.request)
        );
        if let Some(p) = peak {
            println!("trellis serve peak memory:    {:8.1} MiB", p as f64 / 1024.0);
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// What the revocation of an operator's node took (ADR 0022).
struct Revoked {
    /// From the revocation's request until the controller says it is complete.
    took: Duration,
    request: Duration,
    holders: usize,
}

/// Revokes `a00000`, every node's peer (group `ops` may reach every node), while every other
/// agent long-polls from the version it holds; each reports applying every newer bundle it is
/// sent, as an agent does, until the revocation is complete. The time until
/// `GET /v1/admin/nodes/a00000/revocation` says `revoked`: every holder applied a version
/// without its key.
async fn revocation(agents: &Arc<Vec<Agent>>, held: &[u64], base: &str, admin: &trellis_client::AdminClient) -> Result<Revoked> {
    eprintln!("{} agents long-polling; revoking a00000...", agents.len().saturating_sub(1));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut polls = Vec::new();
    for (i, &held) in held.iter().enumerate().skip(1) {
        let (agents, base, done) = (agents.clone(), base.to_string(), done.clone());
        polls.push(tokio::spawn(async move {
            let agent = &agents[i];
            let (mut held, mut seq) = (held, 0);
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                let (status, v, _) = get(agent, &base, Some(held), 5).await?;
                let Some(v) = v.filter(|v| status == 200 && *v > held) else { continue };
                (held, seq) = (v, seq + 1);
                let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64;
                let applied = proto::Evidence {
                    seq,
                    version: v as i64,
                    result: proto::EvidenceResult::Applied,
                    error: None,
                    files: vec![],
                    at,
                    unmanaged: false,
                };
                let resp =
                    agent.http.post(format!("{base}/v1/evidence")).json(&proto::EvidenceBatch { records: vec![applied] }).send().await?;
                if !resp.status().is_success() {
                    bail!("evidence of {} refused: {}", agent.name, resp.text().await.unwrap_or_default());
                }
            }
            Ok::<_, anyhow::Error>(())
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let t0 = Instant::now();
    admin.revoke("a00000").await?;
    let request = t0.elapsed();
    let r = loop {
        let r = admin.revocation("a00000").await?;
        if r.complete() {
            break r;
        }
        if t0.elapsed() > Duration::from_secs(180) {
            let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs() as i64;
            bail!("a00000 is still {} 180 s after its revocation", r.summary(now));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let took = t0.elapsed();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    for p in polls {
        p.await??;
    }
    Ok(Revoked { took, request, holders: r.holders })
}
