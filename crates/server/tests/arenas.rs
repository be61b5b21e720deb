//! `trellis serve` limits glibc's malloc arenas (`memory::limit_malloc_arenas`). A test binary of
//! its own: no other test's threads have made arenas before the limit is set.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

use std::sync::{Arc, Barrier};

/// How many arenas malloc has, as `malloc_info` lists them (`<heap nr="N">`, one per arena).
fn arenas() -> usize {
    let mut buf: *mut libc::c_char = std::ptr::null_mut();
    let mut len: libc::size_t = 0;
    // SAFETY: the stream writes into a buffer malloc owns, read once closed and then freed.
    let text = unsafe {
        let stream = libc::open_memstream(&mut buf, &mut len);
        assert!(!stream.is_null(), "open_memstream");
        assert_eq!(libc::malloc_info(0, stream), 0, "malloc_info");
        libc::fclose(stream);
        let text = std::slice::from_raw_parts(buf.cast::<u8>(), len).to_vec();
        libc::free(buf.cast());
        text
    };
    String::from_utf8_lossy(&text).matches("<heap nr=").count()
}

#[test]
fn threads_allocating_at_once_share_as_many_arenas_as_there_are_cores() {
    let limit = match trellis_server::memory::limit_malloc_arenas() {
        Some(n) => n,
        // Set by the environment, which glibc read at start.
        None => std::env::var("MALLOC_ARENA_MAX").expect("a limit set here or by the environment").parse().expect("a number"),
    };
    // Twelve threads allocating while the others hold their memory: without a limit, glibc gives
    // each its own arena (up to eight per core).
    let threads = 12;
    let all = Arc::new(Barrier::new(threads + 1));
    let held: Vec<_> = (0..threads)
        .map(|i| {
            let all = all.clone();
            std::thread::spawn(move || {
                let v = vec![i as u8; 4096];
                all.wait();
                all.wait();
                v.len()
            })
        })
        .collect();
    all.wait();
    let seen = arenas();
    all.wait();
    for h in held {
        assert_eq!(h.join().expect("a thread"), 4096);
    }
    assert!(seen <= limit, "{seen} malloc arenas with {threads} threads allocating; the limit is {limit}");
}
