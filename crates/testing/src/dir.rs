//! A temporary directory that removes itself.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};

/// A new, private directory under the system's temporary directory, removed with everything in
/// it when dropped. It dereferences to its path.
#[derive(Debug)]
pub struct TempDir {
    path: PathBuf,
}

impl TempDir {
    /// `trellis-TAG-...` under the system's temporary directory, unique per process and call,
    /// with mode 0700, as a directory that holds keys must be (the agent and `trellis init`
    /// refuse an open one).
    #[track_caller]
    pub fn new(tag: &str) -> TempDir {
        use std::os::unix::fs::DirBuilderExt;
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
        let path = std::env::temp_dir().join(format!("trellis-{tag}-{}-{n}-{nanos}", std::process::id()));
        std::fs::DirBuilder::new().mode(0o700).create(&path).unwrap_or_else(|e| panic!("cannot create {}: {e}", path.display()));
        TempDir { path }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// The directory's path: `dir.join("file")`, `&dir` where a `&Path` is wanted.
impl std::ops::Deref for TempDir {
    type Target = Path;

    fn deref(&self) -> &Path {
        &self.path
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.path
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}
