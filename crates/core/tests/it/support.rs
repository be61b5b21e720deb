//! Helpers shared by the core's integration tests.

use std::path::{Path, PathBuf};

use trellis_core::{load, Compiled, Declaration, Loaded, SourceFile};

pub fn source(path: &str, text: &str) -> SourceFile {
    SourceFile { path: path.to_string(), text: text.to_string() }
}

/// Loads a mesh given as text, with modules as (file name, text).
pub fn load_text(mesh: &str, modules: &[(&str, &str)]) -> Loaded {
    let modules: Vec<SourceFile> = modules.iter().map(|(p, t)| source(&format!("modules/{p}"), t)).collect();
    load(&source("mesh.toml", mesh), &modules)
}

pub fn valid(mesh: &str, modules: &[(&str, &str)]) -> Declaration {
    let loaded = load_text(mesh, modules);
    match loaded.declaration {
        Some(d) => d,
        None => panic!("declaration should be valid, got:\n{}", lines(&loaded.diagnostics)),
    }
}

pub fn lines(diags: &[trellis_core::Diagnostic]) -> String {
    diags.iter().map(|d| format!("{d}\n")).collect()
}

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// Loads a fixture directory the way the CLI does, naming files relative to the fixture.
pub fn fixture(name: &str) -> Declaration {
    let dir = fixture_dir(name);
    let read = |p: &Path, shown: String| source(&shown, &std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())));
    let mesh = read(&dir.join("mesh.toml"), "mesh.toml".into());
    let mut paths: Vec<PathBuf> = std::fs::read_dir(dir.join("modules")).unwrap().map(|e| e.unwrap().path()).collect();
    paths.sort();
    let modules: Vec<SourceFile> = paths.iter().map(|p| read(p, format!("modules/{}", p.file_name().unwrap().to_str().unwrap()))).collect();
    let loaded = load(&mesh, &modules);
    loaded.declaration.unwrap_or_else(|| panic!("fixture {name} is invalid:\n{}", lines(&loaded.diagnostics)))
}

pub fn compile_all(decl: &Declaration) -> Compiled {
    trellis_core::compile(&std::sync::Arc::new(decl.clone()), &Default::default(), &Default::default(), None).expect("compiles")
}

/// The source addresses a filter line of a rendered `nftables.conf` matches: the elements of the
/// named set it names (`saddr @NAME`, declared in the same file), or of its anonymous set.
pub fn saddrs(nft: &str, line: &str) -> Vec<String> {
    if let Some(name) = line.split("saddr @").nth(1).and_then(|r| r.split(' ').next()) {
        let decl = format!("\tset {name} {{");
        let mut lines = nft.lines().skip_while(|l| *l != decl);
        assert!(lines.next().is_some(), "the set {name} is not declared:\n{nft}");
        return lines
            .take_while(|l| *l != "\t}")
            .find_map(|l| l.trim().strip_prefix("elements = { "))
            .and_then(|e| e.strip_suffix(" }"))
            .map(|e| e.split(", ").map(str::to_string).collect())
            .unwrap_or_default();
    }
    line.split("saddr { ")
        .nth(1)
        .and_then(|r| r.split(" }").next())
        .map(|e| e.split(", ").map(str::to_string).collect())
        .unwrap_or_default()
}
