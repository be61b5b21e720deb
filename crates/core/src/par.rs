//! A deterministic parallel map over a range, on scoped threads. The result is the same as the
//! sequential map, in the same order; only the time differs.

use std::thread;

pub(crate) fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = thread::available_parallelism().map_or(1, |p| p.get()).min(8);
    if threads <= 1 || n < 256 {
        return (0..n).map(f).collect();
    }
    let chunk = n.div_ceil(threads);
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> =
            (0..n).step_by(chunk).map(|start| s.spawn(move || (start..(start + chunk).min(n)).map(f).collect::<Vec<R>>())).collect();
        handles.into_iter().flat_map(|h| h.join().expect("compiler thread panicked")).collect()
    })
}
