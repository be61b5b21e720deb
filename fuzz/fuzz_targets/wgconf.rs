//! The `wireguard.conf` reader the agent and the lab use. What it reads, written back
//! canonically, reads back the same: no value is lost or changed between reading and writing.
//! And a change of it read by its regions (`Read::edit`, ADR 0037): the input cut in two at its
//! first NUL, the second a change of the first, as a delta's edits give it; whenever the regions
//! give a configuration, it is the whole read's, with the changes the whole read finds.
#![no_main]

use libfuzzer_sys::fuzz_target;
use trellis_core::wgconf;

fuzz_target!(|data: &[u8]| {
    if let Some(cut) = data.iter().position(|&b| b == 0) {
        edited(&data[..cut], &data[cut + 1..]);
    }
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(conf) = wgconf::parse(text) else { return };
    let printed = trellis_fuzz::print_wgconf(&conf);
    assert_eq!(wgconf::parse(&printed).as_ref(), Ok(&conf), "written back as {printed:?}");
    assert!(conf.peers.iter().all(|p| !p.public_key.is_empty()), "a peer without a key was read");
});

fn edited(old: &[u8], new: &[u8]) {
    let (Ok(old_text), Ok(new_text)) = (std::str::from_utf8(old), std::str::from_utf8(new)) else { return };
    let (Ok(held), Ok(whole)) = (wgconf::read(old_text), wgconf::read(new_text)) else { return };
    let edits = trellis_core::delta::edits(old, new);
    let Ok((built, Some(hunks))) = trellis_core::delta::rebuild_with_hunks(old, &edits, new.len(), "wireguard.conf") else { return };
    assert_eq!(built, new);
    if let Some((edited, changes)) = held.edit(old, new, &hunks) {
        assert_eq!(edited.conf, whole.conf, "{old_text:?} -> {new_text:?}");
        assert_eq!(changes, wgconf::changes(&held.conf.peers, &whole.conf.peers));
    }
}
