//! The `mesh.zone` reader the lab uses. What it reads, written back canonically, reads back the
//! same; and every record it keeps is one of the names `addresses` answers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use trellis_core::zone;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let z = match zone::parse(text) {
        Ok(z) => z,
        Err(e) => {
            // The line named is a line of the file (or 1, for an empty one).
            assert!(e.line >= 1 && e.line <= text.lines().count().max(1), "{e} in a file of {} lines", text.lines().count());
            return;
        }
    };
    assert!(!z.origin.is_empty());
    let printed = trellis_fuzz::print_zone(&z);
    assert_eq!(zone::parse(&printed).as_ref(), Ok(&z), "written back as {printed:?}");
    assert_eq!(z.addresses().values().map(Vec::len).sum::<usize>(), z.records.len());
});
