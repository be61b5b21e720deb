//! The agent's one way to write a file atomically: staged beside its target (created with its
//! final mode before any byte is written, written, synced), then renamed into place and the
//! directory synced. A crash leaves the old file or the new one, never a mix.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Where `target` is staged before it is committed.
fn stage_path(target: &Path) -> PathBuf {
    let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    target.with_file_name(format!(".{name}.trellis-new"))
}

/// Writes `content` to a staging file beside `target` with `mode`, synced; returns its path.
/// Nothing is visible at `target` until [`commit`].
pub fn stage(target: &Path, content: &[u8], mode: u32) -> Result<PathBuf> {
    let tmp = stage_path(target);
    let _ = std::fs::remove_file(&tmp);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    out.write_all(content).with_context(|| format!("cannot write {}", tmp.display()))?;
    out.sync_all().with_context(|| format!("cannot sync {}", tmp.display()))?;
    Ok(tmp)
}

/// Renames a staged file over its target.
pub fn commit(tmp: &Path, target: &Path) -> Result<()> {
    std::fs::rename(tmp, target).with_context(|| format!("cannot rename {} to {}", tmp.display(), target.display()))
}

/// Syncs a directory so that the renames in it survive a crash; best effort.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes one file atomically with `mode` (the directory must exist).
pub fn write(path: &Path, content: &[u8], mode: u32) -> Result<()> {
    let dir = path.parent().with_context(|| format!("{} has no directory", path.display()))?;
    let tmp = stage(path, content, mode)?;
    commit(&tmp, path)?;
    sync_dir(dir);
    Ok(())
}
