//! `trellis-dev bench`: figures for the compiler on a generated mesh, printed for people (or as
//! JSON). Time is measured here, at the edge; the compiler itself has no clock.

use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use std::sync::Arc;
use trellis_core::decl::PublicKey;

use trellis_core::compile::{MESH_ZONE, NFTABLES_CONF, WIREGUARD_CONF};
use trellis_core::{compile, load, Compiled, Declaration, Keys, SourceFile};

#[derive(Subcommand)]
pub enum BenchCommand {
    /// Full compile of every node, and a one-node change recompiling only what it affects
    Compile(CompileArgs),
    /// Enrolments per second against an in-process controller on loopback (CSR signing included);
    /// with --mesh DIR, every node of a real declaration enrols and the bench also reports when
    /// every node holds its first bundle
    Enrol(EnrolArgs),
    /// N simulated agents against a real `trellis serve` on loopback: 304s per second, and the
    /// time from one `apply` until every long-polling agent holds its new bundle; with --mesh
    /// DIR, on a real declaration: a change to about 1 % of the nodes, one node added, and the
    /// controller's memory
    Delivery(DeliveryArgs),
    /// Service certificates (ADR 0023): the services CA's signatures per second, issuance over
    /// HTTPS end to end, and what renewals cost a controller at a fleet's size
    Certs(crate::certs::CertsArgs),
    /// A real agent in a network namespace on a node that sees N peers (an operator's): the
    /// first apply, a change of three peers, each split by phase (files, WireGuard, ruleset,
    /// DNS), its memory and its resolver's answer time, on each WireGuard backend; needs root
    Agent(crate::agentbench::AgentArgs),
}

#[derive(Args)]
pub struct DeliveryArgs {
    /// How many simulated agents (each enrols, then long-polls); with --mesh, that many of the
    /// mesh's nodes, spread evenly over it
    #[arg(long, default_value_t = 2000)]
    pub agents: usize,
    /// How many `304` requests to time (spread over 64 concurrent agents; not with --mesh)
    #[arg(long, default_value_t = 20000)]
    pub requests: usize,
    /// A declaration directory (`trellis-dev mesh --out DIR`; nodes without public_key) to run
    /// on. Every node of it enrols (the ones without an agent too, so that bundles are those of
    /// a fully enrolled fleet); --agents of them long-poll. Then: a few nodes move to another
    /// group (chosen so that about 1 % of the bundles change), one node is added and enrols;
    /// the figures are the time until every affected agent holds its new bundle, the bytes
    /// agents fetched again, and the peak memory of `trellis serve`
    #[arg(long, value_name = "DIR", conflicts_with = "requests")]
    pub mesh: Option<std::path::PathBuf>,
    /// sqlite://... or postgres://... (default: SQLite in a temporary state directory)
    #[arg(long)]
    pub database_url: Option<String>,
    #[arg(long)]
    pub json: bool,
}

#[derive(Args)]
pub struct EnrolArgs {
    /// How many nodes enrol (in a generated mesh of nodes without modules; not with --mesh)
    #[arg(long, default_value_t = 500, conflicts_with = "mesh")]
    nodes: usize,
    /// How many enrolments are in flight at once (default 16, or 64 with --mesh)
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// A declaration directory (`trellis-dev mesh --out DIR`; nodes without public_key): apply
    /// it and enrol every one of its nodes
    #[arg(long, value_name = "DIR")]
    pub mesh: Option<std::path::PathBuf>,
    /// With --mesh: how many nodes fetch their first bundle over HTTPS with their own certificate
    #[arg(long, default_value_t = 16)]
    pub sample: usize,
    /// sqlite://... or postgres://... of an empty database (default: SQLite in a temporary state
    /// directory)
    #[arg(long)]
    pub database_url: Option<String>,
    #[arg(long)]
    pub json: bool,
}

/// The shape of a generated mesh.
#[derive(Args, Clone)]
pub struct Shape {
    #[arg(long, default_value_t = 10_000)]
    pub nodes: usize,
    #[arg(long, default_value_t = 500)]
    pub groups: usize,
    #[arg(long, default_value_t = 50)]
    pub modules: usize,
    #[arg(long, default_value_t = 20)]
    pub networks: usize,
    #[arg(long, default_value_t = 10)]
    pub hubs: usize,
}

#[derive(Args)]
pub struct CompileArgs {
    #[command(flatten)]
    shape: Shape,
    /// How many times to time the full compile and each change (the medians are reported)
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Time only this change (its JSON key: rekey_one_node, enrol_one_node, regroup_one_node,
    /// pool_member_joins, no_change), for a profiler
    #[arg(long, value_name = "KEY")]
    only: Option<String>,
    /// Print the figures as JSON
    #[arg(long)]
    json: bool,
}

/// `trellis-dev mesh`: a generated declaration directory, for `trellis compile` and the benches.
#[derive(Args)]
pub struct MeshArgs {
    #[command(flatten)]
    shape: Shape,
    /// Where to write mesh.toml and modules/ (created; must not hold a mesh.toml yet)
    #[arg(long)]
    out: std::path::PathBuf,
    /// Declare every node's WireGuard key in the mesh (nodes managed outside trellis); by
    /// default nodes have no key and get one by enrolling
    #[arg(long)]
    declared_keys: bool,
}

/// Writes a generated mesh as a declaration directory.
pub fn write_mesh(a: &MeshArgs) -> Result<ExitCode> {
    if a.out.join("mesh.toml").exists() {
        bail!("{} already holds a mesh.toml; choose an empty directory", a.out.display());
    }
    let (mesh, modules) = generate(&a.shape, a.declared_keys);
    std::fs::create_dir_all(a.out.join("modules")).with_context(|| format!("cannot create {}", a.out.display()))?;
    let mut bytes = 0;
    for f in std::iter::once(&mesh).chain(modules.iter()) {
        std::fs::write(a.out.join(&f.path), &f.text).with_context(|| format!("cannot write {}", f.path))?;
        bytes += f.text.len();
    }
    let s = &a.shape;
    eprintln!(
        "wrote {}: {} nodes, {} groups, {} modules, {} networks, {} hubs ({} files, {:.1} MiB)",
        a.out.display(),
        s.nodes,
        s.groups,
        s.modules,
        s.networks,
        s.hubs,
        modules.len() + 1,
        bytes as f64 / 1048576.0
    );
    Ok(ExitCode::SUCCESS)
}

pub fn run(cmd: BenchCommand) -> Result<ExitCode> {
    match cmd {
        BenchCommand::Compile(a) => bench_compile(&a),
        BenchCommand::Enrol(a) => match &a.mesh {
            Some(dir) => runtime()?.block_on(crate::storm::run(&a, dir)),
            None => runtime()?.block_on(bench_enrol(&a)),
        },
        BenchCommand::Certs(a) => runtime()?.block_on(crate::certs::run(&a)),
        BenchCommand::Agent(a) => crate::agentbench::run(&a),
        BenchCommand::Delivery(a) => match &a.mesh {
            Some(dir) => runtime()?.block_on(crate::fleet::run(&a, dir)),
            None => runtime()?.block_on(crate::delivery::run(&a)),
        },
    }
}

fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build().context("cannot start the tokio runtime")
}

/// The IPv4 overlay of a generated mesh of `nodes`: the /16 the benches have always used while
/// it holds twice the nodes (figures stay comparable), else one that grows with the mesh
/// (100,000 nodes: a /14).
pub fn overlay_for(nodes: usize) -> String {
    let bits = (2 * nodes as u64 + 2).next_power_of_two().trailing_zeros().max(16);
    if bits <= 16 {
        return "10.88.0.0/16".into();
    }
    format!("10.64.0.0/{}", 32 - bits.min(22))
}

/// The WireGuard key of generated node `i`.
pub fn key(i: usize) -> PublicKey {
    let mut b = [0u8; 32];
    b[..8].copy_from_slice(&(i as u64 + 1).to_le_bytes());
    b[31] = 0x5a;
    PublicKey(b)
}

/// The name of generated node `i`: the first `hubs` are hubs.
pub fn node_name(i: usize, hubs: usize) -> String {
    if i < hubs {
        format!("hub-{i}")
    } else {
        format!("node-{i:05}")
    }
}

/// A mesh shaped like a fleet: every node in one group and on one network, a third of them with
/// an endpoint; every node runs one service module and the shared `base` module; services admit
/// two groups over TCP and one over ICMP; `base` admits the `ops` group (SSH from operators).
/// With `declared_keys`, every node's WireGuard key is declared in the mesh (as for nodes managed
/// outside trellis); without, nodes get keys by enrolling.
pub fn generate(a: &Shape, declared_keys: bool) -> (SourceFile, Vec<SourceFile>) {
    let (n, g, m, w, h) = (a.nodes, a.groups.max(2), a.modules.max(2), a.networks.max(1), a.hubs);
    let mut s = String::with_capacity(n * 200);
    let _ = write!(
        s,
        "[mesh]\nname = \"bench\"\ndomain = \"bench.mesh\"\noverlay_ipv4 = \"{}\"\noverlay_ipv6 = \"fd88::/64\"\n\n[networks]\n",
        overlay_for(n)
    );
    for i in 0..w {
        let _ = writeln!(s, "net-{i} = {{}}");
    }
    let mut members: Vec<Vec<String>> = vec![Vec::new(); g];
    let name = |i: usize| node_name(i, h);
    for i in 0..n {
        members[i % g].push(name(i));
    }
    s.push_str("\n[groups]\n");
    for (i, list) in members.iter().enumerate() {
        let quoted: Vec<String> = list.iter().map(|m| format!("\"{m}\"")).collect();
        let label = if i == 0 { "ops".to_string() } else { format!("grp-{i}") };
        let _ = writeln!(s, "{label} = [{}]", quoted.join(", "));
    }
    let all_nets: Vec<String> = (0..w).map(|i| format!("\"net-{i}\"")).collect();
    for i in 0..n {
        let _ = write!(
            s,
            "\n[[node]]\nname = \"{}\"\nnetworks = [\"net-{}\"]\nmodules = [\"svc-{}\", \"base\"]\n",
            name(i),
            i % w,
            i % (m - 1),
        );
        if declared_keys {
            let _ = writeln!(s, "public_key = \"{}\"", key(i));
        }
        if i < h {
            let _ = write!(
                s,
                "hub = true\n[[node.endpoint]]\naddress = \"198.51.100.{}:51820\"\nreachable_from = [{}]\n",
                i + 1,
                all_nets.join(", ")
            );
        } else if i.is_multiple_of(3) {
            let _ = write!(
                s,
                "[[node.endpoint]]\naddress = \"203.0.{}.{}:51820\"\nreachable_from = [\"net-{}\", \"net-{}\"]\n",
                (i / 250) % 250,
                i % 250 + 1,
                i % w,
                (i + 1) % w
            );
        }
    }
    let mut modules = Vec::new();
    for j in 0..m - 1 {
        let (g1, g2, g3) = (1 + (j * 7) % (g - 1), 1 + (j * 7 + 1) % (g - 1), 1 + (j * 7 + 2) % (g - 1));
        let text = format!("[module]\nname = \"svc-{j}\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"{}\", \"8000-8100\"]\nfrom = [\"group:grp-{g1}\", \"group:grp-{g2}\"]\n\n[[allow]]\nproto = \"icmp\"\nfrom = [\"group:grp-{g3}\"]\n", 1000 + j);
        modules.push(SourceFile { path: format!("modules/svc-{j}.toml"), text });
    }
    modules.push(SourceFile {
        path: "modules/base.toml".into(),
        text: "[module]\nname = \"base\"\n\n[[allow]]\nproto = \"tcp\"\nports = [\"22\"]\nfrom = [\"group:ops\"]\n".into(),
    });
    (SourceFile { path: "mesh.toml".into(), text: s }, modules)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// CPU time used by this process so far, on every thread: on a shared machine it moves less
/// than the wall clock does when other work takes the cores.
pub fn cpu_time() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The database a `--database-url` names, for the figures.
pub fn database_name(url: Option<&str>) -> &'static str {
    if url.is_some_and(|u| u.starts_with("postgres")) {
        "postgresql"
    } else {
        "sqlite"
    }
}

/// Whether two compiles give every node the same files, byte for byte.
fn same_files(a: &Compiled, b: &Compiled) -> bool {
    a.nodes.len() == b.nodes.len()
        && a.nodes.iter().zip(b.nodes.iter()).all(|((na, oa), (nb, ob))| na == nb && oa.files == ob.files)
        && a.diagnostics == b.diagnostics
}

fn bench_compile(args: &CompileArgs) -> Result<ExitCode> {
    let a = &args.shape;
    if a.nodes <= a.hubs + 8 || args.runs == 0 {
        bail!("--nodes must exceed --hubs by more than 8 and --runs must be at least 1");
    }
    let (mesh, modules) = generate(a, false);
    let t = Instant::now();
    let loaded = load(&mesh, &modules);
    let load_time = t.elapsed();
    let Some(decl) = loaded.declaration else {
        bail!("the generated mesh does not validate: {}", loaded.diagnostics.first().map(|d| d.to_string()).unwrap_or_default());
    };
    let decl = Arc::new(decl);
    // Every node has enrolled except `late`, which enrols during the figures.
    let (target, late) = (node_name(a.hubs + 7, a.hubs), node_name(a.hubs + 8, a.hubs));
    let keys: Keys = (0..a.nodes).map(|i| (node_name(i, a.hubs), key(i))).filter(|(n, _)| *n != late).collect();
    let run = |decl: &Arc<Declaration>, keys: &Keys, prev: Option<Compiled>| {
        let (t, cpu) = (Instant::now(), cpu_time());
        let c = compile(decl, keys, &Default::default(), prev).map_err(|d| anyhow::anyhow!("{d}"))?;
        Ok::<_, anyhow::Error>(((t.elapsed(), cpu_time() - cpu), c))
    };
    let mut times = Vec::new();
    let mut cpus = Vec::new();
    let mut last = None;
    for _ in 0..args.runs {
        // The compile before is dropped first: two of them at once would be the peak.
        drop(last.take());
        let ((took, cpu), c) = run(&decl, &keys, None)?;
        times.push(took);
        cpus.push(cpu);
        last = Some(c);
    }
    let base = last.expect("runs >= 1");
    let bytes: usize = base.nodes.values().flat_map(|o| o.files.iter()).map(|f| f.content.len()).sum();
    let zone_bytes: usize =
        base.nodes.values().flat_map(|o| o.files.iter()).filter(|f| f.path.ends_with("mesh.zone")).map(|f| f.content.len()).sum();
    // The largest file of each kind, and whose it is: the files that grow with the mesh.
    let largest: Vec<(&str, usize, &str)> = [WIREGUARD_CONF, MESH_ZONE, NFTABLES_CONF]
        .into_iter()
        .map(|path| {
            let sizes =
                base.nodes.iter().flat_map(|(n, o)| o.files.iter().filter(|f| f.path == path).map(move |f| (f.content.len(), n.as_str())));
            let (len, node) = sizes.max().unwrap_or((0, ""));
            (path.rsplit('/').next().unwrap_or(path), len, node)
        })
        .collect();
    let peers: usize = base.nodes.values().map(|o| o.plan.peers.len()).sum();
    let max_peers = base.nodes.values().map(|o| o.plan.peers.len()).max().unwrap_or(0);

    // One-node changes, each from the base compile, each checked against a full compile.
    let mut rekeyed = keys.clone();
    rekeyed.set(&target, Some(PublicKey([0xee; 32])));
    let mut enrolled = keys.clone();
    enrolled.set(&late, Some(PublicKey([0xef; 32])));
    let mut moved = (*decl).clone();
    for grp in &mut moved.groups {
        grp.members.retain(|m| *m != target);
    }
    moved.groups.iter_mut().find(|g| g.name == "grp-1").expect("generated").members.push(target.clone());
    let moved = Arc::new(moved);
    // A member of a pool joins (ADR 0019): the declaration gains a node the controller adds, in a
    // group and running a module, with its key.
    let mut pooled = (*decl).clone();
    let template = &decl.nodes[decl.nodes.len() - 1];
    pooled.pools.push(trellis_core::decl::Pool {
        name: "pool".into(),
        size: 10,
        networks: template.networks.clone(),
        groups: vec!["grp-1".into()],
        modules: template.modules.clone(),
        ephemeral_after: Some(600),
        loc: template.loc.clone(),
        refs: Default::default(),
    });
    let member = trellis_core::decl::Member { name: "pool-1".into(), pool: "pool".into(), address_ipv4: None, address_ipv6: None };
    let joined = Arc::new(pooled.with_members(&[member]));
    let mut member_keys = keys.clone();
    member_keys.set("pool-1", Some(PublicKey([0xf0; 32])));
    /// A change to time: what it is for people, its JSON key, and the inputs after it.
    struct Case<'a> {
        what: &'static str,
        key: &'static str,
        decl: &'a Arc<Declaration>,
        keys: &'a Keys,
    }
    let cases = [
        Case { what: "one node re-keyed", key: "rekey_one_node", decl: &decl, keys: &rekeyed },
        Case { what: "one node enrols", key: "enrol_one_node", decl: &decl, keys: &enrolled },
        Case { what: "one node changes group", key: "regroup_one_node", decl: &moved, keys: &keys },
        Case { what: "a pool member joins", key: "pool_member_joins", decl: &joined, keys: &member_keys },
        Case { what: "no change", key: "no_change", decl: &decl, keys: &keys },
    ];
    let mut figures = Vec::new();
    if let Some(only) = &args.only {
        if !cases.iter().any(|c| c.key == only) {
            let keys: Vec<&str> = cases.iter().map(|c| c.key).collect();
            bail!("--only {only}: no such change; choose one of {}", keys.join(", "));
        }
    }
    for Case { what, key, decl: d, keys: k } in cases {
        if args.only.as_ref().is_some_and(|o| o != key) {
            continue;
        }
        // Each change is timed `--runs` times from a copy of the base; the median is reported.
        let (mut took, mut cpu) = (Vec::new(), Vec::new());
        let mut c = None;
        for _ in 0..args.runs {
            let from = base.clone();
            let ((t, u), out) = run(d, k, Some(from))?;
            took.push(t);
            cpu.push(u);
            c = Some(out);
        }
        let c = c.expect("runs >= 1");
        let (_, full) = run(d, k, None)?;
        if !same_files(&c, &full) {
            bail!("{what}: the recompile differs from a full compile");
        }
        figures.push((what, key, median(took), median(cpu), c.rendered.len()));
    }
    let peak = peak_rss_kib();

    if args.json {
        let changes: serde_json::Map<String, serde_json::Value> = figures
            .iter()
            .map(|(_, key, took, cpu, rendered)| {
                (key.to_string(), json!({"ms": ms(*took), "cpu_ms": ms(*cpu), "rendered": rendered, "equals_full_compile": true}))
            })
            .collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "nodes": a.nodes, "groups": a.groups, "modules": a.modules, "networks": a.networks, "hubs": a.hubs,
                "load_ms": ms(load_time),
                "full_compile_ms": {"median": ms(median(times.clone())), "cpu_median": ms(median(cpus.clone())), "runs": times.iter().map(|d| ms(*d)).collect::<Vec<_>>()},
                "peers_total": peers, "peers_max": max_peers, "bytes": bytes, "zone_bytes": zone_bytes,
                "largest": largest.iter().map(|(f, len, node)| (f.to_string(), json!({"bytes": len, "node": node}))).collect::<serde_json::Map<_, _>>(),
                "changes": changes,
                "peak_rss_kib": peak,
            }))?
        );
    } else {
        println!("generated mesh: {} nodes, {} groups, {} modules, {} networks, {} hubs", a.nodes, a.groups, a.modules, a.networks, a.hubs);
        println!("load and validate:           {:8.1} ms", ms(load_time));
        println!(
            "full compile (median of {}):  {:8.1} ms   cpu {:.1} ms; runs: {}",
            args.runs,
            ms(median(times.clone())),
            ms(median(cpus.clone())),
            times.iter().map(|d| format!("{:.0}", ms(*d))).collect::<Vec<_>>().join(" ")
        );
        println!(
            "output: {peers} peer entries (max {max_peers} on one node), {:.1} MiB of files, of which {:.1} MiB of zones",
            bytes as f64 / 1048576.0,
            zone_bytes as f64 / 1048576.0
        );
        let largest: Vec<String> = largest.iter().map(|(f, len, node)| format!("{f} {:.0} KiB ({node})", *len as f64 / 1024.0)).collect();
        println!("largest files: {}", largest.join(", "));
        for (what, _, took, cpu, rendered) in &figures {
            println!(
                "{:<28} {:8.2} ms   cpu {:.2} ms; rendered {rendered} of {} nodes; equals a full compile",
                format!("{what}:"),
                ms(*took),
                ms(*cpu),
                a.nodes
            );
        }
        if let Some(p) = peak {
            println!("peak resident memory:        {:8.1} MiB", p as f64 / 1024.0);
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn bench_enrol(a: &EnrolArgs) -> Result<ExitCode> {
    use base64::Engine as _;
    use trellis_controller::state;
    use trellis_server::Server;
    let concurrency = a.concurrency.unwrap_or(16);
    if a.nodes == 0 || concurrency == 0 {
        bail!("--nodes and --concurrency must be at least 1");
    }
    let dir = std::env::temp_dir().join(format!("trellis-bench-enrol-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let addr = format!("127.0.0.1:{port}");
    let opts = state::InitOptions {
        advertise: vec![addr.clone()],
        listen: Some(addr.clone()),
        database_url: a.database_url.clone(),
        node_cert_secs: 86400,
    };
    let st = state::init(&dir, &opts).await?;
    let server = Server::bind(&st, None, None).await?;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run(async {
        let _ = stopped.await;
    }));
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
