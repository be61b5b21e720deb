//! `trellis-dev bench certs`: what service certificates cost the controller (ADR 0023). Two
//! figures: signing alone (the services CA over prepared CSRs, in this process, timed and its CPU
//! read with `getrusage`), and issuance end to end (enrolled nodes, each over its own mutual-TLS
//! session, `POST /v1/node/certificates` against a real `trellis serve` in process: the
//! declaration read, the CSR checked and signed, the record and its audit written). From them,
//! the signatures a second and the share of one core that renewals at `--fleet` nodes take.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use serde_json::json;
use trellis_proto as proto;

use crate::args::CertsArgs;
use crate::figures::{database_name, ms};

/// This process's CPU time so far (user and system).
fn cpu() -> Duration {
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `u` is a valid rusage for getrusage to fill.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) };
    let tv = |t: libc::timeval| Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64);
    tv(u.ru_utime) + tv(u.ru_stime)
}

pub async fn run(a: &CertsArgs) -> Result<ExitCode> {
    if a.nodes == 0 || a.concurrency == 0 || a.signatures == 0 {
        bail!("--nodes, --concurrency and --signatures must be at least 1");
    }
    // Signing alone: the CSRs (made on nodes in life) are made first.
    let now = SystemTime::now();
    let ca = trellis_pki::create_ca("bench", now, [1; 16])?;
    let mesh_ca = trellis_pki::Ca::load(&ca.cert_pem, &ca.key_pem)?;
    let pair = mesh_ca.services_ca("bench", now, [2; 16])?;
    let services = trellis_pki::ServicesCa::load(&pair.cert_pem, &pair.key_pem)?;
    let names = trellis_pki::ServiceNames {
        dns: vec!["svc.bench.mesh".into(), "n00001.bench.mesh".into()],
        ips: vec!["10.88.0.1".parse()?],
        uri: "spiffe://bench.mesh/module/svc".into(),
    };
    let csrs: Vec<String> = (0..a.signatures.min(200))
        .map(|_| trellis_pki::services::service_key_and_csr(&names.dns[..1]).map(|(_, c)| c))
        .collect::<Result<_, _>>()?;
    let (t, c) = (Instant::now(), cpu());
    for i in 0..a.signatures {
        let mut serial = [0u8; 16];
        serial[..8].copy_from_slice(&(i as u64).to_le_bytes());
        services.sign(&csrs[i % csrs.len()], &names, now, Duration::from_secs(86400), serial)?.map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let (sign_wall, sign_cpu) = (t.elapsed(), cpu() - c);
    let sign_rate = a.signatures as f64 / sign_wall.as_secs_f64();
    let cpu_per_sign = sign_cpu / a.signatures as u32;

    let e2e = issuance(a).await?;
    // Renewal at two thirds of 24 h: each node's certificate is signed once every 16 h.
    let needed = a.fleet as f64 / (86400.0 * 2.0 / 3.0);
    let core_share = needed * e2e.cpu_per_issue.as_secs_f64();
    let db = database_name(a.database_url.as_deref());
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "signing": {"signatures": a.signatures, "per_second": sign_rate, "cpu_us_per_signature": cpu_per_sign.as_secs_f64() * 1e6},
                "issuance": {"nodes": a.nodes, "concurrency": a.concurrency, "database": db, "per_second": e2e.rate,
                             "latency_ms": {"p50": ms(e2e.p50), "p99": ms(e2e.p99)},
                             "cpu_us_per_issue": e2e.cpu_per_issue.as_secs_f64() * 1e6},
                "fleet": {"nodes": a.fleet, "signatures_per_second": needed, "share_of_one_core": core_share},
            }))?
        );
    } else {
        println!(
            "signing alone: {} signatures in {:.0} ms: {sign_rate:.0} per second, {:.0} us of CPU each",
            a.signatures,
            ms(sign_wall),
            cpu_per_sign.as_secs_f64() * 1e6
        );
        println!(
            "issuance over HTTPS ({db}, {} nodes, {} at a time): {:.0} per second; latency p50 {:.1} ms, p99 {:.1} ms; {:.0} us of CPU each (this process: controller and clients)",
            a.nodes,
            a.concurrency,
            e2e.rate,
            ms(e2e.p50),
            ms(e2e.p99),
            e2e.cpu_per_issue.as_secs_f64() * 1e6
        );
        println!(
            "renewals at {} nodes (one certificate each, 24 h, renewed at two thirds): {needed:.2} signatures per second, {:.4} % of one core",
            a.fleet,
            core_share * 100.0
        );
    }
    Ok(ExitCode::SUCCESS)
}

struct Issuance {
    rate: f64,
    p50: Duration,
    p99: Duration,
    cpu_per_issue: Duration,
}

/// `nodes` nodes of a mesh whose every node runs `svc` (with `[module.certificate]`) enrol; then
/// each, over its own session, asks for its certificate, `concurrency` at a time.
async fn issuance(a: &CertsArgs) -> Result<Issuance> {
    let (dir, addr, stop) = crate::enrolling::serve_in_process("certs", a.database_url.clone()).await?;
    let admin = Arc::new(crate::admin_client(&dir)?);
    let mut mesh =
        format!("[mesh]\nname = \"bench\"\ndomain = \"bench.mesh\"\noverlay_ipv4 = \"{}\"\n", crate::meshgen::overlay_for(a.nodes));
    let names: Vec<String> = (0..a.nodes).map(|i| format!("n{i:05}")).collect();
    for n in &names {
        let _ = write!(mesh, "[[node]]\nname = \"{n}\"\nmodules = [\"svc\"]\n");
    }
    let module = "[module]\nname = \"svc\"\n[module.certificate]\n".to_string();
    admin
        .apply(&proto::ApplyRequest {
            files: vec![
                proto::DeclFile { path: "mesh.toml".into(), text: mesh },
                proto::DeclFile { path: "modules/svc.toml".into(), text: module },
            ],
            expect_revision: None,
        })
        .await?;
    let enrolees =
        crate::enrolling::prepare(&admin, names.iter().enumerate().map(|(i, n)| (n.clone(), crate::meshgen::key(i))).collect()).await?;
    let ca = std::fs::read_to_string(dir.join(trellis_controller::layout::CA_CERT))?;
    let enrolled = crate::enrolling::enrol_all(&format!("https://{addr}"), &ca, enrolees, a.concurrency).await?;
    // Each node's session and CSR are made first: the figure is the controller's answer.
    let mut work = Vec::with_capacity(enrolled.len());
    for e in &enrolled {
        let client = trellis_client::NodeClient::new(vec![addr.clone()], &ca, &e.cert_pem, &e.key_pem)?;
        let (_, csr) = trellis_pki::services::service_key_and_csr(&["svc.bench.mesh".to_string()])?;
        work.push((client, proto::ServiceCertRequest { module: "svc".into(), csr_pem: csr }));
    }
    // One request each before timing, so that every session's TLS handshake is done.
    for (client, _) in &work {
        client.service_certificates().await.context("listing a node's certificates")?;
    }
    let queue = Arc::new(tokio::sync::Mutex::new(work));
    let (started, c0) = (Instant::now(), cpu());
    let mut tasks = Vec::new();
    for _ in 0..a.concurrency {
        let queue = queue.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            loop {
                let Some((client, req)) = queue.lock().await.pop() else { return Ok::<_, anyhow::Error>(latencies) };
                let t = Instant::now();
                client.sign_service_certificate(&req).await.context("a service certificate")?;
                latencies.push(t.elapsed());
            }
        }));
    }
    let mut latencies = Vec::new();
    for t in tasks {
        latencies.extend(t.await??);
    }
    let (wall, used) = (started.elapsed(), cpu() - c0);
    let _ = stop.send(());
    let _ = std::fs::remove_dir_all(&dir);
    latencies.sort();
    let pct = |p: f64| latencies[((latencies.len() as f64 - 1.0) * p).round() as usize];
    Ok(Issuance { rate: a.nodes as f64 / wall.as_secs_f64(), p50: pct(0.5), p99: pct(0.99), cpu_per_issue: used / a.nodes as u32 })
}
