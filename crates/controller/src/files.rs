//! Writing secrets and state files: created with their final mode before any byte is written,
//! fsynced, and renamed into place so a crash leaves the old file or the new one.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use anyhow::{Context, Result};

/// Creates `path` (which must not exist) with `mode` and writes `content`.
pub fn create_new(path: &Path, content: &[u8], mode: u32) -> Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(content).with_context(|| format!("cannot write {}", path.display()))?;
    f.sync_all().with_context(|| format!("cannot sync {}", path.display()))?;
    Ok(())
}

/// Replaces `path` atomically with `content`, with `mode` from the start.
pub fn replace(path: &Path, content: &[u8], mode: u32) -> Result<()> {
    let dir = path.parent().context("path has no parent directory")?;
    let tmp = dir.join(format!(".{}.{}.tmp", path.file_name().and_then(|n| n.to_str()).unwrap_or("file"), std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    create_new(&tmp, content, mode)?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

pub fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
}
