//! Bundle deltas, as the agent reads them from the network (`trellis_core::delta`). Any bytes
//! applied to a held bundle are refused or rebuild exactly the bytes the delta names (never over
//! the bundle bound); and a delta made between two inputs rebuilds the second from the first.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sha2::{Digest, Sha256};
use trellis_core::delta;

fuzz_target!(|data: &[u8]| {
    // The first byte says where the held bundle ends and the delta (or the second input) starts.
    let Some((&cut, rest)) = data.split_first() else { return };
    let at = (cut as usize * rest.len()) / 255;
    let (base, other) = rest.split_at(at);
    if let Ok(built) = delta::apply(base, other) {
        assert!(built.len() <= trellis_core::bundle::MAX_BUNDLE);
        assert_eq!(&Sha256::digest(&built)[..], &other[44..76], "rebuilt bytes other than the ones named");
    }
    let made = delta::make(base, other);
    assert_eq!(delta::apply(base, &made).as_deref(), Ok(other), "a delta that does not rebuild its target");
});
