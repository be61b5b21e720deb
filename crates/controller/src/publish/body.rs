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
    /// For a large bundle, the edits from the version before it (that version, the delta): a
    /// node holding that one fetches these instead of the whole bundle.
    pub delta: Option<(i64, bytes::Bytes)>,
}

/// Bundles from this size on are also sent as deltas from their previous version; smaller ones
/// cost less to send whole than to diff.
pub const DELTA_FROM: usize = 128 * 1024;

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

/// A bundle's bytes in order, as the chunks of one answer: the head, then each large piece as it
/// is held (no copy) and the runs of small pieces between them gathered into buffers of at most
/// `CHUNK` bytes. What it gathers lives while the answer is sent, not while the bundle is held.
pub struct Body {
    bundle: Arc<Published>,
    head: bool,
    /// The next piece to send: a content of the bundle, a chunk of it and a piece of that.
    file: usize,
    chunk: usize,
    piece: usize,
    left: usize,
}

impl Body {
    pub fn new(bundle: Arc<Published>) -> Body {
        let left = bundle.signed.len();
        Body { bundle, head: true, file: 0, chunk: 0, piece: 0, left }
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
        if std::mem::take(&mut self.head) && !signed.head.is_empty() {
            self.left -= signed.head.len();
            return Some(signed.head.clone());
        }
        let mut run = bytes::BytesMut::new();
        while let Some(content) = signed.contents.get(self.file) {
            let Some(chunk) = content.chunks().get(self.chunk) else {
                (self.file, self.chunk, self.piece) = (self.file + 1, 0, 0);
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
            if run.len() + piece.len() > CHUNK {
                break;
            }
            if run.capacity() == 0 {
                run.reserve(self.left.min(CHUNK));
            }
            run.extend_from_slice(piece.as_bytes());
            self.piece += 1;
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

    #[test]
    fn an_answer_sends_the_bundle_as_held_large_pieces_without_a_copy() {
        let large = piece('L', SHARED_PIECE);
        let small: Vec<Arc<str>> = (0..40).map(|i| piece(char::from(b'a' + i % 26), 700)).collect();
        let mut first = small[..30].to_vec();
        first.push(large.clone());
        first.extend_from_slice(&small[30..]);
        let contents = vec![Text::from_pieces(first), Text::from(""), Text::from_pieces(vec![piece('z', 3), large.clone()])];
        let head = bytes::Bytes::from_static(b"TRB1 head");
        let bundle = Arc::new(Published { version: 7, digest: [0; 32], signed: Signed { head: head.clone(), contents }, delta: None });
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
