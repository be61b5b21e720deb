//! The offline commands: `check`, `compile`, `explain` and `graph` over a declaration directory.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use serde_json::json;
use trellis_core::explain;
use trellis_core::topology::Topology;
use trellis_core::{compile as core_compile, Checked, Declaration, Diagnostic, Loaded};
use trellis_proto::text::printable;

use crate::declfs;

fn diag_json(d: &Diagnostic) -> serde_json::Value {
    json!({
        "severity": d.severity.as_str(),
        "file": &*d.loc.file,
        "line": d.loc.line,
        "column": d.loc.col,
        "message": d.message,
    })
}

/// Prints diagnostics one a line. They quote declaration text (names, strings, file names), so
/// each passes through `printable`: a control character in a declaration cannot rewrite the
/// terminal or forge a line.
fn print_diagnostics(diags: &[Diagnostic]) {
    let mut err = std::io::stderr().lock();
    for d in diags {
        let _ = writeln!(err, "{}", printable(&d.to_string()));
    }
}

/// Loads a directory, failing with every error printed when it does not validate.
fn load_valid(dir: &Path) -> Result<(Declaration, Vec<Diagnostic>)> {
    let Loaded { declaration, diagnostics } = declfs::read(dir)?;
    match declaration {
        Some(d) => Ok((d, diagnostics)),
        None => {
            print_diagnostics(&diagnostics);
            let n = diagnostics.iter().filter(|d| d.is_error()).count();
            bail!("{} is not a valid declaration: {n} error(s); run `trellis check {}` for the full list", dir.display(), dir.display())
        }
    }
}

pub fn check(dir: &Path, json_out: bool) -> Result<ExitCode> {
    let checked = declfs::check(dir)?;
    let errors = checked.errors();
    let Checked { declaration, diagnostics } = checked;
    let warnings = diagnostics.len() - errors;
    if json_out {
        let summary = declaration.as_ref().map(|d| {
            json!({
                "mesh": d.mesh.name, "nodes": d.nodes.len(), "modules": d.modules.len(), "tests": d.tests.len(), "pools": d.pools.len(),
            })
        });
        let doc = json!({
            "valid": errors == 0,
            "errors": errors,
            "warnings": warnings,
            "declaration": summary,
            "diagnostics": diagnostics.iter().map(diag_json).collect::<Vec<_>>(),
        });
        println!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_diagnostics(&diagnostics);
        match (&declaration, errors) {
            (Some(d), 0) => println!(
                "{}: mesh {} is valid: {} nodes, {}{} modules, {} policy tests passed{}",
                printable(&dir.display().to_string()),
                printable(&d.mesh.name),
                d.nodes.len(),
                match d.pools.len() {
                    0 => String::new(),
                    n => format!("{n} pool(s) of up to {} members, ", d.pools.iter().map(|p| p.size as u64).sum::<u64>()),
                },
                d.modules.len(),
                d.tests.len(),
                if warnings > 0 { format!(", {warnings} warning(s)") } else { String::new() }
            ),
            _ => eprintln!("{}: {errors} error(s), {warnings} warning(s)", printable(&dir.display().to_string())),
        }
    }
    Ok(if errors == 0 { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

fn check_errors(decl: &Declaration) -> Result<()> {
    let diags: Vec<Diagnostic> = explain::check(decl).into_iter().filter(|d| d.is_error()).collect();
    if !diags.is_empty() {
        print_diagnostics(&diags);
        bail!("the declaration does not pass `trellis check`: {} error(s)", diags.len());
    }
    Ok(())
}

pub fn compile(dir: &Path, node: Option<&str>, out: &Path, json_out: bool) -> Result<ExitCode> {
    let (decl, _) = load_valid(dir)?;
    check_errors(&decl)?;
    if let Some(n) = node {
        if decl.node(n).is_none() {
            let mut names: Vec<&str> = decl.nodes.iter().map(|n| n.name.as_str()).collect();
            names.sort_unstable();
            bail!("node `{n}` is not declared in {} (declared: {})", dir.display(), names.join(", "));
        }
    }
    let compiled = core_compile(&std::sync::Arc::new(decl.clone()), &Default::default(), &Default::default(), None)
        .map_err(|d| anyhow::anyhow!("{d}"))?;
    print_diagnostics(&compiled.diagnostics);
    // Nodes are written in parallel (the work is system calls); each file is staged, synced and
    // renamed into place, and each node's directory synced once after its files.
    let targets: Vec<(&String, &trellis_core::compile::NodeOutput)> =
        compiled.nodes.iter().filter(|(name, _)| node.is_none_or(|n| n == name.as_str())).collect();
    let write_node = |name: &str, output: &trellis_core::compile::NodeOutput| -> Result<(usize, Vec<serde_json::Value>)> {
        let base = if node.is_some() { out.to_path_buf() } else { out.join(name) };
        let mut written = Vec::new();
        let mut staged = Vec::with_capacity(output.files.len());
        let mut dirs: Vec<std::path::PathBuf> = Vec::new();
        for f in &output.files {
            let path = base.join(&f.path);
            let dir = path.parent().context("file path has no parent")?;
            if !dirs.iter().any(|d| d == dir) {
                std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
                dirs.push(dir.to_path_buf());
            }
            staged.push((trellis_files::stage(&path, &f.content.to_bytes(), f.mode)?, path.clone()));
            if json_out {
                written.push(
                    json!({"node": name, "path": path.display().to_string(), "mode": format!("{:o}", f.mode), "bytes": f.content.len()}),
                );
            }
        }
        for (tmp, path) in &staged {
            trellis_files::commit(tmp, path)?;
        }
        dirs.iter().for_each(|d| trellis_files::sync_dir(d));
        Ok((staged.len(), written))
    };
    let parts = trellis_core::par::map(targets.len(), |i| write_node(targets[i].0, targets[i].1));
    let (mut files, mut written) = (0, Vec::new());
    for part in parts {
        let (count, json) = part?;
        files += count;
        written.extend(json);
    }
    if json_out {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"written": written, "diagnostics": compiled.diagnostics.iter().map(diag_json).collect::<Vec<_>>()})
            )?
        );
    } else {
        let nodes = if node.is_some() { 1 } else { compiled.nodes.len() };
        println!("wrote {files} files for {nodes} node(s) under {}", out.display());
    }
    Ok(ExitCode::SUCCESS)
}

pub fn explain(dir: &Path, from: &str, to: Option<&str>, json_out: bool) -> Result<ExitCode> {
    let (decl, _) = load_valid(dir)?;
    if let Some(name) = from.strip_prefix("expose:") {
        if let Some(to) = to {
            bail!("`explain DIR expose:{name}` takes no second argument (found {to:?})");
        }
        let alloc = trellis_core::allocate(&decl, &Default::default()).map_err(|d| anyhow::anyhow!("{d}"))?;
        let topo = Topology::new(&decl, &alloc, &trellis_core::Keys::default());
        let Some(text) = explain::explain_exposure(&topo, name) else {
            let names: Vec<&str> = decl.exposures.iter().map(|e| e.name.as_str()).collect();
            let declared = if names.is_empty() { "none are declared".to_string() } else { format!("declared: {}", names.join(", ")) };
            bail!("no exposure `{name}` is declared in {} ({declared})", dir.display());
        };
        if json_out {
            println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "from": from, "text": text }))?);
        } else {
            print!("{text}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    let Some(to) = to else {
        bail!("`explain DIR FROM TO` needs a second node, `route:NAME` or an address (only `expose:NAME` stands alone)")
    };
    // A route, or an address beyond the overlay: which router, which rule, what the filter does.
    if decl.node(to).is_none()
        && (to.starts_with("route:") || to.parse::<std::net::IpAddr>().is_ok() || to.parse::<std::net::SocketAddr>().is_ok())
    {
        if decl.node(from).is_none() {
            bail!("node `{from}` is not declared in {}", dir.display());
        }
        let alloc = trellis_core::allocate(&decl, &Default::default()).map_err(|d| anyhow::anyhow!("{d}"))?;
        let topo = Topology::new(&decl, &alloc, &trellis_core::Keys::default());
        let text = explain::explain_route(&topo, from, to).context("the node is declared")?.map_err(|e| anyhow::anyhow!("{e}"))?;
        if json_out {
            println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "from": from, "to": to, "text": text }))?);
        } else {
            print!("{text}");
        }
        return Ok(ExitCode::SUCCESS);
    }
    for n in [from, to] {
        if decl.node(n).is_none() {
            bail!("node `{n}` is not declared in {}", dir.display());
        }
    }
    let alloc = trellis_core::allocate(&decl, &Default::default()).map_err(|d| anyhow::anyhow!("{d}"))?;
    let topo = Topology::new(&decl, &alloc, &trellis_core::Keys::default());
    let e = explain::explain(&topo, from, to).context("nodes are declared")?;
    if json_out {
        // The shape `GET /v1/admin/explain` answers, text included.
        println!("{}", serde_json::to_string_pretty(&trellis_controller::view::explanation(&e))?);
    } else {
        print!("{}", e.to_text());
    }
    Ok(ExitCode::SUCCESS)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum GraphFormat {
    /// Graphviz DOT, with positions (render with `neato -n2 -Tpng`)
    Dot,
    /// SVG, drawn by trellis
    Svg,
}

/// Draws the declared mesh: every node, direct peerings, pairs relayed through a hub, pairs with
/// no path. To standard output, or to `out`.
pub fn graph(dir: &Path, format: GraphFormat, out: Option<&Path>) -> Result<ExitCode> {
    let (decl, _) = load_valid(dir)?;
    let alloc = trellis_core::allocate(&decl, &Default::default()).map_err(|d| anyhow::anyhow!("{d}"))?;
    let topo = Topology::new(&decl, &alloc, &trellis_core::Keys::default());
    let g = trellis_core::graph::graph(&topo);
    let states = Default::default();
    let text = match format {
        GraphFormat::Dot => trellis_core::graph::dot(&g, &states),
        GraphFormat::Svg => trellis_core::graph::svg(&g, &states),
    };
    match out {
        Some(path) => std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(ExitCode::SUCCESS)
}
