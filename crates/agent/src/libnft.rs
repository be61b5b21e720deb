//! nftables through its own library, `libnftables.so.1` (the one `nft` is a front end to),
//! loaded by the agent's helper process (`crate::nfthelper`), never by the agent itself: the
//! library calls `exit()` or `abort()` on some failures. A run costs what the commands cost,
//! where starting `nft` costs 12-20 ms whatever they are (a change of two set elements: 0.08 ms
//! against 16 ms here). Without the library the agent runs `nft`.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use anyhow::{bail, Context, Result};

/// The library's name in Debian's `libnftables1` (a dependency of `nftables`).
pub const LIBRARY: &str = "libnftables.so.1";

type New = unsafe extern "C" fn(u32) -> *mut c_void;
type Free = unsafe extern "C" fn(*mut c_void);
type Buffer = unsafe extern "C" fn(*mut c_void) -> c_int;
type GetBuffer = unsafe extern "C" fn(*mut c_void) -> *const c_char;
type Run = unsafe extern "C" fn(*mut c_void, *const c_char) -> c_int;

/// One nftables context, its output and errors kept in buffers (never printed).
pub struct LibNft {
    ctx: *mut c_void,
    free: Free,
    error: GetBuffer,
    output: GetBuffer,
    from_buffer: Run,
    from_file: Run,
    /// Kept loaded as long as the context lives.
    _lib: libloading::Library,
}

impl LibNft {
    /// The library, if this host has it. `nft_ctx_new` exits the process (status 3) when it
    /// cannot open its netlink socket: only the helper calls this.
    pub fn load() -> Result<LibNft> {
        // SAFETY: loading libnftables runs its initialisers, which only set up its own state.
        let lib = unsafe { libloading::Library::new(LIBRARY) }.with_context(|| format!("cannot load {LIBRARY}"))?;
        // SAFETY: these are libnftables' documented functions (libnftables(3)) with their C
        // signatures; each pointer is used only while `lib` is loaded, which the struct ensures.
        unsafe {
            let new: New = *lib.get(b"nft_ctx_new\0")?;
            let buffer_output: Buffer = *lib.get(b"nft_ctx_buffer_output\0")?;
            let buffer_error: Buffer = *lib.get(b"nft_ctx_buffer_error\0")?;
            let free: Free = *lib.get(b"nft_ctx_free\0")?;
            let error: GetBuffer = *lib.get(b"nft_ctx_get_error_buffer\0")?;
            let output: GetBuffer = *lib.get(b"nft_ctx_get_output_buffer\0")?;
            let from_buffer: Run = *lib.get(b"nft_run_cmd_from_buffer\0")?;
            let from_file: Run = *lib.get(b"nft_run_cmd_from_filename\0")?;
            // NFT_CTX_DEFAULT. Checked before the struct is made: its `Drop` frees the context,
            // which must not be a null one.
            let ctx = new(0);
            if ctx.is_null() {
                bail!("{LIBRARY} made no context");
            }
            let this = LibNft { free, error, output, from_buffer, from_file, ctx, _lib: lib };
            if buffer_output(this.ctx) != 0 || buffer_error(this.ctx) != 0 {
                bail!("{LIBRARY} cannot keep its output in a buffer");
            }
            Ok(this)
        }
    }

    /// Runs these commands as one transaction (as `nft -f -` would). Returns what nft printed
    /// (a listing); the error is nft's message.
    pub fn run(&mut self, commands: &str) -> Result<String> {
        let commands = CString::new(commands).context("nft commands hold a NUL byte")?;
        // SAFETY: `ctx` is a live context and `commands` a NUL-terminated string that outlives
        // the call.
        let rc = unsafe { (self.from_buffer)(self.ctx, commands.as_ptr()) };
        self.finish(rc)
    }

    /// Loads a ruleset's text as one transaction, as `nft -f` loads a file: the text the agent
    /// read, never its path read a second time (the file may have changed in between). It is
    /// given as a file of this process's own, in memory, not as a buffer, so that nft's message
    /// shows the line at fault (for a buffer it shows the first line, whatever the error's);
    /// `name` stands for that file in the message.
    pub fn load_ruleset(&mut self, text: &str, name: &str) -> Result<()> {
        use std::io::Write;
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: a NUL-terminated name; the descriptor is owned as soon as it exists.
        let fd = unsafe { libc::memfd_create(c"trellis-ruleset".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error()).context("cannot make a file in memory for the ruleset");
        }
        // SAFETY: `fd` is a new descriptor nothing else owns.
        let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
        file.write_all(text.as_bytes()).context("cannot write the ruleset into memory")?;
        // Opened again by nft through /proc, from its start.
        let path = format!("/proc/self/fd/{}", file.as_raw_fd());
        let c_path = CString::new(path.as_str()).expect("no NUL in a /proc path");
        // SAFETY: as in `run`; `file` stays open until the call returns.
        let rc = unsafe { (self.from_file)(self.ctx, c_path.as_ptr()) };
        drop(file);
        self.finish(rc).map(drop).map_err(|e| anyhow::anyhow!("{}", e.to_string().replace(&path, name)))
    }

    /// Takes the buffers (reading one rewinds it for the next run) and the outcome.
    fn finish(&mut self, rc: c_int) -> Result<String> {
        // SAFETY: the buffers are NUL-terminated strings owned by the context, read before the
        // next call can change them.
        let (error, output) = unsafe {
            let text = |p: *const c_char| if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
            (text((self.error)(self.ctx)), text((self.output)(self.ctx)))
        };
        if rc != 0 {
            bail!("{}", error.trim());
        }
        Ok(output)
    }
}

impl Drop for LibNft {
    fn drop(&mut self) {
        // SAFETY: the context was made by `nft_ctx_new` and is freed once.
        unsafe { (self.free)(self.ctx) }
    }
}
