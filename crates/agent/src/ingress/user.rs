//! Who Traefik runs as (the review of 2026-12-02, finding 6). Traefik parses TLS and HTTP from
//! the internet, so a root agent never lends it root, its capabilities or the node's keys: it
//! starts Traefik as the system user `trellis-ingress`, with `CAP_NET_BIND_SERVICE` alone (for
//! 443) and no new privileges, in a directory of that user's; and the agent touches that
//! directory as that user (the thread's filesystem uid), so that what it writes there is the
//! user's and what Traefik leaves there is never read with root's rights.

use std::ffi::CStr;
use std::marker::PhantomData;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

/// The system user Traefik runs as (the .deb's postinst adds it).
pub const USER: &str = "trellis-ingress";

/// The sentence for a root agent on a host without that user.
pub const NO_USER: &str = "Traefik runs as the system user trellis-ingress, which does not exist on this host: add it (`useradd --system --no-create-home --shell /usr/sbin/nologin trellis-ingress`; the .deb's postinst does) or choose --ingress none";

/// `CAP_NET_BIND_SERVICE`, the one capability Traefik keeps: its entry points listen on 443.
pub const NET_BIND_SERVICE: u32 = 10;

/// Who Traefik runs as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RunAs {
    /// The agent is not root and cannot change users (a test, a laptop): Traefik runs as the
    /// agent's user, which holds nothing Traefik should not.
    Agent,
    /// A root agent's Traefik: `trellis-ingress`.
    User { uid: u32, gid: u32 },
}

impl RunAs {
    /// `trellis-ingress` for a root agent (an error naming it when it is missing), else the
    /// agent's own user.
    pub fn resolve() -> Result<RunAs> {
        if !nix::unistd::geteuid().is_root() {
            return Ok(RunAs::Agent);
        }
        let user = nix::unistd::User::from_name(USER)
            .with_context(|| format!("cannot look up the user {USER}, whom Traefik runs as"))?
            .context(NO_USER)?;
        if user.uid.is_root() {
            bail!("the user {USER}, whom Traefik runs as, has uid 0: give it a uid of its own");
        }
        Ok(RunAs::User { uid: user.uid.as_raw(), gid: user.gid.as_raw() })
    }

    /// Its name in messages.
    pub fn name(&self) -> &'static str {
        match self {
            RunAs::Agent => "the agent's user",
            RunAs::User { .. } => USER,
        }
    }

    /// `f`, with the calling thread's file access that of Traefik's user: what it creates is the
    /// user's and every open is checked as the user's would be (root's supplementary groups
    /// aside). Only this thread's filesystem ids change, and only until `f` returns.
    pub fn files<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        let RunAs::User { uid, gid } = *self else { return Ok(f()) };
        let _as = FsIds::enter(uid, gid)?;
        Ok(f())
    }

    /// The first `traefik` on PATH that Traefik's user may execute (a pyenv shim under /root is
    /// not one).
    pub fn program(&self) -> Result<PathBuf> {
        let candidates = super::candidates();
        let Some(first) = candidates.first() else { bail!(super::MISSING) };
        for p in &candidates {
            if self.files(|| executable(p))? {
                return Ok(p.clone());
            }
        }
        bail!(
            "{} is not executable by {}, whom Traefik runs as (a directory on its way is closed to it); install traefik where every user may run it, such as /usr/local/bin",
            first.display(),
            self.name()
        )
    }

    /// Makes `dir` Traefik's: created 0700 when missing (its parents with the usual mode), and
    /// given to Traefik's user, 0700, when it is the agent's. A link or another user's
    /// directory is refused.
    pub fn own(&self, dir: &Path) -> Result<()> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let RunAs::User { uid, gid } = *self else {
            trellis_files::private_dir(dir)?;
            return Ok(());
        };
        let meta = match std::fs::symlink_metadata(dir) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                trellis_files::private_dir(dir)?;
                std::fs::symlink_metadata(dir).with_context(|| format!("cannot inspect {}", dir.display()))?
            }
            Err(e) => return Err(e).with_context(|| format!("cannot inspect {}", dir.display())),
        };
        if !meta.is_dir() {
            bail!("{} is not a directory", dir.display());
        }
        if meta.uid() == uid {
            return Ok(());
        }
        if meta.uid() != nix::unistd::geteuid().as_raw() {
            bail!("{} belongs to uid {}, neither the agent nor {USER}, whom Traefik runs as", dir.display(), meta.uid());
        }
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
            .with_context(|| format!("cannot make {} private", dir.display()))?;
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).with_context(|| format!("cannot give {} to {USER}", dir.display()))
    }
}

/// Whether the thread's filesystem ids may execute `path` (the kernel's own check).
fn executable(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else { return false };
    // SAFETY: a valid C string; faccessat only reads it.
    unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::X_OK, libc::AT_EACCESS) == 0 }
}

/// The calling thread's filesystem uid and gid, switched until dropped. Not `Send`: they
/// belong to the thread that switched them.
struct FsIds {
    uid: u32,
    gid: u32,
    _thread: PhantomData<*const ()>,
}

impl FsIds {
    fn enter(uid: u32, gid: u32) -> Result<FsIds> {
        // setfsuid and setfsgid return the previous id and never fail visibly; an invalid id
        // (u32::MAX) changes nothing, so asking with it reads the current one.
        // SAFETY: plain system calls of the calling thread.
        let was = unsafe { FsIds { uid: libc::setfsuid(u32::MAX) as u32, gid: libc::setfsgid(u32::MAX) as u32, _thread: PhantomData } };
        // SAFETY: as above.
        let now = unsafe {
            libc::setfsgid(gid);
            libc::setfsuid(uid);
            (libc::setfsuid(u32::MAX) as u32, libc::setfsgid(u32::MAX) as u32)
        };
        if now != (uid, gid) {
            drop(was);
            bail!("cannot act as {USER} (uid {uid}): the agent needs CAP_SETUID and CAP_SETGID (dist/trellis-agent.service)");
        }
        Ok(was)
    }
}

impl Drop for FsIds {
    fn drop(&mut self) {
        // Back to root's fsuid first: that gives the thread its filesystem capabilities again.
        // SAFETY: plain system calls of the calling thread, back to ids it held.
        unsafe {
            libc::setfsuid(self.uid);
            libc::setfsgid(self.gid);
        }
    }
}

#[repr(C)]
struct CapHeader {
    version: u32,
    pid: libc::c_int,
}

#[repr(C)]
#[derive(Clone, Copy, Default)]
struct CapData {
    effective: u32,
    permitted: u32,
    inheritable: u32,
}

const CAP_VERSION_3: u32 = 0x2008_0522;

fn check(r: libc::c_long) -> std::io::Result<()> {
    if r == -1 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Between fork and exec: Traefik's user (no supplementary group, its own gid and uid, every
/// capability kept across the change only so that one can be kept), `cwd`, then of the
/// capabilities `CAP_NET_BIND_SERVICE` alone when the agent holds it (effective, permitted,
/// inheritable and ambient, which carries it across exec: Traefik's file has none), every other
/// ambient one cleared, and no new privileges. The change of user clears the parent-death
/// signal: it is set after this.
///
/// # Safety
/// Called in the child between fork and exec: only system calls on values made before the fork,
/// nothing allocated.
pub unsafe fn confine(run_as: &RunAs, cwd: &CStr) -> std::io::Result<()> {
    let c = |r: libc::c_int| check(r as libc::c_long);
    // prctl reads its arguments as unsigned longs: the unused ones must be zero.
    let prctl = |option: libc::c_int, arg: libc::c_ulong, arg3: libc::c_ulong| {
        c(libc::prctl(option, arg, arg3, 0 as libc::c_ulong, 0 as libc::c_ulong))
    };
    if let RunAs::User { uid, gid } = *run_as {
        prctl(libc::PR_SET_KEEPCAPS, 1, 0)?;
        c(libc::setgroups(0, std::ptr::null()))?;
        c(libc::setresgid(gid, gid, gid))?;
        c(libc::setresuid(uid, uid, uid))?;
    }
    c(libc::chdir(cwd.as_ptr()))?;
    let mut head = CapHeader { version: CAP_VERSION_3, pid: 0 };
    let mut data = [CapData::default(); 2];
    check(libc::syscall(libc::SYS_capget, &mut head as *mut CapHeader, data.as_mut_ptr()))?;
    let keep = data[0].permitted & (1 << NET_BIND_SERVICE);
    let data = [CapData { effective: keep, permitted: keep, inheritable: keep }, CapData::default()];
    check(libc::syscall(libc::SYS_capset, &head as *const CapHeader, data.as_ptr()))?;
    prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong, 0)?;
    if keep != 0 {
        prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_RAISE as libc::c_ulong, NET_BIND_SERVICE.into())?;
    }
    prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0)
}
