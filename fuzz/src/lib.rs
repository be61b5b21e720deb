//! What the fuzz targets and the seed generator share: the fixed signing key and node a bundle
//! is verified for, how one input becomes a declaration's files, how the harness completes an
//! input past a checksum or a signature the fuzzer cannot forge, and canonical printers that let
//! a target check that what a reader returns reads back the same.

use std::fmt::Write;

use ed25519_dalek::{Signer, SigningKey};
use trellis_core::wgconf::WgConf;
use trellis_core::zone::Zone;

/// Separates the files of a declaration in one input: TOML may not contain NUL, so no file
/// needs it.
pub const SEP: u8 = 0;
/// The most files one input is split into (`mesh.toml` and modules).
pub const MAX_FILES: usize = 16;

/// The mesh and node every bundle is verified for (the names of `lab/basic`).
pub const MESH: &str = "basic";
pub const NODE: &str = "db-1";

/// The controller's bundle-signing key in every bundle target.
pub fn signing_key() -> SigningKey {
    SigningKey::from_bytes(&[7; 32])
}

/// The files of a declaration directory from one input: `mesh.toml`, then `modules/mNN.toml`
/// for each further part, split at [`SEP`]. Invalid UTF-8 is replaced, not refused, so that
/// no input is wasted.
pub fn declaration_files(data: &[u8]) -> Vec<(String, String)> {
    data.split(|&b| b == SEP)
        .take(MAX_FILES)
        .enumerate()
        .map(|(i, part)| {
            let name = if i == 0 { trellis_core::load::MESH_FILE.to_string() } else { format!("modules/m{i:02}.toml") };
            (name, String::from_utf8_lossy(part).into_owned())
        })
        .collect()
}

/// The input [`declaration_files`] splits into these texts: the mesh first, then the modules.
pub fn join_files<'a>(mesh: &str, modules: impl IntoIterator<Item = &'a str>) -> Vec<u8> {
    let mut out = mesh.as_bytes().to_vec();
    for m in modules {
        out.push(SEP);
        out.extend_from_slice(m.as_bytes());
    }
    out
}

/// A token's text for a payload (everything before the checksum), with its checksum: what
/// `EnrolmentToken::encode` writes for a payload it made.
pub use trellis_core::token::text as token_text;

/// Offset of the manifest length in a bundle: after the magic and the signature.
pub const SIGNED_AT: usize = 4 + 64;

/// A bundle signed with [`signing_key`] from what follows its signature (`u32 manifest length |
/// manifest | contents`): the manifest is signed as the controller signs it, so the bytes after
/// the signature check are the fuzzer's. A length past the end is kept as it is, unsigned.
pub fn sign_envelope(rest: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(SIGNED_AT + rest.len());
    out.extend_from_slice(trellis_core::bundle::MAGIC);
    let len = rest.get(..4).map_or(usize::MAX, |b| u32::from_be_bytes(b.try_into().expect("4")) as usize);
    let manifest = rest.get(4..).and_then(|r| r.get(..len));
    let sig = match manifest {
        Some(m) => {
            let mut msg = b"trellis bundle signature v1\0".to_vec();
            msg.extend_from_slice(m);
            signing_key().sign(&msg).to_bytes()
        }
        None => [0; 64],
    };
    out.extend_from_slice(&sig);
    out.extend_from_slice(rest);
    out
}

/// `conf` written so that `wgconf::parse` reads it back as `conf`.
pub fn print_wgconf(conf: &WgConf) -> String {
    let mut out = String::from("[Interface]\n");
    if !conf.addresses.is_empty() {
        let _ = writeln!(out, "Address = {}", conf.addresses.join(", "));
    }
    if let Some(p) = conf.listen_port {
        let _ = writeln!(out, "ListenPort = {p}");
    }
    if let Some(m) = conf.mtu {
        let _ = writeln!(out, "MTU = {m}");
    }
    for p in &conf.peers {
        let _ = writeln!(out, "\n[Peer]\nPublicKey = {}", p.public_key);
        if !p.allowed_ips.is_empty() {
            let _ = writeln!(out, "AllowedIPs = {}", p.allowed_ips.join(", "));
        }
        if let Some(e) = p.endpoint {
            let _ = writeln!(out, "Endpoint = {e}");
        }
        if let Some(k) = p.keepalive {
            let _ = writeln!(out, "PersistentKeepalive = {k}");
        }
    }
    out
}

/// `zone` written so that `zone::parse` reads it back as `zone`.
pub fn print_zone(zone: &Zone) -> String {
    let mut out = format!("$ORIGIN {}.\n", zone.origin);
    if let Some(t) = zone.ttl {
        let _ = writeln!(out, "$TTL {t}");
    }
    if let Some(s) = zone.serial {
        let _ = writeln!(out, "@ IN SOA ns.{}. hostmaster.{}. {s} 3600 600 86400 60", zone.origin, zone.origin);
    }
    if let Some(ns) = &zone.nameserver {
        let _ = writeln!(out, "@ IN NS {ns}");
    }
    for a in &zone.nameserver_addresses {
        let name = zone.nameserver_name().expect("the name server has addresses only inside the zone");
        let kind = if a.is_ipv4() { "A" } else { "AAAA" };
        let _ = writeln!(out, "{name} IN {kind} {a}");
    }
    for r in &zone.records {
        let kind = if r.address.is_ipv4() { "A" } else { "AAAA" };
        let _ = writeln!(out, "{} IN {kind} {}", r.name, r.address);
    }
    out
}

/// A character that, shown on a terminal, could move the cursor, end the line or reorder the
/// text: a control character (C0, DEL, C1) or a bidirectional override.
pub fn moves_the_terminal(c: char) -> bool {
    c.is_control() || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// Panics when `s` has a character that [`moves_the_terminal`]: what `proto::text::printable`
/// must guarantee of its output.
pub fn assert_terminal_safe(s: &str) {
    if let Some(c) = s.chars().find(|&c| moves_the_terminal(c)) {
        panic!("{c:?} reaches the terminal in {s:?}");
    }
}
