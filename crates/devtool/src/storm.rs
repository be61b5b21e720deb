//! `trellis-dev bench enrol --mesh DIR`: every node of a real declaration enrols at once against
//! an in-process controller on loopback. The figures: enrolments per second, their latency, the
//! time from the last answer until every node holds its first bundle (read from the controller's
//! bundle table, and fetched over HTTPS for a sample with the nodes' own certificates), and the
//! publish runs the storm took.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::args::EnrolArgs;
use crate::enrolling;
use crate::figures::{database_name, ms, pct, sorted};
use crate::meshdir::MeshDir;

/// The targets: issue 10's on the 10,000-node mesh, issue 25's on a larger one (100,000 nodes).
fn targets(nodes: usize) -> (f64, Duration) {
    if nodes > 10_000 {
        (1000.0, Duration::from_secs(5))
    } else {
        (500.0, Duration::from_secs(2))
    }
}
/// How long after the last answer the bench waits for every node to hold a bundle.
const HOLD_LIMIT: Duration = Duration::from_secs(120);

pub async fn run(a: &EnrolArgs, dir: &std::path::Path) -> Result<ExitCode> {
    use trellis_controller::state;
    let concurrency = a.concurrency.unwrap_or(64);
    if concurrency == 0 {
        bail!("--concurrency must be at least 1");
    }
    let mesh = MeshDir::read(dir)?;
    let names: Vec<String> = mesh.decl.nodes.iter().map(|n| n.name.clone()).collect();
    let (target_rate, target_held) = targets(names.len());
    eprintln!("{}: {} nodes", dir.display(), names.len());

    let state_dir = std::env::temp_dir().join(format!("trellis-bench-enrol-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&state_dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let base = format!("https://{addr}");
    let opts = state::InitOptions {
        advertise: vec![addr.clone()],
        listen: Some(addr.clone()),
        database_url: a.database_url.clone(),
        node_cert_secs: 86400,
    };
    let st = state::init(&state_dir, &opts).await?;
    let server = trellis_server::Server::bind(&st, None, None).await?;
    let controller = server.controller.clone();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
    let admin = Arc::new(crate::admin_client(&state_dir)?);
    admin.apply(&mesh.request()).await.with_context(|| format!("cannot apply {}", dir.display()))?;
    controller.settle(Duration::from_secs(300)).await.context("the first publish run did not finish")?;

    // Tokens, keys and CSRs first: the figures are the controller's.
    eprintln!("making {} tokens, keys and CSRs...", names.len());
    let nodes = names.iter().enumerate().map(|(i, n)| (n.clone(), crate::meshgen::key(i))).collect();
    let enrolees = enrolling::prepare(&admin, nodes).await?;
    let ca = std::fs::read_to_string(state_dir.join(trellis_controller::layout::CA_CERT))?;

    eprintln!("enrolling {} nodes, {concurrency} in flight...", names.len());
    let runs_before = controller.publish_runs();
    let (stop_sampling, sampler) = sample_runs(controller.clone(), runs_before);
    let started = Instant::now();
    let enrolled = enrolling::enrol_all(&base, &ca, enrolees, concurrency).await?;
    let last = enrolled.iter().map(|e| e.answered).max().context("no node enrolled")?;
    let wall = last - started;

    // Every node holds its first bundle when the controller would answer it one.
    let mut waiting: Vec<&str> = names.iter().map(String::as_str).collect();
    let all_held = loop {
        waiting.retain(|n| controller.bundle(n).is_none());
        if waiting.is_empty() {
            break Some(Instant::now().saturating_duration_since(last));
        }
        if last.elapsed() > HOLD_LIMIT {
            break None;
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    // The run that gave the last nodes their bundle finishes after filling the table: count it.
    let _ = controller.settle(Duration::from_secs(60)).await;
    let runs = controller.publish_runs() - runs_before;
    stop_sampling.store(true, std::sync::atomic::Ordering::SeqCst);
    let ends = sampler.await?;
    // When each publish run finished, relative to the last answer (negative: before it).
    let ends_ms: Vec<f64> = ends.iter().map(|&t| if t >= last { ms(t - last) } else { -ms(last - t) }).collect();
    let gaps: Vec<Duration> = ends.windows(2).map(|w| w[1] - w[0]).collect();
    let gap_median = sorted(gaps.clone()).get(gaps.len() / 2).copied().unwrap_or_default();
    // Said before the sample below, which may fail: a storm takes minutes at this size.
    eprintln!(
        "  {} enrolled in {:.0} ms; every node held a bundle {} after the last answer; {runs} publish runs",
        enrolled.len(),
        ms(wall),
        all_held.map_or_else(|| format!("not within {} s", HOLD_LIMIT.as_secs()), |d| format!("{:.0} ms", ms(d)))
    );

    // The same bundles over HTTPS, as the nodes' agents fetch them, for a sample of nodes.
    let step = (enrolled.len() / a.sample.max(1)).max(1);
    let mut sample_bytes = 0usize;
    let mut sampled = 0usize;
    for e in enrolled.iter().step_by(step).take(a.sample) {
        let client = trellis_client::NodeClient::new(vec![addr.clone()], &ca, &e.cert_pem, &e.key_pem)?;
        let answer = client.bundle(0, None).await.with_context(|| format!("{} cannot fetch its bundle", e.name))?;
        let body = answer.body.with_context(|| format!("{} was refused its bundle", e.name))?.context("a first fetch got 304")?;
        let held = controller.bundle(&e.name).with_context(|| format!("{} holds no bundle", e.name))?;
        let expect = held.signed.to_vec();
        if body != expect || answer.tag != Some(trellis_proto::etag::BundleTag::new(held.version, &held.digest)) {
            bail!("{} fetched other bytes than the controller holds for it", e.name);
        }
        sample_bytes += body.len();
        sampled += 1;
    }
    let _ = stop.send(());
    let _ = std::fs::remove_dir_all(&state_dir);

    let latencies = sorted(enrolled.iter().map(|e| e.latency).collect());
    let rate = enrolled.len() as f64 / wall.as_secs_f64();
    let db = database_name(a.database_url.as_deref());
    let held_ms = all_held.map(ms);
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "mesh": dir.display().to_string(), "nodes": names.len(), "database": db, "concurrency": concurrency,
                "enrolled": enrolled.len(), "wall_ms": ms(wall),
                "enrolments_per_second": rate, "target_enrolments_per_second": target_rate,
                "latency_ms": {"p50": ms(pct(&latencies, 0.5)), "p99": ms(pct(&latencies, 0.99))},
                "held": names.len() - waiting.len(),
                "last_answer_to_all_held_ms": held_ms, "target_all_held_ms": ms(target_held),
                "publish_runs": runs, "publish_run_ends_ms": ends_ms, "publish_run_interval_median_ms": ms(gap_median),
                "sample_fetched": sampled, "sample_bytes": sample_bytes,
            }))?
        );
    } else {
        let met = |ok: bool| if ok { "met" } else { "MISSED" };
        println!("{} nodes of {} enrol ({db}, {concurrency} in flight, in-process controller on loopback)", names.len(), dir.display());
        println!(
            "enrolments:                   {rate:8.0} per second  (target >= {target_rate:.0}: {}); {} in {:.0} ms",
            met(rate >= target_rate),
            enrolled.len(),
            ms(wall)
        );
        println!("enrolment latency:            p50 {:.1} ms, p99 {:.1} ms", ms(pct(&latencies, 0.5)), ms(pct(&latencies, 0.99)));
        match all_held {
            Some(d) => {
                println!("last answer -> all hold one:  {:8.0} ms  (target <= {:.0} ms: {})", ms(d), ms(target_held), met(d <= target_held))
            }
            None => println!(
                "last answer -> all hold one:  {} of {} nodes still held no bundle after {} s  (target <= {:.0} ms: MISSED)",
                waiting.len(),
                names.len(),
                HOLD_LIMIT.as_secs(),
                ms(target_held)
            ),
        }
        println!(
            "publish runs for the storm:   {runs:8}  (one every {:.0} ms, median; they ended at {} ms from the last answer)",
            ms(gap_median),
            ends_ms.iter().map(|m| format!("{m:.0}")).collect::<Vec<_>>().join(", ")
        );
        println!("HTTPS sample:                 {sampled} nodes fetched their bundle with their own certificate ({sample_bytes} bytes, equal to the controller's)");
    }
    Ok(ExitCode::SUCCESS)
}

/// Watches the controller's count of finished publish runs (from `seen`) (every 2 ms, for at most 10 minutes)
/// and returns when each one finished, once told to stop.
fn sample_runs(
    controller: Arc<trellis_controller::Controller>,
    mut seen: u64,
) -> (Arc<std::sync::atomic::AtomicBool>, tokio::task::JoinHandle<Vec<Instant>>) {
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let task = tokio::spawn(async move {
        let deadline = Instant::now() + Duration::from_secs(600);
        let mut ends = Vec::new();
        loop {
            let now = controller.publish_runs();
            if now != seen {
                ends.extend(std::iter::repeat_n(Instant::now(), (now - seen) as usize));
                seen = now;
            }
            if stopped.load(std::sync::atomic::Ordering::SeqCst) || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        ends
    });
    (stop, task)
}
