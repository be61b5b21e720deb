//! Bundle deltas (ADR 0033): a node that holds a bundle gets the next one as the files that
//! changed, under the new bundle's own signed head. The head is exactly the one the whole bundle
//! carries (magic, signature, manifest: every path, mode, SHA-256 and length), so the signature
//! covers the result and nothing else: the node verifies the head as it verifies any bundle
//! (rollback, freeze, wrong node and mesh), then builds each file from what it holds, and a file
//! that does not come out with the digest the signed manifest names refuses the delta whole.
//!
//! Wire form: `TRD2` | u32 head length | head | u64 base version | [8] start of the base's
//! content digest | one op per file of the manifest, in its order:
//! - `K`: the node holds this file (this path, this SHA-256); nothing follows, nothing is read;
//! - `W` | the content (as long as the manifest says): the file whole;
//! - `E` | [32] SHA-256 of the held file it edits | u32 length | edits: copy and insert ops over
//!   the held file's lines, each `C` u32 first line, u32 lines, or `I` u32 length, bytes. Lines
//!   are the bytes up to and including each `\n` or `,` (the last may lack one).
//!
//! Integers are big endian. The base is the bundle the node named in `If-None-Match`; the node
//! also names the digests of the files it holds, so a delta can be made from any version it
//! holds without the controller keeping old versions (it keeps, for a large file, the edits
//! from the version before).
//!
//! Edits are found by lines and runs of lines: every run of [`RUN`] consecutive lines of the base
//! that starts at an anchor line (about one in four, chosen by content) is indexed by hash; the
//! new content is walked line by line, continuing a copy while the lines agree and otherwise
//! looking its next run up in the index. Linear in the sizes, and exact for the changes a
//! recompile makes (blocks of peers, records and rules added, removed or changed).

use std::collections::HashMap;

use crate::bundle::{Content, MAX_BUNDLE};

pub const MAGIC: &[u8; 4] = b"TRD2";
/// Lines per indexed run.
const RUN: usize = 4;

/// Why a delta was refused: each with its own sentence. A refused delta changes nothing; the
/// node asks for the whole bundle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeltaError {
    NotADelta,
    /// The delta was made from another bundle than the one held.
    OtherBase {
        version: u64,
    },
    /// A file the delta keeps or edits is not held with the digest it names.
    NotHeld {
        path: String,
    },
    Malformed(&'static str),
    TooLarge,
    /// A file built from the delta is not the one the signed manifest names.
    Mismatch {
        path: String,
    },
}

impl std::fmt::Display for DeltaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeltaError::NotADelta => f.write_str("this is not a bundle delta"),
            DeltaError::OtherBase { version } => {
                write!(f, "the delta was made from version {version} with other content than the bundle this node holds")
            }
            DeltaError::NotHeld { path } => write!(f, "the delta builds {path} from a version of it this node does not hold"),
            DeltaError::Malformed(what) => write!(f, "the bundle delta is malformed: {what}"),
            DeltaError::TooLarge => write!(f, "the bundle the delta makes is over the bound of {MAX_BUNDLE} bytes"),
            DeltaError::Mismatch { path } => write!(f, "{path} built from the delta does not match its SHA-256 in the signed manifest"),
        }
    }
}

impl std::error::Error for DeltaError {}

/// What a delta says of one file of the new bundle, as the controller writes it.
pub enum Op<'a, C> {
    /// The node holds it.
    Keep,
    /// The content, whole.
    Whole(&'a C),
    /// The edits from the held file whose SHA-256 is `base`.
    Edits { base: [u8; 32], edits: &'a [u8] },
}

/// The base a delta applies to: the version held and the start of its content digest.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Base {
    pub version: u64,
    pub digest: [u8; 8],
}

impl Base {
    pub fn of(version: u64, content_digest: &[u8; 32]) -> Base {
        Base { version, digest: content_digest[..8].try_into().expect("8 bytes") }
    }
}

/// A delta: the new bundle's signed head, the base, and one op per file of the head's manifest.
pub fn encode<C: Content>(head: &[u8], base: Base, ops: &[Op<'_, C>]) -> Vec<u8> {
    let mut out = frame(head, base);
    for op in ops {
        out.extend_from_slice(&op_head(op));
        if let Op::Whole(c) = op {
            c.write_to(&mut out);
        }
    }
    out
}

/// A delta's frame: magic, the head and the base; the ops follow.
pub fn frame(head: &[u8], base: Base) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + 4 + head.len() + 16);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&(head.len() as u32).to_be_bytes());
    out.extend_from_slice(head);
    out.extend_from_slice(&base.version.to_be_bytes());
    out.extend_from_slice(&base.digest);
    out
}

/// The bytes of an op before a whole file's content (which follows it as it is held): `K`,
/// `W`, or an `E` with its base, length and edits.
pub fn op_head<C>(op: &Op<'_, C>) -> Vec<u8> {
    match op {
        Op::Keep => vec![b'K'],
        Op::Whole(_) => vec![b'W'],
        Op::Edits { base, edits } => {
            let mut out = Vec::with_capacity(37 + edits.len());
            out.push(b'E');
            out.extend_from_slice(base);
            out.extend_from_slice(&(edits.len() as u32).to_be_bytes());
            out.extend_from_slice(edits);
            out
        }
    }
}

/// What a delta says of one file of the new bundle: keep it when the node holds it (`held` says
/// whether it holds a content with this SHA-256), its edits when it holds their base and they are
/// shorter than the content, else whole.
pub fn op<'a, C: Content>(sha256: &[u8; 32], content: &'a C, edits: Option<&'a Edits>, held: &impl Fn(&[u8; 32]) -> bool) -> Op<'a, C> {
    if held(sha256) {
        return Op::Keep;
    }
    match edits.filter(|e| e.edits.len() + 36 < content.byte_len() && held(&e.base)) {
        Some(e) => Op::Edits { base: e.base, edits: &e.edits },
        None => Op::Whole(content),
    }
}

/// A large file's edits from the version of it before: the base's SHA-256 and the ops.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Edits {
    pub base: [u8; 32],
    pub edits: bytes::Bytes,
}

/// A delta as read, before its head is verified: the head, the base, and the ops (read against
/// the verified manifest by [`Ops::next`]).
pub struct Parsed<'a> {
    pub head: &'a [u8],
    pub base: Base,
    pub ops: Ops<'a>,
}

/// A file's op as read.
pub enum Read<'a> {
    Keep,
    Whole(&'a [u8]),
    Edits { base: [u8; 32], edits: &'a [u8] },
}

/// The ops of a delta, read one file at a time (a `W` is as long as the manifest says).
pub struct Ops<'a> {
    rest: &'a [u8],
}

impl<'a> Ops<'a> {
    /// The op of the next file, whose manifest length is `len`.
    pub fn next(&mut self, len: usize) -> Result<Read<'a>, DeltaError> {
        let b = &mut self.rest;
        Ok(match take(b, 1, "a file's op is missing")?[0] {
            b'K' => Read::Keep,
            b'W' => Read::Whole(take(b, len, "a file is shorter than the manifest says")?),
            b'E' => {
                let base = take(b, 32, "an edit's base is cut")?.try_into().expect("32 bytes");
                let n = u32_at(b, "an edit's length is cut")?;
                Read::Edits { base, edits: take(b, n, "an edit is cut")? }
            }
            _ => return Err(DeltaError::Malformed("an unknown op")),
        })
    }

    /// Whether every op was read.
    pub fn done(&self) -> bool {
        self.rest.is_empty()
    }
}

/// Reads a delta's frame: its head (not yet verified), base and ops.
pub fn parse(delta: &[u8]) -> Result<Parsed<'_>, DeltaError> {
    if delta.len() > MAX_BUNDLE {
        return Err(DeltaError::TooLarge);
    }
    let mut d = delta;
    if take(&mut d, 4, "magic").ok() != Some(&MAGIC[..]) {
        return Err(DeltaError::NotADelta);
    }
    let n = u32_at(&mut d, "the head's length is cut")?;
    let head = take(&mut d, n, "the head is cut")?;
    let version = u64::from_be_bytes(take(&mut d, 8, "the base is cut")?.try_into().expect("8 bytes"));
    let digest = take(&mut d, 8, "the base is cut")?.try_into().expect("8 bytes");
    Ok(Parsed { head, base: Base { version, digest }, ops: Ops { rest: d } })
}

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

/// The edits that turn the content `base` into `new`: copy and insert ops over lines.
pub fn edits(base: &[u8], new: &[u8]) -> Vec<u8> {
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
    let mut insert: Vec<u8> = Vec::new();
    let flush_insert = |out: &mut Vec<u8>, insert: &mut Vec<u8>| {
        if !insert.is_empty() {
            out.push(b'I');
            out.extend_from_slice(&(insert.len() as u32).to_be_bytes());
            out.append(insert);
        }
    };
    // Where the last copy ended in the base: copies only go forward from it, so the edits say
    // in order where the two contents differ (their hunks, which the agent reads by, ADR 0035).
    let (mut j, mut at, mut floor) = (0usize, Some(0usize), 0usize);
    while j < new_lines.len() {
        // Continue the copy while the lines agree; else find the next run in the base.
        let start = match at {
            Some(i) if i < old.len() && old_h[i] == new_h[j] && old[i] == new_lines[j] => Some(i),
            _ if j + RUN <= new_lines.len() && anchor(new_h[j]) => {
                index.get(&run_key(&new_h, j)).map(|&i| i as usize).filter(|&i| i >= floor && old[i..i + RUN] == new_lines[j..j + RUN])
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
                floor = i + n;
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

/// Rebuilds a content from the one held (`base`) and its edits, never beyond `len` bytes (what
/// the signed manifest says); the caller checks the result against the manifest's digest.
pub fn rebuild(base: &[u8], edits: &[u8], len: usize, path: &str) -> Result<Vec<u8>, DeltaError> {
    rebuild_with_hunks(base, edits, len, path).map(|(out, _)| out)
}

/// Where a content built from edits differs from its base: a byte range of the base and the
/// range of the result that takes its place. Outside a content's hunks, the base and the result
/// are the same bytes in the same order, so a reader of the result need look only at the hunks
/// (and as much of the bytes around them as its own units take) to know what changed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hunk {
    pub old: std::ops::Range<usize>,
    pub new: std::ops::Range<usize>,
}

/// As [`rebuild`], with the hunks the edits make, in order; `None` for the hunks when the edits
/// copy the base out of order (a delta the controller makes never does, but any is valid).
pub fn rebuild_with_hunks(base: &[u8], edits: &[u8], len: usize, path: &str) -> Result<(Vec<u8>, Option<Vec<Hunk>>), DeltaError> {
    let mismatch = || DeltaError::Mismatch { path: path.to_string() };
    let mut d = edits;
    let old = lines(base);
    let offset = |i: usize| old.get(i).map_or(base.len(), |l| l.as_ptr() as usize - base.as_ptr() as usize);
    let mut out = Vec::with_capacity(len);
    let mut hunks = Some(Vec::new());
    // Where the last copy ended, in the base and in the result.
    let (mut old_at, mut new_at) = (0usize, 0usize);
    while !d.is_empty() {
        match take(&mut d, 1, "op")?[0] {
            b'C' => {
                let (first, n) = (u32_at(&mut d, "copy")?, u32_at(&mut d, "copy")?);
                let copied =
                    first.checked_add(n).and_then(|end| old.get(first..end)).ok_or(DeltaError::Malformed("a copy beyond the base"))?;
                if n > 0 {
                    let from = offset(first);
                    match hunks.as_mut() {
                        Some(h) if from >= old_at => {
                            if from > old_at || out.len() > new_at {
                                h.push(Hunk { old: old_at..from, new: new_at..out.len() });
                            }
                        }
                        _ => hunks = None,
                    }
                    old_at = offset(first + n);
                }
                for l in copied {
                    if out.len() + l.len() > len {
                        return Err(mismatch());
                    }
                    out.extend_from_slice(l);
                }
                if n > 0 {
                    new_at = out.len();
                }
            }
            b'I' => {
                let n = u32_at(&mut d, "insert")?;
                let bytes = take(&mut d, n, "insert")?;
                if out.len() + bytes.len() > len {
                    return Err(mismatch());
                }
                out.extend_from_slice(bytes);
            }
            _ => return Err(DeltaError::Malformed("an unknown edit")),
        }
    }
    if out.len() != len {
        return Err(mismatch());
    }
    if let Some(h) = hunks.as_mut() {
        if old_at < base.len() || new_at < out.len() {
            h.push(Hunk { old: old_at..base.len(), new: new_at..out.len() });
        }
    }
    Ok((out, hunks))
}

/// The parts of hunk `h` where `old` and `new` differ: its bytes the same at either end left out,
/// and, for a hunk of up to a few hundred units either side, the units both have in the same
/// order (their longest common run) left out between. In order; none when the bytes are the same.
fn differing(old: &[u8], new: &[u8], h: &Hunk, seps: &[u8]) -> Vec<Hunk> {
    let (mut o, mut n) = (h.old.clone(), h.new.clone());
    let same = old[o.clone()].iter().zip(&new[n.clone()]).take_while(|(a, b)| a == b).count();
    (o.start, n.start) = (o.start + same, n.start + same);
    let same = old[o.clone()].iter().rev().zip(new[n.clone()].iter().rev()).take_while(|(a, b)| a == b).count();
    (o.end, n.end) = (o.end - same, n.end - same);
    if o.is_empty() && n.is_empty() {
        return Vec::new();
    }
    let units = |t: &[u8], r: &std::ops::Range<usize>| {
        let mut list = Vec::new();
        let mut start = r.start;
        for at in r.clone() {
            if seps.contains(&t[at]) {
                list.push(start..at + 1);
                start = at + 1;
            }
        }
        if start < r.end {
            list.push(start..r.end);
        }
        list
    };
    let (a, b) = (units(old, &o), units(new, &n));
    let (la, lb) = (a.len(), b.len());
    if la < 2 && lb < 2 || la * lb > 1 << 16 {
        return vec![Hunk { old: o, new: n }];
    }
    // The longest common subsequence of units, from the end: lcs[i][j] for a[i..] and b[j..].
    let w = lb + 1;
    let eq = |i: usize, j: usize| old[a[i].clone()] == new[b[j].clone()];
    let mut lcs = vec![0u32; (la + 1) * w];
    for i in (0..la).rev() {
        for j in (0..lb).rev() {
            lcs[i * w + j] = if eq(i, j) { lcs[(i + 1) * w + j + 1] + 1 } else { lcs[(i + 1) * w + j].max(lcs[i * w + j + 1]) };
        }
    }
    let at_old = |i: usize| a.get(i).map_or(o.end, |u| u.start);
    let at_new = |j: usize| b.get(j).map_or(n.end, |u| u.start);
    let mut out = Vec::new();
    let mut cur: Option<Hunk> = None;
    let (mut i, mut j) = (0, 0);
    while i < la || j < lb {
        if i < la && j < lb && eq(i, j) {
            out.extend(cur.take());
            (i, j) = (i + 1, j + 1);
            continue;
        }
        let c = cur.get_or_insert_with(|| Hunk { old: at_old(i)..at_old(i), new: at_new(j)..at_new(j) });
        if j == lb || (i < la && lcs[(i + 1) * w + j] >= lcs[i * w + j + 1]) {
            c.old.end = a[i].end;
            i += 1;
        } else {
            c.new.end = b[j].end;
            j += 1;
        }
    }
    out.extend(cur);
    out
}

/// A place where two texts differ, widened to whole units of their reader: the old text's range
/// and the new's. Outside its regions, the two texts are the same bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Region {
    pub old: std::ops::Range<usize>,
    pub new: std::ops::Range<usize>,
}

/// The hunks between `old` and `new` (in order, as [`rebuild_with_hunks`] gives them) widened
/// until each region starts and ends where a unit of the reader may start, in both texts, and
/// merged where they meet. Units start only after a byte of `seps` (and at either end of a
/// text); `boundary(text, at)` says whether one starts at such a place `at` of `text`. A region
/// grows over the bytes around it, which are the same in both texts, so the two stay aligned.
/// `None` when the hunks do not fit the texts (out of order, or beyond them).
pub fn widen(old: &[u8], new: &[u8], hunks: &[Hunk], seps: &[u8], boundary: impl Fn(&[u8], usize) -> bool) -> Option<Vec<Region>> {
    let fits = |t: &[u8], at: usize| at == 0 || at == t.len() || (seps.contains(&t[at - 1]) && boundary(t, at));
    // Edits may send again units the base has (an insert runs on to the next run of lines it
    // finds in the base): first, each hunk is cut to where its units differ.
    let mut hunks_in: Vec<Hunk> = Vec::with_capacity(hunks.len());
    for h in hunks {
        if h.old.start > h.old.end || h.new.start > h.new.end || h.old.end > old.len() || h.new.end > new.len() {
            return None;
        }
        hunks_in.extend(differing(old, new, h, seps));
    }
    let hunks = &hunks_in;
    let mut out: Vec<Region> = Vec::with_capacity(hunks.len());
    let mut i = 0;
    while i < hunks.len() {
        let h = &hunks[i];
        i += 1;
        let mut r = Region { old: h.old.clone(), new: h.new.clone() };
        if let Some(p) = out.last() {
            if r.old.start < p.old.end || r.new.start < p.new.end {
                return None;
            }
        }
        // Left, over the bytes shared with the region before (or the texts' start).
        loop {
            if let Some(p) = out.last() {
                if r.old.start == p.old.end {
                    let p = out.pop().expect("a region before");
                    (r.old.start, r.new.start) = (p.old.start, p.new.start);
                    break;
                }
            }
            if fits(old, r.old.start) && fits(new, r.new.start) {
                break;
            }
            if r.old.start == 0 || r.new.start == 0 {
                return None;
            }
            r.old.start -= 1;
            r.new.start -= 1;
        }
        // Right, over the bytes shared with the next hunk (or the texts' end), taking in each
        // hunk it meets.
        loop {
            if let Some(next) = hunks.get(i).filter(|n| r.old.end >= n.old.start || r.new.end >= n.new.start) {
                if r.old.end != next.old.start || r.new.end != next.new.start || next.old.end > old.len() || next.new.end > new.len() {
                    return None;
                }
                (r.old.end, r.new.end) = (next.old.end.max(r.old.end), next.new.end.max(r.new.end));
                i += 1;
                continue;
            }
            if fits(old, r.old.end) && fits(new, r.new.end) {
                break;
            }
            if r.old.end == old.len() || r.new.end == new.len() {
                return None;
            }
            r.old.end += 1;
            r.new.end += 1;
        }
        out.push(r);
    }
    Some(out)
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
    fn one_peer_more_or_less_is_small_edits_that_rebuild_the_exact_bytes() {
        let base = peers(5000, None, None);
        for new in [peers(5000, None, Some(2500)), peers(5000, Some(17), None), peers(5001, None, None), base.clone()] {
            let d = edits(&base, &new);
            assert!(d.len() < 300, "{} bytes of edits for a {} byte file", d.len(), new.len());
            assert_eq!(rebuild(&base, &d, new.len(), "f").unwrap(), new);
        }
    }

    #[test]
    fn edits_rebuild_only_what_they_were_made_for() {
        let (base, new) = (peers(50, None, None), peers(50, None, Some(3)));
        let d = edits(&base, &new);
        // Against a shorter base the copies reach beyond it, or make other bytes.
        assert!(rebuild(&peers(3, None, None), &d, new.len(), "f").is_err());
        // Never longer than the manifest says.
        assert_eq!(rebuild(&base, &d, new.len() - 1, "f"), Err(DeltaError::Mismatch { path: "f".into() }));
        let mut far = b"C\0\0\xff\xff\0\0\0\x01".to_vec();
        far.extend_from_slice(&d);
        assert_eq!(rebuild(&base, &far, new.len(), "f"), Err(DeltaError::Malformed("a copy beyond the base")));
        assert!(matches!(rebuild(&base, &d[..d.len() - 3], new.len(), "f"), Err(DeltaError::Malformed(_) | DeltaError::Mismatch { .. })));
    }

    #[test]
    fn a_frame_reads_back_and_refuses_what_is_not_one() {
        let whole = bytes::Bytes::from_static(b"new content");
        let d = encode(
            b"HEAD",
            Base { version: 7, digest: [1; 8] },
            &[Op::Keep, Op::Whole(&whole), Op::Edits { base: [2; 32], edits: b"I\0\0\0\x01x" }],
        );
        let mut p = parse(&d).unwrap();
        assert_eq!((p.head, p.base), (&b"HEAD"[..], Base { version: 7, digest: [1; 8] }));
        assert!(matches!(p.ops.next(0), Ok(Read::Keep)));
        assert!(matches!(p.ops.next(11), Ok(Read::Whole(b"new content"))));
        assert!(matches!(p.ops.next(1), Ok(Read::Edits { base, .. }) if base == [2; 32]));
        assert!(p.ops.done());
        assert!(matches!(parse(b"TRB1...."), Err(DeltaError::NotADelta)));
        assert!(matches!(parse(&d[..10]), Err(DeltaError::Malformed(_))));
        let mut p = parse(&d).unwrap();
        p.ops.next(0).unwrap();
        assert!(matches!(p.ops.next(1000), Err(DeltaError::Malformed(_))), "a whole file longer than sent");
    }

    /// Timing of the edits of a file the size of the largest at 10,000 nodes (2.8 MB):
    /// `cargo test --release -p trellis-core --lib delta::tests::timing -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn timing() {
        let base = peers(20_000, None, None);
        let new = peers(20_000, None, Some(10_000));
        let t = std::time::Instant::now();
        let mut d = Vec::new();
        for _ in 0..10 {
            d = edits(&base, &new);
        }
        let made = t.elapsed() / 10;
        let t = std::time::Instant::now();
        for _ in 0..10 {
            rebuild(&base, &d, new.len(), "f").unwrap();
        }
        eprintln!("{} bytes: edits {made:?}, rebuild {:?}, {} bytes of edits", base.len(), t.elapsed() / 10, d.len());
    }

    /// Checks that `base` and `new` are the same bytes outside `places` (ranges of each, in
    /// order) and that `base` with each place's range of `new` put in gives `new`.
    pub(crate) fn put_in(
        base: &[u8],
        new: &[u8],
        places: impl Iterator<Item = (std::ops::Range<usize>, std::ops::Range<usize>)>,
    ) -> Result<(), String> {
        let (mut old_at, mut new_at, mut patched) = (0, 0, Vec::new());
        for (old, into) in places {
            if old.start < old_at || into.start < new_at {
                return Err(format!("{old:?} / {into:?} out of order"));
            }
            if base[old_at..old.start] != new[new_at..into.start] {
                return Err(format!("the texts differ before {old:?} / {into:?}"));
            }
            patched.extend_from_slice(&base[old_at..old.start]);
            patched.extend_from_slice(&new[into.clone()]);
            (old_at, new_at) = (old.end, into.end);
        }
        if base[old_at..] != new[new_at..] {
            return Err("the texts differ after the last place".into());
        }
        patched.extend_from_slice(&base[old_at..]);
        if patched != new {
            return Err("the base with the places put in is not the result".into());
        }
        Ok(())
    }

    proptest::proptest! {
        #[test]
        fn any_edit_rebuilds_exactly(base in proptest::collection::vec(proptest::sample::select(vec![&b"a\n"[..], b"b\n", b"[Peer]\n", b"x", b"\n", b"key1\n", b"key2\n"]), 0..200),
                                     changes in proptest::collection::vec((0usize..200, 0usize..4, proptest::sample::select(vec![&b"c\n"[..], b"a\n", b"[Peer]\n", b"zz"])), 0..10)) {
            let base: Vec<u8> = base.concat();
            let mut new = base.clone();
            for (at, cut, ins) in changes {
                let at = at.min(new.len());
                let end = (at + cut).min(new.len());
                new.splice(at..end, ins.iter().copied());
            }
            let d = edits(&base, &new);
            let (built, hunks) = rebuild_with_hunks(&base, &d, new.len(), "f").unwrap();
            proptest::prop_assert_eq!(&built, &new);
            // The edits made here copy in order, so the hunks are given; outside them the base
            // and the result are the same bytes, and the base with each hunk's old range put in
            // place of its new one gives the result.
            let hunks = hunks.expect("in-order copies give hunks");
            proptest::prop_assert!(hunks.iter().all(|h| !h.old.is_empty() || !h.new.is_empty()), "an empty hunk in {:?}", hunks);
            put_in(&base, &new, hunks.iter().map(|h| (h.old.clone(), h.new.clone()))).map_err(proptest::test_runner::TestCaseError::fail)?;
            // Widened to whole lines: in order, apart, each starting and ending at a line's
            // start in both, the same outside, and the base with them put in gives the result.
            let regions = widen(&base, &new, &hunks, b"\n", |_, _| true).expect("hunks that fit");
            let line_start = |t: &[u8], at: usize| at == 0 || at == t.len() || t[at - 1] == b'\n';
            for (r, next) in regions.iter().zip(regions.iter().skip(1)) {
                proptest::prop_assert!(next.old.start > r.old.end, "{:?}", regions);
            }
            for r in &regions {
                proptest::prop_assert!(line_start(&base, r.old.start) && line_start(&base, r.old.end), "{:?}", r);
                proptest::prop_assert!(line_start(&new, r.new.start) && line_start(&new, r.new.end), "{:?}", r);
            }
            put_in(&base, &new, regions.iter().map(|r| (r.old.clone(), r.new.clone()))).map_err(proptest::test_runner::TestCaseError::fail)?;
        }
    }

    /// Edits that copy the base out of order rebuild it, and give no hunks.
    #[test]
    fn copies_out_of_order_give_no_hunks() {
        let base = b"a\nb\nc\n";
        let mut d = Vec::new();
        for (first, n) in [(2u32, 1u32), (0, 2)] {
            d.push(b'C');
            d.extend_from_slice(&first.to_be_bytes());
            d.extend_from_slice(&n.to_be_bytes());
        }
        let (built, hunks) = rebuild_with_hunks(base, &d, 6, "f").unwrap();
        assert_eq!(built, b"c\na\nb\n");
        assert_eq!(hunks, None);
        // In order: a kept, b replaced by x, c kept.
        let mut d = vec![b'C', 0, 0, 0, 0, 0, 0, 0, 1, b'I', 0, 0, 0, 2, b'x', b'\n'];
        d.extend_from_slice(&[b'C', 0, 0, 0, 2, 0, 0, 0, 1]);
        let (built, hunks) = rebuild_with_hunks(base, &d, 6, "f").unwrap();
        assert_eq!(built, b"a\nx\nc\n");
        assert_eq!(hunks, Some(vec![Hunk { old: 2..4, new: 2..4 }]));
    }
}
