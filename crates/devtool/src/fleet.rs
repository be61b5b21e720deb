//! `trellis-dev bench delivery --mesh DIR`: simulated agents for some of the nodes of a real
//! declaration, long-polling a real `trellis serve` on loopback, while the declaration changes.
//! Every node of the mesh enrols (so that bundles are those of a fully enrolled fleet); the
//! agents are `--agents` of them, spread evenly. Which bundles each change alters is worked out
//! first by compiling offline, so the bench knows whom to wait for; what the agents actually
//! received is what it reports. Every loop is bounded in count and time; every address is
//! 127.0.0.1.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use base64::Engine;
use serde_json::json;
use trellis_core::decl::{PublicKey, Source};
use trellis_core::Compiled;

use crate::args::DeliveryArgs;
use crate::delivery::{agent_source, fetch, raise_fd_limit, start, trellis_exe, Agent};
use crate::enrolling;
use crate::figures::{database_name, memory_kib, ms, pct, sorted};
use crate::meshdir::MeshDir;

const TARGET_P99: Duration = Duration::from_secs(1);

/// The targets for the bytes fetched again when a node is added and for the controller's peak
/// memory: issue 10's on the 10,000-node mesh, issue 25's on a larger one (100,000 nodes, 20,000
/// agents).
fn targets(nodes: usize) -> (usize, u64) {
    if nodes > 10_000 {
        (20 * 1024 * 1024, 6 * 1024 * 1024)
    } else {
        (10 * 1024 * 1024, 1024 * 1024)
    }
}

/// The name of the node the bench adds.
const ADDED: &str = "bench-added-1";
/// How many single-node moves are compiled to find one that changes about 1 % of the bundles.
const CANDIDATES: usize = 8;
/// After the last expected agent got its bundle, how long to keep counting unexpected ones.
const GRACE: Duration = Duration::from_secs(1);
/// How long a phase may wait for its expected agents.
const PHASE_LIMIT: Duration = Duration::from_secs(60);
/// The longest the whole long-polling part may last.
const POLLING_LIMIT: Duration = Duration::from_secs(900);

/// The nodes whose delivered files differ between two compiles (nodes of `after` only), and for
/// each file path, in how many of them it differs.
fn changed(what: String, before: &Compiled, after: &Compiled) -> Change {
    let mut change = Change { what, changed: HashSet::new(), files: BTreeMap::new() };
    for (name, out) in &after.nodes {
        let old = before.nodes.get(name);
        if old.is_some_and(|b| b.files == out.files) {
            continue;
        }
        change.changed.insert(name.clone());
        for f in &out.files {
            if old.is_none_or(|b| !b.files.iter().any(|o| o.path == f.path && o.content == f.content)) {
                *change.files.entry(f.path.clone()).or_default() += 1;
            }
        }
    }
    change
}

fn compile(mesh: &MeshDir, keys: &trellis_core::Keys, previous: Option<Compiled>) -> Result<Compiled> {
    trellis_core::compile(&mesh.decl, keys, &Default::default(), previous).map_err(|d| anyhow::anyhow!("{}: {d}", mesh.dir.display()))
}

/// A change, the nodes whose bundles it changes, and per file path in how many of them.
struct Change {
    what: String,
    changed: HashSet<String>,
    files: BTreeMap<String, usize>,
}

/// The changes the bench makes, in order, and the declarations they apply.
struct Plan {
    moved_mesh: MeshDir,
    moved: Change,
    added_mesh: MeshDir,
    added: Change,
    enrolled: Change,
}

/// How many nodes a group's members may reach through rules: the nodes running a module whose
/// rules name the group. Moving a node out of or into the group changes about that many
/// bundles.
fn reach(decl: &trellis_core::Declaration) -> Vec<usize> {
    let mut runners: HashMap<&str, usize> = HashMap::new();
    for n in &decl.nodes {
        for m in &n.modules {
            *runners.entry(m.as_str()).or_default() += 1;
        }
    }
    decl.groups
        .iter()
        .map(|g| {
            let source = Source::Group(g.name.clone());
            decl.modules
                .iter()
                .filter(|m| m.allow.iter().any(|r| r.from.contains(&source)))
                .map(|m| runners.get(m.name.as_str()).copied().unwrap_or(0))
                .sum()
        })
        .collect()
}

/// The changes, worked out offline: (a) one node moved to another group, chosen among a few
/// so that the share of bundles it changes is nearest 1 %; (b) a node added, (c) that node
/// enrolled.
fn plan_changes(mesh: &MeshDir, keys: &trellis_core::Keys) -> Result<Plan> {
    let t = Instant::now();
    let rss = memory_kib(std::process::id(), "VmRSS").unwrap_or(0);
    let base = compile(mesh, keys, None)?;
    eprintln!(
        "  full compile: {:.1} s, holding {:.0} MiB more",
        t.elapsed().as_secs_f64(),
        memory_kib(std::process::id(), "VmRSS").unwrap_or(0).saturating_sub(rss) as f64 / 1024.0
    );
    let decl = &mesh.decl;
    let target = decl.nodes.len().div_ceil(100) as f64;
    let movable: Vec<&str> = decl.nodes.iter().filter(|n| !n.hub).map(|n| n.name.as_str()).collect();
    let hubs: HashSet<&str> = decl.nodes.iter().filter(|n| n.hub).map(|n| n.name.as_str()).collect();
    // Candidates: out of the groups reaching fewest nodes, into the groups whose reach is
    // nearest the target.
    let reach = reach(decl);
    let mut from_order: Vec<usize> = (0..decl.groups.len()).collect();
    from_order.sort_by_key(|&g| reach[g]);
    let mut to_order = from_order.clone();
    let distance = |count: usize| ((count as f64 + 0.5) / target).ln().abs();
    to_order.sort_by(|&a, &b| distance(reach[a]).total_cmp(&distance(reach[b])));
    let mut best: Option<(f64, MeshDir, Change, Compiled)> = None;
    let mut tried = 0;
    for (k, &to) in to_order.iter().enumerate().take(CANDIDATES * 4) {
        if tried == CANDIDATES {
            break;
        }
        let pick = from_order.iter().cycle().skip(k).take(from_order.len()).find_map(|&from| {
            let g = &decl.groups[from];
            let node = g.members.iter().find(|m| !hubs.contains(m.as_str()) && !decl.groups[to].members.contains(m))?;
            (from != to).then_some((from, node))
        });
        let Some((from, node)) = pick else { continue };
        tried += 1;
        let (from, to) = (&decl.groups[from].name, &decl.groups[to].name);
        let moved = mesh.move_node(node, from, to)?;
        let c = compile(&moved, keys, Some(base.clone()))?;
        let change = changed(format!("{node} moved from group {from} to {to}"), &base, &c);
        let distance = distance(change.changed.len());
        eprintln!("  moving {node} from {from} to {to} changes {} bundles", change.changed.len());
        if best.as_ref().is_none_or(|(d, _, _, _)| distance < *d) {
            best = Some((distance, moved, change, c));
        }
    }
    let Some((_, moved_mesh, moved, after_move)) = best else {
        bail!("{}: no node could be moved to another group (the mesh needs groups under [groups])", mesh.dir.display());
    };
    drop(base);
    if decl.node(ADDED).is_some() {
        bail!("{} already declares a node {ADDED}, the name this bench adds", mesh.dir.display());
    }
    let like = movable.get(movable.len() / 2).context("the mesh has no node that is not a hub")?;
    let added_mesh = moved_mesh.add_node(ADDED, like)?;
    let after_add = compile(&added_mesh, keys, Some(after_move.clone()))?;
    let added = changed(format!("{ADDED} added, like {like}"), &after_move, &after_add);
    drop(after_move);
    let mut with_added = keys.clone();
    with_added.set(ADDED, Some(added_key(decl)));
    let after_enrol = compile(&added_mesh, &with_added, Some(after_add.clone()))?;
    let enrolled = changed(format!("{ADDED} enrolled"), &after_add, &after_enrol);
    Ok(Plan { moved_mesh, moved, added_mesh, added, enrolled })
}

/// The WireGuard key of the node the bench adds: after those of the mesh's nodes.
fn added_key(decl: &trellis_core::Declaration) -> PublicKey {
    crate::meshgen::key(decl.nodes.len())
}

/// A bundle one agent received while long-polling.
enum Event {
    Bundle {
        agent: usize,
        at: Instant,
        bytes: usize,
    },
    /// Answered that what it holds is current (`304`), holding this version.
    Current {
        agent: usize,
        at: Instant,
        held: u64,
    },
    Failed {
        agent: usize,
        error: String,
    },
}

/// What the agents received in one phase.
#[derive(Default)]
struct Phase {
    /// Per agent: when its first new bundle came (after the phase began) and the bytes fetched.
    got: HashMap<usize, (Duration, usize)>,
    /// Agents that got a bundle the offline compile did not expect to change.
    unexpected: usize,
    /// Expected agents that got nothing within the limit.
    missing: usize,
    /// Of the missing (a few): the agent, and when it was last answered "current" after the
    /// phase began and holding which version, if it was.
    missing_seen: Vec<(usize, Option<(Duration, u64)>)>,
    failures: Vec<String>,
}

impl Phase {
    fn bytes(&self) -> usize {
        self.got.values().map(|(_, b)| b).sum()
    }

    /// How many agents fetched more than 1 MiB, and how many bytes they fetched.
    fn large(&self) -> (usize, usize) {
        let large: Vec<usize> = self.got.values().map(|(_, b)| *b).filter(|b| *b > 1024 * 1024).collect();
        (large.len(), large.iter().sum())
    }

    fn latencies(&self) -> Vec<Duration> {
        sorted(self.got.values().map(|(d, _)| *d).collect())
    }
}

/// Collects the agents' bundles from `t0` until every agent of `expect` has one and `GRACE`
/// passed, or `PHASE_LIMIT`.
async fn collect(events: &mut tokio::sync::mpsc::UnboundedReceiver<Event>, t0: Instant, expect: &HashSet<usize>) -> Phase {
    let mut phase = Phase::default();
    let mut waiting = expect.clone();
    let mut current: HashMap<usize, (Duration, u64)> = HashMap::new();
    let mut all_at = waiting.is_empty().then(Instant::now);
    loop {
        let until = match all_at {
            Some(at) => at + GRACE,
            None => t0 + PHASE_LIMIT,
        };
        let Ok(Some(event)) = tokio::time::timeout_at(until.into(), events.recv()).await else {
            break;
        };
        match event {
            Event::Bundle { agent, at, bytes } => {
                let entry = phase.got.entry(agent).or_insert((at.saturating_duration_since(t0), 0));
                entry.1 += bytes;
                if !expect.contains(&agent) && entry.1 == bytes {
                    phase.unexpected += 1;
                }
                waiting.remove(&agent);
                if waiting.is_empty() && all_at.is_none() {
                    all_at = Some(Instant::now());
                }
            }
            Event::Current { agent, at, held } => {
                current.insert(agent, (at.saturating_duration_since(t0), held));
            }
            Event::Failed { agent, error } => phase.failures.push(format!("agent {agent}: {error}")),
        }
    }
    phase.missing = waiting.len();
    let mut missing: Vec<usize> = waiting.into_iter().collect();
    missing.sort_unstable();
    phase.missing_seen = missing.into_iter().take(5).map(|a| (a, current.get(&a).copied())).collect();
    phase
}

/// Waits until `trellis serve` has published every decision made so far: the audit checkpoint
/// is answered only then (each request waits up to 20 seconds; a few are tried).
pub async fn settled(admin: &trellis_client::AdminClient) -> Result<Duration> {
    let t = Instant::now();
    let mut last = None;
    for _ in 0..15 {
        match admin.audit_checkpoint().await {
            Ok(_) => return Ok(t.elapsed()),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map(anyhow::Error::from).unwrap_or_else(|| anyhow::anyhow!("no answer")).context("trellis serve did not finish publishing"))
}

/// Events that arrived before a phase began: bundles of an earlier change that came late.
fn drain(events: &mut tokio::sync::mpsc::UnboundedReceiver<Event>) -> usize {
    let mut n = 0;
    while let Ok(e) = events.try_recv() {
        n += usize::from(matches!(e, Event::Bundle { .. }));
    }
    n
}

/// A whole bundle as the agent verifies it (its mesh read from the manifest, as the agent knows
/// its own).
fn whole_bundle(agent: &Agent, body: &[u8]) -> Result<trellis_core::bundle::Bundle, trellis_core::bundle::BundleError> {
    let key = agent.signing.ok_or(trellis_core::bundle::BundleError::Malformed("no signing key"))?;
    let mesh = trellis_core::bundle::signed_mesh(body).ok_or(trellis_core::bundle::BundleError::UnknownFormat)?;
    trellis_core::bundle::verify(body, &key, &mesh, &agent.name, None).map(|v| v.bundle)
}

/// An agent's loop: long-poll for a bundle newer than the one held, report each one received. A
/// request that fails is reported and, as the agent does, asked again after a backoff that
/// doubles up to 16 s (spread by the agent's number): 19,400 agents reconnecting at once
/// overflow the listen queue of a loopback server, and an agent that gave up at its first
/// failure was counted missing from every later change.
async fn poll(agents: Arc<Vec<Agent>>, i: usize, base: String, first_wait: u64, tx: tokio::sync::mpsc::UnboundedSender<Event>) {
    let deadline = Instant::now() + POLLING_LIMIT;
    let mut held = agents[i].version;
    let mut wait = first_wait;
    let mut failures = 0u32;
    for _ in 0..1000 {
        if Instant::now() > deadline {
            return;
        }
        match fetch(&agents[i], &base, Some(held), wait, true).await {
            Ok((200, Some(v), body, delta)) => {
                // A delta is verified and built into the new bundle, as the agent does; the bytes
                // fetched are what came over the wire.
                let built = match (delta, agents[i].last.lock().expect("last").clone(), agents[i].signing) {
                    (true, Some(last), Some(key)) => {
                        trellis_core::bundle::verify_delta(&body, &key, &last.mesh, &agents[i].name, None, &last).map(|v| v.bundle)
                    }
                    (true, ..) => Err(trellis_core::bundle::BundleError::Malformed("a delta to an agent that holds no bundle")),
                    (false, ..) => whole_bundle(&agents[i], &body),
                };
                match built {
                    Ok(b) => *agents[i].last.lock().expect("last") = Some(b),
                    Err(e) => {
                        let _ = tx.send(Event::Failed { agent: i, error: format!("version {v} was refused: {e}") });
                        return;
                    }
                }
                held = v;
                let _ = tx.send(Event::Bundle { agent: i, at: Instant::now(), bytes: body.len() });
            }
            Ok((304, _, _, _)) => {
                let _ = tx.send(Event::Current { agent: i, at: Instant::now(), held });
            }
            Ok((status, _, _, _)) => {
                let _ = tx.send(Event::Failed { agent: i, error: format!("answer {status} without a version") });
                return;
            }
            Err(e) => {
                let _ = tx.send(Event::Failed { agent: i, error: format!("{e:#}") });
                failures += 1;
                let backoff = Duration::from_secs(1 << failures.min(5).saturating_sub(1)) + Duration::from_millis((i % 1000) as u64);
                tokio::time::sleep(backoff).await;
                continue;
            }
        }
        failures = 0;
        wait = 55;
    }
}

pub async fn run(a: &DeliveryArgs, dir: &Path) -> Result<ExitCode> {
    let mesh = MeshDir::read(dir)?;
    let n = mesh.decl.nodes.len();
    if a.agents == 0 || a.agents > n.min(20_000) {
        bail!("--agents must be between 1 and the {n} nodes of {} (at most 20000)", dir.display());
    }
    let trellis = trellis_exe()?;
    raise_fd_limit(a.agents)?;
    let names: Vec<String> = mesh.decl.nodes.iter().map(|n| n.name.clone()).collect();
    let keys: trellis_core::Keys = names.iter().enumerate().map(|(i, n)| (n.clone(), crate::meshgen::key(i))).collect();
    // The agents, spread evenly over the mesh (the first is the first node, a hub in a
    // generated mesh).
    let agent_of: HashMap<&str, usize> = (0..a.agents).map(|k| (names[k * n / a.agents].as_str(), k)).collect();
    let expect = |c: &Change| -> HashSet<usize> { c.changed.iter().filter_map(|node| agent_of.get(node.as_str()).copied()).collect() };

    eprintln!("compiling {} offline to choose the changes...", dir.display());
    let Plan { moved_mesh, moved, added_mesh, added, enrolled: enrol_added } = plan_changes(&mesh, &keys)?;
    eprintln!(
        "  change: {} ({} bundles change); {} ({}); {} ({})",
        moved.what,
        moved.changed.len(),
        added.what,
        added.changed.len(),
        enrol_added.what,
        enrol_added.changed.len()
    );

    let running = start(&trellis, a.database_url.clone(), "fleet").await?;
    let (base, serve_pid) = (running.base(), running.serve.0.id());
    let admin = Arc::new(crate::admin_client(&running.dir)?);
    admin.apply(&mesh.request()).await.with_context(|| format!("cannot apply {}", dir.display()))?;
    let ca = std::fs::read_to_string(running.dir.join(trellis_controller::layout::CA_CERT))?;
    settled(&admin).await?;
    let rss_applied = memory_kib(serve_pid, "VmRSS");

    // Every node enrols, 64 in flight; the agents' certificates are kept.
    eprintln!("making {n} tokens, keys and CSRs...");
    let enrolees =
        enrolling::prepare(&admin, names.iter().map(|name| (name.clone(), keys.get(name).expect("every node has a key"))).collect())
            .await?;
    eprintln!("enrolling {n} nodes...");
    let t = Instant::now();
    let enrolled = enrolling::enrol_all(&base, &ca, enrolees, 64).await?;
    let enrol_wall = t.elapsed();
    let publish_after_enrol = settled(&admin).await?;
    let rss_enrolled = memory_kib(serve_pid, "VmRSS");
    let mut agents: Vec<Option<Agent>> = (0..a.agents).map(|_| None).collect();
    for e in enrolled {
        if let Some(&k) = agent_of.get(e.name.as_str()) {
            let cfg = trellis_pki::tls::client_config(&ca, Some((&e.cert_pem, &e.key_pem)))?;
            let http =
                reqwest::Client::builder().use_preconfigured_tls(cfg).pool_max_idle_per_host(1).local_address(agent_source(k)).build()?;
            let mut agent = Agent::new(e.name, http);
            let key: [u8; 32] = base64::engine::general_purpose::STANDARD
                .decode(&e.signing_public_key)?
                .try_into()
                .map_err(|_| anyhow::anyhow!("the signing key is not 32 bytes"))?;
            agent.signing = Some(ed25519_dalek::VerifyingKey::from_bytes(&key)?);
            agents[k] = Some(agent);
        }
    }
    let agents: Vec<Agent> = agents.into_iter().map(|x| x.context("an agent did not enrol")).collect::<Result<_>>()?;

    // Every agent takes its first bundle, 64 at a time.
    eprintln!("{} agents fetch their first bundle...", agents.len());
    let mut first_bytes = Vec::with_capacity(agents.len());
    let mut fetched_all = Vec::with_capacity(agents.len());
    let mut pending = agents.into_iter();
    loop {
        let tasks: Vec<_> = pending
            .by_ref()
            .take(64)
            .map(|agent| {
                let base = base.clone();
                tokio::spawn(async move {
                    let r = fetch(&agent, &base, None, 0, false).await;
                    (agent, r)
                })
            })
            .collect();
        if tasks.is_empty() {
            break;
        }
        for t in tasks {
            let (mut agent, r) = t.await?;
            let (status, v, body, _) = r.with_context(|| format!("{}: first bundle", agent.name))?;
            if status != 200 {
                bail!("{} got {status} for its first bundle", agent.name);
            }
            agent.version = v.context("no ETag")?;
            first_bytes.push(body.len());
            agent.last = std::sync::Mutex::new(Some(whole_bundle(&agent, &body).map_err(|e| anyhow::anyhow!("{}: {e}", agent.name))?));
            fetched_all.push(agent);
        }
    }
    let agents = fetched_all;
    let agents = Arc::new(agents);

    // Every agent long-polls; the first waits are spread over 30 to 59 seconds so that the 304s
    // do not all come back at once.
    eprintln!("{} agents long-polling...", agents.len());
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // Started all at once, as a fleet reconnects after a controller restart (the controller's
    // listen queue holds the burst).
    let mut pollers: Vec<tokio::task::JoinHandle<()>> = Vec::with_capacity(agents.len());
    for i in 0..agents.len() {
        pollers.push(tokio::spawn(poll(agents.clone(), i, base.clone(), 30 + (i % 30) as u64, tx.clone())));
    }
    drop(tx);
    tokio::time::sleep(Duration::from_secs(2) + Duration::from_millis(agents.len() as u64 / 2)).await;
    let mut late = drain(&mut rx);

    // (a) A node moves to another group.
    eprintln!("applying: {}...", moved.what);
    let t0 = Instant::now();
    admin.apply(&moved_mesh.request()).await?;
    let apply_ms = ms(t0.elapsed());
    let change = collect(&mut rx, t0, &expect(&moved)).await;
    settled(&admin).await?;
    late += drain(&mut rx);

    // (b) One node is added, then enrols.
    eprintln!("applying: {}...", added.what);
    let t1 = Instant::now();
    admin.apply(&added_mesh.request()).await?;
    let declare = collect(&mut rx, t1, &expect(&added)).await;
    settled(&admin).await?;
    late += drain(&mut rx);
    let new_node = enrolling::prepare(&admin, vec![(ADDED.to_string(), added_key(&mesh.decl))]).await?;
    eprintln!("{}...", enrol_added.what);
    let t2 = Instant::now();
    enrolling::enrol_all(&base, &ca, new_node, 1).await?;
    let enrol = collect(&mut rx, t2, &expect(&enrol_added)).await;

    // (c) The controller's memory, with every agent still connected.
    let peak = memory_kib(serve_pid, "VmHWM");
    let rss = memory_kib(serve_pid, "VmRSS");
    for p in &pollers {
        p.abort();
    }
    let state_dir = running.dir.clone();
    drop(running);
    // TRELLIS_BENCH_KEEP keeps the state directory, its `serve.log` among it (run with
    // RUST_LOG=info,trellis_controller=debug for each publish run's stages).
    if std::env::var_os("TRELLIS_BENCH_KEEP").is_some() {
        eprintln!("the state directory and serve.log are kept in {}", state_dir.display());
    } else {
        let _ = std::fs::remove_dir_all(&state_dir);
    }

    let lat = change.latencies();
    let refetch = declare.bytes() + enrol.bytes();
    let (target_refetch, target_rss_kib) = targets(n);
    let failures: Vec<&String> = change.failures.iter().chain(&declare.failures).chain(&enrol.failures).collect();
    let db = database_name(a.database_url.as_deref());
    let phase_json = |p: &Phase, c: &Change| {
        json!({
            "what": c.what, "bundles_changed_offline": c.changed.len(), "agents_expected": expect(c).len(),
            "agents_changed": p.got.len(), "agents_unexpected": p.unexpected, "agents_missing": p.missing, "bytes": p.bytes(),
            "files_changed": c.files,
            "largest_bytes": p.got.values().map(|(_, b)| *b).max(), "agents_over_1_mib": p.large().0, "bytes_over_1_mib": p.large().1,
        })
    };
    if a.json {
        let mut a_json = phase_json(&change, &moved);
        a_json["apply_ms"] = json!(apply_ms);
        a_json["to_bundle_ms"] =
            json!({"p50": ms(pct(&lat, 0.5)), "p99": ms(pct(&lat, 0.99)), "max": ms(lat.last().copied().unwrap_or_default())});
        a_json["target_p99_ms"] = json!(ms(TARGET_P99));
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "mesh": dir.display().to_string(), "nodes": n, "agents": agents.len(), "database": db,
                "enrolled": n, "enrol_ms": ms(enrol_wall), "enrol_publish_settled_ms": ms(publish_after_enrol),
                "late_bundles": late,
                "first_bundles": {"bytes": first_bytes.iter().sum::<usize>(), "max": first_bytes.iter().max()},
                "change": a_json,
                "add_node": {
                    "declare": phase_json(&declare, &added), "enrol": phase_json(&enrol, &enrol_added),
                    "refetched_bytes": refetch, "target_refetched_bytes": target_refetch,
                },
                "serve_peak_rss_kib": peak, "serve_rss_kib": rss, "target_serve_peak_rss_kib": target_rss_kib,
                "serve_rss_kib_applied": rss_applied, "serve_rss_kib_enrolled": rss_enrolled,
                "agent_failures": failures,
            }))?
        );
    } else {
        let met = |ok: bool| if ok { "met" } else { "MISSED" };
        let mib = |b: usize| b as f64 / 1048576.0;
        println!(
            "{} agents of the {n} nodes of {} against trellis serve ({db}) on loopback; every node enrolled",
            agents.len(),
            dir.display()
        );
        println!(
            "enrolment of all {n} nodes:    {:.1} s, published {:.1} s later; first bundles: {:.1} MiB to {} agents (largest {:.1} MiB)",
            enrol_wall.as_secs_f64(),
            publish_after_enrol.as_secs_f64(),
            mib(first_bytes.iter().sum()),
            agents.len(),
            mib(first_bytes.iter().copied().max().unwrap_or(0))
        );
        let phase_line = |p: &Phase, c: &Change| {
            let files: Vec<String> = c.files.iter().map(|(f, k)| format!("{} in {k}", f.rsplit('/').next().unwrap_or(f))).collect();
            format!(
                "{}: {} bundles change [{}] ({} of them agents'); {} agents got a new one{}{}, {:.2} MiB ({} over 1 MiB each: {:.2} MiB)",
                c.what,
                c.changed.len(),
                files.join(", "),
                expect(c).len(),
                p.got.len(),
                if p.unexpected > 0 { format!(" ({} unexpected)", p.unexpected) } else { String::new() },
                if p.missing > 0 {
                    let seen: Vec<String> = p
                        .missing_seen
                        .iter()
                        .map(|(a, c)| match c {
                            Some((at, held)) => format!("agent {a}: told version {held} is current at +{:.1} s", at.as_secs_f64()),
                            None => format!("agent {a}: no answer"),
                        })
                        .collect();
                    format!(", {} MISSING after {} s [{}]", p.missing, PHASE_LIMIT.as_secs(), seen.join("; "))
                } else {
                    String::new()
                },
                mib(p.bytes()),
                p.large().0,
                mib(p.large().1)
            )
        };
        println!("(a) {}", phase_line(&change, &moved));
        println!(
            "    apply request {apply_ms:.0} ms; apply -> agent holds it: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms  (target p99 < {:.0} ms: {})",
            ms(pct(&lat, 0.5)),
            ms(pct(&lat, 0.99)),
            ms(lat.last().copied().unwrap_or_default()),
            ms(TARGET_P99),
            if lat.is_empty() { "no agent was affected" } else { met(pct(&lat, 0.99) < TARGET_P99 && change.missing == 0) }
        );
        println!("(b) {}", phase_line(&declare, &added));
        println!("    {}", phase_line(&enrol, &enrol_added));
        println!(
            "    bytes agents fetched again: {:.2} MiB  (target < {:.0} MiB: {})",
            mib(refetch),
            mib(target_refetch),
            met(refetch < target_refetch)
        );
        match peak {
            Some(p) => println!(
                "(c) trellis serve peak memory (VmHWM): {:.0} MiB, now {:.0} MiB, with {} agents connected  (target <= {} MiB: {})",
                p as f64 / 1024.0,
                rss.unwrap_or(0) as f64 / 1024.0,
                agents.len(),
                target_rss_kib / 1024,
                met(p <= target_rss_kib)
            ),
            None => println!("(c) the peak memory of trellis serve could not be read"),
        }
        let mib_of = |k: Option<u64>| k.unwrap_or(0) as f64 / 1024.0;
        println!(
            "    trellis serve memory (VmRSS) after the apply: {:.0} MiB; after every node enrolled: {:.0} MiB",
            mib_of(rss_applied),
            mib_of(rss_enrolled)
        );
        if late > 0 {
            println!("    {late} bundles came after their phase ended (not counted in any phase)");
        }
        if !failures.is_empty() {
            println!("{} agent requests failed during the phases (each asked again after a backoff); the first:", failures.len());
        }
        for f in failures.iter().take(10) {
            println!("agent failure: {f}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
