//! Reading a declaration directory (`mesh.toml` and `modules/*.toml`) from disk: the files as
//! they are sent to the controller, and loaded as `check` loads them.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use trellis_core::Loaded;

/// `DIR/mesh.toml` and every `DIR/modules/*.toml`, in name order, each named relative to `DIR`.
pub fn files(dir: &Path) -> Result<Vec<(String, String)>> {
    if !dir.is_dir() {
        bail!("{} is not a directory; give the declaration directory that holds mesh.toml", dir.display());
    }
    let mut files = vec![(trellis_core::load::MESH_FILE.to_string(), read_file(&dir.join(trellis_core::load::MESH_FILE))?)];
    let modules_dir = dir.join("modules");
    let mut paths: Vec<PathBuf> = Vec::new();
    if modules_dir.is_dir() {
        for entry in std::fs::read_dir(&modules_dir).with_context(|| format!("cannot list {}", modules_dir.display()))? {
            let path = entry.with_context(|| format!("cannot list {}", modules_dir.display()))?.path();
            if path.extension().is_some_and(|e| e == "toml") {
                paths.push(path);
            }
        }
    }
    paths.sort();
    for p in paths {
        let name = p.file_name().and_then(|n| n.to_str()).with_context(|| format!("{}: the file name is not UTF-8", p.display()))?;
        files.push((format!("modules/{name}"), read_file(&p)?));
    }
    Ok(files)
}

/// Reads and loads a declaration directory; diagnostics name the files under `dir`.
pub fn read(dir: &Path) -> Result<Loaded> {
    let files = files(dir)?;
    Ok(trellis_core::load_relative(&files, |p| dir.join(p).display().to_string()))
}

fn read_file(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}
