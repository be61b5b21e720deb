//! Reading a declaration directory (`mesh.toml` and `modules/*.toml`) from disk.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use trellis_core::{load, Loaded, SourceFile};

/// Reads `DIR/mesh.toml` and every `DIR/modules/*.toml`, in name order, and loads them.
pub fn read(dir: &Path) -> Result<Loaded> {
    let mesh_path = dir.join("mesh.toml");
    if !dir.is_dir() {
        bail!("{} is not a directory; give the declaration directory that holds mesh.toml", dir.display());
    }
    let mesh = read_file(&mesh_path)?;
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
    let modules = paths.iter().map(|p| read_file(p)).collect::<Result<Vec<_>>>()?;
    Ok(load(&mesh, &modules))
}

fn read_file(path: &Path) -> Result<SourceFile> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(SourceFile { path: path.display().to_string(), text })
}
