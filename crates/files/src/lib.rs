//! Writing the files that hold keys and state, shared by the controller and the agent: each is
//! created with its final mode before any byte is written, fsynced, and renamed into place, so a
//! crash leaves the old file or the new one, never half of either. Also the one Unix clock read
//! of the edges (the pure core takes time as a parameter).

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// A file operation that failed, with the path it failed on.
#[derive(Debug, thiserror::Error)]
#[error("cannot {op} {}: {source}", path.display())]
pub struct FileError {
    pub op: &'static str,
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

fn at<'p>(op: &'static str, path: &'p Path) -> impl FnOnce(std::io::Error) -> FileError + 'p {
    move |source| FileError { op, path: path.to_path_buf(), source }
}

/// Creates `path`, which must not exist, with `mode`, and writes and syncs `content`.
pub fn create_new(path: &Path, content: &[u8], mode: u32) -> Result<(), FileError> {
    let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(path).map_err(at("create", path))?;
    f.write_all(content).map_err(at("write", path))?;
    f.sync_all().map_err(at("sync", path))
}

/// Where `target` is staged before it is committed: beside it, so the rename stays on one
/// filesystem.
fn stage_path(target: &Path) -> PathBuf {
    let name = target.file_name().and_then(|n| n.to_str()).unwrap_or("file");
    target.with_file_name(format!(".{name}.trellis-new"))
}

/// Writes `content` to a staging file beside `target`, created with `mode`, and syncs it;
/// returns its path. Nothing is visible at `target` until [`commit`], so several files can be
/// staged before any of them is committed.
pub fn stage(target: &Path, content: &[u8], mode: u32) -> Result<PathBuf, FileError> {
    let tmp = stage_path(target);
    let _ = std::fs::remove_file(&tmp);
    create_new(&tmp, content, mode)?;
    Ok(tmp)
}

/// Renames a staged file over its target.
pub fn commit(staged: &Path, target: &Path) -> Result<(), FileError> {
    std::fs::rename(staged, target).map_err(at("rename a staged file onto", target))
}

/// Replaces `path` atomically with `content`, with `mode` from the first byte: staged, committed,
/// and the directory synced.
pub fn replace(path: &Path, content: &[u8], mode: u32) -> Result<(), FileError> {
    let tmp = stage(path, content, mode)?;
    commit(&tmp, path)?;
    sync_dir(path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new(".")));
    Ok(())
}

/// Syncs a directory so that renames in it survive a crash; best effort.
pub fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Reads a text file, naming it when that fails.
pub fn read(path: &Path) -> Result<String, FileError> {
    std::fs::read_to_string(path).map_err(at("read", path))
}

/// The current Unix time in seconds.
pub fn unix_now() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::*;

    #[test]
    fn replace_keeps_the_mode_from_the_first_byte_and_leaves_no_temporary_file() {
        let dir = std::env::temp_dir().join(format!("trellis-files-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("key");
        replace(&path, b"one", 0o600).unwrap();
        replace(&path, b"two", 0o600).unwrap();
        assert_eq!(read(&path).unwrap(), "two");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["key"], "no temporary file is left behind");
        let e = create_new(&path, b"three", 0o600).unwrap_err();
        assert!(e.to_string().starts_with(&format!("cannot create {}", path.display())), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
