//! `trellis-dev bench compile`: figures for the compiler on a generated mesh, printed for people
//! (or as JSON): a full compile, and each one-node change recompiling only what it affects. Time
//! is measured here, at the edge; the compiler itself has no clock.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use serde_json::json;
use trellis_core::compile::{MESH_ZONE, NFTABLES_CONF, WIREGUARD_CONF};
use trellis_core::decl::PublicKey;
use trellis_core::{compile, load, Compiled, Declaration, Keys};

use crate::args::CompileArgs;
use crate::figures::{cpu_time, median, ms, peak_rss_kib};
use crate::meshgen::{generate, key, node_name};

/// Where two compiles first differ (a node's file, the nodes, or the diagnostics), if they do
/// not give every node the same files, byte for byte.
fn difference(a: &Compiled, b: &Compiled) -> Option<String> {
    if !a.nodes.keys().eq(b.nodes.keys()) {
        return Some(format!("the nodes differ ({} and {})", a.nodes.len(), b.nodes.len()));
    }
    for ((name, oa), ob) in a.nodes.iter().zip(b.nodes.values()) {
        if let Some(f) = oa.files.iter().zip(&ob.files).find(|(x, y)| x != y).map(|(x, _)| &x.path) {
            return Some(format!("node {name}'s {f} differs"));
        }
        if oa.files.len() != ob.files.len() {
            return Some(format!("node {name} has other files"));
        }
    }
    (a.diagnostics != b.diagnostics).then(|| "the diagnostics differ".to_string())
}

/// A copy of `plan` whose lists have the room the plan's have: a clone's lists are exactly full,
/// and the first node added to one would be timed copying it to a larger one, which the plan
/// itself does not do.
fn own_copy(plan: &trellis_core::plan::NodePlan) -> trellis_core::plan::NodePlan {
    let mut copy = plan.clone();
    copy.peers.reserve_exact(plan.peers.capacity() - plan.peers.len());
    for (c, p) in copy.peers.iter_mut().zip(&plan.peers) {
        c.relays_for.reserve_exact(p.relays_for.capacity() - p.relays_for.len());
    }
    copy
}

pub fn run(args: &CompileArgs) -> Result<ExitCode> {
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
    let run = |decl: &Arc<Declaration>, keys: &Keys, prev: Option<Compiled>, addresses: &trellis_core::Allocation| {
        let (t, cpu) = (Instant::now(), cpu_time());
        let c = compile(decl, keys, addresses, prev).map_err(|d| anyhow::anyhow!("{d}"))?;
        Ok::<_, anyhow::Error>(((t.elapsed(), cpu_time() - cpu), c))
    };
    let mut times = Vec::new();
    let mut cpus = Vec::new();
    let mut last = None;
    for _ in 0..args.runs {
        // The compile before is dropped first: two of them at once would be the peak.
        drop(last.take());
        let ((took, cpu), c) = run(&decl, &keys, None, &Default::default())?;
        times.push(took);
        cpus.push(cpu);
        last = Some(c);
    }
    let base = last.expect("runs >= 1");
    // The peak of the full compiles (the base and the one before it dropped first), before the
    // changes' copies of the base add theirs.
    let peak = peak_rss_kib();
    let bytes: usize = base.nodes.values().flat_map(|o| o.files.iter()).map(|f| f.content.len()).sum();
    let zone_bytes: usize =
        base.nodes.values().flat_map(|o| o.files.iter()).filter(|f| trellis_core::plan::is_zone(&f.path)).map(|f| f.content.len()).sum();
    // The largest file of each kind, and whose it is: the files that grow with the mesh.
    let largest: Vec<(&str, usize, &str)> = [WIREGUARD_CONF, MESH_ZONE, NFTABLES_CONF]
        .into_iter()
        .map(|path| {
            // A node's WireGuard configuration is `wireguard.conf` and its parts (ADR 0039), its zone
            // `mesh.zone` and its parts (ADR 0043), its ruleset `nftables.conf` and its parts (ADR 0044).
            let of = move |f: &&trellis_core::plan::FileResource| {
                f.path == path
                    || (path == WIREGUARD_CONF && trellis_core::plan::is_wireguard(&f.path))
                    || (path == MESH_ZONE && trellis_core::plan::is_zone(&f.path))
                    || (path == NFTABLES_CONF && trellis_core::plan::is_ruleset(&f.path))
            };
            let sizes = base.nodes.iter().map(|(n, o)| (o.files.iter().filter(of).map(|f| f.content.len()).sum::<usize>(), n.as_str()));
            let (len, node) = sizes.max().unwrap_or((0, ""));
            (path.rsplit('/').next().unwrap_or(path), len, node)
        })
        .collect();
    let peers: usize = base.nodes.values().map(|o| o.plan.peers.len()).sum();
    // Direct paths as a publish run decides them after each compile, with no hub's
    // observations: every relayed pair is counted and stays on its hub.
    let decide = |c: &Compiled, k: &Keys, d: &Declaration, counts: &mut trellis_core::paths::PairCounts| {
        trellis_core::paths::decide(c, k, d, &Default::default(), &|_, _| Default::default(), &Default::default(), counts)
    };
    let t = Instant::now();
    let mut base_counts = trellis_core::paths::PairCounts::default();
    let decided = decide(&base, &keys, &decl, &mut base_counts);
    let decide_time = t.elapsed();
    let relayed_pairs = decided.relayed.others + decided.relayed.ranked.len();
    drop(decided);
    let max_peers = base.nodes.values().map(|o| o.plan.peers.len()).max().unwrap_or(0);

    // One-node changes, each from the base compile, each checked against a full compile.
    let mut rekeyed = keys.clone();
    rekeyed.set(&target, Some(PublicKey([0xee; 32])));
    let mut enrolled = keys.clone();
    enrolled.set(&late, Some(PublicKey([0xef; 32])));
    let mut moved = (*decl).clone();
    for grp in &mut moved.groups {
        let joins = (grp.name == "grp-1").then(|| target.clone());
        grp.members = grp.members.iter().filter(|m| **m != target).cloned().chain(joins).collect();
    }
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
    let joined = Arc::new(pooled.with_members(&[member]).into_owned());
    let mut member_keys = keys.clone();
    member_keys.set("pool-1", Some(PublicKey([0xf0; 32])));
    // The same, for a pool whose members' names sort among the declared nodes (`mid-1`, before
    // every `node-`): every later node's position in name order moves by one.
    let mut between = (*decl).clone();
    let mut pool = pooled.pools.last().expect("pushed above").clone();
    pool.name = "mid".into();
    between.pools.push(pool);
    let member = trellis_core::decl::Member { name: "mid-1".into(), pool: "mid".into(), address_ipv4: None, address_ipv6: None };
    let between = Arc::new(between.with_members(&[member]).into_owned());
    let mut between_keys = keys.clone();
    between_keys.set("mid-1", Some(PublicKey([0xf1; 32])));
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
        Case { what: "a member joins mid-mesh", key: "pool_member_joins_between", decl: &between, keys: &between_keys },
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
            // A copy of the base whose plans are its own: a controller's recompile holds the
            // only reference to each plan (a publish run lets go of those kept for status before
            // it compiles), so an edited plan is edited in place, not copied first (a copy of an
            // operator's plan of 100,000 peers is most of a re-key's time, and no part of it).
            let mut from = base.clone();
            for o in from.nodes.values_mut() {
                o.plan = Arc::new(own_copy(&o.plan));
            }
            // What the compile before rendered: a recompile lets go of that list first, and
            // after a full compile it names every node (100,000 names freed: 0.8 ms, paid once
            // after the full compile; a run that follows a recompile holds a few).
            from.rendered = Vec::new();
            let ((t, u), out) = run(d, k, Some(from), &Default::default())?;
            took.push(t);
            cpu.push(u);
            c = Some(out);
        }
        let c = c.expect("runs >= 1");
        // From nothing but the addresses held before (a node placed among others would else
        // take another's address: allocation is in name order).
        let (_, full) = run(d, k, None, &base.allocation)?;
        if let Some(difference) = difference(&c, &full) {
            bail!("{what}: the recompile differs from a full compile: {difference}");
        }
        // The direct paths decided after it, from the pairs counted after the base compile (a
        // publish run's counts), and as decided afresh.
        let mut counts = base_counts.clone();
        let t = Instant::now();
        let decided = decide(&c, k, d, &mut counts);
        let decided_in = t.elapsed();
        if decided != decide(&full, k, d, &mut Default::default()) {
            bail!("{what}: the direct paths decided after the recompile differ from those decided afresh");
        }
        figures.push((what, key, median(took), median(cpu), c.rendered.len(), decided_in));
    }

    if args.json {
        let changes: serde_json::Map<String, serde_json::Value> = figures
            .iter()
            .map(|(_, key, took, cpu, rendered, decided)| {
                (key.to_string(), json!({"ms": ms(*took), "cpu_ms": ms(*cpu), "rendered": rendered, "paths_decided_ms": ms(*decided), "equals_full_compile": true}))
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
                "paths_decided_ms": ms(decide_time), "relayed_pairs": relayed_pairs,
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
        println!("largest files (wireguard.conf with its parts): {}", largest.join(", "));
        println!("direct paths decided:        {:8.1} ms   {relayed_pairs} relayed pairs, none observed", ms(decide_time));
        for (what, _, took, cpu, rendered, decided) in &figures {
            println!(
                "{:<28} {:8.2} ms   cpu {:.2} ms; rendered {rendered} of {} nodes; equals a full compile; direct paths decided after it {:.2} ms",
                format!("{what}:"),
                ms(*took),
                ms(*cpu),
                a.nodes,
                ms(*decided)
            );
        }
        if let Some(p) = peak {
            println!("peak resident memory, full compiles: {:8.1} MiB", p as f64 / 1024.0);
        }
    }
    Ok(ExitCode::SUCCESS)
}
