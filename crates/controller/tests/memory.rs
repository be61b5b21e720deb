//! A publish run gives what it freed back to the system (`memory::release_freed`, ADR 0041). A
//! test binary of its own: the resident size it reads is the whole process's.

#![cfg(all(target_os = "linux", target_env = "gnu"))]

/// The process's resident bytes (`/proc/self/statm`).
fn resident() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm");
    let pages: u64 = statm.split_whitespace().nth(1).expect("resident pages").parse().expect("a number");
    // SAFETY: sysconf reads a constant.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64
}

#[test]
fn memory_freed_between_blocks_still_held_goes_back_to_the_system() {
    const BLOCK: usize = 64 * 1024;
    const BLOCKS: usize = 4096;
    // 256 MiB in blocks below malloc's mmap threshold, on a thread of its own (so in an arena of
    // its own, as a compile's threads are), every other block freed: what was freed lies between
    // blocks still held, where glibc does not give it back by itself.
    let held: Vec<Vec<u8>> = std::thread::spawn(|| {
        let blocks: Vec<Vec<u8>> = (0..BLOCKS).map(|i| vec![(i | 1) as u8; BLOCK]).collect();
        blocks.into_iter().enumerate().filter(|(i, _)| i % 2 == 0).map(|(_, b)| b).collect()
    })
    .join()
    .expect("the allocating thread");
    let before = resident();
    trellis_controller::memory::release_freed();
    let after = resident();
    let given_back = before.saturating_sub(after);
    // Half of 256 MiB was freed; most of its pages (all but each block's first and last) go back.
    assert!(
        given_back >= 64 << 20,
        "{} MiB given back of 128 MiB freed (resident {} -> {} MiB)",
        given_back >> 20,
        before >> 20,
        after >> 20
    );
    assert_eq!(held.iter().map(|b| b.len()).sum::<usize>(), BLOCKS / 2 * BLOCK, "the blocks held are intact");
    assert!(held.iter().enumerate().all(|(i, b)| b[0] == ((2 * i) | 1) as u8 && b[BLOCK - 1] == ((2 * i) | 1) as u8));
}
