//! How the controller's process holds its memory.

/// Limits glibc's malloc to as many arenas as there are cores (at least two), unless
/// `MALLOC_ARENA_MAX` is set (glibc read it at start). glibc gives each thread that allocates its
/// own arena, up to eight per core, and an arena keeps what was freed in it for itself: a
/// controller at 100,000 nodes compiles on short-lived threads and answers on many, and peaked at
/// 5.6-6.4 GiB with the default, 4.3 GiB with two arenas (`trellis-dev bench delivery`; its
/// enrolment storm about 30 % slower, ADR 0041). Call it before any thread starts. Gives the limit it set; `None` where it set none (the environment's
/// stands, or this is not glibc).
pub fn limit_malloc_arenas() -> Option<usize> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        if std::env::var_os("MALLOC_ARENA_MAX").is_some() {
            return None;
        }
        let n = std::thread::available_parallelism().map_or(2, |p| p.get()).max(2);
        let limit = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
        // SAFETY: `mallopt` sets a limit malloc reads when a thread first allocates; it takes no
        // pointer.
        let set = unsafe { libc::mallopt(libc::M_ARENA_MAX, limit) } == 1;
        set.then_some(n)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}
