//! A declaration directory on disk (`mesh.toml` and `modules/*.toml`) as the files `trellis
//! apply DIR` sends: each named relative to the directory, modules in name order.

use std::path::{Path, PathBuf};

/// Why a declaration directory cannot be read; the sentence names the path.
#[derive(Debug, thiserror::Error)]
pub enum DeclDirError {
    #[error("{} is not a directory; give the declaration directory that holds mesh.toml", .0.display())]
    NotADirectory(PathBuf),
    #[error("cannot {op} {}: {source}", path.display())]
    Io { op: &'static str, path: PathBuf, source: std::io::Error },
    #[error("{}: the file name is not UTF-8", .0.display())]
    NotUtf8Name(PathBuf),
}

/// `DIR/mesh.toml` and every `DIR/modules/*.toml`, in name order, each named relative to `DIR`.
pub fn declaration_files(dir: &Path) -> Result<Vec<(String, String)>, DeclDirError> {
    if !dir.is_dir() {
        return Err(DeclDirError::NotADirectory(dir.to_path_buf()));
    }
    let read = |p: &Path| std::fs::read_to_string(p).map_err(|source| DeclDirError::Io { op: "read", path: p.to_path_buf(), source });
    let mut files = vec![(trellis_core::load::MESH_FILE.to_string(), read(&dir.join(trellis_core::load::MESH_FILE))?)];
    let modules = dir.join("modules");
    let list = |source| DeclDirError::Io { op: "list", path: modules.clone(), source };
    let mut paths: Vec<PathBuf> = Vec::new();
    if modules.is_dir() {
        for entry in std::fs::read_dir(&modules).map_err(list)? {
            let path = entry.map_err(list)?.path();
            if path.extension().is_some_and(|e| e == "toml") {
                paths.push(path);
            }
        }
    }
    paths.sort();
    for p in paths {
        let name = p.file_name().and_then(|n| n.to_str()).ok_or_else(|| DeclDirError::NotUtf8Name(p.clone()))?;
        files.push((format!("modules/{name}"), read(&p)?));
    }
    Ok(files)
}
