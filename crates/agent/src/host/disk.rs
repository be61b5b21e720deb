//! The file writer on a real host: a bundle's files written under a root, each opened beneath it
//! without following a symbolic link, every file staged and synced before any is committed.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use trellis_core::bundle::BundleFile;
use trellis_files::beneath::Beneath;

use super::traits::{FileOutcome, FileWriter};

pub struct DiskWriter {
    pub root: PathBuf,
}

impl DiskWriter {
    /// Where a bundle's file goes: only a file trellis delivers (the verifier has refused any
    /// other already; this holds even for a caller that did not verify), as (its directory, its
    /// name).
    fn split(rel: &str) -> Result<(&str, &str)> {
        if !trellis_core::bundle::safe_path(rel) {
            bail!("refusing to write {rel:?}: it is not one of the files trellis delivers");
        }
        Ok(rel.rsplit_once('/').unwrap_or(("", rel)))
    }

    /// The directory a file goes in, opened under the root without following a symbolic link in
    /// any component (a linked `etc/trellis` would have the agent write wherever the link
    /// points), once per directory.
    fn dir(&self, dirs: &mut Vec<(String, Beneath)>, rel: &str, dir: &str) -> Result<usize> {
        if let Some(i) = dirs.iter().position(|(d, _)| d == dir) {
            return Ok(i);
        }
        let opened = Beneath::open(&self.root, dir, true).map_err(|e| anyhow::anyhow!("refusing to write {rel}: {e}"))?;
        dirs.push((dir.to_string(), opened));
        Ok(dirs.len() - 1)
    }
}

impl DiskWriter {
    /// Stages every file that differs from what is on disk (a file already as the bundle has it
    /// is `Unchanged`), noting what it staged in `staged` as it goes.
    fn stage_all(
        &self,
        files: &[BundleFile],
        dirs: &mut Vec<(String, Beneath)>,
        staged: &mut Vec<(usize, String, String)>,
        outcomes: &mut Vec<FileOutcome>,
    ) -> Result<()> {
        let mut unsynced: Vec<(PathBuf, std::fs::File)> = Vec::new();
        for f in files {
            let (dir_rel, name) = Self::split(&f.path)?;
            let d = self.dir(dirs, &f.path, dir_rel)?;
            let dir = &dirs[d].1;
            if dir.is_link(name) {
                bail!("refusing to write {}: {} is a symbolic link, which is never followed", f.path, dir.path().join(name).display());
            }
            let sha = hex::encode(f.sha256);
            if dir.holds(name, &f.content, f.mode) {
                outcomes.push(FileOutcome { path: f.path.clone(), sha256: sha, result: trellis_proto::FileResult::Unchanged });
                continue;
            }
            let (tmp, file) = dir.stage_unsynced(name, &f.content, f.mode)?;
            staged.push((d, tmp, name.to_string()));
            unsynced.push((dir.path().join(&staged.last().expect("staged").1), file));
            outcomes.push(FileOutcome { path: f.path.clone(), sha256: sha, result: trellis_proto::FileResult::Written });
        }
        // Synced at once, before any is committed: a crash leaves the old files or the new ones.
        std::thread::scope(|s| {
            let syncs: Vec<_> = unsynced.iter().map(|(path, file)| s.spawn(move || file.sync_all().map_err(|e| (path, e)))).collect();
            syncs.into_iter().try_for_each(|t| t.join().expect("a sync thread panicked"))
        })
        .map_err(|(path, e)| anyhow::anyhow!("cannot sync {}: {e}", path.display()))?;
        Ok(())
    }
}

impl FileWriter for DiskWriter {
    fn write_all(&mut self, files: &[BundleFile], dropped: &[String]) -> Result<Vec<FileOutcome>> {
        let mut outcomes = Vec::new();
        let mut dirs: Vec<(String, Beneath)> = Vec::new();
        // (directory index, staged name, final name)
        let mut staged: Vec<(usize, String, String)> = Vec::new();
        // Everything is staged before anything is committed. On any failure (a full disk) the
        // staged files go and the old ones stay; discarding one already committed does nothing.
        let written = self
            .stage_all(files, &mut dirs, &mut staged, &mut outcomes)
            .and_then(|()| staged.iter().try_for_each(|(d, tmp, name)| Ok(dirs[*d].1.commit(tmp, name)?)));
        if let Err(e) = written {
            for (d, tmp, _) in &staged {
                dirs[*d].1.discard(tmp);
            }
            return Err(e);
        }
        for (_, dir) in &dirs {
            dir.sync();
        }
        for path in dropped {
            let (dir_rel, name) = Self::split(path)?;
            let dir = match Beneath::open(&self.root, dir_rel, false) {
                Ok(d) => d,
                // No directory, no file to remove.
                Err(e) if e.source.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e).with_context(|| format!("cannot remove {path}")),
            };
            if dir.remove(name)? {
                outcomes.push(FileOutcome { path: path.clone(), sha256: String::new(), result: trellis_proto::FileResult::Removed });
            }
        }
        Ok(outcomes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("trellis-diskwriter-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    /// The attack: the agent's root holds `etc/trellis` as a link to a directory outside it.
    /// Before, the writer followed it and wrote the bundle's files there.
    #[test]
    fn a_symlinked_directory_is_never_written_through() {
        let base = scratch("link");
        let (root, outside) = (base.join("root"), base.join("outside"));
        std::fs::create_dir_all(root.join("etc")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("etc/trellis")).unwrap();
        let mut w = DiskWriter { root: root.clone() };
        let file = BundleFile::new(trellis_core::compile::NFTABLES_CONF, 0o644, b"table inet trellis {}\n".to_vec());
        let e = w.write_all(std::slice::from_ref(&file), &[]).unwrap_err().to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing was written outside the root");

        // A linked file is refused as well, and a plain tree is written.
        std::fs::remove_file(root.join("etc/trellis")).unwrap();
        std::fs::create_dir_all(root.join("etc/trellis")).unwrap();
        std::os::unix::fs::symlink(outside.join("x"), root.join(trellis_core::compile::NFTABLES_CONF)).unwrap();
        assert!(w.write_all(std::slice::from_ref(&file), &[]).is_err());
        std::fs::remove_file(root.join(trellis_core::compile::NFTABLES_CONF)).unwrap();
        let out = w.write_all(&[file], &[]).unwrap();
        assert_eq!(out[0].result, trellis_proto::FileResult::Written);
        let _ = std::fs::remove_dir_all(&base);
    }

    #[test]
    fn only_the_files_trellis_delivers_are_written() {
        let root = scratch("names");
        let mut w = DiskWriter { root: root.clone() };
        for bad in ["etc/cron.d/x", "root/.ssh/authorized_keys", "etc/trellis/../../x"] {
            let e = w.write_all(&[BundleFile::new(bad, 0o644, b"x".to_vec())], &[]).unwrap_err().to_string();
            assert!(e.contains("not one of the files trellis delivers"), "{bad}: {e}");
        }
        assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0);
        let _ = std::fs::remove_dir_all(&root);
    }
}
