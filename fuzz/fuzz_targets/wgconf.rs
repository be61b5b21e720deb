//! The `wireguard.conf` reader the agent and the lab use. What it reads, written back
//! canonically, reads back the same: no value is lost or changed between reading and writing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use trellis_core::wgconf;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(conf) = wgconf::parse(text) else { return };
    let printed = trellis_fuzz::print_wgconf(&conf);
    assert_eq!(wgconf::parse(&printed).as_ref(), Ok(&conf), "written back as {printed:?}");
    assert!(conf.peers.iter().all(|p| !p.public_key.is_empty()), "a peer without a key was read");
});
