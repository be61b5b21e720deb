//! `trellis-dev bench apply`: what one `trellis apply` of a one-node group move costs on a real
//! declaration directory. The request is timed end to end against a controller served in this
//! process (the declaration sent, checked, allocated and stored, as `trellis apply` does it),
//! and the stages the controller runs before it stores are timed offline on the same files, so
//! that the figure says where the time goes.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::json;

use crate::args::ApplyArgs;
use crate::figures::{database_name, median, ms};
use crate::meshdir::MeshDir;

/// The target of issue 35 for one group move at 100,000 nodes.
const TARGET: Duration = Duration::from_millis(300);

/// A node that is in some group and a group it is not in, hubs aside (a hub's group move changes
/// every bundle; an operator moves a workload): the first such pair in declaration order.
fn choose_move(mesh: &MeshDir) -> Result<(String, String, String)> {
    let decl = &mesh.decl;
    let hubs: std::collections::HashSet<&str> = decl.nodes.iter().filter(|n| n.hub).map(|n| n.name.as_str()).collect();
    for from in &decl.groups {
        for node in from.members.iter().filter(|m| !hubs.contains(m.as_str())) {
            if let Some(to) = decl.groups.iter().find(|g| g.name != from.name && !g.members.contains(node)) {
                return Ok((node.clone(), from.name.clone(), to.name.clone()));
            }
        }
    }
    bail!("{}: no node in a group that could move to another group (the mesh needs two groups)", mesh.dir.display())
}

/// The median of `runs` timings of `f`; what it returns is dropped after the clock stops.
fn timed<T>(runs: usize, mut f: impl FnMut() -> T) -> Duration {
    median(
        (0..runs)
            .map(|_| {
                let t = Instant::now();
                let out = std::hint::black_box(f());
                let took = t.elapsed();
                drop(out);
                took
            })
            .collect(),
    )
}

pub async fn run(a: &ApplyArgs) -> Result<ExitCode> {
    if a.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let mesh = MeshDir::read(&a.mesh)?;
    let (node, from, to) = choose_move(&mesh)?;
    let moved = mesh.move_node(&node, &from, &to)?;
    let nodes = mesh.decl.nodes.len();
    let bytes: usize = moved.files.iter().map(|(_, t)| t.len()).sum();
    eprintln!(
        "{}: {nodes} nodes, {:.1} MiB of declaration; the change: {node} moved from group {from} to {to}",
        a.mesh.display(),
        bytes as f64 / (1 << 20) as f64
    );

    // The stages before the store, offline, on the files of the change.
    eprintln!("timing the stages offline ({} runs each)...", a.runs);
    // Loaded as the controller loads: through a cache that holds the mesh before the move.
    let mut cache = trellis_core::load::LoadCache::default();
    trellis_core::load::load_relative_cached(&mesh.files, str::to_string, &mut cache);
    let mut loads = Vec::new();
    // The last two declarations loaded (the mesh and the move, sharing their unchanged nodes as
    // the controller's are), for the check by difference below.
    let mut loaded: Vec<std::sync::Arc<trellis_core::Declaration>> = Vec::new();
    for i in 0..2 * a.runs {
        let change = if i % 2 == 0 { &moved } else { &mesh };
        let t = Instant::now();
        let out = std::hint::black_box(trellis_core::load::load_relative_cached(&change.files, str::to_string, &mut cache));
        loads.push(t.elapsed());
        loaded.push(std::sync::Arc::new(out.declaration.with_context(|| format!("{}: the declaration does not load", a.mesh.display()))?));
        if loaded.len() > 2 {
            loaded.remove(0);
        }
    }
    let load = median(loads);
    let (hits, parsed) = (cache.hits, cache.parsed);
    eprintln!("  the load cache: {hits} node tables taken, {parsed} parsed, {} whole-file parses", cache.whole);
    drop(cache);
    let whole_load = timed(a.runs, || trellis_core::load::load_relative(&moved.files, str::to_string));
    let previous = trellis_core::allocate(&mesh.decl, &Default::default()).map_err(|d| anyhow::anyhow!("{d}"))?;
    let allocate = timed(a.runs, || trellis_core::allocate(&moved.decl, &previous));
    // A move keeps every node's name and pins: the controller keeps the allocation held instead
    // of making it again (ADR 0034), so it is not part of the request's time.
    let kept = trellis_core::alloc::same_addressing(&mesh.decl, &moved.decl);
    let in_request = if kept { Duration::ZERO } else { allocate };
    // Checked as the controller checks: with the addresses it allocated.
    let placed = trellis_core::allocate(&moved.decl, &previous).map_err(|d| anyhow::anyhow!("{d}"))?;
    let check = timed(a.runs, || trellis_core::explain::check_allocated(&moved.decl, &placed));
    // As the controller checks: from what the check of the declaration before held (the move and
    // back, in turn), the allocation kept when the move keeps it.
    let (_, mut held) = trellis_core::explain::check_after(&loaded[0], &placed, None);
    let mut checks_after = Vec::new();
    for i in 0..2 * a.runs {
        let decl = &loaded[(i + 1) % 2];
        let t = Instant::now();
        let (out, next) = trellis_core::explain::check_after(decl, &placed, Some((&held, kept)));
        checks_after.push(t.elapsed());
        drop(std::hint::black_box(out));
        held = next;
    }
    let check_after = median(checks_after);

    // The request against a controller in this process, each after the publish run of the one
    // before has finished (so that a request is not timed sharing the cores with it).
    let (dir, _addr, stop) = crate::enrolling::serve_in_process("apply", a.database_url.clone()).await?;
    let admin = crate::admin_client(&dir)?;
    let t = Instant::now();
    admin.apply(&mesh.request()).await.with_context(|| format!("cannot apply {}", a.mesh.display()))?;
    let first = t.elapsed();
    crate::fleet::settled(&admin).await?;
    eprintln!("first apply {:.0} ms; timing {} applies of the move and back...", ms(first), 2 * a.runs);
    let mut applies = Vec::new();
    for i in 0..2 * a.runs {
        let change = if i % 2 == 0 { &moved } else { &mesh };
        let t = Instant::now();
        let answer = admin.apply(&change.request()).await?;
        applies.push(t.elapsed());
        if answer.unchanged {
            bail!("the controller answered the move as unchanged: the bench would time nothing");
        }
        crate::fleet::settled(&admin).await?;
    }
    let _ = stop.send(());
    let _ = std::fs::remove_dir_all(&dir);
    let apply = median(applies);
    let rest = apply.saturating_sub(load + check_after + in_request);
    let met = apply <= TARGET;
    let db = database_name(a.database_url.as_deref());
    if a.json {
        let v = json!({
            "nodes": nodes, "declaration_bytes": bytes, "database": db, "change": format!("{node} moved from group {from} to {to}"),
            "first_apply_ms": ms(first), "apply_ms": ms(apply), "target_ms": ms(TARGET), "met": met,
            "stages_ms": {"load": ms(load), "check": ms(check_after), "allocate": ms(in_request), "rest": ms(rest)},
            "check_whole_ms": ms(check),
            "allocate_again_ms": ms(allocate), "allocation_kept": kept,
            "whole_load_ms": ms(whole_load),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        println!("trellis apply of one group move, {nodes} nodes, {db}:");
        println!(
            "  request, median of {}: {:.0} ms  (target {:.0} ms: {})",
            2 * a.runs,
            ms(apply),
            ms(TARGET),
            if met { "met" } else { "not met" }
        );
        println!(
            "  of it: load {:.0} ms, check {:.0} ms (from the check before; {:.0} ms made whole), allocate {}, the rest (request, store, index) {:.0} ms",
            ms(load),
            ms(check_after),
            ms(check),
            if kept {
                format!("0 ms (the allocation held is kept; {:.0} ms made again)", ms(allocate))
            } else {
                format!("{:.0} ms", ms(allocate))
            },
            ms(rest)
        );
        println!(
            "  the first apply (every node new): {:.0} ms; a load parsing every node table again: {:.0} ms",
            ms(first),
            ms(whole_load)
        );
    }
    Ok(ExitCode::SUCCESS)
}
