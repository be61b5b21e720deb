//! What the benches measure with and print: milliseconds, percentiles and medians of durations,
//! CPU time and memory from the kernel, and the database a figure was taken on.

use std::time::Duration;

/// A duration in milliseconds, as the figures print it.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// Durations sorted, for percentiles.
pub fn sorted(mut v: Vec<Duration>) -> Vec<Duration> {
    v.sort();
    v
}

/// The `p` percentile (0..=1) of sorted durations; zero for none.
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The median of durations.
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// CPU time used by this process so far, on every thread: on a shared machine it moves less
/// than the wall clock does when other work takes the cores.
pub fn cpu_time() -> Duration {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `t` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut t) } != 0 {
        return Duration::ZERO;
    }
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The peak resident memory of this process, in KiB.
pub fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status.lines().find(|l| l.starts_with("VmHWM:"))?.split_whitespace().nth(1)?.parse().ok()
}

/// A memory figure of process `pid` from /proc (`VmHWM` is the peak, `VmRSS` the current), in KiB.
pub fn memory_kib(pid: u32, field: &str) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?.split_whitespace().nth(1)?.parse().ok()
}

/// The database a `--database-url` names, for the figures.
pub fn database_name(url: Option<&str>) -> &'static str {
    if url.is_some_and(|u| u.starts_with("postgres")) {
        "postgresql"
    } else {
        "sqlite"
    }
}
