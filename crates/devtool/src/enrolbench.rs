//! `trellis-dev bench enrol` on a generated mesh: enrolments per second against an in-process
//! controller on loopback, CSR signing included.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;

use crate::args::EnrolArgs;
use crate::figures::{database_name, ms};
use crate::meshgen::overlay_for;

pub async fn run(a: &EnrolArgs) -> Result<ExitCode> {
    use base64::Engine as _;
    let concurrency = a.concurrency.unwrap_or(16);
    if a.nodes == 0 || concurrency == 0 {
        bail!("--nodes and --concurrency must be at least 1");
    }
    let (dir, addr, stop) = crate::enrolling::serve_in_process("enrol", a.database_url.clone()).await?;
    let admin = crate::admin_client(&dir)?;
    let mut mesh = format!("[mesh]\nname = \"bench\"\ndomain = \"bench.mesh\"\noverlay_ipv4 = \"{}\"\n", overlay_for(a.nodes));
    for i in 0..a.nodes {
        let _ = write!(mesh, "[[node]]\nname = \"n{i:05}\"\n");
    }
    admin
        .apply(&trellis_proto::ApplyRequest {
            files: vec![trellis_proto::DeclFile { path: "mesh.toml".into(), text: mesh }],
            expect_revision: None,
        })
        .await?;
    // Tokens and the nodes' own keys and CSRs are made first: the figure is the controller's.
    let mut requests = Vec::with_capacity(a.nodes);
    for i in 0..a.nodes {
        let t = admin
            .create_token(&trellis_proto::TokenRequest {
                node: format!("n{i:05}"),
                ttl_secs: 3600,
                require_approval: false,
                ..Default::default()
            })
            .await?;
        let token = trellis_core::token::EnrolmentToken::decode(&t.token).map_err(|e| anyhow::anyhow!("{e}"))?;
        let (_key, csr) = trellis_pki::node_key_and_csr(&token.node)?;
        let mut wg = [0u8; 32];
        wg[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
        requests.push(trellis_client::enrol_request(&token, csr, base64::engine::general_purpose::STANDARD.encode(wg)));
    }
    let ca = std::fs::read_to_string(dir.join(trellis_controller::layout::CA_CERT))?;
    let http = reqwest::Client::builder().use_preconfigured_tls(trellis_pki::tls::client_config(&ca, None)?).build()?;
    let queue = std::sync::Arc::new(tokio::sync::Mutex::new(requests));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let (queue, http, url) = (queue.clone(), http.clone(), format!("https://{addr}/v1/enrol"));
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let Some(req) = queue.lock().await.pop() else {
                    return Ok::<_, anyhow::Error>(latencies);
                };
                let t = Instant::now();
                let resp = http.post(&url).json(&req).send().await?;
                if !resp.status().is_success() {
                    bail!("enrolment of {} failed: {}", req.node, resp.text().await.unwrap_or_default());
                }
                latencies.push(t.elapsed());
            }
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    let wall = started.elapsed();
    let _ = stop.send(());
    let _ = std::fs::remove_dir_all(&dir);
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
    let rate = a.nodes as f64 / wall.as_secs_f64();
    let db = database_name(a.database_url.as_deref());
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "nodes": a.nodes, "concurrency": concurrency, "database": db, "wall_ms": ms(wall),
                "enrolments_per_second": rate, "latency_ms": {"p50": ms(pct(0.5)), "p99": ms(pct(0.99))},
            }))?
        );
    } else {
        println!(
            "{} enrolments ({db}, {} at a time) in {:.0} ms: {rate:.0} per second; latency p50 {:.1} ms, p99 {:.1} ms",
            a.nodes,
            concurrency,
            ms(wall),
            ms(pct(0.5)),
            ms(pct(0.99))
        );
    }
    Ok(ExitCode::SUCCESS)
}
