//! The signed bundles as held and sent: `Published` (a node's current bundle, its signed head
//! and the compiled contents it shares with other bundles, and the delta from the version before
//! for a large one) and `Body`, the chunks of one answer, sent from those shared pieces without a
//! copy per bundle.

use std::sync::Arc;

use trellis_core::Text;

/// One node's current bundle, signed.
pub struct Published {
    pub version: i64,
    /// The digest of its content as signed (`trellis_core::bundle::content_digest`): with the
    /// version, what its ETag names.
    pub digest: [u8; 32],
    pub signed: Signed,
    /// For each large file that changed from the version before (by its place in the
    /// manifest), the edits from that version's file, made when a node that holds it first asks:
    /// it gets these in its delta instead of the file (ADR 0033).
    pub edits: Vec<(usize, EditsFrom)>,
}

/// A large file's edits from the version of it before, made once, when first asked for: a
/// publish run keeps the file before (its compiled text, sharing the pieces that did not change)
/// and signs on; the node's request makes the edits (a few milliseconds a megabyte) and the file
/// before is let go.
pub struct EditsFrom {
    /// The SHA-256 of the file before: a node that holds it can take the edits.
    pub base: [u8; 32],
    from: std::sync::Mutex<Option<Text>>,
    made: std::sync::OnceLock<Option<trellis_core::delta::Edits>>,
}

impl EditsFrom {
    pub fn new(base: [u8; 32], from: Text) -> EditsFrom {
        EditsFrom { base, from: std::sync::Mutex::new(Some(from)), made: std::sync::OnceLock::new() }
    }

    /// The edits that turn the file before into `to`, made at the first call.
    pub fn edits(&self, to: &Text) -> Option<&trellis_core::delta::Edits> {
        self.made
            .get_or_init(|| {
                let from = self.from.lock().expect("edits").take()?;
                let (mut a, mut b) = (Vec::with_capacity(from.len()), Vec::with_capacity(to.len()));
                trellis_core::bundle::Content::write_to(&from, &mut a);
                trellis_core::bundle::Content::write_to(to, &mut b);
                Some(trellis_core::delta::Edits { base: self.base, edits: trellis_core::delta::edits(&a, &b).into() })
            })
            .as_ref()
    }
}

/// Files from this size on that changed are also kept as the edits from the version before;
/// smaller ones cost less to send whole than to diff. At 16 KiB a group move sent its 40
/// agents 17 KiB each on the 10,000-node bench mesh (their rulesets and zones of a few KiB,
/// whole); making the edits costs about what hashing the file does.
pub const EDITS_FROM: usize = 2 * 1024;

/// A signed bundle as held: the head (magic, signature, manifest) and the files' contents in
/// manifest order, as the compiled output holds them. A content is made of pieces shared with
/// other files (a peer's `[Peer]` section, a rule's filter block, a module's zone records): the
/// bundles hold them once, with the compiled output, and `Body` sends them from there. None of
/// them is copied into a buffer per file or per bundle: ten thousand wireguard.conf files
/// naming the same few thousand peers would hold about 190 MiB of copies of a few MiB.
pub type Signed = trellis_core::bundle::Signed<Text>;

/// Pieces from this size on are sent from where the compiled output holds them; smaller ones
/// are gathered into the buffer of the answer that sends them.
const SHARED_PIECE: usize = 4096;

/// The most bytes of small pieces one chunk of an answer gathers.
const CHUNK: usize = 16 * 1024;

struct ArcStr(Arc<str>);

impl AsRef<[u8]> for ArcStr {
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// One part of an answer's bytes: bytes of its own (the head, a delta's frame and ops), sent as
/// a chunk of their own or, when small, gathered with what follows; or a content of the bundle,
/// by its place, sent from where it is held.
pub enum Part {
    Alone(bytes::Bytes),
    Small(bytes::Bytes),
    Content(usize),
}

/// A bundle's bytes in order, as the chunks of one answer: the head, then each large piece as it
/// is held (no copy) and the runs of small pieces between them gathered into buffers of at most
/// `CHUNK` bytes. What it gathers lives while the answer is sent, not while the bundle is held.
/// A delta (ADR 0033) is sent the same way: its frame, and each file sent whole from where the
/// bundle holds it.
pub struct Body {
    bundle: Arc<Published>,
    parts: Vec<Part>,
    /// The next piece to send: a part, a chunk of it and a piece of that.
    part: usize,
    chunk: usize,
    piece: usize,
    left: usize,
}

impl Body {
    pub fn new(bundle: Arc<Published>) -> Body {
        let mut parts = vec![Part::Alone(bundle.signed.head.clone())];
        parts.extend((0..bundle.signed.contents.len()).map(Part::Content));
        Body::of_parts(bundle, parts)
    }

    /// The bytes of `parts`, contents taken from `bundle`.
    pub fn of_parts(bundle: Arc<Published>, parts: Vec<Part>) -> Body {
        let left = parts
            .iter()
            .map(|p| match p {
                Part::Alone(b) | Part::Small(b) => b.len(),
                Part::Content(i) => bundle.signed.contents[*i].len(),
            })
            .sum();
        Body { bundle, parts, part: 0, chunk: 0, piece: 0, left }
    }

    /// The bytes not sent yet.
    pub fn remaining(&self) -> usize {
        self.left
    }
}

impl Iterator for Body {
    type Item = bytes::Bytes;

    fn next(&mut self) -> Option<bytes::Bytes> {
        let signed = &self.bundle.signed;
        let mut run = bytes::BytesMut::new();
        while let Some(part) = self.parts.get(self.part) {
            let piece: &[u8] = match part {
                Part::Alone(b) => {
                    if !run.is_empty() {
                        break;
                    }
                    self.part += 1;
                    if b.is_empty() {
                        continue;
                    }
                    self.left -= b.len();
                    return Some(b.clone());
                }
                Part::Small(b) => b,
                Part::Content(i) => {
                    let Some(chunk) = signed.contents[*i].chunks().get(self.chunk) else {
                        (self.part, self.chunk, self.piece) = (self.part + 1, 0, 0);
                        continue;
                    };
                    let Some(piece) = chunk.pieces().get(self.piece) else {
                        (self.chunk, self.piece) = (self.chunk + 1, 0);
                        continue;
                    };
                    if piece.len() >= SHARED_PIECE {
                        if !run.is_empty() {
                            break;
                        }
                        self.piece += 1;
                        self.left -= piece.len();
                        return Some(bytes::Bytes::from_owner(ArcStr(piece.clone())));
                    }
                    piece.as_bytes()
                }
            };
            if run.len() + piece.len() > CHUNK && !run.is_empty() {
                break;
            }
            if run.capacity() == 0 {
                run.reserve(self.left.min(CHUNK).max(piece.len()));
            }
            run.extend_from_slice(piece);
            match part {
                Part::Small(_) => self.part += 1,
                _ => self.piece += 1,
            }
        }
        self.left -= run.len();
        (!run.is_empty()).then(|| run.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn piece(c: char, n: usize) -> Arc<str> {
        Arc::from(c.to_string().repeat(n).as_str())
    }

    /// A large file's edits are made at the first ask, from the file before, which is let go;
    /// they rebuild the file exactly.
    #[test]
    fn edits_are_made_once_when_first_asked_and_rebuild_the_file() {
        let lines = |n: usize| -> Vec<Arc<str>> { (0..n).map(|i| Arc::from(format!("peer-{i}\n").as_str())).collect() };
        let (before, after) = (Text::from_pieces(lines(3000)), Text::from_pieces(lines(3001)));
        let e = EditsFrom::new([9; 32], before.clone());
        let made = e.edits(&after).expect("made").clone();
        assert!(e.from.lock().unwrap().is_none(), "the file before is let go");
        assert_eq!(e.edits(&after), Some(&made), "made once");
        assert_eq!(made.base, [9; 32]);
        assert!(made.edits.len() < 128, "{} bytes of edits", made.edits.len());
        let (mut a, mut b) = (Vec::new(), Vec::new());
        trellis_core::bundle::Content::write_to(&before, &mut a);
        trellis_core::bundle::Content::write_to(&after, &mut b);
        assert_eq!(trellis_core::delta::rebuild(&a, &made.edits, b.len(), "f").unwrap(), b);
    }

    #[test]
    fn an_answer_sends_the_bundle_as_held_large_pieces_without_a_copy() {
        let large = piece('L', SHARED_PIECE);
        let small: Vec<Arc<str>> = (0..40).map(|i| piece(char::from(b'a' + i % 26), 700)).collect();
        let mut first = small[..30].to_vec();
        first.push(large.clone());
        first.extend_from_slice(&small[30..]);
        let contents = vec![Text::from_pieces(first), Text::from(""), Text::from_pieces(vec![piece('z', 3), large.clone()])];
        let head = bytes::Bytes::from_static(b"TRB1 head");
        let bundle =
            Arc::new(Published { version: 7, digest: [0; 32], signed: Signed { head: head.clone(), contents }, edits: Vec::new() });
        let mut body = Body::new(bundle.clone());
        assert_eq!(body.remaining(), bundle.signed.len());
        let mut chunks = Vec::new();
        let mut left = Vec::new();
        while let Some(c) = body.next() {
            chunks.push(c);
            left.push(body.remaining());
        }
        assert_eq!(chunks.concat(), bundle.signed.to_vec());
        assert_eq!(body.remaining(), 0);
        assert_eq!(left.last(), Some(&0));
        assert_eq!(chunks[0], head);
        // 30 small pieces (21,000 bytes) come as one full chunk and one short one, then the large
        // piece itself, then the last 10 and the next file's small piece, then the large one.
        let sizes: Vec<usize> = chunks.iter().map(bytes::Bytes::len).collect();
        assert_eq!(sizes, [head.len(), 16_100, 4_900, SHARED_PIECE, 7_003, SHARED_PIECE]);
        for i in [3, 5] {
            assert_eq!(chunks[i].as_ptr(), large.as_ptr(), "a large piece is sent from where it is held");
        }
    }
}
