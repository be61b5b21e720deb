//! The controller's process gives back what its publish runs freed.

/// How long after a small publish run what malloc holds freed is given back
/// (`release_freed_soon`).
const SOON: std::time::Duration = std::time::Duration::from_secs(2);

/// `release_freed`, `SOON` from now on a blocking thread, unless that is asked already: after a
/// small publish run, out of the way of the agents fetching what it published (after an
/// enrolment storm at 100,000 nodes, giving back took 0.15-1 s of a core, the heap being
/// fragmented). Call it on a tokio runtime.
pub fn release_freed_soon() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static ASKED: AtomicBool = AtomicBool::new(false);
    if ASKED.swap(true, Ordering::SeqCst) {
        return;
    }
    /// Asked no more once the wait is over, or the task dropped (its runtime stopped).
    struct Asked;
    impl Drop for Asked {
        fn drop(&mut self) {
            ASKED.store(false, Ordering::SeqCst);
        }
    }
    tokio::spawn(async {
        let asked = Asked;
        tokio::time::sleep(SOON).await;
        drop(asked);
        give_back().await;
    });
}

/// `release_freed` on a blocking thread, off the runtime's, timed in the debug log.
pub async fn give_back() {
    let at = std::time::Instant::now();
    if let Err(e) = tokio::task::spawn_blocking(release_freed).await {
        tracing::error!("giving freed memory back failed: {e}");
    }
    tracing::debug!(ms = at.elapsed().as_millis() as u64, "freed memory given back");
}

/// Gives the memory malloc holds freed back to the system, in every arena (glibc's
/// `malloc_trim`); does nothing on another C library. A publish run at 100,000 nodes frees
/// gigabytes on the threads it compiled on, and glibc keeps what each arena freed for that
/// arena's next allocations: without this, `trellis serve` peaked at 5.9 GiB in the delivery
/// bench's enrolment storm, with it at 4.7 GiB (ADR 0041). Takes about a millisecond after a small
/// run in a storm, up to 1 s once a storm has left the heap fragmented; call it off the runtime's
/// threads.
pub fn release_freed() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: `malloc_trim` takes no pointer and only returns free pages to the system.
    unsafe {
        libc::malloc_trim(0);
    }
}
