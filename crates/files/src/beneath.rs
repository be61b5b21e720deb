//! Files under a root, reached without following a symbolic link in any component: each
//! directory is opened relative to the one before it with `O_NOFOLLOW`, and files are read,
//! created, renamed and removed relative to their directory's handle. A link planted inside the
//! root, even between a check and a write, cannot lead a write outside it: the handle stays on
//! the directory that was opened.

use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{openat, renameat, OFlag};
use nix::sys::stat::{fstatat, mkdirat, Mode, SFlag};
use nix::unistd::{unlinkat, UnlinkatFlags};

use crate::FileError;

/// An open directory under a root.
pub struct Beneath {
    fd: OwnedFd,
    /// For messages only.
    path: PathBuf,
}

/// Exactly `len` bytes of `f`, or `None` (an error, or a file that was shorter or longer).
fn read_len(f: std::fs::File, len: usize) -> Option<Vec<u8>> {
    let mut content = Vec::with_capacity(len);
    f.take(len as u64 + 1).read_to_end(&mut content).ok()?;
    (content.len() == len).then_some(content)
}

fn io(e: Errno) -> std::io::Error {
    std::io::Error::from_raw_os_error(e as i32)
}

fn err(op: &'static str, path: PathBuf, e: Errno) -> FileError {
    FileError { op, path, source: io(e) }
}

/// Whether `name` in the directory `dir` is a symbolic link (not followed to find out).
fn is_link(dir: &OwnedFd, name: &str) -> bool {
    fstatat(dir.as_fd(), name, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW)
        .is_ok_and(|st| SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == SFlag::S_IFLNK)
}

const DIR_FLAGS: OFlag = OFlag::O_DIRECTORY.union(OFlag::O_NOFOLLOW).union(OFlag::O_CLOEXEC).union(OFlag::O_RDONLY);

impl Beneath {
    /// Opens the directory `rel` ('/'-separated, relative) under `root`, making the missing
    /// directories (mode 0755, whatever the process's umask: a service reads its certificates
    /// through them) when `create`. A component that is a symbolic link is refused, and so is
    /// one that is not a directory.
    pub fn open(root: &Path, rel: &str, create: bool) -> Result<Beneath, FileError> {
        if create && !root.exists() {
            // The root is the operator's choice, made as it is named.
            std::fs::create_dir_all(root).map_err(|source| FileError { op: "create", path: root.to_path_buf(), source })?;
        }
        let mut fd = openat(nix::fcntl::AT_FDCWD, root, OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_RDONLY, Mode::empty())
            .map_err(|e| err("open", root.to_path_buf(), e))?;
        let mut path = root.to_path_buf();
        for part in rel.split('/').filter(|p| !p.is_empty()) {
            if part == "." || part == ".." {
                return Err(err("open", path.join(part), Errno::EINVAL));
            }
            path.push(part);
            let next = match openat(fd.as_fd(), part, DIR_FLAGS, Mode::empty()) {
                Err(Errno::ENOENT) if create => {
                    let made = match mkdirat(fd.as_fd(), part, Mode::from_bits_truncate(0o755)) {
                        Ok(()) => true,
                        Err(Errno::EEXIST) => false,
                        Err(e) => return Err(err("create", path, e)),
                    };
                    let opened = openat(fd.as_fd(), part, DIR_FLAGS, Mode::empty());
                    if let (true, Ok(dir)) = (made, &opened) {
                        // The umask took bits from the mode asked for; the directory made here
                        // gets them back (one that was there keeps its own).
                        nix::sys::stat::fchmod(dir.as_fd(), Mode::from_bits_truncate(0o755))
                            .map_err(|e| err("set the mode of", path.clone(), e))?;
                    }
                    opened
                }
                other => other,
            }
            .map_err(|e| {
                if is_link(&fd, part) {
                    FileError {
                        op: "open",
                        path: path.clone(),
                        source: std::io::Error::other("it is a symbolic link, which is never followed"),
                    }
                } else {
                    err("open", path.clone(), e)
                }
            })?;
            fd = next;
        }
        Ok(Beneath { fd, path })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether `name` in this directory is a symbolic link.
    pub fn is_link(&self, name: &str) -> bool {
        is_link(&self.fd, name)
    }

    /// The content and permission bits of the file `name`, if it is there (a link is not
    /// followed: it reads as absent).
    pub fn read(&self, name: &str) -> Option<(Vec<u8>, u32)> {
        let fd = openat(self.fd.as_fd(), name, OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty()).ok()?;
        let mut f = std::fs::File::from(fd);
        let mode = {
            use std::os::unix::fs::PermissionsExt;
            f.metadata().ok()?.permissions().mode() & 0o777
        };
        let mut content = Vec::new();
        f.read_to_end(&mut content).ok()?;
        Some((content, mode))
    }

    /// The content and permission bits of the regular file `name`, when it is one of exactly
    /// `len` bytes; otherwise what it is instead ("missing", "not a regular file", "N bytes"),
    /// without reading it: a link to `/dev/zero` does not fill the memory, a FIFO does not hang.
    pub fn read_exact_len(&self, name: &str, len: usize) -> Result<(Vec<u8>, u32), String> {
        let (f, mode) = self.open_exact_len(name, len)?;
        Ok((read_len(f, len).ok_or_else(|| "shorter than it says".to_string())?, mode))
    }

    /// The regular file `name` of exactly `len` bytes, opened, and its permission bits; or what
    /// it is instead, as [`Beneath::read_exact_len`] says.
    fn open_exact_len(&self, name: &str, len: usize) -> Result<(std::fs::File, u32), String> {
        use std::os::unix::fs::PermissionsExt;
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NONBLOCK;
        let fd = match openat(self.fd.as_fd(), name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(Errno::ENOENT) => return Err("missing".into()),
            Err(Errno::ELOOP) => return Err("not a regular file".into()),
            Err(e) => return Err(e.desc().to_string()),
        };
        let f = std::fs::File::from(fd);
        let meta = f.metadata().map_err(|e| e.to_string())?;
        if !meta.is_file() {
            return Err("not a regular file".into());
        }
        if meta.len() != len as u64 {
            return Err(format!("{} bytes, not {len}", meta.len()));
        }
        Ok((f, meta.permissions().mode() & 0o777))
    }

    /// Whether `name` holds exactly `content` with `mode`: a file of another size or mode is not
    /// read at all, one of the same size is compared byte for byte (no digest: a bundle's files
    /// run to megabytes on a node that sees ten thousand peers, and most changes change their size).
    pub fn holds(&self, name: &str, content: &[u8], mode: u32) -> bool {
        match self.open_exact_len(name, content.len()) {
            Ok((f, m)) if m == mode => read_len(f, content.len()).is_some_and(|held| held == content),
            _ => false,
        }
    }

    /// Writes `content` to a new staging file beside `name`, created with `mode` before any
    /// byte is written, and syncs it; returns the staging file's name. On failure (a full disk)
    /// nothing is left behind.
    pub fn stage(&self, name: &str, content: &[u8], mode: u32) -> Result<String, FileError> {
        let (staged, file) = self.stage_unsynced(name, content, mode)?;
        if let Err(source) = file.sync_all() {
            self.discard(&staged);
            return Err(FileError { op: "sync", path: self.path.join(&staged), source });
        }
        Ok(staged)
    }

    /// As [`Beneath::stage`], without the sync: the caller syncs the file it is given before it
    /// commits it (several staged files synced at once share the file system's journal commits,
    /// where one after the other each waits for its own). On failure nothing is left behind.
    pub fn stage_unsynced(&self, name: &str, content: &[u8], mode: u32) -> Result<(String, std::fs::File), FileError> {
        let staged = crate::staging_name(name);
        let _ = unlinkat(self.fd.as_fd(), staged.as_str(), UnlinkatFlags::NoRemoveDir);
        let write = || -> Result<std::fs::File, FileError> {
            let fd = openat(
                self.fd.as_fd(),
                staged.as_str(),
                OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
                Mode::from_bits_truncate(mode),
            )
            .map_err(|e| err("create", self.path.join(&staged), e))?;
            // Created with no more than `mode` (the umask may take bits away), and given exactly
            // `mode` before any byte is written: a file meant to be read by others (a CA, a
            // certificate) is readable under a strict umask too, and one that holds a key has
            // never been more than `mode`.
            nix::sys::stat::fchmod(fd.as_fd(), Mode::from_bits_truncate(mode))
                .map_err(|e| err("set the mode of", self.path.join(&staged), e))?;
            let mut f = std::fs::File::from(fd);
            f.write_all(content).map_err(|source| FileError { op: "write", path: self.path.join(&staged), source })?;
            Ok(f)
        };
        match write() {
            Ok(f) => Ok((staged, f)),
            Err(e) => {
                self.discard(&staged);
                Err(e)
            }
        }
    }

    /// As [`Beneath::stage`], for a file that holds a key another group may read: created 0600
    /// before any byte is written, then, written and synced, given group `gid` (when one is
    /// named) and its final `mode`. Until it is committed nobody but the owner can open it.
    pub fn stage_for_group(&self, name: &str, content: &[u8], gid: Option<u32>, mode: u32) -> Result<String, FileError> {
        let staged = self.stage(name, content, 0o600)?;
        let p = self.path.join(&staged);
        let fd = openat(self.fd.as_fd(), staged.as_str(), OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC, Mode::empty())
            .map_err(|e| err("open", p.clone(), e));
        let finish = fd.and_then(|fd| {
            let f = std::fs::File::from(fd);
            if gid.is_some() {
                std::os::unix::fs::fchown(&f, None, gid).map_err(|source| FileError {
                    op: "change the group of",
                    path: p.clone(),
                    source,
                })?;
            }
            use std::os::unix::fs::PermissionsExt;
            f.set_permissions(std::fs::Permissions::from_mode(mode)).map_err(|source| FileError {
                op: "set the mode of",
                path: p.clone(),
                source,
            })?;
            f.sync_all().map_err(|source| FileError { op: "sync", path: p.clone(), source })
        });
        if let Err(e) = finish {
            self.discard(&staged);
            return Err(e);
        }
        Ok(staged)
    }

    /// The names in this directory (not `.` or `..`), sorted.
    pub fn names(&self) -> Result<Vec<String>, FileError> {
        // A description of its own, so that reading it moves no position the handle shares.
        let mut dir =
            nix::dir::Dir::openat(self.fd.as_fd(), ".", DIR_FLAGS, Mode::empty()).map_err(|e| err("read", self.path.clone(), e))?;
        let mut out: Vec<String> = dir
            .iter()
            .filter_map(|e| e.ok())
            .filter_map(|e| e.file_name().to_str().ok().map(str::to_string))
            .filter(|n| n != "." && n != "..")
            .collect();
        out.sort();
        Ok(out)
    }

    /// Removes the empty directory `name`; `false` when it was not there.
    pub fn remove_dir(&self, name: &str) -> Result<bool, FileError> {
        match unlinkat(self.fd.as_fd(), name, UnlinkatFlags::RemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(err("remove", self.path.join(name), e)),
        }
    }

    /// Renames a staged file over `name` (a link at `name` is replaced, not followed).
    pub fn commit(&self, staged: &str, name: &str) -> Result<(), FileError> {
        renameat(self.fd.as_fd(), staged, self.fd.as_fd(), name).map_err(|e| err("rename a staged file onto", self.path.join(name), e))
    }

    /// Removes a staged file that will not be committed.
    pub fn discard(&self, staged: &str) {
        let _ = unlinkat(self.fd.as_fd(), staged, UnlinkatFlags::NoRemoveDir);
    }

    /// Removes `name`; `false` when it was not there.
    pub fn remove(&self, name: &str) -> Result<bool, FileError> {
        match unlinkat(self.fd.as_fd(), name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) => Ok(true),
            Err(Errno::ENOENT) => Ok(false),
            Err(e) => Err(err("remove", self.path.join(name), e)),
        }
    }

    /// Syncs the directory, so that the renames in it are durable.
    pub fn sync(&self) {
        let _ = nix::unistd::fsync(self.fd.as_fd());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(tag: &str) -> trellis_testing::TempDir {
        trellis_testing::TempDir::new(&format!("beneath-{tag}"))
    }

    /// A file is held only when its bytes and its mode are the bundle's: another mode, another
    /// size, the same size with another byte, no file, or a link to a file that holds the bytes.
    #[test]
    fn a_file_is_held_only_with_the_same_bytes_and_mode() {
        let base = scratch("holds");
        std::fs::create_dir_all(base.join("etc")).unwrap();
        let dir = Beneath::open(&base, "etc", false).unwrap();
        let staged = dir.stage("a.conf", b"peer 1\n", 0o644).unwrap();
        dir.commit(&staged, "a.conf").unwrap();
        assert!(dir.holds("a.conf", b"peer 1\n", 0o644));
        assert!(!dir.holds("a.conf", b"peer 1\n", 0o600), "another mode");
        assert!(!dir.holds("a.conf", b"peer 10\n", 0o644), "another size");
        assert!(!dir.holds("a.conf", b"peer 2\n", 0o644), "the same size, another byte");
        assert!(!dir.holds("b.conf", b"peer 1\n", 0o644), "no file");
        std::os::unix::fs::symlink(base.join("etc/a.conf"), base.join("etc/c.conf")).unwrap();
        assert!(!dir.holds("c.conf", b"peer 1\n", 0o644), "a link is never followed");
    }

    /// The race the path check could not close: the directory is swapped for a link to
    /// somewhere outside the root after it was checked (here: after it was opened). The write
    /// goes to the directory that was opened, inside the root, never through the link.
    #[test]
    fn a_directory_swapped_for_a_link_after_it_was_opened_is_not_followed() {
        let base = scratch("race");
        let (root, outside) = (base.join("root"), base.join("outside"));
        std::fs::create_dir_all(root.join("etc/trellis")).unwrap();
        std::fs::create_dir_all(&outside).unwrap();
        let dir = Beneath::open(&root, "etc/trellis", false).unwrap();
        std::fs::rename(root.join("etc/trellis"), root.join("etc/moved")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("etc/trellis")).unwrap();
        let staged = dir.stage("mesh.zone", b"zone\n", 0o644).unwrap();
        dir.commit(&staged, "mesh.zone").unwrap();
        assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing outside the root");
        assert_eq!(std::fs::read(root.join("etc/moved/mesh.zone")).unwrap(), b"zone\n");
        // Opened again now, the link is refused.
        let e = Beneath::open(&root, "etc/trellis", true).err().expect("a link is refused").to_string();
        assert!(e.contains("is a symbolic link"), "{e}");
    }

    #[test]
    fn files_are_made_with_their_mode_read_back_and_removed() {
        let base = scratch("plain");
        let root = base.join("new-root");
        let dir = Beneath::open(&root, "etc/trellis", true).unwrap();
        assert!(dir.read("node.toml").is_none());
        let staged = dir.stage("node.toml", b"x", 0o600).unwrap();
        dir.commit(&staged, "node.toml").unwrap();
        assert_eq!(dir.read("node.toml"), Some((b"x".to_vec(), 0o600)));
        std::os::unix::fs::symlink("/etc/passwd", root.join("etc/trellis/link")).unwrap();
        assert!(dir.is_link("link") && !dir.is_link("node.toml"));
        assert_eq!(dir.read("link"), None, "a link is not read through");
        assert!(dir.remove("node.toml").unwrap());
        assert!(!dir.remove("node.toml").unwrap());
        assert!(Beneath::open(&root, "etc/../..", false).is_err());
    }
}
