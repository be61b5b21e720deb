//! Bundle deltas: a new signed bundle sent as the edits that turn the bundle a node holds into it
//! (ADR 0012). A node that peers with the whole mesh holds a bundle of megabytes; one node more
//! changes a few lines of it. The delta is transport only: the node rebuilds the new bundle's
//! exact bytes from the ones it holds and verifies them as it verifies any bundle (signature,
//! manifest, digests), so a delta can change nothing a full bundle could not.
//!
//! Wire form: `TRD1` | [32] SHA-256 of the base bundle | u64 length of the new bundle | [32]
//! SHA-256 of the new bundle | ops, each `C` u32 first line, u32 lines (copy lines of the base)
//! or `I` u32 length, bytes (insert). Lines are the bytes up to and including each `\n` or `,`
//! (the last may lack one); integers big endian.
//!
//! Edits are found by lines and runs of lines: every run of [`RUN`] consecutive lines of the base
//! that starts at an anchor line (about one in four, chosen by content) is indexed by hash; the
//! new bundle is walked line by line, continuing a copy while the lines agree and otherwise
//! looking its next run up in the index. Linear in the sizes, and exact for the changes a
//! recompile makes (blocks of peers, records and rules added, removed or changed).

use std::collections::HashMap;

use sha2::{Digest, Sha256};

use crate::bundle::MAX_BUNDLE;

pub const MAGIC: &[u8; 4] = b"TRD1";
/// Lines per indexed run.
const RUN: usize = 4;

#[derive(Debug, PartialEq, Eq)]
pub enum DeltaError {
    NotADelta,
    /// The delta was made from another bundle than the one held.
    OtherBase,
    Malformed(&'static str),
    TooLarge,
    /// The rebuilt bytes are not the ones the delta names.
    Mismatch,
}

impl std::fmt::Display for DeltaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeltaError::NotADelta => f.write_str("this is not a bundle delta"),
            DeltaError::OtherBase => f.write_str("the delta was made from another bundle than the one held"),
            DeltaError::Malformed(what) => write!(f, "the bundle delta is malformed: {what}"),
            DeltaError::TooLarge => write!(f, "the bundle the delta makes is over the bound of {MAX_BUNDLE} bytes"),
            DeltaError::Mismatch => f.write_str("the bundle rebuilt from the delta is not the one it names"),
        }
    }
}

impl std::error::Error for DeltaError {}

/// The units edits are made of: lines, and within a line the items of a list (an nftables set
/// of a thousand addresses is one line).
fn lines(b: &[u8]) -> Vec<&[u8]> {
    b.split_inclusive(|&c| c == b'\n' || c == b',').collect()
}

/// A fast, non-cryptographic hash of one line (a match is always confirmed on the bytes).
fn line_hash(l: &[u8]) -> u64 {
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut h = l.len() as u64;
    let mut chunks = l.chunks_exact(8);
    for c in &mut chunks {
        h = (h ^ u64::from_le_bytes(c.try_into().expect("8 bytes"))).wrapping_mul(K).rotate_left(29);
    }
    for &b in chunks.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(K).rotate_left(29);
    }
    h
}

/// The key of the run of RUN lines starting at `i`, from their line hashes.
fn run_key(h: &[u64], i: usize) -> u64 {
    h[i] ^ h[i + 1].rotate_left(17) ^ h[i + 2].rotate_left(34) ^ h[i + 3].rotate_left(51)
}

/// Whether a run may start at a line with this hash. Only about one line in [`ANCHOR`] is an
/// anchor, chosen by its content, so the base and the new bundle agree on where runs start and
/// the index is that much smaller; an edit then costs at most a few unchanged lines more.
fn anchor(h: u64) -> bool {
    h.is_multiple_of(ANCHOR)
}

const ANCHOR: u64 = 4;

/// Keys are hashes already: the map uses them as they are.
#[derive(Default)]
struct Identity(u64);

impl std::hash::Hasher for Identity {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("only u64 keys")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// The edits that turn `base` into `new`.
pub fn make(base: &[u8], new: &[u8]) -> Vec<u8> {
    let (old, new_lines) = (lines(base), lines(new));
    let (old_h, new_h): (Vec<u64>, Vec<u64>) =
        (old.iter().map(|l| line_hash(l)).collect(), new_lines.iter().map(|l| line_hash(l)).collect());
    // Each run of RUN lines of the base, by hash: its first position.
    let mut index: HashMap<u64, u32, std::hash::BuildHasherDefault<Identity>> =
        HashMap::with_capacity_and_hasher(old.len(), Default::default());
    for i in 0..old.len().saturating_sub(RUN - 1) {
        if anchor(old_h[i]) {
            index.entry(run_key(&old_h, i)).or_insert(i as u32);
        }
    }
    let mut out = Vec::with_capacity(64 + new.len() / 64);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&Sha256::digest(base));
    out.extend_from_slice(&(new.len() as u64).to_be_bytes());
    out.extend_from_slice(&Sha256::digest(new));
    let mut insert: Vec<u8> = Vec::new();
    let flush_insert = |out: &mut Vec<u8>, insert: &mut Vec<u8>| {
        if !insert.is_empty() {
            out.push(b'I');
            out.extend_from_slice(&(insert.len() as u32).to_be_bytes());
            out.append(insert);
        }
    };
    let (mut j, mut at) = (0usize, None::<usize>);
    while j < new_lines.len() {
        // Continue the copy while the lines agree; else find the next run in the base.
        let start = match at {
            Some(i) if i < old.len() && old_h[i] == new_h[j] && old[i] == new_lines[j] => Some(i),
            _ if j + RUN <= new_lines.len() && anchor(new_h[j]) => {
                index.get(&run_key(&new_h, j)).map(|&i| i as usize).filter(|&i| old[i..i + RUN] == new_lines[j..j + RUN])
            }
            _ => None,
        };
        match start {
            Some(i) => {
                let mut n = 0;
                while i + n < old.len() && j + n < new_lines.len() && old_h[i + n] == new_h[j + n] && old[i + n] == new_lines[j + n] {
                    n += 1;
                }
                flush_insert(&mut out, &mut insert);
                out.push(b'C');
                out.extend_from_slice(&(i as u32).to_be_bytes());
                out.extend_from_slice(&(n as u32).to_be_bytes());
                j += n;
                at = Some(i + n);
            }
            None => {
                insert.extend_from_slice(new_lines[j]);
                j += 1;
                at = None;
            }
        }
    }
    flush_insert(&mut out, &mut insert);
    out
}

fn take<'a>(b: &mut &'a [u8], n: usize, what: &'static str) -> Result<&'a [u8], DeltaError> {
    if b.len() < n {
        return Err(DeltaError::Malformed(what));
    }
    let (head, rest) = b.split_at(n);
    *b = rest;
    Ok(head)
}

fn u32_at(b: &mut &[u8], what: &'static str) -> Result<usize, DeltaError> {
    Ok(u32::from_be_bytes(take(b, 4, what)?.try_into().expect("4 bytes")) as usize)
}

/// Rebuilds the new bundle from the one held (`base`) and a delta; its bytes are checked against
/// the digest the delta names, never beyond [`MAX_BUNDLE`]. The caller verifies the result as a
/// bundle.
pub fn apply(base: &[u8], delta: &[u8]) -> Result<Vec<u8>, DeltaError> {
    let mut d = delta;
    if take(&mut d, 4, "magic").ok() != Some(&MAGIC[..]) {
        return Err(DeltaError::NotADelta);
    }
    if take(&mut d, 32, "base digest")? != &Sha256::digest(base)[..] {
        return Err(DeltaError::OtherBase);
    }
    let len = u64::from_be_bytes(take(&mut d, 8, "length")?.try_into().expect("8 bytes"));
    if len > MAX_BUNDLE as u64 {
        return Err(DeltaError::TooLarge);
    }
    let digest: [u8; 32] = take(&mut d, 32, "digest")?.try_into().expect("32 bytes");
    let old = lines(base);
    let mut out = Vec::with_capacity(len as usize);
    while !d.is_empty() {
        match take(&mut d, 1, "op")?[0] {
            b'C' => {
                let (first, n) = (u32_at(&mut d, "copy")?, u32_at(&mut d, "copy")?);
                let copied =
                    first.checked_add(n).and_then(|end| old.get(first..end)).ok_or(DeltaError::Malformed("a copy beyond the base"))?;
                for l in copied {
                    if out.len() + l.len() > len as usize {
                        return Err(DeltaError::Mismatch);
                    }
                    out.extend_from_slice(l);
                }
            }
            b'I' => {
                let n = u32_at(&mut d, "insert")?;
                let bytes = take(&mut d, n, "insert")?;
                if out.len() + bytes.len() > len as usize {
                    return Err(DeltaError::Mismatch);
                }
                out.extend_from_slice(bytes);
            }
            _ => return Err(DeltaError::Malformed("an unknown op")),
        }
    }
    if out.len() as u64 != len || Sha256::digest(&out)[..] != digest {
        return Err(DeltaError::Mismatch);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peers(n: usize, skip: Option<usize>, extra: Option<usize>) -> Vec<u8> {
        let mut s = String::from("[Interface]\nPrivateKey = x\n");
        for i in 0..n {
            if Some(i) == skip {
                continue;
            }
            s.push_str(&format!(
                "\n# node-{i}\n[Peer]\nPublicKey = key{i}\nAllowedIPs = 10.0.{}.{}/32\nPersistentKeepalive = 25\n",
                i / 256,
                i % 256
            ));
            if Some(i) == extra {
                s.push_str("\n# late-1\n[Peer]\nPublicKey = late\nAllowedIPs = 10.9.9.9/32\nPersistentKeepalive = 25\n");
            }
        }
        s.into_bytes()
    }

    #[test]
    fn one_peer_more_or_less_is_a_small_delta_that_rebuilds_the_exact_bytes() {
        let base = peers(5000, None, None);
        for new in [peers(5000, None, Some(2500)), peers(5000, Some(17), None), peers(5001, None, None), base.clone()] {
            let d = make(&base, &new);
            assert!(d.len() < 400, "{} bytes of delta for a {} byte bundle", d.len(), new.len());
            assert_eq!(apply(&base, &d).unwrap(), new);
        }
    }

    #[test]
    fn a_delta_applies_only_to_its_base_and_only_as_it_was_made() {
        let (base, new) = (peers(50, None, None), peers(50, None, Some(3)));
        let d = make(&base, &new);
        assert_eq!(apply(&peers(51, None, None), &d), Err(DeltaError::OtherBase));
        assert_eq!(apply(&base, b"TRB1...."), Err(DeltaError::NotADelta));
        // Any byte changed: refused (malformed, or not the bytes it names), or, where the change
        // copies the same bytes from elsewhere, the very same bundle.
        let mut refused = 0;
        for i in 0..d.len() {
            let mut bad = d.clone();
            bad[i] ^= 0x40;
            match apply(&base, &bad) {
                Ok(b) => assert_eq!(b, new, "byte {i} changed gave other bytes"),
                Err(_) => refused += 1,
            }
        }
        assert!(refused > d.len() / 2, "{refused} of {}", d.len());
        // A copy beyond the base.
        let mut far = d[..76].to_vec();
        far.extend_from_slice(b"C\0\0\xff\xff\0\0\0\x01");
        assert_eq!(apply(&base, &far), Err(DeltaError::Malformed("a copy beyond the base")));
        assert!(matches!(apply(&base, &d[..80]), Err(DeltaError::Malformed(_))), "a cut delta");
    }

    /// Timing of a delta of a bundle the size of the largest at 10,000 nodes (2.8 MB):
    /// `cargo test --release -p trellis-core --lib delta::tests::timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn timing() {
        let base = peers(20_000, None, None);
        let new = peers(20_000, None, Some(10_000));
        let t = std::time::Instant::now();
        let mut d = Vec::new();
        for _ in 0..10 {
            d = make(&base, &new);
        }
        let made = t.elapsed() / 10;
        let t = std::time::Instant::now();
        for _ in 0..10 {
            apply(&base, &d).unwrap();
        }
        eprintln!("{} bytes: make {made:?}, apply {:?}, delta {} bytes", base.len(), t.elapsed() / 10, d.len());
    }

    proptest::proptest! {
        #[test]
        fn any_edit_rebuilds_exactly(base in proptest::collection::vec(proptest::sample::select(vec![&b"a\n"[..], b"b\n", b"[Peer]\n", b"x", b"\n", b"key1\n", b"key2\n"]), 0..200),
                                     edits in proptest::collection::vec((0usize..200, 0usize..4, proptest::sample::select(vec![&b"c\n"[..], b"a\n", b"[Peer]\n", b"zz"])), 0..10)) {
            let base: Vec<u8> = base.concat();
            let mut new = base.clone();
            for (at, cut, ins) in edits {
                let at = at.min(new.len());
                let end = (at + cut).min(new.len());
                new.splice(at..end, ins.iter().copied());
            }
            let d = make(&base, &new);
            proptest::prop_assert_eq!(apply(&base, &d).unwrap(), new);
        }
    }
}
