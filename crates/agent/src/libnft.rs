//! nftables through its own library, `libnftables.so.1` (the one `nft` is a front end to),
//! loaded when the agent first loads a ruleset: a run in the agent's process costs what the
//! commands cost, where starting `nft` costs 12-20 ms whatever they are (a change of two set
//! elements: 0.08 ms against 16 ms here). Without the library the agent runs `nft`.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use anyhow::{bail, Context, Result};

/// The library's name in Debian's `libnftables1` (a dependency of `nftables`).
const LIBRARY: &str = "libnftables.so.1";

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

// SAFETY: the context is only used through `&mut self` (one call at a time), and libnftables
// keeps no state tied to the thread that made it.
unsafe impl Send for LibNft {}

impl LibNft {
    /// The library, if this host has it.
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

    /// Runs these commands as one transaction (as `nft -f -` would); the error is nft's message.
    pub fn run(&mut self, commands: &str) -> Result<()> {
        let commands = CString::new(commands).context("nft commands hold a NUL byte")?;
        // SAFETY: `ctx` is a live context and `commands` a NUL-terminated string that outlives
        // the call.
        let rc = unsafe { (self.from_buffer)(self.ctx, commands.as_ptr()) };
        self.finish(rc)
    }

    /// Loads a ruleset file as one transaction (as `nft -f FILE` would).
    pub fn run_file(&mut self, path: &std::path::Path) -> Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let path = CString::new(path.as_os_str().as_bytes()).context("a ruleset path holds a NUL byte")?;
        // SAFETY: as in `run`.
        let rc = unsafe { (self.from_file)(self.ctx, path.as_ptr()) };
        self.finish(rc)
    }

    /// Takes the buffers (reading one rewinds it for the next run) and the outcome.
    fn finish(&mut self, rc: c_int) -> Result<()> {
        // SAFETY: the buffers are NUL-terminated strings owned by the context, read before the
        // next call can change them.
        let (error, _) = unsafe {
            let text = |p: *const c_char| if p.is_null() { String::new() } else { CStr::from_ptr(p).to_string_lossy().into_owned() };
            (text((self.error)(self.ctx)), text((self.output)(self.ctx)))
        };
        if rc != 0 {
            bail!("{}", error.trim());
        }
        Ok(())
    }
}

impl Drop for LibNft {
    fn drop(&mut self) {
        // SAFETY: the context was made by `nft_ctx_new` and is freed once.
        unsafe { (self.free)(self.ctx) }
    }
}
