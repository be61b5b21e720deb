//! The controller's process gives back what its publish runs freed.

/// Gives the memory malloc holds freed back to the system, in every arena (glibc's
/// `malloc_trim`); does nothing on another C library. A publish run at 100,000 nodes frees
/// gigabytes on the threads it compiled on, and glibc keeps what each arena freed for that
/// arena's next allocations: without this, `trellis serve` peaked at 5.9 GiB in the delivery
/// bench's enrolment storm, with it at 4.7 GiB (ADR 0041). Takes about a millisecond after a small
/// run, up to 0.8 s after a storm's; call it off the runtime's threads.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointer and only returns free pages to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}
