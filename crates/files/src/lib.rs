//! Writing the files that hold keys and state, shared by the controller and the agent: each is
//! created with its final mode before any byte is written, fsynced, and renamed into place, so a
//! crash leaves the old file or the new one, never half of either. Also the one Unix clock read
//! of the edges (the pure core takes time as a parameter).

pub mod beneath;

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

/// Where [`stage`] stages a file: beside its target (one file system, so the rename is atomic),
/// under a name of its own for this call: the process, a count of its calls and a random part,
/// so that two writers of one file (two tasks of a controller, or controllers in containers that
/// share a state directory and may have the same process id) never take each other's staging
/// file: each renames its own, and the last rename wins whole.
fn stage_path(target: &Path) -> PathBuf {
    use std::hash::BuildHasher;
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nonce = std::hash::RandomState::new().hash_one(call);
    let name = staging_name(target.file_name().and_then(|n| n.to_str()).unwrap_or("file"));
    target.with_file_name(format!("{name}.{}.{call}.{nonce:016x}", std::process::id()))
}

/// The name a file is staged under, beside the file named `name` (with a suffix of its own, for
/// [`stage`]).
fn staging_name(name: &str) -> String {
    format!(".{name}.trellis-new")
}

/// How old a staging file of [`stage`]'s must be to be taken for one left by a writer that
/// stopped before its commit, and removed.
const STALE_SECS: u64 = 3600;

/// Removes the staging files of `target` left an hour or more ago: a writer stopped between its
/// stage and its commit (a crash) left them, under a name nobody will use again.
fn sweep(target: &Path) {
    let Some(name) = target.file_name().and_then(|n| n.to_str()) else { return };
    let prefix = staging_name(name);
    let dir = target.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let left =
            e.file_name().to_str().is_some_and(|n| n.strip_prefix(&prefix).is_some_and(|rest| rest.is_empty() || rest.starts_with('.')));
        let old =
            e.metadata().ok().and_then(|m| m.modified().ok()).and_then(|t| t.elapsed().ok()).is_some_and(|a| a.as_secs() >= STALE_SECS);
        if left && old {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// Writes `content` to a staging file beside `target`, created with `mode`, and syncs it;
/// returns its path. Nothing is visible at `target` until [`commit`], so several files can be
/// staged before any of them is committed. Staging files of `target` left by a crash an hour or
/// more ago are removed first.
pub fn stage(target: &Path, content: &[u8], mode: u32) -> Result<PathBuf, FileError> {
    sweep(target);
    let tmp = stage_path(target);
    if let Err(e) = create_new(&tmp, content, mode) {
        // A full disk or a failed sync leaves no staging file behind; a name taken (never by
        // this call's own) is another writer's, and left to it.
        if e.source.kind() != std::io::ErrorKind::AlreadyExists {
            let _ = std::fs::remove_file(&tmp);
        }
        return Err(e);
    }
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

/// A directory that may hold keys: private to its owner.
#[derive(Debug, thiserror::Error)]
pub enum DirError {
    #[error("{} is not a directory", .0.display())]
    NotADirectory(PathBuf),
    #[error(
        "{} is open to others (mode {mode:o}) and would hold private keys; give a new directory, or make it private first (chmod 700)",
        path.display()
    )]
    NotPrivate { path: PathBuf, mode: u32 },
    #[error(transparent)]
    File(#[from] FileError),
}

/// Makes sure `dir` is private: a missing one is created with mode 0700 (its missing parents
/// with the usual mode); an existing one must already grant nothing to group and others, and is
/// refused otherwise, never changed (a shared directory such as /tmp must keep its mode).
/// Returns whether it was created.
pub fn private_dir(dir: &Path) -> Result<bool, DirError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    match std::fs::metadata(dir) {
        Ok(m) if !m.is_dir() => Err(DirError::NotADirectory(dir.to_path_buf())),
        Ok(m) if m.permissions().mode() & 0o077 != 0 => {
            Err(DirError::NotPrivate { path: dir.to_path_buf(), mode: m.permissions().mode() & 0o7777 })
        }
        Ok(_) => Ok(false),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent).map_err(at("create", parent))?;
            }
            std::fs::DirBuilder::new().mode(0o700).create(dir).map_err(at("create", dir))?;
            Ok(true)
        }
        Err(e) => Err(FileError { op: "inspect", path: dir.to_path_buf(), source: e }.into()),
    }
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
        let dir = trellis_testing::TempDir::new("files");
        let path = dir.join("key");
        replace(&path, b"one", 0o600).unwrap();
        replace(&path, b"two", 0o600).unwrap();
        assert_eq!(read(&path).unwrap(), "two");
        assert_eq!(std::fs::metadata(&path).unwrap().permissions().mode() & 0o777, 0o600);
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["key"], "no temporary file is left behind");
        let e = create_new(&path, b"three", 0o600).unwrap_err();
        assert!(e.to_string().starts_with(&format!("cannot create {}", path.display())), "{e}");
        // A staging file left by a write that stopped before its commit (open to all, other
        // bytes) is never written into: the next stage is a file of its own, with its mode. One
        // left an hour ago or more is removed; a recent one (perhaps another writer's) is not.
        let recent = dir.join(format!("{}.1.2.3", staging_name("key")));
        let stale = dir.join(format!("{}.4.5.6", staging_name("key")));
        for f in [&recent, &stale] {
            std::fs::write(f, b"stale and longer").unwrap();
            std::fs::set_permissions(f, std::fs::Permissions::from_mode(0o666)).unwrap();
        }
        let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(STALE_SECS + 5);
        std::fs::File::options().write(true).open(&stale).unwrap().set_modified(hour_ago).unwrap();
        let other = dir.join(format!("{}.1.2.3", staging_name("keyring")));
        std::fs::write(&other, b"not key's").unwrap();
        std::fs::File::options().write(true).open(&other).unwrap().set_modified(hour_ago).unwrap();
        let staged = stage(&path, b"four", 0o600).unwrap();
        assert!(staged != recent && staged != stale);
        assert_eq!(std::fs::metadata(&staged).unwrap().permissions().mode() & 0o777, 0o600);
        commit(&staged, &path).unwrap();
        assert_eq!(read(&path).unwrap(), "four");
        assert_eq!(std::fs::read(&recent).unwrap(), b"stale and longer", "a recent one is left");
        assert!(!stale.exists(), "one an hour old is removed");
        assert!(other.exists(), "another file's is not this file's to remove");
    }

    /// The flake of 2026-12-06 (a first apply answered 500, "writing the state directory
    /// failed"): two tasks of a controller replaced one file at once, and with one staging name
    /// for both, one removed or renamed the other's staging file, which then failed. Two writers
    /// of one file, many times over: every replace succeeds, the file is one of theirs, whole,
    /// and no staging file is left.
    #[test]
    fn two_writers_of_one_file_both_succeed_and_leave_one_whole() {
        let dir = trellis_testing::TempDir::new("files-race");
        let path = dir.join("services-ca.pem");
        let contents: [Vec<u8>; 2] = [vec![b'a'; 64 * 1024], vec![b'b'; 48 * 1024]];
        std::thread::scope(|s| {
            for c in &contents {
                let path = &path;
                s.spawn(move || {
                    for i in 0..200 {
                        replace(path, c, 0o644).unwrap_or_else(|e| panic!("replace {i}: {e}"));
                    }
                });
            }
        });
        let held = std::fs::read(&path).unwrap();
        assert!(contents.contains(&held), "the file is one writer's content, whole");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["services-ca.pem"], "no staging file is left");
    }

    #[test]
    fn a_private_directory_is_made_private_and_an_open_one_is_refused_unchanged() {
        let base = trellis_testing::TempDir::new("private");
        let made = base.join("a/b");
        assert!(private_dir(&made).unwrap());
        assert_eq!(std::fs::metadata(&made).unwrap().permissions().mode() & 0o7777, 0o700);
        assert!(!private_dir(&made).unwrap(), "an existing private directory is taken as it is");
        let open = base.join("open");
        std::fs::create_dir_all(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o1777)).unwrap();
        let e = private_dir(&open).unwrap_err();
        assert!(e.to_string().contains("is open to others (mode 1777)"), "{e}");
        assert_eq!(std::fs::metadata(&open).unwrap().permissions().mode() & 0o7777, 0o1777, "its mode is kept");
    }
}
