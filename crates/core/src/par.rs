//! A deterministic parallel map over a range, on scoped threads. The result is the same as the
//! sequential map, in the same order; only the time differs.

use std::thread;

/// `f` over `0..n`, in order: on up to eight threads from 256 items on.
pub fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    map_from(n, 256, f)
}

/// [`map`] for items that each take milliseconds (a delta of a large bundle, say): parallel from
/// two items on.
pub fn map_each<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    map_from(n, 2, f)
}

/// `a` and `b`, the second on a thread of its own when there is a core for it: the results are
/// those of running one after the other.
pub fn join<A, B: Send>(a: impl FnOnce() -> A, b: impl FnOnce() -> B + Send) -> (A, B) {
    if thread::available_parallelism().map_or(1, |p| p.get()) <= 1 {
        return (a(), b());
    }
    thread::scope(|s| {
        let other = s.spawn(b);
        let first = a();
        (first, other.join().expect("a worker thread panicked"))
    })
}

fn map_from<R: Send>(n: usize, min: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    let threads = thread::available_parallelism().map_or(1, |p| p.get()).min(8);
    if threads <= 1 || n < min {
        return (0..n).map(f).collect();
    }
    let chunk = n.div_ceil(threads);
    let f = &f;
    thread::scope(|s| {
        let handles: Vec<_> =
            (0..n).step_by(chunk).map(|start| s.spawn(move || (start..(start + chunk).min(n)).map(f).collect::<Vec<R>>())).collect();
        // Sized once: collected through `flat_map` the output grew by copies (a hundred thousand
        // plans at 100,000 nodes).
        let mut out = Vec::with_capacity(n);
        for h in handles {
            out.extend(h.join().expect("a worker thread panicked"));
        }
        out
    })
}
